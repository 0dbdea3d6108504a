"""Compute shares through a live nodemgr (docs/compute.md): `gpushare-run --compute`
reaches the task's ledger entry, `nodemgr share` changes it while the task runs, an
environment's cap applies, a restart keeps both, and tasks, top and metrics show them."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from nodemgr.host.ledger import COMPUTE_WINDOW, PAUSE_COMPUTE, Schedule
from tests.conftest import invoke
from tests.daemon.conftest import free_port, ledger_of, scrape
from tests.shim import compute_child

P = 100_000_000  # [compute] period's default, ns


def schedule(daemon: Any, env: str, task_id: str) -> Schedule | None:
    with ledger_of(daemon, env) as ledger:
        return ledger.schedule_of(task_id)


def start(daemon: Any, run_task: Any, wait_for: Any, env: str, *opts: str, **variables: str) -> str:
    """A running task (sleep) of ``env`` on GPU 0 (CUDA_VISIBLE_DEVICES), given
    gpushare-run ``opts``; its id."""
    known = {q["env"] for q in quotas(daemon)}
    ep = endpoint(daemon, env) if env in known else daemon.env(env)
    before = {t["task_id"] for t in daemon.tasks()}
    run_task(ep, "sleep", "60", opts=list(opts), env={"CUDA_VISIBLE_DEVICES": "0", **variables})
    wait_for(lambda: len(daemon.tasks()) == len(before) + 1, 10)
    [task_id] = [str(t["task_id"]) for t in daemon.tasks() if t["task_id"] not in before]
    return task_id


def quotas(daemon: Any) -> list[dict[str, Any]]:
    return list(daemon.admin("quota_show")["quotas"])


def endpoint(daemon: Any, env: str) -> str:
    return next(str(q["endpoint"]) for q in quotas(daemon) if q["env"] == env)


def task_view(daemon: Any, task_id: str) -> dict[str, Any]:
    return next(t for t in daemon.tasks() if t["task_id"] == task_id)


def test_a_share_reaches_the_ledger_and_changes_live(
    daemon: Any, run_task: Any, wait_for: Any
) -> None:
    a = start(daemon, run_task, wait_for, "alice", "--compute", "30")
    s = schedule(daemon, "alice", a)
    assert s is not None and s.flags == COMPUTE_WINDOW
    assert (s.period_ns, s.offset_ns, s.length_ns, s.share) == (P, 0, 30 * P // 100, 30)
    view = task_view(daemon, a)
    assert (view["compute"], view["share"]) == (30, 30)
    assert view["window"] == {"offset": 0.0, "length": 0.03, "period": 0.1}
    reply = daemon.admin("share", task_id=a, compute=50)
    assert (reply["compute"], reply["share"]) == (50, 50)
    assert [w["task_id"] for w in reply["windows"]] == [a]
    s = schedule(daemon, "alice", a)
    assert s is not None and s.length_ns == P // 2
    reply = daemon.admin("share", task_id=a)
    assert reply["share"] == 0 and reply["windows"] == []
    assert schedule(daemon, "alice", a) == Schedule(), "no share: never gated"


def test_gpushare_compute_asks_for_a_share(daemon: Any, run_task: Any, wait_for: Any) -> None:
    """The variable behind --compute, for auto-loaded tasks too."""
    a = start(daemon, run_task, wait_for, "alice", GPUSHARE_COMPUTE="15")
    assert (task_view(daemon, a)["compute"], task_view(daemon, a)["share"]) == (15, 15)


def test_tasks_on_one_gpu_get_windows_apart(daemon: Any, run_task: Any, wait_for: Any) -> None:
    daemon.env("alice", gpus=1)
    daemon.env("bob", gpus=1)
    a = start(daemon, run_task, wait_for, "alice", "--compute", "30")
    b = start(daemon, run_task, wait_for, "bob")
    sa, sb = schedule(daemon, "alice", a), schedule(daemon, "bob", b)
    assert sa is not None and sb is not None
    assert (sa.offset_ns, sa.length_ns) == (0, 30 * P // 100)
    assert (sb.offset_ns, sb.length_ns) == (30 * P // 100, 70 * P // 100)


def test_an_environments_cap_applies_and_survives_a_restart(
    daemon_factory: Any, run_task: Any, wait_for: Any
) -> None:
    d = daemon_factory(heartbeat_interval=0.2, heartbeat_timeout=3.0)
    d.env("alice")
    reply = d.admin("quota_set", env="alice", compute=20)
    assert reply["compute"] == 20
    capped = start(d, run_task, wait_for, "alice", "--compute", "60")
    free = start(d, run_task, wait_for, "alice")
    for t in (capped, free):
        s = schedule(d, "alice", t)
        assert s is not None and s.share == 20, "clamped to the cap; the cap alone applies"
    assert task_view(d, capped)["compute"] == 60
    d.admin("share", task_id=capped, compute=10)
    d.kill()
    d.start()
    assert quotas(d)[0]["compute"] == 20
    assert task_view(d, capped)["compute"] == 10
    assert task_view(d, capped)["share"] == 10
    s = schedule(d, "alice", capped)
    assert s is not None and s.length_ns == 10 * P // 100
    d.admin("quota_set", env="alice", compute=0)
    assert quotas(d)[0]["compute"] is None
    # The cap gone, the task without a share of its own takes the rest of the period.
    assert task_view(d, free)["share"] == 90


def test_cli_and_metrics_show_shares(daemon_factory: Any, run_task: Any, wait_for: Any) -> None:
    port = free_port()
    daemon = daemon_factory({"metrics": {"port": port}})
    a = start(daemon, run_task, wait_for, "alice", "--compute", "40")
    key = f'gpushare_task_compute_share{{env="alice",task="{a}"}}'
    wait_for(lambda: scrape(port).get(key) == 0.4, 10)
    assert f'gpushare_task_device_seconds_total{{env="alice",task="{a}"}}' in scrape(port)
    out = invoke(daemon, "tasks")
    assert out.exit_code == 0, out.output
    header, row = out.output.splitlines()[:2]
    assert "SHARE" in header and "40%" in row
    out = invoke(daemon, "share", a, "--compute", "25")
    assert out.exit_code == 0, out.output
    assert "in force 25%" in out.output and "0-25 ms of 100" in out.output
    out = invoke(daemon, "share", a, "--compute", "none", "--json")
    assert json.loads(out.output)["share"] == 0
    out = invoke(daemon, "quota", "set", "alice", "--compute", "none")
    assert out.exit_code == 0, out.output
    out = invoke(daemon, "share", a, "--compute", "101")
    assert out.exit_code == 2


def test_a_task_run_with_a_share_launches_only_in_its_window(
    daemon: Any, run_task: Any, tmp_path: Path
) -> None:
    """End to end: gpushare-run --compute 30 and a busy launcher (tests/c/compute_child.c)
    under nodemgr's grant: its launches fall in its window, and its pacer's device time
    shows in the task's view."""
    program = compute_child.build(tmp_path)
    ep = daemon.env("alice")
    p = run_task(ep, str(program), "3", "1000", "100", opts=["--compute", "30"])
    assert p.stdout is not None
    assert p.stdout.readline() == "ready\n"
    time.sleep(1)
    [view] = daemon.tasks()
    assert view["share"] == 30 and view["device_seconds"] > 0
    with ledger_of(daemon, "alice") as ledger:
        # Its one process runs its pacer: its launches need not go out of line to start one.
        assert ledger.task_pacing(view["task_id"]).pacers == 1
        found = ledger.task_entry(view["task_id"])
        assert found is not None
        assert ledger._l.task[found.index].paused & PAUSE_COMPUTE == 0
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    bins = compute_child.parse(out)
    start, end = bins.span()
    assert bins.busy_fraction(start + P, end - P) <= 0.35
    assert bins.in_window(P, 0, 30 * P // 100, slack_ns=1_000_000) >= 0.97
