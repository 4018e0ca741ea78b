"""The ``run.yaml`` schema, its validation and ``--set dotted.key=value`` overrides.

Every process of a run reads the same resolved config (``<run_dir>/config.yaml``). Any problem is
raised as ``ConfigError`` with the field's dotted path, the bad value and what is allowed; the CLI
turns it into exit code 2 before any process starts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

PositiveInt = Annotated[int, Field(gt=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]


class ConfigError(ValueError):
    """A config that cannot run; the message names the field, the value and what is allowed."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunConfig(_Section):
    name: str = Field("tiny", pattern=r"^[A-Za-z0-9._-]+$")
    run_dir: str | None = None
    """Defaults to ``runs/<name>``."""
    seed: int = 0


class TinyModelConfig(_Section):
    """Shape of the built-in random Llama used by ``model.path: builtin:tiny``."""

    hidden_size: PositiveInt = 64
    intermediate_size: PositiveInt = 128
    num_layers: PositiveInt = 2
    num_heads: PositiveInt = 4
    num_kv_heads: PositiveInt = 2
    max_position_embeddings: PositiveInt = 512


class ModelConfig(_Section):
    path: str = "builtin:tiny"
    """A hub id, a local directory, or ``builtin:tiny`` (generated under ``runs/.cache``)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    tiny: TinyModelConfig = TinyModelConfig()


class RewardConfig(_Section):
    """One reward function of ``task.rewards`` (``task.reward`` is the one-function shorthand)."""

    fn: str = Field(min_length=1)
    """``package.module:function`` or ``path/to/file.py:function``."""
    weight: float = 1.0
    style: Literal["trl", "verl"] = "trl"
    """``trl``: ``fn(prompts, completions, completion_ids, **columns) -> list[float | None]``;
    ``verl``: ``compute_score(data_source, solution_str, ground_truth, extra_info)`` per sample."""
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]+$")
    """The name it is logged under (default: the function's name)."""
    timeout_s: PositiveFloat | None = None
    """Per-call limit; default ``task.reward_timeout_s``."""


class EvalConfig(_Section):
    """Eval prompts, run on one instance every ``every`` steps and once at the end."""

    dataset: str = Field(min_length=1)
    """Same formats and fields (prompt_field, id_field, rewards) as ``task.dataset``."""
    every: PositiveInt = 10
    n: PositiveInt = 4
    """Samples per prompt; pass@n is reported when every reward is 0 or 1."""
    temperature: Annotated[float, Field(ge=0.0)] = 1.0
    timeout_s: PositiveFloat = 600.0
    """How long the final eval may take before the run ends without it."""


class TaskConfig(_Section):
    name: Literal["target_length", "gsm8k", "dataset", "sim"] = "target_length"
    dataset: str | None = None
    """``gsm8k``: a JSONL file. ``dataset``: a JSONL/JSON, Parquet or CSV file, a directory
    written by ``datasets.save_to_disk``, or a hub id."""
    split: str = "train"
    """Split of a hub dataset or a saved ``DatasetDict`` (a single file is one split)."""
    prompt_field: str = "prompt"
    """Column holding the prompt: a string, or a chat list of ``{role, content}`` messages."""
    id_field: str | None = None
    """Column with a unique string or integer id per row (default: the row number)."""
    max_prompt_tokens: PositiveInt | None = None
    """Longer prompts are reported and skipped, never cut."""
    chat_template: str | None = None
    """Overrides the tokenizer's chat template: a Jinja string or a file holding one."""
    reward: str | RewardConfig | None = None
    rewards: list[RewardConfig] = []
    reward_timeout_s: PositiveFloat = 60.0
    eval: EvalConfig | None = None
    on_reward_error: Literal["fail", "skip_group"] = "fail"
    """A reward that raises, returns the wrong count, NaN or times out: stop the run (exit 1,
    traceback in the worker's log), or drop the group, count it and go on."""
    num_prompts: PositiveInt = 256
    lengths_trace: str | None = None
    """Length trace the synthetic task draws its targets from (a file in shared/data/lengths)."""
    max_target_length: PositiveInt = 96
    sft_steps: NonNegativeInt = 200
    """Supervised warm-start steps before RL (0 to skip); cached per model and task."""

    def reward_functions(self) -> list[RewardConfig]:
        """``task.rewards``, or ``task.reward`` as a one-element list."""
        if isinstance(self.reward, str):
            return [RewardConfig(fn=self.reward)]
        if self.reward is not None:
            return [self.reward]
        return list(self.rewards)

    def check(self) -> None:
        """Cross-field rules of the section (raised from ``Config``, so messages name fields)."""
        if self.reward is not None and self.rewards:
            raise ValueError("task.reward: give task.reward or task.rewards, not both")
        if self.name == "dataset":
            if not self.dataset:
                raise ValueError(
                    "task.dataset: task.name 'dataset' needs a file, a save_to_disk directory "
                    "or a hub id"
                )
            if not self.reward_functions():
                raise ValueError(
                    "task.reward: task.name 'dataset' needs a reward function "
                    "('package.module:function' or 'path/to/file.py:function')"
                )
        elif self.eval is not None:
            raise ValueError(
                f"task.eval: evaluation runs the reward functions of task.name: dataset; "
                f"task {self.name!r} has none"
            )
        elif self.reward is not None or self.rewards:
            raise ValueError(
                f"task.reward: task {self.name!r} has its own reward; reward functions are "
                "for task.name: dataset"
            )
        names = [fn.name or fn.fn.rpartition(":")[2] for fn in self.reward_functions()]
        if len(set(names)) != len(names):
            raise ValueError(
                f"task.rewards: two reward functions log under one name ({names}); "
                "set a distinct name on each"
            )


class SamplingConfig(_Section):
    n: PositiveInt = 4
    max_tokens: PositiveInt = 128
    temperature: Annotated[float, Field(ge=0.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    seed: int | None = None


class InstanceConfig(_Section):
    max_num_seqs: PositiveInt | None = None
    tensor_parallel_size: PositiveInt = 1
    host: str = "localhost"
    """Where the worker starts: ``localhost`` (this host), or another host, reached through
    ``launcher`` (ssh, slurm or a command of your own)."""
    gpus: list[NonNegativeInt] | None = None
    """GPU indices on its host (``CUDA_VISIBLE_DEVICES``), as many as ``tensor_parallel_size``;
    unset: whatever the host gives (``srun --gpus-per-task`` gives each task its own)."""


class SimBackendConfig(_Section):
    lengths: str | None = None
    """Length trace for simulated outputs; defaults to the castillo grouped trace."""
    time_scale: PositiveFloat = 1.0
    """Simulated seconds per wall second (>1 runs faster than a real cluster)."""
    trainer_step_s: PositiveFloat | None = None
    """Fixed simulated trainer step (the sim trainer takes it and the scheduler plans with it);
    default comes from the cost model."""


class RestartConfig(_Section):
    auto: bool = True
    backoff_initial_s: PositiveFloat = 2.0
    backoff_max_s: PositiveFloat = 60.0
    max_restarts: NonNegativeInt = 5


class RolloutConfig(_Section):
    backend: Literal["vllm", "sim"] = "vllm"
    engine: Literal["auto", "inproc", "async"] = "auto"
    """``inproc``: vLLM's engine stepped inside the worker process (fastest on CPU hosts);
    ``async``: ``AsyncLLM`` with its engine core in a process of its own (GPUs, tensor
    parallelism); ``auto``: ``async`` where CUDA is available or an instance spans GPUs."""
    instances: PositiveInt | list[InstanceConfig] = 2
    max_num_seqs: PositiveInt = 16
    kv_cache_gib: PositiveFloat = 1.0
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    """The engine's waiting queue (vLLM ``scheduling_policy``; the sim backend and the
    simulator model the same): ``fcfs`` in arrival order, ignoring ``Generate.priority``;
    ``priority``: lowest ``Generate.priority`` first, arrival order among equals (and the
    highest is preempted first when the KV cache runs out). ``fcfs`` unless a scheduler that
    sets priorities asks for it."""
    sampling: SamplingConfig = SamplingConfig()
    heartbeat_s: PositiveFloat = 1.0
    heartbeat_timeout_s: PositiveFloat = 10.0
    start_timeout_s: PositiveFloat = 300.0
    restart: RestartConfig = RestartConfig()
    sim: SimBackendConfig = SimBackendConfig()

    def instance_list(self) -> list[InstanceConfig]:
        if isinstance(self.instances, int):
            return [InstanceConfig() for _ in range(self.instances)]
        return list(self.instances)

    def max_num_seqs_of(self, instance_id: int) -> int:
        own = self.instance_list()[instance_id].max_num_seqs
        return own if own is not None else self.max_num_seqs


class SchedulerConfig(_Section):
    policy: Literal["fifo", "sorted", "asp"] = "fifo"
    lengths: str | None = None
    """Predicted lengths (CSV as ``asp-tui plan --lengths``); default: running history, then the
    prompt-length proxy."""
    dispatch: Literal["minibatch", "continuous"] = "continuous"
    """``minibatch``: an instance takes its next minibatch when the last one finished (barrier);
    ``continuous``: a group is dispatched as soon as ``n`` slots are free."""
    defer_factor: PositiveFloat = 1.0
    """asp only: a running group the trainer waits on (the lag bound makes the next step
    consume it) is deferred, aborted and its prompt regenerated later at a newer version, when
    its projected remaining time exceeds ``defer_factor`` x the trainer period. Smaller defers
    sooner."""
    tail_instances: NonNegativeInt = 0
    """asp only: the last ``tail_instances`` instances form the tail lane, left out of the plan
    and kept for stragglers moved there and for deferred prompts (0: none). Fewer than
    ``rollout.instances``: the plan needs one."""
    tail_max_seqs: PositiveInt = 16
    """asp only: the most sequences the tail lane loads on each of its instances, so that a
    straggler there decodes near its single-sequence speed."""


class LossConfig(_Section):
    clip_eps: PositiveFloat = 0.2
    clip_eps_high: PositiveFloat | None = None
    importance_cap: PositiveFloat = 2.0
    """Truncation of the importance weight between the proximal and behaviour policies."""
    decoupled: bool = True
    """AReaL's decoupled objective: PPO ratio against the trainer's pre-step policy times the
    truncated weight pi_prox/pi_behav. False: PPO ratio against the behaviour log-probs, no
    weight (verl's bypass mode). See runtime/trainer/grpo.py."""
    kl_coef: Annotated[float, Field(ge=0.0)] = 0.0
    aggregation: Literal["token", "sequence"] = "token"
    scale_rewards: bool = True


class TrainerConfig(_Section):
    backend: Literal["torch", "sim"] = "torch"
    steps: PositiveInt = 30
    lr: PositiveFloat = 1e-3
    batch_groups: PositiveInt = 8
    """B: groups per trainer batch (one optimizer step)."""
    micro_batch_size: PositiveInt = 16
    num_processes: PositiveInt = 1
    grad_clip: PositiveFloat = 1.0
    loss: LossConfig = LossConfig()
    checkpoint_every: NonNegativeInt = 10
    keep_weight_versions: PositiveInt = 3
    step_timeout_s: PositiveFloat = 600.0
    hosts: list[str] = []
    """Where the trainer runs: empty for this host; one host: its ``num_processes`` ranks there;
    several: torchrun on each (``num_processes`` ranks per host), reached through ``launcher``,
    meeting at ``rendezvous``. The run directory must be on a filesystem every host shares."""
    gpus: list[NonNegativeInt] | None = None
    """GPU indices of its ranks on each host (``CUDA_VISIBLE_DEVICES``), ``num_processes`` of
    them; unset: whatever the host gives."""
    rendezvous: str | None = None
    """``host:port`` of torchrun's c10d rendezvous for several ``hosts`` (default
    ``<hosts[0]>:29500``); give an address the other trainer hosts reach."""


class AsyncConfig(_Section):
    lag_bound: NonNegativeInt = 1
    on_lag_decrease: Literal["wait", "abort"] = "wait"
    weight_sync: Literal["file", "collective"] = "file"
    """``file``: each step writes safetensors that every worker reloads (one host, or a shared
    filesystem). ``collective``: trainer rank 0 broadcasts the weights into the workers over a
    torch.distributed group, gloo on CPUs and NCCL on GPUs (runtime/collective.py)."""
    weight_bucket_mb: PositiveInt = 256
    """``collective``: the broadcast's bucket size; a worker holds a few buckets, not the
    model, while it loads."""
    update_mode: Literal["boundary", "keep", "inflight"] = "boundary"
    """How a worker loads new weights under running samples: ``boundary`` lets them finish on
    the old weights first; ``keep`` freezes them and recomputes their KV on the new weights;
    ``inflight`` freezes them for the reload only and keeps their KV (no prefix caching)."""
    max_lag_bound: NonNegativeInt = 16

    @field_validator("weight_sync", mode="before")
    @classmethod
    def _nccl_is_collective(cls, value: object) -> object:
        if value == "nccl":
            raise ValueError(
                "'nccl' is spelled 'collective' (NCCL on GPUs, gloo on CPUs); "
                "use 'collective' or 'file'"
            )
        return value


class WandbConfig(_Section):
    """Weights & Biases logging of every step record (``WANDB_MODE=offline`` needs no network)."""

    project: str = Field(min_length=1)
    name: str | None = None
    """The W&B run's name (default: ``run.name``)."""
    entity: str | None = None
    run_id: str | None = None
    """Resume this W&B run instead of starting a new one."""


class TelemetryConfig(_Section):
    hz: Annotated[float, Field(gt=0.0, le=100.0)] = 4.0
    ring_size: PositiveInt = 600
    window_s: PositiveFloat = 10.0
    tensorboard: bool = True
    """Step records also go to TensorBoard event files in ``<run_dir>/tensorboard``."""
    wandb: WandbConfig | None = None


class ResourcesConfig(_Section):
    """Overrides of the resource plan (``runtime/resources.py``); unset fields are derived."""

    cpus: list[NonNegativeInt] | None = None
    """Cores the run may use; default: every core this process may run on."""
    engine_threads: PositiveInt | None = None
    """Threads per vLLM engine; default: cores / (engines + trainer ranks)."""
    trainer_threads: PositiveInt | None = None
    """Threads per trainer rank; default as for engines."""
    pin: bool | None = None
    """Pin each process to cores of its own; default: when the threads fit in the cores."""

    @field_validator("cpus")
    @classmethod
    def _cpus_known(cls, cpus: list[int] | None) -> list[int] | None:
        if cpus is None:
            return None
        if not cpus:
            raise ValueError("cpus: give at least one core, or leave it unset for all")
        if len(set(cpus)) != len(cpus):
            raise ValueError(f"cpus: {cpus} lists a core twice")
        return sorted(cpus)


LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
"""Host names that mean "this host": processes start here, without a launcher."""

LAUNCHER_FIELDS = frozenset({"host", "cmd", "env", "workdir"})
"""The placeholders of ``launcher.command``."""


class LauncherConfig(_Section):
    """How processes start on other hosts (``rollout.instances[i].host``, ``trainer.hosts``).

    What a process needs to join the run (the resolved config, the controller's addresses and
    public key, its role's secret key) goes to it on the launcher's stdin, never in a file or
    on a command line. Logs come back on its stdout into ``logs/`` here. File weight sync and
    the trainer's checkpoints need the run directory on a filesystem every host shares, at the
    same path."""

    kind: Literal["ssh", "slurm", "command"] = "ssh"
    """``ssh``: ``ssh HOST 'cd WORKDIR && exec env ... CMD'``; ``slurm``: ``srun --nodelist
    HOST ...`` inside an allocation; ``command``: ``launcher.command`` run by ``sh -c``."""
    command: str | None = None
    """For ``kind: command``: a shell command with ``{cmd}`` (the command to run there) and
    optionally ``{host}``, ``{env}`` (``env K=V ...``) and ``{workdir}``, each already quoted,
    e.g. ``ip netns exec {host} {env} {cmd}``."""
    ssh_options: list[str] = [
        "-o", "BatchMode=yes", "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3",
    ]  # fmt: skip
    """Options before the host; the defaults never prompt, and notice a dead host in ~15 s."""
    srun_options: list[str] = []
    """Extra ``srun`` options, e.g. ``["--partition=gpu"]``."""
    gpus: bool = True
    """slurm: ask for GPUs (``--gpus-per-task``): ``tensor_parallel_size`` for a worker,
    ``trainer.num_processes`` for each trainer host."""
    python: str | None = None
    """The Python interpreter on the other hosts (default: this one's path)."""
    project_dir: str | None = None
    """Where this project's source is on the other hosts (default: the same path as here)."""
    workdir: str | None = None
    """Working directory on the other hosts (default: the controller's), so that a relative
    run directory means the same there."""
    env: dict[str, str] = {}
    """Extra environment there, e.g. ``HF_HOME``, ``OMP_NUM_THREADS`` or ``NCCL_SOCKET_IFNAME``."""

    @field_validator("command")
    @classmethod
    def _template(cls, command: str | None) -> str | None:
        if command is None:
            return None
        import string

        try:
            names = {
                name for _, name, _, _ in string.Formatter().parse(command) if name is not None
            }
        except ValueError as exc:
            raise ValueError(f"command: not a valid template ({exc})") from None
        unknown = names - LAUNCHER_FIELDS
        if unknown:
            raise ValueError(
                f"command: unknown placeholder(s) {sorted(unknown)}; allowed: "
                f"{sorted(LAUNCHER_FIELDS)}"
            )
        if "cmd" not in names:
            raise ValueError("command: needs {cmd}, where the command to run goes")
        return command


class ControllerConfig(_Section):
    host: str = "127.0.0.1"
    """Bind address. Every socket, loopback too, is CurveZMQ with per-role client keys. With
    processes on other hosts, an address they reach (or ``0.0.0.0``)."""
    port_base: NonNegativeInt = 0
    """0 picks free ports; otherwise rollout, trainer, telemetry and control use base..base+3."""


class Config(_Section):
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    rollout: RolloutConfig = RolloutConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    trainer: TrainerConfig = TrainerConfig()
    async_: AsyncConfig = Field(AsyncConfig(), alias="async")
    telemetry: TelemetryConfig = TelemetryConfig()
    controller: ControllerConfig = ControllerConfig()
    launcher: LauncherConfig = LauncherConfig()
    resources: ResourcesConfig = ResourcesConfig()

    model_config = ConfigDict(extra="forbid", populate_by_name=True, validate_assignment=True)

    @field_validator("rollout")
    @classmethod
    def _instances_exist(cls, rollout: RolloutConfig) -> RolloutConfig:
        if isinstance(rollout.instances, list) and not rollout.instances:
            raise ValueError("instances: at least one instance is required")
        return rollout

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        self.task.check()
        if self.async_.lag_bound > self.async_.max_lag_bound:
            raise ValueError(
                f"async.lag_bound: {self.async_.lag_bound} exceeds async.max_lag_bound "
                f"({self.async_.max_lag_bound})"
            )
        if (self.rollout.backend == "sim") != (self.task.name == "sim"):
            raise ValueError(
                f"task.name: {self.task.name!r} with rollout.backend {self.rollout.backend!r}; "
                "simulated instances take their output lengths from the sim task's trace, so "
                "use task.name: sim exactly when rollout.backend is sim"
            )
        if self.async_.weight_sync == "collective" and self.trainer.backend != "torch":
            raise ValueError(
                "async.weight_sync: 'collective' broadcasts a torch trainer's weights; the sim "
                "trainer has none, so use 'file' with trainer.backend: sim"
            )
        if self.rollout.backend == "sim" and self.trainer.backend != "sim":
            raise ValueError(
                "trainer.backend: a torch trainer cannot learn from simulated tokens; "
                "use trainer.backend: sim with rollout.backend: sim"
            )
        if self.rollout.sampling.n < 2 and self.trainer.backend == "torch":
            raise ValueError("rollout.sampling.n: GRPO needs at least 2 samples per group")
        for i, instance in enumerate(self.rollout.instance_list()):
            if self.rollout.max_num_seqs_of(i) < self.rollout.sampling.n:
                raise ValueError(
                    f"rollout.instances[{i}].max_num_seqs: {self.rollout.max_num_seqs_of(i)} "
                    f"is below rollout.sampling.n ({self.rollout.sampling.n}); one group "
                    "must fit on an instance"
                )
            if instance.gpus is not None and len(instance.gpus) != instance.tensor_parallel_size:
                raise ValueError(
                    f"rollout.instances[{i}].gpus: {instance.gpus} lists {len(instance.gpus)} "
                    f"GPU(s) for tensor_parallel_size {instance.tensor_parallel_size}; give one "
                    "per tensor-parallel rank"
                )
        self._check_tail_lane()
        self._check_hosts()
        return self

    def _check_tail_lane(self) -> None:
        sched, instances = self.scheduler, self.num_instances
        if sched.tail_instances >= instances:
            raise ValueError(
                f"scheduler.tail_instances: {sched.tail_instances} must be less than "
                f"rollout.instances ({instances}); the plan needs at least one instance that is "
                "not in the tail lane"
            )
        if sched.tail_instances and sched.tail_max_seqs < self.rollout.sampling.n:
            raise ValueError(
                f"scheduler.tail_max_seqs: {sched.tail_max_seqs} is below rollout.sampling.n "
                f"({self.rollout.sampling.n}); a tail instance must hold one group"
            )

    def remote_hosts(self) -> dict[str, list[str]]:
        """Field -> the other hosts it names (``rollout.instances[i].host``, ``trainer.hosts``)."""
        found: dict[str, list[str]] = {}
        for i, instance in enumerate(self.rollout.instance_list()):
            if instance.host not in LOCAL_HOSTS:
                found[f"rollout.instances[{i}].host"] = [instance.host]
        if self.trainer.hosts and set(self.trainer.hosts) - LOCAL_HOSTS:
            found["trainer.hosts"] = list(self.trainer.hosts)
        return found

    def _check_hosts(self) -> None:
        """Cross-field rules for processes on other hosts."""
        hosts = self.trainer.hosts
        for field, names in [("trainer.hosts", hosts)] + [
            (f"rollout.instances[{i}].host", [inst.host])
            for i, inst in enumerate(self.rollout.instance_list())
        ]:
            for name in names:
                # A name starting with '-' would be read as an option by ssh or srun.
                if not name or name.startswith("-") or any(c.isspace() for c in name):
                    raise ValueError(
                        f"{field}: {name!r} is not a host name (no spaces, not starting with '-')"
                    )
        gpus = self.trainer.gpus
        if gpus is not None and len(gpus) != self.trainer.num_processes:
            raise ValueError(
                f"trainer.gpus: {gpus} lists {len(gpus)} GPU(s) for num_processes "
                f"{self.trainer.num_processes}; give one per rank"
            )
        if len(set(hosts)) != len(hosts):
            raise ValueError(f"trainer.hosts: {hosts} names a host twice")
        if len(hosts) > 1 and set(hosts) & LOCAL_HOSTS:
            raise ValueError(
                f"trainer.hosts: {hosts} mixes this host with others; name this host as the "
                "other hosts reach it"
            )
        remote = self.remote_hosts()
        if not remote:
            return
        first = next(iter(remote))
        if self.rollout.backend == "sim" and any(f.startswith("rollout") for f in remote):
            raise ValueError(
                f"{first}: the sim backend is one process on this host for every instance; "
                "use localhost"
            )
        if self.trainer.backend == "sim" and "trainer.hosts" in remote:
            raise ValueError("trainer.hosts: the sim trainer runs on this host; leave it empty")
        if self.controller.host in LOCAL_HOSTS or self.controller.host.startswith("127."):
            raise ValueError(
                f"controller.host: {self.controller.host!r} is loopback, which {first} "
                f"({remote[first][0]}) cannot reach; bind an address of this host on the "
                "network the other hosts share, or 0.0.0.0"
            )
        if self.launcher.kind == "command" and not self.launcher.command:
            raise ValueError(
                "launcher.command: launcher.kind 'command' needs a command with {cmd}, e.g. "
                "'ip netns exec {host} {env} {cmd}'"
            )

    @property
    def run_dir(self) -> Path:
        return Path(self.run.run_dir or Path("runs") / self.run.name)

    @property
    def num_instances(self) -> int:
        return len(self.rollout.instance_list())

    def to_yaml(self) -> str:
        data = self.model_dump(mode="json", by_alias=True)
        return yaml.safe_dump(data, sort_keys=False)


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """``["trainer.steps=30", ...]`` -> nested dict; values are parsed as YAML scalars."""
    result: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"--set {item!r}: expected dotted.key=value, e.g. trainer.steps=30")
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError:
            value = raw
        node = result
        *parents, leaf = key.split(".")
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {item!r}: {part} is set to a value and a section")
            node = child
        node[leaf] = value
    return result


def deep_merge(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_config(
    path: str | Path | None = None,
    overrides: Iterable[str] = (),
    run_dir: str | Path | None = None,
) -> Config:
    """Read, merge overrides into, and validate a run config."""
    data: dict[str, Any] = {}
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"--config {file}: no such file")
        data = _yaml_mapping(file.read_text(), f"--config {file}")
    data = deep_merge(data, parse_overrides(overrides))
    if run_dir is not None:
        data = deep_merge(data, {"run": {"run_dir": str(run_dir)}})
    return validate_config(data, source=str(path) if path else "config")


def _yaml_mapping(text: str, source: str) -> dict[str, Any]:
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections")
    return loaded or {}


def config_from_yaml(text: str, source: str) -> Config:
    """A resolved config sent as text (``Config.to_yaml``), e.g. to a process on another host."""
    return validate_config(_yaml_mapping(text, source), source=source)


def validate_config(data: Mapping[str, Any], source: str = "config") -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source)) from None


def format_validation_error(exc: ValidationError, source: str) -> str:
    lines = [f"{source}: {exc.error_count()} invalid field(s)"]
    for error in exc.errors():
        field = _dotted(error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = "unknown field (check the spelling; see configs/tiny.yaml for every field)"
        elif error["type"] == "literal_error":
            message = f"must be one of {error.get('ctx', {}).get('expected', '?')}"
        value = error.get("input")
        shown = "" if isinstance(value, dict | list) else f" (got {value!r})"
        lines.append(f"  {field}: {message}{shown}" if field else f"  {message}")
    return "\n".join(lines)


_UNION_BRANCHES = {"int", "constrained-int", "list[InstanceConfig]", "str", "RewardConfig"}


def _dotted(loc: tuple[int | str, ...]) -> str:
    parts: list[str] = []
    for part in loc:
        if isinstance(part, int):
            parts[-1:] = [f"{parts[-1]}[{part}]"] if parts else [f"[{part}]"]
        elif part in _UNION_BRANCHES or part.startswith("function-"):
            continue
        else:
            parts.append("async" if part == "async_" else str(part))
    return ".".join(parts)


def read_run_config(run_dir: str | Path) -> Config:
    """The resolved config that the launcher wrote into a run directory."""
    return load_config(Path(run_dir) / "config.yaml")
