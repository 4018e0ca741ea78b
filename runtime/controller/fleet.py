"""The rollout instances as the controller sees them: their states, weight syncs, liveness and
restarts, and the operator's pause, resume and restart.

States and transitions (DESIGN.md §5): ``starting`` until the worker says hello; ``syncing``
while it loads the weights it was sent (it gets no new work); ``running``; ``paused`` by the
operator; ``down`` when its process died, its heartbeats stopped or its weights would not load.
A down instance's groups go back to the scheduler, and its process is restarted with backoff.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from runtime import protocol as P
from runtime.config import Config
from runtime.controller.actions import KillProcess, Outbox, RestartProcess, WakeLater
from runtime.controller.dispatch import Dispatcher
from runtime.controller.governor import LagGovernor
from runtime.controller.instances import DOWN, PAUSED, RUNNING, STARTING, SYNCING, Instance
from runtime.controller.work import WorkQueue
from runtime.resources import SIM_BACKEND, worker_instance, worker_name

log = logging.getLogger(__name__)


def process_of(name: str, instances: dict[int, Instance]) -> list[Instance]:
    """The instances a child process hosts: every one for the sim backend, else its own."""
    if name == SIM_BACKEND:
        return list(instances.values())
    instance_id = worker_instance(name)
    return [] if instance_id is None else [instances[instance_id]]


class Fleet:
    """Instance states, weight syncs, heartbeats and restarts."""

    def __init__(
        self,
        config: Config,
        governor: LagGovernor,
        work: WorkQueue,
        dispatcher: Dispatcher,
        outbox: Outbox,
        *,
        supervises: bool,
        locate_weights: Callable[[int], str],
        request_stop: Callable[[str, int], None],
        on_resize: Callable[[int, int, float], None],
    ) -> None:
        self.config = config
        self.governor = governor
        self.work = work
        self.dispatcher = dispatcher
        self.outbox = outbox
        self.clock = outbox.clock
        self.instances = dispatcher.instances
        self.sim = config.rollout.backend == "sim"
        self.supervises = supervises
        self._locate_weights = locate_weights
        self._request_stop = request_stop
        self._on_resize = on_resize
        self.stopping = False
        self.weight_rendezvous: P.WeightRendezvous | None = None
        """Where the trainer serves weights (``async.weight_sync: collective``; None: files)."""
        self.sync_started_at: float | None = None
        self.last_sync_s = 0.0
        self._restart_generation: dict[str, int] = {}

    @property
    def worker_processes(self) -> bool:
        """Each instance is its own worker process that this controller may kill."""
        return self.supervises and not self.sim

    def process_name(self, inst: Instance) -> str:
        return SIM_BACKEND if self.sim else worker_name(inst.instance_id)

    # --- messages from instances --------------------------------------------------------------
    def on_message(self, inst: Instance, msg: object) -> None:
        now = self.clock()
        inst.last_heartbeat = now
        if isinstance(msg, P.WorkerHello):
            self._on_hello(inst, msg, now)
        elif isinstance(msg, P.Heartbeat):
            inst.running_seqs = msg.running_seqs
            inst.observe_tokens(msg.tokens_generated, now)
            if inst.state == DOWN and inst.restart_at is None and inst.ever_up:
                # It was declared dead on a missed heartbeat but is talking again: resync it.
                self._instance_up(inst, msg.weight_version, now, "heartbeat resumed")
        elif isinstance(msg, P.WorkerAck):
            self._on_ack(inst, msg, now)

    def _on_hello(self, inst: Instance, msg: P.WorkerHello, now: float) -> None:
        if inst.in_flight:
            # A fresh engine knows nothing of what we think it runs.
            self.dispatcher.lose_in_flight(inst, "worker restarted")
        if msg.max_num_seqs != inst.max_num_seqs and msg.max_num_seqs >= 1:
            inst.max_num_seqs = msg.max_num_seqs
            self._on_resize(inst.instance_id, msg.max_num_seqs, now)
        inst.pid = msg.pid
        inst.running_seqs = 0
        inst.tokens_generated = 0
        inst.last_tokens_at = 0.0
        self._instance_up(inst, msg.weight_version, now, f"worker up ({msg.backend})")

    def _instance_up(self, inst: Instance, version: int, now: float, why: str) -> None:
        inst.weight_version = version
        inst.sync_target = None
        inst.restart_at = None
        inst.ever_up = True
        inst.up_since = inst.up_since or now
        if inst.in_flight:
            self.dispatcher.lose_in_flight(inst, why)
        scheduler = self.work.scheduler
        if inst.lost_by_scheduler and scheduler is not None:
            inst.lost_by_scheduler = False
            if not inst.operator_paused:  # a paused one is resumed by the operator
                scheduler.on_instance_resumed(inst.instance_id)
        if inst.weight_version != self.governor.version:
            self.start_sync(inst, now)
        else:
            self.set_state(inst, PAUSED if inst.operator_paused else RUNNING, now, why)
            if inst.operator_paused:
                self.outbox.to_instance(inst.instance_id, P.PauseWorker(mode="keep"))

    def _on_ack(self, inst: Instance, msg: P.WorkerAck, now: float) -> None:
        if msg.request in ("pause", "resume"):
            inst.pending_ack = None
            inst.weight_version = max(inst.weight_version, msg.weight_version)
            return
        if msg.request != "update_weights":
            return
        if not msg.ok:
            inst.sync_failures += 1
            self.outbox.publish(
                P.EventKind.WEIGHTS,
                f"instance {inst.instance_id} failed to load weights: {msg.detail}",
                instance=inst.instance_id,
                ok=False,
            )
            inst.sync_target = None
            if inst.sync_failures >= 3:
                self.mark_down(inst, now, f"weight sync failed 3 times: {msg.detail}")
                self._kill(inst)
            else:
                self.start_sync(inst, now)
            return
        inst.sync_failures = 0
        inst.weight_version = max(inst.weight_version, msg.weight_version)
        inst.sync_target = None
        if inst.weight_version < self.governor.version:
            self.start_sync(inst, now)  # a newer version came out meanwhile
        elif inst.state == SYNCING:
            state = PAUSED if inst.operator_paused else RUNNING
            self.set_state(inst, state, now, f"weights v{inst.weight_version}", routine=True)
        self.check_sync_complete()

    # --- weights ------------------------------------------------------------------------------
    def start_sync(self, inst: Instance, now: float) -> None:
        """Send the current weights; the instance gets no dispatch until it acknowledges."""
        v = self.governor.version
        inst.sync_target = v
        inst.sync_started = now
        mode = self.config.async_.update_mode
        path = self._locate_weights(v)
        update = P.UpdateWeights(version=v, path=path, mode=mode, rendezvous=self.weight_rendezvous)
        self.outbox.to_instance(inst.instance_id, update)
        if inst.state != PAUSED:
            self.set_state(inst, SYNCING, now, f"syncing weights v{v}", routine=True)

    def publish_version(self, version: int, path: str, now: float) -> None:
        """The trainer published ``version``: every live instance starts loading it."""
        told = []
        for inst in self.instances.values():
            if inst.state in (RUNNING, SYNCING, PAUSED):
                if inst.sync_target is None:
                    self.start_sync(inst, now)
                told.append(inst.instance_id)
        self.sync_started_at = now
        self.outbox.publish(
            P.EventKind.WEIGHTS,
            f"weights v{version} published to {len(told)} instance(s)",
            version=version,
            path=path,
            instances=told,
        )

    def sync_all_stale(self) -> None:
        """The controller followed the trainer's checkpoint to another version."""
        for inst in self.instances.values():
            if inst.alive and inst.weight_version != self.governor.version:
                self.start_sync(inst, self.clock())

    def sync_lagging(self) -> list[int]:
        """Live instances still loading a version older than the trainer's previous one."""
        floor = self.governor.version - 1
        return [
            i
            for i, inst in self.instances.items()
            if inst.state in (RUNNING, SYNCING) and inst.weight_version < floor
        ]

    def check_sync_complete(self) -> None:
        started = self.sync_started_at
        if started is None:
            return
        v = self.governor.version
        live = [inst for inst in self.instances.values() if inst.state in (RUNNING, SYNCING)]
        if any(inst.weight_version < v for inst in live):
            return
        self.sync_started_at = None
        self.last_sync_s = self.clock() - started
        self.outbox.publish(
            P.EventKind.WEIGHTS,
            f"weights v{v} loaded by {len(live)}/{len(self.instances)} instances in "
            f"{self.last_sync_s:.2f}s",
            version=v,
            sync_s=self.last_sync_s,
            instances=len(live),
        )

    # --- states -------------------------------------------------------------------------------
    def set_state(
        self, inst: Instance, state: str, now: float, why: str = "", *, routine: bool = False
    ) -> None:
        """Change an instance's state and record it. A ``routine`` change (running <-> syncing
        for a weight version) goes to metrics.jsonl only: on a big cluster every version would
        otherwise put two lines per instance in the event log; the version's own "loaded by"
        event sums them up."""
        if inst.state == state:
            return
        old = inst.state
        inst.state = state
        inst.state_since = now
        message = f"instance {inst.instance_id}: {old} -> {state}" + (f" ({why})" if why else "")
        data = {"instance": inst.instance_id, "old": old, "new": state, "reason": why}
        if routine and {old, state} == {RUNNING, SYNCING}:
            data["routine"] = True
            self.outbox.record(
                {"event": P.EventKind.INSTANCE, "message": message, **data, "time": now}
            )
            return
        self.outbox.publish(P.EventKind.INSTANCE, message, **data)

    def mark_down(self, inst: Instance, now: float, why: str) -> None:
        if inst.state == DOWN:
            return
        self.dispatcher.lose_in_flight(inst, why)
        inst.sync_target = None
        inst.pending_ack = None
        inst.tokens_per_s = 0.0
        if self.work.scheduler is not None and not inst.lost_by_scheduler:
            inst.lost_by_scheduler = True
            self.work.scheduler.on_instance_lost(inst.instance_id)
        self.set_state(inst, DOWN, now, why)
        self.check_sync_complete()

    def _kill(self, inst: Instance) -> None:
        if self.worker_processes:
            self.outbox.add(KillProcess(worker_name(inst.instance_id)))

    # --- processes ----------------------------------------------------------------------------
    def on_started(self, name: str, pid: int) -> None:
        for inst in process_of(name, self.instances):
            inst.pid = pid
            inst.state_since = self.clock()  # the start timeout counts from here

    def on_exit(self, name: str, code: int) -> None:
        if self.stopping:
            return
        now = self.clock()
        affected = process_of(name, self.instances)
        if not affected:
            return
        backoff_max = self.config.rollout.restart.backoff_max_s
        for inst in affected:
            if inst.up_since and now - inst.up_since > backoff_max:
                inst.auto_restarts = 0  # it ran well for a while: a fresh failure, fresh backoff
            inst.up_since = 0.0
            inst.ever_up = False  # a dead process does not come back by itself
            self.mark_down(inst, now, f"process exited with code {code}")
        self._schedule_restart(name, affected, manual=False)

    def _schedule_restart(self, name: str, affected: list[Instance], manual: bool) -> bool:
        rcfg = self.config.rollout.restart
        lead = affected[0]
        if manual:
            delay = 0.0
        else:
            if not rcfg.auto or lead.auto_restarts >= rcfg.max_restarts:
                self.outbox.publish(
                    P.EventKind.INSTANCE,
                    f"{name} stays down (automatic restarts: "
                    f"{lead.auto_restarts}/{rcfg.max_restarts}, auto={rcfg.auto})",
                    name=name,
                )
                gone = all(
                    x.state == DOWN and x.restart_at is None for x in self.instances.values()
                )
                if rcfg.auto and gone:  # with auto off, the operator restarts by command
                    self._request_stop("every rollout instance is down for good", 1)
                return False
            delay = min(rcfg.backoff_max_s, rcfg.backoff_initial_s * 2**lead.auto_restarts)
            for inst in affected:
                inst.auto_restarts += 1
        when = self.clock() + delay
        for inst in affected:
            inst.restart_at = when
        # A newer restart (the operator's, say) supersedes one still waiting out its backoff.
        generation = self._restart_generation.get(name, 0) + 1
        self._restart_generation[name] = generation
        self.outbox.add(WakeLater(delay, name, generation))
        return True

    def on_restart_due(self, name: str, generation: int) -> None:
        if self.stopping or self._restart_generation.get(name) != generation:
            return
        now = self.clock()
        for inst in process_of(name, self.instances):
            inst.restarts += 1
            inst.restart_at = None
            inst.last_heartbeat = now
            inst.ever_up = False
            self.set_state(inst, STARTING, now, "restarting")
        self.outbox.add(RestartProcess(name))

    def on_start_failed(self, name: str, error: str) -> None:
        for inst in process_of(name, self.instances):
            self.mark_down(inst, self.clock(), f"restart failed: {error}")

    # --- liveness -----------------------------------------------------------------------------
    def check_liveness(self, now: float) -> None:
        rcfg = self.config.rollout
        if self.stopping:
            return  # every worker is about to get Shutdown; a slow one is no reason to kill it
        self.dispatcher.drop_stale_aborts(now, rcfg.heartbeat_timeout_s)
        limit = self.config.trainer.step_timeout_s
        for inst in self.instances.values():
            syncing = inst.state == SYNCING and inst.sync_target is not None
            if syncing and now - inst.sync_started > limit:
                # Heartbeats alone do not prove progress: an engine that never finishes loading
                # would hold the trainer (which waits for the previous version) forever.
                self.mark_down(inst, now, f"weights v{inst.sync_target} not loaded in {limit:.0f}s")
                self._kill(inst)
                continue
            if inst.state in (RUNNING, SYNCING, PAUSED):
                if now - inst.last_heartbeat > rcfg.heartbeat_timeout_s:
                    self.mark_down(inst, now, f"no heartbeat for {rcfg.heartbeat_timeout_s:.0f}s")
                    self._kill(inst)
            elif (
                inst.state == STARTING
                and self.worker_processes
                and now - inst.state_since > rcfg.start_timeout_s
            ):
                self.outbox.publish(
                    P.EventKind.INSTANCE,
                    f"instance {inst.instance_id} did not start within {rcfg.start_timeout_s:.0f}s",
                    instance=inst.instance_id,
                )
                inst.state_since = now
                self._kill(inst)

    # --- operator -----------------------------------------------------------------------------
    def pause(self, inst: Instance) -> None:
        inst.operator_paused = True
        inst.pending_ack = "pause"
        self.outbox.to_instance(inst.instance_id, P.PauseWorker(mode="keep"))
        if self.work.scheduler is not None:
            self.work.scheduler.on_instance_paused(inst.instance_id)
        if inst.state in (RUNNING, SYNCING):
            self.set_state(inst, PAUSED, self.clock(), "operator")

    def resume(self, inst: Instance) -> None:
        inst.operator_paused = False
        inst.pending_ack = "resume"
        self.outbox.to_instance(inst.instance_id, P.ResumeWorker())
        if self.work.scheduler is not None and not inst.lost_by_scheduler:
            self.work.scheduler.on_instance_resumed(inst.instance_id)
        now = self.clock()
        if inst.state != PAUSED:
            return
        if inst.weight_version < self.governor.version:
            self.set_state(inst, SYNCING, now, "operator resume; weights stale")
            if inst.sync_target is None:
                self.start_sync(inst, now)
        else:
            self.set_state(inst, RUNNING, now, "operator")

    def restart(self, inst: Instance) -> str:
        now = self.clock()
        name = self.process_name(inst)
        affected = list(self.instances.values()) if self.sim else [inst]
        for other in affected:
            other.ever_up = False
            other.auto_restarts = 0
            self.mark_down(other, now, "operator restart")
        self._schedule_restart(name, affected, manual=True)
        return f"restarting {name}"
