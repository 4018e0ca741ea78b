"""The resource plan: which cores and how many threads each process of a run gets.

Every heavy process (each vLLM engine, each trainer rank) gets an explicit share of the host's
cores, so that their thread pools do not fight: on a 2-core machine, a vLLM worker with 46 threads
and a trainer with 2 turned a 0.035 s trainer step into 1.4 s. The plan is derived from the cores
this run may use and the config, can be overridden in ``run.yaml`` (``resources``), is printed at
start and logged by the controller, which applies it to each child through its environment (thread
counts, a passive OpenMP wait policy so nothing spins while it waits) and, when every process can
have cores of its own, its CPU affinity.

On a GPU host the same plan sizes the CPU threads around the GPUs: an engine or rank that computes
on a GPU still runs its Python, tokenization and host-side kernels on the cores it is given here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from runtime.config import Config, ConfigError

CONTROLLER = "controller"
TRAINER = "trainer"
SIM_BACKEND = "sim-backend"


def worker_name(instance_id: int) -> str:
    return f"worker-{instance_id}"


def worker_instance(name: str) -> int | None:
    """The instance id of child ``name`` when it is a rollout worker (``worker_name``'s
    inverse), else None."""
    prefix, _, number = name.partition("-")
    return int(number) if prefix == "worker" and number.isdigit() else None


@dataclass(frozen=True, slots=True)
class Share:
    """One process's share of the host."""

    name: str
    threads: int
    """torch intra-op and OpenMP threads."""
    cpus: tuple[int, ...] | None
    """Cores it is pinned to; None: any of the run's cores."""

    def env(self) -> dict[str, str]:
        """Environment that makes the process (and what it starts) keep to its share."""
        threads = str(self.threads)
        return {
            "OMP_NUM_THREADS": threads,
            "MKL_NUM_THREADS": threads,
            # Idle OpenMP threads sleep at once instead of spinning for a while after each
            # parallel region, which on shared cores steals time from the other processes.
            "OMP_WAIT_POLICY": "PASSIVE",
            "KMP_BLOCKTIME": "0",
            # vLLM's own CPU binding ("auto") puts every engine on the same first core; the
            # plan already chose, so vLLM binds to our cores or not at all.
            "VLLM_CPU_OMP_THREADS_BIND": _cpu_list(self.cpus) if self.cpus else "nobind",
        }

    def describe(self) -> str:
        where = f"cores {_cpu_list(self.cpus)}" if self.cpus else "any core"
        plural = "s" if self.threads != 1 else ""
        return f"{self.name}: {self.threads} thread{plural}, {where}"


@dataclass(frozen=True, slots=True)
class ResourcePlan:
    host_cpus: tuple[int, ...]
    shares: tuple[Share, ...]

    def share(self, name: str) -> Share:
        for share in self.shares:
            if share.name == name:
                return share
        raise KeyError(f"no share for process {name!r}")

    def describe(self) -> str:
        head = f"resource plan: {len(self.host_cpus)} cores ({_cpu_list(self.host_cpus)})"
        return "\n".join([head, *(f"  {share.describe()}" for share in self.shares)])


def available_cpus() -> tuple[int, ...]:
    """The cores this process may run on (its affinity, which cgroups and taskset narrow)."""
    return tuple(sorted(os.sched_getaffinity(0)))


def plan_resources(config: Config, host_cpus: tuple[int, ...] | None = None) -> ResourcePlan:
    """Split the run's cores between its processes.

    Each engine and each trainer rank gets ``cores // heavy processes`` threads (at least one);
    ``resources.engine_threads`` / ``trainer_threads`` override that. When the threads fit in
    the cores, each process is pinned to cores of its own (``resources.pin`` overrides), engines
    first, then the trainer's ranks together. The controller and a simulated backend are light:
    one thread, any core.
    """
    res = config.resources
    host = host_cpus or available_cpus()
    cpus = tuple(res.cpus) if res.cpus else host
    if missing := sorted(set(cpus) - set(host)):
        raise ConfigError(
            f"resources.cpus: {_cpu_list(tuple(missing))} not available to this run "
            f"(allowed here: {_cpu_list(host)})"
        )
    engines = config.num_instances if config.rollout.backend == "vllm" else 0
    ranks = config.trainer.num_processes if config.trainer.backend == "torch" else 0
    each = max(1, len(cpus) // max(1, engines + ranks))
    engine_threads = res.engine_threads or each
    trainer_threads = res.trainer_threads or each
    needed = engines * engine_threads + ranks * trainer_threads
    pin = res.pin if res.pin is not None else needed <= len(cpus)
    if pin and needed > len(cpus):
        raise ConfigError(
            f"resources.pin: true needs {needed} cores ({engines} engines x {engine_threads} "
            f"threads + {ranks} trainer ranks x {trainer_threads}), but the run has "
            f"{len(cpus)}; lower the thread counts or set resources.pin: false"
        )
    free = iter(cpus)

    def take(count: int) -> tuple[int, ...] | None:
        return tuple(next(free) for _ in range(count)) if pin else None

    shares = [Share(CONTROLLER, 1, None)]
    if engines:
        shares += [
            Share(worker_name(i), engine_threads, take(engine_threads)) for i in range(engines)
        ]
    else:
        shares.append(Share(SIM_BACKEND, 1, None))
    if ranks:
        shares.append(Share(TRAINER, trainer_threads, take(ranks * trainer_threads)))
    else:
        shares.append(Share(TRAINER, 1, None))
    return ResourcePlan(cpus, tuple(shares))


def _cpu_list(cpus: tuple[int, ...] | None) -> str:
    """``(0, 1, 2, 5)`` -> ``"0-2,5"`` (the form taskset and vLLM read)."""
    if not cpus:
        return ""
    ranges: list[str] = []
    start = prev = cpus[0]
    for cpu in (*cpus[1:], None):
        if cpu is not None and cpu == prev + 1:
            prev = cpu
            continue
        ranges.append(str(start) if start == prev else f"{start}-{prev}")
        if cpu is not None:
            start = prev = cpu
    return ",".join(ranges)
