"""The controller process: sockets, dispatch, training queue, trainer protocol, telemetry.

One asyncio loop owns everything; each socket has one reader task, and every state change runs to
completion before the next message is read, so the governor, the ledger and the instance table
never disagree. The lag rules live in ``governor.py``, the bubble math in ``runtime/bubbles.py``,
the dispatch order in the scheduler; this module wires them to the wire protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import zmq
import zmq.asyncio

from runtime import protocol as P
from runtime.auth import Refusal, RunKeys, ZapHandler, may_command
from runtime.bubbles import BubbleAccountant, free_slot_cause
from runtime.config import Config, read_run_config
from runtime.controller import commands
from runtime.controller.evaluation import EvalRound, describe_eval, eval_group_ids
from runtime.controller.governor import ABORTED, SKIPPED, LagGovernor, LagRecorder
from runtime.controller.instances import (
    DOWN,
    PAUSED,
    RUNNING,
    STARTING,
    SYNCING,
    InFlight,
    Instance,
)
from runtime.controller.ledger import Ledger
from runtime.controller.sockets import bind_sockets
from runtime.controller.state import ControllerState, load_state, save_state
from runtime.controller.supervisor import Supervisor
from runtime.controller.telemetry import BubbleWindows, Telemetry
from runtime.resources import SIM_BACKEND, TRAINER, ResourcePlan, plan_resources, worker_name
from runtime.rundir import Endpoints, JsonlWriter, RunDir, read_jsonl

log = logging.getLogger(__name__)

ROLLOUT_TYPES = (
    P.WorkerHello | P.Heartbeat | P.GroupDone | P.GroupAborted | P.GroupFailed | P.WorkerAck
)
TRAINER_TYPES = P.TrainerHello | P.BatchRequest | P.StepDone
CONTROL_TYPES = P.Command


@dataclass
class QueuedResult:
    """A completed group waiting in the training queue."""

    done: P.GroupDone
    epoch: int
    version_min: int
    version_max: int


@dataclass
class _EpochPlan:
    """An epoch to plan: its groups, the lag bound it is planned for, and the planning call."""

    epoch: int
    groups: list[Any]
    lag_bound: int
    make: Callable[[], Any]


class Controller:
    """One run's controller. ``await Controller(run_dir).run()`` returns the exit code."""

    def __init__(self, run_dir: str | Path, *, spawn: bool = True) -> None:
        self.rd = RunDir(run_dir).create()
        self.config: Config = read_run_config(self.rd.root)
        self.spawn = spawn
        cfg = self.config
        self.B = cfg.trainer.batch_groups
        self.n = cfg.rollout.sampling.n
        self.total_steps = cfg.trainer.steps
        self.sim = cfg.rollout.backend == "sim"
        self.state = "starting"
        self.exit_code = 0
        self.stopping = False
        self.stop_reason = ""
        self._stop_event = asyncio.Event()
        self._wake = asyncio.Event()

        saved = load_state(self.rd)
        # Any saved progress is resumed (trainer.steps may have been raised since).
        self.resumed = saved is not None and saved.version > 0
        st = (
            saved
            if self.resumed and saved is not None
            else ControllerState(lag_bound=cfg.async_.lag_bound)
        )
        self.epoch = st.epoch
        self.consumed_prompts: set[int] = set(st.consumed_prompts)
        self.governor = LagGovernor(
            self.B,
            min(st.lag_bound, cfg.async_.max_lag_bound),
            max_lag_bound=cfg.async_.max_lag_bound,
            on_lag_decrease=cfg.async_.on_lag_decrease,
            version=st.version,
            consumed_before=st.consumed_total if self.resumed else 0,
        )
        self.governor.counters.discarded = st.discarded_total if self.resumed else 0
        self.governor.counters.requeued = st.requeued_total if self.resumed else 0
        self.governor.counters.skipped = st.skipped_total if self.resumed else 0
        self.governor.counters.admitted += self.governor.counters.discarded
        self.governor.counters.admitted += self.governor.counters.requeued
        self.governor.counters.admitted += self.governor.counters.skipped
        self.next_group_id = max(st.next_group_id, _max_ledger_group(self.rd.ledger) + 1)

        now = time.time()
        self.instances: dict[int, Instance] = {}
        for i in range(cfg.num_instances):
            self.instances[i] = Instance(
                i, cfg.rollout.max_num_seqs_of(i), self.n, state_since=now, last_heartbeat=now
            )
        self.queue: dict[int, QueuedResult] = {}
        self.retry: deque[tuple[int, int]] = deque()
        self.scheduler: Any = None
        # The next epoch's plan while it is built off the loop, and once built (not yet current).
        self._planning: asyncio.Task | None = None
        self._planned: tuple[_EpochPlan, Any] | None = None
        self.lengths: Any = None
        self.prompts: dict[int, Any] = {}
        self.prompt_tokens: dict[int, np.ndarray] = {}
        self.weights_path: dict[int, str] = {}
        self.weight_rendezvous: P.WeightRendezvous | None = None
        """The trainer's weight server (``async.weight_sync: collective``), from TrainerHello."""
        self.model_path = ""
        self._rr = 0

        # trainer side
        self.trainer_identity: bytes | None = None
        self.trainer_pending: int | None = None
        self.trainer_condition = "idle"
        self.trainer_waiting_since: float | None = None
        self.trainer_shutdown_sent = False
        self.trainer_connected = False
        self.trainer_hello_seen = False
        self.last_step_at: float | None = None
        self.first_request_at: float | None = None
        self.first_dispatch_at: float | None = None
        self.last_metrics: P.StepMetrics | None = None
        self.last_iteration_s = 0.0
        self.last_samples_per_s = 0.0
        self.last_tokens_per_s = 0.0
        self.last_lag: dict[str, Any] = LagRecorder().stats()
        self._batch_tokens = 0
        self._batch_samples = 0
        self._batch_rewards: list[float] = []
        self._batch_fn_rewards: dict[str, float] = {}
        self._pending_events: list[tuple[P.EventKind, str, dict[str, Any]]] = []
        self.eval_prompts: dict[int, Any] = {}
        self.eval_tokens: dict[int, np.ndarray] = {}
        self.eval_round: EvalRound | None = None
        self._eval_ids = eval_group_ids()
        self._batch_bound = self.governor.lag_bound
        self._batch_pending: int | None = None
        self._seen_pending: int | None = None
        self._predicted_mean: dict[int, float] = {}
        self._observed_pairs: list[tuple[float, float]] = []
        self._sync_started_at: float | None = None
        self.last_sync_s = 0.0

        self.accountant = BubbleAccountant(
            {i: inst.max_num_seqs for i, inst in self.instances.items()}, now
        )
        self.windows = BubbleWindows(self.accountant, cfg.telemetry.window_s, now)
        self._window: dict[str, float] = {}
        self._shares: dict[int, float] = {}
        self._total: dict[str, float] = {}

        self.guards = {
            name: P.FrameGuard(name, P.Decoder(t))
            for name, t in (
                ("rollout", ROLLOUT_TYPES),
                ("trainer", TRAINER_TYPES),
                ("control", CONTROL_TYPES),
            )
        }
        self.encoder = P.Encoder()
        self.ctx: zmq.asyncio.Context | None = None
        self.sockets: Any = None
        self.auth: ZapHandler | None = None
        self._auth_task: asyncio.Task | None = None
        self.telemetry: Telemetry | None = None
        self.metrics = JsonlWriter(self.rd.metrics)
        self.trackers: Any = None  # TensorBoard / W&B, started with the sockets
        self.ledger = Ledger(self.rd.ledger)
        self.supervisor = Supervisor(self._on_child_exit, env=_child_env())
        self.resources: ResourcePlan = plan_resources(cfg)
        self._tasks: list[asyncio.Task] = []
        self._restart_gen: dict[str, int] = {}

    # ============================================================================ lifecycle
    async def run(self) -> int:
        """Bind, spawn, serve until the run finishes or is stopped; always reap every child."""
        loop = asyncio.get_running_loop()
        installed = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, self._on_signal, sig.name)
                installed.append(sig)
            except (NotImplementedError, RuntimeError, ValueError):
                pass  # not the main thread: the caller handles signals
        try:
            await self._startup()
            self._tasks = [
                asyncio.create_task(self._read_loop("rollout"), name="rollout"),
                asyncio.create_task(self._read_loop("trainer"), name="trainer"),
                asyncio.create_task(self._read_loop("control"), name="control"),
                asyncio.create_task(self._tick_loop(), name="tick"),
            ]
            if self.spawn and not self.stopping:
                await self._spawn_children()
            await self._stop_event.wait()
            await self._shutdown()
        except Exception as exc:
            log.exception("controller failed")
            self.exit_code = self.exit_code or 1
            self._event(P.EventKind.RUN, f"controller failed: {exc}", error=str(exc))
        finally:
            tasks = [*self._tasks, *([self._auth_task] if self._auth_task else [])]
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            await self.supervisor.stop_all(grace_s=5.0)
            self.supervisor.close()
            for sig in installed:
                loop.remove_signal_handler(sig)
            self._save_state()
            self.metrics.close()
            self.ledger.close()
            if self.trackers is not None:
                with contextlib.suppress(Exception):  # tracking never changes the exit code
                    self.trackers.close()
            if self.sockets is not None:
                self.sockets.close()
            if self.auth is not None:
                self.auth.close()
            if self.ctx is not None:
                self.ctx.term()
        return self.exit_code

    async def _startup(self) -> None:
        cfg = self.config
        self.ctx = zmq.asyncio.Context()
        keys = RunKeys(self.rd.keys).ensure()
        # The ZAP handler first: the sockets refuse every client until it answers.
        self.auth = ZapHandler(self.ctx, keys, on_refused=self._on_auth_refused)
        self._auth_task = asyncio.create_task(self.auth.serve(), name="zap")
        self.sockets = bind_sockets(
            self.ctx, cfg.controller.host, cfg.controller.port_base, keys.server()
        )
        self.telemetry = Telemetry(
            self.sockets.telemetry, cfg.telemetry.ring_size, on_event=self._record_event
        )
        addresses = self.sockets.addresses
        self.rd.write_endpoints(
            Endpoints(
                rollout=addresses["rollout"],
                trainer=addresses["trainer"],
                telemetry=addresses["telemetry"],
                control=addresses["control"],
                controller_pid=os.getpid(),
                run_name=cfg.run.name,
                server_public_key=self.sockets.public_key,
                keys_dir=str(self.rd.keys.resolve()),
                started_at=time.time(),
            )
        )
        from runtime.tracking import Trackers

        self.trackers = Trackers(self.rd.root, cfg)
        self.ledger.controller_start(
            version=self.governor.version, epoch=self.epoch, resumed=self.resumed
        )
        self._event(
            P.EventKind.RUN,
            "controller started"
            + (
                f" (resumed at v{self.governor.version}, epoch {self.epoch})"
                if self.resumed
                else ""
            ),
            version=self.governor.version,
            endpoints=addresses,
        )
        await asyncio.get_running_loop().run_in_executor(None, self._load_task)
        for kind, message, data in self._pending_events:  # found in the loader's thread
            self._event(kind, message, **data)
        self._new_epoch(self.epoch, skip=self.consumed_prompts)
        self.state = "running"

    def _load_task(self) -> None:
        """Prompts, their token ids and weight version 0 (blocking; runs in a thread)."""
        from runtime.scheduler.lengths import LengthHistory, read_lengths
        from runtime.tasks import (
            build_task,
            encode_prompt,
            ensure_model,
            load_tokenizer,
            resolve_chat_template,
        )

        cfg = self.config
        task = build_task(cfg)
        self.prompts = {p.prompt_id: p for p in task.prompts}
        if not self.prompts:
            raise ValueError("task: no prompts")
        self.model_path = ensure_model(cfg) if not self.sim else cfg.model.path
        tokenizer = None
        if not self.sim:
            tokenizer = load_tokenizer(self.model_path)
        template = resolve_chat_template(cfg.task.chat_template)
        for pid, prompt in self.prompts.items():
            if tokenizer is not None:
                ids = encode_prompt(tokenizer, prompt, template)
            else:
                # No model behind simulated instances: the task makes ids of the prompt's length.
                ids = task.prompt_token_ids(prompt)
            self.prompt_tokens[pid] = np.asarray(ids, dtype=np.int32)
        self._skip_long_prompts(task, self.prompts, self.prompt_tokens, "training")
        from runtime.tasks.dataset import DatasetTask

        eval_task = DatasetTask.eval_of(cfg)
        if eval_task is not None and tokenizer is not None:
            self.eval_prompts = {p.prompt_id: p for p in eval_task.prompts}
            self.eval_tokens = {
                pid: np.asarray(encode_prompt(tokenizer, p, template), dtype=np.int32)
                for pid, p in self.eval_prompts.items()
            }
            self._skip_long_prompts(eval_task, self.eval_prompts, self.eval_tokens, "eval")
        initial = None
        if cfg.scheduler.lengths:
            initial = read_lengths(cfg.scheduler.lengths).as_map()
        self.lengths = LengthHistory(
            initial=initial,
            prompt_tokens={pid: int(t.size) for pid, t in self.prompt_tokens.items()},
        )
        self.weights_path[0] = self.model_path

    def _skip_long_prompts(
        self, task: Any, prompts: dict[int, Any], tokens: dict[int, np.ndarray], what: str
    ) -> None:
        """Prompts over ``task.max_prompt_tokens`` are reported and left out, never cut."""
        limit = self.config.task.max_prompt_tokens
        if limit is None:
            return
        long = sorted(pid for pid, ids in tokens.items() if ids.size > limit)
        if not long:
            return
        label = getattr(task, "label", None)
        names = [label(prompts[pid]) if label else str(pid) for pid in long]
        shown = ", ".join(names[:20]) + (f" and {len(names) - 20} more" if len(names) > 20 else "")
        log.warning("%d %s prompt(s) over %d tokens skipped: %s", len(long), what, limit, shown)
        for pid in long:
            del prompts[pid], tokens[pid]
        if not prompts:
            raise ValueError(
                f"task.max_prompt_tokens: every {what} prompt is longer than {limit} tokens"
            )
        self._pending_events.append(
            (
                P.EventKind.TASK,
                f"{len(long)} {what} prompt(s) longer than task.max_prompt_tokens ({limit}) "
                f"skipped: {shown}",
                {"skipped_prompts": len(long), "max_prompt_tokens": limit, "set": what},
            )
        )

    def _new_epoch(self, epoch: int, skip: set[int] | None = None) -> None:
        """Plan ``epoch`` and make it current, blocking (start-up, and when no loop runs)."""
        plan = self._epoch_plan(epoch, skip)
        self._install_epoch(plan, plan.make())

    def _epoch_plan(self, epoch: int, skip: set[int] | None = None) -> _EpochPlan:
        """What planning ``epoch`` needs, read on the loop now. ``make`` touches nothing of the
        controller's (fresh group and instance lists, immutable lengths), so it may run in a
        thread while the loop goes on serving the current epoch."""
        from runtime.scheduler import InstanceSpec, make_scheduler

        cfg = self.config
        ids = [pid for pid in self.prompts if not skip or pid not in skip]
        if not ids:  # a resumed epoch that was fully consumed
            epoch, ids = epoch + 1, list(self.prompts)
            self.consumed_prompts.clear()
        groups = self.lengths.groups(ids, self.n)
        specs = [InstanceSpec(i, inst.max_num_seqs) for i, inst in self.instances.items()]
        bound = self.governor.admission_bound
        make = functools.partial(
            make_scheduler,
            cfg.scheduler.policy,
            groups,
            specs,
            batch_groups=self.B,
            lag_bound=bound,
            seed=cfg.run.seed + epoch,
            dispatch=cfg.scheduler.dispatch,
        )
        return _EpochPlan(epoch, groups, bound, make)

    def _install_epoch(self, plan: _EpochPlan, scheduler: Any) -> None:
        """Make ``scheduler`` (``plan``'s) current, told what changed since it was planned."""
        # Predictor quality is reported per epoch: what was predicted vs. what came.
        self._predicted_mean = {
            g.prompt_id: float(np.mean(g.predicted_lengths))
            for g in plan.groups
            if g.predicted_lengths
        }
        self._observed_pairs: list[tuple[float, float]] = []
        self.scheduler = scheduler
        for i, inst in self.instances.items():
            if inst.lost_by_scheduler:
                self.scheduler.on_instance_lost(i)
            elif inst.operator_paused:
                self.scheduler.on_instance_paused(i)
        if self.governor.admission_bound != plan.lag_bound:
            self.scheduler.set_lag_bound(self.governor.admission_bound)
        if plan.epoch != self.epoch:
            self.consumed_prompts.clear()
        self.epoch = plan.epoch
        log.info(
            "epoch %d: %d groups scheduled (%s)",
            plan.epoch,
            len(plan.groups),
            self.config.scheduler.policy,
        )

    def _roll_over(self) -> bool:
        """The current epoch is handed out: install the next one if it is planned (True), else
        start planning it off the loop (asp takes seconds for 14k groups; the loop must keep
        serving heartbeats, results and the trainer meanwhile). Until it is installed the
        instances get no new work; nothing is dispatched from a half-built scheduler."""
        if self._planned is not None:
            plan, scheduler = self._planned
            self._planned = None
            self._install_epoch(plan, scheduler)
            return True
        if self._planning is not None:
            return False
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # called outside the loop (tests driving the controller directly)
            self._new_epoch(self.epoch + 1)
            return True
        self._planning = asyncio.create_task(
            self._plan_in_thread(self._epoch_plan(self.epoch + 1)), name="plan-epoch"
        )
        self._tasks.append(self._planning)
        return False

    async def _plan_in_thread(self, plan: _EpochPlan) -> None:
        started = time.perf_counter()
        try:
            scheduler = await asyncio.get_running_loop().run_in_executor(None, plan.make)
        except Exception as exc:
            log.exception("planning epoch %d failed", plan.epoch)
            self._event(
                P.EventKind.RUN, f"planning epoch {plan.epoch} failed: {exc}", error=str(exc)
            )
            self.request_stop(f"planning epoch {plan.epoch} failed", code=1)
            return
        finally:
            self._planning = None
        log.info("epoch %d planned in %.2fs", plan.epoch, time.perf_counter() - started)
        if not self.stopping:
            self._planned = (plan, scheduler)
            self._after_change()  # installs it as soon as the current epoch has nothing left

    async def _spawn_children(self) -> None:
        cfg = self.config
        log.info("%s", self.resources.describe())
        root = str(self.rd.root)
        if self.sim:
            await self._spawn(
                SIM_BACKEND, [sys.executable, "-m", "runtime.sim.backend", "--run-dir", root]
            )
        else:
            for i in self.instances:
                await self._spawn_worker(i)
        from runtime.trainer import trainer_command

        await self._spawn(TRAINER, trainer_command(cfg, self.rd.root))

    async def _spawn(self, name: str, argv: list[str]) -> None:
        share = self.resources.share(name)
        child = await self.supervisor.spawn(name, argv, self.rd.log_file(name), share)
        if name == SIM_BACKEND:
            started = list(self.instances.values())
        elif name.startswith("worker-"):
            started = [self.instances[int(name.split("-")[1])]]
        else:
            started = []
        for inst in started:
            inst.pid = child.pid
            inst.state_since = time.time()  # the start timeout counts from here

    async def _spawn_worker(self, i: int) -> None:
        argv = [
            sys.executable,
            "-m",
            "runtime.rollout.worker",
            "--run-dir",
            str(self.rd.root),
            "--instance-id",
            str(i),
        ]
        await self._spawn(worker_name(i), argv)

    def _on_signal(self, name: str) -> None:
        if self.stopping:
            # A second signal: the operator does not want to wait for the final checkpoint.
            self._event(P.EventKind.RUN, f"signal {name} again: killing every child now")
            self.supervisor.kill_all_now()
            return
        self.request_stop(f"signal {name}")

    def request_stop(self, reason: str = "stop requested", code: int = 0) -> None:
        """Begin a clean stop: the trainer gets Shutdown at its next request (it writes its final
        checkpoint), then the workers; exit ``code``."""
        if self.stopping:
            return
        self.stopping = True
        self.stop_reason = reason
        self.exit_code = self.exit_code or code
        self.state = "stopping"
        self._event(P.EventKind.RUN, f"stopping: {reason}", reason=reason)
        self._try_batch()
        self._stop_event.set()

    async def _shutdown(self) -> None:
        """Trainer first (final checkpoint), then workers; everything is reaped in ``run``."""
        cfg = self.config
        if self.spawn and self.supervisor.alive(TRAINER):
            # The trainer finishes its step, asks again, gets Shutdown and checkpoints.
            await self.supervisor.wait_exit(TRAINER, cfg.trainer.step_timeout_s + 60.0)
        if cfg.task.eval is not None and self.exit_code == 0 and self.eval_prompts:
            await self._final_eval(cfg.task.eval.timeout_s)
        elif not self.spawn and self.trainer_connected and not self.trainer_shutdown_sent:
            deadline = time.time() + min(30.0, cfg.trainer.step_timeout_s)
            while not self.trainer_shutdown_sent and time.time() < deadline:
                await asyncio.sleep(0.05)
        for inst in self.instances.values():
            self._send_worker(inst, P.Shutdown(reason=self.stop_reason))
        if self.spawn:
            names = [n for n in self.supervisor.children if n != TRAINER]
            await asyncio.gather(*(self.supervisor.wait_exit(n, 15.0) for n in names))
        else:
            await asyncio.sleep(0.2)  # let the Shutdown frames leave
        if self.exit_code == 0 and not self.sim and self.spawn:
            await self._export_final()
        self.state = "finished" if self.exit_code == 0 else "failed"
        self._publish_snapshot()
        self._event(
            P.EventKind.RUN,
            f"stopped ({self.stop_reason}), exit {self.exit_code}",
            code=self.exit_code,
            version=self.governor.version,
        )
        self._save_state()

    async def _export_final(self) -> None:
        """``final/``: the last weights as a Hugging Face model directory (off the loop)."""
        from runtime.export import FINAL_DIR, export_version

        target = self.rd.root / FINAL_DIR
        try:
            await asyncio.get_running_loop().run_in_executor(
                None, export_version, self.rd.root, target, None
            )
        except Exception as exc:
            log.exception("export of the final weights failed")
            self._event(P.EventKind.RUN, f"export to {target} failed: {exc}", error=str(exc))
            self.exit_code = self.exit_code or 1
            return
        self._event(
            P.EventKind.RUN,
            f"final weights (v{self.governor.version}) exported to {target}",
            path=str(target),
            version=self.governor.version,
        )

    # ============================================================================ socket loops
    async def _read_loop(self, name: str) -> None:
        sock = getattr(self.sockets, name)
        guard = self.guards[name]
        handler = {
            "rollout": self._on_rollout,
            "trainer": self._on_trainer,
            "control": self._on_control,
        }[name]
        while True:
            frames = await sock.recv_multipart(copy=False)
            identity = frames[0].bytes
            msg = guard.decode(frames[1:], peer=repr(identity))
            if msg is None:
                continue
            if name == "control" and not self._may_command(frames[1], identity, msg):
                continue
            try:
                handler(identity, msg)
            except Exception:
                # A bug while handling one message must not take the run down silently.
                log.exception("error handling %s on %s", type(msg).__name__, name)

    def _may_command(self, frame: zmq.Frame, identity: bytes, msg: P.Command) -> bool:
        """Whether the client's key (its ZAP User-Id) has, now, a role that may send ``msg``; a
        refusal is answered, counted and reported like a refused connection."""
        public_key = frame.get("User-Id") or ""
        found = self.auth.role_of(public_key) if self.auth is not None else None
        role = found.value if found is not None else ""
        if may_command(role, msg.name):
            return True
        reason = f"role {role or 'unknown'} may not send {msg.name!r} (operator only)"
        if self.auth is not None:
            address = str(frame.get("Peer-Address"))
            self.auth.refuse(Refusal("control", role, public_key, address, reason))
        self._send(
            self.sockets.control,
            identity,
            P.CommandReply(request_id=msg.request_id, ok=False, reason=reason),
        )
        return False

    def _on_auth_refused(self, refusal: Refusal, count: int) -> None:
        self._event(
            P.EventKind.AUTH,
            f"refused {refusal.role or 'unknown'} client from {refusal.address} on "
            f"{refusal.socket}: {refusal.reason} ({count} refused on {refusal.socket} so far)",
            socket=refusal.socket,
            role=refusal.role,
            public_key=refusal.public_key,
            address=refusal.address,
            reason=refusal.reason,
            refused=count,
        )

    def _send(self, sock: Any, identity: bytes, msg: Any) -> bool:
        try:
            sock.send_multipart(
                [identity, *self.encoder.encode(msg)], flags=zmq.NOBLOCK, copy=False
            )
            return True
        except zmq.ZMQError as exc:
            log.warning("cannot send %s to %r: %s", type(msg).__name__, identity, exc)
            return False

    def _send_worker(self, inst: Instance, msg: Any) -> bool:
        return self._send(self.sockets.rollout, inst.identity, msg)

    # ============================================================================ rollout plane
    def _on_rollout(self, identity: bytes, msg: Any) -> None:
        inst = self._instance_of(identity)
        if inst is None:
            self.guards["rollout"].rejected["UnknownIdentity"] += 1
            log.warning("message from unknown rollout peer %r ignored", identity)
            return
        now = time.time()
        inst.last_heartbeat = now
        if isinstance(msg, P.GroupDone | P.GroupAborted | P.GroupFailed) and msg.group_id < 0:
            self._on_eval_result(msg)
            return
        if isinstance(msg, P.WorkerHello):
            self._on_hello(inst, msg, now)
        elif isinstance(msg, P.Heartbeat):
            inst.running_seqs = msg.running_seqs
            inst.observe_tokens(msg.tokens_generated, now)
            if inst.state == DOWN and inst.restart_at is None and inst.ever_up:
                # It was declared dead on a missed heartbeat but is talking again: resync it.
                self._instance_up(inst, msg.weight_version, now, "heartbeat resumed")
        elif isinstance(msg, P.GroupDone):
            self._on_group_done(inst, msg, now)
        elif isinstance(msg, P.GroupAborted):
            self._on_group_aborted(inst, msg)
        elif isinstance(msg, P.GroupFailed):
            self._on_group_failed(inst, msg)
        elif isinstance(msg, P.WorkerAck):
            self._on_worker_ack(inst, msg, now)
        self._after_change()

    def _instance_of(self, identity: bytes) -> Instance | None:
        prefix = b"instance-"
        if not identity.startswith(prefix):
            return None
        try:
            return self.instances.get(int(identity[len(prefix) :]))
        except ValueError:
            return None

    def _on_hello(self, inst: Instance, msg: P.WorkerHello, now: float) -> None:
        if inst.in_flight:
            # A fresh engine knows nothing of what we think it runs.
            self._lose_in_flight(inst, "worker restarted")
        if msg.max_num_seqs != inst.max_num_seqs and msg.max_num_seqs >= 1:
            inst.max_num_seqs = msg.max_num_seqs
            self.accountant.add_instance(inst.instance_id, msg.max_num_seqs, now)
        inst.pid = msg.pid
        inst.running_seqs = 0
        inst.tokens_generated = 0
        inst.last_tokens_at = 0.0
        self._instance_up(inst, msg.weight_version, now, f"worker up ({msg.backend})")

    def _instance_up(self, inst: Instance, version: int, now: float, why: str) -> None:
        inst.weight_version = version
        inst.sync_target = None
        inst.restart_at = None
        inst.ever_up = True
        inst.up_since = inst.up_since or now
        if inst.in_flight:
            self._lose_in_flight(inst, why)
        if inst.lost_by_scheduler and self.scheduler is not None:
            inst.lost_by_scheduler = False
            if not inst.operator_paused:  # a paused one is resumed by the operator
                self.scheduler.on_instance_resumed(inst.instance_id)
        if inst.weight_version != self.governor.version:
            self._start_sync(inst, now)
        else:
            self._set_state(inst, PAUSED if inst.operator_paused else RUNNING, now, why)
            if inst.operator_paused:
                self._send_worker(inst, P.PauseWorker(mode="keep"))

    def _start_sync(self, inst: Instance, now: float) -> None:
        """Send the current weights; the instance gets no dispatch until it acknowledges."""
        v = self.governor.version
        path = self._weights_of(v)
        inst.sync_target = v
        inst.sync_started = now
        mode = self.config.async_.update_mode
        self._send_worker(
            inst,
            P.UpdateWeights(version=v, path=path, mode=mode, rendezvous=self.weight_rendezvous),
        )
        if inst.state != PAUSED:
            self._set_state(inst, SYNCING, now, f"syncing weights v{v}", routine=True)

    def _weights_of(self, version: int) -> str:
        """Where version ``version`` lives: what StepDone said, else the file on disk (a resumed
        run), the real trainer's safetensors or the sim trainer's marker."""
        known = self.weights_path.get(version)
        if known:
            return known
        if version == 0:
            return self.model_path
        real = self.rd.weights_file(version)
        marker = self.rd.weights / f"v{version:06d}.sim.json"
        return str(marker if not real.exists() and marker.exists() else real)

    def _on_worker_ack(self, inst: Instance, msg: P.WorkerAck, now: float) -> None:
        if msg.request == "update_weights":
            if not msg.ok:
                inst.sync_failures += 1
                self._event(
                    P.EventKind.WEIGHTS,
                    f"instance {inst.instance_id} failed to load weights: {msg.detail}",
                    instance=inst.instance_id,
                    ok=False,
                )
                inst.sync_target = None
                if inst.sync_failures >= 3:
                    self._mark_down(inst, now, f"weight sync failed 3 times: {msg.detail}")
                    self._kill_instance_process(inst)
                else:
                    self._start_sync(inst, now)
                return
            inst.sync_failures = 0
            inst.weight_version = max(inst.weight_version, msg.weight_version)
            inst.sync_target = None
            if inst.weight_version < self.governor.version:
                self._start_sync(inst, now)  # a newer version came out meanwhile
            elif inst.state == SYNCING:
                self._set_state(
                    inst,
                    PAUSED if inst.operator_paused else RUNNING,
                    now,
                    f"weights v{inst.weight_version}",
                    routine=True,
                )
            self._check_sync_complete()
        elif msg.request in ("pause", "resume"):
            inst.pending_ack = None
            inst.weight_version = max(inst.weight_version, msg.weight_version)

    def _on_group_done(self, inst: Instance, msg: P.GroupDone, now: float) -> None:
        flight = inst.in_flight.pop(msg.group_id, None)
        if flight is None or flight.aborting:
            self.ledger.ignored(msg.group_id, reason="result of a group no longer in flight")
            return
        if not msg.completions:
            self.governor.cancel(msg.group_id)
            self.ledger.requeued(msg.group_id, reason="empty result")
            self._give_back(flight.prompt_id, flight.epoch)
            return
        vmin = min(c.version_min for c in msg.completions)
        vmax = max(c.version_max for c in msg.completions)
        if vmin < flight.start_version:
            log.warning(
                "group %d reports version_min %d below its dispatch version %d",
                msg.group_id,
                vmin,
                flight.start_version,
            )
        lengths = [len(c.token_ids) for c in msg.completions]
        if flight.epoch == self.epoch and self.scheduler is not None:
            self.scheduler.on_group_finished(flight.prompt_id, inst.instance_id, lengths)
        predicted = self._predicted_mean.get(flight.prompt_id)
        if predicted is not None and flight.epoch == self.epoch:
            self._observed_pairs.append((predicted, float(np.mean(lengths))))
        self.lengths.observe(flight.prompt_id, lengths)
        outcome = self.governor.complete(msg.group_id, vmin, vmax)
        self.ledger.completed(
            msg.group_id, instance=inst.instance_id, version_min=vmin, version_max=vmax
        )
        if outcome == "discarded":
            self._discard(
                msg.group_id,
                flight.prompt_id,
                flight.epoch,
                f"started at v{vmin}, beyond lag bound {self.governor.lag_bound}",
            )
        else:
            self.queue[msg.group_id] = QueuedResult(msg, flight.epoch, vmin, vmax)

    def _on_group_aborted(self, inst: Instance, msg: P.GroupAborted) -> None:
        flight = inst.in_flight.pop(msg.group_id, None)
        if flight is None or flight.aborting:
            return  # an abort we asked for, now confirmed (ledgered when we asked)
        self.governor.cancel(msg.group_id, ABORTED)
        self.ledger.aborted(msg.group_id, reason=f"worker: {msg.reason}")
        self._give_back(flight.prompt_id, flight.epoch)

    def _on_group_failed(self, inst: Instance, msg: P.GroupFailed) -> None:
        """A reward function failed on a group: stop the run, or drop the group and count it
        (``task.on_reward_error``). The group is never scored in its place, nor handed out
        again this epoch: the same prompt would fail the same way."""
        flight = inst.in_flight.pop(msg.group_id, None)
        if flight is None or flight.aborting:
            self.ledger.ignored(msg.group_id, reason="result of a group no longer in flight")
            return
        self.governor.cancel(msg.group_id, SKIPPED)
        self.ledger.skipped(msg.group_id, reason=msg.error)
        if flight.epoch == self.epoch:
            self.consumed_prompts.add(flight.prompt_id)
        if self.config.task.on_reward_error == "fail":
            log.error("reward failed on instance %d: %s", inst.instance_id, msg.error)
            self._event(
                P.EventKind.REWARD,
                f"reward failed, stopping (task.on_reward_error: fail): {msg.error}; "
                f"traceback in logs/worker-{inst.instance_id}.log",
                group=msg.group_id,
                prompt=msg.prompt_id,
                instance=inst.instance_id,
                error=msg.error,
            )
            self.request_stop(f"reward failed: {msg.error}", code=1)
            return
        self._event(
            P.EventKind.REWARD,
            f"group {msg.group_id} skipped (task.on_reward_error: skip_group): {msg.error}",
            group=msg.group_id,
            prompt=msg.prompt_id,
            instance=inst.instance_id,
            error=msg.error,
            skipped_total=self.governor.counters.skipped,
        )

    # ============================================================================ evaluation
    def _start_eval(self, final: bool) -> bool:
        """Send every eval prompt to one running instance; False if no round could start."""
        cfg = self.config.task.eval
        if cfg is None or not self.eval_prompts:
            return False
        version = self.governor.version
        if self.eval_round is not None and not self.eval_round.done:
            self._event(
                P.EventKind.EVAL, f"eval at v{version} not started: the previous round is running"
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
            self._event(P.EventKind.EVAL, f"eval at v{version} not started: no running instance")
            return False
        inst = min(ready, key=lambda x: (len(x.in_flight), x.instance_id))
        pending = {}
        for pid in self.eval_prompts:
            gid = next(self._eval_ids)
            pending[gid] = pid
        self.eval_round = EvalRound(version, final, inst.instance_id, set(pending))
        max_tokens = self.config.rollout.sampling.max_tokens
        for gid, pid in pending.items():
            self._send_worker(
                inst,
                P.Generate(
                    group_id=gid,
                    prompt_id=pid,
                    prompt_token_ids=self.eval_tokens[pid],
                    n=cfg.n,
                    max_tokens=max_tokens,
                    temperature=cfg.temperature,
                    seed=None if self.config.rollout.sampling.seed is None else -gid,
                ),
            )
        log.info("eval at v%d: %d prompts on instance %d", version, len(pending), inst.instance_id)
        return True

    def _on_eval_result(self, msg: Any) -> None:
        round_ = self.eval_round
        if round_ is None or msg.group_id not in round_.pending:
            return  # a round given up on (its instance went down, or the run is ending)
        if isinstance(msg, P.GroupDone):
            round_.completed(msg.group_id, msg.prompt_id, msg.completions)
        elif isinstance(msg, P.GroupFailed):
            round_.failed(msg.group_id, msg.error)
        else:
            round_.failed(msg.group_id, f"group {msg.group_id} aborted: {msg.reason}")
        if round_.done:
            self._finish_eval(round_)

    def _finish_eval(self, round_: EvalRound) -> None:
        cfg = self.config.task.eval
        assert cfg is not None
        record = round_.summary(cfg.n)
        if self.trackers is not None:
            self.trackers.log(record, max(1, round_.version))
        # The event is the metrics.jsonl record: {"event": "eval", "message": ..., eval_*}.
        self._event(
            P.EventKind.EVAL,
            describe_eval(record),
            **{k: v for k, v in record.items() if k != "event"},
        )

    async def _final_eval(self, timeout_s: float) -> None:
        """The eval prompts once more on the final weights, before the workers stop."""
        deadline = time.time() + timeout_s
        # The last weights must be on some instance first (they sync after the last step).
        while time.time() < deadline and not any(
            inst.state == RUNNING and inst.weight_version >= self.governor.version
            for inst in self.instances.values()
        ):
            await asyncio.sleep(0.1)
        if self.eval_round is not None and not self.eval_round.done:
            self.eval_round = None  # superseded: the final round is the one that counts
        if not self._start_eval(final=True):
            return
        while time.time() < deadline and self.eval_round is not None and not self.eval_round.done:
            await asyncio.sleep(0.1)
        if self.eval_round is not None and not self.eval_round.done:
            self._event(
                P.EventKind.EVAL, f"final eval gave up after {timeout_s:g} s (task.eval.timeout_s)"
            )

    # ============================================================================ dispatch
    def _after_change(self) -> None:
        """Run after every handled message: feed the instances, then the trainer, then account."""
        self._dispatch()
        self._try_batch()
        self._account()
        gov = self.governor
        if self._seen_pending is not None and gov.pending_lag_bound is None:
            self._event(
                P.EventKind.LAG,
                f"lag bound {gov.lag_bound} now in force (in-flight work drained)",
                lag_bound=gov.lag_bound,
            )
        self._seen_pending = gov.pending_lag_bound

    def _dispatch(self) -> None:
        if self.stopping or self.scheduler is None:
            return
        if self.resumed and not self.trainer_hello_seen:
            # The trainer's checkpoint decides the version a resumed run continues from; no
            # work starts before it has said which.
            return
        self._rr = (self._rr + 1) % max(1, len(self.instances))
        continuous = self.config.scheduler.dispatch == "continuous"
        ready: list[Instance] = []
        for inst in self.instances.values():
            inst.blocked = ""
            if inst.state != RUNNING or inst.operator_paused:
                continue
            if not continuous and inst.in_flight:
                inst.blocked = "minibatch barrier"
                continue
            if inst.concurrency - len(inst.in_flight) > 0:
                ready.append(inst)
        # Least loaded first (rotating ties), and in continuous mode one group per instance per
        # round: when admission is scarce (small η) every instance still gets its share, and
        # work the scheduler re-queued onto any of them is not starved.
        n = max(1, len(self.instances))
        ready.sort(key=lambda x: (len(x.in_flight), (x.instance_id - self._rr) % n))
        # One refusal text per weight version and pass: formatting one for each of hundreds of
        # blocked instances after every message cost more than the dispatch itself.
        refusals: dict[int, str] = {}
        while ready:
            still = []
            for inst in ready:
                free = inst.concurrency - len(inst.in_flight)
                allowed = self.governor.admissible(inst.weight_version)
                if allowed <= 0:
                    v = inst.weight_version
                    if v not in refusals:
                        refusals[v] = self.governor.refusal(v) or "admission"
                    inst.blocked = refusals[v]
                    continue
                # minibatch mode: the scheduler's whole minibatch (never past its boundary)
                picks = self._next_prompts(
                    inst.instance_id, 1 if continuous else min(free, allowed)
                )
                if not picks:
                    inst.blocked = "no work"
                    continue
                for prompt_id, epoch in picks:
                    self._dispatch_group(inst, prompt_id, epoch)
                if continuous and inst.state == RUNNING and free > 1:
                    still.append(inst)
            ready = still

    def _next_prompts(self, i: int, k: int) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        while self.retry and len(out) < k:
            out.append(self.retry.popleft())
        if len(out) < k:
            out += [(p, self.epoch) for p in self.scheduler.next_groups(i, k - len(out))]
        if not out and self.scheduler.remaining() == 0 and self._roll_over():
            out = [(p, self.epoch) for p in self.scheduler.next_groups(i, k)]
        return out

    def _dispatch_group(self, inst: Instance, prompt_id: int, epoch: int) -> None:
        gid = self.next_group_id
        self.next_group_id += 1
        if self.first_dispatch_at is None:
            self.first_dispatch_at = time.time()
        version = inst.weight_version
        self.governor.admit(gid, prompt_id, version)
        now = time.time()
        inst.in_flight[gid] = InFlight(gid, prompt_id, epoch, version, now)
        self.ledger.dispatched(
            gid, prompt=prompt_id, epoch=epoch, instance=inst.instance_id, version=version
        )
        sampling = self.config.rollout.sampling
        seed = None if sampling.seed is None else sampling.seed + gid
        msg = P.Generate(
            group_id=gid,
            prompt_id=prompt_id,
            prompt_token_ids=self.prompt_tokens[prompt_id],
            n=self.n,
            max_tokens=sampling.max_tokens,
            seed=seed,
        )
        inst.running_seqs = min(inst.max_num_seqs, inst.running_seqs + self.n)
        if not self._send_worker(inst, msg):
            # Unroutable: the worker is gone. Its death handling requeues this group too.
            self._mark_down(inst, now, "unreachable")

    def _give_back(self, prompt_id: int, epoch: int) -> None:
        """A prompt's group will not be consumed: hand it out again (same epoch)."""
        if epoch == self.epoch and self.scheduler is not None:
            self.scheduler.requeue([prompt_id])
        else:
            self.retry.append((prompt_id, epoch))

    def _discard(self, gid: int, prompt_id: int, epoch: int, reason: str) -> None:
        self.queue.pop(gid, None)
        self.ledger.discarded(gid, reason=reason)
        self._give_back(prompt_id, epoch)
        self._event(
            P.EventKind.DISCARD,
            f"group {gid} (prompt {prompt_id}) discarded and re-queued: {reason}",
            group=gid,
            prompt=prompt_id,
            reason=reason,
        )

    def _discard_queued(self, gid: int, reason: str) -> None:
        result = self.queue.get(gid)
        if result is not None:
            self._discard(gid, result.done.prompt_id, result.epoch, reason)

    def _abort(self, gid: int, reason: str) -> None:
        """The governor gave up on an in-flight group: stop it on its instance, re-queue it."""
        for inst in self.instances.values():
            flight = inst.in_flight.get(gid)
            if flight is not None:
                flight.aborting = True
                flight.dispatched_at = time.time()  # now: when the abort was asked for
                self.ledger.aborted(gid, reason=reason)
                self._give_back(flight.prompt_id, flight.epoch)
                self._send_worker(inst, P.AbortGroups(group_ids=[gid]))
                self._event(
                    P.EventKind.DISCARD,
                    f"group {gid} aborted on instance {inst.instance_id} and re-queued: {reason}",
                    group=gid,
                    instance=inst.instance_id,
                    reason=reason,
                )
                return

    def _lose_in_flight(self, inst: Instance, reason: str) -> None:
        """Every group out on ``inst`` is gone: back to the scheduler, dispatched elsewhere."""
        lost = list(inst.in_flight.values())
        inst.in_flight.clear()
        inst.running_seqs = 0
        for flight in lost:
            if flight.aborting:
                continue
            self.governor.cancel(flight.group_id)
            self.ledger.requeued(flight.group_id, reason=f"instance {inst.instance_id}: {reason}")
            self._give_back(flight.prompt_id, flight.epoch)
        if lost:
            self._event(
                P.EventKind.INSTANCE,
                f"instance {inst.instance_id}: {len(lost)} group(s) re-queued ({reason})",
                instance=inst.instance_id,
                requeued=len(lost),
            )

    # ============================================================================ instance states
    def _set_state(
        self, inst: Instance, state: str, now: float, why: str = "", *, routine: bool = False
    ) -> None:
        """Change an instance's state and record it. A ``routine`` change (running <-> syncing
        for a weight version) goes to metrics.jsonl only: on a big cluster every version would
        otherwise put two lines per instance in the event log; the version's own "loaded by"
        event sums them up."""
        if inst.state == state:
            return
        old = inst.state
        inst.state = state
        inst.state_since = now
        message = f"instance {inst.instance_id}: {old} -> {state}" + (f" ({why})" if why else "")
        data = {"instance": inst.instance_id, "old": old, "new": state, "reason": why}
        if routine and {old, state} == {RUNNING, SYNCING}:
            data["routine"] = True
            kind = P.EventKind.INSTANCE
            self._record_event(P.Event(time=now, kind=kind, message=message, data=data))
            return
        self._event(P.EventKind.INSTANCE, message, **data)

    def _mark_down(self, inst: Instance, now: float, why: str) -> None:
        if inst.state == DOWN:
            return
        self._lose_in_flight(inst, why)
        inst.sync_target = None
        inst.pending_ack = None
        inst.tokens_per_s = 0.0
        if self.scheduler is not None and not inst.lost_by_scheduler:
            inst.lost_by_scheduler = True
            self.scheduler.on_instance_lost(inst.instance_id)
        self._set_state(inst, DOWN, now, why)
        self._check_sync_complete()

    def _kill_instance_process(self, inst: Instance) -> None:
        if self.spawn and not self.sim:
            self.supervisor.kill(worker_name(inst.instance_id))

    def _on_child_exit(self, name: str, code: int) -> None:
        now = time.time()
        if name == TRAINER:
            if self.stopping and self.trainer_shutdown_sent:
                return
            if self.governor.version >= self.total_steps and self.trainer_shutdown_sent:
                return
            self._event(P.EventKind.RUN, f"trainer exited unexpectedly with code {code}", code=code)
            self.request_stop(f"trainer exited with code {code}", code=1)
            return
        if self.stopping:
            return
        if name == SIM_BACKEND:
            affected = list(self.instances.values())
        else:
            affected = [self.instances[int(name.split("-")[1])]]
        backoff_max = self.config.rollout.restart.backoff_max_s
        for inst in affected:
            if inst.up_since and now - inst.up_since > backoff_max:
                inst.auto_restarts = 0  # it ran well for a while: a fresh failure, fresh backoff
            inst.up_since = 0.0
            inst.ever_up = False  # a dead process does not come back by itself
            self._mark_down(inst, now, f"process exited with code {code}")
        self._schedule_restart(name, affected, manual=False)
        self._after_change()

    def _schedule_restart(self, name: str, affected: list[Instance], manual: bool) -> bool:
        rcfg = self.config.rollout.restart
        lead = affected[0]
        if not manual:
            if not rcfg.auto or lead.auto_restarts >= rcfg.max_restarts:
                self._event(
                    P.EventKind.INSTANCE,
                    f"{name} stays down (automatic restarts: "
                    f"{lead.auto_restarts}/{rcfg.max_restarts}, auto={rcfg.auto})",
                    name=name,
                )
                gone = all(
                    x.state == DOWN and x.restart_at is None for x in self.instances.values()
                )
                if rcfg.auto and gone:  # with auto off, the operator restarts by command
                    self.request_stop("every rollout instance is down for good", code=1)
                return False
            delay = min(rcfg.backoff_max_s, rcfg.backoff_initial_s * 2**lead.auto_restarts)
            for inst in affected:
                inst.auto_restarts += 1
        else:
            delay = 0.0
        when = time.time() + delay
        for inst in affected:
            inst.restart_at = when
        # A newer restart (the operator's, say) supersedes one still waiting out its backoff.
        generation = self._restart_gen.get(name, 0) + 1
        self._restart_gen[name] = generation
        task = self._restart_later(name, affected, delay, generation)
        self._tasks.append(asyncio.create_task(task))
        return True

    async def _restart_later(
        self, name: str, affected: list[Instance], delay: float, generation: int
    ) -> None:
        await asyncio.sleep(delay)
        if self.stopping or self._restart_gen.get(name) != generation:
            return
        if self.supervisor.alive(name):
            await self.supervisor.stop(name, grace_s=5.0)
        now = time.time()
        for inst in affected:
            inst.restarts += 1
            inst.restart_at = None
            inst.last_heartbeat = now
            inst.ever_up = False
            self._set_state(inst, STARTING, now, "restarting")
        try:
            if name == SIM_BACKEND:
                await self._spawn(
                    SIM_BACKEND,
                    [sys.executable, "-m", "runtime.sim.backend", "--run-dir", str(self.rd.root)],
                )
            else:
                await self._spawn_worker(affected[0].instance_id)
        except Exception as exc:
            log.exception("restart of %s failed", name)
            for inst in affected:
                self._mark_down(inst, time.time(), f"restart failed: {exc}")
        self._account()

    # ============================================================================ trainer plane
    def _on_trainer(self, identity: bytes, msg: Any) -> None:
        if identity != b"trainer":
            self.guards["trainer"].rejected["UnknownIdentity"] += 1
            log.warning("message from unknown trainer peer %r ignored", identity)
            return
        self.trainer_identity = identity
        self.trainer_connected = True
        now = time.time()
        if isinstance(msg, P.TrainerHello):
            self.trainer_hello_seen = True
            self._on_trainer_hello(msg)
        elif isinstance(msg, P.BatchRequest):
            if self.first_request_at is None:
                self.first_request_at = now
            if msg.version != self.governor.version:
                log.warning(
                    "trainer asks for a batch at v%d; controller is at v%d",
                    msg.version,
                    self.governor.version,
                )
            self.trainer_pending = msg.version
            self.trainer_waiting_since = now
        elif isinstance(msg, P.StepDone):
            self._on_step_done(msg, now)
        self._after_change()

    def _on_trainer_hello(self, msg: P.TrainerHello) -> None:
        gov = self.governor
        self.weight_rendezvous = msg.weight_rendezvous
        if msg.weight_version != gov.version:
            if gov.outstanding or gov.in_flight or gov.queued:
                self._event(
                    P.EventKind.TRAINER,
                    f"trainer at v{msg.weight_version} but the controller is "
                    f"at v{gov.version} with work in flight; keeping v{gov.version}",
                )
            else:
                self._event(
                    P.EventKind.TRAINER,
                    f"trainer checkpoint is at v{msg.weight_version}; "
                    f"controller state said v{gov.version}: following the trainer",
                )
                gov.version = msg.weight_version
                c = gov.counters
                c.consumed = c.completed = msg.weight_version * self.B
                c.admitted = c.consumed + c.discarded + c.aborted + c.requeued
                for inst in self.instances.values():
                    if inst.alive and inst.weight_version != gov.version:
                        self._start_sync(inst, time.time())
        self._event(
            P.EventKind.TRAINER,
            f"trainer connected ({msg.num_processes} process(es), "
            f"v{msg.weight_version}, pid {msg.pid})",
            pid=msg.pid,
        )

    def _sync_lagging(self) -> list[int]:
        """Live instances still loading a version older than the trainer's previous one."""
        floor = self.governor.version - 1
        return [
            i
            for i, inst in self.instances.items()
            if inst.state in (RUNNING, SYNCING) and inst.weight_version < floor
        ]

    def _try_batch(self) -> None:
        if self.trainer_pending is None or self.trainer_identity is None:
            return
        gov = self.governor
        if self.stopping or gov.version >= self.total_steps:
            if not gov.outstanding:
                self._send(
                    self.sockets.trainer,
                    self.trainer_identity,
                    P.Shutdown(reason=self.stop_reason or "trainer.steps reached"),
                )
                self.trainer_shutdown_sent = True
                self.trainer_pending = None
                self.trainer_condition = "idle"
            return
        if gov.outstanding:
            return
        if self._sync_lagging():
            # The weights of the previous version are still going out; keep it simple and
            # correct: at most two versions are ever in flight to the workers.
            self.trainer_condition = "lag_wait"
            return
        # The bound in force while this batch is formed (a pending bound may apply right after).
        bound, pending = gov.lag_bound, gov.pending_lag_bound
        plan = gov.take_batch()
        if not plan.ready:
            self.trainer_condition = plan.condition
            if plan.condition == "lag_wait":
                self._release_paused(plan.waiting_for)
            return
        for gid in plan.discarded:
            self._discard_queued(gid, f"more than B groups due at v{plan.version}")
        for gid in plan.aborted:
            self._abort(gid, f"more than B groups due at v{plan.version}")
        groups = []
        recorder = LagRecorder()
        lags = []
        for gid in plan.group_ids:
            result = self.queue.pop(gid)
            lag = gov.lag_of(gid)
            lags.append(lag)
            for c in result.done.completions:
                # Conservative: never below the group's own lag (its dispatch version).
                recorder.add(max(plan.version - c.version_min, lag), c.version_max - c.version_min)
            groups.append(
                P.TrainGroup(
                    group_id=gid,
                    prompt_id=result.done.prompt_id,
                    prompt_token_ids=self.prompt_tokens[result.done.prompt_id],
                    completions=result.done.completions,
                )
            )
            if result.epoch == self.epoch:
                self.consumed_prompts.add(result.done.prompt_id)
        self.ledger.consumed(plan.group_ids, step=plan.version, lags=lags)
        gov.forget(plan.group_ids)
        self.last_lag = recorder.stats()
        self._batch_bound, self._batch_pending = bound, pending
        self._batch_tokens = sum(len(c.token_ids) for g in groups for c in g.completions)
        self._batch_samples = sum(len(g.completions) for g in groups)
        self._batch_rewards = [c.reward for g in groups for c in g.completions]
        self._batch_fn_rewards = _per_function_means(groups)
        self._send(
            self.sockets.trainer,
            self.trainer_identity,
            P.Batch(version=plan.version, groups=groups),
        )
        self.trainer_pending = None
        self.trainer_condition = "stepping"

    def _release_paused(self, group_ids: tuple[int, ...]) -> None:
        """Groups the trainer must have, frozen on an operator-paused instance, would stall the
        run until resume: abort them there and regenerate them elsewhere."""
        released = False
        for inst in self.instances.values():
            if not inst.operator_paused:
                continue
            for gid in group_ids:
                flight = inst.in_flight.get(gid)
                if (
                    flight is not None
                    and not flight.aborting
                    and self.governor.cancel(gid, ABORTED)
                ):
                    self._abort(
                        gid, f"needed by the trainer; instance {inst.instance_id} is paused"
                    )
                    released = True
        if released:
            self._dispatch()

    def _on_step_done(self, msg: P.StepDone, now: float) -> None:
        gov = self.governor
        if not gov.outstanding or msg.version != gov.version + 1:
            log.warning("unexpected StepDone(v%d) at v%d", msg.version, gov.version)
            self._send(
                self.sockets.trainer,
                self.trainer_identity,
                P.TrainerAck(ok=False, detail=f"controller is at v{gov.version}"),
            )
            return
        step = gov.version
        pending_before = self._batch_pending
        bound_before = self._batch_bound
        gov.step_done(msg.version)
        self.weights_path[msg.version] = msg.weights_path
        for old in [v for v in self.weights_path if 0 < v < msg.version - 4]:
            del self.weights_path[old]
        # The first iteration starts when both sides were ready (not at process start-up).
        first = max(self.first_request_at or now, self.first_dispatch_at or now)
        since = self.last_step_at or first
        iteration = max(1e-9, now - since)
        self.last_step_at = now
        self.last_iteration_s = iteration
        self.last_metrics = msg.metrics
        samples = msg.metrics.samples or self._batch_samples
        tokens = msg.metrics.tokens or self._batch_tokens
        self.last_samples_per_s = samples / iteration
        self.last_tokens_per_s = tokens / iteration
        told = []
        for inst in self.instances.values():
            if inst.state in (RUNNING, SYNCING, PAUSED):
                if inst.sync_target is None:
                    self._start_sync(inst, now)
                told.append(inst.instance_id)
        self._sync_started_at = now
        self._event(
            P.EventKind.WEIGHTS,
            f"weights v{msg.version} published to {len(told)} instance(s)",
            version=msg.version,
            path=msg.weights_path,
            instances=told,
        )
        self._send(self.sockets.trainer, self.trainer_identity, P.TrainerAck(ok=True))
        bubbles = self.windows.step_interval(now)
        predicted = self._predicted()
        record: dict[str, Any] = {
            "event": "step",
            "step": step + 1,
            "version": msg.version,
            "reward_mean": msg.metrics.reward_mean,
            "reward_mean_rollout": float(np.mean(self._batch_rewards))
            if self._batch_rewards
            else 0.0,
            "reward_std": msg.metrics.reward_std,
            "loss": msg.metrics.loss,
            "kl": msg.metrics.kl,
            "clip_fraction": msg.metrics.clip_fraction,
            "importance_clip_fraction": msg.metrics.importance_clip_fraction,
            "grad_norm": msg.metrics.grad_norm,
            "lag_mean": self.last_lag["mean"],
            "lag_p95": self.last_lag["p95"],
            "lag_max": self.last_lag["max"],
            "lag_span_max": self.last_lag["span_max"],
            "lag_histogram": self.last_lag["histogram"],
            "lag_bound": bound_before,
            "pending_lag_bound": pending_before,
            "queue_depth": gov.queued,
            "in_flight": gov.in_flight,
            "iteration_s": iteration,
            "step_s": msg.metrics.step_s,
            "compute_s": msg.metrics.compute_s,
            "publish_s": msg.metrics.publish_s,
            "wait_batch_s": msg.metrics.wait_batch_s,
            "wait_ack_s": msg.metrics.wait_ack_s,
            "checkpoint_s": msg.metrics.checkpoint_s,
            "sync_s": self.last_sync_s,
            "samples": samples,
            "tokens": tokens,
            "samples_per_s": samples / iteration,
            "tokens_per_s": tokens / iteration,
            "epoch": self.epoch,
            "discarded_total": gov.counters.discarded + gov.counters.aborted,
            "skipped_groups_total": gov.counters.skipped,
        }
        if self._batch_fn_rewards:
            record["reward_functions"] = dict(self._batch_fn_rewards)
        if len(self._observed_pairs) >= 2:
            from runtime.scheduler.lengths import predictor_quality

            pred, actual = zip(*self._observed_pairs, strict=True)
            rho, mape = predictor_quality(pred, actual)
            record["predictor_rho"] = None if np.isnan(rho) else rho
            record["predictor_mape"] = mape
        for cat, value in bubbles.items():
            record[f"bubble_{cat}"] = value
        for cat, value in predicted.items():
            record[f"predicted_bubble_{cat}"] = value
        self.metrics.write(record)
        if self.trackers is not None:
            self.trackers.log(record, step + 1)
        self._save_state()
        evaluation = self.config.task.eval
        if evaluation and (step + 1) % evaluation.every == 0 and step + 1 < self.total_steps:
            self._start_eval(final=False)  # the last step's eval is the final one
        if gov.version >= self.total_steps:
            self.request_stop(f"trainer.steps ({self.total_steps}) reached", code=0)

    def _check_sync_complete(self) -> None:
        started = self._sync_started_at
        if started is None:
            return
        v = self.governor.version
        if all(
            inst.weight_version >= v
            for inst in self.instances.values()
            if inst.state in (RUNNING, SYNCING)
        ):
            self._sync_started_at = None
            self.last_sync_s = time.time() - started
            live = sum(inst.state in (RUNNING, SYNCING) for inst in self.instances.values())
            self._event(
                P.EventKind.WEIGHTS,
                f"weights v{v} loaded by {live}/{len(self.instances)} instances in "
                f"{self.last_sync_s:.2f}s",
                version=v,
                sync_s=self.last_sync_s,
                instances=live,
            )

    # ============================================================================ control plane
    def _on_control(self, identity: bytes, msg: P.Command) -> None:
        reply = commands.handle(self, msg)
        # Stamped when it took effect, before the reply can reach the client.
        handled_at = time.time()
        self._send(self.sockets.control, identity, reply)
        entry = {
            "event": P.EventKind.COMMAND,
            "name": msg.name,
            "args": _jsonable(msg.args),
            "ok": reply.ok,
            "reason": reply.reason,
            "time": handled_at,
        }
        self.metrics.write(entry)
        if msg.name not in ("status", "history"):
            text = f"{msg.name} {msg.args or ''}".strip()
            text += " acknowledged" if reply.ok else f" refused: {reply.reason}"
            if reply.ok and reply.reason:
                text += f" ({reply.reason})"
            self._event(
                P.EventKind.COMMAND,
                text,
                name=msg.name,
                args=_jsonable(msg.args),
                ok=reply.ok,
                reason=reply.reason,
            )
        self._after_change()

    # operator actions (called by commands.handle after validation) --------------------------
    def op_set_lag_bound(self, value: int) -> str:
        change = self.governor.set_lag_bound(value)
        for gid in change.aborted:
            self._abort(gid, f"lag bound lowered to {value} (abort)")
        for gid in change.discarded:
            self._discard_queued(gid, f"lag bound lowered to {value} (abort)")
        if self.scheduler is not None:
            self.scheduler.set_lag_bound(self.governor.admission_bound)
        self._save_state()
        return change.description

    def op_pause(self, inst: Instance) -> None:
        inst.operator_paused = True
        inst.pending_ack = "pause"
        self._send_worker(inst, P.PauseWorker(mode="keep"))
        if self.scheduler is not None:
            self.scheduler.on_instance_paused(inst.instance_id)
        if inst.state in (RUNNING, SYNCING):
            self._set_state(inst, PAUSED, time.time(), "operator")

    def op_resume(self, inst: Instance) -> None:
        inst.operator_paused = False
        inst.pending_ack = "resume"
        self._send_worker(inst, P.ResumeWorker())
        if self.scheduler is not None and not inst.lost_by_scheduler:
            self.scheduler.on_instance_resumed(inst.instance_id)
        now = time.time()
        if inst.state == PAUSED:
            if inst.weight_version < self.governor.version:
                self._set_state(inst, SYNCING, now, "operator resume; weights stale")
                if inst.sync_target is None:
                    self._start_sync(inst, now)
            else:
                self._set_state(inst, RUNNING, now, "operator")

    def op_restart(self, inst: Instance) -> str:
        now = time.time()
        name = SIM_BACKEND if self.sim else worker_name(inst.instance_id)
        affected = list(self.instances.values()) if self.sim else [inst]
        for other in affected:
            other.ever_up = False
            other.auto_restarts = 0
            self._mark_down(other, now, "operator restart")
        self._schedule_restart(name, affected, manual=True)
        return f"restarting {name}"

    # ============================================================================ accounting
    def _account(self) -> None:
        now = time.time()
        # O(N) per call: this runs after every message, and 256 instances send hundreds a second.
        working = sum(1 for inst in self.instances.values() if inst.in_flight)
        cond = self.trainer_condition if self.trainer_connected else "idle"
        for i, inst in self.instances.items():
            if inst.state == DOWN or (inst.state == STARTING and inst.restarts > 0):
                state = "down"
            elif inst.state == STARTING:
                state = "starting"
            else:
                state = inst.state
            pending = self.scheduler.pending(i) if self.scheduler is not None else 0
            pending += len(self.retry)
            blocked = inst.blocked
            admission_open = not blocked or blocked in ("no work", "minibatch barrier")
            active = inst.active_slots()
            cause = free_slot_cause(
                state=state,
                pending=pending if state == "running" else 0,
                running=active,
                admission_open=admission_open,
                work_elsewhere=working - (1 if inst.in_flight else 0) > 0,
                trainer_condition=cond,
                held=blocked == "no work" and pending > 0,
            )
            if inst.state == STARTING and inst.restarts == 0:
                cause = "idle"  # first start-up: nothing was lost yet
            self.accountant.update(i, now, active=active, cause=cause)
        self.accountant.trainer_update(
            now, cond if cond in ("stepping", "starved", "lag_wait") else "idle"
        )

    def _predicted(self) -> dict[str, float]:
        pred = getattr(self.scheduler, "predicted_breakdown", None) if self.scheduler else None
        if pred is None:
            return {}
        if hasattr(pred, "fractions"):
            pred = pred.fractions
        return {str(k): float(v) for k, v in dict(pred).items()}

    # ============================================================================ telemetry
    async def _tick_loop(self) -> None:
        period = 1.0 / self.config.telemetry.hz
        last_state = 0.0
        deadline = time.monotonic()
        while True:
            now = time.time()
            self._check_heartbeats(now)
            self._after_change()
            self._publish_snapshot()
            if now - last_state >= 1.0:
                self._save_state()
                last_state = now
            # A fixed schedule, not a fixed pause: the tick's own work and a busy loop would
            # otherwise slow snapshots below telemetry.hz. More than a period behind, it
            # restarts the schedule rather than bursting to catch up.
            deadline += period
            late = time.monotonic() - deadline
            if late > period:
                deadline += late
            await asyncio.sleep(max(0.0, deadline - time.monotonic()))

    def _check_heartbeats(self, now: float) -> None:
        rcfg = self.config.rollout
        if self.stopping:
            return  # every worker is about to get Shutdown; a slow one is no reason to kill it
        for inst in self.instances.values():
            for gid in [g for g, f in inst.in_flight.items() if f.aborting]:
                # An abort the worker never confirmed must not hold its slots forever.
                if now - inst.in_flight[gid].dispatched_at > rcfg.heartbeat_timeout_s:
                    del inst.in_flight[gid]
            limit = self.config.trainer.step_timeout_s
            if (
                inst.state == SYNCING
                and inst.sync_target is not None
                and (now - inst.sync_started > limit)
            ):
                # Heartbeats alone do not prove progress: an engine that never finishes loading
                # would hold the trainer (which waits for the previous version) forever.
                self._mark_down(
                    inst, now, f"weights v{inst.sync_target} not loaded in {limit:.0f}s"
                )
                self._kill_instance_process(inst)
                continue
            if inst.state in (RUNNING, SYNCING, PAUSED):
                if now - inst.last_heartbeat > rcfg.heartbeat_timeout_s:
                    self._mark_down(inst, now, f"no heartbeat for {rcfg.heartbeat_timeout_s:.0f}s")
                    if self.spawn and not self.sim:
                        self.supervisor.kill(worker_name(inst.instance_id))
            elif (
                inst.state == STARTING
                and self.spawn
                and not self.sim
                and now - inst.state_since > rcfg.start_timeout_s
            ):
                self._event(
                    P.EventKind.INSTANCE,
                    f"instance {inst.instance_id} did not start within {rcfg.start_timeout_s:.0f}s",
                    instance=inst.instance_id,
                )
                inst.state_since = now
                self.supervisor.kill(worker_name(inst.instance_id))

    def snapshot(self) -> P.Snapshot:
        now = time.time()
        gov = self.governor
        self._window, self._shares, total = self.windows.tick(now)
        self._total = total.fractions
        m = self.last_metrics
        lag = self.last_lag
        trainer = P.TrainerSnapshot(
            state=self.trainer_condition if self.trainer_connected else "starting",
            reward_mean=m.reward_mean if m else 0.0,
            loss=m.loss if m else 0.0,
            iteration_s=self.last_iteration_s,
            samples_per_s=self.last_samples_per_s,
            tokens_per_s=self.last_tokens_per_s,
            waiting_s=(now - self.trainer_waiting_since)
            if self.trainer_pending is not None and self.trainer_waiting_since
            else 0.0,
            wait_batch_s=m.wait_batch_s if m else 0.0,
            train_s=m.step_s if m else 0.0,
            sync_s=self.last_sync_s,
        )
        rows = [
            P.InstanceSnapshot(
                instance_id=i,
                state=inst.state,
                in_flight_groups=len(inst.in_flight),
                running_seqs=inst.active_slots(),
                max_num_seqs=inst.max_num_seqs,
                tokens_per_s=inst.tokens_per_s,
                weight_version=max(0, inst.weight_version),
                versions_behind=max(0, gov.version - max(0, inst.weight_version)),
                bubble_share=self._shares.get(i, 0.0),
                restarts=inst.restarts,
                pending=inst.pending_text(now),
            )
            for i, inst in sorted(self.instances.items())
        ]
        assert self.telemetry is not None
        self.telemetry.seq += 1
        c = gov.counters
        return P.Snapshot(
            run_name=self.config.run.name,
            time=now,
            seq=self.telemetry.seq,
            state=self.state,
            step=gov.version,
            total_steps=self.total_steps,
            weight_version=gov.version,
            lag_bound=gov.lag_bound,
            pending_lag_bound=gov.pending_lag_bound,
            on_lag_decrease=gov.on_lag_decrease,
            batch_groups=self.B,
            queue_depth=gov.queued,
            queue_capacity=gov.queue_capacity,
            in_flight_groups=gov.in_flight,
            admitted_groups=c.admitted,
            consumed_groups=c.consumed,
            discarded_groups=c.discarded + c.aborted,
            requeued_groups=c.requeued,
            lag=P.LagStats(
                mean=float(lag["mean"]),
                p95=float(lag["p95"]),
                max=int(lag["max"]),
                span_max=int(lag["span_max"]),
                histogram=list(lag["histogram"]),
            ),
            trainer=trainer,
            bubbles_window=self._window,
            bubbles_total=self._total,
            bubbles_predicted=self._predicted(),
            instances=rows,
            rejected_frames=sum(g.rejected_total for g in self.guards.values()),
            auth_refused=dict(self.auth.refused) if self.auth is not None else {},
        )

    def _publish_snapshot(self) -> None:
        if self.telemetry is not None:
            self.telemetry.publish_snapshot(self.snapshot())

    def _event(self, kind: P.EventKind, message: str, **data: Any) -> None:
        """Publish an Event (PUB + ring buffer) and append it to metrics.jsonl."""
        log.info("[%s] %s", kind, message)
        event = P.Event(time=time.time(), kind=kind, message=message, data=_jsonable(data))
        if self.telemetry is not None:
            self.telemetry.publish_event(event)
        else:
            self._record_event(event)

    def _record_event(self, event: P.Event) -> None:
        if event.kind == P.EventKind.COMMAND:
            return  # _on_control writes the command record itself, with its reply
        self.metrics.write(
            {"event": event.kind, "message": event.message, **event.data, "time": event.time}
        )

    def _save_state(self) -> None:
        gov = self.governor
        c = gov.counters
        with contextlib.suppress(OSError):
            save_state(
                self.rd,
                ControllerState(
                    version=gov.version,
                    epoch=self.epoch,
                    lag_bound=gov.admission_bound,
                    consumed_total=c.consumed,
                    consumed_prompts=sorted(self.consumed_prompts),
                    next_group_id=self.next_group_id,
                    discarded_total=c.discarded + c.aborted,
                    requeued_total=c.requeued,
                    skipped_total=c.skipped,
                    finished=gov.version >= self.total_steps,
                    time=time.time(),
                ),
            )


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    # Children import this package; make sure they find it even when it is not installed.
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _per_function_means(groups: list[P.TrainGroup]) -> dict[str, float]:
    """Mean score of each reward function over the completions it scored (None left out)."""
    scores: dict[str, list[float]] = {}
    for group in groups:
        for completion in group.completions:
            for name, value in completion.rewards.items():
                scores.setdefault(name, []).append(value)
    return {name: float(np.mean(values)) for name, values in scores.items()}


def _max_ledger_group(path: Path) -> int:
    best = -1
    for rec in read_jsonl(path):
        gid = rec.get("group")
        if isinstance(gid, int) and gid > best:
            best = gid
    return best


def _jsonable(value: Any) -> Any:
    return msgspec.to_builtins(value, str_keys=True)
