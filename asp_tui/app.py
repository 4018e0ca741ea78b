"""The live dashboard: ``make_app(link, ...)`` builds it, so tests inject the link they need.

Structure (the anchors' pattern): one long-lived async worker owns the telemetry subscription and
writes into a ``DashboardModel``; a render tick (``set_interval``) pushes the latest state into
the widgets inside ``batch_update()``; every command runs in its own worker with a timeout.
Losing the controller never ends the app: it shows DISCONNECTED, keeps the last data dimmed and
reconnects with capped, jittered backoff. Quitting only detaches.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.command import DiscoveryHit, Hit, Hits, Provider
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.widgets import Footer, Input

from asp_tui import messages as msg
from asp_tui.link import TelemetryLink
from asp_tui.model import Backoff, DashboardModel, Link
from asp_tui.widgets.bubbles import BubblePanel
from asp_tui.widgets.dialogs import ConfirmDialog, HelpScreen, LagBoundDialog, StopDialog
from asp_tui.widgets.events import EventLog
from asp_tui.widgets.header import RunHeader
from asp_tui.widgets.instances import InstanceTable
from asp_tui.widgets.meters import LagMeter, QueueMeter, SchedulerMeter, TrainerMeter
from runtime.protocol import (
    Command,
    CommandReply,
    Event,
    HistoryCmd,
    PauseInstances,
    RestartInstances,
    ResumeInstances,
    SetLagBound,
    Snapshot,
    StatusCmd,
    StopRun,
)

COMMAND_ACTIONS = frozenset(
    {"toggle_pause", "pause", "resume", "restart", "set_lag_bound", "lag_up", "lag_down", "stop"}
)
"""Actions that send a command; ``--readonly`` refuses every one of them."""

MAIN_SCREEN_ACTIONS = COMMAND_ACTIONS | {"detach", "filter", "clear", "help", "toggle_mark"}
"""Keys for the main screen only: under a dialog, ``q`` or ``p`` must not act behind it."""


@dataclass(frozen=True)
class PaletteEntry:
    title: str
    help: str
    run: Callable[[], Any]


class DashboardCommands(Provider):
    """The command palette: every action, plus entries built from live state."""

    async def discover(self) -> Hits:
        app = self.app
        assert isinstance(app, Dashboard)
        for entry in app.palette_entries():
            yield DiscoveryHit(entry.title, entry.run, help=entry.help)

    async def search(self, query: str) -> Hits:
        app = self.app
        assert isinstance(app, Dashboard)
        matcher = self.matcher(query)
        for entry in app.palette_entries():
            score = matcher.match(entry.title)
            if score > 0:
                yield Hit(score, matcher.highlight(entry.title), entry.run, help=entry.help)


class Dashboard(App[int]):
    """Attach to one controller: watch the run, pause/resume instances, change the lag bound."""

    CSS_PATH = "app.tcss"
    TITLE = "asp-tui"
    HORIZONTAL_BREAKPOINTS: ClassVar[list[tuple[int, str]]] = [(0, "-compact"), (120, "-wide")]
    COMMANDS: ClassVar = {DashboardCommands}
    ENABLE_COMMAND_PALETTE = True

    BINDINGS: ClassVar = [
        Binding("q", "detach", "Detach", id="app.detach"),
        Binding("p", "toggle_pause", "Pause/Resume", id="app.pause-resume"),
        Binding("L", "set_lag_bound", "Lag bound", id="app.lag-bound"),
        Binding("plus,equals_sign", "lag_up", "η+1", show=False, id="app.lag-up"),
        Binding("minus", "lag_down", "η-1", show=False, id="app.lag-down"),
        Binding("R", "restart", "Restart", show=False, id="app.restart"),
        Binding("slash", "filter", "Filter", id="app.filter"),
        Binding("escape", "clear", "Clear marks/filter", show=False, id="app.clear"),
        Binding("question_mark,f1", "help", "Help", id="app.help"),
        Binding("colon", "command_palette", "Commands", show=False, id="app.palette"),
        Binding("S", "stop", "Stop run", show=False, id="app.stop"),
    ]

    def __init__(
        self,
        link: TelemetryLink,
        *,
        readonly: bool = False,
        render_hz: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        command_timeout_s: float = 5.0,
        probe_after_s: float = 2.0,
        max_lag_bound: int = 16,
        backoff: Backoff | None = None,
        handle_hangup: bool = False,
        keymap: dict[str, str] | None = None,
    ) -> None:
        super().__init__()
        self.link = link
        self.readonly = readonly
        self.render_hz = render_hz
        self.clock = clock
        self.wall_clock = wall_clock
        """Timestamps of the dashboard's own log lines (injected, so snapshots are stable)."""
        self.command_timeout_s = command_timeout_s
        self.probe_after_s = probe_after_s
        self.max_lag_bound = max_lag_bound
        self.backoff = backoff or Backoff()
        self.handle_hangup = handle_hangup
        self.model = DashboardModel(clock, stale_after_s=max(1.5, 3.0 / render_hz))
        self.marked: set[int] = set()
        self._dirty = True
        self._keymap = keymap or {}
        self._was_disconnected = False

    # --- layout ---------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield RunHeader(id="header")
        with Horizontal(id="body"):
            with Vertical(id="side"):
                with Horizontal(id="meters"):
                    yield QueueMeter(id="queue", classes="panel")
                    yield LagMeter(id="lag", classes="panel")
                    yield TrainerMeter(id="trainer", classes="panel")
                yield BubblePanel(id="bubbles", classes="panel")
                yield SchedulerMeter(id="scheduler", classes="panel")
            with Vertical(id="main"):
                yield Input(
                    placeholder="filter: ids, a state and/or a lane (e.g. 'paused', 'tail' or '3')",
                    id="filter",
                )
                yield InstanceTable(id="instances")
        yield EventLog(id="events")
        yield Footer()

    def on_mount(self) -> None:
        if self._keymap:
            self.set_keymap(self._keymap)
        # Widgets are looked up once: while a dialog is open, query_one searches the dialog.
        self.header_bar = self.query_one(RunHeader)
        self.body = self.query_one("#body")
        self.queue_meter = self.query_one(QueueMeter)
        self.lag_meter = self.query_one(LagMeter)
        self.trainer_meter = self.query_one(TrainerMeter)
        self.bubble_panel = self.query_one(BubblePanel)
        self.scheduler_meter = self.query_one(SchedulerMeter)
        self.table = self.query_one(InstanceTable)
        self.event_log = self.query_one(EventLog)
        self.filter_input = self.query_one("#filter", Input)
        self.filter_input.display = False
        self.table.focus()
        self.telemetry_loop()
        self.set_interval(1 / self.render_hz, self.render_tick)
        if self.handle_hangup:
            self._install_hangup()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        under_dialog = len(self.screen_stack) > 1
        return not (action in MAIN_SCREEN_ACTIONS and under_dialog)

    @property
    def wide(self) -> bool:
        return self.size.width >= 120

    # --- telemetry (one long-lived worker owns the subscription) --------------------------

    @work(exclusive=True, group="telemetry", exit_on_error=False)
    async def telemetry_loop(self) -> None:
        while True:
            try:
                await self._session()
                reason = "telemetry stream ended"
            except Exception as exc:
                # Anything (zmq errors, a malformed reply) means "not connected": never let
                # the loop die, or the dashboard would stop reconnecting.
                reason = str(exc) or type(exc).__name__
            finally:
                with contextlib.suppress(Exception):
                    await self.link.close()
            if self.model.connected or not self._was_disconnected:
                self.post_message(msg.Disconnected(reason))
                self.event_log.add_local(
                    self.wall_clock(), "link", f"lost the controller ({reason}); reconnecting"
                )
            self._was_disconnected = True
            self.model.mark_disconnected(reason)
            self._dirty = True
            await asyncio.sleep(self.backoff.next_delay())

    async def _session(self) -> None:
        """One connection: probe, backfill from the ring buffer, then follow the stream."""
        await self.link.open()
        history = await self.link.request(HistoryCmd(), self.command_timeout_s)
        if history.ok and isinstance(history.data, dict):
            snapshots, events = self.model.backfill(history.data)
            self.post_message(msg.HistoryBackfilled(snapshots, events))
        status = await self.link.request(StatusCmd(), self.command_timeout_s)
        if status.ok and isinstance(status.data, dict):
            self.model.apply_snapshot(_snapshot(status.data))
        self.backoff.reset()
        self._was_disconnected = False
        self.post_message(msg.Connected(self.link.label, self.link.run_name))
        self._flush_events()  # the backfilled history first, then this line
        self.event_log.add_local(self.wall_clock(), "link", f"connected to {self.link.label}")
        stream = self.link.stream()
        pending = asyncio.ensure_future(anext(stream))
        try:
            while True:
                done, _ = await asyncio.wait({pending}, timeout=self.probe_after_s)
                if not done:
                    # A SUB socket never reports a dead publisher: ask the control socket.
                    reply = await self.link.request(StatusCmd(), min(1.5, self.command_timeout_s))
                    if reply.ok and isinstance(reply.data, dict):
                        self.model.apply_snapshot(_snapshot(reply.data))
                    continue
                item = pending.result()
                pending = asyncio.ensure_future(anext(stream))
                if isinstance(item, Snapshot):
                    self.model.apply_snapshot(item)
                elif isinstance(item, Event):
                    self.model.apply_event(item)
        except StopAsyncIteration:
            return
        finally:
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending

    # --- render tick ----------------------------------------------------------------------

    def render_tick(self) -> None:
        """Push the latest state into the widgets, in one batch, only where it changed."""
        model = self.model
        link = model.link()
        snapshot = model.snapshot
        with self.batch_update():
            self.header_bar.show(
                run_name=snapshot.run_name if snapshot else self.link.run_name,
                endpoint=self.link.label,
                link=link,
                age=model.age(),
                step=snapshot.step if snapshot else None,
                total_steps=snapshot.total_steps if snapshot else None,
                lag_bound=snapshot.lag_bound if snapshot else None,
                readonly=self.readonly,
                width=self.size.width,
            )
            disconnected = link is Link.DISCONNECTED
            if self.body.has_class("-disconnected") != disconnected:
                self.body.set_class(disconnected, "-disconnected")
                # Dim (or undim) every panel now, border titles included, not as each one
                # happens to repaint.
                self.refresh_css(animate=False)
            self._flush_events()
            if snapshot is None or (snapshot.seq == model.seq_applied and not self._dirty):
                return
            self._dirty = False
            model.seq_applied = snapshot.seq
            self.queue_meter.show(snapshot, model.queue_depth)
            self.lag_meter.show(snapshot)
            self.trainer_meter.show(
                snapshot,
                {
                    "reward": model.reward,
                    "loss": model.loss,
                    "iteration": model.iteration_s,
                    "samples": model.samples_per_s,
                },
            )
            self.bubble_panel.show(snapshot, wide=self.wide)
            self.scheduler_meter.show(snapshot, model.predictor_rho, wide=self.wide)
            table = self.table
            self.marked &= {instance.instance_id for instance in snapshot.instances}
            shown = table.sync(snapshot.instances, model.pending, self.marked)
            title = f"Instances ({shown}/{len(snapshot.instances)})"
            if self.marked:
                title += f" · {len(self.marked)} marked"
            if table.filter_text:
                title += f" · filter {table.filter_text!r}"
            table.border_title = title
        self.post_message(msg.SnapshotApplied(snapshot.seq, snapshot.step))

    def on_resize(self) -> None:
        self._dirty = True

    def _flush_events(self) -> None:
        new_events = self.model.take_new_events()
        for event in new_events:
            self.event_log.add_event(event)
        if new_events:
            self.event_log.scroll_end(animate=False)

    # --- targets ----------------------------------------------------------------------------

    def targets(self) -> list[int]:
        """Marked instances, or else the highlighted one."""
        if self.marked:
            return sorted(self.marked)
        highlighted = self.table.highlighted_id()
        return [] if highlighted is None else [highlighted]

    # --- actions ------------------------------------------------------------------------------

    def _refuse_readonly(self, name: str) -> bool:
        if not self.readonly:
            return False
        self._refused(name, "read-only dashboard (--readonly): commands are disabled")
        return True

    def _refused(self, name: str, reason: str) -> None:
        self.post_message(msg.CommandRefused(name, reason))
        self.event_log.add_local(self.wall_clock(), "refused", f"{name}: {reason}")
        self.notify(reason, title=f"{name} refused", severity="error")

    def action_detach(self) -> None:
        """Leave the run going: only this dashboard exits."""
        self.exit(0)

    def action_toggle_mark(self) -> None:
        highlighted = self.table.highlighted_id()
        if highlighted is None:
            return
        self.marked ^= {highlighted}
        self._dirty = True
        self.post_message(msg.InstancesMarked(sorted(self.marked)))
        self.table.action_cursor_down()

    def action_clear(self) -> None:
        table = self.table
        if self.marked:
            self.marked.clear()
            self.post_message(msg.InstancesMarked([]))
        elif table.filter_text:
            self._apply_filter("")
        self._dirty = True

    def action_filter(self) -> None:
        field = self.filter_input
        field.display = True
        field.focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        if event.input.id == "filter":
            self._apply_filter(event.value)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id == "filter":
            field = self.filter_input
            field.display = bool(field.value)
            self.table.focus()

    def _apply_filter(self, text: str) -> None:
        table = self.table
        table.filter_text = text.strip()
        field = self.filter_input
        if not text and field.value:
            field.value = ""
        if not text and not field.has_focus:
            field.display = False
        self._dirty = True
        self.render_tick()

    def action_help(self) -> None:
        self.push_screen(HelpScreen(self.help_rows()))

    def help_rows(self) -> list[tuple[str, str]]:
        rows = [("j/k, ↑/↓", "move the highlight"), ("space", "mark or unmark an instance")]
        seen = set()
        for binding in [*self.BINDINGS, *InstanceTable.BINDINGS]:
            if not isinstance(binding, Binding) or binding.action in seen:
                continue
            seen.add(binding.action)
            if binding.action in {"cursor_down", "cursor_up", "app.toggle_mark"}:
                continue
            keys = self._current_keys(binding)
            rows.append((keys, binding.description))
        rows.append(("ctrl+p, :", "command palette (every action, live entries)"))
        if self.readonly:
            rows.append(("", "READ-ONLY: commands are disabled"))
        return rows

    def _current_keys(self, binding: Binding) -> str:
        keys = self._keymap.get(binding.id or "", binding.key)
        names = {
            "question_mark": "?",
            "slash": "/",
            "colon": ":",
            "plus": "+",
            "minus": "-",
            "equals_sign": "=",
            "escape": "esc",
        }
        return ", ".join(names.get(key, key) for key in keys.split(","))

    def action_toggle_pause(self) -> None:
        """Pause the targets, or resume them when every target is already paused."""
        ids = self.targets()
        if not ids:
            return
        states = {i: self.model.instance_state(i) for i in ids}
        if all(state == "paused" for state in states.values()):
            self.action_resume(ids)
        else:
            self.action_pause([i for i in ids if states[i] != "paused"])

    def action_pause(self, ids: Iterable[int] | None = None) -> None:
        ids = sorted(ids if ids is not None else self.targets())
        if self._refuse_readonly("pause") or not ids:
            return
        groups = self._in_flight(ids)
        them, their = ("it", "its") if len(ids) == 1 else ("them", "their")
        body = (
            f"Pause {_plural(len(ids), 'instance')}: {_id_list(ids)}.\n"
            f"No new groups go to {them}; {their} {_plural(groups, 'in-flight group')} "
            "are kept and finish after resume."
        )
        self._confirm(
            "Pause instances",
            body,
            "Pause",
            "pause",
            lambda: self._send(
                PauseInstances(ids=ids),
                pending=(ids, "pausing", ("paused",)),
                on_ok=lambda reply: msg.InstancesPaused(ids),
            ),
        )

    def action_resume(self, ids: Iterable[int] | None = None) -> None:
        ids = sorted(ids if ids is not None else self.targets())
        if self._refuse_readonly("resume") or not ids:
            return
        body = f"Resume {_plural(len(ids), 'instance')}: {_id_list(ids)}."
        self._confirm(
            "Resume instances",
            body,
            "Resume",
            "resume",
            lambda: self._send(
                ResumeInstances(ids=ids),
                pending=(ids, "resuming", ("running", "syncing")),
                on_ok=lambda reply: msg.InstancesResumed(ids),
            ),
        )

    def action_restart(self, ids: Iterable[int] | None = None) -> None:
        ids = sorted(ids if ids is not None else self.targets())
        if self._refuse_readonly("restart") or not ids:
            return
        body = (
            f"Restart {_plural(len(ids), 'instance')}: {_id_list(ids)}.\n"
            f"{_plural(self._in_flight(ids), 'in-flight group')} on "
            f"{'it' if len(ids) == 1 else 'them'} are aborted and re-queued."
        )
        self._confirm(
            "Restart instances",
            body,
            "Restart",
            "restart",
            lambda: self._send(
                RestartInstances(ids=ids),
                pending=(ids, "restarting", ("starting", "running")),
                on_ok=lambda reply: msg.InstancesRestarted(ids),
            ),
        )

    def action_set_lag_bound(self) -> None:
        if self._refuse_readonly("set_lag_bound"):
            return
        snapshot = self.model.snapshot
        if snapshot is None:
            self._refused("set_lag_bound", "no data from the controller yet")
            return

        def chosen(value: int | None) -> None:
            if value is None:
                self.post_message(msg.CommandCancelled("set_lag_bound"))
            else:
                self._confirm_lag_bound(value)

        self.push_screen(LagBoundDialog(snapshot.lag_bound, self.max_lag_bound), chosen)

    def action_lag_up(self) -> None:
        self._step_bound(+1)

    def action_lag_down(self) -> None:
        self._step_bound(-1)

    def _step_bound(self, delta: int) -> None:
        if self._refuse_readonly("set_lag_bound"):
            return
        snapshot = self.model.snapshot
        if snapshot is None:
            self._refused("set_lag_bound", "no data from the controller yet")
            return
        base = snapshot.pending_lag_bound
        value = (snapshot.lag_bound if base is None else base) + delta
        if not 0 <= value <= self.max_lag_bound:
            self._refused("set_lag_bound", f"η={value} is outside 0..{self.max_lag_bound}")
            return
        self._confirm_lag_bound(value)

    def _confirm_lag_bound(self, value: int) -> None:
        snapshot = self.model.snapshot
        old = snapshot.lag_bound if snapshot else None
        _, effect = self.model.lag_bound_effect(value)
        body = f"Lag bound η: {old} → {value}\n{effect}."
        self._confirm(
            "Change the lag bound",
            body,
            "Set bound",
            "set_lag_bound",
            lambda: self._send(
                SetLagBound(value=value),
                on_ok=lambda reply: msg.LagBoundChanged(old, value),
            ),
        )

    def action_stop(self) -> None:
        if self._refuse_readonly("stop"):
            return

        def chosen(confirmed: bool | None) -> None:
            if confirmed:
                self._send(StopRun(), on_ok=lambda reply: msg.RunStopRequested())
            else:
                self.post_message(msg.CommandCancelled("stop"))

        run_name = self.model.snapshot.run_name if self.model.snapshot else self.link.run_name
        self.push_screen(StopDialog(run_name), chosen)

    def _confirm(
        self, title: str, body: str, label: str, name: str, then: Callable[[], None]
    ) -> None:
        def chosen(confirmed: bool | None) -> None:
            if confirmed:
                then()
            else:
                self.post_message(msg.CommandCancelled(name))

        self.push_screen(ConfirmDialog(title, body, label), chosen)

    def _in_flight(self, ids: list[int]) -> int:
        snapshot = self.model.snapshot
        if snapshot is None:
            return 0
        wanted = set(ids)
        return sum(i.in_flight_groups for i in snapshot.instances if i.instance_id in wanted)

    # --- commands (each in its own worker, with a timeout) -------------------------------------

    def _send(
        self,
        command: Command,
        *,
        on_ok: Callable[[CommandReply], Message | None],
        pending: tuple[list[int], str, tuple[str, ...]] | None = None,
    ) -> None:
        if pending is not None:
            ids, verb, targets = pending
            self.model.add_pending(ids, verb, targets)
            self._dirty = True
        self.run_worker(
            partial(self._command, command, on_ok, pending[0] if pending else []),
            group="commands",
            exit_on_error=False,
            description=f"command {command.name}",
        )

    async def _command(
        self,
        command: Command,
        on_ok: Callable[[CommandReply], Message | None],
        pending_ids: list[int],
    ) -> None:
        name = command.name
        try:
            reply = await self.link.request(command, self.command_timeout_s)
        except Exception as exc:  # timeout, unreachable, zmq error: the command got no answer
            self.model.clear_pending(pending_ids)
            self._dirty = True
            error = str(exc) or f"no reply within {self.command_timeout_s:.0f}s"
            self.post_message(msg.CommandFailed(name, error))
            self.event_log.add_local(self.wall_clock(), "failed", f"{name}: {error}")
            self.notify(error, title=f"{name} failed", severity="error")
            return
        if not reply.ok:
            self.model.clear_pending(pending_ids)
            self._dirty = True
            self._refused(name, reply.reason or "refused by the controller")
            return
        message = on_ok(reply)
        if message is not None:
            self.post_message(message)

    # --- palette --------------------------------------------------------------------------------

    def palette_entries(self) -> list[PaletteEntry]:
        """Every action, plus live ones ("Resume all 3 paused")."""
        entries = []
        paused = self.model.instance_ids({"paused"})
        running = self.model.instance_ids({"running", "syncing"})
        down = self.model.instance_ids({"down"})
        for verb, ids, state, action in (
            ("Resume", paused, "paused", self.action_resume),
            ("Pause", running, "running", self.action_pause),
            ("Restart", down, "down", self.action_restart),
        ):
            if len(ids) == 1:
                title = f"{verb} the {state} instance {ids[0]}"
            elif ids:
                title = f"{verb} all {len(ids)} {state}"
            else:
                continue
            entries.append(PaletteEntry(title, _id_list(ids), partial(action, ids)))
        targets = self.targets()
        if targets:
            what = _id_list(targets)
            entries += [
                PaletteEntry(f"Pause/resume {what}", "p", self.action_toggle_pause),
                PaletteEntry(f"Restart {what}", "R", self.action_restart),
            ]
        snapshot = self.model.snapshot
        bound = snapshot.lag_bound if snapshot else None
        entries += [
            PaletteEntry("Set the lag bound…", f"L (now η={bound})", self.action_set_lag_bound),
            PaletteEntry("Raise the lag bound by 1", "+", self.action_lag_up),
            PaletteEntry("Lower the lag bound by 1", "-", self.action_lag_down),
            PaletteEntry("Filter instances…", "/", self.action_filter),
            PaletteEntry("Clear marks and filter", "esc", self.action_clear),
            PaletteEntry("Help: keys", "?", self.action_help),
            PaletteEntry("Save a screenshot (SVG)", "", self.action_screenshot),
            PaletteEntry("Detach (the run keeps going)", "q", self.action_detach),
            PaletteEntry("Stop the run…", "S, asks for the run name", self.action_stop),
        ]
        if self.readonly:
            entries = [
                PaletteEntry(e.title + " (read-only)", e.help, e.run) if _sends_command(e) else e
                for e in entries
            ]
        return entries

    def action_screenshot(self) -> None:
        path = self.save_screenshot()
        self.notify(f"saved {path}", title="screenshot")

    # --- terminal going away --------------------------------------------------------------------

    def _install_hangup(self) -> None:
        """Exit cleanly on SIGHUP (SSH dropped) and when stdin stops being a TTY."""
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self._hangup)
        self.set_interval(5.0, self._watch_tty)

    def _hangup(self) -> None:
        self.exit(0)

    def _watch_tty(self) -> None:
        with contextlib.suppress(Exception):
            if not sys.stdin.isatty():
                self.exit(0)


def _snapshot(data: dict) -> Snapshot:
    import msgspec

    return msgspec.convert(data, Snapshot)


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" + ("" if count == 1 else "s")


def _id_list(ids: list[int]) -> str:
    shown = ", ".join(str(i) for i in ids[:8])
    return shown + (f" and {len(ids) - 8} more" if len(ids) > 8 else "")


def _sends_command(entry: PaletteEntry) -> bool:
    func = getattr(entry.run, "func", entry.run)
    name = getattr(func, "__name__", "")
    return name.removeprefix("action_") in COMMAND_ACTIONS


def make_app(
    link: TelemetryLink,
    *,
    readonly: bool = False,
    render_hz: float = 10.0,
    **options: Any,
) -> Dashboard:
    """The app factory (posting's ``make_posting``): tests pass the link they need."""
    if render_hz <= 0:
        raise ValueError(f"render_hz: {render_hz} must be > 0")
    return Dashboard(link, readonly=readonly, render_hz=render_hz, **options)
