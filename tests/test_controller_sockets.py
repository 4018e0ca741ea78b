"""Socket set-up and authentication, in-process: every bound socket is a CurveZMQ server and
the ZAP handler admits a client only with a key whose role may use that socket."""

from __future__ import annotations

import asyncio
import contextlib
import stat
from collections.abc import AsyncIterator

import pytest
import zmq
import zmq.asyncio

from runtime.auth import (
    KeyUnavailable,
    Refusal,
    Role,
    RunKeys,
    ZapHandler,
    client_key,
    may_command,
    parse_public_key,
    parse_role,
    write_keypair,
)
from runtime.controller.sockets import BoundSockets, bind_sockets
from runtime.rundir import Endpoints, RunDir
from runtime.transport import connect


class Served:
    """Bound sockets, their ZAP handler, and endpoints that point at them."""

    def __init__(self, ctx: zmq.asyncio.Context, rd: RunDir, host: str) -> None:
        self.keys = RunKeys(rd.keys).ensure()
        self.refusals: list[Refusal] = []
        self.zap = ZapHandler(ctx, self.keys, on_refused=lambda r, _n: self.refusals.append(r))
        self.sockets: BoundSockets = bind_sockets(ctx, host, 0, self.keys.server())
        loopback = {
            name: "tcp://127.0.0.1:" + address.rsplit(":", 1)[1]
            for name, address in self.sockets.addresses.items()
        }
        self.endpoints = Endpoints(
            **loopback,
            controller_pid=0,
            run_name="t",
            server_public_key=self.sockets.public_key,
            keys_dir=str(rd.keys),
        )


@contextlib.asynccontextmanager
async def served(
    tmp_path, host: str = "127.0.0.1"
) -> AsyncIterator[tuple[Served, zmq.asyncio.Context]]:
    ctx = zmq.asyncio.Context()
    rd = RunDir(tmp_path).create()
    srv = Served(ctx, rd, host)
    task = asyncio.create_task(srv.zap.serve())
    try:
        yield srv, ctx
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        srv.sockets.close()
        srv.zap.close()
        ctx.destroy(linger=0)


async def _gets_through(sock: zmq.asyncio.Socket, server: zmq.asyncio.Socket) -> str | None:
    """Send one frame; the ZAP User-Id (the client's public key) it arrived with, or None if it
    never arrived."""
    await sock.send(b"hello")
    if not await server.poll(1500):
        return None
    frames = await server.recv_multipart(copy=False)
    return frames[-1].get("User-Id")


def test_keys_dir_and_secret_files_are_private(tmp_path):
    keys = RunKeys(tmp_path / "keys").ensure()
    assert stat.S_IMODE(keys.dir.stat().st_mode) == 0o700
    for name in ("server", "operator", "viewer", "worker", "trainer"):
        assert stat.S_IMODE(keys.secret_file(name).stat().st_mode) == 0o600
    first = keys.role_key(Role.OPERATOR)
    assert RunKeys(keys.dir).ensure().role_key(Role.OPERATOR) == first  # kept, not remade
    keys.secret_file("viewer").chmod(0o644)  # it may have leaked: replaced
    viewer = keys.role_key(Role.VIEWER).public
    assert RunKeys(keys.dir).ensure().role_key(Role.VIEWER).public != viewer


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
async def test_each_role_gets_in_only_where_it_belongs(tmp_path, host):
    async with served(tmp_path, host) as (srv, ctx):
        ports = {a.rsplit(":", 1)[1] for a in srv.sockets.addresses.values()}
        assert len(ports) == 4
        for plane, role in (
            ("control", Role.OPERATOR),
            ("control", Role.VIEWER),
            ("rollout", Role.WORKER),
            ("trainer", Role.TRAINER),
        ):
            sock = connect(ctx, srv.endpoints, plane, role)
            user_id = await _gets_through(sock, getattr(srv.sockets, plane))
            assert user_id == srv.keys.role_key(role).public_text
            assert srv.zap.role_of(user_id) is role
            sock.close(0)
        # The right protocol, the server's public key, but a key of the wrong role.
        wrong = {
            "control": Role.WORKER,
            "rollout": Role.OPERATOR,
            "trainer": Role.WORKER,
        }
        for plane, role in wrong.items():
            sock = ctx.socket(zmq.DEALER)
            pair = srv.keys.role_key(role)
            sock.curve_serverkey = srv.sockets.public_key.encode()
            sock.curve_publickey, sock.curve_secretkey = pair.public, pair.secret
            sock.connect(getattr(srv.endpoints, plane))
            assert await _gets_through(sock, getattr(srv.sockets, plane)) is None
            sock.close(0)
        # An unknown key, and a plaintext client.
        stranger = write_keypair(tmp_path / "stranger")
        sock = connect(ctx, srv.endpoints, "control", Role.OPERATOR, key=stranger)
        assert await _gets_through(sock, srv.sockets.control) is None
        plain = ctx.socket(zmq.DEALER)
        plain.connect(srv.endpoints.control)
        assert await _gets_through(plain, srv.sockets.control) is None
        sock.close(0)
        plain.close(0)
        assert srv.zap.refused["control"] >= 2 and srv.zap.refused["rollout"] >= 1
        assert srv.zap.refused["trainer"] >= 1
        reasons = {(r.socket, r.reason) for r in srv.refusals}
        assert ("control", "unknown client key") in reasons
        assert ("rollout", "role operator may not use the rollout socket") in reasons


async def test_a_viewer_subscribes_and_a_stranger_hears_nothing(tmp_path):
    async with served(tmp_path) as (srv, ctx):
        viewer = connect(ctx, srv.endpoints, "telemetry", Role.VIEWER)
        viewer.subscribe(b"")
        stranger = connect(
            ctx, srv.endpoints, "telemetry", Role.VIEWER, key=write_keypair(tmp_path / "x")
        )
        stranger.subscribe(b"")
        for _ in range(30):  # PUB drops until a subscription is in: publish a while
            await srv.sockets.telemetry.send(b"snapshot")
            await asyncio.sleep(0.05)
        assert await viewer.poll(1000)
        assert not await stranger.poll(200)
        assert srv.zap.refused["telemetry"] >= 1
        viewer.close(0)
        stranger.close(0)


async def test_an_authorized_key_gets_in_without_a_restart(tmp_path):
    async with served(tmp_path) as (srv, ctx):
        mine = write_keypair(tmp_path / "mine")
        sock = connect(ctx, srv.endpoints, "control", Role.VIEWER, key=mine)
        assert await _gets_through(sock, srv.sockets.control) is None
        sock.close(0)
        srv.keys.authorize(mine.public_text, Role.VIEWER, name="alice")
        assert stat.S_IMODE(srv.keys.authorized_file.stat().st_mode) == 0o600
        sock = connect(ctx, srv.endpoints, "control", Role.VIEWER, key=mine)
        assert await _gets_through(sock, srv.sockets.control) == mine.public_text
        assert srv.zap.role_of(mine.public_text) is Role.VIEWER
        # Removed: its role is gone at once (the controller checks it on every command) and
        # its next connection is refused.
        assert srv.keys.revoke(mine.public_text) and not srv.keys.revoke(mine.public_text)
        assert srv.zap.role_of(mine.public_text) is None
        sock.close(0)
        sock = connect(ctx, srv.endpoints, "control", Role.VIEWER, key=mine)
        assert await _gets_through(sock, srv.sockets.control) is None
        sock.close(0)


def test_roles_commands_and_key_parsing(tmp_path):
    assert may_command("operator", "stop") and may_command("viewer", "status")
    assert not may_command("viewer", "stop") and not may_command("viewer", "set_lag_bound")
    assert not may_command("worker", "status") and not may_command("", "status")
    with pytest.raises(ValueError, match="operator, viewer, worker, trainer"):
        parse_role("admin")
    with pytest.raises(ValueError, match="40"):
        parse_public_key("short")
    with pytest.raises(ValueError, match="Z85"):
        parse_public_key("~" * 40)
    with pytest.raises(KeyUnavailable, match="asp-tui keys add RUN_DIR --role viewer"):
        client_key(tmp_path / "nowhere", Role.VIEWER, key_file=tmp_path / "missing")


async def test_no_zap_handler_means_nobody_gets_in(tmp_path):
    """Fail closed: a socket bound with its ZAP domain refuses even the run's own operator key
    while no handler answers (libzmq would otherwise accept every CURVE client)."""
    ctx = zmq.asyncio.Context()
    rd = RunDir(tmp_path).create()
    keys = RunKeys(rd.keys).ensure()
    sockets = bind_sockets(ctx, "127.0.0.1", 0, keys.server())
    try:
        endpoints = Endpoints(
            **sockets.addresses,
            controller_pid=0,
            run_name="t",
            server_public_key=sockets.public_key,
            keys_dir=str(rd.keys),
        )
        sock = connect(ctx, endpoints, "control", Role.OPERATOR)
        assert await _gets_through(sock, sockets.control) is None
        sock.close(0)
    finally:
        sockets.close()
        ctx.destroy(linger=0)


def test_key_lookup_order(tmp_path, monkeypatch):
    keys = RunKeys(tmp_path / "keys").ensure()
    mine = write_keypair(tmp_path / "mine")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    assert client_key(keys.dir, Role.OPERATOR) == keys.role_key(Role.OPERATOR)
    monkeypatch.setenv("ASP_TUI_KEY", str(tmp_path / "mine.key_secret"))
    assert client_key(keys.dir, Role.VIEWER) == mine
    # The run's own processes inherit the owner's environment: they keep the run's keys.
    assert client_key(keys.dir, Role.WORKER) == keys.role_key(Role.WORKER)
    other = write_keypair(tmp_path / "other")
    assert client_key(keys.dir, Role.OPERATOR, tmp_path / "other.key_secret") == other
    with pytest.raises(KeyUnavailable, match="a public key only"):
        client_key(keys.dir, Role.OPERATOR, tmp_path / "other.key")
