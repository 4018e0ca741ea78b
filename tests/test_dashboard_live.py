"""Pilot tests against a real controller on the ``sim`` backend (configs/sim-8.yaml).

The controller runs as its own process (``python -m runtime.controller``) with 8 simulated
instances and a simulated trainer; the dashboard attaches through ``endpoints.json`` exactly as
``asp-tui attach`` does. Each test checks the controller's own state through a separate
``ControlClient``, not just what the dashboard shows.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from asp_tui import messages as msg
from asp_tui.app import Dashboard, make_app
from asp_tui.attach import print_once, stop_run
from asp_tui.format import ratio_text, rho_text
from asp_tui.link import LiveLink
from asp_tui.model import Backoff, Link
from asp_tui.widgets.instances import InstanceTable
from runtime.auth import Role
from runtime.config import load_config
from runtime.controller.client import ControlClient, write_run_config
from runtime.launcher import spawn_controller, wait_for_controller
from runtime.protocol import PauseInstances, Snapshot
from runtime.rundir import RunDir, read_jsonl

REPO = Path(__file__).resolve().parents[1]


class Controller:
    """``python -m runtime.controller`` on a run dir, started and reaped synchronously."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60.0) -> None:
        self.proc = spawn_controller(self.run_dir)
        wait_for_controller(RunDir(self.run_dir), self.proc, timeout_s=timeout)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash would (children die with it by PDEATHSIG)."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


def new_run(tmp: Path, *overrides: str) -> Controller:
    config = load_config(
        REPO / "configs" / "sim-8.yaml", ["trainer.steps=100000", *overrides], run_dir=tmp
    )
    write_run_config(tmp, config)
    return Controller(tmp)


@pytest.fixture(scope="module")
def controller(tmp_path_factory) -> Iterator[Controller]:
    run = new_run(tmp_path_factory.mktemp("sim8"))
    run.start()
    try:
        yield run
    finally:
        run.stop()


async def status(run: Controller) -> Snapshot:
    async with ControlClient(RunDir(run.run_dir).read_endpoints(), timeout_s=5) as client:
        return await client.status()


async def wait_until(pilot, predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        await pilot.pause(0.05)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


async def controller_until(run: Controller, predicate, timeout: float, what: str) -> Snapshot:
    deadline = time.monotonic() + timeout
    snap = await status(run)
    while not predicate(snap):
        if time.monotonic() > deadline:
            raise AssertionError(f"controller never showed {what}; last: {snap.instances}")
        await asyncio.sleep(0.1)
        snap = await status(run)
    return snap


def attach_app(run: Controller, role: Role = Role.OPERATOR, **options) -> Dashboard:
    link = LiveLink(RunDir(run.run_dir).endpoints, role=role)
    return make_app(link, backoff=Backoff(cap_s=1.0, rng=random.Random(0)), **options)


def state_cell(app: Dashboard, instance_id: int) -> str:
    return app.query_one(InstanceTable).get_cell(str(instance_id), "state").plain


async def live(pilot, app: Dashboard) -> None:
    await wait_until(
        pilot,
        lambda: app.model.link() is Link.LIVE and app.query_one(InstanceTable).row_count == 8,
        30,
        "LIVE with 8 rows",
    )


def of_type(seen: list, kind: type) -> list:
    return [m for m in seen if isinstance(m, kind)]


async def test_pause_then_resume_the_highlighted_instance(controller):
    app = attach_app(controller)
    seen: list = []
    async with app.run_test(size=(100, 30), message_hook=seen.append) as pilot:
        await live(pilot, app)
        assert of_type(seen, msg.HistoryBackfilled), "sparklines were backfilled on attach"
        await pilot.press("j", "j")  # highlight instance 2
        assert app.query_one(InstanceTable).highlighted_id() == 2
        await pilot.press("p")
        await pilot.pause()
        await pilot.press("y")
        await controller_until(
            controller, lambda s: s.instances[2].state == "paused", 15, "instance 2 paused"
        )
        await wait_until(pilot, lambda: state_cell(app, 2) == "⏸ PAUSED", 10, "PAUSED in table")
        assert [m.ids for m in of_type(seen, msg.InstancesPaused)] == [[2]]
        others = (await status(controller)).instances
        assert [i.instance_id for i in others if i.state == "paused"] == [2]

        await pilot.press("p")  # every target is paused: p offers resume
        await pilot.pause()
        assert "Resume 1 instance: 2" in str(app.screen.query_one(".dialog-body").render())
        await pilot.press("y")
        await controller_until(
            controller, lambda s: s.instances[2].state != "paused", 15, "instance 2 resumed"
        )
        await wait_until(
            pilot, lambda: state_cell(app, 2) in ("▶ RUNNING", "⟳ SYNCING"), 10, "RUNNING"
        )
        assert [m.ids for m in of_type(seen, msg.InstancesResumed)] == [[2]]
        assert not of_type(seen, msg.CommandRefused)


async def test_lag_bound_dialog_changes_the_controllers_bound(controller):
    before = (await status(controller)).lag_bound
    new = before + 1
    app = attach_app(controller)
    seen: list = []
    async with app.run_test(size=(100, 30), message_hook=seen.append) as pilot:
        await live(pilot, app)
        await pilot.press("L")
        await pilot.pause()
        await pilot.press("backspace", "backspace", *str(new), "enter")
        await pilot.pause()
        assert f"{before} → {new}" in str(app.screen.query_one(".dialog-body").render())
        await pilot.press("y")
        await controller_until(controller, lambda s: s.lag_bound == new, 10, f"η={new}")
        await wait_until(pilot, lambda: of_type(seen, msg.LagBoundChanged), 5, "message")
        (changed,) = of_type(seen, msg.LagBoundChanged)
        assert (changed.old, changed.new) == (before, new)
        await wait_until(pilot, lambda: f"η={new}" in str(app.header_bar.render()), 5, "header")

        # Out of range: the controller's reason reaches the operator.
        app.max_lag_bound = 99  # let the input through, so the controller decides
        await pilot.press("L")
        await pilot.pause()
        await pilot.press("backspace", "backspace", "5", "0", "enter")
        await pilot.pause()
        await pilot.press("y")
        await wait_until(pilot, lambda: of_type(seen, msg.CommandRefused), 10, "refusal")
        (refused,) = of_type(seen, msg.CommandRefused)
        assert "out of range" in refused.reason and "max_lag_bound" in refused.reason
        assert (await status(controller)).lag_bound == new


async def test_readonly_can_neither_pause_nor_change_the_bound(controller):
    """As ``attach --readonly`` does: a viewer key, which the controller refuses too."""
    before = await status(controller)
    app = attach_app(controller, Role.VIEWER, readonly=True)
    seen: list = []
    async with app.run_test(size=(100, 30), message_hook=seen.append) as pilot:
        await live(pilot, app)  # history, status and telemetry all work with a viewer key
        await pilot.press("p", "y", "L", "1", "enter", "y", "plus", "y")
        await pilot.pause(1.0)
        # Past the dashboard's own refusal, straight to the controller: refused there as well.
        reply = await app.link.request(PauseInstances(ids=[0]), 5.0)
        assert not reply.ok and "role viewer may not send 'pause_instance'" in reply.reason
    after = await status(controller)
    assert after.lag_bound == before.lag_bound
    assert [i.state for i in after.instances if i.state == "paused"] == []
    assert [m.name for m in of_type(seen, msg.CommandRefused)] == [
        "pause",
        "set_lag_bound",
        "set_lag_bound",
    ]
    assert not of_type(seen, msg.InstancesPaused) and not of_type(seen, msg.LagBoundChanged)


async def test_lanes_and_each_steps_scheduler_numbers_match_the_controller(tmp_path):
    """The asp policy on the sim (it defers stragglers): the lane column is the controller's,
    and the scheduler line shows the step record of the step on screen, from metrics.jsonl."""
    run = new_run(tmp_path, "scheduler.policy=asp")
    run.start()
    try:
        app = attach_app(run)
        async with app.run_test(size=(80, 24)) as pilot:
            await live(pilot, app)
            model = app.model
            await wait_until(
                pilot,
                lambda: model.snapshot.step >= 3 and model.seq_applied == model.snapshot.seq,
                60,
                "step 3 on screen",
            )
            snap = model.snapshot  # what the widgets show now (no await since the check)
            text = str(app.scheduler_meter.text.render())
            table = app.query_one(InstanceTable)
            shown = {i: str(table.get_cell(str(i), "lane")) for i in table.shown_ids()}
        assert shown == {row.instance_id: str(row.lane) for row in snap.instances}
        assert {row.instance_id: row.lane for row in (await status(run)).instances} == {
            row.instance_id: row.lane for row in snap.instances
        }
        steps = {}
        for _ in range(50):  # the step's line may still be on its way to the file
            metrics = RunDir(run.run_dir).metrics
            steps = {r["step"]: r for r in read_jsonl(metrics) if r.get("event") == "step"}
            if snap.step in steps:
                break
            await asyncio.sleep(0.1)
        record = steps[snap.step]
        assert (snap.trainer.deferred, snap.trainer.migrated) == (
            record["deferred"],
            record["migrated"],
        )
        assert f"deferred {record['deferred']} (run {snap.deferred_groups})" in text
        assert f"migrated {record['migrated']} (run {snap.migrated_groups})" in text
        rho, ratio = record["predictor_longest_rho"], record["predictor_longest_ratio"]
        assert f"ρ {rho_text(rho)} {ratio_text(ratio)}" in text
        assert ratio is not None  # asp planned every group with a prediction
        # The run's totals count every step so far (and what happened since the last one).
        before = [r for step, r in steps.items() if step <= snap.step]
        assert snap.deferred_groups >= sum(r["deferred"] for r in before)
        assert snap.migrated_groups >= sum(r["migrated"] for r in before)
    finally:
        run.stop()


async def test_quitting_leaves_the_run_going(controller):
    app = attach_app(controller)
    async with app.run_test(size=(80, 24)) as pilot:
        await live(pilot, app)
        step_at_quit = app.model.snapshot.step
        await pilot.press("q")
        await pilot.pause()
    assert app.return_code == 0
    assert controller.alive()
    snap = await controller_until(
        controller, lambda s: s.step > step_at_quit, 30, "the trainer stepping after detach"
    )
    assert snap.state not in ("stopping", "stopped", "finished")


async def test_print_once_and_unreachable(controller, tmp_path):
    out = io.StringIO()
    assert await asyncio.to_thread(print_once, str(controller.run_dir), 5.0, out) == 0
    text = out.getvalue()
    assert text.startswith("run       sim-8")
    assert text.count("\ninstance ") == 8
    assert "lag       mean" in text and "bubbles   window" in text
    assert any(word in text for word in ("RUNNING", "SYNCING", "STARTING"))

    gone = RunDir(tmp_path).create()
    endpoints = RunDir(controller.run_dir).read_endpoints()
    # A port nobody listens on: what a dead controller leaves behind.
    gone.write_endpoints(
        type(endpoints)(
            **{
                **{f: getattr(endpoints, f) for f in endpoints.__struct_fields__},
                "control": "tcp://127.0.0.1:9",
                "telemetry": "tcp://127.0.0.1:9",
            }
        )
    )
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = await asyncio.to_thread(print_once, str(tmp_path), 1.0)
    assert code == 2
    assert "no answer from the controller at tcp://127.0.0.1:9" in err.getvalue()

    ended = subprocess.Popen(["true"])
    ended.wait()  # reaped: its pid is what a controller that has exited leaves behind
    gone.write_endpoints(
        type(endpoints)(
            **{
                **{f: getattr(endpoints, f) for f in endpoints.__struct_fields__},
                "control": "tcp://127.0.0.1:9",
                "controller_pid": ended.pid,
            }
        )
    )
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert await asyncio.to_thread(print_once, str(tmp_path), 1.0) == 2
    assert f"is not running (controller pid {ended.pid} is gone)" in err.getvalue()
    with contextlib.redirect_stderr(err):
        assert await asyncio.to_thread(print_once, str(tmp_path / "nowhere.json")) == 2
    assert "no run has started here" in err.getvalue()


@pytest.mark.slow
async def test_controller_killed_then_restarted(tmp_path):
    """DISCONNECTED without a crash while the controller is gone; LIVE again once it is back."""
    run = new_run(tmp_path)
    run.start()
    try:
        app = attach_app(run)
        seen: list = []
        async with app.run_test(size=(80, 24), message_hook=seen.append) as pilot:
            await live(pilot, app)
            step_before = app.model.snapshot.step
            run.kill()
            await wait_until(
                pilot, lambda: app.model.link() is Link.DISCONNECTED, 15, "DISCONNECTED"
            )
            await pilot.pause(0.3)
            assert "DISCONNECTED" in str(app.header_bar.render())
            assert app.body.has_class("-disconnected"), "last data is dimmed"
            assert app.query_one(InstanceTable).row_count == 8, "last data is kept"
            assert app.is_running and of_type(seen, msg.Disconnected)
            assert any("lost the controller" in line for line in app.event_log.lines)
            await pilot.pause(2.0)  # a few failed reconnects: still no crash
            assert app.is_running

            run.start()  # new process, new ports in endpoints.json
            await wait_until(pilot, lambda: app.model.link() is Link.LIVE, 30, "LIVE again")
            assert len(of_type(seen, msg.Connected)) == 2
            await pilot.pause(0.3)
            assert not app.body.has_class("-disconnected"), "no longer dimmed"
            assert "LIVE" in str(app.header_bar.render())
            assert app.model.snapshot.step >= 0 and step_before >= 0
        # Stopping the run is a separate, explicit command.
        assert await asyncio.to_thread(stop_run, str(run.run_dir), 30.0, io.StringIO()) == 0
        assert not run.alive() or run.proc.wait(5) is not None
    finally:
        run.stop()


def test_attach_in_a_terminal_exits_cleanly_on_sighup(controller):
    """``attach`` in a real pseudo-terminal; SIGHUP (the SSH session dropped) ends it with 0."""
    import pty
    import threading

    master, slave = pty.openpty()
    code = (
        "import sys; from asp_tui.attach import attach; "
        f"sys.exit(attach({str(controller.run_dir)!r}, readonly=True))"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        cwd=REPO,
        env={**os.environ, "TERM": "xterm-256color", "COLUMNS": "100", "LINES": "30"},
        start_new_session=True,
    )
    os.close(slave)
    screen = bytearray()

    def drain() -> None:  # a terminal that nobody reads would block the app's writes
        with contextlib.suppress(OSError):
            while chunk := os.read(master, 65536):
                screen.extend(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 30
        while b"LIVE" not in screen and time.monotonic() < deadline:
            assert proc.poll() is None, bytes(screen[-2000:]).decode(errors="replace")
            time.sleep(0.1)
        assert b"LIVE" in screen, "the dashboard drew a LIVE badge in the terminal"
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    assert controller.alive(), "the run keeps going after the terminal went away"
