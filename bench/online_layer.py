"""Controller time the asp online layer adds per finished group, on a large simulated cluster.

Runs asp (with its online layer) in the simulator on the seqsched trace (one sample as the
prediction) on K instances, and times every call the online layer adds to the controller core:
``Dispatcher.repair`` (building the view of the groups the trainer waits on, and the policy's
``repair_due``/``repair``), and the layer's own work in ``on_group_finished``, ``next_groups``,
``requeue`` and ``priority``. Prints the total and the time per finished group (goal < 1 ms).

    .venv/bin/python bench/online_layer.py [--instances 256] [--groups 20000]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from scheduling import C, setup

from runtime.controller.dispatch import Dispatcher
from runtime.scheduler import CostModel, InstanceSpec, make_scheduler
from runtime.scheduler.online import OnlinePlanned
from runtime.sim.engine import simulate

SPENT: dict[str, float] = defaultdict(float)


def _timed(owner: type, name: str) -> None:
    """Time every call of ``owner.name``, the whole call (the plain plan's share included:
    an upper bound on what the layer adds)."""
    fn: Callable[..., Any] = getattr(owner, name)

    def wrapper(*args: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*args, **kw)
        SPENT[name] += time.perf_counter() - t0
        return out

    setattr(owner, name, wrapper)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--instances", type=int, default=256)
    ap.add_argument("--groups", type=int, default=20_000)
    ap.add_argument("--lag-bound", type=int, default=1)
    args = ap.parse_args(argv)
    groups, actual, ptok, n = setup("seqsched", 0.0, 0)
    groups = groups[: args.groups]
    actual = {g.prompt_id: actual[g.prompt_id] for g in groups}
    k = args.instances
    inst = [InstanceSpec(i, C) for i in range(k)]
    b = max(1, min(math.ceil(k * C / n), len(groups) // 16))
    cost = CostModel.sized_for(k, max_num_seqs=C)
    sched = make_scheduler("asp", groups, inst, batch_groups=b, lag_bound=args.lag_bound)
    assert isinstance(sched, OnlinePlanned)
    _timed(Dispatcher, "repair")
    for name in ("on_group_finished", "next_groups", "requeue", "priority"):
        _timed(OnlinePlanned, name)
    t0 = time.perf_counter()
    r = simulate(
        sched,
        groups,
        actual,
        inst,
        batch_groups=b,
        lag_bound=args.lag_bound,
        cost_model=cost,
        prompt_tokens=ptok,
    )
    wall = time.perf_counter() - t0
    total = sum(SPENT.values())
    finished = r.groups + r.extra["deferred"]
    print(
        f"asp online layer, {k} sim instances, {len(groups)} groups (n={n}), B={b}, "
        f"η={args.lag_bound}: {r.steps} steps, {r.extra['deferred']} deferred; "
        f"simulation wall {wall:.1f} s"
    )
    for name, s in sorted(SPENT.items()):
        print(f"  {name:18s} {s * 1e3:9.1f} ms")
    per = total / max(1, finished) * 1e3
    print(
        f"online layer (upper bound: whole calls charged): {total * 1e3:.1f} ms, "
        f"{per:.3f} ms per finished group (goal < 1 ms: {'met' if per < 1 else 'missed'})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
