"""Hugging Face reference decoding that vLLM's output is compared against (rollout tests)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch


def hf_model(weights: dict[str, torch.Tensor], model_dir: Path) -> Any:
    """The model in ``model_dir`` with ``weights`` loaded (float32, eval mode)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.load_state_dict(weights, strict=True)
    return model.eval()


@torch.no_grad()
def hf_greedy(model: Any, prompt: np.ndarray, max_tokens: int, eos: int) -> list[int]:
    """Greedy decoding, one token at a time, stopping after ``eos``."""
    ids = torch.tensor([prompt.tolist()], dtype=torch.long)
    out: list[int] = []
    for _ in range(max_tokens):
        token = int(model(input_ids=ids).logits[0, -1].argmax())
        out.append(token)
        if token == eos:
            break
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out
