"""How the dashboard reaches a controller: one small interface, two implementations.

``LiveLink`` wraps the runtime's UI-free ``ControlClient`` and ``TelemetrySubscriber``
(``runtime/controller/client.py``) and re-reads ``endpoints.json`` on every (re)connect, because a
restarted controller may bind new ports. ``FixedLink`` replays fixed snapshots with no sockets:
it makes snapshot tests deterministic and lets ``bench/dashboard.py`` time a render tick alone.
No Textual here.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import msgspec

from runtime.auth import KeyPair, Role, client_key
from runtime.protocol import (
    Command,
    CommandReply,
    Event,
    HistoryCmd,
    HistoryReply,
    Snapshot,
    StatusCmd,
)
from runtime.rundir import Endpoints, RunDir


class LinkError(ConnectionError):
    """The controller could not be reached; the message says what to do."""


class TelemetryLink(Protocol):
    """What the app needs from a controller connection."""

    label: str
    """Shown in the header: the control endpoint."""
    run_name: str

    async def open(self) -> None:
        """(Re)connect; raises ``LinkError`` when the controller does not answer."""

    def stream(self) -> AsyncIterator[Snapshot | Event]:
        """Snapshots and events as they are published."""

    async def request(self, command: Command, timeout: float) -> CommandReply:
        """One command; raises ``LinkError`` or ``TimeoutError`` when there is no answer."""

    async def close(self) -> None:
        """Close sockets; safe to call twice."""


def resolve_target(target: str | Path) -> Path:
    """A run directory or an ``endpoints.json`` path -> the ``endpoints.json`` path."""
    path = Path(target)
    if path.is_dir():
        return RunDir(path).endpoints
    if path.name.endswith(".json"):
        return path
    raise FileNotFoundError(
        f"{target}: not a run directory or an endpoints.json file "
        "(pass runs/<name> or runs/<name>/endpoints.json)"
    )


def read_endpoints(path: Path) -> Endpoints:
    """Read ``endpoints.json`` with errors that name the file and the problem."""
    try:
        return msgspec.json.decode(path.read_bytes(), type=Endpoints)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no run has started here (no endpoints.json)") from None
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"{path}: unreadable endpoints file ({exc})") from None


class LiveLink:
    """A live controller, found through ``endpoints.json``, as ``role`` (operator, or viewer
    for a read-only dashboard) with the key in ``key_file`` or the default of
    ``auth.client_key``."""

    def __init__(
        self,
        endpoints_path: Path,
        *,
        probe_timeout_s: float = 1.5,
        role: Role = Role.OPERATOR,
        key_file: str | Path | None = None,
    ) -> None:
        self.endpoints_path = endpoints_path
        self.probe_timeout_s = probe_timeout_s
        self.role = role
        self.key_file = key_file
        endpoints = read_endpoints(endpoints_path)
        self.label = endpoints.control
        self.run_name = endpoints.run_name
        self._control: Any = None
        self._telemetry: Any = None

    async def open(self) -> None:
        from runtime.controller.client import ControlClient, TelemetrySubscriber

        await self.close()
        try:
            endpoints = read_endpoints(self.endpoints_path)
        except (FileNotFoundError, ValueError) as exc:
            raise LinkError(str(exc)) from None
        self.label, self.run_name = endpoints.control, endpoints.run_name
        try:
            key = self.key(endpoints.keys_dir)
        except (OSError, ValueError) as exc:
            raise LinkError(str(exc)) from None
        # Subscribe first so nothing published between the probe and the stream is lost.
        self._telemetry = TelemetrySubscriber(endpoints, role=self.role, key=key)
        self._control = ControlClient(endpoints, role=self.role, key=key)
        try:
            await self.request(StatusCmd(), self.probe_timeout_s)
        except TimeoutError:
            await self.close()
            raise LinkError(
                f"no answer from the controller at {self.label} within {self.probe_timeout_s:g} s "
                f"(if the run is live, it does not accept this {self.role.value} key)"
            ) from None
        except OSError as exc:
            await self.close()
            raise LinkError(f"no answer from the controller at {self.label} ({exc})") from None

    def key(self, keys_dir: str) -> KeyPair:
        """The key pair this link connects with (``auth.KeyUnavailable`` says what to do)."""
        return client_key(keys_dir, self.role, self.key_file)

    def stream(self) -> AsyncIterator[Snapshot | Event]:
        if self._telemetry is None:
            raise LinkError("not connected")
        return aiter(self._telemetry)

    async def request(self, command: Command, timeout: float) -> CommandReply:
        if self._control is None:
            raise LinkError("not connected to the controller")
        # ControllerUnavailable (no reply in time) is a TimeoutError.
        return await self._control.request(command, timeout_s=timeout)

    async def close(self) -> None:
        for client in (self._telemetry, self._control):
            if client is None:
                continue
            closer = getattr(client, "close", None)
            if closer is not None:
                result = closer()
                if asyncio.iscoroutine(result):
                    await result
        self._telemetry = self._control = None


class FixedLink:
    """Replays fixed data with no controller: deterministic screens for tests and the bench.

    ``stream`` yields ``items`` and then either holds (the run looks live) or ends (the
    controller "went away"; later ``open`` calls fail, so the app shows DISCONNECTED).
    Commands are refused with a reason, since there is nothing to act on.
    """

    def __init__(
        self,
        items: Sequence[Snapshot | Event],
        *,
        history: Sequence[Snapshot] = (),
        history_events: Sequence[Event] = (),
        drop_after_items: bool = False,
        label: str = "tcp://127.0.0.1:5557",
        run_name: str | None = None,
    ) -> None:
        self.items = list(items)
        self.history = list(history)
        self.history_events = list(history_events)
        self.drop_after_items = drop_after_items
        self.label = label
        first = next((item for item in self.items if isinstance(item, Snapshot)), None)
        self.run_name = run_name or (first.run_name if first else "fixed")
        self.opened = 0
        self.requests: list[tuple[str, dict[str, Any]]] = []

    async def open(self) -> None:
        self.opened += 1
        if self.drop_after_items and self.opened > 1:
            raise LinkError(f"no answer from the controller at {self.label}")

    async def stream(self) -> AsyncIterator[Snapshot | Event]:
        for item in self.items:
            yield item
        if not self.drop_after_items:
            await asyncio.Event().wait()

    async def request(self, command: Command, timeout: float) -> CommandReply:
        self.requests.append((command.name, command.args))
        if isinstance(command, HistoryCmd):
            data = HistoryReply(snapshots=self.history, events=self.history_events)
            # As it would arrive over the wire: plain data.
            return CommandReply(request_id=0, ok=True, data=msgspec.to_builtins(data))
        return CommandReply(request_id=0, ok=False, reason="fixed snapshot: no controller to act")

    async def close(self) -> None:
        return None
