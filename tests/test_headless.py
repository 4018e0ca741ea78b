"""What ``asp-tui run --headless`` prints from the records the controller writes."""

from __future__ import annotations

import io
import json
from pathlib import Path

from rich.console import Console

from asp_tui.headless import _RecordPrinter
from runtime.protocol import EventKind
from runtime.rundir import RunDir


def _printed(tmp_path: Path, records: list[dict]) -> str:
    run_dir = RunDir(tmp_path / "run").create()
    run_dir.metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = io.StringIO()
    console = Console(file=out, width=200)
    _RecordPrinter(run_dir, 10, console).print_new(console)
    return out.getvalue()


def test_a_lowered_bound_coming_into_force_is_printed(tmp_path: Path) -> None:
    """The controller records it as ``EventKind.LAG``; the printer used to wait for a
    ``lag_bound`` kind that nothing emits, so a headless run never said it."""
    record = {"event": EventKind.LAG.value, "message": "lag bound 0 in force", "time": 1.0}
    assert "lag bound 0 in force" in _printed(tmp_path, [record])


def test_routine_weight_syncs_stay_in_the_metrics_file(tmp_path: Path) -> None:
    record = {"event": EventKind.WEIGHTS.value, "message": "weights v3 published", "time": 1.0}
    assert "weights v3" not in _printed(tmp_path, [record])


def test_routine_instance_transitions_are_not_printed(tmp_path: Path) -> None:
    routine = {
        "event": EventKind.INSTANCE.value,
        "message": "instance 3: running -> syncing (syncing weights v4)",
        "routine": True,
        "time": 1.0,
    }
    down = {"event": EventKind.INSTANCE.value, "message": "instance 3: running -> down"}
    printed = _printed(tmp_path, [routine, {**down, "time": 2.0}])
    assert "syncing weights v4" not in printed and "running -> down" in printed


def test_a_step_line_says_what_the_scheduler_deferred_and_moved() -> None:
    from asp_tui.headless import format_step

    step = {"step": 4, "reward_mean": 0.5, "iteration_s": 2.0}
    assert "deferred" not in format_step(step, 10)  # quiet when there is nothing to say
    line = format_step({**step, "deferred": 3, "migrated": 1}, 10)
    assert line.endswith("deferred 3  migrated 1")
