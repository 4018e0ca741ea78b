"""GRPO's group-normalised advantages: the one definition in the tree (numpy, no torch).

The real trainer (:mod:`runtime.trainer.batching`) and the sim trainer
(:mod:`runtime.sim.trainer`, which must not need torch) call :func:`group_advantages`;
:func:`runtime.trainer.grpo.tensor_group_advantages` wraps it for tensors.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike


def group_advantages(
    rewards: ArrayLike, group_ids: ArrayLike, scale_rewards: bool = True, eps: float = 1e-6
) -> np.ndarray:
    """Group-normalised advantages, one per sample (float64).

    A_i = (r_i - mean_{j in g(i)} r_j) / (std_{j in g(i)} r_j + eps) with ``scale_rewards``
    (GRPO; TRL ``scale_rewards="group"``, verl ``compute_grpo_outcome_advantage`` with
    ``norm_adv_by_std_in_grpo=True``); A_i = r_i - mean_g r without it (Dr. GRPO, TRL
    ``scale_rewards="none"``). The std is the unbiased one, as TRL and verl use. A group whose
    rewards are all equal, or that has one member, gets advantage 0: it carries no signal.

    ``group_ids`` are arbitrary integers; samples with the same id form one group.
    """
    r = np.asarray(rewards, dtype=np.float64)
    ids = np.asarray(group_ids)
    if r.ndim != 1 or r.shape != ids.shape:
        raise ValueError(
            f"rewards {tuple(r.shape)} and group_ids {tuple(ids.shape)} must be 1-D "
            "and the same length"
        )
    if r.size == 0:
        return r
    _, index = np.unique(ids, return_inverse=True)
    index = index.reshape(-1)
    counts = np.bincount(index).astype(np.float64)
    mean = np.bincount(index, r) / counts
    centered = r - mean[index]
    if not scale_rewards:
        return centered
    squares = np.bincount(index, centered**2)
    std = np.sqrt(squares / np.maximum(counts - 1, 1))
    return centered / (std[index] + eps)
