"""Several policies planned and simulated on the same input, side by side (the scheduling
bench and ``asp-tui simulate``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from runtime.bubbles import excess_sorting
from runtime.scheduler.base import GroupSpec, InstanceSpec
from runtime.scheduler.cost_model import CostModel
from runtime.scheduler.policies import make_scheduler
from runtime.sim.engine import SimResult, simulate


def compare(
    policies: Sequence[str],
    groups: Sequence[GroupSpec],
    actual: Mapping[int, Sequence[int]],
    instances: Sequence[InstanceSpec],
    *,
    batch_groups: int,
    lag_bound: int,
    cost_model: CostModel | None = None,
    prompt_tokens: Mapping[int, int] | None = None,
    dispatch: str = "continuous",
    seed: int = 0,
    max_tokens: int | None = None,
) -> dict[str, SimResult]:
    """Plan and simulate each policy on the same input. Sorting is reported in excess of fifo's
    (fifo always runs first, as the baseline, even when not asked for). ``max_tokens`` is the
    sampling cap that the plans know, as a live run's do (None: none)."""
    cost = cost_model or CostModel()
    out: dict[str, SimResult] = {}

    def run(p: str, baseline: float | None) -> SimResult:
        s = make_scheduler(
            p,
            groups,
            instances,
            batch_groups=batch_groups,
            lag_bound=lag_bound,
            cost_model=cost,
            seed=seed,
            max_tokens=max_tokens,
        )
        return simulate(
            s,
            groups,
            actual,
            instances,
            batch_groups=batch_groups,
            lag_bound=lag_bound,
            cost_model=cost,
            prompt_tokens=prompt_tokens,
            dispatch=dispatch,
            sorting_baseline=baseline,
        )

    fifo = run("fifo", None)
    base = fifo.extra["raw_sorting"]
    fifo.breakdown.fractions = excess_sorting(fifo.breakdown.fractions, base)
    fifo.breakdown.sorting_baseline = base
    for p in policies:
        out[p] = fifo if p == "fifo" else run(p, base)
    return out
