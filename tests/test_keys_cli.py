"""``asp-tui keys``: make a key pair, show it, authorize it on a run; bad input exits 2."""

from __future__ import annotations

import stat

import pytest

from asp_tui.cli import main
from runtime.auth import Role, RunKeys


@pytest.fixture
def run_keys(tmp_path) -> RunKeys:
    return RunKeys(tmp_path / "run" / "keys").ensure()


def test_new_show_add_list(tmp_path, run_keys, capsys, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    assert main(["keys", "new"]) == 0
    public = capsys.readouterr().out.strip()
    secret = tmp_path / "config" / "asp-tui" / "client.key_secret"
    assert len(public) == 40 and stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert main(["keys", "new"]) == 2  # never overwrites a key silently
    assert "--force" in capsys.readouterr().err
    assert main(["keys", "show"]) == 0
    assert capsys.readouterr().out.strip() == public

    run = str(run_keys.dir.parent)
    assert main(["keys", "add", run, "--role", "viewer", public, "--name", "alice"]) == 0
    assert run_keys.roles()[public] is Role.VIEWER
    # A .key file works as well as the text, and a second add changes the role.
    assert main(["keys", "add", run, "--role", "operator", str(secret.with_suffix(".key"))]) == 0
    assert run_keys.roles()[public] is Role.OPERATOR and len(run_keys.authorized()) == 1
    capsys.readouterr()
    assert main(["keys", "list", run]) == 0
    listing = capsys.readouterr().out
    assert f"operator  {public}  alice" in listing and listing.count("the run's own") == 4
    assert main(["keys", "remove", run, public]) == 0
    assert public not in run_keys.roles()
    assert main(["keys", "remove", run, public]) == 2
    assert "not among the keys authorized" in capsys.readouterr().err


def test_a_key_that_starts_with_a_dash_is_a_key_not_an_option(run_keys, capsys):
    import zmq

    public = next(k for k in iter(lambda: zmq.curve_keypair()[0].decode(), "") if k[0] == "-")
    run = str(run_keys.dir.parent)
    for argv in (["--role", "viewer", public], [public, "--role", "viewer", "--name", "bob"]):
        assert main(["keys", "add", run, *argv]) == 0, capsys.readouterr().err
        assert run_keys.roles()[public] is Role.VIEWER
    assert main(["keys", "remove", run, public]) == 0
    assert public not in run_keys.roles()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--role", "admin", "K" * 40], "role 'admin' is not one of: operator, viewer, worker"),
        (["--role", "viewer", "tooshort"], "40 Z85 characters"),
        (["--role", "viewer", "~" * 40], "not valid Z85"),
    ],
)
def test_bad_role_or_key_exits_2(run_keys, capsys, argv, message):
    assert main(["keys", "add", str(run_keys.dir.parent), *argv]) == 2
    assert message in capsys.readouterr().err
    assert run_keys.authorized() == []


def test_not_a_run_dir_exits_2(tmp_path, capsys):
    key = "K" * 40
    assert main(["keys", "add", str(tmp_path), "--role", "viewer", key]) == 2
    assert "no keys/ here" in capsys.readouterr().err
    assert main(["keys", "show", str(tmp_path / "missing.key")]) == 2
    assert main(["keys", "list", str(tmp_path)]) == 2


def test_attach_without_a_readable_key_exits_2(tmp_path, capsys, monkeypatch):
    from runtime.rundir import Endpoints, RunDir

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv("ASP_TUI_KEY", raising=False)
    rd = RunDir(tmp_path / "run").create()
    rd.write_endpoints(
        Endpoints(
            rollout="tcp://127.0.0.1:1",
            trainer="tcp://127.0.0.1:2",
            telemetry="tcp://127.0.0.1:3",
            control="tcp://127.0.0.1:4",
            controller_pid=0,
            run_name="r",
            server_public_key="K" * 40,
            keys_dir=str(tmp_path / "elsewhere"),
        )
    )
    assert main(["attach", str(rd.root), "--readonly"]) == 2
    assert "no viewer key" in capsys.readouterr().err
    assert main(["attach", str(rd.root), "--key", str(tmp_path / "nope.key_secret")]) == 2
    assert "asp-tui keys new" in capsys.readouterr().err
