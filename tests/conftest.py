"""Shared test set-up: one model cache for every process a test starts."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LENGTHS = REPO.parent / "shared" / "data" / "lengths"

# Built models (the tiny Llama and its warm start) are cached by content hash, so every test
# and every process it starts reuses one build instead of racing to make its own.
os.environ.setdefault("ASP_TUI_CACHE", str(REPO / "runs" / ".cache"))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
