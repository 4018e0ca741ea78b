"""The lag governor: admission control and batch forming under a policy-lag bound (DESIGN.md §4).

A pure state machine with no I/O and no clock, so it can be property-tested alone. The controller
tells it what happened (a group was admitted, completed, cancelled; the trainer stepped; the
operator changed the bound) and asks it two questions: "may I dispatch to an instance at weight
version v?" (:meth:`LagGovernor.admissible`) and "what is the batch for the trainer now?"
(:meth:`LagGovernor.take_batch`).

Notation: ``s`` = trainer version = steps taken; ``B`` = groups per batch; ``η`` = lag bound. A
group's *start version* is the weight version of the instance it was dispatched to (conservative;
a completion that reports an older ``version_min`` lowers it). A group consumed by the step taken
at version ``s`` has lag ``s − start``. The next consumption happens at ``c = s`` while no batch
is out, and at ``c = s + 1`` while the trainer is stepping on one.

Rules, exactly as implemented:

1. Admission (AReaL's rule plus a staleness guard). A group may be admitted at trainer version
   ``s`` to an instance at version ``v`` only while
   ``admitted − discarded − requeued − aborted < (s + η_adm + 1)·B`` and ``v + η_adm ≥ c``
   (otherwise it would exceed the bound at the earliest step that could consume it).
   ``η_adm`` is the newest bound the operator set (a decrease applies to admission at once).
2. Batch forming at version ``s`` under the bound in force ``η``: the *mandatory* groups are the
   unconsumed ones (in flight or completed) with ``start ≤ s − η``: left for a later step they
   would exceed the bound. If there are at most ``B`` of them the trainer waits (``lag_wait``)
   until all are completed, and the batch is the ``B`` completed groups with the oldest start
   versions (which include every mandatory one); with fewer than ``B`` completed it waits
   (``starved``). If more than ``B`` are mandatory, the batch is the ``B`` oldest completed ones
   as soon as ``B`` have completed, and the others are explicitly discarded (completed) or
   aborted (in flight) for regeneration.
3. A completion whose start version already exceeds the bound at ``c`` (only possible when a
   worker reports an older ``version_min`` than it was dispatched at) is discarded, never
   consumed.
4. ``set_lag_bound``: an increase applies at once. A decrease with ``wait`` applies to admission
   at once, while consumption keeps the old bound (``pending_lag_bound``) until no unconsumed
   group would violate the new one (every start ``≥ c − η_new``). With ``abort``, unconsumed
   groups with ``start < c − η_new`` are aborted (in flight) or discarded (completed), and the
   new bound is in force at once.

Invariant (what the property tests check): no consumed group has lag > the bound in force for
its step, no group is consumed twice, and every admitted group ends consumed, discarded, aborted
or requeued, or is still unconsumed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

IN_FLIGHT = "in_flight"
COMPLETED = "completed"
CONSUMED = "consumed"
DISCARDED = "discarded"
ABORTED = "aborted"
REQUEUED = "requeued"
SKIPPED = "skipped"
"""A group whose reward failed, dropped under ``task.on_reward_error: skip_group``."""
_OPEN = (IN_FLIGHT, COMPLETED)


@dataclass(eq=False)
class GroupRecord:
    """One dispatched group: the only record of it. The governor indexes the open ones, the
    instance it runs on the ones out there (until an abort is confirmed); ``result`` holds the
    completions while it waits in the training queue."""

    group_id: int
    prompt_id: int
    start_version: int
    instance_id: int = -1
    epoch: int = 0
    dispatched_at: float = 0.0
    status: str = IN_FLIGHT
    aborting: bool = False
    """Stopped by the controller (AbortGroups sent); its slots stay busy until confirmed."""
    version_min: int | None = None
    version_max: int | None = None
    completed_seq: int = 0
    consumed_step: int | None = None
    result: Any = None
    """The ``GroupDone`` while the group is completed and not yet consumed."""
    predicted_longest: float | None = None
    """The scheduler's prediction of its longest sample, read at dispatch (None: it had none),
    scored against what came when the group is consumed."""

    @property
    def sort_key(self) -> tuple[int, int, int]:
        """Oldest start version first, then completion order, then id (deterministic)."""
        return (self.start_version, self.completed_seq, self.group_id)


def _oldest_first(g: GroupRecord) -> tuple[int, int, int]:
    return g.sort_key


@dataclass(frozen=True)
class BatchPlan:
    """The answer to "what does the trainer get now?".

    ``condition`` is ``ready`` (``group_ids`` hold the batch, already marked consumed),
    ``starved`` (fewer than B completed groups) or ``lag_wait`` (a mandatory group is still in
    flight; ``waiting_for`` names them). ``discarded``/``aborted`` list groups the governor
    gave up on (they must be re-queued by the caller, and aborted ones stopped on their
    instance).
    """

    condition: str
    version: int
    group_ids: tuple[int, ...] = ()
    discarded: tuple[int, ...] = ()
    aborted: tuple[int, ...] = ()
    detail: str = ""
    discarded_records: tuple[GroupRecord, ...] = ()
    """The records behind ``discarded`` (the governor lets go of them)."""
    find_waiting: Callable[[], tuple[int, ...]] | None = field(default=None, repr=False)

    @property
    def waiting_for(self) -> tuple[int, ...]:
        """The in-flight groups a ``lag_wait`` plan waits for (looked up when asked: most
        plans are never asked)."""
        return self.find_waiting() if self.find_waiting is not None else ()

    @property
    def ready(self) -> bool:
        return self.condition == "ready"


@dataclass(frozen=True)
class BoundChange:
    """What ``set_lag_bound`` did."""

    old: int
    new: int
    mode: str
    in_force: int
    pending: int | None
    discarded: tuple[int, ...] = ()
    aborted: tuple[int, ...] = ()
    discarded_records: tuple[GroupRecord, ...] = ()

    @property
    def description(self) -> str:
        if self.new == self.old:
            return f"lag bound unchanged at {self.new}"
        if self.new > self.old:
            return f"lag bound raised {self.old} -> {self.new}, in force now"
        if self.pending is not None:
            return (
                f"lag bound lowered {self.old} -> {self.new} (wait): admission uses {self.new} "
                f"now; consumption keeps {self.in_force} until in-flight work drains"
            )
        extra = ""
        if self.discarded or self.aborted:
            extra = (
                f"; aborted {len(self.aborted)}, discarded {len(self.discarded)} for regeneration"
            )
        return f"lag bound lowered {self.old} -> {self.new} ({self.mode}), in force now{extra}"


@dataclass
class Counters:
    admitted: int = 0
    completed: int = 0
    consumed: int = 0
    discarded: int = 0
    aborted: int = 0
    requeued: int = 0
    skipped: int = 0


class LagGovernor:
    """Admission control and oldest-first batch forming with a live-adjustable lag bound."""

    def __init__(
        self,
        batch_groups: int,
        lag_bound: int,
        *,
        max_lag_bound: int = 16,
        on_lag_decrease: str = "wait",
        version: int = 0,
        consumed_before: int | None = None,
    ) -> None:
        if batch_groups < 1:
            raise ValueError(f"batch_groups: {batch_groups} must be >= 1")
        if not 0 <= lag_bound <= max_lag_bound:
            raise ValueError(f"lag_bound: {lag_bound} is outside 0..{max_lag_bound}")
        if on_lag_decrease not in ("wait", "abort"):
            raise ValueError(f"on_lag_decrease: {on_lag_decrease!r} is not wait or abort")
        self.batch_groups = batch_groups
        self.max_lag_bound = max_lag_bound
        self.on_lag_decrease = on_lag_decrease
        self.version = version
        self._bound = lag_bound
        self._pending: int | None = None
        self.outstanding = False
        """A batch was handed out and its StepDone has not come back yet."""
        # Groups consumed by earlier controller runs (resume) count as admitted and consumed.
        before = version * batch_groups if consumed_before is None else consumed_before
        self.counters = Counters(admitted=before, completed=before, consumed=before)
        self.groups: dict[int, GroupRecord] = {}
        self._seq = 0
        # Open groups counted by start version, all and in flight only: the questions asked
        # after every event (how many are due, is one still out) are answered from these
        # without walking the groups.
        self._open_starts: Counter[int] = Counter()
        self._flying_starts: Counter[int] = Counter()
        self._completed = 0

    # --- bounds ---------------------------------------------------------------------------------
    @property
    def lag_bound(self) -> int:
        """The bound in force for consumption."""
        return self._bound

    @property
    def pending_lag_bound(self) -> int | None:
        """A lowered bound that waits for in-flight work to drain (``wait`` mode)."""
        return self._pending

    @property
    def admission_bound(self) -> int:
        return self._pending if self._pending is not None else self._bound

    @property
    def next_consume_version(self) -> int:
        return self.version + (1 if self.outstanding else 0)

    # --- counts ---------------------------------------------------------------------------------
    def _open(self) -> Iterable[GroupRecord]:
        return (g for g in self.groups.values() if g.status in _OPEN)

    def _count(self, g: GroupRecord, sign: int) -> None:
        """Add (+1) or take back (-1) an open group's share of the counts."""
        if g.status == IN_FLIGHT:
            _bump(self._flying_starts, g.start_version, sign)
        elif g.status == COMPLETED:
            self._completed += sign
        else:
            return
        _bump(self._open_starts, g.start_version, sign)

    @property
    def in_flight(self) -> int:
        return self._flying_starts.total()

    @property
    def queued(self) -> int:
        """Completed groups waiting for the trainer (the training queue depth)."""
        return self._completed

    def _due(self, starts: Counter[int], floor: int) -> int:
        return sum(count for start, count in starts.items() if start <= floor)

    def waiting_for(self) -> tuple[int, ...]:
        """In-flight groups the next batch must include (their lag would pass the bound)."""
        floor = self.version - self._bound
        return tuple(
            g.group_id
            for g in self.groups.values()
            if g.status == IN_FLIGHT and g.start_version <= floor
        )

    @property
    def admitted_live(self) -> int:
        """Admitted minus discarded, aborted, requeued and skipped: what AReaL's rule counts."""
        c = self.counters
        return c.admitted - c.discarded - c.aborted - c.requeued - c.skipped

    @property
    def queue_capacity(self) -> int:
        """Most groups that may be admitted and not yet consumed: (η_adm + 1)·B."""
        return (self.admission_bound + 1) * self.batch_groups

    # --- admission ------------------------------------------------------------------------------
    def admissible(self, instance_version: int) -> int:
        """How many groups may be admitted now to an instance at ``instance_version``."""
        if self._refused(instance_version) is not None:
            return 0
        return max(0, self._admission_limit() - self.admitted_live)

    def refusal(self, instance_version: int) -> str | None:
        """Why a group may not be admitted to an instance at ``instance_version`` (None: it may)."""
        kind = self._refused(instance_version)
        eta = self.admission_bound
        if kind == "stale":
            return (
                f"instance weights v{instance_version} are too old: the next step consumes at "
                f"v{self.next_consume_version} with lag bound {eta}"
            )
        if kind == "full":
            return (
                f"admission full: {self.admitted_live} admitted >= (v{self.version} + {eta} + 1)·B"
            )
        return None

    def _admission_limit(self) -> int:
        return admission_limit(self.version, self.admission_bound, self.batch_groups)

    def _refused(self, instance_version: int) -> str | None:
        # The dispatcher asks this for every instance after every message: no string building.
        if instance_version + self.admission_bound < self.next_consume_version:
            return "stale"
        if self.admitted_live >= self._admission_limit():
            return "full"
        return None

    def admit(
        self,
        group_id: int,
        prompt_id: int,
        start_version: int,
        *,
        instance_id: int = -1,
        epoch: int = 0,
        at: float = 0.0,
    ) -> GroupRecord:
        """Record a dispatched group. The caller checked :meth:`admissible` first."""
        if group_id in self.groups:
            raise ValueError(f"group {group_id} was admitted already")
        reason = self.refusal(start_version)
        if reason is not None:
            raise ValueError(f"group {group_id} may not be admitted: {reason}")
        record = GroupRecord(group_id, prompt_id, start_version, instance_id, epoch, at)
        self.groups[group_id] = record
        self._count(record, +1)
        self.counters.admitted += 1
        return record

    # --- completion and cancellation ------------------------------------------------------------
    def complete(
        self, group_id: int, version_min: int, version_max: int, result: Any = None
    ) -> str:
        """A group came back. Returns ``queued``, ``discarded`` (rule 3) or ``ignored`` (it is
        unknown or no longer in flight, e.g. aborted or requeued already)."""
        g = self.groups.get(group_id)
        if g is None or g.status != IN_FLIGHT:
            return "ignored"
        self._seq += 1
        self._count(g, -1)
        g.completed_seq = self._seq
        g.version_min, g.version_max = version_min, version_max
        g.start_version = min(g.start_version, version_min)
        g.status = COMPLETED
        self._count(g, +1)
        g.result = result
        self.counters.completed += 1
        if self.next_consume_version - g.start_version > self._bound:
            self._set(g, DISCARDED)
            self._maybe_apply_pending()
            return "discarded"
        self._maybe_apply_pending()
        return "queued"

    def cancel(self, group_id: int, status: str = REQUEUED) -> bool:
        """An in-flight group will not come back (instance lost: ``requeued``; abort
        acknowledged: ``aborted``; its reward failed: ``skipped``). Returns False when it was not
        in flight."""
        if status not in (REQUEUED, ABORTED, SKIPPED):
            raise ValueError(f"status: {status!r} is not requeued, aborted or skipped")
        g = self.groups.get(group_id)
        if g is None or g.status != IN_FLIGHT:
            return False
        self._set(g, status)
        self._maybe_apply_pending()
        return True

    def _set(self, g: GroupRecord, status: str) -> None:
        self._count(g, -1)
        g.status = status
        self._count(g, +1)
        if status == DISCARDED:
            g.result = None
            self.counters.discarded += 1
        elif status == ABORTED:
            self.counters.aborted += 1
        elif status == REQUEUED:
            self.counters.requeued += 1
        elif status == SKIPPED:
            self.counters.skipped += 1
        elif status == CONSUMED:
            self.counters.consumed += 1
        if status not in _OPEN and status != CONSUMED:
            # Terminal and not needed for lag accounting any more.
            self.groups.pop(g.group_id, None)

    # --- batches --------------------------------------------------------------------------------
    def plan_batch(self) -> BatchPlan:
        """What the trainer would get now, without changing anything."""
        return self._plan(commit=False)

    def take_batch(self, *, last: bool = False) -> BatchPlan:
        """Form the batch for the step at the current version; a ready plan marks its groups
        consumed (and its discards/aborts done) and the batch outstanding. ``last``: no more
        groups will be admitted, so once none is in flight the queue is a batch, even short."""
        return self._plan(commit=True, last=last)

    def _plan(self, commit: bool, last: bool = False) -> BatchPlan:
        if self.outstanding:
            raise RuntimeError(f"a batch for v{self.version} is already out")
        s, eta, b = self.version, self._bound, self.batch_groups
        if last and self._completed and not self._flying_starts:
            b = min(b, self._completed)
        # This runs after every event: answer from the counts unless a batch can form.
        due = self._due(self._open_starts, s - eta)
        if due <= b:
            flying = self._due(self._flying_starts, s - eta)
            if flying:
                return BatchPlan(
                    "lag_wait",
                    s,
                    detail=f"waiting for {flying} group(s) that would exceed lag bound {eta}",
                    find_waiting=self.waiting_for,
                )
            if self._completed < b:
                return BatchPlan("starved", s, detail=f"{self._completed} of {b} groups ready")
        discard: list[GroupRecord] = []
        abort: list[GroupRecord] = []
        if due > b:
            # More are due than one batch holds: the B oldest completed ones, once B are.
            mandatory = sorted(
                (g for g in self._open() if g.start_version <= s - eta), key=_oldest_first
            )
            done = [g for g in mandatory if g.status == COMPLETED]
            if len(done) < b:
                return BatchPlan(
                    "lag_wait",
                    s,
                    detail=f"{len(mandatory)} groups must be consumed at v{s}; {len(done)} done",
                    find_waiting=self.waiting_for,
                )
            batch = done[:b]
            chosen = {g.group_id for g in batch}
            for g in mandatory:
                if g.group_id not in chosen:
                    (discard if g.status == COMPLETED else abort).append(g)
        else:
            completed = (g for g in self.groups.values() if g.status == COMPLETED)
            batch = sorted(completed, key=_oldest_first)[:b]
        plan = BatchPlan(
            "ready",
            s,
            group_ids=tuple(g.group_id for g in batch),
            discarded=tuple(g.group_id for g in discard),
            aborted=tuple(g.group_id for g in abort),
            discarded_records=tuple(discard),
        )
        if commit:
            for g in batch:
                g.consumed_step = s
                self._set(g, CONSUMED)
            for g in discard:
                self._set(g, DISCARDED)
            for g in abort:
                self._set(g, ABORTED)
            self.outstanding = True
            self._maybe_apply_pending()
        return plan

    def lag_of(self, group_id: int) -> int:
        """Lag of a consumed group: the step's version minus its (effective) start version."""
        g = self.groups[group_id]
        if g.consumed_step is None:
            raise ValueError(f"group {group_id} was not consumed")
        return g.consumed_step - g.start_version

    def forget(self, group_ids: Iterable[int]) -> None:
        """Drop consumed groups once the caller has recorded their lag (bounded memory)."""
        for gid in group_ids:
            g = self.groups.get(gid)
            if g is not None and g.status == CONSUMED:
                del self.groups[gid]

    def step_done(self, new_version: int) -> None:
        """The trainer finished the outstanding step; its weights are ``new_version``."""
        if not self.outstanding:
            raise RuntimeError("step_done without an outstanding batch")
        if new_version != self.version + 1:
            raise ValueError(f"step_done(v{new_version}) after a batch at v{self.version}")
        self.version = new_version
        self.outstanding = False
        self._maybe_apply_pending()

    # --- live bound changes ---------------------------------------------------------------------
    def set_lag_bound(self, value: int) -> BoundChange:
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"lag bound: {value!r} is not an integer")
        if not 0 <= value <= self.max_lag_bound:
            raise ValueError(f"lag bound: {value} is outside 0..{self.max_lag_bound}")
        old = self.admission_bound
        mode = self.on_lag_decrease
        if value >= self._bound:
            self._bound, self._pending = value, None
            return BoundChange(old, value, mode, self._bound, None)
        c = self.next_consume_version
        if mode == "abort":
            violating = [g for g in self._open() if g.start_version < c - value]
            discard = [g for g in violating if g.status == COMPLETED]
            abort = [g for g in violating if g.status == IN_FLIGHT]
            for g in discard:
                self._set(g, DISCARDED)
            for g in abort:
                self._set(g, ABORTED)
            self._bound, self._pending = value, None
            return BoundChange(
                old,
                value,
                mode,
                value,
                None,
                discarded=tuple(g.group_id for g in discard),
                aborted=tuple(g.group_id for g in abort),
                discarded_records=tuple(discard),
            )
        self._pending = value
        self._maybe_apply_pending()
        return BoundChange(old, value, mode, self._bound, self._pending)

    def _maybe_apply_pending(self) -> bool:
        """``wait`` mode: switch to the pending bound once nothing unconsumed would violate it."""
        if self._pending is None:
            return False
        floor = self.next_consume_version - self._pending
        if self._open_starts and min(self._open_starts) < floor:
            return False
        self._bound, self._pending = self._pending, None
        return True

    def open_groups(self) -> list[GroupRecord]:
        return sorted(self._open(), key=_oldest_first)


@dataclass
class LagRecorder:
    """Per-step lag statistics of consumed samples (mean, p95, max, span, histogram)."""

    samples: list[int] = field(default_factory=list)
    spans: list[int] = field(default_factory=list)

    def add(self, lag: int, span: int) -> None:
        self.samples.append(lag)
        self.spans.append(span)

    def stats(self) -> dict[str, float | int | list[int]]:
        if not self.samples:
            return {"mean": 0.0, "p95": 0.0, "max": 0, "span_max": 0, "histogram": []}
        ordered = sorted(self.samples)
        # Nearest-rank p95: an observed value, never interpolated past the max.
        rank = max(0, -(-95 * len(ordered) // 100) - 1)
        hist = [0] * (ordered[-1] + 1)
        for lag in ordered:
            hist[max(0, lag)] += 1
        return {
            "mean": sum(ordered) / len(ordered),
            "p95": float(ordered[rank]),
            "max": int(ordered[-1]),
            "span_max": int(max(self.spans)),
            "histogram": hist,
        }


def admission_limit(version: int, lag_bound: int, batch_groups: int) -> int:
    """Rule 1: the most groups admitted (and not discarded, aborted or requeued) at trainer
    version ``version`` under ``lag_bound``: ``(v + η + 1)·B``."""
    return (version + lag_bound + 1) * batch_groups


def _bump(counter: Counter[int], key: int, sign: int) -> None:
    counter[key] += sign
    if not counter[key]:
        del counter[key]
