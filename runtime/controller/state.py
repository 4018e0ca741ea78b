"""Controller state on disk (``state/controller.json``), enough to resume a run with the
trainer's checkpoint: weight version, epoch, lag bound, the prompts consumed in this epoch."""

from __future__ import annotations

from pathlib import Path

import msgspec

from runtime.rundir import RunDir, atomic_write_bytes


class ControllerState(msgspec.Struct, kw_only=True):
    version: int = 0
    epoch: int = 0
    lag_bound: int = 0
    consumed_total: int = 0
    """Groups consumed over the whole run (AReaL's admission count starts here)."""
    consumed_prompts: list[int] = []
    """Prompt ids consumed in the current epoch (a resumed epoch skips them)."""
    next_group_id: int = 0
    discarded_total: int = 0
    requeued_total: int = 0
    skipped_total: int = 0
    """Groups dropped because a reward function failed (``task.on_reward_error: skip_group``)."""
    deferred_total: int = 0
    """Groups the scheduler deferred (aborted, to regenerate later) over the whole run."""
    migrated_total: int = 0
    """Groups moved to another instance with their partial output over the whole run."""
    finished: bool = False
    time: float = 0.0


def state_file(run_dir: RunDir) -> Path:
    return run_dir.state / "controller.json"


def load_state(run_dir: RunDir) -> ControllerState | None:
    path = state_file(run_dir)
    if not path.is_file():
        return None
    try:
        return msgspec.json.decode(path.read_bytes(), type=ControllerState)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"{path}: unreadable controller state ({exc})") from None


def save_state(run_dir: RunDir, state: ControllerState) -> None:
    atomic_write_bytes(state_file(run_dir), msgspec.json.encode(state))
