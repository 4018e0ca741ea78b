"""The trainer process: rank 0 talks to the controller, every rank trains.

Message flow on the trainer socket (rank 0's DEALER, identity ``b"trainer"``):

    -> TrainerHello(num_processes, weight_version, pid)
    -> BatchRequest(version)
    loop:
      <- Batch(version, groups) | Shutdown
      (all ranks: one GRPO step; rank 0 writes weights v+1)
      -> StepDone(version + 1, weights_path, metrics)
      -> BatchRequest(version + 1)
      <- TrainerAck | Shutdown
      (all ranks: a checkpoint when one is due)

Rank 0 broadcasts what it received to the other ranks with ``torch.distributed`` (the raw
msgpack frames as ``bytes``, decoded again on each rank, so no custom object is pickled). While it
waits it broadcasts a keep-alive every ``_TICK_S``, so a long wait for rollouts never trips the
process group's collective timeout. SIGTERM/SIGINT end the run at the next wait: final
checkpoint, exit 0.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch
import zmq

from runtime.auth import KeyPair, Role
from runtime.collective import WeightServer, local_address_towards
from runtime.config import Config
from runtime.logs import setup_logging
from runtime.protocol import (
    Batch,
    BatchRequest,
    Decoder,
    Encoder,
    FrameGuard,
    Shutdown,
    StepDone,
    TrainerAck,
    TrainerHello,
    WeightRendezvous,
)
from runtime.remote import RunContext, run_context
from runtime.rundir import Endpoints, JsonlWriter, RunDir
from runtime.trainer import weights as weights_mod
from runtime.trainer.train import EmptyBatch, Trainer
from runtime.transport import connect

log = logging.getLogger("runtime.trainer")

_TICK_S = 1.0
WEIGHT_PORT_OFFSET = 4
"""The weight server's port is ``controller.port_base + 4`` (the controller's are +0..+3)."""
CHECKSUM_ENV = "ASP_TUI_TRAINER_CHECKSUMS"
"""Set to 1 to make every rank append the sha256 of its own weights after each step to
``state/trainer-checksums-rank<r>.jsonl`` (tests use it to prove the ranks agree)."""


class StopFlag:
    """Set by SIGTERM/SIGINT; the loop looks at it between steps."""

    def __init__(self) -> None:
        self.reason = ""

    def __bool__(self) -> bool:
        return bool(self.reason)

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: Any) -> None:
        self.reason = signal.Signals(signum).name


class TrainerPlaneClient:
    """Rank 0's DEALER socket to the controller's trainer ROUTER."""

    def __init__(self, endpoints: Endpoints, key: KeyPair | None = None) -> None:
        self.context = zmq.Context()
        self.socket = connect(
            self.context,
            endpoints,
            "trainer",
            Role.TRAINER,
            identity=b"trainer",
            linger_ms=1000,
            key=key,
        )
        self.encoder = Encoder()
        self.guard = FrameGuard("trainer")

    def send(self, message: Any) -> None:
        self.socket.send_multipart(self.encoder.encode(message), copy=False)

    def receive(self, timeout_s: float) -> tuple[Any, list[bytes]] | None:
        """The next valid message and its frames, or None after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not self.socket.poll(int(left * 1000) + 1):
                return None
            frames = self.socket.recv_multipart(copy=True)
            message = self.guard.decode(frames, peer="controller")
            if message is not None:
                return message, frames
            log.warning("ignored a garbage frame (%d rejected so far)", self.guard.rejected_total)
        return None

    def close(self) -> None:
        self.socket.close()
        self.context.term()


@dataclass(slots=True)
class _Timing:
    """Where one step's wall time went outside its own compute (see ``StepMetrics``)."""

    acknowledge: bool = False
    """A StepDone is out and its acknowledgment not yet read."""
    reported_at: float = 0.0
    wait_ack_s: float = 0.0
    checkpoint_s: float = 0.0
    wait_batch_s: float = 0.0


class TrainerProcess:
    """Runs the message loop around a ``Trainer`` on every rank."""

    def __init__(self, context: RunContext, run_dir: RunDir, trainer: Trainer) -> None:
        self.config = context.config
        self.run_dir = run_dir
        self.trainer = trainer
        self.stop = StopFlag()
        self.decoder = Decoder()
        self.link = TrainerPlaneClient(context.endpoints, context.key) if trainer.is_main else None
        self.checkpointed_version = trainer.version
        self.checksums: JsonlWriter | None = None
        if os.environ.get(CHECKSUM_ENV) == "1":
            path = run_dir.state / f"trainer-checksums-rank{trainer.rank}.jsonl"
            self.checksums = JsonlWriter(path)

    # --- collective receive -------------------------------------------------------------------

    def receive(self, expect: type) -> tuple[str, Any]:
        """Wait for ``expect`` (Batch or TrainerAck) on rank 0; every rank gets the outcome.

        Returns ``("message", msg)`` or ``("shutdown", reason)``. Must be called on all ranks.
        """
        started, warned = time.monotonic(), False
        while True:
            payload: list[Any] = ["wait"]
            if self.link is not None:
                payload = self._poll_controller(expect)
                waited = time.monotonic() - started
                if not warned and waited > self.config.trainer.step_timeout_s:
                    warned = True
                    log.warning("no %s after %.0fs; still waiting", expect.__name__, waited)
            payload = self._broadcast(payload)
            if payload[0] == "wait":
                continue
            if payload[0] == "shutdown":
                return "shutdown", payload[1]
            return "message", self.decoder.decode(payload[1])

    def _poll_controller(self, expect: type) -> list[Any]:
        assert self.link is not None
        if self.stop:
            return ["shutdown", f"signal {self.stop.reason}"]
        got = self.link.receive(_TICK_S)
        if got is None:
            return ["wait"]
        message, frames = got
        if isinstance(message, Shutdown):
            return ["shutdown", message.reason or "controller"]
        if isinstance(message, expect):
            return ["message", frames]
        log.warning("ignored %s while waiting for %s", type(message).__name__, expect.__name__)
        return ["wait"]

    def _broadcast(self, payload: list[Any]) -> list[Any]:
        if self.trainer.world_size == 1:
            return payload
        box = [payload]
        torch.distributed.broadcast_object_list(box, src=0, device=self.trainer.accelerator.device)
        return box[0]

    # --- the loop -----------------------------------------------------------------------------

    def run(self) -> str:
        """Serve batches until Shutdown or a signal; returns the reason.

        The next batch is asked for as soon as a step is reported, so the controller forms it
        while this rank waits for the acknowledgment and writes any checkpoint: neither sits
        on the critical path between two steps.
        """
        trainer = self.trainer
        self.stop.install()
        if self.link is not None:
            server = trainer.weight_server
            self.link.send(
                TrainerHello(
                    num_processes=trainer.world_size,
                    weight_version=trainer.version,
                    pid=os.getpid(),
                    weight_rendezvous=None
                    if server is None
                    else WeightRendezvous(
                        address=server.address, token=server.token, backend=server.backend
                    ),
                )
            )
        timing = _Timing()
        while True:
            if self.link is not None:
                self.link.send(BatchRequest(version=trainer.version))
            asked_at = time.perf_counter()
            if timing.acknowledge:
                kind, value = self.receive(TrainerAck)
                if kind == "shutdown":
                    return self._shutdown(value)
                timing.wait_ack_s = time.perf_counter() - timing.reported_at
                if not value.ok:
                    log.warning(
                        "controller acknowledged step %d with: %s", trainer.version, value.detail
                    )
                elif trainer.weight_server is not None:
                    # The controller knows this version now: workers may load it.
                    trainer.weight_server.promote(trainer.version)
                timing.acknowledge = False
                if self.config.trainer.checkpoint_every and (
                    trainer.version % self.config.trainer.checkpoint_every == 0
                ):
                    timing.checkpoint_s = self._checkpoint()
            kind, value = self.receive(Batch)
            if kind == "shutdown":
                return self._shutdown(value)
            batch: Batch = value
            timing.wait_batch_s = time.perf_counter() - asked_at
            if batch.version != trainer.version:
                log.warning(
                    "batch is for version %d, trainer is at %d; training on it anyway",
                    batch.version,
                    trainer.version,
                )
            if self._step(batch, timing):
                timing = _Timing(acknowledge=True, reported_at=time.perf_counter())

    def _step(self, batch: Batch, timing: _Timing) -> bool:
        trainer = self.trainer
        try:
            result = trainer.step(batch)
        except EmptyBatch as exc:
            log.error("%s; asking for another batch", exc)
            return False
        for problem in result.problems[:10]:
            log.warning("left out of step %d: %s", trainer.version, problem)
        publish_started = time.perf_counter()
        path = trainer.publish()
        metrics = result.metrics
        metrics.publish_s = time.perf_counter() - publish_started
        metrics.step_s = metrics.compute_s + metrics.publish_s
        metrics.wait_batch_s = timing.wait_batch_s
        metrics.wait_ack_s = timing.wait_ack_s
        metrics.checkpoint_s = timing.checkpoint_s
        log.info(
            "rank %d trained on %d samples (%d tokens) of %d",
            trainer.rank,
            result.share_samples,
            result.share_tokens,
            metrics.samples,
        )
        if self.checksums is not None:
            self.checksums.write(
                {
                    "version": trainer.version,
                    "rank": trainer.rank,
                    "samples": result.share_samples,
                    "sha256": trainer.local_checksum(),
                }
            )
        if self.link is not None:
            self.link.send(
                StepDone(version=trainer.version, weights_path=str(path or ""), metrics=metrics)
            )
            log.info(
                "step %d: loss %.4f reward %.3f samples %d tokens %d clip %.3f is-clip %.3f "
                "kl %.4f grad %.3f %.2fs",
                trainer.version,
                metrics.loss,
                metrics.reward_mean,
                metrics.samples,
                metrics.tokens,
                metrics.clip_fraction,
                metrics.importance_clip_fraction,
                metrics.kl,
                metrics.grad_norm,
                metrics.step_s,
            )
        return True

    def _checkpoint(self) -> float:
        """Save a checkpoint; returns the seconds it took."""
        started = time.perf_counter()
        path = self.trainer.save_checkpoint()
        self.checkpointed_version = self.trainer.version
        took = time.perf_counter() - started
        log.info("checkpoint %s in %.2fs", path, took)
        return took

    def _shutdown(self, reason: str) -> str:
        log.info("shutting down at version %d: %s", self.trainer.version, reason)
        trainer = self.trainer
        if (
            self.config.async_.weight_sync == "collective"
            and trainer.version > 0
            and not self.run_dir.weights_file(trainer.version).exists()
        ):
            # Steps published no files; the run's final export (and asp-tui export) reads one.
            trainer.write_weights_file()
        if self.trainer.version > self.checkpointed_version:
            self._checkpoint()
        return reason

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
        if self.checksums is not None:
            self.checksums.close()


def start_weight_server(
    config: Config, endpoints: Endpoints, device: torch.device
) -> WeightServer | None:
    """Rank 0's weight server for ``async.weight_sync: collective``, on this host's address
    towards the controller (loopback for a one-host run) and ``controller.port_base + 4`` when
    ports are fixed. None, with a warning, when it cannot start: the run then publishes files.
    """
    controller_host = urlsplit(endpoints.trainer).hostname or "127.0.0.1"
    port = config.controller.port_base + WEIGHT_PORT_OFFSET if config.controller.port_base else 0
    try:
        host = local_address_towards(controller_host)
        server = WeightServer(host, port, device=device)
    except OSError as exc:
        log.warning("weight server could not start (%s); publishing weight files instead", exc)
        return None
    log.info("weight server on %s (%s)", server.address, server.backend)
    return server


def run(run_dir: str | Path) -> int:
    """The whole trainer process on one rank; returns the exit code."""
    from runtime.tasks import ensure_model

    rd = RunDir(run_dir)
    # Every rank fails fast, before loading anything, if there is no run.
    context = run_context(rd.root, Role.TRAINER)
    config = context.config
    rank = int(os.environ.get("RANK", "0"))
    # Through a launcher everything goes to stderr, which it carries back to the head node.
    name = "trainer" if rank == 0 else f"trainer-rank{rank}"
    setup_logging(
        None if context.launched else rd.log_file(name),
        tag=f"rank{rank}",
        console=None if context.launched else logging.WARNING,
    )
    model_path = ensure_model(config)
    trainer = Trainer(config, rd, model_path)
    log.info(
        "trainer rank %d/%d on %s, model %s",
        trainer.rank,
        trainer.world_size,
        trainer.accelerator.device,
        model_path,
    )
    if trainer.is_main:
        removed = weights_mod.remove_stale_temp_files(rd)
        if removed:
            log.info("removed %d temp weight files of a crashed writer", removed)
    if trainer.is_main and config.async_.weight_sync == "collective":
        trainer.weight_server = start_weight_server(
            config, context.endpoints, trainer.accelerator.device
        )
    resumed = trainer.load_latest_checkpoint()
    if resumed is not None:
        log.info("resumed from %s at version %d", resumed, trainer.version)
        if config.async_.weight_sync == "collective":
            trainer.publish()
            if trainer.weight_server is not None:
                trainer.weight_server.promote(trainer.version)
        # The workers may need this version's file even if it was pruned or never written.
        elif not rd.weights_file(trainer.version).exists():
            trainer.publish()
        elif trainer.is_main:
            weights_mod.prune_weights(rd, trainer.version, config.trainer.keep_weight_versions)
    process = TrainerProcess(context, rd, trainer)
    try:
        reason = process.run()
    finally:
        process.close()
        if trainer.weight_server is not None:
            trainer.weight_server.close()
    log.info("trainer exits at version %d (%s)", trainer.version, reason)
    # Every rank leaves together: a rank that tears gloo down while another still uses it can
    # make that one abort at exit.
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()
    return 0
