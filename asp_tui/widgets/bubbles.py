"""The bubble breakdown: where rollout capacity went, as stacked bars for window and run."""

from __future__ import annotations

from textual.content import Content
from textual.widgets import Static

from asp_tui.format import BUBBLE_GLYPHS, bar_segments, normalised, percent, top_cause_words
from asp_tui.widgets.meters import Resizable
from runtime.protocol import BUBBLE_CATEGORIES, Snapshot

BUBBLE_STYLES = {
    "useful": "$success",
    "padding": "$warning",
    "skewness": "$error",
    "sorting": "$accent",
    "sync": "$primary",
    "paused": "$secondary",
    "down": "$error-darken-2",
    "idle": "$foreground-darken-3",
}
"""Colour is extra: every category also has its own fill glyph (format.BUBBLE_GLYPHS)."""

SHORT_NAMES = {
    "useful": "useful",
    "padding": "pad",
    "skewness": "skew",
    "sorting": "sort",
    "sync": "sync",
    "paused": "pause",
    "down": "down",
    "idle": "idle",
}


def legend(short: bool) -> Content:
    parts: list[str | tuple[str, str]] = []
    for name in BUBBLE_CATEGORIES:
        parts += [(BUBBLE_GLYPHS[name], BUBBLE_STYLES[name]), SHORT_NAMES[name] if short else name]
        parts.append(" ")
    return Content.assemble(*parts)


def bar(bubbles: dict[str, float], width: int) -> Content:
    segments = bar_segments(bubbles, width)
    if not segments:
        return Content("╌" * width)
    return Content.assemble(
        *[(BUBBLE_GLYPHS[name] * cells, BUBBLE_STYLES[name]) for name, cells in segments]
    )


class BubblePanel(Resizable, Static):
    """Two stacked bars (window, run so far), the top cause in words and a legend."""

    def on_mount(self) -> None:
        self.border_title = "Bubbles"

    def show(self, snapshot: Snapshot, wide: bool) -> None:
        self._last = (snapshot, wide)
        width = max(self.content_size.width, 20)
        label_width = 7
        share_width = 12
        bar_width = max(width - label_width - share_width, 8)
        lines: list[Content] = []
        for title, bubbles in (
            ("window", snapshot.bubbles_window),
            ("run", snapshot.bubbles_total),
        ):
            useful = normalised(bubbles)["useful"]
            lines.append(
                Content.assemble(
                    (f"{title:<{label_width}}", "bold"),
                    bar(bubbles, bar_width),
                    f" useful {percent(useful):>4}",
                )
            )
        lines.append(
            Content.assemble(
                ("window ", "bold"), top_cause_words(snapshot.bubbles_window, short=not wide)
            )
        )
        if wide:
            lines.append(
                Content.assemble(("run    ", "bold"), top_cause_words(snapshot.bubbles_total))
            )
            lines.append(legend(short=True))
            self.border_title = "Bubbles: where rollout capacity went"
        else:
            self.border_title = Content.assemble("Bubbles ", legend(short=True))
        self.update(Content("\n").join(lines), layout=False)
