"""The simulator: a plan scored by the rules the live run enforces.

:class:`SimRun` drives the live controller's core (:class:`~runtime.controller.core.ControllerCore`:
the same dispatch, lag governor, batch forming, weight syncs and bubble accounting) with one
simulated vLLM instance per rollout instance (:class:`~runtime.sim.instance.InstanceModel`, the
model the ``sim`` backend runs too: continuous batching under the cost model, prefill stalls,
``max_num_seqs`` slots) and a simulated trainer (:class:`~runtime.sim.trainer.TrainerModel`,
``trainer_step_s`` per batch), on one simulated clock. Any plan (a ``Scheduler``) runs against
*actual* lengths, which may differ from the predicted ones.

The lag rule is the governor's (``runtime/controller/governor.py``): a group is admitted at
version v only while admitted < (v + η + 1)·B, and the step at version s waits until every group
started at a version <= s - η is in, oldest first, so no consumed group has lag > η; η = 0 is
synchronous. After each step every instance loads the new weights in ``keep`` mode: its running
samples freeze for ``weight_sync_s``. The last batch may be short when the groups do not divide
into B.

Events are the models' own (a sequence finishing: the running set only changes then, so k
decode steps have a closed form; a prefill or a load ending) and the trainer's step ends.
Bubbles are integrated by the core's ``runtime.bubbles.BubbleAccountant``.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from runtime.bubbles import Breakdown, excess_sorting
from runtime.config import Config, validate_config
from runtime.controller import actions as A
from runtime.controller.core import ControllerCore
from runtime.controller.ledger import Ledger
from runtime.controller.work import EpochPlan, TaskData
from runtime.protocol import Batch, BatchRequest, StepMetrics, TrainerHello
from runtime.scheduler.base import Defer, GroupSpec, InstanceSpec, Move, RolloutView, Scheduler
from runtime.scheduler.cost_model import CostModel
from runtime.sim.instance import InstanceModel, TableOutputs
from runtime.sim.trainer import TrainerModel

_MODEL, _TRAIN = 0, 1


@dataclass
class SimResult:
    policy: str
    iteration_s: float
    """Mean iteration time: makespan / steps, every step counted (fill and drain included, so
    that no stall can hide in a warm-up window); ``lower_bound_s`` bounds it for any plan."""
    steady_iteration_s: float
    """Mean of the full steps after step 0 (the pipeline fill)."""
    iteration_times: np.ndarray
    step_end_times: np.ndarray
    makespan_s: float
    lower_bound_s: float
    """Lower bound on ``iteration_s``: the makespan bound / steps (see ``lower_bound``)."""
    steady_lower_bound_s: float
    """Throughput bound per step (B groups' share of the work), for ``steady_iteration_s``."""
    makespan_lower_bound_s: float
    latency_lower_bound_s: float
    """Critical-path bound on ``iteration_s`` (see ``latency_lower_bound``): the long groups'
    solo latency over the trainer periods the lag bound allows, per step. ``lower_bound_s``
    stays the throughput bound; neither is implied by the other, and both hold for any plan."""
    breakdown: Breakdown
    queue_timeline: np.ndarray
    """(k, 2) array of (time, training-queue depth in groups) at every change."""
    lag_histogram: dict[int, int]
    steps: int
    groups: int
    tokens: int
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def ratio_to_bound(self) -> float:
        return self.iteration_s / self.lower_bound_s if self.lower_bound_s > 0 else math.inf

    @property
    def ratio_to_latency_bound(self) -> float:
        lb = self.latency_lower_bound_s
        return self.iteration_s / lb if lb > 0 else math.inf

    def summary(self) -> dict:
        d = self.iteration_times
        return {
            "policy": self.policy,
            "iteration_s": self.iteration_s,
            "iteration_p50_s": float(np.median(d)) if d.size else 0.0,
            "iteration_p90_s": float(np.percentile(d, 90)) if d.size else 0.0,
            "iteration_max_s": float(d.max()) if d.size else 0.0,
            "steady_iteration_s": self.steady_iteration_s,
            "lower_bound_s": self.lower_bound_s,
            "steady_lower_bound_s": self.steady_lower_bound_s,
            "ratio_to_bound": self.ratio_to_bound,
            "latency_lower_bound_s": self.latency_lower_bound_s,
            "ratio_to_latency_bound": self.ratio_to_latency_bound,
            "makespan_s": self.makespan_s,
            "makespan_lower_bound_s": self.makespan_lower_bound_s,
            "steps": self.steps,
            "groups": self.groups,
            "breakdown": self.breakdown.fractions,
            "trainer": self.breakdown.trainer,
            "lag_histogram": {str(k): v for k, v in sorted(self.lag_histogram.items())},
            **self.extra,
        }


def lower_bound(
    actual: Sequence[Sequence[int]],
    prompt_tokens: Sequence[int],
    instances: Sequence[InstanceSpec],
    cost: CostModel,
    batch_groups: int,
    lag_bound: int,
) -> tuple[float, float]:
    """(steady-state iteration bound, makespan bound), valid for any plan.

    Decode time on an instance is ``a * steps + b * tokens + c * sum(context)``; only the step
    count depends on the schedule, and it is at least tokens / C. So the cluster needs at least
    ``W = sum over samples [L (a/C + b) + c (L P + L (L - 1) / 2)] + prefill`` instance-seconds,
    i.e. ``W / N`` seconds; no instance finishes before its longest sample alone. A step's share
    is ``B / G`` of that; the trainer's steps add to it at η = 0 (no overlap) and bound it
    otherwise."""
    a, b, c = cost.step_base_s, cost.step_per_seq_s, cost.step_per_ctx_token_s
    cmax = max(s.max_num_seqs for s in instances)
    g = len(actual)
    steps = max(1, math.ceil(g / batch_groups))
    sizes = np.array([len(x) for x in actual])
    arr = np.concatenate([np.asarray(x, dtype=float) for x in actual]) if g else np.zeros(0)
    p = np.repeat(np.asarray(prompt_tokens, dtype=float), sizes)
    per_sample = arr * (a / cmax + b) + c * (arr * p + arr * (arr - 1) / 2)
    w = float(per_sample.sum()) + float(sum(cost.prefill_s(x) for x in prompt_tokens))
    solo = arr * (a + b) + c * (arr * p + arr * (arr - 1) / 2)
    longest = float(solo.max()) if solo.size else 0.0
    tok_total = float(arr.sum() + p.sum())
    n = len(instances)
    train = steps * cost.trainer_base_s + tok_total / cost.trainer_tokens_per_s
    roll = w / n
    if lag_bound == 0:
        span = max(roll, longest) + train
        per = roll / steps + train / steps
    else:
        # The last step follows the last rollout; the trainer's steps cannot overlap each other.
        span = max(roll + cost.trainer_base_s, longest + cost.trainer_base_s, train)
        per = max(roll / steps, train / steps)
    if g:
        per = per * steps * batch_groups / g if g >= batch_groups else per
    return per, span


def latency_lower_bound(
    actual: Sequence[Sequence[int]],
    prompt_tokens: Sequence[int],
    cost: CostModel,
    batch_groups: int,
    lag_bound: int,
) -> float:
    """Makespan bound from the critical path (shared/reference/long-tail-rollouts.md §4.2),
    valid for any plan under the governor's lag rule.

    A group's latency is at least its longest sample alone on an instance: ``Λ = prefill_s(P) +
    decode_steps_s(L_max, running=1, P)``. Step s (publishing version s+1 at t_{s+1}; t_0 = 0)
    consumes B groups, each started at a version >= s - η, i.e. no earlier than t_{s-η}, so
    ``t_{s+1} - t_{s-η} >= X_s + T_s`` with X_s the longest Λ in its batch and T_s its trainer
    step. Steps η+1 apart have disjoint windows, which gives two bounds on the makespan t_S:

    - averaged over the η+1 residues: ``t_S >= (sum_s X_s + sum_s T_s) / (η + 1)``, and the sum of
      batch maxima is least when batches are the length-sorted chunks of B, so
      ``sum_s X_s >= sum_j Λ_(jB)`` (Λ sorted descending); ``sum_s T_s`` is the trainer's total;
    - a chain: at least k steps hold a group with Λ >= Λ_((k-1)B), and ceil(k / (η+1)) of them
      have disjoint windows, so ``t_S >= ceil(k / (η+1)) (Λ_((k-1)B) + trainer_base_s)``.

    In steady state with a long group in every batch this is the note's period bound
    ``P >= (Λ + T) / (η + 1)``; one group alone gives ``Λ + T``. Weight-sync freezes are left out
    (a group may finish before the next publish), so the bound stays valid."""
    g = len(actual)
    if not g:
        return 0.0
    b = max(1, batch_groups)
    steps = math.ceil(g / b)
    h = lag_bound + 1
    longest = np.array([max(x) if len(x) else 0 for x in actual], dtype=float)
    ptok = np.asarray(prompt_tokens, dtype=float)
    lam = np.array(
        [
            cost.prefill_s(p) + cost.decode_steps_s(L, 1, p)
            for L, p in zip(longest, ptok, strict=True)
        ]
    )
    heads = np.sort(lam)[::-1][::b]  # Λ_(jB), j = 0..steps-1
    tokens = float(sum(sum(x) for x in actual)) + float(
        sum(len(x) * p for x, p in zip(actual, ptok, strict=True))
    )
    train = steps * cost.trainer_base_s + tokens / cost.trainer_tokens_per_s
    averaged = (float(heads.sum()) + train) / h
    k = np.arange(1, steps + 1)
    chain = float(np.max(np.ceil(k / h) * (heads + cost.trainer_base_s)))
    return max(averaged, chain)


def simulate(
    scheduler: Scheduler,
    groups: Sequence[GroupSpec],
    actual: Mapping[int, Sequence[int]],
    instances: Sequence[InstanceSpec],
    *,
    batch_groups: int,
    lag_bound: int,
    cost_model: CostModel | None = None,
    prompt_tokens: Mapping[int, int] | None = None,
    dispatch: str = "continuous",
    sorting_baseline: float | None = None,
    scheduling_policy: str = "fcfs",
) -> SimResult:
    """Run ``scheduler``'s plan against ``actual`` lengths (prompt_id -> the n output lengths):
    the live controller's core, simulated instances and a simulated trainer (:class:`SimRun`).
    ``scheduling_policy``: the engines' waiting queue (``rollout.scheduling_policy``)."""
    cost = cost_model or CostModel()
    if dispatch not in ("continuous", "minibatch"):
        raise ValueError(f"dispatch: {dispatch!r} is not one of continuous, minibatch")
    for g in groups:
        if g.prompt_id not in actual:
            raise ValueError(f"actual: no lengths for prompt_id {g.prompt_id}")
        if not len(actual[g.prompt_id]):
            raise ValueError("actual: every group needs at least one length")
    ptok = {g.prompt_id: int((prompt_tokens or {}).get(g.prompt_id, 0)) for g in groups}
    run = SimRun(
        scheduler,
        groups,
        actual,
        ptok,
        instances,
        cost,
        batch_groups=batch_groups,
        lag_bound=lag_bound,
        dispatch=dispatch,
        scheduling_policy=scheduling_policy,
    )
    run.run()
    return run.result(sorting_baseline)


class _Renumbered(Scheduler):
    """A scheduler planned for instance ids ``ids`` (any), seen by the core as 0..N-1: the
    core's instances are the config's, numbered in order."""

    def __init__(self, inner: Scheduler, ids: Sequence[int]) -> None:
        self.inner = inner
        self.ids = list(ids)
        self.index = {x: k for k, x in enumerate(self.ids)}
        self.name = inner.name
        self.predicted_breakdown = inner.predicted_breakdown

    def next_groups(self, instance_id: int, max_groups: int) -> list[int]:
        return self.inner.next_groups(self.ids[instance_id], max_groups)

    def on_group_finished(self, prompt_id: int, instance_id: int, lengths: Sequence[int]) -> None:
        self.inner.on_group_finished(prompt_id, self.ids[instance_id], lengths)

    def requeue(self, prompt_ids: Sequence[int]) -> None:
        self.inner.requeue(prompt_ids)

    def on_instance_paused(self, instance_id: int) -> None:
        self.inner.on_instance_paused(self.ids[instance_id])

    def on_instance_resumed(self, instance_id: int) -> None:
        self.inner.on_instance_resumed(self.ids[instance_id])

    def on_instance_lost(self, instance_id: int) -> None:
        self.inner.on_instance_lost(self.ids[instance_id])

    def on_instance_added(self, spec: InstanceSpec) -> None:
        self.inner.on_instance_added(InstanceSpec(self.ids[spec.instance_id], spec.max_num_seqs))

    def set_lag_bound(self, lag_bound: int) -> None:
        self.inner.set_lag_bound(lag_bound)

    def remaining(self) -> int:
        return self.inner.remaining()

    def pending(self, instance_id: int) -> int:
        return self.inner.pending(self.ids[instance_id])

    def priority(self, prompt_id: int, start_version: int) -> int:
        return self.inner.priority(prompt_id, start_version)

    def repair_due(self, now: float, version: int) -> bool:
        return self.inner.repair_due(now, version)

    def repair(self, view: RolloutView) -> Sequence[Defer | Move]:
        seen = dataclasses.replace(
            view,
            waiting=tuple(
                dataclasses.replace(r, instance_id=self.ids[r.instance_id]) for r in view.waiting
            ),
        )
        return [
            dataclasses.replace(x, to=self.index[x.to]) if isinstance(x, Move) else x
            for x in self.inner.repair(seen)
        ]


class _Clock:
    """The simulated clock the core reads."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _ConsumedLags:
    """A ledger that keeps only what the result needs: the lag of every consumed group."""

    def __init__(self) -> None:
        self.histogram: Counter[int] = Counter()

    def write(self, record: dict) -> None:
        if record["event"] == "consumed":
            self.histogram[record["lag"]] += 1

    def close(self) -> None:
        pass


class SimRun:
    """One simulated run: the :class:`~runtime.controller.core.ControllerCore` the live run uses,
    an :class:`~runtime.sim.instance.InstanceModel` per instance and a
    :class:`~runtime.sim.trainer.TrainerModel`, on one simulated clock. Events are the models'
    own (a sequence finishing, a load ending) and the trainer's step ends, taken in time
    order from one heap."""

    def __init__(
        self,
        scheduler: Scheduler,
        groups: Sequence[GroupSpec],
        actual: Mapping[int, Sequence[int]],
        prompt_tokens: Mapping[int, int],
        instances: Sequence[InstanceSpec],
        cost: CostModel,
        *,
        batch_groups: int,
        lag_bound: int,
        dispatch: str,
        scheduling_policy: str = "fcfs",
    ) -> None:
        self.groups = groups
        self.instances = instances
        self.cost = cost
        self.batch_groups = batch_groups
        self.lag_bound = lag_bound
        self.n = max(len(actual[g.prompt_id]) for g in groups) if groups else 1
        self.lengths = [np.asarray(actual[g.prompt_id], dtype=np.int64) for g in groups]
        self.prompt_tokens = [prompt_tokens[g.prompt_id] for g in groups]
        self.clock = _Clock()
        self.lags = _ConsumedLags()
        config = _sim_config(
            instances, self.n, batch_groups, len(groups), lag_bound, dispatch, scheduling_policy
        )
        task = _sim_task(groups, prompt_tokens)
        self.core = ControllerCore(
            config,
            task,
            clock=self.clock,
            ledger=Ledger(self.lags),  # type: ignore[arg-type]
            supervises=False,
            plan_inline=True,
            single_epoch=True,
            quiet=True,
        )
        outputs = TableOutputs(actual, prompt_tokens, payload="light", reward=None)
        ids = [spec.instance_id for spec in instances]
        if ids != list(range(len(ids))):
            scheduler = _Renumbered(scheduler, ids)
        self.models = {
            k: InstanceModel(
                k, spec.max_num_seqs, cost, outputs, scheduling_policy=scheduling_policy
            )
            for k, spec in enumerate(instances)
        }
        self.trainer = TrainerModel(cost, config.trainer.loss)
        self.first = (EpochPlan(0, list(groups), lag_bound, lambda: scheduler), scheduler)
        self._events: list[tuple[float, int, int, int]] = []
        self._seq = 0
        self._due: dict[int, float] = {}
        self.step_ends: list[float] = []
        self.queue_timeline: list[tuple[float, int]] = [(0.0, 0)]
        self.stopped = False
        self._pending_step: StepMetrics | None = None
        """The metrics of the step the trainer model is taking."""
        self.consumed_samples = 0
        self.consumed_tokens = 0

    # --- the loop -----------------------------------------------------------------------------
    def run(self) -> None:
        self._route(self.core.start(self.first))
        hellos: list[A.Event] = []
        for i, model in self.models.items():
            model.start(0.0)
            hellos.append(A.InstanceMessage(i, model.hello()))
        hellos.append(A.TrainerMessage(TrainerHello(num_processes=1, weight_version=0, pid=0)))
        hellos.append(A.TrainerMessage(BatchRequest(version=0)))
        self._route(self.core.handle_all(hellos))
        while self._events and not self.stopped:
            now, _, kind, who = heapq.heappop(self._events)
            if kind == _MODEL and self._due.get(who) != now:
                continue  # superseded: the model was rescheduled since
            self.clock.now = now
            if kind == _MODEL:
                del self._due[who]
                self.models[who].advance(now)
                self._feed_outputs([who])
                self._reschedule(who)
            else:
                self._step_done()
        consumed = self.core.governor.counters.consumed
        if consumed < len(self.groups):
            core = self.core
            why = sorted({f"{x.state}: {x.blocked or '-'}" for x in core.instances.values()})
            raise RuntimeError(
                f"simulation stalled at {self.clock.now:.3f}s: {consumed} of {len(self.groups)} "
                f"groups consumed; trainer {core.trainer.condition}, "
                f"{core.work.scheduler.remaining()} groups not handed out; instances {why}"
            )

    def _push(self, at: float, kind: int, who: int) -> None:
        self._seq += 1
        heapq.heappush(self._events, (at, self._seq, kind, who))

    def _feed_outputs(self, touched: list[int]) -> None:
        """What the touched models produced, and a heartbeat from each, into the core; repeat
        while the core's answer makes a model say more (an ack, an abort)."""
        now = self.clock.now
        while touched:
            events: list[A.Event] = []
            for i in touched:
                model = self.models[i]
                events += [A.InstanceMessage(i, m) for m in model.take_output()]
                events.append(A.InstanceMessage(i, model.heartbeat(now)))
            actions = self.core.handle_all(events)
            touched = self._route(actions) if actions else []
            queued = self.core.governor.queued
            if queued != self.queue_timeline[-1][1]:
                self.queue_timeline.append((now, queued))

    def _route(self, actions: list[A.Action]) -> list[int]:
        """Carry out the core's actions; the models that were sent something."""
        now = self.clock.now
        touched: dict[int, None] = {}
        for action in actions:
            if isinstance(action, A.SendToInstance):
                model = self.models[action.instance_id]
                model.advance(now)
                model.handle(action.message, now)
                touched[action.instance_id] = None
            elif isinstance(action, A.SendToTrainer) and isinstance(action.message, Batch):
                for group in action.message.groups:
                    self.consumed_samples += len(group.completions)
                    self.consumed_tokens += sum(len(c.token_ids) for c in group.completions)
                metrics, seconds = self.trainer.step(action.message)
                self._pending_step = metrics
                self._push(now + seconds, _TRAIN, -1)
            elif isinstance(action, A.StopRequested):
                self.stopped = True
        for i in touched:
            self._reschedule(i)
        return [i for i in touched if self.models[i].has_output()]

    def _reschedule(self, i: int) -> None:
        """Wake model ``i`` when its next event is due (at most one live entry per model)."""
        due = self.models[i].next_event(self.clock.now)
        if due == math.inf:
            self._due.pop(i, None)
        elif due != self._due.get(i):
            self._due[i] = due
            self._push(due, _MODEL, i)

    def _step_done(self) -> None:
        assert self._pending_step is not None, "a step ends only after a batch started it"
        done = self.trainer.step_done(self._pending_step)
        self.step_ends.append(self.clock.now)
        events: list[A.Event] = [
            A.TrainerMessage(done),
            A.TrainerMessage(BatchRequest(version=done.version)),
        ]
        touched = self._route(self.core.handle_all(events))
        self._feed_outputs(touched)

    # --- the result ---------------------------------------------------------------------------
    def result(self, sorting_baseline: float | None) -> SimResult:
        end = self.step_ends[-1] if self.step_ends else self.clock.now
        accountant = self.core.accounting.accountant
        accountant.trainer_update(end, "idle")
        bd = accountant.total(end)
        raw_sorting = float(bd.fractions["sorting"])
        if sorting_baseline is not None:
            bd.fractions = excess_sorting(bd.fractions, sorting_baseline)
            bd.sorting_baseline = sorting_baseline
        ends = np.asarray(self.step_ends)
        durs = np.diff(np.concatenate([[0.0], ends]))
        g, b = len(self.groups), self.batch_groups
        full = g // b
        # Steady state: every full step but step 0, which includes filling the pipeline.
        steady = durs[1:full] if full > 1 else durs
        lb_step, lb_span = lower_bound(
            self.lengths, self.prompt_tokens, self.instances, self.cost, b, self.lag_bound
        )
        steps = len(self.step_ends)
        lat_span = latency_lower_bound(
            self.lengths, self.prompt_tokens, self.cost, b, self.lag_bound
        )
        return SimResult(
            policy=self.first[1].name,
            iteration_s=float(end) / max(1, steps),
            steady_iteration_s=float(steady.mean()) if steady.size else 0.0,
            iteration_times=durs,
            step_end_times=ends,
            makespan_s=float(end),
            lower_bound_s=lb_span / max(1, steps),
            steady_lower_bound_s=lb_step,
            makespan_lower_bound_s=lb_span,
            latency_lower_bound_s=lat_span / max(1, steps),
            breakdown=bd,
            queue_timeline=np.asarray(self.queue_timeline, dtype=float),
            lag_histogram=dict(self.lags.histogram),
            steps=steps,
            groups=g,
            tokens=int(sum(int(x.sum()) for x in self.lengths)),
            extra={
                "raw_sorting": raw_sorting,
                "consumed_mean_length": self.consumed_tokens / max(1, self.consumed_samples),
                "deferred": self.core.dispatcher.deferred,
                "migrated": self.core.dispatcher.migrated,
            },
        )


def _sim_config(
    instances: Sequence[InstanceSpec],
    n: int,
    batch_groups: int,
    groups: int,
    lag_bound: int,
    dispatch: str,
    scheduling_policy: str = "fcfs",
) -> Config:
    """The run config a simulated run stands for: its instances, B, η, dispatch; weights
    loaded in ``keep`` mode (in-flight samples freeze for ``weight_sync_s``), no output cap."""
    return validate_config(
        {
            "run": {"name": "simulate"},
            "model": {"path": "sim"},
            "task": {"name": "sim"},
            "rollout": {
                "backend": "sim",
                "instances": [{"max_num_seqs": s.max_num_seqs} for s in instances],
                "sampling": {"n": n, "max_tokens": 1 << 30},
                "scheduling_policy": scheduling_policy,
            },
            "scheduler": {"dispatch": dispatch},
            "trainer": {
                "backend": "sim",
                "batch_groups": batch_groups,
                "steps": max(1, -(-groups // batch_groups)),
            },
            "async": {
                "lag_bound": lag_bound,
                "max_lag_bound": max(16, lag_bound),
                "update_mode": "keep",
            },
        },
        source="simulate",
    )


def _sim_task(groups: Sequence[GroupSpec], prompt_tokens: Mapping[int, int]) -> TaskData:
    """Prompts with stand-in token ids of their length (views of one buffer: no model)."""
    longest = max(prompt_tokens.values(), default=0)
    buffer = np.zeros(longest, dtype=np.int32)
    tokens = {g.prompt_id: buffer[: prompt_tokens[g.prompt_id]] for g in groups}
    return TaskData(
        prompts={g.prompt_id: g for g in groups},
        prompt_tokens=tokens,
        model_path="sim",
        lengths=None,
    )
