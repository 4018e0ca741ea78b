"""The bubble definitions (runtime/bubbles.py): formulas, attribution and the accountant."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.bubbles import (
    BubbleAccountant,
    excess_sorting,
    free_slot_cause,
    padding_fraction,
    skewness_fraction,
)
from runtime.protocol import BUBBLE_CATEGORIES


def test_padding_fraction_token_form():
    assert padding_fraction([5, 5, 5]) == 0.0
    # 1 - (1 + 1 + 4) / (3 * 4) = 0.5
    assert padding_fraction([1, 1, 4]) == pytest.approx(0.5)
    assert padding_fraction([]) == 0.0


def test_skewness_fraction_over_finish_times():
    assert skewness_fraction([3.0, 3.0]) == 0.0
    # (4 - 1 + 4 - 2 + 0) / (3 * 4)
    assert skewness_fraction([1.0, 2.0, 4.0]) == pytest.approx(5 / 12)
    assert skewness_fraction([11.0, 12.0], start=10.0) == pytest.approx(0.25)


def test_free_slot_cause_rules():
    base = dict(
        pending=0,
        running=0,
        admission_open=True,
        work_elsewhere=False,
        trainer_condition="stepping",
    )
    assert free_slot_cause(**base) == "idle"
    assert free_slot_cause(**{**base, "work_elsewhere": True}) == "skewness"
    assert free_slot_cause(**{**base, "running": 3}) == "padding"
    assert free_slot_cause(**{**base, "pending": 2}) == "padding"
    assert free_slot_cause(**{**base, "pending": 2, "admission_open": False}) == "sorting"
    blocked_on_straggler = {
        **base,
        "pending": 2,
        "admission_open": False,
        "trainer_condition": "lag_wait",
    }
    assert free_slot_cause(**blocked_on_straggler) == "skewness"
    assert free_slot_cause(**{**base, "pending": 2, "held": True}) == "sorting"
    for state, cause in (("paused", "paused"), ("down", "down"), ("syncing", "sync")):
        assert free_slot_cause(**{**base, "state": state, "running": 5}) == cause


def test_accountant_slot_form_and_windows():
    acc = BubbleAccountant({0: 4, 1: 4}, now=0.0)
    acc.update(0, 0.0, active=4, cause="padding")
    acc.update(1, 0.0, active=1, cause="padding")
    acc.update(1, 5.0, active=0, cause="skewness")
    b = acc.window(10.0)
    assert b.seconds == 10.0
    # instance 0: 40 useful; instance 1: 5 useful, 15 padding, 20 skewness; of 80 slot-s
    assert b.fractions["useful"] == pytest.approx(45 / 80)
    assert b.fractions["padding"] == pytest.approx(15 / 80)
    assert b.fractions["skewness"] == pytest.approx(20 / 80)
    assert b.per_instance[1]["skewness"] == pytest.approx(0.5)
    assert b.top_cause() == "skewness"
    acc.update(0, 10.0, active=2, cause="paused")  # paused charges the whole capacity
    w = acc.window(12.0)
    assert w.seconds == pytest.approx(2.0)
    assert w.per_instance[0]["paused"] == pytest.approx(1.0)
    t = acc.total(12.0)
    assert t.seconds == 12.0
    assert sum(t.fractions.values()) == pytest.approx(1.0)
    assert set(t.fractions) == set(BUBBLE_CATEGORIES)


def test_accountant_trainer_and_instances_coming_and_going():
    acc = BubbleAccountant({0: 2}, now=0.0)
    acc.trainer_update(0.0, "stepping")
    acc.trainer_update(3.0, "starved")
    acc.trainer_update(4.0, "lag_wait")
    acc.add_instance(1, 2, now=2.0)
    acc.update(1, 2.0, active=2, cause="idle")
    acc.remove_instance(0, now=4.0)
    b = acc.total(6.0)
    assert b.trainer == pytest.approx(
        {"stepping": 0.5, "starved": 1 / 6, "lag_wait": 1 / 3, "idle": 0.0}
    )
    assert b.trainer_categories()["skewness"] == pytest.approx(1 / 3)
    # instance 0 idle 4 s x 2 slots, instance 1 useful 4 s x 2 slots
    assert b.fractions["useful"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="cause"):
        acc.update(1, 7.0, active=0, cause="bogus")
    with pytest.raises(KeyError):
        acc.update(0, 7.0, active=0, cause="idle")


def test_excess_sorting_moves_only_the_fifo_part():
    fr = {c: 0.0 for c in BUBBLE_CATEGORIES}
    fr.update(useful=0.6, sorting=0.3, idle=0.1)
    out = excess_sorting(fr, 0.2)
    assert out["sorting"] == pytest.approx(0.1)
    assert out["idle"] == pytest.approx(0.3)
    assert sum(out.values()) == pytest.approx(1.0)
    acc = BubbleAccountant({0: 1}, 0.0, sorting_baseline=0.5)
    acc.update(0, 0.0, active=0, cause="sorting")
    assert acc.total(1.0).fractions["sorting"] == pytest.approx(0.5)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 2),
            st.floats(0, 10),
            st.integers(0, 8),
            st.sampled_from(["padding", "skewness", "sorting", "sync", "paused", "down", "idle"]),
        ),
        min_size=1,
        max_size=40,
    )
)
def test_accountant_fractions_always_sum_to_one(updates):
    acc = BubbleAccountant({0: 8, 1: 4, 2: 1}, 0.0)
    now = 0.0
    for inst, dt, active, cause in updates:
        now += dt
        acc.update(inst, now, active=active, cause=cause)
    b = acc.total(now + 1.0)
    assert sum(b.fractions.values()) == pytest.approx(1.0)
    assert all(v >= -1e-12 for v in b.fractions.values())
    for per in b.per_instance.values():
        assert sum(per.values()) == pytest.approx(1.0)
