"""Cost model of a continuous-batching rollout instance and of the trainer step.

Decode step time is linear in what one step reads and computes::

    decode_step_s(r, ctx) = step_base_s + step_per_seq_s * r + step_per_ctx_token_s * ctx

for ``r`` running sequences whose contexts (prompt + generated so far) sum to ``ctx`` tokens.
Defaults are for a 7-8B dense model in bf16 on one H100-class GPU (80 GB HBM3, ~3.3 TB/s):

- ``step_base_s`` = 6 ms: reading 15 GB of weights at ~3 TB/s is ~5 ms per step, plus ~1 ms of
  scheduler/sampling overhead; this is the memory-bound floor at batch 1.
- ``step_per_seq_s`` = 50 us: the per-sequence matmul FLOPs (2 x 7.5e9 per token ~ 15 GFLOP, at
  ~400 TFLOP/s achieved ~ 40 us) plus sampling and detokenisation.
- ``step_per_ctx_token_s`` = 50 ns: KV-cache read, 128 KiB per token for a GQA model with 8 KV
  heads x 128 dims x 32 layers x (K, V) x 2 bytes, at ~2.6 TB/s achieved.
- ``prefill_per_token_s`` = 30 us: compute bound, 15 GFLOP per token at ~500 TFLOP/s achieved.
- ``max_num_seqs`` = 256, vLLM's default on such a GPU.
- Trainer: ``trainer_base_s`` = 1 s (optimizer step, weight export) plus
  ``1 / trainer_tokens_per_s`` per token; 48k tokens/s is 8 GPUs at ~6k tokens/s each for forward,
  backward and the reference forward of a 7B model (~8 x 7.5e9 FLOP/token at ~35% MFU).
- ``weight_sync_s`` = 0.3 s: broadcasting 15 GB of bf16 weights over NCCL at ~50 GB/s.

``CostModel.fit`` recalibrates any of these from measured step records (least squares,
non-negative).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

DURATIONS = (
    "step_base_s",
    "step_per_seq_s",
    "step_per_ctx_token_s",
    "prefill_base_s",
    "prefill_per_token_s",
    "trainer_base_s",
    "weight_sync_s",
)
"""The fields of ``CostModel`` that are seconds (or seconds per unit)."""


@dataclass(frozen=True)
class CostModel:
    step_base_s: float = 6e-3
    step_per_seq_s: float = 5e-5
    step_per_ctx_token_s: float = 5e-8
    prefill_base_s: float = 0.0
    prefill_per_token_s: float = 3e-5
    max_num_seqs: int = 256
    trainer_base_s: float = 1.0
    trainer_tokens_per_s: float = 48_000.0
    weight_sync_s: float = 0.3

    def __post_init__(self) -> None:
        for name in DURATIONS:
            if getattr(self, name) < 0:
                raise ValueError(f"CostModel.{name}: {getattr(self, name)} must be >= 0")
        if self.max_num_seqs < 1:
            raise ValueError(f"CostModel.max_num_seqs: {self.max_num_seqs} must be >= 1")
        if self.trainer_tokens_per_s <= 0:
            raise ValueError(
                f"CostModel.trainer_tokens_per_s: {self.trainer_tokens_per_s} must be > 0"
            )
        if self.step_base_s + self.step_per_seq_s <= 0:
            raise ValueError("CostModel: a decode step must take some time")

    @classmethod
    def sized_for(cls, instances: int, **overrides: Any) -> CostModel:
        """Defaults with the trainer scaled to a cluster of ``instances`` rollout GPUs: 20k
        tokens/s per instance and 0.5 s fixed per step. That keeps rollout, not the trainer,
        the bottleneck, as measured in practice (rollout is 63-90% of an RL step in RollPacker,
        Seer and APRIL; see shared/data/lengths/SOURCES.md), which is the regime the scheduler
        is for. The simulator and the CLI use this unless told otherwise."""
        kw: dict[str, Any] = {
            "trainer_tokens_per_s": 20_000.0 * max(1, instances),
            "trainer_base_s": 0.5,
        }
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def simulated(cls, trainer_step_s: float | None) -> CostModel:
        """What the sim backend and the sim trainer run on, in simulated seconds: the defaults,
        with a fixed trainer step where ``rollout.sim.trainer_step_s`` sets one."""
        model = cls()
        return model if trainer_step_s is None else model.with_fixed_trainer_step(trainer_step_s)

    def with_fixed_trainer_step(self, seconds: float) -> CostModel:
        """This model with a trainer step of ``seconds`` whatever the batch (the sim trainer's
        ``rollout.sim.trainer_step_s``)."""
        return replace(self, trainer_base_s=seconds, trainer_tokens_per_s=math.inf)

    def trainer_share(self, fraction: float) -> CostModel:
        """This model for a cluster and a trainer batch both scaled by ``fraction`` (a planner's
        subsample): the trainer's token rate scales with them, so that its step on the scaled
        batch takes as long as on the whole one."""
        if not 0 < fraction <= 1:
            raise ValueError(f"CostModel.trainer_share: fraction {fraction} must be in (0, 1]")
        return replace(self, trainer_tokens_per_s=self.trainer_tokens_per_s * fraction)

    def scaled(self, factor: float) -> CostModel:
        """This model with every duration multiplied by ``factor`` (rates divided by it): the
        sim backend's model in wall seconds is ``scaled(1 / rollout.sim.time_scale)``."""
        if not factor > 0:
            raise ValueError(f"CostModel.scaled: factor {factor} must be > 0")
        return replace(
            self,
            **{name: getattr(self, name) * factor for name in DURATIONS},
            trainer_tokens_per_s=self.trainer_tokens_per_s / factor,
        )

    # --- the three functions the simulator and the sim backend call ---------------------------
    def decode_step_s(self, running_seqs: int, context_tokens: float) -> float:
        """Seconds for one decode step of ``running_seqs`` sequences with ``context_tokens`` of
        context in total (0 running -> 0)."""
        if running_seqs <= 0:
            return 0.0
        return (
            self.step_base_s
            + self.step_per_seq_s * running_seqs
            + self.step_per_ctx_token_s * context_tokens
        )

    def prefill_s(self, tokens: float) -> float:
        """Seconds to prefill ``tokens`` prompt tokens (0 tokens -> 0)."""
        if tokens <= 0:
            return 0.0
        return self.prefill_base_s + self.prefill_per_token_s * tokens

    def trainer_step_s(self, tokens: float) -> float:
        """Seconds for one optimizer step on a batch of ``tokens`` (prompt + response) tokens."""
        return self.trainer_base_s + max(0.0, tokens) / self.trainer_tokens_per_s

    # --- helpers for planning -----------------------------------------------------------------
    def decode_steps_s(self, steps: float, running_seqs: int, context_tokens: float) -> float:
        """Seconds for ``steps`` consecutive steps while the running set is fixed (each step adds
        one token per sequence to the context)."""
        if running_seqs <= 0 or steps <= 0:
            return 0.0
        per = self.decode_step_s(running_seqs, context_tokens)
        return steps * per + self.step_per_ctx_token_s * running_seqs * steps * (steps - 1) / 2

    def token_s(self, running_seqs: int, mean_context: float) -> float:
        """Marginal seconds of one generated token on an instance holding ``running_seqs``."""
        r = max(1, running_seqs)
        return self.step_base_s / r + self.step_per_seq_s + self.step_per_ctx_token_s * mean_context

    def sequence_s(
        self, output_tokens: float, prompt_tokens: float, running_seqs: int, mean_context: float
    ) -> float:
        """Wall time of one sequence of ``output_tokens`` in a batch of ``running_seqs`` others
        whose mean context is ``mean_context`` (a planning estimate)."""
        return output_tokens * self.decode_step_s(running_seqs, running_seqs * mean_context) + (
            self.prefill_s(prompt_tokens)
        )

    # --- calibration --------------------------------------------------------------------------
    @classmethod
    def fit(cls, records: Iterable[Mapping[str, Any]], base: CostModel | None = None) -> CostModel:
        """Calibrate from measured records; kinds not measured keep ``base``'s values.

        Each record is a mapping with ``kind`` and ``seconds`` and:
        ``decode``: ``running_seqs``, ``context_tokens``; ``prefill``: ``tokens``;
        ``trainer``: ``tokens``. Coefficients are fitted by non-negative least squares.
        """
        base = base or cls()
        rows: dict[str, list[Mapping[str, Any]]] = {"decode": [], "prefill": [], "trainer": []}
        for k, rec in enumerate(records):
            kind = rec.get("kind")
            if kind not in rows:
                raise ValueError(
                    f"records[{k}].kind: {kind!r} is not one of decode, prefill, trainer"
                )
            if "seconds" not in rec or float(rec["seconds"]) < 0:
                raise ValueError(f"records[{k}].seconds: missing or negative")
            rows[kind].append(rec)
        out = base
        if rows["decode"]:
            x = np.array(
                [[1.0, r["running_seqs"], r["context_tokens"]] for r in rows["decode"]], float
            )
            y = np.array([r["seconds"] for r in rows["decode"]], float)
            a, b, c = _nnls(x, y)
            out = replace(out, step_base_s=a, step_per_seq_s=b, step_per_ctx_token_s=c)
        if rows["prefill"]:
            x = np.array([[1.0, r["tokens"]] for r in rows["prefill"]], float)
            y = np.array([r["seconds"] for r in rows["prefill"]], float)
            p0, p1 = _nnls(x, y)
            out = replace(out, prefill_base_s=p0, prefill_per_token_s=p1)
        if rows["trainer"]:
            x = np.array([[1.0, r["tokens"]] for r in rows["trainer"]], float)
            y = np.array([r["seconds"] for r in rows["trainer"]], float)
            t0, t1 = _nnls(x, y)
            out = replace(out, trainer_base_s=t0, trainer_tokens_per_s=1.0 / max(t1, 1e-12))
        return out


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (active-set by elimination; 2-3 unknowns)."""
    m = x.shape[1]
    best, best_err = np.zeros(m), float(np.sum(y**2))
    # Try every subset of free coefficients; with <= 3 unknowns that is at most 7 solves.
    for mask in range(1, 1 << m):
        cols = [j for j in range(m) if mask >> j & 1]
        coef, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
        if np.any(coef < 0):
            continue
        full = np.zeros(m)
        full[cols] = coef
        err = float(np.sum((x @ full - y) ** 2))
        if err < best_err - 1e-18:
            best, best_err = full, err
    return best


def iteration_estimate(
    tok: np.ndarray, slots: Sequence[int], b: int, lag_bound: int, cost: CostModel
) -> float:
    """Predicted time per trainer step: B groups' tokens at full-instance throughput, on
    instances of ``slots`` concurrency each."""
    if len(tok) == 0:
        return 0.0
    c = float(np.mean(slots))
    ctx = float(np.mean(tok))
    per_tok = cost.decode_step_s(int(c), c * ctx / 2) / c
    roll = float(np.mean(tok)) * b * per_tok / len(slots)
    train = cost.trainer_step_s(float(np.mean(tok)) * b)
    return roll + train if lag_bound == 0 else max(roll, train)
