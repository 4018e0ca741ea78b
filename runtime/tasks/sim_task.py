"""``sim``: the task of the simulated backend. Prompts are the rows of an output-length trace.

No model reads these prompts. Each one stands for a trace row: its ``meta`` carries the row's
sampled output lengths (``trace_lengths``: what the sim instances will generate, and what an
oracle length predictor would know) and its prompt length (``prompt_tokens``). The sim rollout
instances build this same task from the same config and look a prompt's lengths up by
``prompt_id`` (the index into :attr:`SimTask.prompts`; it equals the trace row when every row is
used), so the two sides always agree.

The trace is, in order of preference: ``rollout.sim.lengths``, ``task.lengths_trace``, the
CASTILLO grouped trace in ``../shared/data/lengths/`` (10 samples per prompt, GRPO-like), or the
1,200-row CASTILLO sample shipped in ``runtime/tasks/data/`` when ``../shared`` is absent.

Rewards: :func:`sim_reward` is a deterministic, binary "the answer was right" draw whose success
probability rises with the weight version that generated the sample and falls with a per-prompt
difficulty, so that reward curves and group advantages look like those of a verifiable task.
"""

from __future__ import annotations

import csv
import hashlib
import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from runtime.tasks.base import TaskPrompt

if TYPE_CHECKING:
    from runtime.config import Config

log = logging.getLogger(__name__)

DEFAULT_TRACE = "castillo_10samples_per_prompt_test.csv"
SHARED_LENGTHS = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "lengths"
"""``../shared/data/lengths`` relative to the repository root."""

BUILTIN_SAMPLE = "builtin:castillo-sample"
"""Value of ``rollout.sim.lengths`` that forces the packaged sample."""

DEFAULT_PROMPT_TOKENS = 64
"""Prompt length for traces that do not record one (seqsched)."""

SYNTHETIC_VOCAB = 32_000
"""Token ids of sim prompts and completions are drawn from [4, SYNTHETIC_VOCAB) (Llama-sized;
ids 0-3 are left for special tokens)."""

_GROUP_COLUMN = re.compile(r"^(o\d+|out_t[\d.]+)$")


def packaged_sample() -> Path:
    """The CASTILLO sample that ships with ``runtime.tasks`` (see ``data/SOURCES.md``)."""
    return Path(str(resources.files("runtime.tasks") / "data" / "castillo_sample.csv"))


def resolve_trace(config: Config) -> tuple[Path, str]:
    """The trace file to use and the config field it came from (for error messages)."""
    for field, value in (
        ("rollout.sim.lengths", config.rollout.sim.lengths),
        ("task.lengths_trace", config.task.lengths_trace),
    ):
        if not value:
            continue
        if value == BUILTIN_SAMPLE:
            return packaged_sample(), field
        path = Path(value)
        if not path.is_file():
            raise ValueError(
                f"{field}: {value!r} is not a file (use a CSV from ../shared/data/lengths, or "
                f"{BUILTIN_SAMPLE!r})"
            )
        return path, field
    shared = SHARED_LENGTHS / DEFAULT_TRACE
    if shared.is_file():
        return shared, "default"
    return packaged_sample(), "default"


@dataclass(frozen=True)
class TraceRow:
    """One trace row: the prompt's length and its sampled output lengths (all >= 1)."""

    row: int
    prompt_tokens: int
    lengths: tuple[int, ...]
    label: str


def load_trace(path: str | Path, field: str = "rollout.sim.lengths") -> list[TraceRow]:
    """Rows of a CSV in ``shared/data/lengths`` format.

    Grouped traces (castillo ``o1..o10``, seqsched ``out_t*``) give every sample of a row; flat
    traces (azure, mooncake: ``output_tokens``) give one sample per row. PMFs (servegen) have no
    prompts and are refused.
    """
    file = Path(path)
    with file.open(newline="") as handle:
        reader = csv.DictReader(handle)
        columns = list(reader.fieldnames or [])
        if "prob" in columns:
            raise ValueError(
                f"{field}: {str(file)!r} is a PMF (prob column) with no per-prompt rows; use a "
                "grouped or per-request trace such as castillo, seqsched, azure or mooncake"
            )
        samples = [c for c in columns if _GROUP_COLUMN.match(c)] or (
            ["output_tokens"] if "output_tokens" in columns else []
        )
        if not samples:
            raise ValueError(
                f"{field}: {str(file)!r} has columns {columns}; expected grouped columns "
                "o1..oN or out_t*, or an output_tokens column"
            )
        rows: list[TraceRow] = []
        for line_no, record in enumerate(reader, start=2):
            try:
                lengths = tuple(
                    max(1, round(float(record[c]))) for c in samples if record[c] not in ("", None)
                )
                raw_prompt = record.get("prompt_tokens")
                prompt = round(float(raw_prompt)) if raw_prompt else DEFAULT_PROMPT_TOKENS
            except ValueError:
                raise ValueError(
                    f"{field}: {str(file)!r} line {line_no}: a non-numeric value in "
                    f"{[*samples, 'prompt_tokens']}"
                ) from None
            if not lengths:
                continue
            label = "/".join(
                str(record[c])
                for c in ("dataset", "model", "prompt_idx", "prompt_id", "split")
                if record.get(c)
            )
            rows.append(TraceRow(len(rows), max(1, prompt), lengths, label or f"row {len(rows)}"))
    if not rows:
        raise ValueError(f"{field}: {str(file)!r} has no rows with output lengths")
    return rows


def select_rows(rows: Sequence[TraceRow], count: int) -> list[TraceRow]:
    """``count`` rows spread evenly over the trace (traces are sorted by dataset and model, so a
    prefix would be one dataset); all rows, in order, when ``count`` covers the trace."""
    if count >= len(rows):
        return list(rows)
    return [rows[k * len(rows) // count] for k in range(count)]


# --- deterministic pseudo-randomness ---------------------------------------------------------

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def unit_hash(*keys: int) -> float:
    """A uniform number in [0, 1) that depends only on ``keys``."""
    h = 0
    for key in keys:
        h = _splitmix64(h ^ (key & _MASK64))
    return (h >> 11) * 2.0**-53


# --- the reward model ------------------------------------------------------------------------

SKILL_MAX = 2.5
SKILL_STEPS = 60.0
"""The policy's skill rises as ``SKILL_MAX * (1 - exp(-version / SKILL_STEPS))``."""


def prompt_difficulty(trace_row: int) -> float:
    """Per-prompt difficulty in [-1, 3): some prompts are easy from the start, some never."""
    return 4.0 * unit_hash(0x5EED, trace_row) - 1.0


def success_probability(trace_row: int, version: int) -> float:
    """P(reward = 1) for a sample of this prompt generated by weight ``version``: about 0.3 at
    version 0, about 0.75 once the skill saturates."""
    skill = SKILL_MAX * (1.0 - math.exp(-max(version, 0) / SKILL_STEPS))
    return 1.0 / (1.0 + math.exp(-1.5 * (skill - prompt_difficulty(trace_row))))


def sim_reward(trace_row: int, group_id: int, sample: int, version: int, truncated: bool) -> float:
    """The reward of one simulated sample: 1.0 or 0.0, deterministic in its arguments.

    A truncated sample (it hit ``max_tokens``) scores 0, as an unfinished answer would."""
    if truncated:
        return 0.0
    draw = unit_hash(trace_row, group_id, sample)
    return 1.0 if draw < success_probability(trace_row, version) else 0.0


# --- the task --------------------------------------------------------------------------------


class SimTask:
    """The trace's rows as prompts; see the module docstring."""

    name = "sim"

    def __init__(self, rows: Sequence[TraceRow], num_prompts: int, source: str = "") -> None:
        if not rows:
            raise ValueError("rollout.sim.lengths: the trace has no rows")
        chosen = select_rows(rows, num_prompts)
        if num_prompts > len(rows):
            log.info(
                "task.num_prompts=%d exceeds the trace's %d rows; using every row",
                num_prompts,
                len(rows),
            )
        self.source = source
        self.prompts: list[TaskPrompt] = [
            TaskPrompt(
                prompt_id=k,
                text=f"[sim] {r.label} ({r.prompt_tokens} prompt tokens)",
                meta={
                    "trace_row": r.row,
                    "trace_lengths": list(r.lengths),
                    "prompt_tokens": r.prompt_tokens,
                },
            )
            for k, r in enumerate(chosen)
        ]

    @classmethod
    def from_config(cls, config: Config) -> SimTask:
        path, field = resolve_trace(config)
        return cls(load_trace(path, field), config.task.num_prompts, source=str(path))

    def prompt_token_ids(self, prompt: TaskPrompt) -> np.ndarray:
        """Synthetic prompt ids (int32) of the trace's prompt length; deterministic per prompt.

        The sim task has no tokenizer: a controller dispatching sim prompts sends these."""
        count = int(prompt.meta["prompt_tokens"])
        base = int(unit_hash(0x9A0, int(prompt.meta["trace_row"])) * SYNTHETIC_VOCAB)
        ids = (base + 7919 * np.arange(count, dtype=np.int64)) % (SYNTHETIC_VOCAB - 4) + 4
        return ids.astype(np.int32)

    def reward(self, prompt: TaskPrompt, completion_text: str) -> float:
        """The version-0 reward of a completion, drawn by a hash of its text.

        Sim workers never call this (they score samples with :func:`sim_reward`, which knows
        the weight version); it exists so that ``SimTask`` is a complete ``Task``."""
        row = int(prompt.meta["trace_row"])
        digest = hashlib.blake2b(completion_text.encode(), digest_size=8).digest()
        draw = unit_hash(row, int.from_bytes(digest, "little"))
        return 1.0 if draw < success_probability(row, 0) else 0.0


def build_sim_task(config: Config) -> SimTask:
    """``build_task``'s entry point for ``task.name: sim``."""
    return SimTask.from_config(config)


__all__ = [
    "BUILTIN_SAMPLE",
    "SimTask",
    "TraceRow",
    "build_sim_task",
    "load_trace",
    "resolve_trace",
    "sim_reward",
    "success_probability",
]
