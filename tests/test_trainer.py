"""The trainer end to end: GRPO moves the policy, checkpoints resume exactly, and the real trainer
process (1 and 2 ranks) speaks the protocol to a test ROUTER that stands in for the controller."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zmq

from runtime.config import Config, TinyModelConfig
from runtime.protocol import (
    Batch,
    BatchRequest,
    Completion,
    Decoder,
    Encoder,
    Shutdown,
    StepDone,
    TrainerAck,
    TrainerHello,
    TrainGroup,
)
from runtime.rundir import RunDir, read_jsonl
from runtime.tasks.tiny_model import build_tiny_model
from runtime.trainer import trainer_command
from runtime.trainer.batching import balance_partitions, samples_from_batch
from runtime.trainer.loop import CHECKSUM_ENV
from runtime.trainer.synthetic import random_batch
from runtime.trainer.train import Trainer, checkpoint_dirs
from runtime.trainer.weights import checksum, load_weights
from runtime.transport import bind_standin

REPO = Path(__file__).resolve().parents[1]
VOCAB = 100  # the tiny model's character vocabulary


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), TinyModelConfig(), seed=0)


def _config(model_dir: Path, run_dir: Path, **trainer: object) -> Config:
    return Config.model_validate(
        {
            "run": {"run_dir": str(run_dir)},
            "model": {"path": str(model_dir)},
            "trainer": {"micro_batch_size": 8, **trainer},
        }
    )


def _group(prompt: list[int], completions: list[tuple[list[int], float]]) -> TrainGroup:
    return TrainGroup(
        group_id=0,
        prompt_id=0,
        prompt_token_ids=np.array(prompt, dtype=np.int32),
        completions=[
            Completion(
                token_ids=np.array(tokens, dtype=np.int32),
                logprobs=np.zeros(len(tokens), dtype=np.float32),
                version_min=0,
                version_max=0,
                finish_reason="stop",
                reward=reward,
                finished_at=0.0,
            )
            for tokens, reward in completions
        ],
    )


def _with_behaviour(trainer: Trainer, batch: Batch) -> Batch:
    """The batch with the trainer's current log-probs as behaviour log-probs (on-policy)."""
    samples, _ = samples_from_batch(batch, trainer.vocab_size)
    logprobs = iter(trainer.completion_logprobs(samples))
    for group in batch.groups:
        for completion in group.completions:
            completion.logprobs = next(logprobs)
    return batch


def test_grpo_steps_raise_the_logprob_of_rewarded_completions(
    model_dir: Path, tmp_path: Path
) -> None:
    config = _config(model_dir, tmp_path, lr=1e-3)
    trainer = Trainer(config, RunDir(tmp_path).create(), str(model_dir))
    good, bad = [40, 41, 42, 43, 44], [60, 61, 62, 63, 64]
    batch = Batch(version=0, groups=[_group([1, 20, 21, 22], [(good, 1.0), (bad, 0.0)] * 2)])
    samples, _ = samples_from_batch(batch, VOCAB)

    def seq_logp() -> tuple[float, float]:
        per_token = trainer.completion_logprobs(samples[:2])
        return float(per_token[0].sum()), float(per_token[1].sum())

    start = seq_logp()
    history = [start]
    stale = _with_behaviour(trainer, batch)  # behaviour stays at version 0: increasingly stale
    for step in range(4):
        result = trainer.step(stale)
        assert result.metrics.samples == 4 and result.metrics.tokens == 20
        assert result.metrics.reward_mean == pytest.approx(0.5)
        assert np.isfinite(result.metrics.loss) and result.metrics.grad_norm > 0
        history.append(seq_logp())
        assert trainer.version == step + 1
    good_logp, bad_logp = zip(*history, strict=True)
    assert all(b > a for a, b in itertools.pairwise(good_logp)), good_logp
    assert all(b < a for a, b in itertools.pairwise(bad_logp)), bad_logp
    assert good_logp[-1] - good_logp[0] > 0.5 and bad_logp[0] - bad_logp[-1] > 0.5


def test_equal_rewards_leave_the_policy_unchanged(model_dir: Path, tmp_path: Path) -> None:
    trainer = Trainer(_config(model_dir, tmp_path), RunDir(tmp_path).create(), str(model_dir))
    before = trainer.local_checksum()
    batch = Batch(version=0, groups=[_group([1, 20], [([40, 41], 1.0), ([50, 51], 1.0)])])
    result = trainer.step(_with_behaviour(trainer, batch))
    assert result.metrics.grad_norm == 0.0 and result.metrics.loss == 0.0
    assert trainer.local_checksum() == before


def test_stale_behaviour_logprobs_are_corrected_and_reported(
    model_dir: Path, tmp_path: Path
) -> None:
    """Random behaviour log-probs are far from the policy's: the decoupled objective truncates
    their importance weights, the coupled one clips its ratio instead."""
    batch = random_batch(np.random.default_rng(3), groups=2, samples=4, vocab_size=VOCAB)
    decoupled = Trainer(_config(model_dir, tmp_path), RunDir(tmp_path).create(), str(model_dir))
    metrics = decoupled.step(batch).metrics
    assert 0 < metrics.importance_clip_fraction < 1
    assert metrics.clip_fraction == 0.0  # one update per batch: the ratio to pi_prox is 1
    assert metrics.entropy > 0
    config = _config(model_dir, tmp_path)
    config.trainer.loss.decoupled = False
    coupled = Trainer(config, RunDir(tmp_path), str(model_dir))
    metrics = coupled.step(batch).metrics
    assert 0 < metrics.clip_fraction < 1
    assert metrics.importance_clip_fraction == 0.0


def test_checkpoint_resume_restores_weights_and_optimizer(model_dir: Path, tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path).create()
    config = _config(model_dir, tmp_path)
    rng = np.random.default_rng(0)
    batches = [
        random_batch(rng, version=v, groups=2, samples=4, vocab_size=VOCAB) for v in range(3)
    ]
    first = Trainer(config, run_dir, str(model_dir))
    for batch in batches[:2]:
        first.step(batch)
    saved = first.save_checkpoint()
    assert saved.name == "step-000002" and checkpoint_dirs(run_dir) == [saved]
    second = Trainer(config, run_dir, str(model_dir))
    assert second.local_checksum() != first.local_checksum()
    assert second.load_latest_checkpoint() == saved
    assert second.version == 2
    assert second.local_checksum() == first.local_checksum()
    # Adam's moments came back too: the next step is the same from both
    first.step(batches[2])
    second.step(batches[2])
    assert second.local_checksum() == first.local_checksum()


def test_trainer_command_picks_the_launcher() -> None:
    config = Config()
    assert trainer_command(config, "runs/x") == [
        sys.executable, "-m", "runtime.trainer", "--run-dir", "runs/x"
    ]  # fmt: skip
    config.trainer.num_processes = 2
    assert trainer_command(config, "runs/x") == [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "runtime.trainer", "--run-dir", "runs/x",
    ]  # fmt: skip
    config.trainer.backend = "sim"
    assert trainer_command(config, "runs/x")[1:3] == ["-m", "runtime.sim.trainer"]


# --- the real process, against a ROUTER that stands in for the controller ---------------------


class ControllerStandIn:
    """The controller's trainer ROUTER and nothing else: the test plays the controller's part."""

    def __init__(self, run_dir: RunDir) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        bind_standin(self.socket, run_dir, "test")
        self.encoder = Encoder()
        self.decoder = Decoder()

    def receive(self, timeout_s: float = 180.0) -> object:
        assert self.socket.poll(int(timeout_s * 1000)), "no message from the trainer in time"
        identity, *frames = self.socket.recv_multipart()
        assert identity == b"trainer"
        return self.decoder.decode(frames)

    def send(self, message: object) -> None:
        self.socket.send_multipart([b"trainer", *self.encoder.encode(message)])

    def send_garbage(self) -> None:
        self.socket.send_multipart([b"trainer", b"\x93not msgpack at all"])

    def close(self) -> None:
        self.socket.close()
        self.context.term()


def _start(config: Config, run_dir: RunDir) -> subprocess.Popen[bytes]:
    run_dir.create()
    run_dir.config.write_text(config.to_yaml())
    env = {**os.environ, CHECKSUM_ENV: "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        trainer_command(config, run_dir.root),
        cwd=REPO,
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _serve_steps(controller: ControllerStandIn, batches: list[Batch]) -> list[StepDone]:
    done = []
    for batch in batches:
        request = controller.receive()
        assert isinstance(request, BatchRequest) and request.version == batch.version
        controller.send(batch)
        step = controller.receive()
        assert isinstance(step, StepDone) and step.version == batch.version + 1
        done.append(step)
        controller.send(TrainerAck())
    return done


@pytest.mark.slow
def test_trainer_process_steps_checkpoints_and_resumes(model_dir: Path, tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path / "run")
    config = _config(model_dir, run_dir.root, keep_weight_versions=1)
    controller = ControllerStandIn(run_dir.create())
    rng = np.random.default_rng(0)
    process = _start(config, run_dir)
    try:
        hello = controller.receive()
        assert isinstance(hello, TrainerHello)
        assert (hello.num_processes, hello.weight_version) == (1, 0)
        controller.send_garbage()  # counted and ignored; the trainer keeps going
        batch = random_batch(rng, version=0, groups=4, samples=4, vocab_size=VOCAB)
        (step,) = _serve_steps(controller, [batch])
        assert step.weights_path == str(run_dir.weights_file(1).resolve())
        assert step.metrics.samples == 16 and step.metrics.tokens > 0 and step.metrics.step_s > 0
        published = load_weights(step.weights_path)
        assert "model.layers.0.mlp.gate_proj.weight" in published
        assert isinstance(controller.receive(), BatchRequest)
        controller.send(Shutdown(reason="test"))
        assert process.wait(timeout=120) == 0, process.stderr.read().decode()
        assert [p.name for p in checkpoint_dirs(run_dir)] == ["step-000001"]
        log = run_dir.log_file("trainer").read_text()
        assert "rejected frame on trainer socket" in log and "shutting down at version 1" in log

        # a restart resumes at the checkpointed version; SIGTERM ends it with a final checkpoint
        process = _start(config, run_dir)
        hello = controller.receive()
        assert isinstance(hello, TrainerHello) and hello.weight_version == 1
        (step,) = _serve_steps(controller, [random_batch(rng, version=1, vocab_size=VOCAB)])
        assert isinstance(controller.receive(), BatchRequest)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=120) == 0, process.stderr.read().decode()
        assert [p.name for p in checkpoint_dirs(run_dir)] == ["step-000001", "step-000002"]
        assert sorted(p.name for p in run_dir.weights.glob("*.safetensors")) == [
            "v000002.safetensors"
        ]  # keep_weight_versions=1 pruned v1
    finally:
        _stop(process)
        controller.close()


@pytest.mark.slow
def test_two_rank_trainer_ends_each_step_with_identical_weights(
    model_dir: Path, tmp_path: Path
) -> None:
    """torchrun with 2 gloo ranks. Each rank trains on a different half of the batch (checked),
    so the ranks can only agree if DDP synchronised their gradients."""
    run_dir = RunDir(tmp_path / "run")
    config = _config(model_dir, run_dir.root, num_processes=2, micro_batch_size=4)
    controller = ControllerStandIn(run_dir.create())
    rng = np.random.default_rng(1)
    batches = [random_batch(rng, version=v, groups=4, samples=4, vocab_size=VOCAB) for v in (0, 1)]
    # one sample for two ranks: rank 1 has nothing to train on and must still join the all-reduce
    batches.append(random_batch(rng, version=2, groups=1, samples=1, vocab_size=VOCAB))
    process = _start(config, run_dir)
    try:
        hello = controller.receive()
        assert isinstance(hello, TrainerHello) and hello.num_processes == 2
        steps = _serve_steps(controller, batches)
        assert isinstance(controller.receive(), BatchRequest)
        controller.send(Shutdown(reason="test"))
        assert process.wait(timeout=180) == 0, process.stderr.read().decode()
    finally:
        _stop(process)
        controller.close()

    ranks = [read_jsonl(run_dir.state / f"trainer-checksums-rank{r}.jsonl") for r in (0, 1)]
    assert [r["version"] for r in ranks[0]] == [r["version"] for r in ranks[1]] == [1, 2, 3]
    for batch, rank0, rank1 in zip(batches, *ranks, strict=True):
        samples, _ = samples_from_batch(batch, VOCAB)
        shares = balance_partitions([s.length for s in samples], 2)
        assert [rank0["samples"], rank1["samples"]] == [len(p) for p in shares]
        assert rank0["sha256"] == rank1["sha256"]
    assert all(r["samples"] > 0 for r in ranks[0] + ranks[1][:2]) and ranks[1][2]["samples"] == 0
    assert ranks[0][0]["sha256"] != ranks[0][1]["sha256"]  # the weights did move
    # what was published is what the ranks hold (float32 model, float32 file)
    assert checksum(load_weights(steps[-1].weights_path)) == ranks[0][-1]["sha256"]
    assert (
        json.loads((checkpoint_dirs(run_dir)[-1] / "trainer_state.json").read_text())["version"]
        == 3
    )
    assert run_dir.log_file("trainer-rank1").is_file()
