"""A client run as another Unix user against a live run (``tests/test_security.py``).

    python tests/intruder.py RUN_DIR KEY_SECRET_FILE

It tries what a curious or hostile neighbour on a shared head node would, with the project's
own client code: read the run's secret keys, connect with the default key lookup, then with its
own key (``KEY_SECRET_FILE``) send stop, pause and set-lag-bound, pose as a rollout worker that
hands in a fabricated ``GroupDone``, and subscribe to telemetry. It prints one JSON object: for
each attempt ``refused`` (no answer at all), ``denied: <reason>`` (answered ok=False), ``ok``,
``no-key: ...`` or ``read``/``unreadable``. The test decides what each should be.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import zmq

from runtime.auth import KeyUnavailable, Role, read_keypair
from runtime.controller.client import ControllerUnavailable, TelemetrySubscriber, send_command
from runtime.protocol import (
    Command,
    Completion,
    Encoder,
    GroupDone,
    PauseInstances,
    SetLagBound,
    StatusCmd,
    StopRun,
    WorkerHello,
)
from runtime.rundir import RunDir
from runtime.transport import connect

FAKE_REWARD = 1000.0
"""No real reward is this large: a step record that shows it means the fake group got in."""


def _command(endpoints, key, command: Command) -> str:
    try:
        reply = send_command(endpoints, command, timeout_s=3.0, key=key)
    except ControllerUnavailable:
        return "refused"
    return "ok" if reply.ok else f"denied: {reply.reason}"


def _fake_worker(endpoints, key) -> str:
    """Hello as instance 0, then a finished group with fabricated rewards; any answer at all
    (a Generate, a Shutdown) would mean the controller took us for a worker."""
    ctx = zmq.Context()
    sock = connect(ctx, endpoints, "rollout", Role.WORKER, identity=b"instance-0", key=key)
    try:
        encoder = Encoder()
        hello = WorkerHello(instance_id=0, max_num_seqs=32, weight_version=0, pid=1, backend="x")
        sock.send_multipart(encoder.encode(hello))
        completion = Completion(
            token_ids=np.arange(8, dtype=np.int32),
            logprobs=np.zeros(8, dtype=np.float32),
            version_min=0,
            version_max=0,
            finish_reason="stop",
            reward=FAKE_REWARD,
            finished_at=time.time(),
        )
        for group_id in range(4):
            done = GroupDone(
                group_id=group_id,
                prompt_id=group_id,
                instance_id=0,
                completions=[completion] * 8,
                started_at=time.time() - 1,
                finished_at=time.time(),
            )
            sock.send_multipart(encoder.encode(done))
        return "answered" if sock.poll(3000) else "refused"
    finally:
        sock.close(0)
        ctx.term()


async def _subscribe(endpoints, key) -> str:
    try:
        async with TelemetrySubscriber(endpoints, role=Role.VIEWER, key=key) as telemetry:
            await telemetry.receive(timeout_s=3.0)
    except TimeoutError:
        return "refused"
    return "ok"


def main(run_dir: str, key_file: str) -> int:
    rd = RunDir(run_dir)
    endpoints = rd.read_endpoints()  # world-readable: addresses and the server's public key
    out: dict[str, str] = {"uid": str(os.getuid())}
    try:
        (rd.keys / "operator.key_secret").read_bytes()
        out["operator_secret"] = "read"
    except PermissionError:
        out["operator_secret"] = "unreadable"
    try:
        out["default_key"] = _command(endpoints, None, StatusCmd())
    except KeyUnavailable as exc:
        out["default_key"] = f"no-key: {exc}"
    key = read_keypair(Path(key_file))
    out["status"] = _command(endpoints, key, StatusCmd())
    out["pause"] = _command(endpoints, key, PauseInstances(ids=[0]))
    out["set_lag_bound"] = _command(endpoints, key, SetLagBound(value=0))
    out["worker"] = _fake_worker(endpoints, key)
    out["telemetry"] = asyncio.run(_subscribe(endpoints, key))
    out["stop"] = _command(endpoints, key, StopRun())
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
