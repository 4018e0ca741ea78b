"""Binding the controller's four sockets, with CurveZMQ for any non-loopback address."""

from __future__ import annotations

import ipaddress
import os
import socket as pysocket
from dataclasses import dataclass

import zmq
import zmq.asyncio

from runtime.rundir import RunDir

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "ip6-localhost"})
SOCKET_NAMES = ("rollout", "trainer", "telemetry", "control")


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class CurveKeys:
    public: bytes
    secret: bytes


def ensure_server_keys(run_dir: RunDir) -> CurveKeys:
    """The server keypair in ``keys/`` (generated once, secret file mode 0600)."""
    run_dir.keys.mkdir(parents=True, exist_ok=True)
    public_file, secret_file = run_dir.keys / "server.key", run_dir.keys / "server.key_secret"
    if public_file.is_file() and secret_file.is_file():
        return CurveKeys(public_file.read_bytes().strip(), secret_file.read_bytes().strip())
    public, secret = zmq.curve_keypair()
    fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(secret)
    public_file.write_bytes(public)
    return CurveKeys(public, secret)


@dataclass
class BoundSockets:
    rollout: zmq.asyncio.Socket
    trainer: zmq.asyncio.Socket
    telemetry: zmq.asyncio.Socket
    control: zmq.asyncio.Socket
    addresses: dict[str, str]
    public_key: str | None

    def all(self) -> list[zmq.asyncio.Socket]:
        return [self.rollout, self.trainer, self.telemetry, self.control]

    def close(self) -> None:
        for sock in self.all():
            sock.close(linger=0)


def bind_sockets(
    ctx: zmq.asyncio.Context, host: str, port_base: int, run_dir: RunDir
) -> BoundSockets:
    """ROUTER rollout/trainer/control and PUB telemetry on ``host``; ``port_base == 0`` picks
    free ports. A non-loopback host makes every socket a CurveZMQ server (keys in ``keys/``)."""
    keys = None if is_loopback(host) else ensure_server_keys(run_dir)
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
            if keys is not None:
                sock.curve_secretkey = keys.secret
                sock.curve_publickey = keys.public
                sock.curve_server = True
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
    return BoundSockets(
        **sockets, addresses=addresses, public_key=keys.public.decode() if keys else None
    )


def apply_client_curve(sock: zmq.Socket, server_public_key: str | None) -> None:
    """Make a client socket talk to a CurveZMQ server (no-op on loopback endpoints)."""
    if not server_public_key:
        return
    public, secret = zmq.curve_keypair()
    sock.curve_serverkey = server_public_key.encode()
    sock.curve_publickey = public
    sock.curve_secretkey = secret
