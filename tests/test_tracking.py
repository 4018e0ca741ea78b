"""Step records in TensorBoard event files and in an offline W&B run, from a real controller
(sim backend and sim trainer: the same processes and wire as the real run, in seconds)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_controller import make_run  # the same sim run set-up as the controller tests

from runtime.controller.client import SpawnedController
from runtime.rundir import RunDir, read_jsonl
from runtime.tracking import NAMES, tracker_scalars


def test_tracker_names_follow_trl_and_verl() -> None:
    record = {
        "event": "step",
        "step": 3,
        "reward_mean": 0.5,
        "reward_functions": {"accuracy": 0.25},
        "lag_max": 1,
        "iteration_s": 2.0,
        "bubble_padding": 0.1,
        "predicted_bubble_padding": 0.2,
        "lag_histogram": [3, 1],
        "predictor_rho": None,
        "tokens": 40,
        "samples": 8,
    }
    scalars = tracker_scalars(record)
    assert scalars["reward/mean"] == 0.5
    assert scalars["reward/accuracy"] == 0.25
    assert scalars["policy/lag_max"] == 1.0
    assert scalars["timing/iteration_s"] == 2.0
    assert scalars["bubble/padding"] == 0.1
    assert scalars["bubble_predicted/padding"] == 0.2
    assert scalars["completions/mean_length"] == 5.0
    assert "lag_histogram" not in scalars and "predictor/rho" not in scalars
    assert len(set(NAMES.values())) == len(NAMES)


async def test_tensorboard_and_offline_wandb_get_every_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = make_run(tmp_path, "trainer.steps=4", "telemetry.wandb={project: asp-tui-test}")
    async with SpawnedController(run_dir) as ctl:
        assert await ctl.wait(120) == 0
    steps = [r for r in read_jsonl(RunDir(run_dir).metrics) if r.get("event") == "step"]
    assert len(steps) == 4
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"reward/mean", "policy/lag_max", "timing/iteration_s", "bubble/useful"} <= tags
    logged = events.Scalars("reward/mean")
    assert [e.step for e in logged] == [1, 2, 3, 4]
    assert [e.value for e in logged] == pytest.approx([r["reward_mean"] for r in steps])
    offline = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and list(offline[0].glob("*.wandb")), offline
