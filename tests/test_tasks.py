"""Tasks, rewards, the built-in tiny model and its cache."""

from __future__ import annotations

import json
import math
import random
import statistics
import threading
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file

from runtime.config import TinyModelConfig, load_config, validate_config
from runtime.tasks import (
    MARKER_FILE,
    SupervisedTask,
    Task,
    TaskPrompt,
    build_task,
    encode_prompt,
    ensure_model,
    load_tokenizer,
    model_cache_key,
)
from runtime.tasks.gsm8k import (
    Gsm8kTask,
    answers_match,
    extract_answer,
    load_gsm8k,
    parse_number,
    sample_dataset,
)
from runtime.tasks.target_length import (
    MIN_TARGET,
    TargetLengthTask,
    answer_length,
    default_trace,
    length_reward,
    load_length_trace,
    scaled_groups,
)
from runtime.tasks.tiny_model import CHARACTERS, build_tiny_model, build_tokenizer

REPO = Path(__file__).resolve().parents[1]
SHARED_LENGTHS = REPO.parent / "shared" / "data" / "lengths"
SMALL = TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=1,
                        num_kv_heads=1, max_position_embeddings=256)  # fmt: skip


def small_config(**task: object) -> object:
    """A config with a small tiny model and a short warm start, so tests take seconds."""
    return validate_config(
        {
            "model": {"tiny": SMALL.model_dump()},
            "task": {"num_prompts": 32, "sft_steps": 3, **task},
        }
    )


# --- tokenizer and model -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", SMALL, seed=0)


def test_tokenizer_round_trip_is_character_level(tiny_dir: Path) -> None:
    tokenizer = load_tokenizer(str(tiny_dir))
    text = "Write 23 letters:\n" + "".join(CHARACTERS)
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert len(ids) == len(text) + 1  # one token per character, plus <bos>
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert {tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token} == {
        "<bos>",
        "<eos>",
        "<pad>",
    }
    assert len({tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}) == 3


def test_tokenizer_maps_unknown_characters_to_unk() -> None:
    tokenizer = build_tokenizer()
    ids = tokenizer.encode("a€b").ids
    assert ids[1:] == [tokenizer.token_to_id(c) for c in "a"] + [
        tokenizer.token_to_id("<unk>"),
        tokenizer.token_to_id("b"),
    ]


def test_model_directory_is_a_normal_hf_directory(tiny_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (tiny_dir / name).is_file(), name
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["head_dim"] >= 32  # vLLM's CPU attention needs head sizes >= 32
    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir))
    assert all(p.dtype.is_floating_point and p.element_size() == 4 for p in model.parameters())
    assert model.config.vocab_size == len(load_tokenizer(str(tiny_dir)))


def test_same_seed_same_weights_other_seed_other_weights(tiny_dir: Path, tmp_path: Path) -> None:
    again = load_file(build_tiny_model(tmp_path / "a", SMALL, seed=0) / "model.safetensors")
    other = load_file(build_tiny_model(tmp_path / "b", SMALL, seed=1) / "model.safetensors")
    first = load_file(tiny_dir / "model.safetensors")
    assert first.keys() == again.keys() == other.keys()
    assert all((first[k] == again[k]).all() for k in first)
    assert any((first[k] != other[k]).any() for k in first)


def test_encode_prompt_without_chat_template_prepends_bos(tiny_dir: Path) -> None:
    tokenizer = load_tokenizer(str(tiny_dir))
    prompt = TaskPrompt(0, "Write 5 letters:\n", {"target": 5})
    ids = encode_prompt(tokenizer, prompt)
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids[1:]) == prompt.text


# --- ensure_model ------------------------------------------------------------------------------


def test_ensure_model_passes_hub_ids_and_paths_through(tmp_path: Path) -> None:
    for path in ("Qwen/Qwen2.5-1.5B-Instruct", "/models/llama"):
        config = validate_config({"model": {"path": path}})
        assert ensure_model(config, cache_dir=tmp_path) == path
    assert list(tmp_path.iterdir()) == []


def test_ensure_model_builds_once_and_caches(tmp_path: Path) -> None:
    config = small_config()
    steps: list[int] = []
    first = Path(ensure_model(config, cache_dir=tmp_path, progress=lambda s, t, m: steps.append(s)))
    assert steps == [1, 2, 3]
    info = json.loads((first / MARKER_FILE).read_text())
    assert info["sft"]["steps"] == 3 and math.isfinite(info["sft"]["loss"])
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    second = Path(
        ensure_model(config, cache_dir=tmp_path, progress=lambda s, t, m: steps.append(s))
    )
    assert second == first and steps == [1, 2, 3]  # no second warm start
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime
    # The warm start changed the random init.
    raw = build_tiny_model(tmp_path / "raw", SMALL, seed=0) / "model.safetensors"
    trained, init = load_file(first / "model.safetensors"), load_file(raw)
    assert any((trained[k] != init[k]).any() for k in init)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_cache_key_depends_on_model_task_and_seed() -> None:
    base = small_config()
    keys = {
        model_cache_key(base),
        model_cache_key(small_config(max_target_length=50)),
        model_cache_key(small_config(sft_steps=4)),
        model_cache_key(validate_config({**base.model_dump(by_alias=True), "run": {"seed": 1}})),
    }
    assert len(keys) == 4
    assert model_cache_key(small_config()) == model_cache_key(base)


def test_concurrent_ensure_model_builds_one_directory(tmp_path: Path) -> None:
    config = small_config()
    results: list[str] = []
    threads = [
        threading.Thread(target=lambda: results.append(ensure_model(config, cache_dir=tmp_path)))
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(results)) == 1 and len(results) == 3
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == [Path(results[0]).name]


def test_failed_build_leaves_no_model_behind(tmp_path: Path) -> None:
    config = small_config()

    def crash(step: int, total: int, metrics: object) -> None:
        if step == 2:
            raise KeyboardInterrupt  # what Ctrl-C during the warm start looks like

    with pytest.raises(KeyboardInterrupt):
        ensure_model(config, cache_dir=tmp_path, progress=crash)
    assert [p for p in tmp_path.iterdir() if p.is_dir()] == []
    built = Path(ensure_model(config, cache_dir=tmp_path))
    assert (built / MARKER_FILE).is_file()


def test_ensure_model_uses_env_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASP_TUI_CACHE", str(tmp_path / "cache"))
    built = Path(ensure_model(small_config(sft_steps=0)))
    assert built.parent == tmp_path / "cache"
    assert json.loads((built / MARKER_FILE).read_text())["sft"] is None


# --- target_length ------------------------------------------------------------------------------


@given(target=st.integers(1, 500), miss=st.integers(0, 500))
def test_length_reward_is_one_when_exact_and_decreases_symmetrically(
    target: int, miss: int
) -> None:
    assert length_reward(target, target) == 1.0
    over, under = length_reward(target + miss, target), length_reward(target - miss, target)
    assert over == pytest.approx(under)
    assert 0.0 < over <= 1.0
    assert length_reward(target + miss + 1, target) < over


def test_length_reward_tolerance_is_relative() -> None:
    # A 25% miss costs less at length 80 than a 25% miss at length 8 gains nothing absolute...
    assert length_reward(100, 80) == pytest.approx(length_reward(60, 80))
    assert length_reward(100, 80) > length_reward(30, 10)
    with pytest.raises(ValueError, match="target"):
        length_reward(3, 0)


def test_task_reward_counts_answer_characters() -> None:
    task = TargetLengthTask.from_config(small_config())
    prompt = task.prompts[0]
    target = prompt.meta["target"]
    assert answer_length("  abc \n") == 3
    assert task.reward(prompt, "x" * target) == 1.0
    assert task.reward(prompt, "x" * target + "\n") == 1.0
    assert task.reward(prompt, "x" * (target + 5)) < task.reward(prompt, "x" * (target + 1))


def test_target_length_prompts_are_deterministic_long_tailed_and_bounded() -> None:
    config = validate_config({"task": {"num_prompts": 256, "max_target_length": 96}})
    task = build_task(config)
    assert isinstance(task, Task) and isinstance(task, SupervisedTask)
    again = build_task(config)
    assert [p.text for p in task.prompts] == [p.text for p in again.prompts]
    targets = [p.meta["target"] for p in task.prompts]
    assert [p.prompt_id for p in task.prompts] == list(range(256))
    assert all(MIN_TARGET <= t <= 96 for t in targets)
    assert all(f"Write {t} letters" in p.text for t, p in zip(targets, task.prompts, strict=True))
    assert len(set(targets)) > 30
    median = statistics.median(targets)
    p95 = sorted(targets)[int(0.95 * len(targets))]
    assert p95 > 2 * median  # a long tail, not a uniform spread
    other = build_task(validate_config({"run": {"seed": 1}, "task": {"num_prompts": 256}}))
    assert [p.text for p in other.prompts] != [p.text for p in task.prompts]


def test_sft_examples_overshoot_the_target_like_the_trace() -> None:
    task = TargetLengthTask.from_config(small_config())
    pairs = task.sft_examples(2000, random.Random(0))
    ratios = [len(c) / p.meta["target"] for p, c in pairs]
    assert all(c == ("abcdefghijklmnopqrstuvwxyz" * 8)[: len(c)] for _, c in pairs)
    assert statistics.median(ratios) > 1.05  # the warm policy has something to learn
    assert min(ratios) >= 0.5


def test_default_trace_is_package_data() -> None:
    rows = load_length_trace(default_trace())
    assert len(rows) == 1200 and all(len(r) == 10 for r in rows)


@pytest.mark.skipif(not SHARED_LENGTHS.is_dir(), reason="shared traces not present")
def test_other_real_traces_load() -> None:
    seqsched = load_length_trace(SHARED_LENGTHS / "seqsched_vicuna7b_alpaca_4temps.csv")
    assert len(seqsched) == 20000 and all(len(r) == 4 for r in seqsched)
    azure = load_length_trace(SHARED_LENGTHS / "azure_llm_2023_conv.csv")
    assert all(len(r) == 1 for r in azure)
    groups = scaled_groups(seqsched, 64)
    assert max(g.target for g in groups) == 64
    config = validate_config(
        {"task": {"lengths_trace": str(SHARED_LENGTHS / "seqsched_vicuna7b_alpaca_4temps.csv")}}
    )
    assert len(build_task(config).prompts) == config.task.num_prompts
    with pytest.raises(ValueError, match=r"task.lengths_trace: .*PMF"):
        load_length_trace(SHARED_LENGTHS / "servegen_deepseek_r1_output_pmf.csv")


@pytest.mark.parametrize(
    ("config", "field"),
    [("sim-8.yaml", "rollout.sim.lengths"), ("tiny.yaml", "task.lengths_trace")],
)
def test_a_missing_trace_is_a_config_error_before_anything_starts(
    tmp_path: Path, config: str, field: str
) -> None:
    from runtime.config import ConfigError
    from runtime.tasks import preflight

    configs = Path(__file__).resolve().parents[1] / "configs"
    missing = tmp_path / "missing.csv"
    with pytest.raises(ConfigError, match=rf"{field}: .*missing.csv' is not a file"):
        preflight(load_config(configs / config, [f"{field}={missing}"]))


def test_bad_traces_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"task.lengths_trace: .* is not a file"):
        load_length_trace(tmp_path / "missing.csv")
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match=r"task.lengths_trace: .*columns \['a', 'b'\]"):
        load_length_trace(bad)
    bad.write_text("output_tokens\n12\nlots\n")
    with pytest.raises(ValueError, match="line 3: non-numeric"):
        load_length_trace(bad)


# --- gsm8k ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "reference", "right"),
    [
        ("So the total is \\boxed{26}.", "26", True),
        ("\\boxed{\\$1,500.00}", "1500", True),
        ("... so she needs 12 months.\n#### 12", "12", True),
        ("First 3 * 12 = 36, then 36 - 10 = 26", "26", True),
        ("The answer is 5,000.", "5000", True),
        ("It is \\boxed{2.50} meters", "2.5", True),
        ("\\boxed{\\frac{5}{2}}", "2.5", True),
        ("The temperature is -7 degrees.", "-7", True),
        ("\\boxed{x = 7}", "7", True),
        ("\\boxed{25\\%}", "25", True),
        ("I think 26 but \\boxed{27}", "26", False),  # the box wins over earlier numbers
        ("#### 26\nActually, 27", "27", False),  # #### wins over a later stray number
        ("No idea.", "26", False),
        ("\\boxed{}", "26", False),
        ("2.5", "25", False),
        ("7", "-7", False),
    ],
)
def test_gsm8k_answer_matching(completion: str, reference: str, right: bool) -> None:
    assert answers_match(completion, reference) is right


def test_gsm8k_extraction_details() -> None:
    assert extract_answer("a \\boxed{\\frac{1}{2}} b") == "\\frac{1}{2}"
    assert extract_answer("1, 2, then 3.") == "3"
    assert extract_answer("nothing here") is None
    assert parse_number("1,234.50") == parse_number("1234.5")
    assert parse_number("abc") is None


def test_gsm8k_task_from_sample_dataset() -> None:
    task = build_task(validate_config({"task": {"name": "gsm8k", "num_prompts": 5}}))
    assert isinstance(task, Gsm8kTask) and len(task.prompts) == 5
    prompt = task.prompts[0]
    assert prompt.text.startswith("Tom has 3 boxes") and "\\boxed{}" in prompt.text
    assert task.reward(prompt, "3*12=36, 36-10=26. \\boxed{26}") == 1.0
    assert task.reward(prompt, "\\boxed{36}") == 0.0
    # The reference solutions themselves earn full reward.
    for p, solution in task.sft_examples(20, random.Random(0)):
        assert "<<" not in solution and task.reward(p, solution) == 1.0
    assert len(load_gsm8k(sample_dataset())) == 8


def test_gsm8k_bad_dataset_lines_name_the_line(tmp_path: Path) -> None:
    data = tmp_path / "g.jsonl"
    data.write_text('{"question": "q", "answer": "a\\n#### 3"}\n{"question": "q"}\n')
    with pytest.raises(ValueError, match=r"task.dataset: .*g.jsonl:2: expected an object"):
        load_gsm8k(data)
    data.write_text('{"question": "q", "answer": "no final line"}\n')
    with pytest.raises(ValueError, match=r":1: answer: no '#### <number>'"):
        load_gsm8k(data)
    data.write_text("not json\n")
    with pytest.raises(ValueError, match=":1: not JSON"):
        load_gsm8k(data)


def test_gpu_gsm8k_config_validates() -> None:
    config = load_config(REPO / "configs" / "gpu-gsm8k.yaml")
    assert config.model.path == "Qwen/Qwen2.5-1.5B-Instruct"
    assert config.task.name == "gsm8k" and config.task.sft_steps == 0
    assert config.num_instances == 6
    assert config.trainer.num_processes == 2
    assert config.scheduler.policy == "asp"
    assert ensure_model(config) == "Qwen/Qwen2.5-1.5B-Instruct"


def test_encode_prompt_uses_the_chat_template_when_there_is_one(tiny_dir: Path) -> None:
    tokenizer = load_tokenizer(str(tiny_dir))
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    ids = encode_prompt(tokenizer, TaskPrompt(0, "2+2?", {}))
    assert all(isinstance(i, int) for i in ids)
    assert tokenizer.decode(ids) == "<user>2+2?\n<assistant>"
