"""Processes on other hosts: what they are sent to join a run, and the entry point that takes it.

A worker or trainer on another host cannot read the run directory's ``keys/`` (0700 on the head
node) and must not find its secret in a file or on a command line (``ps`` shows those to every
user there). So the controller sends one JSON line, the ``Bootstrap`` (the resolved config, the
endpoints with the server's public key, and the role's key pair), on the launcher's stdin (ssh,
srun and ``ip netns exec`` all forward it), to::

    python -m runtime.remote -- python -m runtime.rollout.worker --run-dir D --instance-id 3

which reads the line, starts the command with it in ``$ASP_TUI_BOOTSTRAP`` (an environment is
readable by its owner and root only, and torchrun passes it on to every rank), and keeps
reading stdin: when stdin closes (the controller stopped or lost the launcher, or ssh lost the
host), the command's process group is ended. The worker and the trainer get what they need
through ``run_context``, from the bootstrap when there is one, else from the run directory.

``python -m runtime.remote --fanout JSON`` runs, on the head node, one launcher command per host
(JSON: a list of argvs), gives each the bootstrap line and ends them all when one ends; the
controller uses it for a trainer on several hosts through ssh or a ``command`` launcher.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

from runtime.auth import KeyPair, Role
from runtime.config import Config, ConfigError, config_from_yaml, read_run_config
from runtime.lifetime import die_with_parent
from runtime.logs import setup_logging
from runtime.rundir import Endpoints, RunDir

log = logging.getLogger(__name__)

BOOTSTRAP_ENV = "ASP_TUI_BOOTSTRAP"


class Bootstrap(msgspec.Struct, kw_only=True):
    """All that a process on another host needs to join a run."""

    config: str
    """The resolved config as YAML (``Config.to_yaml``)."""
    endpoints: Endpoints
    role: str
    public_key: str
    secret_key: str


def encode_bootstrap(config: Config, endpoints: Endpoints, role: Role, key: KeyPair) -> bytes:
    """The bootstrap line for a process of ``role``; it carries a secret: never log it."""
    if key.secret is None:
        raise ValueError(f"the {role.value} key pair has no secret half")
    boot = Bootstrap(
        config=config.to_yaml(),
        # keys_dir names the head node's directory, which means nothing there.
        endpoints=msgspec.structs.replace(endpoints, keys_dir=""),
        role=role.value,
        public_key=key.public_text,
        secret_key=key.secret.decode("ascii"),
    )
    return msgspec.json.encode(boot) + b"\n"


@dataclass(frozen=True)
class RunContext:
    """What a worker or trainer process reads at start: the config, where the controller is,
    and the key to connect with (None: the run's own key file for the role, on this host)."""

    config: Config
    endpoints: Endpoints
    key: KeyPair | None
    launched: bool
    """Started through a launcher (logs go to stdout, which the launcher carries back)."""


def launched() -> bool:
    """Whether this process was started through a launcher, with a bootstrap."""
    return bool(os.environ.get(BOOTSTRAP_ENV))


def run_context(run_dir: str | Path, role: Role) -> RunContext:
    """The bootstrap in ``$ASP_TUI_BOOTSTRAP`` if there is one, else ``run_dir``'s files.
    Raises ``ConfigError`` for an unreadable bootstrap or one meant for another role."""
    raw = os.environ.get(BOOTSTRAP_ENV)
    if not raw:
        rd = RunDir(run_dir)
        return RunContext(read_run_config(rd.root), rd.read_endpoints(), None, launched=False)
    try:
        boot = msgspec.json.decode(raw, type=Bootstrap)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ConfigError(
            f"${BOOTSTRAP_ENV}: not a bootstrap from the controller ({exc})"
        ) from None
    if boot.role != role.value:
        raise ConfigError(
            f"${BOOTSTRAP_ENV}: sent for a {boot.role} process, but this is a {role.value}"
        )
    config = config_from_yaml(boot.config, "the config sent by the controller")
    key = KeyPair(boot.public_key.encode("ascii"), boot.secret_key.encode("ascii"))
    return RunContext(config, boot.endpoints, key, launched=True)


# --- the entry point on the far side of a launcher ------------------------------------------------


def _serve(commands: Sequence[Sequence[str]], line: bytes, *, via_env: bool, grace_s: float) -> int:
    """Run ``commands`` until one ends, stdin closes or a signal comes; then end the rest.
    ``via_env``: the bootstrap goes into their environment, else onto their stdin."""
    env = dict(os.environ)
    if via_env:
        env[BOOTSTRAP_ENV] = line.decode("utf-8").strip()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())

    def watch_stdin() -> None:
        # os.read, not sys.stdin: a daemon thread blocked in a buffered read holds its lock,
        # and the interpreter aborts at exit when it cannot take it.
        with contextlib.suppress(OSError):
            while os.read(0, 65536):
                pass
        stop.set()

    threading.Thread(target=watch_stdin, name="stdin", daemon=True).start()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for argv in commands:
            proc = subprocess.Popen(
                list(argv),
                env=env,
                stdin=subprocess.DEVNULL if via_env else subprocess.PIPE,
                start_new_session=True,  # its own group: ending it ends what it started
                preexec_fn=die_with_parent,
            )
            procs.append(proc)
            if proc.stdin is not None:
                proc.stdin.write(line)
                proc.stdin.flush()  # and kept open: its close tells that launcher to stop
        first: subprocess.Popen[bytes] | None = None
        while first is None and not stop.is_set():
            first = next((p for p in procs if p.poll() is not None), None)
            stop.wait(0.2)
        if first is not None:
            log.info("%s exited with %s", first.args, first.returncode)
    finally:
        _end(procs, grace_s)
    if first is not None:
        return first.returncode if first.returncode >= 0 else 128 - first.returncode
    bad = [p.returncode for p in procs if p.returncode not in (0, None)]
    return 0 if not bad else (bad[0] if bad[0] > 0 else 128 - bad[0])


def _end(procs: list[subprocess.Popen[bytes]], grace_s: float) -> None:
    """SIGTERM every group (and close its stdin), SIGKILL what is left after ``grace_s``."""
    for proc in procs:
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        _killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        _killpg(proc.pid, signal.SIGKILL)  # whatever of its group outlived it, too
        proc.wait()


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _read_line(fd: int, limit: int = 1 << 22) -> bytes:
    """One line from ``fd``, read unbuffered so that nothing after it is taken from the pipe."""
    data = bytearray()
    while not data.endswith(b"\n") and len(data) < limit:
        byte = os.read(fd, 1)
        if not byte:
            break
        data += byte
    return bytes(data)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m runtime.remote",
        description="Run a worker or trainer command with the bootstrap read from stdin.",
    )
    parser.add_argument(
        "--fanout",
        metavar="JSON",
        help="a JSON list of launcher commands to run here, each given the bootstrap on stdin",
    )
    parser.add_argument("--grace-s", type=float, default=10.0)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    args = parser.parse_args(argv)
    setup_logging(None, tag="remote")
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.fanout is not None:
        try:
            commands = json.loads(args.fanout)
            assert isinstance(commands, list) and commands
            assert all(
                isinstance(c, list) and c and all(isinstance(a, str) for a in c) for c in commands
            )
        except (json.JSONDecodeError, AssertionError):
            print("--fanout: expected a JSON list of argv lists", file=sys.stderr)
            return 2
    elif command:
        commands = [command]
    else:
        print("give a command after --, or --fanout", file=sys.stderr)
        return 2
    line = _read_line(0)
    try:
        msgspec.json.decode(line, type=Bootstrap)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        print(f"stdin: no bootstrap line from the controller ({exc})", file=sys.stderr)
        return 2
    return _serve(commands, line, via_env=args.fanout is None, grace_s=args.grace_s)


if __name__ == "__main__":
    sys.exit(main())
