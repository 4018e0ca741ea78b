"""The ``sim`` backend and the sim trainer.

Two kinds of test:

- In-process: a ``SimInstance`` is driven with explicit clock values (no sockets), and its
  finish times are compared with a per-token reference simulation written here, so the
  event-driven "advance to the next finish" arithmetic is checked exactly.
- Processes: ``python -m runtime.sim.backend`` / ``runtime.sim.trainer`` run against a test
  ROUTER on a free loopback port that **stands in for the controller** (``FakeController``
  below); the test plays the controller's part message by message and checks the protocol.
"""

from __future__ import annotations

import csv
import json
import math
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import psutil
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.config import Config, deep_merge, load_config, validate_config
from runtime.protocol import (
    PROTOCOL_VERSION,
    AbortGroups,
    Batch,
    BatchRequest,
    Completion,
    Encoder,
    FrameGuard,
    Generate,
    GroupAborted,
    GroupDone,
    Heartbeat,
    PauseWorker,
    ResumeWorker,
    Shutdown,
    StepDone,
    TrainerAck,
    TrainerHello,
    TrainGroup,
    UpdateWeights,
    WorkerAck,
    WorkerHello,
)
from runtime.rundir import RunDir
from runtime.scheduler.cost_model import CostModel
from runtime.sim.backend import SimInstance, SimSettings
from runtime.sim.trainer import marker_path, write_marker
from runtime.tasks import build_task
from runtime.tasks.sim_task import SimTask
from runtime.transport import bind_standin

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "runtime" / "tasks" / "data" / "castillo_sample.csv"

BASE_CONFIG: dict[str, Any] = {
    "run": {"name": "simtest"},
    "model": {"path": "sim"},
    "task": {"name": "sim", "num_prompts": 100_000, "sft_steps": 0},
    "rollout": {
        "backend": "sim",
        "instances": 2,
        "max_num_seqs": 16,
        "heartbeat_s": 0.2,
        "sampling": {"n": 4, "max_tokens": 4096},
        "sim": {"lengths": str(SAMPLE), "time_scale": 50.0},
    },
    "trainer": {"backend": "sim"},
}


def sample_rows() -> list[tuple[int, list[int]]]:
    """(prompt_tokens, o1..o10) per row, read straight from the CSV (not through the code
    under test)."""
    with SAMPLE.open(newline="") as handle:
        return [
            (int(r["prompt_tokens"]), [int(r[f"o{k}"]) for k in range(1, 11)])
            for r in csv.DictReader(handle)
        ]


ROWS = sample_rows()


def rows_where(accept: Callable[[list[int]], bool]) -> list[int]:
    return [i for i, (_, lengths) in enumerate(ROWS) if accept(lengths)]


# --- in-process: the simulation arithmetic ---------------------------------------------------

COST = CostModel()


def make_task() -> SimTask:
    return SimTask.from_config(validate_config(BASE_CONFIG))


TASK = make_task()


def make_instance(max_num_seqs: int, time_scale: float = 1.0) -> SimInstance:
    settings_ = SimSettings(
        cost=COST, time_scale=time_scale, heartbeat_s=1.0, task=TASK, clock_offset=0.0
    )
    instance = SimInstance(0, None, max_num_seqs, settings_)
    instance.start(0.0)
    return instance


def generate(group_id: int, row: int, n: int = 10, max_tokens: int = 100_000) -> Generate:
    prompt = TASK.prompts[row]
    return Generate(
        group_id=group_id,
        prompt_id=row,
        prompt_token_ids=TASK.prompt_token_ids(prompt),
        n=n,
        max_tokens=max_tokens,
    )


def reference_finish_times(
    rows: list[int], max_num_seqs: int, n: int = 10
) -> dict[tuple[int, int], float]:
    """A per-token simulation of continuous batching: every decode step one at a time."""
    waiting = [(g, j, ROWS[r][1][j % 10], ROWS[r][0]) for g, r in enumerate(rows) for j in range(n)]
    running: list[list[int]] = []
    started: set[int] = set()
    finish: dict[tuple[int, int], float] = {}
    t = 0.0
    while running or waiting:
        while waiting and len(running) < max_num_seqs:
            g, j, length, prompt = waiting.pop(0)
            running.append([g, j, length, prompt, 0])
            if g not in started:
                started.add(g)
                t += COST.prefill_s(prompt)
        t += COST.decode_step_s(len(running), sum(s[3] + s[4] for s in running))
        for s in running:
            s[4] += 1
        for s in [s for s in running if s[4] >= s[2]]:
            running.remove(s)
            finish[(s[0], s[1])] = t
    return finish


def drive(
    instance: SimInstance,
    until: float = math.inf,
    interrupts: list[float] | None = None,
    events: dict[float, Any] | None = None,
) -> list[Any]:
    """Run the instance's clock forward like its event loop does: to each next event, to each
    interrupt (a wake-up with nothing to do) and to each scheduled message."""
    pending = sorted((interrupts or []) + list(events or {}))
    out: list[Any] = []
    now = 0.0
    while True:
        nxt = instance.next_event(now)
        now = pending.pop(0) if pending and pending[0] <= nxt else nxt
        if now == math.inf or now > until:
            return out
        instance.advance(now)
        if events and now in events:
            instance.handle(events.pop(now), now)
        out += instance.take_output()


def finish_times(messages: list[Any]) -> dict[tuple[int, int], float]:
    return {
        (m.group_id, j): c.finished_at
        for m in messages
        if isinstance(m, GroupDone)
        for j, c in enumerate(m.completions)
    }


@settings(max_examples=25, deadline=None)
@given(
    rows=st.lists(st.integers(0, len(ROWS) - 1), min_size=1, max_size=5),
    max_num_seqs=st.integers(10, 40),
    interrupts=st.lists(st.floats(0.0, 30.0), max_size=60),
)
def test_event_driven_decoding_matches_a_per_token_simulation(
    rows: list[int], max_num_seqs: int, interrupts: list[float]
) -> None:
    instance = make_instance(max_num_seqs)
    for g, row in enumerate(rows):
        instance.handle(generate(g, row), 0.0)
    got = finish_times(drive(instance, interrupts=interrupts))
    want = reference_finish_times(rows, max_num_seqs)
    assert got.keys() == want.keys()
    assert max(abs(got[k] - want[k]) for k in want) < 1e-6


def test_keep_pause_freezes_in_flight_work_for_exactly_the_pause() -> None:
    row = rows_where(lambda lengths: min(lengths) > 300)[0]
    want = reference_finish_times([row], 16)
    first = min(want.values())
    pause_at, resume_at = first / 2, first / 2 + 7.5
    instance = make_instance(16)
    instance.handle(generate(0, row), 0.0)
    out = drive(
        instance,
        interrupts=[pause_at + 1.0, pause_at + 3.0],
        events={pause_at: PauseWorker(mode="keep"), resume_at: ResumeWorker()},
    )
    got = finish_times(out)
    assert max(abs(got[k] - (want[k] + 7.5)) for k in want) < 1e-6
    acks = [(m.request, m.ok) for m in out if isinstance(m, WorkerAck)]
    assert acks == [("pause", True), ("resume", True)]


def test_keep_update_spans_versions_and_boundary_update_does_not(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path).create()
    path1 = str(write_marker(run_dir, 1, {}))
    path2 = str(write_marker(run_dir, 2, {}))
    row_a, row_b = rows_where(lambda lengths: min(lengths) > 200)[:2]
    instance = make_instance(32)
    instance.handle(generate(0, row_a), 0.0)
    end_a = max(reference_finish_times([row_a], 32).values())
    # Boundary: A (in flight) finishes on v0, then the update, then B (sent meanwhile) on v1.
    out = drive(
        instance,
        events={
            1.0: UpdateWeights(version=1, path=path1, mode="boundary"),
            1.5: generate(1, row_b),
        },
        until=1000.0,
    )
    done = {m.group_id: m for m in out if isinstance(m, GroupDone)}
    ack = next(m for m in out if isinstance(m, WorkerAck))
    assert {(c.version_min, c.version_max) for c in done[0].completions} == {(0, 0)}
    assert {(c.version_min, c.version_max) for c in done[1].completions} == {(1, 1)}
    assert (ack.request, ack.ok, ack.weight_version) == ("update_weights", True, 1)
    assert done[0].finished_at == pytest.approx(end_a)
    assert done[1].started_at >= done[0].finished_at + COST.weight_sync_s - 1e-9

    # Keep: C is frozen in flight, loads v2, continues: every sample spans v1..v2.
    instance = make_instance(32)
    instance.version = 1
    instance.handle(generate(2, row_a), 0.0)
    out = drive(instance, events={1.0: UpdateWeights(version=2, path=path2, mode="keep")})
    done = {m.group_id: m for m in out if isinstance(m, GroupDone)}
    assert {(c.version_min, c.version_max) for c in done[2].completions} == {(1, 2)}
    # The load froze decoding for weight_sync_s (give or take the partial step in progress).
    step = COST.decode_step_s(10, 10 * 2000)
    assert done[2].finished_at == pytest.approx(end_a + COST.weight_sync_s, abs=step)


def test_lengths_come_from_the_trace_cycling_from_the_seed_offset() -> None:
    row = rows_where(lambda lengths: len(set(lengths)) == 10 and max(lengths) > 400)[0]
    lengths = ROWS[row][1]
    instance = make_instance(64)
    request = generate(0, row, n=13, max_tokens=400)
    instance.handle(msgspec.structs.replace(request, seed=23), 0.0)
    (done,) = [m for m in drive(instance) if isinstance(m, GroupDone)]
    expected = [lengths[(3 + j) % 10] for j in range(13)]
    assert [len(c.token_ids) for c in done.completions] == [min(x, 400) for x in expected]
    assert [c.finish_reason for c in done.completions] == [
        "length" if x > 400 else "stop" for x in expected
    ]


def test_abort_frees_the_slots_for_queued_work() -> None:
    long_row, short_row = rows_where(lambda lengths: min(lengths) > 1000)[0], 0
    instance = make_instance(10)
    instance.handle(generate(0, long_row), 0.0)
    instance.handle(generate(1, short_row), 0.0)  # queued: the 10 slots are taken
    out = drive(instance, events={0.5: AbortGroups(group_ids=[0, 99])})
    assert [m.group_id for m in out if isinstance(m, GroupAborted)] == [0]
    (done,) = [m for m in out if isinstance(m, GroupDone)]
    assert done.group_id == 1 and done.started_at == pytest.approx(0.5)
    assert instance.running_seqs == 0


# --- processes against a stand-in controller -------------------------------------------------


class FakeController:
    """A ROUTER on a free loopback port standing in for the controller, plus the run dir."""

    def __init__(
        self, root: Path, overrides: dict[str, Any] | None = None, controller_pid: int = 0
    ) -> None:
        self.run_dir = RunDir(root).create()
        self.config: Config = validate_config(deep_merge(BASE_CONFIG, overrides or {}))
        self.run_dir.config.write_text(self.config.to_yaml())
        self.context = zmq.Context()
        self.router = self.context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        bind_standin(self.router, self.run_dir, "simtest", controller_pid)
        self.encoder = Encoder()
        self.guard = FrameGuard("test-router")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, module: str, *args: str) -> subprocess.Popen[bytes]:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, "--run-dir", str(self.run_dir.root), *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            cwd=REPO,
        )
        return self.proc

    def send(self, identity: bytes, message: Any) -> None:
        self.router.send_multipart([identity, *self.encoder.encode(message)])

    def send_raw(self, identity: bytes, frames: list[bytes]) -> None:
        self.router.send_multipart([identity, *frames])

    def recv(self, timeout_s: float = 10.0) -> tuple[bytes, Any]:
        """The next message and who sent it; fails the test on a timeout."""
        if self.router.poll(int(timeout_s * 1000) + 1):
            identity, *frames = self.router.recv_multipart()
            message = self.guard.decode(frames, peer=identity.decode())
            assert message is not None, f"{identity!r} sent an undecodable message"
            return identity, message
        note = ""
        if self.proc is not None and self.proc.poll() is not None:
            stderr = self.proc.stderr.read().decode() if self.proc.stderr else ""
            note = f"; the process exited with {self.proc.returncode}: {stderr[-2000:]}"
        raise AssertionError(f"nothing received in {timeout_s:.1f}s{note}")

    def expect(
        self, accept: Callable[[bytes, Any], bool], timeout_s: float = 10.0
    ) -> tuple[bytes, Any]:
        """The first message that ``accept`` takes (others are dropped)."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            identity, message = self.recv(left)
            if accept(identity, message):
                return identity, message
        raise AssertionError(f"the expected message did not come in {timeout_s}s")

    def collect(self, seconds: float) -> list[tuple[bytes, Any]]:
        """Everything that arrives within ``seconds``."""
        out = []
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if not self.router.poll(int(left * 1000) + 1):
                break
            identity, *frames = self.router.recv_multipart()
            out.append((identity, self.guard.decode(frames, peer=identity.decode())))
        return out

    def hellos(self, count: int, timeout_s: float = 20.0) -> dict[bytes, WorkerHello]:
        seen: dict[bytes, WorkerHello] = {}
        while len(seen) < count:
            identity, message = self.expect(
                lambda _i, m: isinstance(m, WorkerHello), timeout_s=timeout_s
            )
            seen[identity] = message
        return seen

    def log_text(self, process: str) -> str:
        path = self.run_dir.log_file(process)
        return path.read_text() if path.exists() else ""

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if self.proc is not None and self.proc.stderr:
            self.proc.stderr.close()
        self.router.close()
        self.context.term()


@pytest.fixture
def fake(tmp_path: Path):
    controllers: list[FakeController] = []

    def make(overrides: dict[str, Any] | None = None, **kwargs: Any) -> FakeController:
        controller = FakeController(tmp_path / f"run{len(controllers)}", overrides, **kwargs)
        controllers.append(controller)
        return controller

    yield make
    for controller in controllers:
        controller.close()


def pid_gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def is_(kind: type, **fields: Any) -> Callable[[bytes, Any], bool]:
    return lambda _i, m: isinstance(m, kind) and all(getattr(m, k) == v for k, v in fields.items())


def shutdown_all(fake_controller: FakeController, identities: list[bytes]) -> int:
    for identity in identities:
        fake_controller.send(identity, Shutdown(reason="test"))
    assert fake_controller.proc is not None
    return fake_controller.proc.wait(15)


def test_every_instance_says_hello_and_sends_heartbeats(fake) -> None:
    ctl = fake({"rollout": {"instances": [{"max_num_seqs": 8}, {}, {}, {}, {}]}})
    proc = ctl.start("runtime.sim.backend")
    hellos = ctl.hellos(5)
    assert sorted(hellos) == [b"instance-%d" % i for i in range(5)]
    for identity, hello in hellos.items():
        assert identity == b"instance-%d" % hello.instance_id
        assert (hello.backend, hello.pid, hello.weight_version) == ("sim", proc.pid, 0)
        assert hello.max_num_seqs == (8 if hello.instance_id == 0 else 16)
    beats: dict[bytes, list[Heartbeat]] = {}
    for identity, message in ctl.collect(1.5):
        if isinstance(message, Heartbeat):
            beats.setdefault(identity, []).append(message)
    assert sorted(beats) == sorted(hellos)
    for identity, got in beats.items():
        assert len(got) >= 3  # heartbeat_s = 0.2
        assert {(b.state, b.running_seqs, b.tokens_generated) for b in got} == {("running", 0, 0)}
        assert got[0].instance_id == hellos[identity].instance_id
    assert psutil.Process(proc.pid).children(recursive=True) == []
    assert shutdown_all(ctl, list(hellos)) == 0
    assert pid_gone(proc.pid)


def test_generate_returns_a_group_with_the_trace_lengths(fake) -> None:
    ctl = fake({"rollout": {"instances": 2}})
    ctl.start("runtime.sim.backend")
    ctl.hellos(2)
    rows = [0, 17, 600, len(ROWS) - 1]
    task = build_task(ctl.config)
    for g, row in enumerate(rows):
        prompt = task.prompts[row]
        ctl.send(
            b"instance-%d" % (g % 2),
            Generate(
                group_id=100 + g,
                prompt_id=row,
                prompt_token_ids=task.prompt_token_ids(prompt),
                n=10,
                max_tokens=300,
            ),
        )
    done: dict[int, tuple[bytes, GroupDone]] = {}
    while len(done) < len(rows):
        identity, message = ctl.expect(lambda _i, m: isinstance(m, GroupDone), timeout_s=20)
        done[message.group_id] = (identity, message)
    for g, row in enumerate(rows):
        identity, message = done[100 + g]
        assert identity == b"instance-%d" % (g % 2) and message.instance_id == g % 2
        assert message.prompt_id == row
        trace = ROWS[row][1]
        assert [len(c.token_ids) for c in message.completions] == [min(x, 300) for x in trace]
        for c, wanted in zip(message.completions, trace, strict=True):
            assert c.token_ids.dtype == np.int32 and c.logprobs.dtype == np.float32
            assert c.logprobs.shape == c.token_ids.shape
            assert np.all(c.logprobs <= 0) and np.all(np.isfinite(c.logprobs))
            assert c.finish_reason == ("length" if wanted > 300 else "stop")
            assert (c.version_min, c.version_max) == (0, 0)
            assert c.reward in (0.0, 1.0)
            assert message.started_at <= c.finished_at <= message.finished_at
        assert message.finished_at == max(c.finished_at for c in message.completions)
    assert shutdown_all(ctl, [b"instance-0", b"instance-1"]) == 0


def test_pause_freezes_progress_and_resume_continues(fake) -> None:
    ctl = fake({"rollout": {"instances": 1, "sim": {"time_scale": 2.0}}})
    ctl.start("runtime.sim.backend")
    ctl.hellos(1)
    who = b"instance-0"
    row = rows_where(lambda lengths: min(lengths) > 700 and max(lengths) < 3000)[0]
    prompt = build_task(ctl.config).prompts[row]
    ctl.send(
        who,
        Generate(
            group_id=7,
            prompt_id=row,
            prompt_token_ids=np.arange(prompt.meta["prompt_tokens"], dtype=np.int32),
            n=4,
            max_tokens=4096,
        ),
    )
    ctl.expect(lambda _i, m: isinstance(m, Heartbeat) and m.tokens_generated > 0)
    ctl.send(who, PauseWorker(mode="keep"))
    ctl.expect(is_(WorkerAck, request="pause", ok=True))
    paused_at = time.time()
    during = [m for _i, m in ctl.collect(1.2)]
    beats = [m for m in during if isinstance(m, Heartbeat)]
    assert len(beats) >= 3
    assert {b.state for b in beats} == {"paused"}
    assert {b.running_seqs for b in beats} == {4}
    assert len({b.tokens_generated for b in beats}) == 1  # frozen
    frozen_tokens = beats[0].tokens_generated
    assert not any(isinstance(m, GroupDone) for m in during)
    ctl.send(who, ResumeWorker())
    resumed_at = time.time()
    ctl.expect(is_(WorkerAck, request="resume", ok=True))
    _, beat = ctl.expect(
        lambda _i, m: isinstance(m, Heartbeat) and m.tokens_generated > frozen_tokens
    )
    assert beat.state == "running"
    _, done = ctl.expect(lambda _i, m: isinstance(m, GroupDone), timeout_s=30)
    assert [len(c.token_ids) for c in done.completions] == ROWS[row][1][:4]
    # The paused time was not generation time: the group took at least that much longer.
    assert done.finished_at - done.started_at >= resumed_at - paused_at
    assert shutdown_all(ctl, [who]) == 0


def test_update_weights_bumps_versions_over_the_wire(fake) -> None:
    ctl = fake({"rollout": {"instances": 1, "sim": {"time_scale": 2.0}}})
    ctl.start("runtime.sim.backend")
    ctl.hellos(1)
    who = b"instance-0"
    task = build_task(ctl.config)
    row = rows_where(lambda lengths: min(lengths) > 800 and max(lengths) < 3000)[0]

    def group(group_id: int) -> Generate:
        prompt = task.prompts[row]
        return Generate(
            group_id=group_id,
            prompt_id=row,
            prompt_token_ids=task.prompt_token_ids(prompt),
            n=3,
            max_tokens=4096,
        )

    # keep: in flight across the update, so the samples span v0..v1.
    ctl.send(who, group(1))
    ctl.expect(lambda _i, m: isinstance(m, Heartbeat) and m.running_seqs == 3)
    path1 = write_marker(ctl.run_dir, 1, {})
    ctl.send(who, UpdateWeights(version=1, path=str(path1), mode="keep"))
    _, ack = ctl.expect(lambda _i, m: isinstance(m, (WorkerAck, GroupDone)))
    assert isinstance(ack, WorkerAck), "the group finished before the keep update applied"
    assert (ack.request, ack.ok, ack.weight_version) == ("update_weights", True, 1)
    _, done = ctl.expect(lambda _i, m: isinstance(m, GroupDone), timeout_s=30)
    assert {(c.version_min, c.version_max) for c in done.completions} == {(0, 1)}
    _, beat = ctl.expect(lambda _i, m: isinstance(m, Heartbeat))
    assert beat.weight_version == 1

    # boundary: the group in flight finishes on v1 before v2 is loaded.
    ctl.send(who, group(2))
    ctl.expect(lambda _i, m: isinstance(m, Heartbeat) and m.running_seqs == 3)
    path2 = write_marker(ctl.run_dir, 2, {})
    ctl.send(who, UpdateWeights(version=2, path=str(path2), mode="boundary"))
    _, first = ctl.expect(lambda _i, m: isinstance(m, (WorkerAck, GroupDone)), timeout_s=30)
    assert isinstance(first, GroupDone)
    assert {(c.version_min, c.version_max) for c in first.completions} == {(1, 1)}
    _, ack = ctl.expect(is_(WorkerAck, request="update_weights"))
    assert (ack.ok, ack.weight_version) == (True, 2)

    # A missing file is refused and the version stays.
    ctl.send(who, UpdateWeights(version=3, path=str(marker_path(ctl.run_dir, 3))))
    _, ack = ctl.expect(is_(WorkerAck, request="update_weights"))
    assert not ack.ok and "do not exist" in ack.detail and ack.weight_version == 2
    # So is a marker that holds another version.
    ctl.send(who, UpdateWeights(version=4, path=str(path2)))
    _, ack = ctl.expect(is_(WorkerAck, request="update_weights"))
    assert not ack.ok and "holds version 2" in ack.detail
    assert shutdown_all(ctl, [who]) == 0


def test_abort_groups_answers_group_aborted(fake) -> None:
    ctl = fake({"rollout": {"instances": 1, "sim": {"time_scale": 1.0}}})
    ctl.start("runtime.sim.backend")
    ctl.hellos(1)
    who = b"instance-0"
    row = rows_where(lambda lengths: min(lengths) > 700)[0]
    ctl.send(who, generate(5, row, n=4))
    ctl.expect(lambda _i, m: isinstance(m, Heartbeat) and m.running_seqs == 4)
    ctl.send(who, AbortGroups(group_ids=[5]))
    _, aborted = ctl.expect(lambda _i, m: isinstance(m, (GroupAborted, GroupDone)))
    assert isinstance(aborted, GroupAborted) and aborted.group_id == 5
    ctl.expect(is_(WorkerAck, request="abort", ok=True))
    _, beat = ctl.expect(lambda _i, m: isinstance(m, Heartbeat))
    assert beat.running_seqs == 0
    assert shutdown_all(ctl, [who]) == 0


def test_garbage_frames_are_counted_and_ignored(fake) -> None:
    ctl = fake({"rollout": {"instances": 1}})
    ctl.start("runtime.sim.backend")
    ctl.hellos(1)
    who = b"instance-0"
    garbage = [
        [b"not msgpack at all \xff\xfe"],
        [msgspec.msgpack.encode((PROTOCOL_VERSION + 7, {"type": "Shutdown"}))],
        [msgspec.msgpack.encode((PROTOCOL_VERSION, {"type": "NoSuchMessage"}))],
        [msgspec.msgpack.encode((PROTOCOL_VERSION, {"type": "Generate", "group_id": "x"}))],
    ]
    for frames in garbage:
        ctl.send_raw(who, frames)
    ctl.send(who, generate(1, 0, n=2))
    _, done = ctl.expect(lambda _i, m: isinstance(m, GroupDone))
    assert [len(c.token_ids) for c in done.completions] == ROWS[0][1][:2]
    assert shutdown_all(ctl, [who]) == 0
    text = ctl.log_text("sim-backend")
    assert text.count("rejected frame on rollout[instance-0] socket") == len(garbage)
    assert f"{len(garbage)} rejected frame(s)" in text


def test_sigterm_and_a_dead_controller_both_end_the_process(fake) -> None:
    ctl = fake({"rollout": {"instances": 3}})
    proc = ctl.start("runtime.sim.backend")
    ctl.hellos(3)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0

    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ctl = fake({"rollout": {"instances": 3}}, controller_pid=stand_in.pid)
        proc = ctl.start("runtime.sim.backend")
        ctl.hellos(3)
        stand_in.kill()
        stand_in.wait(5)
        assert proc.wait(15) == 0
        assert f"controller (pid {stand_in.pid}) is gone" in ctl.log_text("sim-backend")
    finally:
        if stand_in.poll() is None:
            stand_in.kill()
            stand_in.wait(5)


def test_one_instance_can_be_hosted_alone(fake) -> None:
    ctl = fake({"rollout": {"instances": 4}})
    ctl.start("runtime.sim.backend", "--instance-id", "2")
    (identity,) = ctl.hellos(1)
    assert identity == b"instance-2"
    assert not [m for _i, m in ctl.collect(0.5) if isinstance(m, WorkerHello)]
    assert shutdown_all(ctl, [identity]) == 0


def test_bad_input_exits_2_naming_the_problem(fake, tmp_path: Path) -> None:
    ctl = fake({"rollout": {"instances": 4}})
    proc = ctl.start("runtime.sim.backend", "--instance-id", "4")
    assert proc.wait(20) == 2
    assert "--instance-id 4 is out of range" in proc.stderr.read().decode()

    ctl = fake({"rollout": {"sim": {"lengths": str(tmp_path / "missing.csv")}}})
    proc = ctl.start("runtime.sim.backend")
    assert proc.wait(20) == 2
    assert "rollout.sim.lengths" in proc.stderr.read().decode()

    pmf = tmp_path / "pmf.csv"
    pmf.write_text("output_tokens,prob\n10,0.5\n20,0.5\n")
    ctl = fake({"rollout": {"sim": {"lengths": str(pmf)}}})
    proc = ctl.start("runtime.sim.backend")
    assert proc.wait(20) == 2
    assert "is a PMF" in proc.stderr.read().decode()

    proc = subprocess.run(
        [sys.executable, "-m", "runtime.sim.backend", "--run-dir", str(tmp_path / "nowhere")],
        capture_output=True,
        cwd=REPO,
        timeout=30,
    )
    assert proc.returncode == 2 and b"no such file" in proc.stderr


# --- the sim trainer ---------------------------------------------------------------------------


def completion(length: int, reward: float, logprob: float = -0.5) -> Completion:
    return Completion(
        token_ids=np.full(length, 5, dtype=np.int32),
        logprobs=np.full(length, logprob, dtype=np.float32),
        version_min=0,
        version_max=0,
        finish_reason="stop",
        reward=reward,
        finished_at=time.time(),
    )


def test_sim_trainer_steps_and_computes_its_metrics_from_the_batch(fake) -> None:
    ctl = fake({"trainer": {"keep_weight_versions": 2}, "rollout": {"sim": {"time_scale": 100.0}}})
    proc = ctl.start("runtime.sim.trainer")
    identity, hello = ctl.recv(20)
    assert identity == b"trainer" and isinstance(hello, TrainerHello)
    assert (hello.weight_version, hello.pid) == (0, proc.pid)
    ctl.recv()  # BatchRequest(0)
    # Group 0: rewards 1, 0 on 10 and 30 tokens; group 1: all equal (no signal).
    batch = Batch(
        version=0,
        groups=[
            TrainGroup(
                group_id=1,
                prompt_id=0,
                prompt_token_ids=np.arange(6, dtype=np.int32),
                completions=[completion(10, 1.0, -1.0), completion(30, 0.0, -0.5)],
            ),
            TrainGroup(
                group_id=2,
                prompt_id=1,
                prompt_token_ids=np.arange(4, dtype=np.int32),
                completions=[completion(20, 1.0, -0.25), completion(20, 1.0, -0.25)],
            ),
        ],
    )
    for version in range(3):
        ctl.send(b"trainer", msgspec.structs.replace(batch, version=version))
        _, done = ctl.expect(lambda _i, m: isinstance(m, StepDone), timeout_s=20)
        assert done.version == version + 1
        marker = json.loads(Path(done.weights_path).read_text())
        assert (
            marker["version"] == version + 1
            and Path(done.weights_path).parent == ctl.run_dir.weights
        )
        ctl.send(b"trainer", TrainerAck())
        _, request = ctl.expect(lambda _i, m: isinstance(m, BatchRequest))
        assert request.version == version + 1
    metrics = done.metrics
    # A = +-1/sqrt(2) in group 0 (unbiased std of {1, 0}), 0 in group 1; token-level mean.
    a = 0.5 / math.sqrt(0.5)
    assert metrics.loss == pytest.approx(-(10 * a - 30 * a) / 80, rel=1e-5)
    assert metrics.reward_mean == pytest.approx(0.75)
    assert metrics.reward_std == pytest.approx(math.sqrt(0.1875))
    assert metrics.entropy == pytest.approx((10 * 1.0 + 30 * 0.5 + 40 * 0.25) / 80)
    assert (metrics.tokens, metrics.samples) == (80, 4)
    assert metrics.response_length_mean == pytest.approx(20.0)
    # Old markers are pruned to keep_weight_versions.
    assert sorted(p.name for p in ctl.run_dir.weights.iterdir()) == [
        "v000002.sim.json",
        "v000003.sim.json",
    ]
    ctl.send_raw(b"trainer", [b"garbage"])
    ctl.send(b"trainer", Shutdown(reason="test"))
    assert proc.wait(10) == 0
    assert "rejected frame on trainer socket" in ctl.log_text("trainer")

    # A restarted sim trainer resumes at the version it reached.
    proc = ctl.start("runtime.sim.trainer")
    _, hello = ctl.expect(lambda _i, m: isinstance(m, TrainerHello), timeout_s=20)
    assert hello.weight_version == 3
    ctl.send(b"trainer", Shutdown())
    assert proc.wait(10) == 0


# --- configs -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["sim-8", "sim-64"])
def test_sim_configs_validate_and_use_the_sim_backends(name: str) -> None:
    config = load_config(REPO / "configs" / f"{name}.yaml")
    assert (config.rollout.backend, config.trainer.backend, config.task.name) == (
        "sim",
        "sim",
        "sim",
    )
    assert config.num_instances == int(name.split("-")[1])
    assert config.telemetry.hz == 10
    task = build_task(config)
    with open(task.source, newline="") as handle:
        trace_rows = sum(1 for _ in csv.DictReader(handle))
    assert len(task.prompts) == min(config.task.num_prompts, trace_rows)
    assert all(len(p.meta["trace_lengths"]) == 10 for p in task.prompts)


# --- the sim task --------------------------------------------------------------------------------


def test_trace_choice_prefers_rollout_sim_lengths_and_falls_back_to_the_sample(
    tmp_path: Path,
) -> None:
    seqsched = tmp_path / "seqsched.csv"
    seqsched.write_text(
        "split,prompt_id,ref_answer_tokens,out_t0.0,out_t0.3,out_t0.5,out_t0.7\n"
        "train,5,160,115,142,277,220\ntrain,7,49,83,120,101,86\n"
    )
    both = {
        "task": {"name": "sim", "lengths_trace": str(SAMPLE)},
        "rollout": {"backend": "sim"},
        "trainer": {"backend": "sim"},
    }
    task = build_task(
        validate_config(deep_merge(both, {"rollout": {"sim": {"lengths": str(seqsched)}}}))
    )
    assert [p.meta["trace_lengths"] for p in task.prompts] == [
        [115, 142, 277, 220],
        [83, 120, 101, 86],
    ]
    assert task.prompts[1].meta["trace_row"] == 1
    task = build_task(validate_config(both))
    assert len(task.prompts) == 256 and task.source == str(SAMPLE)
    builtin = {
        "task": {"name": "sim", "num_prompts": 5000},
        "rollout": {"backend": "sim", "sim": {"lengths": "builtin:castillo-sample"}},
        "trainer": {"backend": "sim"},
    }
    task = build_task(validate_config(builtin))
    assert [p.meta["trace_lengths"] for p in task.prompts] == [lengths for _, lengths in ROWS]
    assert [p.meta["prompt_tokens"] for p in task.prompts] == [tokens for tokens, _ in ROWS]
    ids = task.prompt_token_ids(task.prompts[3])
    assert ids.dtype == np.int32 and len(ids) == ROWS[3][0]


def test_fewer_prompts_than_rows_are_spread_over_the_whole_trace() -> None:
    config = validate_config(deep_merge(BASE_CONFIG, {"task": {"num_prompts": 12}}))
    rows = [p.meta["trace_row"] for p in build_task(config).prompts]
    assert rows == [k * len(ROWS) // 12 for k in range(12)]
    assert [p.prompt_id for p in build_task(config).prompts] == list(range(12))


def test_rewards_are_deterministic_binary_and_rise_with_the_weight_version() -> None:
    from runtime.tasks.sim_task import sim_reward

    def mean_reward(version: int) -> float:
        draws = [
            sim_reward(row, 1000 + row, j, version, False) for row in range(1000) for j in range(8)
        ]
        return sum(draws) / len(draws)

    early, late = mean_reward(0), mean_reward(300)
    assert 0.15 < early < 0.45 and late > early + 0.25
    assert sim_reward(3, 4, 5, 6, False) == sim_reward(3, 4, 5, 6, False)
    assert sim_reward(3, 4, 5, 300, True) == 0.0  # truncated answers score nothing
    assert TASK.reward(TASK.prompts[0], "some text") in (0.0, 1.0)
