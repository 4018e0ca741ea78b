"""Each of asp's candidate plans forced, against the better of fifo and sorted (issue 11).

asp builds several candidate plans (``runtime.scheduler.asp.VARIANTS``) and scores them on a
noisy subsample to pick one. This bench skips the pick: every candidate is planned and served
at full scale with the online layer, in the simulator, on the same input as fifo and sorted
(``bench/scheduling.py``'s set-up: split ``--split``, one sample as the prior, the others what
comes). ``--oracle`` plans on the exact lengths instead: the most any predictor could give these
candidates. ``--probe`` plans on the prior plus one actual member of every group, known for
free: what Seer's probe would learn, without its costs (the probe's latency, the lag budget it
spends, a member started apart from its siblings), so an upper bound on what the probe gives.
The best cell of a row is the ceiling of asp's pick.

    .venv/bin/python bench/candidates.py [--trace seqsched] [--k 16 64] [--lag-bound 1 2]
        [--split 0] [--oracle | --probe]

seqsched's four cells take about 2.5 minutes (4 with ``--oracle`` or ``--probe``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rich import box
from rich.console import Console
from rich.table import Table
from scheduling import BASELINES, MAX_TOKENS, TRACES, baseline_times, cluster, setup

from runtime.scheduler.asp import VARIANTS, build_variant
from runtime.scheduler.base import GroupSpec, Predictions
from runtime.scheduler.online import OnlinePlanned
from runtime.sim.engine import simulate

PRIORS = {
    "sample": "one sample",
    "probe": "one sample + one free probe",
    "oracle": "exact lengths",
}
"""What the candidates may be planned on, and how the table's title names it."""


def run_cell(trace: str, k: int, lag_bound: int, split: int, prior: str) -> dict[str, float]:
    """Iteration s of fifo and sorted (on the one-sample prior) and of every candidate planned
    on ``prior`` (one of ``PRIORS``), all on the same actual lengths."""
    honest, actual, ptok, n = setup(trace, 0.0, split)
    if prior == "oracle":
        planned = setup(trace, None, split)[0]
    elif prior == "probe":
        planned = [
            GroupSpec(g.prompt_id, g.n, (*(g.predicted_lengths or ()), actual[g.prompt_id][0]))
            for g in honest
        ]
    else:
        planned = honest
    instances, sim = cluster(k, n, lag_bound)
    cap = MAX_TOKENS[trace]
    out = baseline_times(honest, actual, ptok, instances, sim, cap)
    pred = Predictions.of(planned, limit=cap)
    for v in VARIANTS:
        plan = build_variant(v, planned, instances, **sim, predictions=pred)
        s = OnlinePlanned(v, planned, instances, plan, **sim, predictions=pred)
        out[v] = simulate(s, planned, actual, instances, **sim, prompt_tokens=ptok).iteration_s
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--trace", choices=tuple(TRACES), nargs="+", default=["seqsched"])
    ap.add_argument("--k", type=int, nargs="+", default=[16, 64], help="instances")
    ap.add_argument("--lag-bound", type=int, nargs="+", default=[1, 2], help="η")
    ap.add_argument("--split", type=int, default=0, help="which sample is the prior (0-2)")
    known = ap.add_mutually_exclusive_group()
    known.add_argument("--oracle", action="store_true", help="plan the candidates on exact lengths")
    known.add_argument(
        "--probe",
        action="store_true",
        help="plan on the prior plus one actual member per group, for free (the probe's ceiling)",
    )
    args = ap.parse_args(argv)
    if min(args.lag_bound) < 0:
        ap.error(f"--lag-bound: {min(args.lag_bound)} is negative; η must be >= 0")
    if min(args.k) < 1:
        ap.error(f"--k: {min(args.k)} instances; K must be >= 1")
    if not 0 <= args.split <= 2:
        ap.error(f"--split: {args.split} is not 0, 1 or 2 (the sample that is the prior)")
    con = Console(width=140)
    prior = "oracle" if args.oracle else "probe" if args.probe else "sample"
    t = Table(
        title=f"asp's candidates forced, planned on {PRIORS[prior]} (split {args.split}): "
        "iteration s / best(fifo, sorted)",
        box=box.SIMPLE,
    )
    for col in ("trace", "K", "η", "fifo s", "sorted s", *VARIANTS, "best"):
        t.add_column(col, justify="right")
    t0 = time.perf_counter()
    for trace in args.trace:
        for k in args.k:
            for eta in args.lag_bound:
                con.print(f"[dim]{trace} K={k} η={eta} ...[/]")
                r = run_cell(trace, k, eta, args.split, prior)
                base = min(r[p] for p in BASELINES)
                ratios = {v: r[v] / base for v in VARIANTS}
                best = min(ratios, key=ratios.__getitem__)
                t.add_row(
                    trace,
                    str(k),
                    str(eta),
                    f"{r['fifo']:.2f}",
                    f"{r['sorted']:.2f}",
                    *(f"{ratios[v]:.3f}" for v in VARIANTS),
                    f"{best} {ratios[best]:.3f}",
                )
    con.print(t)
    con.print(f"simulated in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
