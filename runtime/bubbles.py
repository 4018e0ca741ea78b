"""The one definition of the rollout bubbles (DESIGN.md section 4).

The simulator (``runtime.sim.engine``) and the controller's live measurement both feed a
``BubbleAccountant``, so a predicted and a measured breakdown are the same quantity.

Model: instance i has C_i slots (``max_num_seqs``). Its state is piecewise constant in time: from
an ``update`` on, ``active`` slots hold running sequences (useful) and the ``C_i - active`` free
slots are charged to one cause; while an instance is paused, down or syncing its whole capacity
is charged to that state. The breakdown over a window is the share of total slot-time
``sum_i C_i * T`` in each category of ``protocol.BUBBLE_CATEGORIES``; the shares sum to 1.

Which cause the free slots get is decided by ``free_slot_cause`` (callers pass what they know):

- **padding**: the instance holds work it cannot start yet because its unit of dispatch waits for
  its last, longest members: a minibatch barrier, or fewer free slots than a group needs; also
  the free slots of an instance that is finishing its last groups.
- **skewness**: the instance has nothing running and no work of its own left while other instances
  still work (long-tail outputs elsewhere), or admission is blocked while the trainer waits on
  groups still in flight (a straggler holds the lag bound or the batch).
- **sorting**: back-pressure: the instance has work but admission control or a full queue blocks
  it while the trainer is busy stepping (the training queue swung full), or the scheduler holds
  its work back.
- **idle**: no work left anywhere, or an instance's first start-up (nothing was lost yet).

Trainer side (``trainer_update``): the trainer is ``stepping``, ``starved`` (ready, fewer than B
groups queued: counts as sorting), ``lag_wait`` (it has B groups but the lag bound makes it wait
for a straggler: counts as skewness), or ``idle``.

FIFO baseline: only the part of sorting in excess of a length-agnostic order counts as sorting.
Where a FIFO baseline is known (the simulator runs fifo on the same input; the controller can pass
the plan's simulated fifo share as ``sorting_baseline``), ``min(sorting, baseline)`` is moved to
``idle``: it is back-pressure that any order pays (e.g. rollout waiting for the trainer at η = 0).
Without a baseline the live measurement reports all back-pressure as sorting, an upper bound, and
says so in ``Breakdown.sorting_baseline`` (None).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from runtime.protocol import BUBBLE_CATEGORIES

CAUSES = BUBBLE_CATEGORIES[1:]
WHOLE_CAPACITY = frozenset({"sync", "paused", "down"})
TRAINER_CONDITIONS = ("stepping", "starved", "lag_wait", "idle")
TRAINER_CATEGORY = {
    "stepping": "useful",
    "starved": "sorting",
    "lag_wait": "skewness",
    "idle": "idle",
}
_IDX = {c: k for k, c in enumerate(BUBBLE_CATEGORIES)}
_TIDX = {c: k for k, c in enumerate(TRAINER_CONDITIONS)}


def padding_fraction(lengths: Sequence[int]) -> float:
    """Token-form padding of one minibatch M: ``1 - sum(L_k) / (|M| * max L_k)``.

    The share of the minibatch's slot-steps spent waiting for its longest member (0 when all
    lengths are equal, or the minibatch is empty or all zero)."""
    a = np.asarray(lengths, dtype=float)
    if a.size == 0 or a.max() <= 0:
        return 0.0
    return float(1.0 - a.sum() / (a.size * a.max()))


def skewness_fraction(finish_times: Sequence[float], start: float = 0.0) -> float:
    """Skewness over a window starting at ``start``: ``sum_i (T_max - T_i) / (N * T_max)``, with
    T_i when instance i finished its last sample and times measured from ``start``."""
    t = np.asarray(finish_times, dtype=float) - start
    if t.size == 0 or t.max() <= 0:
        return 0.0
    return float(np.sum(t.max() - t) / (t.size * t.max()))


def free_slot_cause(
    *,
    state: str = "running",
    pending: int,
    running: int,
    admission_open: bool,
    work_elsewhere: bool,
    trainer_condition: str,
    held: bool = False,
) -> str:
    """The cause the free slots of one instance are charged to (see the module docstring).

    ``pending``: groups planned for it not yet dispatched; ``admission_open``: the lag governor
    and the queue would admit a group now; ``work_elsewhere``: any other instance still runs or
    holds work; ``held``: the scheduler returned nothing although work is pending for it."""
    if state == "paused":
        return "paused"
    if state in ("down", "starting"):
        return "down"
    if state == "syncing":
        return "sync"
    if pending > 0:
        if not admission_open:
            return "sorting" if trainer_condition == "stepping" else "skewness"
        return "sorting" if held else "padding"
    if running > 0:
        return "padding"
    return "skewness" if work_elsewhere else "idle"


@dataclass
class Breakdown:
    """Shares of rollout slot-time per category over a window (sum 1.0), per instance, and the
    trainer's condition shares. ``seconds`` is the window length."""

    fractions: dict[str, float]
    per_instance: dict[int, dict[str, float]]
    trainer: dict[str, float]
    seconds: float
    sorting_baseline: float | None = None
    slot_seconds: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)

    def top_cause(self) -> str:
        """The largest bubble (any category but useful); "useful" if there is none."""
        bubbles = {k: v for k, v in self.fractions.items() if k != "useful" and v > 0}
        return max(bubbles, key=bubbles.__getitem__) if bubbles else "useful"

    def trainer_categories(self) -> dict[str, float]:
        """Trainer shares mapped to bubble names: starved -> sorting, lag_wait -> skewness."""
        out = {"useful": 0.0, "sorting": 0.0, "skewness": 0.0, "idle": 0.0}
        for k, v in self.trainer.items():
            out[TRAINER_CATEGORY[k]] += v
        return out

    def to_dict(self) -> dict:
        return {
            "fractions": dict(self.fractions),
            "per_instance": {str(k): dict(v) for k, v in self.per_instance.items()},
            "trainer": dict(self.trainer),
            "seconds": self.seconds,
            "sorting_baseline": self.sorting_baseline,
        }


def excess_sorting(fractions: Mapping[str, float], baseline: float) -> dict[str, float]:
    """Move the part of sorting that a FIFO order also pays (``baseline``) to idle."""
    out = dict(fractions)
    moved = min(out.get("sorting", 0.0), max(0.0, baseline))
    out["sorting"] = out.get("sorting", 0.0) - moved
    out["idle"] = out.get("idle", 0.0) + moved
    return out


class _Acc:
    """One instance's accumulators: slot-seconds per category, in the window and in total."""

    __slots__ = ("active", "capacity", "cause", "since", "total", "win")

    def __init__(self, capacity: int, now: float) -> None:
        self.capacity = capacity
        self.active = 0
        self.cause = "idle"
        self.since = now
        # Plain lists: this runs once per state change in the simulator's inner loop.
        self.win = [0.0] * len(BUBBLE_CATEGORIES)
        self.total = [0.0] * len(BUBBLE_CATEGORIES)

    def accrue(self, now: float) -> None:
        dt = now - self.since
        if dt > 0:
            win, tot = self.win, self.total
            k = _IDX[self.cause]
            if self.cause in WHOLE_CAPACITY:
                v = self.capacity * dt
                win[k] += v
                tot[k] += v
            else:
                a = min(max(self.active, 0), self.capacity)
                u, f = a * dt, (self.capacity - a) * dt
                win[0] += u
                tot[0] += u
                win[k] += f
                tot[k] += f
            self.since = now


class BubbleAccountant:
    """Integrates piecewise-constant instance and trainer states into ``Breakdown``s."""

    def __init__(
        self, capacities: Mapping[int, int], now: float, sorting_baseline: float | None = None
    ) -> None:
        self.start = now
        self.window_start = now
        self.sorting_baseline = sorting_baseline
        # The last slot_seconds result, valid while nothing changed: the controller asks for the
        # rows and the total breakdown at the same instant, and accruing twice is half its cost.
        self._changes = 0
        self._rows: tuple[float, str, int, tuple[int, ...], np.ndarray] | None = None
        self._inst: dict[int, _Acc] = {}
        self._gone: dict[int, _Acc] = {}
        for i, c in capacities.items():
            self.add_instance(i, c, now)
        self._tcond = "idle"
        self._tsince = now
        self._twin = np.zeros(len(TRAINER_CONDITIONS))
        self._ttotal = np.zeros(len(TRAINER_CONDITIONS))

    def add_instance(self, instance_id: int, capacity: int, now: float) -> None:
        """Start accounting an instance (initially idle); re-adding a removed one resumes it."""
        if capacity < 1:
            raise ValueError(f"capacity of instance {instance_id}: {capacity} must be >= 1")
        acc = self._gone.pop(instance_id, None) or _Acc(capacity, now)
        acc.capacity, acc.since, acc.active, acc.cause = capacity, now, 0, "idle"
        self._inst[instance_id] = acc
        self._changes += 1

    def remove_instance(self, instance_id: int, now: float) -> None:
        """Stop accruing an instance (its capacity leaves the bar); its past time is kept."""
        acc = self._inst.pop(instance_id, None)
        if acc is not None:
            acc.accrue(now)
            self._gone[instance_id] = acc
            self._changes += 1

    def update(self, instance_id: int, now: float, *, active: int, cause: str) -> None:
        """From ``now`` on, ``active`` slots are useful and the rest are charged to ``cause``
        (for paused, down and sync the whole capacity is)."""
        if cause not in CAUSES:
            raise ValueError(f"cause: {cause!r} is not one of {', '.join(CAUSES)}")
        acc = self._inst.get(instance_id)
        if acc is None:
            raise KeyError(f"instance {instance_id} is not accounted (add_instance first)")
        if acc.active == active and acc.cause == cause:
            return  # the same piece continues
        acc.accrue(now)
        acc.active, acc.cause = active, cause
        self._changes += 1

    def trainer_update(self, now: float, condition: str) -> None:
        if condition not in _TIDX:
            raise ValueError(
                f"condition: {condition!r} is not one of {', '.join(TRAINER_CONDITIONS)}"
            )
        self._taccrue(now)
        self._tcond = condition

    def _taccrue(self, now: float) -> None:
        dt = now - self._tsince
        if dt > 0:
            self._twin[_TIDX[self._tcond]] += dt
            self._ttotal[_TIDX[self._tcond]] += dt
        self._tsince = max(self._tsince, now)

    def slot_seconds(self, now: float, which: str = "total") -> tuple[tuple[int, ...], np.ndarray]:
        """Accrue to ``now``; then (instance ids, slot-seconds): one row per instance ever
        accounted (removed ones keep theirs), one column per ``BUBBLE_CATEGORIES`` entry, since
        the start (``which="total"``) or in the current window (``"win"``).

        The raw numbers behind every ``Breakdown``, without building per-instance dicts: the
        controller samples this at the telemetry rate. Rows are in accounting order (removed
        instances first), not sorted; the ids say which row is which. The rows are read-only:
        a second call at the same ``now`` with nothing changed in between returns the same."""
        if which not in ("total", "win"):
            raise ValueError(f"which: {which!r} is not one of total, win")
        cached = self._rows
        if cached is not None and cached[:3] == (now, which, self._changes):
            return cached[3], cached[4]
        for acc in self._inst.values():
            acc.accrue(now)
        accs = [*self._gone.items(), *self._inst.items()]
        rows = np.array([getattr(a, which) for _, a in accs], dtype=float)
        rows = rows.reshape(len(accs), len(BUBBLE_CATEGORIES))
        rows.flags.writeable = False
        ids = tuple(i for i, _ in accs)
        self._rows = (now, which, self._changes, ids, rows)
        return ids, rows

    def _breakdown(
        self, now: float, which: str, seconds: float, per_instance: bool = True
    ) -> Breakdown:
        ids, rows = self.slot_seconds(now, which)
        self._taccrue(now)
        tot = rows.sum(axis=0)
        s = float(tot.sum())
        fr = _fractions(tot)
        if self.sorting_baseline is not None:
            fr = excess_sorting(fr, self.sorting_baseline)
        per = _per_instance(ids, rows) if per_instance else {}
        tv = self._twin if which == "win" else self._ttotal
        tsum = float(tv.sum())
        trainer = {
            c: (float(tv[k]) / tsum if tsum > 0 else 0.0) for k, c in enumerate(TRAINER_CONDITIONS)
        }
        return Breakdown(fr, per, trainer, seconds, self.sorting_baseline, s)

    def window(self, now: float, *, per_instance: bool = True) -> Breakdown:
        """The breakdown since the last ``window`` call (or the start); then resets the window.
        ``per_instance=False`` leaves ``Breakdown.per_instance`` empty (cheaper)."""
        b = self._breakdown(now, "win", now - self.window_start, per_instance)
        for acc in [*self._inst.values(), *self._gone.values()]:
            acc.win = [0.0] * len(BUBBLE_CATEGORIES)
        self._twin[:] = 0
        self.window_start = now
        self._changes += 1
        return b

    def total(self, now: float, *, per_instance: bool = True) -> Breakdown:
        """The breakdown since the start. ``per_instance=False`` leaves
        ``Breakdown.per_instance`` empty (cheaper)."""
        return self._breakdown(now, "total", now - self.start, per_instance)


def _per_instance(ids: tuple[int, ...], rows: np.ndarray) -> dict[int, dict[str, float]]:
    """Per-instance shares of the rows with any slot-time, sorted by id: one vectorised
    division instead of a dict comprehension over numpy scalars per instance."""
    sums = rows.sum(axis=1)
    live = np.flatnonzero(sums > 0)
    shares = (rows[live] / sums[live, None]).tolist()
    out = {ids[k]: row for k, row in zip(live.tolist(), shares, strict=True)}
    return {i: dict(zip(BUBBLE_CATEGORIES, out[i], strict=True)) for i in sorted(out)}


def _fractions(v: np.ndarray) -> dict[str, float]:
    s = float(v.sum())
    if s <= 0:
        return {c: (1.0 if c == "idle" else 0.0) for c in BUBBLE_CATEGORIES}
    return {c: float(v[k]) / s for k, c in enumerate(BUBBLE_CATEGORIES)}
