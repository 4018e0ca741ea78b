"""Two Unix users on one head node: the run's owner (root here) and a neighbour created for the
test. The neighbour can read ``endpoints.json`` (addresses and the server's public key) and can
reach every port, loopback or not, yet every attempt on a live sim run is refused, counted and
logged, and the run's records show no trace of it; once the owner adds the neighbour's public
key (``asp-tui keys add``) as viewer, then as operator, exactly that role's rights follow.

It needs root (``useradd``, ``setpriv``); the user is deleted even when the test fails.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from asp_tui.cli import main as cli_main
from runtime.config import load_config
from runtime.controller.client import (
    ControlClient,
    SpawnedController,
    TelemetrySubscriber,
    write_run_config,
)
from runtime.rundir import RunDir, read_jsonl

REPO = Path(__file__).resolve().parents[1]
INTRUDER = REPO / "tests" / "intruder.py"
FAKE_REWARD = 1000.0
"""The reward ``intruder.py`` puts in its fabricated groups; no real reward is this large."""

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not (shutil.which("useradd") and shutil.which("setpriv")),
    reason="needs root with useradd and setpriv, to create a second Unix user",
)


class OtherUser:
    """A throwaway local user with a private scratch home, and a way to run Python as it."""

    def __init__(self, name: str, home: Path) -> None:
        self.name = name
        self.home = home
        self.python = ""
        self.pythonpath = ""

    def setpriv(self) -> list[str]:
        return ["setpriv", "--reuid", self.name, "--regid", self.name, "--init-groups", "--"]

    def run(self, *argv: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": str(self.home),
            "XDG_CONFIG_HOME": str(self.home),
            "PYTHONPATH": self.pythonpath,
            "LANG": "C.UTF-8",
        }
        return subprocess.run(
            [*self.setpriv(), self.python, *argv],
            env=env,
            cwd=self.home,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def find_python(self) -> None:
        """The test's interpreter if this user may run it, else the system one of the same
        version with this environment's packages (a venv's base interpreter may sit in a
        home directory other users cannot enter)."""
        site = sysconfig.get_paths()["purelib"]
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        for python, path in (
            (sys.executable, str(REPO)),
            (f"/usr/bin/python{version}", f"{REPO}:{site}"),
        ):
            self.python, self.pythonpath = python, path
            probe = self.run("-c", "import zmq, msgspec, numpy, runtime.auth", timeout=60)
            if probe.returncode == 0:
                return
        pytest.skip(f"no Python {version} with this project's packages that {self.name} can run")


@pytest.fixture
def other_user() -> Iterator[OtherUser]:
    name = f"asptui{uuid.uuid4().hex[:10]}"
    subprocess.run(
        [
            *("useradd", "--no-create-home", "--home-dir", "/nonexistent"),
            *("--shell", "/usr/sbin/nologin", "--user-group", name),
        ],
        check=True,
        capture_output=True,
    )
    home = Path(tempfile.mkdtemp(prefix=f"{name}-home-"))
    try:
        shutil.chown(home, name, name)
        user = OtherUser(name, home)
        user.find_python()
        yield user
    finally:
        shutil.rmtree(home, ignore_errors=True)
        subprocess.run(["userdel", "--force", name], capture_output=True)
        gone = subprocess.run(["getent", "passwd", name], capture_output=True)
        assert gone.returncode != 0, f"user {name} was not deleted"


@pytest.fixture
def shared_run_dir() -> Iterator[Path]:
    """A run directory that other users can look into, as ``runs/`` on a shared head node
    usually is (pytest's own tmp_path is private to root, which would prove nothing)."""
    base = Path(tempfile.mkdtemp(prefix="asp-security-"))
    base.chmod(0o755)
    try:
        yield base / "run"
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _make_run(run_dir: Path, host: str) -> None:
    overrides = [
        f"controller.host={host}",
        "rollout.instances=2",
        "rollout.max_num_seqs=16",
        "rollout.sampling.n=4",
        "rollout.sampling.max_tokens=1024",
        "rollout.sim.time_scale=60",
        "task.num_prompts=64",
        "trainer.batch_groups=4",
        "trainer.steps=100000",  # the owner stops it
        "telemetry.hz=10",
    ]
    config = load_config(REPO / "configs" / "sim-8.yaml", overrides, run_dir=run_dir)
    write_run_config(run_dir, config)
    run_dir.chmod(0o755)


def _attack(user: OtherUser, run_dir: Path, key: Path) -> dict[str, str]:
    done = user.run(str(INTRUDER), str(run_dir), str(key))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
async def test_another_user_is_refused_until_the_owner_adds_their_key(
    other_user: OtherUser, shared_run_dir: Path, host: str
) -> None:
    run_dir = shared_run_dir
    _make_run(run_dir, host)
    rd = RunDir(run_dir)
    made = other_user.run("-m", "asp_tui.cli", "keys", "new", "--out", str(other_user.home / "me"))
    assert made.returncode == 0, made.stderr
    public_key = made.stdout.strip()
    key = other_user.home / "me.key_secret"

    async with SpawnedController(run_dir) as ctl:
        endpoints = ctl.endpoints
        assert oct(rd.keys.stat().st_mode & 0o777) == "0o700"
        assert all(f.stat().st_mode & 0o077 == 0 for f in rd.keys.glob("*.key_secret"))
        assert "secret" not in rd.endpoints.read_text()
        async with (
            ControlClient(endpoints, timeout_s=10) as owner,
            TelemetrySubscriber(endpoints) as telemetry,
        ):
            before = await telemetry.wait_for(lambda s: s.step >= 2, timeout=60)

            # 1. A stranger's key, and the run's own keys out of reach.
            seen = _attack(other_user, run_dir, key)
            assert seen["uid"] != "0"
            assert seen["operator_secret"] == "unreadable"
            assert seen["default_key"].startswith("no-key:"), seen["default_key"]
            for attempt in ("status", "pause", "set_lag_bound", "worker", "telemetry", "stop"):
                assert seen[attempt] == "refused", (attempt, seen[attempt])
            # Snapshots are published at telemetry.hz: wait for one taken after the attempts.
            after = await telemetry.wait_for(
                lambda s: (
                    s.auth_refused.get("control", 0) >= 4  # status, pause, set-lag, stop
                    and s.auth_refused.get("rollout", 0) >= 1
                    and s.auth_refused.get("telemetry", 0) >= 1
                ),
                timeout=10,
            )
            assert after.state == "running" and after.lag_bound == before.lag_bound
            assert not [r for r in after.instances if r.state == "paused"]
            await telemetry.wait_for(lambda s: s.step >= after.step + 2, timeout=60)

            # 2. Authorized as a viewer: it may look, not act.
            assert cli_main(["keys", "add", str(run_dir), "--role", "viewer", public_key]) == 0
            seen = _attack(other_user, run_dir, key)
            assert seen["status"] == "ok" and seen["telemetry"] == "ok"
            for attempt in ("pause", "set_lag_bound", "stop"):
                assert seen[attempt].startswith("denied: role viewer may not send"), seen
            assert seen["worker"] == "refused"
            status = await telemetry.wait_for(
                lambda s: s.auth_refused["control"] >= after.auth_refused["control"] + 3,
                timeout=10,
            )
            assert status.state == "running" and status.lag_bound == before.lag_bound
            assert not [r for r in status.instances if r.state == "paused"]
            assert (await owner.status()).step >= before.step  # the owner's key still works

            # 3. Authorized as an operator: the same client now steers the run, and stops it.
            assert cli_main(["keys", "add", str(run_dir), "--role", "operator", public_key]) == 0
            seen = _attack(other_user, run_dir, key)
            for attempt in ("status", "pause", "set_lag_bound", "telemetry", "stop"):
                assert seen[attempt] == "ok", (attempt, seen)
            assert seen["worker"] == "refused"  # an operator's key is no worker's key
        assert await ctl.wait(120) == 0

    records = read_jsonl(rd.metrics)
    commands = [r for r in records if r.get("event") == "command" and r["name"] != "status"]
    # Only phase 3's commands took effect; phase 2's were refused before reaching a handler.
    assert [(c["name"], c["ok"]) for c in commands] == [
        ("pause_instance", True),
        ("set_lag_bound", True),
        ("stop", True),
    ]
    steps = [r for r in records if r.get("event") == "step"]
    assert steps and all(r.get("reward_mean_rollout", 0.0) < FAKE_REWARD for r in steps)
    auth = [r for r in records if r.get("event") == "auth"]
    assert {r["socket"] for r in auth} >= {"control", "rollout", "telemetry"}
    assert any(r["reason"] == "unknown client key" for r in auth)
    log = rd.log_file("controller").read_text()
    assert "refused unknown client" in log
