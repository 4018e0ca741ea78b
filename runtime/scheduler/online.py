"""asp's online layer: learns lengths while the epoch runs and keeps stragglers off the trainer.

The offline plan (``asp.plan_asp``) orders work on *predicted* lengths; under a small lag bound
the iteration time is set by the stragglers that no earlier sample foresees (a run to the
length cap is sampling noise). This layer, served in place of the plain ``PlannedScheduler``,
repairs the plan online (``long-tail-rollouts.md`` sections 1, 4.2 and 5):

- **Online length estimate** (Seer's, per group): ``max(upper quantile of the prior, what the
  group has generated so far)``. The prior's upper quantile is the predicted longest member
  times the ``quantile`` of the ratio actual/predicted longest over the groups finished this
  epoch (learned as it runs). A group that has run past its upper quantile is assumed to run
  to the cap (the longest length any prior saw or any group of this epoch reached), as Seer
  assumes the maximum for unknowns.
  What a running group has generated is bounded from the time it has run: elapsed / the
  per-token time of a full instance (the cost model).
- **Deadlines and deferral.** The lag governor makes the trainer wait (``lag_wait``) on the
  in-flight groups the next step must consume: those are at their deadline. Each one whose
  projected remaining time exceeds ``defer_factor`` of the trainer period (measured) is
  deferred: aborted (its partial work is lost, counted) and its prompt regenerated later, at a
  newer version, never dropped. Deferred prompts form a tail round (RollPacker's long round):
  they are started longest first, together, at the highest engine priority, once the plan's
  other work is handed out or a whole batch of them has gathered, so that the long runs hold
  one step instead of every step. A prompt is deferred at most once per epoch, so the tail
  round is never deferred again. Every other group's engine priority is its deadline (start
  version + η): earliest deadline first, in the engine's queue and in what it preempts.
- **Tail lane** (``tail_instances``): instances the plan leaves out, whose load the layer caps
  at ``tail_max_seqs`` sequences, so that a sequence there decodes near its single-sequence
  speed. A running group whose projected finish on its bulk instance misses its deadline (the
  start of the step that must consume it: the publish of its start version plus
  ``(η + 1)`` trainer periods less one trainer step), and would finish sooner on the tail lane,
  is moved there with its partial output (``Move``), longest projected remainder first, while
  the lane has room. The tail round of deferred prompts starts there too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from runtime.protocol import Lane
from runtime.scheduler.base import (
    Defer,
    GroupSpec,
    InstanceSpec,
    Move,
    Plan,
    PlannedScheduler,
    Predictions,
    RolloutView,
    Running,
)
from runtime.scheduler.cost_model import CostModel, iteration_estimate

TAIL_PRIORITY = -1
"""Engine priority of a regenerated (deferred) group: ahead of everything planned (whose
priorities are deadlines, never negative)."""


@dataclass(frozen=True, slots=True)
class Late:
    """A running group projected to miss its deadline where it runs."""

    running: Running
    n: int
    """Its samples."""
    generated: float
    """Tokens its longest member has generated (bounded from the time it has run)."""
    left: float
    """Tokens its longest member is expected to need still."""


class OnlinePlanned(PlannedScheduler):
    """A ``PlannedScheduler`` with the online layer (see the module docstring)."""

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
        steal: bool = True,
        quantile: float = 0.9,
        defer_factor: float = 1.0,
        release_at: int | None = None,
        tail_instances: Sequence[int] = (),
        tail_max_seqs: int = 16,
    ) -> None:
        pred = predictions or Predictions.of(groups)
        super().__init__(
            name,
            groups,
            instances,
            plan,
            batch_groups=batch_groups,
            lag_bound=lag_bound,
            cost_model=cost_model,
            predictions=pred,
            steal=steal,
        )
        self.limit = pred.limit
        self.cap = float(pred.longest.max()) if len(pred.longest) else pred.default
        self.quantile = quantile
        self.defer_factor = defer_factor
        self.release_at = batch_groups if release_at is None else release_at
        # Per-token time of a full instance at the plan's mean context: the slowest a running
        # sequence goes, so elapsed / it never overstates what a group has generated.
        c = float(np.mean([s.max_num_seqs for s in instances])) if instances else 1.0
        ctx = float(np.mean(pred.longest)) if len(pred.longest) else pred.default
        self.token_s = self.cost_model.decode_step_s(int(c), c * ctx)
        self.tail_ids = set(tail_instances) & set(self.specs)
        """The tail lane: never handed planned work (the plan is made without them)."""
        self.active -= self.tail_ids
        self.tail_active = set(self.tail_ids)
        self.tail_max_seqs = tail_max_seqs
        self.tail_token_s = self.cost_model.decode_step_s(tail_max_seqs, tail_max_seqs * ctx)
        self._tail_seqs = dict.fromkeys(self.tail_ids, 0)
        """Sequences the layer put on each tail instance (moved or started) and not yet back."""
        self._on_tail: dict[int, int] = {}
        """Prompt id -> the tail instance it runs on."""
        self.moved: set[int] = set()
        """Prompts moved to the tail lane this epoch (each at most once)."""
        self.train_s = self.cost_model.trainer_step_s(
            float(np.mean(pred.tokens)) * batch_groups if len(pred.tokens) else 0.0
        )
        self._published: dict[int, float] = {}
        """When each weight version was first seen (its publish, to the layer)."""
        self._ratios: list[float] = []
        self._ratio_q = 2.0  # until enough groups have finished
        self._ratio_mid = 1.0
        self.tail: list[int] = []
        """Deferred group indices waiting for the tail round (a max-heap by prior: longest
        first; kept sorted on insertion, it is small)."""
        self._deferring: set[int] = set()
        self.deferred: set[int] = set()
        """Prompts deferred this epoch (each at most once)."""
        self._tail_started: set[int] = set()
        self._releasing = False
        slots = [x.max_num_seqs for x in instances]
        self.period_s = iteration_estimate(
            pred.tokens, slots, batch_groups, lag_bound, self.cost_model
        )
        """Trainer period: the plan's estimate, then measured (EWMA of the time between
        version changes)."""
        self._version = -1
        self._measured = 0
        self._version_at = 0.0
        self._next_check = 0.0

    # --- length learning ----------------------------------------------------------------------
    def on_group_finished(self, prompt_id: int, instance_id: int, lengths: Sequence[int]) -> None:
        super().on_group_finished(prompt_id, instance_id, lengths)
        self._leave_tail(prompt_id)
        g = self.index.get(prompt_id)
        if g is None or not lengths:
            return
        self.cap = max(self.cap, float(max(lengths)))
        self._ratios.append(max(lengths) / max(1.0, float(self.longest[g])))
        if len(self._ratios) >= 32 and len(self._ratios) % 32 == 0:
            recent = self._ratios[-4096:]
            mid, q = np.quantile(recent, [0.5, self.quantile])
            self._ratio_mid, self._ratio_q = float(mid), max(1.0, float(q))

    def estimate(self, g: int, generated: float) -> float:
        """Tokens group ``g``'s longest member is expected to reach, having ``generated``: the
        prior's point (median ratio) while it is inside the prior's upper quantile, the cap
        once it has run past it; never past the sampling ``max_tokens``."""
        prior = float(self.longest[g])
        if generated > prior * self._ratio_q:
            guess = max(self.cap, generated)
        else:
            guess = max(prior * self._ratio_mid, generated)
        # No sample outruns max_tokens: the engine cuts it there (a learned ratio or an
        # elapsed-time guess could say more).
        return min(self.limit, guess)

    # --- serving ------------------------------------------------------------------------------
    def next_groups(self, instance_id: int, max_groups: int) -> list[int]:
        if instance_id in self.tail_active:
            room = (self.tail_max_seqs - self._tail_seqs[instance_id]) // self._n_of_tail()
            out = self._from_tail(min(max_groups, room))
            for p in out:
                self._join_tail(p, instance_id)
            return out
        if instance_id not in self.active or max_groups <= 0:
            return []
        if self.tail and (self._releasing or len(self.tail) >= self.release_at):
            self._releasing = True
            return self._from_tail(max_groups)
        out = super().next_groups(instance_id, max_groups)
        if not out and self.tail:
            self._releasing = True
            out = self._from_tail(max_groups)
        return out

    def _from_tail(self, k: int) -> list[int]:
        if k <= 0:
            return []
        take, self.tail = self.tail[:k], self.tail[k:]
        if not self.tail:
            self._releasing = False
        for g in take:
            self._tail_started.add(g)
        return [self.groups[g].prompt_id for g in take]

    def requeue(self, prompt_ids: Sequence[int]) -> None:
        for p in prompt_ids:
            self._leave_tail(p)
        back = [p for p in prompt_ids if p in self._deferring]
        if back:
            for p in back:
                self._deferring.discard(p)
                self.tail.append(self.index[p])
            self.tail.sort(key=lambda g: -self.longest[g])
        rest = [p for p in prompt_ids if p not in back]
        if rest:
            super().requeue(rest)

    def remaining(self) -> int:
        return super().remaining() + len(self.tail)

    def pending_groups(self) -> list[int]:
        return super().pending_groups() + [self.groups[g].prompt_id for g in self.tail]

    # --- the tail lane ------------------------------------------------------------------------
    def lane(self, instance_id: int) -> Lane:
        return Lane.TAIL if instance_id in self.tail_ids else Lane.BULK

    def _n_of_tail(self) -> int:
        return max(1, self.groups[self.tail[0]].n) if self.tail else 1

    def _join_tail(self, prompt_id: int, instance_id: int) -> None:
        g = self.index.get(prompt_id)
        self._on_tail[prompt_id] = instance_id
        self._tail_seqs[instance_id] += self.groups[g].n if g is not None else 1

    def _leave_tail(self, prompt_id: int) -> None:
        i = self._on_tail.pop(prompt_id, None)
        if i is not None:
            g = self.index.get(prompt_id)
            self._tail_seqs[i] -= self.groups[g].n if g is not None else 1

    def on_instance_paused(self, instance_id: int) -> None:
        if instance_id in self.tail_ids:
            self.tail_active.discard(instance_id)
        else:
            super().on_instance_paused(instance_id)

    def on_instance_resumed(self, instance_id: int) -> None:
        if instance_id in self.tail_ids:
            self.tail_active.add(instance_id)
        else:
            super().on_instance_resumed(instance_id)

    def priority(self, prompt_id: int, start_version: int) -> int:
        """Earliest deadline first: the last step allowed to consume the group (its start
        version + η), so that an engine's queue and its preemption favour the groups the
        trainer will wait on first; the tail round ahead of all."""
        g = self.index.get(prompt_id)
        if g is not None and g in self._tail_started:
            return TAIL_PRIORITY
        return start_version + self.lag_bound

    # --- repair -------------------------------------------------------------------------------
    def repair_due(self, now: float, version: int) -> bool:
        if version != self._version:
            if self._version >= 0:
                span = now - self._version_at
                self.period_s = span if self._measured == 0 else 0.7 * self.period_s + 0.3 * span
                self._measured += 1
            self._version, self._version_at = version, now
            self._published.setdefault(version, now)
            return self.period_s > 0
        return self.period_s > 0 and now >= self._next_check

    def repair(self, view: RolloutView) -> Sequence[Defer | Move]:
        out: list[Defer | Move] = []
        budget = self.defer_factor * self.period_s
        soonest = self.period_s
        for r in view.waiting:
            g = self.index.get(r.prompt_id)
            if g is None or r.prompt_id in self.deferred:
                continue
            generated = max(0.0, view.now - r.dispatched_at) / self.token_s
            left_s = (self.estimate(g, generated) - generated) * self.token_s
            if left_s > budget:
                self.deferred.add(r.prompt_id)
                self._deferring.add(r.prompt_id)
                out.append(
                    Defer(
                        r.group_id,
                        f"the trainer waits on it and it needs about {left_s:.1f}s more, "
                        f"over {self.defer_factor:g} x the trainer period "
                        f"({self.period_s:.1f}s)",
                    )
                )
            else:
                soonest = min(soonest, left_s)
        out.extend(self._to_tail(view))
        # Look again when the first of the kept ones should have finished: if it has not, it
        # has run past its estimate, and the estimate grows.
        step = max(0.05 * self.period_s, soonest)
        if self.tail_active:
            step = min(step, 0.1 * self.period_s)
        self._next_check = view.now + step
        return out

    def deadline(self, start_version: int) -> float:
        """When the step that must consume a group started at ``start_version`` is expected to
        start: η + 1 trainer periods after that version's publish, less one trainer step."""
        published = self._published.get(start_version, self._version_at)
        return published + (self.lag_bound + 1) * self.period_s - self.train_s

    def late(self, view: RolloutView) -> list[Late]:
        """The running groups on bulk instances projected to finish after their deadline there,
        not moved yet this epoch, longest remainder first."""
        out: list[Late] = []
        for r in view.running:
            g = self.index.get(r.prompt_id)
            if g is None or r.instance_id in self.tail_ids or r.prompt_id in self.moved:
                continue
            generated = max(0.0, view.now - r.dispatched_at) / self.token_s
            left = self.estimate(g, generated) - generated
            if view.now + left * self.token_s > self.deadline(r.start_version):
                out.append(Late(r, self.groups[g].n, generated, left))
        out.sort(key=lambda x: -x.left)
        return out

    def _to_tail(self, view: RolloutView) -> list[Move]:
        """Moves of the late groups (``late``) that would finish sooner on the tail lane, longest
        projected remainder first, while it has room."""
        if not self.tail_active:
            return []
        out: list[Move] = []
        for x in self.late(view):
            # The move's prefill of prompt plus partial output is the tail's price; it pays
            # when the remainder's saving exceeds it.
            saving = x.left * (self.token_s - self.tail_token_s)
            if saving <= self.cost_model.prefill_s(x.n * x.generated):
                continue
            to = max(self.tail_active, key=lambda i: (-self._tail_seqs[i], -i))
            if self._tail_seqs[to] + x.n > self.tail_max_seqs:
                break
            self.moved.add(x.running.prompt_id)
            self._join_tail(x.running.prompt_id, to)
            out.append(Move(x.running.group_id, to, TAIL_PRIORITY))
        return out
