"""``plan`` and ``simulate`` subcommands (runtime/scheduler/cli.py)."""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

import pytest

from runtime.scheduler.cli import add_plan_parser, add_simulate_parser

DATA = Path(__file__).parent / "data"


def cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers()
    add_plan_parser(sub)
    add_simulate_parser(sub)
    args = p.parse_args(argv)
    return args.func(args)


def test_plan_writes_every_group_once(tmp_path, capsys):
    out = tmp_path / "plan.csv"
    rc = cli(
        [
            "plan",
            "--lengths",
            str(DATA / "seqsched_sample.csv"),
            "--instances",
            "3",
            "--policy",
            "asp",
            "--max-num-seqs",
            "12",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    rows = list(csv.DictReader(out.open()))
    assert list(rows[0]) == ["instance", "position", "prompt_id"]
    assert len(rows) == 60
    ids = [int(r["prompt_id"]) for r in rows]
    assert len(set(ids)) == 60
    for i in {r["instance"] for r in rows}:
        pos = [int(r["position"]) for r in rows if r["instance"] == i]
        assert pos == list(range(len(pos)))
    text = capsys.readouterr().out
    assert "predicted bubble breakdown" in text and "ratio" in text


def test_plan_json_and_long_file(tmp_path, capsys):
    f = tmp_path / "l.csv"
    f.write_text(
        "prompt_id,output_tokens\n"
        + "".join(f"{p},{10 + p * k}\n" for p in range(20) for k in range(4))
    )
    assert (
        cli(
            [
                "plan",
                "--lengths",
                str(f),
                "--instances",
                "2",
                "--policy",
                "fifo",
                "--max-num-seqs",
                "8",
                "--json",
            ]
        )
        == 0
    )
    d = json.loads(capsys.readouterr().out)
    assert d["groups"] == 20 and sum(r["groups"] for r in d["per_instance"]) == 20
    assert sum(d["predicted_breakdown"].values()) == pytest.approx(1.0)
    assert d["ratio_to_bound"] >= 1.0


def test_simulate_all_policies_json(capsys):
    rc = cli(
        [
            "simulate",
            "--lengths",
            str(DATA / "castillo_sample.csv"),
            "--instances",
            "2",
            "--policy",
            "all",
            "--max-num-seqs",
            "18",
            "--lag-bound",
            "0",
            "--json",
        ]
    )
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    assert set(d["policies"]) == {"fifo", "sorted", "asp"}
    assert d["group_size"] == 9
    for s in d["policies"].values():
        assert s["lag_histogram"] == {"0": 60}
    assert -1 <= d["predictor"]["spearman_rho"] <= 1


def test_simulate_table_and_actual_file(tmp_path, capsys):
    pred = tmp_path / "p.csv"
    act = tmp_path / "a.csv"
    pred.write_text("prompt_id,output_tokens\n" + "".join(f"{p},{5 + p}\n" for p in range(30)))
    act.write_text(
        "prompt_id,output_tokens\n" + "".join(f"{p},{40 - p}\n{p},{3 + p}\n" for p in range(30))
    )
    assert (
        cli(
            [
                "simulate",
                "--lengths",
                str(pred),
                "--actual",
                str(act),
                "--instances",
                "2",
                "--max-num-seqs",
                "4",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "fifo" in out and "asp" in out and "Spearman" in out


@pytest.mark.parametrize("cmd", ["plan", "simulate"])
@pytest.mark.parametrize(
    "content,needle",
    [
        ("", "empty"),
        ("prompt_id,x\n1,2\n", "output_tokens"),
        ("prompt_id,output_tokens\n1,-2\n", "negative"),
    ],
)
def test_bad_files_exit_2_with_the_reason(tmp_path, capsys, cmd, content, needle):
    f = tmp_path / "bad.csv"
    f.write_text(content)
    assert cli([cmd, "--lengths", str(f), "--instances", "2"]) == 2
    assert needle in capsys.readouterr().err


def test_missing_file_and_bad_flags(capsys):
    assert cli(["simulate", "--lengths", "/nonexistent.csv", "--instances", "2"]) == 2
    assert "no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli(["plan", "--lengths", "x.csv", "--instances", "0"])
    assert e.value.code == 2
