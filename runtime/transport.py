"""Sockets to and from the controller, with CurveZMQ authentication: the one place for both.

A client opens its socket with :func:`connect` (the run's endpoints, the plane, its role); a
server socket becomes a CurveZMQ server with :func:`curve_server`. Roles, keys and the ZAP handler
that checks them are in ``runtime/auth.py``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TypeVar

import zmq

from runtime.auth import PLANE_ROLES, KeyPair, Role, RunKeys, client_key
from runtime.rundir import Endpoints, RunDir

PLANE_KINDS = {
    "rollout": zmq.DEALER,
    "trainer": zmq.DEALER,
    "control": zmq.DEALER,
    "telemetry": zmq.SUB,
}
"""The client's socket type on each of the controller's four sockets."""

SocketT = TypeVar("SocketT", bound=zmq.Socket)


def connect(
    ctx: zmq.Context[SocketT],
    endpoints: Endpoints,
    plane: str,
    role: Role,
    *,
    identity: bytes | None = None,
    linger_ms: int = 0,
    key: KeyPair | None = None,
) -> SocketT:
    """A socket of ``ctx`` (sync or asyncio) connected to the controller's ``plane`` socket,
    authenticated as ``role`` with ``key`` (default: see ``auth.client_key``). Raises
    ``auth.KeyUnavailable`` when no key can be read, ``ValueError`` for a role the plane
    refuses anyway."""
    if role not in PLANE_ROLES[plane]:
        allowed = ", ".join(sorted(PLANE_ROLES[plane]))
        raise ValueError(f"role {role.value} may not use the {plane} socket (allowed: {allowed})")
    if not endpoints.server_public_key:
        raise ValueError(
            f"the endpoints of run {endpoints.run_name!r} carry no server public key "
            "(written by an older controller?); restart the run"
        )
    pair = key or client_key(endpoints.keys_dir, role)
    if pair.secret is None:
        raise ValueError("a client key needs its secret half")
    sock = ctx.socket(PLANE_KINDS[plane])
    try:
        sock.setsockopt(zmq.LINGER, linger_ms)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        sock.curve_serverkey = endpoints.server_public_key.encode()
        sock.curve_publickey = pair.public
        sock.curve_secretkey = pair.secret
        sock.connect(getattr(endpoints, plane))
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def curve_server(sock: zmq.Socket, server: KeyPair, domain: str | None) -> None:
    """Make ``sock`` a CurveZMQ server. With a ``domain`` (the socket's name) every client must
    also pass the ZAP handler for it, and is refused while no handler answers; ``None`` is for
    test stand-ins only: encrypted, but any client that knows the server key gets in."""
    if server.secret is None:
        raise ValueError("the server key pair needs its secret half")
    sock.curve_secretkey = server.secret
    sock.curve_publickey = server.public
    sock.curve_server = True
    if domain is not None:
        sock.zap_domain = domain.encode()
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


def standin_server(sock: zmq.Socket, keys_dir: Path) -> dict[str, str]:
    """For test and bench stand-ins of the controller: make ``sock`` a CurveZMQ server with the
    run's keys (no ZAP handler, so any client that knows the server key gets in) and return the
    ``Endpoints`` fields that let the real clients connect to it."""
    server = RunKeys(keys_dir).ensure().server()
    curve_server(sock, server, domain=None)
    return {"server_public_key": server.public_text, "keys_dir": str(keys_dir)}


def bind_standin(
    sock: zmq.Socket, run_dir: RunDir, run_name: str, controller_pid: int | None = None
) -> str:
    """A test or bench stand-in of the controller in one ROUTER: ``standin_server``, bound to a
    free loopback port that serves every plane, written to the run's ``endpoints.json``.
    Returns the address."""
    keys = standin_server(sock, run_dir.keys)
    address = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
    run_dir.write_endpoints(
        Endpoints(
            rollout=address,
            trainer=address,
            telemetry=address,
            control=address,
            controller_pid=controller_pid or os.getpid(),
            run_name=run_name,
            started_at=time.time(),
            **keys,
        )
    )
    return address
