"""What the controller knows about each rollout instance."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.controller.governor import GroupRecord
from runtime.protocol import INSTANCE_STATES

STARTING, RUNNING, PAUSED, SYNCING, DOWN = INSTANCE_STATES


@dataclass
class Instance:
    instance_id: int
    max_num_seqs: int
    n: int
    state: str = STARTING
    weight_version: int = -1
    """Weights the worker has acknowledged (-1: not known yet)."""
    sync_target: int | None = None
    """Version of the UpdateWeights in progress."""
    sync_started: float = 0.0
    operator_paused: bool = False
    in_flight: dict[int, GroupRecord] = field(default_factory=dict)
    running_seqs: int = 0
    tokens_generated: int = 0
    tokens_per_s: float = 0.0
    last_heartbeat: float = 0.0
    last_tokens_at: float = 0.0
    state_since: float = 0.0
    restarts: int = 0
    auto_restarts: int = 0
    restart_at: float | None = None
    pid: int | None = None
    ever_up: bool = False
    up_since: float = 0.0
    pending_ack: str | None = None
    lost_by_scheduler: bool = False
    """The scheduler was told ``on_instance_lost`` and not yet ``on_instance_resumed``."""
    sync_failures: int = 0
    blocked: str = ""
    """Why the dispatcher gave it nothing last time (for the bubble cause and the dashboard)."""

    @property
    def identity(self) -> bytes:
        return b"instance-%d" % self.instance_id

    @property
    def concurrency(self) -> int:
        """Groups in flight that fill it: ``max_num_seqs // n`` (at least one)."""
        return max(1, self.max_num_seqs // self.n)

    @property
    def live_in_flight(self) -> int:
        return sum(1 for g in self.in_flight.values() if not g.aborting)

    @property
    def alive(self) -> bool:
        return self.state != DOWN and self.state != STARTING

    def active_slots(self) -> int:
        """Sequences running now: the last heartbeat's count, bounded by what is in flight."""
        running = min(self.running_seqs, len(self.in_flight) * self.n, self.max_num_seqs)
        return running if running > 0 else 0

    def observe_tokens(self, total: int, now: float) -> None:
        """Tokens/s from the heartbeat's cumulative counter (EWMA; a restart resets it)."""
        if self.last_tokens_at and total >= self.tokens_generated and now > self.last_tokens_at:
            rate = (total - self.tokens_generated) / (now - self.last_tokens_at)
            self.tokens_per_s = 0.5 * self.tokens_per_s + 0.5 * rate
        self.tokens_generated = total
        self.last_tokens_at = now

    def pending_text(self, now: float) -> str:
        if self.state == DOWN and self.restart_at is not None:
            return f"restart in {max(0.0, self.restart_at - now):.0f}s"
        if self.sync_target is not None:
            return f"weights v{self.sync_target}"
        if self.pending_ack:
            return self.pending_ack
        aborting = len(self.in_flight) - self.live_in_flight
        if aborting:
            return f"abort {aborting}"
        if self.operator_paused and self.state != PAUSED:
            return "pause"
        return self.blocked
