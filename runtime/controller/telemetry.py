"""Telemetry: snapshots and events on the PUB socket, the ring buffer for late attachers, and the
rolling bubble window built from the one ``BubbleAccountant`` (runtime/bubbles.py)."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

import msgspec
import numpy as np
import zmq

from runtime.bubbles import Breakdown, BubbleAccountant, excess_sorting
from runtime.protocol import (
    BUBBLE_CATEGORIES,
    TOPIC_EVENT,
    TOPIC_SNAPSHOT,
    Encoder,
    Event,
    HistoryReply,
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
        """A ``HistoryReply`` as plain data, the way it crosses the wire."""
        snaps = list(self.snapshots)
        events = list(self.events)
        if limit is not None:
            snaps, events = snaps[-limit:], events[-limit:]
        return msgspec.to_builtins(HistoryReply(snapshots=snaps, events=events))


class _Sample(NamedTuple):
    """The accountant's slot-seconds since the start, at ``time``."""

    time: float
    ids: tuple[int, ...]
    rows: np.ndarray  # one row per id, one column per category
    total: np.ndarray  # the column sums


class BubbleWindows:
    """Rolling-window and per-interval breakdowns as differences of the accountant's totals.

    ``BubbleAccountant.window`` resets on every call, so the controller never uses it; instead it
    samples the raw slot-seconds (``BubbleAccountant.slot_seconds``) and subtracts, which gives
    any number of independent windows (the snapshot's last ``window_s`` seconds, and each
    trainer step's interval). Everything per instance is a numpy row, so a tick with 256
    instances builds no per-instance dicts but the one of shares the snapshot carries.
    """

    def __init__(
        self,
        accountant: BubbleAccountant,
        window_s: float,
        now: float,
        capacity_of: Callable[[int], int] | None = None,
    ) -> None:
        # capacity_of is accepted for older callers and unused: the accountant's rows are
        # slot-seconds already, so no fraction has to be scaled back by a capacity.
        del capacity_of
        self.accountant = accountant
        self.window_s = window_s
        self.samples: deque[_Sample] = deque()
        self._step_mark = self._sample(now)

    def _sample(self, now: float) -> _Sample:
        ids, rows = self.accountant.slot_seconds(now)
        return _Sample(now, ids, rows, rows.sum(axis=0))

    def _window_fractions(self, vec: np.ndarray) -> dict[str, float]:
        frac = _fractions(vec)
        baseline = self.accountant.sorting_baseline
        return frac if baseline is None else excess_sorting(frac, baseline)

    def tick(self, now: float) -> tuple[dict[str, float], dict[int, float], Breakdown]:
        """(window fractions, per-instance bubble share in the window, the total breakdown).

        The total breakdown has no ``per_instance`` (the snapshot does not carry it)."""
        sample = self._sample(now)
        self.samples.append(sample)
        while len(self.samples) > 2 and self.samples[1].time <= now - self.window_s:
            self.samples.popleft()
        first = self.samples[0]
        frac = self._window_fractions(sample.total - first.total)
        diff = sample.rows - _aligned(first, sample.ids)
        slot = diff.sum(axis=1)
        live = slot > 0
        share = np.zeros(len(sample.ids))
        share[live] = 1.0 - diff[live, 0] / slot[live]
        shares = dict(zip(sample.ids, share.tolist(), strict=True))
        return frac, shares, self.accountant.total(now, per_instance=False)

    def step_interval(self, now: float) -> dict[str, float]:
        """Fractions since the previous call (one trainer step's interval)."""
        sample = self._sample(now)
        frac = self._window_fractions(sample.total - self._step_mark.total)
        self._step_mark = sample
        return frac


def _aligned(sample: _Sample, ids: tuple[int, ...]) -> np.ndarray:
    """``sample``'s rows in the order of ``ids`` (zeros for an id it does not have)."""
    if sample.ids == ids:
        return sample.rows  # the usual case: the same instances in the same order
    where = {i: k for k, i in enumerate(sample.ids)}
    out = np.zeros((len(ids), len(BUBBLE_CATEGORIES)))
    for k, i in enumerate(ids):
        j = where.get(i)
        if j is not None:
            out[k] = sample.rows[j]
    return out


def _fractions(vec: np.ndarray) -> dict[str, float]:
    vec = np.maximum(vec, 0.0)
    s = float(vec.sum())
    if s <= 0:
        return {c: (1.0 if c == "idle" else 0.0) for c in BUBBLE_CATEGORIES}
    return {c: float(vec[k] / s) for k, c in enumerate(BUBBLE_CATEGORIES)}
