"""Child processes of the controller: rollout workers (or the sim backend) and the trainer.

Each child runs in its own session and process group, logs to ``RunDir.log_file(name)``, and dies
with the controller: stopping kills its whole group (SIGTERM, then SIGKILL after a grace period),
an ``atexit`` hook does the same if the controller leaves by an exception, and on Linux the kernel
sends the child SIGTERM if the controller itself is killed (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from runtime.lifetime import die_with_parent
from runtime.resources import Share

log = logging.getLogger(__name__)


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    proc: asyncio.subprocess.Process | None = None
    started_at: float = 0.0
    exit_code: int | None = None
    stopping: bool = False
    watcher: asyncio.Task | None = field(default=None, repr=False)
    stdin: asyncio.StreamWriter | None = field(default=None, repr=False)
    """Held open for the child's life when it was given input (see ``spawn``)."""

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None


class Supervisor:
    """Spawns, watches and stops children. ``on_exit(name, returncode)`` is called (in the event
    loop) when a child exits that was not being stopped by us."""

    def __init__(
        self,
        on_exit: Callable[[str, int], None],
        *,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.on_exit = on_exit
        self.cwd = cwd
        self.env = env
        self.children: dict[str, Child] = {}
        atexit.register(self.kill_all_now)

    async def spawn(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        share: Share | None = None,
        stdin: bytes | None = None,
    ) -> Child:
        """Start ``argv`` as child ``name``; ``share`` (from the resource plan) sets its threads
        and, if it has cores of its own, its CPU affinity. ``stdin`` is written to the child's
        standard input, which then stays open until the child exits (a launcher's process on
        another host ends its command when it sees that input close)."""
        old = self.children.get(name)
        if old is not None and old.alive:
            raise RuntimeError(f"child {name} is still running (pid {old.pid})")
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as logf:
            logf.write(f"\n=== {time.strftime('%F %T')} start: {' '.join(argv)}\n".encode())
            logf.flush()
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL if stdin is None else asyncio.subprocess.PIPE,
                stdout=logf,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_child_setup(share),  # runs in the child between fork and exec
                cwd=self.cwd,
                env=_with_share(self.env, share),
            )
        child = Child(name, list(argv), log_path, proc, time.time(), stdin=proc.stdin)
        if proc.stdin is not None and stdin is not None:
            proc.stdin.write(stdin)
            with contextlib.suppress(ConnectionError):  # it died at once: the watcher says so
                await proc.stdin.drain()
        child.watcher = asyncio.create_task(self._watch(child), name=f"watch-{name}")
        self.children[name] = child
        log.info("started %s (pid %d): %s", name, proc.pid, " ".join(argv))
        return child

    async def _watch(self, child: Child) -> None:
        assert child.proc is not None
        code = await child.proc.wait()
        child.exit_code = code
        if child.stdin is not None:
            child.stdin.close()
        # The leader is gone; make sure nothing of its group outlives it (vLLM engine cores).
        _killpg(child.proc.pid, signal.SIGKILL)
        log.info("%s (pid %d) exited with %s", child.name, child.proc.pid, code)
        if not child.stopping:
            self.on_exit(child.name, code)

    def alive(self, name: str) -> bool:
        child = self.children.get(name)
        return child is not None and child.alive

    async def stop(self, name: str, grace_s: float = 10.0) -> int | None:
        """SIGTERM the child's group, SIGKILL after ``grace_s``; returns its exit code."""
        child = self.children.get(name)
        if child is None or child.proc is None:
            return None
        child.stopping = True
        if child.alive:
            _killpg(child.proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(child.proc.wait(), grace_s)
            except TimeoutError:
                log.warning("%s did not exit in %.0fs; killing", name, grace_s)
                _killpg(child.proc.pid, signal.SIGKILL)
                await child.proc.wait()
        if child.watcher is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await child.watcher
        return child.proc.returncode

    def kill(self, name: str) -> None:
        """SIGKILL a child's group now; its exit is reported through ``on_exit``."""
        child = self.children.get(name)
        if child is not None and child.alive and child.proc is not None:
            _killpg(child.proc.pid, signal.SIGKILL)

    async def wait_exit(self, name: str, timeout_s: float) -> bool:
        child = self.children.get(name)
        if child is None or child.proc is None:
            return True
        try:
            await asyncio.wait_for(asyncio.shield(child.proc.wait()), timeout_s)
            return True
        except TimeoutError:
            return False

    async def stop_all(self, grace_s: float = 10.0) -> None:
        await asyncio.gather(*(self.stop(n, grace_s) for n in list(self.children)))

    def kill_all_now(self) -> None:
        """Synchronous last resort: SIGKILL every child group still alive."""
        for child in self.children.values():
            if child.proc is not None and child.proc.returncode is None:
                child.stopping = True
                _killpg(child.proc.pid, signal.SIGKILL)

    def close(self) -> None:
        self.kill_all_now()
        atexit.unregister(self.kill_all_now)


def _with_share(env: dict[str, str] | None, share: Share | None) -> dict[str, str] | None:
    if share is None:
        return env
    return {**(env if env is not None else os.environ), **share.env()}


def _child_setup(share: Share | None) -> Callable[[], None]:
    cpus = share.cpus if share is not None else None

    def setup() -> None:
        die_with_parent()
        if cpus:
            os.sched_setaffinity(0, cpus)

    return setup


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
