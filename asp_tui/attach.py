"""What ``asp-tui attach``, ``attach --once`` and ``asp-tui stop`` do, as plain functions.

``asp_tui/cli.py`` parses arguments and calls these; each returns the process exit code:
0 done, 1 the action did not complete in time, 2 bad target or unreachable controller.
``target`` is a run directory or an ``endpoints.json`` path.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path
from typing import TextIO

import msgspec

from asp_tui.format import once_text
from asp_tui.link import LinkError, LiveLink, read_endpoints, resolve_target
from runtime.auth import Role
from runtime.protocol import Snapshot, StatusCmd, StopRun

EXIT_OK, EXIT_INCOMPLETE, EXIT_BAD_TARGET = 0, 1, 2


def _error(command: str, text: str, stream: TextIO | None = None) -> int:
    print(f"asp-tui {command}: {text}", file=stream or sys.stderr)
    return EXIT_BAD_TARGET


def _link(target: str | Path, role: Role, key_file: str | None) -> LiveLink:
    return LiveLink(resolve_target(target), role=role, key_file=key_file)


def _run_settings(endpoints_path: Path) -> tuple[float, int]:
    """Render rate and the largest allowed lag bound, from the run's resolved config if any."""
    try:
        from runtime.config import read_run_config

        config = read_run_config(endpoints_path.parent)
    except Exception:
        return 10.0, 16
    return max(10.0, config.telemetry.hz), config.async_.max_lag_bound


def attach(
    target: str,
    readonly: bool = False,
    render_hz: float | None = None,
    key_file: str | None = None,
) -> int:
    """Open the dashboard on a live run (``readonly``: with a viewer key). Quitting detaches;
    the run keeps going."""
    from asp_tui.app import make_app

    try:
        link = _link(target, Role.VIEWER if readonly else Role.OPERATOR, key_file)
        # No key at all is a usage error, not a connection to retry forever.
        link.key(read_endpoints(link.endpoints_path).keys_dir)
    except (OSError, ValueError) as exc:
        return _error("attach", str(exc))
    default_hz, max_lag_bound = _run_settings(link.endpoints_path)
    app = make_app(
        link,
        readonly=readonly,
        render_hz=render_hz or default_hz,
        max_lag_bound=max_lag_bound,
        handle_hangup=True,
    )
    app.run()
    return app.return_code or EXIT_OK


async def fetch_status(link: LiveLink, timeout: float) -> Snapshot:
    """One ``status`` round trip; raises ``LinkError`` with what to do when it fails."""
    try:
        await link.open()
        reply = await link.request(StatusCmd(), timeout)
    except LinkError:
        raise  # already says where and why
    except (TimeoutError, OSError) as exc:
        raise LinkError(f"no answer from the controller at {link.label} ({exc})") from None
    finally:
        await link.close()
    if not reply.ok:
        raise LinkError(f"the controller refused status: {reply.reason}")
    return msgspec.convert(reply.data, Snapshot)


def print_once(
    target: str, timeout: float = 3.0, stream: TextIO | None = None, key_file: str | None = None
) -> int:
    """Print a plain-text snapshot of the run (a viewer's query) and exit 0; an unreachable run
    exits 2."""
    try:
        link = _link(target, Role.VIEWER, key_file)
    except (FileNotFoundError, ValueError) as exc:
        return _error("attach --once", str(exc))
    try:
        snapshot = asyncio.run(fetch_status(link, timeout))
    except LinkError as exc:
        run_dir = link.endpoints_path.parent
        pid = _controller_pid(link.endpoints_path)
        if pid is not None and not _pid_alive(pid):
            return _error(
                "attach --once",
                f"run {link.run_name} is not running (controller pid {pid} is gone); its "
                f"records are in {run_dir / 'metrics.jsonl'}",
            )
        return _error(
            "attach --once",
            f"{exc}. Is the run going? Check {run_dir / 'logs'}, or start it "
            "with `asp-tui --config FILE`.",
        )
    print(once_text(snapshot, endpoint=link.label), file=stream or sys.stdout)
    return EXIT_OK


def _controller_pid(endpoints_path: Path) -> int | None:
    try:
        return read_endpoints(endpoints_path).controller_pid
    except (FileNotFoundError, ValueError):
        return None


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (a child nobody reaped yet) has finished too.
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def stop_run(
    target: str, timeout: float = 60.0, stream: TextIO | None = None, key_file: str | None = None
) -> int:
    """Ask the controller to stop the run (an operator's command), then wait up to ``timeout`` s
    for it to exit."""
    try:
        endpoints_path = resolve_target(target)
        link = LiveLink(endpoints_path, role=Role.OPERATOR, key_file=key_file)
        pid = read_endpoints(endpoints_path).controller_pid
    except (FileNotFoundError, ValueError) as exc:
        return _error("stop", str(exc))
    out = stream or sys.stdout

    async def request_stop() -> None:
        try:
            await link.open()
            reply = await link.request(StopRun(), 5.0)
        except LinkError:
            raise
        except (TimeoutError, OSError) as exc:
            raise LinkError(f"no answer from the controller at {link.label} ({exc})") from None
        finally:
            await link.close()
        if not reply.ok:
            raise LinkError(f"the controller refused stop: {reply.reason}")

    try:
        asyncio.run(request_stop())
    except LinkError as exc:
        if not _pid_alive(pid):
            print(f"run {link.run_name} is not running (controller pid {pid} is gone)", file=out)
            return EXIT_OK
        return _error("stop", str(exc))
    print(f"stopping run {link.run_name} (controller pid {pid})…", file=out)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _pid_alive(pid):
            print(f"run {link.run_name} stopped", file=out)
            return EXIT_OK
        time.sleep(0.2)
    print(
        f"asp-tui stop: the controller (pid {pid}) is still running after {timeout:.0f}s; "
        f"see {endpoints_path.parent / 'logs' / 'controller.log'}",
        file=sys.stderr,
    )
    return EXIT_INCOMPLETE
