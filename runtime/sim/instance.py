"""The continuous-batching instance model: one simulated vLLM instance, sans-IO.

:class:`InstanceModel` is the one model of an inference engine in the tree. The ``sim`` rollout
backend (:mod:`runtime.sim.backend`) wraps it in sockets and an asyncio loop; the simulator
drives it on a simulated clock. It has no sockets, no tasks and no clock of its own: every
method takes ``now`` in **simulated seconds**, and the timestamps it writes into messages
(``started_at``, ``finished_at``, ``Heartbeat.time``) are ``stamp(now)``, a function the caller
injects (the backend maps simulated seconds to wall time, the simulator keeps them).

The protocol with its driver: ``handle(message, now)`` applies a controller message;
``advance(now)`` brings the simulation forward; ``next_event(now)`` is the time of the next
thing that happens on its own (a finish, a stall or a load ending; ``inf`` if none);
``take_output()`` returns the messages produced since the last call (``GroupDone``,
``GroupAborted``, ``WorkerAck``).

How it simulates vLLM (no model runs):

- **Content.** What a group generates (output lengths, prompt length, rewards, token payloads)
  comes from an :class:`Outputs`: :class:`TraceOutputs` reads the sim task's trace rows (the
  backend), :class:`TableOutputs` a table of lengths per prompt (the simulator). Lengths are
  capped at ``max_tokens`` (``finish_reason`` "length" when cut) and are at least 1.
- **Time.** Continuous batching with ``max_num_seqs`` slots: queued sequences take free slots
  in arrival order, or under ``scheduling_policy="priority"`` lowest ``Generate.priority``
  first (arrival order among equals), as vLLM's waiting queue; a group's first admission
  stalls the batch for ``prefill_s(prompt)`` (vLLM prefills the shared prompt once for its
  ``n`` samples); every decode step advances each
  running sequence by one token and lasts ``CostModel.decode_step_s(running, context)``.
  Nothing ticks per token: while the running set is fixed, the time to the next finish is one
  closed-form sum (``decode_steps_s``); when a message arrives mid-way, a binary search finds
  how many whole steps fit and the partial step's progress is carried, not lost.
- **Weights.** ``UpdateWeights`` takes ``CostModel.weight_sync_s``. ``boundary`` waits for the
  in-flight sequences to finish (no new ones start), so no sample spans versions; ``keep``
  freezes them in place, loads, and lets them continue, so their ``version_max`` is the new
  one. Whether a weight file can be loaded is asked of an injected ``check_weights`` (the
  backend checks the file; the simulator has none and accepts every version).
- **Pause.** ``keep`` freezes in-flight sequences until ``ResumeWorker``; ``wait`` stops
  admitting and pauses once the running ones finish; ``abort`` aborts every group first.
- **Migration.** ``AbortGroups(partial=True)`` reports each sample's output so far in
  ``GroupAborted.partial``; a ``Generate`` with that as ``prefix`` continues each unfinished
  sample for the length it has left (its content the same as had it never stopped, given the
  same group id, seed and max_tokens), returns finished ones as they are, and stalls for the
  prefill of prompt plus prefixes (an approximation: vLLM shares the prompt's KV, not the
  prefixes').
"""

from __future__ import annotations

import heapq
import logging
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np

from runtime.protocol import (
    AbortGroups,
    Completion,
    Generate,
    GroupAborted,
    GroupDone,
    Heartbeat,
    PartialSample,
    PauseWorker,
    ResumeWorker,
    Shutdown,
    UpdateWeights,
    WorkerAck,
    WorkerHello,
)
from runtime.scheduler.cost_model import CostModel
from runtime.tasks.sim_task import SYNTHETIC_VOCAB, SimTask, sim_reward

log = logging.getLogger("runtime.sim.instance")

_EPS = 1e-9

Payload = Literal["random", "light"]
"""``random``: token ids and log-probs drawn per group (deterministic; what a trainer can train
on). ``light``: read-only views of one shared buffer (token id 4, log-prob 0.0), for the
simulator, which only needs their lengths."""

RewardFn = Callable[[int, int, int, int, bool], float]
"""``(key, group_id, sample, version, truncated) -> reward``, as :func:`sim_reward`."""

LIGHT_TOKEN_ID = 4
"""The token id of light payloads: the first id after the four special ones."""


# --- what a group generates ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GroupShape:
    """What one ``Generate`` will produce."""

    prompt_tokens: int
    lengths: list[int]
    """Output length of each sample, capped at ``max_tokens``, at least 1."""
    truncated: list[bool]
    """Whether the sample was cut at ``max_tokens``."""
    key: int
    """Seeds rewards and random payloads: the trace row (backend) or the prompt id."""


def capped_shape(
    prompt_tokens: int, wanted: Sequence[int], max_tokens: int, key: int
) -> GroupShape:
    """The shape of samples that want ``wanted`` tokens under ``max_tokens``."""
    wanted = [int(w) for w in wanted]
    return GroupShape(
        prompt_tokens=prompt_tokens,
        lengths=[w if 0 < w < max_tokens else max(1, min(w, max_tokens)) for w in wanted],
        truncated=[w > max_tokens for w in wanted],
        key=key,
    )


class _LightBuffers:
    """One growing read-only buffer of token ids and one of log-probs; payloads are views."""

    def __init__(self) -> None:
        self.ids = np.zeros(0, dtype=np.int32)
        self.logprobs = np.zeros(0, dtype=np.float32)

    def views(self, lengths: Sequence[int]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        longest = max(lengths, default=0)
        if longest > self.ids.size:
            size = max(longest, 2 * self.ids.size, 4096)
            self.ids = np.full(size, LIGHT_TOKEN_ID, dtype=np.int32)
            self.logprobs = np.zeros(size, dtype=np.float32)
            self.ids.flags.writeable = False
            self.logprobs.flags.writeable = False
        ids, logprobs = self.ids, self.logprobs
        return [ids[:n] for n in lengths], [logprobs[:n] for n in lengths]


_LIGHT = _LightBuffers()


def random_payload(
    key: int, group_id: int, lengths: Sequence[int]
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Token ids in [4, SYNTHETIC_VOCAB) and negative log-probs, deterministic per (key, group).
    One draw per group, split into per-sample views: cheap even for long groups."""
    rng = np.random.default_rng([key, group_id & 0xFFFFFFFF])
    total = sum(lengths)
    ids = rng.integers(4, SYNTHETIC_VOCAB, size=total, dtype=np.int32)
    logprobs = (-rng.exponential(0.8, size=total)).astype(np.float32)
    cuts = np.cumsum(lengths)[:-1]
    return np.split(ids, cuts), np.split(logprobs, cuts)


class Outputs:
    """Where a group's content comes from; subclasses say how long its samples are."""

    def __init__(self, payload: Payload = "random", reward: RewardFn | None = sim_reward) -> None:
        if payload not in ("random", "light"):
            raise ValueError(f"payload: {payload!r} is not one of random, light")
        self.payload = payload
        self.reward_fn = reward

    def shape(self, request: Generate) -> GroupShape:
        raise NotImplementedError

    def tokens(self, shape: GroupShape, group_id: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Per sample: token ids and behaviour log-probs, of the shape's lengths."""
        if self.payload == "light":
            return _LIGHT.views(shape.lengths)
        return random_payload(shape.key, group_id, shape.lengths)

    def reward(self, key: int, group_id: int, sample: int, version: int, truncated: bool) -> float:
        if self.reward_fn is None:
            return 0.0
        return self.reward_fn(key, group_id, sample, version, truncated)


class TraceOutputs(Outputs):
    """The sim task's trace (the backend): sample ``j`` of prompt ``p`` gets the trace row's
    sample ``(offset + j) mod S``, ``offset = seed mod S`` (0 without a seed); the prompt
    length is the trace's (a controller may send stand-in ids for sim prompts)."""

    def __init__(self, task: SimTask, payload: Payload = "random") -> None:
        super().__init__(payload)
        self.task = task

    def shape(self, request: Generate) -> GroupShape:
        prompts = self.task.prompts
        prompt_id = request.prompt_id
        if not 0 <= prompt_id < len(prompts):
            # Unknown prompts still get plausible lengths rather than wedging the run.
            log.warning(
                "prompt_id %d is outside the sim task's %d prompts; using prompt %d",
                prompt_id,
                len(prompts),
                prompt_id % len(prompts),
            )
            prompt_id %= len(prompts)
        meta = prompts[prompt_id].meta
        trace = meta["trace_lengths"]
        offset = (request.seed or 0) % len(trace)
        wanted = [trace[(offset + j) % len(trace)] for j in range(request.n)]
        prompt_tokens = int(meta.get("prompt_tokens") or len(request.prompt_token_ids))
        return capped_shape(prompt_tokens, wanted, request.max_tokens, int(meta["trace_row"]))


class TableOutputs(Outputs):
    """A table of lengths per prompt (the simulator): sample ``j`` of prompt ``p`` gets
    ``lengths[p][j]`` (cycling if ``n`` is larger); prompt lengths from ``prompt_tokens``
    (0 where missing). Payloads are light unless asked otherwise."""

    def __init__(
        self,
        lengths: Mapping[int, Sequence[int]],
        prompt_tokens: Mapping[int, int] | None = None,
        payload: Payload = "light",
        reward: RewardFn | None = sim_reward,
    ) -> None:
        super().__init__(payload, reward)
        self.lengths = lengths
        self.prompt_tokens = prompt_tokens or {}

    def shape(self, request: Generate) -> GroupShape:
        table = self.lengths.get(request.prompt_id)
        if not table:
            raise ValueError(f"prompt_id {request.prompt_id} has no lengths in the table")
        size = len(table)
        wanted = (
            table[: request.n] if request.n <= size else [table[j % size] for j in range(request.n)]
        )
        prompt_tokens = int(self.prompt_tokens.get(request.prompt_id, 0))
        return capped_shape(prompt_tokens, wanted, request.max_tokens, request.prompt_id)


# --- the model ----------------------------------------------------------------------------------


def _sequences(group: _Group) -> list[_Seq]:
    """A group's sequences: fresh, or continuing ``Generate.prefix`` (a finished prefix, or one
    with no ``max_tokens`` left, is a finished sequence that generates nothing here)."""
    request, shape = group.request, group.shape
    if request.prefix is None:
        return [
            _Seq(group, j, length, truncated)
            for j, (length, truncated) in enumerate(
                zip(shape.lengths, shape.truncated, strict=True)
            )
        ]
    seqs = []
    for j, (full, truncated, prefix) in enumerate(
        zip(shape.lengths, shape.truncated, request.prefix, strict=True)
    ):
        carried = len(prefix.token_ids)
        left = request.max_tokens - carried
        seq = _Seq(group, j, 0, prefix.finish_reason == "length", carried)
        seq.version_min = seq.version_max = prefix.version_min
        if prefix.finish_reason != "abort" or left <= 0:
            seq.finished, seq.finished_at = True, prefix.finished_at
            seq.truncated = seq.truncated or prefix.finish_reason == "abort"
            seq.version_max = prefix.version_max
        elif full > carried:
            seq.length, seq.truncated = full - carried, truncated
        else:  # the trace wants no more than it has: one token, then it stops (or is cut)
            seq.length, seq.truncated = 1, left == 1
        seqs.append(seq)
    return seqs


def _finish_reason(seq: _Seq) -> str:
    if seq.finished and seq.length == 0 and seq.group.request.prefix is not None:
        reason = seq.group.request.prefix[seq.index].finish_reason
        return reason if reason != "abort" else "length"
    return "length" if seq.truncated else "stop"


def _contents(outputs: Outputs, group: _Group) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per sample, the whole completion's token ids and log-probs (the prefix's first)."""
    lengths = [seq.carried + seq.length for seq in group.seqs]
    shape = group.shape if group.request.prefix is None else replace(group.shape, lengths=lengths)
    ids, logprobs = outputs.tokens(shape, group.request.group_id)
    if group.request.prefix is None:
        return ids, logprobs
    for j, prefix in enumerate(group.request.prefix):
        if len(prefix.token_ids):
            tail = slice(len(prefix.token_ids), None)
            ids[j] = np.concatenate([prefix.token_ids, ids[j][tail]]).astype(np.int32)
            logprobs[j] = np.concatenate([prefix.logprobs, logprobs[j][tail]]).astype(np.float32)
    return ids, logprobs


@dataclass(eq=False, slots=True)
class _Group:
    request: Generate
    shape: GroupShape
    seqs: list[_Seq] = field(default_factory=list)
    started_at: float | None = None
    unfinished: int = 0


@dataclass(eq=False, slots=True)
class _Seq:
    group: _Group
    index: int
    length: int
    """Tokens to generate here (after ``carried``)."""
    truncated: bool
    carried: int = 0
    """Tokens generated elsewhere before a migration (``Generate.prefix``)."""
    start_step: int = -1
    version_min: int = 0
    version_max: int = 0
    finished_at: float = 0.0
    finished: bool = False
    aborted: bool = False


def _partial(group: _Group, outputs: Outputs, step: int, version: int) -> list[PartialSample]:
    """Each sample's output so far (prefix included), as ``GroupAborted.partial``, at decode
    step ``step`` of an instance at weight ``version``."""
    ids, logprobs = _contents(outputs, group)
    out = []
    for seq, token_ids, lp in zip(group.seqs, ids, logprobs, strict=True):
        if seq.finished:
            made, reason = seq.length, _finish_reason(seq)
        else:
            made, reason = (step - seq.start_step if seq.start_step >= 0 else 0), "abort"
        low = seq.version_min if made or seq.carried else version
        if made:
            high = seq.version_max if seq.finished else version
        else:  # nothing generated here: the prefix's span, if any
            prefix = group.request.prefix[seq.index] if seq.carried else None
            high = prefix.version_max if prefix is not None else low
        out.append(
            PartialSample(
                token_ids=token_ids[: seq.carried + made],
                logprobs=lp[: seq.carried + made],
                version_min=low,
                version_max=high,
                finish_reason=reason,
                finished_at=seq.finished_at if seq.finished else 0.0,
            )
        )
    return out


def _same(now: float) -> float:
    return now


class InstanceModel:
    """One simulated vLLM instance; see the module doc. Times are simulated seconds."""

    def __init__(
        self,
        instance_id: int,
        max_num_seqs: int,
        cost: CostModel,
        outputs: Outputs,
        *,
        stamp: Callable[[float], float] = _same,
        check_weights: Callable[[int, str], str] | None = None,
        scheduling_policy: str = "fcfs",
    ) -> None:
        if scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy: {scheduling_policy!r} is not fcfs or priority")
        self.instance_id = instance_id
        self.max_num_seqs = max_num_seqs
        self.cost = cost
        self.outputs = outputs
        self.stamp = stamp
        """Simulated seconds -> the timestamps written into messages."""
        self.check_weights = check_weights
        """``(version, path) -> why it cannot be loaded ("" if it can)``; None accepts all."""
        self.state = "starting"
        self.version = 0
        self.closed = False
        """Set by ``Shutdown``."""
        self.unexpected = 0
        # Simulation state. ``step`` counts decode steps; a running sequence has generated
        # ``step - start_step`` tokens and finishes at ``start_step + length``.
        self.step = 0
        self._heap: list[tuple[int, int, _Seq]] = []
        self._tiebreak = 0
        self._running = 0
        self._queued = 0
        self._prompt_sum = 0
        self._start_sum = 0
        self._tokens_done = 0
        self._by_priority = scheduling_policy == "priority"
        self._waiting: list[tuple[int, int, _Seq]] = []
        """Queued sequences, a heap by (priority under ``priority``, else 0; arrival)."""
        self._arrivals = 0
        self._groups: dict[int, _Group] = {}
        self._stall_s = 0.0
        self._carry_s = 0.0
        self._last = 0.0
        # Control state.
        self._paused = False
        self._pause_wait = False
        self._updates: deque[UpdateWeights] = deque()
        self._sync_left_s: float | None = None
        self._outbox: list[object] = []

    # --- derived quantities -------------------------------------------------------------------
    @property
    def running_seqs(self) -> int:
        """Sequences holding a slot (decoding, or frozen by a pause or a keep update)."""
        return self._running

    @property
    def queued_seqs(self) -> int:
        """Sequences received but not yet in a slot."""
        return self._queued

    @property
    def groups_in_flight(self) -> int:
        """Groups received and neither finished nor aborted."""
        return len(self._groups)

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

    @property
    def reported_state(self) -> str:
        """The state a heartbeat reports: starting, syncing, paused or running."""
        if self.state == "starting":
            return "starting"
        if self._syncing():
            return "syncing"
        return "paused" if self._paused else "running"

    def hello(self, pid: int = 0) -> WorkerHello:
        """What the instance says when it is up (``pid``: the process hosting it, if any)."""
        return WorkerHello(
            instance_id=self.instance_id,
            max_num_seqs=self.max_num_seqs,
            weight_version=self.version,
            pid=pid,
            backend="sim",
        )

    def heartbeat(self, now: float) -> Heartbeat:
        return Heartbeat(
            instance_id=self.instance_id,
            state=self.reported_state,
            weight_version=self.version,
            running_seqs=self._running,
            tokens_generated=self.tokens_generated,
            time=self.stamp(now),
        )

    def has_output(self) -> bool:
        """Whether ``take_output`` would return something."""
        return bool(self._outbox)

    def take_output(self) -> list[object]:
        """Messages produced since the last call (GroupDone, GroupAborted, WorkerAck)."""
        out, self._outbox = self._outbox, []
        return out

    # --- simulated time -----------------------------------------------------------------------
    def start(self, now: float) -> None:
        """The engine is up at ``now`` (after its start-up)."""
        self._last = now
        self.state = "running"

    def next_event(self, now: float) -> float:
        """Time of the next thing that happens on its own (a finish, a sync completing), given
        that the model was brought to ``now``; ``inf`` if nothing will."""
        if self._syncing():
            return now + max(0.0, self._sync_left_s or 0.0)
        if self._frozen() or self._running == 0:
            return math.inf
        k = self._steps_to_next_finish()
        sim = self._stall_s + self.cost.decode_steps_s(k, self._running, self._context())
        return now + max(0.0, sim - self._carry_s)

    def _steps_to_next_finish(self) -> int:
        heap = self._heap
        while heap and heap[0][2].aborted:
            heapq.heappop(heap)
        return max(1, heap[0][0] - self.step)

    def advance(self, now: float) -> None:
        """Bring the simulation forward to ``now``."""
        carried = self._carry_s
        budget = (now - self._last) + carried
        self._last = now
        self._carry_s = 0.0
        if self.state == "starting":
            return
        while True:
            if self._syncing():
                used = min(budget, self._sync_left_s or 0.0)
                self._sync_left_s = (self._sync_left_s or 0.0) - used
                budget -= used
                if self._sync_left_s > _EPS:
                    return
                self._finish_sync()
                continue
            if self._paused:
                # The partial step in progress resumes with the sequences (keep mode).
                self._carry_s = min(carried, max(budget, 0.0))
                return
            if self._waiting and self._running < self.max_num_seqs:
                self._admit(now - budget if budget > 0.0 else now)  # the point reached so far
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
                self._finish_due(now - budget if budget > 0.0 else now)
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
        if not self._admitting():
            return
        waiting, heap, cost = self._waiting, self._heap, self.cost
        while waiting and self._running < self.max_num_seqs:
            seq = heapq.heappop(waiting)[2]
            if seq.aborted:
                continue
            self._queued -= 1
            group = seq.group
            seq.start_step = self.step
            if not seq.carried:  # a continued sample keeps its prefix's version_min
                seq.version_min = self.version
            self._running += 1
            self._prompt_sum += group.shape.prompt_tokens + seq.carried
            self._start_sum += self.step
            self._tiebreak += 1
            heapq.heappush(heap, (self.step + seq.length, self._tiebreak, seq))
            if group.started_at is None:
                # vLLM prefills the prompt once for all n samples (they share the prefix).
                group.started_at = self.stamp(at)
                carried = sum(s.carried for s in group.seqs if not s.finished)
                self._stall_s += cost.prefill_s(group.shape.prompt_tokens + carried)

    def _release(self, seq: _Seq) -> None:
        self._running -= 1
        self._prompt_sum -= seq.group.shape.prompt_tokens + seq.carried
        self._start_sum -= seq.start_step

    def _finish_due(self, at: float) -> None:
        """Retire every sequence whose last token was generated by step ``self.step``."""
        heap, step, version = self._heap, self.step, self.version
        stamp = self.stamp(at)
        while heap and heap[0][0] <= step:
            seq = heapq.heappop(heap)[2]
            if seq.aborted:
                continue
            self._release(seq)
            self._tokens_done += seq.length
            seq.version_max = version
            seq.finished_at = stamp
            seq.finished = True
            group = seq.group
            group.unfinished -= 1
            if group.unfinished == 0:
                self._outbox.append(self._group_done(group, stamp))
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
            self._sync_left_s = self.cost.weight_sync_s

    def _finish_sync(self) -> None:
        update = self._updates.popleft()
        self._sync_left_s = None
        self.version = update.version
        self._ack("update_weights", True, f"loaded {update.path}")
        log.debug("instance %d now at weight version %d", self.instance_id, self.version)
        self._start_next_update()

    def _start_next_update(self) -> None:
        if not self._updates or self._syncing():
            return
        if self._updates[0].mode == "keep" or self._running == 0:
            self._sync_left_s = self.cost.weight_sync_s

    # --- output -------------------------------------------------------------------------------
    def _group_done(self, group: _Group, finished_at: float) -> GroupDone:
        request, shape = group.request, group.shape
        reward = self.outputs.reward
        ids, logprobs = _contents(self.outputs, group)
        completions = [
            Completion(
                token_ids=token_ids,
                logprobs=lp,
                version_min=seq.version_min,
                version_max=seq.version_max,
                finish_reason=_finish_reason(seq),
                reward=reward(
                    shape.key, request.group_id, seq.index, seq.version_min, seq.truncated
                ),
                finished_at=seq.finished_at,
            )
            for seq, token_ids, lp in zip(group.seqs, ids, logprobs, strict=True)
        ]
        return GroupDone(
            group_id=request.group_id,
            prompt_id=request.prompt_id,
            instance_id=self.instance_id,
            completions=completions,
            started_at=group.started_at if group.started_at is not None else self.stamp(self._last),
            finished_at=finished_at,
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
        """Apply one controller message at ``now`` (the model is first brought to ``now``)."""
        if now > self._last:
            self.advance(now)
        if isinstance(message, Generate):
            self._on_generate(message, now)
        elif isinstance(message, PauseWorker):
            self._on_pause(message)
        elif isinstance(message, ResumeWorker):
            self._on_resume()
        elif isinstance(message, UpdateWeights):
            self._on_update(message)
        elif isinstance(message, AbortGroups):
            self._on_abort(message.group_ids, "aborted", message.partial)
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
        if request.n == 0:
            self._outbox.append(
                GroupDone(
                    group_id=request.group_id,
                    prompt_id=request.prompt_id,
                    instance_id=self.instance_id,
                    completions=[],
                    started_at=self.stamp(now),
                    finished_at=self.stamp(now),
                )
            )
            return
        if request.prefix is not None and len(request.prefix) != request.n:
            reason = f"failed: {len(request.prefix)} prefixes for a group of n = {request.n}"
            self._outbox.append(
                GroupAborted(group_id=request.group_id, instance_id=self.instance_id, reason=reason)
            )
            return
        shape = self.outputs.shape(request)
        group = _Group(request=request, shape=shape)
        group.seqs = _sequences(group)
        waiting = [seq for seq in group.seqs if not seq.finished]
        group.unfinished = len(waiting)
        if not waiting:
            self._outbox.append(self._group_done(group, self.stamp(now)))
            return
        self._groups[request.group_id] = group
        priority = request.priority if self._by_priority else 0
        for seq in waiting:
            self._arrivals += 1
            heapq.heappush(self._waiting, (priority, self._arrivals, seq))
        self._queued += len(waiting)

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
        problem = self.check_weights(update.version, update.path) if self.check_weights else ""
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

    def _on_abort(self, group_ids: Sequence[int], reason: str, partial: bool = False) -> None:
        for group_id in group_ids:
            group = self._groups.pop(group_id, None)
            if group is None:
                continue  # finished (GroupDone already sent) or never here
            report = _partial(group, self.outputs, self.step, self.version) if partial else None
            for seq in group.seqs:
                if seq.aborted or seq.finished:
                    continue
                if seq.start_step >= 0:
                    self._release(seq)
                    self._tokens_done += self.step - seq.start_step
                else:
                    self._queued -= 1
                seq.aborted = True
            self._outbox.append(
                GroupAborted(
                    group_id=group_id, instance_id=self.instance_id, reason=reason, partial=report
                )
            )
        self._settle()


__all__ = [
    "GroupShape",
    "InstanceModel",
    "Outputs",
    "Payload",
    "TableOutputs",
    "TraceOutputs",
    "capped_shape",
    "random_payload",
]
