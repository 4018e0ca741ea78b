"""``asp-tui run --headless``: run in the foreground with a progress bar and one line per step."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from runtime.config import Config
from runtime.launcher import (
    prepare_model,
    prepare_run,
    request_stop,
    spawn_controller,
    wait_for_controller,
)
from runtime.protocol import EventKind
from runtime.resources import plan_resources
from runtime.rundir import JsonlTail, RunDir

_EVENTS_SHOWN = frozenset(
    {
        EventKind.COMMAND,
        EventKind.INSTANCE,
        EventKind.DISCARD,
        EventKind.RUN,
        EventKind.LAG,
        EventKind.AUTH,
        EventKind.REWARD,
        EventKind.TASK,
        EventKind.EVAL,
    }
)
"""The event records a headless run prints between its step lines (routine weight syncs and
trainer hellos stay in metrics.jsonl)."""


def format_step(record: dict[str, Any], total_steps: int) -> str:
    """One line per trainer step, as the README documents it."""
    return (
        f"step {record['step']:>4}/{total_steps}  "
        f"reward {record.get('reward_mean', 0.0):6.3f}  "
        f"loss {record.get('loss', 0.0):+8.4f}  "
        f"lag {record.get('lag_mean', 0.0):4.2f}/{record.get('lag_max', 0)} "
        f"(bound {record.get('lag_bound', 0)})  "
        f"queue {record.get('queue_depth', 0):>3}  "
        f"iter {record.get('iteration_s', 0.0):6.2f}s  "
        f"{record.get('samples_per_s', 0.0):6.1f} samples/s"
        + "".join(f"  {key} {record[key]}" for key in ("deferred", "migrated") if record.get(key))
    )


def format_event(record: dict[str, Any]) -> str:
    detail = record.get("message") or ", ".join(
        f"{k}={v}" for k, v in record.items() if k not in ("event", "time")
    )
    return f"[{record['event']}] {detail}"


def run_headless(config: Config) -> int:
    console = Console()
    print_resource_plan(config, console)
    run_dir = prepare_run(config)
    console.print(f"run [bold]{config.run.name}[/] in {run_dir.root}")
    prepare_model_with_status(config, console)
    process = spawn_controller(run_dir)
    printer = _RecordPrinter(run_dir, config.trainer.steps, console)
    try:
        with console.status("starting the controller, rollout instances and trainer"):
            wait_for_controller(run_dir, process)
        printer.follow(process)
    except KeyboardInterrupt:
        console.print("stopping: waiting for the final checkpoint and every process to exit")
        request_stop(process)
        _wait_quietly(process)
    except (RuntimeError, TimeoutError) as exc:
        console.print(f"[bold red]error:[/] {exc}")
        request_stop(process)
        _wait_quietly(process)
        return 1
    # Steps the trainer finished while we were stopping still belong on the screen.
    printer.print_new(console)
    code = process.returncode or 0
    if code == 0:
        console.print(f"done: metrics in {run_dir.metrics}")
    else:
        console.print(f"[bold red]the controller exited with code {code}[/]; see {run_dir.logs}")
    return code


def print_resource_plan(config: Config, console: Console) -> None:
    """Show each process's threads and cores (a bad ``resources`` section fails here, exit 2)."""
    console.print(plan_resources(config).describe(), style="dim", highlight=False)


def prepare_model_with_status(config: Config, console: Console) -> None:
    with console.status(f"preparing model {config.model.path}"):
        model = prepare_model(config)
    console.print(f"model: {model}")


class _RecordPrinter:
    """Prints each new step and event record of ``metrics.jsonl`` once."""

    def __init__(self, run_dir: RunDir, total_steps: int, console: Console) -> None:
        self._tail = JsonlTail(run_dir.metrics)
        self._total = total_steps
        self._console = console

    def follow(self, process: Any) -> None:
        """Print records under a progress bar until the controller exits."""
        columns = (
            TextColumn("[bold]training"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
        )
        with Progress(*columns, console=self._console, transient=False) as progress:
            task = progress.add_task("steps", total=self._total)
            while True:
                exited = process.poll() is not None
                last_step = self.print_new(progress.console)
                if last_step is not None:
                    progress.update(task, completed=last_step)
                if exited:
                    return
                time.sleep(0.25)

    def print_new(self, console: Console) -> int | None:
        """Print the records written since the last call; return the last step seen."""
        last_step = None
        for record in self._tail.read():
            if record.get("event") == "step":
                console.print(format_step(record, self._total), soft_wrap=True)
                last_step = record["step"]
            elif record.get("event") in _EVENTS_SHOWN and not record.get("routine"):
                console.print(format_event(record), style="dim", soft_wrap=True)
        return last_step


def _wait_quietly(process: Any) -> None:
    """Wait for the controller; a second Ctrl-C does not abandon its children."""
    while True:
        try:
            process.wait()
            return
        except KeyboardInterrupt:
            continue
