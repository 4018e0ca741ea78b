"""Side by side with TRL (issue #9): TRL's ``GRPOTrainer`` and our pipeline on the same work.

Both sides train the same warm-started model (``runtime.tasks.ensure_model``) on the same task
prompts (same token ids as our workers get), with the same reward (``task.reward``: for
``target_length``, ``length_reward(answer_length(text), target)``), the same batch (B groups of
n samples a step), max tokens, temperature, learning rate and step count, all read from the
run config. Runs alternate, peer, ours, peer, ours, ..., each in a fresh process so that they
never overlap. TRL keeps its own defaults otherwise (loss type, reward scaling, bf16 autocast,
gradient checkpointing, lr schedule, ``transformers`` generation): the peer is not tuned down.
(TRL's vLLM path is left off, as by default; TRL 1.16 supports vLLM 0.22..0.31, not our 0.32.)

Then two references for our pipeline, each in a process of its own: bare ``vllm.LLM.generate``
on the same prompts (``BareLLM``: the physical limit of generation here) and the trainer's step
time on a same-sized synthetic batch (``runtime.trainer.synthetic``).

Steady state is steps 5..N; rewards are compared over the first and the last 5 steps; "wall s"
is a whole process, start-up included. Numbers on shared cores are noisy: read the ratios (also
run by run: run k of each side saw about the same machine) and the medians over runs. Under
contention the comparison leans our way: our many processes get a bigger share of busy cores
than TRL's one, so take the numbers that count on an otherwise idle machine.

    .venv/bin/python bench/peer.py [--runs 3] [--steps 30] [--config configs/tiny.yaml]
        [--set key=value ...] [--skip-peer] [--skip-ours] [--json results.json]
"""

from __future__ import annotations

import argparse
import enum
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: bench/ is on the path, the repo is not
    sys.path.insert(0, str(REPO))

from runtime.config import Config, ConfigError, load_config  # noqa: E402

WARMUP_STEPS = 4
"""Steps left out of the steady state: start-up, first weight syncs, lazy initialisation."""
EDGE_STEPS = 5
"""Steps averaged for the first and the last reward."""
MIN_STEPS = WARMUP_STEPS + 2
BARE_PASSES = 3
STANDALONE_STEPS = 10
CHILD_TIMEOUT_S = 3600.0
FORBIDDEN_SETS = {
    "trainer.steps": "use --steps",
    "run.run_dir": "the bench picks a scratch run directory",
}


# --- summaries (pure; tests/test_bench_peer.py checks them) -----------------------------------


@dataclass(frozen=True)
class Series:
    """Per-step records of one run, step 1 first."""

    seconds: tuple[float, ...]
    """Wall time of each step (ours: ``iteration_s``; peer: between two ``on_step_end``)."""
    tokens: tuple[int, ...]
    """Completion tokens trained on in each step."""
    rewards: tuple[float, ...]
    """Mean reward of each step's batch."""

    def __post_init__(self) -> None:
        if not len(self.seconds) == len(self.tokens) == len(self.rewards):
            raise ValueError(
                f"series lengths differ: {len(self.seconds)} seconds, {len(self.tokens)} "
                f"tokens, {len(self.rewards)} rewards"
            )


@dataclass(frozen=True)
class Summary:
    s_per_step: float
    """Median seconds per step over the steady steps."""
    tokens_per_s: float
    """Completion tokens over seconds, steady steps."""
    reward_first: float
    reward_last: float


def steady(values: Sequence[float], warmup: int = WARMUP_STEPS) -> list[float]:
    """The values of steps ``warmup + 1`` onwards; at least two must be left."""
    if len(values) < warmup + 2:
        raise ValueError(f"{len(values)} steps; the steady state needs at least {warmup + 2}")
    return list(values[warmup:])


def median_steady(values: Sequence[float], warmup: int = WARMUP_STEPS) -> float:
    return statistics.median(steady(values, warmup))


def steady_rate(
    tokens: Sequence[float], seconds: Sequence[float], warmup: int = WARMUP_STEPS
) -> float:
    """Tokens per second over the steady steps (total over total, not a mean of rates)."""
    total_s = sum(steady(seconds, warmup))
    return sum(steady(tokens, warmup)) / total_s if total_s > 0 else math.nan


def first_mean(values: Sequence[float], count: int = EDGE_STEPS) -> float:
    if not values:
        raise ValueError("no steps")
    return statistics.fmean(values[:count])


def last_mean(values: Sequence[float], count: int = EDGE_STEPS) -> float:
    if not values:
        raise ValueError("no steps")
    return statistics.fmean(values[-count:])


def ratio(numerator: float, denominator: float) -> float:
    """``numerator / denominator``; NaN when either is missing or the denominator is not > 0."""
    if not (denominator > 0) or math.isnan(numerator):
        return math.nan
    return numerator / denominator


def summarise(series: Series, warmup: int = WARMUP_STEPS, edge: int = EDGE_STEPS) -> Summary:
    return Summary(
        s_per_step=median_steady(series.seconds, warmup),
        tokens_per_s=steady_rate(series.tokens, series.seconds, warmup),
        reward_first=first_mean(series.rewards, edge),
        reward_last=last_mean(series.rewards, edge),
    )


def median_summary(summaries: Sequence[Summary]) -> Summary:
    """Each field's median over runs."""
    if not summaries:
        raise ValueError("no runs")
    return Summary(
        s_per_step=statistics.median(s.s_per_step for s in summaries),
        tokens_per_s=statistics.median(s.tokens_per_s for s in summaries),
        reward_first=statistics.median(s.reward_first for s in summaries),
        reward_last=statistics.median(s.reward_last for s in summaries),
    )


# --- raw results ------------------------------------------------------------------------------


@dataclass
class Run:
    """One run of one side: its steps and what else its process reported."""

    side: str
    number: int
    series: Series
    wall_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def summary(self) -> Summary:
        return summarise(self.series)


@dataclass
class Results:
    settings: dict[str, Any]
    runs: list[Run] = field(default_factory=list)
    bare: dict[str, Any] | None = None
    standalone: dict[str, Any] | None = None

    def side(self, name: str) -> list[Run]:
        return [r for r in self.runs if r.side == name]

    def to_json(self) -> dict[str, Any]:
        runs = [
            {
                "side": r.side,
                "run": r.number,
                "wall_s": r.wall_s,
                **asdict(r.series),
                "summary": asdict(r.summary),
                **r.extra,
            }
            for r in self.runs
        ]
        medians = {
            side: asdict(median_summary([r.summary for r in self.side(side)]))
            for side in ("peer", "ours")
            if self.side(side)
        }
        return {
            "settings": self.settings,
            "runs": runs,
            "medians": medians,
            "bare_llm": self.bare,
            "standalone_step": self.standalone,
        }


# --- child processes --------------------------------------------------------------------------


def _child_env() -> dict[str, str]:
    from runtime.launcher import child_env

    env = child_env()
    # Children import this checkout, never another copy installed in the venv.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def _stop(proc: subprocess.Popen[bytes], graceful: bool) -> None:
    """Stop a child and everything in its session. ``graceful``: SIGINT first (``asp-tui run``
    stops its controller on Ctrl-C, and the controller lives in a session of its own)."""
    if proc.poll() is not None:
        return
    if graceful:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(180)
            return
        except subprocess.TimeoutExpired:
            pass
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def run_child(
    name: str, command: list[str], log: Path, timeout_s: float, graceful: bool = False
) -> float:
    """Run ``command`` from the repo root, output into ``log``; its wall seconds.

    A new session, so that a timeout or Ctrl-C stops its grandchildren (vLLM's engine core) too.
    """
    began = time.perf_counter()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            command,
            cwd=REPO,
            env=_child_env(),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            _stop(proc, graceful)
            raise RuntimeError(
                f"{name} ran past {timeout_s:.0f} s; log {log}:\n{_tail(log)}"
            ) from None
        except BaseException:
            _stop(proc, graceful)
            raise
    if code != 0:
        raise RuntimeError(f"{name} exited {code}; log {log}:\n{_tail(log)}")
    return time.perf_counter() - began


def _child_command(kind: str, config_file: Path, result: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        str(Path(__file__).resolve()),
        "_child",
        kind,
        "--config",
        str(config_file),
        "--result",
        str(result),
        *extra,
    ]


def run_peer(scratch: Path, config_file: Path, steps: int, number: int, timeout_s: float) -> Run:
    result = scratch / f"peer-{number}.json"
    wall = run_child(
        f"peer run {number}",
        _child_command("peer", config_file, result, "--steps", str(steps)),
        scratch / f"peer-{number}.log",
        timeout_s,
    )
    data = json.loads(result.read_text())
    series = Series(tuple(data["seconds"]), tuple(data["tokens"]), tuple(data["rewards"]))
    extra = {k: v for k, v in data.items() if k not in ("seconds", "tokens", "rewards")}
    return Run("peer", number, series, wall, extra)


def run_ours(
    scratch: Path, config: str, sets: list[str], steps: int, number: int, timeout_s: float
) -> Run:
    from runtime.rundir import RunDir, read_jsonl

    run_dir = scratch / f"ours-{number}"
    overrides = [arg for item in sets for arg in ("--set", item)]
    command = [
        sys.executable,
        "-m",
        "asp_tui.cli",
        "run",
        "--headless",
        "--config",
        config,
        *overrides,
        "--set",
        f"trainer.steps={steps}",
        "--run-dir",
        str(run_dir),
    ]
    try:
        wall = run_child(
            f"our run {number}", command, scratch / f"ours-{number}.log", timeout_s, graceful=True
        )
    finally:
        _stop_leftover_run(run_dir)
    records = [r for r in read_jsonl(RunDir(run_dir).metrics) if r.get("event") == "step"]
    records.sort(key=lambda r: r["step"])
    if len(records) != steps:
        raise RuntimeError(f"our run {run_dir} logged {len(records)} steps of {steps}")
    series = Series(
        tuple(float(r["iteration_s"]) for r in records),
        tuple(int(r["tokens"]) for r in records),
        tuple(float(r["reward_mean"]) for r in records),
    )
    extra = {
        "step_s": [float(r["step_s"]) for r in records],
        "bubble_useful": [float(r.get("bubble_useful", math.nan)) for r in records],
        "samples": [int(r["samples"]) for r in records],
    }
    return Run("ours", number, series, wall, extra)


def _stop_leftover_run(run_dir: Path) -> None:
    """If the headless client died without stopping its controller, stop the run cleanly."""
    from runtime.rundir import RunDir

    try:
        os.kill(RunDir(run_dir).read_endpoints().controller_pid, 0)
    except (OSError, ValueError):
        return  # never started, or no controller left
    subprocess.run(
        [sys.executable, "-m", "asp_tui.cli", "stop", str(run_dir), "--timeout", "120"],
        cwd=REPO,
        env=_child_env(),
        check=False,
        timeout=180,
    )


def run_bare(scratch: Path, config_file: Path, groups: int, timeout_s: float) -> dict[str, Any]:
    result = scratch / "bare.json"
    wall = run_child(
        "bare LLM.generate",
        _child_command("bare", config_file, result, "--groups", str(groups)),
        scratch / "bare.log",
        timeout_s,
    )
    return {**json.loads(result.read_text()), "wall_s": wall}


def run_standalone(
    scratch: Path, config_file: Path, length: int, timeout_s: float
) -> dict[str, Any]:
    result = scratch / "step.json"
    wall = run_child(
        "standalone trainer step",
        _child_command("step", config_file, result, "--length", str(length)),
        scratch / "step.log",
        timeout_s,
    )
    return {**json.loads(result.read_text()), "wall_s": wall}


# --- what runs inside the children ------------------------------------------------------------


def peer_child(config: Config, steps: int) -> dict[str, Any]:
    """TRL's ``GRPOTrainer`` for ``steps`` steps on our model, prompts, reward and batch."""
    began = time.perf_counter()  # start-up counts TRL's imports, as ours counts its processes'
    import datasets
    import torch
    import transformers
    import trl
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from runtime.tasks import build_task, encode_prompt, ensure_model, load_tokenizer

    model = ensure_model(config)
    tokenizer = load_tokenizer(model)
    task = build_task(config)
    by_id = {p.prompt_id: p for p in task.prompts}
    chat = bool(getattr(tokenizer, "chat_template", None))
    rows = [
        {
            # With a chat template TRL applies it to a conversation, as encode_prompt does.
            "prompt": [{"role": "user", "content": p.text}] if chat else p.text,
            "prompt_id": p.prompt_id,
        }
        for p in task.prompts
    ]
    rewards: list[float] = []
    tokens: list[int] = []

    def task_reward(
        prompts: list[Any], completions: list[Any], completion_ids: list[list[int]], **kw: Any
    ) -> list[float]:
        """Our workers' reward path: decode the tokens with the task tokenizer, ``task.reward``."""
        texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in completion_ids]
        values = [
            task.reward(by_id[int(i)], text) for i, text in zip(kw["prompt_id"], texts, strict=True)
        ]
        # One call per generation batch, which is one optimizer step (steps_per_generation 1).
        rewards.append(statistics.fmean(values))
        tokens.append(sum(len(ids) for ids in completion_ids))
        return values

    class StepClock(TrainerCallback):
        """Wall time of each optimizer step, generation included; step 1 from its beginning."""

        def __init__(self) -> None:
            self.seconds: list[float] = []
            self.last: float | None = None
            self.first_step_at: float | None = None

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if self.last is None:
                self.last = self.first_step_at = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            now = time.perf_counter()
            assert self.last is not None
            self.seconds.append(now - self.last)
            self.last = now

    sampling = config.rollout.sampling
    completions_per_step = config.trainer.batch_groups * sampling.n
    clock = StepClock()
    with tempfile.TemporaryDirectory(prefix="asp-peer-trl-") as out:
        # Only what the comparison fixes is set; everything else stays TRL's default.
        explicit = {
            "use_cpu": True,
            "report_to": "none",
            "save_strategy": "no",
            "max_steps": steps,
            # TRL counts completions, not prompts: one step = B groups of n completions.
            "per_device_train_batch_size": completions_per_step,
            "gradient_accumulation_steps": 1,
            "num_generations": sampling.n,
            "max_completion_length": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "learning_rate": config.trainer.lr,
            "beta": config.trainer.loss.kl_coef,
            "seed": config.run.seed,
            "disable_tqdm": True,  # a log file, not a terminal
        }
        args = GRPOConfig(output_dir=out, **explicit)
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=task_reward,
            args=args,
            train_dataset=datasets.Dataset.from_list(rows),
            processing_class=tokenizer,
            callbacks=[clock],
        )
        # The peer must see the token ids our workers get; TRL tokenizes prompts itself.
        trl_ids, _, _ = trainer._tokenize_prompts([r["prompt"] for r in rows])
        ours = [encode_prompt(tokenizer, p) for p in task.prompts]
        mismatched = [i for i, (a, b) in enumerate(zip(trl_ids, ours, strict=True)) if a != b]
        if mismatched:
            raise RuntimeError(f"TRL tokenizes {len(mismatched)} prompts differently from ours")
        trainer.train()
    if not len(clock.seconds) == len(rewards) == steps:
        raise RuntimeError(
            f"TRL took {len(clock.seconds)} steps and {len(rewards)} generation batches; "
            f"expected {steps} of each"
        )
    used = trainer.args
    defaults = {
        name: getattr(used, name)
        for name in (
            "loss_type",
            "scale_rewards",
            "num_iterations",
            "epsilon",
            "epsilon_high",
            "generation_batch_size",
            "steps_per_generation",
            "use_vllm",
            "bf16",
            "gradient_checkpointing",
            "lr_scheduler_type",
            "warmup_steps",
            "weight_decay",
            "max_grad_norm",
            "optim",
            "top_k",
            "mask_truncated_completions",
        )
    }
    return {
        "seconds": clock.seconds,
        "tokens": tokens,
        "rewards": rewards,
        "startup_s": (clock.first_step_at or began) - began,
        "trl_explicit": explicit,
        "trl_defaults": {k: _plain(v) for k, v in defaults.items()},
        "versions": {
            "trl": trl.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        },
    }


def _plain(value: Any) -> Any:
    """A JSON-able form of a config value (enums by their value: ``linear``, not the repr)."""
    if isinstance(value, enum.Enum):
        value = value.value
    return value if value is None or isinstance(value, int | float | bool | str) else str(value)


def bare_child(config: Config, groups: int, passes: int = BARE_PASSES) -> dict[str, Any]:
    """Bare ``LLM.generate`` on the first ``groups`` task prompts: one warm-up, timed passes."""
    from runtime.rollout.bench import Throughput, bare_llm, bench_prompts

    prompts = [ids for _, ids in bench_prompts(config, groups)]
    engine, specs = bare_llm(config, groups, seed=1234)
    tokens, seconds = [], []
    with engine:
        engine.generate(prompts[:4], specs[:4])
        for _ in range(passes):
            began = time.perf_counter()
            tokens.append(engine.generate(prompts, specs))
            seconds.append(time.perf_counter() - began)
    rate = Throughput(tuple(tokens), tuple(seconds)).tokens_per_s
    return {"groups": groups, "tokens": tokens, "seconds": seconds, "tokens_per_s": rate}


def step_child(config: Config, length: int, steps: int = STANDALONE_STEPS) -> dict[str, Any]:
    """Our trainer's step on random B x n batches of about ``length`` completion tokens."""
    from runtime.tasks import ensure_model
    from runtime.trainer.synthetic import measure_step_time

    times = measure_step_time(
        ensure_model(config),
        steps=steps,
        groups=config.trainer.batch_groups,
        samples=config.rollout.sampling.n,
        length=length,
        config=config,
    )
    return {"length": length, "seconds": times, "step_s": statistics.median(times)}


def child_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench/peer.py _child")
    parser.add_argument("kind", choices=("peer", "bare", "step"))
    parser.add_argument("--config", required=True)
    parser.add_argument("--result", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--length", type=int, default=60)
    args = parser.parse_args(argv)
    config = load_config(args.config)
    if args.kind == "peer":
        data = peer_child(config, args.steps)
    elif args.kind == "bare":
        data = bare_child(config, args.groups)
    else:
        data = step_child(config, args.length)
    Path(args.result).write_text(json.dumps(data, indent=1))
    return 0


# --- the report -------------------------------------------------------------------------------


def _f(value: float, digits: int = 2) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def report(results: Results, console: Console) -> None:
    steps = results.settings["steps"]
    # Headings as lines of their own: a table title wraps at the (narrow) table's width.
    console.print(
        f"\n[b]peer (TRL GRPOTrainer) vs ours[/b]: s/step (median) and tokens/s over steps "
        f"{WARMUP_STEPS + 1}..{steps}, rewards over the first and last {EDGE_STEPS} steps"
    )
    table = Table()
    for column in (
        "side",
        "run",
        "s/step (median)",
        "tokens/s",
        "reward first 5",
        "reward last 5",
        "wall s",
    ):
        table.add_column(column, justify="right")
    medians: dict[str, Summary] = {}
    for side in ("peer", "ours"):
        runs = results.side(side)
        if not runs:
            continue
        for run in runs:
            s = run.summary
            table.add_row(
                side,
                str(run.number),
                _f(s.s_per_step),
                _f(s.tokens_per_s, 0),
                _f(s.reward_first, 3),
                _f(s.reward_last, 3),
                _f(run.wall_s, 0),
            )
        m = medians[side] = median_summary([r.summary for r in runs])
        table.add_row(
            f"[b]{side}[/b]",
            "median",
            _f(m.s_per_step),
            _f(m.tokens_per_s, 0),
            _f(m.reward_first, 3),
            _f(m.reward_last, 3),
            "",
            end_section=True,
        )
    console.print(table)
    peers = results.side("peer")
    if peers:
        kept = peers[0].extra.get("trl_defaults", {})
        console.print(
            "TRL defaults kept: " + ", ".join(f"{k}={v}" for k, v in kept.items()),
            highlight=False,
        )

    if "peer" in medians and "ours" in medians:
        speed = ratio(medians["peer"].s_per_step, medians["ours"].s_per_step)
        # Runs alternate, so run k of each side saw about the same machine: its own ratio.
        paired = [
            _f(ratio(p.summary.s_per_step, o.summary.s_per_step))
            for p, o in zip(results.side("peer"), results.side("ours"), strict=False)
        ]
        console.print(
            f"speed: peer s/step / ours s/step = [b]{_f(speed)}x[/b] (>1: ours is faster; "
            f"run by run: {', '.join(paired)})"
        )
        console.print(
            "reward: ours last-5 - peer last-5 = "
            f"[b]{medians['ours'].reward_last - medians['peer'].reward_last:+.3f}[/b] "
            f"(first-5: ours {medians['ours'].reward_first:.3f}, "
            f"peer {medians['peer'].reward_first:.3f})"
        )

    if results.bare is not None:
        bare_rate = results.bare["tokens_per_s"]
        console.print(
            f"\n[b]generation[/b]: bare vllm.LLM.generate, one engine, {results.bare['groups']} "
            f"groups x n, median of {BARE_PASSES} passes, against each pipeline's steady tokens/s"
        )
        gen = Table()
        for column in ("path", "tokens/s", "of bare"):
            gen.add_column(column, justify="right")
        gen.add_row("bare LLM.generate", _f(bare_rate, 0), "1.00")
        for side, m in medians.items():
            gen.add_row(
                f"{side} pipeline (steady)",
                _f(m.tokens_per_s, 0),
                _f(ratio(m.tokens_per_s, bare_rate)),
            )
        console.print(gen)

    ours = results.side("ours")
    if ours:
        in_pipeline = statistics.median(median_steady(r.extra["step_s"]) for r in ours)
        useful = statistics.median(statistics.fmean(steady(r.extra["bubble_useful"])) for r in ours)
        console.print(
            "\n[b]our trainer step_s[/b]: in the pipeline vs standalone on a same-sized "
            "synthetic batch"
        )
        step = Table()
        for column in ("where", "step s (median)", "vs standalone"):
            step.add_column(column, justify="right")
        standalone = results.standalone["step_s"] if results.standalone else math.nan
        step.add_row(
            f"pipeline, steps {WARMUP_STEPS + 1}..{steps}",
            _f(in_pipeline, 3),
            _f(ratio(in_pipeline, standalone)),
        )
        if results.standalone:
            step.add_row(
                f"standalone, {results.settings['groups']}x{results.settings['n']} x "
                f"~{results.standalone['length']} tokens",
                _f(standalone, 3),
                "1.00",
            )
        console.print(step)
        console.print(
            f"our steady-state bubble_useful (useful rollout capacity): [b]{100 * useful:.1f}%[/b]"
        )


# --- main -------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bench/peer.py", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("--runs", type=int, default=3, help="runs of each side (default 3)")
    parser.add_argument("--steps", type=int, default=30, help="steps per run (default 30)")
    parser.add_argument("--config", default=str(REPO / "configs/tiny.yaml"), help="run config")
    parser.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override, for both sides (repeatable)",
    )
    parser.add_argument("--skip-peer", action="store_true", help="no TRL runs")
    parser.add_argument(
        "--skip-ours",
        action="store_true",
        help="no runs of ours, no bare-vLLM or standalone-step reference",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the raw results here")
    # Default: every task prompt once, the same prompts both sides train on.
    parser.add_argument("--bare-groups", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--timeout-s", type=float, default=CHILD_TIMEOUT_S, help=argparse.SUPPRESS)
    return parser


def _validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Config:
    if args.runs < 1:
        parser.error(f"--runs: {args.runs} is not allowed; at least 1")
    if args.steps < MIN_STEPS:
        parser.error(
            f"--steps: {args.steps} is too few; at least {MIN_STEPS} (steps 1..{WARMUP_STEPS} "
            "are warm-up and the steady state needs two more)"
        )
    if args.bare_groups is not None and args.bare_groups < 4:
        parser.error(f"--bare-groups: {args.bare_groups} is not allowed; at least 4")
    if args.skip_peer and args.skip_ours:
        parser.error("--skip-peer with --skip-ours leaves nothing to run")
    for item in args.sets:
        key = item.partition("=")[0].strip()
        if key in FORBIDDEN_SETS:
            parser.error(f"--set {item!r}: not allowed here; {FORBIDDEN_SETS[key]}")
    if args.json and not Path(args.json).resolve().parent.is_dir():
        parser.error(f"--json: {Path(args.json).parent} is not a directory")
    # Children run from the repo root: a path relative to here must not change meaning there.
    args.config = str(Path(args.config).resolve())
    try:
        config = load_config(args.config, [*args.sets, f"trainer.steps={args.steps}"])
    except ConfigError as exc:
        parser.error(str(exc))
    if config.rollout.backend != "vllm" or config.trainer.backend != "torch":
        parser.error("the peer comparison needs rollout.backend vllm and trainer.backend torch")
    if args.bare_groups is None:
        args.bare_groups = config.task.num_prompts
    return config


def run_all(
    args: argparse.Namespace, config_file: Path, scratch: Path, results: Results, console: Console
) -> None:
    """Peer and ours in turn, then the references; each in a process of its own."""
    for number in range(1, args.runs + 1):
        if not args.skip_peer:
            console.print(f"run {number}/{args.runs}: peer (TRL), {args.steps} steps ...")
            results.runs.append(run_peer(scratch, config_file, args.steps, number, args.timeout_s))
        if not args.skip_ours:
            console.print(f"run {number}/{args.runs}: ours, {args.steps} steps ...")
            results.runs.append(
                run_ours(scratch, args.config, args.sets, args.steps, number, args.timeout_s)
            )
    if args.skip_ours:
        return
    console.print(f"bare vllm.LLM.generate on {args.bare_groups} groups ...")
    results.bare = run_bare(scratch, config_file, args.bare_groups, args.timeout_s)
    # The synthetic batch is as long as what our runs actually trained on.
    length = round(
        statistics.median(
            sum(steady(r.series.tokens)) / sum(steady(r.extra["samples"]))
            for r in results.side("ours")
        )
    )
    console.print(f"standalone trainer step, ~{length} tokens a completion ...")
    results.standalone = run_standalone(scratch, config_file, length, args.timeout_s)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_child"]:
        return child_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    config = _validate(parser, args)
    console = Console(width=max(Console().width, 120))  # tables are wide; never truncate them

    from runtime.launcher import prepare_model

    console.print("preparing the model (built once, then cached) ...")
    model = prepare_model(config)
    settings = {
        "config": args.config,
        "sets": args.sets,
        "steps": args.steps,
        "runs": args.runs,
        "model": model,
        "groups": config.trainer.batch_groups,
        "n": config.rollout.sampling.n,
        "max_tokens": config.rollout.sampling.max_tokens,
        "temperature": config.rollout.sampling.temperature,
        "lr": config.trainer.lr,
        "warmup_steps": WARMUP_STEPS,
        "edge_steps": EDGE_STEPS,
    }
    results = Results(settings)
    # Kept when something fails, so that the logs the error names are still there.
    scratch = Path(tempfile.mkdtemp(prefix="asp-peer-bench-"))
    config_file = scratch / "config.yaml"
    config_file.write_text(config.to_yaml())
    try:
        run_all(args, config_file, scratch, results, console)
    except RuntimeError as exc:
        console.print("[bold red]error:[/]")
        console.print(str(exc), markup=False, highlight=False)
        console.print(f"logs kept in {scratch}", highlight=False)
        if args.json and results.runs:
            # What finished is still worth keeping after an hour of runs.
            Path(args.json).write_text(json.dumps({**results.to_json(), "error": str(exc)}))
        return 1
    shutil.rmtree(scratch, ignore_errors=True)
    report(results, console)
    if args.json:
        Path(args.json).write_text(json.dumps(results.to_json(), indent=1))
        console.print(f"raw results in {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
