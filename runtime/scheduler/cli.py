"""``asp-tui plan`` and ``asp-tui simulate``: offline scheduling from the command line.

    asp-tui plan --lengths FILE --instances K --policy P [--group-size n] [--batch-groups B]
                 [--max-num-seqs C] [--lag-bound η] [--out plan.csv] [--json] [--seed S]
    asp-tui simulate --lengths FILE [--actual FILE] --instances K --policy all [--lag-bound η]
                 [--json] ...

Without ``--actual``, a grouped lengths file is split: each group's first sample is the
prediction and the others are what actually comes (as ``bench/scheduling.py`` does); a file with
one sample per group is its own actual. Bad files exit 2 with the reason.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np

from runtime.protocol import BUBBLE_CATEGORIES
from runtime.scheduler.base import GroupSpec, InstanceSpec, Scheduler
from runtime.scheduler.cost_model import CostModel
from runtime.scheduler.lengths import LengthsFileError, LengthTable, predictor_quality, read_lengths
from runtime.scheduler.policies import POLICIES, make_scheduler

EXIT_USAGE = 2
MIN_STEPS = 16
"""The default ``--batch-groups`` leaves at least this many trainer steps (when there are at
least as many groups): fewer steps are mostly pipeline fill and drain, and a mean iteration
time over them says little about steady state."""


def default_batch_groups(instances: int, max_num_seqs: int, group_size: int, groups: int) -> int:
    """Groups per step when ``--batch-groups`` is not given: enough to fill every slot once
    (ceil(K C / n)), capped at groups // MIN_STEPS, and at least 1."""
    fill = math.ceil(instances * max_num_seqs / group_size)
    return max(1, min(fill, groups // MIN_STEPS))


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``, with a message that says so."""

    def parse(value: str) -> int:
        try:
            v = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be >= {minimum}")
        return v

    return parse


_positive = _int_at_least(1)
_nonneg = _int_at_least(0)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--lengths",
        required=True,
        metavar="FILE",
        help="predicted lengths: CSV prompt_id,output_tokens, or a wide grouped file "
        "(o1..oK / out_* columns)",
    )
    p.add_argument(
        "--instances",
        required=True,
        type=_positive,
        metavar="K",
        help="number of rollout instances",
    )
    p.add_argument(
        "--group-size",
        type=_positive,
        metavar="n",
        help="samples per group (default: as in the file)",
    )
    p.add_argument(
        "--batch-groups",
        type=_positive,
        metavar="B",
        help="groups per trainer step (default: enough to fill every slot once, but at most "
        f"groups/{MIN_STEPS} so that the run has at least {MIN_STEPS} trainer steps)",
    )
    p.add_argument(
        "--max-num-seqs",
        type=_positive,
        metavar="C",
        default=CostModel().max_num_seqs,
        help="concurrency per instance (default %(default)s)",
    )
    p.add_argument(
        "--lag-bound",
        type=_nonneg,
        default=1,
        metavar="η",
        help="lag bound (default %(default)s; 0 = synchronous)",
    )
    p.add_argument(
        "--dispatch",
        choices=("continuous", "minibatch"),
        default="continuous",
        help="how instances take work (default %(default)s)",
    )
    p.add_argument(
        "--trainer-tokens-per-s",
        type=float,
        metavar="R",
        help="trainer throughput in tokens/s (default: CostModel.sized_for(K))",
    )
    p.add_argument(
        "--max-tokens",
        type=_positive,
        metavar="T",
        help="the sampling cap (rollout.sampling.max_tokens): no prediction goes past it "
        "(default: none)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--seed", type=int, default=0, help="planning seed (default %(default)s)")


def add_plan_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan",
        help="plan one epoch and print the predicted load",
        description="Plan one epoch over predicted lengths.",
    )
    _common(p)
    p.add_argument("--policy", choices=POLICIES, default="asp", help="(default %(default)s)")
    p.add_argument("--out", metavar="plan.csv", help="write instance,position,prompt_id rows")
    p.set_defaults(func=run_plan)
    return p


def add_simulate_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "simulate",
        help="simulate policies on a cluster, side by side",
        description="Simulate policies against actual lengths.",
    )
    _common(p)
    p.add_argument("--actual", metavar="FILE", help="actual lengths (default: split --lengths)")
    p.add_argument(
        "--policy", choices=(*POLICIES, "all"), default="all", help="(default %(default)s)"
    )
    p.set_defaults(func=run_simulate)
    return p


# --- shared setup ---------------------------------------------------------------------------


class _Setup:
    def __init__(self, args: argparse.Namespace, split: bool) -> None:
        table = read_lengths(args.lengths)
        self.source = table
        actual: LengthTable | None = None
        if getattr(args, "actual", None):
            actual = read_lengths(args.actual)
            known = set(table.ids)
            missing = [k for k, x in enumerate(actual.ids) if x not in known]
            if missing:
                k = missing[0]
                raise LengthsFileError(
                    f"{args.actual}:{actual.lines[k]}: prompt_id {actual.ids[k]!r} has no "
                    f"prediction in {args.lengths} ({len(missing)} of {len(actual)} ids have "
                    "none; ids are matched as text)"
                )
            # The prediction, in the actual file's order: dense id k is actual.ids[k] in both.
            pred = table.subset(actual.ids)
            if actual.prompt_tokens:
                pred.prompt_tokens = actual.prompt_tokens
        elif split and min(len(x) for x in table.lengths) > 1:
            pred, actual = table.split(1)
        else:
            pred = table
            actual = table if split else None
        self.pred, self.actual = pred, actual
        sizes = [len(x) for x in (actual or pred).lengths]
        self.n = args.group_size or max(sizes)
        if actual is not None:
            # Every group gets n actual samples: cycle the ones the file has.
            self.actual_map = {
                p: tuple(ls[k % len(ls)] for k in range(self.n))
                for p, ls in zip(actual.prompt_ids, actual.lengths, strict=True)
            }
        self.groups = [
            GroupSpec(p, self.n, tuple(ls))
            for p, ls in zip(pred.prompt_ids, pred.lengths, strict=True)
        ]
        self.prompt_tokens = (
            dict(zip(pred.prompt_ids, pred.prompt_tokens, strict=True))
            if pred.prompt_tokens
            else None
        )
        c = args.max_num_seqs
        if c < self.n:
            raise LengthsFileError(f"--max-num-seqs {c} is smaller than the group size {self.n}")
        self.instances = [InstanceSpec(i, c) for i in range(args.instances)]
        self.batch_groups = args.batch_groups or default_batch_groups(
            args.instances, c, self.n, len(self.groups)
        )
        self.cost = CostModel.sized_for(args.instances, max_num_seqs=c)
        if args.trainer_tokens_per_s:
            self.cost = replace(self.cost, trainer_tokens_per_s=args.trainer_tokens_per_s)


def _fail(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return EXIT_USAGE


# --- plan -----------------------------------------------------------------------------------


def run_plan(args: argparse.Namespace) -> int:
    from runtime.sim.engine import simulate

    try:
        st = _Setup(args, split=False)
    except (LengthsFileError, ValueError) as e:
        return _fail(str(e))

    def build() -> Scheduler:  # schedulers are stateful: one to list, one to simulate
        return make_scheduler(
            args.policy,
            st.groups,
            st.instances,
            batch_groups=st.batch_groups,
            lag_bound=args.lag_bound,
            cost_model=st.cost,
            seed=args.seed,
            dispatch=args.dispatch,
            max_tokens=args.max_tokens,
        )

    sched = build()
    rows = _plan_rows(sched)
    # Predicted outcome: the plan run against the predicted lengths themselves.
    pred_actual = {
        g.prompt_id: tuple(
            (g.predicted_lengths or (0,))[k % len(g.predicted_lengths or (0,))] for k in range(st.n)
        )
        for g in st.groups
    }
    sim_sched = build()
    res = simulate(
        sim_sched,
        st.groups,
        pred_actual,
        st.instances,
        batch_groups=st.batch_groups,
        lag_bound=args.lag_bound,
        cost_model=st.cost,
        prompt_tokens=st.prompt_tokens,
        dispatch=args.dispatch,
    )
    per_inst = _per_instance_load(rows, st)
    if args.out:
        with Path(args.out).open("w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["instance", "position", "prompt_id"])
            w.writerows((i, pos, st.pred.ids[p]) for i, pos, p in rows)
    out = {
        "policy": args.policy,
        "variant": getattr(getattr(sched, "plan_info", None), "variant", None),
        "groups": len(st.groups),
        "instances": args.instances,
        "batch_groups": st.batch_groups,
        "lag_bound": args.lag_bound,
        "per_instance": per_inst,
        "predicted_breakdown": res.breakdown.fractions,
        "predicted_iteration_s": res.iteration_s,
        "lower_bound_s": res.lower_bound_s,
        "ratio_to_bound": res.ratio_to_bound,
        "latency_lower_bound_s": res.latency_lower_bound_s,
        "ratio_to_latency_bound": res.ratio_to_latency_bound,
        "out": args.out,
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    con = Console()
    t = Table(
        title=f"plan: {args.policy} ({out['variant'] or 'fixed'}), {len(st.groups)} groups"
        f" of {st.n} on {args.instances} instances, B={st.batch_groups}, "
        f"η={args.lag_bound}"
    )
    for col in ("instance", "groups", "pred. tokens", "pred. busy s", "share"):
        t.add_column(col, justify="right")
    tot = sum(r["tokens"] for r in per_inst) or 1
    for r in per_inst:
        t.add_row(
            str(r["instance"]),
            str(r["groups"]),
            f"{r['tokens']:,}",
            f"{r['busy_s']:.1f}",
            f"{r['tokens'] / tot:.1%}",
        )
    con.print(t)
    b = Table(title="predicted bubble breakdown (plan against its own predictions)")
    for c in BUBBLE_CATEGORIES:
        b.add_column(c, justify="right")
    b.add_row(*(f"{res.breakdown.fractions[c]:.1%}" for c in BUBBLE_CATEGORIES))
    con.print(b)
    con.print(
        f"predicted iteration time {res.iteration_s:.2f} s; lower bounds: throughput "
        f"{res.lower_bound_s:.2f} s (ratio {res.ratio_to_bound:.3f}), latency "
        f"{res.latency_lower_bound_s:.2f} s (ratio {res.ratio_to_latency_bound:.3f})"
    )
    if args.out:
        con.print(f"wrote {len(rows)} rows to {args.out}")
    return 0


def _plan_rows(sched) -> list[tuple[int, int, int]]:
    """(instance, position, dense prompt id) of every planned group."""
    rows = []
    for i in sorted(sched.queues):
        pos = 0
        for mb in sched.queues[i]:
            for g in mb:
                rows.append((i, pos, sched.groups[g].prompt_id))
                pos += 1
    return rows


def _per_instance_load(rows, st: _Setup) -> list[dict]:
    pred = {g.prompt_id: g for g in st.groups}
    c = st.instances[0].max_num_seqs
    step = st.cost.decode_step_s(c, c * 300)
    out: dict[int, dict] = {
        s.instance_id: {"instance": s.instance_id, "groups": 0, "tokens": 0, "busy_s": 0.0}
        for s in st.instances
    }
    for i, _, p in rows:
        g = pred[p]
        tok = round(st.n * float(np.mean(g.predicted_lengths))) if g.predicted_lengths else 0
        out[i]["groups"] += 1
        out[i]["tokens"] += tok
        out[i]["busy_s"] += tok * step / c
    return list(out.values())


# --- simulate -------------------------------------------------------------------------------


def run_simulate(args: argparse.Namespace) -> int:
    from runtime.sim.compare import compare

    try:
        st = _Setup(args, split=True)
    except (LengthsFileError, ValueError) as e:
        return _fail(str(e))
    policies = list(POLICIES) if args.policy == "all" else [args.policy]
    res = compare(
        policies,
        st.groups,
        st.actual_map,
        st.instances,
        batch_groups=st.batch_groups,
        lag_bound=args.lag_bound,
        cost_model=st.cost,
        prompt_tokens=st.prompt_tokens,
        dispatch=args.dispatch,
        seed=args.seed,
        max_tokens=args.max_tokens,
    )
    pm = [float(np.mean(g.predicted_lengths)) if g.predicted_lengths else 0.0 for g in st.groups]
    am = [float(np.mean(st.actual_map[g.prompt_id])) for g in st.groups]
    rho, mape = predictor_quality(pm, am)
    out = {
        "lengths": args.lengths,
        "actual": args.actual or "split: first sample predicts the rest",
        "groups": len(st.groups),
        "group_size": st.n,
        "instances": args.instances,
        "max_num_seqs": args.max_num_seqs,
        "batch_groups": st.batch_groups,
        "lag_bound": args.lag_bound,
        "dispatch": args.dispatch,
        "predictor": {"spearman_rho": rho, "mape": mape},
        "policies": {p: r.summary() for p, r in res.items()},
    }
    if args.json:
        print(json.dumps(out, indent=2, default=float))
        return 0
    from rich.console import Console

    con = Console()
    con.print(
        simulate_table(
            res,
            title=(
                f"{Path(args.lengths).name}: {len(st.groups)} groups of {st.n}, "
                f"K={args.instances}, "
                f"C={args.max_num_seqs}, B={st.batch_groups}, η={args.lag_bound}, {args.dispatch}"
            ),
        )
    )
    con.print(
        f"predictor: Spearman rho {rho:.3f}, MAPE {mape:.1%} (per-group mean length); "
        "sorting is counted in excess of fifo's"
    )
    return 0


_SHORT = {
    "useful": "use",
    "padding": "pad",
    "skewness": "skew",
    "sorting": "sort",
    "sync": "sync",
    "paused": "paus",
    "down": "down",
    "idle": "idle",
}


def simulate_table(res, title: str = ""):
    """A rich table of ``compare`` results, one row per policy (fits 80 columns)."""
    from rich import box
    from rich.table import Table

    cats = [
        c
        for c in BUBBLE_CATEGORIES
        if c not in ("paused", "down") or any(r.breakdown.fractions[c] > 0 for r in res.values())
    ]
    t = Table(
        title=title,
        caption="bubbles and trainer time in %; iter = makespan / steps (s); xLB, xLLB = iter "
        "over the throughput and the latency (critical-path) lower bound",
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
    )
    t.add_column("policy", justify="right", no_wrap=True, min_width=6)
    for col in ("iter", "xLB", "xLLB"):
        t.add_column(col, justify="right")
    for c in cats:
        t.add_column(_SHORT[c], justify="right")
    t.add_column("starv", justify="right")
    t.add_column("lagw", justify="right")
    best = min(r.iteration_s for r in res.values())
    for p, r in res.items():
        name = f"[b]{p}[/b]" if r.iteration_s == best else p
        fr = r.breakdown.fractions
        t.add_row(
            name,
            f"{r.iteration_s:.1f}",
            f"{r.ratio_to_bound:.2f}",
            f"{r.ratio_to_latency_bound:.2f}",
            *(f"{100 * fr[c]:.1f}" for c in cats),
            f"{100 * r.breakdown.trainer['starved']:.0f}",
            f"{100 * r.breakdown.trainer['lag_wait']:.0f}",
        )
    return t


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (``python -m runtime.scheduler.cli plan|simulate ...``)."""
    parser = argparse.ArgumentParser(prog="asp-tui")
    sub = parser.add_subparsers(dest="command", required=True)
    add_plan_parser(sub)
    add_simulate_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
