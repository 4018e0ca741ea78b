"""Evaluation rounds (``task.eval``): eval prompts on one instance, every N steps and at the end.

An eval group is sent to one running instance like any other group, but under a negative group
id, outside the lag governor and the ledger: it is never trained on, so it neither counts
towards admission nor moves the lag bound. :class:`EvalRound` collects a round's results and
sums them up: mean reward, pass@k (when every reward is 0 or 1), mean completion length.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from runtime.config import Config
from runtime.controller.actions import Outbox, Track
from runtime.controller.instances import RUNNING, SYNCING, Instance
from runtime.protocol import (
    Completion,
    EventKind,
    Generate,
    GroupAborted,
    GroupDone,
    GroupFailed,
)

log = logging.getLogger(__name__)


def eval_group_ids() -> Iterator[int]:
    """-1, -2, ...: never a training group id (those count up from 0)."""
    return itertools.count(-1, -1)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt with ``c`` correct out of ``n`` samples (Codex paper)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


@dataclass
class EvalRound:
    """One round: which groups are out, what came back."""

    version: int
    final: bool
    instance_id: int
    pending: set[int]
    started_at: float = field(default_factory=time.time)
    results: dict[int, list[Completion]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return not self.pending

    def completed(self, group_id: int, prompt_id: int, completions: list[Completion]) -> None:
        if group_id in self.pending:
            self.pending.discard(group_id)
            self.results[prompt_id] = completions

    def failed(self, group_id: int, error: str) -> None:
        if group_id in self.pending:
            self.pending.discard(group_id)
            self.errors.append(error)

    def _pass_at(self, n: int, score: Any, suffix: str) -> dict[str, float]:
        """pass@1 and pass@n over the prompts, when ``score`` is 0 or 1 on every completion."""
        values = [score(c) for cs in self.results.values() for c in cs]
        if not values or any(v not in (0.0, 1.0) for v in values):
            return {}
        out = {}
        for k in sorted({1, n}):
            per_prompt = [
                pass_at_k(len(cs), sum(score(c) == 1.0 for c in cs), k)
                for cs in self.results.values()
                if len(cs) >= k
            ]
            if per_prompt:
                out[f"eval_pass@{k}{suffix}"] = float(np.mean(per_prompt))
        return out

    def summary(self, n: int) -> dict[str, Any]:
        """The eval record's fields (``eval_*``; the trackers log them as ``eval/*``)."""
        rewards = [c.reward for cs in self.results.values() for c in cs]
        lengths = [len(c.token_ids) for cs in self.results.values() for c in cs]
        out: dict[str, Any] = {
            "event": "eval",
            "step": self.version,
            "final": self.final,
            "instance": self.instance_id,
            "eval_prompts": len(self.results),
            "eval_failed_groups": len(self.errors),
            "eval_reward_mean": float(np.mean(rewards)) if rewards else None,
            "eval_mean_length": float(np.mean(lengths)) if lengths else None,
            "eval_s": time.time() - self.started_at,
        }
        versions = [c.version_min for cs in self.results.values() for c in cs]
        if versions:  # the weights the round actually ran on
            out["eval_weight_version"] = min(versions)
        out.update(self._pass_at(n, lambda c: c.reward, ""))
        names = sorted({name for cs in self.results.values() for c in cs for name in c.rewards})
        for name in names:
            scored = [
                c.rewards[name] for cs in self.results.values() for c in cs if name in c.rewards
            ]
            out[f"eval_reward/{name}"] = float(np.mean(scored))
            out.update(self._pass_at(n, lambda c, name=name: c.rewards.get(name), f"/{name}"))
        if self.errors:
            out["eval_errors"] = self.errors[:5]
        return out


def describe_eval(record: dict[str, Any]) -> str:
    """One line for the event log: ``final eval at v4: reward 0.52, pass@4 0.80, length 12.3``."""
    passes = ", ".join(
        f"{key.removeprefix('eval_')} {value:.3f}"
        for key, value in record.items()
        if key.startswith("eval_pass@") and value is not None
    )
    reward, length = record["eval_reward_mean"], record["eval_mean_length"]
    text = f"{'final ' if record['final'] else ''}eval at v{record['step']}: "
    if reward is None:
        text += "no results"
    else:
        text += f"reward {reward:.3f}, {passes + ', ' if passes else ''}length {length:.1f}"
    if record["eval_failed_groups"]:
        text += f", {record['eval_failed_groups']} group(s) failed"
    return text


class Evaluator:
    """Starts eval rounds on a running instance and reports them when they are complete."""

    def __init__(
        self,
        config: Config,
        instances: dict[int, Instance],
        outbox: Outbox,
        prompts: dict[int, Any],
        tokens: dict[int, np.ndarray],
    ) -> None:
        self.config = config
        self.instances = instances
        self.outbox = outbox
        self.prompts = prompts
        self.tokens = tokens
        self.round: EvalRound | None = None
        self._ids = eval_group_ids()

    @property
    def enabled(self) -> bool:
        return self.config.task.eval is not None and bool(self.prompts)

    @property
    def running(self) -> bool:
        return self.round is not None and not self.round.done

    def start(self, version: int, final: bool) -> bool:
        """Send every eval prompt to one running instance; False if no round could start."""
        cfg = self.config.task.eval
        if cfg is None or not self.prompts:
            return False
        if final and self.running:
            self.round = None  # superseded: the final round is the one that counts
        if self.running:
            self.outbox.publish(
                EventKind.EVAL, f"eval at v{version} not started: the previous round is running"
            )
            return False
        # A syncing instance holds the round until its new weights are in (worker.py), so the
        # round right after a step runs on that step's weights.
        ready = [
            inst
            for inst in self.instances.values()
            if inst.state in (RUNNING, SYNCING) and not inst.operator_paused
        ]
        if not ready:
            self.outbox.publish(
                EventKind.EVAL, f"eval at v{version} not started: no running instance"
            )
            return False
        inst = min(ready, key=lambda x: (len(x.in_flight), x.instance_id))
        pending = {next(self._ids): pid for pid in self.prompts}
        self.round = EvalRound(
            version, final, inst.instance_id, set(pending), started_at=self.outbox.clock()
        )
        sampling = self.config.rollout.sampling
        for gid, pid in pending.items():
            self.outbox.to_instance(
                inst.instance_id,
                Generate(
                    group_id=gid,
                    prompt_id=pid,
                    prompt_token_ids=self.tokens[pid],
                    n=cfg.n,
                    max_tokens=sampling.max_tokens,
                    temperature=cfg.temperature,
                    seed=None if sampling.seed is None else -gid,
                ),
            )
        log.info("eval at v%d: %d prompts on instance %d", version, len(pending), inst.instance_id)
        return True

    def on_result(self, msg: GroupDone | GroupFailed | GroupAborted) -> None:
        round_ = self.round
        if round_ is None or msg.group_id not in round_.pending:
            return  # a round given up on (its instance went down, or the run is ending)
        if isinstance(msg, GroupDone):
            round_.completed(msg.group_id, msg.prompt_id, msg.completions)
        elif isinstance(msg, GroupFailed):
            round_.failed(msg.group_id, msg.error)
        else:
            round_.failed(msg.group_id, f"group {msg.group_id} aborted: {msg.reason}")
        if round_.done:
            cfg = self.config.task.eval
            assert cfg is not None
            record = round_.summary(cfg.n)
            # The event is the metrics.jsonl record: {"event": "eval", "message": ..., eval_*};
            # the trackers get it at the round's version.
            self.outbox.publish(
                EventKind.EVAL,
                describe_eval(record),
                **{k: v for k, v in record.items() if k != "event"},
            )
            self.outbox.add(Track(record, step=max(1, round_.version)))
