"""``asp``: the Adaptive Scheduling Pipeline's offline pass.

It attacks the three bubbles together, on *predicted* lengths and the cost model:

- padding: groups of similar predicted length share a trainer batch and a minibatch;
- skewness: long-tail groups are spread over the instances by LPT on predicted work (see
  ``partition.lpt``) and started early, inside their lag window and in the epoch;
- sorting: the dispatch order keeps every window of B dispatched groups close to the mean work,
  so that the training queue fills at a steady rate.

Which trade-off is best depends on η and the cost model (DESIGN.md section 5), so ``plan_asp``
builds a few candidate plans and scores each with the discrete-event simulator on the predicted
lengths with multiplicative log-normal noise (the predictor's error is never zero):

- ``homogeneous``: batches of B groups in ascending predicted length, each spread by LPT
  (the η = 0 winner: every batch waits only for members like itself);
- ``ascending``: shortest first dealt round robin (the ``sorted`` order; kept as a candidate so
  that asp never plans worse than it in its own scoring);
- ``longest_first``: global LPT, longest first (every long group starts as early as possible);
- ``mix``: every window of B groups gets the same spread of predicted lengths (snake deal),
  LPT-balanced across instances, so that a long group shares its instance with short ones and
  runs nearly alone once they finish (a straggler's co-runners set its speed);
- ``head_mix``: the groups predicted to outlive their lag window go first, spread by LPT; the
  rest are dealt into windows of B in snake order by length (every window gets the same mix of
  long and short), each window longest first and LPT-balanced across instances.

Scoring runs on a subsample when the epoch is large, so a 1M-group plan takes seconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from runtime.scheduler.base import GroupSpec, InstanceSpec, Plan, Predictions
from runtime.scheduler.cost_model import CostModel, iteration_estimate
from runtime.scheduler.fifo import minibatch_size
from runtime.scheduler.partition import lpt, snake

VARIANTS = ("homogeneous", "ascending", "longest_first", "head_mix", "mix")
MIN_TAIL_P = 0.002
"""Least chance per sample of a run to the cap that candidate plans are scored with."""
SCORE_MAX_GROUPS = 3000
"""Candidate plans are scored on at most this many groups (a stratified subsample)."""
SCORE_MAX_INSTANCES = 16
"""... on a cluster of at most this many instances (the rest scaled down with it)."""


@dataclass
class AspInfo:
    variant: str
    scores: dict[str, float] = field(default_factory=dict)
    predicted_breakdown: dict[str, float] | None = None
    predicted_iteration_s: float | None = None


def _assemble(
    windows: Sequence[np.ndarray], tok: np.ndarray, instances: Sequence[InstanceSpec], n: int
) -> Plan:
    """Spread each window's groups over the instances by LPT on predicted work (longest
    first inside the window), and concatenate the windows per instance."""
    ids = [s.instance_id for s in instances]
    speeds = [float(s.max_num_seqs) for s in instances]
    queues: dict[int, list[int]] = {i: [] for i in ids}
    cuts: dict[int, list[int]] = {i: [] for i in ids}
    loads = [0.0] * len(ids)
    total_speed = sum(speeds)
    for win in windows:
        if len(win) == 0:
            continue
        # Carry the loads over, so an instance that got more of window w gets less of w + 1.
        # Each instance takes at most its slot share of the window's groups: a window fills the
        # cluster, and an instance given more groups than slots would start a second wave.
        caps = [math.ceil(len(win) * sp / total_speed) for sp in speeds]
        parts = lpt(tok[win], speeds, loads, caps=caps)
        for j, part in enumerate(parts):
            if not part:
                continue
            i = ids[j]
            q = queues[i]
            mb = minibatch_size(instances[j], n)
            # Minibatch boundaries at window starts and every C_i // n groups inside a window.
            cuts[i].extend(range(len(q), len(q) + len(part), mb))
            q.extend(win[part].tolist())
            loads[j] += float(tok[win[part]].sum()) / speeds[j]
    return Plan(queues, {i: (c or [0]) for i, c in cuts.items()})


def _windows(order: np.ndarray, b: int) -> list[np.ndarray]:
    return [order[k : k + b] for k in range(0, len(order), b)]


def build_variant(
    variant: str,
    groups: Sequence[GroupSpec],
    instances: Sequence[InstanceSpec],
    *,
    batch_groups: int,
    lag_bound: int,
    cost_model: CostModel,
    predictions: Predictions | None = None,
) -> Plan:
    """One candidate plan (see the module docstring)."""
    n = groups[0].n if groups else 1
    pred = predictions or Predictions.of(groups)
    tok, mx = pred.tokens, pred.longest
    b = batch_groups
    if variant == "homogeneous":
        order = np.argsort(mx, kind="stable")
        return _assemble(_windows(order, b), tok, instances, n)
    if variant == "ascending":
        from runtime.scheduler.length_sorted import plan_sorted

        return plan_sorted(groups, instances, pred)
    if variant == "longest_first":
        order = np.argsort(-mx, kind="stable")
        return _assemble([order], tok, instances, n)
    if variant == "mix":
        # Every window of B gets the same spread of lengths (snake deal), LPT inside.
        desc = np.argsort(-mx, kind="stable")
        nwin = max(1, -(-len(desc) // b))
        win_of = snake(len(desc), nwin)
        return _assemble([desc[win_of == w] for w in range(nwin)], tok, instances, n)
    if variant == "head_mix":
        dur = _durations(mx, groups, instances, cost_model)
        it = iteration_estimate(
            tok, [x.max_num_seqs for x in instances], batch_groups, lag_bound, cost_model
        )
        budget = max(1, lag_bound) * it
        desc = np.argsort(-mx, kind="stable")
        head_n = int(np.sum(dur > budget))
        head, body = desc[:head_n], desc[head_n:]
        # Snake the body over windows: window w gets ranks w, 2W-1-w, 2W+w, ... of the sorted
        # lengths, so every window has the same spread; inside a window, longest first.
        nwin = max(1, -(-len(body) // b))
        win_of = snake(len(body), nwin)
        wins = [body[win_of == w] for w in range(nwin)]
        return _assemble([head, *wins], tok, instances, n)
    raise ValueError(f"variant: {variant!r} is not one of {', '.join(VARIANTS)}")


def _durations(
    mx: np.ndarray, groups: Sequence[GroupSpec], instances: Sequence[InstanceSpec], cost: CostModel
) -> np.ndarray:
    """Predicted wall time of each group's longest member in a full instance."""
    c = float(np.mean([s.max_num_seqs for s in instances]))
    mean_ctx = float(np.mean(mx)) if len(mx) else 0.0
    per_step = cost.decode_step_s(int(c), c * mean_ctx)
    return mx * per_step


def cap_share(groups: Sequence[GroupSpec], limit: float = math.inf) -> float:
    """The share of predicted samples within 2% of the longest prediction (the length cap, in
    practice; predictions are capped at ``limit``, max_tokens), at least ``MIN_TAIL_P``."""
    preds = [x for g in groups if g.predicted_lengths for x in g.predicted_lengths]
    if not preds:
        return MIN_TAIL_P
    values = np.minimum(np.asarray(preds, dtype=float), limit)
    return max(MIN_TAIL_P, float(np.mean(values >= 0.98 * values.max())))


def _noisy_actual(
    groups: Sequence[GroupSpec],
    rng: np.random.Generator,
    sigma: float,
    pred: Predictions,
    tail_p: float,
) -> dict[int, tuple[int, ...]]:
    """Plausible actual lengths of the groups, given their predictions (``pred``).

    A prediction from m samples is an estimate of its prompt's (log) mean length that is off by
    ``sigma`` / sqrt(m), ``sigma`` being a sample's spread around its prompt's mean. Read the
    empirical-Bayes way, the prompt's mean is the prediction shrunk towards the epoch's mean by
    between / (between + sigma^2 / m), ``between`` being the spread of the prompts' means (the
    predictions' spread less that of their error), and drawn with what spread is left. A prompt
    predicted long from one fluke long sample thus has shorter siblings behind it, as in the
    data; a prediction from many samples stays where it is. Each sample then adds its own
    ``sigma``, and with probability ``tail_p`` is a degenerate run to the cap (the longest
    prediction), the long tail that no earlier sample foresees; none goes past ``pred.limit``
    (max_tokens), where the engine cuts."""
    if not groups:
        return {}
    cap = float(pred.longest.max()) if len(pred.longest) else pred.default
    sizes = np.array([g.n for g in groups], dtype=float)
    samples = np.array([max(1, len(g.predicted_lengths or ())) for g in groups], dtype=float)
    log_mean = np.log(np.maximum(1.0, pred.tokens / sizes))
    error_var = sigma * sigma / samples
    between = max(1e-6, float(log_mean.var()) - float(error_var.mean()))
    shrink = between / (between + error_var)
    centre = log_mean.mean() + shrink * (log_mean - log_mean.mean())
    centre = rng.normal(centre, np.sqrt(shrink * error_var))
    out = {}
    for k, g in enumerate(groups):
        x = np.exp(centre[k] + rng.normal(0.0, sigma, size=g.n))
        x = np.minimum(np.where(rng.random(g.n) < tail_p, max(cap, x.max()), x), pred.limit)
        out[g.prompt_id] = tuple(np.maximum(1, np.round(x)).astype(int).tolist())
    return out


def plan_asp(
    groups: Sequence[GroupSpec],
    instances: Sequence[InstanceSpec],
    *,
    batch_groups: int,
    lag_bound: int,
    cost_model: CostModel,
    seed: int = 0,
    variants: Sequence[str] = VARIANTS,
    noise_sigma: float = 0.4,
    tail_p: float | None = None,
    draws: int = 2,
    dispatch: str = "continuous",
    predictions: Predictions | None = None,
    defer_factor: float = 1.0,
) -> tuple[Plan, AspInfo]:
    """Build the candidates, score them in the simulator, return the best plan.

    Each candidate is scored by its mean simulated iteration time over ``draws`` noisy
    realisations of the predictions (``_noisy_actual``; ``noise_sigma``: log-normal spread of a
    sample around its prompt's mean, 0.4 is about the within-group spread of the grouped traces,
    0.31 castillo and 0.39 seqsched; ``tail_p``: chance per sample of a run to the
    cap, 0.1-1% in shared/data/lengths; None: the share of the predictions' own samples at the
    cap, at least ``MIN_TAIL_P``, since a prior sample runs to the cap as often as a new one).
    All candidates see the same draws. ``predictions``
    are the groups' own, when the caller has them already; ``defer_factor`` is the online
    layer's, as it will serve the plan."""
    from runtime.scheduler.online import OnlinePlanned
    from runtime.sim.engine import simulate

    variants = list(variants)
    pred = predictions or Predictions.of(groups)

    def build(variant: str) -> Plan:
        return build_variant(
            variant,
            groups,
            instances,
            batch_groups=batch_groups,
            lag_bound=lag_bound,
            cost_model=cost_model,
            predictions=pred,
        )

    if len(variants) == 1 or not groups:
        return build(variants[0]), AspInfo(variants[0])
    if tail_p is None:
        tail_p = cap_share(groups, pred.limit)
    rng = np.random.default_rng(seed)
    # Score on a subsample with the cluster scaled down in proportion, so per-instance load,
    # batch size relative to capacity and the lag window look the same.
    sub_groups, sub_inst, sub_b = _subsample(groups, instances, batch_groups, rng)
    # The trainer shrinks with them: with the whole cluster's trainer, a scaled-down cluster
    # would see it several times too fast, and a plan that starves it early would score well.
    sub_cost = cost_model.trainer_share(sub_b / batch_groups)
    # The whole epoch's default and cap: a subsample of unknowns must not fall back further.
    sub_pred = Predictions.of(sub_groups, fallback=pred.default, limit=pred.limit)
    if len(groups) > 100_000:
        draws = 1  # keep 1M-group planning within seconds
    actuals = [_noisy_actual(sub_groups, rng, noise_sigma, sub_pred, tail_p) for _ in range(draws)]
    scores: dict[str, float] = {}
    best = None
    for v in variants:
        plan = build_variant(
            v,
            sub_groups,
            sub_inst,
            batch_groups=sub_b,
            lag_bound=lag_bound,
            cost_model=sub_cost,
            predictions=sub_pred,
        )
        runs = []
        for actual in actuals:
            # Scored with the online layer it will be served with (it repairs every plan).
            s = OnlinePlanned(
                v,
                sub_groups,
                sub_inst,
                plan,
                batch_groups=sub_b,
                lag_bound=lag_bound,
                cost_model=sub_cost,
                predictions=sub_pred,
                defer_factor=defer_factor,
            )
            runs.append(
                simulate(
                    s,
                    sub_groups,
                    actual,
                    sub_inst,
                    batch_groups=sub_b,
                    lag_bound=lag_bound,
                    cost_model=sub_cost,
                    dispatch=dispatch,
                )
            )
        scores[v] = float(np.mean([r.iteration_s for r in runs]))
        if best is None or scores[v] < best[2]:
            best = (v, runs[0], scores[v])
    assert best is not None
    v, r, _ = best
    return build(v), AspInfo(v, scores, dict(r.breakdown.fractions), r.iteration_s)


def _subsample(
    groups: Sequence[GroupSpec], instances: Sequence[InstanceSpec], b: int, rng: np.random.Generator
) -> tuple[list[GroupSpec], list[InstanceSpec], int]:
    """A random subsample of at most ``SCORE_MAX_GROUPS`` groups on a cluster of at most
    ``SCORE_MAX_INSTANCES`` (at least 4) scaled down in proportion, with B scaled by the same
    factor, so per-instance load, batch size relative to capacity and the lag window stay as
    they are. The scorer runs the controller core, whose every decision looks at every instance:
    the cluster's size, not only the groups', sets the cost of a score."""
    g, k = len(groups), len(instances)
    if g <= SCORE_MAX_GROUPS and k <= SCORE_MAX_INSTANCES:
        return list(groups), list(instances), b
    keep_k = min(k, SCORE_MAX_INSTANCES, max(4, round(k * SCORE_MAX_GROUPS / g)))
    frac = keep_k / k
    sub_b = max(1, round(b * frac))
    size = min(SCORE_MAX_GROUPS, g, max(sub_b, round(g * frac)))
    keep = np.sort(rng.choice(g, size=size, replace=False))
    return [groups[i] for i in keep], list(instances[:keep_k]), sub_b
