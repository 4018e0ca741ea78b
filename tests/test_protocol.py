"""The wire codec: round trips, zero-copy array frames, and garbage that must not get through."""

from __future__ import annotations

import contextlib

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime import protocol
from runtime.auth import READ_ONLY_COMMANDS
from runtime.protocol import (
    Completion,
    Decoder,
    Encoder,
    FrameGuard,
    GroupDone,
    Heartbeat,
    ProtocolError,
    Snapshot,
)


def _group_done(length: int = 7) -> GroupDone:
    completion = Completion(
        token_ids=np.arange(length, dtype=np.int32),
        logprobs=-np.linspace(0.1, 2.0, length, dtype=np.float32),
        version_min=3,
        version_max=4,
        finish_reason="stop",
        reward=0.5,
        finished_at=12.5,
    )
    return GroupDone(
        group_id=9,
        prompt_id=2,
        instance_id=1,
        completions=[completion, completion],
        started_at=10.0,
        finished_at=12.5,
    )


def test_round_trip_keeps_arrays_out_of_the_header() -> None:
    message = _group_done(length=1000)
    frames = Encoder().encode(message)
    assert len(frames) == 1 + 4  # header + token ids and logprobs of two completions
    assert len(frames[0]) < 600  # the 8 KB of arrays are not packed into the header
    decoded = Decoder().decode([bytes(f) for f in frames])
    assert isinstance(decoded, GroupDone)
    np.testing.assert_array_equal(decoded.completions[1].token_ids, np.arange(1000))
    assert decoded.completions[0].logprobs.dtype == np.float32
    assert decoded.completions[0].version_max == 4


def test_empty_arrays_round_trip() -> None:
    decoded = Decoder().decode([bytes(f) for f in Encoder().encode(_group_done(length=0))])
    assert decoded.completions[0].token_ids.shape == (0,)


def test_partial_outputs_round_trip_in_aborts_and_generates() -> None:
    partial = [
        protocol.PartialSample(
            token_ids=np.arange(5 + k, dtype=np.int32),
            logprobs=np.full(5 + k, -0.25, np.float32),
            version_min=2,
            version_max=3,
            finish_reason="stop" if k == 0 else "abort",
            finished_at=4.0 if k == 0 else 0.0,
        )
        for k in range(2)
    ]
    aborted = protocol.GroupAborted(group_id=4, instance_id=1, reason="asked", partial=partial)
    generate = protocol.Generate(
        group_id=4, prompt_id=2, prompt_token_ids=np.arange(3, dtype=np.int32), n=2,
        max_tokens=64, priority=-2, prefix=partial,
    )  # fmt: skip
    for message in (aborted, generate, protocol.AbortGroups(group_ids=[4], partial=True)):
        frames = Encoder().encode(message)
        decoded = Decoder().decode([bytes(f) for f in frames])
        assert type(decoded) is type(message)
        as_lists = {"enc_hook": np.ndarray.tolist}
        assert msgspec.to_builtins(decoded, **as_lists) == msgspec.to_builtins(message, **as_lists)
    decoded = Decoder().decode([bytes(f) for f in Encoder().encode(generate)])
    assert decoded.priority == -2 and decoded.prefix[1].finish_reason == "abort"
    np.testing.assert_array_equal(decoded.prefix[1].token_ids, np.arange(6))
    # Old senders omit them: a plain Generate, abort and GroupAborted decode as before.
    plain = Decoder().decode(
        Encoder().encode(protocol.GroupAborted(group_id=4, instance_id=1, reason="x"))
    )
    assert plain.partial is None


def test_every_message_type_is_in_the_union() -> None:
    snapshot = Snapshot(
        run_name="r", time=1.0, seq=1, state="running", step=2, total_steps=3,
        weight_version=2, lag_bound=1,
    )  # fmt: skip
    decoded = Decoder().decode(Encoder().encode(snapshot))
    assert decoded == snapshot


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([], "empty"),
        ([b"\xc1garbage"], "malformed header"),
        ([msgspec.msgpack.encode((99, {"type": "Heartbeat"}))], "protocol version 99"),
        ([msgspec.msgpack.encode((1, {"type": "NoSuchMessage"}))], "invalid message"),
        ([msgspec.msgpack.encode((1, {"type": "Heartbeat", "instance_id": "x"}))], "invalid"),
    ],
)
def test_decoder_rejects_garbage_with_a_reason(frames: list[bytes], reason: str) -> None:
    with pytest.raises(ProtocolError, match=reason):
        Decoder().decode(frames)


def test_array_frame_that_does_not_match_its_header_is_rejected() -> None:
    frames = [bytes(f) for f in Encoder().encode(_group_done(length=4))]
    with pytest.raises(ProtocolError, match="array frame"):
        Decoder().decode([frames[0], frames[1], b"\x00" * 3, *frames[3:]])
    with pytest.raises(ProtocolError, match="array frame"):
        Decoder().decode(frames[:2])  # frames referenced by the header are missing


def test_oversized_frames_are_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(protocol, "MAX_FRAME_BYTES", 16)
    frames = [bytes(f) for f in Encoder().encode(_group_done(length=8))]
    with pytest.raises(ProtocolError, match="exceeds"):
        Decoder().decode(frames)


def test_frame_guard_counts_and_survives() -> None:
    guard = FrameGuard("rollout")
    assert guard.decode([b"\x00"]) is None
    assert guard.decode([b""]) is None
    heartbeat = Heartbeat(
        instance_id=0, state="running", weight_version=1, running_seqs=2,
        tokens_generated=10, time=0.0,
    )  # fmt: skip
    assert guard.decode(Encoder().encode(heartbeat)) == heartbeat
    assert guard.rejected_total == 2


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), min_size=0, max_size=4))
def test_random_bytes_never_escape_as_anything_but_protocol_error(frames: list[bytes]) -> None:
    with contextlib.suppress(ProtocolError):
        Decoder().decode(frames)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_mutated_valid_messages_decode_or_fail_cleanly(data: st.DataObject) -> None:
    frames = [bytearray(bytes(f)) for f in Encoder().encode(_group_done(length=5))]
    for _ in range(data.draw(st.integers(1, 6))):
        frame = frames[data.draw(st.integers(0, len(frames) - 1))]
        if frame:
            frame[data.draw(st.integers(0, len(frame) - 1))] = data.draw(st.integers(0, 255))
    with contextlib.suppress(ProtocolError):
        Decoder().decode([bytes(f) for f in frames])


# --- commands ---------------------------------------------------------------------------------


def _sent(raw: dict) -> list[bytes]:
    return [msgspec.msgpack.encode((protocol.PROTOCOL_VERSION, raw))]


def test_commands_round_trip_typed() -> None:
    decoder = protocol.CommandDecoder()
    for command in (
        protocol.StatusCmd(request_id=1),
        protocol.HistoryCmd(request_id=2, limit=5),
        protocol.SetLagBound(request_id=3, value=0),
        protocol.PauseInstances(request_id=4, ids=[0, 2]),
        protocol.ResumeInstances(request_id=5, ids=[1]),
        protocol.RestartInstances(request_id=6, ids=[3]),
        protocol.StopRun(request_id=7),
    ):
        assert decoder.decode(Encoder().encode(command)) == command
    assert protocol.COMMANDS == (
        "status", "history", "set_lag_bound", "pause_instance", "resume_instance",
        "restart_instance", "stop",
    )  # fmt: skip
    assert protocol.SetLagBound(value=1).args == {"value": 1}


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ({"type": "bogus"}, "unknown command 'bogus' (allowed: status, history,"),
        ({"type": 7}, "unknown command 7"),
        ({"type": "set_lag_bound"}, "set_lag_bound needs value: an integer 0..async.max_lag_bound"),
        (
            {"type": "set_lag_bound", "value": "one"},
            "set_lag_bound: value: 'one' is not an integer; allowed: an integer",
        ),
        ({"type": "set_lag_bound", "value": True}, "value: True is not an integer"),
        ({"type": "set_lag_bound", "value": -1}, "value: -1 is out of range (must be >= 0)"),
        (
            {"type": "set_lag_bound", "valu": 1},
            "set_lag_bound: unknown field valu (allowed: value)",
        ),
        (
            {"type": "pause_instance", "ids": []},
            "ids: [] has 0 items (must have >= 1); allowed: a non-empty list of instance ids",
        ),
        ({"type": "pause_instance", "ids": [1, "x"]}, "pause_instance: ids[1]: 'x' is not an int"),
        ({"type": "pause_instance", "ids": 3}, "ids: 3 is not a list"),
        ({"type": "history", "limit": 0}, "history: limit: 0 is out of range (must be >= 1)"),
        ({"type": "history", "limit": "a"}, "limit: 'a' is not an integer or null"),
        ({"type": "stop", "now": True}, "stop: unknown field now (allowed: no arguments)"),
    ],
)
def test_a_bad_command_is_answered_with_what_was_wrong(raw: dict, reason: str) -> None:
    decoded = protocol.CommandDecoder().decode(_sent({**raw, "request_id": 41}))
    assert isinstance(decoded, protocol.InvalidCommand)
    assert decoded.request_id == 41 and reason in decoded.reason, decoded.reason
    assert decoded.args == {k: v for k, v in raw.items() if k != "type"}


@pytest.mark.parametrize("raw", [{"type": "status"}, {"type": "status", "request_id": "1"}])
def test_a_command_nobody_can_be_answered_for_is_garbage(raw: dict) -> None:
    with pytest.raises(ProtocolError, match="request_id"):
        protocol.CommandDecoder().decode(_sent(raw))
    with pytest.raises(ProtocolError, match="invalid message"):
        protocol.CommandDecoder().decode(_sent([1, 2]))  # type: ignore[arg-type]


def test_viewers_may_send_only_the_read_only_commands() -> None:
    assert sorted(READ_ONLY_COMMANDS) == ["history", "status"]
