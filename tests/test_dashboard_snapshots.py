"""SVG snapshots of the dashboard at 80×24 and 140×40: connected, confirm dialog, disconnected.

A ``FixedLink`` feeds a fixed Snapshot and history, and the app's clock is frozen, so the age
text and every number on screen are the same on every run.
"""

from __future__ import annotations

import random

import pytest

from asp_tui.app import Dashboard, make_app
from asp_tui.link import FixedLink
from asp_tui.model import Backoff, Link
from asp_tui.samples import BASE_TIME, sample_events, sample_history, sample_snapshot

SIZES = [(80, 24), (140, 40)]


class FrozenClock:
    """Monotonic time that moves only when a test says so."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def build(instances: int, *, drop: bool = False) -> tuple[Dashboard, FrozenClock]:
    clock = FrozenClock()
    link = FixedLink(
        [sample_snapshot(instances)],
        history=sample_history(instances),
        history_events=sample_events(),
        drop_after_items=drop,
    )
    app = make_app(
        link,
        clock=clock,
        wall_clock=lambda: BASE_TIME + 50,
        backoff=Backoff(rng=random.Random(0)),
    )
    return app, clock


async def wait_for(pilot, predicate, what: str) -> None:
    for _ in range(200):
        if predicate():
            return
        await pilot.pause(0.05)
    raise AssertionError(f"never saw {what}")


async def settle(pilot, app: Dashboard, link: Link) -> None:
    """Wait until the data is on screen and the badge and the dimming show ``link``."""
    dimmed = link is Link.DISCONNECTED
    await wait_for(pilot, lambda: app.model.seq_applied >= 0, "data on screen")
    await wait_for(pilot, lambda: app.model.link() is link, f"{link}")
    await wait_for(pilot, lambda: link.value in str(app.header_bar.render()), "the badge")
    await wait_for(pilot, lambda: app.body.has_class("-disconnected") == dimmed, "dimming")
    await pilot.pause(0.2)
    await pilot.wait_for_scheduled_animations()


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_connected(snap_compare, size):
    """Live data: header badge LIVE, meters, bubble bars, instance table, event log."""
    app, _ = build(8 if size[0] < 120 else 64)

    async def run_before(pilot) -> None:
        await settle(pilot, app, Link.LIVE)

    assert snap_compare(app, terminal_size=size, run_before=run_before)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_confirm_dialog(snap_compare, size):
    """``p`` on the highlighted instance opens the pause confirm with Cancel focused."""
    app, _ = build(8 if size[0] < 120 else 64)

    async def run_before(pilot) -> None:
        await settle(pilot, app, Link.LIVE)
        await pilot.press("p")
        await pilot.pause(0.2)

    assert snap_compare(app, terminal_size=size, run_before=run_before)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_disconnected(snap_compare, size):
    """The controller went away 12 s ago: DISCONNECTED badge with the age, last data dimmed."""
    app, clock = build(8 if size[0] < 120 else 64, drop=True)

    async def run_before(pilot) -> None:
        await settle(pilot, app, Link.DISCONNECTED)
        clock.now += 12
        await wait_for(pilot, lambda: "12s ago" in str(app.header_bar.render()), "the age")
        await pilot.pause(0.2)

    assert snap_compare(app, terminal_size=size, run_before=run_before)
