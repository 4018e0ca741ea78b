"""Experiment tracking: every step record also goes to TensorBoard and, if configured, to W&B.

``metrics.jsonl`` stays the source of truth; the trackers get the same numbers under the names
TRL and verl users know (``reward/mean``, ``reward/<fn>``, ``completions/mean_length``,
``policy/lag_max``, ``timing/iteration_s``, ``bubble/<category>``; :data:`NAMES` is the whole
mapping, and the README prints it). TensorBoard event files go to ``<run_dir>/tensorboard``
(written with tensorboardX, which needs neither torch nor TensorFlow in the controller).
``telemetry.wandb`` logs to Weights & Biases; ``WANDB_MODE=offline`` writes
``<run_dir>/wandb/offline-run-*`` with no network. A tracker that fails is logged and switched
off: tracking never stops a run.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from runtime.config import Config

log = logging.getLogger(__name__)

NAMES: dict[str, str] = {
    "reward_mean": "reward/mean",
    "reward_std": "reward/std",
    "reward_mean_rollout": "reward/mean_rollout",
    "loss": "train/loss",
    "kl": "train/kl",
    "clip_fraction": "train/clip_ratio",
    "importance_clip_fraction": "train/importance_clip_ratio",
    "grad_norm": "train/grad_norm",
    "epoch": "train/epoch",
    "lag_mean": "policy/lag_mean",
    "lag_p95": "policy/lag_p95",
    "lag_max": "policy/lag_max",
    "lag_span_max": "policy/lag_span_max",
    "lag_bound": "policy/lag_bound",
    "queue_depth": "queue/depth",
    "in_flight": "queue/in_flight",
    "iteration_s": "timing/iteration_s",
    "step_s": "timing/step_s",
    "samples": "throughput/samples",
    "tokens": "throughput/tokens",
    "samples_per_s": "throughput/samples_per_s",
    "tokens_per_s": "throughput/tokens_per_s",
    "discarded_total": "groups/discarded_total",
    "skipped_groups_total": "groups/skipped_total",
    "deferred": "groups/deferred",
    "migrated": "groups/migrated",
    "predictor_rho": "predictor/rho",
    "predictor_mape": "predictor/mape",
    "predictor_longest_rho": "predictor/longest_rho",
    "predictor_longest_ratio": "predictor/longest_ratio",
}
"""metrics.jsonl field -> tracker name. ``bubble_<c>`` -> ``bubble/<c>``, ``predicted_bubble_<c>``
-> ``bubble_predicted/<c>``, ``reward_functions[fn]`` -> ``reward/<fn>``, ``tokens / samples`` ->
``completions/mean_length``, ``eval_<m>`` -> ``eval/<m>`` (``pass@k`` -> ``pass_at_k``)."""


def tracker_scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of a step (or eval) record under their tracker names."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in ("event", "step", "version", "time", "instance") or isinstance(value, bool):
            continue
        if key == "reward_functions" and isinstance(value, Mapping):
            for fn, mean in value.items():
                out[f"reward/{fn}"] = float(mean)
            continue
        if not isinstance(value, int | float) or not math.isfinite(value):
            continue  # histograms, None and NaN stay in metrics.jsonl only
        if key.startswith("predicted_bubble_"):
            name = "bubble_predicted/" + key.removeprefix("predicted_bubble_")
        elif key.startswith("bubble_"):
            name = "bubble/" + key.removeprefix("bubble_")
        elif key.startswith("eval_"):
            # TensorBoard allows no '@' in a tag: pass@4 is logged as pass_at_4.
            name = "eval/" + key.removeprefix("eval_").replace("@", "_at_")
        else:
            name = NAMES.get(key, key)
        out[name] = float(value)
    if record.get("samples"):
        out["completions/mean_length"] = float(record["tokens"]) / float(record["samples"])
    return out


class Trackers:
    """TensorBoard (always) and W&B (``telemetry.wandb``) for one run; owned by the controller."""

    def __init__(self, run_dir: Path, config: Config) -> None:
        self._tb: Any = None
        self._wandb: Any = None
        self._last_step = 0
        telemetry = config.telemetry
        if telemetry.tensorboard:
            try:
                from tensorboardX import SummaryWriter

                self._tb = SummaryWriter(logdir=str(run_dir / "tensorboard"), flush_secs=5)
            except Exception:
                log.exception("TensorBoard logging is off: its writer failed to start")
        if telemetry.wandb is not None:
            try:
                import wandb

                self._wandb = wandb.init(
                    project=telemetry.wandb.project,
                    name=telemetry.wandb.name or config.run.name,
                    entity=telemetry.wandb.entity,
                    dir=str(run_dir),
                    config=config.model_dump(mode="json", by_alias=True),
                    resume="allow",
                    id=telemetry.wandb.run_id,
                )
            except Exception:
                log.exception("W&B logging is off: wandb.init failed")

    def log(self, record: Mapping[str, Any], step: int) -> None:
        scalars = tracker_scalars(record)
        if self._tb is not None:
            try:
                for name, value in scalars.items():
                    self._tb.add_scalar(name, value, step)
            except Exception:
                log.exception("TensorBoard logging is off: a write failed")
                self._tb = None
        if self._wandb is not None:
            try:
                # W&B drops data logged at a step below its last one (an eval round that ends
                # after the next step record): such a record goes in at the latest step.
                self._last_step = max(self._last_step, step)
                self._wandb.log(scalars, step=self._last_step)
            except Exception:
                log.exception("W&B logging is off: a log call failed")
                self._wandb = None

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
