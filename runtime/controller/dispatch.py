"""Dispatch and the life of a group: out to an instance under the lag governor, back as a
result (queued for the trainer, discarded, aborted or skipped), or lost with its instance.

Every group has one record (:class:`~runtime.controller.governor.GroupRecord`), held by the
governor while it is open and by its instance while it runs there; every transition is written
to the ledger.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from runtime import protocol as P
from runtime.config import Config
from runtime.controller.actions import Outbox
from runtime.controller.governor import ABORTED, SKIPPED, GroupRecord, LagGovernor
from runtime.controller.instances import RUNNING, Instance
from runtime.controller.ledger import Ledger
from runtime.controller.work import WorkQueue
from runtime.scheduler.base import Defer, InstanceSpec, Move, RolloutView, Running

log = logging.getLogger(__name__)


class Dispatcher:
    """Hands prompts to instances with free slots, and settles what comes back."""

    def __init__(
        self,
        config: Config,
        governor: LagGovernor,
        work: WorkQueue,
        instances: dict[int, Instance],
        ledger: Ledger,
        outbox: Outbox,
        *,
        may_dispatch: Callable[[], bool],
        request_stop: Callable[[str, int], None],
    ) -> None:
        self.config = config
        self.governor = governor
        self.work = work
        self.instances = instances
        self.ledger = ledger
        self.outbox = outbox
        self.clock = outbox.clock
        self._may_dispatch = may_dispatch
        self._request_stop = request_stop
        self.n = config.rollout.sampling.n
        self.continuous = config.scheduler.dispatch == "continuous"
        self.first_dispatch_at: float | None = None
        self._rr = 0
        self._migrating: dict[int, tuple[int, int | None]] = {}
        """Groups asked to move (``migrate``): id -> (target instance, priority there)."""
        self.migrated = 0
        """Groups moved to another instance with their partial output, so far."""
        self.deferred = 0
        """Groups the policy aborted to regenerate later (``repair``), so far."""
        self._trainer_waited = False
        """Whether the trainer was waiting on in-flight groups at the last ``repair``."""

    # --- dispatch -----------------------------------------------------------------------------
    def dispatch(self) -> None:
        if self.work.scheduler is None or not self._may_dispatch():
            return
        self._rr = (self._rr + 1) % max(1, len(self.instances))
        ready: list[Instance] = []
        for inst in self.instances.values():
            inst.blocked = ""
            if inst.state != RUNNING or inst.operator_paused:
                continue
            if not self.continuous and inst.in_flight:
                inst.blocked = "minibatch barrier"
                continue
            if inst.concurrency - len(inst.in_flight) > 0:
                ready.append(inst)
        # Least loaded first (rotating ties), and in continuous mode one group per instance per
        # round: when admission is scarce (small η) every instance still gets its share, and
        # work the scheduler re-queued onto any of them is not starved.
        n = max(1, len(self.instances))
        ready.sort(key=lambda x: (len(x.in_flight), (x.instance_id - self._rr) % n))
        # Admission and its refusal text depend only on the weight version: asked once per
        # version until a dispatch changes the count (hundreds of instances wait on it).
        allowed_at: dict[int, int] = {}
        refusals: dict[int, str] = {}
        while ready:
            still = []
            for inst in ready:
                free = inst.concurrency - len(inst.in_flight)
                v = inst.weight_version
                allowed = allowed_at.get(v)
                if allowed is None:
                    allowed = allowed_at[v] = self.governor.admissible(v)
                if allowed <= 0:
                    if v not in refusals:
                        refusals[v] = self.governor.refusal(v) or "admission"
                    inst.blocked = refusals[v]
                    continue
                # minibatch mode: the scheduler's whole minibatch (never past its boundary)
                picks = self._next_prompts(
                    inst.instance_id, 1 if self.continuous else min(free, allowed)
                )
                if not picks:
                    inst.blocked = "no work"
                    continue
                for prompt_id, epoch in picks:
                    self._dispatch_group(inst, prompt_id, epoch)
                allowed_at.clear()
                if self.continuous and free > 1:
                    still.append(inst)
            ready = still

    def _next_prompts(self, instance_id: int, k: int) -> list[tuple[int, int]]:
        out = self.work.next_prompts(instance_id, k)
        if not out and self.work.exhausted() and self.roll_over():
            out = self.work.next_prompts(instance_id, k)
        return out

    def roll_over(self) -> bool:
        """The current epoch is handed out: install the next one if it is planned (True), else
        have it planned. Until it is installed the instances get no new work; nothing is
        dispatched from a half-built scheduler."""
        planned = self.work.take_planned()
        if planned is None:
            planned = self.work.request_next(self.instance_specs(), self.governor.admission_bound)
        if planned is None:
            return False
        self.install_epoch(*planned)
        return True

    def instance_specs(self) -> list[InstanceSpec]:
        return [InstanceSpec(i, inst.max_num_seqs) for i, inst in self.instances.items()]

    def install_epoch(self, plan: Any, scheduler: Any) -> None:
        """Make ``scheduler`` current, told what changed since it was planned."""
        self.work.install(plan, scheduler)
        for i, inst in self.instances.items():
            if inst.lost_by_scheduler:
                scheduler.on_instance_lost(i)
            elif inst.operator_paused:
                scheduler.on_instance_paused(i)
        if self.governor.admission_bound != plan.lag_bound:
            scheduler.set_lag_bound(self.governor.admission_bound)

    def _dispatch_group(self, inst: Instance, prompt_id: int, epoch: int) -> None:
        gid = self.work.new_group_id()
        now = self.clock()
        if self.first_dispatch_at is None:
            self.first_dispatch_at = now
        version = inst.weight_version
        record = self.governor.admit(
            gid, prompt_id, version, instance_id=inst.instance_id, epoch=epoch, at=now
        )
        record.predicted_longest = self.work.predicted_longest(prompt_id, epoch)
        inst.in_flight[gid] = record
        self.ledger.dispatched(
            gid, prompt=prompt_id, epoch=epoch, instance=inst.instance_id, version=version
        )
        self.outbox.to_instance(inst.instance_id, self._generate(gid, prompt_id, version))
        inst.running_seqs = min(inst.max_num_seqs, inst.running_seqs + self.n)

    def _generate(
        self,
        gid: int,
        prompt_id: int,
        start_version: int,
        priority: int | None = None,
        prefix: list[P.PartialSample] | None = None,
    ) -> P.Generate:
        """The ``Generate`` of group ``gid`` (the same seed wherever and however often it is
        sent); ``priority`` None: the scheduler's for a group started at ``start_version``."""
        sampling = self.config.rollout.sampling
        return P.Generate(
            group_id=gid,
            prompt_id=prompt_id,
            prompt_token_ids=self.work.prompt_tokens[prompt_id],
            n=self.n,
            max_tokens=sampling.max_tokens,
            seed=None if sampling.seed is None else sampling.seed + gid,
            priority=(
                self.work.scheduler.priority(prompt_id, start_version)
                if priority is None
                else priority
            ),
            prefix=prefix,
        )

    # --- migration ----------------------------------------------------------------------------
    def migrate(self, gid: int, to: int, priority: int | None = None) -> bool:
        """Move in-flight group ``gid`` to instance ``to`` without losing its work: it is
        aborted where it runs with ``partial`` output, and when that comes back
        (``on_group_aborted``) the prompt plus each sample's partial output is sent to ``to``,
        which generates only the rest (same group id, record and start version). ``priority``:
        its engine priority there (None: the scheduler's). The target's free slots are the
        caller's concern (a tail lane may be reserved). False (nothing sent) when the group is
        not in flight, is being aborted or moved already, or ``to`` is not a running instance
        other than its own. Should the group finish first, its result is taken as usual; should
        ``to`` be gone by the time the partial output arrives, the group is re-queued."""
        target = self.instances.get(to)
        if gid in self._migrating or not self._can_take(target):
            return False
        for inst in self.instances.values():
            record = inst.in_flight.get(gid)
            if record is None or record.aborting or inst.instance_id == to:
                continue
            self._migrating[gid] = (to, priority)
            self.outbox.to_instance(inst.instance_id, P.AbortGroups(group_ids=[gid], partial=True))
            return True
        return False

    @staticmethod
    def _can_take(inst: Instance | None) -> bool:
        return inst is not None and inst.state == RUNNING and not inst.operator_paused

    def _resume_elsewhere(
        self,
        source: Instance,
        record: GroupRecord,
        msg: P.GroupAborted,
        to: int,
        priority: int | None,
    ) -> bool:
        """The second half of ``migrate``: ``msg`` brought the partial output from ``source``."""
        target = self.instances.get(to)
        if msg.partial is None or not self._can_take(target):
            return False
        assert target is not None
        gid = record.group_id
        record.instance_id = to
        target.in_flight[gid] = record
        carried = sum(len(p.token_ids) for p in msg.partial)
        self.ledger.migrated(gid, instance=source.instance_id, to=to, tokens=carried)
        self.outbox.to_instance(
            to, self._generate(gid, record.prompt_id, record.start_version, priority, msg.partial)
        )
        target.running_seqs = min(target.max_num_seqs, target.running_seqs + self.n)
        self.migrated += 1
        self.outbox.publish(
            P.EventKind.MIGRATE,
            f"group {gid} moved from instance {source.instance_id} to {to} "
            f"with {carried} token(s) generated",
            group=gid,
            instance=source.instance_id,
            to=to,
            tokens=carried,
        )
        return True

    # --- online repair ------------------------------------------------------------------------
    def repair(self, trainer_waits: bool) -> bool:
        """Let the scheduler defer or move in-flight groups (``Scheduler.repair``), when it says
        it has something to decide; ``trainer_waits``: the trainer waits on the oldest of them
        (``lag_wait``). True when anything was asked for. The moment the trainer starts to wait
        it is always asked: the policy's own schedule of looks cannot know when that is."""
        sched = self.work.scheduler
        now = self.clock()
        gov = self.governor
        starts_waiting = trainer_waits and not self._trainer_waited
        self._trainer_waited = trainer_waits
        if sched is None:
            return False
        # repair_due is always asked: it is how the policy sees each new version.
        if not sched.repair_due(now, gov.version) and not starts_waiting:
            return False
        running = tuple(
            Running(r.group_id, r.prompt_id, r.instance_id, r.start_version, r.dispatched_at)
            for inst in self.instances.values()
            for r in inst.in_flight.values()
            # The scheduler knows only its own epoch's groups.
            if not r.aborting and r.group_id not in self._migrating and r.epoch == self.work.epoch
        )
        waiting: tuple[Running, ...] = ()
        if trainer_waits:
            due = set(gov.waiting_for())
            waiting = tuple(r for r in running if r.group_id in due)
        view = RolloutView(now, gov.version, gov.queued, gov.batch_groups, waiting, running)
        acted = False
        for what in sched.repair(view):
            if isinstance(what, Defer):
                acted |= self.defer(what.group_id, what.reason)
            elif isinstance(what, Move):
                acted |= self.migrate(what.group_id, what.to, what.priority)
        return acted

    def defer(self, gid: int, reason: str) -> bool:
        """Abort in-flight group ``gid`` and hand its prompt back to the scheduler, to be
        regenerated at a later version (ledgered as aborted with ``reason``, counted)."""
        if gid in self._migrating or not self.governor.cancel(gid, ABORTED):
            return False
        self.abort(gid, f"deferred: {reason}")
        self.deferred += 1
        return True

    # --- results ------------------------------------------------------------------------------
    def on_group_done(self, inst: Instance, msg: P.GroupDone) -> None:
        self._migrating.pop(msg.group_id, None)  # finished before the move: taken as it is
        record = inst.in_flight.pop(msg.group_id, None)
        if record is None or record.aborting:
            self.ledger.ignored(msg.group_id, reason="result of a group no longer in flight")
            return
        if not msg.completions:
            self.governor.cancel(msg.group_id)
            self.ledger.requeued(msg.group_id, reason="empty result")
            self.work.give_back(record.prompt_id, record.epoch)
            return
        vmin = min(c.version_min for c in msg.completions)
        vmax = max(c.version_max for c in msg.completions)
        if vmin < record.start_version:
            log.warning(
                "group %d reports version_min %d below its dispatch version %d",
                msg.group_id,
                vmin,
                record.start_version,
            )
        lengths = [len(c.token_ids) for c in msg.completions]
        self.work.finished(record.prompt_id, record.epoch, inst.instance_id, lengths)
        outcome = self.governor.complete(msg.group_id, vmin, vmax, msg)
        self.ledger.completed(
            msg.group_id,
            instance=inst.instance_id,
            version_min=vmin,
            version_max=vmax,
            lengths=lengths,
        )
        if outcome == "discarded":
            self._discarded(
                msg.group_id,
                record.prompt_id,
                record.epoch,
                f"started at v{vmin}, beyond lag bound {self.governor.lag_bound}",
            )

    def on_group_aborted(self, inst: Instance, msg: P.GroupAborted) -> None:
        move = self._migrating.pop(msg.group_id, None)
        record = inst.in_flight.pop(msg.group_id, None)
        if record is None or record.aborting:
            return  # an abort we asked for, now confirmed (ledgered when we asked)
        if move is not None and self._resume_elsewhere(inst, record, msg, *move):
            return
        self.governor.cancel(msg.group_id, ABORTED)
        self.ledger.aborted(msg.group_id, reason=f"worker: {msg.reason}")
        self.work.give_back(record.prompt_id, record.epoch)

    def on_group_failed(self, inst: Instance, msg: P.GroupFailed) -> None:
        """A reward function failed on a group: stop the run, or drop the group and count it
        (``task.on_reward_error``). The group is never scored in its place, nor handed out
        again this epoch: the same prompt would fail the same way."""
        self._migrating.pop(msg.group_id, None)
        record = inst.in_flight.pop(msg.group_id, None)
        if record is None or record.aborting:
            self.ledger.ignored(msg.group_id, reason="result of a group no longer in flight")
            return
        self.governor.cancel(msg.group_id, SKIPPED)
        self.ledger.skipped(msg.group_id, reason=msg.error)
        self.work.consumed(record.prompt_id, record.epoch)
        about = {"group": msg.group_id, "prompt": msg.prompt_id, "instance": inst.instance_id}
        if self.config.task.on_reward_error == "fail":
            log.error("reward failed on instance %d: %s", inst.instance_id, msg.error)
            self.outbox.publish(
                P.EventKind.REWARD,
                f"reward failed, stopping (task.on_reward_error: fail): {msg.error}; "
                f"traceback in logs/worker-{inst.instance_id}.log",
                **about,
                error=msg.error,
            )
            self._request_stop(f"reward failed: {msg.error}", 1)
            return
        self.outbox.publish(
            P.EventKind.REWARD,
            f"group {msg.group_id} skipped (task.on_reward_error: skip_group): {msg.error}",
            **about,
            error=msg.error,
            skipped_total=self.governor.counters.skipped,
        )

    # --- giving up on groups ------------------------------------------------------------------
    def _discarded(self, gid: int, prompt_id: int, epoch: int, reason: str) -> None:
        self.ledger.discarded(gid, reason=reason)
        self.work.give_back(prompt_id, epoch)
        self.outbox.publish(
            P.EventKind.DISCARD,
            f"group {gid} (prompt {prompt_id}) discarded and re-queued: {reason}",
            group=gid,
            prompt=prompt_id,
            reason=reason,
        )

    def discard_completed(self, records: tuple[GroupRecord, ...], reason: str) -> None:
        """Completed groups the governor discarded: ledgered and handed out again."""
        for record in records:
            self._discarded(record.group_id, record.prompt_id, record.epoch, reason)

    def abort(self, gid: int, reason: str) -> None:
        """The governor gave up on an in-flight group: stop it on its instance, re-queue it."""
        for inst in self.instances.values():
            record = inst.in_flight.get(gid)
            if record is None:
                continue
            record.aborting = True
            record.dispatched_at = self.clock()  # now: when the abort was asked for
            self.ledger.aborted(gid, reason=reason)
            self.work.give_back(record.prompt_id, record.epoch)
            self.outbox.to_instance(inst.instance_id, P.AbortGroups(group_ids=[gid]))
            self.outbox.publish(
                P.EventKind.DISCARD,
                f"group {gid} aborted on instance {inst.instance_id} and re-queued: {reason}",
                group=gid,
                instance=inst.instance_id,
                reason=reason,
            )
            return

    def lose_in_flight(self, inst: Instance, reason: str) -> None:
        """Every group out on ``inst`` is gone: back to the scheduler, dispatched elsewhere."""
        lost = list(inst.in_flight.values())
        inst.in_flight.clear()
        for record in lost:
            self._migrating.pop(record.group_id, None)
        inst.running_seqs = 0
        for record in lost:
            if record.aborting:
                continue
            self.governor.cancel(record.group_id)
            self.ledger.requeued(record.group_id, reason=f"instance {inst.instance_id}: {reason}")
            self.work.give_back(record.prompt_id, record.epoch)
        if lost:
            self.outbox.publish(
                P.EventKind.INSTANCE,
                f"instance {inst.instance_id}: {len(lost)} group(s) re-queued ({reason})",
                instance=inst.instance_id,
                requeued=len(lost),
            )

    def any_paused(self) -> bool:
        return any(inst.operator_paused for inst in self.instances.values())

    def release_paused(self, group_ids: tuple[int, ...]) -> None:
        """Groups the trainer must have, frozen on an operator-paused instance, would stall the
        run until resume: abort them there and regenerate them elsewhere."""
        released = False
        for inst in self.instances.values():
            if not inst.operator_paused:
                continue
            for gid in group_ids:
                record = inst.in_flight.get(gid)
                if (
                    record is not None
                    and not record.aborting
                    and self.governor.cancel(gid, ABORTED)
                ):
                    self.abort(gid, f"needed by the trainer; instance {inst.instance_id} is paused")
                    released = True
        if released:
            self.dispatch()

    def drop_stale_aborts(self, now: float, timeout_s: float) -> None:
        """An abort the worker never confirmed must not hold its slots forever."""
        for inst in self.instances.values():
            for gid in [g for g, r in inst.in_flight.items() if r.aborting]:
                if now - inst.in_flight[gid].dispatched_at > timeout_s:
                    del inst.in_flight[gid]
