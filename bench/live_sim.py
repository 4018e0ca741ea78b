"""Live scheduling benchmark: fifo vs sorted vs asp under the real controller, in real time.

For each lag bound η and each policy, one run of configs/sim-64.yaml: the real controller
(runtime/controller) with the sim backend's 64 instances in one process (real sockets) and the
sim trainer (rollout.sim.trainer_step_s = 3 s), headless, in a fresh run directory, one run
after another and niced. Every number comes from the run's step records (``metrics.jsonl``,
``runtime.records.StepRecord``) after the first ``--warmup`` steps: the mean iteration time,
the mean length of the consumed samples (tokens / samples), the measured bubble breakdown, and
the groups the scheduler deferred and migrated in those steps. The goals table gives
asp / best(fifo, sorted) (goal <= 0.90) and asp's consumed length against fifo's (goal within
3%: deferral must not bias training towards short answers). The length is also taken over every
prompt of the first epoch, from the run's ledger, when the run is long enough to consume them
all (sim-64's epoch is 14,121 prompts, 111 steps: ``--steps 114``); the goal is judged on that
one when both runs have it, because a window of steps holds different prompts under each policy,
and a deferred prompt is consumed later. A 40-step run takes 5-7 minutes, so the default
2 x 3 cells take about 35; ``--quick`` (8 steps) about 10.

    .venv/bin/python bench/live_sim.py [--steps 40] [--warmup 3] [--lag-bound 1 2]
        [--policies fifo sorted asp] [--keep DIR] [--quick] [--set key=value ...]

A run that fails stops the benchmark with its error and the tail of its controller log (exit 1);
Ctrl-C or SIGTERM stops the run in progress and every process it started.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from rich import box
from rich.console import Console
from rich.table import Table

from runtime.config import Config, ConfigError, load_config
from runtime.controller.client import write_run_config
from runtime.controller.ledger import EpochSamples, epoch_samples
from runtime.launcher import request_stop, spawn_controller, wait_for_controller
from runtime.protocol import BUBBLE_CATEGORIES
from runtime.records import StepRecord
from runtime.rundir import JsonlTail, RunDir, read_jsonl
from runtime.tasks import preflight

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "sim-64.yaml"
POLICIES = ("fifo", "sorted", "asp")
SWEPT = ("trainer.steps", "async.lag_bound", "scheduler.policy")
"""Set by the benchmark for each cell; ``--set`` may not touch them."""
STOP_GRACE_S = 30.0
READY_TIMEOUT_S = 300.0
# A sim-64 step takes ~12 s; a run whose step takes ten times that is stuck, not slow.
STEP_TIMEOUT_S = 120.0
LOG_TAIL_LINES = 25

Progress = Callable[[str], None]


class RunFailed(RuntimeError):
    """A run that did not produce its steps; the message says why and shows its log."""


@dataclass(frozen=True)
class Cell:
    """One run, summarised over its steps after the warm-up."""

    policy: str
    lag_bound: int
    steps: int
    """Step records measured (after the warm-up)."""
    iteration_s: float
    """Mean wall time per trainer step."""
    mean_length: float
    """Mean completion tokens of the consumed samples."""
    deferred: int
    migrated: int
    lag_mean: float
    bubbles: dict[str, float]
    """Mean measured fraction of rollout capacity per ``BUBBLE_CATEGORIES`` entry."""
    epoch_length: float | None = None
    """Mean length of the consumed samples of the first epoch's prompts, all of them (None:
    the run ended before it consumed every one). Unlike ``mean_length`` it compares policies
    on the same prompts: a deferred prompt is consumed later, often after a window of steps."""


def step_records(records: Iterable[dict[str, Any]]) -> list[StepRecord]:
    """The typed step records among a run's ``metrics.jsonl`` lines."""
    return [msgspec.convert(r, StepRecord) for r in records if r.get("event") == "step"]


def summarise(
    steps: Sequence[StepRecord],
    policy: str,
    lag_bound: int,
    warmup: int,
    first_epoch: EpochSamples | None = None,
) -> Cell:
    """The cell of one run from its step records, skipping the first ``warmup``, and from what
    its ledger says of the first epoch."""
    steady = list(steps[warmup:])
    if not steady:
        raise RunFailed(
            f"η={lag_bound} {policy}: {len(steps)} step record(s), none after the "
            f"{warmup} warm-up step(s)"
        )
    samples = sum(s.samples for s in steady)
    return Cell(
        policy=policy,
        lag_bound=lag_bound,
        steps=len(steady),
        iteration_s=statistics.fmean(s.iteration_s for s in steady),
        mean_length=sum(s.tokens for s in steady) / max(samples, 1),
        deferred=sum(s.deferred for s in steady),
        migrated=sum(s.migrated for s in steady),
        lag_mean=statistics.fmean(s.lag_mean for s in steady),
        bubbles={
            c: statistics.fmean(getattr(s, f"bubble_{c}") for s in steady)
            for c in BUBBLE_CATEGORIES
        },
        epoch_length=first_epoch.mean_length if first_epoch and first_epoch.complete else None,
    )


def cell_config(
    policy: str,
    lag_bound: int,
    *,
    steps: int,
    run_dir: Path,
    config: Path = CONFIG,
    overrides: Sequence[str] = (),
) -> Config:
    """The resolved config of one cell (``ConfigError`` on bad input)."""
    swept = [f"trainer.steps={steps}", f"async.lag_bound={lag_bound}", f"scheduler.policy={policy}"]
    name = f"run.name=live-eta{lag_bound}-{policy}"
    return load_config(config, [*overrides, *swept, name], run_dir=run_dir)


def run_cell(
    policy: str,
    lag_bound: int,
    *,
    steps: int,
    warmup: int,
    run_dir: Path,
    config: Path = CONFIG,
    overrides: Sequence[str] = (),
    progress: Progress | None = None,
) -> Cell:
    """Run one cell to completion in the fresh directory ``run_dir`` and summarise it.
    ``RunFailed`` if the controller fails, hangs or stops short; the controller is stopped, and
    with it every process it started, whatever happens (Ctrl-C included)."""
    say = progress or (lambda _line: None)
    label = f"η={lag_bound} {policy}"
    if run_dir.exists() and any(run_dir.iterdir()):
        raise RunFailed(f"{label}: {run_dir} is not empty; every run needs a fresh directory")
    cfg = cell_config(
        policy, lag_bound, steps=steps, run_dir=run_dir, config=config, overrides=overrides
    )
    rd = write_run_config(run_dir, cfg)
    proc = spawn_controller(rd)
    records: list[StepRecord] = []
    try:
        wait_for_controller(rd, proc, timeout_s=READY_TIMEOUT_S)
        say(f"{label}: controller pid {proc.pid} ready, run dir {run_dir}")
        tail = JsonlTail(rd.metrics)
        last_step = time.monotonic()
        while True:
            done = proc.poll() is not None
            for record in step_records(tail.read()):  # after poll: nothing written is missed
                records.append(record)
                last_step = time.monotonic()
                say(f"{label}: step {record.step}/{steps}  {record.iteration_s:.1f} s")
            if done:
                break
            if time.monotonic() - last_step > STEP_TIMEOUT_S:
                raise RunFailed(
                    f"{label}: no step for {STEP_TIMEOUT_S:.0f} s after step "
                    f"{len(records)}/{steps}\n{_log_tail(rd)}"
                )
            time.sleep(1.0)
    except RunFailed:
        raise
    except (TimeoutError, RuntimeError) as exc:  # it died or hung before it was ready
        raise RunFailed(f"{label}: {exc}\n{_log_tail(rd)}") from exc
    finally:
        stop_controller(proc)
    if proc.returncode != 0:
        raise RunFailed(f"{label}: the controller exited with {proc.returncode}\n{_log_tail(rd)}")
    if len(records) != steps:
        raise RunFailed(
            f"{label}: {len(records)} of {steps} steps recorded before the controller exited\n"
            f"{_log_tail(rd)}"
        )
    first_epoch = epoch_samples(read_jsonl(rd.ledger), epoch=0)
    return summarise(records, policy, lag_bound, warmup, first_epoch)


def stop_controller(proc: subprocess.Popen[bytes]) -> None:
    """Stop the controller cleanly (it stops its children), then by force: SIGKILL to its group,
    and its children die with it (PR_SET_PDEATHSIG). A second Ctrl-C only skips the wait."""
    if proc.poll() is None:
        request_stop(proc)
        with contextlib.suppress(subprocess.TimeoutExpired, KeyboardInterrupt):
            proc.wait(STOP_GRACE_S)
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _log_tail(rd: RunDir) -> str:
    log = rd.log_file("controller")
    try:
        lines = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
    except FileNotFoundError:
        return f"(no log at {log})"
    body = "\n".join(f"    {line}" for line in lines)
    return f"  last lines of {log} (other logs beside it):\n{body}"


# --- the report ---------------------------------------------------------------------------------
def results_table(cells: Sequence[Cell], steps: int, warmup: int) -> Table:
    table = Table(
        title=f"live sim benchmark: real controller, steps {warmup + 1}..{steps}; "
        "iter s = mean wall time per step; length = mean tokens of the consumed samples in "
        "those steps; epoch length = the same over every prompt of the first epoch",
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
    )
    columns = (
        *("η", "policy", "steps", "iter s", "vs fifo", "length", "vs fifo", "epoch length"),
        *("vs fifo", "lag", "deferred", "migrated"),
    )
    for column in columns:
        table.add_column(column, justify="right")
    categories = [c for c in BUBBLE_CATEGORIES if c not in ("paused", "down")]
    for category in categories:
        table.add_column(category[:5], justify="right")
    by_eta = _by_eta(cells)
    for eta, row in by_eta.items():
        fifo = row.get("fifo")
        for cell in row.values():
            table.add_row(
                str(eta),
                cell.policy,
                str(cell.steps),
                f"{cell.iteration_s:.2f}",
                f"{cell.iteration_s / fifo.iteration_s - 1:+.1%}" if fifo else "",
                f"{cell.mean_length:.0f}",
                f"{cell.mean_length / fifo.mean_length - 1:+.1%}" if fifo else "",
                f"{cell.epoch_length:.0f}" if cell.epoch_length else "-",
                f"{ratio - 1:+.1%}" if (ratio := _epoch_length_ratio(cell, fifo)) else "",
                f"{cell.lag_mean:.2f}",
                str(cell.deferred),
                str(cell.migrated),
                *(f"{100 * cell.bubbles[c]:.1f}" for c in categories),
            )
        table.add_section()
    return table


def goals_table(cells: Sequence[Cell]) -> Table | None:
    """asp against the others per η (None if asp or both others are missing)."""
    table = Table(title="goals (asp)", box=box.SIMPLE_HEAD)
    for column in (
        "η",
        "asp / best(fifo,sorted)",
        "goal <=0.90",
        "length / fifo's (steps)",
        "(epoch 0)",
        "goal ±3%",
        "deferred",
        "migrated",
    ):
        table.add_column(column, justify="right")
    rows = 0
    for eta, row in _by_eta(cells).items():
        asp = row.get("asp")
        others = [row[p].iteration_s for p in ("fifo", "sorted") if p in row]
        if asp is None or not others:
            continue
        vs_best = asp.iteration_s / min(others)
        fifo = row.get("fifo")
        in_steps = asp.mean_length / fifo.mean_length if fifo else None
        in_epoch = _epoch_length_ratio(asp, fifo)
        # Judged on the same prompts where both runs consumed the whole first epoch.
        judged = in_epoch or in_steps
        table.add_row(
            str(eta),
            f"{vs_best:.3f}",
            "met" if vs_best <= 0.90 else "missed",
            f"{in_steps:.3f}" if in_steps is not None else "",
            f"{in_epoch:.3f}" if in_epoch is not None else "-",
            ("met" if abs(judged - 1) <= 0.03 else "missed") if judged is not None else "",
            str(asp.deferred),
            str(asp.migrated),
        )
        rows += 1
    return table if rows else None


def _epoch_length_ratio(cell: Cell, fifo: Cell | None) -> float | None:
    """``cell``'s first-epoch length over fifo's (None unless both consumed a whole epoch)."""
    if fifo is None or not cell.epoch_length or not fifo.epoch_length:
        return None
    return cell.epoch_length / fifo.epoch_length


def _by_eta(cells: Sequence[Cell]) -> dict[int, dict[str, Cell]]:
    out: dict[int, dict[str, Cell]] = {}
    for cell in cells:
        out.setdefault(cell.lag_bound, {})[cell.policy] = cell
    return out


# --- the command line ---------------------------------------------------------------------------
def _stderr(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def _raise_interrupt(signum: int, _frame: object) -> None:
    # SIGTERM and SIGHUP unwind like Ctrl-C, so every run's ``finally`` stops its controller.
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--config", type=Path, default=CONFIG, help="run config (default sim-64)")
    ap.add_argument("--steps", type=int, help="trainer steps per run (default 40; --quick 8)")
    ap.add_argument("--warmup", type=int, default=3, help="first steps left out (default 3)")
    ap.add_argument("--lag-bound", type=int, nargs="+", default=[1, 2], help="η, one or more")
    ap.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    ap.add_argument("--keep", type=Path, metavar="DIR", help="keep the run dirs under DIR")
    ap.add_argument("--quick", action="store_true", help="8 steps per run (a smoke run)")
    ap.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="config override for every run (not the swept fields)",
    )  # fmt: skip
    ap.add_argument("--nice", type=int, default=10, help="niceness of the runs (at least)")
    args = ap.parse_args(argv)
    steps = args.steps if args.steps is not None else 8 if args.quick else 40
    if args.warmup < 0 or steps <= args.warmup:
        ap.error(f"--steps ({steps}) must be greater than --warmup ({args.warmup}) >= 0")
    if min(args.lag_bound) < 0:
        ap.error(f"--lag-bound: {min(args.lag_bound)} must be >= 0")
    for item in args.overrides:
        if item.split("=", 1)[0].strip() in SWEPT:
            ap.error(f"--set {item!r}: the benchmark sets {', '.join(SWEPT)} itself")
    cells = [(eta, policy) for eta in args.lag_bound for policy in args.policies]
    root = args.keep.resolve() if args.keep else None
    if root is not None:
        taken = [d for eta, p in cells if (d := root / _dir_name(eta, p)).exists()]
        if taken:
            ap.error(f"--keep {root}: {taken[0]} already exists; every run needs a fresh directory")
    try:  # a bad --set, config or task file fails before anything runs
        for eta, policy in cells:
            preflight(cell_config(
                policy, eta, steps=steps, run_dir=Path("unused"), config=args.config,
                overrides=args.overrides,
            ))  # fmt: skip
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    with contextlib.suppress(OSError):  # children inherit it; never lower a niceness
        os.nice(max(0, args.nice - os.nice(0)))
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupt)
    results: list[Cell] = []
    started = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="asp-live-sim-") as scratch:
            base = root or Path(scratch)
            for k, (eta, policy) in enumerate(cells, 1):
                _stderr(f"run {k}/{len(cells)}: η={eta} {policy}, {steps} steps ...")
                cell = run_cell(
                    policy, eta, steps=steps, warmup=args.warmup,
                    run_dir=base / _dir_name(eta, policy), config=args.config,
                    overrides=args.overrides, progress=_stderr,
                )  # fmt: skip
                _stderr(
                    f"run {k}/{len(cells)}: η={eta} {policy}: {cell.iteration_s:.2f} s/step, "
                    f"length {cell.mean_length:.0f} over {cell.steps} steps"
                )
                results.append(cell)
    except RunFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        if root is None:
            print("(the run dir is gone: --keep DIR keeps it and its logs)", file=sys.stderr)
        if results:
            print(f"({len(results)} of {len(cells)} runs finished)", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        print(f"interrupted ({exc or 'SIGINT'}); every run stopped", file=sys.stderr)
        return 130
    console = Console(width=max(Console().width, 170))  # the table is wide; never truncate it
    console.print(results_table(results, steps, args.warmup))
    goals = goals_table(results)
    if goals is not None:
        console.print(goals)
    console.print(
        f"{len(results)} runs of {steps} steps in {(time.monotonic() - started) / 60:.1f} min"
        + (f"; run dirs in {root}" if root else "")
    )
    return 0


def _dir_name(lag_bound: int, policy: str) -> str:
    return f"eta{lag_bound}-{policy}"


if __name__ == "__main__":
    sys.exit(main())
