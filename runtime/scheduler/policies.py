"""The policy registry and ``make_scheduler``, the controller's one entry point."""

from __future__ import annotations

from collections.abc import Sequence

from runtime.scheduler.base import (
    GroupSpec,
    InstanceSpec,
    PlannedScheduler,
    Predictions,
    Scheduler,
)
from runtime.scheduler.cost_model import CostModel
from runtime.scheduler.fifo import plan_fifo
from runtime.scheduler.length_sorted import plan_sorted

POLICIES = ("fifo", "sorted", "asp")


def _validate(
    groups: Sequence[GroupSpec],
    instances: Sequence[InstanceSpec],
    batch_groups: int,
    lag_bound: int,
) -> None:
    if not instances:
        raise ValueError("instances: at least one instance is required")
    if len({s.instance_id for s in instances}) != len(instances):
        raise ValueError("instances: instance_id values must be unique")
    if batch_groups < 1:
        raise ValueError(f"batch_groups: {batch_groups} must be >= 1")
    if lag_bound < 0:
        raise ValueError(f"lag_bound: {lag_bound} must be >= 0")
    for g in groups:
        if g.n < 1:
            raise ValueError(f"groups[prompt_id={g.prompt_id}].n: {g.n} must be >= 1")
        if g.predicted_lengths and min(g.predicted_lengths) < 0:
            raise ValueError(f"groups[prompt_id={g.prompt_id}].predicted_lengths: negative")
    for s in instances:
        if s.max_num_seqs < 1:
            raise ValueError(f"instances[{s.instance_id}].max_num_seqs must be >= 1")


def tail_lane(instances: Sequence[InstanceSpec], count: int) -> list[int]:
    """The ids of the instances kept for the tail lane: the last ``count``, never all."""
    if count < 0:
        raise ValueError(f"tail_instances: {count} must be >= 0")
    k = min(count, len(instances) - 1)
    return [s.instance_id for s in instances[len(instances) - k :]] if k > 0 else []


def make_scheduler(
    policy: str,
    groups: Sequence[GroupSpec],
    instances: Sequence[InstanceSpec],
    *,
    batch_groups: int,
    lag_bound: int,
    cost_model: CostModel | None = None,
    seed: int = 0,
    dispatch: str = "continuous",
    tail_instances: int = 0,
    tail_max_seqs: int = 16,
    defer_factor: float = 1.0,
    max_tokens: int | None = None,
) -> Scheduler:
    """Plan one epoch with ``policy`` and return the scheduler that serves and repairs it.

    ``dispatch`` is the controller's dispatch mode (``scheduler.dispatch`` in the config); asp
    scores its candidate plans under it. asp keeps the last ``tail_instances`` instances for its
    tail lane, loaded with at most ``tail_max_seqs`` sequences each (off by default: on the
    grouped traces deferral alone does better, see docs/scheduling.md). asp defers a running
    group the trainer waits on when its projected remaining time exceeds ``defer_factor`` x the
    trainer period. ``max_tokens`` (the sampling cap; None: none) caps every prediction."""
    if policy not in POLICIES:
        raise ValueError(f"policy: {policy!r} is not one of {', '.join(POLICIES)}")
    _validate(groups, instances, batch_groups, lag_bound)
    if not defer_factor > 0:
        raise ValueError(f"defer_factor: {defer_factor} must be > 0")
    if tail_max_seqs < 1:
        raise ValueError(f"tail_max_seqs: {tail_max_seqs} must be >= 1")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens: {max_tokens} must be >= 1")
    cost_model = cost_model or CostModel()
    # One pass over the groups for every user of the predictions: 1M groups cost ~0.3 s a pass.
    predictions = Predictions.of(groups, limit=max_tokens)
    if policy == "fifo":
        plan = plan_fifo(groups, instances)
    elif policy == "sorted":
        plan = plan_sorted(groups, instances, predictions)
    else:
        from runtime.scheduler.asp import plan_asp

        tail = tail_lane(instances, tail_instances)
        bulk = [s for s in instances if s.instance_id not in tail]
        plan, info = plan_asp(
            groups,
            bulk,
            batch_groups=batch_groups,
            lag_bound=lag_bound,
            cost_model=cost_model,
            seed=seed,
            dispatch=dispatch,
            predictions=predictions,
            defer_factor=defer_factor,
        )
        from runtime.scheduler.online import OnlinePlanned

        s = OnlinePlanned(
            policy,
            groups,
            instances,
            plan,
            batch_groups=batch_groups,
            lag_bound=lag_bound,
            cost_model=cost_model,
            predictions=predictions,
            steal=True,
            defer_factor=defer_factor,
            tail_instances=tail,
            tail_max_seqs=tail_max_seqs,
        )
        s.predicted_breakdown = info.predicted_breakdown
        s.plan_info = info
        s.name = "asp"
        return s
    return PlannedScheduler(
        policy,
        groups,
        instances,
        plan,
        batch_groups=batch_groups,
        lag_bound=lag_bound,
        cost_model=cost_model,
        predictions=predictions,
    )
