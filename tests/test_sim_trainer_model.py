"""The sim trainer's step without a process (runtime/sim/trainer.py ``TrainerModel``), on a
hand-made batch whose metrics are worked out here."""

from __future__ import annotations

import math

import numpy as np
import pytest

from runtime.config import LossConfig
from runtime.protocol import Batch, Completion, TrainGroup
from runtime.scheduler.cost_model import CostModel
from runtime.sim.trainer import TrainerModel


def completion(reward: float, length: int) -> Completion:
    return Completion(
        token_ids=np.full(length, 7, dtype=np.int32),
        logprobs=np.full(length, -0.5, dtype=np.float32),
        version_min=0,
        version_max=0,
        finish_reason="stop",
        reward=reward,
        finished_at=0.0,
    )


def batch(version: int = 0) -> Batch:
    prompt = np.arange(5, dtype=np.int32)
    return Batch(
        version=version,
        groups=[
            TrainGroup(
                group_id=10,
                prompt_id=1,
                prompt_token_ids=prompt,
                completions=[completion(1.0, 2), completion(0.0, 4)],
            ),
            TrainGroup(
                group_id=11,
                prompt_id=2,
                prompt_token_ids=prompt,
                completions=[completion(1.0, 3), completion(1.0, 3)],
            ),
        ],
    )


def test_a_step_returns_the_batch_metrics_and_the_cost_model_s_step_time() -> None:
    cost = CostModel()
    model = TrainerModel(cost, LossConfig())
    metrics, seconds = model.step(batch())
    # Group 10: rewards 1, 0 -> advantages +-0.5 / (unbiased std 1/sqrt 2 + 1e-6); group 11
    # carries no signal. Token aggregation: -(2 a - 4 a) / 12.
    a = 0.5 / (1 / math.sqrt(2) + 1e-6)
    assert metrics.loss == pytest.approx(2 * a / 12)
    assert (metrics.reward_mean, metrics.reward_std) == pytest.approx((0.75, math.sqrt(0.1875)))
    assert (metrics.tokens, metrics.samples, metrics.response_length_mean) == (12, 4, 3.0)
    assert metrics.entropy == pytest.approx(0.5)
    # 12 response + 4 x 5 prompt tokens.
    assert seconds == pytest.approx(cost.trainer_step_s(32)) and metrics.step_s == seconds
    assert model.version == 0
    done = model.step_done(metrics)
    assert (done.version, done.weights_path, done.metrics) == (1, "", metrics)
    assert model.version == 1


def test_sequence_aggregation_and_a_fixed_step_time() -> None:
    fixed = CostModel().with_fixed_trainer_step(2.5)
    model = TrainerModel(fixed, LossConfig(aggregation="sequence"), version=4)
    metrics, seconds = model.step(batch(version=4))
    assert metrics.loss == pytest.approx(0.0, abs=1e-12)  # mean of +-a, 0, 0
    assert seconds == 2.5
    assert model.step_done(metrics, "w.json").version == 5
