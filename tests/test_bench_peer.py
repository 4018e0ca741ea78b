"""The peer benchmark's summaries (bench/peer.py): steady medians, reward means, ratios.

No processes are started and nothing is timed; the benchmark's numbers are not asserted.
"""

from __future__ import annotations

import math

import pytest
from bench_scripts import load_bench

peer = load_bench("peer")


def test_steady_leaves_out_the_warmup_steps() -> None:
    values = [10.0, 9.0, 8.0, 7.0, 1.0, 2.0, 3.0]
    assert peer.steady(values, warmup=4) == [1.0, 2.0, 3.0]
    assert peer.median_steady(values, warmup=4) == 2.0


def test_steady_needs_two_steps_after_the_warmup() -> None:
    with pytest.raises(ValueError, match="at least 6"):
        peer.steady([1.0] * 5, warmup=4)


def test_steady_rate_is_total_tokens_over_total_seconds() -> None:
    tokens = [999, 999, 100, 300]
    seconds = [50.0, 50.0, 1.0, 4.0]
    # (100 + 300) / (1 + 4) = 80, not the mean of the per-step rates (87.5)
    assert peer.steady_rate(tokens, seconds, warmup=2) == pytest.approx(80.0)


def test_first_and_last_means() -> None:
    rewards = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1]
    assert peer.first_mean(rewards, 5) == pytest.approx(0.2)
    assert peer.last_mean(rewards, 5) == pytest.approx(0.9)
    assert peer.first_mean([0.5, 1.0], 5) == pytest.approx(0.75)  # fewer steps than the edge
    with pytest.raises(ValueError):
        peer.last_mean([], 5)


def test_ratio() -> None:
    assert peer.ratio(3.0, 1.5) == pytest.approx(2.0)
    assert math.isnan(peer.ratio(1.0, 0.0))
    assert math.isnan(peer.ratio(math.nan, 1.0))
    assert math.isnan(peer.ratio(1.0, math.nan))


def test_summarise_a_run() -> None:
    steps = 30
    seconds = [20.0] * 4 + [1.0, 3.0] * 13  # steady median 2.0 despite the slow start
    tokens = [500] * steps
    rewards = [0.1] * 5 + [0.5] * 20 + [0.8] * 5
    summary = peer.summarise(peer.Series(tuple(seconds), tuple(tokens), tuple(rewards)))
    assert summary.s_per_step == pytest.approx(2.0)
    assert summary.tokens_per_s == pytest.approx(250.0)
    assert summary.reward_first == pytest.approx(0.1)
    assert summary.reward_last == pytest.approx(0.8)


def test_series_lengths_must_agree() -> None:
    with pytest.raises(ValueError, match="lengths differ"):
        peer.Series((1.0, 2.0), (1,), (0.5, 0.5))


def test_median_summary_takes_each_field_over_runs() -> None:
    runs = [
        peer.Summary(s_per_step=1.0, tokens_per_s=300.0, reward_first=0.2, reward_last=0.9),
        peer.Summary(s_per_step=3.0, tokens_per_s=100.0, reward_first=0.4, reward_last=0.5),
        peer.Summary(s_per_step=2.0, tokens_per_s=200.0, reward_first=0.3, reward_last=0.7),
    ]
    assert peer.median_summary(runs) == peer.Summary(2.0, 200.0, 0.3, 0.7)
    with pytest.raises(ValueError):
        peer.median_summary([])


@pytest.mark.parametrize(
    "argv",
    [
        ["--runs", "0"],
        ["--steps", "5"],
        ["--skip-peer", "--skip-ours"],
        ["--set", "trainer.steps=10"],
        ["--set", "no_such_section.x=1"],
        ["--config", "no/such/file.yaml"],
        ["--no-such-flag"],
    ],
)
def test_bad_flags_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        peer.main(argv)
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip()
