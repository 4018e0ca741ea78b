"""Cost of the instance model (runtime/sim/instance.py) alone, as the simulator drives it.

K instances with C slots each serve G groups of n samples whose lengths are log-normal
(median ~400 tokens, capped at 8k); a minimal driver keeps every instance's dispatched samples
at most C, wakes each instance at its ``next_event``, and reads its ``GroupDone`` messages.
No controller logic, no trainer: this is the floor under any simulator built on the model.
CPU seconds (``time.process_time``) are reported, the best of ``--repeat`` runs, because the
machine may be shared.

    .venv/bin/python bench/sim_instance.py [--groups 10000] [--n 10] [--instances 8] [--slots 256]
"""

from __future__ import annotations

import argparse
import heapq
import math
import time

import numpy as np
from rich.console import Console
from rich.table import Table

from runtime.protocol import Generate, GroupDone
from runtime.scheduler.cost_model import CostModel
from runtime.sim.instance import InstanceModel, Payload, TableOutputs
from runtime.tasks.sim_task import sim_reward


def run_once(
    lengths: dict[int, list[int]],
    prompt_tokens: dict[int, int],
    n: int,
    instances: int,
    slots: int,
    payload: Payload,
    rewards: bool,
) -> tuple[float, int, float]:
    """(CPU seconds, samples finished, simulated makespan)."""
    started = time.process_time()
    cost = CostModel.sized_for(instances)
    outputs = TableOutputs(lengths, prompt_tokens, payload, sim_reward if rewards else None)
    models = [InstanceModel(i, slots, cost, outputs) for i in range(instances)]
    no_ids = np.zeros(0, dtype=np.int32)
    todo = list(lengths)
    in_flight = [0] * instances
    samples, end = 0, 0.0

    def fill(i: int, now: float) -> None:
        while todo and in_flight[i] + n <= slots:
            prompt = todo.pop()
            request = Generate(
                group_id=prompt, prompt_id=prompt, prompt_token_ids=no_ids, n=n, max_tokens=8192
            )
            models[i].handle(request, now)
            in_flight[i] += n

    wake: list[tuple[float, int]] = []
    for i, model in enumerate(models):
        model.start(0.0)
        fill(i, 0.0)
        heapq.heappush(wake, (model.next_event(0.0), i))
    while wake:
        now, i = heapq.heappop(wake)
        if now == math.inf:
            break
        model = models[i]
        model.advance(now)
        for message in model.take_output():
            if isinstance(message, GroupDone):
                in_flight[i] -= n
                samples += len(message.completions)
                end = now
        fill(i, now)
        heapq.heappush(wake, (model.next_event(now), i))
    return time.process_time() - started, samples, end


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, default=10_000)
    parser.add_argument("--n", type=int, default=10)
    parser.add_argument("--instances", type=int, default=8)
    parser.add_argument("--slots", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    lengths = {
        p: [int(x) for x in rng.lognormal(6.0, 1.0, args.n).clip(1, 8192)]
        for p in range(args.groups)
    }
    prompt_tokens = {p: int(rng.integers(50, 500)) for p in range(args.groups)}
    table = Table(
        title=f"instance model: {args.groups} groups x {args.n} samples, "
        f"{args.instances} instances x {args.slots} slots"
    )
    for column in ("payload", "rewards", "samples", "makespan (sim s)", "CPU s", "samples/s"):
        table.add_column(column, justify="right")
    for payload, rewards in (("light", False), ("light", True), ("random", True)):
        best = math.inf
        for _ in range(args.repeat):
            cpu, samples, end = run_once(
                lengths, prompt_tokens, args.n, args.instances, args.slots, payload, rewards
            )
            best = min(best, cpu)
        table.add_row(
            payload,
            "sim_reward" if rewards else "none",
            f"{samples:,}",
            f"{end:,.1f}",
            f"{best:.2f}",
            f"{samples / best:,.0f}",
        )
    Console().print(table)


if __name__ == "__main__":
    main()
