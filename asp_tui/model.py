"""The dashboard's state, free of Textual: what was received, when, and what is pending.

The telemetry worker writes into a ``DashboardModel``; the render tick reads from it. Keeping it
here (not in widgets) lets tests and ``bench/dashboard.py`` drive it without a terminal, and keeps
the connection rules (LIVE / STALE / DISCONNECTED) in one place.
"""

from __future__ import annotations

import enum
import random
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import msgspec

from runtime.controller.governor import admission_limit
from runtime.protocol import Event, Snapshot

SPARK_POINTS = 120
"""Points kept per sparkline: 2 minutes of queue depth at 1 Hz backfill, or 120 trainer steps."""


class Link(enum.Enum):
    """Connection state shown by the header badge."""

    CONNECTING = "CONNECTING"
    LIVE = "LIVE"
    STALE = "STALE"
    DISCONNECTED = "DISCONNECTED"


@dataclass
class Pending:
    """An operator command sent for one instance, shown until a snapshot shows its effect."""

    verb: str
    """Shown in the state column: ``pausing``, ``resuming``, ``restarting``."""
    target_states: tuple[str, ...]
    since: float


@dataclass
class Backoff:
    """Capped exponential backoff with jitter, so many dashboards don't reconnect in lockstep."""

    initial_s: float = 0.25
    cap_s: float = 5.0
    rng: random.Random = field(default_factory=random.Random)
    attempt: int = 0

    def next_delay(self) -> float:
        ceiling = min(self.cap_s, self.initial_s * (2**self.attempt))
        self.attempt += 1
        # Jitter in [ceiling/2, ceiling]: never zero (no hot loop), never above the cap.
        return ceiling * (0.5 + 0.5 * self.rng.random())

    def reset(self) -> None:
        self.attempt = 0


class DashboardModel:
    """Latest snapshot, sparkline histories, events and pending commands."""

    def __init__(
        self,
        clock: Callable[[], float],
        *,
        stale_after_s: float = 1.5,
        pending_timeout_s: float = 20.0,
    ) -> None:
        self.clock = clock
        self.stale_after_s = stale_after_s
        self.pending_timeout_s = pending_timeout_s
        self.snapshot: Snapshot | None = None
        self.received_at: float | None = None
        self.seq_applied = -1
        """The seq of the snapshot the widgets show; the render tick skips work when unchanged."""
        self.connected = False
        self.disconnect_reason = ""
        self.reconnect_attempts = 0
        self.events: deque[Event] = deque(maxlen=500)
        self.new_events: list[Event] = []
        self.pending: dict[int, Pending] = {}
        self.queue_depth: deque[float] = deque(maxlen=SPARK_POINTS)
        self.lag_mean: deque[float] = deque(maxlen=SPARK_POINTS)
        self.reward: deque[float] = deque(maxlen=SPARK_POINTS)
        self.loss: deque[float] = deque(maxlen=SPARK_POINTS)
        self.iteration_s: deque[float] = deque(maxlen=SPARK_POINTS)
        self.samples_per_s: deque[float] = deque(maxlen=SPARK_POINTS)
        self.predictor_rho: deque[float] = deque(maxlen=SPARK_POINTS)
        """Per step that had one: the predictor's ρ over the batch's longest samples."""
        self._last_step: int | None = None
        self._last_queue_sample: float | None = None

    # --- writes (telemetry worker) ---------------------------------------------------------

    def apply_snapshot(self, snapshot: Snapshot, *, backfill: bool = False) -> None:
        """Record a snapshot; sparklines take queue depth at most 1 Hz and trainer data per step."""
        if self._last_queue_sample is None or snapshot.time - self._last_queue_sample >= 1.0:
            self.queue_depth.append(float(snapshot.queue_depth))
            self.lag_mean.append(float(snapshot.lag.mean))
            self._last_queue_sample = snapshot.time
        if snapshot.step != self._last_step and snapshot.step > 0:
            trainer = snapshot.trainer
            self.reward.append(trainer.reward_mean)
            self.loss.append(trainer.loss)
            self.iteration_s.append(trainer.iteration_s)
            self.samples_per_s.append(trainer.samples_per_s)
            if trainer.predictor_longest_rho is not None:
                self.predictor_rho.append(trainer.predictor_longest_rho)
        self._last_step = snapshot.step
        self.snapshot = snapshot
        if not backfill:
            self.received_at = self.clock()
            self.connected = True
            self.reconnect_attempts = 0
        self._settle_pending(snapshot)

    def apply_event(self, event: Event) -> None:
        self.events.append(event)
        self.new_events.append(event)

    def backfill(self, data: dict) -> tuple[int, int]:
        """Fill sparklines and the event log from the controller's ``history`` ring buffer."""
        snapshots = [msgspec.convert(item, Snapshot) for item in data.get("snapshots", [])]
        events = [msgspec.convert(item, Event) for item in data.get("events", [])]
        known = {(event.time, event.kind, event.message) for event in self.events}
        for snapshot in snapshots:
            if (
                self.snapshot is None
                or snapshot.seq > self.snapshot.seq
                or snapshot.time > (self.snapshot.time)
            ):
                self.apply_snapshot(snapshot, backfill=True)
        for event in events:
            if (event.time, event.kind, event.message) not in known:
                self.apply_event(event)
        return len(snapshots), len(events)

    def mark_disconnected(self, reason: str) -> None:
        self.connected = False
        self.disconnect_reason = reason
        self.reconnect_attempts += 1

    def add_pending(self, ids: Iterable[int], verb: str, target_states: tuple[str, ...]) -> None:
        now = self.clock()
        for instance_id in ids:
            self.pending[instance_id] = Pending(verb, target_states, now)

    def clear_pending(self, ids: Iterable[int]) -> None:
        for instance_id in ids:
            self.pending.pop(instance_id, None)

    def _settle_pending(self, snapshot: Snapshot) -> None:
        """Drop a pending mark once the snapshot shows the target state (or it timed out)."""
        if not self.pending:
            return
        states = {instance.instance_id: instance.state for instance in snapshot.instances}
        now = self.clock()
        for instance_id, pending in list(self.pending.items()):
            shown = states.get(instance_id) in pending.target_states
            if shown or now - pending.since > self.pending_timeout_s:
                del self.pending[instance_id]

    def take_new_events(self) -> list[Event]:
        events, self.new_events = self.new_events, []
        return events

    # --- reads (render tick) ---------------------------------------------------------------

    def age(self) -> float | None:
        """Seconds since the last live snapshot arrived (local clock, immune to host skew)."""
        if self.received_at is None:
            return None
        return max(self.clock() - self.received_at, 0.0)

    def link(self) -> Link:
        if not self.connected:
            return Link.DISCONNECTED if self.reconnect_attempts else Link.CONNECTING
        age = self.age()
        if age is not None and age > self.stale_after_s:
            return Link.STALE
        return Link.LIVE

    def instance_ids(self, states: Iterable[str] | None = None) -> list[int]:
        if self.snapshot is None:
            return []
        wanted = None if states is None else set(states)
        return [
            instance.instance_id
            for instance in self.snapshot.instances
            if wanted is None or instance.state in wanted
        ]

    def instance_state(self, instance_id: int) -> str | None:
        if self.snapshot is None:
            return None
        for instance in self.snapshot.instances:
            if instance.instance_id == instance_id:
                return instance.state
        return None

    def lag_bound_effect(self, new_bound: int) -> tuple[int, str]:
        """How many queued or in-flight groups a new bound affects, and how, in words.

        Admission allows ``(v + η + 1)·B`` groups (the governor's ``admission_limit``). Lowering
        η to η' leaves the groups admitted beyond ``(v + η' + 1)·B`` over the new bound: they
        are waited for or aborted and re-queued (``async.on_lag_decrease``). Raising it admits
        ``(η' − η)·B`` more groups.
        """
        snapshot = self.snapshot
        if snapshot is None:
            return 0, "no data yet"
        old = snapshot.lag_bound
        batch = max(snapshot.batch_groups, 1)
        if new_bound < old:
            allowed = admission_limit(snapshot.weight_version, new_bound, batch)
            outstanding = snapshot.queue_depth + snapshot.in_flight_groups
            over = max(0, min(outstanding, snapshot.admitted_groups - allowed))
            verb = (
                "aborted and re-queued"
                if snapshot.on_lag_decrease == "abort"
                else "waited for before the trainer steps"
            )
            return over, f"{over} queued/in-flight groups exceed the new bound and will be {verb}"
        if new_bound > old:
            more = (new_bound - old) * batch
            return 0, f"admits up to {more} more groups ({snapshot.queue_depth} queued, " + (
                f"{snapshot.in_flight_groups} in flight now)"
            )
        return 0, "unchanged"
