"""``dataset``: the user's own prompts and reward functions.

``task.dataset`` is a JSONL/JSON, Parquet or CSV file, a directory written by
``datasets.save_to_disk`` (a ``Dataset`` or a ``DatasetDict``, of which ``task.split`` is taken),
or a hub id; all are read with the ``datasets`` library. ``task.prompt_field`` holds a string
prompt or a chat list of ``{role, content}`` messages; ``task.id_field`` a unique string or
integer id per row (default: the row number). Every other column travels with the prompt, in
``TaskPrompt.meta``, to the reward functions (see :mod:`runtime.tasks.rewards`).

Prompt ids on the wire are row numbers; messages show the user's own id.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from runtime.config import Config, ConfigError
from runtime.tasks.base import TaskPrompt
from runtime.tasks.rewards import GroupRewards, RewardSuite

EVAL_PROMPT_BASE = 1 << 30
"""Eval prompt ids start here (row + base), so they never collide with training prompt ids."""

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
"""File suffix -> the ``datasets`` builder that reads it."""


def _looks_local(source: str) -> bool:
    path = Path(source).expanduser()
    return path.exists() or path.suffix in _BUILDERS or source.startswith((".", "/", "~"))


def load_rows(config: Config) -> tuple[list[dict[str, Any]], list[str]]:
    """The rows of ``task.dataset`` (``task.split``) and its column names; ConfigError naming
    the field on a missing file, an unreadable one or an empty dataset."""
    try:
        import datasets
    except ImportError:  # pragma: no cover - a dependency of the project
        raise ConfigError(
            "task.dataset: the 'datasets' package is needed; pip install datasets"
        ) from None
    task = config.task
    source = str(task.dataset)
    path = Path(source).expanduser()
    datasets.disable_progress_bars()  # one bar per process start is noise in the run's logs
    try:
        if path.is_dir():
            table = _load_saved(datasets, path, task.split)
        elif _looks_local(source):
            if not path.is_file():
                raise ConfigError(f"task.dataset: {source!r}: no such file or directory")
            builder = _BUILDERS.get(path.suffix)
            if builder is None:
                raise ConfigError(
                    f"task.dataset: {source!r} has suffix {path.suffix!r}; allowed: "
                    f"{', '.join(_BUILDERS)} files or a save_to_disk directory"
                )
            if _blank(path):  # datasets fails on it with a bare StopIteration
                raise ConfigError(f"task.dataset: {source!r} is empty (no rows)")
            table = datasets.load_dataset(builder, data_files=str(path), split="train")
        else:
            table = datasets.load_dataset(source, split=task.split)
    except ConfigError:
        raise
    except Exception as exc:  # datasets raises many types; the user needs the cause
        raise ConfigError(
            f"task.dataset: cannot read {source!r} ({type(exc).__name__}: {exc})"
        ) from None
    if len(table) == 0:
        raise ConfigError(f"task.dataset: {source!r} is empty (no rows)")
    return table.to_list(), list(table.column_names)


def _blank(path: Path) -> bool:
    with path.open("rb") as handle:
        return not handle.read(1 << 16).strip()


def _load_saved(datasets: Any, path: Path, split: str) -> Any:
    if not ((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()):
        raise ConfigError(
            f"task.dataset: {str(path)!r} is a directory but not one written by "
            "datasets.save_to_disk (no dataset_info.json or dataset_dict.json)"
        )
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ConfigError(
                f"task.split: {split!r} is not a split of {str(path)!r} (it has {list(loaded)})"
            )
        loaded = loaded[split]
    return loaded


def _messages(value: Any, row: int, field: str) -> list[dict[str, str]] | None:
    """A chat prompt as a list of ``{role, content}`` dicts, or None if ``value`` is a string."""
    if isinstance(value, str):
        if not value:
            raise ConfigError(f"task.prompt_field: {field!r} is empty in row {row}")
        return None
    ok = isinstance(value, list) and value
    ok = ok and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value
    )
    if not ok:
        raise ConfigError(
            f"task.prompt_field: {field!r} in row {row} is {type(value).__name__} {value!r:.80}; "
            "allowed: a string or a non-empty list of {role, content} messages"
        )
    return [{"role": m["role"], "content": m["content"]} for m in value]


class DatasetTask:
    """Prompts from the user's dataset, scored by the user's reward functions."""

    name = "dataset"

    def __init__(self, config: Config, id_base: int = 0) -> None:
        task = config.task
        self.id_base = id_base
        rows, columns = load_rows(config)
        if task.prompt_field not in columns:
            raise ConfigError(
                f"task.prompt_field: {task.prompt_field!r} is not a column of "
                f"{task.dataset!r} (columns: {columns})"
            )
        if task.id_field is not None and task.id_field not in columns:
            raise ConfigError(
                f"task.id_field: {task.id_field!r} is not a column of {task.dataset!r} "
                f"(columns: {columns})"
            )
        self.columns = [c for c in columns if c != task.prompt_field]
        self.ids: list[str | int] = []
        seen: set[str | int] = set()
        self.prompts: list[TaskPrompt] = []
        for row, record in enumerate(rows):
            key: Any = row if task.id_field is None else record[task.id_field]
            if isinstance(key, bool) or not isinstance(key, str | int):
                raise ConfigError(
                    f"task.id_field: {task.id_field!r} in row {row} is "
                    f"{type(key).__name__} {key!r}; allowed: a string or an integer"
                )
            if key in seen:
                raise ConfigError(f"task.id_field: id {key!r} appears twice (row {row})")
            seen.add(key)
            self.ids.append(key)
            value = record[task.prompt_field]
            messages = _messages(value, row, task.prompt_field)
            text = value if messages is None else messages[-1]["content"]
            meta = {c: record[c] for c in self.columns}
            self.prompts.append(TaskPrompt(id_base + row, text, meta, messages=messages))
        self._task_config = task
        self._rewards: RewardSuite | None = None

    @property
    def rewards(self) -> RewardSuite:
        """The reward functions, imported on first use: only the workers (and the pre-flight
        check) pay for importing them, never the controller."""
        if self._rewards is None:
            self._rewards = RewardSuite.from_config(self._task_config, self.columns, self.label)
        return self._rewards

    @classmethod
    def from_config(cls, config: Config) -> DatasetTask:
        return cls(config)

    @classmethod
    def eval_of(cls, config: Config) -> DatasetTask | None:
        """``task.eval.dataset`` read like ``task.dataset``, ids from :data:`EVAL_PROMPT_BASE`."""
        if config.task.eval is None:
            return None
        task = config.task.model_copy(update={"dataset": config.task.eval.dataset})
        try:
            return cls(config.model_copy(update={"task": task}), id_base=EVAL_PROMPT_BASE)
        except ConfigError as exc:  # name the eval field, not the training one
            raise ConfigError(str(exc).replace("task.dataset:", "task.eval.dataset:")) from None

    def label(self, prompt: TaskPrompt) -> str:
        """How messages name a prompt: the user's id, and its row."""
        row = prompt.prompt_id - self.id_base
        return f"id {self.ids[row]!r} (row {row}{' of the eval set' if self.id_base else ''})"

    async def score_group(
        self, prompt: TaskPrompt, completions: Sequence[str], completion_ids: Sequence[list[int]]
    ) -> GroupRewards:
        return await self.rewards.score(prompt, completions, completion_ids)

    def reward(self, prompt: TaskPrompt, completion_text: str) -> float:
        """One completion alone (the probe's path); workers score whole groups."""
        scores = asyncio.run(self.score_group(prompt, [completion_text], [[]]))
        return scores.totals[0]

    def describe(self) -> dict[str, Any]:
        return {"prompts": len(self.prompts), "rewards": self.rewards.names}
