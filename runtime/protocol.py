"""The wire vocabulary between processes, and its codec.

Every message is a msgspec Struct tagged by its class name. A message travels as one header frame
(msgpack of ``[PROTOCOL_VERSION, message]``) followed by zero or more raw frames: numpy arrays are
never packed into the header, they ride beside it zero-copy, as vLLM's ``serial_utils`` does.
Decoders reject an unknown type, a wrong version or an oversized frame with ``ProtocolError``;
``FrameGuard`` turns that into a logged, counted rejection so the receiving process keeps running.
"""

from __future__ import annotations

import enum
import logging
import re
import typing
from collections import Counter
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar

import msgspec
import numpy as np

PROTOCOL_VERSION = 1
MAX_HEADER_BYTES = 16 * 1024 * 1024
MAX_FRAME_BYTES = 1024 * 1024 * 1024
MAX_FRAMES = 1 << 16

_NDARRAY_EXT = 1
_ALLOWED_DTYPES = frozenset({"int8", "int16", "int32", "int64", "uint8", "float16", "float32"})
_ALLOWED_DTYPES |= {"float64", "bool"}

log = logging.getLogger(__name__)


class ProtocolError(ValueError):
    """A frame sequence that is not a valid message of this protocol version."""


class _Message(msgspec.Struct, tag=True, omit_defaults=True, kw_only=True):
    pass


# --- rollout plane: controller ROUTER <-> worker DEALER (identity = b"instance-<id>") ---------


class WorkerHello(_Message):
    instance_id: int
    max_num_seqs: int
    weight_version: int
    pid: int
    backend: str


class Heartbeat(_Message):
    instance_id: int
    state: str
    weight_version: int
    running_seqs: int
    tokens_generated: int
    time: float
    rejected_frames: int = 0
    """Garbage frames this worker's socket has rejected so far (counted, then ignored)."""


class PartialSample(msgspec.Struct, omit_defaults=True, kw_only=True):
    """One sample's output so far: what an instance reports for a group aborted with
    ``AbortGroups(partial=True)``, and what a ``Generate`` continues (``Generate.prefix``)."""

    token_ids: np.ndarray
    """int32, the tokens generated so far (the prompt not included)."""
    logprobs: np.ndarray
    """float32, their behaviour log-probs."""
    version_min: int
    version_max: int
    finish_reason: str = "abort"
    """``abort``: unfinished, to be continued; ``stop`` or ``length``: the sample is complete."""
    finished_at: float = 0.0
    """When a complete sample finished."""


class Generate(_Message):
    """Generate one group: ``n`` samples of one prompt."""

    group_id: int
    prompt_id: int
    prompt_token_ids: np.ndarray
    n: int
    max_tokens: int
    seed: int | None = None
    temperature: float | None = None
    """Overrides ``rollout.sampling.temperature`` for this group (0 = greedy, e.g. for evals)."""
    top_p: float | None = None
    """Overrides ``rollout.sampling.top_p`` for this group."""
    priority: int = 0
    """Lower is sooner (vLLM's convention); heeded under ``rollout.scheduling_policy:
    priority``, ignored under ``fcfs``."""
    prefix: list[PartialSample] | None = None
    """Continue a migrated group: per sample (``n`` of them) the output generated so far
    elsewhere. An unfinished sample continues from prompt + its tokens, for at most
    ``max_tokens`` minus what it has (``max_tokens`` caps the whole completion); a complete
    one is returned as it is. The result holds the whole completions, prefix included."""


class Completion(msgspec.Struct, omit_defaults=True, kw_only=True):
    token_ids: np.ndarray
    logprobs: np.ndarray
    version_min: int
    version_max: int
    finish_reason: str
    reward: float
    finished_at: float
    rewards: dict[str, float] = {}
    """Each reward function's own score (``task.rewards``; a function's None is left out)."""


class GroupDone(_Message):
    group_id: int
    prompt_id: int
    instance_id: int
    completions: list[Completion]
    started_at: float
    finished_at: float


class GroupAborted(_Message):
    group_id: int
    instance_id: int
    reason: str
    partial: list[PartialSample] | None = None
    """Per sample, the output so far (prefix included), when the abort asked for it
    (``AbortGroups.partial``); a ``Generate`` with it as ``prefix`` continues the group."""


class GroupFailed(_Message):
    """A group's rewards could not be computed; ``task.on_reward_error`` decides what follows."""

    group_id: int
    prompt_id: int
    instance_id: int
    error: str
    """Names the reward function, the prompt id and the problem."""


class PauseWorker(_Message):
    mode: str = "keep"


class ResumeWorker(_Message):
    pass


class WeightRendezvous(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Trainer rank 0's weight server (``async.weight_sync: collective``, runtime/collective.py).

    ``token`` prefixes every key of the unauthenticated store, so it only travels on
    authenticated sockets (TrainerHello, UpdateWeights)."""

    address: str
    """``host:port`` of the server's TCPStore."""
    token: str
    backend: str
    """``gloo`` or ``nccl``."""


class UpdateWeights(_Message):
    """Load weight ``version``: from the file at ``path``, or, with a ``rendezvous``, from the
    trainer's weight server (which may serve a newer version; the ack says which)."""

    version: int
    path: str
    mode: str = "boundary"
    rendezvous: WeightRendezvous | None = None


class AbortGroups(_Message):
    group_ids: list[int]
    partial: bool = False
    """Report each aborted group's output so far in its ``GroupAborted.partial`` (to move the
    group to another instance); False: a plain abort, the output is dropped."""


class Shutdown(_Message):
    reason: str = ""


class WorkerAck(_Message):
    """The worker finished a control request (pause, resume, update_weights, abort)."""

    instance_id: int
    request: str
    ok: bool
    weight_version: int
    detail: str = ""


# --- trainer plane: controller ROUTER <-> trainer rank 0 DEALER -------------------------------


class TrainerHello(_Message):
    num_processes: int
    weight_version: int
    pid: int
    weight_rendezvous: WeightRendezvous | None = None
    """Set when the trainer serves weights collectively; the controller passes it on."""


class BatchRequest(_Message):
    version: int


class TrainGroup(msgspec.Struct, omit_defaults=True, kw_only=True):
    group_id: int
    prompt_id: int
    prompt_token_ids: np.ndarray
    completions: list[Completion]


class Batch(_Message):
    version: int
    groups: list[TrainGroup]


class StepMetrics(msgspec.Struct, omit_defaults=True, kw_only=True):
    loss: float
    reward_mean: float
    reward_std: float = 0.0
    kl: float = 0.0
    clip_fraction: float = 0.0
    importance_clip_fraction: float = 0.0
    grad_norm: float = 0.0
    entropy: float = 0.0
    tokens: int = 0
    samples: int = 0
    response_length_mean: float = 0.0
    step_s: float = 0.0
    """compute_s + publish_s: the trainer's own work for this step."""
    compute_s: float = 0.0
    """Forward, backward and optimizer step."""
    publish_s: float = 0.0
    """Writing the new weights for the workers."""
    wait_batch_s: float = 0.0
    """From asking for this step's batch to having it."""
    wait_ack_s: float = 0.0
    """The previous step: from StepDone to the controller's acknowledgment."""
    checkpoint_s: float = 0.0
    """The previous step's checkpoint (done while the controller forms this batch)."""


class StepDone(_Message):
    """The trainer took a step; ``weights_path`` holds version ``version``."""

    version: int
    weights_path: str
    metrics: StepMetrics


class TrainerAck(_Message):
    ok: bool = True
    detail: str = ""


# --- telemetry plane: controller PUB -> asp-tui SUB (topics b"snapshot", b"event") ------------

BUBBLE_CATEGORIES = ("useful", "padding", "skewness", "sorting", "sync", "paused", "down", "idle")
INSTANCE_STATES = ("starting", "running", "paused", "syncing", "down")


class Lane(enum.StrEnum):
    """What a rollout instance is kept for: the bulk of the plan, or the tail lane, where the
    controller caps its load so that a moved straggler decodes near its single-sequence speed."""

    BULK = "bulk"
    TAIL = "tail"


class InstanceSnapshot(msgspec.Struct, omit_defaults=True, kw_only=True):
    instance_id: int
    state: str
    in_flight_groups: int = 0
    running_seqs: int = 0
    max_num_seqs: int = 0
    tokens_per_s: float = 0.0
    weight_version: int = 0
    versions_behind: int = 0
    bubble_share: float = 0.0
    restarts: int = 0
    pending: str = ""
    lane: Lane = Lane.BULK
    """The scheduler's ``lane`` for the instance (on the wire as its string)."""


class LagStats(msgspec.Struct, omit_defaults=True, kw_only=True):
    mean: float = 0.0
    p95: float = 0.0
    max: int = 0
    span_max: int = 0
    histogram: list[int] = []


class TrainerSnapshot(msgspec.Struct, omit_defaults=True, kw_only=True):
    state: str = "starting"
    reward_mean: float = 0.0
    loss: float = 0.0
    iteration_s: float = 0.0
    samples_per_s: float = 0.0
    tokens_per_s: float = 0.0
    waiting_s: float = 0.0
    wait_batch_s: float = 0.0
    """Last step's critical path: waiting for its batch, the trainer's own work (compute and
    publish), and loading the previous weights on every instance."""
    train_s: float = 0.0
    sync_s: float = 0.0
    deferred: int = 0
    """Last step: groups deferred and migrated since the step before (``StepRecord``)."""
    migrated: int = 0
    predictor_longest_rho: float | None = None
    """Last step: the predictor against this batch's longest samples (``StepRecord``)."""
    predictor_longest_ratio: float | None = None


class Snapshot(_Message):
    run_name: str
    time: float
    seq: int
    state: str
    step: int
    total_steps: int
    weight_version: int
    lag_bound: int
    pending_lag_bound: int | None = None
    on_lag_decrease: str = "wait"
    batch_groups: int = 0
    queue_depth: int = 0
    queue_capacity: int = 0
    in_flight_groups: int = 0
    admitted_groups: int = 0
    consumed_groups: int = 0
    discarded_groups: int = 0
    requeued_groups: int = 0
    deferred_groups: int = 0
    """Groups the scheduler deferred (aborted, to regenerate later) over the run, resumes
    included."""
    migrated_groups: int = 0
    """Groups moved to another instance with their partial output over the run, resumes included."""
    lag: LagStats = msgspec.field(default_factory=LagStats)
    trainer: TrainerSnapshot = msgspec.field(default_factory=TrainerSnapshot)
    bubbles_window: dict[str, float] = {}
    bubbles_total: dict[str, float] = {}
    bubbles_predicted: dict[str, float] = {}
    instances: list[InstanceSnapshot] = []
    rejected_frames: int = 0
    auth_refused: dict[str, int] = {}
    """Clients refused so far, per socket: unknown keys, roles not allowed on that socket, and
    (under ``control``) commands the client's role may not send."""


class EventKind(enum.StrEnum):
    """What a controller event (and its ``metrics.jsonl`` record's ``event`` field) is about.

    The wire carries the plain string, so a client that meets a newer kind still decodes it.
    """

    RUN = "run"
    TRAINER = "trainer"
    INSTANCE = "instance"
    WEIGHTS = "weights"
    DISCARD = "discard"
    MIGRATE = "migrate"
    """A group moved to another instance with its partial output."""
    LAG = "lag"
    """A lowered lag bound came into force."""
    COMMAND = "command"
    AUTH = "auth"
    EVAL = "eval"
    REWARD = "reward"
    TASK = "task"


class Event(_Message):
    time: float
    kind: str
    """An ``EventKind`` value."""
    message: str
    data: dict[str, Any] = {}


# --- control plane: controller ROUTER <-> asp-tui / CLI DEALER --------------------------------


class _Command(_Message, forbid_unknown_fields=True):
    """An operator command. Its tag (``name``: ``"set_lag_bound"``, ...) is what the wire, the
    role check (``auth.may_command``) and ``metrics.jsonl`` call it; ``request_id`` is set by the
    client that sends it (``ControlClient.request``) and matches the reply to the request."""

    request_id: int = 0
    name: ClassVar[str] = ""
    """The tag; set for every command class below."""
    read_only: ClassVar[bool] = False
    """A viewer may send it (it changes nothing)."""
    reply: ClassVar[Any] = None
    """The type of ``CommandReply.data`` when the command succeeds (None: no data)."""

    @property
    def args(self) -> dict[str, Any]:
        """The arguments as plain data (for logs and ``metrics.jsonl``)."""
        out = msgspec.to_builtins(self)
        return {k: v for k, v in out.items() if k not in ("type", "request_id")}


class LagBoundReply(msgspec.Struct, kw_only=True):
    """What ``set_lag_bound`` did to the governor."""

    lag_bound: int
    pending_lag_bound: int | None
    """A lowered bound that waits for in-flight work (``on_lag_decrease: wait``)."""
    on_lag_decrease: str


class InstancesReply(msgspec.Struct, kw_only=True):
    """The instances a pause, resume or restart acted on."""

    ids: list[int]


class HistoryReply(msgspec.Struct, kw_only=True):
    """The controller's recent snapshots and events, oldest first."""

    snapshots: list[Snapshot]
    events: list[Event]


_InstanceIds = Annotated[
    list[int], msgspec.Meta(min_length=1, description="a non-empty list of instance ids")
]


class StatusCmd(_Command, tag="status", kw_only=True):
    """The latest snapshot."""

    read_only = True
    reply = Snapshot


class HistoryCmd(_Command, tag="history", kw_only=True):
    """Recent snapshots and events (for a dashboard that attaches mid-run)."""

    read_only = True
    reply = HistoryReply
    limit: Annotated[int, msgspec.Meta(ge=1, description="a positive integer")] | None = None
    """At most this many of each (None: all the controller keeps)."""


class SetLagBound(_Command, tag="set_lag_bound", kw_only=True):
    """Change the lag bound; a decrease follows ``async.on_lag_decrease``."""

    reply = LagBoundReply
    value: Annotated[int, msgspec.Meta(ge=0, description="an integer 0..async.max_lag_bound")]


class PauseInstances(_Command, tag="pause_instance", kw_only=True):
    """Stop dispatching to these instances; their in-flight groups finish."""

    reply = InstancesReply
    ids: _InstanceIds


class ResumeInstances(_Command, tag="resume_instance", kw_only=True):
    """Dispatch to these operator-paused instances again."""

    reply = InstancesReply
    ids: _InstanceIds


class RestartInstances(_Command, tag="restart_instance", kw_only=True):
    """Restart these instances' worker processes (their groups are re-queued)."""

    reply = InstancesReply
    ids: _InstanceIds


class StopRun(_Command, tag="stop", kw_only=True):
    """Final checkpoint, then every process exits."""


Command = (
    StatusCmd
    | HistoryCmd
    | SetLagBound
    | PauseInstances
    | ResumeInstances
    | RestartInstances
    | StopRun
)
"""Every operator command (the control socket decodes these with ``CommandDecoder``)."""
COMMAND_TYPES: tuple[type[_Command], ...] = typing.get_args(Command)
for _cls in COMMAND_TYPES:
    _cls.name = _cls.__struct_config__.tag
COMMANDS = tuple(cls.name for cls in COMMAND_TYPES)
COMMAND_BY_NAME = dict(zip(COMMANDS, COMMAND_TYPES, strict=True))


class CommandReply(_Message):
    request_id: int
    ok: bool
    reason: str = ""
    data: Any = None
    """On success, the command's ``reply`` type (plain data once it has crossed the wire:
    ``msgspec.convert(reply.data, SetLagBound.reply)`` types it again)."""


class InvalidCommand(msgspec.Struct, kw_only=True):
    """A command the control socket could not accept (unknown name, wrong or missing field); never
    sent. It still has the sender's ``request_id``, so the refusal ``reason`` reaches the sender."""

    request_id: int
    name: str
    args: dict[str, Any]
    reason: str


Message = (
    WorkerHello
    | Heartbeat
    | Generate
    | GroupDone
    | GroupAborted
    | GroupFailed
    | PauseWorker
    | ResumeWorker
    | UpdateWeights
    | AbortGroups
    | Shutdown
    | WorkerAck
    | TrainerHello
    | BatchRequest
    | Batch
    | StepDone
    | TrainerAck
    | Command
    | CommandReply
    | Snapshot
    | Event
)


# --- codec -----------------------------------------------------------------------------------


class Encoder:
    """Encodes a message into ``[header, *array_frames]``."""

    def __init__(self) -> None:
        self._frames: list[Any] = []
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)

    def encode(self, message: _Message) -> list[Any]:
        self._frames = [b""]
        try:
            self._frames[0] = self._encoder.encode((PROTOCOL_VERSION, message))
            return self._frames
        finally:
            self._frames = []

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            array = np.ascontiguousarray(obj)
            index = len(self._frames)
            self._frames.append(memoryview(array).cast("B") if array.size else b"")
            meta = msgspec.msgpack.encode((array.dtype.str, list(array.shape), index))
            return msgspec.msgpack.Ext(_NDARRAY_EXT, meta)
        raise TypeError(f"cannot encode {type(obj).__name__}")


class Decoder:
    """Decodes ``[header, *array_frames]`` back into a message, validating everything."""

    def __init__(self, message_type: Any = Message) -> None:
        self._frames: Sequence[Any] = ()
        self._outer = msgspec.msgpack.Decoder(tuple[int, msgspec.Raw])
        self._inner = msgspec.msgpack.Decoder(message_type, ext_hook=self._ext_hook)

    def decode(self, frames: Sequence[Any]) -> Any:
        if not frames:
            raise ProtocolError("empty message")
        if len(frames) > MAX_FRAMES:
            raise ProtocolError(f"{len(frames)} frames exceeds the limit of {MAX_FRAMES}")
        header = _as_bytes(frames[0])
        if len(header) > MAX_HEADER_BYTES:
            raise ProtocolError(f"header of {len(header)} bytes exceeds {MAX_HEADER_BYTES}")
        for frame in frames[1:]:
            if len(_as_bytes(frame)) > MAX_FRAME_BYTES:
                raise ProtocolError(f"frame exceeds {MAX_FRAME_BYTES} bytes")
        try:
            version, body = self._outer.decode(header)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError(f"malformed header: {exc}") from None
        if version != PROTOCOL_VERSION:
            raise ProtocolError(f"protocol version {version}, expected {PROTOCOL_VERSION}")
        self._frames = frames
        try:
            return self._inner.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError(f"invalid message: {exc}") from None
        except (ValueError, TypeError, IndexError) as exc:
            raise ProtocolError(f"invalid array frame: {exc}") from None
        finally:
            self._frames = ()

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code != _NDARRAY_EXT:
            raise ProtocolError(f"unknown extension type {code}")
        dtype_str, shape, index = msgspec.msgpack.decode(data, type=tuple[str, list[int], int])
        dtype = np.dtype(dtype_str)
        if dtype.name not in _ALLOWED_DTYPES:
            raise ValueError(f"dtype {dtype_str} is not allowed")
        if not 1 <= index < len(self._frames):
            raise IndexError(f"array frame {index} is missing")
        buffer = _as_bytes(self._frames[index])
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if any(dim < 0 for dim in shape) or count * dtype.itemsize != len(buffer):
            raise ValueError(f"frame of {len(buffer)} bytes does not hold {dtype_str}{shape}")
        return np.frombuffer(buffer, dtype=dtype).reshape(shape)


class CommandDecoder(Decoder):
    """The control socket's decoder: a typed ``Command``, or an ``InvalidCommand`` whose reason
    says which field was wrong, how, and what is allowed. Only a frame that is no command at all
    (not a mapping, no integer ``request_id``) is a ``ProtocolError``: nobody to answer."""

    def __init__(self) -> None:
        super().__init__(dict[str, Any])

    def decode(self, frames: Sequence[Any]) -> Command | InvalidCommand:
        return parse_command(super().decode(frames))


def parse_command(raw: dict[str, Any]) -> Command | InvalidCommand:
    """A decoded mapping -> its command, or an ``InvalidCommand`` that explains the problem."""
    request_id = raw.get("request_id")
    if not isinstance(request_id, int) or isinstance(request_id, bool):
        raise ProtocolError(f"command without an integer request_id: {request_id!r}")
    name = raw.get("type")
    args = {k: v for k, v in raw.items() if k not in ("type", "request_id")}
    cls = COMMAND_BY_NAME.get(name) if isinstance(name, str) else None
    if cls is None:
        reason = f"unknown command {name!r} (allowed: {', '.join(COMMANDS)})"
        return InvalidCommand(request_id=request_id, name=str(name), args=args, reason=reason)
    try:
        return msgspec.convert(raw, cls)
    except msgspec.ValidationError as exc:
        reason = explain_invalid(cls, args, str(exc))
        return InvalidCommand(request_id=request_id, name=cls.name, args=args, reason=reason)


_KINDS = {
    "int": "an integer",
    "float": "a number",
    "str": "a string",
    "bool": "true or false",
    "array": "a list",
    "object": "a mapping",
    "null": "null",
}
_AT = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$")
_FIELD = re.compile(r"`(?P<field>[^`]+)`")
_WRONG_TYPE = re.compile(r"^Expected `(?P<kinds>[^`]+)`, got `[^`]+`$")
_BOUND = re.compile(r"^Expected `[^`]+` (?P<op>[<>]=?) (?P<limit>\S+)$")
_LENGTH = re.compile(r"^Expected `[^`]+` of length (?P<op>[<>]=?) (?P<limit>\d+)$")


def explain_invalid(cls: type[_Command], args: dict[str, Any], error: str) -> str:
    """msgspec's validation error for command ``cls`` -> which field, what was wrong, what is
    allowed (from the field's ``Meta(description=...)``)."""
    fields = {f.name: f for f in msgspec.structs.fields(cls) if f.name != "request_id"}
    at = _AT.match(error)
    assert at is not None  # the pattern matches any string
    what, path = at["what"], at["path"] or ""
    if what.startswith("Object missing required field"):
        field = _FIELD.search(what)
        wanted = field["field"] if field else "?"
        return f"{cls.name} needs {wanted}: {_allowed(fields.get(wanted))}"
    if what.startswith("Object contains unknown field"):
        field = _FIELD.search(what)
        allowed = ", ".join(fields) or "no arguments"
        return f"{cls.name}: unknown field {field['field'] if field else '?'} (allowed: {allowed})"
    top = re.split(r"[.\[]", path.lstrip("."), maxsplit=1)[0]
    value = _value_at(args, path)
    if wrong := _WRONG_TYPE.match(what):
        kinds = " or ".join(_KINDS.get(k, k) for k in wrong["kinds"].split(" | "))
        problem = f"is not {kinds}"
    elif bound := _LENGTH.match(what):
        size = f"{len(value)} items" if isinstance(value, list | str | dict) else "a length"
        problem = f"has {size} (must have {bound['op']} {bound['limit']})"
    elif bound := _BOUND.match(what):
        problem = f"is out of range (must be {bound['op']} {bound['limit']})"
    else:
        problem = f"is invalid ({what})"
    return f"{cls.name}: {path.lstrip('.') or '?'}: {value!r} {problem}; allowed: " + _allowed(
        fields.get(top)
    )


def _allowed(field: msgspec.structs.FieldInfo | None) -> str:
    if field is None:
        return "?"
    described = [m.description for m in _metas(field.type) if m.description]
    return described[0] if described else _type_name(field.type)


def _metas(tp: Any) -> list[msgspec.Meta]:
    """The ``Meta`` annotations inside a field type (``Annotated[...] | None`` included)."""
    if typing.get_origin(tp) is Annotated:
        return [m for m in tp.__metadata__ if isinstance(m, msgspec.Meta)]
    return [m for arg in typing.get_args(tp) for m in _metas(arg)]


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp)


def _value_at(args: dict[str, Any], path: str) -> Any:
    """The sent value at msgspec's error path (``.ids[1]``)."""
    value: Any = args
    for key, index in re.findall(r"\.(\w+)|\[(\d+)\]", path):
        try:
            value = value[key] if key else value[int(index)]
        except (KeyError, IndexError, TypeError):
            return None
    return value


def _as_bytes(frame: Any) -> bytes | memoryview:
    """zmq.Frame, bytes or memoryview -> a bytes-like object (no copy for frames)."""
    buffer = getattr(frame, "buffer", None)
    return buffer if buffer is not None else frame


class FrameGuard:
    """Decodes frames from one socket; garbage is logged and counted, never raised."""

    def __init__(self, socket_name: str, decoder: Decoder | None = None) -> None:
        self.socket_name = socket_name
        self.decoder = decoder or Decoder()
        self.rejected: Counter[str] = Counter()

    @property
    def rejected_total(self) -> int:
        return sum(self.rejected.values())

    def decode(self, frames: Sequence[Any], peer: str = "?") -> Any | None:
        try:
            return self.decoder.decode(frames)
        except ProtocolError as exc:
            self.rejected[type(exc).__name__] += 1
            log.warning("rejected frame on %s socket from %s: %s", self.socket_name, peer, exc)
            return None


def encode_topic(topic: bytes, message: _Message, encoder: Encoder) -> list[Any]:
    """Telemetry frames: ``[topic, header, *arrays]``."""
    return [topic, *encoder.encode(message)]


TOPIC_SNAPSHOT = b"snapshot"
TOPIC_EVENT = b"event"
