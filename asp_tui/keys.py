"""``asp-tui keys``: a person's own key pair, and authorizing other people's keys on a run.

    asp-tui keys new [--out BASE]                  make your key pair; prints the public key
    asp-tui keys show [FILE]                       print the public key of a key file
    asp-tui keys add RUN_DIR --role ROLE PUBKEY    let that key in, as ROLE (owner only)
    asp-tui keys remove RUN_DIR PUBKEY             take an authorized key's rights away
    asp-tui keys list RUN_DIR                      the run's role keys and the authorized ones

Only public keys travel: the run's owner adds yours, and you keep your secret. Every function
returns the exit code (2 for bad input, with what was wrong).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from runtime.auth import RunKeys, parse_public_key, parse_role, personal_key_file, read_keypair

EXIT_OK, EXIT_USAGE = 0, 2


def _error(text: str) -> int:
    print(f"asp-tui keys: {text}", file=sys.stderr)
    return EXIT_USAGE


def _base(path: Path) -> Path:
    """``x.key_secret`` or ``x.key`` -> ``x``."""
    for suffix in (".key_secret", ".key"):
        if path.name.endswith(suffix):
            return path.with_name(path.name[: -len(suffix)])
    return path


def new_key(out: str | None, force: bool) -> int:
    from runtime.auth import write_keypair

    base = _base(Path(out) if out else personal_key_file())
    secret = base.with_name(base.name + ".key_secret")
    if secret.exists() and not force:
        return _error(
            f"{secret} exists; pass --force to replace it (its old public key stops working)"
        )
    try:
        base.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        pair = write_keypair(base, comment="personal asp-tui key")
    except OSError as exc:
        return _error(f"cannot write {secret}: {exc.strerror or exc}")
    print(f"secret key: {secret} (mode 0600; keep it)", file=sys.stderr)
    print(
        f"public key (give this to a run's owner): {base.with_name(base.name + '.key')}",
        file=sys.stderr,
    )
    print(pair.public_text)
    return EXIT_OK


def show_key(path: str | None) -> int:
    file = Path(path) if path else personal_key_file()
    try:
        pair = read_keypair(file)
    except OSError as exc:
        hint = "" if path else " (make one with `asp-tui keys new`)"
        return _error(f"cannot read {file}: {exc.strerror or exc}{hint}")
    except ValueError as exc:
        return _error(str(exc))
    print(pair.public_text)
    return EXIT_OK


def _run_keys(run_dir: str) -> RunKeys | None:
    keys = RunKeys(Path(run_dir) / "keys")
    return keys if keys.dir.is_dir() else None


def add_key(run_dir: str, role_text: str, public: str, name: str) -> int:
    try:
        role = parse_role(role_text)
        if Path(public).is_file():
            public = read_keypair(Path(public)).public_text
        key = parse_public_key(public)
    except (ValueError, OSError) as exc:
        return _error(str(exc))
    keys = _run_keys(run_dir)
    if keys is None:
        return _error(f"{run_dir}: no keys/ here (not a run directory, or the run never started)")
    try:
        entry = keys.authorize(key, role, name)
    except PermissionError:
        return _error(f"cannot write {keys.authorized_file}: only the run's owner can add keys")
    except (OSError, ValueError) as exc:
        return _error(str(exc))
    print(f"authorized {entry.public_key} as {entry.role} on {run_dir} (takes effect at once)")
    return EXIT_OK


def remove_key(run_dir: str, public: str) -> int:
    keys = _run_keys(run_dir)
    if keys is None:
        return _error(f"{run_dir}: no keys/ here (not a run directory, or the run never started)")
    try:
        if Path(public).is_file():
            public = read_keypair(Path(public)).public_text
        removed = keys.revoke(public)
    except PermissionError:
        return _error(f"cannot write {keys.authorized_file}: only the run's owner can remove keys")
    except (OSError, ValueError) as exc:
        return _error(str(exc))
    if not removed:
        return _error(f"{public} is not among the keys authorized on {run_dir}")
    print(f"removed {public} from {run_dir} (its commands are refused at once)")
    return EXIT_OK


def list_keys(run_dir: str) -> int:
    keys = _run_keys(run_dir)
    if keys is None:
        return _error(f"{run_dir}: no keys/ here (not a run directory, or the run never started)")
    try:
        own = keys.own_roles()
        others = keys.authorized()
    except PermissionError:
        return _error(f"cannot read {keys.dir}: only the run's owner can list its keys")
    except (OSError, ValueError) as exc:
        return _error(str(exc))
    for public, role in own.items():
        print(f"{role.value:<9} {public}  (the run's own)")
    for entry in others:
        print(f"{entry.role:<9} {entry.public_key}  {entry.name}".rstrip())
    return EXIT_OK


def _is_public_key(arg: str) -> bool:
    try:
        parse_public_key(arg)
    except ValueError:
        return False
    return True


class _KeysParser(argparse.ArgumentParser):
    """Takes a public key that starts with ``-`` (Z85 allows it) as PUBKEY, not as an option."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        if args is not None and "--" not in args:
            dashed = [a for a in args if a.startswith("-") and _is_public_key(a)]
            if dashed:
                args = [*(a for a in args if a not in dashed), "--", *dashed]
        return super().parse_known_args(args, namespace)


def add_keys_parser(commands: argparse._SubParsersAction) -> None:
    keys = commands.add_parser("keys", help="key pairs and who may connect to a run")
    sub = keys.add_subparsers(
        dest="keys_command", metavar="ACTION", required=True, parser_class=_KeysParser
    )
    new = sub.add_parser("new", help="make your own key pair and print its public key")
    new.add_argument("--out", help=f"where (default {personal_key_file()})")
    new.add_argument("--force", action="store_true", help="replace an existing key pair")
    new.set_defaults(func=lambda a: new_key(a.out, a.force))
    show = sub.add_parser("show", help="print the public key of a key file")
    show.add_argument("file", nargs="?", help="a .key or .key_secret file (default: your own)")
    show.set_defaults(func=lambda a: show_key(a.file))
    add = sub.add_parser("add", help="authorize a public key on a run (the run's owner)")
    add.add_argument("run_dir", metavar="RUN_DIR")
    add.add_argument("--role", required=True, help="operator, viewer, worker or trainer")
    add.add_argument("public_key", metavar="PUBKEY", help="40-character Z85 key, or a .key file")
    add.add_argument("--name", default="", help="who it belongs to (shown by `keys list`)")
    add.set_defaults(func=lambda a: add_key(a.run_dir, a.role, a.public_key, a.name))
    remove = sub.add_parser("remove", help="take an authorized key's rights away")
    remove.add_argument("run_dir", metavar="RUN_DIR")
    remove.add_argument("public_key", metavar="PUBKEY", help="40-character Z85 key, or a .key file")
    remove.set_defaults(func=lambda a: remove_key(a.run_dir, a.public_key))
    show_all = sub.add_parser("list", help="the keys a run accepts, with their roles")
    show_all.add_argument("run_dir", metavar="RUN_DIR")
    show_all.set_defaults(func=lambda a: list_keys(a.run_dir))
