"""Operator commands on the control socket: validation, then the controller's ``op_*`` action.

Every command is answered: ``CommandReply(ok=True, reason=<what happened>)`` or
``ok=False`` with a reason that says what was wrong and what is allowed. A command that names
several instances is all-or-nothing: one bad id refuses the whole command.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from runtime.controller.instances import DOWN, STARTING
from runtime.protocol import COMMANDS, Command, CommandReply

if TYPE_CHECKING:
    from runtime.controller.instances import Instance
    from runtime.controller.server import Controller


class Refused(Exception):
    """A command that cannot be carried out; the message is the reply's reason."""


def handle(ctl: Controller, cmd: Command) -> CommandReply:
    try:
        if cmd.name not in COMMANDS:
            raise Refused(f"unknown command {cmd.name!r} (allowed: {', '.join(COMMANDS)})")
        if not isinstance(cmd.args, dict):
            raise Refused("args must be a mapping")
        if ctl.stopping and cmd.name not in ("status", "history", "stop"):
            raise Refused(f"the run is stopping ({ctl.stop_reason})")
        reason, data = _HANDLERS[cmd.name](ctl, cmd.args)
        return CommandReply(request_id=cmd.request_id, ok=True, reason=reason, data=data)
    except Refused as exc:
        return CommandReply(request_id=cmd.request_id, ok=False, reason=str(exc))


def _status(ctl: Controller, args: dict[str, Any]) -> tuple[str, Any]:
    snap = ctl.telemetry.latest if ctl.telemetry is not None else None
    snap = snap or ctl.snapshot()
    return "", msgspec.to_builtins(snap)


def _history(ctl: Controller, args: dict[str, Any]) -> tuple[str, Any]:
    limit = args.get("limit")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise Refused(f"limit: {limit!r} must be a positive integer")
    assert ctl.telemetry is not None
    return "", ctl.telemetry.history(limit)


def _set_lag_bound(ctl: Controller, args: dict[str, Any]) -> tuple[str, Any]:
    if "value" not in args:
        raise Refused("set_lag_bound needs {value: int}")
    value = args["value"]
    top = ctl.config.async_.max_lag_bound
    if not isinstance(value, int) or isinstance(value, bool):
        raise Refused(f"value: {value!r} is not an integer (allowed 0..{top})")
    if not 0 <= value <= top:
        raise Refused(f"value: {value} is out of range (allowed 0..{top}, async.max_lag_bound)")
    description = ctl.op_set_lag_bound(value)
    gov = ctl.governor
    return description, {
        "lag_bound": gov.lag_bound,
        "pending_lag_bound": gov.pending_lag_bound,
        "on_lag_decrease": gov.on_lag_decrease,
    }


def _instances(ctl: Controller, args: dict[str, Any]) -> list[Instance]:
    ids = args.get("ids", args.get("id"))
    if isinstance(ids, int) and not isinstance(ids, bool):
        ids = [ids]
    if not isinstance(ids, list) or not ids:
        raise Refused("ids: a non-empty list of instance ids is required")
    known = sorted(ctl.instances)
    out = []
    for i in ids:
        if not isinstance(i, int) or isinstance(i, bool):
            raise Refused(f"ids: {i!r} is not an integer instance id")
        if i not in ctl.instances:
            raise Refused(f"unknown instance id {i} (known: {known[0]}..{known[-1]})")
        out.append(ctl.instances[i])
    return out


def _pause(ctl: Controller, args: dict[str, Any]) -> tuple[str, Any]:
    targets = _instances(ctl, args)
    for inst in targets:
        if inst.operator_paused:
            raise Refused(f"instance {inst.instance_id} is already paused")
        if inst.state == DOWN:
            raise Refused(f"instance {inst.instance_id} is down; restart it first")
    for inst in targets:
        ctl.op_pause(inst)
    ids = [inst.instance_id for inst in targets]
    return f"paused {ids} (in-flight groups kept; no new dispatch)", {"ids": ids}


def _resume(ctl: Controller, args: dict[str, Any]) -> tuple[str, Any]:
    targets = _instances(ctl, args)
    for inst in targets:
        if not inst.operator_paused:
            raise Refused(f"instance {inst.instance_id} is not paused (it is {inst.state})")
    for inst in targets:
        ctl.op_resume(inst)
    ids = [inst.instance_id for inst in targets]
    return f"resumed {ids}", {"ids": ids}


def _restart(ctl: Controller, args: dict[str, Any]) -> tuple[str, Any]:
    targets = _instances(ctl, args)
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
    return "; ".join(done), {"ids": [inst.instance_id for inst in targets]}


def _stop(ctl: Controller, args: dict[str, Any]) -> tuple[str, Any]:
    if ctl.stopping:
        return f"already stopping ({ctl.stop_reason})", None
    ctl.request_stop("operator stop", code=0)
    return "stopping: final checkpoint, then every process exits", None


_HANDLERS = {
    "status": _status,
    "history": _history,
    "set_lag_bound": _set_lag_bound,
    "pause_instance": _pause,
    "resume_instance": _resume,
    "restart_instance": _restart,
    "stop": _stop,
}
assert set(_HANDLERS) == set(COMMANDS)
