"""The work to hand out: the task's prompts, the epoch's plan (the scheduler), and what comes back.

:func:`load_task` reads the task once, off the event loop. :class:`WorkQueue` serves prompts to
the dispatcher, epoch by epoch: a prompt given back (its group was lost, aborted or discarded)
is handed out again in the same epoch, and the next epoch is planned when this one is handed
out. It also keeps what the scheduler predicted per prompt, for the predictor-quality metrics.
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from runtime import protocol as P
from runtime.config import Config
from runtime.scheduler.cost_model import CostModel

log = logging.getLogger(__name__)


def planning_cost_model(config: Config) -> CostModel:
    """The cost model the scheduler plans with, in the controller's (wall) seconds: the default
    one, with the sim trainer's fixed step (``rollout.sim.trainer_step_s``) when it has one, and
    on the sim backend divided by its ``time_scale`` (simulated seconds per wall second). The
    default trainer (8 GPUs) is another size: planning with it, asp would balance rollout
    against a trainer that does not run; and the online layer compares the model's times with
    the wall clock."""
    step_s = config.rollout.sim.trainer_step_s
    cost = CostModel.simulated(step_s) if config.trainer.backend == "sim" else CostModel()
    if config.rollout.backend == "sim":
        cost = cost.scaled(1.0 / config.rollout.sim.time_scale)
    return cost


@dataclass
class TaskData:
    """What :func:`load_task` read: prompts and their token ids, the eval set, the lengths."""

    prompts: dict[int, Any]
    prompt_tokens: dict[int, np.ndarray]
    model_path: str
    lengths: Any
    eval_prompts: dict[int, Any] = field(default_factory=dict)
    eval_tokens: dict[int, np.ndarray] = field(default_factory=dict)
    notices: list[tuple[P.EventKind, str, dict[str, Any]]] = field(default_factory=list)
    """Events found while loading (skipped prompts), published once the run is up."""


def load_task(config: Config) -> TaskData:
    """Prompts, their token ids, the eval set and the length history (blocking)."""
    from runtime.scheduler.lengths import LengthHistory
    from runtime.tasks import (
        build_task,
        encode_prompt,
        ensure_model,
        length_prior,
        load_tokenizer,
        resolve_chat_template,
    )
    from runtime.tasks.dataset import DatasetTask

    sim = config.rollout.backend == "sim"
    task = build_task(config)
    prompts = {p.prompt_id: p for p in task.prompts}
    if not prompts:
        raise ValueError("task: no prompts")
    model_path = config.model.path if sim else ensure_model(config)
    tokenizer = None if sim else load_tokenizer(model_path)
    template = resolve_chat_template(config.task.chat_template)
    tokens: dict[int, np.ndarray] = {}
    for pid, prompt in prompts.items():
        # No model behind simulated instances: the task makes ids of the prompt's length.
        ids = (
            task.prompt_token_ids(prompt)
            if tokenizer is None
            else encode_prompt(tokenizer, prompt, template)
        )
        tokens[pid] = np.asarray(ids, dtype=np.int32)
    data = TaskData(prompts, tokens, model_path, lengths=None)
    _skip_long_prompts(config, task, prompts, tokens, "training", data.notices)
    eval_task = DatasetTask.eval_of(config)
    if eval_task is not None and tokenizer is not None:
        data.eval_prompts = {p.prompt_id: p for p in eval_task.prompts}
        data.eval_tokens = {
            pid: np.asarray(encode_prompt(tokenizer, p, template), dtype=np.int32)
            for pid, p in data.eval_prompts.items()
        }
        _skip_long_prompts(
            config, eval_task, data.eval_prompts, data.eval_tokens, "eval", data.notices
        )
    initial = length_prior(config, task)
    data.lengths = LengthHistory(
        initial=initial, prompt_tokens={pid: int(t.size) for pid, t in tokens.items()}
    )
    return data


def _skip_long_prompts(
    config: Config,
    task: Any,
    prompts: dict[int, Any],
    tokens: dict[int, np.ndarray],
    what: str,
    notices: list[tuple[P.EventKind, str, dict[str, Any]]],
) -> None:
    """Prompts over ``task.max_prompt_tokens`` are reported and left out, never cut."""
    limit = config.task.max_prompt_tokens
    if limit is None:
        return
    long = sorted(pid for pid, ids in tokens.items() if ids.size > limit)
    if not long:
        return
    label = getattr(task, "label", None)
    names = [label(prompts[pid]) if label else str(pid) for pid in long]
    shown = ", ".join(names[:20]) + (f" and {len(names) - 20} more" if len(names) > 20 else "")
    log.warning("%d %s prompt(s) over %d tokens skipped: %s", len(long), what, limit, shown)
    for pid in long:
        del prompts[pid], tokens[pid]
    if not prompts:
        raise ValueError(
            f"task.max_prompt_tokens: every {what} prompt is longer than {limit} tokens"
        )
    notices.append(
        (
            P.EventKind.TASK,
            f"{len(long)} {what} prompt(s) longer than task.max_prompt_tokens ({limit}) "
            f"skipped: {shown}",
            {"skipped_prompts": len(long), "max_prompt_tokens": limit, "set": what},
        )
    )


@dataclass
class EpochPlan:
    """An epoch to plan: its groups, the lag bound it is planned for, and the planning call.
    ``make`` touches nothing of the controller's, so it may run in a thread."""

    epoch: int
    groups: list[Any]
    lag_bound: int
    make: Callable[[], Any]


class WorkQueue:
    """Prompts for the dispatcher, the current epoch's scheduler, and the next epoch's plan."""

    def __init__(
        self,
        config: Config,
        data: TaskData,
        *,
        epoch: int,
        consumed: Iterable[int],
        next_group_id: int,
        request_plan: Callable[[EpochPlan], None] | None,
        make_scheduler: Callable[..., Any] | None,
        single_epoch: bool = False,
        quiet: bool = False,
    ) -> None:
        self.config = config
        self.n = config.rollout.sampling.n
        self.prompts = data.prompts
        self.prompt_tokens = data.prompt_tokens
        self.lengths = data.lengths
        self.epoch = epoch
        self.consumed_prompts: set[int] = set(consumed)
        self.next_group_id = next_group_id
        self.scheduler: Any = None
        self.retry: deque[tuple[int, int]] = deque()
        # ``request_plan`` builds the next epoch off the loop (None: plan inline, blocking).
        self._request_plan = request_plan
        self.single_epoch = single_epoch
        self.quiet = quiet
        self._make_scheduler = make_scheduler
        """``runtime.scheduler.make_scheduler`` (injected: ASP plans with the simulator, which
        runs this core, so the core does not import the policies)."""
        """One epoch and no more (the simulator): once it is handed out, the work is done."""
        self.planning = False
        self._planned: tuple[EpochPlan, Any] | None = None
        self._predicted_mean: dict[int, float] = {}
        self.observed_pairs: list[tuple[float, float]] = []

    # --- epochs -------------------------------------------------------------------------------
    def plan(self, epoch: int, specs: list[Any], bound: int, skip: set[int] | None) -> EpochPlan:
        """What planning ``epoch`` needs, read now."""
        if self._make_scheduler is None:
            raise RuntimeError("this core was given its plan and plans nothing itself")
        cfg = self.config
        ids = [pid for pid in self.prompts if not skip or pid not in skip]
        if not ids:  # a resumed epoch that was fully consumed
            epoch, ids = epoch + 1, list(self.prompts)
            self.consumed_prompts.clear()
        groups = self.lengths.groups(ids, self.n)
        make = functools.partial(
            self._make_scheduler,
            cfg.scheduler.policy,
            groups,
            specs,
            batch_groups=cfg.trainer.batch_groups,
            lag_bound=bound,
            cost_model=planning_cost_model(cfg),
            seed=cfg.run.seed + epoch,
            dispatch=cfg.scheduler.dispatch,
            defer_factor=cfg.scheduler.defer_factor,
            tail_instances=cfg.scheduler.tail_instances,
            tail_max_seqs=cfg.scheduler.tail_max_seqs,
            max_tokens=cfg.rollout.sampling.max_tokens,
        )
        return EpochPlan(epoch, groups, bound, make)

    def install(self, plan: EpochPlan, scheduler: Any) -> None:
        """Make ``scheduler`` (``plan``'s) current. The caller then tells it what changed since
        it was planned (instances lost or paused, the bound)."""
        # Predictor quality is reported per epoch: what was predicted vs. what came.
        self._predicted_mean = {
            g.prompt_id: float(np.mean(g.predicted_lengths))
            for g in plan.groups
            if g.predicted_lengths
        }
        self.observed_pairs = []
        self.scheduler = scheduler
        if plan.epoch != self.epoch:
            self.consumed_prompts.clear()
        self.epoch = plan.epoch
        (log.debug if self.quiet else log.info)(
            "epoch %d: %d groups scheduled (%s)",
            plan.epoch,
            len(plan.groups),
            self.config.scheduler.policy,
        )

    def planned(self, plan: EpochPlan, scheduler: Any) -> None:
        """The plan asked for is built: it becomes current when this epoch is handed out."""
        self.planning = False
        self._planned = (plan, scheduler)

    def take_planned(self) -> tuple[EpochPlan, Any] | None:
        planned, self._planned = self._planned, None
        return planned

    def exhausted(self) -> bool:
        return self.scheduler is not None and self.scheduler.remaining() == 0 and not self.retry

    def done(self) -> bool:
        """No prompt will be handed out again (a single epoch, all of it handed out)."""
        return self.single_epoch and self.exhausted()

    def request_next(self, specs: list[Any], bound: int) -> tuple[EpochPlan, Any] | None:
        """The epoch is handed out: the next one if it can be had now (inline planning), else
        None while it is being planned off the loop."""
        if self.single_epoch or self.planning:
            return None  # planning again on every request would stall the loop
        plan = self.plan(self.epoch + 1, specs, bound, None)
        if self._request_plan is None:
            return plan, plan.make()
        self.planning = True
        self._request_plan(plan)
        return None

    # --- serving ------------------------------------------------------------------------------
    def next_prompts(self, instance_id: int, k: int) -> list[tuple[int, int]]:
        """Up to ``k`` (prompt, epoch) pairs for ``instance_id``: given-back prompts first."""
        out: list[tuple[int, int]] = []
        while self.retry and len(out) < k:
            out.append(self.retry.popleft())
        if len(out) < k:
            out += [(p, self.epoch) for p in self.scheduler.next_groups(instance_id, k - len(out))]
        return out

    def give_back(self, prompt_id: int, epoch: int) -> None:
        """A prompt's group will not be consumed: hand it out again (same epoch)."""
        if epoch == self.epoch and self.scheduler is not None:
            self.scheduler.requeue([prompt_id])
        else:
            self.retry.append((prompt_id, epoch))

    def pending(self, instance_id: int) -> int:
        queued = self.scheduler.pending(instance_id) if self.scheduler is not None else 0
        return queued + len(self.retry)

    def lane(self, instance_id: int) -> P.Lane:
        """The current scheduler's lane for ``instance_id`` (bulk before there is one)."""
        return self.scheduler.lane(instance_id) if self.scheduler is not None else P.Lane.BULK

    def predicted_longest(self, prompt_id: int, epoch: int) -> float | None:
        """What the plan of ``epoch`` predicted for the prompt's longest sample (None: no
        prediction, or that epoch's plan is gone)."""
        if epoch != self.epoch or self.scheduler is None:
            return None
        return self.scheduler.predicted_longest(prompt_id)

    def new_group_id(self) -> int:
        gid = self.next_group_id
        self.next_group_id += 1
        return gid

    # --- results ------------------------------------------------------------------------------
    def finished(self, prompt_id: int, epoch: int, instance_id: int, lengths: list[int]) -> None:
        """A group came back with these output lengths (for the plan and the predictor)."""
        if epoch == self.epoch and self.scheduler is not None:
            self.scheduler.on_group_finished(prompt_id, instance_id, lengths)
            predicted = self._predicted_mean.get(prompt_id)
            if predicted is not None:
                self.observed_pairs.append((predicted, sum(lengths) / len(lengths)))
        if self.lengths is not None:
            self.lengths.observe(prompt_id, lengths)

    def consumed(self, prompt_id: int, epoch: int) -> None:
        """Not to be handed out again this epoch (consumed, or skipped for a failed reward)."""
        if epoch == self.epoch:
            self.consumed_prompts.add(prompt_id)

    def predicted_breakdown(self) -> dict[str, float]:
        """The plan's predicted bubble fractions (empty when the policy predicts none)."""
        pred = getattr(self.scheduler, "predicted_breakdown", None) if self.scheduler else None
        if pred is None:
            return {}
        if hasattr(pred, "fractions"):
            pred = pred.fractions
        return {str(k): float(v) for k, v in dict(pred).items()}
