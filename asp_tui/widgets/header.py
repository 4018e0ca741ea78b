"""The one-line run header: run name, endpoint, connection badge and trainer step."""

from __future__ import annotations

from textual.content import Content
from textual.widgets import Static

from asp_tui.format import age_words
from asp_tui.model import Link

_BADGE_STYLES = {
    Link.CONNECTING: "bold $warning",
    Link.LIVE: "bold $success",
    Link.STALE: "bold $warning",
    Link.DISCONNECTED: "bold $error",
}
_BADGE_GLYPHS = {
    Link.CONNECTING: "◌",
    Link.LIVE: "●",
    Link.STALE: "◐",
    Link.DISCONNECTED: "✖",
}


def badge_text(link: Link, age: float | None) -> str:
    """``● LIVE``, ``◐ STALE 4s``, ``✖ DISCONNECTED (last data 12s ago)``."""
    text = f"{_BADGE_GLYPHS[link]} {link.value}"
    if link is Link.STALE and age is not None:
        text += f" {age_words(age)}"
    elif link is Link.DISCONNECTED and age is not None:
        text += f" (last data {age_words(age)} ago)"
    return text


class RunHeader(Static):
    """Repaints only when its text changes (the age ticks once a second at most)."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__("", id=id)
        self._shown: tuple = ()

    def show(
        self,
        *,
        run_name: str,
        endpoint: str,
        link: Link,
        age: float | None,
        step: int | None,
        total_steps: int | None,
        lag_bound: int | None,
        readonly: bool,
        width: int,
    ) -> None:
        key = (
            run_name,
            endpoint,
            link,
            None if age is None else int(age),
            step,
            total_steps,
            lag_bound,
            readonly,
            width,
        )
        if key == self._shown:
            return
        self._shown = key
        step_text = "step —" if step is None else f"step {step}/{total_steps}"
        bound_text = "" if lag_bound is None else f"  η={lag_bound}"
        badge = (badge_text(link, age), _BADGE_STYLES[link])
        tail: list[str | tuple[str, str]] = ["  ", badge, "  ", (step_text, "bold"), bound_text]
        if readonly:
            tail += ["  ", ("READ-ONLY", "bold $warning")]
        head: list[str | tuple[str, str]] = [
            (" ASP-TUI ", "bold reverse $primary"),
            " ",
            (run_name, "bold"),
        ]
        full = Content.assemble(*head, "  ", (endpoint, "$text-muted"), *tail)
        # The endpoint is the first thing to go when the terminal is narrow.
        content = full if full.cell_length <= width else Content.assemble(*head, *tail)
        self.update(content, layout=False)
