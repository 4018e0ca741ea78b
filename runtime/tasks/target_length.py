"""``target_length``: the built-in synthetic task with a verifiable reward.

Each prompt asks for an answer of a given number of characters: ``"Write 23 letters:\n"``. The
targets come from a real output-length trace (by default a sample of CASTILLO, 10 samples per
prompt), scaled so that the trace's p99 group median maps to ``task.max_target_length``, so they
are long-tailed and differ from prompt to prompt.

The target of a prompt is the *shortest* of its trace group's samples, while the supervised warm
start imitates *all* of them: the SFT answer has the length of a random sample of the group. The
warm policy is therefore prompt-dependent and long-tailed like a real SFT checkpoint, but
imprecise: it overshoots by a prompt-dependent margin (about 20% at the median), inherits the
within-group spread and the degenerate long samples, and adds the tiny model's own counting
error. That leaves GRPO a clear signal: shorten, and sharpen.
"""

from __future__ import annotations

import csv
import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from runtime.config import Config
from runtime.tasks.base import TaskPrompt

MIN_TARGET = 2
"""Shortest target; shorter ones carry no length signal."""

TRACE_QUANTILE = 0.99
"""The trace quantile that is mapped onto ``task.max_target_length`` (longer targets clip)."""

ANSWER_ALPHABET = "abcdefghijklmnopqrstuvwxyz"

_GROUP_COLUMN = re.compile(r"^(o\d+|out_t[\d.]+)$")


def prompt_text(target: int) -> str:
    return f"Write {target} letters:\n"


def count_off(length: int) -> str:
    """The warm-start answer of ``length`` letters: the alphabet, over and over ("abc...zab...").

    A count-off lets a two-layer model read its position (mod 26) off its last letter, so it can
    learn the *trace's* length distribution per target; the imprecision then comes from the data,
    not from a model too small to count.
    """
    repeats = length // len(ANSWER_ALPHABET) + 1
    return (ANSWER_ALPHABET * repeats)[:length]


def answer_length(completion_text: str) -> int:
    """What the reward measures: characters of the answer, surrounding whitespace excluded."""
    return len(completion_text.strip())


def length_reward(length: int, target: int) -> float:
    """``exp(-|length - target| / (0.25 * target + 2))``: 1 when exact, in (0, 1] otherwise.

    The tolerance grows with the target, so a 10% miss costs about the same at every length,
    and the reward never goes flat, so even a badly-off group still has a gradient.
    """
    if target < 1:
        raise ValueError(f"target: {target} must be >= 1")
    return math.exp(-abs(length - target) / (0.25 * target + 2.0))


def default_trace() -> Path:
    """The CASTILLO sample shipped as package data."""
    return Path(str(resources.files("runtime.tasks") / "data" / "castillo_sample.csv"))


def load_length_trace(path: str | Path) -> list[list[float]]:
    """Per-prompt output lengths from a CSV trace in ``shared/data/lengths`` format.

    Grouped traces (castillo ``o1..o10``, seqsched ``out_t*``) give every sample of a row; flat
    traces (azure, mooncake: ``output_tokens``) give one sample per row.
    """
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"task.lengths_trace: {str(file)!r} is not a file")
    with file.open(newline="") as handle:
        reader = csv.DictReader(handle)
        columns = reader.fieldnames or []
        grouped = [c for c in columns if _GROUP_COLUMN.match(c)]
        if not grouped and "output_tokens" not in columns:
            raise ValueError(
                f"task.lengths_trace: {str(file)!r} has columns {columns}; expected grouped "
                "columns o1..oN or out_t*, or an output_tokens column"
            )
        if "prob" in columns:
            raise ValueError(
                f"task.lengths_trace: {str(file)!r} is a PMF (prob column) with no per-prompt "
                "rows; use a grouped or per-request trace such as castillo or seqsched"
            )
        use = grouped or ["output_tokens"]
        rows: list[list[float]] = []
        for line_no, record in enumerate(reader, start=2):
            try:
                values = [float(record[c]) for c in use if record[c] not in ("", None)]
            except ValueError:
                raise ValueError(
                    f"task.lengths_trace: {str(file)!r} line {line_no}: non-numeric length in {use}"
                ) from None
            if values and min(values) > 0:
                rows.append(values)
    if not rows:
        raise ValueError(f"task.lengths_trace: {str(file)!r} has no positive lengths")
    return rows


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _median(values: Sequence[float]) -> float:
    return _quantile(values, 0.5)


@dataclass(frozen=True)
class LengthGroup:
    """One trace row, scaled: the prompt's target and the lengths its samples had."""

    row: int
    target: int
    sample_lengths: tuple[int, ...]


def scaled_groups(rows: Sequence[Sequence[float]], max_target: int) -> list[LengthGroup]:
    """Scale a trace so that its p99 group median becomes ``max_target``; clip both ends.

    A group's target is its *shortest* sample: the prompt asks for the most concise answer the
    traced model ever gave, so the warm policy, which imitates all the samples, overshoots by a
    prompt-dependent margin (about 20% at the median), as verbose SFT checkpoints do.
    """
    medians = [_median(r) for r in rows]
    scale = max_target / max(_quantile(medians, TRACE_QUANTILE), 1e-9)

    def clip(value: float, low: int) -> int:
        return int(min(max(round(value * scale), low), max_target))

    return [
        LengthGroup(i, clip(min(r), MIN_TARGET), tuple(clip(v, 1) for v in r))
        for i, (m, r) in enumerate(zip(medians, rows, strict=True))
    ]


class TargetLengthTask:
    """Prompts with a target answer length; reward by :func:`length_reward`."""

    name = "target_length"

    def __init__(self, groups: Sequence[LengthGroup], num_prompts: int, seed: int = 0) -> None:
        if not groups:
            raise ValueError("task.lengths_trace: the trace has no rows")
        self.groups = list(groups)
        rng = random.Random(seed)
        if num_prompts <= len(self.groups):
            chosen = rng.sample(self.groups, num_prompts)
        else:
            chosen = [rng.choice(self.groups) for _ in range(num_prompts)]
        self.prompts: list[TaskPrompt] = [
            TaskPrompt(
                prompt_id=i,
                text=prompt_text(g.target),
                meta={
                    "target": g.target,
                    "trace_row": g.row,
                    # The trace's own lengths for this prompt: what an oracle length predictor
                    # would know (the scheduler can use them as "profiled" lengths).
                    "trace_lengths": list(g.sample_lengths),
                },
            )
            for i, g in enumerate(chosen)
        ]

    @classmethod
    def from_config(cls, config: Config) -> TargetLengthTask:
        trace = config.task.lengths_trace or default_trace()
        groups = scaled_groups(load_length_trace(trace), config.task.max_target_length)
        return cls(groups, config.task.num_prompts, seed=config.run.seed)

    def reward(self, prompt: TaskPrompt, completion_text: str) -> float:
        return length_reward(answer_length(completion_text), int(prompt.meta["target"]))

    def sft_examples(self, count: int, rng: random.Random) -> list[tuple[TaskPrompt, str]]:
        """Warm-start pairs: a trace row's target, answered with one of its samples' lengths."""
        examples = []
        for _ in range(count):
            group = rng.choice(self.groups)
            length = rng.choice(group.sample_lengths)
            prompt = TaskPrompt(-1, prompt_text(group.target), {"target": group.target})
            examples.append((prompt, count_off(length)))
        return examples

    def describe(self) -> dict[str, Any]:
        targets = [int(p.meta["target"]) for p in self.prompts]
        return {
            "prompts": len(targets),
            "target_mean": sum(targets) / len(targets),
            "target_median": _median(targets),
            "target_max": max(targets),
        }
