"""The continuous-batching instance model (runtime/sim/instance.py), alone, in simulated time.

Most tests use a flat cost model (every decode step takes ``A`` seconds whatever runs), so that
finish times are sums a reader can check by hand; one checks the closed form of the real cost
model. The model is driven like the simulator drives it: messages at chosen times, and in
between, to each ``next_event``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from runtime.protocol import (
    AbortGroups,
    Generate,
    GroupAborted,
    GroupDone,
    PartialSample,
    PauseWorker,
    ResumeWorker,
    Shutdown,
    UpdateWeights,
    WorkerAck,
)
from runtime.scheduler.cost_model import CostModel
from runtime.sim.instance import InstanceModel, TableOutputs
from runtime.tasks.sim_task import SYNTHETIC_VOCAB, sim_reward

A = 0.01
"""Seconds per decode step under FLAT."""
FLAT = CostModel(
    step_base_s=A,
    step_per_seq_s=0.0,
    step_per_ctx_token_s=0.0,
    prefill_per_token_s=1e-3,
    weight_sync_s=0.3,
)


def model(
    lengths: dict[int, list[int]],
    prompt_tokens: dict[int, int] | None = None,
    max_num_seqs: int = 16,
    cost: CostModel = FLAT,
    policy: str = "fcfs",
    **kwargs: Any,
) -> InstanceModel:
    outputs = TableOutputs(lengths, prompt_tokens, **kwargs)
    instance = InstanceModel(0, max_num_seqs, cost, outputs, scheduling_policy=policy)
    instance.start(0.0)
    return instance


def generate(
    group_id: int, prompt_id: int, n: int, max_tokens: int = 100_000, **fields: Any
) -> Generate:
    return Generate(
        group_id=group_id,
        prompt_id=prompt_id,
        prompt_token_ids=np.zeros(0, dtype=np.int32),
        n=n,
        max_tokens=max_tokens,
        **fields,
    )


def drive(
    instance: InstanceModel,
    events: dict[float, Any] | None = None,
    interrupts: list[float] | None = None,
) -> list[tuple[float, Any]]:
    """Run to quiescence: to each next event, each interrupt (a wake-up with nothing to do) and
    each scheduled message (a list of messages for one time is allowed). Returns (time, output)
    pairs."""
    events = dict(events or {})
    pending = sorted((interrupts or []) + list(events))
    out: list[tuple[float, Any]] = []
    now = 0.0
    while True:
        nxt = instance.next_event(now)
        now = pending.pop(0) if pending and pending[0] <= nxt else nxt
        if now == math.inf:
            return out
        instance.advance(now)
        messages = events.pop(now, [])
        for message in messages if isinstance(messages, list) else [messages]:
            instance.handle(message, now)
        out += [(now, m) for m in instance.take_output()]


def done(out: list[tuple[float, Any]]) -> dict[int, GroupDone]:
    return {m.group_id: m for _, m in out if isinstance(m, GroupDone)}


def acks(out: list[tuple[float, Any]]) -> list[tuple[float, str, bool]]:
    return [(t, m.request, m.ok) for t, m in out if isinstance(m, WorkerAck)]


def test_a_single_sequence_finishes_at_the_closed_form_decode_sum() -> None:
    cost = CostModel()
    prompt, length = 700, 1234
    want = cost.prefill_s(prompt) + cost.decode_steps_s(length, 1, prompt)
    for interrupts in ([], [0.5, 1.25, 3.0, want - 1e-4]):
        instance = model({5: [length]}, {5: prompt}, cost=cost)
        instance.handle(generate(0, 5, 1), 0.0)
        (group,) = done(drive(instance, interrupts=interrupts)).values()
        assert group.finished_at == pytest.approx(want, abs=1e-9)
        assert group.started_at == 0.0
        assert instance.tokens_generated == length


def test_a_group_s_first_admission_stalls_the_whole_batch_for_its_prefill() -> None:
    instance = model({0: [100], 1: [500]}, {0: 1000, 1: 5000})
    instance.handle(generate(0, 0, 1), 0.0)
    # Group 1 arrives mid-step, after group 0's 1 s prefill and 50.5 of its decode steps.
    out = drive(instance, events={1.505: generate(1, 1, 1)})
    groups = done(out)
    # Group 0: 1 s prefill, 100 steps, and group 1's 5 s prefill in between (its partial step
    # is carried over the stall, not lost).
    assert groups[0].finished_at == pytest.approx(1.0 + 100 * A + 5.0)
    assert groups[1].started_at == pytest.approx(1.505)
    # Group 1 joins the step in progress (the model's resolution is one step): its 500 steps
    # end 500 A after that step began, plus its own prefill.
    assert groups[1].finished_at == pytest.approx(1.5 + 5.0 + 500 * A)


def test_prefill_is_paid_once_per_group_not_per_sample() -> None:
    instance = model({0: [10, 20, 30]}, {0: 2000})
    instance.handle(generate(0, 0, 3), 0.0)
    (group,) = done(drive(instance)).values()
    assert [c.finished_at for c in group.completions] == pytest.approx(
        [2.0 + 10 * A, 2.0 + 20 * A, 2.0 + 30 * A]
    )


def test_continuous_batching_never_runs_more_than_max_num_seqs() -> None:
    instance = model({0: [10] * 6, 1: [5, 5]}, max_num_seqs=4)
    instance.handle(generate(0, 0, 6), 0.0)
    instance.handle(generate(1, 1, 2), 0.0)
    assert (instance.running_seqs, instance.queued_seqs) == (4, 4)
    seen: list[int] = []
    now = 0.0
    while (now := instance.next_event(now)) < math.inf:
        instance.advance(now)
        seen.append(instance.running_seqs)
    assert max(seen) <= 4 and instance.queued_seqs == 0
    groups = {m.group_id: m for m in instance.take_output() if isinstance(m, GroupDone)}
    # Samples 0-3 of group 0 take the slots at t=0; 4-5 take two of them at 10 A, group 1
    # the other two (queued sequences take free slots in arrival order).
    assert [c.finished_at for c in groups[0].completions] == pytest.approx(
        [10 * A] * 4 + [20 * A] * 2
    )
    assert groups[1].started_at == pytest.approx(10 * A)
    assert [c.finished_at for c in groups[1].completions] == pytest.approx([15 * A] * 2)


def test_boundary_update_waits_for_in_flight_work_and_keep_freezes_it() -> None:
    # Boundary: group 0 (in flight) finishes on v0; then the load; then group 1, sent meanwhile.
    instance = model({0: [200], 1: [50]})
    instance.handle(generate(0, 0, 1), 0.0)
    out = drive(
        instance,
        events={
            0.505: UpdateWeights(version=1, path="v1", mode="boundary"),
            0.6: generate(1, 1, 1),
        },
    )
    groups = done(out)
    assert (groups[0].completions[0].version_min, groups[0].completions[0].version_max) == (0, 0)
    assert groups[0].finished_at == pytest.approx(200 * A)
    assert acks(out) == [(pytest.approx(200 * A + 0.3), "update_weights", True)]
    assert groups[1].started_at == pytest.approx(200 * A + 0.3)
    assert (groups[1].completions[0].version_min, groups[1].completions[0].version_max) == (1, 1)

    # Keep: group 0 freezes in place (its partial step too), loads v1 and finishes on it,
    # exactly weight_sync_s late.
    instance = model({0: [200]})
    instance.handle(generate(0, 0, 1), 0.0)
    out = drive(instance, events={0.505: UpdateWeights(version=1, path="v1", mode="keep")})
    (group,) = done(out).values()
    assert (group.completions[0].version_min, group.completions[0].version_max) == (0, 1)
    assert group.finished_at == pytest.approx(200 * A + 0.3)
    assert acks(out) == [(pytest.approx(0.805), "update_weights", True)]
    assert instance.version == 1


def test_updates_refused_by_the_weight_check_change_nothing() -> None:
    outputs = TableOutputs({0: [10]})
    instance = InstanceModel(0, 4, FLAT, outputs, check_weights=lambda v, p: f"no {p}")
    instance.start(0.0)
    instance.handle(UpdateWeights(version=3, path="x", mode="keep"), 0.0)
    instance.handle(UpdateWeights(version=3, path="y", mode="sideways"), 0.0)
    details = [(m.ok, m.detail) for m in instance.take_output()]
    assert details == [(False, "no x"), (False, "mode 'sideways' is not one of boundary, keep")]
    assert instance.version == 0 and instance.next_event(0.0) == math.inf


def test_keep_pause_freezes_in_flight_work_for_exactly_the_pause() -> None:
    instance = model({0: [300, 100]})
    instance.handle(generate(0, 0, 2), 0.0)
    out = drive(
        instance,
        events={0.555: PauseWorker(mode="keep"), 8.055: ResumeWorker()},
        interrupts=[1.0, 4.0],
    )
    (group,) = done(out).values()
    assert [c.finished_at for c in group.completions] == pytest.approx([10.5, 8.5])
    assert [(r, ok) for _, r, ok in acks(out)] == [("pause", True), ("resume", True)]


def test_wait_pause_stops_admitting_and_acks_when_the_running_finish() -> None:
    instance = model({0: [100], 1: [100]}, max_num_seqs=1)
    instance.handle(generate(0, 0, 1), 0.0)
    instance.handle(generate(1, 1, 1), 0.0)  # queued behind group 0
    out = drive(instance, events={0.2: PauseWorker(mode="wait"), 5.0: ResumeWorker()})
    groups = done(out)
    assert acks(out)[0] == (pytest.approx(100 * A), "pause", True)
    assert groups[0].finished_at == pytest.approx(100 * A)
    # Group 1 waited for the resume.
    assert groups[1].started_at == pytest.approx(5.0)
    assert groups[1].finished_at == pytest.approx(5.0 + 100 * A)


def test_abort_pause_aborts_everything_and_the_instance_takes_work_after_resume() -> None:
    instance = model({0: [100], 1: [100], 2: [10]}, max_num_seqs=1)
    instance.handle(generate(0, 0, 1), 0.0)
    instance.handle(generate(1, 1, 1), 0.0)
    out = drive(
        instance, events={0.2: PauseWorker(mode="abort"), 1.0: [ResumeWorker(), generate(2, 2, 1)]}
    )
    aborted = [(m.group_id, m.reason) for _, m in out if isinstance(m, GroupAborted)]
    assert aborted == [(0, "paused"), (1, "paused")]
    assert list(done(out)) == [2] and done(out)[2].finished_at == pytest.approx(1.0 + 10 * A)
    assert (instance.running_seqs, instance.queued_seqs, instance.groups_in_flight) == (0, 0, 0)
    # Aborted work counts the tokens it generated (0.2 s = 20 steps of group 0), no more.
    assert instance.tokens_generated == 20 + 10


def test_abort_frees_the_slots_for_queued_work() -> None:
    instance = model({0: [1000, 1000], 1: [30, 30]}, max_num_seqs=2)
    instance.handle(generate(0, 0, 2), 0.0)
    instance.handle(generate(1, 1, 2), 0.0)
    out = drive(instance, events={0.5: AbortGroups(group_ids=[0, 99])})
    assert [m.group_id for _, m in out if isinstance(m, GroupAborted)] == [0]
    (group,) = done(out).values()
    assert group.group_id == 1 and group.started_at == pytest.approx(0.5)
    assert group.finished_at == pytest.approx(0.5 + 30 * A)
    assert instance.running_seqs == 0


def test_light_payloads_have_the_capped_lengths_and_share_one_buffer() -> None:
    instance = model({7: [50, 400, 3, 0]})
    instance.handle(generate(0, 7, 6, max_tokens=100), 0.0)  # n > table: it cycles
    (group,) = done(drive(instance)).values()
    assert [len(c.token_ids) for c in group.completions] == [50, 100, 3, 1, 50, 100]
    assert [len(c.logprobs) for c in group.completions] == [50, 100, 3, 1, 50, 100]
    assert [c.finish_reason for c in group.completions] == ["stop", "length"] + ["stop"] * 3 + [
        "length"
    ]
    first, second = group.completions[0].token_ids, group.completions[1].token_ids
    assert np.shares_memory(first, second) and not first.flags.writeable
    # Rewards are sim_reward's, keyed by the prompt id and the version that sampled.
    assert [c.reward for c in group.completions] == [
        sim_reward(7, 0, j, 0, truncated)
        for j, truncated in enumerate([False, True, False, False, False, True])
    ]


def test_random_payloads_are_deterministic_token_ids_and_logprobs() -> None:
    def run() -> GroupDone:
        instance = model({3: [20, 40]}, payload="random", reward=None)
        instance.handle(generate(9, 3, 2), 0.0)
        (group,) = done(drive(instance)).values()
        return group

    one, two = run(), run()
    for a, b in zip(one.completions, two.completions, strict=True):
        assert np.array_equal(a.token_ids, b.token_ids)
        assert ((a.token_ids >= 4) & (a.token_ids < SYNTHETIC_VOCAB)).all()
        assert (a.logprobs <= 0).all() and a.reward == 0.0
    assert [len(c.token_ids) for c in one.completions] == [20, 40]


def test_timestamps_come_from_the_injected_stamp() -> None:
    instance = InstanceModel(2, 4, FLAT, TableOutputs({0: [10]}), stamp=lambda s: 1000.0 + s)
    instance.start(0.0)
    instance.handle(generate(0, 0, 1), 0.0)
    (group,) = done(drive(instance)).values()
    assert (group.started_at, group.finished_at) == pytest.approx((1000.0, 1000.0 + 10 * A))
    hello = instance.hello()
    assert (hello.instance_id, hello.max_num_seqs, hello.backend) == (2, 4, "sim")
    beat = instance.heartbeat(2.0)
    assert (beat.instance_id, beat.time, beat.state, beat.tokens_generated) == (
        2,
        1002.0,
        "running",
        10,
    )


def test_edge_messages() -> None:
    instance = model({0: [10]})
    assert instance.next_event(0.0) == math.inf  # idle: nothing happens on its own
    instance.handle(generate(0, 0, 0), 0.0)
    assert instance.has_output()
    (empty,) = instance.take_output()
    assert not instance.has_output()
    assert isinstance(empty, GroupDone) and empty.completions == []
    with pytest.raises(ValueError, match="prompt_id 5 has no lengths"):
        instance.handle(generate(1, 5, 1), 0.0)
    instance.handle(Shutdown(reason="test"), 0.0)
    assert instance.closed


def test_the_priority_policy_admits_the_lowest_priority_value_first_and_ties_in_order() -> None:
    lengths = {0: [100], 1: [10], 2: [10], 3: [10]}
    sent = {
        0.0: generate(0, 0, 1),  # takes the only slot
        0.1: generate(1, 1, 1, priority=5),
        0.2: generate(2, 2, 1, priority=1),
        0.3: generate(3, 3, 1, priority=1),
    }
    order = {}
    for policy in ("priority", "fcfs"):
        instance = model(lengths, max_num_seqs=1, policy=policy)
        out = drive(instance, events=dict(sent))
        order[policy] = [m.group_id for _, m in out if isinstance(m, GroupDone)]
    assert order["priority"] == [0, 2, 3, 1]
    assert order["fcfs"] == [0, 1, 2, 3]  # priorities ignored, as vLLM's fcfs
    with pytest.raises(ValueError, match="scheduling_policy"):
        model(lengths, policy="sjf")


def _partial_of(out: list[tuple[float, Any]], group_id: int) -> list[PartialSample]:
    (aborted,) = [m for _, m in out if isinstance(m, GroupAborted) and m.group_id == group_id]
    assert aborted.partial is not None
    return aborted.partial


def test_a_migrated_group_continues_its_partial_output_on_another_instance() -> None:
    table = {3: [20, 40, 500]}
    whole = model(table, payload="random", reward=None)
    whole.handle(generate(9, 3, 3, max_tokens=300), 0.0)
    (uninterrupted,) = done(drive(whole)).values()

    first = model(table, payload="random", reward=None)
    first.handle(generate(9, 3, 3, max_tokens=300), 0.0)
    out = drive(first, events={25.5 * A: AbortGroups(group_ids=[9], partial=True)})
    assert not done(out) and first.running_seqs == 0
    partial = _partial_of(out, 9)
    assert [len(p.token_ids) for p in partial] == [20, 25, 25]
    assert [p.finish_reason for p in partial] == ["stop", "abort", "abort"]
    assert partial[0].finished_at == pytest.approx(20 * A)
    for p, c in zip(partial, uninterrupted.completions, strict=True):
        assert np.array_equal(p.token_ids, c.token_ids[: len(p.token_ids)])
        assert np.array_equal(p.logprobs, c.logprobs[: len(p.logprobs)])

    # Elsewhere, at weight version 2: only the rest is generated, and it is what the group
    # would have generated had it never stopped (same group id, same payload).
    second = model(table, {3: 1000}, payload="random", reward=None)
    second.version = 2
    second.handle(generate(9, 3, 3, max_tokens=300, prefix=partial), 0.0)
    (group,) = done(drive(second)).values()
    assert second.tokens_generated == (40 - 25) + (300 - 25)
    completions = group.completions
    assert [len(c.token_ids) for c in completions] == [20, 40, 300]
    assert [c.finish_reason for c in completions] == ["stop", "stop", "length"]
    for c, u in zip(completions, uninterrupted.completions, strict=True):
        assert np.array_equal(c.token_ids, u.token_ids) and np.array_equal(c.logprobs, u.logprobs)
    assert [(c.version_min, c.version_max) for c in completions] == [(0, 0), (0, 2), (0, 2)]
    # The finished sample keeps its time; the others pay the prefill of prompt + prefixes.
    stall = FLAT.prefill_s(1000 + 25 + 25)
    assert [c.finished_at for c in completions] == pytest.approx(
        [20 * A, stall + 15 * A, stall + 275 * A]
    )


def test_partial_outputs_of_queued_groups_and_prefixes_with_nothing_left() -> None:
    instance = model({0: [100], 1: [10, 10]}, max_num_seqs=1, payload="random", reward=None)
    instance.handle(generate(0, 0, 1), 0.0)
    instance.handle(generate(1, 1, 2, priority=3), 0.0)
    out = drive(instance, events={5 * A: AbortGroups(group_ids=[1], partial=True)})
    queued = _partial_of(out, 1)
    assert [len(p.token_ids) for p in queued] == [0, 0]
    assert [p.finish_reason for p in queued] == ["abort", "abort"]
    assert [m.group_id for _, m in out if isinstance(m, GroupDone)] == [0]

    # Every sample complete, or with no max_tokens left: done at once, nothing generated.
    ids, lp = np.arange(4, 9, dtype=np.int32), np.full(5, -0.5, dtype=np.float32)
    full = [
        PartialSample(token_ids=ids, logprobs=lp, version_min=1, version_max=1,
                      finish_reason="stop", finished_at=7.0),
        PartialSample(token_ids=ids, logprobs=lp, version_min=1, version_max=2),
    ]  # fmt: skip
    before = instance.tokens_generated
    instance.handle(generate(2, 1, 2, max_tokens=5, prefix=full), 1.0)
    (group,) = done([(1.0, m) for m in instance.take_output()]).values()
    assert instance.tokens_generated == before
    assert [c.finish_reason for c in group.completions] == ["stop", "length"]
    assert [(c.version_min, c.version_max) for c in group.completions] == [(1, 1), (1, 2)]
    assert all(np.array_equal(c.token_ids, ids) for c in group.completions)

    # A prefix list that does not fit the group is refused, as the worker's engine does.
    instance.handle(generate(3, 1, 2, prefix=full[:1]), 1.0)
    (refused,) = instance.take_output()
    assert isinstance(refused, GroupAborted) and "1 prefixes for a group of n = 2" in refused.reason
    # A plain abort reports no partial output.
    instance.handle(generate(4, 1, 2), 1.0)
    instance.handle(AbortGroups(group_ids=[4]), 1.0)
    aborted = [m for m in instance.take_output() if isinstance(m, GroupAborted)]
    assert [(m.group_id, m.partial) for m in aborted] == [(4, None)]
