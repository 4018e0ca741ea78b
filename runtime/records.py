"""The trainer-step record of ``metrics.jsonl``: one typed definition, and its builder.

Each trainer step writes one ``StepRecord`` (``"event": "step"``) to ``runs/<name>/metrics.jsonl``
and to the trackers (``runtime/tracking.py``). The README's metrics.jsonl table documents every
field here; ``tests/test_step_record.py`` checks the two against each other. A field that is
``UNSET`` is left out of the line (it is written only when it means something), while ``None`` is
written as ``null``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import numpy as np

from runtime.protocol import BUBBLE_CATEGORIES, LagStats, StepMetrics


class StepRecord(msgspec.Struct, tag_field="event", tag="step", kw_only=True):
    """One trainer step, as written to ``metrics.jsonl``."""

    step: int
    """Trainer step just taken (= the new weight ``version``)."""
    version: int
    """The weight version the step produced."""
    reward_mean: float
    """Reward of the batch's samples, as the trainer saw it."""
    reward_mean_rollout: float
    """The same mean from the rewards the rollout workers reported."""
    reward_std: float
    loss: float
    """GRPO loss of the step."""
    kl: float
    """KL to the reference policy (0 unless ``loss.kl_coef``)."""
    clip_fraction: float
    """Fraction of tokens whose ratio was clipped."""
    importance_clip_fraction: float
    """Fraction of tokens whose importance weight was truncated at ``loss.importance_cap``."""
    grad_norm: float
    """Gradient norm before clipping."""
    lag_mean: float
    """Policy lag of the consumed samples (trainer version - ``version_min``)."""
    lag_p95: float
    lag_max: int
    lag_span_max: int
    """Largest ``version_max - version_min`` in the batch."""
    lag_histogram: list[int]
    """Count of samples per lag 0, 1, ..."""
    lag_bound: int
    """The bound η in force for this step."""
    pending_lag_bound: int | None
    """A lowered bound still waiting for in-flight work to drain (None if none)."""
    queue_depth: int
    """Finished groups waiting in the training queue, after the batch was taken."""
    in_flight: int
    """Groups being generated, after the batch was taken."""
    iteration_s: float
    """Wall time since the previous step."""
    step_s: float
    """The trainer's own work for this step (``compute_s`` + ``publish_s``)."""
    compute_s: float
    """Forward, backward and optimizer step."""
    publish_s: float
    """Writing the new weights for the workers."""
    wait_batch_s: float
    """The trainer waiting for this step's batch."""
    wait_ack_s: float
    """The previous step's acknowledgment round trip (off the critical path)."""
    checkpoint_s: float
    """The previous step's checkpoint (off the critical path)."""
    sync_s: float
    """The last completed weight sync: StepDone until every live instance had the version."""
    samples: int
    """Completions in the batch."""
    tokens: int
    """Completion tokens in the batch."""
    samples_per_s: float
    tokens_per_s: float
    epoch: int
    """Pass over the prompts the batch came from."""
    discarded_total: int
    """Groups discarded or aborted (and re-queued) so far to keep the bound."""
    skipped_groups_total: int
    """Groups dropped so far because a reward function failed."""
    deferred: int
    """Groups the scheduler deferred (aborted, to regenerate later) since the previous step."""
    migrated: int
    """Groups moved to another instance with their partial output since the previous step."""
    reward_functions: dict[str, float] | msgspec.UnsetType = msgspec.UNSET
    """Mean score of each reward function over the batch (when the task has several)."""
    predictor_rho: float | msgspec.UnsetType | None = msgspec.UNSET
    """Spearman ρ of predicted against observed group lengths this epoch (None: undefined)."""
    predictor_mape: float | msgspec.UnsetType = msgspec.UNSET
    """MAPE of the same (both written once two groups are known)."""
    predictor_longest_rho: float | None
    """Spearman ρ of the plan's predicted against the actual longest sample, over the batch's
    groups that had a prediction (None: fewer than three, or undefined)."""
    predictor_longest_ratio: float | None
    """Median actual/predicted longest sample over the same groups (None: none had one)."""
    bubble_useful: float
    """Measured fraction of rollout capacity since the previous step, per category; the eight
    ``bubble_*`` fields sum to 1."""
    bubble_padding: float
    bubble_skewness: float
    bubble_sorting: float
    bubble_sync: float
    bubble_paused: float
    bubble_down: float
    bubble_idle: float
    predicted_bubble_useful: float | msgspec.UnsetType = msgspec.UNSET
    """The scheduler's predicted fraction for the same category (only when the policy predicts
    one: ``asp``)."""
    predicted_bubble_padding: float | msgspec.UnsetType = msgspec.UNSET
    predicted_bubble_skewness: float | msgspec.UnsetType = msgspec.UNSET
    predicted_bubble_sorting: float | msgspec.UnsetType = msgspec.UNSET
    predicted_bubble_sync: float | msgspec.UnsetType = msgspec.UNSET
    predicted_bubble_paused: float | msgspec.UnsetType = msgspec.UNSET
    predicted_bubble_down: float | msgspec.UnsetType = msgspec.UNSET
    predicted_bubble_idle: float | msgspec.UnsetType = msgspec.UNSET
    time: float
    """Unix time of the record."""

    def to_dict(self) -> dict[str, Any]:
        """The ``metrics.jsonl`` line (and what the trackers log) as plain data."""
        return msgspec.to_builtins(self)


def step_record(
    *,
    step: int,
    metrics: StepMetrics,
    rollout_rewards: Sequence[float],
    lag: LagStats,
    lag_bound: int,
    pending_lag_bound: int | None,
    queue_depth: int,
    in_flight: int,
    iteration_s: float,
    sync_s: float,
    samples: int,
    tokens: int,
    epoch: int,
    discarded_total: int,
    skipped_groups_total: int,
    bubbles: Mapping[str, float],
    predicted_bubbles: Mapping[str, float],
    reward_functions: Mapping[str, float] | None = None,
    observed_lengths: Sequence[tuple[float, float]] = (),
    deferred: int = 0,
    migrated: int = 0,
    longest_lengths: Sequence[tuple[float, float]] = (),
    time: float,
) -> StepRecord:
    """Build a step's record. ``lag`` is the batch's lag statistics; ``bubbles`` and
    ``predicted_bubbles`` map a ``BUBBLE_CATEGORIES`` entry to its fraction (predicted may be
    empty); ``observed_lengths`` holds (predicted, actual) group lengths of this epoch, and
    ``longest_lengths`` (predicted, actual) longest samples of this batch's groups."""
    from runtime.scheduler.lengths import longest_quality, predictor_quality

    extra: dict[str, Any] = {f"bubble_{c}": float(bubbles[c]) for c in BUBBLE_CATEGORIES}
    for category, value in predicted_bubbles.items():
        if category not in BUBBLE_CATEGORIES:
            raise ValueError(
                f"predicted bubble category {category!r} is not one of {BUBBLE_CATEGORIES}"
            )
        extra[f"predicted_bubble_{category}"] = float(value)
    if reward_functions:
        extra["reward_functions"] = dict(reward_functions)
    if len(observed_lengths) >= 2:
        predicted, actual = zip(*observed_lengths, strict=True)
        rho, mape = predictor_quality(predicted, actual)
        extra["predictor_rho"] = None if np.isnan(rho) else rho
        extra["predictor_mape"] = mape
    longest_rho, longest_ratio = longest_quality(longest_lengths)
    iteration_s = max(iteration_s, 1e-9)
    return StepRecord(
        step=step,
        version=step,
        reward_mean=metrics.reward_mean,
        reward_mean_rollout=float(np.mean(rollout_rewards)) if len(rollout_rewards) else 0.0,
        reward_std=metrics.reward_std,
        loss=metrics.loss,
        kl=metrics.kl,
        clip_fraction=metrics.clip_fraction,
        importance_clip_fraction=metrics.importance_clip_fraction,
        grad_norm=metrics.grad_norm,
        lag_mean=lag.mean,
        lag_p95=lag.p95,
        lag_max=lag.max,
        lag_span_max=lag.span_max,
        lag_histogram=list(lag.histogram),
        lag_bound=lag_bound,
        pending_lag_bound=pending_lag_bound,
        queue_depth=queue_depth,
        in_flight=in_flight,
        iteration_s=iteration_s,
        step_s=metrics.step_s,
        compute_s=metrics.compute_s,
        publish_s=metrics.publish_s,
        wait_batch_s=metrics.wait_batch_s,
        wait_ack_s=metrics.wait_ack_s,
        checkpoint_s=metrics.checkpoint_s,
        sync_s=sync_s,
        samples=samples,
        tokens=tokens,
        samples_per_s=samples / iteration_s,
        tokens_per_s=tokens / iteration_s,
        epoch=epoch,
        discarded_total=discarded_total,
        skipped_groups_total=skipped_groups_total,
        deferred=deferred,
        migrated=migrated,
        predictor_longest_rho=longest_rho,
        predictor_longest_ratio=longest_ratio,
        time=time,
        **extra,
    )
