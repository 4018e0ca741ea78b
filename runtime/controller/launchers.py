"""Starting a child on other hosts: turns (hosts, argv) into the argv the supervisor runs here.

A child whose hosts are all this host runs as it is. Otherwise its command is wrapped in
``python -m runtime.remote --`` (see ``runtime/remote.py``) and handed to the configured launcher
(``launcher.kind``):

- ``ssh``: ``ssh OPTIONS HOST 'cd WORKDIR && exec env K=V... CMD'``;
- ``slurm``: ``srun --nodes N --ntasks-per-node 1 --nodelist HOSTS [--gpus-per-task G] --chdir
  WORKDIR ... env K=V... CMD`` (inside an allocation: ``sbatch``/``salloc``);
- ``command``: ``sh -c TEMPLATE`` with ``{host}``, ``{cmd}``, ``{env}`` and ``{workdir}`` filled in.

Several hosts (a multi-node trainer) take one ``srun`` across them, or for ``ssh`` and
``command`` one launcher per host under ``python -m runtime.remote --fanout``. The bootstrap
line (config, endpoints, the role's key) goes on the child's stdin; the supervisor keeps that
pipe open for the child's life, and its close ends the processes over there.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from runtime.auth import Role, RunKeys
from runtime.config import LOCAL_HOSTS, Config, LauncherConfig
from runtime.remote import encode_bootstrap
from runtime.resources import TRAINER, worker_instance
from runtime.rundir import Endpoints

PROJECT_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Launch:
    """What the supervisor runs on this host, and what it writes to the child's stdin."""

    argv: list[str]
    stdin: bytes | None = None


def remote_env(launcher: LauncherConfig) -> dict[str, str]:
    """The environment a process gets on another host (ssh and srun do not carry ours)."""
    env = {
        "PYTHONPATH": launcher.project_dir or str(PROJECT_ROOT),
        "PYTHONUNBUFFERED": "1",
    }
    if os.environ.get("ASP_TUI_CACHE"):
        # The built models' cache: on a shared filesystem, or prepared on each host.
        env["ASP_TUI_CACHE"] = str(Path(os.environ["ASP_TUI_CACHE"]).resolve())
    return env | launcher.env


def launch_argv(
    launcher: LauncherConfig,
    hosts: list[str],
    command: list[str],
    *,
    gpus: int = 0,
    extra_env: dict[str, str] | None = None,
) -> list[str]:
    """The argv, run here, that runs ``command`` on each of ``hosts`` through ``launcher``."""
    python = launcher.python or sys.executable
    if command and command[0] == sys.executable:
        command = [python, *command[1:]]  # this interpreter's path may differ over there
    wrapped = [python, "-m", "runtime.remote", "--", *command]
    workdir = launcher.workdir or os.getcwd()
    env = [f"{k}={v}" for k, v in (remote_env(launcher) | (extra_env or {})).items()]
    if launcher.kind == "slurm":
        gpu_args = [f"--gpus-per-task={gpus}"] if launcher.gpus and gpus else []
        return [
            "srun",
            f"--nodes={len(hosts)}",
            "--ntasks-per-node=1",
            f"--nodelist={','.join(hosts)}",
            *gpu_args,
            f"--chdir={workdir}",
            "--kill-on-bad-exit=1",
            *launcher.srun_options,
            "env",
            *env,
            *wrapped,
        ]
    each = [_one_host(launcher, host, wrapped, env, workdir) for host in hosts]
    if len(each) == 1:
        return each[0]
    return [sys.executable, "-m", "runtime.remote", "--fanout", json.dumps(each)]


def _one_host(
    launcher: LauncherConfig, host: str, wrapped: list[str], env: list[str], workdir: str
) -> list[str]:
    if launcher.kind == "ssh":
        line = f"cd {shlex.quote(workdir)} && exec env {shlex.join([*env, *wrapped])}"
        return ["ssh", *launcher.ssh_options, host, line]
    assert launcher.command is not None  # the config refuses kind 'command' without one
    filled = launcher.command.format(
        host=shlex.quote(host),
        cmd=shlex.join(wrapped),
        env=shlex.join(["env", *env]),
        workdir=shlex.quote(workdir),
    )
    return ["sh", "-c", filled]


class Launchers:
    """Which children of a run go to other hosts, and how (see the module's docstring)."""

    def __init__(self, config: Config, endpoints: Endpoints, keys: RunKeys) -> None:
        self.config = config
        self.endpoints = endpoints
        self.keys = keys

    def hosts(self, name: str) -> list[str]:
        """The other hosts child ``name`` runs on; empty for this host."""
        if name == TRAINER:
            hosts = self.config.trainer.hosts
        elif (i := worker_instance(name)) is not None:
            hosts = [self.config.rollout.instance_list()[i].host]
        else:
            hosts = []
        return [] if set(hosts) <= LOCAL_HOSTS else list(hosts)

    def gpus(self, name: str) -> list[int] | None:
        """The configured GPU indices of child ``name`` on its host, if any."""
        if name == TRAINER:
            return self.config.trainer.gpus
        if (i := worker_instance(name)) is not None:
            return self.config.rollout.instance_list()[i].gpus
        return None

    def wrap(self, name: str, argv: list[str]) -> Launch:
        """``argv`` (with its ``CUDA_VISIBLE_DEVICES``, if configured) as is for this host,
        else through the launcher with the bootstrap."""
        gpus = self.gpus(name)
        env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))} if gpus is not None else {}
        hosts = self.hosts(name)
        if not hosts:
            return Launch(["env", *(f"{k}={v}" for k, v in env.items()), *argv] if env else argv)
        if name == TRAINER:
            role, count = Role.TRAINER, self.config.trainer.num_processes
        else:
            instance_id = worker_instance(name)
            assert instance_id is not None, "only workers and the trainer run on other hosts"
            instance = self.config.rollout.instance_list()[instance_id]
            role, count = Role.WORKER, instance.tensor_parallel_size
        line = encode_bootstrap(self.config, self.endpoints, role, self.keys.role_key(role))
        launcher = self.config.launcher
        return Launch(launch_argv(launcher, hosts, argv, gpus=count, extra_env=env), stdin=line)
