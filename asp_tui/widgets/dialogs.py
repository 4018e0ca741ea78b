"""Modal dialogs: confirm (Cancel is the default), lag-bound input, typed stop, help."""

from __future__ import annotations

from typing import ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.validation import Integer
from textual.widgets import Button, Input, Static


class ConfirmDialog(ModalScreen[bool]):
    """A yes/no question. ``y`` confirms; ``n``, ``esc`` and the focused Cancel button cancel."""

    BINDINGS: ClassVar = [
        Binding("y", "confirm", "Confirm", id="confirm.yes"),
        Binding("n,escape", "cancel", "Cancel", id="confirm.no"),
    ]

    def __init__(self, title: str, body: str, confirm_label: str = "Confirm") -> None:
        super().__init__(classes="dialog-screen")
        self.title_text = title
        self.body = body
        self.confirm_label = confirm_label

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="confirm-dialog") as dialog:
            dialog.border_title = self.title_text
            yield Static(self.body, classes="dialog-body", markup=False)
            yield Static("y confirms · n or esc cancels", classes="dialog-hint")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Cancel", id="cancel", variant="default")
                yield Button(self.confirm_label, id="confirm", variant="warning")

    def on_mount(self) -> None:
        # Cancel is the default (k9s): a stray Enter must not act.
        self.query_one("#cancel", Button).focus()

    @on(Button.Pressed, "#confirm")
    def action_confirm(self) -> None:
        self.dismiss(True)

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(False)


class LagBoundDialog(ModalScreen[int | None]):
    """A validated integer input for the lag bound; Enter submits, esc cancels."""

    BINDINGS: ClassVar = [Binding("escape", "cancel", "Cancel", id="lag.cancel")]

    def __init__(self, current: int, maximum: int) -> None:
        super().__init__(classes="dialog-screen")
        self.current = current
        self.maximum = maximum

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="lag-dialog") as dialog:
            dialog.border_title = "Set the lag bound η"
            yield Static(
                f"Current bound: {self.current}. A sample may be at most η trainer versions "
                f"older than the policy that consumes it (0..{self.maximum}).",
                classes="dialog-body",
            )
            yield Input(
                str(self.current),
                type="integer",
                validators=[Integer(minimum=0, maximum=self.maximum)],
                id="lag-input",
                select_on_focus=True,
            )
            yield Static("", id="lag-error", classes="dialog-error")
            yield Static("enter continues to the confirm · esc cancels", classes="dialog-hint")

    @on(Input.Submitted, "#lag-input")
    def submitted(self, event: Input.Submitted) -> None:
        result = event.validation_result
        if result is not None and not result.is_valid:
            self.query_one("#lag-error", Static).update(
                f"{event.value!r} is not allowed: enter a whole number from 0 to {self.maximum}"
            )
            return
        self.dismiss(int(event.value))

    def action_cancel(self) -> None:
        self.dismiss(None)


class StopDialog(ModalScreen[bool]):
    """Stopping the run is the one irreversible action: type the run name to confirm."""

    BINDINGS: ClassVar = [Binding("escape", "cancel", "Cancel", id="stop.cancel")]

    def __init__(self, run_name: str) -> None:
        super().__init__(classes="dialog-screen")
        self.run_name = run_name

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="stop-dialog") as dialog:
            dialog.border_title = "Stop the run"
            yield Static(
                f"This stops run {self.run_name!r} for everyone: the controller shuts down its "
                "workers and trainer. Type the run name and press enter to stop it. (q only "
                "detaches this dashboard and leaves the run going.)",
                classes="dialog-body",
                markup=False,
            )
            yield Input(placeholder=self.run_name, id="stop-input")
            yield Static("", id="stop-error", classes="dialog-error")
            yield Static("esc cancels", classes="dialog-hint")

    @on(Input.Submitted, "#stop-input")
    def submitted(self, event: Input.Submitted) -> None:
        if event.value.strip() != self.run_name:
            self.query_one("#stop-error", Static).update(
                f"{event.value!r} is not the run name {self.run_name!r}; nothing was stopped"
            )
            return
        self.dismiss(True)

    def action_cancel(self) -> None:
        self.dismiss(False)


class HelpScreen(ModalScreen[None]):
    """Every key binding, as the app currently maps it."""

    BINDINGS: ClassVar = [Binding("escape,q,question_mark", "close", "Close", id="help.close")]

    def __init__(self, rows: list[tuple[str, str]]) -> None:
        super().__init__(classes="dialog-screen")
        self.rows = rows

    def compose(self) -> ComposeResult:
        width = max((len(key) for key, _ in self.rows), default=4) + 2
        text = "\n".join(f"{key:<{width}}{what}" for key, what in self.rows)
        with Vertical(classes="dialog", id="help-dialog") as dialog:
            dialog.border_title = "Keys"
            with VerticalScroll():
                yield Static(text, markup=False)
            yield Static("esc, q or ? closes", classes="dialog-hint")

    def action_close(self) -> None:
        self.dismiss(None)
