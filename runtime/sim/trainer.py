"""The ``sim`` trainer: the real trainer protocol, no model, simulated step time.

``python -m runtime.sim.trainer --run-dir D`` connects to the controller's trainer ROUTER as
``b"trainer"`` and runs the same loop as :mod:`runtime.trainer.loop`::

    -> TrainerHello(num_processes, weight_version, pid)
    loop:
      -> BatchRequest(version)
      <- Batch(version, groups) | Shutdown
      (sleep the simulated step; write the weight marker of version + 1)
      -> StepDone(version + 1, weights_path, metrics)
      <- TrainerAck | Shutdown

**Step time.** ``rollout.sim.trainer_step_s`` if set, else ``CostModel.trainer_step_s(tokens)``
for the batch's prompt + response tokens, in simulated seconds; ``rollout.sim.time_scale`` of
them pass per wall second.

**Weights.** There are no weights. ``StepDone.weights_path`` points at a small JSON *marker*,
``RunDir.weights / "v<version:06d>.sim.json"`` (``{"format": "asp-tui-sim-weights", "version":
v, ...}``), written atomically; sim instances "load" it by checking that it names the version
they were told to load (:func:`runtime.sim.backend.check_weights`). Old markers are pruned to
``trainer.keep_weight_versions``. The version reached is also the checkpoint
(``RunDir.checkpoints / "sim-trainer.json"``, written after every step), so a restarted sim
trainer resumes where it stopped.

**Metrics** are computed from the batch, never made up: the reward mean and std of its samples;
``loss``, the value of the GRPO surrogate at the behaviour policy (ratio 1), i.e. with
group-normalised advantages A_i (:func:`runtime.trainer.advantages.group_advantages`, the
real trainer's) and token aggregation ``-sum_i L_i A_i / sum_i L_i`` (``sequence``:
``-mean_i A_i``); ``entropy``, the mean negative behaviour log-prob per token (an unbiased
estimate of the sampling entropy); tokens, samples and the mean response length. KL, clip
fractions and grad norm need a model and stay 0.

:class:`TrainerModel` is the step itself, sans-IO (a ``Batch`` in; the metrics and the
simulated step time out), shared with the simulator; :class:`SimTrainer` is its process.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from runtime.auth import Role
from runtime.config import Config, ConfigError, LossConfig, read_run_config
from runtime.logs import setup_logging
from runtime.protocol import (
    Batch,
    BatchRequest,
    Encoder,
    FrameGuard,
    Shutdown,
    StepDone,
    StepMetrics,
    TrainerAck,
    TrainerHello,
)
from runtime.rundir import RunDir, atomic_write_bytes
from runtime.scheduler.cost_model import CostModel
from runtime.sim.backend import SIM_WEIGHTS_FORMAT, controller_alive
from runtime.trainer.advantages import group_advantages
from runtime.transport import connect

log = logging.getLogger("runtime.sim.trainer")

_TICK_S = 1.0
"""Longest single wait (wall seconds), so signals and a dead controller are noticed."""
_MARKER_RE = re.compile(r"^v(\d+)\.sim\.json$")
CHECKPOINT_NAME = "sim-trainer.json"


def marker_path(run_dir: RunDir, version: int) -> Path:
    return run_dir.weights / f"v{version:06d}.sim.json"


def write_marker(run_dir: RunDir, version: int, info: dict[str, Any]) -> Path:
    path = marker_path(run_dir, version)
    record = {"format": SIM_WEIGHTS_FORMAT, "version": version, "created_at": time.time(), **info}
    atomic_write_bytes(path, json.dumps(record, sort_keys=True).encode())
    return path


def prune_markers(run_dir: RunDir, keep: int) -> None:
    """Keep the ``keep`` newest markers."""
    found = sorted(
        (int(m.group(1)), p)
        for p in run_dir.weights.glob("v*.sim.json")
        if (m := _MARKER_RE.match(p.name))
    )
    for _, path in found[:-keep] if keep > 0 else []:
        path.unlink(missing_ok=True)


def resumed_version(run_dir: RunDir) -> int:
    try:
        return int(json.loads((run_dir.checkpoints / CHECKPOINT_NAME).read_text())["version"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def batch_metrics(batch: Batch, loss: LossConfig) -> tuple[StepMetrics, int]:
    """The step's metrics and the tokens (prompt + response) the step time is charged for."""
    rewards: list[float] = []
    index: list[int] = []
    lengths: list[int] = []
    logprob_sum = 0.0
    prompt_tokens = 0
    add = np.add.reduce  # np.sum's dispatch costs as much as the sum of a short row
    for k, group in enumerate(batch.groups):
        completions = group.completions
        rewards.extend(c.reward for c in completions)
        index.extend([k] * len(completions))
        lengths.extend(len(c.token_ids) for c in completions)
        logprob_sum += sum(float(add(c.logprobs, dtype=np.float64)) for c in completions)
        prompt_tokens += len(completions) * len(group.prompt_token_ids)
    if not rewards:
        return StepMetrics(loss=0.0, reward_mean=0.0), 0
    r = np.asarray(rewards, dtype=np.float64)
    length = np.asarray(lengths, dtype=np.float64)
    advantages = group_advantages(r, np.asarray(index), loss.scale_rewards)
    tokens = int(length.sum())
    if loss.aggregation == "token":
        value = -float(np.sum(length * advantages)) / max(tokens, 1)
    else:
        value = -float(np.mean(advantages[length > 0])) if np.any(length > 0) else 0.0
    metrics = StepMetrics(
        loss=value,
        reward_mean=float(r.mean()),
        reward_std=float(r.std()),
        entropy=-logprob_sum / max(tokens, 1),
        tokens=tokens,
        samples=len(rewards),
        response_length_mean=float(length.mean()),
    )
    return metrics, tokens + prompt_tokens


class TrainerModel:
    """The sim trainer's step without a process: ``step(batch)`` returns the batch's metrics
    and the simulated step time; ``step_done`` then moves to the next weight version."""

    def __init__(self, cost: CostModel, loss: LossConfig, version: int = 0) -> None:
        self.cost = cost
        """Its ``trainer_step_s`` is the step time (``CostModel.simulated``: with the config's fixed
        step, when it has one)."""
        self.loss = loss
        self.version = version

    def step(self, batch: Batch) -> tuple[StepMetrics, float]:
        """Train on ``batch``: (metrics, simulated seconds). ``metrics.step_s`` is the simulated
        time (a process overwrites it with its own)."""
        if batch.version != self.version:
            log.warning(
                "batch is for version %d, trainer is at %d; training on it anyway",
                batch.version,
                self.version,
            )
        metrics, tokens = batch_metrics(batch, self.loss)
        seconds = self.cost.trainer_step_s(tokens)
        metrics.step_s = seconds
        return metrics, seconds

    def step_done(self, metrics: StepMetrics, weights_path: str = "") -> StepDone:
        """The step's time has passed: move to the next version and say so (``weights_path``
        "" where there are no weights)."""
        self.version += 1
        return StepDone(version=self.version, weights_path=weights_path, metrics=metrics)


class Stop(Exception):
    """Shutdown from the controller, a signal, or the controller is gone."""


class SimTrainer:
    def __init__(self, config: Config, run_dir: RunDir) -> None:
        self.config = config
        self.run_dir = run_dir
        self.endpoints = run_dir.read_endpoints()
        self.scale = config.rollout.sim.time_scale
        self.model = TrainerModel(
            CostModel.simulated(config.rollout.sim.trainer_step_s),
            config.trainer.loss,
            resumed_version(run_dir),
        )
        self.signal_name = ""
        self.context = zmq.Context()
        self.socket = connect(
            self.context,
            self.endpoints,
            "trainer",
            Role.TRAINER,
            identity=b"trainer",
            linger_ms=1000,
        )
        self.encoder = Encoder()
        self.guard = FrameGuard("trainer")

    def send(self, message: Any) -> None:
        self.socket.send_multipart(self.encoder.encode(message))

    def receive(self, expect: tuple[type, ...], timeout_s: float | None) -> Any | None:
        """The next message of a type in ``expect`` (``None`` after ``timeout_s``); raises
        ``Stop`` on Shutdown, a signal, or a dead controller."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if self.signal_name:
                raise Stop(f"signal {self.signal_name}")
            left = _TICK_S if deadline is None else min(_TICK_S, deadline - time.monotonic())
            if left <= 0:
                return None
            if not self.socket.poll(int(left * 1000) + 1):
                if not controller_alive(self.endpoints.controller_pid):
                    raise Stop("the controller is gone")
                continue
            message = self.guard.decode(self.socket.recv_multipart(), peer="controller")
            if message is None:
                continue
            if isinstance(message, Shutdown):
                raise Stop(message.reason or "controller")
            if isinstance(message, expect):
                return message
            log.warning(
                "ignored %s (waiting for %s)",
                type(message).__name__,
                "/".join(t.__name__ for t in expect),
            )

    def run(self) -> str:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        self.send(
            TrainerHello(
                num_processes=self.config.trainer.num_processes,
                weight_version=self.version,
                pid=os.getpid(),
            )
        )
        log.info(
            "sim trainer pid %d at version %d, time_scale %.3g",
            os.getpid(),
            self.version,
            self.scale,
        )
        try:
            while True:
                self.send(BatchRequest(version=self.version))
                batch = self.receive((Batch,), None)
                assert batch is not None
                self.step(batch)
                ack = self.receive((TrainerAck,), self.config.trainer.step_timeout_s)
                if ack is None:
                    log.warning(
                        "no TrainerAck for version %d after %.0fs; going on",
                        self.version,
                        self.config.trainer.step_timeout_s,
                    )
                elif not ack.ok:
                    log.warning(
                        "controller acknowledged version %d with: %s", self.version, ack.detail
                    )
        except Stop as stop:
            return str(stop)

    @property
    def version(self) -> int:
        return self.model.version

    def step(self, batch: Batch) -> None:
        started = time.perf_counter()
        metrics, simulated = self.model.step(batch)
        # Wait out the step, still listening: a Shutdown mid-step ends it (Stop propagates).
        until = time.monotonic() + simulated / self.scale
        while (left := until - time.monotonic()) > 0:
            self.receive((), left)
        version = self.version + 1
        path = write_marker(
            self.run_dir,
            version,
            {
                "step": version - 1,
                "groups": len(batch.groups),
                "samples": metrics.samples,
                "reward_mean": metrics.reward_mean,
                "simulated_step_s": simulated,
            },
        )
        prune_markers(self.run_dir, self.config.trainer.keep_weight_versions)
        atomic_write_bytes(
            self.run_dir.checkpoints / CHECKPOINT_NAME,
            json.dumps({"version": version, "weights": str(path)}).encode(),
        )
        done = self.model.step_done(metrics, str(path))
        metrics.step_s = time.perf_counter() - started
        self.send(done)
        log.info(
            "step %d: loss %.4f reward %.3f samples %d tokens %d simulated %.2fs (%.2fs)",
            self.version,
            metrics.loss,
            metrics.reward_mean,
            metrics.samples,
            metrics.tokens,
            simulated,
            metrics.step_s,
        )

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.signal_name = signal.Signals(signum).name

    def close(self) -> None:
        self.socket.close()
        self.context.term()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m runtime.sim.trainer",
        description="Simulated trainer for the run in RUN_DIR (see the module doc).",
    )
    parser.add_argument("--run-dir", required=True, type=Path)
    args = parser.parse_args(argv)
    try:
        config = read_run_config(args.run_dir)
        run_dir = RunDir(args.run_dir)
        run_dir.read_endpoints()
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        print(f"sim trainer: {exc}", file=sys.stderr)
        return 2
    run_dir.create()
    setup_logging(run_dir.log_file("trainer"))
    trainer = SimTrainer(config, run_dir)
    try:
        reason = trainer.run()
    finally:
        trainer.close()
    log.info("sim trainer exits at version %d (%s)", trainer.version, reason)
    return 0


if __name__ == "__main__":
    sys.exit(main())
