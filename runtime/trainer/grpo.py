"""The GRPO loss with off-policy corrections, as pure torch functions.

Notation (reference notes, section 6): a group is the G completions o_i of one prompt with rewards
r_i; t indexes completion tokens, m_{i,t} is the loss mask. Three policies meet in one loss, as in
AReaL's decoupled PPO (``inclusionAI/AReaL areal/utils/functional/functional.py``,
``ppo_actor_loss_fn``; docs ``docs/algorithms/grpo_series.md``):

- pi_behav: the vLLM engine(s) that sampled the tokens, possibly several weight versions ago;
  its per-token log-probs travel with each sample.
- pi_prox: the proximal policy, the trainer's weights at the start of this step.
- pi_theta: the policy being optimised.

With one optimizer step per batch (our loop), pi_prox equals pi_theta in value, so the PPO ratio
is 1 and only its gradient remains; the staleness correction then lives entirely in the truncated
importance weight pi_prox / pi_behav. This is what TRL does with ``num_iterations=1`` and
``vllm_importance_sampling_mode="token_truncate"``. Passing no proximal log-probs gives the
coupled PPO objective that clips the ratio against pi_behav directly (verl ``bypass_mode``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from runtime.trainer.advantages import group_advantages as shared_group_advantages

Aggregation = Literal["token", "sequence"]

# exp() of a log-ratio beyond this is a numerical accident, not information (|log| > 20 means
# a probability ratio above 5e8); clamp before exponentiating so one token cannot produce inf.
_MAX_LOG_RATIO = 20.0


def tensor_group_advantages(
    rewards: Tensor, group_ids: Tensor, scale_rewards: bool = True, eps: float = 1e-6
) -> Tensor:
    """:func:`runtime.trainer.advantages.group_advantages` (the one definition) for tensors:
    float32 advantages, one per sample."""
    advantages = shared_group_advantages(
        rewards.detach().cpu().numpy(), group_ids.detach().cpu().numpy(), scale_rewards, eps
    )
    return torch.from_numpy(advantages).to(torch.float32)


def token_logprobs(
    logits: Tensor, targets: Tensor, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[Tensor, Tensor | None]:
    """log pi(target_t | prefix) for every position, and optionally the entropy (no grad).

    ``logits`` [B, T, V] are divided by ``temperature`` first, because vLLM's behaviour log-probs
    come from the temperature-adjusted distribution (``logprobs_mode="processed_logprobs"``).
    ``targets`` [B, T] are the next tokens (the caller shifts). The log-prob is
    ``logit[target] - logsumexp(logits)``, which, unlike ``log_softmax(...).gather``, keeps no
    second [B, T, V] tensor for backward (TRL's ``selective_log_softmax`` trick); the entropy
    is computed one row at a time for the same reason.
    """
    logits = logits.float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    logp = picked - torch.logsumexp(logits, dim=-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            rows = []
            for row in logits.detach():
                logp_row = torch.log_softmax(row, dim=-1)
                rows.append(-(logp_row.exp() * logp_row).sum(-1))
            entropy = torch.stack(rows)
    return logp, entropy


@dataclass
class LossStats:
    """Sums over this rank's masked tokens (or sequences); all-reduce them, then divide."""

    tokens: Tensor
    sequences: Tensor
    clipped_tokens: Tensor
    importance_clipped_tokens: Tensor
    kl_sum: Tensor
    entropy_sum: Tensor

    def as_tensor(self) -> Tensor:
        return torch.stack(
            [
                self.tokens,
                self.sequences,
                self.clipped_tokens,
                self.importance_clipped_tokens,
                self.kl_sum,
                self.entropy_sum,
            ]
        ).to(torch.float64)

    @staticmethod
    def metrics_from(total: Tensor) -> dict[str, float]:
        """Means from (possibly all-reduced, possibly summed over micro-batches) ``as_tensor``."""
        tokens = max(float(total[0]), 1.0)
        return {
            "tokens": float(total[0]),
            "sequences": float(total[1]),
            "clip_fraction": float(total[2]) / tokens,
            "importance_clip_fraction": float(total[3]) / tokens,
            "kl": float(total[4]) / tokens,
            "entropy": float(total[5]) / tokens,
        }


def grpo_loss(
    logp: Tensor,
    behaviour_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    proximal_logp: Tensor | None = None,
    ref_logp: Tensor | None = None,
    entropy: Tensor | None = None,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    importance_cap: float = 2.0,
    kl_coef: float = 0.0,
    aggregation: Aggregation = "token",
    normalizer: float | None = None,
) -> tuple[Tensor, LossStats]:
    """The clipped, importance-corrected GRPO loss of one micro-batch.

    Shapes: ``logp``, ``behaviour_logp``, ``proximal_logp``, ``ref_logp``, ``entropy``, ``mask``
    are [B, T] (token positions); ``advantages`` is [B] (one per sequence, broadcast to tokens).

    Per token, with A the advantage and eps_h = ``clip_eps_high`` or ``clip_eps``:

        r  = pi_theta / pi_old,  pi_old = pi_prox if given, else pi_behav
        w  = min(pi_prox / pi_behav, C)  (detached; C = ``importance_cap``; 1 without pi_prox)
        l  = -w * min(r A, clip(r, 1 - eps, 1 + eps_h) A)  +  beta * k3
        k3 = pi_ref / pi_theta - log(pi_ref / pi_theta) - 1      (beta = ``kl_coef``)

    The clip is PPO's (Schulman 2017), the asymmetric upper bound DAPO's "clip-higher"
    (TRL ``epsilon_high``, verl ``clip_ratio_high``). The weight w is AReaL's decoupled
    behaviour weight (``behav_imp_weight_cap``), truncated rather than masked as in TRL's
    ``vllm_importance_sampling_mode="token_truncate"`` (cap C, default 2 here, 3 in TRL).
    k3 is Schulman's low-variance KL estimator (TRL ``beta``, verl ``low_var_kl``).

    Aggregation:
    - ``token``: sum_{i,t} m l / N with N = ``normalizer`` or the local masked-token count
      (DAPO / TRL ``loss_type="dapo"`` / verl ``token-mean``). Pass the global token count of
      the whole batch as ``normalizer`` so micro-batches and ranks sum to one mean.
    - ``sequence``: sum_i (sum_t m l / sum_t m) / N with N = ``normalizer`` or the number of
      sequences (original GRPO / TRL ``loss_type="grpo"`` / verl ``seq-mean-token-mean``).

    Returns the scalar loss and ``LossStats`` sums: clipped tokens are those where the clip
    changed the objective (r < 1-eps with A < 0, or r > 1+eps_h with A > 0, as TRL counts them);
    importance-clipped tokens are those whose raw weight exceeded C.
    """
    if aggregation not in ("token", "sequence"):
        raise ValueError(f"aggregation: {aggregation!r}, allowed: 'token', 'sequence'")
    mask = mask.bool()
    maskf = mask.to(logp.dtype)
    adv = advantages.to(logp.dtype).unsqueeze(-1)
    old = proximal_logp if proximal_logp is not None else behaviour_logp
    log_ratio = torch.where(mask, logp - old.detach(), 0.0).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    low, high = 1.0 - clip_eps, 1.0 + (clip_eps_high if clip_eps_high is not None else clip_eps)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(low, high) * adv)
    clipped = ((ratio < low) & (adv < 0)) | ((ratio > high) & (adv > 0))

    if proximal_logp is not None:
        behav_log_w = torch.where(mask, proximal_logp - behaviour_logp, 0.0).detach()
        raw_w = torch.exp(behav_log_w.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
        weight = raw_w.clamp(max=importance_cap)
        importance_clipped = raw_w > importance_cap
    else:
        weight = torch.ones_like(logp)
        importance_clipped = torch.zeros_like(mask)

    per_token = -weight * surrogate
    kl = torch.zeros_like(logp)
    if ref_logp is not None:
        delta = torch.where(mask, ref_logp.detach() - logp, 0.0).clamp(
            -_MAX_LOG_RATIO, _MAX_LOG_RATIO
        )
        kl = torch.exp(delta) - delta - 1.0
        if kl_coef > 0:
            per_token = per_token + kl_coef * kl
    # where(), not multiplication: a NaN at a padded position must not leak into the sum.
    per_token = torch.where(mask, per_token, 0.0)

    seq_tokens = maskf.sum(-1)
    has_tokens = seq_tokens > 0
    if aggregation == "token":
        denom = normalizer if normalizer is not None else seq_tokens.sum().clamp(min=1.0)
        loss = per_token.sum() / denom
    else:
        seq_loss = per_token.sum(-1) / seq_tokens.clamp(min=1.0)
        denom = normalizer if normalizer is not None else has_tokens.sum().clamp(min=1)
        loss = seq_loss.sum() / denom

    with torch.no_grad():
        stats = LossStats(
            tokens=seq_tokens.sum(),
            sequences=has_tokens.sum().to(logp.dtype),
            clipped_tokens=(clipped & mask).sum().to(logp.dtype),
            importance_clipped_tokens=(importance_clipped & mask).sum().to(logp.dtype),
            kl_sum=torch.where(mask, kl, 0.0).sum(),
            entropy_sum=(
                torch.where(mask, entropy, 0.0).sum()
                if entropy is not None
                else torch.zeros((), dtype=logp.dtype)
            ),
        )
    return loss, stats
