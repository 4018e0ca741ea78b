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
  round is never deferred again.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from runtime.scheduler.base import (
    Defer,
    GroupSpec,
    InstanceSpec,
    Move,
    Plan,
    PlannedScheduler,
    Predictions,
    RolloutView,
)
from runtime.scheduler.cost_model import CostModel, iteration_estimate

TAIL_PRIORITY = -1
"""Engine priority of a regenerated (deferred) group: ahead of everything planned."""


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
        self.cap = float(pred.longest.max()) if len(pred.longest) else pred.default
        self.quantile = quantile
        self.defer_factor = defer_factor
        self.release_at = batch_groups if release_at is None else release_at
        # Per-token time of a full instance at the plan's mean context: the slowest a running
        # sequence goes, so elapsed / it never overstates what a group has generated.
        c = float(np.mean([s.max_num_seqs for s in instances])) if instances else 1.0
        ctx = float(np.mean(pred.longest)) if len(pred.longest) else pred.default
        self.token_s = self.cost_model.decode_step_s(int(c), c * ctx)
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
        once it has run past it."""
        prior = float(self.longest[g])
        if generated > prior * self._ratio_q:
            return max(self.cap, generated)
        return max(prior * self._ratio_mid, generated)

    # --- serving ------------------------------------------------------------------------------
    def next_groups(self, instance_id: int, max_groups: int) -> list[int]:
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
        take, self.tail = self.tail[:k], self.tail[k:]
        if not self.tail:
            self._releasing = False
        for g in take:
            self._tail_started.add(g)
        return [self.groups[g].prompt_id for g in take]

    def requeue(self, prompt_ids: Sequence[int]) -> None:
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

    def priority(self, prompt_id: int) -> int:
        g = self.index.get(prompt_id)
        return TAIL_PRIORITY if g is not None and g in self._tail_started else 0

    # --- repair -------------------------------------------------------------------------------
    def repair_due(self, now: float, version: int) -> bool:
        if version != self._version:
            if self._version >= 0:
                span = now - self._version_at
                self.period_s = span if self._measured == 0 else 0.7 * self.period_s + 0.3 * span
                self._measured += 1
            self._version, self._version_at = version, now
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
                        f"projected {left_s:.1f}s past its deadline "
                        f"(trainer period {self.period_s:.1f}s)",
                    )
                )
            else:
                soonest = min(soonest, left_s)
        # Look again when the first of the kept ones should have finished: if it has not, it
        # has run past its estimate, and the estimate grows.
        self._next_check = view.now + max(0.05 * self.period_s, soonest)
        return out
