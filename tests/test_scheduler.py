"""Scheduler policies, plan invariants, online repair, length sources, cost model, partition."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.config import load_config
from runtime.controller.work import TaskData, WorkQueue
from runtime.protocol import Lane
from runtime.scheduler import CostModel, GroupSpec, InstanceSpec, make_scheduler
from runtime.scheduler.asp import VARIANTS, _noisy_actual, build_variant
from runtime.scheduler.base import Defer, Move, Predictions, RolloutView, Running
from runtime.scheduler.lengths import (
    LengthHistory,
    LengthsFileError,
    longest_quality,
    predictor_quality,
    read_lengths,
    write_lengths,
)
from runtime.scheduler.online import TAIL_PRIORITY
from runtime.scheduler.partition import karmarkar_karp, lpt, snake

DATA = Path(__file__).parent / "data"


def groups_of(lengths, n=4):
    return [GroupSpec(p, n, None if ls is None else tuple(ls)) for p, ls in enumerate(lengths)]


def drain(sched, instances, max_groups=3):
    """Hand out everything, round robin, as a controller would; returns (instance, ids) calls."""
    calls = []
    while sched.remaining():
        progressed = False
        for s in instances:
            got = sched.next_groups(s.instance_id, max_groups)
            if got:
                calls.append((s.instance_id, got))
                progressed = True
        assert progressed, "remaining() > 0 but no instance gets work"
    return calls


@pytest.mark.parametrize("policy", ["fifo", "sorted", "asp"])
def test_plan_covers_every_group_once_and_is_deterministic(policy):
    rng = np.random.default_rng(3)
    lengths = [tuple(rng.integers(1, 500, size=4).tolist()) for _ in range(300)]
    lengths[7] = None  # unknown prediction
    groups = groups_of(lengths)
    inst = [InstanceSpec(0, 16), InstanceSpec(1, 8), InstanceSpec(5, 32)]
    a = make_scheduler(policy, groups, inst, batch_groups=12, lag_bound=1, seed=7)
    b = make_scheduler(policy, groups, inst, batch_groups=12, lag_bound=1, seed=7)
    ca, cb = drain(a, inst), drain(b, inst)
    assert ca == cb
    handed = [p for _, ids in ca for p in ids]
    assert sorted(handed) == list(range(300))
    assert a.remaining() == 0
    assert all(len(ids) <= 3 for _, ids in ca)


@pytest.mark.parametrize("policy", ["fifo", "sorted", "asp"])
def test_next_groups_never_crosses_a_minibatch_boundary(policy):
    groups = groups_of([(x,) * 4 for x in range(1, 101)])
    inst = [InstanceSpec(0, 16), InstanceSpec(1, 16)]  # minibatch = 16 // 4 = 4 groups
    s = make_scheduler(policy, groups, inst, batch_groups=8, lag_bound=0)
    cuts = {i: set() for i in (0, 1)}
    pos = {i: 0 for i in (0, 1)}
    for i in (0, 1):
        for mb in s.queues[i]:
            cuts[i].add(pos[i])
            pos[i] += len(mb)
    pos = {i: 0 for i in (0, 1)}
    while s.remaining():
        for i in (0, 1):
            got = s.next_groups(i, 100)
            if not got:
                continue
            start, end = pos[i], pos[i] + len(got)
            assert not any(start < c < end for c in cuts[i]), "crossed a boundary"
            pos[i] = end
            assert len(got) <= 4


def test_fifo_is_dataset_order_round_robin_and_sorted_is_shortest_first():
    groups = groups_of([(10 - p,) for p in range(10)], n=1)
    inst = [InstanceSpec(0, 1), InstanceSpec(1, 1)]
    f = make_scheduler("fifo", groups, inst, batch_groups=2, lag_bound=1)
    assert [f.next_groups(0, 1)[0] for _ in range(5)] == [0, 2, 4, 6, 8]
    s = make_scheduler("sorted", groups, inst, batch_groups=2, lag_bound=1)
    assert [s.next_groups(0, 1)[0] for _ in range(5)] == [9, 7, 5, 3, 1]


def test_make_scheduler_rejects_bad_input():
    g = groups_of([(1,), (2,)], n=1)
    inst = [InstanceSpec(0, 4)]
    with pytest.raises(ValueError, match="policy"):
        make_scheduler("lifo", g, inst, batch_groups=1, lag_bound=0)
    with pytest.raises(ValueError, match="unique"):
        make_scheduler("fifo", [g[0], g[0]], inst, batch_groups=1, lag_bound=0)
    with pytest.raises(ValueError, match="batch_groups"):
        make_scheduler("fifo", g, inst, batch_groups=0, lag_bound=0)
    with pytest.raises(ValueError, match="instances"):
        make_scheduler("fifo", g, [], batch_groups=1, lag_bound=0)
    with pytest.raises(ValueError, match="defer_factor"):
        make_scheduler("asp", g, inst, batch_groups=1, lag_bound=0, defer_factor=0.0)
    with pytest.raises(ValueError, match="max_tokens"):
        make_scheduler("asp", g, inst, batch_groups=1, lag_bound=0, max_tokens=0)
    with pytest.raises(ValueError, match="tail_max_seqs"):
        make_scheduler("asp", g, inst, batch_groups=1, lag_bound=0, tail_max_seqs=0)


def test_asp_reports_a_predicted_breakdown_and_picks_a_variant():
    rng = np.random.default_rng(0)
    groups = groups_of([tuple(rng.integers(1, 800, size=4).tolist()) for _ in range(200)])
    inst = [InstanceSpec(i, 16) for i in range(4)]
    s = make_scheduler("asp", groups, inst, batch_groups=16, lag_bound=1)
    assert s.name == "asp"
    assert s.plan_info.variant in VARIANTS
    assert set(s.plan_info.scores) == set(VARIANTS)
    assert sum(s.predicted_breakdown.values()) == pytest.approx(1.0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_asp_variant_is_a_complete_plan(variant):
    rng = np.random.default_rng(1)
    groups = groups_of([tuple(rng.integers(1, 900, size=2).tolist()) for _ in range(97)], n=2)
    inst = [InstanceSpec(0, 8), InstanceSpec(1, 4)]
    plan = build_variant(variant, groups, inst, batch_groups=6, lag_bound=2, cost_model=CostModel())
    flat = sorted(g for q in plan.queues.values() for g in q)
    assert flat == list(range(97))
    for i, q in plan.queues.items():
        assert plan.cuts[i][0] == 0 and plan.cuts[i] == sorted(set(plan.cuts[i]))
        assert all(c < max(1, len(q)) for c in plan.cuts[i])


def test_asp_longest_first_spreads_the_long_tail_over_instances():
    lengths = [(1000,)] * 4 + [(10,)] * 60
    groups = groups_of(lengths, n=1)
    inst = [InstanceSpec(i, 4) for i in range(4)]
    plan = build_variant(
        "longest_first", groups, inst, batch_groups=4, lag_bound=1, cost_model=CostModel()
    )
    # Each instance starts with exactly one of the four long groups.
    assert sorted(plan.queues[i][0] for i in range(4)) == [0, 1, 2, 3]


# --- the max_tokens cap ---------------------------------------------------------------------


def test_predictions_never_exceed_max_tokens():
    groups = groups_of([None, (40, 60), (100, 300), None], n=2)
    free = Predictions.of(groups)
    capped = Predictions.of(groups, limit=128)
    # Each sample is capped, then averaged: the median of 50 and (100 + 128) / 2, not of 200.
    assert free.default == 125.0 and capped.default == 82.0
    assert capped.longest.tolist() == [82.0, 60.0, 128.0, 82.0]
    assert capped.tokens.tolist() == [164.0, 100.0, 228.0, 164.0]
    # With nothing known the fallback is the guess, and the cap bounds it too.
    unknown = groups_of([None] * 3, n=4)
    assert Predictions.of(unknown).default == 512.0
    cold = Predictions.of(unknown, limit=128)
    assert cold.default == 128.0 and cold.longest.max() == 128.0 and cold.tokens.max() == 512.0


@pytest.mark.parametrize("policy", ["fifo", "sorted", "asp"])
def test_every_policy_predicts_within_max_tokens(policy):
    groups = groups_of([None] * 20 + [(900, 50)] * 4, n=2)
    inst = [InstanceSpec(0, 8), InstanceSpec(1, 8)]
    s = make_scheduler(policy, groups, inst, batch_groups=4, lag_bound=1, max_tokens=128)
    longest = [s.predicted_longest(p) for p in range(24)]
    assert max(longest) == 128.0 and longest[20:] == [128.0] * 4
    if policy == "asp":
        assert s.cap == 128.0
        s.on_group_finished(0, 0, [128, 128])
        s._ratio_mid = 3.0  # as if groups had run 3x their priors
        assert s.estimate(1, 0.0) == 128.0
        assert s.estimate(1, 10_000.0) == 128.0


def waiting_view(s, generated: float) -> RolloutView:
    """The trainer waits on prompt 0's group, which has run ``generated`` tokens' time."""
    r = Running(group_id=0, prompt_id=0, instance_id=0, start_version=0, dispatched_at=0.0)
    return RolloutView(generated * s.token_s, 0, 0, s.batch_groups, (r,), (r,))


@pytest.mark.parametrize(("max_tokens", "deferred"), [(None, True), (128, False)])
def test_no_history_is_no_reason_to_defer_a_group_max_tokens_will_end(max_tokens, deferred):
    # The first epoch of a run: no length known, so every prediction is the fallback. Without
    # the cap it says 512 tokens, and a group 20 tokens in looks like a straggler.
    groups = groups_of([None] * 16, n=4)
    inst = [InstanceSpec(0, 32)]
    s = make_scheduler("asp", groups, inst, batch_groups=8, lag_bound=1, max_tokens=max_tokens)
    s.period_s = 200 * s.token_s  # a trainer period: a 128-token group fits, 512 does not
    out = s.repair(waiting_view(s, 20.0))
    assert bool(out) is deferred
    assert all(isinstance(d, Defer) for d in out)


def test_defer_factor_sets_how_late_is_too_late():
    groups = groups_of([(100, 100)] * 16, n=2)
    inst = [InstanceSpec(0, 32)]
    strict = make_scheduler("asp", groups, inst, batch_groups=8, lag_bound=1, defer_factor=0.25)
    lenient = make_scheduler("asp", groups, inst, batch_groups=8, lag_bound=1)
    assert (strict.defer_factor, lenient.defer_factor) == (0.25, 1.0)
    for s in (strict, lenient):
        s.period_s = 200 * s.token_s
    # 100 tokens left: over a quarter period, inside a whole one.
    assert [type(d) for d in strict.repair(waiting_view(strict, 0.0))] == [Defer]
    assert lenient.repair(waiting_view(lenient, 0.0)) == []


def test_a_group_late_for_its_deadline_moves_to_the_tail_lane_once():
    # Prompt 0 is predicted at 100 tokens, prompt 1 at 10; the deadline falls at 80 tokens' time.
    groups = groups_of([(100, 100), (10, 10)] + [(50, 50)] * 6, n=2)
    inst = [InstanceSpec(0, 32), InstanceSpec(1, 32)]
    s = make_scheduler(
        "asp", groups, inst, batch_groups=4, lag_bound=1, tail_instances=1, tail_max_seqs=8
    )
    assert s.lane(1) is Lane.TAIL and s.tail_ids == {1}
    s.period_s, s.train_s = 40 * s.token_s, 0.0
    running = tuple(
        Running(group_id=p, prompt_id=p, instance_id=0, start_version=0, dispatched_at=0.0)
        for p in (0, 1)
    )
    view = RolloutView(10 * s.token_s, 0, 0, s.batch_groups, (), running)
    [late] = s.late(view)
    assert (late.running.prompt_id, late.n) == (0, 2)
    assert (late.generated, late.left) == (pytest.approx(10.0), pytest.approx(90.0))
    assert s.repair(view) == [Move(0, 1, TAIL_PRIORITY)]
    assert s.late(view) == []  # a group moves at most once an epoch
    assert s.repair(view) == []


def test_asp_priorities_are_deadlines_and_the_tail_round_goes_first():
    from runtime.scheduler.online import TAIL_PRIORITY

    groups = groups_of([(100, 100)] * 16, n=2)
    s = make_scheduler("asp", groups, [InstanceSpec(0, 32)], batch_groups=8, lag_bound=2)
    # Earliest deadline first: the last step that may consume a group started at version v.
    assert [s.priority(0, v) for v in (0, 3)] == [2, 5]
    assert s.priority(1, 0) < s.priority(0, 1)
    while s.next_groups(0, 16):  # the whole plan handed out
        pass
    s.period_s = 200 * s.token_s
    s.defer_factor = 0.25
    assert [type(d) for d in s.repair(waiting_view(s, 0.0))] == [Defer]
    s.requeue([0])  # what the core does with a deferred group's prompt
    assert s.next_groups(0, 1) == [0]  # its regeneration: the tail round
    assert s.priority(0, 7) == TAIL_PRIORITY < min(s.priority(p, 0) for p in range(1, 16))


def test_asp_scores_its_candidates_with_the_defer_factor_it_serves(monkeypatch):
    from runtime.scheduler.online import OnlinePlanned

    seen: list[float] = []
    init = OnlinePlanned.__init__

    def spy(self, *args, **kw):
        init(self, *args, **kw)
        seen.append(self.defer_factor)

    monkeypatch.setattr(OnlinePlanned, "__init__", spy)
    groups = groups_of([(100, 100), (10, 20)] * 8, n=2)
    make_scheduler(
        "asp", groups, [InstanceSpec(0, 8)], batch_groups=4, lag_bound=1, defer_factor=0.4
    )
    assert len(seen) > 1 and set(seen) == {0.4}  # every scoring run, and the served one


def test_work_queue_plans_with_the_configs_scheduler_knobs():
    config = load_config(
        None,
        [
            "scheduler.policy=asp",
            "scheduler.defer_factor=0.5",
            "scheduler.tail_instances=1",
            "scheduler.tail_max_seqs=8",
            "rollout.sampling.max_tokens=64",
        ],
    )
    data = TaskData({0: "a", 1: "b"}, {}, "builtin:tiny", LengthHistory())
    seen = {}
    work = WorkQueue(
        config,
        data,
        epoch=0,
        consumed=(),
        next_group_id=0,
        request_plan=None,
        make_scheduler=lambda *args, **kwargs: seen.update(kwargs),
    )
    work.plan(0, [InstanceSpec(0, 16), InstanceSpec(1, 16)], 1, None).make()
    assert seen["defer_factor"] == 0.5 and seen["max_tokens"] == 64
    assert seen["tail_instances"] == 1 and seen["tail_max_seqs"] == 8


# --- online repair -------------------------------------------------------------------------


def unfinished_accounted(s, out, finished, total):
    pending = s.pending_groups()
    assert len(pending) == len(set(pending)), "a group is planned twice"
    assert not set(pending) & out, "a handed-out group is still planned"
    assert not set(pending) & finished
    assert set(pending) | out | finished == set(range(total))


def test_pause_moves_work_and_resume_takes_a_fair_share_back():
    groups = groups_of([(50,)] * 40, n=1)
    inst = [InstanceSpec(i, 2) for i in range(4)]
    s = make_scheduler("asp", groups, inst, batch_groups=4, lag_bound=1)
    s.on_instance_paused(2)
    assert s.pending(2) == 0 and s.next_groups(2, 5) == []
    assert s.remaining() == 40
    s.on_instance_resumed(2)
    assert s.pending(2) > 0
    assert s.remaining() == 40
    s.on_instance_lost(3)
    assert s.next_groups(3, 5) == [] and s.remaining() == 40
    s.on_instance_added(InstanceSpec(9, 2))
    assert s.pending(9) > 0 and s.remaining() == 40
    unfinished_accounted(s, set(), set(), 40)


def test_asp_steals_the_last_minibatch_when_an_instance_runs_dry():
    groups = groups_of([(50,)] * 24, n=1)
    inst = [InstanceSpec(i, 2) for i in range(3)]
    s = make_scheduler("asp", groups, inst, batch_groups=3, lag_bound=1)
    while s.pending(0):
        s.next_groups(0, 2)
    before = s.remaining()
    got = s.next_groups(0, 2)
    assert got and s.remaining() == before - len(got)
    unfinished_accounted(s, set(got), set(range(24)) - set(s.pending_groups()) - set(got), 24)
    # fifo and sorted keep their static plan.
    f = make_scheduler("fifo", groups, inst, batch_groups=3, lag_bound=1)
    while s.pending(0) and f.pending(0):
        f.next_groups(0, 2)
    while f.pending(0):
        f.next_groups(0, 2)
    assert f.next_groups(0, 2) == []


def test_requeued_groups_come_back_first():
    groups = groups_of([(5,)] * 12, n=1)
    inst = [InstanceSpec(0, 1), InstanceSpec(1, 1)]
    s = make_scheduler("fifo", groups, inst, batch_groups=2, lag_bound=1)
    got = s.next_groups(0, 1) + s.next_groups(0, 1)
    s.requeue(got)
    # They go to the least loaded instances as one minibatch at the front of each queue.
    first = {*s.next_groups(0, 5), *s.next_groups(1, 5)}
    assert set(got) <= first


@settings(max_examples=60, deadline=None)
@given(
    policy=st.sampled_from(["fifo", "sorted", "asp"]),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["next", "finish", "requeue", "pause", "resume", "lost", "add"]),
            st.integers(0, 5),
            st.integers(1, 4),
        ),
        max_size=60,
    ),
    lengths=st.lists(st.integers(1, 1000), min_size=1, max_size=80),
)
def test_property_repair_keeps_every_unfinished_group(policy, ops, lengths):
    total = len(lengths)
    groups = groups_of([(x, x // 2 + 1) for x in lengths], n=2)
    inst = [InstanceSpec(i, 4) for i in range(3)]
    s = make_scheduler(policy, groups, inst, batch_groups=3, lag_bound=1, seed=1)
    out: dict[int, int] = {}
    finished: set[int] = set()
    known = {0, 1, 2}
    for op, i, k in ops:
        if op == "next":
            for p in s.next_groups(i, k):
                out[p] = i
        elif op == "finish" and out:
            p = sorted(out)[i % len(out)]
            s.on_group_finished(p, out.pop(p), [1, 2])
            finished.add(p)
        elif op == "requeue" and out:
            back = sorted(out)[:k]
            for p in back:
                out.pop(p)
            s.requeue(back)
        elif op == "pause":
            s.on_instance_paused(i)
        elif op == "resume":
            s.on_instance_resumed(i)
        elif op == "lost":
            s.on_instance_lost(i)
            back = [p for p, j in out.items() if j == i]
            for p in back:
                out.pop(p)
            s.requeue(back)
        elif op == "add" and i not in known:
            s.on_instance_added(InstanceSpec(i, 4))
            known.add(i)
        unfinished_accounted(s, set(out), finished, total)
    assert s.remaining() == total - len(out) - len(finished)


# --- partition -----------------------------------------------------------------------------


def test_lpt_and_karmarkar_karp_balance():
    w = [7, 5, 4, 3, 3, 2, 2, 1]
    parts = lpt(w, [1.0, 1.0])
    assert sorted(i for p in parts for i in p) == list(range(8))
    loads = sorted(sum(w[i] for i in p) for p in parts)
    assert loads == [13, 14]
    kk = karmarkar_karp(w, 2)
    assert sorted(i for p in kk for i in p) == list(range(8))
    assert sorted(sum(w[i] for i in p) for p in kk) in ([13, 14], [13.5, 13.5])
    # A bin with twice the speed takes about twice the load.
    fast = lpt([1.0] * 30, [2.0, 1.0])
    assert len(fast[0]) == 20
    assert snake(7, 3).tolist() == [0, 1, 2, 2, 1, 0, 0]


def test_asp_scoring_draws_shrink_a_one_sample_prior_towards_the_mean():
    """A prompt predicted long from one sample is often a fluke: the scorer's draws for it come
    out shorter (and the short ones longer), while a prediction from many samples stays put."""
    rng = np.random.default_rng(3)
    means = rng.lognormal(5.0, 0.6, size=3000)

    def predicted(samples: int) -> list[GroupSpec]:
        return [
            GroupSpec(p, 4, tuple(np.round(m * rng.lognormal(0.0, 0.4, samples)).astype(int)))
            for p, m in enumerate(means)
        ]

    for samples, (low, high) in ((1, (0.55, 0.85)), (64, (0.9, 1.1))):
        groups = predicted(samples)
        pred = Predictions.of(groups)
        draws = _noisy_actual(groups, np.random.default_rng(0), 0.4, pred, tail_p=0.0)
        prior = np.array([np.mean(g.predicted_lengths) for g in groups])
        drawn = np.array([np.median(draws[g.prompt_id]) for g in groups])
        top = prior >= np.quantile(prior, 0.9)
        assert low < np.median(drawn[top] / prior[top]) < high, samples
        assert np.median(drawn) == pytest.approx(np.median(prior), rel=0.1)


# --- cost model ----------------------------------------------------------------------------


def test_cost_model_scaled_multiplies_every_duration():
    cm, half = CostModel(prefill_base_s=0.01), CostModel(prefill_base_s=0.01).scaled(0.5)
    assert half.decode_step_s(9, 900.0) == pytest.approx(cm.decode_step_s(9, 900.0) / 2)
    assert half.prefill_s(100) == pytest.approx(cm.prefill_s(100) / 2)
    assert half.trainer_step_s(96_000) == pytest.approx(cm.trainer_step_s(96_000) / 2)
    assert half.weight_sync_s == pytest.approx(cm.weight_sync_s / 2)
    with pytest.raises(ValueError, match="factor"):
        cm.scaled(0.0)


def test_cost_model_trainer_share_keeps_the_step_of_a_scaled_batch():
    cm = CostModel.sized_for(64)
    quarter = cm.trainer_share(0.25)
    assert quarter.trainer_step_s(24_000) == pytest.approx(cm.trainer_step_s(96_000))
    assert quarter.decode_step_s(9, 900.0) == cm.decode_step_s(9, 900.0)
    fixed = cm.with_fixed_trainer_step(2.0).trainer_share(0.25)
    assert fixed.trainer_step_s(24_000) == pytest.approx(2.0)
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="fraction"):
            cm.trainer_share(bad)


def test_cost_model_steps_and_fit():
    cm = CostModel()
    assert cm.decode_step_s(0, 0) == 0.0
    r, ctx, k = 10, 5000.0, 7
    manual = sum(cm.decode_step_s(r, ctx + r * j) for j in range(k))
    assert cm.decode_steps_s(k, r, ctx) == pytest.approx(manual)
    assert cm.trainer_step_s(48_000) == pytest.approx(cm.trainer_base_s + 1.0)
    truth = CostModel(
        step_base_s=0.004,
        step_per_seq_s=2e-5,
        step_per_ctx_token_s=3e-8,
        prefill_per_token_s=1e-5,
        trainer_base_s=2.0,
        trainer_tokens_per_s=1e5,
    )
    rng = np.random.default_rng(0)
    recs = []
    for _ in range(200):
        rs, cx = int(rng.integers(1, 256)), float(rng.integers(0, 200_000))
        recs.append(
            {
                "kind": "decode",
                "running_seqs": rs,
                "context_tokens": cx,
                "seconds": truth.decode_step_s(rs, cx),
            }
        )
    recs += [{"kind": "prefill", "tokens": t, "seconds": truth.prefill_s(t)} for t in (10, 900)]
    recs += [
        {"kind": "trainer", "tokens": t, "seconds": truth.trainer_step_s(t)} for t in (1e4, 1e6)
    ]
    fit = CostModel.fit(recs)
    for f in (
        "step_base_s",
        "step_per_seq_s",
        "step_per_ctx_token_s",
        "prefill_per_token_s",
        "trainer_base_s",
        "trainer_tokens_per_s",
    ):
        assert getattr(fit, f) == pytest.approx(getattr(truth, f), rel=1e-6), f
    with pytest.raises(ValueError, match="kind"):
        CostModel.fit([{"kind": "warp", "seconds": 1.0}])
    with pytest.raises(ValueError, match="step_base_s"):
        CostModel(step_base_s=-1)


# --- length sources ------------------------------------------------------------------------


def test_read_wide_and_long_files(tmp_path):
    cas = read_lengths(DATA / "castillo_sample.csv")
    assert cas.form == "wide" and len(cas) == 60 and len(cas.lengths[0]) == 10
    assert cas.prompt_ids == list(range(60)) and cas.ids == [str(k) for k in range(60)]
    assert cas.lengths[0] == (187, 209, 263, 197, 189, 218, 197, 201, 217, 203)
    assert cas.prompt_tokens[0] == 37
    seq = read_lengths(DATA / "seqsched_sample.csv")
    assert seq.form == "wide" and len(seq.lengths[0]) == 4 and seq.ids[0] == "5"
    assert seq.prompt_ids[:2] == [0, 1] and seq.lines[:2] == [2, 3]
    p = tmp_path / "long.csv"
    write_lengths(p, {3: [10, 20], 9: [5]})
    long = read_lengths(p)
    assert long.form == "long" and long.by_id() == {"3": (10, 20), "9": (5,)}
    assert long.as_map() == {0: (10, 20), 1: (5,)}
    pred, act = cas.split(1)
    assert pred.lengths[0] == (187,) and len(act.lengths[0]) == 9


@pytest.mark.parametrize(
    "text,match",
    [
        ("", "empty"),
        ("prompt_id,tokens\n1,2\n", "missing column 'output_tokens'"),
        ("prompt_id,output_tokens\n1,-3\n", "negative"),
        ("prompt_id,output_tokens\n1,2.5\n", "not an integer"),
        ("prompt_id,output_tokens\n1,abc\n", "not an integer"),
        ("prompt_id,output_tokens\n", "no data rows"),
        ("o1,o2\n1,2\n3\n", "fields"),
        ("prompt_id,output_tokens\n ,2\n", "'prompt_id' is empty"),
        ("prompt_id,o1,o2\nh7-0,1,2\nh7-1,3,4\nh7-0,5,6\n", r"bad.csv:4: .*'h7-0' repeats line 2"),
    ],
)
def test_bad_lengths_files_are_clear_errors(tmp_path, text, match):
    p = tmp_path / "bad.csv"
    p.write_text(text)
    with pytest.raises(LengthsFileError, match=match):
        read_lengths(p)


def test_longest_quality_ranks_and_scales_a_batch():
    """Spearman rho and the median actual/predicted of (predicted, actual) longest samples."""
    rho, ratio = longest_quality([(10, 12), (20, 18), (30, 33)])
    assert rho == pytest.approx(1.0) and ratio == pytest.approx(1.1)  # of 1.2, 0.9, 1.1
    rho, _ = longest_quality([(30, 12), (20, 18), (10, 33)])
    assert rho == pytest.approx(-1.0)
    # One swapped pair in four: 1 - 6·Σd²/(n(n²-1)) = 1 - 6·2/60.
    rho, ratio = longest_quality([(1, 1), (2, 3), (3, 2), (4, 4)])
    assert rho == pytest.approx(0.8) and ratio == pytest.approx((1 + 1) / 2)  # of 1, 1.5, 2/3, 1
    assert longest_quality([(10, 20), (20, 10)]) == (None, pytest.approx(1.25))  # two: no rank
    assert longest_quality([(10, 5), (10, 6), (10, 7)])[0] is None  # a constant prediction
    assert longest_quality([(0, 4), (0, 6), (0.5, 8)])[1] == pytest.approx(6.0)  # over max(p, 1)
    assert longest_quality([]) == (None, None)


def test_predictor_quality_and_history():
    assert predictor_quality([1, 2, 3], [10, 20, 30]) == pytest.approx((1.0, 0.9))
    rho, mape = predictor_quality([3, 2, 1], [1, 2, 3])
    assert rho == pytest.approx(-1.0) and mape == pytest.approx((2 / 1 + 0 + 2 / 3) / 3)
    assert math.isnan(predictor_quality([1, 1], [1, 2])[0])
    h = LengthHistory(window=2, prompt_tokens={1: 100, 2: 200, 3: 300})
    assert h.predict(1, 2) is None
    h.observe(1, [100, 120])
    h.observe(2, [200, 220])
    assert h.predict(1, 2) == (110, 110)
    assert h.predict(3, 1) == (310,)  # the prompt-length proxy: a line through (100,110),(200,210)
    h.observe(1, [300])
    h.observe(1, [500])
    assert h.predict(1, 1) == (400,)  # window of 2 observations
    assert h.predict(99, 1) is not None  # the global mean
    gs = h.groups([1, 2], 3)
    assert gs[0] == GroupSpec(1, 3, (400, 400, 400))
