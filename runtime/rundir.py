"""The run directory: where every process of a run finds and leaves its files.

``runs/<name>/`` holds ``config.yaml`` (resolved), ``endpoints.json`` (all that ``asp-tui attach``
needs), ``logs/<process>.log``, ``metrics.jsonl``, ``ledger.jsonl``, ``state/``, ``checkpoints/``,
``weights/`` and ``keys/`` (CurveZMQ key pairs, mode 0700; see ``runtime/auth.py``).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec


class Endpoints(msgspec.Struct, kw_only=True):
    rollout: str
    trainer: str
    telemetry: str
    control: str
    controller_pid: int
    run_name: str
    server_public_key: str | None = None
    """The controller's CurveZMQ public key (Z85): clients check the server with it."""
    keys_dir: str = ""
    """The run's ``keys/`` (readable by its owner only): where local clients find their role
    key. Only the path: endpoints.json carries no secret."""
    started_at: float = 0.0


class RunDir:
    """Typed paths inside one run directory."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    config = property(lambda self: self.root / "config.yaml")
    endpoints = property(lambda self: self.root / "endpoints.json")
    metrics = property(lambda self: self.root / "metrics.jsonl")
    ledger = property(lambda self: self.root / "ledger.jsonl")
    logs = property(lambda self: self.root / "logs")
    state = property(lambda self: self.root / "state")
    checkpoints = property(lambda self: self.root / "checkpoints")
    weights = property(lambda self: self.root / "weights")
    keys = property(lambda self: self.root / "keys")

    def create(self) -> RunDir:
        for folder in (self.root, self.logs, self.state, self.checkpoints, self.weights):
            folder.mkdir(parents=True, exist_ok=True)
        return self

    def log_file(self, process: str) -> Path:
        return self.logs / f"{process}.log"

    def weights_file(self, version: int) -> Path:
        return self.weights / f"v{version:06d}.safetensors"

    def write_endpoints(self, endpoints: Endpoints) -> None:
        # Readable by all (0644): it holds only public material, and a person whose key the
        # owner authorized needs the addresses and the server's public key to attach.
        data = msgspec.json.format(msgspec.json.encode(endpoints))
        atomic_write_bytes(self.endpoints, data, mode=0o644)

    def read_endpoints(self) -> Endpoints:
        try:
            return msgspec.json.decode(self.endpoints.read_bytes(), type=Endpoints)
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.endpoints}: no run has started here") from None
        except msgspec.DecodeError as exc:
            raise ValueError(f"{self.endpoints}: unreadable ({exc})") from None


def atomic_write_bytes(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write via a temp file + rename, so readers never see a partial file; the file gets
    ``mode`` (by default private to the owner)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class JsonlWriter:
    """Appends one JSON object per line and flushes each, so a crash loses no accepted record."""

    def __init__(self, path: Path, fsync: bool = False) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fsync = fsync
        self._handle = path.open("ab", buffering=0)

    def write(self, record: dict[str, Any]) -> None:
        record.setdefault("time", time.time())
        self._handle.write(msgspec.json.encode(record) + b"\n")
        if self._fsync:
            os.fsync(self._handle.fileno())

    def close(self) -> None:
        self._handle.close()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete line; a torn last line (a crash mid-write) is skipped."""
    records = []
    if not path.exists():
        return records
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


class JsonlTail:
    """Follows a growing JSONL file; each ``read()`` returns only the new complete records."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0

    def read(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as handle:
                handle.seek(self._offset)
                chunk = handle.read()
        except FileNotFoundError:
            return []
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self._offset += len(complete)
        records = []
        for line in complete.splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return records
