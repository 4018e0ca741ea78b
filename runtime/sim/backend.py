"""The ``sim`` rollout backend: K simulated vLLM instances in one process, in real time.

``python -m runtime.sim.backend --run-dir D [--instance-id I ...]`` hosts every instance of the
run (or only the ones named) as asyncio tasks. Each instance has its own DEALER socket (identity
``b"instance-<i>"``) to the controller's rollout ROUTER and speaks exactly the real worker's
protocol, so the controller cannot tell it from a cluster of vLLM workers.

How an instance simulates vLLM is :mod:`runtime.sim.instance` (the sans-IO model, shared with
the simulator); this module is its process wrapper (sockets, asyncio loops, heartbeats, and
``rollout.sim.time_scale`` simulated seconds per wall second). Lengths come from the trace row
behind each prompt (:class:`runtime.sim.instance.TraceOutputs`). ``UpdateWeights`` "loads" the
file it names: a sim marker (``*.json`` written by :mod:`runtime.sim.trainer`) must name the
same version; any other existing file or directory is accepted as is (:func:`check_weights`).

Every socket decodes through a ``FrameGuard``: garbage is logged, counted (the totals are logged
at exit) and ignored. The process exits 0 when every instance got ``Shutdown``, on SIGTERM or
SIGINT, or when the controller process is gone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import psutil
import zmq
import zmq.asyncio

from runtime.auth import Role
from runtime.config import Config, ConfigError, read_run_config
from runtime.logs import setup_logging
from runtime.protocol import Encoder, FrameGuard
from runtime.rundir import RunDir
from runtime.scheduler.cost_model import CostModel
from runtime.sim.instance import InstanceModel, TraceOutputs
from runtime.tasks.sim_task import SimTask, unit_hash
from runtime.transport import connect

log = logging.getLogger("runtime.sim.backend")

STARTUP_S = 3.0
STARTUP_JITTER_S = 2.0
"""Simulated engine start-up: 3-5 simulated seconds (deterministic per instance), so operators
see STARTING before RUNNING."""

SIM_WEIGHTS_FORMAT = "asp-tui-sim-weights"
"""``format`` of the JSON weight markers that the sim trainer writes and sim instances load."""

CONTROLLER_CHECK_S = 2.0
"""How often (wall seconds) the process checks that the controller is still alive."""


@dataclass
class SimSettings:
    """What every instance of one backend process shares."""

    cost: CostModel
    time_scale: float
    heartbeat_s: float
    task: SimTask
    clock_offset: float
    """``time.time() - loop.time()``: loop (monotonic) seconds -> wall timestamps."""
    scheduling_policy: str = "fcfs"
    """``rollout.scheduling_policy``: how the instances' waiting queues order requests."""


class SimInstance:
    """One simulated vLLM instance as a process part: a DEALER socket, a receive task and a
    scheduling loop around an :class:`InstanceModel`.

    The model counts simulated seconds from the instance's start; this wrapper speaks loop
    (monotonic) seconds: ``sim = (loop - origin) * time_scale``. Message timestamps are wall
    times (``loop + clock_offset``)."""

    def __init__(
        self,
        instance_id: int,
        socket: zmq.asyncio.Socket | None,
        max_num_seqs: int,
        settings: SimSettings,
    ) -> None:
        self.instance_id = instance_id
        self.socket = socket
        self.max_num_seqs = max_num_seqs
        self.settings = settings
        self.scale = settings.time_scale
        self.guard = FrameGuard(f"rollout[instance-{instance_id}]")
        self.encoder = Encoder()
        self._origin = 0.0
        self.model = InstanceModel(
            instance_id,
            max_num_seqs,
            settings.cost,
            TraceOutputs(settings.task),
            stamp=self._wall,
            check_weights=check_weights,
            scheduling_policy=settings.scheduling_policy,
        )
        self._closed = False
        self._inbox: deque[object] = deque()
        self._wake = asyncio.Event()
        self._closing = asyncio.Event()

    # --- loop time <-> simulated time ----------------------------------------------------------
    def _sim(self, loop_time: float) -> float:
        return (loop_time - self._origin) * self.scale

    def _loop(self, sim_time: float) -> float:
        return self._origin + sim_time / self.scale

    def _wall(self, sim_time: float) -> float:
        return self._loop(sim_time) + self.settings.clock_offset

    # --- the model, in loop time --------------------------------------------------------------
    def start(self, now: float) -> None:
        """The engine is up at loop time ``now`` (after the simulated start-up)."""
        self._origin = now
        self.model.start(0.0)

    def advance(self, now: float) -> None:
        self.model.advance(self._sim(now))

    def handle(self, message: object, now: float) -> None:
        self.model.handle(message, self._sim(now))

    def next_event(self, now: float) -> float:
        """Loop time of the next thing that happens on its own (a finish, a sync completing)."""
        return self._loop(self.model.next_event(self._sim(now)))

    def take_output(self) -> list[object]:
        return self.model.take_output()

    @property
    def version(self) -> int:
        return self.model.version

    @version.setter
    def version(self, value: int) -> None:
        self.model.version = value

    @property
    def running_seqs(self) -> int:
        return self.model.running_seqs

    @property
    def unexpected(self) -> int:
        return self.model.unexpected

    @property
    def closed(self) -> bool:
        return self._closed or self.model.closed

    # --- the loops ----------------------------------------------------------------------------
    async def run(self) -> None:
        """Start up, then serve until ``Shutdown`` or :meth:`close`."""
        loop = asyncio.get_running_loop()
        receiver = asyncio.create_task(self._receive(), name=f"recv-{self.instance_id}")
        try:
            startup = STARTUP_S + STARTUP_JITTER_S * unit_hash(0x57A27, self.instance_id)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), startup / self.scale)
            if self.closed:
                return
            self.start(loop.time())
            await self._send(self.model.hello(os.getpid()))
            log.info("instance %d up (max_num_seqs=%d)", self.instance_id, self.max_num_seqs)
            next_heartbeat = loop.time()
            while not self.closed:
                self._wake.clear()
                now = loop.time()
                self.advance(now)
                while self._inbox and not self.closed:
                    self.handle(self._inbox.popleft(), now)
                outbox = self.take_output()
                if now >= next_heartbeat:
                    outbox.append(self.model.heartbeat(self._sim(now)))
                    next_heartbeat += self.settings.heartbeat_s
                    if next_heartbeat <= now:  # fell behind (a stall): do not send a burst
                        next_heartbeat = now + self.settings.heartbeat_s
                for message in outbox:
                    await self._send(message)
                if self.closed:
                    break
                deadline = min(self.next_event(now), next_heartbeat)
                timer = loop.call_at(deadline, self._wake.set)
                try:
                    await self._wake.wait()
                finally:
                    timer.cancel()
        finally:
            receiver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await receiver

    async def _receive(self) -> None:
        while True:
            frames = await self.socket.recv_multipart()
            message = self.guard.decode(frames, peer="controller")
            if message is None:
                continue
            self._inbox.append(message)
            self._wake.set()

    def close(self) -> None:
        """Stop the loops (used on SIGTERM and when the controller is gone)."""
        self._closed = True
        self._closing.set()
        self._wake.set()

    async def _send(self, message: object) -> None:
        await self.socket.send_multipart(self.encoder.encode(message))  # type: ignore[arg-type]


def check_weights(version: int, path: str) -> str:
    """Why a weight file cannot be "loaded" ("" if it can). Version 0 is the initial model."""
    if version == 0:
        return ""
    file = Path(path)
    if not file.exists():
        return f"weights {path!r} do not exist"
    if file.suffix != ".json":
        return ""
    try:
        marker = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return f"weights marker {path!r} is unreadable: {exc}"
    if not isinstance(marker, dict) or marker.get("format") != SIM_WEIGHTS_FORMAT:
        return f"weights marker {path!r} is not a {SIM_WEIGHTS_FORMAT} file"
    if marker.get("version") != version:
        return f"weights marker {path!r} holds version {marker.get('version')}, not {version}"
    return ""


# --- the process -----------------------------------------------------------------------------


def controller_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


async def watch_controller(pid: int, stop: asyncio.Event) -> None:
    """Set ``stop`` when the controller process is gone: never outlive the run."""
    while not stop.is_set():
        if not controller_alive(pid):
            log.warning("controller (pid %d) is gone; stopping", pid)
            stop.set()
            return
        await asyncio.sleep(CONTROLLER_CHECK_S)


def install_stop_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, stop.set)


async def serve(config: Config, run_dir: RunDir, instance_ids: list[int]) -> int:
    """Run the given instances until all have shut down or ``stop`` fires."""
    endpoints = run_dir.read_endpoints()
    loop = asyncio.get_running_loop()
    settings = SimSettings(
        cost=CostModel.simulated(config.rollout.sim.trainer_step_s),
        time_scale=config.rollout.sim.time_scale,
        heartbeat_s=config.rollout.heartbeat_s,
        task=SimTask.from_config(config),
        clock_offset=time.time() - loop.time(),
        scheduling_policy=config.rollout.scheduling_policy,
    )
    log.info(
        "sim backend pid %d: instances %s, trace %s (%d prompts), time_scale %.3g",
        os.getpid(),
        _ranges(instance_ids),
        settings.task.source,
        len(settings.task.prompts),
        settings.time_scale,
    )
    context = zmq.asyncio.Context()
    instances = []
    for i in instance_ids:
        # A long linger lets the last acks out on a clean exit.
        socket = connect(
            context, endpoints, "rollout", Role.WORKER, identity=b"instance-%d" % i, linger_ms=1000
        )
        instances.append(SimInstance(i, socket, config.rollout.max_num_seqs_of(i), settings))

    stop = asyncio.Event()
    install_stop_signals(stop)

    async def guarded(instance: SimInstance) -> None:
        try:
            await instance.run()
        except Exception:
            # One broken instance goes quiet (the controller marks it down); the rest go on.
            log.exception("instance %d failed", instance.instance_id)

    everyone = asyncio.gather(*(guarded(inst) for inst in instances))
    watchers = [
        asyncio.create_task(watch_controller(endpoints.controller_pid, stop)),
        asyncio.create_task(stop.wait()),
    ]
    await asyncio.wait([everyone, watchers[1]], return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set():
        for instance in instances:
            instance.close()
    await everyone
    for task in watchers:
        task.cancel()
    rejected = sum(inst.guard.rejected_total for inst in instances)
    unexpected = sum(inst.unexpected for inst in instances)
    log.info(
        "sim backend exiting: %d rejected frame(s), %d unexpected message(s)", rejected, unexpected
    )
    for instance in instances:
        instance.socket.close()
    context.term()
    return 0


def _ranges(ids: list[int]) -> str:
    return f"{ids[0]}..{ids[-1]}" if ids == list(range(ids[0], ids[-1] + 1)) else str(ids)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m runtime.sim.backend",
        description="Simulated rollout instances for the run in RUN_DIR (see the module doc).",
    )
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument(
        "--instance-id",
        type=int,
        action="append",
        dest="instance_ids",
        help="host only this instance (repeatable); default: all of the run's",
    )
    args = parser.parse_args(argv)
    try:
        config = read_run_config(args.run_dir)
        run_dir = RunDir(args.run_dir)
        run_dir.read_endpoints()
        SimTask.from_config(config)  # a bad trace is reported here, before anything starts
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        print(f"sim backend: {exc}", file=sys.stderr)
        return 2
    count = config.num_instances
    ids = sorted(set(args.instance_ids)) if args.instance_ids else list(range(count))
    bad = [i for i in ids if not 0 <= i < count]
    if bad:
        print(
            f"sim backend: --instance-id {bad[0]} is out of range: the run has {count} "
            f"instance(s), ids 0..{count - 1}",
            file=sys.stderr,
        )
        return 2
    setup_logging(run_dir.log_file("sim-backend"))
    return asyncio.run(serve(config, run_dir, ids))


if __name__ == "__main__":
    sys.exit(main())
