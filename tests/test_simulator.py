"""The discrete-event simulator (runtime/sim/engine.py): the issue's invariants."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.bubbles import skewness_fraction
from runtime.scheduler import CostModel, GroupSpec, InstanceSpec, make_scheduler
from runtime.sim.compare import compare
from runtime.sim.engine import SimRun, latency_lower_bound, simulate

# Constant step time and free prefill, sync and training: timings become analytic.
FLAT = CostModel(
    step_base_s=1e-3,
    step_per_seq_s=0.0,
    step_per_ctx_token_s=0.0,
    prefill_per_token_s=0.0,
    trainer_base_s=0.0,
    trainer_tokens_per_s=1e15,
    weight_sync_s=0.0,
)


def run(policy, lengths, k, c, b, eta, cost=FLAT, dispatch="continuous", pred=None):
    n = len(lengths[0])
    groups = [GroupSpec(p, n, pred[p] if pred else tuple(ls)) for p, ls in enumerate(lengths)]
    inst = [InstanceSpec(i, c) for i in range(k)]
    s = make_scheduler(policy, groups, inst, batch_groups=b, lag_bound=eta, cost_model=cost)
    actual = {p: ls for p, ls in enumerate(lengths)}
    return simulate(
        s, groups, actual, inst, batch_groups=b, lag_bound=eta, cost_model=cost, dispatch=dispatch
    )


@pytest.mark.parametrize("policy", ["fifo", "sorted", "asp"])
@pytest.mark.parametrize("eta", [0, 1, 3])
@pytest.mark.parametrize("dispatch", ["continuous", "minibatch"])
def test_equal_lengths_have_no_padding_and_no_skewness(policy, eta, dispatch):
    # 4 instances x 8 slots, groups of 4: two groups fill an instance; 8 groups fill the cluster.
    lengths = [(50, 50, 50, 50)] * 64
    r = run(policy, lengths, k=4, c=8, b=8, eta=eta, dispatch=dispatch)
    assert r.breakdown.fractions["padding"] == pytest.approx(0.0, abs=1e-9)
    assert r.breakdown.fractions["skewness"] == pytest.approx(0.0, abs=1e-9)
    assert r.steps == 8
    assert sum(r.lag_histogram.values()) == 64


@pytest.mark.parametrize("n_inst,ratio,n", [(4, 3, 4), (8, 5, 2), (2, 2, 1)])
def test_single_long_outlier_gives_the_analytic_skewness(n_inst, ratio, n):
    # One group per instance filling it; group 0 has one sample `ratio` times longer.
    base = 40
    lengths = [tuple([base] * n) for _ in range(n_inst)]
    lengths[0] = (base * ratio, *([base] * (n - 1)))
    r = run("fifo", lengths, k=n_inst, c=n, b=n_inst, eta=0)
    expected = (n_inst - 1) * (ratio - 1) / (n_inst * ratio)
    assert r.breakdown.fractions["skewness"] == pytest.approx(expected, rel=1e-9)
    # The formula over the instances' finish times says the same.
    finish = [base * ratio * 1e-3] + [base * 1e-3] * (n_inst - 1)
    assert skewness_fraction(finish) == pytest.approx(expected)
    # Instance 0's other n-1 slots wait for the long member: token-form padding / N.
    pad = (n - 1) * (ratio - 1) / (n * ratio) / n_inst
    assert r.breakdown.fractions["padding"] == pytest.approx(pad, rel=1e-9)
    assert r.makespan_s == pytest.approx(base * ratio * 1e-3)


def test_lag_bound_zero_is_synchronous():
    lengths = [(10 * (1 + p % 7), 5, 20) for p in range(60)]
    cost = CostModel(trainer_base_s=0.5, trainer_tokens_per_s=1e6, weight_sync_s=0.0)
    r = run("fifo", lengths, k=3, c=6, b=6, eta=0, cost=cost)
    assert r.lag_histogram == {0: 60}
    # Synchronous: rollout and training never overlap, so every iteration is at least one
    # trainer step plus the rollout of its own batch, and the rollout never meets the trainer.
    assert r.steps == 10
    assert min(r.iteration_times) >= 0.5
    assert r.breakdown.trainer["stepping"] > 0
    # Nothing is dispatched while the trainer steps: the step time shows up as whole-cluster
    # back-pressure (sorting before the fifo baseline) and never as useful rollout.
    assert r.extra["raw_sorting"] > 0


def test_equal_lengths_synchronous_iteration_is_rollout_plus_step():
    lengths = [(30, 30)] * 24
    cost = CostModel(
        step_base_s=1e-3,
        step_per_seq_s=0.0,
        step_per_ctx_token_s=0.0,
        prefill_per_token_s=0.0,
        trainer_base_s=0.25,
        trainer_tokens_per_s=1e15,
        weight_sync_s=0.0,
    )
    r = run("fifo", lengths, k=2, c=4, b=4, eta=0, cost=cost)
    assert r.iteration_times == pytest.approx([0.03 + 0.25] * 6)


@pytest.mark.parametrize("eta", [1, 2])
def test_lag_never_exceeds_the_bound(eta):
    lengths = [
        ((p * 37) % 200 + 1, (p * 11) % 90 + 1, 400 if p % 17 == 0 else 5) for p in range(120)
    ]
    for policy in ("fifo", "sorted", "asp"):
        r = run(policy, lengths, k=3, c=6, b=6, eta=eta, cost=CostModel())
        assert max(r.lag_histogram) <= eta
        assert sum(r.lag_histogram.values()) == 120


def test_actual_lengths_may_differ_from_predicted():
    lengths = [(100, 120), (10, 12), (300, 50), (7, 9)] * 10
    pred = {p: (1,) for p in range(40)}
    r = run("asp", lengths, k=2, c=4, b=4, eta=1, cost=CostModel(), pred=pred)
    assert r.tokens == sum(sum(x) for x in lengths)
    assert r.lower_bound_s <= r.iteration_s


def test_compare_reports_sorting_in_excess_of_fifo():
    lengths = [((p * 53) % 300 + 1,) * 2 for p in range(200)]
    groups = [GroupSpec(p, 2, ls) for p, ls in enumerate(lengths)]
    inst = [InstanceSpec(i, 8) for i in range(4)]
    res = compare(
        ["fifo", "sorted", "asp"],
        groups,
        dict(enumerate(lengths)),
        inst,
        batch_groups=16,
        lag_bound=1,
        cost_model=CostModel(),
    )
    assert res["fifo"].breakdown.fractions["sorting"] == pytest.approx(0.0)
    base = res["fifo"].breakdown.sorting_baseline
    for r in res.values():
        fr = r.breakdown.fractions
        assert sum(fr.values()) == pytest.approx(1.0)
        assert fr["sorting"] == pytest.approx(max(0.0, r.extra["raw_sorting"] - base))


def test_simulate_rejects_missing_actual_lengths():
    groups = [GroupSpec(0, 1, (5,)), GroupSpec(1, 1, (5,))]
    inst = [InstanceSpec(0, 2)]
    s = make_scheduler("fifo", groups, inst, batch_groups=1, lag_bound=0)
    with pytest.raises(ValueError, match="prompt_id 1"):
        simulate(s, groups, {0: (5,)}, inst, batch_groups=1, lag_bound=0)


def castillo_sample(policies, batch_groups, lag_bound):
    """``compare`` on tests/data/castillo_sample.csv: sample 1 predicts the other nine."""
    from pathlib import Path

    from runtime.scheduler.lengths import read_lengths

    t = read_lengths(Path(__file__).parent / "data" / "castillo_sample.csv")
    pred, act = t.split(1)
    groups = [GroupSpec(p, 9, ls) for p, ls in zip(pred.prompt_ids, pred.lengths, strict=True)]
    return compare(
        policies,
        groups,
        act.as_map(),
        [InstanceSpec(i, 18) for i in range(3)],
        batch_groups=batch_groups,
        lag_bound=lag_bound,
        prompt_tokens=dict(zip(t.prompt_ids, t.prompt_tokens, strict=True)),
    )


def test_castillo_sample_runs_and_is_deterministic():
    a = castillo_sample(["fifo", "sorted", "asp"], 6, 1)
    b = castillo_sample(["asp"], 6, 1)
    assert a["asp"].iteration_s == b["asp"].iteration_s
    assert all(r.groups == 60 for r in a.values())


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(
        st.lists(st.integers(1, 300), min_size=2, max_size=2), min_size=1, max_size=60
    ),
    k=st.integers(1, 4),
    slots=st.integers(1, 3),
    b=st.integers(1, 8),
    eta=st.integers(0, 3),
    policy=st.sampled_from(["fifo", "sorted", "asp"]),
    dispatch=st.sampled_from(["continuous", "minibatch"]),
)
def test_property_every_group_consumed_once_within_the_bound(
    lengths, k, slots, b, eta, policy, dispatch
):
    lengths = [tuple(x) for x in lengths]
    r = run(policy, lengths, k=k, c=2 * slots, b=b, eta=eta, cost=CostModel(), dispatch=dispatch)
    assert sum(r.lag_histogram.values()) == len(lengths)
    assert max(r.lag_histogram) <= eta
    assert r.steps == -(-len(lengths) // b)
    assert sum(r.breakdown.fractions.values()) == pytest.approx(1.0)
    assert r.makespan_s >= r.makespan_lower_bound_s * (1 - 1e-9)
    assert r.iteration_s >= r.latency_lower_bound_s * (1 - 1e-9)
    assert r.tokens == sum(map(sum, lengths))


# --- the latency-aware (critical-path) lower bound --------------------------------------------

# Per-token time grows with the batch and the context; prefill and the trainer cost time too.
LAT = CostModel(
    step_base_s=1e-3,
    step_per_seq_s=2e-4,
    step_per_ctx_token_s=1e-7,
    prefill_per_token_s=1e-5,
    trainer_base_s=0.05,
    trainer_tokens_per_s=1e6,
    weight_sync_s=0.0,
)


def solo_s(cost, length, prompt=0):
    """One sequence alone on an instance: prefill, then ``length`` decode steps at running=1."""
    return cost.prefill_s(prompt) + cost.decode_steps_s(length, 1, prompt)


@pytest.mark.parametrize("eta", [0, 1, 2])
def test_one_long_group_alone_is_bounded_by_its_solo_decode(eta):
    # One sample on an otherwise empty cluster: the run is its solo decode plus the trainer's
    # step, whatever η; the bound is that solo decode plus the step's fixed part (its per-token
    # part is only counted spread over the η + 1 periods).
    r = run("fifo", [(2000,)], k=2, c=8, b=1, eta=eta, cost=LAT)
    lam, step = solo_s(LAT, 2000), LAT.trainer_step_s(2000)
    assert r.latency_lower_bound_s == pytest.approx(
        max(lam + LAT.trainer_base_s, (lam + step) / (eta + 1))
    )
    assert r.iteration_s == pytest.approx(lam + step, rel=1e-9)
    assert r.iteration_s >= r.latency_lower_bound_s
    # Siblings share the instance: the long sample decodes slower than alone, never faster.
    r3 = run("fifo", [(2000, 30, 10)], k=2, c=8, b=1, eta=eta, cost=LAT)
    assert r3.iteration_s > r3.latency_lower_bound_s >= lam + LAT.trainer_base_s


@pytest.mark.parametrize("eta", [0, 1, 2, 3])
def test_lag_bound_divides_the_critical_path(eta):
    # 12 equal groups, one per step: the steady period is (Λ + T) / (η + 1).
    prompt = 40
    lam = solo_s(LAT, 500, prompt)
    actual = [(500, 500)] * 12
    t1 = LAT.trainer_step_s(2 * (500 + prompt))
    got = latency_lower_bound(actual, [prompt] * 12, LAT, batch_groups=1, lag_bound=eta) / 12
    assert got == pytest.approx((lam + t1) / (eta + 1))
    # Batches of 3 share one critical path: 4 steps. When η + 1 does not divide the steps, the
    # chain of disjoint windows (ceil(4 / (η + 1)) of them) is the larger bound.
    t3 = LAT.trainer_step_s(6 * (500 + prompt))
    got3 = latency_lower_bound(actual, [prompt] * 12, LAT, batch_groups=3, lag_bound=eta) / 4
    chain = math.ceil(4 / (eta + 1)) * (lam + LAT.trainer_base_s) / 4
    assert got3 == pytest.approx(max((lam + t3) / (eta + 1), chain))
    # The simulator never beats it.
    r = run("fifo", actual, k=2, c=4, b=1, eta=eta, cost=LAT)
    assert r.iteration_s >= r.latency_lower_bound_s * (1 - 1e-9) > 0


def test_rare_long_groups_are_counted_once_per_chain():
    # Two long groups among 20 short ones, B=1, η=1: both long groups may share a window, so
    # the bound counts one long path, plus the short groups' share over the η + 1 periods.
    cost = LAT
    actual = [(3000,)] * 2 + [(10,)] * 20
    lb = latency_lower_bound(actual, [0] * 22, cost, batch_groups=1, lag_bound=1)
    lam_long, lam_short = solo_s(cost, 3000), solo_s(cost, 10)
    toks = 2 * 3000 + 20 * 10
    averaged = (2 * lam_long + 20 * lam_short + 22 * cost.trainer_base_s + toks / 1e6) / 2
    chain = max(lam_long + cost.trainer_base_s, 11 * (lam_short + cost.trainer_base_s))
    assert lb == pytest.approx(max(averaged, chain))


@pytest.mark.parametrize("eta", [0, 1, 2])
def test_latency_bound_holds_on_the_castillo_sample(eta):
    res = castillo_sample(["fifo", "sorted", "asp"], 4, eta)
    for r in res.values():
        assert 0 < r.latency_lower_bound_s <= r.iteration_s
        assert r.ratio_to_latency_bound >= 1.0


class _MigratingRun(SimRun):
    """Every 7th time the core hears from the instances, every group in flight on instance 0
    is moved to instance 1 (when that one is running, not loading weights)."""

    asked = 0
    calls = 0

    def _feed_outputs(self, touched: list[int]) -> None:
        super()._feed_outputs(touched)
        self.calls += 1
        if self.calls % 7:
            return
        gids = list(self.core.instances[0].in_flight)
        self.asked += sum(self.core.dispatcher.migrate(gid, 1) for gid in gids)
        super()._feed_outputs(self._route(self.core.outbox.take()))


def test_migrated_groups_continue_in_the_simulator_and_no_token_is_generated_twice():
    rng = random.Random(3)
    lengths = [[rng.randint(10, 400) for _ in range(4)] for _ in range(16)]
    groups = [GroupSpec(p, 4, tuple(ls)) for p, ls in enumerate(lengths)]
    inst = [InstanceSpec(i, 8) for i in range(2)]
    scheduler = make_scheduler("fifo", groups, inst, batch_groups=2, lag_bound=3, cost_model=FLAT)
    actual = {p: ls for p, ls in enumerate(lengths)}
    sim = _MigratingRun(
        scheduler, groups, actual, dict.fromkeys(actual, 0), inst, FLAT,
        batch_groups=2, lag_bound=3, dispatch="continuous",
    )  # fmt: skip
    sim.run()  # raises unless every group was consumed
    counters = sim.core.governor.counters
    assert sim.asked > 0 and sim.core.dispatcher.migrated == sim.asked
    assert counters.consumed == len(groups) and counters.discarded == 0
    # Each sample's tokens were generated once, split between the two instances.
    made = sum(model.tokens_generated for model in sim.models.values())
    assert made == sum(map(sum, lengths))


def test_asp_defers_an_unforeseen_straggler_and_still_consumes_every_group_once():
    # Every prompt predicted short; a few actually run 40x longer (the cap-hitters no earlier
    # sample foresees). The online layer defers them to a tail round instead of letting each
    # hold a step; nothing is dropped, no token counted twice, and the lag bound holds.
    rng = random.Random(3)
    n, count = 4, 240
    groups = [GroupSpec(p, n, (100,)) for p in range(count)]
    actual = {
        p: tuple(4000 if p % 37 == 5 and j == 0 else rng.randint(60, 140) for j in range(n))
        for p in range(count)
    }
    inst = [InstanceSpec(i, 16) for i in range(4)]
    cost = CostModel.sized_for(4, max_num_seqs=16)
    out = {}
    for policy in ("fifo", "asp"):
        s = make_scheduler(policy, groups, inst, batch_groups=16, lag_bound=1, cost_model=cost)
        out[policy] = simulate(
            s, groups, actual, inst, batch_groups=16, lag_bound=1, cost_model=cost
        )
    asp, fifo = out["asp"], out["fifo"]
    assert asp.extra["deferred"] > 0 and fifo.extra["deferred"] == 0
    assert sum(asp.lag_histogram.values()) == count and max(asp.lag_histogram) <= 1
    mean = sum(sum(x) for x in actual.values()) / (n * count)
    assert asp.extra["consumed_mean_length"] == pytest.approx(mean)
    assert fifo.extra["consumed_mean_length"] == pytest.approx(mean)
    assert asp.iteration_s < fifo.iteration_s
