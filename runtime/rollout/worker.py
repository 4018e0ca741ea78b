"""Rollout worker: one process per instance, serving one vLLM engine to the controller over zmq.

``python -m runtime.rollout.worker --run-dir D --instance-id I`` reads the run's config and
endpoints, connects a DEALER (identity ``instance-<I>``) to the controller's rollout ROUTER,
starts the engine on weight version 0 and says ``WorkerHello``. Then it heartbeats every
``rollout.heartbeat_s`` and serves the controller's requests:

- ``Generate``: one group; the finished group goes back as ``GroupDone`` (token ids, behaviour
  log-probs, version span and reward of every sample), as ``GroupAborted`` if any sample was
  aborted, or as ``GroupFailed`` if a reward function failed on it (traceback in this log).
  Groups run concurrently; vLLM schedules up to ``max_num_seqs`` sequences.
- ``PauseWorker(mode)`` / ``ResumeWorker``: vLLM's own pause (``keep``, ``wait``, ``abort``).
- ``UpdateWeights(version, path, mode, rendezvous)``: in place, ``boundary`` or ``keep`` (see
  ``RolloutEngine.update_weights``), from the file or, with a rendezvous, from the trainer's
  broadcast (``runtime/collective.py``). Generates that arrive meanwhile wait behind it.
- ``AbortGroups``: ends those groups with ``GroupAborted``; with ``partial`` the message
  carries each sample's output so far, which a ``Generate`` with ``prefix`` continues (on this
  or another instance). ``Shutdown``: clean exit.
- ``Generate.priority`` reaches vLLM (heeded under ``rollout.scheduling_policy: priority``).

Control requests run one at a time, in arrival order, and each ends with a ``WorkerAck``.
Garbage frames are logged and counted (``Heartbeat.rejected_frames``); the worker keeps running.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import zmq
import zmq.asyncio

from runtime.auth import Role
from runtime.lifetime import die_with_parent, exit_when_orphaned
from runtime.logs import setup_logging
from runtime.protocol import (
    AbortGroups,
    Completion,
    Encoder,
    FrameGuard,
    Generate,
    GroupAborted,
    GroupDone,
    GroupFailed,
    Heartbeat,
    PartialSample,
    PauseWorker,
    ResumeWorker,
    Shutdown,
    UpdateWeights,
    WorkerAck,
    WorkerHello,
)
from runtime.tasks.rewards import GroupRewards, RewardError
from runtime.transport import connect

if __name__ == "__mp_main__":
    # This module is being re-imported by a process that vLLM spawned from the worker (its
    # engine core, or that one's model worker): die with the parent. See lifetime.py.
    die_with_parent()
    exit_when_orphaned()

log = logging.getLogger("runtime.rollout.worker")

RewardFn = Callable[[int, Sequence[Sequence[int]]], Awaitable[GroupRewards]]
"""``await reward(prompt_id, completion_token_ids_of_the_group)``."""


class TaskRewarder:
    """Scores a group with the run's task: decode the tokens, then the task's reward.

    A task with ``score_group`` (the user's reward functions) scores the whole group in one call
    and may raise ``RewardError``; a built-in task scores each completion.
    """

    def __init__(self, task: Any, tokenizer: Any, *more: Any) -> None:
        """``more``: further tasks with their own prompt ids (the eval set)."""
        self._tokenizer = tokenizer
        self._prompts = {p.prompt_id: (p, t) for t in (task, *more) for p in t.prompts}
        self._name = task.name
        for each in (task, *more):
            getattr(each, "rewards", None)  # import the user's reward functions now, not mid-run

    async def __call__(self, prompt_id: int, group: Sequence[Sequence[int]]) -> GroupRewards:
        found = self._prompts.get(prompt_id)
        if found is None:
            raise KeyError(f"prompt_id {prompt_id} is not in task {self._name!r}")
        prompt, task = found
        ids = [list(token_ids) for token_ids in group]
        texts = [self._tokenizer.decode(i, skip_special_tokens=True) for i in ids]
        score_group = getattr(task, "score_group", None)
        if score_group is not None:
            return await score_group(prompt, texts, ids)
        return GroupRewards([float(task.reward(prompt, t)) for t in texts], {})


class RolloutWorker:
    """The message loop of one instance; owns the socket, borrows the engine."""

    def __init__(
        self,
        instance_id: int,
        engine: Any,
        socket: zmq.asyncio.Socket,
        reward: RewardFn,
        sampling: Any,
        heartbeat_s: float,
    ) -> None:
        self.instance_id = instance_id
        self.engine = engine
        self.socket = socket
        self.reward = reward
        self.sampling = sampling
        self.heartbeat_s = heartbeat_s
        self.guard = FrameGuard("rollout")
        self.exit_code = 0
        self._encoder = Encoder()
        self._groups: dict[int, asyncio.Task[None]] = {}
        self._request_ids: dict[int, str] = {}
        self._aborting: dict[int, bool] = {}
        """Groups being aborted -> whether their ``GroupAborted`` carries the partial output."""
        self._held: list[Generate] = []
        self._updates_pending = 0
        self._control = asyncio.Lock()  # FIFO: control requests apply in arrival order
        self._control_tasks: set[asyncio.Task[None]] = set()
        self._stop = asyncio.Event()
        self._request_seq = itertools.count()

    # --- lifecycle ---------------------------------------------------------------------------

    @property
    def state(self) -> str:
        if self._updates_pending:
            return "syncing"
        return "paused" if self.engine.paused else "running"

    def stop(self, exit_code: int = 0) -> None:
        self.exit_code = max(self.exit_code, exit_code)
        self._stop.set()

    async def run(self) -> int:
        """Serve until ``Shutdown``, ``stop()`` or a dead engine; returns the exit code."""
        await self._send(
            WorkerHello(
                instance_id=self.instance_id,
                max_num_seqs=self.engine.spec.max_num_seqs,
                weight_version=self.engine.weight_version,
                pid=os.getpid(),
                backend="vllm",
            )
        )
        log.info(
            "instance %d ready at weight version %d", self.instance_id, self.engine.weight_version
        )
        loops = [asyncio.create_task(self._receive()), asyncio.create_task(self._heartbeat())]
        try:
            await self._stop.wait()
        finally:
            for task in loops + list(self._control_tasks) + list(self._groups.values()):
                task.cancel()
            await asyncio.gather(
                *loops, *self._control_tasks, *self._groups.values(), return_exceptions=True
            )
        return self.exit_code

    async def _send(self, message: Any) -> None:
        await self.socket.send_multipart(self._encoder.encode(message))

    async def _heartbeat(self) -> None:
        while True:
            if self.engine.errored:
                log.error("the vLLM engine died; exiting so the controller restarts us")
                self.stop(1)
                return
            await self._send(
                Heartbeat(
                    instance_id=self.instance_id,
                    state=self.state,
                    weight_version=self.engine.weight_version,
                    running_seqs=self.engine.running_seqs,
                    tokens_generated=self.engine.tokens_generated,
                    time=time.time(),
                    rejected_frames=self.guard.rejected_total,
                )
            )
            await asyncio.sleep(self.heartbeat_s)

    async def _receive(self) -> None:
        while True:
            frames = await self.socket.recv_multipart(copy=False)
            message = self.guard.decode(frames, peer="controller")
            if message is not None:
                self._dispatch(message)

    def _dispatch(self, message: Any) -> None:
        """Route one message; never blocks the receive loop."""
        if isinstance(message, Generate):
            if message.group_id in self._groups or any(
                held.group_id == message.group_id for held in self._held
            ):
                log.warning(
                    "group %d is already here; duplicate Generate ignored", message.group_id
                )
            elif self._updates_pending:
                self._held.append(message)
            else:
                self._start_group(message)
        elif isinstance(message, AbortGroups):
            self._control_task(self._abort(message))
        elif isinstance(message, UpdateWeights):
            # Counted now, not when the task runs, so Generates behind it in the socket wait.
            self._updates_pending += 1
            self._control_task(self._update(message))
        elif isinstance(message, PauseWorker):
            self._control_task(self._pause(message))
        elif isinstance(message, ResumeWorker):
            self._control_task(self._resume())
        elif isinstance(message, Shutdown):
            log.info("shutdown requested: %s", message.reason or "no reason given")
            self.stop(0)
        else:
            self.guard.rejected["UnexpectedMessage"] += 1
            log.warning("ignored %s: not a message for a rollout worker", type(message).__name__)

    def _control_task(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._control_tasks.add(task)
        task.add_done_callback(self._control_tasks.discard)

    async def _ack(self, request: str, ok: bool, detail: str = "") -> None:
        if not ok:
            log.warning("%s refused: %s", request, detail)
        await self._send(
            WorkerAck(
                instance_id=self.instance_id,
                request=request,
                ok=ok,
                weight_version=self.engine.weight_version,
                detail=detail,
            )
        )

    # --- control requests --------------------------------------------------------------------

    async def _pause(self, message: PauseWorker) -> None:
        async with self._control:
            try:
                await self.engine.pause(message.mode)
            except ValueError as exc:
                await self._ack("pause", False, str(exc))
            else:
                await self._ack("pause", True, f"mode {message.mode}")

    async def _resume(self) -> None:
        async with self._control:
            await self.engine.resume()
            await self._ack("resume", True)

    async def _update(self, message: UpdateWeights) -> None:
        try:
            async with self._control:
                ok, detail = await self._apply_update(message)
        finally:
            self._updates_pending -= 1
            if not self._updates_pending:
                held, self._held = self._held, []
                for generate in held:
                    self._start_group(generate)
        await self._ack("update_weights", ok, detail)

    async def _apply_update(self, message: UpdateWeights) -> tuple[bool, str]:
        current = self.engine.weight_version
        if message.version < current:
            return False, f"version {message.version} is older than the loaded {current}"
        if message.version == current:
            return True, f"already at version {current}"
        from runtime.rollout.engine import WeightSource

        rendezvous = message.rendezvous
        if rendezvous is None and not Path(message.path).is_file():
            return False, f"weights file {message.path} does not exist"
        source = WeightSource(
            version=message.version,
            path=message.path,
            address=rendezvous.address if rendezvous else "",
            token=rendezvous.token if rendezvous else "",
        )
        try:
            held_s = await self.engine.update_weights(source, message.mode)
        except (ValueError, RuntimeError, OSError) as exc:
            return False, f"{type(exc).__name__}: {exc}"
        loaded = self.engine.weight_version
        origin = f"{rendezvous.backend} from {rendezvous.address}" if rendezvous else message.path
        log.info(
            "weights v%d -> v%d (%s) by %s; engine held %.3f s",
            current,
            loaded,
            message.mode,
            origin,
            held_s,
        )
        return True, f"mode {message.mode}, v{loaded} by {origin}, engine held {held_s:.3f} s"

    async def _abort(self, message: AbortGroups) -> None:
        async with self._control:
            unknown = []
            for group_id in message.group_ids:
                held = next((g for g in self._held if g.group_id == group_id), None)
                if held is not None:
                    self._held.remove(held)
                    partial = _unstarted(held) if message.partial else None
                    await self._send_aborted(group_id, "aborted before it started", partial)
                elif group_id in self._request_ids:
                    self._aborting[group_id] = message.partial
                    await self.engine.abort([self._request_ids[group_id]])
                else:
                    unknown.append(group_id)
            detail = f"not here (finished or never sent): {unknown}" if unknown else ""
            await self._ack("abort", True, detail)

    # --- groups ------------------------------------------------------------------------------

    def _start_group(self, message: Generate) -> None:
        request_id = f"g{message.group_id}-{next(self._request_seq)}"
        self._request_ids[message.group_id] = request_id
        task = asyncio.create_task(self._run_group(message, request_id))
        self._groups[message.group_id] = task

    def _sampling(self, message: Generate) -> Any:
        from runtime.rollout.engine import SamplingSpec

        seed = message.seed
        if seed is None and self.sampling.seed is not None:
            # A configured seed must not make every group of one prompt sample alike; vLLM
            # gives sample k of a group seed + k, so groups are spaced far apart.
            seed = (self.sampling.seed * 1_000_003 + message.group_id * 4_099) % (1 << 31)
        return SamplingSpec(
            n=message.n,
            max_tokens=message.max_tokens,
            temperature=self.sampling.temperature
            if message.temperature is None
            else message.temperature,
            top_p=self.sampling.top_p if message.top_p is None else message.top_p,
            seed=seed,
        )

    async def _run_group(self, message: Generate, request_id: str) -> None:
        group_id = message.group_id
        started_at = time.time()
        try:
            samples = await self.engine.generate(
                request_id,
                message.prompt_token_ids.tolist(),
                self._sampling(message),
                priority=message.priority,
                prefixes=_prefixes(message),
            )
            if group_id in self._aborting or any(s.finish_reason == "abort" for s in samples):
                reason = "aborted" if group_id in self._aborting else "aborted by a pause"
                partial = [_partial(s) for s in samples] if self._aborting.get(group_id) else None
                await self._send_aborted(group_id, reason, partial)
                return
            try:
                scores = await self.reward(
                    message.prompt_id, [sample.token_ids.tolist() for sample in samples]
                )
            except RewardError as exc:
                # The traceback (the user's function's own, chained) goes to this worker's log.
                log.exception("group %d: %s", group_id, exc)
                await self._send(
                    GroupFailed(
                        group_id=group_id,
                        prompt_id=message.prompt_id,
                        instance_id=self.instance_id,
                        error=str(exc),
                    )
                )
                return
            completions = [
                Completion(
                    token_ids=sample.token_ids,
                    logprobs=sample.logprobs,
                    version_min=sample.version_min,
                    version_max=sample.version_max,
                    finish_reason=sample.finish_reason,
                    reward=scores.totals[k],
                    finished_at=sample.finished_at,
                    rewards={
                        name: values[k]
                        for name, values in scores.per_function.items()
                        if values[k] is not None
                    },
                )
                for k, sample in enumerate(samples)
            ]
            await self._send(
                GroupDone(
                    group_id=group_id,
                    prompt_id=message.prompt_id,
                    instance_id=self.instance_id,
                    completions=completions,
                    started_at=started_at,
                    finished_at=max(c.finished_at for c in completions),
                )
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # one bad group must not take the instance down
            log.exception("group %d failed", group_id)
            await self._send_aborted(group_id, f"failed: {type(exc).__name__}: {exc}")
        finally:
            self._groups.pop(group_id, None)
            self._request_ids.pop(group_id, None)
            self._aborting.pop(group_id, None)

    async def _send_aborted(
        self, group_id: int, reason: str, partial: list[PartialSample] | None = None
    ) -> None:
        await self._send(
            GroupAborted(
                group_id=group_id, instance_id=self.instance_id, reason=reason, partial=partial
            )
        )


def _prefixes(message: Generate) -> list[Any] | None:
    """``Generate.prefix`` as the engine's samples (None: a fresh group)."""
    if message.prefix is None:
        return None
    from runtime.rollout.engine import GeneratedSample

    return [
        GeneratedSample(
            token_ids=np.asarray(p.token_ids, dtype=np.int32),
            logprobs=np.asarray(p.logprobs, dtype=np.float32),
            finish_reason=p.finish_reason,
            version_min=p.version_min,
            version_max=p.version_max,
            finished_at=p.finished_at,
        )
        for p in message.prefix
    ]


def _partial(sample: Any) -> PartialSample:
    """An engine sample (maybe cut by an abort) as the partial output a ``GroupAborted``
    reports."""
    return PartialSample(
        token_ids=sample.token_ids,
        logprobs=sample.logprobs,
        version_min=sample.version_min,
        version_max=sample.version_max,
        finish_reason=sample.finish_reason,
        finished_at=sample.finished_at if sample.finish_reason != "abort" else 0.0,
    )


def _unstarted(message: Generate) -> list[PartialSample]:
    """The partial output of a group aborted before it started: its prefix, or nothing."""
    if message.prefix is not None:
        return list(message.prefix)
    empty = PartialSample(
        token_ids=np.zeros(0, np.int32),
        logprobs=np.zeros(0, np.float32),
        version_min=0,
        version_max=0,
    )
    return [empty] * message.n


# --- process entry ---------------------------------------------------------------------------


async def serve(run_dir: Path, instance_id: int) -> int:
    """Start the engine for ``instance_id`` of the run in ``run_dir`` and serve until told."""
    import torch

    from runtime.config import ConfigError
    from runtime.remote import run_context
    from runtime.rollout.engine import EngineSpec, resolve_engine_kind, start_engine
    from runtime.tasks import build_task, ensure_model, load_tokenizer

    context = run_context(run_dir, Role.WORKER)
    config = context.config
    if not 0 <= instance_id < config.num_instances:
        raise ConfigError(
            f"--instance-id: {instance_id} is not an instance of this run "
            f"(rollout.instances has {config.num_instances})"
        )
    instance = config.rollout.instance_list()[instance_id]
    model = ensure_model(config)
    from runtime.tasks.dataset import DatasetTask

    task = build_task(config)
    extra = [t for t in (DatasetTask.eval_of(config),) if t is not None]
    reward = TaskRewarder(task, load_tokenizer(model), *extra)

    zmq_context = zmq.asyncio.Context()
    socket = connect(
        zmq_context,
        context.endpoints,
        "rollout",
        Role.WORKER,
        identity=b"instance-%d" % instance_id,
        linger_ms=1000,
        key=context.key,
    )
    engine = None
    try:
        started = time.perf_counter()
        engine = await start_engine(
            EngineSpec(
                model=model,
                dtype=config.model.dtype,
                max_num_seqs=config.rollout.max_num_seqs_of(instance_id),
                kv_cache_gib=config.rollout.kv_cache_gib,
                seed=config.run.seed + instance_id,
                tensor_parallel_size=instance.tensor_parallel_size,
                engine=resolve_engine_kind(config.rollout.engine, instance.tensor_parallel_size),
                prefix_caching=config.async_.update_mode != "inflight",
                scheduling_policy=config.rollout.scheduling_policy,
            )
        )
        log.info(
            "%s engine for %s up in %.1f s (%d torch threads)",
            engine.spec.engine,
            model,
            time.perf_counter() - started,
            torch.get_num_threads(),
        )
        worker = RolloutWorker(
            instance_id,
            engine,
            socket,
            reward,
            config.rollout.sampling,
            config.rollout.heartbeat_s,
        )
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, worker.stop)
        return await worker.run()
    finally:
        if engine is not None:
            engine.shutdown()
        socket.close()
        zmq_context.term()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime.rollout.worker", description=__doc__)
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--instance-id", required=True, type=int)
    parser.add_argument(
        "--die-with-parent",
        action="store_true",
        help="exit when the process that started this worker dies (for supervisors)",
    )
    parser.add_argument(
        "--log-stdout", action="store_true", help="log to stdout instead of the run's log file"
    )
    args = parser.parse_args(argv)

    from runtime.config import ConfigError
    from runtime.lifetime import arm_forked_children
    from runtime.remote import launched
    from runtime.rundir import RunDir

    if args.die_with_parent:
        die_with_parent()
    arm_forked_children()
    # The log file also takes vLLM's own output, and its engine core's. Through a launcher,
    # stderr is carried back to the head node's logs/.
    remote = args.log_stdout or launched()
    log_file = None if remote else RunDir(args.run_dir).log_file(f"worker-{args.instance_id}")
    setup_logging(log_file, capture_output=not remote)
    try:
        return asyncio.run(serve(args.run_dir, args.instance_id))
    except (ConfigError, FileNotFoundError) as exc:
        log.error("%s", exc)
        print(f"error: {exc}", file=sys.__stderr__)
        return 2


if __name__ == "__main__":
    sys.exit(main())
