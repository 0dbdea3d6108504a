"""Idle tasks are reclaimed, and every reclaimed task's user is told why: a real nodemgr,
real gpushare-run processes with the shim, and the stand-in torch launching kernels."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from gpushare.client import NodeError
from gpushare.exitcodes import (
    EXIT_RECLAIMED_ADMIN,
    EXIT_RECLAIMED_DELETED,
    EXIT_RECLAIMED_IDLE,
)
from tests.conftest import invoke

STANDIN = Path(__file__).resolve().parent.parent / "fixtures" / "standin"
GiB = 1 << 30

# Allocates, launches once, says so, then launches every ``pause`` seconds (never, if 0).
SCRIPT = """
import sys, time, torch
torch.cuda.alloc(1 << 20)
torch.cuda.launch()
print("ready", flush=True)
pause = float(sys.argv[1])
while True:
    time.sleep(pause or 3600)
    if pause:
        torch.cuda.launch()
"""


def start(run_task: Any, ep: str, pause: float) -> Any:
    env = {**os.environ, "PYTHONPATH": str(STANDIN)}
    p = run_task(ep, sys.executable, "-c", SCRIPT, str(pause), env=env)
    assert p.stdout.readline() == "ready\n"
    return p


def test_an_idle_task_is_warned_then_reclaimed_and_a_launching_one_is_not(
    daemon_factory: Any, run_task: Any, wait_for: Any
) -> None:
    d = daemon_factory({"idle": {"timeout": 3.0, "warn_before": 2.0}}, reclaim_grace=2.0)
    idle_ep = str(d.env("alice", gpus=1, memory=GiB))
    busy_ep = str(d.env("bob", gpus=1, memory=GiB))
    busy = start(run_task, busy_ep, 0.2)
    idle = start(run_task, idle_ep, 0.0)
    assert idle.wait(30) == EXIT_RECLAIMED_IDLE
    err = idle.stderr.read()
    assert "its GPUs are reclaimed in" in err, err  # the warning came first
    assert err.count("GPUs reclaimed: no kernel launched for") == 1, err
    [rec] = [r for r in d.admin("history")["records"] if r["env"] == "alice"]
    assert rec["reason"] == "idle"
    # The launching task kept its GPU throughout, and runs on.
    assert busy.poll() is None
    [task] = d.tasks()
    assert task["env"] == "bob" and task["idle"] is not None and task["idle"] < 3.0
    wait_for(lambda: d.gpu_used(0) + d.gpu_used(1) <= GiB, 10)


def test_report_only_keeps_the_task(daemon_factory: Any, run_task: Any, wait_for: Any) -> None:
    d = daemon_factory({"idle": {"timeout": 1.0, "action": "report"}})
    start(run_task, str(d.env("alice", gpus=1, memory=GiB)), 0.0)
    wait_for(lambda: "launched no kernel; its GPUs could serve others" in d.logtext(), 10)
    [task] = d.tasks()
    assert task["idle"] >= 1.0 and task["idle_timeout"] == 1.0


def test_an_environment_policy_overrides_the_node_and_survives_a_restart(
    daemon_factory: Any,
) -> None:
    d = daemon_factory()
    d.env("alice", gpus=1, memory=GiB)
    d.admin("idle_set", env="alice", idle_timeout=60.0, idle_action="report")
    d.kill()
    d.start()
    [q] = d.admin("quota_show", env="alice")["quotas"]
    assert (q["idle_timeout"], q["idle_action"], q["idle_own"]) == (60.0, "report", True)
    d.admin("idle_set", env="alice")
    [q] = d.admin("quota_show", env="alice")["quotas"]
    assert (q["idle_timeout"], q["idle_action"], q["idle_own"]) == (0.0, "reclaim", False)


def test_admin_reclaim_is_told(daemon: Any, run_task: Any) -> None:
    p = start(run_task, str(daemon.env("alice", gpus=1, memory=GiB)), 0.0)
    [task] = daemon.tasks()
    daemon.admin("reclaim", task_id=task["task_id"])
    assert p.wait(30) == EXIT_RECLAIMED_ADMIN
    assert "GPUs reclaimed by an operator (nodemgr reclaim)" in p.stderr.read()


def test_a_deleted_environments_user_is_told(daemon: Any, run_task: Any) -> None:
    """The environment's socket goes at once, but its clients' connections stay for the
    grace, so the next heartbeat hears why."""
    ep = str(daemon.env("alice", gpus=1, memory=GiB))
    p = start(run_task, ep, 0.0)
    daemon.admin("quota_delete", env="alice", force=True)
    assert not Path(ep.removeprefix("ipc://")).exists()
    assert p.wait(30) == EXIT_RECLAIMED_DELETED
    err = p.stderr.read()
    assert "an operator deleted the environment 'alice'" in err, err


def test_the_operators_reason_reaches_the_user(daemon: Any, run_task: Any) -> None:
    """`nodemgr reclaim --reason` travels in the `reclaimed` answer to the task's client,
    which prints it with its exit 92 line."""
    p = start(run_task, str(daemon.env("alice", gpus=1, memory=GiB)), 0.0)
    [task] = daemon.tasks()
    why = "GPU 0 goes into maintenance at 14:00, see #ops"
    r = invoke(daemon, "reclaim", task["task_id"], "--reason", why)
    assert r.exit_code == 0, r.output
    assert p.wait(30) == EXIT_RECLAIMED_ADMIN
    err = p.stderr.read()
    assert f"GPUs reclaimed by an operator (nodemgr reclaim): {why}" in err
    # One printable line only: nothing the operator writes can move the user's cursor.
    for bad in ("two\nlines", "\x1b[2J", "x" * 501):
        r = invoke(daemon, "reclaim", "0123456789abcdef", "--reason", bad)
        assert r.exit_code == 2 and "--reason" in r.output
        with pytest.raises(NodeError) as e:
            daemon.admin("reclaim", task_id="0123456789abcdef", reason=bad)
        assert e.value.code == "bad_request"
