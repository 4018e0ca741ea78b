"""What every task module shares: the prompt and task types, and how a prompt becomes token ids
(the rollout workers and the trainer must agree). ``runtime.tasks`` re-exports all of it; the task
modules import it from here, so that the package and its modules do not import each other."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import random


@dataclass(frozen=True)
class TaskPrompt:
    """One prompt of a task; ``meta`` holds what the reward needs (target, reference answer)."""

    prompt_id: int
    text: str
    meta: dict[str, Any]
    messages: list[dict[str, str]] | None = None
    """A chat prompt's ``{role, content}`` messages (``text`` is then the last one's content)."""


@runtime_checkable
class Task(Protocol):
    """A dataset of prompts and a reward function over completions."""

    name: str
    prompts: Sequence[TaskPrompt]

    def reward(self, prompt: TaskPrompt, completion_text: str) -> float: ...


@runtime_checkable
class SupervisedTask(Task, Protocol):
    """A task that can also produce (prompt, completion) pairs for the warm start."""

    def sft_examples(self, count: int, rng: random.Random) -> list[tuple[TaskPrompt, str]]: ...


def load_tokenizer(model: str):
    """The tokenizer of a model directory or hub id (``transformers.AutoTokenizer``)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    if tokenizer.pad_token_id is None:
        # Instruct models often ship without a pad token; batching needs one.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def resolve_chat_template(value: str | None) -> str | None:
    """``task.chat_template``: a file holding a Jinja template, or the template itself."""
    if value is None:
        return None
    if "{" not in value:  # no Jinja tag: a path (a template always has one)
        file = Path(value).expanduser()
        if not file.is_file():
            raise ValueError(f"task.chat_template: {value!r} is neither a template nor a file")
        return file.read_text()
    return value


def encode_prompt(tokenizer, prompt: TaskPrompt, chat_template: str | None = None) -> list[int]:
    """Prompt token ids, computed once by the controller and sent to the workers and the trainer,
    so both see the same ids.

    A chat prompt (``prompt.messages``) goes through ``chat_template`` or else the tokenizer's
    own, with the generation prompt; a string prompt goes through the template as one user
    message when there is one, else it is tokenized as plain text (+BOS).
    """
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if prompt.messages is not None and not template:
        raise ValueError(
            f"task.chat_template: prompt {prompt.prompt_id} is a chat (a list of messages) but "
            "the tokenizer has no chat template; set task.chat_template"
        )
    if template:
        messages = prompt.messages or [{"role": "user", "content": prompt.text}]
        ids = tokenizer.apply_chat_template(
            messages, chat_template=template, add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, Mapping):  # transformers 5 may return a BatchEncoding
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer(prompt.text, add_special_tokens=True)["input_ids"]]
