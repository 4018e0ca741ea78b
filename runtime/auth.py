"""Who may talk to a run: CurveZMQ key pairs, client roles, and the controller's ZAP handler.

Every socket of the controller is a CurveZMQ server, on loopback too (a head node is shared, and
any local user can reach a loopback port). A client proves who it is with its key pair; the ZAP
handler maps the client's public key to a role and accepts it only on the sockets that role may
use:

    role      sockets                              what for
    operator  control (every command), telemetry   the dashboard, ``asp-tui stop``
    viewer    control (status, history), telemetry ``attach --readonly``; never changes anything
    worker    rollout                              rollout workers and the sim backend
    trainer   trainer                              the trainer's rank 0

``keys/`` in the run directory (mode 0700, secret files 0600) holds the server's key pair, one key
pair per role, and ``authorized.json``: public keys of other people that the run's owner added
with ``asp-tui keys add`` (read again whenever it changes, so a live run picks them up). Key files
use pyzmq's certificate format (``zmq.auth.load_certificate`` reads them).
"""

from __future__ import annotations

import contextlib
import datetime
import enum
import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio
import zmq.auth
from zmq.utils import z85

from runtime.protocol import COMMAND_TYPES

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
KEY_ENV = "ASP_TUI_KEY"
"""A person's secret key file, used ahead of the run's own operator or viewer key. Never for
worker or trainer: those processes inherit the owner's environment and must use the run's keys."""


class Role(enum.StrEnum):
    OPERATOR = "operator"
    VIEWER = "viewer"
    WORKER = "worker"
    TRAINER = "trainer"


PLANE_ROLES: dict[str, frozenset[Role]] = {
    "control": frozenset({Role.OPERATOR, Role.VIEWER}),
    "telemetry": frozenset({Role.OPERATOR, Role.VIEWER}),
    "rollout": frozenset({Role.WORKER}),
    "trainer": frozenset({Role.TRAINER}),
}
"""The sockets (ZAP domains) each role may connect to."""

READ_ONLY_COMMANDS = frozenset(cmd.name for cmd in COMMAND_TYPES if cmd.read_only)
"""The control commands a viewer may send: queries that change nothing (``status``, ``history``)."""


def may_command(role: str, command: str) -> bool:
    """Whether a client of ``role`` may send ``command`` on the control socket."""
    return role == Role.OPERATOR or (role == Role.VIEWER and command in READ_ONLY_COMMANDS)


def parse_role(text: str) -> Role:
    """``text`` as a Role; ``ValueError`` names the allowed ones."""
    try:
        return Role(text)
    except ValueError:
        allowed = ", ".join(r.value for r in Role)
        raise ValueError(f"role {text!r} is not one of: {allowed}") from None


def parse_public_key(text: str) -> str:
    """A Z85 CurveZMQ public key (40 characters); ``ValueError`` says what is wrong."""
    key = text.strip()
    if len(key) != 40:
        raise ValueError(
            f"public key {key!r} has {len(key)} characters; a CurveZMQ public key is 40 "
            "Z85 characters (as printed by `asp-tui keys new` or `asp-tui keys show`)"
        )
    try:
        z85.decode(key.encode("ascii"))
    except (ValueError, UnicodeEncodeError, KeyError):
        raise ValueError(f"public key {key!r} is not valid Z85 text") from None
    return key


@dataclass(frozen=True)
class KeyPair:
    """A CurveZMQ key pair as Z85 bytes; ``secret`` is None for a public-only file."""

    public: bytes
    secret: bytes | None = None

    @property
    def public_text(self) -> str:
        return self.public.decode("ascii")


def write_keypair(base: Path, *, comment: str = "") -> KeyPair:
    """A new key pair in ``<base>.key`` (0644) and ``<base>.key_secret`` (0600, never briefly
    readable by others: created with that mode)."""
    public, secret = zmq.curve_keypair()
    stamp = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    head = f"#   ****  asp-tui CurveZMQ certificate  ****\n#   {comment or base.name}, {stamp}\n"
    public_text = f'{head}metadata\ncurve\n    public-key = "{public.decode()}"\n'
    secret_text = public_text + f'    secret-key = "{secret.decode()}"\n'
    secret_file = base.with_name(base.name + ".key_secret")
    secret_file.unlink(missing_ok=True)
    fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(secret_text)
    base.with_name(base.name + ".key").write_text(public_text)
    return KeyPair(public, secret)


def read_keypair(path: Path) -> KeyPair:
    """A certificate file (``.key`` or ``.key_secret``); errors name the file."""
    try:
        public, secret = zmq.auth.load_certificate(path)
    except OSError:
        raise  # missing or unreadable: the caller words it
    except Exception as exc:  # pyzmq's parser raises assorted errors for a malformed file
        raise ValueError(f"{path}: not a CurveZMQ certificate ({exc})") from None
    if public is None:
        raise ValueError(f"{path}: no public-key in this certificate")
    return KeyPair(public, secret)


class AuthorizedKey(msgspec.Struct, kw_only=True):
    public_key: str
    role: str
    name: str = ""
    added_at: float = 0.0


class RunKeys:
    """``keys/`` of one run directory: the server pair, one pair per role, and other people's
    authorized public keys."""

    def __init__(self, keys_dir: Path) -> None:
        self.dir = keys_dir

    @property
    def authorized_file(self) -> Path:
        return self.dir / "authorized.json"

    def secret_file(self, name: str) -> Path:
        return self.dir / f"{name}.key_secret"

    def ensure(self) -> RunKeys:
        """Create ``keys/`` (0700) with the server's and each role's key pair, once. A key pair
        whose secret file others could read is replaced: it may have leaked."""
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)  # also tightens a directory made by an older version
        for name in ("server", *(r.value for r in Role)):
            secret = self.secret_file(name)
            if secret.is_file() and secret.stat().st_mode & 0o077 == 0:
                continue
            if secret.is_file():
                log.warning("%s was readable by others; making a new key pair", secret)
            write_keypair(self.dir / name, comment=f"{name} key of this run")
        return self

    def server(self) -> KeyPair:
        return read_keypair(self.secret_file("server"))

    def role_key(self, role: Role) -> KeyPair:
        return read_keypair(self.secret_file(role.value))

    def authorized(self) -> list[AuthorizedKey]:
        try:
            data = self.authorized_file.read_bytes()
        except FileNotFoundError:
            return []
        try:
            return msgspec.json.decode(data, type=list[AuthorizedKey])
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ValueError(f"{self.authorized_file}: unreadable ({exc})") from None

    def revoke(self, public_key: str) -> bool:
        """Remove ``public_key`` from ``authorized.json``; False if it was not there. The run's
        own role keys cannot be removed (they are remade only with a new run directory)."""
        from runtime.rundir import atomic_write_bytes

        key = parse_public_key(public_key)
        entries = self.authorized()
        kept = [e for e in entries if e.public_key != key]
        if len(kept) == len(entries):
            return False
        data = msgspec.json.format(msgspec.json.encode(kept))
        atomic_write_bytes(self.authorized_file, data, mode=0o600)
        return True

    def authorize(self, public_key: str, role: Role, name: str = "") -> AuthorizedKey:
        """Add (or re-role, keeping its name unless a new one is given) ``public_key``; a live
        controller picks it up at the key's next connection attempt."""
        from runtime.rundir import atomic_write_bytes

        key = parse_public_key(public_key)
        entries = self.authorized()
        earlier = next((e.name for e in entries if e.public_key == key), "")
        entries = [e for e in entries if e.public_key != key]
        entry = AuthorizedKey(
            public_key=key, role=role.value, name=name or earlier, added_at=time.time()
        )
        entries.append(entry)
        data = msgspec.json.format(msgspec.json.encode(entries))
        atomic_write_bytes(self.authorized_file, data, mode=0o600)
        return entry

    def own_roles(self) -> dict[str, Role]:
        """Public key (Z85 text) -> role, for the run's own role keys."""
        return {self.role_key(role).public_text: role for role in Role}

    def roles(self) -> dict[str, Role]:
        """Public key (Z85 text) -> role, for the run's own keys and the authorized ones."""
        table: dict[str, Role] = {}
        for entry in self.authorized():
            with contextlib.suppress(ValueError):
                table[entry.public_key] = Role(entry.role)
        # The run's own role keys win over anything in authorized.json.
        return table | self.own_roles()


def personal_key_file() -> Path:
    """Where ``asp-tui keys new`` keeps a person's own key pair by default."""
    base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return base / "asp-tui" / "client.key_secret"


class KeyUnavailable(PermissionError):
    """No secret key this process can read for the role it needs; the message says what to do."""


def client_key(
    keys_dir: str | Path | None, role: Role, key_file: str | Path | None = None
) -> KeyPair:
    """The key pair a client of ``role`` connects with, first found of: ``key_file``;
    ``$ASP_TUI_KEY`` (operator and viewer only); the run's own ``keys/<role>.key_secret``
    (readable by the run's owner only); the person's own key from ``asp-tui keys new``."""
    person = role in (Role.OPERATOR, Role.VIEWER)
    explicit = key_file or (os.environ.get(KEY_ENV) if person else None)
    candidates = [Path(explicit)] if explicit else []
    if not explicit and keys_dir:
        candidates.append(Path(keys_dir) / f"{role.value}.key_secret")
    if not explicit:
        candidates.append(personal_key_file())
    problems = []
    for path in candidates:
        try:
            pair = read_keypair(path)
        except (OSError, ValueError) as exc:
            problems.append(f"{path}: {getattr(exc, 'strerror', None) or exc}")
            continue
        if pair.secret is None:
            problems.append(f"{path}: a public key only (pass the .key_secret file)")
            continue
        return pair
    raise KeyUnavailable(
        f"no {role.value} key ({'; '.join(problems)}). Make your own with `asp-tui keys new` "
        f"and ask the run's owner to run `asp-tui keys add RUN_DIR --role {role.value} PUBKEY`"
    )


# --- the server side ---------------------------------------------------------------------------


@dataclass
class Refusal:
    socket: str
    """The socket (ZAP domain), or ``control`` for a command a viewer may not send."""
    role: str
    """The role of the client's key, ``""`` when the key is unknown."""
    public_key: str
    address: str
    reason: str


class ZapHandler:
    """Answers libzmq's ZAP requests for every socket of one context: a CURVE client whose key
    has a role allowed on that socket gets status 200 and its public key as the ZMQ ``User-Id``
    (a property of every frame it sends, so ``role_of`` can check each command against the
    current key table: a removed key loses its commands at once); everything else gets 400,
    is counted in ``refused`` and reported through ``on_refused`` (rate-limited per socket, key
    and host, so that a client retrying in a loop cannot flood the log; libzmq itself does not
    reconnect after a refusal, so each count is one attempt).

    Bind it before the server sockets: with ``ZAP_ENFORCE_DOMAIN`` a socket refuses everyone
    until the handler answers, never the other way round.
    """

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        keys: RunKeys,
        on_refused: Callable[[Refusal, int], None] | None = None,
        report_every_s: float = 60.0,
    ) -> None:
        self.keys = keys
        self.on_refused = on_refused
        self.report_every_s = report_every_s
        self.refused: Counter[str] = Counter()
        self.accepted: Counter[str] = Counter()
        self._reported: dict[tuple[str, str, str], float] = {}
        self._table: dict[str, Role] = {}
        self._table_stamp: tuple[float, ...] | None = None
        self.sock = ctx.socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(ZAP_ENDPOINT)

    def role_of(self, public_key: str) -> Role | None:
        """The role of ``public_key`` now (``authorized.json`` is read again when it changed)."""
        stamp = _stamp(self.keys.authorized_file)
        if stamp != self._table_stamp:
            try:
                self._table = self.keys.roles()
            except ValueError as exc:
                # A broken authorized.json must not lock the owner out: keep the run's own keys.
                log.error("%s; using the run's own role keys only", exc)
                self._table = self.keys.own_roles()
            self._table_stamp = stamp
        return self._table.get(public_key)

    def decide(self, frames: list[bytes]) -> list[bytes]:
        """One ZAP request -> its reply frames (RFC 27)."""
        if len(frames) < 6:
            log.warning("malformed ZAP request with %d frames", len(frames))
            return [b"1.0", frames[1] if len(frames) > 1 else b"", b"500", b"malformed", b"", b""]
        version, request_id, domain, address, _identity, mechanism = frames[:6]
        socket = domain.decode(errors="replace")
        host = address.decode(errors="replace")
        public_key, role = "", None
        if mechanism == b"CURVE" and len(frames) > 6 and len(frames[6]) == 32:
            public_key = z85.encode(frames[6]).decode()
            role = self.role_of(public_key)
        if role is not None and role in PLANE_ROLES.get(socket, ()):
            self.accepted[socket] += 1
            return [version, request_id, b"200", b"OK", public_key.encode(), b""]
        if mechanism != b"CURVE":
            reason = f"{mechanism.decode(errors='replace')} mechanism (CURVE required)"
        elif role is None:
            reason = "unknown client key"
        else:
            reason = f"role {role.value} may not use the {socket} socket"
        self.refuse(Refusal(socket, role.value if role else "", public_key, host, reason))
        return [version, request_id, b"400", reason.encode(), b"", b""]

    def refuse(self, refusal: Refusal) -> None:
        """Count a refusal; report it when this (socket, key, host) was not reported lately."""
        self.refused[refusal.socket] += 1
        now = time.monotonic()
        mark = (refusal.socket, refusal.public_key, refusal.address)
        if now - self._reported.get(mark, -1e9) < self.report_every_s:
            return
        if len(self._reported) > 1000:
            # A client that makes a new key per attempt must not grow this without bound.
            horizon = now - self.report_every_s
            self._reported = {m: t for m, t in self._reported.items() if t > horizon}
        self._reported[mark] = now
        log.warning(
            "refused %s client %s from %s on %s: %s",
            refusal.role or "unknown",
            refusal.public_key or "-",
            refusal.address,
            refusal.socket,
            refusal.reason,
        )
        if self.on_refused is not None:
            self.on_refused(refusal, self.refused[refusal.socket])

    async def serve(self) -> None:
        """Answer ZAP requests until cancelled."""
        while True:
            frames = await self.sock.recv_multipart()
            try:
                reply = self.decide(frames)
            except Exception:
                log.exception("ZAP handler failed; refusing")
                reply = [b"1.0", frames[1] if len(frames) > 1 else b"", b"500", b"error", b"", b""]
            await self.sock.send_multipart(reply)

    def close(self) -> None:
        self.sock.close(linger=0)


def _stamp(path: Path) -> tuple[float, ...]:
    try:
        st = path.stat()
    except FileNotFoundError:
        return ()
    return (st.st_mtime_ns, st.st_size, st.st_ino)
