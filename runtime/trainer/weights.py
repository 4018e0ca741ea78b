"""Publishing trainer weights for the rollout workers: versioned safetensors files.

Version v lives in ``RunDir.weights_file(v)``; version 0 is the initial model directory and has no
file. Names are the Hugging Face ``state_dict`` names of the unwrapped model
(``model.layers.0.self_attn.q_proj.weight``, ...), which is what vLLM's ``load_weights`` /
``reload_weights`` for a HF Llama expects.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from runtime.rundir import RunDir

# Wrapper prefixes that FSDP1, activation checkpointing, DDP and torch.compile insert; vLLM knows
# only the bare HF names.
_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
_VERSION_RE = re.compile(r"^v(\d+)\.safetensors$")


def hf_name(name: str) -> str:
    """Strip wrapper prefixes from a parameter name."""
    if name.startswith("module."):
        name = name[len("module.") :]
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def state_items(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(HF name, full tensor)`` of every entry of the state dict, tied duplicates removed, on
    the tensor's own device and in its own dtype (no copy on DDP or a single process).

    Iterate it on every rank, in step: under FSDP2 the parameters are DTensors and
    ``full_tensor()`` is a collective (all ranks gather, every rank gets the full tensor). Tied
    weights (``lm_head.weight`` sharing ``embed_tokens``) keep only the first name, as
    ``save_pretrained`` does; vLLM's Llama skips ``lm_head`` when tied.
    """
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    for name, value in model.state_dict().items():
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        if value.device.type != "meta":
            key = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape))
            if key in seen:
                continue
            seen.add(key)
        yield hf_name(name), value.detach()


def full_state_dict(
    model: torch.nn.Module, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """``state_items`` as full, CPU, contiguous tensors (floating ones in ``dtype``); call it
    on every rank."""
    tensors: dict[str, torch.Tensor] = {}
    for name, value in state_items(model):
        tensor = value.to("cpu")
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        tensors[name] = tensor.contiguous()
    return tensors


def checksum(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and bytes, in name order: equal iff the weights are."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def weight_versions(run_dir: RunDir) -> list[int]:
    """Versions with a published file, ascending."""
    if not run_dir.weights.is_dir():
        return []
    found = (_VERSION_RE.match(p.name) for p in run_dir.weights.iterdir())
    return sorted(int(m.group(1)) for m in found if m)


def publish_weights(
    tensors: dict[str, torch.Tensor], run_dir: RunDir, version: int, keep: int
) -> Path:
    """Write version ``version`` atomically, then prune; returns its path.

    safetensors goes to a temp file in the same folder, is fsynced and renamed over the target, so
    a worker never opens a partial file. ``save_file`` streams tensors to disk instead of building
    the whole file in memory first (``atomic_write_bytes`` would double peak memory for big
    models).
    """
    if version < 1:
        raise ValueError(f"version: {version}, published versions start at 1 (0 is the base model)")
    path = run_dir.weights_file(version)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"format": "pt", "version": str(version)})
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    prune_weights(run_dir, current=version, keep=keep)
    return path


def prune_weights(run_dir: RunDir, current: int, keep: int) -> list[Path]:
    """Keep versions ``current-keep+1 .. current``; delete older ones and any newer (stale).

    Newer files can only be left over from before a resume from an older checkpoint; they are not
    this run's history any more. The current version is never deleted (``keep`` >= 1). A worker
    that has a pruned file open keeps reading it (POSIX unlink semantics).
    """
    if keep < 1:
        raise ValueError(f"keep_weight_versions: {keep}, must be at least 1")
    removed = []
    for version in weight_versions(run_dir):
        if version <= current - keep or version > current:
            path = run_dir.weights_file(version)
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def remove_stale_temp_files(run_dir: RunDir) -> int:
    """Temp files of a crashed writer; only call it when no writer runs."""
    count = 0
    if run_dir.weights.is_dir():
        for path in run_dir.weights.glob(".v*.safetensors.*.tmp"):
            path.unlink(missing_ok=True)
            count += 1
    return count


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a published file (what a rollout worker feeds to ``reload_weights``)."""
    return load_file(str(path))
