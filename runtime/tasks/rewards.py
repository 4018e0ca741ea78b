"""User reward functions: import paths, TRL's signature, weights, ``async``, timeouts, verl.

A reward function is named ``package.module:function`` or ``path/to/file.py:function`` and called
once per group, in the rollout worker, with TRL's signature::

    fn(prompts, completions, completion_ids, **columns) -> list[float | None]

``prompts`` repeats the group's prompt (a string, or a list of ``{role, content}`` messages),
``completions`` holds the decoded completions (strings, or ``[{"role": "assistant", "content":
...}]`` for chat prompts, as TRL passes them), ``completion_ids`` the token ids, and every other
dataset column arrives as a keyword argument with one value per completion. ``None`` means "this
function does not score this completion"; the weighted sum skips it, and a completion that no
function scores is an error. ``style: verl`` wraps verl's per-sample
``compute_score(data_source, solution_str, ground_truth, extra_info)``.

Every problem at call time (an exception, the wrong count, a non-number, NaN or a timeout) raises
:class:`RewardError` naming the function, the prompt id and the problem. Nothing is scored 0
in its place.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.util
import inspect
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.config import ConfigError

if TYPE_CHECKING:
    from runtime.config import RewardConfig, TaskConfig
    from runtime.tasks.base import TaskPrompt

TRL_ARGUMENTS = ("prompts", "completions", "completion_ids")
VERL_ARGUMENTS = ("data_source", "solution_str", "ground_truth", "extra_info")


class RewardError(RuntimeError):
    """A reward function failed on one group; the message names the function, prompt and problem."""

    def __init__(self, function: str, prompt: str, problem: str) -> None:
        super().__init__(f"reward function {function!r} on prompt {prompt}: {problem}")
        self.function = function
        self.prompt = prompt
        self.problem = problem


@dataclass(frozen=True)
class GroupRewards:
    """The scores of one group: the weighted total per completion, and each function's own."""

    totals: list[float]
    per_function: dict[str, list[float | None]]


def load_callable(path: str, field: str) -> Callable[..., Any]:
    """The object that ``module:attr`` or ``file.py:attr`` names; ConfigError naming ``field``."""
    source, sep, attr = path.rpartition(":")
    if not sep or not source or not attr:
        raise ConfigError(
            f"{field}: {path!r} is not an import path; expected 'package.module:function' or "
            "'path/to/file.py:function'"
        )
    if source.endswith(".py") or "/" in source:
        module = _import_file(Path(source).expanduser(), field)
    else:
        try:
            module = importlib.import_module(source)
        except Exception as exc:  # any import-time failure is the user's to see
            raise ConfigError(
                f"{field}: cannot import module {source!r} ({type(exc).__name__}: {exc}); "
                "is it installed or on PYTHONPATH?"
            ) from None
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"{field}: {source!r} has no attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"{field}: {path!r} is a {type(target).__name__}, not a function")
    return target


def _import_file(file: Path, field: str) -> Any:
    if not file.is_file():
        raise ConfigError(f"{field}: reward file {str(file)!r} does not exist")
    resolved = file.resolve()
    # One module per file, named by its path, so two files called reward.py never collide.
    name = f"_asp_tui_reward_{hashlib.sha1(str(resolved).encode()).hexdigest()[:12]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{field}: {str(file)!r} cannot be imported as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    # Its own folder first, so the file can import its neighbours as TRL users' scripts do.
    sys.path.insert(0, str(resolved.parent))
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise ConfigError(
            f"{field}: importing {str(file)!r} failed ({type(exc).__name__}: {exc})"
        ) from None
    finally:
        sys.path.remove(str(resolved.parent))
    return module


def check_signature(fn: Callable[..., Any], arguments: Sequence[str], field: str) -> None:
    """ConfigError unless ``fn`` accepts every name of ``arguments`` as a keyword."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin or extension function: nothing to inspect, the call will tell
    try:
        signature.bind(**dict.fromkeys(arguments))
    except TypeError as exc:
        raise ConfigError(
            f"{field}: {getattr(fn, '__name__', fn)}{signature} cannot be called with keyword "
            f"arguments {list(arguments)} ({exc}); a reward function takes "
            "(prompts, completions, completion_ids, **columns)"
        ) from None


def _is_async(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 (a callable object's async __call__)
    )


class VerlAdapter:
    """verl's per-sample ``compute_score`` behind TRL's per-group signature.

    ``ground_truth`` comes from the ``reward_model`` column's ``ground_truth`` (verl's parquet
    layout) or a ``ground_truth`` column; ``data_source`` from a ``data_source`` column, else the
    dataset's name; ``extra_info`` from an ``extra_info`` column, else None. A dict result is read
    at its ``score`` key, as verl does.
    """

    def __init__(self, compute_score: Callable[..., Any], data_source: str) -> None:
        self.compute_score = compute_score
        self.source = data_source
        self.is_async = _is_async(compute_score)

    @staticmethod
    def ground_truth_column(columns: Sequence[str]) -> str | None:
        if "reward_model" in columns:
            return "reward_model"
        return "ground_truth" if "ground_truth" in columns else None

    def _arguments(self, i: int, completion: Any, columns: Mapping[str, list[Any]]) -> dict:
        truth: Any = None
        if "reward_model" in columns:
            truth = (columns["reward_model"][i] or {}).get("ground_truth")
        elif "ground_truth" in columns:
            truth = columns["ground_truth"][i]
        return {
            "data_source": columns["data_source"][i] if "data_source" in columns else self.source,
            "solution_str": _completion_text(completion),
            "ground_truth": truth,
            "extra_info": columns["extra_info"][i] if "extra_info" in columns else None,
        }

    def score(
        self, prompts: list[Any], completions: list[Any], completion_ids: list[Any], **columns: Any
    ) -> list[Any]:
        """TRL's signature over a sync ``compute_score`` (run in a thread by the caller)."""
        return [
            _verl_score(self.compute_score(**self._arguments(i, c, columns)))
            for i, c in enumerate(completions)
        ]

    async def score_async(
        self, prompts: list[Any], completions: list[Any], completion_ids: list[Any], **columns: Any
    ) -> list[Any]:
        """TRL's signature over an ``async def compute_score``."""
        return [
            _verl_score(await self.compute_score(**self._arguments(i, c, columns)))
            for i, c in enumerate(completions)
        ]


def _verl_score(result: Any) -> Any:
    return result["score"] if isinstance(result, Mapping) else result


def _completion_text(completion: Any) -> str:
    if isinstance(completion, list):  # chat: [{"role": "assistant", "content": ...}]
        return "".join(str(m.get("content", "")) for m in completion)
    return str(completion)


@dataclass
class RewardFunction:
    """One configured reward function, ready to call on a group."""

    name: str
    fn: Callable[..., Any]
    weight: float
    timeout_s: float
    is_async: bool

    async def __call__(self, label: str, kwargs: dict[str, Any], n: int) -> list[float | None]:
        """The function's scores for ``n`` completions, checked; RewardError on any problem."""
        try:
            # A sync function runs in a thread, so the worker's loop (heartbeats, other groups)
            # goes on meanwhile; one that times out cannot be killed: its thread runs to its end.
            call = self.fn(**kwargs) if self.is_async else asyncio.to_thread(self.fn, **kwargs)
            result = await asyncio.wait_for(call, self.timeout_s)
        except TimeoutError:
            raise RewardError(self.name, label, f"timed out after {self.timeout_s:g} s") from None
        except Exception as exc:
            raise RewardError(self.name, label, f"raised {type(exc).__name__}: {exc}") from exc
        return _checked(result, n, self.name, label)


def _checked(result: Any, n: int, name: str, label: str) -> list[float | None]:
    if isinstance(result, str | bytes | Mapping) or not hasattr(result, "__len__"):
        raise RewardError(name, label, f"returned {type(result).__name__}, not a list of {n}")
    values = list(result)
    if len(values) != n:
        raise RewardError(name, label, f"returned {len(values)} values for {n} completions")
    out: list[float | None] = []
    for i, value in enumerate(values):
        if value is None:
            out.append(None)
            continue
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise RewardError(
                name, label, f"returned {type(value).__name__} {value!r} for completion {i}"
            ) from None
        if not math.isfinite(number):
            raise RewardError(name, label, f"returned {number} for completion {i}")
        out.append(number)
    return out


class RewardSuite:
    """The configured reward functions of a dataset task; scores one group at a time."""

    def __init__(self, functions: Sequence[RewardFunction], prompt_label: Callable[..., str]):
        self.functions = list(functions)
        self._label = prompt_label

    @classmethod
    def from_config(cls, task: TaskConfig, columns: Sequence[str], label: Callable[..., str]):
        """Import, adapt and check every function of ``task``; ConfigError naming the field."""
        configs = task.reward_functions()
        several = task.reward is None
        functions = []
        for i, spec in enumerate(configs):
            field = f"task.rewards[{i}].fn" if several else "task.reward"
            functions.append(_build(spec, field, task, columns))
        return cls(functions, label)

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.functions]

    async def score(
        self, prompt: TaskPrompt, completions: Sequence[str], completion_ids: Sequence[list[int]]
    ) -> GroupRewards:
        """Every function on the group at once; the weighted total per completion."""
        n = len(completions)
        label = self._label(prompt)
        chat = prompt.messages is not None
        kwargs: dict[str, Any] = {
            "prompts": [prompt.messages if chat else prompt.text] * n,
            "completions": [[{"role": "assistant", "content": t}] for t in completions]
            if chat
            else list(completions),
            "completion_ids": [list(ids) for ids in completion_ids],
        }
        for column, value in prompt.meta.items():
            kwargs[column] = [value] * n
        results = await asyncio.gather(*(f(label, dict(kwargs), n) for f in self.functions))
        per_function = {f.name: r for f, r in zip(self.functions, results, strict=True)}
        totals = []
        for i in range(n):
            scored = [
                (f.weight, r[i])
                for f, r in zip(self.functions, results, strict=True)
                if r[i] is not None
            ]
            if not scored:
                names = ", ".join(self.names)
                raise RewardError(
                    names, label, f"no reward function scored completion {i} (all None)"
                )
            totals.append(sum(w * v for w, v in scored))
        return GroupRewards(totals, per_function)


def _build(
    spec: RewardConfig, field: str, task: TaskConfig, columns: Sequence[str]
) -> RewardFunction:
    fn = load_callable(spec.fn, field)
    name = spec.name or spec.fn.rpartition(":")[2]
    if spec.style == "verl":
        check_signature(fn, VERL_ARGUMENTS, field)
        if VerlAdapter.ground_truth_column(columns) is None:
            raise ConfigError(
                f"{field}: style verl needs a 'reward_model' column with a ground_truth key or a "
                f"'ground_truth' column; the dataset has {list(columns)}"
            )
        adapter = VerlAdapter(fn, data_source=str(task.dataset))
        call = adapter.score_async if adapter.is_async else adapter.score
        return RewardFunction(name, call, spec.weight, _timeout(spec, task), adapter.is_async)
    check_signature(fn, [*TRL_ARGUMENTS, *columns], field)
    return RewardFunction(name, fn, spec.weight, _timeout(spec, task), _is_async(fn))


def _timeout(spec: RewardConfig, task: TaskConfig) -> float:
    return spec.timeout_s if spec.timeout_s is not None else task.reward_timeout_s
