"""``python -m runtime.trainer --run-dir D`` (one process, or one rank under torchrun)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime.trainer", description=__doc__)
    parser.add_argument("--run-dir", required=True, help="run directory with config.yaml")
    args = parser.parse_args(argv)

    from runtime.config import ConfigError
    from runtime.trainer.loop import run

    try:
        return run(args.run_dir)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"trainer: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
