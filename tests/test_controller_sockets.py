"""Socket set-up: free ports, endpoints, and CurveZMQ for non-loopback binds."""

from __future__ import annotations

import zmq
import zmq.asyncio

from runtime.controller.sockets import apply_client_curve, bind_sockets, is_loopback
from runtime.rundir import RunDir


def test_loopback_detection():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")


async def test_loopback_binds_without_keys(tmp_path):
    ctx = zmq.asyncio.Context()
    rd = RunDir(tmp_path).create()
    sockets = bind_sockets(ctx, "127.0.0.1", 0, rd)
    try:
        assert sockets.public_key is None
        ports = {a.rsplit(":", 1)[1] for a in sockets.addresses.values()}
        assert len(ports) == 4
        assert not rd.keys.exists()
    finally:
        sockets.close()
        ctx.term()


async def test_wildcard_bind_requires_curve(tmp_path):
    """A non-loopback bind is a CurveZMQ server: a client with the public key talks, and the
    key files land in keys/ (secret mode 0600)."""
    ctx = zmq.asyncio.Context()
    rd = RunDir(tmp_path).create()
    sockets = bind_sockets(ctx, "0.0.0.0", 0, rd)
    try:
        assert sockets.public_key
        assert (rd.keys / "server.key_secret").stat().st_mode & 0o777 == 0o600
        port = sockets.addresses["control"].rsplit(":", 1)[1]
        good = ctx.socket(zmq.DEALER)
        apply_client_curve(good, sockets.public_key)
        good.connect(f"tcp://127.0.0.1:{port}")
        plain = ctx.socket(zmq.DEALER)
        plain.connect(f"tcp://127.0.0.1:{port}")
        await plain.send(b"plaintext")
        await good.send(b"encrypted")
        frames = await sockets.control.recv_multipart()
        assert frames[-1] == b"encrypted"
        assert await sockets.control.poll(300) == 0  # the plaintext peer never got through
        good.close(0)
        plain.close(0)
    finally:
        sockets.close()
        ctx.term()
