"""Telemetry: snapshots and events on the PUB socket, the ring buffer for late attachers, and the
rolling bubble window built from the one ``BubbleAccountant`` (runtime/bubbles.py)."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import zmq

from runtime.bubbles import Breakdown, BubbleAccountant
from runtime.protocol import (
    BUBBLE_CATEGORIES,
    TOPIC_EVENT,
    TOPIC_SNAPSHOT,
    Encoder,
    Event,
    Snapshot,
    encode_topic,
)

log = logging.getLogger(__name__)


class Telemetry:
    """Publishes snapshots/events and keeps the last ``ring_size`` of each."""

    def __init__(
        self,
        pub: Any,
        ring_size: int,
        on_event: Callable[[Event], None] | None = None,
    ) -> None:
        self.pub = pub
        self.snapshots: deque[Snapshot] = deque(maxlen=ring_size)
        self.events: deque[Event] = deque(maxlen=ring_size)
        self.encoder = Encoder()
        self.on_event = on_event
        self.seq = 0

    def publish_snapshot(self, snapshot: Snapshot) -> None:
        self.snapshots.append(snapshot)
        self._send(encode_topic(TOPIC_SNAPSHOT, snapshot, self.encoder))

    def publish_event(self, event: Event) -> None:
        self.events.append(event)
        if self.on_event is not None:
            self.on_event(event)
        self._send(encode_topic(TOPIC_EVENT, event, self.encoder))

    def _send(self, frames: list[Any]) -> None:
        if self.pub is None:
            return
        try:
            # PUB never blocks; past the HWM zmq drops for slow subscribers, which is what a
            # dashboard wants (the next snapshot supersedes the dropped one).
            self.pub.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:
            log.debug("telemetry send dropped: %s", exc)

    @property
    def latest(self) -> Snapshot | None:
        return self.snapshots[-1] if self.snapshots else None

    def history(self, limit: int | None = None) -> dict[str, list[Any]]:
        snaps = list(self.snapshots)
        events = list(self.events)
        if limit is not None:
            snaps, events = snaps[-limit:], events[-limit:]
        return {
            "snapshots": msgspec.to_builtins(snaps),
            "events": msgspec.to_builtins(events),
        }


def _absolute(b: Breakdown) -> np.ndarray:
    """Slot-seconds per category (the fractions times the slot-time they are shares of)."""
    return np.array([b.fractions.get(c, 0.0) for c in BUBBLE_CATEGORIES]) * b.slot_seconds


class BubbleWindows:
    """Rolling-window and per-interval breakdowns as differences of the accountant's totals.

    ``BubbleAccountant.window`` resets on every call, so the controller never uses it; instead it
    samples ``total`` and subtracts, which gives any number of independent windows (the
    snapshot's last ``window_s`` seconds, and each trainer step's interval).
    """

    def __init__(
        self,
        accountant: BubbleAccountant,
        window_s: float,
        now: float,
        capacity_of: Callable[[int], int],
    ) -> None:
        self.accountant = accountant
        self.capacity_of = capacity_of
        self.window_s = window_s
        self.samples: deque[tuple[float, np.ndarray, dict[int, np.ndarray]]] = deque()
        self._step_mark = self._sample(now)

    def _sample(self, now: float) -> tuple[float, np.ndarray, dict[int, np.ndarray]]:
        total = self.accountant.total(now)
        per = {}
        for i, fr in total.per_instance.items():
            cap = self.capacity_of(i)
            per[i] = np.array([fr.get(c, 0.0) for c in BUBBLE_CATEGORIES]) * cap * total.seconds
        return now, _absolute(total), per

    def tick(self, now: float) -> tuple[dict[str, float], dict[int, float], Breakdown]:
        """(window fractions, per-instance bubble share in the window, the total breakdown)."""
        sample = self._sample(now)
        self.samples.append(sample)
        while len(self.samples) > 2 and self.samples[1][0] <= now - self.window_s:
            self.samples.popleft()
        _, first_abs, first_per = self.samples[0]
        frac = _fractions(sample[1] - first_abs)
        shares = {}
        for i, vec in sample[2].items():
            diff = vec - first_per.get(i, np.zeros(len(BUBBLE_CATEGORIES)))
            total = float(diff.sum())
            shares[i] = float(1.0 - diff[0] / total) if total > 0 else 0.0
        return frac, shares, self.accountant.total(now)

    def step_interval(self, now: float) -> dict[str, float]:
        """Fractions since the previous call (one trainer step's interval)."""
        sample = self._sample(now)
        frac = _fractions(sample[1] - self._step_mark[1])
        self._step_mark = sample
        return frac


def _fractions(vec: np.ndarray) -> dict[str, float]:
    vec = np.maximum(vec, 0.0)
    s = float(vec.sum())
    if s <= 0:
        return {c: (1.0 if c == "idle" else 0.0) for c in BUBBLE_CATEGORIES}
    return {c: float(vec[k] / s) for k, c in enumerate(BUBBLE_CATEGORIES)}
