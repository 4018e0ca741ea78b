"""The controller process: sockets, child processes and the event loop around the core.

:class:`ControllerProcess` binds the four sockets (CurveZMQ, with the ZAP handler deciding who
may connect), spawns and supervises the workers (or the sim backend) and the trainer, and turns
every frame, child exit and timer into an event for the
:class:`~runtime.controller.core.ControllerCore`; it carries out the actions the core returns.
One asyncio loop runs everything, and each event is handled to completion before the next frame
is read, so the core is never seen half-changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from runtime import protocol as P
from runtime.auth import Refusal, RunKeys, ZapHandler, may_command
from runtime.config import Config, read_run_config
from runtime.controller import actions as A
from runtime.controller.core import ControllerCore
from runtime.controller.instances import RUNNING
from runtime.controller.launchers import Launchers
from runtime.controller.ledger import Ledger
from runtime.controller.sockets import bind_sockets
from runtime.controller.state import load_state, save_state
from runtime.controller.supervisor import Supervisor
from runtime.controller.telemetry import Telemetry
from runtime.controller.work import TaskData, load_task
from runtime.resources import (
    SIM_BACKEND,
    TRAINER,
    ResourcePlan,
    plan_resources,
    worker_instance,
    worker_name,
)
from runtime.rundir import Endpoints, JsonlWriter, RunDir, read_jsonl
from runtime.scheduler.policies import make_scheduler

log = logging.getLogger(__name__)

ROLLOUT_TYPES = (
    P.WorkerHello | P.Heartbeat | P.GroupDone | P.GroupAborted | P.GroupFailed | P.WorkerAck
)
TRAINER_TYPES = P.TrainerHello | P.BatchRequest | P.StepDone
INSTANCE_PREFIX = b"instance-"
TRAINER_IDENTITY = b"trainer"


class ControllerProcess:
    """One run's controller process. ``await ControllerProcess(run_dir).run()``: the exit code."""

    def __init__(self, run_dir: str | Path, *, spawn: bool = True) -> None:
        self.rd = RunDir(run_dir).create()
        self.config: Config = read_run_config(self.rd.root)
        self.spawn = spawn
        self.sim = self.config.rollout.backend == "sim"
        self.core: ControllerCore | None = None
        self.exit_code = 0
        self._stop_event = asyncio.Event()
        self.guards = {
            "rollout": P.FrameGuard("rollout", P.Decoder(ROLLOUT_TYPES)),
            "trainer": P.FrameGuard("trainer", P.Decoder(TRAINER_TYPES)),
            "control": P.FrameGuard("control", P.CommandDecoder()),
        }
        self.encoder = P.Encoder()
        self.ctx: zmq.asyncio.Context | None = None
        self.sockets: Any = None
        self.auth: ZapHandler | None = None
        self.telemetry: Telemetry | None = None
        self.metrics = JsonlWriter(self.rd.metrics)
        self.trackers: Any = None  # TensorBoard / W&B, started with the sockets
        self.ledger = Ledger(self.rd.ledger)
        self.supervisor = Supervisor(self._on_child_exit, env=_child_env())
        self.resources: ResourcePlan = plan_resources(self.config)
        self.model_path = self.config.model.path
        self.launchers: Launchers | None = None
        self._tasks: list[asyncio.Task] = []
        self._command_identity: bytes | None = None
        self._events = A.Outbox(time.time)

    # --- lifecycle ----------------------------------------------------------------------------
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
            self._tasks += [
                asyncio.create_task(self._read_loop("rollout"), name="rollout"),
                asyncio.create_task(self._read_loop("trainer"), name="trainer"),
                asyncio.create_task(self._read_loop("control"), name="control"),
                asyncio.create_task(self._tick_loop(), name="tick"),
            ]
            if self.spawn and not self._stop_event.is_set():
                await self._spawn_children()
            await self._stop_event.wait()
            await self._shutdown()
        except Exception as exc:
            log.exception("controller failed")
            self.exit_code = self.exit_code or 1
            self._publish(P.EventKind.RUN, f"controller failed: {exc}", error=str(exc))
        finally:
            await self._close(installed)
        return self.exit_code

    @property
    def core_(self) -> ControllerCore:
        assert self.core is not None, "the core exists once the task is loaded"
        return self.core

    async def _startup(self) -> None:
        cfg = self.config
        self.ctx = zmq.asyncio.Context()
        keys = RunKeys(self.rd.keys).ensure()
        # The ZAP handler first: the sockets refuse every client until it answers.
        self.auth = ZapHandler(self.ctx, keys, on_refused=self._on_auth_refused)
        self._tasks.append(asyncio.create_task(self.auth.serve(), name="zap"))
        self.sockets = bind_sockets(
            self.ctx, cfg.controller.host, cfg.controller.port_base, keys.server()
        )
        self.telemetry = Telemetry(
            self.sockets.telemetry, cfg.telemetry.ring_size, on_event=self._record_event
        )
        addresses = self.sockets.addresses
        endpoints = Endpoints(
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
        self.rd.write_endpoints(endpoints)
        self.launchers = Launchers(cfg, endpoints, keys)
        from runtime.tracking import Trackers

        self.trackers = Trackers(self.rd.root, cfg)
        task: TaskData = await asyncio.get_running_loop().run_in_executor(None, load_task, cfg)
        self.model_path = task.model_path
        core = ControllerCore(
            cfg,
            task,
            clock=time.time,
            ledger=self.ledger,
            saved=load_state(self.rd),
            next_group_id=_max_ledger_group(self.rd.ledger) + 1,
            supervises=self.spawn,
            make_scheduler=make_scheduler,
            locate_weights=self._weights_on_disk,
        )
        core.telemetry = self.telemetry
        self.core = core
        self._publish(
            P.EventKind.RUN,
            "controller started"
            + (
                f" (resumed at v{core.governor.version}, epoch {core.work.epoch})"
                if core.resumed
                else ""
            ),
            version=core.governor.version,
            endpoints=addresses,
        )
        for kind, message, data in task.notices:  # found while loading the task
            self._publish(kind, message, **data)
        self._execute(core.start())

    def _weights_on_disk(self, version: int) -> str:
        """Where ``version`` lives when the trainer did not say in this controller's life (a
        resumed run): the real trainer's safetensors, or the sim trainer's marker."""
        if version == 0:
            return self.model_path
        real = self.rd.weights_file(version)
        marker = self.rd.weights / f"v{version:06d}.sim.json"
        return str(marker if not real.exists() and marker.exists() else real)

    async def _spawn_children(self) -> None:
        log.info("%s", self.resources.describe())
        if self.sim:
            await self._start_process(SIM_BACKEND)
        else:
            for i in self.core_.instances:
                await self._start_process(worker_name(i))
        from runtime.trainer import trainer_command

        await self._start_process(TRAINER, trainer_command(self.config, self.rd.root))

    async def _start_process(self, name: str, argv: list[str] | None = None) -> None:
        root = str(self.rd.root)
        if argv is None and name == SIM_BACKEND:
            argv = [sys.executable, "-m", "runtime.sim.backend", "--run-dir", root]
        elif argv is None:
            argv = [sys.executable, "-m", "runtime.rollout.worker", "--run-dir", root]
            argv += ["--instance-id", str(worker_instance(name))]
        share = self.resources.share(name)
        assert self.launchers is not None, "children start after the sockets are bound"
        launch = self.launchers.wrap(name, argv)  # through ssh/srun/a command for other hosts
        log_file = self.rd.log_file(name)
        child = await self.supervisor.spawn(name, launch.argv, log_file, share, launch.stdin)
        if child.pid is not None:
            self._feed(A.ProcessStarted(name, child.pid))

    def _on_signal(self, name: str) -> None:
        if self.core is not None and self.core.stopping:
            # A second signal: the operator does not want to wait for the final checkpoint.
            self._publish(P.EventKind.RUN, f"signal {name} again: killing every child now")
            self.supervisor.kill_all_now()
            return
        self.request_stop(f"signal {name}")

    def request_stop(self, reason: str, code: int = 0) -> None:
        if self.core is None:
            self.exit_code = self.exit_code or code
            self._stop_event.set()
            return
        self.core.request_stop(reason, code)
        self._execute(self.core.outbox.take())

    async def _shutdown(self) -> None:
        """Trainer first (final checkpoint), then workers; everything is reaped in ``run``."""
        cfg = self.config
        core = self.core_
        if not core.stopping:  # a signal came before the core was up
            self.request_stop("signal during start-up", self.exit_code)
        if self.spawn and self.supervisor.alive(TRAINER):
            # The trainer finishes its step, asks again, gets Shutdown and checkpoints.
            await self.supervisor.wait_exit(TRAINER, cfg.trainer.step_timeout_s + 60.0)
        if cfg.task.eval is not None and core.exit_code == 0 and core.evaluator.enabled:
            await self._final_eval(cfg.task.eval.timeout_s)
        elif not self.spawn and core.trainer.connected and not core.trainer.shutdown_sent:
            deadline = time.time() + min(30.0, cfg.trainer.step_timeout_s)
            while not core.trainer.shutdown_sent and time.time() < deadline:
                await asyncio.sleep(0.05)
        for i in core.instances:
            self._send_instance(i, P.Shutdown(reason=core.stop_reason))
        if self.spawn:
            names = [n for n in self.supervisor.children if n != TRAINER]
            await asyncio.gather(*(self.supervisor.wait_exit(n, 15.0) for n in names))
        else:
            await asyncio.sleep(0.2)  # let the Shutdown frames leave
        if core.exit_code == 0 and not self.sim and self.spawn:
            await self._export_final()
        core.finish()
        self.exit_code = core.exit_code
        self._publish_snapshot()
        self._publish(
            P.EventKind.RUN,
            f"stopped ({core.stop_reason}), exit {self.exit_code}",
            code=self.exit_code,
            version=core.governor.version,
        )
        self._save_state()

    async def _final_eval(self, timeout_s: float) -> None:
        """The eval prompts once more on the final weights, before the workers stop."""
        core = self.core_
        deadline = time.time() + timeout_s
        # The last weights must be on some instance first (they sync after the last step).
        while time.time() < deadline and not any(
            inst.state == RUNNING and inst.weight_version >= core.governor.version
            for inst in core.instances.values()
        ):
            await asyncio.sleep(0.1)
        self._feed(A.StartFinalEval())
        if core.evaluator.round is None or not core.evaluator.round.final:
            return
        while time.time() < deadline and core.evaluator.running:
            await asyncio.sleep(0.1)
        if core.evaluator.running:
            self._publish(
                P.EventKind.EVAL, f"final eval gave up after {timeout_s:g} s (task.eval.timeout_s)"
            )

    async def _export_final(self) -> None:
        """``final/``: the last weights as a Hugging Face model directory (off the loop)."""
        from runtime.export import FINAL_DIR, export_version

        target = self.rd.root / FINAL_DIR
        version = self.core_.governor.version
        try:
            await asyncio.get_running_loop().run_in_executor(
                None, export_version, self.rd.root, target, None
            )
        except Exception as exc:
            log.exception("export of the final weights failed")
            self._publish(P.EventKind.RUN, f"export to {target} failed: {exc}", error=str(exc))
            self.core_.exit_code = self.core_.exit_code or 1
            return
        self._publish(
            P.EventKind.RUN,
            f"final weights (v{version}) exported to {target}",
            path=str(target),
            version=version,
        )

    async def _close(self, installed: list[signal.Signals]) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.supervisor.stop_all(grace_s=5.0)
        self.supervisor.close()
        loop = asyncio.get_running_loop()
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

    # --- events in ----------------------------------------------------------------------------
    def _feed(self, event: A.Event) -> None:
        if self.core is not None:
            self._execute(self.core.handle(event))

    async def _read_loop(self, name: str) -> None:
        sock = getattr(self.sockets, name)
        guard = self.guards[name]
        while True:
            frames = await sock.recv_multipart(copy=False)
            identity = frames[0].bytes
            msg = guard.decode(frames[1:], peer=repr(identity))
            if msg is None:
                continue
            try:
                event = self._event_of(name, frames[1], identity, msg)
                if event is not None:
                    self._feed(event)
            except Exception:
                # A bug while handling one message must not take the run down silently.
                log.exception("error handling %s on %s", type(msg).__name__, name)

    def _event_of(self, name: str, frame: zmq.Frame, identity: bytes, msg: Any) -> A.Event | None:
        if name == "rollout":
            instance_id = _instance_id(identity)
            if instance_id is None or instance_id not in self.core_.instances:
                guard = self.guards["rollout"]
                guard.rejected["UnknownIdentity"] += 1
                log.warning("message from unknown rollout peer %r ignored", identity)
                return None
            return A.InstanceMessage(instance_id, msg)
        if name == "trainer":
            if identity != TRAINER_IDENTITY:
                self.guards["trainer"].rejected["UnknownIdentity"] += 1
                log.warning("message from unknown trainer peer %r ignored", identity)
                return None
            return A.TrainerMessage(msg)
        if not self._may_command(frame, identity, msg):
            return None
        self._command_identity = identity
        return A.OperatorCommand(msg)

    def _may_command(
        self, frame: zmq.Frame, identity: bytes, msg: P.Command | P.InvalidCommand
    ) -> bool:
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
        self._publish(
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

    def _on_child_exit(self, name: str, code: int) -> None:
        self._feed(A.ProcessExited(name, code))

    async def _tick_loop(self) -> None:
        period = 1.0 / self.config.telemetry.hz
        last_state = 0.0
        deadline = time.monotonic()
        while True:
            self._feed(A.Tick())
            self._publish_snapshot()
            now = time.time()
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

    # --- actions out --------------------------------------------------------------------------
    def _execute(self, actions: list[A.Action]) -> None:
        for action in actions:
            if isinstance(action, A.SendToInstance):
                if not self._send_instance(action.instance_id, action.message):
                    self._feed(A.InstanceUnreachable(action.instance_id))
            elif isinstance(action, A.SendToTrainer):
                self._send(self.sockets.trainer, TRAINER_IDENTITY, action.message)
            elif isinstance(action, A.CommandAnswered):
                if self._command_identity is not None:
                    self._send(self.sockets.control, self._command_identity, action.reply)
            elif isinstance(action, A.Publish):
                self._publish_event(action.event)
            elif isinstance(action, A.Record):
                self.metrics.write(action.record)
                if action.step is not None and self.trackers is not None:
                    self.trackers.log(action.record, action.step)
            elif isinstance(action, A.Track):
                if self.trackers is not None:
                    self.trackers.log(action.record, action.step)
            elif isinstance(action, A.SaveState):
                with contextlib.suppress(OSError):
                    save_state(self.rd, action.state)
            elif isinstance(action, A.KillProcess):
                self.supervisor.kill(action.name)
            elif isinstance(action, A.RestartProcess):
                self._spawn_task(self._restart(action.name))
            elif isinstance(action, A.WakeLater):
                self._spawn_task(self._wake_later(action))
            elif isinstance(action, A.PlanEpoch):
                self._spawn_task(self._plan(action.plan))
            elif isinstance(action, A.StopRequested):
                self._stop_event.set()

    def _spawn_task(self, coro: Any) -> None:
        self._tasks.append(asyncio.create_task(coro))

    async def _wake_later(self, wake: A.WakeLater) -> None:
        await asyncio.sleep(wake.delay_s)
        self._feed(A.RestartDue(wake.name, wake.generation))

    async def _restart(self, name: str) -> None:
        if self.supervisor.alive(name):
            await self.supervisor.stop(name, grace_s=5.0)
        try:
            await self._start_process(name)
        except Exception as exc:
            log.exception("restart of %s failed", name)
            self._feed(A.ProcessStartFailed(name, str(exc)))

    async def _plan(self, plan: Any) -> None:
        """Plan the next epoch off the loop (asp takes seconds for 14k groups; the loop must
        keep serving heartbeats, results and the trainer meanwhile)."""
        started = time.perf_counter()
        try:
            scheduler = await asyncio.get_running_loop().run_in_executor(None, plan.make)
        except Exception as exc:
            log.exception("planning epoch %d failed", plan.epoch)
            self._feed(A.EpochPlanned(plan, error=str(exc)))
            return
        self._feed(A.EpochPlanned(plan, scheduler, seconds=time.perf_counter() - started))

    def _send(self, sock: Any, identity: bytes, msg: Any) -> bool:
        try:
            sock.send_multipart(
                [identity, *self.encoder.encode(msg)], flags=zmq.NOBLOCK, copy=False
            )
            return True
        except zmq.ZMQError as exc:
            log.warning("cannot send %s to %r: %s", type(msg).__name__, identity, exc)
            return False

    def _send_instance(self, instance_id: int, msg: Any) -> bool:
        return self._send(self.sockets.rollout, INSTANCE_PREFIX + b"%d" % instance_id, msg)

    def _publish(self, kind: P.EventKind, message: str, **data: Any) -> None:
        """An event of the process's own (start-up, signals, auth, export)."""
        self._events.publish(kind, message, **data)
        self._execute(self._events.take())

    def _publish_event(self, event: P.Event) -> None:
        """Publish an Event (PUB + ring buffer) and append it to metrics.jsonl."""
        if self.telemetry is not None:
            self.telemetry.publish_event(event)
        else:
            self._record_event(event)

    def _record_event(self, event: P.Event) -> None:
        if event.kind == P.EventKind.COMMAND:
            return  # the core records a command itself, with its reply
        self.metrics.write(
            {"event": event.kind, "message": event.message, **event.data, "time": event.time}
        )

    def _publish_snapshot(self) -> None:
        if self.telemetry is None or self.core is None:
            return
        self.telemetry.seq += 1
        snapshot = msgspec.structs.replace(
            self.core.snapshot(self.telemetry.seq),
            rejected_frames=sum(g.rejected_total for g in self.guards.values()),
            auth_refused=dict(self.auth.refused) if self.auth is not None else {},
        )
        self.telemetry.publish_snapshot(snapshot)

    def _save_state(self) -> None:
        if self.core is not None:
            with contextlib.suppress(OSError):
                save_state(self.rd, self.core.saved_state())


def _instance_id(identity: bytes) -> int | None:
    if not identity.startswith(INSTANCE_PREFIX):
        return None
    try:
        return int(identity[len(INSTANCE_PREFIX) :])
    except ValueError:
        return None


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    # Children import this package; make sure they find it even when it is not installed.
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _max_ledger_group(path: Path) -> int:
    best = -1
    for rec in read_jsonl(path):
        gid = rec.get("group")
        if isinstance(gid, int) and gid > best:
            best = gid
    return best
