"""Bubble windows built from the shared accountant, and the telemetry ring buffer."""

from __future__ import annotations

import pytest

from runtime.bubbles import BubbleAccountant
from runtime.controller.telemetry import BubbleWindows, Telemetry
from runtime.protocol import Event, Snapshot


def test_step_intervals_and_rolling_window():
    acc = BubbleAccountant({0: 4, 1: 4}, now=0.0)
    windows = BubbleWindows(acc, window_s=1.0, now=0.0, capacity_of=lambda i: 4)
    acc.update(0, 0.0, active=4, cause="idle")
    acc.update(1, 0.0, active=2, cause="padding")
    first = windows.step_interval(2.0)
    assert first["useful"] == pytest.approx(6 / 8)
    assert first["padding"] == pytest.approx(2 / 8)
    acc.update(0, 2.0, active=0, cause="sync")
    acc.update(1, 2.0, active=0, cause="paused")
    windows.tick(2.0)
    frac, shares, total = windows.tick(3.0)
    # The last second only: both instances were out of service.
    assert frac["sync"] == pytest.approx(0.5) and frac["paused"] == pytest.approx(0.5)
    assert shares[0] == pytest.approx(1.0)
    assert total.fractions["useful"] == pytest.approx(12 / 24)
    second = windows.step_interval(3.0)
    assert second["useful"] == pytest.approx(0.0) and sum(second.values()) == pytest.approx(1.0)


def test_ring_buffer_keeps_the_latest():
    seen = []
    tel = Telemetry(None, ring_size=3, on_event=seen.append)
    for k in range(5):
        tel.publish_snapshot(
            Snapshot(
                run_name="r",
                time=k,
                seq=k,
                state="running",
                step=k,
                total_steps=9,
                weight_version=k,
                lag_bound=1,
            )
        )
        tel.publish_event(Event(time=k, kind="run", message=f"e{k}"))
    history = tel.history()
    assert [s["seq"] for s in history["snapshots"]] == [2, 3, 4]
    assert [e["message"] for e in history["events"]] == ["e2", "e3", "e4"]
    assert len(seen) == 5 and tel.latest.seq == 4
    assert [s["seq"] for s in tel.history(limit=1)["snapshots"]] == [4]
