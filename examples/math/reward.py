"""Reward functions for examples/math, in TRL's signature: they work unchanged in TRL's GRPOTrainer.

``fn(prompts, completions, completion_ids, **columns) -> list[float | None]``: one call per group
of completions of one prompt; every dataset column other than the prompt (here ``answer`` and
``id``) arrives as a keyword argument with one value per completion.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+")


def correctness(completions: list[str], answer: list[str], **kwargs: object) -> list[float]:
    """1.0 when the first number in the completion is the answer, else 0.0."""
    scores = []
    for completion, expected in zip(completions, answer, strict=True):
        found = _NUMBER.search(completion)
        scores.append(1.0 if found and found.group() == expected.strip() else 0.0)
    return scores


def brevity(
    completions: list[str], completion_ids: list[list[int]], **kwargs: object
) -> list[float]:
    """A small push towards short answers: 1 for an empty answer, falling to 0 at 32 tokens."""
    return [max(0.0, 1.0 - len(ids) / 32) for ids in completion_ids]
