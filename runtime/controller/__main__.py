"""``python -m runtime.controller --run-dir D [--no-spawn]``."""

from __future__ import annotations

import argparse
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
    from runtime.controller import run_controller

    try:
        return run_controller(args.run_dir, spawn=not args.no_spawn)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except FileNotFoundError as exc:
        print(f"error: --run-dir: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
