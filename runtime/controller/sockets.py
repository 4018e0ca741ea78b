"""Binding the controller's four sockets, each a CurveZMQ server checked by the ZAP handler
(``runtime/auth.py``), on loopback too."""

from __future__ import annotations

import socket as pysocket
from dataclasses import dataclass

import zmq
import zmq.asyncio

from runtime.auth import KeyPair
from runtime.transport import curve_server

SOCKET_NAMES = ("rollout", "trainer", "telemetry", "control")


@dataclass
class BoundSockets:
    rollout: zmq.asyncio.Socket
    trainer: zmq.asyncio.Socket
    telemetry: zmq.asyncio.Socket
    control: zmq.asyncio.Socket
    addresses: dict[str, str]
    public_key: str

    def all(self) -> list[zmq.asyncio.Socket]:
        return [self.rollout, self.trainer, self.telemetry, self.control]

    def close(self) -> None:
        for sock in self.all():
            sock.close(linger=0)


def bind_sockets(
    ctx: zmq.asyncio.Context, host: str, port_base: int, server: KeyPair
) -> BoundSockets:
    """ROUTER rollout/trainer/control and PUB telemetry on ``host``; ``port_base == 0`` picks
    free ports. Each is a CurveZMQ server with its name as ZAP domain, so bind the ZAP handler
    (``auth.ZapHandler``) on ``ctx`` first: until it answers, every client is refused."""
    kinds = {
        "rollout": zmq.ROUTER,
        "trainer": zmq.ROUTER,
        "telemetry": zmq.PUB,
        "control": zmq.ROUTER,
    }
    sockets: dict[str, zmq.asyncio.Socket] = {}
    addresses: dict[str, str] = {}
    bind_host = f"[{host}]" if ":" in host else host
    shown_host = host
    if host in ("0.0.0.0", "::", "*"):
        # Clients cannot connect to the wildcard; advertise this machine's name.
        shown_host = pysocket.getfqdn()
    try:
        for offset, name in enumerate(SOCKET_NAMES):
            sock = ctx.socket(kinds[name])
            sock.setsockopt(zmq.LINGER, 0)
            if kinds[name] == zmq.ROUTER:
                # An unroutable reply raises instead of vanishing (a peer that went away).
                sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            else:
                sock.setsockopt(zmq.SNDHWM, 10_000)
            curve_server(sock, server, domain=name)
            sockets[name] = sock
            if port_base == 0:
                port = sock.bind_to_random_port(f"tcp://{bind_host}")
            else:
                port = port_base + offset
                sock.bind(f"tcp://{bind_host}:{port}")
            shown = f"[{shown_host}]" if ":" in shown_host else shown_host
            addresses[name] = f"tcp://{shown}:{port}"
    except zmq.ZMQError as exc:
        for sock in sockets.values():
            sock.close(linger=0)
        raise OSError(
            f"controller.host {host!r}, port_base {port_base}: cannot bind: {exc}"
        ) from exc
    return BoundSockets(**sockets, addresses=addresses, public_key=server.public_text)
