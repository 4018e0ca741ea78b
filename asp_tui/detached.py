"""``asp-tui --config F``: start the run detached from this terminal, then attach to it."""

from __future__ import annotations

from rich.console import Console

from asp_tui.headless import prepare_model_with_status, print_resource_plan
from runtime.config import Config
from runtime.launcher import RunAlreadyLive, prepare_run, spawn_controller, wait_for_controller


def start_and_attach(config: Config, *, readonly: bool, render_hz: float | None = None) -> int:
    """Start (or find) the run in ``config.run_dir`` and attach the dashboard to it."""
    from asp_tui.attach import attach

    console = Console()
    print_resource_plan(config, console)
    try:
        run_dir = prepare_run(config)
    except RunAlreadyLive:
        console.print(f"a run is already live in {config.run_dir}: attaching")
        return attach(str(config.run_dir), readonly=readonly, render_hz=render_hz)
    prepare_model_with_status(config, console)
    process = spawn_controller(run_dir)
    with console.status("starting the controller (it keeps running when you detach)"):
        wait_for_controller(run_dir, process)
    console.print(f"run started in {run_dir.root}; `asp-tui stop {run_dir.root}` stops it")
    return attach(str(run_dir.root), readonly=readonly, render_hz=render_hz)
