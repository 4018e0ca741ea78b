"""The sim backend and sim trainer under the real controller (``configs/sim-8.yaml``).

``python -m runtime.controller`` spawns ``runtime.sim.backend`` (8 instances in one process) and
``runtime.sim.trainer``; the test watches telemetry, pauses and resumes one instance through
the control socket, and checks the run's metrics, ledger and logs after it ends.
"""

from __future__ import annotations

from pathlib import Path

import psutil

from runtime.config import load_config
from runtime.controller.client import (
    ControlClient,
    SpawnedController,
    TelemetrySubscriber,
    write_run_config,
)
from runtime.controller.ledger import verify_ledger
from runtime.protocol import PauseInstances, ResumeInstances, Snapshot
from runtime.rundir import read_jsonl

REPO = Path(__file__).resolve().parents[1]
STEPS = 6


def processes_mentioning(text: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if any(text in part for part in proc.info["cmdline"] or []):
            found.append(proc)
    return found


def state_of(snap: Snapshot, instance_id: int) -> str:
    return next(i.state for i in snap.instances if i.instance_id == instance_id)


async def test_sim8_trains_under_the_real_controller(tmp_path: Path) -> None:
    config = load_config(
        REPO / "configs" / "sim-8.yaml",
        overrides=[f"trainer.steps={STEPS}"],
        run_dir=tmp_path / "sim-8",
    )
    rd = write_run_config(config.run_dir, config)
    async with SpawnedController(rd.root) as controller:
        endpoints = controller.endpoints
        assert endpoints is not None
        async with TelemetrySubscriber(endpoints) as telemetry, ControlClient(endpoints) as ctl:
            snap = await telemetry.wait_for(
                lambda s: len(s.instances) == 8 and all(i.state == "running" for i in s.instances),
                timeout=60,
            )
            assert {i.max_num_seqs for i in snap.instances} == {32}
            reply = await ctl.request(PauseInstances(ids=[3]))
            assert reply.ok, reply.reason
            await telemetry.wait_for(lambda s: state_of(s, 3) == "paused", timeout=30)
            reply = await ctl.request(ResumeInstances(ids=[3]))
            assert reply.ok, reply.reason
            await telemetry.wait_for(lambda s: state_of(s, 3) == "running", timeout=30)
            await telemetry.wait_for(lambda s: s.step >= 2, timeout=60)
            _, events = await ctl.history()
        assert await controller.wait(180) == 0

    # One "loaded by" line per weight version, not a syncing and a running line per instance.
    routine = [
        e
        for e in events
        if e.kind == "instance"
        and ("running -> syncing" in e.message or "syncing -> running" in e.message)
    ]
    assert routine == [], routine
    assert any(e.kind == "weights" and "loaded by 8/8 instances" in e.message for e in events)

    steps = [r for r in read_jsonl(rd.metrics) if r.get("event") == "step"]
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    batch_samples = config.trainer.batch_groups * config.rollout.sampling.n
    for step in steps:
        assert step["lag_max"] <= step["lag_bound"]
        assert step["samples"] == batch_samples
        assert 0.0 <= step["reward_mean"] <= 1.0
        assert step["tokens"] > 0
    report = verify_ledger(rd.ledger)
    assert report.errors == [] and report.consumed_twice == []
    assert report.counts["consumed"] == STEPS * config.trainer.batch_groups
    # keep mode: some samples were generated across a weight update.
    assert any(step["lag_span_max"] >= 1 for step in steps)
    backend_log = rd.log_file("sim-backend").read_text()
    assert "0 rejected frame(s)" in backend_log
    assert f"sim trainer exits at version {STEPS}" in rd.log_file("trainer").read_text()
    assert processes_mentioning(str(rd.root)) == []
    synced = [r for r in read_jsonl(rd.metrics) if r.get("routine")]
    assert synced, "routine transitions stay in metrics.jsonl"
