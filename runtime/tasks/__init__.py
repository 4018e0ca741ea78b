"""Tasks (prompts + verifiable rewards) and the model a run starts from.

- :func:`build_task` turns ``config.task`` into a :class:`Task`: ``target_length`` (built-in,
  synthetic), ``gsm8k`` (JSONL math problems), ``dataset`` (the user's dataset and reward
  functions, :mod:`runtime.tasks.dataset`) or ``sim`` (simulated backend).
- :func:`ensure_model` returns the directory (or hub id) of weight version 0. For
  ``model.path: builtin:tiny`` it builds the tiny Llama and its supervised warm start once, into
  a cache keyed by everything that changes them.
- :func:`load_tokenizer` / :func:`encode_prompt`: how every process turns a prompt into token ids,
  so that the rollout workers and the trainer agree.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.config import Config

from runtime.tasks.base import (
    SupervisedTask,
    Task,
    TaskPrompt,
    encode_prompt,
    load_tokenizer,
    resolve_chat_template,
)

__all__ = [
    "BUILTIN_TINY",
    "SupervisedTask",
    "Task",
    "TaskPrompt",
    "build_task",
    "default_cache_dir",
    "encode_prompt",
    "ensure_model",
    "load_tokenizer",
    "model_cache_key",
    "preflight",
    "resolve_chat_template",
]

log = logging.getLogger(__name__)

BUILTIN_TINY = "builtin:tiny"
MODEL_BUILD_VERSION = 1
"""Bump when the tiny model or the warm start changes, so old cache entries are not reused."""
MARKER_FILE = "asp_tui_model.json"
"""Written last into a cached model; a directory without it is never used."""


def build_task(config: Config) -> Task:
    """The task that ``config.task`` names."""
    name = config.task.name
    if name == "target_length":
        from runtime.tasks.target_length import TargetLengthTask

        return TargetLengthTask.from_config(config)
    if name == "gsm8k":
        from runtime.tasks.gsm8k import Gsm8kTask

        return Gsm8kTask.from_config(config)
    if name == "dataset":
        from runtime.tasks.dataset import DatasetTask

        return DatasetTask.from_config(config)
    if name == "sim":
        # Owned by the sim backend; imported lazily so the real path never needs it.
        from runtime.tasks.sim_task import build_sim_task

        return build_sim_task(config)
    raise ValueError(
        f"task.name: unknown task {name!r} (allowed: target_length, gsm8k, dataset, sim)"
    )


def default_cache_dir() -> Path:
    """``$ASP_TUI_CACHE``, else ``runs/.cache`` (relative to the working directory)."""
    return Path(os.environ.get("ASP_TUI_CACHE") or Path("runs") / ".cache")


def model_cache_key(config: Config) -> str:
    """Hash of everything that changes the built-in model: its shape, the task, the seed."""
    task = config.task.model_dump(mode="json")
    if config.task.name == "dataset":
        # No warm start for a user's dataset (see _build_builtin): the model is the same for any.
        task = {"name": "dataset"}
    for field in ("lengths_trace", "dataset"):
        # The file's content counts, not only its name.
        if task.get(field):
            task[field + "_sha256"] = _file_sha256(task[field])
    payload = {
        "version": MODEL_BUILD_VERSION,
        "tiny": config.model.tiny.model_dump(mode="json"),
        "task": task,
        "seed": config.run.seed,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def _file_sha256(path: str) -> str | None:
    file = Path(path)
    if not file.is_file():
        return None  # build_task reports the missing file with the field's name
    return hashlib.sha256(file.read_bytes()).hexdigest()


ProgressFn = Callable[[int, int, Mapping[str, float]], None]
"""``progress(step, total, metrics)`` during the warm start."""


def ensure_model(
    config: Config, cache_dir: Path | None = None, progress: ProgressFn | None = None
) -> str:
    """The model of weight version 0: a local directory, or the hub id / path as configured.

    ``builtin:tiny`` is built (random init, then ``task.sft_steps`` supervised steps when the task
    supports it) into ``<cache_dir>/tiny-<key>``. The build happens in a temporary directory that
    is renamed into place, under a file lock, so concurrent callers build it once and a crash
    never leaves a half-written model behind.
    """
    if config.model.path != BUILTIN_TINY:
        return config.model.path
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    key = model_cache_key(config)
    final = cache / f"tiny-{key}"
    if (final / MARKER_FILE).is_file():
        return str(final)
    with (cache / f".tiny-{key}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if (final / MARKER_FILE).is_file():
            return str(final)  # another process built it while we waited
        if final.exists():
            shutil.rmtree(final)  # no marker: left over from an older, interrupted layout
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-tiny-{key}-", dir=cache))
        try:
            info = _build_builtin(config, tmp, progress)
            (tmp / MARKER_FILE).write_text(json.dumps(info, indent=2, sort_keys=True))
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    log.info("built %s into %s", BUILTIN_TINY, final)
    return str(final)


def _build_builtin(config: Config, out_dir: Path, progress: ProgressFn | None) -> dict[str, Any]:
    from runtime.tasks.tiny_model import build_tiny_model, tiny_model_info

    build_tiny_model(out_dir, config.model.tiny, seed=config.run.seed)
    info: dict[str, Any] = {
        "key": model_cache_key(config),
        "model": tiny_model_info(out_dir),
        "task": config.task.model_dump(mode="json"),
        "seed": config.run.seed,
        "sft": None,
    }
    if config.task.sft_steps > 0 and config.task.name != "dataset":
        task = build_task(config)
        if isinstance(task, SupervisedTask):
            from runtime.tasks.sft import warm_start

            info["sft"] = warm_start(out_dir, task, config, progress=progress)
        else:
            log.info("task %s has no warm-start data; skipping SFT", task.name)
    return info


def task_ids(task: Any) -> dict[int, str | int]:
    """The task's own id of every prompt, by prompt id: a dataset's ``task.id_field`` (else its
    row number); any other task's prompt id."""
    from runtime.tasks.dataset import DatasetTask

    if isinstance(task, DatasetTask):
        return {p.prompt_id: task.ids[p.prompt_id - task.id_base] for p in task.prompts}
    return {p.prompt_id: p.prompt_id for p in task.prompts}


def length_prior(config: Config, task: Any) -> dict[int, tuple[int, ...]] | None:
    """``scheduler.lengths`` by prompt id, its ids matched as text against the task's own
    (:func:`task_ids`); None when unset. A file none of whose ids names a prompt is a
    ConfigError; ids that name none while others do are logged and left out."""
    if not config.scheduler.lengths:
        return None
    from runtime.config import ConfigError
    from runtime.scheduler.lengths import LengthsFileError, match_task_ids, read_lengths

    try:
        table = read_lengths(config.scheduler.lengths)
        prior, unknown = match_task_ids(table, task_ids(task), config.task.name)
    except LengthsFileError as exc:
        msg = str(exc)
        raise ConfigError(
            msg if msg.startswith("scheduler.") else f"scheduler.lengths: {msg}"
        ) from None
    if unknown:
        log.warning(
            "scheduler.lengths: %d of the %d ids in %s name no prompt of task %r and are left "
            "out (first: %r)",
            len(unknown),
            len(table),
            table.source,
            config.task.name,
            unknown[0],
        )
    return prior


def preflight(config: Config) -> Config:
    """Check the task (and that telemetry.wandb can be honoured) before any process starts,
    and fix the task's local paths.

    A length trace that is not a file (``rollout.sim.lengths``, ``task.lengths_trace``) is a
    ``ConfigError``. For ``task.name: dataset`` this loads the dataset and imports and checks
    every reward function, so a missing file or field, an unimportable path, a wrong signature
    or an empty dataset is a ``ConfigError`` (exit 2). Local paths (dataset, reward files, chat
    template) are made absolute, since every process reads the resolved config from the run
    directory.
    """
    import importlib.util

    from runtime.config import ConfigError

    if config.telemetry.wandb is not None and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            "telemetry.wandb: the wandb package is not installed; pip install 'asp-tui[wandb]'"
        )
    if config.rollout.backend == "sim" or config.task.lengths_trace:
        from runtime.tasks.sim_task import resolve_trace

        try:
            resolve_trace(config)  # the length trace a sim run or a target-length task reads
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if config.task.name != "dataset":
        return config
    task = config.task.model_copy(deep=True)
    if task.dataset and Path(task.dataset).expanduser().exists():
        task.dataset = str(Path(task.dataset).expanduser().resolve())
    if isinstance(task.reward, str):
        task.reward = task.reward_functions()[0]
    for spec in task.reward_functions():
        source, sep, attr = spec.fn.rpartition(":")
        if sep and (source.endswith(".py") or "/" in source) and Path(source).is_file():
            spec.fn = f"{Path(source).resolve()}:{attr}"
    if task.chat_template and "{" not in task.chat_template:
        try:
            resolve_chat_template(task.chat_template)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        task.chat_template = str(Path(task.chat_template).expanduser().resolve())
    if task.eval is not None and Path(task.eval.dataset).expanduser().exists():
        task.eval.dataset = str(Path(task.eval.dataset).expanduser().resolve())
    resolved = config.model_copy(update={"task": task})
    built = build_task(resolved)
    built.rewards  # noqa: B018 (loads the data, imports the rewards: ConfigError)
    length_prior(resolved, built)  # scheduler.lengths names this dataset's ids
    from runtime.tasks.dataset import DatasetTask

    evaluation = DatasetTask.eval_of(resolved)
    if evaluation is not None:
        evaluation.rewards  # noqa: B018 (checks the functions against the eval set's columns)
    return resolved
