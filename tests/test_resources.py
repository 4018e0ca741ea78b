"""The resource plan: each process's threads and cores, and the supervisor applying them."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

from runtime.config import Config, ConfigError
from runtime.controller.supervisor import Supervisor
from runtime.resources import Share, plan_resources


def _config(**overrides: object) -> Config:
    data: dict = {"rollout": {"instances": 1}, "trainer": {"num_processes": 1}}
    for dotted, value in overrides.items():
        section, key = dotted.split("__")
        data.setdefault(section, {})[key] = value
    return Config.model_validate(data)


def test_two_cores_one_engine_one_trainer_each_get_a_core_of_their_own() -> None:
    plan = plan_resources(_config(), host_cpus=(0, 1))
    assert plan.share("worker-0") == Share("worker-0", 1, (0,))
    assert plan.share("trainer") == Share("trainer", 1, (1,))
    assert plan.share("controller").cpus is None  # light: it may run anywhere
    assert "worker-0: 1 thread, cores 0" in plan.describe()


def test_more_processes_than_cores_share_every_core_with_one_thread_each() -> None:
    plan = plan_resources(_config(rollout__instances=2), host_cpus=(0, 1))
    for name in ("worker-0", "worker-1", "trainer"):
        assert plan.share(name) == Share(name, 1, None)


def test_a_big_host_is_split_evenly_and_the_trainer_ranks_share_one_slice() -> None:
    config = _config(rollout__instances=2, trainer__num_processes=2)
    plan = plan_resources(config, host_cpus=tuple(range(16)))
    assert plan.share("worker-0").cpus == (0, 1, 2, 3)
    assert plan.share("worker-1").cpus == (4, 5, 6, 7)
    trainer = plan.share("trainer")
    assert trainer.threads == 4 and trainer.cpus == tuple(range(8, 16))


def test_overrides_from_run_yaml_win() -> None:
    config = _config(resources__cpus=[2, 3, 4], resources__engine_threads=2, resources__pin=False)
    plan = plan_resources(config, host_cpus=tuple(range(8)))
    assert plan.host_cpus == (2, 3, 4)
    assert plan.share("worker-0") == Share("worker-0", 2, None)
    assert plan.share("trainer").threads == 1


def test_cores_the_run_may_not_use_are_refused_with_the_field_named() -> None:
    with pytest.raises(ConfigError, match=r"resources\.cpus: 7 not available"):
        plan_resources(_config(resources__cpus=[0, 7]), host_cpus=(0, 1))


def test_pinning_more_threads_than_cores_is_refused() -> None:
    config = _config(rollout__instances=2, resources__pin=True)
    with pytest.raises(ConfigError, match=r"resources\.pin: true needs 3 cores"):
        plan_resources(config, host_cpus=(0, 1))


def test_a_core_listed_twice_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="lists a core twice"):
        _config(resources__cpus=[0, 0])


def test_share_environment_keeps_thread_pools_small_and_passive() -> None:
    env = Share("worker-0", 2, (0, 1, 2, 5)).env()
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "2"
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-2,5"
    assert Share("trainer", 1, None).env()["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin to one")
def test_the_supervisor_starts_a_child_on_its_share(tmp_path: Path) -> None:
    core = max(os.sched_getaffinity(0))
    out = tmp_path / "child.json"
    script = (
        "import json, os, sys; json.dump({'cpus': sorted(os.sched_getaffinity(0)), "
        "'omp': os.environ.get('OMP_NUM_THREADS')}, open(sys.argv[1], 'w'))"
    )

    async def run() -> int | None:
        supervisor = Supervisor(lambda _name, _code: None)
        try:
            share = Share("probe", 1, (core,))
            await supervisor.spawn(
                "probe", [sys.executable, "-c", script, str(out)], tmp_path / "probe.log", share
            )
            await supervisor.wait_exit("probe", 30)
            return supervisor.children["probe"].proc.returncode
        finally:
            supervisor.close()

    assert asyncio.run(run()) == 0
    assert json.loads(out.read_text()) == {"cpus": [core], "omp": "1"}
