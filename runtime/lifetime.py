"""Process lifetime: children die with the process that started them (PR_SET_PDEATHSIG).

The controller arms it for the workers and trainer it supervises; the rollout worker arms it for
vLLM's engine processes, as follows. vLLM's ``AsyncLLM`` runs its engine core in a child process,
which on CPU starts the model worker as a grandchild. The engine core does not watch its parent: if
the rollout worker is SIGKILLed, it would keep running, holding memory and cores. Linux's
``PR_SET_PDEATHSIG`` asks the kernel to signal a process when its parent dies, so every process in
the chain arms it for itself:

- spawned children (vLLM's default on CPU) re-import the parent's main module as ``__mp_main__``
  before they run their target; ``runtime.rollout.worker`` calls ``die_with_parent`` there;
- forked children (vLLM's default on GPU hosts) run the ``os.register_at_fork`` hook that
  ``arm_forked_children`` installs.

A spawned child also starts ``exit_when_orphaned``: the SIGTERM runs Python's handler only when
the main thread gets back to Python, and a model worker blocked in C on its dead engine core
never does.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM, parent_pid: int | None = None) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent exits.

    SIGTERM lets vLLM's engine core run its own shutdown (it stops its workers, which also watch
    it through a pipe). Returns False where the call is unavailable (not Linux). If the parent is
    already gone (it died before the signal was armed: we were re-parented to ``parent_pid``'s
    successor, usually init), exits at once, since nothing would ever signal us.
    """
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    ppid = os.getppid()
    if ppid == 1 or (parent_pid is not None and ppid != parent_pid):
        os._exit(1)
    return True


def exit_when_orphaned(grace_s: float = 10.0, poll_s: float = 1.0) -> threading.Thread:
    """Exit this process ``grace_s`` after its parent is gone, from a daemon thread: the backstop
    to ``die_with_parent``'s SIGTERM for a main thread stuck where no handler runs. Not for a
    ``preexec_fn`` (no thread survives the exec)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        time.sleep(grace_s)  # the SIGTERM's own shutdown goes first
        os._exit(1)

    thread = threading.Thread(target=watch, name="exit-when-orphaned", daemon=True)
    thread.start()
    return thread


_forking_pid: list[int] = []


def arm_forked_children() -> None:
    """Make every child this process forks (``os.fork``) from now on die with it."""
    os.register_at_fork(
        before=lambda: _forking_pid.append(os.getpid()),
        after_in_parent=_forking_pid.clear,
        after_in_child=lambda: die_with_parent(
            parent_pid=_forking_pid.pop() if _forking_pid else None
        ),
    )
