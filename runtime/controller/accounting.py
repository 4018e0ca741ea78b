"""Bubble accounting and the run's snapshot.

After every event each instance's free slots are charged to a cause (``runtime.bubbles``), and
the trainer's time to its condition; the snapshot operators see is built from the same state.
"""

from __future__ import annotations

from collections.abc import Callable

from runtime import protocol as P
from runtime.bubbles import BubbleAccountant, free_slot_cause
from runtime.config import Config
from runtime.controller.governor import LagGovernor
from runtime.controller.instances import DOWN, STARTING, Instance
from runtime.controller.telemetry import BubbleWindows
from runtime.controller.training import TrainerSide
from runtime.controller.work import WorkQueue

TRAINER_CONDITIONS = ("stepping", "starved", "lag_wait")


class Accounting:
    """Free-slot and trainer time by cause: in total, per window, and per step."""

    def __init__(self, config: Config, instances: dict[int, Instance], now: float) -> None:
        self.config = config
        self.instances = instances
        self.accountant = BubbleAccountant(
            {i: inst.max_num_seqs for i, inst in instances.items()}, now
        )
        self.windows = BubbleWindows(self.accountant, config.telemetry.window_s, now)
        self._working = 0
        self._trainer_condition = "idle"
        self.window: dict[str, float] = {}
        self.shares: dict[int, float] = {}
        self.total: dict[str, float] = {}

    def resize(self, instance_id: int, max_num_seqs: int, now: float) -> None:
        self.accountant.add_instance(instance_id, max_num_seqs, now)

    def since_step(self, now: float) -> dict[str, float]:
        return self.windows.step_interval(now)

    def account(self, now: float, work: WorkQueue, trainer_condition: str) -> None:
        """Every instance and the trainer, after an event that may have changed any of them."""
        # O(N) per call: this runs after every event, and 256 instances send hundreds a second.
        self._working = sum(1 for inst in self.instances.values() if inst.in_flight)
        self._trainer_condition = trainer_condition
        for i, inst in self.instances.items():
            self._account_one(now, i, inst, work)
        trainer = trainer_condition if trainer_condition in TRAINER_CONDITIONS else "idle"
        self.accountant.trainer_update(now, trainer)

    def account_some(self, now: float, instance_ids: set[int], work: WorkQueue) -> None:
        """Only these instances' own counts moved (a heartbeat): the rest is as last time."""
        for i in instance_ids:
            self._account_one(now, i, self.instances[i], work)

    def _account_one(self, now: float, i: int, inst: Instance, work: WorkQueue) -> None:
        if inst.state == DOWN or (inst.state == STARTING and inst.restarts > 0):
            state = "down"
        elif inst.state == STARTING:
            state = "starting"
        else:
            state = inst.state
        pending = work.pending(i)
        blocked = inst.blocked
        active = inst.active_slots()
        cause = free_slot_cause(
            state=state,
            pending=pending if state == "running" else 0,
            running=active,
            admission_open=not blocked or blocked in ("no work", "minibatch barrier"),
            work_elsewhere=self._working - (1 if inst.in_flight else 0) > 0,
            trainer_condition=self._trainer_condition,
            held=blocked == "no work" and pending > 0,
        )
        if inst.state == STARTING and inst.restarts == 0:
            cause = "idle"  # first start-up: nothing was lost yet
        self.accountant.update(i, now, active=active, cause=cause)

    def snapshot(
        self,
        now: float,
        *,
        run_state: str,
        governor: LagGovernor,
        trainer: TrainerSide,
        predicted: dict[str, float],
        sync_s: float,
        lane: Callable[[int], P.Lane],
        seq: int = 0,
    ) -> P.Snapshot:
        """``lane`` is asked once per instance: keep it a lookup."""
        gov = governor
        self.window, self.shares, total = self.windows.tick(now)
        self.total = total.fractions
        m = trainer.last_metrics
        r = trainer.last_record
        waiting = trainer.pending is not None and trainer.waiting_since
        trainer_row = P.TrainerSnapshot(
            state=trainer.condition if trainer.connected else "starting",
            reward_mean=m.reward_mean if m else 0.0,
            loss=m.loss if m else 0.0,
            iteration_s=trainer.last_iteration_s,
            samples_per_s=trainer.last_samples_per_s,
            tokens_per_s=trainer.last_tokens_per_s,
            waiting_s=(now - trainer.waiting_since) if waiting and trainer.waiting_since else 0.0,
            wait_batch_s=m.wait_batch_s if m else 0.0,
            train_s=m.step_s if m else 0.0,
            sync_s=sync_s,
            deferred=r.deferred if r else 0,
            migrated=r.migrated if r else 0,
            predictor_longest_rho=r.predictor_longest_rho if r else None,
            predictor_longest_ratio=r.predictor_longest_ratio if r else None,
        )
        rows = [
            P.InstanceSnapshot(
                instance_id=i,
                state=inst.state,
                in_flight_groups=len(inst.in_flight),
                running_seqs=inst.active_slots(),
                max_num_seqs=inst.max_num_seqs,
                tokens_per_s=inst.tokens_per_s,
                weight_version=max(0, inst.weight_version),
                versions_behind=max(0, gov.version - max(0, inst.weight_version)),
                bubble_share=self.shares.get(i, 0.0),
                restarts=inst.restarts,
                pending=inst.pending_text(now),
                lane=lane(i),
            )
            for i, inst in sorted(self.instances.items())
        ]
        c = gov.counters
        return P.Snapshot(
            run_name=self.config.run.name,
            time=now,
            seq=seq,
            state=run_state,
            step=gov.version,
            total_steps=self.config.trainer.steps,
            weight_version=gov.version,
            lag_bound=gov.lag_bound,
            pending_lag_bound=gov.pending_lag_bound,
            on_lag_decrease=gov.on_lag_decrease,
            batch_groups=gov.batch_groups,
            queue_depth=gov.queued,
            queue_capacity=gov.queue_capacity,
            in_flight_groups=gov.in_flight,
            admitted_groups=c.admitted,
            consumed_groups=c.consumed,
            discarded_groups=c.discarded + c.aborted,
            requeued_groups=c.requeued,
            deferred_groups=trainer.dispatcher.deferred,
            migrated_groups=trainer.dispatcher.migrated,
            lag=trainer.last_lag,
            trainer=trainer_row,
            bubbles_window=self.window,
            bubbles_total=self.total,
            bubbles_predicted=predicted,
            instances=rows,
        )
