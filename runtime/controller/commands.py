"""Operator commands on the control socket: the checks that need the run's state, then the
controller's ``op_*`` action.

The control socket's ``protocol.CommandDecoder`` has already typed the command (or made it an
``InvalidCommand`` that says which field was wrong). Every command is answered:
``CommandReply(ok=True, reason=<what happened>, data=<the command's reply type>)`` or ``ok=False``
with a reason that says what was wrong and what is allowed. A command that names several instances
is all-or-nothing: one bad id refuses the whole command.

This module knows the controller only as a ``CommandTarget``: it imports nothing of the process
that owns the sockets.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from runtime.controller.instances import DOWN, STARTING
from runtime.protocol import (
    Command,
    CommandReply,
    HistoryCmd,
    InstancesReply,
    InvalidCommand,
    LagBoundReply,
    PauseInstances,
    RestartInstances,
    ResumeInstances,
    SetLagBound,
    StatusCmd,
    StopRun,
)

if TYPE_CHECKING:
    from runtime.config import Config
    from runtime.controller.governor import LagGovernor
    from runtime.controller.instances import Instance
    from runtime.controller.telemetry import Telemetry
    from runtime.protocol import Snapshot


class CommandTarget(Protocol):
    """What commands read and call on the controller."""

    config: Config
    governor: LagGovernor
    instances: dict[int, Instance]
    telemetry: Telemetry | None
    spawn: bool
    """Whether the controller supervises its workers (restart needs it)."""
    sim: bool
    """The sim backend: every instance lives in one process."""
    stopping: bool
    stop_reason: str

    def snapshot(self) -> Snapshot: ...

    def op_set_lag_bound(self, value: int) -> str: ...

    def op_pause(self, inst: Instance) -> None: ...

    def op_resume(self, inst: Instance) -> None: ...

    def op_restart(self, inst: Instance) -> str: ...

    def request_stop(self, reason: str = ..., code: int = ...) -> None: ...


class Refused(Exception):
    """A command that cannot be carried out; the message is the reply's reason."""


READ_WHILE_STOPPING = (StatusCmd, HistoryCmd, StopRun)


def handle(ctl: CommandTarget, cmd: Command | InvalidCommand) -> CommandReply:
    try:
        if isinstance(cmd, InvalidCommand):
            raise Refused(cmd.reason)
        if ctl.stopping and not isinstance(cmd, READ_WHILE_STOPPING):
            raise Refused(f"the run is stopping ({ctl.stop_reason})")
        reason, data = _dispatch(ctl, cmd)
        return CommandReply(request_id=cmd.request_id, ok=True, reason=reason, data=data)
    except Refused as exc:
        return CommandReply(request_id=cmd.request_id, ok=False, reason=str(exc))


def _dispatch(ctl: CommandTarget, cmd: Command) -> tuple[str, Any]:
    match cmd:
        case StatusCmd():
            snap = ctl.telemetry.latest if ctl.telemetry is not None else None
            return "", snap or ctl.snapshot()
        case HistoryCmd(limit=limit):
            assert ctl.telemetry is not None
            return "", ctl.telemetry.history(limit)
        case SetLagBound(value=value):
            return _set_lag_bound(ctl, value)
        case PauseInstances(ids=ids):
            return _pause(ctl, _instances(ctl, ids))
        case ResumeInstances(ids=ids):
            return _resume(ctl, _instances(ctl, ids))
        case RestartInstances(ids=ids):
            return _restart(ctl, _instances(ctl, ids))
        case StopRun():
            return _stop(ctl)
    raise Refused(f"no handler for {type(cmd).__name__}")  # a command added without one


def _set_lag_bound(ctl: CommandTarget, value: int) -> tuple[str, LagBoundReply]:
    top = ctl.config.async_.max_lag_bound
    if value > top:
        raise Refused(f"value: {value} is out of range (allowed 0..{top}, async.max_lag_bound)")
    description = ctl.op_set_lag_bound(value)
    gov = ctl.governor
    return description, LagBoundReply(
        lag_bound=gov.lag_bound,
        pending_lag_bound=gov.pending_lag_bound,
        on_lag_decrease=gov.on_lag_decrease,
    )


def _instances(ctl: CommandTarget, ids: list[int]) -> list[Instance]:
    known = sorted(ctl.instances)
    for i in ids:
        if i not in ctl.instances:
            raise Refused(f"unknown instance id {i} (known: {known[0]}..{known[-1]})")
    return [ctl.instances[i] for i in ids]


def _pause(ctl: CommandTarget, targets: list[Instance]) -> tuple[str, InstancesReply]:
    for inst in targets:
        if inst.operator_paused:
            raise Refused(f"instance {inst.instance_id} is already paused")
        if inst.state == DOWN:
            raise Refused(f"instance {inst.instance_id} is down; restart it first")
    for inst in targets:
        ctl.op_pause(inst)
    ids = [inst.instance_id for inst in targets]
    return f"paused {ids} (in-flight groups kept; no new dispatch)", InstancesReply(ids=ids)


def _resume(ctl: CommandTarget, targets: list[Instance]) -> tuple[str, InstancesReply]:
    for inst in targets:
        if not inst.operator_paused:
            raise Refused(f"instance {inst.instance_id} is not paused (it is {inst.state})")
    for inst in targets:
        ctl.op_resume(inst)
    ids = [inst.instance_id for inst in targets]
    return f"resumed {ids}", InstancesReply(ids=ids)


def _restart(ctl: CommandTarget, targets: list[Instance]) -> tuple[str, InstancesReply]:
    if not ctl.spawn:
        raise Refused("this controller does not supervise its workers (started with --no-spawn)")
    if ctl.sim:
        if len(targets) != len(ctl.instances) and any(t.state != DOWN for t in targets):
            raise Refused(
                "the sim backend hosts every instance in one process: restart all ids at once, "
                "or restart a down instance"
            )
        targets = targets[:1]
    for inst in targets:
        if inst.state == STARTING and inst.restart_at is None:
            raise Refused(f"instance {inst.instance_id} is already starting")
    done = [ctl.op_restart(inst) for inst in targets]
    return "; ".join(done), InstancesReply(ids=[inst.instance_id for inst in targets])


def _stop(ctl: CommandTarget) -> tuple[str, None]:
    if ctl.stopping:
        return f"already stopping ({ctl.stop_reason})", None
    ctl.request_stop("operator stop", code=0)
    return "stopping: final checkpoint, then every process exits", None
