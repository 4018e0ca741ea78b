"""The ledger writer and its verifier: good histories pass, each kind of loss or double
consumption is caught."""

from __future__ import annotations

from runtime.controller.ledger import Ledger, epoch_samples, verify_ledger, verify_records


def d(group, prompt, epoch=0, instance=0, version=0):
    return {
        "event": "dispatched",
        "group": group,
        "prompt": prompt,
        "epoch": epoch,
        "instance": instance,
        "version": version,
    }


def ev(event, group, **extra):
    return {"event": event, "group": group, **extra}


def test_writer_round_trip_is_ok(tmp_path):
    path = tmp_path / "ledger.jsonl"
    ledger = Ledger(path)
    ledger.controller_start(version=0, epoch=0, resumed=False)
    ledger.dispatched(0, prompt=5, epoch=0, instance=1, version=0)
    ledger.dispatched(1, prompt=6, epoch=0, instance=0, version=0)
    ledger.completed(0, instance=1, version_min=0, version_max=0, lengths=[3, 5])
    ledger.requeued(1, reason="instance 0 lost")
    ledger.dispatched(2, prompt=6, epoch=0, instance=1, version=0)
    ledger.completed(2, instance=1, version_min=0, version_max=1, lengths=[7, 1])
    ledger.consumed([0, 2], step=0, lags=[0, 0])
    ledger.ignored(1, reason="late result")
    ledger.close()
    report = verify_ledger(path)
    assert report.ok, report.errors
    assert report.dispatched == 3
    assert report.counts["consumed"] == 2 and report.counts["requeued"] == 1
    assert report.requeued_pending == [] and report.in_flight == [] and report.queued == []


def test_double_consumption_is_caught():
    report = verify_records(
        [d(0, 1), ev("completed", 0), ev("consumed", 0, step=0), ev("consumed", 0, step=1)]
    )
    assert not report.ok and report.consumed_twice == [0]


def test_same_prompt_consumed_twice_in_one_epoch_is_caught():
    records = [
        d(0, 7),
        d(1, 7),
        ev("completed", 0),
        ev("completed", 1),
        ev("consumed", 0, step=0),
        ev("consumed", 1, step=0),
    ]
    report = verify_records(records)
    assert not report.ok and report.prompts_consumed_twice == [(0, 7)]
    # The same prompt in the next epoch is a new sample, not a duplicate.
    records[1] = d(1, 7, epoch=1)
    assert verify_records(records).ok


def test_impossible_transitions_are_errors():
    assert not verify_records([ev("completed", 3)]).ok  # never dispatched
    assert not verify_records([d(0, 1), ev("consumed", 0, step=0)]).ok  # not completed
    assert not verify_records([d(0, 1), d(0, 1)]).ok  # dispatched twice
    assert not verify_records([d(0, 1), ev("requeued", 0), ev("completed", 0)]).ok
    assert not verify_records([d(0, 1), ev("completed", 0), ev("aborted", 0)]).ok


def test_given_back_and_never_redispatched_is_reported():
    report = verify_records([d(0, 4), ev("aborted", 0, reason="lag bound")])
    assert report.ok and report.requeued_pending == [(0, 4)]
    report = verify_records([d(0, 4), ev("aborted", 0), d(1, 4), ev("completed", 1)])
    assert report.requeued_pending == [] and report.queued == [1]


def test_restart_abandons_open_groups():
    records = [
        d(0, 1),
        d(1, 2),
        ev("completed", 1),
        {"event": "controller_start", "version": 3, "epoch": 0, "resumed": True},
        d(2, 1),
        ev("completed", 2),
        ev("consumed", 2, step=3),
    ]
    report = verify_records(records)
    assert report.ok and report.counts["abandoned"] == 2 and report.restarts == 1
    assert report.requeued_pending == [(0, 2)]


def test_an_epochs_samples_are_its_consumed_groups_lengths():
    """A deferred prompt counts once, with the group that was consumed, not the aborted one."""
    records = [
        d(0, 1),
        d(1, 2),
        ev("completed", 0, lengths=[4, 6]),
        ev("aborted", 1, reason="deferred"),
        ev("consumed", 0, step=1),
        d(2, 2),
        ev("completed", 2, lengths=[1, 1]),
    ]
    samples = epoch_samples(records, epoch=0)
    assert samples.prompts == 2 and samples.lengths == {1: [4, 6]}
    assert not samples.complete  # prompt 2 not consumed, and the epoch not all handed out

    records += [ev("consumed", 2, step=2), d(3, 1, epoch=1)]
    samples = epoch_samples(records, epoch=0)
    assert samples.lengths == {1: [4, 6], 2: [1, 1]} and samples.complete
    assert samples.mean_length == 3.0
    # The next epoch's groups are its own.
    assert epoch_samples(records, epoch=1).prompts == 1
    assert not epoch_samples(records, epoch=1).complete
