"""Pilot tests of the dashboard's own behaviour on fixed data (no controller needed).

The live-controller tests are in ``test_dashboard_live.py``; these cover what does not need one:
dialogs and their defaults, read-only refusals, marks, the filter, the palette's live entries,
the help screen and the plain-text formatting.
"""

from __future__ import annotations

import random

import msgspec
import pytest
from textual.widgets import Button

from asp_tui import messages as msg
from asp_tui.app import Dashboard, make_app
from asp_tui.cli import build_parser
from asp_tui.cli import main as cli_main
from asp_tui.format import bar_segments, bubble_bar, gauge, once_text, top_cause_words
from asp_tui.link import FixedLink
from asp_tui.model import Backoff, DashboardModel, Link
from asp_tui.samples import sample_events, sample_history, sample_snapshot
from asp_tui.widgets.dialogs import ConfirmDialog, HelpScreen, LagBoundDialog, StopDialog
from asp_tui.widgets.instances import InstanceTable


def build(readonly: bool = False, instances: int = 8) -> tuple[Dashboard, FixedLink]:
    link = FixedLink(
        [sample_snapshot(instances)],
        history=sample_history(instances),
        history_events=sample_events(),
    )
    return make_app(link, readonly=readonly, backoff=Backoff(rng=random.Random(0))), link


async def ready(pilot, app: Dashboard) -> None:
    for _ in range(100):
        if app.model.seq_applied >= 0:
            return
        await pilot.pause(0.05)
    raise AssertionError("no snapshot reached the widgets")


def of_type(messages: list, kind: type) -> list:
    return [m for m in messages if isinstance(m, kind)]


def commands_sent(link: FixedLink) -> list[str]:
    return [name for name, _ in link.requests if name not in ("status", "history")]


async def test_backfill_and_connected_messages():
    app, _ = build()
    seen: list = []
    async with app.run_test(size=(80, 24), message_hook=seen.append) as pilot:
        await ready(pilot, app)
        (backfill,) = of_type(seen, msg.HistoryBackfilled)
        assert (backfill.snapshots, backfill.events) == (40, 4)
        assert of_type(seen, msg.Connected)[0].run_name == "sim-demo"
        # Trainer sparklines: one point per backfilled step (1..40), then the live step 42.
        assert len(app.model.reward) == 41
        assert app.model.link() is Link.LIVE
        assert app.query_one(InstanceTable).row_count == 8


async def test_confirm_defaults_to_cancel():
    """Enter on the dialog presses the focused button, which is Cancel: nothing is sent."""
    app, link = build()
    seen: list = []
    async with app.run_test(size=(80, 24), message_hook=seen.append) as pilot:
        await ready(pilot, app)
        await pilot.press("p")
        await pilot.pause()
        assert isinstance(app.screen, ConfirmDialog)
        assert app.screen.focused is app.screen.query_one("#cancel", Button)
        await pilot.press("enter")
        await pilot.pause()
        assert not isinstance(app.screen, ConfirmDialog)
        await pilot.press("p", "n")
        await pilot.pause()
        await pilot.press("p", "escape")
        await pilot.pause()
        assert [m.name for m in of_type(seen, msg.CommandCancelled)] == ["pause"] * 3
        assert commands_sent(link) == []


async def test_refusal_shows_the_controllers_reason():
    """``p`` + ``y`` sends pause for the highlighted instance; a refusal reaches the log."""
    app, link = build()
    seen: list = []
    async with app.run_test(size=(80, 24), message_hook=seen.append) as pilot:
        await ready(pilot, app)
        await pilot.press("j", "p", "y")
        for _ in range(40):
            if of_type(seen, msg.CommandRefused):
                break
            await pilot.pause(0.05)
        assert link.requests[-1] == ("pause_instance", {"ids": [1]})
        (refused,) = of_type(seen, msg.CommandRefused)
        assert refused.name == "pause_instance"
        assert refused.reason == "fixed snapshot: no controller to act"
        assert app.model.pending == {}, "a refused command leaves no pending state"
        assert any("no controller to act" in line for line in app.event_log.lines)


async def test_readonly_refuses_every_command():
    app, link = build(readonly=True)
    seen: list = []
    async with app.run_test(size=(80, 24), message_hook=seen.append) as pilot:
        await ready(pilot, app)
        for key in ("p", "L", "plus", "minus", "R", "S"):
            await pilot.press(key)
            await pilot.pause()
            assert not isinstance(app.screen, ConfirmDialog | LagBoundDialog | StopDialog)
        names = [m.name for m in of_type(seen, msg.CommandRefused)]
        assert names == [
            "pause",
            "set_lag_bound",
            "set_lag_bound",
            "set_lag_bound",
            "restart",
            "stop",
        ]
        assert all("read-only" in m.reason for m in of_type(seen, msg.CommandRefused))
        assert commands_sent(link) == []
        assert "READ-ONLY" in str(app.header_bar.render())


async def test_marks_target_the_marked_instances():
    app, _ = build()
    seen: list = []
    async with app.run_test(size=(80, 24), message_hook=seen.append) as pilot:
        await ready(pilot, app)
        await pilot.press("space", "j", "space")  # marks 0, moves to 1... then 2
        await pilot.pause()
        assert app.marked == {0, 2}
        assert of_type(seen, msg.InstancesMarked)[-1].ids == [0, 2]
        await pilot.press("p")
        await pilot.pause()
        assert "2 instances: 0, 2" in str(app.screen.query_one(".dialog-body").render())
        await pilot.press("n", "escape")
        await pilot.pause()
        assert app.marked == set()


async def test_lag_bound_input_validates_and_confirm_shows_old_to_new():
    app, link = build()
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot, app)
        await pilot.press("L")
        await pilot.pause()
        assert isinstance(app.screen, LagBoundDialog)
        await pilot.press("9", "9", "enter")
        await pilot.pause()
        assert isinstance(app.screen, LagBoundDialog), "99 > max_lag_bound keeps the input open"
        assert "0 to 16" in str(app.screen.query_one("#lag-error").render())
        await pilot.press("backspace", "backspace", "1", "enter")
        await pilot.pause()
        assert isinstance(app.screen, ConfirmDialog)
        body = str(app.screen.query_one(".dialog-body").render())
        assert "2 → 1" in body
        # (42+2)·8+5 admitted, (42+1+1)·8 allowed at η=1: 5 groups over the new bound.
        assert "5 queued/in-flight groups" in body and "waited for" in body
        await pilot.press("escape")
        await pilot.press("plus")
        await pilot.pause()
        assert "2 → 3" in str(app.screen.query_one(".dialog-body").render())
        await pilot.press("escape")
        assert commands_sent(link) == []


async def test_filter_shows_matching_rows_only():
    app, _ = build(instances=64)
    async with app.run_test(size=(140, 40)) as pilot:
        await ready(pilot, app)
        table = app.query_one(InstanceTable)
        assert table.row_count == 64
        await pilot.press("slash", *"paused", "enter")
        await pilot.pause(0.2)
        paused = app.model.instance_ids({"paused"})
        assert table.shown_ids() == paused and len(paused) == 6
        assert table.has_focus
        await pilot.press("escape")
        await pilot.pause(0.2)
        assert table.row_count == 64


async def test_lanes_and_the_schedulers_step_are_shown_and_filterable():
    """The lane column says bulk or tail by word; ``/tail`` keeps the tail lane; the scheduler
    line shows the last step's deferred and migrated groups, the run's, and the predictor."""
    app, _ = build(instances=16)
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot, app)
        table = app.query_one(InstanceTable)
        lanes = {i: str(table.get_cell(str(i), "lane")) for i in table.shown_ids()}
        assert lanes[6] == lanes[14] == "tail"
        assert {lanes[i] for i in lanes if i not in (6, 14)} == {"bulk"}
        snap = app.model.snapshot
        want = f"deferred {snap.trainer.deferred} (run {snap.deferred_groups})"
        # The backfilled history may reach the meter after the live snapshot's first paint.
        for _ in range(40):
            text = str(app.scheduler_meter.text.render())
            if want in text:
                break
            await pilot.pause(0.05)
        assert want in text
        assert f"migrated {snap.trainer.migrated} (run {snap.migrated_groups})" in text
        assert f"ρ {snap.trainer.predictor_longest_rho:.2f} ×1.08" in text
        await pilot.press("slash", *"tail", "enter")
        await pilot.pause(0.2)
        assert table.shown_ids() == [6, 14]
    # One point per step that had a ρ: the 40 backfilled steps and the live one.
    assert len(app.model.predictor_rho) == 41


async def test_palette_has_live_entries_and_every_action():
    app, _ = build(instances=64)
    async with app.run_test(size=(140, 40)) as pilot:
        await ready(pilot, app)
        titles = [entry.title for entry in app.palette_entries()]
        assert "Resume all 6 paused" in titles
        assert "Restart the down instance 7" in titles
        assert "Pause all 57 running" in titles
        for action in (
            "Set the lag bound…",
            "Detach (the run keeps going)",
            "Stop the run…",
            "Filter instances…",
            "Help: keys",
        ):
            assert action in titles
        await pilot.press("colon")
        await pilot.pause(0.3)
        assert app.screen.__class__.__name__ == "CommandPalette"


async def test_help_lists_keys_and_stop_needs_the_run_name():
    app, link = build()
    seen: list = []
    async with app.run_test(size=(80, 24), message_hook=seen.append) as pilot:
        await ready(pilot, app)
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        keys = dict(app.help_rows())
        assert keys["q"].startswith("Detach") and keys["p"] == "Pause/Resume"
        await pilot.press("escape", "S")
        await pilot.pause()
        assert isinstance(app.screen, StopDialog)
        await pilot.press(*"wrong", "enter")
        await pilot.pause()
        assert isinstance(app.screen, StopDialog), "a wrong name stops nothing"
        await pilot.press("escape")
        await pilot.pause()
        assert commands_sent(link) == []
        assert of_type(seen, msg.CommandCancelled)[-1].name == "stop"


async def test_quit_detaches_with_exit_code_0():
    app, _ = build()
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot, app)
        await pilot.press("q")
        await pilot.pause()
    assert app.return_code == 0


def test_model_link_states_follow_the_clock():
    now = [100.0]
    model = DashboardModel(lambda: now[0], stale_after_s=1.5)
    assert model.link() is Link.CONNECTING
    model.apply_snapshot(sample_snapshot())
    assert model.link() is Link.LIVE
    now[0] += 2
    assert model.link() is Link.STALE
    model.mark_disconnected("gone")
    assert model.link() is Link.DISCONNECTED
    model.apply_snapshot(sample_snapshot(seq=421))
    assert model.link() is Link.LIVE


def test_backoff_is_capped_and_jittered():
    backoff = Backoff(initial_s=0.25, cap_s=5.0, rng=random.Random(1))
    delays = [backoff.next_delay() for _ in range(12)]
    assert all(0.125 <= d <= 5.0 for d in delays)
    assert max(delays[-4:]) > 2.5, "reaches the cap's range"
    assert len(set(delays)) == len(delays), "jittered, not lockstep"
    backoff.reset()
    assert backoff.next_delay() <= 0.25


def test_pending_clears_when_the_snapshot_shows_the_change():
    now = [0.0]
    model = DashboardModel(lambda: now[0])
    snapshot = sample_snapshot()
    model.apply_snapshot(snapshot)
    model.add_pending([0], "pausing", ("paused",))
    model.apply_snapshot(snapshot)
    assert 0 in model.pending, "still running: still pending"
    snapshot.instances[0].state = "paused"
    model.apply_snapshot(snapshot)
    assert model.pending == {}


def test_formatting():
    assert gauge(1, 2, 8) == "████····"
    assert gauge(5, 2, 4) == "████"
    bubbles = sample_snapshot().bubbles_window
    assert sum(cells for _, cells in bar_segments(bubbles, 37)) == 37
    assert len(bubble_bar(bubbles, 50)) == 50
    assert top_cause_words(bubbles) == "top loss: padding (uneven lengths) 14%"
    assert top_cause_words(bubbles, short=True) == "top loss: padding 14%"
    assert top_cause_words({}) == "not measured yet"
    text = once_text(sample_snapshot(64))
    for word in ("RUNNING", "PAUSED", "SYNCING", "DOWN"):
        assert f"  {word}" in text
    assert "step      42/200" in text and "bound η=2" in text
    assert text.count("\ninstance ") == 64 and "refused" not in text
    assert "scheduler deferred 14  migrated 8  (last step 1, 0)" in text
    assert "longest ρ 0.80  actual/predicted ×1.08" in text
    assert text.count(" tail lane") == 8  # every eighth instance, and no "bulk lane"
    refused = msgspec.structs.replace(sample_snapshot(), auth_refused={"control": 4, "rollout": 1})
    assert "refused   4 on control, 1 on rollout" in once_text(refused)


async def test_keys_can_be_remapped_by_binding_id():
    link = FixedLink([sample_snapshot()])
    app = make_app(link, keymap={"app.pause-resume": "P", "app.lag-bound": "b"})
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot, app)
        await pilot.press("p")
        await pilot.pause()
        assert not isinstance(app.screen, ConfirmDialog), "the old key no longer pauses"
        await pilot.press("P")
        await pilot.pause()
        assert isinstance(app.screen, ConfirmDialog)
        await pilot.press("escape", "b")
        await pilot.pause()
        assert isinstance(app.screen, LagBoundDialog)
        assert dict(app.help_rows())["P"] == "Pause/Resume"


async def test_main_screen_keys_do_nothing_under_a_dialog():
    app, link = build()
    link.requests.clear()
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot, app)
        await pilot.press("p")
        await pilot.pause()
        dialog = app.screen
        await pilot.press("q", "p", "L", "S")
        await pilot.pause()
        assert app.screen is dialog and app.is_running, "q must not detach behind a dialog"
        assert len(app.screen_stack) == 2
        assert commands_sent(link) == []


async def test_last_data_is_kept_and_dimmed_when_disconnected():
    colours = {}
    for drop in (False, True):
        link = FixedLink([sample_snapshot()], drop_after_items=drop)
        app = make_app(link, backoff=Backoff(initial_s=5.0, rng=random.Random(0)))
        async with app.run_test(size=(80, 24)) as pilot:
            await ready(pilot, app)
            await pilot.pause(0.3)
            assert app.model.link() is (Link.DISCONNECTED if drop else Link.LIVE)
            assert app.query_one(InstanceTable).row_count == 8, "the last data stays"
            # Line 12 is the cursor row (instance 0), line 13 a plain row: both are dimmed.
            for line in (12, 13):
                row = app.screen._compositor.render_strips()[line]
                colours[drop, line] = {s.style.color for s in row if s.text.strip() and s.style}
    for line in (12, 13):
        assert colours[False, line], line
        assert colours[True, line].isdisjoint(colours[False, line]), f"line {line} dimmed"


@pytest.mark.parametrize(("value", "why"), [("0", "outside 0.5..60 Hz"), ("fast", "not a number")])
def test_render_rate_flag_is_validated(value: str, why: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["attach", "runs/x", "--render-hz", value])
    assert exit_info.value.code == 2
    assert why in capsys.readouterr().err


def test_render_rate_flag_reaches_attach() -> None:
    args = build_parser().parse_args(["attach", "runs/x", "--render-hz", "2.5"])
    assert args.render_hz == 2.5
