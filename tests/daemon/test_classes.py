"""Latency-sensitive and best-effort tasks (docs/scheduling.md, "Classes"): the class
settings, the refusal of LS where it is not allowed, the LS queue served first, BE tasks
paused for an LS one (their launches held through the real shim) and resumed when it ends,
BE tasks requeued and run again by gpushare-run, and all of it across a restart. Against
a live nodemgr, real gpushare-run processes and the test CUDA client under the shim."""

from __future__ import annotations

import json
import os
import select
import sqlite3
import subprocess
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from client_plugin.run import main as gpushare_run
from gpushare.client import Connection, NodeError
from gpushare.exitcodes import EXIT_CLASS_REFUSED, EXIT_PREEMPTED, EXIT_USAGE
from nodemgr.cli import cli
from nodemgr.node.store import Store
from tests.conftest import BIN, Holder, invoke
from tests.daemon.conftest import free_port, scrape
from tests.daemon.test_store_upgrade import V2_SCHEMA

GiB = 1 << 30
# One 16 GiB GPU: easy to fill.
ONE_GPU = {"gpus": {"simulated_count": 1, "simulated_memory": "16GiB"}}


def _until_file(path: Path) -> list[str]:
    """A command that runs until ``path`` exists."""
    return ["sh", "-c", f'while [ ! -e "{path}" ]; do sleep 0.05; done']


def _readable(p: subprocess.Popen[str], seconds: float) -> bool:
    assert p.stdout is not None
    ready, _, _ = select.select([p.stdout], [], [], seconds)
    return bool(ready)


def test_class_options_are_parsed_and_checked() -> None:
    runner = CliRunner()
    bad = runner.invoke(gpushare_run, ["--endpoint", "ipc:///x", "--class", "urgent", "true"])
    assert bad.exit_code == EXIT_USAGE
    assert "ls (latency-sensitive) or be (best-effort)" in bad.output
    env = {"GPUSHARE_ENDPOINT": "ipc:///x", "GPUSHARE_CLASS": "urgent"}
    bad = runner.invoke(gpushare_run, ["true"], env=env)
    assert bad.exit_code == EXIT_USAGE
    assert "GPUSHARE_CLASS='urgent'" in bad.output
    bad = runner.invoke(cli, ["quota", "set", "a", "--class-default", "fast"])
    assert bad.exit_code == EXIT_USAGE


def test_env_class_settings_are_set_shown_and_kept_across_a_restart(daemon: Any) -> None:
    daemon.env("alice")
    out = invoke(daemon, "quota", "set", "alice", "--class-default", "Latency-Sensitive")
    assert out.exit_code == 0, out.output
    assert "class ls +ls" in out.output
    out = invoke(daemon, "quota", "set", "alice", "--no-allow-ls", "--json")
    reply = json.loads(out.output)
    assert (reply["class_default"], reply["allow_ls"], reply["gpus"]) == ("ls", False, 1)
    daemon.env("bob")  # no settings of its own: the node's ([classes])
    shown = invoke(daemon, "quota", "show")
    assert "ls -ls" in shown.output and "be +ls" in shown.output
    daemon.kill()
    daemon.start()
    [alice] = daemon.admin("quota_show", env="alice")["quotas"]
    assert (alice["class_default"], alice["allow_ls"]) == ("ls", False)


def test_ls_is_refused_where_not_allowed(daemon: Any, run_task: Any) -> None:
    ep = daemon.env("alice")
    daemon.admin("quota_set", env="alice", allow_ls=False)
    with Connection(ep, timeout=5) as conn:
        try:
            conn.call("request", gpus=1, task_class="ls")
        except NodeError as e:
            assert e.code == "class_not_allowed"
            assert "nodemgr quota set alice --allow-ls" in e.message
        else:
            raise AssertionError("an LS request was granted where LS is not allowed")
    p = run_task(ep, "true", opts=["--class", "latency-sensitive"])
    _, err = p.communicate(timeout=30)
    assert p.returncode == EXIT_CLASS_REFUSED, err
    assert "nodemgr quota set alice --allow-ls" in err
    # Best-effort still runs; so does LS once allowed.
    p = run_task(ep, "true", opts=["--class", "be"])
    p.communicate(timeout=30)
    assert p.returncode == 0
    daemon.admin("quota_set", env="alice", allow_ls=True)
    p = run_task(ep, "true", env={"GPUSHARE_CLASS": "ls"})
    p.communicate(timeout=30)
    assert p.returncode == 0
    classes = [r["task_class"] for r in daemon.admin("history", env="alice")["records"]]
    assert classes == ["ls", "be"]


def test_waiting_ls_requests_are_served_before_be_ones(
    daemon_factory: Any, run_task: Any, wait_for: Any, tmp_path: Path
) -> None:
    daemon = daemon_factory(ONE_GPU)
    # The GPU's holder is latency-sensitive itself: nothing can be preempted.
    hold = daemon.env("hold", memory=16 * GiB)
    daemon.admin("quota_set", env="hold", class_default="ls")
    holder = Holder(hold)
    # Either fills the GPU once it is free: the other waits for it to end.
    be_ep = daemon.env("batch", memory=10 * GiB)
    ls_ep = daemon.env("notebook", memory=10 * GiB)
    order = tmp_path / "order"
    be = run_task(be_ep, "sh", "-c", f"echo be >> {order}", opts=["--class", "be"])
    wait_for(lambda: len(daemon.admin("queue")["waiting"]) == 1, 10)
    ls = run_task(ls_ep, "sh", "-c", f"echo ls >> {order}", opts=["--class", "ls"])
    wait_for(lambda: len(daemon.admin("queue")["waiting"]) == 2, 10)
    waiting = daemon.admin("queue")["waiting"]
    assert [w["task_class"] for w in waiting] == ["ls", "be"]
    shown = invoke(daemon, "queue").output
    assert shown.index("notebook") < shown.index("batch")
    holder.close()
    for p in (ls, be):
        p.communicate(timeout=30)
        assert p.returncode == 0
    assert order.read_text().split() == ["ls", "be"]


def test_an_ls_task_pauses_a_be_task_which_resumes_when_it_ends(
    daemon_factory: Any, run_task: Any, wait_for: Any, cbin: dict[str, Path], tmp_path: Path
) -> None:
    """The BE task's launch blocks in the shim while it is paused, its memory stays
    charged; the LS task gets the room the BE environment's quota leaves; when it ends the
    BE task's launch goes through."""
    daemon = daemon_factory(ONE_GPU)
    train = daemon.env("train", memory=12 * GiB)
    nb = daemon.env("nb", memory=8 * GiB)
    go = tmp_path / "go"
    be = run_task(
        train, str(cbin["client"]), "alloc", "1024", "waitfile", str(go), "launch", "5",
        "sleep", "60",
    )  # fmt: skip
    assert be.stdout is not None
    assert be.stdout.readline() == "alloc ok\n"
    assert be.stdout.readline() == "waiting\n"
    [be_task] = daemon.tasks()
    assert be_task["task_class"] == "be"
    done = tmp_path / "done"
    ls = run_task(nb, *_until_file(done), opts=["--class", "ls"])
    wait_for(lambda: len(daemon.tasks()) == 2, 10)
    tasks = {t["env"]: t for t in daemon.tasks()}
    assert tasks["nb"]["task_class"] == "ls"
    assert "latency-sensitive" in tasks["train"]["preempted"]
    assert tasks["train"]["memory_used"] == GiB  # kept, and charged
    go.touch()
    assert not _readable(be, 1.5), "a paused BE task's launch went through"
    # Every view says so.
    table = invoke(daemon, "tasks").output
    assert "preempted" in table and f"{be_task['task_id']}: paused for" in table
    top = json.loads(invoke(daemon, "top", "--json").output)
    assert {t["env"]: t["task_class"] for t in top["tasks"]} == {"train": "be", "nb": "ls"}
    status = subprocess.run(
        [str(BIN / "gpushare-run"), "--status"],
        env={**os.environ, "GPUSHARE_ENDPOINT": train},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert "(be)" in status.stdout and "paused: paused for latency-sensitive task" in status.stdout
    # A resume by an operator lifts only the operator's pause.
    reply = daemon.admin("resume", task_id=be_task["task_id"])
    assert reply["paused"] is True
    assert not _readable(be, 0.5)
    done.touch()
    ls.communicate(timeout=30)
    assert _readable(be, 5), "the BE task did not resume when the LS task ended"
    assert be.stdout.readline() == "launch ok\n"
    assert daemon.tasks()[0]["preempted"] is None


def _counted_be(cbin: dict[str, Path], count: Path) -> list[str]:
    """A BE command that counts its runs and, on its first, holds 10 GiB for long."""
    return [
        "sh",
        "-c",
        f'echo run >> "{count}"; [ "$(wc -l < "{count}")" -ge 2 ] && exit 0; '
        f'exec "{cbin["client"]}" alloc 10240 sleep 60',
    ]


def test_a_be_task_that_pausing_cannot_make_room_for_is_requeued_and_run_again(
    daemon_factory: Any, run_task: Any, wait_for: Any, cbin: dict[str, Path], tmp_path: Path
) -> None:
    daemon = daemon_factory(ONE_GPU)
    train = daemon.env("train", memory=12 * GiB)
    nb = daemon.env("nb", memory=8 * GiB)
    count = tmp_path / "count"
    be = run_task(train, *_counted_be(cbin, count))
    assert be.stdout is not None
    assert be.stdout.readline() == "alloc ok\n"
    done = tmp_path / "done"
    ls = run_task(nb, *_until_file(done), opts=["--class", "ls"])
    # Pausing frees 2 GiB of the 8 needed: the BE task is requeued, the LS one granted.
    wait_for(lambda: [t["env"] for t in daemon.tasks()] == ["nb"], 15)
    done.touch()
    ls.communicate(timeout=30)
    _, err = be.communicate(timeout=30)
    assert be.returncode == 0, err
    assert "latency-sensitive request of environment nb" in err
    assert count.read_text().split() == ["run", "run"]
    reasons = [r["reason"] for r in daemon.admin("history", env="train")["records"]]
    assert reasons == ["done", "preempted"]


def test_no_requeue_exits_with_its_code(
    daemon_factory: Any, run_task: Any, wait_for: Any, cbin: dict[str, Path], tmp_path: Path
) -> None:
    daemon = daemon_factory(ONE_GPU)
    train = daemon.env("train", memory=12 * GiB)
    nb = daemon.env("nb", memory=8 * GiB)
    count = tmp_path / "count"
    be = run_task(train, *_counted_be(cbin, count), opts=["--no-requeue"])
    assert be.stdout is not None
    assert be.stdout.readline() == "alloc ok\n"
    ls = run_task(nb, "true", opts=["--class", "ls"])
    _, err = be.communicate(timeout=30)
    assert be.returncode == EXIT_PREEMPTED, err
    ls.communicate(timeout=30)
    assert ls.returncode == 0
    assert count.read_text().split() == ["run"]


def test_the_class_of_a_running_task_survives_a_restart(
    daemon: Any, run_task: Any, wait_for: Any, tmp_path: Path
) -> None:
    ep = daemon.env("alice")
    done = tmp_path / "done"
    p = run_task(ep, *_until_file(done), opts=["--class", "ls"])
    wait_for(lambda: len(daemon.tasks()) == 1, 10)
    daemon.kill()
    daemon.start()
    [task] = daemon.tasks()
    assert task["task_class"] == "ls"
    done.touch()
    p.communicate(timeout=30)
    assert [r["task_class"] for r in daemon.admin("history")["records"]] == ["ls"]


def test_metrics_count_tasks_by_class_and_the_paused_ones(
    daemon_factory: Any, run_task: Any, wait_for: Any, cbin: dict[str, Path], tmp_path: Path
) -> None:
    port = free_port()
    daemon = daemon_factory({**ONE_GPU, "metrics": {"port": port}})
    train = daemon.env("train", memory=12 * GiB)
    nb = daemon.env("nb", memory=8 * GiB)
    be = run_task(train, str(cbin["client"]), "alloc", "1024", "sleep", "60")
    assert be.stdout is not None
    assert be.stdout.readline() == "alloc ok\n"
    ls = run_task(nb, *_until_file(tmp_path / "done"), opts=["--class", "ls"])
    wait_for(lambda: len(daemon.tasks()) == 2, 10)

    def counted() -> bool:
        m = scrape(port)
        return m.get('gpushare_tasks{class="ls"}') == 1 and m.get("gpushare_preempted_tasks") == 1

    wait_for(counted, 5, interval=0.2)
    assert scrape(port)['gpushare_tasks{class="be"}'] == 1
    (tmp_path / "done").touch()
    ls.communicate(timeout=30)
    wait_for(lambda: scrape(port).get("gpushare_preempted_tasks") == 0, 5, interval=0.2)


def test_an_older_database_gains_classes(tmp_path: Path) -> None:
    """A database from before classes: its records have no class, its environments the
    node's settings, and what is set now is kept."""
    path = tmp_path / "nodemgr.db"
    db = sqlite3.connect(path)
    db.executescript(V2_SCHEMA)
    db.execute(
        "INSERT INTO tasks (task_id, env, gpus, memory, started, ended, reason) "
        "VALUES ('old', 'e', '0', 1, 1.0, 2.0, 'done')"
    )
    db.execute("PRAGMA user_version=2")
    db.commit()
    db.close()
    store = Store(path)
    try:
        [record] = store.history(None, None, 10)
        assert record.view()["task_class"] is None
        assert store.env_classes() == {}
        store.put_env_classes("e", "ls", False)
        assert store.env_classes() == {"e": ("ls", False)}
    finally:
        store.close()
