"""The metrics.jsonl step record: the struct, the README's table and a live run agree."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from runtime.config import load_config
from runtime.controller.client import SpawnedController, write_run_config
from runtime.protocol import BUBBLE_CATEGORIES, LagStats, StepMetrics
from runtime.records import StepRecord, step_record
from runtime.rundir import RunDir, read_jsonl
from runtime.tracking import tracker_scalars

ROOT = Path(__file__).resolve().parents[1]


def _fields() -> set[str]:
    return {f.encode_name for f in msgspec.structs.fields(StepRecord)}


def _readme_fields() -> set[str]:
    """The field names in the first column of README.md's metrics.jsonl table, with
    ``<category>`` expanded to every bubble category."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## metrics.jsonl\n", 1)[1]
    rows = re.search(r"\| field \| meaning \|\n\|[-|]+\|\n((?:\|.*\n)+)", section)
    assert rows, "README.md: no '| field | meaning |' table under '## metrics.jsonl'"
    names: set[str] = set()
    for row in rows.group(1).splitlines():
        first = row.split("|")[1]
        for name in re.findall(r"`([^`]+)`", first):
            if "<category>" in name:
                names |= {name.replace("<category>", c) for c in BUBBLE_CATEGORIES}
            else:
                names.add(name)
    return names


def test_the_readme_documents_every_field_and_nothing_else():
    documented, fields = _readme_fields(), _fields()
    assert fields - documented == set(), "StepRecord fields missing from README.md's table"
    assert documented - fields == set(), "README.md's table names fields StepRecord lacks"


def test_bubble_fields_follow_the_categories():
    fields = _fields()
    for category in BUBBLE_CATEGORIES:
        assert {f"bubble_{category}", f"predicted_bubble_{category}"} <= fields
    assert len([f for f in fields if "bubble_" in f]) == 2 * len(BUBBLE_CATEGORIES)


def _built(**overrides) -> StepRecord:
    args = {
        "step": 3,
        "metrics": StepMetrics(loss=0.5, reward_mean=0.25, samples=8, tokens=80, step_s=1.5),
        "rollout_rewards": [0.0, 0.5],
        "lag": LagStats(mean=0.5, p95=1.0, max=1, span_max=0, histogram=[4, 4]),
        "lag_bound": 1,
        "pending_lag_bound": None,
        "queue_depth": 2,
        "in_flight": 5,
        "iteration_s": 2.0,
        "sync_s": 0.1,
        "samples": 8,
        "tokens": 80,
        "epoch": 0,
        "discarded_total": 0,
        "skipped_groups_total": 0,
        "bubbles": {c: 1.0 / len(BUBBLE_CATEGORIES) for c in BUBBLE_CATEGORIES},
        "predicted_bubbles": {},
        "time": 1000.0,
    }
    return step_record(**(args | overrides))


def test_optional_fields_are_written_only_when_they_mean_something():
    line = _built().to_dict()
    assert line["event"] == "step" and line["step"] == line["version"] == 3
    assert line["pending_lag_bound"] is None  # always written, null when none
    assert line["predictor_longest_rho"] is None and line["predictor_longest_ratio"] is None
    assert line["deferred"] == line["migrated"] == 0
    assert line["reward_mean_rollout"] == 0.25 and line["tokens_per_s"] == 40.0
    for absent in ("reward_functions", "predictor_rho", "predictor_mape", "predicted_bubble_idle"):
        assert absent not in line
    full = _built(
        predicted_bubbles={"useful": 0.9, "idle": 0.1},
        reward_functions={"length": 0.5},
        observed_lengths=[(10.0, 10.0), (10.0, 12.0)],  # a tie in the prediction: rho undefined
        deferred=2,
        migrated=1,
        longest_lengths=[(10.0, 15.0), (20.0, 20.0), (30.0, 24.0)],
    ).to_dict()
    assert (full["deferred"], full["migrated"]) == (2, 1)
    assert full["predictor_longest_rho"] == pytest.approx(1.0)
    assert full["predictor_longest_ratio"] == pytest.approx(1.0)  # median of 1.5, 1, 0.8
    assert full["predicted_bubble_useful"] == 0.9 and "predicted_bubble_sync" not in full
    assert full["reward_functions"] == {"length": 0.5}
    assert full["predictor_rho"] is None and full["predictor_mape"] > 0
    scalars = tracker_scalars(full)
    assert scalars["bubble_predicted/useful"] == 0.9 and scalars["reward/length"] == 0.5
    decoded = msgspec.json.decode(msgspec.json.encode(full), type=StepRecord)
    assert decoded.to_dict() == full


def test_an_unknown_predicted_category_is_refused_by_name():
    with pytest.raises(ValueError, match="'warmup' is not one of"):
        _built(predicted_bubbles={"warmup": 0.1})


async def test_a_live_run_writes_exactly_step_records(tmp_path):
    """A short run of the real controller with the sim backend (the ASP policy, so the
    predicted bubbles are written too): every step line is a StepRecord, field for field."""
    run_dir = tmp_path / "rec"
    overrides = [
        "rollout.instances=2",
        "rollout.max_num_seqs=16",
        "rollout.sampling.n=4",
        "rollout.sim.time_scale=60",
        "task.num_prompts=48",
        "trainer.batch_groups=4",
        "trainer.steps=3",
        "scheduler.policy=asp",
        "scheduler.dispatch=minibatch",
    ]
    config = load_config(ROOT / "configs" / "sim-8.yaml", overrides, run_dir=run_dir)
    write_run_config(run_dir, config)
    async with SpawnedController(run_dir) as ctl:
        assert await ctl.wait(120) == 0
    steps = [r for r in read_jsonl(RunDir(run_dir).metrics) if r.get("event") == "step"]
    assert len(steps) == 3
    for line in steps:
        record = msgspec.convert(line, StepRecord)  # every type checked
        assert record.to_dict() == line  # and no field missing or extra
    assert any("predicted_bubble_useful" in line for line in steps)
