"""The instance table: keyed rows, cells updated in place only when they change."""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

from rich.text import Text
from textual.binding import Binding
from textual.cache import LRUCache
from textual.widgets import DataTable
from textual.widgets.data_table import ColumnKey

from asp_tui.format import percent, state_label
from asp_tui.model import Pending
from runtime.protocol import InstanceSnapshot, Lane

COLUMNS = (
    ("mark", " ", 1),
    ("id", "id", 3),
    ("state", "state", 12),
    ("lane", "lane", 4),
    ("inflight", "grp", 3),
    ("seqs", "seqs", 5),
    ("tps", "tok/s", 5),
    ("version", "ver", 4),
    ("behind", "bhd", 3),
    ("bubble", "bub%", 4),
    ("note", "note", 12),
)
"""Fixed widths (key, label, width) that fit 80 columns, so values never reflow the table
(``bhd``: weight versions behind the trainer; ``bub%``: the window's bubble share)."""

STATE_THEME = {
    "running": "success",
    "paused": "warning",
    "syncing": "accent",
    "down": "error",
    "starting": "secondary",
}


class InstanceTable(DataTable):
    """One row per instance (key = instance id). j/k move, space marks."""

    BINDINGS: ClassVar = [
        Binding("j", "cursor_down", "Down", show=False, id="table.down"),
        Binding("k", "cursor_up", "Up", show=False, id="table.up"),
        Binding("g", "scroll_top", "Top", show=False, id="table.top"),
        Binding("G", "scroll_bottom", "Bottom", show=False, id="table.bottom"),
        Binding("space", "app.toggle_mark", "Mark", id="table.mark"),
    ]

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, cursor_type="row", zebra_stripes=False)
        self._cells: dict[int, tuple] = {}
        self._palette: dict[str, str] = {}
        self._cell_cache: LRUCache[tuple, object] = LRUCache(8192)
        self.filter_text = ""

    def on_resize(self) -> None:
        """Give the note column whatever width the table has left (notes can be long)."""
        column = self.columns.get(ColumnKey("note"))
        if column is None:
            return
        fixed = sum(width for key, _, width in COLUMNS if key != "note")
        padding = 2 * self.cell_padding * len(COLUMNS)
        # From the outer size, always leaving 2 cells for a scrollbar: whether one is showing
        # at resize time is a race, and the width must not depend on it.
        inner = self.size.width - self.styles.gutter.width - 2
        width = max(12, inner - fixed - padding - 2)
        if width != column.width:
            column.width = width
            # DataTable has no public "resize a column": bump what its caches key on.
            self._update_count += 1
            self._require_update_dimensions = True
            self.refresh()

    def _clear_caches(self) -> None:
        super()._clear_caches()
        if hasattr(self, "_cell_cache"):  # DataTable.__init__ may call this first
            self._cell_cache.clear()

    def notify_style_update(self) -> None:
        # A CSS change (the theme, the dimming while disconnected) restyles every cell.
        super().notify_style_update()
        if hasattr(self, "_cell_cache"):
            self._cell_cache.clear()
        self._palette = {}

    def _render_cell(
        self,
        row_index: int,
        column_index: int,
        base_style,
        width: int,
        cursor: bool = False,
        hover: bool = False,
    ):
        """DataTable drops its whole render cache on any ``update_cell``; at 10 Hz with every
        row changing a cell or two, that re-renders every visible cell per tick. Cache by the
        cell's *value* instead, so only cells that changed are rendered again."""
        if row_index < 0 or column_index < 0:
            return super()._render_cell(row_index, column_index, base_style, width, cursor, hover)
        row_key = self._row_locations.get_key(row_index)
        column_key = self._column_locations.get_key(column_index)
        value = self._data[row_key][column_key]
        identity = (value.plain, str(value.style)) if isinstance(value, Text) else value
        key = (
            row_key,
            column_key,
            row_index,
            identity,
            base_style,
            width,
            cursor,
            hover,
            self._show_hover_cursor,
            self.show_cursor,
            self._pseudo_class_state,
        )
        lines = self._cell_cache.get(key)
        if lines is None:
            lines = super()._render_cell(row_index, column_index, base_style, width, cursor, hover)
            self._cell_cache[key] = lines
        return lines

    def on_mount(self) -> None:
        for key, label, width in COLUMNS:
            self.add_column(label, key=key, width=width)
        self.border_title = "Instances"

    def _state_cell(self, instance: InstanceSnapshot, pending: Pending | None) -> Text:
        if pending is not None:
            return Text(state_label(instance.state, pending.verb), style="italic")
        if not self._palette:
            # Colours come from the active theme's variables, looked up once per render pass.
            variables = self.app.get_css_variables()
            self._palette = {state: variables.get(name, "") for state, name in STATE_THEME.items()}
        return Text(state_label(instance.state), style=self._palette.get(instance.state, ""))

    def row_values(
        self, instance: InstanceSnapshot, pending: Pending | None, marked: bool
    ) -> tuple:
        seqs = (
            f"{instance.running_seqs}/{instance.max_num_seqs}"
            if instance.max_num_seqs
            else str(instance.running_seqs)
        )
        return (
            "●" if marked else " ",
            str(instance.instance_id),
            self._state_cell(instance, pending),
            # The tail lane is the exception worth seeing at a glance (by word, in bold).
            Text(instance.lane, style="bold") if instance.lane != Lane.BULK else instance.lane,
            str(instance.in_flight_groups),
            seqs,
            _rate(instance.tokens_per_s),
            f"v{instance.weight_version}",
            str(instance.versions_behind) if instance.versions_behind else "·",
            percent(instance.bubble_share),
            # The controller's note: what the instance waits for ("weights v12", "admission").
            instance.pending or _restarts(instance.restarts),
        )

    def matches(self, instance: InstanceSnapshot) -> bool:
        """``/`` filter: every word must match the id (exactly), or the state or the lane (as a
        prefix)."""
        for word in self.filter_text.lower().split():
            if word.isdigit():
                if int(word) != instance.instance_id:
                    return False
            elif not (
                instance.state.startswith(word)
                or instance.lane.startswith(word)
                or word in (instance.pending or "")
            ):
                return False
        return True

    def sync(
        self,
        instances: Iterable[InstanceSnapshot],
        pending: dict[int, Pending],
        marked: set[int],
    ) -> int:
        """Bring the rows in line with a snapshot; returns how many rows are shown."""
        wanted = [instance for instance in instances if self.matches(instance)]
        wanted_ids = {instance.instance_id for instance in wanted}
        for instance_id in [i for i in self._cells if i not in wanted_ids]:
            self.remove_row(str(instance_id))
            del self._cells[instance_id]
        added = False
        for instance in wanted:
            instance_id = instance.instance_id
            values = self.row_values(instance, pending.get(instance_id), instance_id in marked)
            old = self._cells.get(instance_id)
            if old is None:
                self.add_row(*values, key=str(instance_id))
                added = True
            else:
                for (column, _, _), before, after in zip(COLUMNS, old, values, strict=True):
                    if before != after:
                        self.update_cell(str(instance_id), column, after)
            self._cells[instance_id] = values
        if added:
            self.sort("id", key=int)
        return len(wanted)

    def highlighted_id(self) -> int | None:
        if not self.row_count:
            return None
        try:
            row_key, _ = self.coordinate_to_cell_key(self.cursor_coordinate)
        except Exception:
            return None
        return int(row_key.value) if row_key.value is not None else None

    def shown_ids(self) -> list[int]:
        return sorted(self._cells)

    def reset_palette(self) -> None:
        self._palette = {}


def _restarts(count: int) -> str:
    if not count:
        return ""
    return f"{count} restart" + ("" if count == 1 else "s")


def _rate(tokens_per_s: float) -> str:
    """Fits the 5-cell column: ``384``, ``9012``, ``31.3k``, ``131k``."""
    if tokens_per_s < 10_000:
        return f"{tokens_per_s:.0f}"
    if tokens_per_s < 100_000:
        return f"{tokens_per_s / 1000:.1f}k"
    return f"{tokens_per_s / 1000:.0f}k"
