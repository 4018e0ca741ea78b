"""Logging set-up for every process of a run: one call at start-up, one line format."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(
    path: Path | None,
    *,
    tag: str = "",
    console: int | None = None,
    capture_output: bool = False,
) -> None:
    """Send this process's log records at INFO and above to ``path`` (its directory is created)
    or, with None, to stderr; handlers set up earlier are replaced.

    ``tag`` goes into every line (the trainer's ``rank1``). ``console`` also copies records at that
    level and above to stderr, for whoever watches the terminal. ``capture_output`` points file
    descriptors 1 and 2 at ``path`` too, so the output of native code and of child processes
    (vLLM's engine core) lands in the same file.
    """
    line = FORMAT.replace("%(name)s", f"{tag} %(name)s") if tag else FORMAT
    handlers: list[logging.Handler] = []
    if path is None:
        handlers.append(logging.StreamHandler(sys.stderr))
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        if capture_output:
            _redirect_output(path)
            handlers.append(logging.StreamHandler(sys.stderr))  # now the file
        else:
            handlers.append(logging.FileHandler(path))
        if console is not None:
            to_console = logging.StreamHandler(sys.__stderr__)
            to_console.setLevel(console)
            handlers.append(to_console)
    for handler in handlers:
        handler.setFormatter(logging.Formatter(line))
    logging.basicConfig(level=logging.INFO, handlers=handlers, force=True)


def _redirect_output(path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for target in (1, 2):
        os.dup2(fd, target)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (lives with the process)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
