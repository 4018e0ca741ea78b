"""Talking to a running controller: commands, telemetry, and test helpers. No UI in here.

Everything a client needs is in the run directory's ``endpoints.json``::

    endpoints = RunDir(run_dir).read_endpoints()
    async with ControlClient(endpoints) as control:
        reply = await control.request(SetLagBound(value=0))       # -> protocol.CommandReply
        snapshot = await control.status()                          # -> protocol.Snapshot
    async with TelemetrySubscriber(endpoints) as telemetry:
        async for message in telemetry:                            # Snapshot | Event
            ...
        snap = await telemetry.wait_for(lambda s: s.step >= 3, timeout=60)

For tests and scripts: :class:`SpawnedController` starts a controller on a run directory
(``launcher.spawn_controller``) as a context manager that always reaps it. Garbage from the
server side is counted in ``rejected`` and skipped, as everywhere else.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from runtime.auth import KeyPair, Role
from runtime.launcher import controller_ready, spawn_controller
from runtime.protocol import (
    TOPIC_EVENT,
    TOPIC_SNAPSHOT,
    Command,
    CommandReply,
    Decoder,
    Encoder,
    Event,
    FrameGuard,
    HistoryCmd,
    HistoryReply,
    Snapshot,
    StatusCmd,
)
from runtime.rundir import Endpoints, RunDir
from runtime.transport import connect


class ControllerUnavailable(TimeoutError):
    """No reply from the controller within the timeout (it is gone, or busy)."""


class ControlClient:
    """Request/reply on the control socket. One DEALER; replies are matched by request id, so
    several requests may be outstanding at once. ``role`` is operator (every command) or viewer
    (status and history only); ``key`` defaults as in ``auth.client_key``."""

    def __init__(
        self,
        endpoints: Endpoints,
        *,
        timeout_s: float = 10.0,
        context: zmq.asyncio.Context | None = None,
        role: Role = Role.OPERATOR,
        key: KeyPair | None = None,
    ) -> None:
        self.endpoints = endpoints
        self.timeout_s = timeout_s
        self._own_ctx = context is None
        self.ctx = context or zmq.asyncio.Context()
        try:
            self.sock = connect(self.ctx, endpoints, "control", role, key=key)
        except BaseException:
            if self._own_ctx:
                self.ctx.term()
            raise
        self.guard = FrameGuard("control-client", Decoder(CommandReply))
        self.encoder = Encoder()
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[CommandReply]] = {}
        self._reader: asyncio.Task | None = None

    async def request(self, command: Command, timeout_s: float | None = None) -> CommandReply:
        """Send ``command`` (its ``request_id`` is set here) and wait for its reply
        (``ControllerUnavailable`` after ``timeout_s``). A refused command is a reply with
        ``ok=False``, not an exception."""
        if self._reader is None:
            self._reader = asyncio.create_task(self._read())
        request_id = next(self._ids)
        future: asyncio.Future[CommandReply] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        command = msgspec.structs.replace(command, request_id=request_id)
        await self.sock.send_multipart(self.encoder.encode(command))
        try:
            return await asyncio.wait_for(future, timeout_s or self.timeout_s)
        except TimeoutError:
            raise ControllerUnavailable(
                f"no reply to {command.name!r} from {self.endpoints.control} within "
                f"{timeout_s or self.timeout_s:.0f}s"
            ) from None
        finally:
            self._waiting.pop(request_id, None)

    async def status(self) -> Snapshot:
        reply = await self.request(StatusCmd())
        if not reply.ok:
            raise RuntimeError(f"status refused: {reply.reason}")
        return msgspec.convert(reply.data, Snapshot)

    async def history(self, limit: int | None = None) -> tuple[list[Snapshot], list[Event]]:
        reply = await self.request(HistoryCmd(limit=limit))
        if not reply.ok:
            raise RuntimeError(f"history refused: {reply.reason}")
        history = msgspec.convert(reply.data, HistoryReply)
        return history.snapshots, history.events

    async def _read(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            reply = self.guard.decode(frames, peer="controller")
            if reply is None:
                continue
            future = self._waiting.get(reply.request_id)
            if future is not None and not future.done():
                future.set_result(reply)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        self.sock.close(linger=0)
        if self._own_ctx:
            self.ctx.term()

    async def __aenter__(self) -> ControlClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class TelemetrySubscriber:
    """The telemetry stream: ``async for message in subscriber`` yields Snapshot and Event.

    ``topics`` picks what to receive (both by default). Reconnection is zmq's: a controller that
    restarts on the same endpoint is picked up again; a client that wants to notice staleness
    compares ``Snapshot.time`` with the clock.
    """

    def __init__(
        self,
        endpoints: Endpoints,
        *,
        topics: tuple[bytes, ...] = (TOPIC_SNAPSHOT, TOPIC_EVENT),
        context: zmq.asyncio.Context | None = None,
        role: Role = Role.OPERATOR,
        key: KeyPair | None = None,
    ) -> None:
        self.endpoints = endpoints
        self._own_ctx = context is None
        self.ctx = context or zmq.asyncio.Context()
        try:
            self.sock = connect(self.ctx, endpoints, "telemetry", role, key=key)
        except BaseException:
            if self._own_ctx:
                self.ctx.term()
            raise
        for topic in topics:
            self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.guard = FrameGuard("telemetry-client", Decoder(Snapshot | Event))
        self.latest: Snapshot | None = None

    async def receive(self, timeout_s: float | None = None) -> Snapshot | Event:
        """The next Snapshot or Event (``TimeoutError`` after ``timeout_s``)."""
        while True:
            frames = await asyncio.wait_for(self.sock.recv_multipart(copy=False), timeout_s)
            if len(frames) < 2:
                self.guard.rejected["NoTopic"] += 1
                continue
            message = self.guard.decode(frames[1:], peer="controller")
            if message is None:
                continue
            if isinstance(message, Snapshot):
                self.latest = message
            return message

    def __aiter__(self) -> AsyncIterator[Snapshot | Event]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Snapshot | Event]:
        while True:
            yield await self.receive()

    async def wait_for(
        self, predicate: Callable[[Snapshot], bool], timeout: float = 60.0
    ) -> Snapshot:
        """The first snapshot that satisfies ``predicate``; ``TimeoutError`` names the last one
        seen, so a failing test says where the run was."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"no matching snapshot within {timeout:.0f}s; last: {_describe(self.latest)}"
                )
            try:
                message = await self.receive(timeout_s=left)
            except TimeoutError:
                continue
            if isinstance(message, Snapshot) and predicate(message):
                return message

    async def wait_for_event(
        self, predicate: Callable[[Event], bool], timeout: float = 60.0
    ) -> Event:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no matching event within {timeout:.0f}s")
            try:
                message = await self.receive(timeout_s=left)
            except TimeoutError:
                continue
            if isinstance(message, Event) and predicate(message):
                return message

    async def close(self) -> None:
        self.sock.close(linger=0)
        if self._own_ctx:
            self.ctx.term()

    async def __aenter__(self) -> TelemetrySubscriber:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _describe(snap: Snapshot | None) -> str:
    if snap is None:
        return "none received"
    states = ",".join(f"{r.instance_id}:{r.state}" for r in snap.instances)
    return (
        f"state={snap.state} step={snap.step}/{snap.total_steps} queue={snap.queue_depth} "
        f"in_flight={snap.in_flight_groups} trainer={snap.trainer.state} "
        f"rejected_frames={snap.rejected_frames} instances=[{states}]"
    )


class SpawnedController:
    """A controller started on ``run_dir`` (``launcher.spawn_controller``) for tests and scripts:
    ``async with`` it (its endpoints in ``.endpoints``), or ``await wait_ready()``; always
    reaped."""

    def __init__(
        self, run_dir: str | Path, *, spawn: bool = True, env: dict[str, str] | None = None
    ) -> None:
        self.run_dir = RunDir(run_dir)
        self.proc = spawn_controller(self.run_dir, spawn=spawn, env=env)
        self.endpoints: Endpoints | None = None

    async def wait_ready(self, timeout: float = 60.0) -> Endpoints:
        """The endpoints once it has bound its sockets (``RuntimeError`` if it died first)."""
        deadline = time.monotonic() + timeout
        while (endpoints := controller_ready(self.run_dir, self.proc)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.run_dir.endpoints} did not appear within {timeout:.0f}s")
            await asyncio.sleep(0.05)
        self.endpoints = endpoints
        return endpoints

    @property
    def pid(self) -> int:
        return self.proc.pid

    def signal(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    async def wait(self, timeout: float = 60.0) -> int:
        """Exit code; ``TimeoutError`` if it is still running after ``timeout``."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"controller pid {self.proc.pid} still running")
            await asyncio.sleep(0.05)
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the controller's whole process group (its children have their own groups and
        die by PR_SET_PDEATHSIG)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    async def __aenter__(self) -> SpawnedController:
        try:
            await self.wait_ready()
        except BaseException:
            self.kill()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                await self.wait(30.0)
            except TimeoutError:
                self.kill()


def write_run_config(run_dir: str | Path, config: Any) -> RunDir:
    """Write a resolved ``config.yaml`` (a ``runtime.config.Config``) into a fresh run dir."""
    rd = RunDir(run_dir).create()
    rd.config.write_text(config.to_yaml())
    return rd


def send_command(
    endpoints: Endpoints,
    command: Command,
    *,
    timeout_s: float = 10.0,
    role: Role = Role.OPERATOR,
    key: KeyPair | None = None,
) -> CommandReply:
    """Blocking one-shot command (for CLIs and scripts): the reply, or ``ControllerUnavailable``
    when nothing answers within ``timeout_s`` (a client whose key is refused hears nothing)."""
    ctx = zmq.Context()
    try:
        sock = connect(ctx, endpoints, "control", role, key=key)
    except BaseException:
        ctx.term()
        raise
    try:
        sock.send_multipart(Encoder().encode(msgspec.structs.replace(command, request_id=1)))
        guard = FrameGuard("control-client", Decoder(CommandReply))
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not sock.poll(int(left * 1000)):
                break
            reply = guard.decode(sock.recv_multipart(), peer="controller")
            if reply is not None and reply.request_id == 1:
                return reply
        raise ControllerUnavailable(
            f"no reply to {command.name!r} from {endpoints.control} within {timeout_s:.0f}s"
        )
    finally:
        sock.close(0)
        ctx.term()
