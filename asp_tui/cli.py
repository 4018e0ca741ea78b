"""The ``asp-tui`` command line.

    asp-tui --config run.yaml            start the run detached and attach the dashboard
    asp-tui run --headless --config F    run in the foreground, one line per step
    asp-tui attach RUN_DIR [--readonly] [--once]
    asp-tui stop RUN_DIR
    asp-tui keys new|show|add|list ...     key pairs and who may connect to a run
    asp-tui export RUN_DIR [--version N] OUT_DIR   a kept weight version as a HF model directory
    asp-tui plan ... / asp-tui simulate ...   offline scheduling (no processes started)

Bad input (a config field, a file, a flag) is reported with what was wrong and exits 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from runtime.config import Config, ConfigError, load_config

EXIT_USAGE = 2


def _add_config_arguments(parser: argparse.ArgumentParser, required: bool) -> None:
    parser.add_argument("--config", required=required, help="run.yaml (see configs/)")
    parser.add_argument("--run-dir", help="run directory (default: runs/<run.name>)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config field, e.g. --set trainer.steps=30 (repeatable)",
    )


def _render_hz(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of Hz") from None
    if not 0.5 <= value <= 60.0:
        raise argparse.ArgumentTypeError(f"{value:g} is outside 0.5..60 Hz")
    return value


def _add_key_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--key",
        metavar="FILE",
        help="your secret key file (default: the run's own key when you own the run, else "
        "the one from `asp-tui keys new`)",
    )


def _add_render_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--render-hz",
        type=_render_hz,
        metavar="HZ",
        help="dashboard redraws per second, 0.5..60 (default: the run's telemetry.hz, "
        "at least 10); lower it on a busy head node",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asp-tui",
        description="Asynchronous RL training with the Adaptive Scheduling Pipeline, "
        "watched and steered live from the terminal.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    start = commands.add_parser("start", help="start a run detached and attach the dashboard")
    _add_config_arguments(start, required=True)
    start.add_argument("--readonly", action="store_true", help="attach without any command")
    _add_render_argument(start)
    start.set_defaults(func=_cmd_start)

    run = commands.add_parser("run", help="run in the foreground")
    _add_config_arguments(run, required=True)
    run.add_argument("--headless", action="store_true", help="no dashboard: progress lines")
    run.set_defaults(func=_cmd_run)

    attach = commands.add_parser("attach", help="attach the dashboard to a live run")
    attach.add_argument("target", help="run directory or endpoints.json")
    attach.add_argument("--readonly", action="store_true", help="disable every command")
    attach.add_argument("--once", action="store_true", help="print one snapshot and exit")
    _add_render_argument(attach)
    _add_key_argument(attach)
    attach.set_defaults(func=_cmd_attach)

    stop = commands.add_parser("stop", help="stop a live run cleanly")
    stop.add_argument("target", help="run directory or endpoints.json")
    stop.add_argument("--timeout", type=float, default=120.0, help="seconds to wait")
    _add_key_argument(stop)
    stop.set_defaults(func=_cmd_stop)

    from asp_tui.keys import add_keys_parser

    add_keys_parser(commands)
    export = commands.add_parser(
        "export", help="write a kept weight version as a Hugging Face model directory"
    )
    export.add_argument("run_dir", metavar="RUN_DIR", help="the run's directory")
    export.add_argument("out_dir", metavar="OUT_DIR", help="where the model directory goes")
    export.add_argument(
        "--version", type=int, help="weight version to export (default: the newest kept)"
    )
    export.set_defaults(func=_cmd_export)

    from runtime.scheduler.cli import add_plan_parser, add_simulate_parser

    add_plan_parser(commands)
    add_simulate_parser(commands)
    return parser


def _config_from(args: argparse.Namespace) -> Config:
    return load_config(args.config, args.overrides, run_dir=args.run_dir)


def _cmd_start(args: argparse.Namespace) -> int:
    config = _config_from(args)
    if not sys.stdout.isatty():
        print("asp-tui: no terminal for the dashboard; running headless", file=sys.stderr)
        from asp_tui.headless import run_headless

        return run_headless(config)
    from asp_tui.detached import start_and_attach

    return start_and_attach(config, readonly=args.readonly, render_hz=args.render_hz)


def _cmd_run(args: argparse.Namespace) -> int:
    config = _config_from(args)
    if not args.headless and sys.stdout.isatty():
        from asp_tui.detached import start_and_attach

        return start_and_attach(config, readonly=False)
    from asp_tui.headless import run_headless

    return run_headless(config)


def _cmd_attach(args: argparse.Namespace) -> int:
    from asp_tui.attach import attach, print_once

    if args.once:
        return print_once(args.target, key_file=args.key)
    return attach(args.target, readonly=args.readonly, render_hz=args.render_hz, key_file=args.key)


def _cmd_stop(args: argparse.Namespace) -> int:
    from asp_tui.attach import stop_run

    return stop_run(args.target, timeout=args.timeout, key_file=args.key)


def _cmd_export(args: argparse.Namespace) -> int:
    from runtime.export import export_version

    out = export_version(args.run_dir, args.out_dir, args.version)
    print(f"exported to {out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    known = {"start", "run", "attach", "stop", "keys", "export", "plan", "simulate"}
    if argv and argv[0] not in known and argv[0] not in ("-h", "--help"):
        argv = ["start", *argv]
    if not argv:
        parser.print_help()
        return EXIT_USAGE
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"asp-tui: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
