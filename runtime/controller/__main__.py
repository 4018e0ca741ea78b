"""``python -m runtime.controller --run-dir D [--no-spawn]``: the controller process.

It binds its sockets, writes ``endpoints.json``, spawns the workers (or the sim backend) and the
trainer, and exits 0 after a clean stop (trainer.steps reached, ``stop`` command, SIGINT or
SIGTERM), 1 if the run failed, 2 for a bad run directory or config. Every child is gone when it
exits. ``--no-spawn`` supervises nothing: workers and trainer are started by someone else (tests,
SLURM). Start it with ``runtime.launcher.spawn_controller``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from runtime.config import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime.controller", description=__doc__)
    parser.add_argument("--run-dir", required=True, help="run directory holding config.yaml")
    parser.add_argument(
        "--no-spawn",
        action="store_true",
        help="do not start workers or the trainer (they are started elsewhere)",
    )
    args = parser.parse_args(argv)
    from runtime.controller.process import ControllerProcess
    from runtime.logs import setup_logging
    from runtime.rundir import RunDir

    try:
        setup_logging(RunDir(args.run_dir).create().log_file("controller"))
        return asyncio.run(ControllerProcess(args.run_dir, spawn=not args.no_spawn).run())
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except FileNotFoundError as exc:
        print(f"error: --run-dir: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
