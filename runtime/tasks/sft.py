"""Supervised warm start of the built-in tiny model on a task's (prompt, completion) pairs.

It runs once per cache key (see :func:`runtime.tasks.ensure_model`) and takes seconds on two
cores: a few hundred AdamW steps of next-token loss on the completion and its EOS.
"""

from __future__ import annotations

import logging
import math
import random
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from runtime.tasks.base import SupervisedTask, encode_prompt

if TYPE_CHECKING:
    from runtime.config import Config

log = logging.getLogger(__name__)

SFT_BATCH = 32
SFT_LR = 1e-2
SFT_WARMUP = 20
SFT_THREADS = 2
"""The default machine has 2 cores shared by every process; more threads only thrash."""


def _batch(tokenizer, pairs, max_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, attention mask and labels (-100 outside the completion + EOS)."""
    seqs, labels = [], []
    for prompt, completion in pairs:
        p = encode_prompt(tokenizer, prompt)
        c = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids = (p + c)[:max_len]
        seqs.append(ids)
        labels.append(([-100] * len(p) + c)[:max_len])
    width = max(len(s) for s in seqs)
    pad = tokenizer.pad_token_id
    input_ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    label_ids = torch.full((len(seqs), width), -100, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (s, lab) in enumerate(zip(seqs, labels, strict=True)):
        input_ids[i, : len(s)] = torch.tensor(s)
        label_ids[i, : len(lab)] = torch.tensor(lab)
        mask[i, : len(s)] = 1
    return input_ids, mask, label_ids


def _default_progress() -> Callable[[int, int, Mapping[str, float]], None] | None:
    """A rich progress bar on a terminal; plain log lines otherwise."""
    if not sys.stderr.isatty():
        return None
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    bar = Progress(
        TextColumn("warm start (SFT)"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} loss {task.fields[loss]:.3f}"),
        TimeRemainingColumn(),
        transient=True,
    )
    handle = None

    def update(step: int, total: int, metrics: Mapping[str, float]) -> None:
        nonlocal handle
        if handle is None:
            bar.start()
            handle = bar.add_task("sft", total=total, loss=float("nan"))
        bar.update(handle, completed=step, loss=metrics.get("loss", float("nan")))
        if step >= total:
            bar.stop()

    return update


def warm_start(
    model_dir: Path,
    task: SupervisedTask,
    config: Config,
    progress: Callable[[int, int, Mapping[str, float]], None] | None = None,
) -> dict[str, Any]:
    """Train ``model_dir`` in place for ``config.task.sft_steps`` steps; return a summary."""
    from transformers import AutoModelForCausalLM

    from runtime.tasks.base import load_tokenizer

    steps = config.task.sft_steps
    progress = progress or _default_progress()
    threads = torch.get_num_threads()
    torch.set_num_threads(min(threads, SFT_THREADS))
    started = time.monotonic()
    try:
        tokenizer = load_tokenizer(str(model_dir))
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        model.train()
        max_len = model.config.max_position_embeddings
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.run.seed)
            rng = random.Random(config.run.seed)
            optimizer = torch.optim.AdamW(model.parameters(), lr=SFT_LR, weight_decay=0.0)

            def lr_at(step: int) -> float:
                # Linear warm-up, then cosine decay to 10%: stable and quick for a tiny model.
                if step < SFT_WARMUP:
                    return (step + 1) / SFT_WARMUP
                frac = (step - SFT_WARMUP) / max(1, steps - SFT_WARMUP)
                return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))

            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
            loss_ema = float("nan")
            every = max(1, steps // 10)
            for step in range(steps):
                ids, mask, labels = _batch(tokenizer, task.sft_examples(SFT_BATCH, rng), max_len)
                loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                value = float(loss.detach())
                loss_ema = value if math.isnan(loss_ema) else 0.9 * loss_ema + 0.1 * value
                if progress is not None:
                    progress(step + 1, steps, {"loss": loss_ema})
                elif (step + 1) % every == 0 or step + 1 == steps:
                    log.info("warm start step %d/%d loss %.3f", step + 1, steps, loss_ema)
        model.eval()
        model.save_pretrained(str(model_dir), safe_serialization=True)
    finally:
        torch.set_num_threads(threads)
    elapsed = time.monotonic() - started
    log.info("warm start: %d steps in %.1fs, loss %.3f", steps, elapsed, loss_ema)
    return {"steps": steps, "seconds": round(elapsed, 2), "loss": round(loss_ema, 4)}
