"""The real controller process (``python -m runtime.controller``) against the real sim backend and
sim trainer (``runtime.sim.backend`` / ``runtime.sim.trainer``, the same wire protocol as the
vLLM workers and the torch trainer). Nothing is mocked: every test reads what the processes
wrote (metrics.jsonl, ledger.jsonl, snapshots, command replies)."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import psutil
import pytest
import zmq
import zmq.asyncio

from runtime.auth import Role
from runtime.config import load_config
from runtime.controller.client import (
    ControlClient,
    ControllerUnavailable,
    SpawnedController,
    TelemetrySubscriber,
    send_command,
    write_run_config,
)
from runtime.controller.ledger import verify_ledger
from runtime.protocol import (
    PauseInstances,
    RestartInstances,
    ResumeInstances,
    SetLagBound,
    StatusCmd,
    StopRun,
)
from runtime.rundir import RunDir, read_jsonl
from runtime.transport import connect

ROOT = Path(__file__).resolve().parents[1]


def make_run(tmp_path: Path, *overrides: str, name: str = "ctl") -> Path:
    run_dir = tmp_path / name
    base = [
        "rollout.instances=2",
        "rollout.max_num_seqs=16",
        "rollout.sampling.n=4",
        "rollout.sampling.max_tokens=1024",
        "rollout.heartbeat_s=0.2",
        "rollout.heartbeat_timeout_s=2",
        "rollout.restart.backoff_initial_s=0.5",
        "rollout.sim.time_scale=60",
        "task.num_prompts=48",
        "trainer.batch_groups=4",
        "trainer.steps=8",
        "telemetry.hz=20",
        "telemetry.window_s=2",
    ]
    cfg = load_config(ROOT / "configs" / "sim-8.yaml", [*base, *overrides], run_dir=run_dir)
    write_run_config(run_dir, cfg)
    return run_dir


def steps_of(run_dir: Path) -> list[dict]:
    return [r for r in read_jsonl(RunDir(run_dir).metrics) if r.get("event") == "step"]


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def assert_all_gone(procs: list[psutil.Process], timeout: float = 10.0) -> None:
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    assert not alive, f"orphaned processes: {[(p.pid, p.cmdline()) for p in alive]}"


def assert_lag_bounded(steps: list[dict]) -> None:
    for rec in steps:
        assert rec["lag_max"] <= rec["lag_bound"], rec


async def watch_children(ctl, until: asyncio.Event) -> set[psutil.Process]:
    """Every descendant the controller ever had while ``until`` is not set."""
    seen: dict[int, psutil.Process] = {}
    while not until.is_set() and ctl.proc.poll() is None:
        for proc in descendants(ctl.pid):
            seen.setdefault(proc.pid, proc)
        await asyncio.sleep(0.1)
    return set(seen.values())


@pytest.mark.parametrize(
    ("eta", "policy", "dispatch"),
    [
        (0, "fifo", "continuous"),
        (1, "fifo", "continuous"),
        (2, "fifo", "continuous"),
        (1, "asp", "minibatch"),
        (2, "sorted", "continuous"),
    ],
)
async def test_run_to_completion_with_bounded_lag(tmp_path, eta, policy, dispatch):
    run_dir = make_run(
        tmp_path,
        f"async.lag_bound={eta}",
        "trainer.steps=6",
        f"scheduler.policy={policy}",
        f"scheduler.dispatch={dispatch}",
    )
    done = asyncio.Event()
    async with SpawnedController(run_dir) as ctl:
        watcher = asyncio.create_task(watch_children(ctl, done))
        code = await ctl.wait(120)
        done.set()
        children = await watcher
    assert code == 0
    assert len(children) >= 2, "the controller spawned no backend/trainer"
    assert_all_gone(list(children))
    steps = steps_of(run_dir)
    assert [r["step"] for r in steps] == list(range(1, 7))
    assert_lag_bounded(steps)
    assert all(r["lag_bound"] == eta for r in steps)
    if eta > 0:
        # Asynchrony actually happened (otherwise the bound is trivially met).
        assert max(r["lag_max"] for r in steps) >= 1
    for rec in steps:
        fractions = [
            rec[f"bubble_{c}"]
            for c in ("useful", "padding", "skewness", "sorting", "sync", "paused", "down", "idle")
        ]
        assert sum(fractions) == pytest.approx(1.0)
        assert rec["samples"] == 4 * 4 and rec["tokens"] > 0 and rec["iteration_s"] > 0
    report = verify_ledger(RunDir(run_dir).ledger)
    assert report.ok, report.errors
    assert report.counts["consumed"] == 6 * 4
    state = RunDir(run_dir).state / "controller.json"
    assert '"version":6' in state.read_text()


@pytest.mark.parametrize("mode", ["wait", "abort"])
async def test_live_lag_change_2_0_1(tmp_path, mode):
    run_dir = make_run(
        tmp_path,
        "async.lag_bound=2",
        f"async.on_lag_decrease={mode}",
        "trainer.steps=14",
        "rollout.instances=3",
    )
    async with SpawnedController(run_dir) as ctl:
        endpoints = ctl.endpoints
        async with ControlClient(endpoints) as control, TelemetrySubscriber(endpoints) as tel:
            await tel.wait_for(lambda s: s.step >= 3, timeout=90)
            reply = await control.request(SetLagBound(value=0))
            assert reply.ok, reply.reason
            data = reply.data
            if mode == "abort":
                assert data["lag_bound"] == 0 and data["pending_lag_bound"] is None
            else:  # old bound stays in force until nothing in flight would violate the new one
                assert (data["lag_bound"], data["pending_lag_bound"]) in ((2, 0), (0, None))
            await tel.wait_for(lambda s: s.step >= 7 and s.lag_bound == 0, timeout=90)
            reply = await control.request(SetLagBound(value=1))
            assert reply.ok and reply.data["lag_bound"] == 1
        assert await ctl.wait(120) == 0
    steps = steps_of(run_dir)
    assert len(steps) == 14
    assert_lag_bounded(steps)
    bounds = [r["lag_bound"] for r in steps]
    assert 0 in bounds and bounds[-1] == 1 and bounds[0] == 2
    report = verify_ledger(RunDir(run_dir).ledger)
    assert report.ok, report.errors
    commands = [r for r in read_jsonl(RunDir(run_dir).metrics) if r.get("event") == "command"]
    assert [c["args"]["value"] for c in commands if c["name"] == "set_lag_bound"] == [0, 1]
    if mode == "wait":
        records = read_jsonl(RunDir(run_dir).metrics)
        pending = [r for r in steps if r["pending_lag_bound"] == 0]
        applied = [r for r in records if r.get("event") == "lag"]
        assert pending or applied, "the decrease was neither pending nor applied"


def _unchecked(name: str) -> msgspec.Struct:
    """A command tagged ``name`` with no arguments, which the protocol's classes cannot make: an
    unknown command, or a known one missing its argument."""
    cls = msgspec.defstruct("Unchecked", [("request_id", int, 0)], tag=name, kw_only=True)
    cls.name = name  # the client names it in a timeout message
    return cls()


async def test_commands_pause_resume_and_refusals(tmp_path):
    run_dir = make_run(
        tmp_path,
        "trainer.steps=400",
        "rollout.instances=3",
        "async.lag_bound=2",
        "task.num_prompts=96",
    )
    async with SpawnedController(run_dir) as ctl:
        endpoints = ctl.endpoints
        async with ControlClient(endpoints) as control, TelemetrySubscriber(endpoints) as tel:
            await tel.wait_for(lambda s: s.step >= 1, timeout=90)
            # Structs do not validate on construction, so a wrong field reaches the controller
            # as it would from a foreign client; _unchecked builds what the protocol cannot.
            refusals = [
                (_unchecked("bogus"), "unknown command"),
                (SetLagBound(value=99), "out of range"),
                (SetLagBound(value="one"), "not an integer"),
                (_unchecked("set_lag_bound"), "needs"),
                (PauseInstances(ids=[7]), "unknown instance id 7"),
                (PauseInstances(ids=[]), "non-empty list"),
                (ResumeInstances(ids=[0]), "not paused"),
            ]
            for command, expected in refusals:
                reply = await control.request(command)
                assert not reply.ok and expected in reply.reason, (command, reply)

            reply = await control.request(PauseInstances(ids=[1]))
            assert reply.ok, reply.reason
            again = await control.request(PauseInstances(ids=[1]))
            assert not again.ok and "already paused" in again.reason
            snap = await tel.wait_for(lambda s: s.instances[1].state == "paused", timeout=10)
            paused_at = snap.time
            await asyncio.sleep(1.5)
            late = [
                r
                for r in read_jsonl(RunDir(run_dir).ledger)
                if r.get("event") == "dispatched" and r["instance"] == 1 and r["time"] > paused_at
            ]
            assert late == [], "a paused instance got new work"
            others = [
                r
                for r in read_jsonl(RunDir(run_dir).ledger)
                if r.get("event") == "dispatched" and r["time"] > paused_at
            ]
            assert others, "training stopped while one instance was paused"

            reply = await control.request(ResumeInstances(ids=[1]))
            assert reply.ok, reply.reason
            await tel.wait_for(lambda s: s.instances[1].state in ("running", "syncing"), timeout=10)
            resumed_at = time.time()
            deadline = time.time() + 20
            while time.time() < deadline:
                again = [
                    r
                    for r in read_jsonl(RunDir(run_dir).ledger)
                    if r.get("event") == "dispatched"
                    and r["instance"] == 1
                    and r["time"] > resumed_at
                ]
                if again:
                    break
                await asyncio.sleep(0.2)
            assert again, "the resumed instance got no work"

            full = await tel.wait_for(
                lambda s: (
                    all(r.tokens_per_s > 0 for r in s.instances)
                    and s.trainer.iteration_s > 0
                    and s.trainer.samples_per_s > 0
                    and s.lag.histogram
                    and s.admitted_groups > s.consumed_groups > 0
                ),
                timeout=30,
            )
            assert abs(sum(full.bubbles_window.values()) - 1.0) < 1e-6
            assert abs(sum(full.bubbles_total.values()) - 1.0) < 1e-6
            assert all(r.max_num_seqs == 16 for r in full.instances)
            status = await control.status()
            assert status.total_steps == 400 and len(status.instances) == 3
            assert status.batch_groups == 4 and status.queue_capacity > 0
            assert set(status.bubbles_window) >= {"useful", "padding", "sync", "idle"}
            snapshots, events = await control.history()
            assert snapshots and any("paused" in e.message for e in events)

            reply = await asyncio.to_thread(send_command, endpoints, StopRun())
            assert reply.ok
        assert await ctl.wait(60) == 0
    with pytest.raises(ControllerUnavailable):
        send_command(endpoints, StatusCmd(), timeout_s=0.5)
    records = read_jsonl(RunDir(run_dir).metrics)
    commands = [r for r in records if r.get("event") == "command"]
    assert any(c["name"] == "pause_instance" and c["ok"] for c in commands)
    assert any(c["name"] == "bogus" and not c["ok"] for c in commands)
    assert any(r.get("event") == "instance" for r in records)
    assert verify_ledger(RunDir(run_dir).ledger).ok


async def test_garbage_on_every_socket_is_counted_and_ignored(tmp_path):
    run_dir = make_run(tmp_path, "trainer.steps=10")
    async with SpawnedController(run_dir) as ctl:
        endpoints = ctl.endpoints
        ctx = zmq.asyncio.Context()
        try:
            sent = 0
            # Authenticated peers (with their role's key) that send garbage.
            for plane, role, identity in (
                ("rollout", Role.WORKER, b"instance-0-junk"),
                ("trainer", Role.TRAINER, b"trainer-junk"),
                ("control", Role.OPERATOR, None),
            ):
                # A long linger delivers the junk before closing.
                dealer = connect(ctx, endpoints, plane, role, identity=identity, linger_ms=2000)
                for junk in ([b"\x00\xffgarbage"], [b"\x92\x01\xa3bad"], [b"\x92\x07\xc0"]):
                    await dealer.send_multipart(junk)
                    sent += 1
                dealer.close()
            # Raw bytes that are not even ZMTP, on all four ports, telemetry included.
            for address in (
                endpoints.rollout,
                endpoints.trainer,
                endpoints.telemetry,
                endpoints.control,
            ):
                host, port = address.removeprefix("tcp://").rsplit(":", 1)
                with socket.create_connection((host, int(port)), timeout=2) as raw:
                    raw.sendall(b"GET / HTTP/1.0\r\n\r\n" + bytes(range(256)))
            async with TelemetrySubscriber(endpoints) as tel:
                snap = await tel.wait_for(lambda s: s.rejected_frames >= sent, timeout=30)
                assert snap.rejected_frames >= sent
                await tel.wait_for(lambda s: s.step >= 2, timeout=90)
        finally:
            ctx.term()
        assert await ctl.wait(120) == 0
    assert len(steps_of(run_dir)) == 10


async def test_sigkill_of_the_backend_loses_nothing(tmp_path):
    run_dir = make_run(tmp_path, "trainer.steps=12", "async.lag_bound=1")
    async with SpawnedController(run_dir) as ctl:
        async with TelemetrySubscriber(ctl.endpoints) as tel:
            await tel.wait_for(lambda s: s.step >= 3 and s.in_flight_groups > 0, timeout=90)
            backend = [p for p in descendants(ctl.pid) if "runtime.sim.backend" in p.cmdline()]
            assert len(backend) == 1
            backend[0].send_signal(signal.SIGKILL)
            await tel.wait_for(lambda s: all(r.state == "down" for r in s.instances), timeout=10)
            snap = await tel.wait_for(
                lambda s: all(r.state == "running" for r in s.instances) and s.requeued_groups,
                timeout=60,
            )
            assert all(r.restarts == 1 for r in snap.instances)
        assert await ctl.wait(120) == 0
    steps = steps_of(run_dir)
    assert len(steps) == 12
    assert_lag_bounded(steps)
    report = verify_ledger(RunDir(run_dir).ledger)
    assert report.ok, report.errors
    assert report.counts["requeued"] > 0
    assert not report.consumed_twice and not report.prompts_consumed_twice
    # Every requeued prompt was dispatched again (none lost), barring the very end of the run.
    assert report.counts["consumed"] == 12 * 4
    events = [r for r in read_jsonl(RunDir(run_dir).metrics) if r.get("event") == "instance"]
    assert any("re-queued" in e["message"] for e in events)


async def test_sigterm_stops_cleanly_and_the_run_resumes(tmp_path):
    run_dir = make_run(tmp_path, "trainer.steps=10")
    done = asyncio.Event()
    async with SpawnedController(run_dir) as ctl:
        watcher = asyncio.create_task(watch_children(ctl, done))
        async with TelemetrySubscriber(ctl.endpoints) as tel:
            await tel.wait_for(lambda s: s.step >= 3, timeout=90)
        ctl.signal(signal.SIGTERM)
        assert await ctl.wait(60) == 0
        done.set()
        children = await watcher
    assert_all_gone(list(children))
    first = steps_of(run_dir)
    assert 3 <= len(first) < 10
    async with SpawnedController(run_dir) as ctl:
        assert await ctl.wait(120) == 0
    steps = steps_of(run_dir)
    assert [r["step"] for r in steps] == list(range(1, 11)), "resume did not continue the steps"
    report = verify_ledger(RunDir(run_dir).ledger)
    assert report.ok, report.errors
    assert report.restarts == 2


async def test_no_spawn_heartbeat_timeout_marks_down_and_training_goes_on(tmp_path):
    """Workers started by someone else (one sim backend process per instance): SIGKILL of one is
    noticed by its missing heartbeats alone; its groups are requeued and the run finishes."""
    run_dir = make_run(tmp_path, "trainer.steps=10", "rollout.instances=2")
    async with SpawnedController(run_dir, spawn=False) as ctl:
        root = str(run_dir)
        py = sys.executable
        peers = [
            subprocess.Popen(
                [py, "-m", "runtime.sim.backend", "--run-dir", root, "--instance-id", str(i)]
            )
            for i in range(2)
        ]
        peers.append(subprocess.Popen([py, "-m", "runtime.sim.trainer", "--run-dir", root]))
        try:
            async with (
                ControlClient(ctl.endpoints) as control,
                TelemetrySubscriber(ctl.endpoints) as tel,
            ):
                await tel.wait_for(
                    lambda s: s.step >= 2 and s.instances[1].in_flight_groups, timeout=90
                )
                peers[1].kill()
                snap = await tel.wait_for(lambda s: s.instances[1].state == "down", timeout=15)
                assert snap.instances[0].state in ("running", "syncing")
                reply = await control.request(RestartInstances(ids=[1]))
                assert not reply.ok and "--no-spawn" in reply.reason
            assert await ctl.wait(120) == 0
        finally:
            for peer in peers:
                if peer.poll() is None:
                    peer.terminate()
                peer.wait(10)
    assert len(steps_of(run_dir)) == 10
    report = verify_ledger(RunDir(run_dir).ledger)
    assert report.ok and report.counts["requeued"] > 0


async def test_epochs_roll_over_without_duplicates(tmp_path):
    # 6 prompts, 4 groups per step, 8 steps: 32 groups consumed, so at least 5 epochs.
    run_dir = make_run(tmp_path, "task.num_prompts=6", "trainer.steps=8", "async.lag_bound=1")
    async with SpawnedController(run_dir) as ctl:
        assert await ctl.wait(120) == 0
    records = read_jsonl(RunDir(run_dir).ledger)
    epochs = {r["epoch"] for r in records if r.get("event") == "dispatched"}
    assert len(epochs) >= 5
    report = verify_ledger(RunDir(run_dir).ledger)
    assert report.ok, report.errors
    assert report.counts["consumed"] == 32
    assert_lag_bounded(steps_of(run_dir))


async def test_trainer_death_fails_the_run_and_reaps_everything(tmp_path):
    run_dir = make_run(tmp_path, "trainer.steps=400")
    done = asyncio.Event()
    async with SpawnedController(run_dir) as ctl:
        watcher = asyncio.create_task(watch_children(ctl, done))
        async with TelemetrySubscriber(ctl.endpoints) as tel:
            await tel.wait_for(lambda s: s.step >= 2, timeout=90)
        trainer = [p for p in descendants(ctl.pid) if "runtime.sim.trainer" in p.cmdline()]
        assert len(trainer) == 1
        trainer[0].send_signal(signal.SIGKILL)
        assert await ctl.wait(60) == 1
        done.set()
        children = await watcher
    assert_all_gone(list(children))
    runs = [r for r in read_jsonl(RunDir(run_dir).metrics) if r.get("event") == "run"]
    assert any("trainer exited" in r["message"] for r in runs)


async def test_restart_instance_command_restarts_and_resyncs(tmp_path):
    run_dir = make_run(tmp_path, "trainer.steps=400")
    async with SpawnedController(run_dir) as ctl:
        async with (
            ControlClient(ctl.endpoints) as control,
            TelemetrySubscriber(ctl.endpoints) as tel,
        ):
            await tel.wait_for(lambda s: s.step >= 2, timeout=90)
            reply = await control.request(RestartInstances(ids=[0]))
            assert not reply.ok and "one process" in reply.reason  # sim: all or a down one
            reply = await control.request(RestartInstances(ids=[0, 1]))
            assert reply.ok, reply.reason
            restarted_at = time.time()
            snap = await tel.wait_for(
                lambda s: all(r.restarts == 1 and r.state == "running" for r in s.instances),
                timeout=30,
            )
            version = snap.weight_version
            await tel.wait_for(lambda s: s.step >= version + 2, timeout=60)
            reply = await control.request(StopRun())
            assert reply.ok
        assert await ctl.wait(60) == 0
    records = read_jsonl(RunDir(run_dir).ledger)
    after = [r for r in records if r.get("event") == "dispatched" and r["time"] > restarted_at]
    assert after, "nothing dispatched after the restart"
    # Weights were synced before any dispatch: nothing went out on the initial weights.
    assert all(r["version"] > 0 for r in after)
    assert verify_ledger(RunDir(run_dir).ledger).ok


def test_cli_errors_exit_2(tmp_path):
    missing = subprocess.run(
        [sys.executable, "-m", "runtime.controller", "--run-dir", str(tmp_path / "nothing")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 2 and "config.yaml" in missing.stderr
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.yaml").write_text("trainer:\n  steps: -3\n")
    result = subprocess.run(
        [sys.executable, "-m", "runtime.controller", "--run-dir", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "trainer.steps" in result.stderr


async def test_no_instance_left_fails_the_run(tmp_path):
    run_dir = make_run(tmp_path, "trainer.steps=400", "rollout.restart.max_restarts=0")
    done = asyncio.Event()
    async with SpawnedController(run_dir) as ctl:
        watcher = asyncio.create_task(watch_children(ctl, done))
        async with TelemetrySubscriber(ctl.endpoints) as tel:
            await tel.wait_for(lambda s: s.step >= 1, timeout=90)
        backend = [p for p in descendants(ctl.pid) if "runtime.sim.backend" in p.cmdline()]
        backend[0].send_signal(signal.SIGKILL)
        assert await ctl.wait(60) == 1
        done.set()
        children = await watcher
    assert_all_gone(list(children))
    runs = [r for r in read_jsonl(RunDir(run_dir).metrics) if r.get("event") == "run"]
    assert any("down for good" in r["message"] for r in runs)
    assert verify_ledger(RunDir(run_dir).ledger).ok


async def test_operator_restart_supersedes_the_backoff(tmp_path):
    run_dir = make_run(tmp_path, "trainer.steps=400", "rollout.restart.backoff_initial_s=20")
    async with SpawnedController(run_dir) as ctl:
        async with (
            ControlClient(ctl.endpoints) as control,
            TelemetrySubscriber(ctl.endpoints) as tel,
        ):
            await tel.wait_for(lambda s: s.step >= 1, timeout=90)
            backend = [p for p in descendants(ctl.pid) if "runtime.sim.backend" in p.cmdline()]
            backend[0].send_signal(signal.SIGKILL)
            snap = await tel.wait_for(
                lambda s: all(r.state == "down" and "restart in" in r.pending for r in s.instances),
                timeout=10,
            )
            reply = await control.request(RestartInstances(ids=[0]))  # a down one is fine
            assert reply.ok, reply.reason
            snap = await tel.wait_for(
                lambda s: all(r.state == "running" for r in s.instances), timeout=15
            )
            assert all(r.restarts == 1 for r in snap.instances)
            step = snap.step
            await tel.wait_for(lambda s: s.step >= step + 2, timeout=60)
            assert await control.request(StopRun())
        assert await ctl.wait(60) == 0
    assert verify_ledger(RunDir(run_dir).ledger).ok
