"""The controller: one process per run (DESIGN.md §2).

``run_controller(run_dir)`` is the blocking entry point the launcher calls;
``python -m runtime.controller --run-dir D`` is the same as a process. The run directory must
hold the resolved ``config.yaml``. See ``core.py`` for the decisions, ``process.py`` for the
sockets and children, ``governor.py`` for the lag rules, ``ledger.py`` for the group ledger
and ``client.py`` for talking to a running controller.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

__all__ = ["run_controller"]


def run_controller(run_dir: str | Path, *, spawn: bool = True, log_to_file: bool = True) -> int:
    """Run the controller of ``run_dir`` until the run finishes or is stopped; the exit code.

    It binds its sockets, writes ``endpoints.json``, spawns the workers (or the sim backend) and
    the trainer, and returns 0 after a clean stop (trainer.steps reached, ``stop`` command,
    SIGINT/SIGTERM), 1 if the run failed. Every child is gone when it returns. ``spawn=False``
    supervises nothing: workers and trainer are started by someone else (tests, SLURM).
    """
    from runtime.controller.process import ControllerProcess
    from runtime.rundir import RunDir

    handler = None
    if log_to_file:
        path = RunDir(run_dir).create().log_file("controller")
        handler = logging.FileHandler(path)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root = logging.getLogger()
        root.addHandler(handler)
        if root.level > logging.INFO or root.level == logging.NOTSET:
            root.setLevel(logging.INFO)
    try:
        return asyncio.run(ControllerProcess(run_dir, spawn=spawn).run())
    finally:
        if handler is not None:
            logging.getLogger().removeHandler(handler)
            handler.close()
