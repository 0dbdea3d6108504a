"""The admin CLI against a live nodemgr, through click's CliRunner."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from gpushare import protocol
from gpushare.client import Connection, NodeError
from gpushare.sizes import parse_size
from nodemgr.cli import cli
from tests.conftest import BIN, Holder, invoke
from tests.daemon.conftest import Waiting

GiB = 1 << 30
MiB = 1 << 20


def test_quota_set_and_show(daemon: Any) -> None:
    r = invoke(daemon, "quota", "set", "alice", "--gpus", "2", "--memory", "8GiB")
    assert r.exit_code == 0, r.output
    assert "alice: 2 GPUs x 8GiB" in r.output
    r = invoke(daemon, "quota", "set", "bob", "--gpus", "1", "--memory", "1.5G")
    assert r.exit_code == 0, r.output

    r = invoke(daemon, "quota", "show", "alice", "--json")
    assert r.exit_code == 0, r.output
    shown = json.loads(r.output)
    assert shown["env"] == "alice"
    assert shown["gpus"] == 2
    assert shown["memory"] == 8 * GiB
    assert shown["endpoint"] == f"ipc://{daemon.run_dir}/envs/alice/task.sock"
    assert Path(shown["endpoint"][6:]).exists()

    r = invoke(daemon, "quota", "show", "--json")
    assert [q["env"] for q in json.loads(r.output)] == ["alice", "bob"]
    assert json.loads(r.output)[1]["memory"] == 1_500_000_000

    r = invoke(daemon, "quota", "show")
    assert r.exit_code == 0
    assert r.output.splitlines()[0].split() == [
        "ENV",
        "GPUS",
        "MEMORY/GPU",
        "COMPUTE",
        "IDLE",
        "CLASS",
        "ENDPOINT",
    ]
    assert "8GiB" in r.output

    # Changing a quota keeps the environment and its endpoint.
    r = invoke(daemon, "quota", "set", "alice", "--gpus", "1", "--memory", "512MiB", "--json")
    assert json.loads(r.output) == {**shown, "gpus": 1, "memory": 512 << 20, "over": []}


@pytest.mark.parametrize("size", ["12XB", "-1", "lots", "1.5.2G", ""])
def test_bad_sizes_are_refused_with_the_accepted_forms(daemon: Any, size: str) -> None:
    r = invoke(daemon, "quota", "set", "alice", "--gpus", "1", "--memory", size)
    assert r.exit_code == 2
    assert "not a size" in r.output or "out of range" in r.output
    assert "8GiB" in r.output or "out of range" in r.output
    assert daemon.admin("quota_show")["quotas"] == []


def test_unknown_env_and_bad_env_name(daemon: Any) -> None:
    r = invoke(daemon, "quota", "show", "nobody")
    assert r.exit_code == 1
    assert "no environment 'nobody'" in r.output
    assert "nodemgr quota set nobody" in r.output
    r = invoke(daemon, "tasks", "--env", "nobody")
    assert r.exit_code == 1
    # A name nodemgr would refuse is a usage error (2) that says what a name may be.
    for args in (
        ["quota", "set", "../etc", "--gpus", "1", "--memory", "1GiB"],
        ["quota", "show", "a b"],
        ["quota", "delete", "x/y"],
        ["tasks", "--env", "é"],
        ["history", "x" * 65],
    ):
        r = invoke(daemon, *args)
        assert r.exit_code == 2, (args, r.output)
        assert "is not an environment name: 1 to 64 characters" in r.output, args


def test_quota_show_endpoint_prints_the_endpoint_alone(daemon: Any) -> None:
    ep = daemon.env("alice")
    r = invoke(daemon, "quota", "show", "alice", "--endpoint")
    assert r.exit_code == 0 and r.output == ep + "\n"
    r = invoke(daemon, "quota", "show", "--endpoint")
    assert r.exit_code == 2 and "--endpoint needs ENV" in r.output


def test_counts_take_their_plural_only_when_not_one(daemon: Any) -> None:
    r = invoke(daemon, "quota", "set", "solo", "--gpus", "1", "--memory", "1GiB")
    assert r.exit_code == 0 and "solo: 1 GPU x 1GiB" in r.output
    r = invoke(daemon, "status")
    assert "4 simulated GPUs, 1 environment, 0 tasks" in r.output, r.output


def test_tasks_and_status(
    daemon: Any, run_task: Any, cbin: dict[str, Path], tmp_path: Path
) -> None:
    ep = daemon.env("alice", gpus=1, memory=GiB)
    go = tmp_path / "go"
    p = run_task(ep, str(cbin["client"]), "alloc", "100", "waitfile", str(go))
    assert p.stdout.readline() == "alloc ok\n"
    assert p.stdout.readline() == "waiting\n"

    r = invoke(daemon, "tasks", "--json")
    assert r.exit_code == 0, r.output
    [task] = json.loads(r.output)
    assert task["env"] == "alice"
    assert task["pid"] == p.pid
    assert task["gpus"] == [0]
    assert task["memory_used"] == 100 << 20
    assert str(cbin["client"]) in task["command"]
    r = invoke(daemon, "tasks")
    assert task["task_id"] in r.output and "100MiB" in r.output

    r = invoke(daemon, "status", "--json")
    st = json.loads(r.output)
    assert st["simulated"] is True
    assert st["tasks"] == 1 and st["envs"] == 1
    assert [g["memory"] for g in st["gpus"]] == [16 * GiB] * 4
    assert st["gpus"][0]["envs"] == ["alice"]
    assert st["gpus"][0]["charged"] == GiB
    assert st["gpus"][0]["used"] == 100 << 20
    r = invoke(daemon, "status")
    assert "4 simulated GPUs" in r.output

    go.touch()
    assert p.wait(30) == 0
    assert json.loads(invoke(daemon, "tasks", "--json").output) == []


def test_unreachable_daemon_exit_code(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[node]\nrun_dir = "{tmp_path}"\n')
    r = CliRunner().invoke(cli, ["status", "--config", str(cfg)])
    assert r.exit_code == 69
    assert f"nodemgr is not running: no socket at {tmp_path}/admin.sock" in r.output


def test_bad_config_exit_code(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("[node]\nhartbeat_timeout = 3\n")
    r = CliRunner().invoke(cli, ["status", "--config", str(cfg)])
    assert r.exit_code == 78
    assert "unknown key node.hartbeat_timeout" in r.output


def test_daemon_answers_garbage_with_errors_and_keeps_serving(daemon: Any) -> None:
    import zmq

    ep = daemon.env("alice")
    ctx = zmq.Context()
    ctx.setsockopt(zmq.LINGER, 0)
    try:
        for endpoint in (ep, f"ipc://{daemon.run_dir}/admin.sock"):
            s = ctx.socket(zmq.DEALER)
            s.connect(endpoint)
            # A message without an id is answered with id 0.
            for junk in (
                b"",
                b"\xc1",
                b"\x93\x01\x02\x03",
                b"\x81\xa1v\x02",
                b"\x83\xa1v\x01\xa4type\xa7request\xa4gpus\xa1x",
            ):
                s.send(junk)
                assert s.poll(5000)
                reply = protocol_decode(s.recv())
                assert reply["type"] == "error"
                assert reply["error"] in ("bad_request", "unsupported_version", "unknown_type")
            s.close()
    finally:
        ctx.destroy()
    assert daemon.admin("quota_show", env="alice")["quotas"][0]["gpus"] == 1


def protocol_decode(data: bytes) -> dict[str, Any]:
    import msgpack

    msg: dict[str, Any] = msgpack.unpackb(data)
    return msg


def test_quota_delete_refuses_while_busy_and_forces_with_records_kept(
    daemon: Any, run_task: Any, wait_for: Any
) -> None:
    ep = daemon.env("alice")
    p = run_task(ep, "sleep", "60")
    wait_for(lambda: len(daemon.tasks()) == 1, 10)
    r = invoke(daemon, "quota", "delete", "alice")
    assert r.exit_code == 1
    assert "1 running task and 0B in use" in r.output and "--force" in r.output
    r = invoke(daemon, "quota", "delete", "alice", "--force", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output) == {"env": "alice", "tasks_ended": 1}
    p.wait(10)  # its client was killed, and the command with it
    assert json.loads(invoke(daemon, "quota", "show", "--json").output) == []
    assert not (daemon.run_dir / "envs" / "alice").exists()
    r = invoke(daemon, "history", "alice", "--json")
    assert [rec["reason"] for rec in json.loads(r.output)] == ["admin"]
    r = invoke(daemon, "quota", "delete", "alice")
    assert r.exit_code == 1 and "no environment 'alice'" in r.output


def test_reclaim_ends_the_task_and_frees_its_gpu(daemon: Any, run_task: Any, wait_for: Any) -> None:
    ep = daemon.env("alice")
    p = run_task(ep, "sleep", "60")
    wait_for(lambda: len(daemon.tasks()) == 1, 10)
    [task] = daemon.tasks()
    r = invoke(daemon, "reclaim", task["task_id"])
    assert r.exit_code == 0, r.output
    assert f"task {task['task_id']} of alice: reclaimed" in r.output
    assert daemon.tasks() == []
    assert p.wait(10) != 0
    assert invoke(daemon, "reclaim", task["task_id"]).exit_code == 1


def test_history_filters_by_env_and_time(daemon: Any, run_task: Any) -> None:
    for env in ("alice", "bob"):
        assert run_task(daemon.env(env), "sh", "-c", "exit 3").wait(30) == 3
    r = invoke(daemon, "history", "--json")
    assert r.exit_code == 0, r.output
    records = json.loads(r.output)
    assert [x["env"] for x in records] == ["bob", "alice"]  # newest first
    assert all(x["reason"] == "done" and x["exit_code"] == 3 for x in records)
    assert all(x["ended"] >= x["started"] for x in records)
    assert [x["env"] for x in json.loads(invoke(daemon, "history", "alice", "--json").output)] == [
        "alice"
    ]
    assert json.loads(invoke(daemon, "history", "--since", "2099-01-01", "--json").output) == []
    assert len(json.loads(invoke(daemon, "history", "--since", "1h", "--json").output)) == 2
    r = invoke(daemon, "history", "--since", "yesterday")
    assert r.exit_code == 2 and "neither a duration" in r.output
    # A name no environment ever had is an error, not an empty history.
    r = invoke(daemon, "history", "nobody")
    assert r.exit_code == 1 and "no environment 'nobody' now, and no records of one" in r.stderr
    daemon.env("carol")  # an environment with no records yet has an empty history
    assert json.loads(invoke(daemon, "history", "carol", "--json").output) == []
    r = invoke(daemon, "history")
    assert "REASON" in r.output and "alice" in r.output


def test_a_command_killed_by_a_signal_is_recorded_as_killed(daemon: Any, run_task: Any) -> None:
    p = run_task(daemon.env("alice"), "sh", "-c", "kill -TERM $$")
    assert p.wait(30) == 128 + 15
    [rec] = json.loads(invoke(daemon, "history", "--json").output)
    assert rec["reason"] == "killed" and rec["exit_code"] == 143


def test_top_draws_gpus_envs_tasks_and_queue(daemon: Any, run_task: Any, wait_for: Any) -> None:
    run_task(daemon.env("alice"), "sleep", "60")
    wait_for(lambda: len(daemon.tasks()) == 1, 10)
    r = invoke(daemon, "top", "--iterations", "2", "--interval", "0.1")
    assert r.exit_code == 0, r.output
    # Two frames; not a terminal, so no screen-clearing codes.
    assert r.output.count("GPU  MEMORY") == 2
    assert "\x1b[" not in r.output
    assert "1 task " in r.output and "alice" in r.output and "sleep 60" in r.output
    # -n and -d as in procps top: frames, and seconds between them.
    r = invoke(daemon, "top", "-n", "3", "-d", "0.1")
    assert r.exit_code == 0, r.output
    assert r.output.count("GPU  MEMORY") == 3
    r = invoke(daemon, "top", "-n", "0.5")
    assert r.exit_code == 2
    assert "-n is the number of frames, as in procps top" in r.output
    assert "-d/--delay" in r.output
    snap = json.loads(invoke(daemon, "top", "--json").output)
    assert set(snap) == {"status", "quotas", "tasks", "queue"}
    assert snap["tasks"][0]["env"] == "alice"


def test_shell_completion_as_documented() -> None:
    import os
    import subprocess
    import sys

    exe = Path(sys.executable).parent / "nodemgr"
    out = subprocess.run(
        [str(exe)],
        env={**os.environ, "_NODEMGR_COMPLETE": "bash_source"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0
    assert "complete " in out.stdout and "_nodemgr_completion" in out.stdout
    out = subprocess.run(
        [str(exe)],
        env={
            **os.environ,
            "_NODEMGR_COMPLETE": "bash_complete",
            "COMP_WORDS": "nodemgr qu",
            "COMP_CWORD": "1",
        },
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert "quota" in out.stdout


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["top", "--iterations", "0"], "'0' is not a whole number from 1"),
        (["top", "--interval", "nan"], "'nan' is not a number of seconds from 0.1 to 3600"),
        (["top", "--interval", "inf"], "is not a number of seconds"),
        (["quota", "set", "a", "--gpus", "\uff11", "--memory", "1GiB"], "not a whole number"),
        (["quota", "set", "a", "--gpus", "1", "--memory", "\uff18GiB"], "not a size"),
        (["quota", "set", "a", "--gpus", "1", "--memory", "1" + "0" * 400 + ".5"], "out of range"),
        (["history", "--since", "1" + "0" * 400 + "d"], "neither a duration"),
        (["history", "--since", "\uff17d"], "neither a duration"),
        (["mode", "99999999999999999999"], "'99999999999999999999' is not a GPU: an index"),
        (["mode", "99999999999999999999", "shared"], "is not a GPU: an index from 0 to 63"),
        (["drain", "99999999999999999999"], "is not a GPU: an index from 0 to 63"),
        (["undrain", "64"], "'64' is not a GPU"),
        (["drain", "\uff11"], "is not a GPU"),
        (["mode", "shared"], "'shared' is not a GPU"),
    ],
)
def test_cli_input_errors_are_usage_errors(tmp_path: Path, args: list[str], needle: str) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[node]\nrun_dir = "{tmp_path}"\n')
    r = CliRunner().invoke(cli, [*args, "--config", str(cfg)])
    assert r.exit_code == 2, r.output
    assert needle in r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)


def serve(tmp_path: Path, extra: str = "", node: str = "", gpus: str = "") -> Any:
    """`nodemgr serve` on simulated GPUs, ``node`` and ``gpus`` added to those tables and
    ``extra`` to the config."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f'[node]\nrun_dir = "{tmp_path}/run"\nstate_dir = "{tmp_path}/state"\n{node}'
        f'[gpus]\nsource = "simulated"\nsimulated_memory = "16GiB"\n{gpus}{extra}'
    )
    return subprocess.run(
        [str(BIN / "nodemgr"), "serve", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=30,
    )


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ("[scheduler]\nmax_wait = inf\n", "scheduler.max_wait: inf is not a number of seconds"),
        (
            '[scheduler]\nmemory_reserve = "4GiB"\n',
            "gpus.context_memory (12GiB) leaves nothing of GPU 0",
        ),
        ('[scheduler]\nmemory_reserve = "16GiB"\n', "scheduler.memory_reserve (16GiB) is not less"),
    ],
)
def test_serve_refuses_bad_values_with_exit_78(tmp_path: Path, extra: str, needle: str) -> None:
    r = serve(tmp_path, extra, gpus='context_memory = "12GiB"\n' if "12GiB" in needle else "")
    assert r.returncode == 78, r.stderr
    assert needle in r.stderr
    assert "Traceback" not in r.stderr


def test_serve_sweep_interval_inf_is_exit_78(tmp_path: Path) -> None:
    r = serve(tmp_path, node="sweep_interval = inf\n")
    assert r.returncode == 78, r.stderr
    assert "node.sweep_interval: inf is not a number of seconds from 0.01 to 60" in r.stderr
    assert "Traceback" not in r.stderr


def test_serve_metrics_port_in_use_is_exit_78(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = serve(tmp_path, f"[metrics]\nport = {port}\n")
    assert r.returncode == 78, r.stderr
    assert f"metrics.port {port}: cannot listen there" in r.stderr
    assert "Traceback" not in r.stderr


def test_serve_unwritable_state_dir_is_exit_78(tmp_path: Path) -> None:
    # As root no mode makes a directory read-only; a directory where the lock file
    # goes fails the same open.
    (tmp_path / "state" / "nodemgr.lock").mkdir(parents=True)
    r = serve(tmp_path, "")
    assert r.returncode == 78, r.stderr
    assert f"cannot open {tmp_path}/state/nodemgr.lock in state directory" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_admin_socket_permission_denied_says_so(daemon: Any) -> None:
    # The daemon's admin socket is 0600 root's: the CLI, as nobody, may not connect.
    with tempfile.TemporaryDirectory(dir="/tmp") as public:
        os.chmod(public, 0o755)
        cfg = Path(public) / "c.toml"
        cfg.write_text(daemon.config.read_text())
        cfg.chmod(0o644)
        os.seteuid(65534)
        try:
            r = CliRunner().invoke(cli, ["status", "--config", str(cfg)])
        finally:
            os.seteuid(0)
    assert r.exit_code == 69, r.output
    assert f"permission denied on {daemon.run_dir}/admin.sock: run this as root" in r.output
    assert "did not answer" not in r.output


def test_a_running_task_shows_the_quota_now_and_its_peak_so_far(
    daemon: Any, run_task: Any, cbin: dict[str, Path], tmp_path: Path
) -> None:
    """`tasks` shows the environment's per-GPU quota after a change, not the one at the
    grant; `history` shows a running task's peak from its ledger, not 0 until it ends."""
    ep = daemon.env("alice", gpus=1, memory=GiB)
    go = tmp_path / "go"
    p = run_task(ep, str(cbin["client"]), "alloc", "300", "free", "waitfile", str(go))
    assert p.stdout.readline() == "alloc ok\n"
    assert p.stdout.readline() == "free ok\n"
    assert p.stdout.readline() == "waiting\n"
    assert invoke(daemon, "quota", "set", "alice", "--gpus", "1", "--memory", "2GiB").exit_code == 0
    [task] = json.loads(invoke(daemon, "tasks", "--json").output)
    assert task["memory_limit"] == 2 * GiB
    table = invoke(daemon, "tasks").output.splitlines()
    # GPU names GPUs by index; GPUS (quota show) is a count.
    assert table[0].split()[4] == "GPU" and table[1].split()[4] == str(task["gpus"][0])
    assert table[1].split()[6] == "2GiB"
    [rec] = json.loads(invoke(daemon, "history", "--json").output)
    assert rec["ended"] is None and rec["peak"] == 300 * MiB
    go.touch()
    assert p.wait(30) == 0


def test_replies_beyond_the_request_limit_are_read_whole(daemon_factory: Any) -> None:
    """`tasks` and `history` answer with more than a request may hold (64 KiB): the CLI
    reads replies up to the admin endpoint's reply limit. 600 tasks from 20 processes, 30
    each, across 20 environments (a slow heartbeat keeps them cheap)."""
    d = daemon_factory(
        {"scheduler": {"task_threshold": 1000}}, heartbeat_interval=30.0, heartbeat_timeout=600.0
    )
    holders = [Holder(d.env(f"e{i}", memory=256 * MiB), count=30) for i in range(20)]
    try:
        r = invoke(d, "tasks", "--json")
        assert r.exit_code == 0, r.output
        assert len(r.output) > protocol.MAX_MESSAGE_BYTES
        listed = json.loads(r.output)
        assert sorted(t["task_id"] for t in listed) == sorted(
            t for h in holders for t in h.task_ids
        )
        r = invoke(d, "tasks")
        assert r.exit_code == 0, r.output
        assert len(r.output.splitlines()) == 1 + 600
    finally:
        for h in holders:
            h.close()
    r = invoke(d, "history", "--limit", "400", "--json")
    assert r.exit_code == 0, r.output
    records = json.loads(r.output)
    assert len(records) == 400 and all(x["reason"] == "done" for x in records)
    r = invoke(d, "history", "--limit", "400")
    assert r.exit_code == 0 and len(r.output.splitlines()) == 1 + 400


def test_a_gpu_no_request_can_name_is_a_usage_error_on_a_live_node(daemon: Any) -> None:
    for args in (["mode", "99999999999999999999"], ["drain", "99999999999999999999"]):
        r = invoke(daemon, *args)
        assert r.exit_code == 2, (args, r.output)
        assert "is not a GPU: an index from 0 to 63" in r.output
        assert r.exception is None or isinstance(r.exception, SystemExit)
    # What a GPU may be named still reaches nodemgr.
    r = invoke(daemon, "drain", "1", "--json")
    assert r.exit_code == 0 and json.loads(r.output)[0]["drained"] is True
    r = invoke(daemon, "undrain", "all", "--json")
    assert r.exit_code == 0 and not any(g["drained"] for g in json.loads(r.output))
    uuid = daemon.admin("status")["gpus"][2]["uuid"]
    r = invoke(daemon, "mode", uuid, "--json")
    assert r.exit_code == 0 and json.loads(r.output)[0]["index"] == 2


def test_quotas_no_gpu_could_serve_are_refused_unless_forced(daemon_factory: Any) -> None:
    d = daemon_factory(
        {"scheduler": {"memory_reserve": "1GiB"}, "gpus": {"context_memory": "256MiB"}}
    )
    for args, needle in (
        (
            ["--gpus", "1", "--memory", "100GiB"],
            "100GiB per GPU is more than any GPU of this node can give: the largest, GPU 0 "
            "(gpushare Simulated GPU), has 15GiB (16GiB, less the 1GiB reserve); "
            "give --memory 15GiB",
        ),
        (["--gpus", "5", "--memory", "1GiB"], "this node has 4 GPUs; give --gpus 4 or fewer"),
        (["--gpus", "1", "--memory", "0"], "0 bytes per GPU grants GPUs on which nothing"),
        (
            ["--gpus", "1", "--memory", "200MiB"],
            "200MiB per GPU leaves no room for a process's CUDA context, charged 256MiB",
        ),
    ):
        r = invoke(d, "quota", "set", "x", *args)
        assert r.exit_code == 1, (args, r.output)
        assert needle in r.stderr and "set it anyway with --force" in r.stderr, r.stderr
        assert d.admin("quota_show")["quotas"] == []  # nothing was made
        r = invoke(d, "quota", "set", "x", *args, "--force", "--json")
        assert r.exit_code == 0, r.output
        shown = d.admin("quota_show", env="x")["quotas"][0]
        assert (shown["gpus"], shown["memory"]) == (int(args[1]), parse_size(args[3]))
        assert invoke(d, "quota", "delete", "x").exit_code == 0
    # What can be served is set without --force: the largest GPU's whole capacity, every
    # GPU, or no GPU at all.
    for args in (["--gpus", "4", "--memory", "15GiB"], ["--gpus", "0", "--memory", "0"]):
        r = invoke(d, "quota", "set", "ok", *args)
        assert r.exit_code == 0, (args, r.output)


def test_a_size_without_a_unit_is_bytes_and_warned_of(daemon: Any) -> None:
    r = invoke(daemon, "quota", "set", "alice", "--gpus", "1", "--memory", "12")
    assert r.exit_code == 0, r.output
    assert "warning: --memory 12 has no unit, so it is 12 bytes" in r.stderr
    assert daemon.admin("quota_show", env="alice")["quotas"][0]["memory"] == 12
    r = invoke(daemon, "quota", "set", "alice", "--memory", "12GiB")
    assert r.exit_code == 0 and "warning" not in r.stderr
    r = invoke(daemon, "quota", "set", "alice", "--gpus", "0", "--memory", "0")
    assert r.exit_code == 0 and "warning" not in r.stderr


def test_quota_set_changes_one_field_and_keeps_the_other(daemon: Any) -> None:
    assert invoke(daemon, "quota", "set", "alice", "--gpus", "2", "--memory", "8GiB").exit_code == 0
    r = invoke(daemon, "quota", "set", "alice", "--memory", "4GiB")
    assert r.exit_code == 0 and "alice: 2 GPUs x 4GiB" in r.output, r.output
    r = invoke(daemon, "quota", "set", "alice", "--gpus", "3", "--json")
    assert r.exit_code == 0
    assert (json.loads(r.output)["gpus"], json.loads(r.output)["memory"]) == (3, 4 * GiB)
    # A new environment needs both; neither is a usage error.
    r = invoke(daemon, "quota", "set", "bob", "--gpus", "1")
    assert r.exit_code == 1 and "'bob' does not exist yet: give both" in r.stderr
    assert [q["env"] for q in daemon.admin("quota_show")["quotas"]] == ["alice"]
    r = invoke(daemon, "quota", "set", "alice")
    assert r.exit_code == 2
    assert "give --gpus, --memory, --class-default, --allow-ls or --compute" in r.output


def test_queue_lists_waiting_requests_per_environment(node: Any, wait_for: Any) -> None:
    held = [Holder(node.env(name)) for name in ("a", "b")]  # both GPUs, one task each
    first = Waiting(node.env("c"), 60, gpus=1, memory=512 * MiB, command="train.py")
    wait_for(lambda: len(node.admin("queue")["waiting"]) == 1, 10)
    second = Waiting(node.env("d"), 60, gpus=1, devices=["1"])
    wait_for(lambda: len(node.admin("queue")["waiting"]) == 2, 10)
    try:
        r = invoke(node, "queue", "--json")
        assert r.exit_code == 0, r.output
        listed = json.loads(r.output)
        assert [(w["position"], w["env"], w["gpus"]) for w in listed] == [(1, "c", 1), (2, "d", 1)]
        assert (listed[0]["memory"], listed[0]["devices"]) == (512 * MiB, None)
        assert (listed[1]["memory"], listed[1]["devices"]) == (None, [1])
        assert all("wait for other tasks to end" in w["reason"] for w in listed)
        lines = invoke(node, "queue").output.splitlines()
        assert lines[0].split() == [
            "POS",
            "ENV",
            "CLASS",
            "GPUS",
            "GPU",
            "MEMORY",
            "PID",
            "WAITED",
            "LEFT",
            "COMMAND",
            "WHY",
        ]
        assert lines[1].split()[:6] == ["1", "c", "be", "1", "any", "512MiB"]
        assert "train.py" in lines[1]
        assert lines[2].split()[:6] == ["2", "d", "be", "1", "1", "-"]
        # One environment's requests keep their places in the whole queue.
        r = invoke(node, "queue", "--env", "d", "--json")
        assert [(w["position"], w["env"]) for w in json.loads(r.output)] == [(2, "d")]
        assert json.loads(invoke(node, "queue", "--env", "a", "--json").output) == []
        r = invoke(node, "queue", "--env", "nobody")
        assert r.exit_code == 1 and "no environment 'nobody'" in r.stderr
    finally:
        held[0].close()
        assert first.finish()["env"] == "c"
        held[1].close()
        assert second.finish()["env"] == "d"
    assert json.loads(invoke(node, "queue", "--json").output) == []


def test_pause_and_resume_help_say_what_waits() -> None:
    """As docs/nodemgr.md says: launches and allocations wait, frees do not."""
    text = " ".join(CliRunner().invoke(cli, ["pause", "--help"]).output.split())
    assert "waits in its next kernel launch or allocation (frees are not held)" in text
    assert "until: nodemgr resume TASK_ID" in text
    text = " ".join(CliRunner().invoke(cli, ["resume", "--help"]).output.split())
    assert "waiting in a kernel launch or allocation go on" in text


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_a_reader_sees_the_views_and_changes_nothing(daemon_factory: Any) -> None:
    """[readers] lets a user reach view.sock but not admin.sock: the view commands work
    for it, every change is refused, on the CLI and on the wire, naming the admin socket."""
    d = daemon_factory({"readers": {"mode": "0666"}})
    d.env("alice")
    os.chmod(d.root, 0o755)
    os.chmod(d.run_dir, 0o711)
    with tempfile.TemporaryDirectory(dir="/tmp") as public:
        os.chmod(public, 0o755)
        cfg = Path(public) / "c.toml"
        cfg.write_text(d.config.read_text())
        cfg.chmod(0o644)

        def as_nobody(*args: str) -> Any:
            os.seteuid(65534)
            try:
                return CliRunner().invoke(cli, [*args, "--config", str(cfg)])
            finally:
                os.seteuid(0)

        for args in (
            ["status"],
            ["tasks"],
            ["queue"],
            ["history"],
            ["quota", "show"],
            ["mode"],
            ["drain", "--show"],
            ["top", "--iterations", "1"],
        ):
            r = as_nobody(*args)
            assert r.exit_code == 0, (args, r.output)
        assert "alice" in as_nobody("quota", "show").output
        for args in (["quota", "set", "bob", "--gpus", "1", "--memory", "1GiB"], ["drain", "0"]):
            r = as_nobody(*args)
            assert r.exit_code == 69, (args, r.output)
            assert f"permission denied on {d.run_dir}/admin.sock" in r.output
    # On the wire: the read-only socket answers views and refuses every change.
    with Connection(f"ipc://{d.run_dir}/view.sock") as c:
        assert c.call("status")["envs"] == 1
        assert c.call("mode", gpu=0)["gpus"][0]["mode"] == "shared"
        for kind, fields in (
            ("quota_set", {"env": "bob", "gpus": 1, "memory": 1}),
            ("quota_delete", {"env": "alice"}),
            ("mode", {"gpu": 0, "mode": "timesliced"}),
            ("drain", {"gpu": 0, "drained": True}),
            ("reclaim", {"task_id": "0123456789abcdef"}),
            ("pause", {"task_id": "0123456789abcdef"}),
            ("idle_set", {"env": "alice"}),
        ):
            with pytest.raises(NodeError) as e:
                c.call(kind, **fields)
            assert e.value.code == "forbidden", kind
            assert f"{d.run_dir}/admin.sock" in e.value.message
    assert [q["env"] for q in d.admin("quota_show")["quotas"]] == ["alice"]
    assert d.admin("mode", gpu=0)["gpus"][0]["mode"] == "shared"
