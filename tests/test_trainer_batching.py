"""Packing a Batch into tensors, length balancing across ranks, micro-batching."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from runtime.protocol import Batch, Completion, TrainGroup
from runtime.trainer.batching import balance_partitions, collate, micro_batches, samples_from_batch
from runtime.trainer.synthetic import random_batch


def _completion(tokens: list[int], logprobs: list[float], reward: float) -> Completion:
    return Completion(
        token_ids=np.array(tokens, dtype=np.int32),
        logprobs=np.array(logprobs, dtype=np.float32),
        version_min=3,
        version_max=4,
        finish_reason="stop",
        reward=reward,
        finished_at=0.0,
    )


def _batch() -> Batch:
    group = TrainGroup(
        group_id=11,
        prompt_id=5,
        prompt_token_ids=np.array([1, 20, 21], dtype=np.int32),
        completions=[
            _completion([30, 31], [-0.1, -0.2], 1.0),
            _completion([40, 41, 42, 43], [-1.0, -2.0, -3.0, -4.0], 0.0),
        ],
    )
    return Batch(version=4, groups=[group])


def test_collate_aligns_behaviour_logprobs_with_completion_tokens() -> None:
    samples, problems = samples_from_batch(_batch(), vocab_size=100)
    assert problems == []
    assert [s.prompt_len for s in samples] == [3, 3]
    assert [s.completion_len for s in samples] == [2, 4]
    assert samples[0].advantage > 0 > samples[1].advantage
    assert (samples[0].version_min, samples[0].version_max) == (3, 4)
    packed = collate(samples, pad_token_id=0)
    assert packed.input_ids.tolist() == [[1, 20, 21, 30, 31, 0, 0], [1, 20, 21, 40, 41, 42, 43]]
    assert packed.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0, 0], [1] * 7]
    # position j scores token j+1: the masked targets are exactly the completion tokens
    assert packed.targets[packed.loss_mask].tolist() == [30, 31, 40, 41, 42, 43]
    assert packed.behaviour_logprobs[packed.loss_mask].tolist() == pytest.approx(
        [-0.1, -0.2, -1.0, -2.0, -3.0, -4.0]
    )
    assert packed.loss_mask.sum(-1).tolist() == [2, 4]
    assert packed.loss_mask[0].tolist() == [False, False, True, True, False, False]


def test_bad_completions_are_left_out_with_a_reason() -> None:
    batch = _batch()
    group = batch.groups[0]
    group.completions.append(_completion([50, 51], [-1.0], 1.0))
    group.completions.append(_completion([50, 999], [-1.0, -1.0], 1.0))
    group.completions.append(_completion([], [], 1.0))
    samples, problems = samples_from_batch(batch, vocab_size=100)
    assert len(samples) == 2
    assert len(problems) == 3
    assert "group 11 completion 2: 1 logprobs for 2 tokens" in problems[0]
    assert "outside the vocabulary [0, 100)" in problems[1]
    assert "no completion tokens" in problems[2]


def test_balance_partitions_known_example() -> None:
    parts = balance_partitions([7, 6, 5, 4, 3], 2)
    assert parts == [[0, 3, 4], [1, 2]]  # loads 14 and 11; LPT's answer, optimum is 13/12
    assert balance_partitions([], 3) == [[], [], []]
    with pytest.raises(ValueError, match="k: 0"):
        balance_partitions([1], 0)


def test_balance_partitions_is_within_the_lpt_bound_of_the_optimum() -> None:
    rng = random.Random(0)
    for _ in range(60):
        k = rng.randint(2, 3)
        weights = [rng.randint(1, 400) for _ in range(rng.randint(1, 9))]
        parts = balance_partitions(weights, k)
        assert sorted(itertools.chain(*parts)) == list(range(len(weights)))
        heaviest = max(sum(weights[i] for i in p) for p in parts)
        optimum = min(
            max(
                sum(w for w, a in zip(weights, assign, strict=True) if a == part)
                for part in range(k)
            )
            for assign in itertools.product(range(k), repeat=len(weights))
        )
        assert heaviest <= (4 / 3 - 1 / (3 * k)) * optimum + 1e-9
        assert balance_partitions(weights, k) == parts  # deterministic: every rank agrees


def test_balance_beats_round_robin_on_long_tailed_lengths() -> None:
    lengths = [1000, 900] + [50] * 30
    loads = [sum(lengths[i] for i in p) for p in balance_partitions(lengths, 2)]
    assert max(loads) - min(loads) <= 50
    naive = [sum(lengths[0::2]), sum(lengths[1::2])]
    assert max(naive) - min(naive) > max(loads) - min(loads)


def test_micro_batches_cover_every_index_longest_first() -> None:
    lengths = [5, 50, 20, 40, 10, 30, 60]
    chunks = micro_batches([0, 1, 2, 3, 4, 5], lengths, 4)
    assert chunks == [[1, 3, 5, 2], [4, 0]]
    assert micro_batches([], lengths, 4) == []
    with pytest.raises(ValueError, match="micro_batch_size"):
        micro_batches([0], lengths, 0)


def test_random_batch_packs_into_consistent_tensors() -> None:
    batch = random_batch(np.random.default_rng(1), groups=3, samples=4, vocab_size=50)
    samples, problems = samples_from_batch(batch, vocab_size=50)
    assert problems == [] and len(samples) == 12
    packed = collate(samples, pad_token_id=0)
    assert packed.loss_mask.sum().item() == sum(s.completion_len for s in samples)
    # group advantages sum to ~0 within each group
    adv = torch.tensor([s.advantage for s in samples]).reshape(3, 4)
    assert adv.sum(-1).abs().max().item() < 1e-5
