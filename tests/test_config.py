"""run.yaml validation and ``--set`` overrides: every error names the field, exit code 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from runtime.config import ConfigError, load_config, parse_overrides

REPO = Path(__file__).resolve().parents[1]


def test_defaults_validate_and_overrides_apply() -> None:
    config = load_config(None, ["trainer.steps=7", "async.lag_bound=2", "run.name=x"])
    assert config.trainer.steps == 7
    assert config.async_.lag_bound == 2
    assert config.run_dir == Path("runs/x")


def test_overrides_parse_yaml_scalars_and_nesting() -> None:
    assert parse_overrides(["a.b=3", "a.c=true", "d=[1, 2]", "e=text"]) == {
        "a": {"b": 3, "c": True},
        "d": [1, 2],
        "e": "text",
    }


@pytest.mark.parametrize("item", ["novalue", "=3", "a..b=1"])
def test_malformed_override_is_refused(item: str) -> None:
    with pytest.raises(ConfigError, match=r"dotted\.key=value"):
        parse_overrides([item])


@pytest.mark.parametrize(
    ("override", "field", "allowed"),
    [
        ("rollout.sampling.n=0", "rollout.sampling.n", "greater than 0"),
        ("trainer.stepz=1", "trainer.stepz", "unknown field"),
        ("scheduler.policy=bogus", "scheduler.policy", "'fifo', 'sorted' or 'asp'"),
        ("async.on_lag_decrease=drop", "async.on_lag_decrease", "'wait' or 'abort'"),
        ("async.lag_bound=99", "async.lag_bound", "max_lag_bound"),
        ("rollout.instances=[{max_num_seqs: 2}]", "rollout.instances[0].max_num_seqs", "below"),
        ("telemetry.hz=-1", "telemetry.hz", "greater than 0"),
        ("rollout.backend=sim", "task.name", "use task.name: sim"),
        ("async.weight_sync=nccl", "async.weight_sync", "use 'collective' or 'file'"),
        ("async.weight_sync=shm", "async.weight_sync", "'file' or 'collective'"),
    ],
)
def test_errors_name_the_field_the_value_and_what_is_allowed(
    override: str, field: str, allowed: str
) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(None, [override])
    assert field in str(error.value)
    assert allowed in str(error.value)


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="mapping of sections"):
        load_config(bad)
    bad.write_text("trainer: {steps: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_shipped_configs_validate() -> None:
    configs = sorted((REPO / "configs").glob("*.yaml"))
    assert configs, "configs/ holds the shipped examples"
    for path in configs:
        load_config(path)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rollout.sampling.temperature=-1", "rollout.sampling.temperature"),
        (
            "scheduler.tail_instances=1",
            "scheduler.tail_instances: 1 must be less than rollout.instances (1)",
        ),
    ],
)
def test_cli_exits_2_on_a_bad_config_before_starting_anything(
    tmp_path: Path, override: str, message: str
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "asp_tui.cli", "run", "--headless", "--config",
         str(REPO / "configs/tiny.yaml"), "--run-dir", str(tmp_path / "run"), "--set", override],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert message in result.stderr
    assert not (tmp_path / "run").exists()


def test_asp_online_knobs_default_to_the_online_layers_own() -> None:
    sched = load_config(REPO / "configs/tiny.yaml").scheduler
    assert (sched.defer_factor, sched.tail_instances, sched.tail_max_seqs) == (1.0, 0, 16)
    sched = load_config(
        None,
        ["scheduler.defer_factor=0.25", "scheduler.tail_instances=1", "scheduler.tail_max_seqs=8"],
    ).scheduler
    assert (sched.defer_factor, sched.tail_instances, sched.tail_max_seqs) == (0.25, 1, 8)


@pytest.mark.parametrize(
    ("overrides", "field", "allowed"),
    [
        (["scheduler.defer_factor=0"], "scheduler.defer_factor", "greater than 0"),
        (["scheduler.defer_factor=-0.5"], "scheduler.defer_factor", "greater than 0"),
        (["scheduler.defer_factor=soon"], "scheduler.defer_factor", "valid number"),
        (["scheduler.tail_instances=-1"], "scheduler.tail_instances", "greater than or equal to 0"),
        (["scheduler.tail_instances=1.5"], "scheduler.tail_instances", "valid integer"),
        (["scheduler.tail_max_seqs=0"], "scheduler.tail_max_seqs", "greater than 0"),
        # The default is 2 instances: a tail lane of 2 would leave the plan none.
        (["scheduler.tail_instances=2"], "scheduler.tail_instances", "less than rollout.instances"),
        (
            ["rollout.instances=1", "scheduler.tail_instances=1"],
            "scheduler.tail_instances",
            "must be less than rollout.instances (1)",
        ),
        (
            ["scheduler.tail_instances=1", "scheduler.tail_max_seqs=2"],
            "scheduler.tail_max_seqs",
            "below rollout.sampling.n (4)",
        ),
    ],
)
def test_asp_online_knobs_are_validated(overrides: list[str], field: str, allowed: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(None, overrides)
    assert field in str(error.value)
    assert allowed in str(error.value)


def test_tail_max_seqs_below_n_is_fine_without_a_tail_lane() -> None:
    assert load_config(None, ["scheduler.tail_max_seqs=2"]).scheduler.tail_max_seqs == 2
