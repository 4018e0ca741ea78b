"""The live sim benchmark (bench/live_sim.py): one short real run on configs/sim-64.yaml gives its
table row from the run's own step records; a failed or interrupted run leaves no process behind.

The benchmark's numbers are not asserted, only where they come from.
"""

from __future__ import annotations

import io
import statistics
from pathlib import Path

import psutil
import pytest
from bench_scripts import load_bench
from rich.console import Console

from runtime.rundir import RunDir, read_jsonl

live = load_bench("live_sim")


def processes_mentioning(text: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(text in part for part in proc.info["cmdline"] or []):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def assert_no_process_left(run_dir: Path) -> None:
    left = processes_mentioning(str(run_dir))
    _, alive = psutil.wait_procs(left, timeout=10)
    assert not alive, [(p.pid, p.cmdline()) for p in alive]


def render(table) -> str:
    console = Console(file=io.StringIO(), width=200)
    console.print(table)
    return console.file.getvalue()


def test_a_run_gives_its_row_from_its_step_records(tmp_path: Path) -> None:
    run_dir = tmp_path / "eta1-asp"
    lines: list[str] = []
    cell = live.run_cell("asp", 1, steps=3, warmup=1, run_dir=run_dir, progress=lines.append)
    assert_no_process_left(run_dir)

    steps = [r for r in read_jsonl(RunDir(run_dir).metrics) if r.get("event") == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3]
    steady = steps[1:]
    assert cell.steps == 2
    assert cell.iteration_s == pytest.approx(statistics.fmean(r["iteration_s"] for r in steady))
    tokens, samples = sum(r["tokens"] for r in steady), sum(r["samples"] for r in steady)
    assert samples == 2 * 128 * 8  # two batches of B = 128 groups of n = 8
    assert cell.mean_length == pytest.approx(tokens / samples)
    assert cell.deferred == sum(r["deferred"] for r in steady)
    assert sum(cell.bubbles.values()) == pytest.approx(1.0)
    assert any("step 3/3" in line for line in lines), lines
    # The ledger's lengths are the samples the trainer got: the first-epoch length's source.
    ledger = read_jsonl(RunDir(run_dir).ledger)
    completed = {r["group"]: r["lengths"] for r in ledger if r["event"] == "completed"}
    consumed = [completed[r["group"]] for r in ledger if r["event"] == "consumed"]
    assert sum(map(sum, consumed)) == sum(r["tokens"] for r in steps)
    assert cell.epoch_length is None  # 3 of the 111 steps of sim-64's first epoch

    text = render(live.results_table([cell], steps=3, warmup=1))
    row = next(line for line in text.splitlines() if " asp " in line)
    assert row.split()[:4] == ["1", "asp", "2", f"{cell.iteration_s:.2f}"]


def test_no_step_after_the_warmup_is_a_failure() -> None:
    with pytest.raises(live.RunFailed, match="0 step record"):
        live.summarise([], "fifo", 1, warmup=3)


def test_a_failed_run_shows_its_error_and_log(tmp_path: Path) -> None:
    run_dir = tmp_path / "bad"
    missing = tmp_path / "no-such-trace.csv"
    with pytest.raises(live.RunFailed) as failed:
        live.run_cell(
            "fifo",
            1,
            steps=2,
            warmup=1,
            run_dir=run_dir,
            overrides=[f"rollout.sim.lengths={missing}"],
        )
    message = str(failed.value)
    assert "η=1 fifo" in message
    assert "controller.log" in message and "no-such-trace" in message
    assert_no_process_left(run_dir)


def test_an_interrupt_stops_the_run_and_its_children(tmp_path: Path) -> None:
    run_dir = tmp_path / "interrupted"

    def interrupt(line: str) -> None:
        if "ready" in line:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        live.run_cell("fifo", 1, steps=40, warmup=3, run_dir=run_dir, progress=interrupt)
    assert_no_process_left(run_dir)


@pytest.mark.parametrize(
    "argv",
    [
        ["--steps", "3", "--warmup", "3"],
        ["--lag-bound", "-1"],
        ["--set", "scheduler.policy=fifo"],
    ],
)
def test_bad_arguments_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        live.main(argv)
    assert exited.value.code == 2


def test_a_bad_override_exits_2_before_any_run(capsys) -> None:
    assert live.main(["--set", "rollout.instances=0"]) == 2
    assert "rollout.instances" in capsys.readouterr().err
