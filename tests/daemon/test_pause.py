"""Pausing and resuming tasks, their ledger task entries, context charges and launch times,
against a live nodemgr and real gpushare-run processes."""

from __future__ import annotations

import json
import os
import select
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from gpushare.client import Connection, NodeError
from nodemgr.cli import cli
from nodemgr.host.ledger import MAX_TASKS, LedgerError
from tests.conftest import invoke
from tests.daemon.conftest import ledger_of

MiB = 1 << 20


def entry_ids(daemon: Any, env: str) -> list[str]:
    with ledger_of(daemon, env) as ledger:
        return ledger.task_ids()


def start_sleeper(daemon: Any, run_task: Any, wait_for: Any, env: str = "alice") -> str:
    """A running task whose command never launches a kernel; its task id."""
    ep = daemon.env(env)
    before = {t["task_id"] for t in daemon.tasks()}
    run_task(ep, "sleep", "60")
    wait_for(lambda: len(daemon.tasks()) == len(before) + 1, 10)
    [task_id] = [str(t["task_id"]) for t in daemon.tasks() if t["task_id"] not in before]
    return task_id


def test_pause_and_resume_through_the_admin_socket(
    daemon: Any, run_task: Any, wait_for: Any
) -> None:
    task_id = start_sleeper(daemon, run_task, wait_for)
    [task] = daemon.tasks()
    assert task["paused"] is False
    assert task["last_launch"] is None  # its command launches nothing

    reply = daemon.admin("pause", task_id=task_id)
    assert {k: reply[k] for k in ("type", "task_id", "env", "paused")} == {
        "type": "paused",
        "task_id": task_id,
        "env": "alice",
        "paused": True,
    }
    assert daemon.tasks()[0]["paused"] is True
    with ledger_of(daemon, "alice") as ledger:
        entry = ledger.task_entry(task_id)
        assert entry is not None and entry.paused
    # Pausing twice is no error; the task keeps its GPU and its heartbeats meanwhile.
    assert daemon.admin("pause", task_id=task_id)["paused"] is True
    time.sleep(1.5)  # longer than the test daemon's heartbeat_timeout
    assert [t["task_id"] for t in daemon.tasks()] == [task_id]

    reply = daemon.admin("resume", task_id=task_id)
    assert (reply["type"], reply["paused"]) == ("paused", False)
    assert daemon.tasks()[0]["paused"] is False
    with ledger_of(daemon, "alice") as ledger:
        entry = ledger.task_entry(task_id)
        assert entry is not None and not entry.paused
    assert daemon.admin("resume", task_id=task_id)["paused"] is False


def test_pause_and_resume_through_the_cli(daemon: Any, run_task: Any, wait_for: Any) -> None:
    task_id = start_sleeper(daemon, run_task, wait_for)
    r = invoke(daemon, "pause", task_id)
    assert r.exit_code == 0, r.output
    assert r.output == f"task {task_id} of alice: paused\n"
    r = invoke(daemon, "tasks")
    header, row = r.output.splitlines()
    assert header.split()[-3:] == ["LAUNCHED", "STATE", "COMMAND"]
    assert row.split()[-4:] == ["never", "paused", "sleep", "60"]
    r = invoke(daemon, "top", "--iterations", "1")
    assert r.exit_code == 0, r.output
    assert "paused" in r.output
    assert json.loads(invoke(daemon, "tasks", "--json").output)[0]["paused"] is True

    r = invoke(daemon, "resume", task_id, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output) == {"task_id": task_id, "env": "alice", "paused": False}
    assert "running" in invoke(daemon, "tasks").output.splitlines()[1].split()
    r = invoke(daemon, "pause", task_id, "--json")
    assert json.loads(r.output) == {"task_id": task_id, "env": "alice", "paused": True}
    r = invoke(daemon, "resume", task_id)
    assert r.output == f"task {task_id} of alice: resumed\n"


def test_pausing_an_unknown_task_is_refused(daemon: Any) -> None:
    daemon.env("alice")
    for kind in ("pause", "resume"):
        with pytest.raises(NodeError) as e:
            daemon.admin(kind, task_id="0123456789abcdef")
        assert e.value.code == "unknown_task"
        assert "no running task '0123456789abcdef'" in e.value.message
        with pytest.raises(NodeError) as e:
            daemon.admin(kind, task_id="../etc")
        assert e.value.code == "bad_request"
        with pytest.raises(NodeError) as e:
            daemon.admin(kind)
        assert e.value.code == "bad_request"
        r = invoke(daemon, kind, "0123456789abcdef")
        assert r.exit_code == 1
        assert "nodemgr: no running task '0123456789abcdef'" in r.output


def test_cli_pause_without_nodemgr_exits_69(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[node]\nrun_dir = "{tmp_path}"\n')
    for kind in ("pause", "resume"):
        r = CliRunner().invoke(cli, [kind, "0123456789abcdef", "--config", str(cfg)])
        assert r.exit_code == 69
        assert f"nodemgr is not running: no socket at {tmp_path}/admin.sock" in r.output


def test_a_task_endpoint_does_not_serve_pause_or_resume(
    daemon: Any, run_task: Any, wait_for: Any
) -> None:
    task_id = start_sleeper(daemon, run_task, wait_for)
    with Connection(str(daemon.admin("quota_show", env="alice")["quotas"][0]["endpoint"])) as c:
        for kind in ("pause", "resume"):
            with pytest.raises(NodeError) as e:
                c.call(kind, task_id=task_id)
            assert e.value.code == "unknown_type"
    assert daemon.tasks()[0]["paused"] is False


def test_a_task_has_a_ledger_entry_exactly_while_it_runs(
    daemon: Any, run_task: Any, cbin: dict[str, Path], tmp_path: Path, wait_for: Any
) -> None:
    ep = daemon.env("alice")
    go = tmp_path / "go"
    p = run_task(ep, str(cbin["client"]), "waitfile", str(go))
    assert p.stdout.readline() == "waiting\n"
    [task] = daemon.tasks()
    assert entry_ids(daemon, "alice") == [task["task_id"]]
    go.touch()
    assert p.wait(30) == 0
    wait_for(lambda: not daemon.tasks(), 5)
    assert entry_ids(daemon, "alice") == []

    # Ended by an operator, paused or not: the entry goes too.
    task_id = start_sleeper(daemon, run_task, wait_for)
    daemon.admin("pause", task_id=task_id)
    assert entry_ids(daemon, "alice") == [task_id]
    daemon.admin("reclaim", task_id=task_id)
    assert entry_ids(daemon, "alice") == []


def test_context_memory_lands_in_every_gpus_ctx_charge(daemon_factory: Any) -> None:
    d = daemon_factory()
    d.env("alice")
    with ledger_of(d, "alice") as ledger:
        # Simulated GPUs: contexts take nothing by default.
        assert [ledger.ctx_charge(i) for i in range(4)] == [0] * 4

    d = daemon_factory({"gpus": {"context_memory": "300MiB"}})
    d.env("alice")
    with ledger_of(d, "alice") as ledger:
        assert [ledger.ctx_charge(i) for i in range(4)] == [300 * MiB] * 4

    # A restart adopts the ledger and writes the configured charge into it again.
    d.stop()
    d.config.write_text(d.config.read_text().replace('"300MiB"', '"64MiB"'))
    d.log = open(d.root / "nodemgr.log", "a")  # noqa: SIM115
    d.start()
    with ledger_of(d, "alice") as ledger:
        assert [ledger.ctx_charge(i) for i in range(4)] == [64 * MiB] * 4


def test_last_launch_is_stamped_by_the_sweep(
    daemon: Any, run_task: Any, cbin: dict[str, Path], tmp_path: Path, wait_for: Any
) -> None:
    ep = daemon.env("alice")
    go = tmp_path / "go"
    p = run_task(ep, str(cbin["client"]), "waitfile", str(go), "launch", "3", "sleep", "60")
    assert p.stdout.readline() == "waiting\n"
    time.sleep(0.3)  # a few sweeps with no launch
    assert daemon.tasks()[0]["last_launch"] is None
    before = time.time()
    go.touch()
    assert p.stdout.readline() == "launch ok\n"
    wait_for(lambda: daemon.tasks()[0]["last_launch"] is not None, 5)
    [task] = daemon.tasks()
    assert task["launches"] == 3
    assert before <= task["last_launch"] <= time.time()
    assert "s ago" in invoke(daemon, "tasks").output


def test_a_restart_keeps_pauses_and_frees_entries_of_tasks_that_did_not_survive(
    daemon_factory: Any, run_task: Any, wait_for: Any
) -> None:
    d = daemon_factory(heartbeat_interval=0.2, heartbeat_timeout=3.0)
    kept = start_sleeper(d, run_task, wait_for)
    gone = start_sleeper(d, run_task, wait_for)
    [gone_client] = [t["pid"] for t in d.tasks() if t["task_id"] == gone]
    d.admin("pause", task_id=kept)
    d.admin("pause", task_id=gone)
    d.kill()
    os.kill(gone_client, signal.SIGKILL)  # its task ends while nodemgr is down
    with ledger_of(d, "alice") as ledger:
        ledger.task_add("feedfacecafebeef")  # an entry no record knows
        assert sorted(ledger.task_ids()) == sorted([kept, gone, "feedfacecafebeef"])
    d.start()
    [task] = d.tasks()
    assert task["task_id"] == kept
    assert task["paused"] is True  # the adopted entry's pause word stands
    assert entry_ids(d, "alice") == [kept]
    assert d.admin("resume", task_id=kept)["paused"] is False
    assert d.tasks()[0]["paused"] is False


def test_a_paused_task_waits_in_its_next_launch_until_resumed(
    daemon: Any, run_task: Any, cbin: dict[str, Path], tmp_path: Path
) -> None:
    """End to end through the shim: launches of a paused task block, resume lets them go."""
    ep = daemon.env("alice")
    go = tmp_path / "go"
    p = run_task(ep, str(cbin["client"]), "waitfile", str(go), "launch", "5", "sleep", "60")
    assert p.stdout.readline() == "waiting\n"
    [task] = daemon.tasks()
    daemon.admin("pause", task_id=task["task_id"])
    go.touch()
    assert p.stdout is not None
    ready, _, _ = select.select([p.stdout], [], [], 1.5)
    assert not ready, f"a paused task's launch went through: {p.stdout.readline()!r}"
    assert p.poll() is None
    assert daemon.tasks()[0]["launches"] == 0  # the held launch is counted once it goes
    daemon.admin("resume", task_id=task["task_id"])
    ready, _, _ = select.select([p.stdout], [], [], 5)
    assert ready, "resume did not wake the waiting launch"
    assert p.stdout.readline() == "launch ok\n"


def test_a_task_without_an_entry_runs_but_cannot_be_paused(
    daemon: Any, run_task: Any, wait_for: Any
) -> None:
    daemon.env("alice")
    with ledger_of(daemon, "alice") as ledger:
        for i in range(MAX_TASKS):
            ledger.task_add(f"filler{i:04d}")
        with pytest.raises(LedgerError, match="in use"):
            ledger.task_add("onemore")
    task_id = start_sleeper(daemon, run_task, wait_for)
    assert "cannot be paused" in daemon.logtext()
    with pytest.raises(NodeError) as e:
        daemon.admin("pause", task_id=task_id)
    assert e.value.code == "not_pausable"
    r = invoke(daemon, "pause", task_id)
    assert r.exit_code == 1 and "cannot be held" in r.output
    assert daemon.tasks()[0]["paused"] is False
    daemon.admin("reclaim", task_id=task_id)
    assert daemon.tasks() == []
