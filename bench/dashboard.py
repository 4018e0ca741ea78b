"""Dashboard costs: one render tick at 64 and 256 instances, and the controller's telemetry CPU.

1. Render tick: a headless app (``App.run_test``) fed fixed snapshots through ``FixedLink``; a
   fresh snapshot (new seq, changed cells) goes into the model before every tick, so each tick
   does its full work (header, meters, sparklines, bubble bars, table diff). Reported: the tick
   call itself (p50/p95), and the process CPU per tick at 10 Hz, which adds Textual's layout and
   paint of the changed regions.
2. Controller: the real controller (``python -m runtime.controller``) on the sim backend with 256
   instances, one telemetry subscriber attached, at ``telemetry.hz`` 10 and at 0.5. The
   difference of the controller process's CPU (psutil) is what telemetry costs (goal < 5% of a
   core).

Run: ``.venv/bin/python bench/dashboard.py`` (``--quick`` for shorter windows). Numbers are from
whatever machine runs it; nothing here asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from asp_tui.app import make_app  # noqa: E402
from asp_tui.link import FixedLink  # noqa: E402
from asp_tui.samples import sample_history, sample_snapshot  # noqa: E402
from runtime.protocol import TOPIC_SNAPSHOT, Encoder, Snapshot, encode_topic  # noqa: E402


def encode_cost(instances: int, rounds: int = 200) -> float:
    """CPU seconds to encode one snapshot for the PUB socket (a lower bound on telemetry)."""
    snapshot, encoder = sample_snapshot(instances), Encoder()
    started = time.process_time()
    for _ in range(rounds):
        encode_topic(TOPIC_SNAPSHOT, snapshot, encoder)
    return (time.process_time() - started) / rounds


async def render_cost(instances: int, ticks: int, size: tuple[int, int]) -> dict[str, float]:
    variants = [sample_snapshot(instances, step=40 + k, seq=k, seed=k) for k in range(16)]
    link = FixedLink([variants[0]], history=sample_history(instances, steps=60))
    app = make_app(link, render_hz=1000.0)  # the bench drives ticks itself
    call_ms: list[float] = []
    async with app.run_test(size=size) as pilot:
        for _ in range(100):
            if app.model.seq_applied >= 0:
                break
            await pilot.pause(0.02)
        for timer in list(app._timers):
            timer.stop()  # only the bench's own ticks from here on
        await pilot.pause(0.1)
        cpu_start, wall_start = time.process_time(), time.perf_counter()
        for k in range(ticks):
            snapshot = variants[k % len(variants)]
            snapshot.seq = 1000 + k
            snapshot.time = variants[0].time + k  # every tick also takes a sparkline point
            app.model.apply_snapshot(snapshot)
            started = time.perf_counter()
            app.render_tick()
            call_ms.append((time.perf_counter() - started) * 1000)
            await pilot.pause(0.1)  # 10 Hz: Textual lays out and paints in between
        cpu = time.process_time() - cpu_start
        wall = time.perf_counter() - wall_start
    call_ms.sort()
    return {
        "p50_ms": statistics.median(call_ms),
        "p95_ms": call_ms[int(0.95 * (len(call_ms) - 1))],
        "cpu_ms_per_tick": cpu / ticks * 1000,
        "core_share_10hz": cpu / wall,
    }


def write_config(run_dir: Path, instances: int, hz: float) -> None:
    from runtime.config import load_config
    from runtime.controller.client import write_run_config

    config = load_config(
        REPO / "configs" / "sim-64.yaml",
        [f"rollout.instances={instances}", f"telemetry.hz={hz}", "trainer.steps=100000"],
        run_dir=run_dir,
    )
    write_run_config(run_dir, config)


async def controller_cpu(instances: int, hz: float, warmup_s: float, window_s: float) -> dict:
    from runtime.controller.client import SpawnedController, TelemetrySubscriber

    with tempfile.TemporaryDirectory(prefix="asp-bench-") as tmp:
        run_dir = Path(tmp)
        write_config(run_dir, instances, hz)
        ctl = SpawnedController(run_dir)
        proc = ctl.proc
        received = 0
        snapshots = 0
        try:
            endpoints = await ctl.wait_ready(60)
            controller = psutil.Process(proc.pid)
            async with TelemetrySubscriber(endpoints) as subscriber:

                async def drain() -> None:
                    nonlocal received, snapshots
                    async for message in subscriber:
                        received += 1
                        snapshots += isinstance(message, Snapshot)

                drainer = asyncio.create_task(drain())
                await asyncio.sleep(warmup_s)
                before, t0 = controller.cpu_times(), time.perf_counter()
                received_0, snapshots_0 = received, snapshots
                await asyncio.sleep(window_s)
                after, t1 = controller.cpu_times(), time.perf_counter()
                drainer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await drainer
            cpu = (after.user + after.system) - (before.user + before.system)
            return {
                "hz": hz,
                "core_share": cpu / (t1 - t0),
                "messages_per_s": (received - received_0) / (t1 - t0),
                "snapshots_per_s": (snapshots - snapshots_0) / (t1 - t0),
            }
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


async def snapshot_thread_cpu(instances: int, hz: float, warmup_s: float, window_s: float) -> dict:
    """The real ``ControllerProcess`` in this process, with ``_publish_snapshot`` (build + encode +
    send one snapshot) wrapped in ``time.thread_time``: the exact CPU telemetry costs, apart
    from the sim instances, the trainer and dispatch."""
    from runtime.controller.client import TelemetrySubscriber
    from runtime.controller.process import ControllerProcess
    from runtime.rundir import RunDir

    with tempfile.TemporaryDirectory(prefix="asp-bench-") as tmp:
        run_dir = Path(tmp)
        write_config(run_dir, instances, hz)
        controller = ControllerProcess(run_dir, spawn=True)
        spent = {"cpu": 0.0, "count": 0, "measuring": False}
        publish = controller._publish_snapshot

        def timed_publish() -> None:
            started = time.thread_time()
            publish()
            if spent["measuring"]:
                spent["cpu"] += time.thread_time() - started
                spent["count"] += 1

        controller._publish_snapshot = timed_publish  # type: ignore[method-assign]
        task = asyncio.create_task(controller.run())
        try:
            for _ in range(600):
                with contextlib.suppress(FileNotFoundError, ValueError):
                    endpoints = RunDir(run_dir).read_endpoints()
                    break
                await asyncio.sleep(0.05)
            async with TelemetrySubscriber(endpoints) as subscriber:

                async def drain() -> None:
                    async for _ in subscriber:
                        pass

                drainer = asyncio.create_task(drain())
                await asyncio.sleep(warmup_s)
                spent["measuring"], t0 = True, time.perf_counter()
                await asyncio.sleep(window_s)
                spent["measuring"], t1 = False, time.perf_counter()
                drainer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await drainer
        finally:
            controller.request_stop("bench done")
            try:
                await asyncio.wait_for(task, 60)
            except TimeoutError:
                task.cancel()
        per_snapshot = spent["cpu"] / max(spent["count"], 1)
        return {
            "per_snapshot_ms": per_snapshot * 1000,
            "snapshots_per_s": spent["count"] / (t1 - t0),
            "share_at_10hz": per_snapshot * 10,
        }


def terminal_responsiveness(seconds: float, presses: int) -> dict[str, float]:
    """``attach`` in a pseudo-terminal on a live sim-64 run (configs/sim-64.yaml, 10 Hz):
    the dashboard process's CPU share, and key-press -> help-screen-drawn latency."""
    import pty
    import threading

    from runtime.config import load_config
    from runtime.controller.client import write_run_config

    with tempfile.TemporaryDirectory(prefix="asp-bench-") as tmp:
        run_dir = Path(tmp)
        write_run_config(run_dir, load_config(REPO / "configs" / "sim-64.yaml", run_dir=run_dir))
        controller = subprocess.Popen(
            [sys.executable, "-m", "runtime.controller", "--run-dir", str(run_dir)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            cwd=REPO,
        )
        master, slave = pty.openpty()
        code = f"import sys; from asp_tui.attach import attach; sys.exit(attach({tmp!r}))"
        env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "140", "LINES": "40"}
        screen = bytearray()
        lock = threading.Lock()

        def drain() -> None:
            with contextlib.suppress(OSError):
                while chunk := os.read(master, 65536):
                    with lock:
                        screen.extend(chunk)

        dashboard = None
        try:
            time.sleep(1.0)  # endpoints.json first
            dashboard = subprocess.Popen(
                [sys.executable, "-c", code], stdin=slave, stdout=slave, stderr=slave,
                cwd=REPO, env=env, start_new_session=True,
            )  # fmt: skip
            os.close(slave)
            threading.Thread(target=drain, daemon=True).start()
            deadline = time.monotonic() + 60
            while b"LIVE" not in screen and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(3.0)
            process = psutil.Process(dashboard.pid)
            before, t0 = process.cpu_times(), time.perf_counter()
            time.sleep(seconds)
            after, t1 = process.cpu_times(), time.perf_counter()
            latencies = []
            for _ in range(presses):
                with lock:
                    mark = len(screen)
                started = time.perf_counter()
                os.write(master, b"?")
                while time.perf_counter() - started < 5:
                    with lock:
                        if b"Keys" in screen[mark:]:
                            break
                    time.sleep(0.002)
                latencies.append((time.perf_counter() - started) * 1000)
                os.write(master, b"q")  # closes help (q only detaches on the main screen)
                time.sleep(0.5)
            latencies.sort()
            return {
                "core_share": (sum(after[:2]) - sum(before[:2])) / (t1 - t0),
                "latency_p50_ms": statistics.median(latencies),
                "latency_max_ms": latencies[-1],
            }
        finally:
            for proc in (dashboard, controller):
                if proc is not None and proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGTERM)
                    try:
                        proc.wait(30)
                    except subprocess.TimeoutExpired:
                        os.killpg(proc.pid, signal.SIGKILL)
                        proc.wait()
            os.close(master)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter windows (noisier)")
    parser.add_argument("--skip-controller", action="store_true")
    args = parser.parse_args()
    ticks = 40 if args.quick else 100
    warmup, window = (5.0, 8.0) if args.quick else (10.0, 20.0)

    print("## Render tick (headless, fresh snapshot every tick, 140x40)")
    print(
        f"{'instances':>9} | {'tick p50 ms':>11} | {'tick p95 ms':>11} | "
        f"{'CPU ms/tick':>11} | {'core @10 Hz':>11}"
    )
    print(f"{'-' * 9}-|-{'-' * 11}-|-{'-' * 11}-|-{'-' * 11}-|-{'-' * 11}")
    for instances in (64, 256):
        r = asyncio.run(render_cost(instances, ticks, (140, 40)))
        print(
            f"{instances:>9} | {r['p50_ms']:>11.2f} | {r['p95_ms']:>11.2f} | "
            f"{r['cpu_ms_per_tick']:>11.2f} | {r['core_share_10hz']:>10.1%}"
        )
    if args.skip_controller:
        return 0
    print()
    r = terminal_responsiveness(5.0 if args.quick else 10.0, 5 if args.quick else 10)
    print("## attach in a pseudo-terminal (140x40) on a live sim-64 run, 10 Hz render")
    print(
        f"dashboard CPU {r['core_share']:.1%} of a core; key -> help drawn: "
        f"p50 {r['latency_p50_ms']:.0f} ms, max {r['latency_max_ms']:.0f} ms"
    )
    print()
    print(f"## Controller, 256 sim instances, telemetry.hz 10, one subscriber ({window:.0f}s)")
    r = asyncio.run(controller_cpu(256, 10.0, warmup, window))
    print(
        f"controller process (psutil): {r['core_share']:.1%} of a core in all, "
        f"{r['snapshots_per_s']:.1f} snapshots/s and {r['messages_per_s']:.1f} messages/s "
        "received"
    )
    t = asyncio.run(snapshot_thread_cpu(256, 10.0, warmup, window))
    print(
        f"telemetry alone (in-process, thread CPU): {t['per_snapshot_ms']:.2f} ms per "
        f"snapshot (build + encode + send) at {t['snapshots_per_s']:.1f} snapshots/s "
        f"-> {t['share_at_10hz']:.1%} of a core at 10 Hz (goal < 5%)"
    )
    encode = encode_cost(256)
    print(f"encoding alone: {encode * 1000:.3f} ms per 256-instance snapshot")
    return 0


if __name__ == "__main__":
    sys.exit(main())
