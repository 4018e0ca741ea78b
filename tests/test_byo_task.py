"""Bring your own task: datasets, reward functions by import path, chat templates, bad input.

Everything here is written into pytest's temporary directory, outside the project, the way a
user's files would be. No process is started (the end-to-end run is in test_byo_task_e2e.py).
"""

from __future__ import annotations

import asyncio
import json
import textwrap
from pathlib import Path
from typing import Any

import pytest

from runtime.config import ConfigError, validate_config
from runtime.controller.ledger import verify_records
from runtime.tasks import build_task, encode_prompt, preflight
from runtime.tasks.dataset import DatasetTask
from runtime.tasks.rewards import RewardError

# TRL's documented example reward functions, unmodified (TRL docs, "Using a custom reward
# function"): a length reward on standard completions, and an exact-match reward reading a
# dataset column, written for conversational completions.
TRL_REWARDS = '''
def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    import re
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def accuracy_reward(completions, ground_truth, **kwargs):
    contents = [completion[0]["content"] for completion in completions]
    return [1.0 if gt in c else 0.0 for c, gt in zip(contents, ground_truth)]
'''

VERL_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    bonus = extra_info["bonus"] if extra_info else 0.0
    return {"score": (1.0 if solution_str.strip() == ground_truth else 0.0) + bonus, "acc": 1}
"""

MISBEHAVING = """
import asyncio
import math
import time


def raises(prompts, completions, completion_ids, **columns):
    raise ZeroDivisionError("boom in user code")


def wrong_count(prompts, completions, completion_ids, **columns):
    return [1.0]


def nan(prompts, completions, completion_ids, **columns):
    return [math.nan for _ in completions]


def not_a_number(prompts, completions, completion_ids, **columns):
    return ["high" for _ in completions]


def slow(prompts, completions, completion_ids, **columns):
    time.sleep(1.0)
    return [1.0 for _ in completions]


async def slow_async(prompts, completions, completion_ids, **columns):
    await asyncio.sleep(5.0)
    return [1.0 for _ in completions]


def all_none(prompts, completions, completion_ids, **columns):
    return [None for _ in completions]


def two_args(completions, answer):
    return [0.0 for _ in completions]
"""

GOOD = """
async def async_len(prompts, completions, completion_ids, **columns):
    return [float(len(ids)) for ids in completion_ids]


def weight_column(prompts, completions, completion_ids, weight, **columns):
    return [float(w) for w in weight]


def first_only(prompts, completions, completion_ids, **columns):
    return [1.0] + [None] * (len(completions) - 1)
"""


def write_module(tmp_path: Path, name: str, source: str) -> Path:
    path = tmp_path / "user" / f"{name}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source))
    return path


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def dataset_config(dataset: Path | str, reward: Any, **task: Any):
    return validate_config(
        {"task": {"name": "dataset", "dataset": str(dataset), "reward": reward, **task}}
    )


def rewards_config(dataset: Path | str, rewards: list[dict[str, Any]], **task: Any):
    return validate_config(
        {"task": {"name": "dataset", "dataset": str(dataset), "rewards": rewards, **task}}
    )


ROWS = [
    {"prompt": "Say hi", "answer": "hi", "weight": 0.5, "id": "a"},
    {"prompt": "Say yo", "answer": "yo", "weight": 2.0, "id": "b"},
]


@pytest.fixture
def data(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "user" / "data.jsonl", ROWS)


def score(task: DatasetTask, index: int, texts: list[str], ids: list[list[int]] | None = None):
    ids = ids if ids is not None else [[1] * len(t) for t in texts]
    return asyncio.run(task.score_group(task.prompts[index], texts, ids))


# --- datasets ---------------------------------------------------------------------------------


def test_jsonl_rows_become_prompts_and_other_columns_travel(data: Path, tmp_path: Path) -> None:
    reward = write_module(tmp_path, "trl_rewards", TRL_REWARDS)
    task = build_task(dataset_config(data, f"{reward}:reward_len", id_field="id"))
    assert isinstance(task, DatasetTask)
    assert [p.text for p in task.prompts] == ["Say hi", "Say yo"]
    assert task.prompts[1].meta == {"answer": "yo", "weight": 2.0, "id": "b"}
    assert task.label(task.prompts[1]) == "id 'b' (row 1)"


@pytest.mark.parametrize("kind", ["parquet", "csv", "save_to_disk"])
def test_parquet_csv_and_save_to_disk_load_like_jsonl(kind: str, tmp_path: Path) -> None:
    import datasets

    table = datasets.Dataset.from_list(ROWS)
    if kind == "parquet":
        source = tmp_path / "data.parquet"
        table.to_parquet(str(source))
    elif kind == "csv":
        source = tmp_path / "data.csv"
        table.to_csv(str(source), index=False)
    else:
        source = tmp_path / "saved"
        datasets.DatasetDict({"train": table, "test": table.select([0])}).save_to_disk(str(source))
    reward = write_module(tmp_path, "trl_rewards", TRL_REWARDS)
    task = build_task(dataset_config(source, f"{reward}:reward_len", id_field="id"))
    assert [p.text for p in task.prompts] == ["Say hi", "Say yo"]
    assert task.prompts[0].meta["answer"] == "hi"
    if kind == "save_to_disk":
        test = build_task(dataset_config(source, f"{reward}:reward_len", split="test"))
        assert [p.text for p in test.prompts] == ["Say hi"]
        with pytest.raises(ConfigError, match=r"task.split: 'dev' is not a split"):
            build_task(dataset_config(source, f"{reward}:reward_len", split="dev"))


def test_integer_ids_and_duplicate_ids(tmp_path: Path) -> None:
    reward = write_module(tmp_path, "trl_rewards", TRL_REWARDS)
    rows = [{"q": "x", "n": 7}, {"q": "y", "n": 9}]
    task = build_task(
        dataset_config(
            write_jsonl(tmp_path / "ints.jsonl", rows),
            f"{reward}:reward_len",
            prompt_field="q",
            id_field="n",
        )
    )
    assert task.ids == [7, 9]
    dup = write_jsonl(tmp_path / "dup.jsonl", [{"q": "x", "n": 7}, {"q": "y", "n": 7}])
    with pytest.raises(ConfigError, match=r"task.id_field: id 7 appears twice"):
        build_task(dataset_config(dup, f"{reward}:reward_len", prompt_field="q", id_field="n"))


# --- reward functions --------------------------------------------------------------------------


def test_unmodified_trl_reward_functions(data: Path, tmp_path: Path) -> None:
    reward = write_module(tmp_path, "trl_rewards", TRL_REWARDS)
    task = build_task(dataset_config(data, f"{reward}:reward_len"))
    got = score(task, 0, ["x" * 20, "x" * 25, ""])
    assert got.totals == [0.0, -5.0, -20.0]
    assert got.per_function == {"reward_len": [0.0, -5.0, -20.0]}


def test_trl_functions_on_chat_prompts_get_chat_completions(tmp_path: Path) -> None:
    rows = [{"messages": [{"role": "user", "content": "2+2?"}], "ground_truth": "4"}]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    reward = write_module(tmp_path, "trl_rewards", TRL_REWARDS)
    task = build_task(
        rewards_config(
            data,
            [
                {"fn": f"{reward}:accuracy_reward", "weight": 2.0},
                {"fn": f"{reward}:format_reward_func", "weight": 0.5},
            ],
            prompt_field="messages",
        )
    )
    prompt = task.prompts[0]
    assert prompt.messages == [{"role": "user", "content": "2+2?"}]
    got = score(task, 0, ["<think>easy</think><answer>4</answer>", "5"])
    assert got.per_function == {"accuracy_reward": [1.0, 0.0], "format_reward_func": [1.0, 0.0]}
    assert got.totals == [2.5, 0.0]


def test_module_import_path_async_weights_and_none(tmp_path: Path, monkeypatch) -> None:
    write_module(tmp_path, "user_good_rewards", GOOD)
    monkeypatch.syspath_prepend(str(tmp_path / "user"))
    data = write_jsonl(tmp_path / "d.jsonl", ROWS)
    task = build_task(
        rewards_config(
            data,
            [
                {"fn": "user_good_rewards:async_len", "weight": 0.5, "name": "length"},
                {"fn": "user_good_rewards:weight_column", "weight": 10.0},
                {"fn": "user_good_rewards:first_only", "weight": 100.0},
            ],
        )
    )
    got = score(task, 1, ["abc", "de"], [[1, 2, 3], [4, 5]])
    # 0.5 * length + 10 * weight column (2.0) + 100 on the first completion only (None after).
    assert got.totals == [1.5 + 20.0 + 100.0, 1.0 + 20.0]
    assert got.per_function["first_only"] == [1.0, None]


def test_verl_compute_score_adapter(tmp_path: Path) -> None:
    rows = [
        {
            "prompt": "capital of France?",
            "data_source": "geo",
            "reward_model": {"style": "rule", "ground_truth": "Paris"},
            "extra_info": {"bonus": 0.25},
        }
    ]
    data = write_jsonl(tmp_path / "verl.jsonl", rows)
    reward = write_module(tmp_path, "verl_reward", VERL_REWARD)
    task = build_task(dataset_config(data, {"fn": f"{reward}:compute_score", "style": "verl"}))
    assert score(task, 0, ["Paris", " London"]).totals == [1.25, 0.25]


@pytest.mark.parametrize(
    ("fn", "problem"),
    [
        ("raises", r"raised ZeroDivisionError: boom in user code"),
        ("wrong_count", r"returned 1 values for 2 completions"),
        ("nan", r"returned nan for completion 0"),
        ("not_a_number", r"returned str 'high' for completion 0"),
        ("slow", r"timed out after 0.2 s"),
        ("slow_async", r"timed out after 0.2 s"),
        ("all_none", r"no reward function scored completion 0"),
    ],
)
def test_each_reward_failure_names_function_prompt_and_problem(
    fn: str, problem: str, data: Path, tmp_path: Path
) -> None:
    reward = write_module(tmp_path, "bad_rewards", MISBEHAVING)
    task = build_task(dataset_config(data, f"{reward}:{fn}", id_field="id", reward_timeout_s=0.2))
    with pytest.raises(RewardError, match=rf"reward function '{fn}' on prompt id 'b' \(row 1\): "):
        score(task, 1, ["x", "y"])
    with pytest.raises(RewardError, match=problem):
        score(task, 1, ["x", "y"])


# --- chat templates ----------------------------------------------------------------------------

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_chat_prompts_go_through_the_configured_template(tmp_path: Path) -> None:
    from runtime.tasks import ensure_model, load_tokenizer, resolve_chat_template

    tokenizer = load_tokenizer(ensure_model(validate_config({"task": {"sft_steps": 0}})))
    rows = [
        {
            "chat": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
            ]
        }
    ]
    reward = write_module(tmp_path, "trl_rewards", TRL_REWARDS)
    template_file = tmp_path / "user" / "template.jinja"
    template_file.write_text(TEMPLATE)
    cfg = dataset_config(
        write_jsonl(tmp_path / "chat.jsonl", rows),
        f"{reward}:reward_len",
        prompt_field="chat",
        chat_template=str(template_file),
    )
    prompt = build_task(cfg).prompts[0]
    ids = encode_prompt(tokenizer, prompt, resolve_chat_template(cfg.task.chat_template))
    expected = "<system>Be brief.\n<user>Hi\n<assistant>"
    assert tokenizer.decode(ids, skip_special_tokens=True) == expected
    # The tiny tokenizer has no template of its own: a chat prompt without one is refused.
    with pytest.raises(ValueError, match=r"task.chat_template"):
        encode_prompt(tokenizer, prompt)


# --- bad input: exit 2 before any process starts ----------------------------------------------


def _run_cli(tmp_path: Path, task: dict[str, Any], capsys) -> tuple[int, str]:
    from asp_tui.cli import main

    config = tmp_path / "run.yaml"
    run_dir = tmp_path / "run"
    config.write_text(json.dumps({"task": {"name": "dataset", **task}}))
    code = main(["run", "--headless", "--config", str(config), "--run-dir", str(run_dir)])
    assert not run_dir.exists(), "nothing may be created or started on bad input"
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("missing_file", r"task.dataset: '.*nope.jsonl': no such file"),
        ("missing_prompt_field", r"task.prompt_field: 'question' is not a column .*columns: \["),
        ("unimportable_module", r"task.reward: cannot import module 'no_such_pkg.rewards'"),
        ("missing_reward_file", r"task.reward: reward file '.*missing.py' does not exist"),
        ("missing_function", r"task.reward: '.*' has no attribute 'nope'"),
        ("wrong_signature", r"task.reward: two_args\(completions, answer\) cannot be called"),
        ("empty_dataset", r"task.dataset: '.*empty.jsonl' is empty \(no rows\)"),
        ("verl_without_truth", r"task.rewards\[0\].fn: style verl needs a 'reward_model'"),
        ("missing_chat_template", r"task.chat_template: '.*nope.jinja' is neither a template"),
    ],
)
def test_bad_input_exits_2_naming_the_field(case: str, expected: str, tmp_path: Path, capsys):
    data = write_jsonl(tmp_path / "user" / "data.jsonl", ROWS)
    bad = write_module(tmp_path, "bad_rewards", MISBEHAVING)
    good = write_module(tmp_path, "trl_rewards", TRL_REWARDS)
    verl = write_module(tmp_path, "verl_reward", VERL_REWARD)
    task: dict[str, Any] = {"dataset": str(data), "reward": f"{good}:reward_len"}
    if case == "missing_file":
        task["dataset"] = str(tmp_path / "nope.jsonl")
    elif case == "missing_prompt_field":
        task["prompt_field"] = "question"
    elif case == "unimportable_module":
        task["reward"] = "no_such_pkg.rewards:score"
    elif case == "missing_reward_file":
        task["reward"] = str(tmp_path / "missing.py") + ":score"
    elif case == "missing_function":
        task["reward"] = f"{good}:nope"
    elif case == "wrong_signature":
        task["reward"] = f"{bad}:two_args"
    elif case == "empty_dataset":
        empty = tmp_path / "empty.jsonl"
        empty.write_text("")
        task["dataset"] = str(empty)
    elif case == "verl_without_truth":
        del task["reward"]
        task["rewards"] = [{"fn": f"{verl}:compute_score", "style": "verl"}]
    elif case == "missing_chat_template":
        task["chat_template"] = str(tmp_path / "nope.jinja")
    code, err = _run_cli(tmp_path, task, capsys)
    assert code == 2, err
    assert __import__("re").search(expected, err), err


def test_preflight_makes_local_paths_absolute(tmp_path: Path, monkeypatch) -> None:
    data = write_jsonl(tmp_path / "user" / "data.jsonl", ROWS)
    write_module(tmp_path, "trl_rewards", TRL_REWARDS)
    monkeypatch.chdir(tmp_path / "user")
    resolved = preflight(dataset_config("data.jsonl", "trl_rewards.py:reward_len"))
    assert resolved.task.dataset == str(data)
    fn = resolved.task.reward_functions()[0].fn
    assert fn == f"{tmp_path / 'user' / 'trl_rewards.py'}:reward_len"


# --- the ledger --------------------------------------------------------------------------------


def test_ledger_accounts_for_skipped_groups() -> None:
    records = [
        {"event": "dispatched", "group": 0, "prompt": 3, "epoch": 0, "instance": 0, "version": 0},
        {"event": "skipped", "group": 0, "reason": "reward function 'f' on prompt 3: boom"},
        {"event": "dispatched", "group": 1, "prompt": 4, "epoch": 0, "instance": 0, "version": 0},
        {"event": "completed", "group": 1, "instance": 0, "version_min": 0, "version_max": 0},
        {"event": "skipped", "group": 1, "reason": "too late"},
    ]
    report = verify_records(records)
    assert report.counts["skipped"] == 1
    assert report.requeued_pending == []  # a skipped prompt is not owed a retry
    assert report.errors == ["line 5: 'skipped' for group 1 in state completed"]


# --- evaluation rounds -------------------------------------------------------------------------


def _completion(reward: float, length: int, **per_fn: float):
    import numpy as np

    from runtime.protocol import Completion

    return Completion(
        token_ids=np.zeros(length, dtype=np.int32),
        logprobs=np.zeros(length, dtype=np.float32),
        version_min=4,
        version_max=4,
        finish_reason="stop",
        reward=reward,
        finished_at=0.0,
        rewards=per_fn,
    )


def test_eval_round_reports_mean_reward_pass_at_k_and_length() -> None:
    from runtime.controller.evaluation import EvalRound, pass_at_k

    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    round_ = EvalRound(version=4, final=True, instance_id=0, pending={-1, -2, -3})
    round_.completed(-1, 100, [_completion(1.1, 2, ok=1.0), _completion(0.1, 4, ok=0.0)])
    round_.completed(-2, 101, [_completion(0.1, 6, ok=0.0), _completion(0.1, 8, ok=0.0)])
    assert not round_.done
    round_.failed(-3, "reward function 'ok' on prompt id 'x': boom")
    assert round_.done
    summary = round_.summary(n=2)
    assert summary["eval_reward_mean"] == pytest.approx(0.35)
    assert summary["eval_mean_length"] == 5.0
    assert summary["eval_failed_groups"] == 1 and summary["eval_prompts"] == 2
    assert "eval_pass@2" not in summary  # the total (1.1, 0.1) is not a 0/1 reward
    assert summary["eval_pass@1/ok"] == pytest.approx(0.25)  # (1/2 + 0) / 2
    assert summary["eval_pass@2/ok"] == pytest.approx(0.5)
    assert summary["eval_reward/ok"] == pytest.approx(0.25)
    assert summary["eval_weight_version"] == 4


def test_eval_set_is_checked_like_the_training_set(data: Path, tmp_path: Path) -> None:
    reward = write_module(tmp_path, "trl_rewards", TRL_REWARDS)
    missing = {"dataset": str(tmp_path / "no-eval.jsonl"), "every": 2}
    with pytest.raises(ConfigError, match=r"task.eval.dataset: '.*no-eval.jsonl': no such file"):
        preflight(dataset_config(data, f"{reward}:reward_len", eval=missing))
    resolved = preflight(
        dataset_config(data, f"{reward}:reward_len", eval={"dataset": str(data), "every": 2})
    )
    evaluation = DatasetTask.eval_of(resolved)
    assert evaluation is not None
    assert [p.prompt_id for p in evaluation.prompts] == [1 << 30, (1 << 30) + 1]
    assert evaluation.label(evaluation.prompts[1]) == "id 1 (row 1 of the eval set)"


def test_trls_own_reward_function_by_module_path(tmp_path: Path) -> None:
    """TRL's shipped think_format_reward, imported by its module path, unmodified."""
    pytest.importorskip("trl")
    rows = [{"messages": [{"role": "user", "content": "Think first."}]}]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    task = build_task(
        dataset_config(data, "trl.rewards:think_format_reward", prompt_field="messages")
    )
    got = score(task, 0, ["<think>\nhmm\n</think>\nyes", "no thinking"])
    assert got.totals == [1.0, 0.0]


async def test_eval_results_show_in_the_dashboards_event_log() -> None:
    """The controller publishes each eval round as an ``eval`` event; the dashboard lists it."""
    import random

    from asp_tui.app import make_app
    from asp_tui.link import FixedLink
    from asp_tui.model import Backoff
    from asp_tui.samples import BASE_TIME, sample_events, sample_history, sample_snapshot
    from runtime.controller.evaluation import EvalRound, describe_eval
    from runtime.protocol import Event

    round_ = EvalRound(version=40, final=True, instance_id=0, pending={-1})
    round_.completed(-1, 100, [_completion(1.0, 3, ok=1.0), _completion(0.0, 5, ok=0.0)])
    record = round_.summary(n=2)
    line = describe_eval(record)
    assert line == (
        "final eval at v40: reward 0.500, pass@1 0.500, pass@2 1.000, pass@1/ok 0.500, "
        "pass@2/ok 1.000, length 4.0"
    )
    event = Event(time=BASE_TIME + 41, kind="eval", message=line, data={})
    link = FixedLink(
        [sample_snapshot(8)], history=sample_history(8), history_events=[*sample_events(), event]
    )
    app = make_app(link, readonly=True, backoff=Backoff(rng=random.Random(0)))
    async with app.run_test(size=(80, 24)) as pilot:
        for _ in range(100):
            if any("final eval at v40" in text for text in app.event_log.lines):
                break
            await pilot.pause(0.05)
        assert any("eval" in text and "pass@2 1.000" in text for text in app.event_log.lines)


# --- scheduler.lengths: a profile keyed by the dataset's own ids ------------------------------


def test_lengths_file_ids_match_the_datasets_own_ids(data: Path, tmp_path: Path) -> None:
    from runtime.tasks import length_prior

    reward = write_module(tmp_path, "trl_rewards", TRL_REWARDS)
    lengths = tmp_path / "lengths.csv"
    lengths.write_text("prompt_id,output_tokens\nb,30\nb,40\na,10\n")
    cfg = dataset_config(data, f"{reward}:reward_len", id_field="id")
    cfg.scheduler.lengths = str(lengths)
    task = build_task(cfg)
    # String ids 'a', 'b' are rows 0 and 1: the prior is keyed by the wire's prompt ids.
    assert length_prior(cfg, task) == {1: (30, 40), 0: (10,)}
    # Integer ids match as text; a file may leave prompts out (they fall back to the proxy).
    ints = write_jsonl(tmp_path / "ints.jsonl", [{"q": "x", "n": 7}, {"q": "y", "n": 9}])
    cfg = dataset_config(ints, f"{reward}:reward_len", prompt_field="q", id_field="n")
    lengths.write_text("prompt_id,o1,o2\n9,5,6\n")
    cfg.scheduler.lengths = str(lengths)
    assert length_prior(cfg, build_task(cfg)) == {1: (5, 6)}


def test_lengths_file_with_unknown_ids_is_a_clear_error(data: Path, tmp_path: Path, capsys):
    reward = write_module(tmp_path, "trl_rewards", TRL_REWARDS)
    lengths = tmp_path / "lengths.csv"
    from runtime.tasks import length_prior

    cfg = dataset_config(data, f"{reward}:reward_len", id_field="id")
    cfg.scheduler.lengths = str(lengths)
    # A profile of more prompts than the run has: the known ids are used, the rest logged.
    lengths.write_text("prompt_id,output_tokens\na,10\nh7-0,30\nh7-1,5\n")
    assert length_prior(cfg, build_task(cfg)) == {0: (10,)}
    # No id names a prompt (ids from another column, or another dataset's file): an error.
    lengths.write_text("prompt_id,output_tokens\nh7-0,30\nh7-0,31\nh7-1,5\n")
    expected = (
        rf"scheduler.lengths: {lengths}:2: column 'prompt_id': 'h7-0' is not a prompt id of "
        r"task 'dataset', and neither is any other of the file's 2 ids; the task's ids look "
        r"like 'a', 'b' \(task.id_field"
    )
    with pytest.raises(ConfigError, match=expected):
        preflight(cfg)
    # From the command line: exit 2 before anything is created or started.
    from asp_tui.cli import main

    config = tmp_path / "run.yaml"
    run_dir = tmp_path / "run"
    config.write_text(
        json.dumps(
            {
                "task": {
                    "name": "dataset",
                    "dataset": str(data),
                    "reward": f"{reward}:reward_len",
                    "id_field": "id",
                },
                "scheduler": {"lengths": str(lengths)},
            }
        )
    )
    code = main(["run", "--headless", "--config", str(config), "--run-dir", str(run_dir)])
    assert code == 2 and not run_dir.exists()
    assert "'h7-0' is not a prompt id of task 'dataset'" in capsys.readouterr().err
