"""nodemgr killed with SIGKILL and started again: quotas, records and running tasks survive."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from gpushare.client import Connection, NoResources
from tests.conftest import Holder

MiB = 1 << 20
GiB = 1 << 30


def test_sigkill_and_restart_keeps_quotas_history_and_running_tasks(
    daemon_factory: Any, run_task: Any, cbin: dict[str, Path], tmp_path: Path, wait_for: Any
) -> None:
    # One 1 GiB GPU: whoever holds it leaves no room for anyone else.
    d = daemon_factory(
        {"gpus": {"simulated_count": 1, "simulated_memory": "1GiB"}},
        heartbeat_interval=0.2,
        heartbeat_timeout=3.0,
    )
    alice = d.env("alice", gpus=1, memory=GiB)
    d.env("bob", gpus=1, memory=GiB)
    d.env("carol", gpus=1, memory=0, force=True)
    quotas = d.admin("quota_show")["quotas"]

    # A finished task, so history has an ended record to keep.
    p = run_task(alice, str(cbin["client"]), "alloc", "100")
    assert p.wait(30) == 0

    go = tmp_path / "go"
    runner = run_task(
        alice,
        str(cbin["client"]),
        "alloc",
        "512",
        "waitfile",
        str(go),
        "alloc",
        "256",
        "alloc",
        "512",
    )
    wait_for(lambda: [t["memory_used"] for t in d.tasks()] == [512 * MiB], 10)
    [before] = d.tasks()
    # carol's task: its client will die while nodemgr is down.
    doomed = run_task(
        carol_ep := d.admin("quota_show", env="carol")["quotas"][0]["endpoint"], "sleep", "60"
    )
    wait_for(lambda: len(d.tasks()) == 2, 10)
    [doomed_task] = [t["task_id"] for t in d.tasks() if t["env"] == "carol"]
    assert carol_ep

    d.kill()
    os.killpg(doomed.pid, signal.SIGKILL)
    doomed.wait(30)
    d.start()

    assert d.admin("quota_show")["quotas"] == quotas
    # The running task is back, with the usage its ledger shows; carol's is over.
    [after] = d.tasks()
    assert after["task_id"] == before["task_id"]
    assert after["memory_used"] == 512 * MiB
    assert after["gpus"] == before["gpus"]
    # Its client re-attaches with its next heartbeat.
    wait_for(lambda: d.tasks()[0]["attached"], 5)
    assert d.tasks()[0]["pid"] == before["pid"]
    # Nothing granted twice: the GPU is still alice's.
    bob = d.admin("quota_show", env="bob")["quotas"][0]["endpoint"]
    with Connection(bob) as c, pytest.raises(NoResources):
        c.call("request", gpus=1)
    # The task runs on under the same limit, enforced by the ledger it kept.
    go.touch()
    out, err = runner.communicate(timeout=30)
    assert runner.returncode == 0, err
    assert out.split("\n")[:4] == ["alloc ok", "waiting", "alloc ok", "alloc err 2"]

    records = {r["task_id"]: r for r in d.admin("history")["records"]}
    assert len(records) == 3
    assert records[before["task_id"]]["reason"] == "done"
    assert records[before["task_id"]]["peak"] == 768 * MiB
    assert records[doomed_task]["reason"] == "exited"
    assert sorted(r["reason"] for r in records.values()) == ["done", "done", "exited"]
    assert "re-attached" in d.logtext()


def test_a_restored_task_whose_client_never_returns_times_out(
    daemon_factory: Any, run_task: Any, wait_for: Any
) -> None:
    d = daemon_factory(heartbeat_interval=0.2, heartbeat_timeout=1.0)
    ep = d.env("alice")
    p = run_task(ep, "sleep", "60")
    wait_for(lambda: len(d.tasks()) == 1, 10)
    [task] = d.tasks()
    d.kill()
    os.kill(p.pid, signal.SIGSTOP)  # alive but silent
    try:
        d.start()
        assert [t["task_id"] for t in d.tasks()] == [task["task_id"]]
        wait_for(lambda: not d.tasks(), 5)
        [rec] = d.admin("history")["records"]
        assert rec["reason"] == "timeout"
    finally:
        os.kill(p.pid, signal.SIGCONT)


def test_a_second_nodemgr_on_the_same_state_refuses_to_start(
    daemon_factory: Any, tmp_path: Path
) -> None:
    from click.testing import CliRunner

    from nodemgr.cli import cli

    d = daemon_factory()
    cfg = tmp_path / "other.toml"
    cfg.write_text(
        f'[node]\nrun_dir = "{tmp_path}/run"\nstate_dir = "{d.state_dir}"\n'
        '[gpus]\nsource = "simulated"\n'
    )
    r = CliRunner().invoke(cli, ["serve", "--config", str(cfg)])
    assert r.exit_code == 78
    assert "already running with state directory" in r.output


def test_waiting_requests_survive_a_restart_in_their_order(
    daemon_factory: Any, run_task: Any, wait_for: Any
) -> None:
    d = daemon_factory(
        {"gpus": {"simulated_count": 1}}, heartbeat_interval=0.2, heartbeat_timeout=3.0
    )
    # Two environments' quotas do not fit on the one GPU together: b's task makes a's wait.
    ep = d.env("a", gpus=1, memory=12 * GiB)
    holder = Holder(d.env("b", gpus=1, memory=12 * GiB))
    first = run_task(ep, "true")
    wait_for(lambda: len(d.admin("queue")["waiting"]) == 1, 10)
    second = run_task(ep, "true")
    wait_for(lambda: len(d.admin("queue")["waiting"]) == 2, 10)

    d.kill()
    d.start()
    # Sent again by their clients, in the order they first came, whichever reconnects first.
    wait_for(lambda: [w["pid"] for w in d.admin("queue")["waiting"]] == [first.pid, second.pid], 10)
    assert [t["task_id"] for t in d.tasks()] == [holder.task_id]  # restored, still held
    holder.close()
    for p in (first, second):
        _, err = p.communicate(timeout=30)
        assert p.returncode == 0, err
        assert f"nodemgr is not answering at {ep}; the request is sent again" in err
        assert "nodemgr is back; the request was sent again" in err
        assert "granted after waiting" in err
    assert d.admin("queue")["waiting"] == []
