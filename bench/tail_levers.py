"""Dynamic forms of the tail lane, against asp as built (issue 11).

A long group runs on a busy instance, and would decode about twice as fast alone (the cost
model's per-token time at 1 sequence against 128). The reserved tail lane
(``scheduler.tail_instances``) buys that speed with capacity the bulk then lacks. These
prototypes try to buy it without a reservation, acting on the groups the online layer projects
to miss their deadline (``OnlinePlanned.late``):

- ``drain``: the late group's instance gets no new work until the group finishes, so its batch
  shrinks around it (at most ``--share`` of the instances at once);
- ``hop``: the late group moves, with its partial output, to the least-loaded instance when that
  holds under ``--ratio`` of the sequences of its own and the saving beats the re-prefill;
- ``hop+hold``: a hop whose destination then gets no new work until the group finishes.

``lane`` is the reserved lane as built, one instance of 16 sequences, for comparison.

Each is served on asp's best candidate for the cell (split 0, one sample as the prior, as
``bench/candidates.py`` finds it) and printed as iteration s / best(fifo, sorted).

    .venv/bin/python bench/tail_levers.py [--k 16 64] [--lag-bound 1 2] [--share 0.125]
        [--ratio 0.5]

The four seqsched cells take about 4 minutes.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rich import box
from rich.console import Console
from rich.table import Table
from scheduling import MAX_TOKENS, baseline_times, cluster, setup

from runtime.scheduler.asp import build_variant
from runtime.scheduler.base import Defer, Move, Plan, Predictions, RolloutView
from runtime.scheduler.online import TAIL_PRIORITY, OnlinePlanned
from runtime.sim.engine import simulate

TRACE = "seqsched"
BEST_CANDIDATE = {(16, 1): "ascending", (16, 2): "ascending", (64, 1): "homogeneous"}
"""asp's best candidate per (K, η) on split 0 with the one-sample prior (``bench/candidates.py``);
homogeneous elsewhere."""

TAIL_MAX_SEQS = 16
"""Sequences on the reserved lane's one instance (``lane``; ``scheduler.tail_max_seqs``)."""

CONTEXT_TOKENS = 300.0
"""Context per sequence the hop's cost comparison assumes: about what a late group holds midway
(the trace gives no prompt lengths, and its late groups run to 300-514 tokens)."""


class Held(OnlinePlanned):
    """The online layer, with instances that get no new work while a group it chose runs there."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.held: dict[int, int] = {}
        """Prompt id -> the instance held for it."""
        self.acted = 0

    def hold(self, prompt_id: int, instance_id: int) -> None:
        self.held[prompt_id] = instance_id

    def on_group_finished(self, prompt_id: int, instance_id: int, lengths: Sequence[int]) -> None:
        self.held.pop(prompt_id, None)
        super().on_group_finished(prompt_id, instance_id, lengths)

    def requeue(self, prompt_ids: Sequence[int]) -> None:
        for p in prompt_ids:
            self.held.pop(p, None)
        super().requeue(prompt_ids)

    def next_groups(self, instance_id: int, max_groups: int) -> list[int]:
        if instance_id in self.held.values():
            return []
        return super().next_groups(instance_id, max_groups)


class Draining(Held):
    """``drain``: hold the instance a late group runs on."""

    share = 0.125

    def repair(self, view: RolloutView) -> Sequence[Defer | Move]:
        out = list(super().repair(view))
        gone = {a.group_id for a in out}
        most = max(1, int(self.share * len(self.specs)))
        for x in self.late(view):
            r = x.running
            if r.group_id in gone or r.prompt_id in self.held:
                continue
            if len(set(self.held.values()) | {r.instance_id}) > most:
                break
            self.hold(r.prompt_id, r.instance_id)
            self.acted += 1
        return out


class Hopping(Held):
    """``hop`` (and ``hop+hold`` with ``hold_destination``): move a late group to the
    least-loaded instance."""

    ratio = 0.5
    hold_destination = False

    def repair(self, view: RolloutView) -> Sequence[Defer | Move]:
        out = list(super().repair(view))
        gone = {a.group_id for a in out}
        load = Counter(dict.fromkeys(self.active, 0))
        for r in view.running:
            g = self.index.get(r.prompt_id)
            load[r.instance_id] += self.groups[g].n if g is not None else 1
        cost = self.cost_model
        for x in self.late(view):
            r = x.running
            if r.group_id in gone:
                continue
            to = min(load, key=load.__getitem__)
            here, there = load[r.instance_id], load[to] + x.n
            if there > self.ratio * here:
                break
            saving = x.left * (
                cost.decode_step_s(here, here * CONTEXT_TOKENS)
                - cost.decode_step_s(there, there * CONTEXT_TOKENS)
            )
            if saving <= cost.prefill_s(x.n * x.generated):
                continue
            self.moved.add(r.prompt_id)
            load[to], load[r.instance_id] = there, here - x.n
            if self.hold_destination:
                self.hold(r.prompt_id, to)
            self.acted += 1
            out.append(Move(r.group_id, to, TAIL_PRIORITY))
        return out


@dataclass(frozen=True)
class Lever:
    """How one lever is served."""

    layer: type[OnlinePlanned] = OnlinePlanned
    settings: dict[str, object] = field(default_factory=dict)
    """Class attributes of the layer."""
    tail_instances: int = 0
    """Instances reserved as the tail lane (the plan leaves them out)."""


def levers(share: float, ratio: float) -> dict[str, Lever]:
    """Each lever by name, with the bench's settings."""
    return {
        "as built": Lever(),
        "lane": Lever(tail_instances=1),
        "drain": Lever(Draining, {"share": share}),
        "hop": Lever(Hopping, {"ratio": ratio}),
        "hop+hold": Lever(Hopping, {"ratio": ratio, "hold_destination": True}),
    }


def run_cell(k: int, lag_bound: int, share: float, ratio: float) -> dict[str, tuple[float, int]]:
    """Iteration s (and how often the lever acted) of fifo, sorted and each lever."""
    groups, actual, ptok, n = setup(TRACE, 0.0, 0)
    instances, sim = cluster(k, n, lag_bound)
    cap = MAX_TOKENS[TRACE]
    out = {p: (s, 0) for p, s in baseline_times(groups, actual, ptok, instances, sim, cap).items()}
    pred = Predictions.of(groups, limit=cap)
    variant = BEST_CANDIDATE.get((k, lag_bound), "homogeneous")
    plans: dict[int, Plan] = {}
    for name, lever in levers(share, ratio).items():
        bulk = instances[: k - lever.tail_instances]
        if len(bulk) not in plans:
            plans[len(bulk)] = build_variant(variant, groups, bulk, **sim, predictions=pred)
        s = lever.layer(
            variant,
            groups,
            instances,
            plans[len(bulk)],
            **sim,
            predictions=pred,
            tail_instances=[i.instance_id for i in instances[len(bulk) :]],
            tail_max_seqs=TAIL_MAX_SEQS,
        )
        for key, value in lever.settings.items():
            setattr(s, key, value)
        it = simulate(s, groups, actual, instances, **sim, prompt_tokens=ptok).iteration_s
        out[name] = (it, getattr(s, "acted", len(s.moved)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--k", type=int, nargs="+", default=[16, 64], help="instances")
    ap.add_argument("--lag-bound", type=int, nargs="+", default=[1, 2], help="η")
    ap.add_argument("--share", type=float, default=0.125, help="drain: most instances held")
    ap.add_argument("--ratio", type=float, default=0.5, help="hop: destination load / source's")
    args = ap.parse_args(argv)
    if min(args.lag_bound) < 0:
        ap.error(f"--lag-bound: {min(args.lag_bound)} is negative; η must be >= 0")
    if min(args.k) < 1:
        ap.error(f"--k: {min(args.k)} instances; K must be >= 1")
    if not 0 < args.share <= 1:
        ap.error(f"--share: {args.share} is not in (0, 1] (a share of the instances)")
    if not 0 < args.ratio <= 1:
        ap.error(f"--ratio: {args.ratio} is not in (0, 1] (destination load / source's)")
    con = Console(width=140)
    t = Table(
        title=f"Dynamic tail levers on {TRACE} (split 0, one sample as the prior; share "
        f"{args.share:g}, ratio {args.ratio:g}): iteration s / best(fifo, sorted), times acted",
        box=box.SIMPLE,
    )
    names = tuple(levers(args.share, args.ratio))
    for col in ("K", "η", "candidate", "fifo s", "sorted s", *names):
        t.add_column(col, justify="right")
    t0 = time.perf_counter()
    for k in args.k:
        for eta in args.lag_bound:
            con.print(f"[dim]{TRACE} K={k} η={eta} ...[/]")
            r = run_cell(k, eta, args.share, args.ratio)
            base = min(r["fifo"][0], r["sorted"][0])
            t.add_row(
                str(k),
                str(eta),
                BEST_CANDIDATE.get((k, eta), "homogeneous"),
                f"{r['fifo'][0]:.2f}",
                f"{r['sorted'][0]:.2f}",
                *(
                    f"{r[name][0] / base:.3f}" + (f" ({r[name][1]})" if name != "as built" else "")
                    for name in names
                ),
            )
    con.print(t)
    con.print(f"simulated in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
