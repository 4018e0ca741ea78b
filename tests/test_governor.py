"""The lag governor alone: property tests over random completion orders and timings, plus the
hand-checked cases of each rule (runtime/controller/governor.py docstring)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.controller.governor import LagGovernor, LagRecorder


@dataclass
class SimInstance:
    version: int = 0
    in_flight: list[int] = field(default_factory=list)


def run_random(
    seed: int,
    *,
    eta: int,
    mode: str,
    batch: int,
    instances: int,
    slots: int,
    changes: dict[int, int],
    steps: int = 12,
    lossy: bool = True,
    skew_version_min: bool = False,
) -> tuple[LagGovernor, list[tuple[int, int, int]]]:
    """Drive a governor with a random environment until ``steps`` steps were taken.

    Returns the governor and (step, lag, bound in force) for every consumed group.
    """
    rng = random.Random(seed)
    gov = LagGovernor(batch, eta, max_lag_bound=4, on_lag_decrease=mode)
    insts = [SimInstance() for _ in range(instances)]
    start_of: dict[int, int] = {}
    consumed: list[tuple[int, int, int]] = []
    seen: set[int] = set()
    next_gid = 0
    stepping = False
    ticks = 0
    applied: set[int] = set()
    while gov.version < steps:
        ticks += 1
        assert ticks < 20_000, f"no progress: v{gov.version}, plan {gov.plan_batch()}"
        if gov.version in changes and gov.version not in applied and not stepping:
            applied.add(gov.version)
            gov.set_lag_bound(changes[gov.version])
        action = rng.random()
        if action < 0.35:  # dispatch to a random instance
            inst = rng.choice(insts)
            if len(inst.in_flight) < slots and gov.admissible(inst.version) > 0:
                gov.admit(next_gid, next_gid % 50, inst.version)
                start_of[next_gid] = inst.version
                inst.in_flight.append(next_gid)
                next_gid += 1
        elif action < 0.7:  # a random in-flight group finishes (any order)
            busy = [i for i in insts if i.in_flight]
            if busy:
                inst = rng.choice(busy)
                gid = inst.in_flight.pop(rng.randrange(len(inst.in_flight)))
                vmin = start_of[gid]
                if skew_version_min and rng.random() < 0.1:
                    vmin = max(0, vmin - 1)  # a worker reporting an older version than dispatch
                gov.complete(gid, vmin, max(vmin, inst.version))
        elif action < 0.85:  # trainer
            if stepping:
                gov.step_done(gov.version + 1)
                stepping = False
            else:
                bound = gov.lag_bound  # the bound in force while this batch is formed
                plan = gov.take_batch()
                if plan.ready:
                    assert len(plan.group_ids) == batch
                    for gid in plan.group_ids:
                        assert gid not in seen, f"group {gid} consumed twice"
                        seen.add(gid)
                        consumed.append((plan.version, gov.lag_of(gid), bound))
                        assert gov.lag_of(gid) <= bound
                    gov.forget(plan.group_ids)
                    stepping = True
        elif action < 0.97:  # a weight sync reaches a random instance
            rng.choice(insts).version = gov.version
        elif lossy:  # an instance is lost: its in-flight groups go back
            inst = rng.choice(insts)
            for gid in inst.in_flight:
                gov.cancel(gid)
            inst.in_flight.clear()
            inst.version = gov.version
        c = gov.counters
        open_now = gov.in_flight + gov.queued
        assert c.admitted == c.consumed + c.discarded + c.aborted + c.requeued + open_now
    return gov, consumed


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    eta=st.sampled_from([0, 1, 2]),
    mode=st.sampled_from(["wait", "abort"]),
    batch=st.integers(1, 4),
    instances=st.integers(1, 3),
    slots=st.integers(1, 4),
)
def test_fixed_bound_is_never_exceeded(seed, eta, mode, batch, instances, slots):
    gov, consumed = run_random(
        seed, eta=eta, mode=mode, batch=batch, instances=instances, slots=slots, changes={}
    )
    assert consumed, "the run consumed nothing"
    assert max(lag for _, lag, _ in consumed) <= eta
    assert gov.version == 12


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    mode=st.sampled_from(["wait", "abort"]),
    batch=st.integers(1, 4),
    instances=st.integers(1, 3),
    slots=st.integers(1, 4),
    skew=st.booleans(),
)
def test_live_change_2_0_1_never_exceeds_bound_in_force(seed, mode, batch, instances, slots, skew):
    _gov, consumed = run_random(
        seed,
        eta=2,
        mode=mode,
        batch=batch,
        instances=instances,
        slots=slots,
        changes={4: 0, 8: 1},
        steps=14,
        skew_version_min=skew,
    )
    for _step, lag, bound in consumed:
        assert lag <= bound
    # After the decrease to 0 took effect, and before the raise to 1, lag 0 only.
    late = [lag for step, lag, _ in consumed if step >= 12]
    assert late and max(late) <= 1


def make(batch=2, eta=1, mode="wait") -> LagGovernor:
    return LagGovernor(batch, eta, max_lag_bound=4, on_lag_decrease=mode)


def test_admission_rule_counts_and_staleness():
    gov = make(batch=2, eta=1)
    assert gov.admissible(0) == 4  # (0 + 1 + 1) * 2
    for gid in range(4):
        gov.admit(gid, gid, 0)
    assert gov.admissible(0) == 0
    assert "admission full" in (gov.refusal(0) or "")
    gov.complete(0, 0, 0)
    gov.complete(1, 0, 0)
    plan = gov.take_batch()
    assert plan.ready and plan.group_ids == (0, 1)
    # While the trainer steps on v0 the next consumption is v1: v0 weights are still fine at η=1.
    assert gov.refusal(0) is not None  # count: 4 live admitted >= (0 + 2) * 2
    gov.step_done(1)
    assert gov.admissible(1) == 2
    # An instance two versions behind may not take work at η=1 once v2 is next.
    gov.complete(2, 0, 0)
    gov.complete(3, 0, 0)
    gov.take_batch()
    gov.step_done(2)
    assert "too old" in (gov.refusal(0) or "")
    assert gov.admissible(1) > 0


def test_eta0_is_synchronous():
    gov = make(batch=2, eta=0)
    gov.admit(0, 0, 0)
    gov.admit(1, 1, 0)
    assert gov.admissible(0) == 0
    gov.complete(1, 0, 0)
    assert gov.take_batch().condition == "lag_wait"
    gov.complete(0, 0, 0)
    assert gov.take_batch().ready
    assert gov.admissible(0) == 0  # nothing may start on v0 weights while step 0 runs
    gov.step_done(1)
    assert gov.admissible(0) == 0 and gov.admissible(1) == 2


def test_oldest_first_and_mandatory_wait():
    gov = make(batch=2, eta=1)
    gov.admit(0, 0, 0)
    gov.admit(1, 1, 0)
    gov.admit(2, 2, 0)
    gov.complete(0, 0, 0)
    gov.complete(1, 0, 0)
    gov.take_batch()
    gov.step_done(1)
    gov.admit(3, 3, 1)
    gov.admit(4, 4, 1)
    gov.complete(3, 1, 1)
    gov.complete(4, 1, 1)
    # Group 2 (start 0) must be in the step at v1 (lag 1); it is still in flight: wait.
    plan = gov.take_batch()
    assert plan.condition == "lag_wait" and plan.waiting_for == (2,)
    gov.complete(2, 0, 0)
    plan = gov.take_batch()
    assert plan.group_ids == (2, 3)
    assert [gov.lag_of(g) for g in plan.group_ids] == [1, 0]


def test_excess_mandatory_groups_are_discarded_not_dropped():
    gov = make(batch=2, eta=2, mode="wait")
    for gid in range(6):
        gov.admit(gid, gid, 0)
    for gid in range(6):
        gov.complete(gid, 0, 0)
    gov.take_batch()
    gov.step_done(1)
    gov.take_batch()
    gov.step_done(2)
    # Two groups of v0 left; lower to 0 in wait mode: pending until they drain.
    change = gov.set_lag_bound(0)
    assert change.pending == 0 and gov.lag_bound == 2
    plan = gov.take_batch()
    assert plan.ready and set(plan.group_ids) == {4, 5}
    gov.step_done(3)
    assert gov.lag_bound == 0 and gov.pending_lag_bound is None


def test_abort_mode_discards_and_aborts_violators():
    gov = make(batch=1, eta=2, mode="abort")
    for gid in range(3):
        gov.admit(gid, gid, 0)
    gov.complete(0, 0, 0)
    gov.complete(1, 0, 0)
    gov.take_batch()
    gov.step_done(1)
    change = gov.set_lag_bound(0)
    assert change.in_force == 0 and change.pending is None
    assert change.discarded == (1,) and change.aborted == (2,)
    assert gov.counters.discarded == 1 and gov.counters.aborted == 1
    assert gov.complete(2, 0, 0) == "ignored"  # the aborted group's late result


def test_more_than_b_mandatory_discards_excess():
    gov = make(batch=1, eta=1)
    # Force three groups of start v0 to be open at v1 by admitting while the count allows.
    gov.admit(0, 0, 0)
    gov.admit(1, 1, 0)
    gov.complete(0, 0, 0)
    gov.take_batch()
    gov.step_done(1)
    gov.admit(2, 2, 0)  # v0 weights + 1 >= next consumption v1
    gov.complete(1, 0, 0)
    gov.complete(2, 0, 0)
    plan = gov.take_batch()
    assert plan.ready and plan.group_ids == (1,) and plan.discarded == (2,)
    assert gov.counters.discarded == 1


def test_rejects_bad_bounds():
    gov = make()
    with pytest.raises(ValueError, match=r"outside 0\.\.4"):
        gov.set_lag_bound(5)
    with pytest.raises(ValueError, match="not an integer"):
        gov.set_lag_bound(True)


def test_lag_recorder_stats():
    rec = LagRecorder()
    for lag in [0, 0, 1, 2, 2, 2, 0, 1, 1, 0]:
        rec.add(lag, lag)
    stats = rec.stats()
    assert stats["max"] == 2 and stats["p95"] == 2.0
    assert stats["histogram"] == [4, 3, 3]
    assert stats["mean"] == pytest.approx(0.9)
