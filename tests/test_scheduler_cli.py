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


def test_max_tokens_caps_the_predictions_a_plan_sorts_on(tmp_path, capsys):
    lengths = tmp_path / "p.csv"
    lengths.write_text("prompt_id,output_tokens\n" + "".join(f"{p},{60 - p}\n" for p in range(40)))

    def sorted_plan(*cap: str) -> list[int]:
        out = tmp_path / "plan.csv"
        argv = ["plan", "--lengths", str(lengths), "--instances", "1", "--policy", "sorted"]
        assert cli([*argv, "--out", str(out), *cap]) == 0
        return [int(r["prompt_id"]) for r in csv.DictReader(out.open())]

    assert sorted_plan() == list(range(39, -1, -1))  # shortest (60 - p) first
    # Past the cap every prediction is the cap: those prompts tie and keep the file's order.
    assert sorted_plan("--max-tokens", "30") == [*range(39, 30, -1), *range(31)]
    with pytest.raises(SystemExit) as e:
        cli(["simulate", "--lengths", str(lengths), "--instances", "1", "--max-tokens", "0"])
    assert e.value.code == 2
    assert "--max-tokens" in capsys.readouterr().err


# --- string prompt ids ----------------------------------------------------------------------


def _string_id_file(path: Path, groups: int = 40, n: int = 4) -> list[str]:
    """A long file whose ids are text as real datasets spell them (mixed with number-like ids,
    which stay text: '007' is not 7)."""
    ids = [f"h7-{k}" if k % 3 else f"{k:03d}" for k in range(groups)]
    path.write_text(
        "prompt_id,output_tokens\n"
        + "".join(f"{x},{20 + 7 * k + 13 * j}\n" for k, x in enumerate(ids) for j in range(n))
    )
    return ids


def test_plan_writes_string_ids_back_unchanged(tmp_path, capsys):
    f, out = tmp_path / "ids.csv", tmp_path / "plan.csv"
    ids = _string_id_file(f)
    for policy in ("fifo", "sorted", "asp"):
        rc = cli(
            [
                "plan",
                "--lengths",
                str(f),
                "--instances",
                "3",
                "--policy",
                policy,
                "--max-num-seqs",
                "8",
                "--out",
                str(out),
                "--json",
            ]
        )
        assert rc == 0, capsys.readouterr().err
        d = json.loads(capsys.readouterr().out)
        rows = list(csv.DictReader(out.open()))
        # Every id of the file, once, spelled as in the file.
        assert sorted(r["prompt_id"] for r in rows) == sorted(ids)
        assert "000" in {r["prompt_id"] for r in rows}
        assert d["latency_lower_bound_s"] > 0 and d["ratio_to_latency_bound"] >= 1.0
        assert d["ratio_to_bound"] >= 1.0


def test_simulate_string_ids_with_an_actual_file(tmp_path, capsys):
    pred, act = tmp_path / "p.csv", tmp_path / "a.csv"
    ids = _string_id_file(pred, n=1)
    # The actual file lists the same ids in another order, in the wide form.
    act.write_text(
        "prompt_id,o1,o2\n"
        + "".join(f"{x},{30 + k},{90 - k}\n" for k, x in reversed(list(enumerate(ids))))
    )
    args = ["simulate", "--lengths", str(pred), "--actual", str(act), "--instances", "2"]
    assert cli([*args, "--max-num-seqs", "4", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["groups"] == 40 and d["group_size"] == 2
    for s in d["policies"].values():
        assert sum(s["lag_histogram"].values()) == 40
        assert s["iteration_s"] >= s["latency_lower_bound_s"] > 0
        assert s["iteration_s"] >= s["lower_bound_s"] > 0
    # Same ids, same lengths: the split of one wide string-id file gives the same groups.
    assert cli([*args, "--max-num-seqs", "4"]) == 0
    assert "xLLB" in capsys.readouterr().out


@pytest.mark.parametrize("cmd", ["plan", "simulate"])
def test_string_id_errors_exit_2_naming_file_line_and_id(tmp_path, capsys, cmd):
    f = tmp_path / "w.csv"
    f.write_text("prompt_id,o1,o2\nq-1,1,2\nq-2,3,4\nq-1,5,6\n")
    assert cli([cmd, "--lengths", str(f), "--instances", "2"]) == 2
    err = capsys.readouterr().err
    assert f"{f}:4" in err and "'q-1' repeats line 2" in err


def test_actual_ids_must_have_a_prediction(tmp_path, capsys):
    pred, act = tmp_path / "p.csv", tmp_path / "a.csv"
    pred.write_text("prompt_id,output_tokens\nq-1,10\nq-2,20\n")
    act.write_text("prompt_id,output_tokens\nq-1,12\nq-2,25\nQ-3,7\n")
    rc = cli(["simulate", "--lengths", str(pred), "--actual", str(act), "--instances", "1"])
    assert rc == 2
    err = capsys.readouterr().err
    assert f"{act}:4: prompt_id 'Q-3' has no prediction in {pred}" in err


# --- the default batch size -----------------------------------------------------------------


def test_default_batch_groups_leaves_at_least_16_steps(tmp_path, capsys):
    from runtime.scheduler.cli import MIN_STEPS, default_batch_groups

    # The case: 2,048 groups of 8 on 16 instances of 256 slots filled 4 steps.
    assert default_batch_groups(16, 256, 8, 2048) == 2048 // MIN_STEPS == 128
    # A small cluster keeps its fill-once batch; fewer groups than 16 steps: one per step.
    assert default_batch_groups(2, 8, 4, 10_000) == 4
    assert default_batch_groups(16, 256, 8, 5) == 1
    f = tmp_path / "many.csv"
    f.write_text(
        "prompt_id,output_tokens\n"
        + "".join(f"g{p},{10 + p % 50}\n" for p in range(320) for _ in range(2))
    )
    assert (
        cli(["simulate", "--lengths", str(f), "--instances", "16", "--policy", "fifo", "--json"])
        == 0
    )
    d = json.loads(capsys.readouterr().out)
    assert d["batch_groups"] == 20
    assert d["policies"]["fifo"]["steps"] == 16
