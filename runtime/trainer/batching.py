"""From a wire ``Batch`` to padded tensors: samples, rank balancing, micro-batches, collation.

Every rank holds the whole batch (rank 0 broadcasts it), computes the same deterministic
partition, and trains on its own share. Advantages are computed on whole groups before the
split, so a group may be spread over ranks without changing its normalisation.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from runtime.protocol import Batch
from runtime.trainer.advantages import group_advantages


@dataclass(frozen=True)
class Sample:
    """One completion with its prompt, ready to train on."""

    input_ids: np.ndarray
    """Prompt then completion token ids (int64)."""
    prompt_len: int
    behaviour_logprobs: np.ndarray
    """One log-prob per completion token (float32), from the engine that sampled it."""
    advantage: float
    reward: float
    group_index: int
    version_min: int
    version_max: int

    @property
    def length(self) -> int:
        return len(self.input_ids)

    @property
    def completion_len(self) -> int:
        return len(self.input_ids) - self.prompt_len


def samples_from_batch(
    batch: Batch, vocab_size: int, scale_rewards: bool = True
) -> tuple[list[Sample], list[str]]:
    """Flatten a batch into samples with group-normalised advantages.

    Completions that cannot be trained on (no tokens, log-probs not aligned with tokens, token ids
    outside the vocabulary) are left out and described in the returned problem list, so one bad
    sample is logged instead of crashing the step. Their group's advantages are computed from the
    remaining members.
    """
    problems: list[str] = []
    kept: list[tuple[int, np.ndarray, np.ndarray, np.ndarray, float, int, int]] = []
    for gi, group in enumerate(batch.groups):
        prompt = np.array(group.prompt_token_ids, dtype=np.int64).reshape(-1)
        if prompt.size == 0:
            problems.append(f"group {group.group_id}: empty prompt_token_ids")
            continue
        for ci, comp in enumerate(group.completions):
            # Copies: decoded arrays are read-only views of the zmq frames.
            tokens = np.array(comp.token_ids, dtype=np.int64).reshape(-1)
            logprobs = np.array(comp.logprobs, dtype=np.float32).reshape(-1)
            where = f"group {group.group_id} completion {ci}"
            if tokens.size == 0:
                problems.append(f"{where}: no completion tokens")
            elif logprobs.shape != tokens.shape:
                problems.append(
                    f"{where}: {logprobs.size} logprobs for {tokens.size} tokens (must match)"
                )
            elif not np.isfinite(logprobs).all() or not np.isfinite(comp.reward):
                problems.append(f"{where}: non-finite logprobs or reward")
            elif (
                min(prompt.min(), tokens.min()) < 0 or max(prompt.max(), tokens.max()) >= vocab_size
            ):
                problems.append(f"{where}: token id outside the vocabulary [0, {vocab_size})")
            else:
                kept.append(
                    (gi, prompt, tokens, logprobs, float(comp.reward), comp.version_min,
                     comp.version_max)
                )  # fmt: skip
    if not kept:
        return [], problems
    rewards = np.array([k[4] for k in kept], dtype=np.float64)
    groups = np.array([k[0] for k in kept], dtype=np.int64)
    advantages = group_advantages(rewards, groups, scale_rewards=scale_rewards).tolist()
    samples = [
        Sample(
            input_ids=np.concatenate([prompt, tokens]),
            prompt_len=int(prompt.size),
            behaviour_logprobs=logprobs,
            advantage=float(adv),
            reward=reward,
            group_index=gi,
            version_min=vmin,
            version_max=vmax,
        )
        for (gi, prompt, tokens, logprobs, reward, vmin, vmax), adv in zip(
            kept, advantages, strict=True
        )
    ]
    return samples, problems


def balance_partitions(weights: Sequence[int], k: int) -> list[list[int]]:
    """Split item indices into ``k`` parts with near-equal weight sums (greedy LPT).

    Longest Processing Time first (Graham 1969): take the items heaviest first and give each to
    the currently lightest part. The heaviest part is at most (4/3 - 1/(3k)) times the optimum.
    Ties break on index, so every rank computes the same partition from the same batch. Used with
    token counts as weights, as verl's ``seqlen_balancing`` does with Karmarkar-Karp.
    """
    if k < 1:
        raise ValueError(f"k: {k}, must be at least 1")
    if any(w < 0 for w in weights):
        raise ValueError("weights: must be non-negative")
    order = sorted(range(len(weights)), key=lambda i: (-weights[i], i))
    heap = [(0, 0, part) for part in range(k)]  # (load, items, part index)
    parts: list[list[int]] = [[] for _ in range(k)]
    for i in order:
        load, count, part = heapq.heappop(heap)
        parts[part].append(i)
        heapq.heappush(heap, (load + weights[i], count + 1, part))
    return [sorted(p) for p in parts]


def micro_batches(indices: Sequence[int], lengths: Sequence[int], size: int) -> list[list[int]]:
    """Chunks of at most ``size`` items, longest first, so each chunk pads to similar lengths."""
    if size < 1:
        raise ValueError(f"micro_batch_size: {size}, must be at least 1")
    ordered = sorted(indices, key=lambda i: (-lengths[i], i))
    return [ordered[s : s + size] for s in range(0, len(ordered), size)]


@dataclass
class PackedBatch:
    """Right-padded tensors of one micro-batch.

    Position j of the ``[B, L-1]`` tensors scores token j+1 (next-token prediction): the loss
    mask is on for completion tokens only, and ``behaviour_logprobs[b, j]`` is the engine's
    log-prob of ``input_ids[b, j+1]``.
    """

    input_ids: Tensor
    attention_mask: Tensor
    targets: Tensor
    loss_mask: Tensor
    behaviour_logprobs: Tensor
    advantages: Tensor

    def to(self, device: torch.device | str) -> PackedBatch:
        return PackedBatch(**{k: v.to(device) for k, v in vars(self).items()})


def collate(samples: Sequence[Sample], pad_token_id: int) -> PackedBatch:
    """Pad ``samples`` to their longest member and align the behaviour log-probs."""
    if not samples:
        raise ValueError("collate: no samples")
    width = max(s.length for s in samples)
    b = len(samples)
    input_ids = torch.full((b, width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((b, width), dtype=torch.long)
    loss_mask = torch.zeros((b, width - 1), dtype=torch.bool)
    behaviour = torch.zeros((b, width - 1), dtype=torch.float32)
    for row, s in enumerate(samples):
        input_ids[row, : s.length] = torch.from_numpy(s.input_ids)
        attention[row, : s.length] = 1
        # completion token k sits at position prompt_len + k and is predicted at prompt_len+k-1
        start, stop = s.prompt_len - 1, s.length - 1
        loss_mask[row, start:stop] = True
        behaviour[row, start:stop] = torch.from_numpy(s.behaviour_logprobs)
    return PackedBatch(
        input_ids=input_ids,
        attention_mask=attention,
        targets=input_ids[:, 1:].clone(),
        loss_mask=loss_mask,
        behaviour_logprobs=behaviour,
        advantages=torch.tensor([s.advantage for s in samples], dtype=torch.float32),
    )
