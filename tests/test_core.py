"""The controller core in-process: events in, actions out, on a manual clock. No sockets and no
processes; the instances and the trainer are scripted by the test (:class:`Cluster`), so every
rule can be checked after every event. The wiring is tested with real processes elsewhere
(test_controller.py, test_sim_backend_controller.py)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime import protocol as P
from runtime.config import load_config
from runtime.controller import actions as A
from runtime.controller.core import ControllerCore
from runtime.controller.governor import CONSUMED
from runtime.controller.instances import DOWN, PAUSED, RUNNING
from runtime.controller.ledger import Ledger, MemoryRecords, verify_records
from runtime.controller.work import WorkQueue, load_task
from runtime.scheduler import make_scheduler
from runtime.scheduler.cost_model import CostModel

SIM_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "sim-8.yaml"
_TASKS: dict[int, object] = {}


class Cluster:
    """A scripted cluster around one core: what was sent to each instance and to the trainer."""

    def __init__(
        self,
        *,
        eta: int = 1,
        instances: int = 3,
        batch: int = 4,
        slots: int = 4,
        mode: str = "wait",
        steps: int = 1000,
        prompts: int = 64,
        policy: str = "fifo",
        seen_lengths: dict[int, list[int]] | None = None,
    ) -> None:
        self.config = load_config(
            SIM_CONFIG,
            [
                f"rollout.instances={instances}",
                f"rollout.max_num_seqs={slots * 2}",
                "rollout.sampling.n=2",
                f"trainer.batch_groups={batch}",
                f"trainer.steps={steps}",
                f"async.lag_bound={eta}",
                "async.max_lag_bound=4",
                f"async.on_lag_decrease={mode}",
                f"task.num_prompts={prompts}",
                f"scheduler.policy={policy}",
            ],
        )
        if prompts not in _TASKS:
            _TASKS[prompts] = load_task(self.config)
        task = _TASKS[prompts]
        if seen_lengths is not None:  # a task of its own, whose length history predicts these
            task = load_task(self.config)
            for prompt_id, lengths in seen_lengths.items():
                task.lengths.observe(prompt_id, lengths)
        self.now = 0.0
        self.ledger = MemoryRecords()
        self.core = ControllerCore(
            self.config,
            task,  # type: ignore[arg-type]
            clock=lambda: self.now,
            ledger=Ledger(self.ledger),
            make_scheduler=make_scheduler,
            plan_inline=True,
        )
        # What each instance runs: group id -> (request, the weight version it started at).
        self.running: dict[int, dict[int, tuple[P.Generate, int]]] = {
            i: {} for i in range(instances)
        }
        self.version = {i: -1 for i in range(instances)}
        self.moving: dict[int, dict[int, tuple[P.Generate, int]]] = {
            i: {} for i in range(instances)
        }
        """Groups aborted with ``partial`` (to migrate), until ``confirm_moves``."""
        self.updates: dict[int, int] = {}
        self.to_trainer: list[object] = []
        self.published: list[P.Event] = []
        self.replies: list[P.CommandReply] = []
        self.lags: list[tuple[int, int]] = []  # (lag, bound in force) of every consumed group
        self.stop: A.StopRequested | None = None
        self.records: list[dict] = []
        """metrics.jsonl lines, step records among them."""
        self.longest: Callable[[int], int] | None = None
        """The longest sample ``finish`` makes for a group id (None: a few tokens each)."""
        self.apply(self.core.start())

    # --- plumbing -----------------------------------------------------------------------------
    def apply(self, actions: list[A.Action]) -> None:
        for action in actions:
            if isinstance(action, A.SendToInstance):
                self._to_instance(action.instance_id, action.message)
            elif isinstance(action, A.SendToTrainer):
                self.to_trainer.append(action.message)
            elif isinstance(action, A.Publish):
                self.published.append(action.event)
            elif isinstance(action, A.CommandAnswered):
                self.replies.append(action.reply)
            elif isinstance(action, A.StopRequested):
                self.stop = action
            elif isinstance(action, A.Record):
                self.records.append(action.record)

    def _to_instance(self, i: int, msg: object) -> None:
        if isinstance(msg, P.Generate):
            assert msg.group_id not in self.running[i]
            self.running[i][msg.group_id] = (msg, self.version[i])
        elif isinstance(msg, P.AbortGroups):
            for gid in msg.group_ids:
                running = self.running[i].pop(gid, None)
                if msg.partial and running is not None:
                    self.moving[i][gid] = running
        elif isinstance(msg, P.UpdateWeights):
            self.updates[i] = msg.version

    def feed(self, event: A.Event) -> None:
        self.now += 0.01
        admitted = self.core.governor.counters.admitted
        self.apply(self.core.handle(event))
        self.check(admitted_now=self.core.governor.counters.admitted > admitted)

    def check(self, admitted_now: bool) -> None:
        """The governor's invariants, after every event."""
        gov = self.core.governor
        if admitted_now:
            # AReaL's rule: nothing is admitted past (v + η_adm + 1)·B (a lowered bound only
            # stops new admissions; it does not take back what was admitted).
            assert gov.admitted_live <= (gov.version + gov.admission_bound + 1) * gov.batch_groups
        for inst in self.core.instances.values():
            for gid, record in inst.in_flight.items():
                assert record.instance_id == inst.instance_id
                if not record.aborting:
                    assert gov.groups[gid] is record  # one record per group
        for lag, bound in self.lags:
            assert lag <= bound

    # --- the instances ------------------------------------------------------------------------
    def hello(self, i: int, version: int = 0) -> None:
        self.version[i] = version
        self.running[i].clear()
        self.moving[i].clear()
        hello = P.WorkerHello(
            instance_id=i, max_num_seqs=self.core.instances[i].max_num_seqs,
            weight_version=version, pid=1000 + i, backend="test",
        )  # fmt: skip
        self.feed(A.InstanceMessage(i, hello))

    def load_weights(self, i: int) -> None:
        version = self.updates.pop(i)
        self.version[i] = version
        ack = P.WorkerAck(instance_id=i, request="update_weights", ok=True, weight_version=version)
        self.feed(A.InstanceMessage(i, ack))

    def finish(self, i: int, gid: int) -> None:
        request, started_at = self.running[i].pop(gid)
        prefix = request.prefix or [_empty_partial(started_at)] * request.n
        sizes = [len(p.token_ids) + 3 + k for k, p in enumerate(prefix)]
        if self.longest is not None:
            sizes = [size + self.longest(gid) - max(sizes) for size in sizes]
        completions = [
            P.Completion(
                token_ids=np.zeros(size, dtype=np.int32),
                logprobs=np.zeros(size, np.float32),
                version_min=p.version_min if len(p.token_ids) else started_at,
                version_max=self.version[i], finish_reason="stop", reward=1.0,
                finished_at=self.now,
            )
            for p, size in zip(prefix, sizes, strict=True)
        ]  # fmt: skip
        done = P.GroupDone(
            group_id=gid, prompt_id=request.prompt_id, instance_id=i, completions=completions,
            started_at=self.now, finished_at=self.now,
        )  # fmt: skip
        self.feed(A.InstanceMessage(i, done))

    def confirm_moves(self) -> None:
        """Every instance answers its migration aborts: two tokens made per sample."""
        for i, moving in self.moving.items():
            for gid, (request, started_at) in list(moving.items()):
                del moving[gid]
                partial = [_partial(started_at, 2)] * request.n
                msg = P.GroupAborted(group_id=gid, instance_id=i, reason="asked", partial=partial)
                self.feed(A.InstanceMessage(i, msg))

    def confirm_aborts(self) -> None:
        for i, inst in self.core.instances.items():
            for gid in [g for g, r in inst.in_flight.items() if r.aborting]:
                msg = P.GroupAborted(group_id=gid, instance_id=i, reason="asked")
                self.feed(A.InstanceMessage(i, msg))

    # --- the trainer --------------------------------------------------------------------------
    def trainer_hello(self) -> None:
        self.feed(A.TrainerMessage(P.TrainerHello(num_processes=1, weight_version=0, pid=1)))

    def request_batch(self) -> None:
        self.feed(A.TrainerMessage(P.BatchRequest(version=self.core.governor.version)))

    def batch(self) -> P.Batch | None:
        batches = [m for m in self.to_trainer if isinstance(m, P.Batch)]
        return batches[-1] if batches else None

    def step(self) -> None:
        """The trainer finishes the batch it has, and asks for the next."""
        batch = self.batch()
        assert batch is not None
        self.to_trainer.clear()
        bound = self.core.trainer.batch_bound
        for group in batch.groups:
            self.lags.append((batch.version - min(c.version_min for c in group.completions), bound))
        metrics = P.StepMetrics(loss=0.0, reward_mean=1.0, samples=8, tokens=32)
        done = P.StepDone(version=batch.version + 1, weights_path="w", metrics=metrics)
        self.feed(A.TrainerMessage(done))
        self.request_batch()

    def command(self, name: str, **args: object) -> P.CommandReply:
        command = P.COMMAND_BY_NAME[name](request_id=len(self.replies), **args)
        self.feed(A.OperatorCommand(command))
        return self.replies[-1]

    def dispatched(self) -> int:
        return sum(1 for r in self.ledger.records if r["event"] == "dispatched")


def _partial(version: int, tokens: int) -> P.PartialSample:
    return P.PartialSample(
        token_ids=np.full(tokens, 7, np.int32), logprobs=np.full(tokens, -0.5, np.float32),
        version_min=version, version_max=version,
    )  # fmt: skip


def _empty_partial(version: int) -> P.PartialSample:
    return _partial(version, 0)


def started(cluster: Cluster) -> Cluster:
    for i in cluster.core.instances:
        cluster.hello(i)
    cluster.trainer_hello()
    cluster.request_batch()
    return cluster


def drive(cluster: Cluster, rng: random.Random, steps: int) -> None:
    """Finish groups in a random order and step whenever a batch is out, until ``steps``."""
    target = cluster.core.governor.version + steps
    for _ in range(10_000):
        if cluster.core.governor.version >= target:
            return
        if cluster.batch() is not None and rng.random() < 0.5:
            cluster.step()
            continue
        for i in list(cluster.updates):
            cluster.load_weights(i)
        out = [(i, gid) for i, groups in cluster.running.items() for gid in groups]
        if out:
            cluster.finish(*rng.choice(out))
        elif cluster.batch() is not None:
            cluster.step()
    raise AssertionError("the run did not advance")


@pytest.mark.parametrize("eta", [0, 1, 2, 3])
def test_admission_at_every_bound(eta: int) -> None:
    cluster = started(Cluster(eta=eta, instances=3, batch=4, slots=4))
    rng = random.Random(eta)
    gov = cluster.core.governor
    for _ in range(6):
        # Admission never passes (v + η + 1)·B while no batch is out.
        if not gov.outstanding:
            assert gov.admitted_live <= (gov.version + eta + 1) * 4
        drive(cluster, rng, 1)
    assert gov.version == 6
    assert cluster.lags and max(lag for lag, _ in cluster.lags) <= eta
    # Small bounds hold work back: at η = 0 the run is synchronous (nothing from v0 at v1).
    if eta == 0:
        assert {lag for lag, _ in cluster.lags} == {0}
    report = verify_records(cluster.ledger.records)
    assert report.ok, report.errors


def test_live_bound_decrease_waits_for_in_flight_work() -> None:
    cluster = started(Cluster(eta=3, instances=2, batch=2, slots=4))
    drive(cluster, random.Random(1), 3)
    reply = cluster.command("set_lag_bound", value=0)
    assert reply.ok, reply.reason
    gov = cluster.core.governor
    assert gov.admission_bound == 0
    drive(cluster, random.Random(2), 6)
    assert gov.lag_bound == 0 and gov.pending_lag_bound is None
    assert any(e.kind == P.EventKind.LAG and "now in force" in e.message for e in cluster.published)
    late = cluster.lags[-8:]
    assert all(lag == 0 for lag, _ in late), late


def test_live_bound_decrease_with_abort_regenerates() -> None:
    cluster = started(Cluster(eta=3, instances=2, batch=2, slots=4, mode="abort"))
    drive(cluster, random.Random(3), 4)
    assert cluster.command("set_lag_bound", value=0).ok
    cluster.confirm_aborts()
    drive(cluster, random.Random(4), 4)
    assert verify_records(cluster.ledger.records).ok
    assert cluster.lags[-1][0] == 0


def test_pause_stops_dispatch_to_the_instance() -> None:
    cluster = started(Cluster(eta=1, instances=2, batch=2, slots=4))
    reply = cluster.command("pause_instance", ids=[0])
    assert reply.ok, reply.reason
    assert cluster.core.instances[0].state == PAUSED
    before = set(cluster.running[0])
    drive(cluster, random.Random(5), 4)
    # Its groups stay frozen (or are released for the trainer); no new ones arrive.
    assert set(cluster.running[0]) <= before
    assert cluster.command("resume_instance", ids=[0]).ok
    assert cluster.core.instances[0].state in (RUNNING, "syncing")
    assert not cluster.command("resume_instance", ids=[0]).ok  # not paused any more


def test_instance_loss_requeues_its_groups() -> None:
    cluster = started(Cluster(eta=1, instances=3, batch=4, slots=4))
    lost = set(cluster.running[1])
    assert lost
    cluster.feed(A.ProcessExited("worker-1", -9))
    assert cluster.core.instances[1].state == DOWN
    requeued = {r["group"] for r in cluster.ledger.records if r["event"] == "requeued"}
    assert requeued == lost
    cluster.running[1].clear()
    drive(cluster, random.Random(6), 5)
    report = verify_records(cluster.ledger.records)
    assert report.ok, report.errors
    # The lost prompts were handed out again and consumed.
    prompts = {
        r["prompt"]
        for r in cluster.ledger.records
        if r["event"] == "dispatched" and r["group"] in lost
    }
    redispatched = [
        r for r in cluster.ledger.records
        if r["event"] == "dispatched" and r["prompt"] in prompts and r["group"] not in lost
    ]  # fmt: skip
    assert redispatched


def test_trainer_exit_stops_the_run() -> None:
    cluster = started(Cluster())
    cluster.feed(A.ProcessExited("trainer", 3))
    assert cluster.stop is not None and cluster.stop.code == 1
    assert cluster.core.exit_code == 1


def test_bad_command_is_refused_and_changes_nothing() -> None:
    cluster = started(Cluster(eta=1))
    reply = cluster.command("set_lag_bound", value=99)
    assert not reply.ok and "out of range" in reply.reason
    assert cluster.core.governor.lag_bound == 1


def test_a_group_migrates_with_its_partial_output() -> None:
    cluster = started(Cluster(eta=1, instances=2, batch=2, slots=4))
    core, dispatcher = cluster.core, cluster.core.dispatcher
    gid = min(cluster.running[0])
    request, _ = cluster.running[0][gid]
    assert not dispatcher.migrate(gid, 0)  # where it runs already
    assert not dispatcher.migrate(gid, 7)  # no such instance
    assert not dispatcher.migrate(10**6, 1)  # not in flight
    assert dispatcher.migrate(gid, 1, priority=-3)
    assert not dispatcher.migrate(gid, 1)  # on its way already
    cluster.apply(core.outbox.take())
    assert gid in cluster.moving[0] and gid in core.instances[0].in_flight  # slots still held
    cluster.confirm_moves()
    # Resubmitted on instance 1: the same group, prompt and seed, with the partial output.
    moved, _ = cluster.running[1][gid]
    assert (moved.prompt_id, moved.seed, moved.n, moved.priority) == (
        request.prompt_id, request.seed, request.n, -3,
    )  # fmt: skip
    assert moved.prefix is not None and [len(p.token_ids) for p in moved.prefix] == [2, 2]
    record = core.instances[1].in_flight[gid]
    assert gid not in core.instances[0].in_flight and record.instance_id == 1
    assert record is core.governor.groups[gid]
    assert dispatcher.migrated == 1
    assert any(e.kind == P.EventKind.MIGRATE for e in cluster.published)
    migrated = [r for r in cluster.ledger.records if r["event"] == "migrated"]
    assert migrated == [{"event": "migrated", "group": gid, "instance": 0, "to": 1, "tokens": 4}]
    drive(cluster, random.Random(7), 4)
    events = [r["event"] for r in cluster.ledger.records if r.get("group") == gid]
    assert events == ["dispatched", "migrated", "completed", "consumed"]
    report = verify_records(cluster.ledger.records)
    assert report.ok, report.errors


def test_a_migration_yields_to_a_finished_group_and_to_a_lost_target() -> None:
    cluster = started(Cluster(eta=1, instances=3, batch=2, slots=4))
    core, dispatcher = cluster.core, cluster.core.dispatcher
    # Finished before the abort landed: the result is taken; nothing moves.
    first = min(cluster.running[0])
    assert dispatcher.migrate(first, 1)
    cluster.finish(0, first)
    assert not cluster.moving[0] and first not in cluster.running[1]
    assert [r["event"] for r in cluster.ledger.records if r.get("group") == first] == [
        "dispatched", "completed",
    ]  # fmt: skip
    # The target is lost meanwhile: the group is re-queued, as after a plain abort.
    second = min(cluster.running[0])
    assert dispatcher.migrate(second, 2)
    cluster.apply(core.outbox.take())
    cluster.feed(A.ProcessExited("worker-2", -9))
    cluster.running[2].clear()
    cluster.confirm_moves()
    assert second not in core.governor.groups
    assert [r["event"] for r in cluster.ledger.records if r.get("group") == second] == [
        "dispatched", "aborted",
    ]  # fmt: skip
    assert not dispatcher.migrate(min(cluster.running[0]), 2)  # not running
    drive(cluster, random.Random(8), 3)
    report = verify_records(cluster.ledger.records)
    assert report.ok, report.errors


def test_a_step_record_carries_its_moves_and_the_predictors_score() -> None:
    """Deferred and migrated are per step (deltas), the run's totals are in the snapshot, and the
    plan's predicted longest samples are scored against the batch's actual ones."""
    seen = {prompt_id: [50 + 7 * prompt_id] for prompt_id in range(64)}
    cluster = started(
        Cluster(eta=1, instances=2, batch=4, slots=4, policy="asp", seen_lengths=seen)
    )
    core, dispatcher, gov = cluster.core, cluster.core.dispatcher, cluster.core.governor
    # The plan's prediction, read at dispatch: the prompt's one observed length.
    assert gov.groups
    assert all(r.predicted_longest == seen[r.prompt_id][0] for r in gov.groups.values())
    core.work.scheduler.repair = lambda view: ()  # only the moves made here
    # Every group comes back with twice its predicted longest sample: ranked right, ratio 2.
    cluster.longest = lambda gid: round(2 * gov.groups[gid].predicted_longest)
    assert dispatcher.migrate(min(cluster.running[0]), 1)
    cluster.apply(core.outbox.take())
    cluster.confirm_moves()
    assert dispatcher.defer(max(cluster.running[1]), "a straggler")
    cluster.apply(core.outbox.take())
    cluster.confirm_aborts()
    drive(cluster, random.Random(9), 2)
    steps = [r for r in cluster.records if r.get("event") == "step"]
    assert [(r["deferred"], r["migrated"]) for r in steps] == [(1, 1), (0, 0)]
    for record in steps:
        assert record["predictor_longest_rho"] == pytest.approx(1.0)
        assert record["predictor_longest_ratio"] == pytest.approx(2.0, rel=0.01)
    snap = core.snapshot()
    assert (snap.deferred_groups, snap.migrated_groups) == (1, 1)
    assert (snap.trainer.deferred, snap.trainer.migrated) == (0, 0)  # the last step's
    assert snap.trainer.predictor_longest_rho == pytest.approx(1.0)
    assert [row.lane for row in snap.instances] == [P.Lane.BULK, P.Lane.BULK]
    # The lane is the scheduler's, and crosses the wire as its word.
    core.work.scheduler.lane = lambda i: P.Lane.TAIL if i == 1 else P.Lane.BULK
    wire = msgspec.to_builtins(core.snapshot())
    assert [row.get("lane", "bulk") for row in wire["instances"]] == ["bulk", "tail"]

    # A resumed run keeps the totals, and its next step counts only its own moves.
    saved = core.saved_state()
    assert (saved.version, saved.deferred_total, saved.migrated_total) == (2, 1, 1)
    resumed = ControllerCore(
        cluster.config,
        load_task(cluster.config),
        clock=lambda: 0.0,
        ledger=Ledger(MemoryRecords()),
        saved=saved,
        make_scheduler=make_scheduler,
        plan_inline=True,
    )
    assert (resumed.snapshot().deferred_groups, resumed.snapshot().migrated_groups) == (1, 1)
    assert resumed.trainer._moves_mark == (1, 1)


def test_the_policy_is_asked_the_moment_the_trainer_starts_to_wait() -> None:
    """Whatever the policy's own schedule of looks, it sees the groups the trainer waits on when
    the wait begins (live, the batch request that finds them comes after the version change
    that the policy's schedule keys on)."""
    cluster = started(Cluster(eta=1, instances=2, batch=4, slots=4, policy="asp"))
    scheduler = cluster.core.work.scheduler
    scheduler.repair_due = lambda now, version: False
    seen: list[int] = []
    scheduler.repair = lambda view: seen.append(len(view.waiting)) or []
    drive(cluster, random.Random(3), 6)
    assert sum(seen) > 0  # without the rule: never asked


@pytest.mark.parametrize(
    ("step_s", "time_scale", "expected"),
    [(3.0, 1.0, (3.0, 3.0)), (None, 1.0, (1.0, 21.0)), (3.0, 4.0, (0.75, 0.75))],
)
def test_the_plan_uses_the_sim_trainers_step_time(step_s, time_scale, expected) -> None:
    """asp plans for the trainer that runs: the sim trainer's fixed step, else the default's
    (1 s + tokens / 48k), in wall seconds (a sim run at time_scale 4 runs 4x faster)."""
    overrides = ["task.num_prompts=16", f"rollout.sim.time_scale={time_scale}"]
    if step_s is not None:
        overrides.append(f"rollout.sim.trainer_step_s={step_s}")
    config = load_config(SIM_CONFIG, overrides)
    asked: dict[str, object] = {}
    work = WorkQueue(
        config,
        load_task(config),
        epoch=0,
        consumed=(),
        next_group_id=0,
        request_plan=None,
        make_scheduler=lambda *args, **kwargs: asked.update(kwargs),
    )
    work.plan(0, [], 1, None).make()
    cost = asked["cost_model"]
    assert (cost.trainer_step_s(0), cost.trainer_step_s(960_000)) == pytest.approx(expected)
    default = CostModel().decode_step_s(64, 6400.0)
    assert cost.decode_step_s(64, 6400.0) == pytest.approx(default / time_scale)


EVENTS = st.lists(
    st.tuples(
        st.sampled_from(
            [
                *("finish", "finish", "finish", "step", "load", "lose", "hello", "bound"),
                *("pause", "migrate", "moved"),
            ]
        ),
        st.integers(0, 10_000),
    ),
    min_size=20,
    max_size=120,
)


@settings(max_examples=40, deadline=None)
@given(events=EVENTS, eta=st.integers(0, 3), mode=st.sampled_from(["wait", "abort"]))
def test_random_event_sequences_keep_the_invariants(
    events: list[tuple[str, int]], eta: int, mode: str
) -> None:
    """Random interleavings of results, steps, weight loads, losses, restarts, bound changes
    and pauses: after every event the governor's invariants hold (``Cluster.check``), no
    consumed group exceeds the bound in force, and the ledger proves nothing was lost or
    consumed twice."""
    cluster = started(Cluster(eta=eta, instances=3, batch=3, slots=3, mode=mode))
    core = cluster.core
    for kind, k in events:
        insts = list(core.instances)
        i = insts[k % len(insts)]
        if kind == "finish":
            out = [(j, gid) for j, groups in cluster.running.items() for gid in groups]
            if out:
                cluster.finish(*out[k % len(out)])
        elif kind == "step" and cluster.batch() is not None:
            cluster.step()
        elif kind == "load" and cluster.updates:
            cluster.load_weights(sorted(cluster.updates)[k % len(cluster.updates)])
        elif kind == "lose" and core.instances[i].state != DOWN:
            cluster.feed(A.ProcessExited(f"worker-{i}", -9))
            cluster.running[i].clear()
            cluster.moving[i].clear()
            cluster.updates.pop(i, None)
        elif kind == "hello" and core.instances[i].state == DOWN:
            cluster.hello(i, version=max(0, core.governor.version - k % 2))
        elif kind == "bound":
            cluster.command("set_lag_bound", value=k % 4)
            cluster.confirm_aborts()
        elif kind == "pause":
            paused = core.instances[i].operator_paused
            cluster.command("resume_instance" if paused else "pause_instance", ids=[i])
        elif kind == "migrate":
            out = sorted((gid, j) for j, groups in cluster.running.items() for gid in groups)
            if out:
                gid, _ = out[k % len(out)]
                core.dispatcher.migrate(gid, i)
                cluster.apply(core.outbox.take())
        elif kind == "moved":
            cluster.confirm_moves()
    report = verify_records(cluster.ledger.records)
    assert report.ok, report.errors
    consumed = sum(1 for r in cluster.ledger.records if r["event"] == "consumed")
    assert consumed == core.governor.counters.consumed
    assert all(g.status != CONSUMED for g in core.governor.groups.values())
