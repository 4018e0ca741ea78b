"""The event log: operator actions, weight syncs, state changes and refused commands."""

from __future__ import annotations

from textual.widgets import Log

from asp_tui.format import clock_time
from runtime.protocol import Event


class EventLog(Log):
    """Plain-text lines (the fast Log widget), newest at the bottom."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(max_lines=500, auto_scroll=True, id=id)

    def on_mount(self) -> None:
        self.border_title = "Events"

    def on_resize(self) -> None:
        # A scroll made before the first layout lands short of the end.
        self.scroll_end(animate=False, immediate=True)

    def add_event(self, event: Event) -> None:
        self._line(f"{clock_time(event.time)} {event.kind:<10} {event.message}")

    def add_local(self, time: float, kind: str, message: str) -> None:
        """A line from the dashboard itself (a refused or failed command)."""
        self._line(f"{clock_time(time)} {kind:<10} {message}")

    def _line(self, text: str) -> None:
        # Newline *before* each line, so the newest line is the last one, not a blank.
        self.write(("\n" if self.line_count else "") + text)
