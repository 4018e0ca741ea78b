"""The scheduler interface the controller uses, and the plan machinery the policies share.

The controller asks one question, "what next for instance i" (``next_groups``), and reports what
happened: a group finished, groups came back (aborted or lost), an instance was paused, resumed,
lost or added, the lag bound changed. A policy turns the groups' predicted lengths into a *plan*:
an ordered dispatch list per instance, cut into minibatches. ``PlannedScheduler`` serves any such
plan and repairs it online (moves pending work between instances) without replanning.
"""

from __future__ import annotations

import abc
import heapq
import itertools
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from runtime.protocol import Lane
from runtime.scheduler.cost_model import CostModel


@dataclass(frozen=True)
class InstanceSpec:
    """One rollout instance: its id and concurrency C_i (vLLM ``max_num_seqs``)."""

    instance_id: int
    max_num_seqs: int


@dataclass(frozen=True)
class GroupSpec:
    """One prompt's group of ``n`` samples, with predicted output lengths (None = unknown)."""

    prompt_id: int
    n: int
    predicted_lengths: tuple[int, ...] | None = None


class Scheduler(abc.ABC):
    """What the controller talks to. One instance per epoch (pass over the prompts)."""

    name: str = "base"
    predicted_breakdown: dict[str, float] | None = None

    @abc.abstractmethod
    def next_groups(self, instance_id: int, max_groups: int) -> list[int]:
        """Prompt ids to dispatch next on ``instance_id``: at most ``max_groups``, never crossing
        a planned minibatch boundary; ``[]`` if nothing is for it now."""

    @abc.abstractmethod
    def on_group_finished(self, prompt_id: int, instance_id: int, lengths: Sequence[int]) -> None:
        """A group came back complete with these output lengths."""

    @abc.abstractmethod
    def requeue(self, prompt_ids: Sequence[int]) -> None:
        """Aborted or lost groups come back; they are handed out again, first."""

    @abc.abstractmethod
    def on_instance_paused(self, instance_id: int) -> None: ...

    @abc.abstractmethod
    def on_instance_resumed(self, instance_id: int) -> None: ...

    @abc.abstractmethod
    def on_instance_lost(self, instance_id: int) -> None:
        """The instance is gone. Its unfinished groups come back through ``requeue``."""

    @abc.abstractmethod
    def on_instance_added(self, spec: InstanceSpec) -> None: ...

    @abc.abstractmethod
    def set_lag_bound(self, lag_bound: int) -> None: ...

    @abc.abstractmethod
    def remaining(self) -> int:
        """Groups not yet handed out."""

    def pending(self, instance_id: int) -> int:
        """Groups planned for ``instance_id`` and not yet handed out (for bubble attribution)."""
        return 0

    def priority(self, prompt_id: int, start_version: int) -> int:
        """The engine priority of ``prompt_id``'s group, started at ``start_version``, when it
        is sent now: lower runs sooner and is preempted last (``Generate.priority``; heeded under
        ``rollout.scheduling_policy: priority``)."""
        return 0

    def lane(self, instance_id: int) -> Lane:
        """What ``instance_id`` is kept for (shown per instance on the dashboard)."""
        return Lane.BULK

    def predicted_longest(self, prompt_id: int) -> float | None:
        """The prediction this policy planned ``prompt_id``'s longest sample with (None: it
        has none), to score the predictor against what comes back."""
        return None

    def repair_due(self, now: float, version: int) -> bool:
        """Whether ``repair`` has anything to decide now; cheap, as the controller asks after
        every event."""
        return False

    def repair(self, view: RolloutView) -> Sequence[Defer | Move]:
        """Online repair of running work: groups to defer (abort, regenerate later at a newer
        version: handed back through ``requeue``) or to move to another instance with their
        partial output."""
        return ()


@dataclass(frozen=True)
class Running:
    """An in-flight group as a policy sees it."""

    group_id: int
    prompt_id: int
    instance_id: int
    start_version: int
    dispatched_at: float


@dataclass(frozen=True)
class RolloutView:
    """What ``Scheduler.repair`` sees: the trainer at ``version`` with ``ready`` groups
    completed; ``running``, every group in flight (none being aborted or moved); ``waiting``,
    those of them the lag bound makes the next batch consume (empty unless the trainer waits
    on them, ``lag_wait``)."""

    now: float
    version: int
    ready: int
    batch_groups: int
    waiting: tuple[Running, ...]
    running: tuple[Running, ...] = ()


@dataclass(frozen=True)
class Defer:
    """Abort in-flight group ``group_id`` and regenerate its prompt later (counted, never
    dropped: the prompt comes back to the scheduler through ``requeue``)."""

    group_id: int
    reason: str


@dataclass(frozen=True)
class Move:
    """Move in-flight group ``group_id`` to instance ``to`` with its partial output."""

    group_id: int
    to: int
    priority: int | None = None


@dataclass(frozen=True)
class Predictions:
    """An epoch's predicted lengths as arrays, built in one pass over the groups.

    ``default`` is the median predicted sample length; unknown predictions count as it per
    sample. A prediction may carry fewer values than ``n`` (one profiled sample, say): its mean
    is scaled to ``n`` samples. ``limit`` is the longest a sample can be (the sampling
    ``max_tokens``): every prediction, the default included, is capped at it here, the one
    place, so the plan and the online layer never expect a sample the engine would cut."""

    default: float
    tokens: np.ndarray
    """Predicted output tokens per group."""
    longest: np.ndarray
    """Predicted longest sample per group."""
    limit: float = math.inf

    @classmethod
    def of(
        cls, groups: Sequence[GroupSpec], fallback: float = 512.0, limit: float | None = None
    ) -> Predictions:
        cap = math.inf if limit is None else float(limit)
        count = len(groups)
        mean = np.full(count, np.nan)
        longest = np.full(count, np.nan)
        size = np.empty(count)
        for k, g in enumerate(groups):
            size[k] = g.n
            if p := g.predicted_lengths:
                top = max(p)
                if top > cap:  # a prior from a run with a larger max_tokens
                    p, top = [min(x, cap) for x in p], cap
                mean[k] = sum(p) / len(p)
                longest[k] = top
        known = ~np.isnan(mean)
        default = min(cap, float(np.median(mean[known])) if known.any() else fallback)
        return cls(
            default,
            size * np.where(known, mean, default),
            np.where(known, longest, default),
            cap,
        )


@dataclass
class Plan:
    """Per-instance dispatch order: ``queues[i]`` are indices into the group list, in dispatch
    order, and ``cuts[i]`` the positions where a new minibatch starts (always including 0)."""

    queues: dict[int, list[int]]
    cuts: dict[int, list[int]]

    def to_rows(self, groups: Sequence[GroupSpec]) -> list[tuple[int, int, int]]:
        """``(instance, position, prompt_id)`` rows, as ``plan.csv`` holds them."""
        rows = []
        for i in sorted(self.queues):
            rows.extend((i, pos, groups[g].prompt_id) for pos, g in enumerate(self.queues[i]))
        return rows


def chunk_cuts(count: int, size: int) -> list[int]:
    """Minibatch starts for ``count`` groups in minibatches of ``size``."""
    return list(range(0, count, max(1, size)))


class PlannedScheduler(Scheduler):
    """Serves a ``Plan`` and repairs it online.

    Repair never replans: moving work off a paused or lost instance takes its pending minibatches
    (whole) and gives each to the active instance with the least predicted pending load; a
    resumed or added instance takes minibatches from the tails of the most loaded ones until the
    loads are even. Requeued groups go to the front of the least loaded instance's queue, as
    their own minibatch, because they are the oldest work and the lag bound waits on them.
    """

    def __init__(
        self,
        name: str,
        groups: Sequence[GroupSpec],
        instances: Sequence[InstanceSpec],
        plan: Plan,
        *,
        batch_groups: int,
        lag_bound: int,
        cost_model: CostModel | None = None,
        predictions: Predictions | None = None,
        steal: bool = False,
    ) -> None:
        self.name = name
        self.steal = steal
        self.groups = list(groups)
        self.specs = {s.instance_id: s for s in instances}
        self.batch_groups = batch_groups
        self.lag_bound = lag_bound
        self.cost_model = cost_model or CostModel()
        self.index = {g.prompt_id: k for k, g in enumerate(self.groups)}
        if len(self.index) != len(self.groups):
            raise ValueError("groups: prompt_id values must be unique within an epoch")
        pred = predictions or Predictions.of(self.groups)
        self.tokens = pred.tokens
        self.longest = pred.longest
        # Each instance's pending work is a deque of minibatches (deques of group indices).
        self.queues: dict[int, deque[deque[int]]] = {}
        for i in self.specs:
            q, cuts = plan.queues.get(i, []), plan.cuts.get(i, [0])
            bounds = [*cuts, len(q)]
            self.queues[i] = deque(deque(q[a:b]) for a, b in itertools.pairwise(bounds) if b > a)
        self.load = {}
        self._pending = {}
        for i, qq in self.queues.items():
            flat = [g for mb in qq for g in mb]
            self.load[i] = float(self.tokens[flat].sum()) if flat else 0.0
            self._pending[i] = len(flat)
        self.active = set(self.specs)
        self.handed: dict[int, int] = {}  # group index -> instance, while out
        self.observed: dict[int, tuple[int, ...]] = {}
        self.predicted_breakdown = None

    # --- dispatch -----------------------------------------------------------------------------
    def next_groups(self, instance_id: int, max_groups: int) -> list[int]:
        if instance_id not in self.active or max_groups <= 0:
            return []
        q = self.queues.get(instance_id)
        if not q and self.steal:
            self._steal_into(instance_id)
        if not q:
            return []
        mb = q[0]
        out = []
        while mb and len(out) < max_groups:
            g = mb.popleft()
            out.append(g)
            self.load[instance_id] -= self.tokens[g]
            self.handed[g] = instance_id
        self._pending[instance_id] -= len(out)
        if not mb:
            q.popleft()
        return [self.groups[g].prompt_id for g in out]

    def _steal_into(self, instance_id: int) -> None:
        """Online repair at the end of a plan: an instance that ran out takes the last pending
        minibatch of the instance with the most predicted work left (which would otherwise
        leave it idle while that one catches up)."""
        donors = [i for i in self.active if i != instance_id and len(self.queues[i]) >= 2]
        if not donors:
            return
        donor = max(donors, key=lambda i: self.load[i])
        mb = self.queues[donor].pop()
        cost = float(sum(self.tokens[g] for g in mb))
        self.load[donor] -= cost
        self.load[instance_id] += cost
        self._pending[donor] -= len(mb)
        self._pending[instance_id] += len(mb)
        self.queues[instance_id].append(mb)

    def on_group_finished(self, prompt_id: int, instance_id: int, lengths: Sequence[int]) -> None:
        g = self.index.get(prompt_id)
        if g is None:
            return
        self.handed.pop(g, None)
        self.observed[prompt_id] = tuple(int(x) for x in lengths)

    def requeue(self, prompt_ids: Sequence[int]) -> None:
        idx = [self.index[p] for p in prompt_ids if p in self.index]
        for g in idx:
            self.handed.pop(g, None)
        if not idx:
            return
        targets = sorted(self.active) or sorted(self.specs)
        # Spread the returned groups over the least loaded instances, one minibatch each.
        per: dict[int, deque[int]] = {}
        for g in sorted(idx, key=lambda g: -self.tokens[g]):
            i = min(targets, key=lambda i: self.load[i])
            per.setdefault(i, deque()).append(g)
            self.load[i] += self.tokens[g]
        for i, mb in per.items():
            self.queues[i].appendleft(mb)
            self._pending[i] += len(mb)

    def pending(self, instance_id: int) -> int:
        return self._pending.get(instance_id, 0)

    def predicted_longest(self, prompt_id: int) -> float | None:
        g = self.index.get(prompt_id)
        return None if g is None else float(self.longest[g])

    def remaining(self) -> int:
        return sum(self._pending.values())

    def pending_groups(self) -> list[int]:
        """Prompt ids not yet handed out (any instance)."""
        return [self.groups[g].prompt_id for q in self.queues.values() for mb in q for g in mb]

    # --- repair -------------------------------------------------------------------------------
    def _drain(self, instance_id: int) -> None:
        """Move every pending minibatch of ``instance_id`` onto the active instances."""
        q = self.queues.get(instance_id)
        targets = sorted(self.active - {instance_id})
        if not q or not targets:
            return
        heap = [(self.load[i], i) for i in targets]
        heapq.heapify(heap)
        # Interleave by position: the k-th minibatch goes to the k-th least loaded target, so
        # early work stays early.
        moved: dict[int, list[deque[int]]] = {}
        while q:
            mb = q.popleft()
            load, i = heapq.heappop(heap)
            cost = float(sum(self.tokens[g] for g in mb))
            moved.setdefault(i, []).append(mb)
            heapq.heappush(heap, (load + cost, i))
        for i, mbs in moved.items():
            self.queues[i].extend(mbs)
            self.load[i] += float(sum(self.tokens[g] for mb in mbs for g in mb))
            self._pending[i] += sum(len(mb) for mb in mbs)
        self.load[instance_id] = 0.0
        self._pending[instance_id] = 0

    def _fill(self, instance_id: int) -> None:
        """Give ``instance_id`` minibatches from the tails of the most loaded active instances."""
        others = sorted(self.active - {instance_id})
        if not others:
            return
        total = sum(self.load[i] for i in others) + self.load[instance_id]
        fair = total / (len(others) + 1)
        taken: list[deque[int]] = []
        while self.load[instance_id] < fair:
            donor = max(others, key=lambda i: self.load[i])
            if len(self.queues[donor]) <= 1 or self.load[donor] <= fair:
                break
            mb = self.queues[donor].pop()
            cost = float(sum(self.tokens[g] for g in mb))
            self.load[donor] -= cost
            self.load[instance_id] += cost
            self._pending[donor] -= len(mb)
            self._pending[instance_id] += len(mb)
            taken.append(mb)
        # Tails are the latest work: keep their relative order.
        self.queues[instance_id].extend(reversed(taken))

    def on_instance_paused(self, instance_id: int) -> None:
        if instance_id in self.active:
            self.active.discard(instance_id)
            self._drain(instance_id)

    def on_instance_resumed(self, instance_id: int) -> None:
        if instance_id in self.specs and instance_id not in self.active:
            self.active.add(instance_id)
            self._fill(instance_id)

    def on_instance_lost(self, instance_id: int) -> None:
        self.on_instance_paused(instance_id)

    def on_instance_added(self, spec: InstanceSpec) -> None:
        self.specs[spec.instance_id] = spec
        self.queues.setdefault(spec.instance_id, deque())
        self.load.setdefault(spec.instance_id, 0.0)
        self._pending.setdefault(spec.instance_id, 0)
        self.active.add(spec.instance_id)
        self._fill(spec.instance_id)

    def set_lag_bound(self, lag_bound: int) -> None:
        if lag_bound < 0:
            raise ValueError(f"lag_bound: {lag_bound} must be >= 0")
        self.lag_bound = lag_bound
