"""Starting a run: prepare its directory, start the controller, follow it.

The controller is always its own session leader, so closing the terminal (or a Ctrl-C meant for
the dashboard or the headless follower) never reaches it: stopping is an explicit request.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from runtime.config import Config
from runtime.rundir import Endpoints, RunDir

CACHE_ENV = "ASP_TUI_CACHE"


class RunAlreadyLive(RuntimeError):
    """A controller is already running in this run directory."""


def live_endpoints(run_dir: RunDir) -> Endpoints | None:
    """The endpoints of the controller running in ``run_dir``, or None if none is alive."""
    try:
        endpoints = run_dir.read_endpoints()
    except (FileNotFoundError, ValueError):
        return None
    try:
        process = psutil.Process(endpoints.controller_pid)
        alive = process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return None
    return endpoints if alive and endpoints.started_at <= time.time() else None


def prepare_run(config: Config) -> RunDir:
    """Check the task, then create the run directory and write the resolved config every
    process reads. A bad task (dataset, reward function) raises ConfigError before anything
    is created or started."""
    from runtime.tasks import preflight

    config = preflight(config)
    run_dir = RunDir(config.run_dir).create()
    if live_endpoints(run_dir) is not None:
        raise RunAlreadyLive(f"a run is already live in {run_dir.root}")
    run_dir.config.write_text(config.to_yaml())
    return run_dir


def child_env() -> dict[str, str]:
    """Environment for run processes: one absolute model cache for all of them."""
    env = dict(os.environ)
    env.setdefault(CACHE_ENV, str(Path("runs/.cache").resolve()))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def prepare_model(config: Config) -> str:
    """Build (or find cached) model weights once, before any worker starts and races for them."""
    from runtime.tasks import ensure_model

    os.environ.setdefault(CACHE_ENV, str(Path("runs/.cache").resolve()))
    return ensure_model(config)


def spawn_controller(
    run_dir: RunDir | str | Path, *, spawn: bool = True, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start ``python -m runtime.controller`` on ``run_dir`` (which holds ``config.yaml``): the one
    way a run's controller is started. It leads its own session, detached from this terminal, and
    its output goes to its log file. ``spawn=False`` supervises no workers or trainer (they are
    started elsewhere); ``env`` adds to ``child_env()``."""
    rd = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    argv = [sys.executable, "-m", "runtime.controller", "--run-dir", str(rd.root)]
    if not spawn:
        argv.append("--no-spawn")
    log = rd.log_file("controller")
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as output:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**child_env(), **(env or {})},
        )


def controller_ready(run_dir: RunDir, process: subprocess.Popen[bytes]) -> Endpoints | None:
    """The endpoints of ``process`` once it has bound its sockets, else None; ``RuntimeError``
    if it exited first."""
    endpoints = live_endpoints(run_dir)
    if endpoints is not None and endpoints.controller_pid == process.pid:
        return endpoints
    if process.poll() is not None:
        raise RuntimeError(
            f"the controller exited with code {process.returncode} before it was ready; "
            f"see {run_dir.log_file('controller')}"
        )
    return None


def wait_for_controller(
    run_dir: RunDir,
    process: subprocess.Popen[bytes],
    timeout_s: float = 120.0,
    on_wait: Callable[[float], None] | None = None,
) -> Endpoints:
    """Block until the controller has bound its sockets (``RuntimeError`` if it died,
    ``TimeoutError`` after ``timeout_s``). ``SpawnedController.wait_ready`` is the asyncio
    version."""
    started = time.monotonic()
    while (endpoints := controller_ready(run_dir, process)) is None:
        elapsed = time.monotonic() - started
        if elapsed > timeout_s:
            raise TimeoutError(f"the controller was not ready after {timeout_s:.0f} s")
        if on_wait is not None:
            on_wait(elapsed)
        time.sleep(0.2)
    return endpoints


def request_stop(process: subprocess.Popen[bytes]) -> None:
    """Ask the controller to stop cleanly (it handles SIGTERM like the ``stop`` command)."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
