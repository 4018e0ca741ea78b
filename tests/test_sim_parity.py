"""One scenario, two ways: ``asp-tui simulate`` (the controller core on simulated instances and a
simulated clock) and the real controller process with the sim backend and sim trainer. Both run
the same core, so both must hold the same lag bound and consume the same number of groups."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from runtime.config import load_config
from runtime.controller.client import SpawnedController, write_run_config
from runtime.controller.ledger import verify_ledger
from runtime.rundir import read_jsonl

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO / "tests" / "data" / "castillo_sample.csv"
INSTANCES, SLOTS, BATCH, LAG, STEPS = 2, 18, 4, 1, 6
GROUPS = BATCH * STEPS


def _trace_rows(path: Path, rows: int) -> Path:
    """The first ``rows`` prompts of the trace: one epoch is exactly the run."""
    lines = TRACE.read_text().splitlines()
    path.write_text("\n".join(lines[: rows + 1]) + "\n")
    return path


async def test_simulate_and_the_live_controller_enforce_the_same_rules(tmp_path: Path) -> None:
    trace = _trace_rows(tmp_path / "trace.csv", GROUPS)

    shape = ["--instances", INSTANCES, "--max-num-seqs", SLOTS, "--batch-groups", BATCH]
    simulated = subprocess.run(
        [sys.executable, "-m", "asp_tui.cli", "simulate", "--lengths", str(trace)]
        + [str(x) for x in [*shape, "--lag-bound", LAG, "--policy", "fifo", "--json"]],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=False,
    )
    assert simulated.returncode == 0, simulated.stderr
    result = json.loads(simulated.stdout)["policies"]["fifo"]
    n = json.loads(simulated.stdout)["group_size"]

    config = load_config(
        REPO / "configs" / "sim-8.yaml",
        overrides=[
            f"rollout.instances={INSTANCES}",
            f"rollout.max_num_seqs={SLOTS}",
            f"rollout.sampling.n={n}",
            f"rollout.sim.lengths={trace}",
            "rollout.sim.time_scale=400",
            f"task.num_prompts={GROUPS}",
            f"trainer.batch_groups={BATCH}",
            f"trainer.steps={STEPS}",
            f"async.lag_bound={LAG}",
        ],
        run_dir=tmp_path / "live",
    )
    rd = write_run_config(config.run_dir, config)
    async with SpawnedController(rd.root) as controller:
        assert await controller.wait(180) == 0

    steps = [r for r in read_jsonl(rd.metrics) if r.get("event") == "step"]
    consumed = [r for r in read_jsonl(rd.ledger) if r.get("event") == "consumed"]
    assert verify_ledger(rd.ledger).ok

    # The same number of groups consumed, in the same number of steps of B.
    assert result["groups"] == len(consumed) == GROUPS
    assert result["steps"] == len(steps) == STEPS
    # The same bound held: no consumed group older than η, in either.
    simulated_lags = {int(lag) for lag in result["lag_histogram"]}
    live_lags = {r["lag"] for r in consumed}
    assert max(simulated_lags) <= LAG and max(live_lags) <= LAG
    assert all(s["lag_bound"] == LAG and s["lag_max"] <= LAG for s in steps)
