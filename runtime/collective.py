"""Collective weight sync: trainer rank 0 broadcasts a weight version to rollout workers.

``async.weight_sync: collective``. Weights go from trainer rank 0 straight into the vLLM workers
through a ``torch.distributed`` group: gloo where the tensors live on the CPU, NCCL where they
live on a GPU; the code is the same, only the backend and the device differ.

Rendezvous. torch groups have a fixed size, and rollout workers come and go (restarts, late
joiners, an instance busy finishing a ``boundary`` drain while the others are ready). So the
group is not made once: trainer rank 0 runs a ``WeightServer`` (a thread) that serves weights in
*rounds*, each with a fresh group of the workers that asked since the last round:

1. The server owns a ``TCPStore`` for the life of the trainer. Its address and a random token
   travel to the controller in ``TrainerHello`` and from there in every ``UpdateWeights`` (both
   over the authenticated CurveZMQ sockets).
2. A worker that must load version ``v`` takes a ticket (an atomic counter in the store) and
   writes the version it wants under it.
3. The server waits for a first ticket, gives the others ``gather_s`` to arrive, and closes the
   round over the tickets taken so far. It waits until the version it serves is at least every
   ticket's wish, then publishes the round's tensor layout and each ticket's seat (rank, size).
4. The members and the server form a group under a key prefix of their own
   (``<token>/r<round>``), and the server broadcasts the weights in buckets.

A worker that restarts or joins late simply takes a ticket and gets the current version in the
next round; nothing waits for it. The server serves the newest version the controller has
acknowledged (``promote``), which is never older than what the worker was told to load and
never newer than what the controller knows, so a worker may skip a version but never run ahead.

Buckets. The server keeps one snapshot per version: the weights packed into byte buckets of
``bucket_bytes`` (a tensor larger than that gets a bucket of its own), copied once from the
parameters with the publish dtype cast on the way. Up to ``IN_FLIGHT`` buckets are in the network
at a time, and a receiver hands out each bucket's tensors (views, no copy) while the next ones
arrive, so a worker holds a few buckets, not the model.

Security. ``TCPStore`` and gloo authenticate no one. The store listens only on ``host`` (the
trainer's address towards the controller: loopback for a one-host run), every key is under the
random token that only CurveZMQ-authenticated peers receive, and gloo binds to the same interface.
Anyone who can reach those ports can still disturb a sync (or, knowing the protocol, feed a
worker bytes during a round): run multi-host jobs on a trusted network. NCCL is the same.

This module imports only torch and the standard library: it also runs inside vLLM's worker
processes (``weight_extension.py``).
"""

from __future__ import annotations

import datetime
import json
import logging
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")
IN_FLIGHT = 4
"""Buckets broadcast at once: keeps the links busy while a receiver applies the previous one."""
GLOO_LINKS = 2
"""TCP connections per pair of gloo ranks; two beat one on loopback."""
_ALIGN = 64
"""Byte offset alignment of each tensor in its bucket, so a view of any dtype is valid."""
_POLL_S = 1.0
_IDLE_POLL_S = 0.02
"""How often an idle server looks for a worker's ticket (one loopback round trip)."""


def backend_for(device: torch.device) -> str:
    """The group backend for tensors on ``device``."""
    return "nccl" if device.type == "cuda" else "gloo"


def local_address_towards(host: str) -> str:
    """This host's address on the route to ``host`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return probe.getsockname()[0]


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def _new_group(
    backend: str, store: dist.Store, rank: int, size: int, host: str, timeout_s: float
) -> dist.ProcessGroup:
    """A group of ``size`` over ``store``, outside torch's default group (vLLM and the trainer
    each have one already)."""
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = _timedelta(timeout_s)
        options._devices = [
            dist.ProcessGroupGloo.create_device(hostname=host) for _ in range(GLOO_LINKS)
        ]
        options._threads = 2 * GLOO_LINKS
        return dist.ProcessGroupGloo(store, rank, size, options)
    if backend == "nccl":
        # Written against torch's API; not run here (no GPU). NCCL picks its interface itself:
        # set NCCL_SOCKET_IFNAME on multi-homed hosts.
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = _timedelta(timeout_s)
        return dist.ProcessGroupNCCL(store, rank, size, options)
    raise ValueError(f"weight sync backend {backend!r} is not one of {BACKENDS}")


def _broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> dist.Work:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    return group.broadcast([tensor], options)


# --- packing ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TensorSlot:
    """Where one tensor lives in a snapshot."""

    name: str
    dtype: str
    """torch dtype name without the ``torch.`` prefix."""
    shape: tuple[int, ...]
    bucket: int
    offset: int
    nbytes: int

    def view(self, bucket: torch.Tensor) -> torch.Tensor:
        raw = bucket[self.offset : self.offset + self.nbytes]
        return raw.view(getattr(torch, self.dtype)).view(self.shape)


@dataclass(slots=True)
class PackedWeights:
    """One weight version, packed into byte buckets for broadcasting."""

    version: int
    slots: list[TensorSlot]
    buckets: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slots)

    def layout(self) -> dict:
        """What a receiver needs to allocate the buckets and cut them into tensors."""
        return {
            "version": self.version,
            "buckets": [int(b.numel()) for b in self.buckets],
            "slots": [
                [s.name, s.dtype, list(s.shape), s.bucket, s.offset, s.nbytes] for s in self.slots
            ],
        }


def _slots_from(layout: dict) -> list[TensorSlot]:
    return [
        TensorSlot(name, dtype, tuple(shape), bucket, offset, nbytes)
        for name, dtype, shape, bucket, offset, nbytes in layout["slots"]
    ]


def pack(
    version: int,
    tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    dtype: torch.dtype | None = None,
    pin_memory: bool = False,
    reuse: list[torch.Tensor] | None = None,
) -> PackedWeights:
    """Copy ``tensors`` (any device) into CPU byte buckets, floating ones cast to ``dtype``.

    One copy per tensor, straight from the parameter into its bucket. ``reuse``: the buckets of
    a snapshot nobody reads any more, taken when the layout is the same (it is, step after
    step), which spares the page faults of fresh memory.
    """
    items = list(tensors)
    slots: list[TensorSlot] = []
    sizes: list[int] = []
    for name, value in items:
        target = dtype if dtype is not None and value.is_floating_point() else value.dtype
        nbytes = value.numel() * target.itemsize
        if not sizes or (sizes[-1] and sizes[-1] + nbytes > bucket_bytes):
            sizes.append(0)
        offset = sizes[-1]
        slots.append(
            TensorSlot(name, str(target).removeprefix("torch."), tuple(value.shape), len(sizes) - 1,
                       offset, nbytes)
        )  # fmt: skip
        sizes[-1] = -(-(offset + nbytes) // _ALIGN) * _ALIGN
    if reuse is not None and [b.numel() for b in reuse] == sizes:
        buckets = reuse
    else:
        buckets = [torch.empty(size, dtype=torch.uint8, pin_memory=pin_memory) for size in sizes]
    with torch.no_grad():
        for slot, (_, value) in zip(slots, items, strict=True):
            slot.view(buckets[slot.bucket]).copy_(value.detach())
    return PackedWeights(version, slots, buckets)


# --- trainer side ----------------------------------------------------------------------------


@dataclass(slots=True)
class RoundRecord:
    """One served round, for logs and tests."""

    round: int
    version: int
    members: int
    nbytes: int
    seconds: float


@dataclass
class _State:
    staged: PackedWeights | None = None
    served: PackedWeights | None = None
    sending: PackedWeights | None = None
    """The snapshot of the round in progress."""
    spare: list[torch.Tensor] | None = None
    """Buckets of a snapshot that is neither staged, served nor being sent."""
    rounds: list[RoundRecord] = field(default_factory=list)

    def retire(self, snapshot: PackedWeights | None) -> None:
        """Keep ``snapshot``'s buckets for the next ``pack`` once nothing refers to it."""
        if snapshot is not None and all(
            snapshot is not held for held in (self.staged, self.served, self.sending)
        ):
            self.spare = snapshot.buckets


class WeightServer:
    """Trainer rank 0's side: holds the current snapshot and serves it in rounds (a thread)."""

    def __init__(
        self,
        host: str,
        port: int = 0,
        *,
        device: torch.device | None = None,
        gather_s: float = 0.05,
        timeout_s: float = 300.0,
    ) -> None:
        self.host = host
        self.device = device or torch.device("cpu")
        self.backend = backend_for(self.device)
        self.gather_s = gather_s
        self.timeout_s = timeout_s
        self.token = secrets.token_hex(16)
        # The store listens on a socket we bound ourselves: a TCPStore binding its own listens
        # on every interface, whatever host it is given.
        self._listener = socket.create_server((host, port), backlog=128)
        self.port = self._listener.getsockname()[1]
        self._store = dist.TCPStore(
            host,
            self.port,
            is_master=True,
            wait_for_workers=False,
            timeout=_timedelta(timeout_s),
            master_listen_fd=self._listener.fileno(),
        )
        self._state = _State()
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="weight-server", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def rounds(self) -> list[RoundRecord]:
        return list(self._state.rounds)

    @property
    def version(self) -> int | None:
        """The version being served (None before the first ``promote``)."""
        served = self._state.served
        return None if served is None else served.version

    def stage(
        self,
        version: int,
        tensors: Iterable[tuple[str, torch.Tensor]],
        bucket_bytes: int,
        dtype: torch.dtype | None = None,
    ) -> PackedWeights:
        """Pack ``version``; it is served once ``promote(version)`` says the controller knows it."""
        with self._changed:
            dropped, self._state.staged = self._state.staged, None
            self._state.retire(dropped)  # staged and never promoted (a refused step)
            spare, self._state.spare = self._state.spare, None
        pin = self.backend == "nccl"
        snapshot = pack(version, tensors, bucket_bytes, dtype, pin_memory=pin, reuse=spare)
        with self._changed:
            self._state.staged = snapshot
        return snapshot

    def promote(self, version: int) -> None:
        """Serve the staged ``version`` from now on; the previous snapshot is dropped."""
        with self._changed:
            staged = self._state.staged
            if staged is None or staged.version != version:
                have = None if staged is None else staged.version
                raise ValueError(f"promote({version}): the staged version is {have}")
            old, self._state.served, self._state.staged = self._state.served, staged, None
            self._state.retire(old)
            self._changed.notify_all()

    def close(self) -> None:
        self._stop.set()
        with self._changed:
            self._changed.notify_all()
        self._thread.join(timeout=5.0)
        self._listener.close()

    # --- the thread --------------------------------------------------------------------------

    def _key(self, *parts: object) -> str:
        return "/".join((self.token, *map(str, parts)))

    def _serve(self) -> None:
        served_tickets, round_no = 0, 0
        while not self._stop.is_set():
            # check() rather than a wait with a timeout: c10d logs a warning for every timeout.
            if not self._store.check([self._key("want", served_tickets)]):
                self._stop.wait(_IDLE_POLL_S)
                continue
            time.sleep(self.gather_s)  # let the others told at the same time arrive
            tickets = range(served_tickets, int(self._store.add(self._key("tickets"), 0)))
            # A ticket is taken before its wish is written; wait for every wish.
            self._store.wait([self._key("want", t) for t in tickets])
            wants = [int(self._store.get(self._key("want", t))) for t in tickets]
            snapshot = self._await_version(max(wants))
            if snapshot is None:
                return
            try:
                self._round(round_no, tickets, snapshot)
            except Exception:  # one broken round (a worker died in it) must not end the server
                log.exception("weight round %d (v%d) failed", round_no, snapshot.version)
            finally:
                with self._changed:
                    self._state.sending = None
                    self._state.retire(snapshot)
            for t in tickets:
                self._store.delete_key(self._key("want", t))
                self._store.delete_key(self._key("seat", t))
            self._store.delete_key(self._key("r", round_no, "layout"))
            served_tickets, round_no = tickets.stop, round_no + 1

    def _await_version(self, version: int) -> PackedWeights | None:
        with self._changed:
            while not self._stop.is_set():
                served = self._state.served
                if served is not None and served.version >= version:
                    self._state.sending = served
                    return served
                self._changed.wait(_POLL_S)
        return None

    def _round(self, round_no: int, tickets: range, snapshot: PackedWeights) -> None:
        started = time.perf_counter()
        size = len(tickets) + 1
        self._store.set(self._key("r", round_no, "layout"), json.dumps(snapshot.layout()))
        for rank, ticket in enumerate(tickets, start=1):
            seat = {"round": round_no, "rank": rank, "size": size, "backend": self.backend}
            self._store.set(self._key("seat", ticket), json.dumps(seat))
        store = dist.PrefixStore(self._key("r", round_no), self._store)
        group = _new_group(self.backend, store, 0, size, self.host, self.timeout_s)
        works: deque[dist.Work] = deque()
        for bucket in snapshot.buckets:
            # On a GPU a bucket is staged onto the device just before it is sent.
            works.append(_broadcast(group, bucket.to(self.device, non_blocking=True)))
            if len(works) >= IN_FLIGHT:
                works.popleft().wait()
        while works:
            works.popleft().wait()
        record = RoundRecord(
            round_no, snapshot.version, size - 1, snapshot.nbytes, time.perf_counter() - started
        )
        self._state.rounds.append(record)
        log.info(
            "weights v%d to %d worker(s) in %.3f s (%.2f GB/s)",
            record.version,
            record.members,
            record.seconds,
            record.nbytes / max(record.seconds, 1e-9) / 1e9,
        )


# --- worker side -----------------------------------------------------------------------------


class Fetch:
    """One worker's seat in a round: ``version`` and ``tensors()`` once constructed.

    ``want``: the version the controller asked for; the round may serve a newer one.
    """

    def __init__(
        self,
        address: str,
        token: str,
        want: int,
        device: torch.device,
        *,
        connect_timeout_s: float = 30.0,
        timeout_s: float = 300.0,
    ) -> None:
        host, _, port = address.rpartition(":")
        self.device = device
        self._store = dist.TCPStore(
            host, int(port), is_master=False, timeout=_timedelta(connect_timeout_s)
        )
        self._store.set_timeout(_timedelta(timeout_s))
        key = lambda *parts: "/".join((token, *map(str, parts)))  # noqa: E731
        ticket = int(self._store.add(key("tickets"), 1)) - 1
        self._store.set(key("want", ticket), str(want))
        self._store.wait([key("seat", ticket)])
        seat = json.loads(self._store.get(key("seat", ticket)))
        layout = json.loads(self._store.get(key("r", seat["round"], "layout")))
        self.version: int = layout["version"]
        self._bucket_sizes: list[int] = layout["buckets"]
        self._slots = _slots_from(layout)
        backend = seat["backend"]
        if backend != backend_for(device):
            raise RuntimeError(
                f"the trainer sends weights over {backend}, which cannot reach a model on "
                f"{device}; use async.weight_sync: file for this mix of devices"
            )
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self._group = _new_group(
            backend,
            dist.PrefixStore(key("r", seat["round"]), self._store),
            seat["rank"],
            seat["size"],
            local_address_towards(host),
            timeout_s,
        )

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor, as a view into its freshly received bucket.

        Each bucket is a new allocation, so a view the consumer keeps stays valid. If the
        consumer stops early (or fails), the rest is still received, so the round completes
        for the others.
        """
        by_bucket: list[list[TensorSlot]] = [[] for _ in self._bucket_sizes]
        for slot in self._slots:
            by_bucket[slot.bucket].append(slot)
        pending: deque[tuple[int, torch.Tensor, dist.Work]] = deque()
        posted = 0

        def post() -> None:
            nonlocal posted
            buffer = torch.empty(self._bucket_sizes[posted], dtype=torch.uint8, device=self.device)
            pending.append((posted, buffer, _broadcast(self._group, buffer)))
            posted += 1

        try:
            while posted < min(IN_FLIGHT, len(self._bucket_sizes)):
                post()
            while pending:
                index, buffer, work = pending.popleft()
                work.wait()
                if posted < len(self._bucket_sizes):
                    post()
                for slot in by_bucket[index]:
                    yield slot.name, slot.view(buffer)
        finally:
            while pending:
                pending.popleft()[2].wait()
                if posted < len(self._bucket_sizes):
                    post()


__all__ = [
    "BACKENDS",
    "Fetch",
    "PackedWeights",
    "RoundRecord",
    "TensorSlot",
    "WeightServer",
    "backend_for",
    "local_address_towards",
    "pack",
]
