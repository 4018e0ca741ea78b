"""The group ledger (``RunDir.ledger``): one JSON line per event in a group's life, and its proof.

Every dispatched group id appears once as ``dispatched`` and then moves through
``completed`` → ``consumed`` | ``discarded``, or ends ``requeued`` (its instance was lost) or
``aborted`` (stopped for the lag bound) while in flight, or ends ``skipped`` (a reward function
failed on it; its prompt is not handed out again this epoch). While in flight it may be
``migrated`` (moved to another instance with its partial output) any number of times. A result
that arrives for a group that has already ended is logged as ``ignored``. ``controller_start``
marks a (re)start: groups left open by a previous controller are ``abandoned`` (their prompts
were never consumed, so the resumed epoch schedules them again).

:func:`verify_ledger` replays the file and proves that no group was consumed twice, no transition
is impossible, and no prompt was consumed twice within one epoch.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.rundir import JsonlWriter, read_jsonl

# state -> the events allowed from it
_TRANSITIONS: dict[str, dict[str, str]] = {
    "in_flight": {
        "migrated": "in_flight",
        "completed": "completed",
        "requeued": "requeued",
        "aborted": "aborted",
        "skipped": "skipped",
    },
    "completed": {"consumed": "consumed", "discarded": "discarded"},
}
TERMINAL = ("consumed", "discarded", "requeued", "aborted", "skipped", "abandoned")


class MemoryRecords:
    """A ledger kept in memory (the simulator, in-process tests): ``records`` to verify."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)

    def close(self) -> None:
        pass


class Ledger:
    """Appends ledger records: one flushed line each to a file, or to ``MemoryRecords``."""

    def __init__(self, target: Path | MemoryRecords) -> None:
        self._writer = JsonlWriter(target) if isinstance(target, Path) else target

    def _write(self, event: str, **fields: Any) -> None:
        self._writer.write({"event": event, **fields})

    def controller_start(self, *, version: int, epoch: int, resumed: bool) -> None:
        self._write("controller_start", version=version, epoch=epoch, resumed=resumed)

    def dispatched(
        self, group: int, *, prompt: int, epoch: int, instance: int, version: int
    ) -> None:
        self._write(
            "dispatched",
            group=group,
            prompt=prompt,
            epoch=epoch,
            instance=instance,
            version=version,
        )

    def completed(
        self,
        group: int,
        *,
        instance: int,
        version_min: int,
        version_max: int,
        lengths: Sequence[int],
    ) -> None:
        """Its samples came back, ``lengths`` completion tokens each."""
        self._write(
            "completed",
            group=group,
            instance=instance,
            version_min=version_min,
            version_max=version_max,
            lengths=list(lengths),
        )

    def consumed(self, groups: Iterable[int], *, step: int, lags: Iterable[int]) -> None:
        for group, lag in zip(groups, lags, strict=True):
            self._write("consumed", group=group, step=step, lag=lag)

    def discarded(self, group: int, *, reason: str) -> None:
        self._write("discarded", group=group, reason=reason, requeue=True)

    def requeued(self, group: int, *, reason: str) -> None:
        self._write("requeued", group=group, reason=reason)

    def aborted(self, group: int, *, reason: str) -> None:
        self._write("aborted", group=group, reason=reason, requeue=True)

    def skipped(self, group: int, *, reason: str) -> None:
        self._write("skipped", group=group, reason=reason, requeue=False)

    def migrated(self, group: int, *, instance: int, to: int, tokens: int) -> None:
        """Moved, still in flight, from ``instance`` to ``to`` with ``tokens`` generated."""
        self._write("migrated", group=group, instance=instance, to=to, tokens=tokens)

    def ignored(self, group: int, *, reason: str) -> None:
        self._write("ignored", group=group, reason=reason)

    def close(self) -> None:
        self._writer.close()


@dataclass
class LedgerReport:
    """What :func:`verify_ledger` found. ``ok`` means no error at all."""

    dispatched: int = 0
    counts: Counter[str] = field(default_factory=Counter)
    consumed_twice: list[int] = field(default_factory=list)
    prompts_consumed_twice: list[tuple[int, int]] = field(default_factory=list)
    """(epoch, prompt) pairs consumed more than once within the epoch."""
    in_flight: list[int] = field(default_factory=list)
    queued: list[int] = field(default_factory=list)
    """Groups completed and not consumed when the ledger ends."""
    requeued_pending: list[tuple[int, int]] = field(default_factory=list)
    """(epoch, prompt) given back (requeued/discarded/aborted) and never dispatched again nor
    consumed: only legitimate when the run ended right after."""
    errors: list[str] = field(default_factory=list)
    restarts: int = 0

    @property
    def ok(self) -> bool:
        return not self.errors

    def summary(self) -> str:
        parts = [f"{self.dispatched} dispatched"]
        parts += [f"{v} {k}" for k, v in sorted(self.counts.items()) if k != "dispatched"]
        parts.append(f"{len(self.in_flight)} in flight, {len(self.queued)} queued at the end")
        status = "OK" if self.ok else f"{len(self.errors)} error(s): {self.errors[:3]}"
        return f"ledger {status}: " + ", ".join(parts)


def verify_ledger(path: Path) -> LedgerReport:
    """Replay ``path`` and prove no group was lost or consumed twice."""
    return verify_records(read_jsonl(Path(path)))


def verify_records(records: Iterable[dict[str, Any]]) -> LedgerReport:
    report = LedgerReport()
    state: dict[int, str] = {}
    origin: dict[int, tuple[int, int]] = {}  # group -> (epoch, prompt)
    consumed_prompts: Counter[tuple[int, int]] = Counter()
    given_back: set[tuple[int, int]] = set()
    open_prompts: defaultdict[tuple[int, int], set[int]] = defaultdict(set)
    for line, rec in enumerate(records, start=1):
        event = rec.get("event")
        if event == "controller_start":
            report.restarts += 1
            for gid, st in state.items():
                if st in _TRANSITIONS:
                    state[gid] = "abandoned"
                    report.counts["abandoned"] += 1
                    open_prompts[origin[gid]].discard(gid)
                    given_back.add(origin[gid])
            continue
        gid = rec.get("group")
        if not isinstance(gid, int):
            report.errors.append(f"line {line}: {event!r} without an integer group id")
            continue
        if event == "dispatched":
            if gid in state:
                report.errors.append(f"line {line}: group {gid} dispatched twice")
                continue
            key = (int(rec.get("epoch", 0)), int(rec["prompt"]))
            state[gid], origin[gid] = "in_flight", key
            report.dispatched += 1
            report.counts["dispatched"] += 1
            open_prompts[key].add(gid)
            given_back.discard(key)
            continue
        if gid not in state:
            report.errors.append(f"line {line}: {event!r} for group {gid} never dispatched")
            continue
        if event == "ignored":
            report.counts["ignored"] += 1
            continue
        current = state[gid]
        if event == "consumed" and current == "consumed":
            report.consumed_twice.append(gid)
            report.errors.append(f"line {line}: group {gid} consumed twice")
            continue
        nxt = _TRANSITIONS.get(current, {}).get(str(event))
        if nxt is None:
            report.errors.append(f"line {line}: {event!r} for group {gid} in state {current}")
            continue
        state[gid] = nxt
        report.counts[str(event)] += 1
        key = origin[gid]
        if nxt == "consumed":
            consumed_prompts[key] += 1
            if consumed_prompts[key] == 2:
                report.prompts_consumed_twice.append(key)
                report.errors.append(
                    f"line {line}: prompt {key[1]} consumed twice in epoch {key[0]}"
                )
        if nxt in TERMINAL:
            open_prompts[key].discard(gid)
            if nxt not in ("consumed", "skipped"):
                given_back.add(key)
    report.in_flight = sorted(g for g, st in state.items() if st == "in_flight")
    report.queued = sorted(g for g, st in state.items() if st == "completed")
    report.requeued_pending = sorted(
        k for k in given_back if not open_prompts[k] and consumed_prompts[k] == 0
    )
    return report


@dataclass(frozen=True)
class EpochSamples:
    """What one epoch's prompts gave the trainer, replayed from a ledger."""

    epoch: int
    prompts: int
    """Distinct prompts of the epoch handed out."""
    lengths: dict[int, list[int]]
    """Prompt -> the completion lengths of its consumed group."""
    handed_out: bool
    """A later epoch was dispatched: every prompt of this one had been handed out."""

    @property
    def complete(self) -> bool:
        """Every prompt of the epoch was consumed."""
        return self.handed_out and len(self.lengths) == self.prompts

    @property
    def mean_length(self) -> float:
        """Mean completion tokens per consumed sample (0 if none)."""
        samples = [n for group in self.lengths.values() for n in group]
        return sum(samples) / len(samples) if samples else 0.0


def epoch_samples(records: Iterable[dict[str, Any]], epoch: int) -> EpochSamples:
    """The consumed samples of ``epoch``'s prompts: a policy that defers or reorders is compared
    with another on the same prompts, each consumed once, rather than on a window of steps."""
    origin: dict[int, int] = {}  # group of this epoch -> prompt
    lengths: dict[int, list[int]] = {}  # group -> its completion lengths
    consumed: dict[int, list[int]] = {}
    prompts: set[int] = set()
    later = False
    for rec in records:
        event, gid = rec.get("event"), rec.get("group")
        if event == "dispatched":
            if int(rec.get("epoch", 0)) == epoch:
                origin[gid] = int(rec["prompt"])
                prompts.add(origin[gid])
            later = later or int(rec.get("epoch", 0)) > epoch
        elif event == "completed" and gid in origin:
            lengths[gid] = list(rec.get("lengths", ()))
        elif event == "consumed" and gid in origin:
            consumed[origin[gid]] = lengths.get(gid, [])
    return EpochSamples(epoch, len(prompts), consumed, later)
