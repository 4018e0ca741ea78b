"""Discrete-event simulator of a multi-instance asynchronous RL cluster.

N rollout instances do continuous batching under the cost model (``decode_step_s`` per step,
``prefill_s`` when groups arrive, ``max_num_seqs`` slots), a training queue collects finished
groups, and a trainer takes B groups per step (``trainer_step_s``). The lag bound η is enforced by
admission control exactly as DESIGN.md section 4 says: a group is dispatched at version v only
while admitted < (v + η + 1)·B, and the trainer may not take step v + η + 1 before every group
started at v has been consumed. η = 0 is therefore synchronous.

Any plan (a ``Scheduler``) runs against *actual* lengths, which may differ from the predicted
ones.

On the lag rule: read literally, "step v + η + 1 waits for every group started at v" still lets a
group started at v be consumed by step v + η + 1, i.e. with lag η + 1. The engine enforces the
bound itself: step s waits until every group started at a version <= s - η has finished, and the
batch takes the oldest groups first, so no consumed group has lag > η (admission guarantees that
they fit in one batch).

Events are sequence finishes (an instance's running set only changes then, so the time of
k steps has a closed form), trainer step ends and stalls (prefill, weight sync); a run with 100k
samples takes about a second. Bubbles are integrated by ``runtime.bubbles.BubbleAccountant``,
the same class the live controller uses.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from runtime.bubbles import Breakdown, BubbleAccountant, excess_sorting, free_slot_cause
from runtime.scheduler.base import GroupSpec, InstanceSpec, Scheduler
from runtime.scheduler.cost_model import CostModel
from runtime.scheduler.policies import make_scheduler

_FINISH, _STALL, _TRAIN = 0, 1, 2


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
            "makespan_s": self.makespan_s,
            "makespan_lower_bound_s": self.makespan_lower_bound_s,
            "steps": self.steps,
            "groups": self.groups,
            "breakdown": self.breakdown.fractions,
            "trainer": self.breakdown.trainer,
            "lag_histogram": {str(k): v for k, v in sorted(self.lag_histogram.items())},
            **self.extra,
        }


class _Inst:
    __slots__ = (
        "cap",
        "ctx",
        "finish",
        "id",
        "reserved",
        "running",
        "stall_until",
        "state",
        "step",
        "t",
        "token",
    )

    def __init__(self, iid: int, cap: int) -> None:
        self.id = iid
        self.cap = cap
        self.running = 0  # sequences decoding
        self.reserved = 0  # sequences dispatched (decoding or in prefill)
        self.ctx = 0.0  # total context of decoding sequences at the current step
        self.step = 0
        self.t = 0.0
        self.stall_until = 0.0
        self.finish: list[tuple[int, int, int]] = []  # (finish step, final context, group)
        self.token = 0
        self.state = "running"


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
) -> SimResult:
    """Run ``scheduler``'s plan against ``actual`` lengths (prompt_id -> the n output lengths)."""
    cost = cost_model or CostModel()
    if dispatch not in ("continuous", "minibatch"):
        raise ValueError(f"dispatch: {dispatch!r} is not one of continuous, minibatch")
    B, eta = batch_groups, lag_bound
    ids = [g.prompt_id for g in groups]
    gidx = {p: k for k, p in enumerate(ids)}
    missing = [p for p in ids if p not in actual]
    if missing:
        raise ValueError(f"actual: no lengths for prompt_id {missing[0]}")
    lens = [np.asarray(actual[p], dtype=np.int64) for p in ids]
    if any(x.size == 0 for x in lens):
        raise ValueError("actual: every group needs at least one length")
    ptok = [int((prompt_tokens or {}).get(p, 0)) for p in ids]
    G = len(ids)
    n_max = max(x.size for x in lens)
    inst = {s.instance_id: _Inst(s.instance_id, s.max_num_seqs) for s in instances}
    acct = BubbleAccountant({s.instance_id: s.max_num_seqs for s in instances}, 0.0)

    events: list[tuple[float, int, int, int, int]] = []
    seq = 0

    def push(t: float, kind: int, who: int, token: int) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, who, token))

    version = 0
    admitted = 0
    consumed = 0
    start_version = np.full(G, -1, dtype=np.int64)
    left = np.zeros(G, dtype=np.int64)
    inflight_by_v: Counter[int] = Counter()
    queue: list[tuple[int, int, int]] = []  # heap of (start version, finish order, group)
    finish_order = 0
    trainer_busy = False
    trainer_cond = "idle"
    step_ends: list[float] = []
    queue_tl: list[tuple[float, int]] = [(0.0, 0)]
    lag_hist: Counter[int] = Counter()
    running_total = 0
    inst_finish = {i: 0.0 for i in inst}

    def admission_open() -> bool:
        return admitted < (version + eta + 1) * B

    def cause_of(x: _Inst) -> str:
        pend = scheduler.pending(x.id)
        return free_slot_cause(
            state=x.state,
            pending=pend,
            running=x.reserved,
            admission_open=admission_open(),
            work_elsewhere=(running_total - x.reserved) > 0 or scheduler.remaining() - pend > 0,
            trainer_condition=trainer_cond,
        )

    def account(x: _Inst, now: float) -> None:
        acct.update(x.id, now, active=x.reserved, cause=cause_of(x))

    def account_all(now: float) -> None:
        for x in inst.values():
            account(x, now)

    def advance_to(x: _Inst, now: float) -> None:
        """Complete the whole decode steps that fit before ``now`` (a partial step restarts)."""
        t0 = max(x.t, x.stall_until)
        if x.running == 0 or now <= t0:
            x.t = max(x.t, now) if x.running == 0 else x.t
            return
        dt = now - t0
        d0 = cost.decode_step_s(x.running, x.ctx)
        qa = cost.step_per_ctx_token_s * x.running / 2
        if qa > 0:
            qb = d0 - qa
            k = int((-qb + math.sqrt(qb * qb + 4 * qa * dt)) / (2 * qa))
        else:
            k = int(dt / d0)
        k = max(0, min(k, x.finish[0][0] - x.step - 1 if x.finish else k))
        x.ctx += x.running * k
        x.step += k
        x.t = now

    def schedule(x: _Inst) -> None:
        x.token += 1
        if pending_join[x.id] and x.stall_until > x.t:
            # Prefill (or a sync) in progress: nothing decodes until it ends; then the new
            # sequences join and the next finish is scheduled.
            push(x.stall_until, _STALL, x.id, x.token)
            return
        if x.running == 0 or not x.finish:
            if x.stall_until > x.t:
                push(x.stall_until, _STALL, x.id, x.token)
            return
        k = x.finish[0][0] - x.step
        t = max(x.t, x.stall_until) + cost.decode_steps_s(k, x.running, x.ctx)
        push(t, _FINISH, x.id, x.token)

    pending_join: dict[int, list[tuple[int, int, int]]] = {i: [] for i in inst}

    def join(x: _Inst) -> None:
        """Sequences whose prefill is done start decoding at the instance's current step."""
        nonlocal running_total
        for ln, p, gk in pending_join[x.id]:
            heapq.heappush(x.finish, (x.step + ln, p + ln, gk))
            x.running += 1
            x.ctx += p
        pending_join[x.id].clear()

    def try_dispatch(x: _Inst, now: float) -> bool:
        nonlocal admitted, running_total
        if x.state != "running":
            return False
        free = x.cap - x.reserved
        if dispatch == "minibatch" and x.reserved > 0:
            return False
        # Continuous: ask again until the slots, the admission window or the plan run out (a
        # call never crosses a minibatch boundary). Minibatch: one minibatch per barrier.
        got: list[int] = []
        while True:
            slots = (version + eta + 1) * B - admitted - len(got)
            mg = min(free // n_max, slots)
            if mg <= 0:
                break
            more = scheduler.next_groups(x.id, mg)
            if not more:
                break
            got.extend(more)
            free -= sum(int(lens[gidx[p]].size) for p in more)
            if dispatch == "minibatch":
                break
        if not got:
            return False
        advance_to(x, now)
        ptot = 0
        for p in got:
            gk = gidx[p]
            admitted += 1
            start_version[gk] = version
            inflight_by_v[version] += 1
            left[gk] = lens[gk].size
            for ln in lens[gk]:
                pending_join[x.id].append((int(max(1, ln)), ptok[gk], gk))
            x.reserved += int(lens[gk].size)
            running_total += int(lens[gk].size)
            ptot += ptok[gk]
        stall = cost.prefill_s(ptot)
        x.stall_until = max(now, x.stall_until) + stall
        if stall <= 0:
            join(x)
        schedule(x)
        return True

    def dispatch_all(now: float) -> None:
        was_open = admission_open()
        for x in inst.values():
            try_dispatch(x, now)
        if was_open != admission_open():
            account_all(now)

    def oldest_inflight() -> int | None:
        return min((v for v, c in inflight_by_v.items() if c > 0), default=None)

    def trainer_try(now: float) -> None:
        nonlocal trainer_busy, trainer_cond, version, consumed
        if trainer_busy:
            return
        more_coming = consumed + len(queue) < G
        old = oldest_inflight()
        lag_block = old is not None and old <= version - eta
        if len(queue) >= B or (not more_coming and queue):
            if lag_block:
                cond = "lag_wait"
            else:
                take = [heapq.heappop(queue) for _ in range(min(B, len(queue)))]
                tokens = 0.0
                for sv, _, gk in take:
                    lag_hist[version - int(sv)] += 1
                    tokens += float(lens[gk].sum() + lens[gk].size * ptok[gk])
                consumed += len(take)
                queue_tl.append((now, len(queue)))
                trainer_busy = True
                push(now + cost.trainer_step_s(tokens), _TRAIN, -1, 0)
                cond = "stepping"
        else:
            cond = "starved" if more_coming else "idle"
        if cond != trainer_cond:
            trainer_cond = cond
            acct.trainer_update(now, cond)
            account_all(now)

    for x in inst.values():
        account(x, 0.0)
    acct.trainer_update(0.0, "starved")
    trainer_cond = "starved"
    dispatch_all(0.0)
    account_all(0.0)
    now = 0.0
    while events:
        now, _, kind, who, token = heapq.heappop(events)
        if kind == _TRAIN:
            trainer_busy = False
            version += 1
            step_ends.append(now)
            if cost.weight_sync_s > 0 and consumed < G:
                for x in inst.values():
                    advance_to(x, now)
                    x.stall_until = max(x.stall_until, now) + cost.weight_sync_s
                    x.state = "syncing"
                    schedule(x)
                    push(x.stall_until, _STALL, x.id, -1)  # end of sync, never stale
            trainer_cond = "idle"  # forces an accounting refresh in trainer_try
            acct.trainer_update(now, "idle")
            dispatch_all(now)
            trainer_try(now)
            account_all(now)
            continue
        x = inst[who]
        if kind == _STALL:
            if token == -1:
                if x.state == "syncing" and now >= x.stall_until - 1e-12:
                    x.state = "running"
                    try_dispatch(x, now)
                    account(x, now)
                continue
            if token != x.token:
                continue
            x.t = max(x.t, now)
            join(x)
            schedule(x)
            continue
        if token != x.token:
            continue
        # A sequence finish: advance to its step, retire every sequence ending there.
        k = x.finish[0][0] - x.step
        x.ctx += x.running * k
        x.step += k
        x.t = now
        done_groups = []
        while x.finish and x.finish[0][0] == x.step:
            _, fctx, gk = heapq.heappop(x.finish)
            x.running -= 1
            x.reserved -= 1
            running_total -= 1
            x.ctx -= fctx
            left[gk] -= 1
            if left[gk] == 0:
                done_groups.append(gk)
        if x.running == 0:
            x.ctx = 0.0
        if x.stall_until > now and pending_join[x.id]:
            pass  # prefill still running; its sequences join at the stall end
        else:
            join(x)
        for gk in done_groups:
            inflight_by_v[int(start_version[gk])] -= 1
            finish_order += 1
            heapq.heappush(queue, (int(start_version[gk]), finish_order, gk))
            scheduler.on_group_finished(ids[gk], x.id, lens[gk].tolist())
        if done_groups:
            queue_tl.append((now, len(queue)))
        if x.reserved == 0:
            inst_finish[x.id] = now
        was_open = admission_open()
        try_dispatch(x, now)
        schedule(x)
        account(x, now)
        if done_groups:
            trainer_try(now)
        if was_open != admission_open() or x.reserved == 0:
            account_all(now)
    end = step_ends[-1] if step_ends else now
    if consumed < G:
        raise RuntimeError(f"simulation stalled: {consumed} of {G} groups consumed")
    acct.trainer_update(end, "idle")
    bd = acct.total(end)
    if sorting_baseline is not None:
        bd.fractions = excess_sorting(bd.fractions, sorting_baseline)
        bd.sorting_baseline = sorting_baseline
    ends = np.asarray(step_ends)
    durs = np.diff(np.concatenate([[0.0], ends]))
    full = G // B
    # Steady state: every full step but step 0, which includes filling the pipeline.
    steady = durs[1:full] if full > 1 else durs
    lb_step, lb_span = lower_bound(lens, ptok, instances, cost, B, eta)
    return SimResult(
        policy=scheduler.name,
        iteration_s=float(end) / max(1, len(step_ends)),
        steady_iteration_s=float(steady.mean()) if steady.size else 0.0,
        iteration_times=durs,
        step_end_times=ends,
        makespan_s=float(end),
        lower_bound_s=lb_span / max(1, len(step_ends)),
        steady_lower_bound_s=lb_step,
        makespan_lower_bound_s=lb_span,
        breakdown=bd,
        queue_timeline=np.asarray(queue_tl, dtype=float),
        lag_histogram=dict(lag_hist),
        steps=len(step_ends),
        groups=G,
        tokens=int(sum(int(x.sum()) for x in lens)),
        extra={"raw_sorting": float(acct.total(end).fractions["sorting"])},
    )


def compare(
    policies: Sequence[str],
    groups: Sequence[GroupSpec],
    actual: Mapping[int, Sequence[int]],
    instances: Sequence[InstanceSpec],
    *,
    batch_groups: int,
    lag_bound: int,
    cost_model: CostModel | None = None,
    prompt_tokens: Mapping[int, int] | None = None,
    dispatch: str = "continuous",
    seed: int = 0,
) -> dict[str, SimResult]:
    """Plan and simulate each policy on the same input. Sorting is reported in excess of fifo's
    (fifo always runs first, as the baseline, even when not asked for)."""
    cost = cost_model or CostModel()
    out: dict[str, SimResult] = {}

    def run(p: str, baseline: float | None) -> SimResult:
        s = make_scheduler(
            p,
            groups,
            instances,
            batch_groups=batch_groups,
            lag_bound=lag_bound,
            cost_model=cost,
            seed=seed,
        )
        return simulate(
            s,
            groups,
            actual,
            instances,
            batch_groups=batch_groups,
            lag_bound=lag_bound,
            cost_model=cost,
            prompt_tokens=prompt_tokens,
            dispatch=dispatch,
            sorting_baseline=baseline,
        )

    fifo = run("fifo", None)
    base = fifo.extra["raw_sorting"]
    fifo.breakdown.fractions = excess_sorting(fifo.breakdown.fractions, base)
    fifo.breakdown.sorting_baseline = base
    for p in policies:
        out[p] = fifo if p == "fifo" else run(p, base)
    return out
