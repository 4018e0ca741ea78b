"""The GRPO trainer: Accelerate loop, loss, weight publishing.

The controller spawns ``trainer_command(config, run_dir)``. This module imports no torch, so the
controller stays light.
"""

from __future__ import annotations

import sys
from pathlib import Path

from runtime.config import Config


def trainer_command(config: Config, run_dir: str | Path) -> list[str]:
    """The argv that starts the trainer of ``config`` on ``run_dir``.

    One process: ``python -m runtime.trainer --run-dir D``. N > 1 processes: torchrun
    (``python -m torch.distributed.run --standalone --nproc_per_node N -m runtime.trainer ...``),
    because ``accelerate launch --cpu --num_processes N`` starts a single process (checked with
    accelerate 1.15 and 1.16); torchrun is also what accelerate uses on GPUs. ``--standalone``
    picks a free rendezvous port, so several runs can share a host. Several ``trainer.hosts``:
    torchrun on each with ``--nnodes`` and a c10d rendezvous at ``trainer.rendezvous`` (default
    the first host, port 29500); the launcher starts it on every host. The interpreter is
    ``sys.executable`` so the children use this venv. ``trainer.backend: sim`` runs the simulated
    trainer instead.
    """
    run_dir = str(run_dir)
    if config.trainer.backend == "sim":
        return [sys.executable, "-m", "runtime.sim.trainer", "--run-dir", run_dir]
    module = ["-m", "runtime.trainer", "--run-dir", run_dir]
    n = config.trainer.num_processes
    hosts = config.trainer.hosts
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    if len(hosts) > 1:
        # The same argv on every host: c10d's store runs on the host the endpoint names.
        endpoint = config.trainer.rendezvous or f"{hosts[0]}:29500"
        rendezvous = ["--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint]
        nodes = ["--nnodes", str(len(hosts)), *rendezvous, "--rdzv_id", config.run.name]
        return [*torchrun, *nodes, "--nproc_per_node", str(n), *module]
    if n == 1:
        return [sys.executable, *module]
    return [*torchrun, "--standalone", "--nproc_per_node", str(n), *module]


__all__ = ["trainer_command"]
