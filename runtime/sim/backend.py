"""The ``sim`` rollout backend: K simulated vLLM instances in one process, in real time.

``python -m runtime.sim.backend --run-dir D [--instance-id I ...]`` hosts every instance of the
run (or only the ones named) as asyncio tasks. Each instance has its own DEALER socket (identity
``b"instance-<i>"``) to the controller's rollout ROUTER and speaks exactly the real worker's
protocol, so the controller cannot tell it from a cluster of vLLM workers.

How an instance simulates vLLM (no model runs):

- **Lengths.** A group of ``n`` samples of prompt ``p`` takes its output lengths from the trace
  row behind ``p`` (:mod:`runtime.tasks.sim_task`): sample ``j`` gets the row's sample
  ``(offset + j) mod S``, cycling through the row's ``S`` samples, with ``offset = seed mod S``
  (0 without a seed), capped at ``max_tokens`` (``finish_reason`` "length" when cut).
- **Time.** Continuous batching with ``max_num_seqs`` slots: queued sequences take free slots
  in arrival order; a group's first admission stalls the batch for ``prefill_s(prompt)``; every
  decode step advances each running sequence by one token and lasts
  ``CostModel.decode_step_s(running, context)``. Nothing ticks per token: while the running set
  is fixed, the time to the next finish is one closed-form sum (``decode_steps_s``), and the
  instance sleeps until then, or until a message arrives, when it works out how many steps fit
  in the time that passed. ``rollout.sim.time_scale`` simulated seconds pass per wall second.
- **Weights.** ``UpdateWeights`` "loads" the file it names: a sim marker (``*.json`` written by
  :mod:`runtime.sim.trainer`) must name the same version; any other existing file or directory
  is accepted as is. The load takes ``CostModel.weight_sync_s``. ``boundary`` waits for the
  in-flight sequences to finish (no new ones start), so no sample spans versions; ``keep``
  freezes them in place, loads, and lets them continue, so their ``version_max`` is the new one.
- **Pause.** ``keep`` freezes in-flight sequences until ``ResumeWorker``; ``wait`` stops
  admitting and pauses once the running ones finish; ``abort`` aborts every group first.

Every socket decodes through a ``FrameGuard``: garbage is logged, counted (the totals are logged
at exit) and ignored. The process exits 0 when every instance got ``Shutdown``, on SIGTERM or
SIGINT, or when the controller process is gone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import json
import logging
import math
import os
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil
import zmq
import zmq.asyncio

from runtime.auth import Role
from runtime.config import Config, ConfigError, read_run_config
from runtime.logs import setup_logging
from runtime.protocol import (
    AbortGroups,
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
    UpdateWeights,
    WorkerAck,
    WorkerHello,
)
from runtime.rundir import RunDir
from runtime.scheduler.cost_model import CostModel
from runtime.tasks import TaskPrompt
from runtime.tasks.sim_task import SYNTHETIC_VOCAB, SimTask, sim_reward, unit_hash
from runtime.transport import connect

log = logging.getLogger("runtime.sim.backend")

STARTUP_S = 3.0
STARTUP_JITTER_S = 2.0
"""Simulated engine start-up: 3-5 simulated seconds (deterministic per instance), so operators
see STARTING before RUNNING."""

SIM_WEIGHTS_FORMAT = "asp-tui-sim-weights"
"""``format`` of the JSON weight markers that the sim trainer writes and sim instances load."""

CONTROLLER_CHECK_S = 2.0
"""How often (wall seconds) the process checks that the controller is still alive."""

_EPS = 1e-9


@dataclass(eq=False)
class _Group:
    request: Generate
    prompt: TaskPrompt
    prompt_tokens: int
    seqs: list[_Seq] = field(default_factory=list)
    started_at: float | None = None
    unfinished: int = 0


@dataclass(eq=False)
class _Seq:
    group: _Group
    index: int
    length: int
    truncated: bool
    start_step: int = -1
    version_min: int = 0
    version_max: int = 0
    finished_at: float = 0.0
    finished: bool = False
    aborted: bool = False


@dataclass
class SimSettings:
    """What every instance of one backend process shares."""

    cost: CostModel
    time_scale: float
    heartbeat_s: float
    task: SimTask
    clock_offset: float
    """``time.time() - loop.time()``: loop (monotonic) seconds -> wall timestamps."""


class SimInstance:
    """One simulated vLLM instance: a DEALER socket, a receive task and a scheduling loop."""

    def __init__(
        self,
        instance_id: int,
        socket: zmq.asyncio.Socket | None,
        max_num_seqs: int,
        settings: SimSettings,
    ) -> None:
        self.instance_id = instance_id
        self.socket = socket
        self.max_num_seqs = max_num_seqs
        self.settings = settings
        self.cost = settings.cost
        self.scale = settings.time_scale
        self.guard = FrameGuard(f"rollout[instance-{instance_id}]")
        self.encoder = Encoder()
        self.unexpected = 0
        self.state = "starting"
        self.version = 0
        self.closed = False
        # Simulation state. ``step`` counts decode steps; a running sequence has generated
        # ``step - start_step`` tokens and finishes at ``start_step + length``.
        self.step = 0
        self._heap: list[tuple[int, int, _Seq]] = []
        self._tiebreak = 0
        self._running = 0
        self._prompt_sum = 0
        self._start_sum = 0
        self._tokens_done = 0
        self._waiting: deque[_Seq] = deque()
        self._groups: dict[int, _Group] = {}
        self._stall_s = 0.0
        self._carry_s = 0.0
        self._last = 0.0
        # Control state.
        self._paused = False
        self._pause_wait = False
        self._updates: deque[UpdateWeights] = deque()
        self._sync_left_s: float | None = None
        self._inbox: deque[object] = deque()
        self._outbox: list[object] = []
        self._wake = asyncio.Event()
        self._closing = asyncio.Event()

    # --- derived quantities -------------------------------------------------------------------
    @property
    def running_seqs(self) -> int:
        return self._running

    @property
    def tokens_generated(self) -> int:
        return self._tokens_done + self._running * self.step - self._start_sum

    def _context(self) -> int:
        """Total context (prompt + generated) of the running sequences, in tokens."""
        return self._prompt_sum + self._running * self.step - self._start_sum

    def _syncing(self) -> bool:
        return self._sync_left_s is not None

    def _admitting(self) -> bool:
        """New sequences may start: running, and no boundary update or wait-pause draining."""
        if self._paused or self._pause_wait or self._syncing() or self.state == "starting":
            return False
        return not (self._updates and self._updates[0].mode == "boundary")

    def _frozen(self) -> bool:
        return self._paused or self._syncing() or self.state == "starting"

    def _reported_state(self) -> str:
        if self.state == "starting":
            return "starting"
        if self._syncing():
            return "syncing"
        return "paused" if self._paused else "running"

    def _wall(self, loop_time: float) -> float:
        return loop_time + self.settings.clock_offset

    # --- the loops ----------------------------------------------------------------------------
    async def run(self) -> None:
        """Start up, then serve until ``Shutdown`` or :meth:`close`."""
        loop = asyncio.get_running_loop()
        receiver = asyncio.create_task(self._receive(), name=f"recv-{self.instance_id}")
        try:
            startup = STARTUP_S + STARTUP_JITTER_S * unit_hash(0x57A27, self.instance_id)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), startup / self.scale)
            if self.closed:
                return
            self.start(loop.time())
            await self._send(
                WorkerHello(
                    instance_id=self.instance_id,
                    max_num_seqs=self.max_num_seqs,
                    weight_version=self.version,
                    pid=os.getpid(),
                    backend="sim",
                )
            )
            log.info("instance %d up (max_num_seqs=%d)", self.instance_id, self.max_num_seqs)
            next_heartbeat = loop.time()
            while not self.closed:
                self._wake.clear()
                now = loop.time()
                self.advance(now)
                while self._inbox and not self.closed:
                    self.handle(self._inbox.popleft(), now)
                if now >= next_heartbeat:
                    self._outbox.append(self._heartbeat())
                    next_heartbeat += self.settings.heartbeat_s
                    if next_heartbeat <= now:  # fell behind (a stall): do not send a burst
                        next_heartbeat = now + self.settings.heartbeat_s
                await self._flush()
                if self.closed:
                    break
                deadline = min(self.next_event(now), next_heartbeat)
                timer = loop.call_at(deadline, self._wake.set)
                try:
                    await self._wake.wait()
                finally:
                    timer.cancel()
        finally:
            receiver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await receiver

    async def _receive(self) -> None:
        while True:
            frames = await self.socket.recv_multipart()
            message = self.guard.decode(frames, peer="controller")
            if message is None:
                continue
            self._inbox.append(message)
            self._wake.set()

    def close(self) -> None:
        """Stop the loops (used on SIGTERM and when the controller is gone)."""
        self.closed = True
        self._closing.set()
        self._wake.set()

    async def _send(self, message: object) -> None:
        await self.socket.send_multipart(self.encoder.encode(message))  # type: ignore[arg-type]

    async def _flush(self) -> None:
        for message in self.take_output():
            await self._send(message)

    def take_output(self) -> list[object]:
        """Messages produced since the last call (GroupDone, GroupAborted, WorkerAck, ...)."""
        out, self._outbox = self._outbox, []
        return out

    def _heartbeat(self) -> Heartbeat:
        return Heartbeat(
            instance_id=self.instance_id,
            state=self._reported_state(),
            weight_version=self.version,
            running_seqs=self._running,
            tokens_generated=self.tokens_generated,
            time=time.time(),
        )

    # --- simulated time -----------------------------------------------------------------------
    def next_event(self, now: float) -> float:
        """Loop time of the next thing that happens on its own (a finish, a sync completing)."""
        if self._syncing():
            return now + max(0.0, self._sync_left_s or 0.0) / self.scale
        if self._frozen() or self._running == 0:
            return math.inf
        k = self._steps_to_next_finish()
        sim = self._stall_s + self.cost.decode_steps_s(k, self._running, self._context())
        return now + max(0.0, sim - self._carry_s) / self.scale

    def _steps_to_next_finish(self) -> int:
        heap = self._heap
        while heap and heap[0][2].aborted:
            heapq.heappop(heap)
        return max(1, heap[0][0] - self.step)

    def start(self, now: float) -> None:
        """The engine is up at loop time ``now`` (after the simulated start-up)."""
        self._last = now
        self.state = "running"

    def advance(self, now: float) -> None:
        """Bring the simulation forward to loop time ``now``."""
        carried = self._carry_s
        budget = (now - self._last) * self.scale + carried
        self._last = now
        self._carry_s = 0.0
        if self.state == "starting":
            return
        while True:
            at = now - max(budget, 0.0) / self.scale  # loop time of the point reached so far
            if self._syncing():
                used = min(budget, self._sync_left_s or 0.0)
                self._sync_left_s = (self._sync_left_s or 0.0) - used
                budget -= used
                if self._sync_left_s > _EPS:
                    return
                self._finish_sync(now - max(budget, 0.0) / self.scale)
                continue
            if self._paused:
                # The partial step in progress resumes with the sequences (keep mode).
                self._carry_s = min(carried, max(budget, 0.0))
                return
            self._admit(at)
            if self._running == 0:
                self._settle()  # may start a boundary update, which then uses the time
                if self._syncing():
                    continue
                return  # idle time is not carried over
            if budget <= _EPS:
                self._carry_s = max(budget, 0.0)
                return
            if self._stall_s > 0:
                used = min(budget, self._stall_s)
                self._stall_s -= used
                budget -= used
                if self._stall_s > _EPS:
                    return
                self._stall_s = 0.0
                continue
            k = self._steps_to_next_finish()
            running, context = self._running, self._context()
            segment = self.cost.decode_steps_s(k, running, context)
            if segment <= budget + _EPS:
                budget -= segment
                self.step += k
                self._finish_due(now - max(budget, 0.0) / self.scale)
                continue
            steps = self._steps_within(budget, k, running, context)
            self.step += steps
            self._carry_s = budget - self.cost.decode_steps_s(steps, running, context)
            return

    def _steps_within(self, budget: float, limit: int, running: int, context: int) -> int:
        """The most decode steps (< ``limit``) that fit in ``budget`` simulated seconds."""
        low, high = 0, limit - 1
        while low < high:
            mid = (low + high + 1) // 2
            if self.cost.decode_steps_s(mid, running, context) <= budget:
                low = mid
            else:
                high = mid - 1
        return low

    def _admit(self, at: float) -> None:
        """Move queued sequences into free slots, in arrival order."""
        while self._waiting and self._running < self.max_num_seqs and self._admitting():
            seq = self._waiting.popleft()
            if seq.aborted:
                continue
            group = seq.group
            seq.start_step = self.step
            seq.version_min = self.version
            self._running += 1
            self._prompt_sum += group.prompt_tokens
            self._start_sum += self.step
            self._tiebreak += 1
            heapq.heappush(self._heap, (self.step + seq.length, self._tiebreak, seq))
            if group.started_at is None:
                # vLLM prefills the prompt once for all n samples (they share the prefix).
                group.started_at = self._wall(at)
                self._stall_s += self.cost.prefill_s(group.prompt_tokens)

    def _release(self, seq: _Seq) -> None:
        self._running -= 1
        self._prompt_sum -= seq.group.prompt_tokens
        self._start_sum -= seq.start_step

    def _finish_due(self, at: float) -> None:
        """Retire every sequence whose last token was generated by step ``self.step``."""
        heap = self._heap
        while heap and heap[0][0] <= self.step:
            _, _, seq = heapq.heappop(heap)
            if seq.aborted:
                continue
            self._release(seq)
            self._tokens_done += seq.length
            seq.version_max = self.version
            seq.finished_at = self._wall(at)
            seq.finished = True
            group = seq.group
            group.unfinished -= 1
            if group.unfinished == 0:
                self._outbox.append(self._group_done(group))
                del self._groups[group.request.group_id]
        self._settle()

    def _settle(self) -> None:
        """Start what was waiting for the running sequences to drain (a boundary update, a
        wait-pause)."""
        if self._running:
            return
        if self._pause_wait:
            self._pause_wait = False
            self._paused = True
            self._ack("pause", True, "paused after in-flight sequences finished")
        if self._updates and not self._syncing() and self._updates[0].mode == "boundary":
            self._sync_left_s = self._sync_seconds()

    def _sync_seconds(self) -> float:
        return self.cost.weight_sync_s

    def _finish_sync(self, at: float) -> None:
        update = self._updates.popleft()
        self._sync_left_s = None
        self.version = update.version
        self._ack("update_weights", True, f"loaded {update.path}")
        log.debug("instance %d now at weight version %d", self.instance_id, self.version)
        self._start_next_update()
        del at

    def _start_next_update(self) -> None:
        if not self._updates or self._syncing():
            return
        if self._updates[0].mode == "keep" or self._running == 0:
            self._sync_left_s = self._sync_seconds()

    # --- output -------------------------------------------------------------------------------
    def _group_done(self, group: _Group) -> GroupDone:
        request = group.request
        row = int(group.prompt.meta["trace_row"])
        lengths = [s.length for s in group.seqs]
        rng = np.random.default_rng([row, request.group_id & 0xFFFFFFFF])
        total = sum(lengths)
        # One draw per group, split into per-sample views: cheap even for long groups.
        ids = rng.integers(4, SYNTHETIC_VOCAB, size=total, dtype=np.int32)
        logprobs = (-rng.exponential(0.8, size=total)).astype(np.float32)
        cuts = np.cumsum(lengths)[:-1]
        completions = [
            Completion(
                token_ids=token_ids,
                logprobs=lp,
                version_min=seq.version_min,
                version_max=seq.version_max,
                finish_reason="length" if seq.truncated else "stop",
                reward=sim_reward(row, request.group_id, seq.index, seq.version_min, seq.truncated),
                finished_at=seq.finished_at,
            )
            for seq, token_ids, lp in zip(
                group.seqs, np.split(ids, cuts), np.split(logprobs, cuts), strict=True
            )
        ]
        return GroupDone(
            group_id=request.group_id,
            prompt_id=request.prompt_id,
            instance_id=self.instance_id,
            completions=completions,
            started_at=group.started_at or time.time(),
            finished_at=max(s.finished_at for s in group.seqs),
        )

    def _ack(self, request: str, ok: bool, detail: str = "") -> None:
        self._outbox.append(
            WorkerAck(
                instance_id=self.instance_id,
                request=request,
                ok=ok,
                weight_version=self.version,
                detail=detail,
            )
        )

    # --- messages -----------------------------------------------------------------------------
    def handle(self, message: object, now: float) -> None:
        """Apply one controller message at loop time ``now`` (after ``advance(now)``)."""
        if isinstance(message, Generate):
            self._on_generate(message, now)
        elif isinstance(message, PauseWorker):
            self._on_pause(message)
        elif isinstance(message, ResumeWorker):
            self._on_resume()
        elif isinstance(message, UpdateWeights):
            self._on_update(message)
        elif isinstance(message, AbortGroups):
            self._on_abort(message.group_ids, "aborted")
            self._ack("abort", True, f"{len(message.group_ids)} group(s)")
        elif isinstance(message, Shutdown):
            log.info("instance %d: shutdown (%s)", self.instance_id, message.reason or "-")
            self.closed = True
        else:
            self.unexpected += 1
            log.warning(
                "instance %d: unexpected %s ignored", self.instance_id, type(message).__name__
            )
        # A message may have freed or filled slots: start what can start now.
        if not self._frozen():
            self._admit(now)
            self._settle()

    def _on_generate(self, request: Generate, now: float) -> None:
        if request.group_id in self._groups:
            log.warning(
                "instance %d: group %d is already here; duplicate ignored",
                self.instance_id,
                request.group_id,
            )
            return
        prompts = self.settings.task.prompts
        prompt_id = request.prompt_id
        if not 0 <= prompt_id < len(prompts):
            # Unknown prompts still get plausible lengths rather than wedging the run.
            log.warning(
                "instance %d: prompt_id %d is outside the sim task's %d prompts; using prompt %d",
                self.instance_id,
                prompt_id,
                len(prompts),
                prompt_id % len(prompts),
            )
            prompt_id %= len(prompts)
        prompt = prompts[prompt_id]
        trace = prompt.meta["trace_lengths"]
        offset = (request.seed or 0) % len(trace)
        # The trace's prompt length, not len(prompt_token_ids): a controller may send stand-in
        # ids for sim prompts (there is no tokenizer), and prefill/context cost what the trace
        # says.
        prompt_tokens = int(prompt.meta.get("prompt_tokens") or len(request.prompt_token_ids))
        group = _Group(request=request, prompt=prompt, prompt_tokens=prompt_tokens)
        for j in range(request.n):
            wanted = int(trace[(offset + j) % len(trace)])
            length = max(1, min(wanted, request.max_tokens))
            group.seqs.append(_Seq(group, j, length, truncated=wanted > request.max_tokens))
        group.unfinished = request.n
        if request.n == 0:
            self._outbox.append(
                GroupDone(
                    group_id=request.group_id,
                    prompt_id=request.prompt_id,
                    instance_id=self.instance_id,
                    completions=[],
                    started_at=self._wall(now),
                    finished_at=self._wall(now),
                )
            )
            return
        self._groups[request.group_id] = group
        self._waiting.extend(group.seqs)

    def _on_pause(self, message: PauseWorker) -> None:
        mode = message.mode
        if mode == "keep":
            self._pause_wait = False
            self._paused = True
            self._ack("pause", True, "in-flight sequences kept")
        elif mode == "wait":
            if self._running == 0:
                self._paused = True
                self._ack("pause", True, "nothing in flight")
            else:
                self._pause_wait = True
        elif mode == "abort":
            aborted = list(self._groups)
            self._on_abort(aborted, "paused")
            self._paused = True
            self._ack("pause", True, f"{len(aborted)} group(s) aborted")
        else:
            self._ack("pause", False, f"mode {mode!r} is not one of keep, wait, abort")

    def _on_resume(self) -> None:
        if self._pause_wait:
            self._pause_wait = False
            self._ack("pause", False, "cancelled by resume before in-flight work finished")
        self._paused = False
        self._ack("resume", True)

    def _on_update(self, update: UpdateWeights) -> None:
        if update.mode not in ("boundary", "keep"):
            self._ack("update_weights", False, f"mode {update.mode!r} is not one of boundary, keep")
            return
        problem = check_weights(update.version, update.path)
        if problem:
            log.warning(
                "instance %d: update to v%d refused: %s", self.instance_id, update.version, problem
            )
            self._ack("update_weights", False, problem)
            return
        if update.version == self.version and not self._updates:
            self._ack("update_weights", True, "already at this version")
            return
        self._updates.append(update)
        self._start_next_update()

    def _on_abort(self, group_ids: list[int], reason: str) -> None:
        for group_id in group_ids:
            group = self._groups.pop(group_id, None)
            if group is None:
                continue  # finished (GroupDone already sent) or never here
            for seq in group.seqs:
                if seq.start_step >= 0 and not seq.aborted and not seq.finished:
                    self._release(seq)
                    self._tokens_done += self.step - seq.start_step
                seq.aborted = True
            self._outbox.append(
                GroupAborted(group_id=group_id, instance_id=self.instance_id, reason=reason)
            )
        self._settle()


def check_weights(version: int, path: str) -> str:
    """Why a weight file cannot be "loaded" ("" if it can). Version 0 is the initial model."""
    if version == 0:
        return ""
    file = Path(path)
    if not file.exists():
        return f"weights {path!r} do not exist"
    if file.suffix != ".json":
        return ""
    try:
        marker = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return f"weights marker {path!r} is unreadable: {exc}"
    if not isinstance(marker, dict) or marker.get("format") != SIM_WEIGHTS_FORMAT:
        return f"weights marker {path!r} is not a {SIM_WEIGHTS_FORMAT} file"
    if marker.get("version") != version:
        return f"weights marker {path!r} holds version {marker.get('version')}, not {version}"
    return ""


# --- the process -----------------------------------------------------------------------------


def controller_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


async def watch_controller(pid: int, stop: asyncio.Event) -> None:
    """Set ``stop`` when the controller process is gone: never outlive the run."""
    while not stop.is_set():
        if not controller_alive(pid):
            log.warning("controller (pid %d) is gone; stopping", pid)
            stop.set()
            return
        await asyncio.sleep(CONTROLLER_CHECK_S)


def install_stop_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, stop.set)


async def serve(config: Config, run_dir: RunDir, instance_ids: list[int]) -> int:
    """Run the given instances until all have shut down or ``stop`` fires."""
    endpoints = run_dir.read_endpoints()
    loop = asyncio.get_running_loop()
    settings = SimSettings(
        cost=CostModel(),
        time_scale=config.rollout.sim.time_scale,
        heartbeat_s=config.rollout.heartbeat_s,
        task=SimTask.from_config(config),
        clock_offset=time.time() - loop.time(),
    )
    log.info(
        "sim backend pid %d: instances %s, trace %s (%d prompts), time_scale %.3g",
        os.getpid(),
        _ranges(instance_ids),
        settings.task.source,
        len(settings.task.prompts),
        settings.time_scale,
    )
    context = zmq.asyncio.Context()
    instances = []
    for i in instance_ids:
        # A long linger lets the last acks out on a clean exit.
        socket = connect(
            context, endpoints, "rollout", Role.WORKER, identity=b"instance-%d" % i, linger_ms=1000
        )
        instances.append(SimInstance(i, socket, config.rollout.max_num_seqs_of(i), settings))

    stop = asyncio.Event()
    install_stop_signals(stop)

    async def guarded(instance: SimInstance) -> None:
        try:
            await instance.run()
        except Exception:
            # One broken instance goes quiet (the controller marks it down); the rest go on.
            log.exception("instance %d failed", instance.instance_id)

    everyone = asyncio.gather(*(guarded(inst) for inst in instances))
    watchers = [
        asyncio.create_task(watch_controller(endpoints.controller_pid, stop)),
        asyncio.create_task(stop.wait()),
    ]
    await asyncio.wait([everyone, watchers[1]], return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set():
        for instance in instances:
            instance.close()
    await everyone
    for task in watchers:
        task.cancel()
    rejected = sum(inst.guard.rejected_total for inst in instances)
    unexpected = sum(inst.unexpected for inst in instances)
    log.info(
        "sim backend exiting: %d rejected frame(s), %d unexpected message(s)", rejected, unexpected
    )
    for instance in instances:
        instance.socket.close()
    context.term()
    return 0


def _ranges(ids: list[int]) -> str:
    return f"{ids[0]}..{ids[-1]}" if ids == list(range(ids[0], ids[-1] + 1)) else str(ids)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m runtime.sim.backend",
        description="Simulated rollout instances for the run in RUN_DIR (see the module doc).",
    )
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument(
        "--instance-id",
        type=int,
        action="append",
        dest="instance_ids",
        help="host only this instance (repeatable); default: all of the run's",
    )
    args = parser.parse_args(argv)
    try:
        config = read_run_config(args.run_dir)
        run_dir = RunDir(args.run_dir)
        run_dir.read_endpoints()
        SimTask.from_config(config)  # a bad trace is reported here, before anything starts
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        print(f"sim backend: {exc}", file=sys.stderr)
        return 2
    count = config.num_instances
    ids = sorted(set(args.instance_ids)) if args.instance_ids else list(range(count))
    bad = [i for i in ids if not 0 <= i < count]
    if bad:
        print(
            f"sim backend: --instance-id {bad[0]} is out of range: the run has {count} "
            f"instance(s), ids 0..{count - 1}",
            file=sys.stderr,
        )
        return 2
    setup_logging(run_dir.log_file("sim-backend"))
    return asyncio.run(serve(config, run_dir, ids))


if __name__ == "__main__":
    sys.exit(main())
