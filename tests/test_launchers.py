"""Processes on other hosts, piece by piece: the config's rules, the argv each launcher kind
builds, what the bootstrap carries, and ``python -m runtime.remote`` run for real (the quoting
of a remote shell line is checked by running that line in a local shell). The whole path, with
hosts in network namespaces, is tests/test_netns.py; ssh and srun themselves are not run here
(no sshd, no SLURM on this machine)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import psutil
import pytest

from runtime.auth import Role, RunKeys
from runtime.config import ConfigError, LauncherConfig, load_config
from runtime.controller.launchers import Launchers, launch_argv
from runtime.remote import BOOTSTRAP_ENV, Bootstrap, encode_bootstrap, run_context
from runtime.rundir import Endpoints
from runtime.trainer import trainer_command

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny.yaml"
REMOTE = ["controller.host=0.0.0.0"]


def _config(*overrides: str):
    return load_config(TINY, list(overrides))


@pytest.mark.parametrize(
    ("overrides", "field", "words"),
    [
        (["rollout.instances=[{host: node1}]"], "controller.host", "loopback"),
        (["trainer.hosts=[node1]"], "controller.host", "node1"),
        ([*REMOTE, "trainer.hosts=[a, a]"], "trainer.hosts", "twice"),
        ([*REMOTE, "trainer.hosts=[localhost, b]"], "trainer.hosts", "mixes"),
        ([*REMOTE, "rollout.instances=[{host: -oProxyCommand=x}]"], "instances[0].host", "'-'"),
        ([*REMOTE, "trainer.hosts=[n1]", "launcher.kind=command"], "launcher.command", "{cmd}"),
        (["launcher.command='ssh {host} {cmd} {gpu}'"], "launcher.command", "gpu"),
        (["launcher.command='ssh {host}'"], "launcher.command", "{cmd}"),
        (["launcher.kind=pbs"], "launcher.kind", "ssh"),
    ],
)
def test_bad_host_and_launcher_settings_name_the_field(
    overrides: list[str], field: str, words: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        _config(*overrides)
    assert field in str(caught.value) and words in str(caught.value), str(caught.value)


def test_sim_processes_stay_on_this_host() -> None:
    sim = REPO / "configs" / "sim-8.yaml"
    with pytest.raises(ConfigError, match="sim trainer runs on this host"):
        load_config(sim, [*REMOTE, "trainer.hosts=[n1]"])
    with pytest.raises(ConfigError, match="sim backend is one process"):
        load_config(sim, [*REMOTE, "rollout.instances=[{host: n1}]"])


def test_cli_exits_2_on_a_remote_host_with_a_loopback_controller(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "asp_tui.cli", "run", "--headless", "--config", str(TINY),
         "--run-dir", str(tmp_path / "run"), "--set", "trainer.hosts=[gpu7]"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "controller.host" in result.stderr and "gpu7" in result.stderr
    assert not (tmp_path / "run").exists()


WORKER = [
    sys.executable,
    "-m",
    "runtime.rollout.worker",
    "--run-dir",
    "runs/x",
    "--instance-id",
    "0",
]


def test_ssh_runs_one_shell_line_with_the_environment_and_workdir() -> None:
    launcher = LauncherConfig(
        python="/opt/venv/bin/python", workdir="/shared/w d", env={"A": "x y"}
    )
    argv = launch_argv(launcher, ["node1"], WORKER)
    assert argv[0] == "ssh" and argv[-2] == "node1"
    assert "BatchMode=yes" in argv  # never waits for a password
    words = shlex.split(argv[-1])
    assert words[:5] == ["cd", "/shared/w d", "&&", "exec", "env"]
    assert "A=x y" in words and any(w.startswith("PYTHONPATH=") for w in words)
    tail = words[words.index("/opt/venv/bin/python") :]
    assert tail == ["/opt/venv/bin/python", "-m", "runtime.remote", "--", "/opt/venv/bin/python",
                    *WORKER[1:]]  # fmt: skip


def test_the_ssh_line_survives_a_real_shell(tmp_path: Path) -> None:
    """What ssh hands to the remote shell, run by a local shell: quoting, cd, env, the wrapper."""
    workdir = tmp_path / "it's here"
    workdir.mkdir()
    launcher = LauncherConfig(workdir=str(workdir), env={"ODD": 'a b\'c "d" $HOME'})
    show = "import os; print(os.getcwd()); print(os.environ['ODD'])"
    argv = launch_argv(launcher, ["node1"], [sys.executable, "-c", show])
    shell = subprocess.Popen(["sh", "-c", argv[-1]], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert shell.stdin is not None and shell.stdout is not None
        shell.stdin.write(_line(tmp=tmp_path))
        shell.stdin.flush()  # and open, as the controller keeps it: its close means "stop"
        assert shell.wait(60) == 0
        lines = shell.stdout.read().splitlines()
    finally:
        shell.kill()
        shell.wait()
    assert lines == [str(workdir), 'a b\'c "d" $HOME']


def test_slurm_asks_for_the_nodes_and_gpus() -> None:
    launcher = LauncherConfig(kind="slurm", srun_options=["--partition=gpu"], workdir="/w")
    argv = launch_argv(launcher, ["gpu1", "gpu2"], trainer_command(_config(), "runs/x"), gpus=4)
    assert argv[:6] == [
        "srun", "--nodes=2", "--ntasks-per-node=1", "--nodelist=gpu1,gpu2",
        "--gpus-per-task=4", "--chdir=/w",
    ]  # fmt: skip
    assert "--partition=gpu" in argv and "--kill-on-bad-exit=1" in argv
    assert argv[argv.index("env") + 1].startswith("PYTHONPATH=")
    no_gpus = launch_argv(LauncherConfig(kind="slurm", gpus=False), ["c1"], WORKER, gpus=1)
    assert not [a for a in no_gpus if a.startswith("--gpus")]


def test_command_template_fills_host_env_and_cmd() -> None:
    launcher = LauncherConfig(kind="command", command="ip netns exec {host} {env} {cmd}")
    argv = launch_argv(launcher, ["ns one"], WORKER)
    assert argv[:2] == ["sh", "-c"]
    words = shlex.split(argv[2])
    assert words[:5] == ["ip", "netns", "exec", "ns one", "env"]
    assert words[-len(WORKER) :] == WORKER


def test_several_hosts_fan_out_one_launcher_each() -> None:
    launcher = LauncherConfig(kind="command", command="run-on {host} {cmd}")
    argv = launch_argv(launcher, ["a", "b"], WORKER)
    assert argv[1:4] == ["-m", "runtime.remote", "--fanout"]
    each = json.loads(argv[4])
    assert [shlex.split(c[2])[:2] for c in each] == [["run-on", "a"], ["run-on", "b"]]


def test_a_multi_host_trainer_is_torchrun_with_one_rendezvous() -> None:
    config = _config(*REMOTE, "trainer.hosts=[h0, h1, h2]", "trainer.num_processes=4")
    argv = trainer_command(config, "runs/x")
    assert argv[1:3] == ["-m", "torch.distributed.run"]
    joined = " ".join(argv)
    assert "--nnodes 3" in joined and "--nproc_per_node 4" in joined
    assert "--rdzv_backend c10d --rdzv_endpoint h0:29500" in joined
    assert "--standalone" not in argv
    config = _config(*REMOTE, "trainer.hosts=[h0, h1]", "trainer.rendezvous=10.0.0.5:1234")
    assert "10.0.0.5:1234" in trainer_command(config, "runs/x")
    assert "--standalone" not in trainer_command(_config(*REMOTE, "trainer.hosts=[h0]"), "x")


def _endpoints(tmp_path: Path) -> Endpoints:
    server = RunKeys(tmp_path / "keys").ensure().server()
    planes = ("rollout", "trainer", "telemetry", "control")
    addresses = {p: f"tcp://10.1.2.3:{5000 + i}" for i, p in enumerate(planes)}
    return Endpoints(**addresses, controller_pid=1, run_name="x", keys_dir=str(tmp_path / "keys"),
                     server_public_key=server.public_text)  # fmt: skip


def test_launchers_send_the_role_key_on_stdin_and_nothing_on_the_command_line(
    tmp_path: Path,
) -> None:
    config = _config(*REMOTE, "rollout.instances=[{host: n1}, {host: localhost}]",
                     "trainer.hosts=[t1]")  # fmt: skip
    keys = RunKeys(tmp_path / "keys").ensure()
    launchers = Launchers(config, _endpoints(tmp_path), keys)
    local = launchers.wrap("worker-1", WORKER)
    assert local.argv == WORKER and local.stdin is None
    for name, role in (("worker-0", Role.WORKER), ("trainer", Role.TRAINER)):
        launch = launchers.wrap(name, WORKER)
        assert launch.stdin is not None and launch.argv[0] == "ssh"
        boot = msgspec.json.decode(launch.stdin, type=Bootstrap)
        pair = keys.role_key(role)
        assert boot.role == role.value and boot.public_key == pair.public_text
        assert boot.secret_key.encode() == pair.secret
        assert boot.endpoints.keys_dir == ""  # the head's path means nothing over there
        assert pair.secret.decode() not in " ".join(launch.argv)


def _line(role: Role = Role.WORKER, *, tmp: Path) -> str:
    keys = RunKeys(tmp / f"keys-{time.monotonic_ns()}").ensure()
    endpoints = Endpoints(rollout="tcp://h:1", trainer="tcp://h:2", telemetry="tcp://h:3",
                          control="tcp://h:4", controller_pid=1, run_name="x",
                          server_public_key=keys.server().public_text)  # fmt: skip
    return encode_bootstrap(_config(), endpoints, role, keys.role_key(role)).decode()


def test_run_context_reads_the_bootstrap_and_refuses_another_roles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(BOOTSTRAP_ENV, _line(Role.WORKER, tmp=tmp_path).strip())
    context = run_context(tmp_path / "no-run-dir", Role.WORKER)
    assert context.launched and context.key is not None and context.key.secret
    assert context.endpoints.rollout == "tcp://h:1" and context.config.run.name == "tiny"
    with pytest.raises(ConfigError, match="sent for a worker process, but this is a trainer"):
        run_context(tmp_path, Role.TRAINER)
    monkeypatch.setenv(BOOTSTRAP_ENV, "{not json")
    with pytest.raises(ConfigError, match=BOOTSTRAP_ENV):
        run_context(tmp_path, Role.WORKER)


def _remote(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "runtime.remote", *args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_the_wrapper_passes_the_bootstrap_and_ends_the_command_when_stdin_closes(
    tmp_path: Path,
) -> None:
    line = _line(Role.TRAINER, tmp=tmp_path)
    show = (
        "from runtime.remote import run_context; from runtime.auth import Role; "
        "c = run_context('none', Role.TRAINER); print(c.endpoints.trainer, flush=True); "
        "import time; time.sleep(120)"
    )
    proc = _remote("--grace-s", "3", "--", sys.executable, "-c", show)
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(line)
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "tcp://h:2"
        (child,) = psutil.Process(proc.pid).children()
        proc.stdin.close()  # the launcher went away
        assert proc.wait(30) != 0
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    finally:
        proc.kill()
        proc.wait()


def test_the_wrapper_refuses_a_missing_bootstrap() -> None:
    proc = _remote("--", sys.executable, "-c", "print('ran')")
    out, err = proc.communicate("not a bootstrap\n", timeout=60)
    assert proc.returncode == 2 and "ran" not in out
    assert "no bootstrap line" in err


def test_fanout_gives_each_the_line_and_ends_the_rest_with_the_first(tmp_path: Path) -> None:
    wrapped = [sys.executable, "-m", "runtime.remote", "--grace-s", "3", "--", sys.executable]
    quick = [*wrapped, "-c", "import os, sys; assert os.environ['ASP_TUI_BOOTSTRAP']; sys.exit(3)"]
    slow = [*wrapped, "-c", "import time; time.sleep(120)"]
    proc = _remote("--grace-s", "3", "--fanout", json.dumps([slow, quick]))
    try:
        assert proc.stdin is not None
        proc.stdin.write(_line(tmp=tmp_path))
        proc.stdin.flush()
        assert proc.wait(30) == 3
    finally:
        proc.kill()
        proc.wait()
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if "time.sleep(120)" in
                 " ".join(p.info["cmdline"] or [])]  # fmt: skip
    assert not leftovers


def test_gpu_indices_become_cuda_visible_devices_here_and_there(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"instances\[0\].gpus.*tensor_parallel_size 2"):
        _config("rollout.instances=[{tensor_parallel_size: 2, gpus: [0]}]")
    with pytest.raises(ConfigError, match=r"trainer\.gpus"):
        _config("trainer.gpus=[6]", "trainer.num_processes=2")
    config = _config(*REMOTE, "rollout.instances=[{gpus: [3]}, {host: n1, gpus: [5]}]",
                     "trainer.gpus=[6, 7]", "trainer.num_processes=2")  # fmt: skip
    launchers = Launchers(config, _endpoints(tmp_path), RunKeys(tmp_path / "keys").ensure())
    assert launchers.wrap("worker-0", WORKER).argv == ["env", "CUDA_VISIBLE_DEVICES=3", *WORKER]
    assert launchers.wrap("trainer", WORKER).argv[:2] == ["env", "CUDA_VISIBLE_DEVICES=6,7"]
    remote_line = shlex.split(launchers.wrap("worker-1", WORKER).argv[-1])
    assert "CUDA_VISIBLE_DEVICES=5" in remote_line
