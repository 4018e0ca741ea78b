"""The dashboard's event vocabulary: past-tense messages, posted on the App.

Tests assert on these (``run_test(message_hook=...)``) as well as on what the screen shows.
"""

from __future__ import annotations

from textual.message import Message


class Connected(Message):
    """The controller answered and telemetry is flowing."""

    def __init__(self, endpoint: str, run_name: str) -> None:
        super().__init__()
        self.endpoint = endpoint
        self.run_name = run_name


class Disconnected(Message):
    """The controller stopped answering; the dashboard keeps the last data and retries."""

    def __init__(self, reason: str) -> None:
        super().__init__()
        self.reason = reason


class HistoryBackfilled(Message):
    """Sparklines and the event log were filled from the controller's ring buffer."""

    def __init__(self, snapshots: int, events: int) -> None:
        super().__init__()
        self.snapshots = snapshots
        self.events = events


class SnapshotApplied(Message):
    """A render tick pushed snapshot ``seq`` into the widgets (only the newest one matters)."""

    def __init__(self, seq: int, step: int) -> None:
        super().__init__()
        self.seq = seq
        self.step = step

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, SnapshotApplied)


class InstancesPaused(Message):
    """The controller accepted a pause for these instances."""

    def __init__(self, ids: list[int]) -> None:
        super().__init__()
        self.ids = ids


class InstancesResumed(Message):
    """The controller accepted a resume for these instances."""

    def __init__(self, ids: list[int]) -> None:
        super().__init__()
        self.ids = ids


class InstancesRestarted(Message):
    """The controller accepted a restart for these instances."""

    def __init__(self, ids: list[int]) -> None:
        super().__init__()
        self.ids = ids


class LagBoundChanged(Message):
    """The controller accepted a new lag bound."""

    def __init__(self, old: int | None, new: int) -> None:
        super().__init__()
        self.old = old
        self.new = new


class RunStopRequested(Message):
    """The controller accepted ``stop``: the run is shutting down."""


class CommandRefused(Message):
    """A command was refused: by the controller (its reason) or locally (read-only)."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__()
        self.name = name
        self.reason = reason


class CommandFailed(Message):
    """A command got no answer (timeout, controller unreachable)."""

    def __init__(self, name: str, error: str) -> None:
        super().__init__()
        self.name = name
        self.error = error


class CommandCancelled(Message):
    """The operator cancelled a confirm dialog; nothing was sent."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name


class InstancesMarked(Message):
    """The set of marked instances changed."""

    def __init__(self, ids: list[int]) -> None:
        super().__init__()
        self.ids = ids
