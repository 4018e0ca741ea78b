"""Process lifetime (runtime/lifetime.py): a spawned engine process does not outlive the worker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]

# A parent that starts a child whose main thread ignores SIGTERM (as one blocked in C would) and
# relies on exit_when_orphaned alone; the parent prints the child's pid and waits to be killed.
PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", '''
import signal, time
from runtime.lifetime import exit_when_orphaned
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
exit_when_orphaned(grace_s=0.5, poll_s=0.1)
print("armed", flush=True)
time.sleep(600)
'''], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "armed"
print(child.pid, flush=True)
time.sleep(600)
"""


def test_a_child_stuck_past_its_sigterm_still_exits_once_orphaned() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, env=env
    )
    child: psutil.Process | None = None
    try:
        child = psutil.Process(int(parent.stdout.readline()))
        time.sleep(0.5)
        assert child.is_running()  # the watch keeps still while the parent lives
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 15
        while child.is_running() and child.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the orphan kept running"
            time.sleep(0.1)
    finally:
        parent.kill()
        parent.wait(10)
        if child is not None and child.is_running():
            child.kill()  # never leak it into the rest of the suite
