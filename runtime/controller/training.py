"""The trainer's side of the controller: batches out under the lag bound, steps back in.

The trainer asks for a batch at its version; the governor forms one when the lag rules allow
(or says why not: ``starved``, ``lag_wait``); the StepDone that comes back publishes the new
weights to the instances and writes the step's record to metrics.jsonl.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from runtime import protocol as P
from runtime.config import Config
from runtime.controller.actions import Outbox
from runtime.controller.dispatch import Dispatcher
from runtime.controller.fleet import Fleet
from runtime.controller.governor import LagGovernor, LagRecorder
from runtime.controller.ledger import Ledger
from runtime.controller.work import WorkQueue
from runtime.records import StepRecord, step_record

log = logging.getLogger(__name__)

KEEP_WEIGHT_PATHS = 4
"""Versions whose weight paths are remembered (older ones are gone from disk)."""


@dataclass
class _BatchFacts:
    """What the step record needs of the batch last sent (the trainer may not report it)."""

    tokens: int = 0
    samples: int = 0
    rewards: list[float] = field(default_factory=list)
    reward_functions: dict[str, float] = field(default_factory=dict)
    longest: list[tuple[float, float]] = field(default_factory=list)
    """(predicted, actual) longest sample of each group the plan had a prediction for."""


class TrainerSide:
    """What the controller knows of the trainer, and the batches and steps between them."""

    def __init__(
        self,
        config: Config,
        governor: LagGovernor,
        work: WorkQueue,
        dispatcher: Dispatcher,
        fleet: Fleet,
        ledger: Ledger,
        outbox: Outbox,
        *,
        bubbles_since_step: Callable[[float], dict[str, float]],
        predicted_bubbles: Callable[[], dict[str, float]],
    ) -> None:
        self.config = config
        self.governor = governor
        self.work = work
        self.dispatcher = dispatcher
        self.fleet = fleet
        self.ledger = ledger
        self.outbox = outbox
        self.clock = outbox.clock
        self._bubbles_since_step = bubbles_since_step
        self._predicted_bubbles = predicted_bubbles
        self.total_steps = config.trainer.steps
        self.connected = False
        self.hello_seen = False
        self.pending: int | None = None
        """The version of the batch the trainer is waiting for (None: not waiting)."""
        self.condition = "idle"
        self.waiting_since: float | None = None
        self.shutdown_sent = False
        self.first_request_at: float | None = None
        self.last_step_at: float | None = None
        self.last_metrics: P.StepMetrics | None = None
        self.last_iteration_s = 0.0
        self.last_samples_per_s = 0.0
        self.last_tokens_per_s = 0.0
        self.last_lag = P.LagStats()
        self.last_record: StepRecord | None = None
        self._moves_mark = (dispatcher.deferred, dispatcher.migrated)
        """The dispatcher's (deferred, migrated) counts at the previous step (a resumed run's
        totals carry over)."""
        self.weights_path: dict[int, str] = {}
        self._batch = _BatchFacts()
        self.batch_bound = governor.lag_bound
        """The bound in force when the last batch was formed (its lags are within it)."""
        self.batch_pending: int | None = None

    @property
    def reported_condition(self) -> str:
        return self.condition if self.connected else "idle"

    # --- messages -----------------------------------------------------------------------------
    def on_message(self, msg: object) -> None:
        self.connected = True
        if isinstance(msg, P.TrainerHello):
            self.hello_seen = True
            self._on_hello(msg)
        elif isinstance(msg, P.BatchRequest):
            now = self.clock()
            if self.first_request_at is None:
                self.first_request_at = now
            if msg.version != self.governor.version:
                log.warning(
                    "trainer asks for a batch at v%d; controller is at v%d",
                    msg.version,
                    self.governor.version,
                )
            self.pending = msg.version
            self.waiting_since = now

    def _on_hello(self, msg: P.TrainerHello) -> None:
        gov = self.governor
        # Before any sync below: the workers must learn where the weights are served.
        self.fleet.weight_rendezvous = msg.weight_rendezvous
        if msg.weight_version != gov.version:
            if gov.outstanding or gov.in_flight or gov.queued:
                self.outbox.publish(
                    P.EventKind.TRAINER,
                    f"trainer at v{msg.weight_version} but the controller is "
                    f"at v{gov.version} with work in flight; keeping v{gov.version}",
                )
            else:
                self.outbox.publish(
                    P.EventKind.TRAINER,
                    f"trainer checkpoint is at v{msg.weight_version}; "
                    f"controller state said v{gov.version}: following the trainer",
                )
                gov.version = msg.weight_version
                c = gov.counters
                c.consumed = c.completed = msg.weight_version * gov.batch_groups
                c.admitted = c.consumed + c.discarded + c.aborted + c.requeued
                self.fleet.sync_all_stale()
        self.outbox.publish(
            P.EventKind.TRAINER,
            f"trainer connected ({msg.num_processes} process(es), "
            f"v{msg.weight_version}, pid {msg.pid})",
            pid=msg.pid,
        )

    # --- batches ------------------------------------------------------------------------------
    def try_batch(self, stopping: bool, stop_reason: str) -> None:
        if self.pending is None or not self.connected:
            return
        gov = self.governor
        if stopping or gov.version >= self.total_steps:
            if not gov.outstanding:
                reason = stop_reason or "trainer.steps reached"
                self.outbox.to_trainer(P.Shutdown(reason=reason))
                self.shutdown_sent = True
                self.pending = None
                self.condition = "idle"
            return
        if gov.outstanding:
            return
        if self.fleet.sync_lagging():
            # The weights of the previous version are still going out; keep it simple and
            # correct: at most two versions are ever in flight to the workers.
            self.condition = "lag_wait"
            return
        # The bound in force while this batch is formed (a pending bound may apply right after).
        bound, pending = gov.lag_bound, gov.pending_lag_bound
        plan = gov.take_batch(last=self.work.done())
        if not plan.ready:
            self.condition = plan.condition
            if plan.condition == "lag_wait" and self.dispatcher.any_paused():
                self.dispatcher.release_paused(plan.waiting_for)
            return
        reason = f"more than B groups due at v{plan.version}"
        self.dispatcher.discard_completed(plan.discarded_records, reason)
        for gid in plan.aborted:
            self.dispatcher.abort(gid, reason)
        groups = self._consume(plan)
        self.batch_bound, self.batch_pending = bound, pending
        self.outbox.to_trainer(P.Batch(version=plan.version, groups=groups))
        self.pending = None
        self.condition = "stepping"

    def _consume(self, plan: Any) -> list[P.TrainGroup]:
        gov = self.governor
        groups = []
        recorder = LagRecorder()
        lags = []
        longest_predicted = []
        for gid in plan.group_ids:
            record = gov.groups[gid]
            longest_predicted.append(record.predicted_longest)
            result: P.GroupDone = record.result
            lag = gov.lag_of(gid)
            lags.append(lag)
            for c in result.completions:
                # Conservative: never below the group's own lag (its dispatch version).
                recorder.add(max(plan.version - c.version_min, lag), c.version_max - c.version_min)
            groups.append(
                P.TrainGroup(
                    group_id=gid,
                    prompt_id=result.prompt_id,
                    prompt_token_ids=self.work.prompt_tokens[result.prompt_id],
                    completions=result.completions,
                )
            )
            self.work.consumed(result.prompt_id, record.epoch)
        self.ledger.consumed(plan.group_ids, step=plan.version, lags=lags)
        gov.forget(plan.group_ids)
        self.last_lag = P.LagStats(**recorder.stats())
        self._batch = _BatchFacts(
            tokens=sum(len(c.token_ids) for g in groups for c in g.completions),
            samples=sum(len(g.completions) for g in groups),
            rewards=[c.reward for g in groups for c in g.completions],
            reward_functions=_per_function_means(groups),
            longest=_longest_pairs(groups, longest_predicted),
        )
        return groups

    # --- steps --------------------------------------------------------------------------------
    def on_step_done(self, msg: P.StepDone) -> bool:
        """Apply a finished step; False (and the trainer told so) when it was not expected."""
        gov = self.governor
        if not gov.outstanding or msg.version != gov.version + 1:
            log.warning("unexpected StepDone(v%d) at v%d", msg.version, gov.version)
            self.outbox.to_trainer(
                P.TrainerAck(ok=False, detail=f"controller is at v{gov.version}")
            )
            return False
        now = self.clock()
        step = gov.version
        gov.step_done(msg.version)
        self.weights_path[msg.version] = msg.weights_path
        for old in [v for v in self.weights_path if 0 < v < msg.version - KEEP_WEIGHT_PATHS]:
            del self.weights_path[old]
        # The first iteration starts when both sides were ready (not at process start-up).
        first = max(self.first_request_at or now, self.dispatcher.first_dispatch_at or now)
        iteration = max(1e-9, now - (self.last_step_at or first))
        self.last_step_at = now
        self.last_iteration_s = iteration
        self.last_metrics = msg.metrics
        samples = msg.metrics.samples or self._batch.samples
        tokens = msg.metrics.tokens or self._batch.tokens
        self.last_samples_per_s = samples / iteration
        self.last_tokens_per_s = tokens / iteration
        self.fleet.publish_version(msg.version, msg.weights_path, now)
        self.outbox.to_trainer(P.TrainerAck(ok=True))
        record = self._step_record(step, msg, iteration, samples, tokens, now)
        self.last_record = record
        self.outbox.record(record.to_dict(), step=step + 1)
        return True

    def _step_record(
        self, step: int, msg: P.StepDone, iteration: float, samples: int, tokens: int, now: float
    ) -> StepRecord:
        gov = self.governor
        moves = (self.dispatcher.deferred, self.dispatcher.migrated)
        (deferred_before, migrated_before), self._moves_mark = self._moves_mark, moves
        return step_record(
            step=step + 1,
            metrics=msg.metrics,
            rollout_rewards=self._batch.rewards,
            lag=self.last_lag,
            lag_bound=self.batch_bound,
            pending_lag_bound=self.batch_pending,
            queue_depth=gov.queued,
            in_flight=gov.in_flight,
            iteration_s=iteration,
            sync_s=self.fleet.last_sync_s,
            samples=samples,
            tokens=tokens,
            epoch=self.work.epoch,
            discarded_total=gov.counters.discarded + gov.counters.aborted,
            skipped_groups_total=gov.counters.skipped,
            bubbles=self._bubbles_since_step(now),
            predicted_bubbles=self._predicted_bubbles(),
            reward_functions=self._batch.reward_functions,
            observed_lengths=self.work.observed_pairs,
            deferred=moves[0] - deferred_before,
            migrated=moves[1] - migrated_before,
            longest_lengths=self._batch.longest,
            time=now,
        )

    def weights_of(self, version: int) -> str | None:
        """Where StepDone said ``version`` lives (None: not told in this controller's life)."""
        return self.weights_path.get(version)


def _longest_pairs(
    groups: list[P.TrainGroup], predicted: list[float | None]
) -> list[tuple[float, float]]:
    """(predicted, actual) longest sample of each group that had a prediction."""
    return [
        (p, float(max(len(c.token_ids) for c in g.completions)))
        for p, g in zip(predicted, groups, strict=True)
        if p is not None and g.completions
    ]


def _per_function_means(groups: list[P.TrainGroup]) -> dict[str, float]:
    """Mean score of each reward function over the completions it scored (None left out)."""
    scores: dict[str, list[float]] = {}
    for group in groups:
        for completion in group.completions:
            for name, value in completion.rewards.items():
                scores.setdefault(name, []).append(value)
    return {name: float(np.mean(values)) for name, values in scores.items()}
