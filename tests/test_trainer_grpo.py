"""The GRPO loss on hand-made numbers: advantages, clipping, importance truncation, aggregation."""

from __future__ import annotations

import math

import pytest
import torch

from runtime.trainer.grpo import LossStats, grpo_loss, token_logprobs
from runtime.trainer.grpo import tensor_group_advantages as group_advantages


def _metrics(stats: LossStats) -> dict[str, float]:
    return LossStats.metrics_from(stats.as_tensor())


def test_equal_rewards_give_zero_advantage() -> None:
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.3, 0.3])
    groups = torch.tensor([7, 7, 7, 2, 2])
    for scale in (True, False):
        assert torch.equal(group_advantages(rewards, groups, scale), torch.zeros(5))


def test_advantages_are_normalised_within_each_group() -> None:
    rewards = torch.tensor([0.0, 1.0, 5.0, 5.0, 9.0, 1.0])
    groups = torch.tensor([0, 0, 1, 1, 1, 2])
    adv = group_advantages(rewards, groups, scale_rewards=True)
    # group 0: mean 0.5, unbiased std 1/sqrt(2); group 1: mean 19/3; a lone sample gets 0
    expected0 = 0.5 / (1 / math.sqrt(2) + 1e-6)
    assert adv[:2].tolist() == pytest.approx([-expected0, expected0], rel=1e-5)
    g1 = torch.tensor([5.0, 5.0, 9.0])
    assert adv[2:5].tolist() == pytest.approx(((g1 - g1.mean()) / (g1.std() + 1e-6)).tolist())
    assert adv[5] == 0.0
    unscaled = group_advantages(rewards, groups, scale_rewards=False)
    assert unscaled[:2].tolist() == pytest.approx([-0.5, 0.5])
    assert unscaled[2:5].tolist() == pytest.approx((g1 - g1.mean()).tolist())


def test_advantages_reject_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="same length"):
        group_advantages(torch.zeros(3), torch.zeros(2, dtype=torch.long))


def _ratios(values: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """logp (requires grad) and behaviour log-probs whose ratios are ``values``."""
    behaviour = torch.full((1, len(values)), -2.0)
    logp = (behaviour + torch.log(torch.tensor([values]))).requires_grad_(True)
    return logp, behaviour


def test_ratio_clipping_positive_advantage() -> None:
    logp, behaviour = _ratios([0.5, 1.0, 1.5])
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, stats = grpo_loss(logp, behaviour, torch.tensor([1.0]), mask, clip_eps=0.2)
    # min(r*A, clip(r, 0.8, 1.2)*A) = [0.5, 1.0, 1.2]; token mean, negated
    assert loss.item() == pytest.approx(-(0.5 + 1.0 + 1.2) / 3)
    assert _metrics(stats)["clip_fraction"] == pytest.approx(1 / 3)
    loss.backward()
    # d(-r/3)/dlogp = -r/3 where unclipped; the clipped token has no gradient
    assert logp.grad[0].tolist() == pytest.approx([-0.5 / 3, -1.0 / 3, 0.0])


def test_ratio_clipping_negative_advantage_and_clip_higher() -> None:
    logp, behaviour = _ratios([0.5, 1.0, 1.5])
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, stats = grpo_loss(logp, behaviour, torch.tensor([-1.0]), mask, clip_eps=0.2)
    # min(-r, -clip(r)) = [-0.8, -1.0, -1.5]: with A < 0 the low side is clipped
    assert loss.item() == pytest.approx((0.8 + 1.0 + 1.5) / 3)
    assert _metrics(stats)["clip_fraction"] == pytest.approx(1 / 3)
    # an asymmetric upper bound of 1.6 lets r = 1.5 through for A > 0
    loss_high, stats_high = grpo_loss(
        logp, behaviour, torch.tensor([1.0]), mask, clip_eps=0.2, clip_eps_high=0.6
    )
    assert loss_high.item() == pytest.approx(-(0.5 + 1.0 + 1.5) / 3)
    assert _metrics(stats_high)["clip_fraction"] == 0.0


def test_importance_weights_are_truncated_and_counted() -> None:
    # behaviour -> proximal weights [0.5, 1, 3, 10] with cap 2: two of four are truncated
    prox = torch.full((1, 4), -1.0)
    behaviour = prox - torch.log(torch.tensor([[0.5, 1.0, 3.0, 10.0]]))
    logp = prox.clone().requires_grad_(True)
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, stats = grpo_loss(
        logp, behaviour, torch.tensor([1.0]), mask, proximal_logp=prox, importance_cap=2.0
    )
    weights = [0.5, 1.0, 2.0, 2.0]
    assert loss.item() == pytest.approx(-sum(weights) / 4)
    assert _metrics(stats)["importance_clip_fraction"] == pytest.approx(0.5)
    assert _metrics(stats)["clip_fraction"] == 0.0
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([-w / 4 for w in weights])


def test_token_and_sequence_aggregation_differ_as_defined() -> None:
    # sequence 0: one token, A = +1; sequence 1: three tokens, A = -1; ratio 1 everywhere
    logp = torch.full((2, 3), -1.0)
    mask = torch.tensor([[True, False, False], [True, True, True]])
    adv = torch.tensor([1.0, -1.0])
    token, stats = grpo_loss(logp, logp, adv, mask, aggregation="token")
    sequence, _ = grpo_loss(logp, logp, adv, mask, aggregation="sequence")
    assert token.item() == pytest.approx((-1.0 + 3 * 1.0) / 4)
    assert sequence.item() == pytest.approx((-1.0 + 1.0) / 2)
    assert stats.tokens.item() == 4 and stats.sequences.item() == 2
    # an explicit normaliser (the global token count) replaces the local one
    half, _ = grpo_loss(logp, logp, adv, mask, aggregation="token", normalizer=8.0)
    assert half.item() == pytest.approx(token.item() / 2)
    with pytest.raises(ValueError, match="aggregation"):
        grpo_loss(logp, logp, adv, mask, aggregation="mean")  # type: ignore[arg-type]


def test_k3_kl_is_zero_at_the_reference_and_added_with_its_coefficient() -> None:
    logp = torch.tensor([[-1.0, -2.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    adv = torch.tensor([0.0])
    same, stats = grpo_loss(logp, logp, adv, mask, ref_logp=logp, kl_coef=0.5)
    assert same.item() == 0.0 and _metrics(stats)["kl"] == 0.0
    ref = torch.tensor([[-1.5, -1.0]])
    d = ref - logp
    k3 = (torch.exp(d) - d - 1).mean().item()
    loss, stats = grpo_loss(logp, logp, adv, mask, ref_logp=ref, kl_coef=0.5)
    assert k3 > 0
    assert _metrics(stats)["kl"] == pytest.approx(k3)
    assert loss.item() == pytest.approx(0.5 * k3)


def test_padding_never_leaks_into_the_loss() -> None:
    logp = torch.tensor([[-1.0, float("nan")]], requires_grad=True)
    behaviour = torch.tensor([[-1.0, float("-inf")]])
    mask = torch.tensor([[True, False]])
    loss, _ = grpo_loss(logp, behaviour, torch.tensor([2.0]), mask, proximal_logp=logp.detach())
    loss.backward()
    assert loss.item() == pytest.approx(-2.0)
    assert torch.isfinite(logp.grad).all()


def test_token_logprobs_match_a_plain_softmax_with_temperature() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=generator)
    targets = torch.randint(0, 11, (2, 5), generator=generator)
    logp, entropy = token_logprobs(logits, targets, temperature=0.7, with_entropy=True)
    probs = torch.softmax(logits / 0.7, dim=-1)
    expected = torch.log(probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1))
    assert torch.allclose(logp, expected, atol=1e-5)
    assert torch.allclose(entropy, -(probs * probs.log()).sum(-1), atol=1e-5)
    _, uniform = token_logprobs(
        torch.zeros(1, 1, 11), torch.zeros(1, 1, dtype=torch.long), 1.0, True
    )
    assert uniform.item() == pytest.approx(math.log(11))
