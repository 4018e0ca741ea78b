"""What goes into the controller core and what comes out of it.

The core (:mod:`runtime.controller.core`) is sans-IO: the process shell, or the simulator, turns
socket frames, child exits and timers into these events, and carries out the actions the core
returns. Nothing here touches a socket, a process or a clock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from runtime import protocol as P

log = logging.getLogger("runtime.controller")

# --- events: what happened ------------------------------------------------------------------


@dataclass(frozen=True)
class InstanceMessage:
    """A decoded message from rollout instance ``instance_id``."""

    instance_id: int
    message: Any


@dataclass(frozen=True)
class TrainerMessage:
    """A decoded message from the trainer (rank 0)."""

    message: Any


@dataclass(frozen=True)
class OperatorCommand:
    """A command from an authorized operator; answered by one :class:`CommandAnswered`."""

    command: P.Command | P.InvalidCommand


@dataclass(frozen=True)
class Tick:
    """The clock moved: check heartbeats and timeouts, account bubbles."""


@dataclass(frozen=True)
class ProcessStarted:
    """A child process (a worker, the sim backend) was started with ``pid``."""

    name: str
    pid: int


@dataclass(frozen=True)
class InstanceUnreachable:
    """A message to ``instance_id`` could not be sent: its worker is gone."""

    instance_id: int


@dataclass(frozen=True)
class ProcessExited:
    name: str
    code: int


@dataclass(frozen=True)
class ProcessStartFailed:
    name: str
    error: str


@dataclass(frozen=True)
class RestartDue:
    """A restart's backoff is over; ``generation`` tells a superseded restart from the latest."""

    name: str
    generation: int


@dataclass(frozen=True)
class EpochPlanned:
    """The plan asked for by :class:`PlanEpoch` is built (``scheduler``), or failed (``error``)."""

    plan: Any
    scheduler: Any = None
    error: str = ""
    seconds: float = 0.0


@dataclass(frozen=True)
class StartFinalEval:
    """The last weights are out: run the eval set once more before the instances stop."""


Event = (
    InstanceMessage
    | TrainerMessage
    | OperatorCommand
    | Tick
    | ProcessStarted
    | InstanceUnreachable
    | ProcessExited
    | ProcessStartFailed
    | RestartDue
    | EpochPlanned
    | StartFinalEval
)

# --- actions: what to do ----------------------------------------------------------------------


@dataclass(frozen=True)
class SendToInstance:
    instance_id: int
    message: Any


@dataclass(frozen=True)
class SendToTrainer:
    message: Any


@dataclass(frozen=True)
class CommandAnswered:
    reply: P.CommandReply


@dataclass(frozen=True)
class Publish:
    """An event for operators: the event log, telemetry and metrics.jsonl."""

    event: P.Event


@dataclass(frozen=True)
class Record:
    """A line for metrics.jsonl only; ``step`` (when set) also sends it to the trackers."""

    record: dict[str, Any]
    step: int | None = None


@dataclass(frozen=True)
class Track:
    """A record for the experiment trackers only (TensorBoard, W&B), at ``step``."""

    record: dict[str, Any]
    step: int


@dataclass(frozen=True)
class SaveState:
    state: Any


@dataclass(frozen=True)
class KillProcess:
    name: str


@dataclass(frozen=True)
class RestartProcess:
    """Stop ``name`` if it still runs, then start it again; report :class:`ProcessStarted`."""

    name: str


@dataclass(frozen=True)
class WakeLater:
    """Feed :class:`RestartDue` back after ``delay_s``."""

    delay_s: float
    name: str
    generation: int


@dataclass(frozen=True)
class PlanEpoch:
    """Build ``plan`` off the event loop and feed :class:`EpochPlanned` back."""

    plan: Any


@dataclass(frozen=True)
class StopRequested:
    """The run is to stop: trainer first, then the instances (the shell's shutdown)."""

    reason: str
    code: int


Action = (
    SendToInstance
    | SendToTrainer
    | CommandAnswered
    | Publish
    | Record
    | Track
    | SaveState
    | KillProcess
    | RestartProcess
    | WakeLater
    | PlanEpoch
    | StopRequested
)


class Outbox:
    """Where the core's parts put their actions, stamped by the core's clock."""

    def __init__(self, clock: Callable[[], float], *, quiet: bool = False) -> None:
        self.clock = clock
        self.quiet = quiet
        """Events are not logged (a simulated run's are not the live run's)."""
        self.actions: list[Action] = []

    def add(self, action: Action) -> None:
        self.actions.append(action)

    def take(self) -> list[Action]:
        out, self.actions = self.actions, []
        return out

    def to_instance(self, instance_id: int, message: Any) -> None:
        self.actions.append(SendToInstance(instance_id, message))

    def to_trainer(self, message: Any) -> None:
        self.actions.append(SendToTrainer(message))

    def publish(self, kind: P.EventKind, message: str, **data: Any) -> None:
        if not self.quiet:
            log.info("[%s] %s", kind, message)
        event = P.Event(time=self.clock(), kind=kind, message=message, data=jsonable(data))
        self.actions.append(Publish(event))

    def record(self, record: dict[str, Any], step: int | None = None) -> None:
        record.setdefault("time", self.clock())
        self.actions.append(Record(record, step))


def jsonable(value: Any) -> Any:
    return msgspec.to_builtins(value, str_keys=True)
