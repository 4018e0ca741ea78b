"""``gsm8k``: grade-school math word problems with an exact-answer reward.

The dataset is JSONL in GSM8K's own format: one object per line with ``question`` and ``answer``,
where the answer's final line is ``#### <number>``. The reward extracts the completion's final
number (``\\boxed{...}``, then ``#### ...``, then the last number in the text) and compares it
numerically with the reference, after removing thousands separators, currency signs and units.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from fractions import Fraction
from importlib import resources
from pathlib import Path
from typing import Any

from runtime.config import Config
from runtime.tasks.base import TaskPrompt

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
"""Appended to each question; the phrasing Qwen2.5's math evaluations use."""

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_HASHES = re.compile(r"####\s*([^\n]*)")


def sample_dataset() -> Path:
    """A handful of GSM8K-style problems shipped for tests."""
    return Path(str(resources.files("runtime.tasks") / "data" / "gsm8k_sample.jsonl"))


def reference_answer(answer: str) -> str:
    """The number after ``####`` in a GSM8K answer field."""
    match = _HASHES.search(answer)
    if match is None:
        raise ValueError(f"answer: no '#### <number>' line in {answer[-80:]!r}")
    return match.group(1).strip()


def _boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``, with nested braces balanced."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def extract_answer(completion: str) -> str | None:
    """The completion's final answer: ``\\boxed{}``, else ``####``, else the last number."""
    boxed = _boxed(completion)
    if boxed is not None:
        return boxed
    hashes = _HASHES.findall(completion)
    if hashes and hashes[-1].strip():
        return hashes[-1].strip()
    numbers = _NUMBER.findall(completion)
    return numbers[-1] if numbers else None


def parse_number(text: str | None) -> Fraction | None:
    """A number out of an answer string: ``"$1,234.50"`` -> 1234.5, ``"\\frac{3}{4}"`` -> 3/4."""
    if text is None:
        return None
    s = text.strip().replace("\\!", "").replace("{,}", "")
    frac = re.fullmatch(r"-?\\d?frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}", s.replace(" ", ""))
    if frac:
        num, den = Fraction(frac.group(1)), Fraction(frac.group(2))
        value = num / den if den else None
        return -value if value is not None and s.lstrip().startswith("-") else value
    numbers = _NUMBER.findall(s)
    if not numbers:
        return None
    # Inside a box or after ####, the first number is the answer ("18 dollars", "= 18").
    token = numbers[0] if len(numbers) == 1 or "=" not in s else numbers[-1]
    token = token.replace(",", "")
    try:
        if "/" in token:
            num, den = token.split("/")
            return Fraction(num) / Fraction(den) if Fraction(den) else None
        return Fraction(token)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(completion: str, reference: str) -> bool:
    predicted = parse_number(extract_answer(completion))
    expected = parse_number(reference)
    return predicted is not None and expected is not None and predicted == expected


def load_gsm8k(path: str | Path) -> list[dict[str, str]]:
    """Problems from a GSM8K JSONL file; bad lines raise with the line number."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"task.dataset: {str(file)!r} is not a file")
    problems = []
    for line_no, line in enumerate(file.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"task.dataset: {file}:{line_no}: not JSON ({exc.msg})") from None
        if not isinstance(record, dict) or not all(
            isinstance(record.get(k), str) for k in ("question", "answer")
        ):
            raise ValueError(
                f"task.dataset: {file}:{line_no}: expected an object with string fields "
                "'question' and 'answer'"
            )
        try:
            reference = reference_answer(record["answer"])
        except ValueError as exc:
            raise ValueError(f"task.dataset: {file}:{line_no}: {exc}") from None
        if parse_number(reference) is None:
            raise ValueError(
                f"task.dataset: {file}:{line_no}: the answer after '####' ({reference!r}) "
                "is not a number"
            )
        problems.append({"question": record["question"], "answer": record["answer"]})
    if not problems:
        raise ValueError(f"task.dataset: {str(file)!r} has no problems")
    return problems


def format_prompt(question: str) -> str:
    return f"{question.strip()}\n{INSTRUCTION}"


class Gsm8kTask:
    """GSM8K prompts; reward 1.0 for the right final number, else 0.0."""

    name = "gsm8k"

    def __init__(self, problems: Sequence[dict[str, str]], num_prompts: int | None = None) -> None:
        chosen = list(problems)[:num_prompts] if num_prompts else list(problems)
        self.prompts: list[TaskPrompt] = [
            TaskPrompt(
                prompt_id=i,
                text=format_prompt(p["question"]),
                meta={"reference": reference_answer(p["answer"]), "solution": p["answer"]},
            )
            for i, p in enumerate(chosen)
        ]

    @classmethod
    def from_config(cls, config: Config) -> Gsm8kTask:
        path = config.task.dataset or sample_dataset()
        return cls(load_gsm8k(path), config.task.num_prompts)

    def reward(self, prompt: TaskPrompt, completion_text: str) -> float:
        return 1.0 if answers_match(completion_text, str(prompt.meta["reference"])) else 0.0

    def sft_examples(self, count: int, rng: random.Random) -> list[tuple[TaskPrompt, str]]:
        """The reference solutions, for warm-starting the tiny model on this task."""
        picks = rng.choices(self.prompts, k=count)
        return [(p, _as_completion(str(p.meta["solution"]))) for p in picks]

    def describe(self) -> dict[str, Any]:
        return {"prompts": len(self.prompts)}


def _as_completion(solution: str) -> str:
    """GSM8K's solution with its ``<<48/2=24>>`` calculator notes removed."""
    return re.sub(r"<<[^>]*>>", "", solution)
