"""A Hugging Face model directory out of a run: config, tokenizer, safetensors, generation config.

``export_version(run_dir, out_dir, version)`` writes weight version ``version`` (default: the
newest kept one) of a run as a directory that ``AutoModelForCausalLM.from_pretrained`` and
``vllm.LLM`` load. The weights come from the run's published files (``weights/v<N>.safetensors``),
which hold full HF-named tensors: under FSDP the trainer gathers them on every rank and rank 0
writes them, so an export never needs the trainer. Config, tokenizer and generation config come
from weight version 0 (the model the run started from). The controller writes ``final/`` this
way at the end of a run; ``asp-tui export`` does it for any kept version.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from runtime.config import ConfigError, read_run_config
from runtime.rundir import RunDir

FINAL_DIR = "final"


def kept_versions(run_dir: RunDir) -> list[int]:
    """Versions an export can write: 0 (the starting model) and every published file."""
    from runtime.trainer.weights import weight_versions

    return [0, *weight_versions(run_dir)]


def export_version(run_dir: str | Path, out_dir: str | Path, version: int | None = None) -> Path:
    """Write ``version`` of the run in ``run_dir`` to ``out_dir`` (replaced atomically)."""
    import torch
    from huggingface_hub import save_torch_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from runtime.tasks import ensure_model, load_tokenizer, resolve_chat_template
    from runtime.trainer.weights import load_weights

    rd = RunDir(run_dir)
    if not rd.config.is_file():
        raise ConfigError(f"RUN_DIR: {str(rd.root)!r} is not a run directory (no config.yaml)")
    config = read_run_config(rd.root)
    if config.rollout.backend == "sim":
        raise ConfigError(f"RUN_DIR: {str(rd.root)!r} is a simulated run; it has no weights")
    kept = kept_versions(rd)
    version = kept[-1] if version is None else version
    if version not in kept:
        raise ConfigError(f"--version: {version} is not kept in {rd.root} (kept: {kept})")
    base = ensure_model(config)
    model_config = AutoConfig.from_pretrained(base)
    if version == 0:
        model = AutoModelForCausalLM.from_pretrained(base, dtype="auto")
        tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    else:
        tensors = load_weights(rd.weights_file(version))
    dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(dtypes) == 1:
        model_config.dtype = str(dtypes.pop()).removeprefix("torch.")
    tokenizer = load_tokenizer(base)
    template = resolve_chat_template(config.task.chat_template)
    if template:  # the run's prompts were formatted with it: ship it with the model
        tokenizer.chat_template = template
    try:
        generation = GenerationConfig.from_pretrained(base)
    except OSError:  # a model without generation_config.json: derive one from its config
        generation = GenerationConfig.from_model_config(model_config)

    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model_config.save_pretrained(tmp)
        generation.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        with torch.no_grad():
            # Shards above 5 GB, as save_pretrained does; tied duplicates were already dropped.
            save_torch_state_dict(tensors, tmp, max_shard_size="5GB")
        (tmp / "asp_tui_export.json").write_text(
            json.dumps({"run": config.run.name, "version": version}) + "\n"
        )
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
