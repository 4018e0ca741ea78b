"""The controller core: every decision of a run, with no sockets, no processes and no clock of
its own (sans-IO, like vLLM's ``EngineCore``).

Events go in (:mod:`runtime.controller.actions`: a message from an instance or the trainer, an
operator command, a tick, a child process started or exited), actions come out (send this to
instance i, answer the command, publish an event, record a line, restart a process). The live
controller (:mod:`runtime.controller.process`) feeds it from its sockets; the simulator
(:mod:`runtime.sim.engine`) feeds it from simulated instances on a simulated clock, so a plan is
scored by the rules the live run enforces.

The state is split by concern: :class:`~runtime.controller.work.WorkQueue` (prompts, epochs,
the scheduler), :class:`~runtime.controller.dispatch.Dispatcher` (groups out and back, under the
:class:`~runtime.controller.governor.LagGovernor`), :class:`~runtime.controller.fleet.Fleet`
(instance states, weights, liveness, restarts), :class:`~runtime.controller.training.TrainerSide`
(batches and steps), :class:`~runtime.controller.accounting.Accounting` (bubbles, snapshots) and
:class:`~runtime.controller.evaluation.Evaluator`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from runtime import protocol as P
from runtime.config import Config
from runtime.controller import actions as A
from runtime.controller import commands
from runtime.controller.accounting import Accounting
from runtime.controller.dispatch import Dispatcher
from runtime.controller.evaluation import Evaluator
from runtime.controller.fleet import Fleet
from runtime.controller.governor import LagGovernor
from runtime.controller.instances import Instance
from runtime.controller.ledger import Ledger
from runtime.controller.state import ControllerState
from runtime.controller.training import TrainerSide
from runtime.controller.work import EpochPlan, TaskData, WorkQueue
from runtime.resources import TRAINER

log = logging.getLogger(__name__)


class ControllerCore:
    """One run's decisions. ``core.handle(event)`` returns the actions to carry out.

    ``make_scheduler`` plans each epoch (``runtime.scheduler.make_scheduler``; None: the core
    is given its one plan, as the simulator does); ``plan_inline`` plans the next epoch at once
    instead of asking the shell to plan it off the loop (:class:`~actions.PlanEpoch`);
    ``quiet`` logs nothing (the simulator's cores run beside the live one's log).
    """

    def __init__(
        self,
        config: Config,
        task: TaskData,
        *,
        clock: Callable[[], float],
        ledger: Ledger,
        saved: ControllerState | None = None,
        next_group_id: int = 0,
        supervises: bool = True,
        make_scheduler: Callable[..., Any] | None = None,
        plan_inline: bool = False,
        single_epoch: bool = False,
        locate_weights: Callable[[int], str] | None = None,
        quiet: bool = False,
    ) -> None:
        self.config = config
        self.clock = clock
        self.ledger = ledger
        self.spawn = supervises
        self.sim = config.rollout.backend == "sim"
        self.state = "starting"
        self.exit_code = 0
        self.stopping = False
        self.stop_reason = ""
        self.telemetry: Any = None
        """What ``status``/``history`` read (the shell's telemetry ring; None: none)."""
        self.outbox = A.Outbox(clock, quiet=quiet)
        self._locate_weights = locate_weights or (lambda v: task.model_path if v == 0 else "")

        # Any saved progress is resumed (trainer.steps may have been raised since).
        self.resumed = saved is not None and saved.version > 0
        st = saved if self.resumed and saved else ControllerState(lag_bound=config.async_.lag_bound)
        self.governor = _governor(config, st, self.resumed)
        now = clock()
        n = config.rollout.sampling.n
        instances = {
            i: Instance(
                i, config.rollout.max_num_seqs_of(i), n, state_since=now, last_heartbeat=now
            )
            for i in range(config.num_instances)
        }
        self.work = WorkQueue(
            config,
            task,
            epoch=st.epoch,
            consumed=st.consumed_prompts,
            next_group_id=max(st.next_group_id, next_group_id),
            request_plan=None if plan_inline else self._request_plan,
            make_scheduler=make_scheduler,
            single_epoch=single_epoch,
            quiet=quiet,
        )
        self.dispatcher = Dispatcher(
            config,
            self.governor,
            self.work,
            instances,
            ledger,
            self.outbox,
            may_dispatch=self._may_dispatch,
            request_stop=self.request_stop,
        )
        self.dispatcher.deferred, self.dispatcher.migrated = st.deferred_total, st.migrated_total
        self.accounting = Accounting(config, instances, now)
        self.fleet = Fleet(
            config,
            self.governor,
            self.work,
            self.dispatcher,
            self.outbox,
            supervises=supervises,
            locate_weights=self.weights_of,
            request_stop=self.request_stop,
            on_resize=self.accounting.resize,
        )
        self.trainer = TrainerSide(
            config,
            self.governor,
            self.work,
            self.dispatcher,
            self.fleet,
            ledger,
            self.outbox,
            bubbles_since_step=self.accounting.since_step,
            predicted_bubbles=self.work.predicted_breakdown,
        )
        self.evaluator = Evaluator(
            config, instances, self.outbox, task.eval_prompts, task.eval_tokens
        )
        self.instances = instances
        self._seen_pending: int | None = None

    # --- the one entry point ------------------------------------------------------------------
    def start(self, first: tuple[EpochPlan, Any] | None = None) -> list[A.Action]:
        """Plan the current epoch (blocking; ``first``: a plan made already) and start."""
        if first is None:
            skip = self.work.consumed_prompts
            specs = self.dispatcher.instance_specs()
            plan = self.work.plan(self.work.epoch, specs, self.governor.admission_bound, skip)
            first = (plan, plan.make())
        self.dispatcher.install_epoch(*first)
        self.ledger.controller_start(
            version=self.governor.version, epoch=self.work.epoch, resumed=self.resumed
        )
        self.state = "running"
        self._after_change()
        return self.outbox.take()

    def handle(self, event: A.Event) -> list[A.Action]:
        """Apply one event; the actions it calls for, in order."""
        return self.handle_all([event])

    def handle_all(self, events: list[A.Event]) -> list[A.Action]:
        """Apply events that happened at the same moment, then decide once."""
        local: set[int] = set()
        changed = False
        for event in events:
            if not _is_heartbeat(event):
                self._apply(event)
                changed = True
            elif self._heartbeat(event):  # type: ignore[arg-type]
                local.add(event.instance_id)  # type: ignore[union-attr]
            else:
                changed = True
        if changed:
            self._after_change()
        elif local:
            # Only slot counts moved: nothing to dispatch or batch; re-account those instances.
            self.accounting.account_some(self.clock(), local, self.work)
        return self.outbox.take()

    def _heartbeat(self, event: A.InstanceMessage) -> bool:
        """Apply a heartbeat; True when it changed nothing but the instance's own counts."""
        inst = self.instances.get(event.instance_id)
        if inst is None:
            log.warning("message from unknown instance %d ignored", event.instance_id)
            return False
        state, actions = inst.state, len(self.outbox.actions)
        self.fleet.on_message(inst, event.message)
        return inst.state == state and len(self.outbox.actions) == actions

    def _apply(self, event: A.Event) -> None:
        if isinstance(event, A.InstanceMessage):
            self._on_instance(event.instance_id, event.message)
        elif isinstance(event, A.TrainerMessage):
            self._on_trainer(event.message)
        elif isinstance(event, A.OperatorCommand):
            self._on_command(event.command)
        elif isinstance(event, A.Tick):
            self.fleet.check_liveness(self.clock())
        elif isinstance(event, A.ProcessStarted):
            self.fleet.on_started(event.name, event.pid)
        elif isinstance(event, A.ProcessExited):
            self._on_exit(event.name, event.code)
        elif isinstance(event, A.ProcessStartFailed):
            self.fleet.on_start_failed(event.name, event.error)
        elif isinstance(event, A.RestartDue):
            self.fleet.on_restart_due(event.name, event.generation)
        elif isinstance(event, A.InstanceUnreachable):
            inst = self.instances.get(event.instance_id)
            if inst is not None:
                # Its death handling re-queues what was sent to it.
                self.fleet.mark_down(inst, self.clock(), "unreachable")
        elif isinstance(event, A.EpochPlanned):
            self._on_planned(event)
        elif isinstance(event, A.StartFinalEval):
            self.evaluator.start(self.governor.version, final=True)

    def _after_change(self) -> None:
        """After every event: feed the instances, then the trainer, then account."""
        self.dispatcher.dispatch()
        self.trainer.try_batch(self.stopping, self.stop_reason)
        if self.dispatcher.repair(self.trainer.condition == "lag_wait"):
            # The policy deferred or moved running work: refill, batch again.
            self.dispatcher.dispatch()
            self.trainer.try_batch(self.stopping, self.stop_reason)
        self.accounting.account(self.clock(), self.work, self.trainer.reported_condition)
        gov = self.governor
        if self._seen_pending is not None and gov.pending_lag_bound is None:
            self.outbox.publish(
                P.EventKind.LAG,
                f"lag bound {gov.lag_bound} now in force (in-flight work drained)",
                lag_bound=gov.lag_bound,
            )
        self._seen_pending = gov.pending_lag_bound

    # --- events -------------------------------------------------------------------------------
    def _on_instance(self, instance_id: int, msg: Any) -> None:
        inst = self.instances.get(instance_id)
        if inst is None:
            log.warning("message from unknown instance %d ignored", instance_id)
            return
        if isinstance(msg, P.GroupDone | P.GroupAborted | P.GroupFailed):
            inst.last_heartbeat = self.clock()
            if msg.group_id < 0:
                self.evaluator.on_result(msg)
            elif isinstance(msg, P.GroupDone):
                self.dispatcher.on_group_done(inst, msg)
            elif isinstance(msg, P.GroupAborted):
                self.dispatcher.on_group_aborted(inst, msg)
            else:
                self.dispatcher.on_group_failed(inst, msg)
        else:
            self.fleet.on_message(inst, msg)

    def _on_trainer(self, msg: Any) -> None:
        if isinstance(msg, P.StepDone):
            step = self.governor.version
            if not self.trainer.on_step_done(msg):
                return
            self.outbox.add(A.SaveState(self.saved_state()))
            evaluation = self.config.task.eval
            total = self.trainer.total_steps
            if evaluation and (step + 1) % evaluation.every == 0 and step + 1 < total:
                self.evaluator.start(self.governor.version, final=False)  # the last: final
            if self.governor.version >= total:
                self.request_stop(f"trainer.steps ({total}) reached", 0)
        else:
            self.trainer.on_message(msg)

    def _on_command(self, cmd: P.Command | P.InvalidCommand) -> None:
        reply = commands.handle(self, cmd)
        self.outbox.add(A.CommandAnswered(reply))
        # Stamped when it took effect, before the reply can reach the client.
        args = A.jsonable(cmd.args)
        self.outbox.record(
            {
                "event": P.EventKind.COMMAND,
                "name": cmd.name,
                "args": args,
                "ok": reply.ok,
                "reason": reply.reason,
                "time": self.clock(),
            }
        )
        if cmd.name in ("status", "history"):
            return
        text = f"{cmd.name} {cmd.args or ''}".strip()
        text += " acknowledged" if reply.ok else f" refused: {reply.reason}"
        if reply.ok and reply.reason:
            text += f" ({reply.reason})"
        self.outbox.publish(
            P.EventKind.COMMAND,
            text,
            name=cmd.name,
            args=args,
            ok=reply.ok,
            reason=reply.reason,
        )

    def _on_exit(self, name: str, code: int) -> None:
        if name != TRAINER:
            self.fleet.on_exit(name, code)
            return
        if self.trainer.shutdown_sent and (
            self.stopping or self.governor.version >= self.trainer.total_steps
        ):
            return
        self.outbox.publish(
            P.EventKind.RUN, f"trainer exited unexpectedly with code {code}", code=code
        )
        self.request_stop(f"trainer exited with code {code}", 1)

    def _request_plan(self, plan: EpochPlan) -> None:
        self.outbox.add(A.PlanEpoch(plan))

    def _on_planned(self, event: A.EpochPlanned) -> None:
        plan = event.plan
        if event.error:
            self.outbox.publish(
                P.EventKind.RUN, f"planning epoch {plan.epoch} failed: {event.error}"
            )
            self.request_stop(f"planning epoch {plan.epoch} failed", 1)
            return
        log.info("epoch %d planned in %.2fs", plan.epoch, event.seconds)
        if not self.stopping:
            # Installed as soon as the current epoch has nothing left.
            self.work.planned(plan, event.scheduler)

    # --- what the shell and the commands call -------------------------------------------------
    def _may_dispatch(self) -> bool:
        # The trainer's checkpoint decides the version a resumed run continues from; no work
        # starts before it has said which.
        return not self.stopping and (self.trainer.hello_seen or not self.resumed)

    def request_stop(self, reason: str = "stop requested", code: int = 0) -> None:
        """Begin a clean stop: the trainer gets Shutdown at its next request (it writes its final
        checkpoint), then the workers; exit ``code``."""
        if self.stopping:
            return
        self.stopping = True
        self.fleet.stopping = True
        self.stop_reason = reason
        self.exit_code = self.exit_code or code
        self.state = "stopping"
        self.outbox.publish(P.EventKind.RUN, f"stopping: {reason}", reason=reason)
        self.trainer.try_batch(self.stopping, self.stop_reason)
        self.outbox.add(A.StopRequested(reason, code))

    def op_set_lag_bound(self, value: int) -> str:
        change = self.governor.set_lag_bound(value)
        reason = f"lag bound lowered to {value} (abort)"
        for gid in change.aborted:
            self.dispatcher.abort(gid, reason)
        self.dispatcher.discard_completed(change.discarded_records, reason)
        if self.work.scheduler is not None:
            self.work.scheduler.set_lag_bound(self.governor.admission_bound)
        self.outbox.add(A.SaveState(self.saved_state()))
        return change.description

    def op_pause(self, inst: Instance) -> None:
        self.fleet.pause(inst)

    def op_resume(self, inst: Instance) -> None:
        self.fleet.resume(inst)

    def op_restart(self, inst: Instance) -> str:
        return self.fleet.restart(inst)

    def weights_of(self, version: int) -> str:
        """Where weight version ``version`` lives."""
        return self.trainer.weights_of(version) or self._locate_weights(version)

    def snapshot(self, seq: int = 0) -> P.Snapshot:
        return self.accounting.snapshot(
            self.clock(),
            run_state=self.state,
            governor=self.governor,
            trainer=self.trainer,
            predicted=self.work.predicted_breakdown(),
            sync_s=self.fleet.last_sync_s,
            lane=self.work.lane,
            seq=seq,
        )

    def saved_state(self) -> ControllerState:
        gov = self.governor
        c = gov.counters
        return ControllerState(
            version=gov.version,
            epoch=self.work.epoch,
            lag_bound=gov.admission_bound,
            consumed_total=c.consumed,
            consumed_prompts=sorted(self.work.consumed_prompts),
            next_group_id=self.work.next_group_id,
            discarded_total=c.discarded + c.aborted,
            requeued_total=c.requeued,
            skipped_total=c.skipped,
            deferred_total=self.dispatcher.deferred,
            migrated_total=self.dispatcher.migrated,
            finished=gov.version >= self.trainer.total_steps,
            time=self.clock(),
        )

    def finish(self) -> None:
        """The shell's shutdown is over: the run's final state."""
        self.state = "finished" if self.exit_code == 0 else "failed"


def _is_heartbeat(event: A.Event) -> bool:
    return isinstance(event, A.InstanceMessage) and isinstance(event.message, P.Heartbeat)


def _governor(config: Config, st: ControllerState, resumed: bool) -> LagGovernor:
    """The lag governor, with the counters of a resumed run."""
    cfg = config.async_
    governor = LagGovernor(
        config.trainer.batch_groups,
        min(st.lag_bound, cfg.max_lag_bound),
        max_lag_bound=cfg.max_lag_bound,
        on_lag_decrease=cfg.on_lag_decrease,
        version=st.version,
        consumed_before=st.consumed_total if resumed else 0,
    )
    if resumed:
        c = governor.counters
        c.discarded, c.requeued, c.skipped = st.discarded_total, st.requeued_total, st.skipped_total
        c.admitted += c.discarded + c.requeued + c.skipped
    return governor
