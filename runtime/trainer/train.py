"""The policy being trained: model, optimizer, one GRPO step, checkpoints and weight export.

``Trainer`` knows nothing about sockets; ``runtime.trainer.loop`` feeds it batches. Every rank
builds one and calls ``step`` with the same batch; each rank trains on its balanced share and
DDP averages the gradients, so all ranks end the step with identical weights.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator

from runtime.collective import WeightServer
from runtime.config import Config
from runtime.protocol import Batch, StepMetrics
from runtime.rundir import RunDir
from runtime.trainer import weights as weights_mod
from runtime.trainer.batching import (
    Sample,
    balance_partitions,
    collate,
    micro_batches,
    samples_from_batch,
)
from runtime.trainer.grpo import LossStats, grpo_loss, token_logprobs

log = logging.getLogger(__name__)

_CHECKPOINT_RE = re.compile(r"^step-(\d+)$")
KEEP_CHECKPOINTS = 2
"""Checkpoints kept on disk: the newest and one before it, in case the newest is unreadable."""
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class EmptyBatch(ValueError):
    """A batch with no trainable completion (raised on every rank alike, before any collective)."""


@dataclass
class StepResult:
    metrics: StepMetrics
    problems: list[str]
    """Completions left out of the step, with the reason."""
    share_samples: int = 0
    """Samples this rank trained on (its balanced share)."""
    share_tokens: int = 0


class Trainer:
    """One rank's share of the GRPO trainer."""

    def __init__(self, config: Config, run_dir: RunDir, model_path: str) -> None:
        from transformers import AutoModelForCausalLM

        from runtime.tasks import load_tokenizer

        self.config = config
        self.run_dir = run_dir
        self.model_path = model_path
        cpu = not torch.cuda.is_available()
        mixed = "bf16" if (not cpu and config.model.dtype == "bfloat16") else "no"
        # cpu=True is required on a GPU-less box: without it every torchrun rank comes up as a
        # separate non-distributed trainer (reference notes, section 5).
        self.accelerator = Accelerator(cpu=cpu, mixed_precision=mixed)
        self.tokenizer = load_tokenizer(model_path)
        self.pad_token_id = int(self.tokenizer.pad_token_id)
        # Master weights stay float32; bf16 is autocast (GPU) and the published dtype.
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        model.config.use_cache = False
        self.vocab_size = int(model.config.vocab_size)
        # No weight decay (TRL's default): with it, a batch without signal (all advantages 0)
        # would still shrink every weight.
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.trainer.lr, weight_decay=0.0)
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        self.ref_model = None
        if config.trainer.loss.kl_coef > 0:
            ref = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
            self.ref_model = ref.to(self.accelerator.device).eval().requires_grad_(False)
        self.publish_dtype = _DTYPES[config.model.dtype]
        temperature = config.rollout.sampling.temperature
        self.temperature = temperature if temperature > 0 else 1.0
        self.version = 0
        self.weight_server: WeightServer | None = None
        """Rank 0 under ``async.weight_sync: collective`` (see ``runtime.trainer.loop``)."""

    # --- properties ---------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.accelerator.process_index

    @property
    def world_size(self) -> int:
        return self.accelerator.num_processes

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    # --- one step -----------------------------------------------------------------------------

    def step(self, batch: Batch) -> StepResult:
        """One optimizer step on ``batch`` (identical on every rank); ``version`` += 1."""
        started = time.perf_counter()
        loss_cfg = self.config.trainer.loss
        samples, problems = samples_from_batch(
            batch, self.vocab_size, scale_rewards=loss_cfg.scale_rewards
        )
        if not samples:
            raise EmptyBatch(
                f"batch for version {batch.version} has no trainable completion: "
                + "; ".join(problems[:3])
            )
        lengths = [s.length for s in samples]
        share = balance_partitions(lengths, self.world_size)[self.rank]
        if loss_cfg.aggregation == "token":
            normalizer = float(sum(s.completion_len for s in samples))
        else:
            normalizer = float(len(samples))
        # DDP averages gradients over ranks; scaling by the world size turns that average back
        # into the sum of per-rank contributions to one global mean.
        scale = float(self.world_size)

        model = self.model
        model.train()
        chunks = micro_batches(share, lengths, self.config.trainer.micro_batch_size)
        if not chunks:
            # More ranks than samples: this rank still joins DDP's all-reduce with a zero loss.
            chunks, scale = [[0]], 0.0
        totals = torch.zeros(6, dtype=torch.float64)
        loss_sum = torch.zeros((), dtype=torch.float64)
        for i, chunk in enumerate(chunks):
            packed = collate([samples[j] for j in chunk], self.pad_token_id).to(
                self.accelerator.device
            )
            last = i == len(chunks) - 1
            # Gradients accumulate locally and are all-reduced once, in the last backward.
            context = self.accelerator.no_sync(model) if not last else nullcontext()
            with context:
                with self.accelerator.autocast():
                    logits = model(
                        input_ids=packed.input_ids, attention_mask=packed.attention_mask
                    ).logits[:, :-1]
                    logp, entropy = token_logprobs(
                        logits, packed.targets, self.temperature, with_entropy=True
                    )
                    ref_logp = self._ref_logprobs(packed) if self.ref_model is not None else None
                    loss, stats = grpo_loss(
                        logp,
                        packed.behaviour_logprobs,
                        packed.advantages,
                        packed.loss_mask,
                        proximal_logp=logp.detach() if loss_cfg.decoupled else None,
                        ref_logp=ref_logp,
                        entropy=entropy,
                        clip_eps=loss_cfg.clip_eps,
                        clip_eps_high=loss_cfg.clip_eps_high,
                        importance_cap=loss_cfg.importance_cap,
                        kl_coef=loss_cfg.kl_coef,
                        aggregation=loss_cfg.aggregation,
                        normalizer=normalizer,
                    )
                self.accelerator.backward(loss * scale)
            if scale:
                totals += stats.as_tensor().cpu()
                loss_sum += loss.detach().double().cpu()
        grad_norm = self.accelerator.clip_grad_norm_(
            model.parameters(), self.config.trainer.grad_clip
        )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1

        reduced = self._all_reduce(torch.cat([totals, loss_sum.reshape(1)]))
        loss_metrics = LossStats.metrics_from(reduced[:6])
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
        metrics = StepMetrics(
            loss=float(reduced[6]),
            reward_mean=float(rewards.mean()),
            reward_std=float(rewards.std(correction=0)),
            kl=loss_metrics["kl"],
            clip_fraction=loss_metrics["clip_fraction"],
            importance_clip_fraction=loss_metrics["importance_clip_fraction"],
            grad_norm=float(grad_norm),
            entropy=loss_metrics["entropy"],
            tokens=int(sum(s.completion_len for s in samples)),
            samples=len(samples),
            response_length_mean=float(sum(s.completion_len for s in samples) / len(samples)),
            compute_s=time.perf_counter() - started,
        )
        return StepResult(
            metrics=metrics,
            problems=problems,
            share_samples=len(share),
            share_tokens=sum(lengths[i] for i in share),
        )

    def _ref_logprobs(self, packed) -> torch.Tensor:
        assert self.ref_model is not None
        with torch.no_grad():
            logits = self.ref_model(
                input_ids=packed.input_ids, attention_mask=packed.attention_mask
            ).logits[:, :-1]
            logp, _ = token_logprobs(logits, packed.targets, self.temperature)
        return logp

    def _all_reduce(self, values: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return values
        # gloo and NCCL both reduce float64 on their device.
        tensor = values.to(self.accelerator.device)
        torch.distributed.all_reduce(tensor)
        return tensor.cpu()

    # --- logprobs for tests and diagnostics ---------------------------------------------------

    def completion_logprobs(self, samples: list[Sample]) -> list[np.ndarray]:
        """Per-token log-probs of each sample's completion under the current weights (no grad).

        What a perfectly matched engine would report as behaviour log-probs.
        """
        model = self.accelerator.unwrap_model(self.model)
        with torch.no_grad():
            packed = collate(samples, self.pad_token_id).to(self.accelerator.device)
            logits = model(input_ids=packed.input_ids, attention_mask=packed.attention_mask).logits
            logp, _ = token_logprobs(logits[:, :-1], packed.targets, self.temperature)
        logp, mask = logp.cpu(), packed.loss_mask.cpu()
        return [logp[row][mask[row]].numpy().astype(np.float32) for row in range(len(samples))]

    # --- weights ------------------------------------------------------------------------------

    def export_weights(self) -> dict[str, torch.Tensor]:
        """Full HF-named tensors in the publish dtype (a collective under FSDP: call on all)."""
        return weights_mod.full_state_dict(
            self.accelerator.unwrap_model(self.model), dtype=self.publish_dtype
        )

    def local_checksum(self) -> str:
        """sha256 of this rank's own parameters, float32 as trained (for divergence checks)."""
        return weights_mod.checksum(
            weights_mod.full_state_dict(self.accelerator.unwrap_model(self.model))
        )

    def publish(self) -> Path | None:
        """Make ``version``'s weights available to the workers; every rank must call this.

        With a ``weight_server`` (rank 0, ``async.weight_sync: collective``) they are packed
        into it, to be served once ``promote``d; otherwise rank 0 writes the safetensors file
        and returns its path. None: no file was written.
        """
        model = self.accelerator.unwrap_model(self.model)
        if self.weight_server is not None:
            self.weight_server.stage(
                self.version,
                weights_mod.state_items(model),
                self.config.async_.weight_bucket_mb << 20,
                dtype=self.publish_dtype,
            )
            return None
        if self.config.async_.weight_sync == "collective" and not self.is_main:
            for _ in weights_mod.state_items(model):  # rank 0's gathers, in step (FSDP)
                pass
            return None
        return self.write_weights_file()

    def write_weights_file(self) -> Path:
        """Write ``version``'s safetensors file (rank 0 writes; every rank must call this)."""
        tensors = self.export_weights()
        # Absolute, so a worker started from another directory can open it.
        path = self.run_dir.weights_file(self.version).resolve()
        if self.is_main:
            weights_mod.publish_weights(
                tensors, self.run_dir, self.version, self.config.trainer.keep_weight_versions
            )
        return path

    # --- checkpoints --------------------------------------------------------------------------

    def save_checkpoint(self) -> Path:
        """``accelerator.save_state`` into ``checkpoints/step-<version>`` (collective).

        The state is written into a ``.tmp`` folder that rank 0 renames once every rank is done,
        so a crash mid-save never leaves a checkpoint that resume would pick.
        """
        final = self.run_dir.checkpoints / f"step-{self.version:06d}"
        tmp = final.with_name(final.name + ".tmp")
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self.accelerator.wait_for_everyone()
        self.accelerator.save_state(str(tmp), safe_serialization=True)
        self.accelerator.wait_for_everyone()
        if self.is_main:
            (tmp / "trainer_state.json").write_text(
                json.dumps({"version": self.version, "model_path": self.model_path})
            )
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            for old in checkpoint_dirs(self.run_dir)[:-KEEP_CHECKPOINTS]:
                shutil.rmtree(old, ignore_errors=True)
        self.accelerator.wait_for_everyone()
        return final

    def load_latest_checkpoint(self) -> Path | None:
        """Resume from the newest complete checkpoint, if any; sets ``version``."""
        found = checkpoint_dirs(self.run_dir)
        if not found:
            return None
        latest = found[-1]
        self.accelerator.load_state(str(latest))
        self.version = int(json.loads((latest / "trainer_state.json").read_text())["version"])
        self.accelerator.wait_for_everyone()
        return latest


def checkpoint_dirs(run_dir: RunDir) -> list[Path]:
    """Complete checkpoints (a ``trainer_state.json`` inside), oldest first."""
    if not run_dir.checkpoints.is_dir():
        return []
    found = []
    for path in run_dir.checkpoints.iterdir():
        match = _CHECKPOINT_RE.match(path.name)
        if match and (path / "trainer_state.json").is_file():
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]
