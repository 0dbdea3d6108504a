"""What a user sees from inside an environment: `gpushare-run --status` (a real daemon, real
gpushare-run and its real commands)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.client.conftest import gpushare_run
from tests.conftest import Holder

GiB = 1 << 30


def test_status_shows_holders_and_this_environments_wait(
    node: Any, run_task: Any, tmp_path: Path, wait_for: Any
) -> None:
    a, b = Holder(node.env("a", memory=2 * GiB)), Holder(node.env("b"))
    c = node.env("c")
    waiter = run_task(c, "sh", "-c", "true # my-own-cmd")
    wait_for(lambda: len(node.admin("queue")["waiting"]) == 1, 10)
    other = run_task(node.env("d"), "sh", "-c", "true # their-cmd")
    wait_for(lambda: len(node.admin("queue")["waiting"]) == 2, 10)

    r = gpushare_run("--status", env={"GPUSHARE_ENDPOINT": c})
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert out.startswith("environment c\n")
    for line in (
        "GPU 0",
        "GPU 1",
        "  a  1 task, holds 0B, promised 2GiB",
        "  b  1 task, holds 0B, promised 1GiB",
        "queue: 2 requests waiting, 1 of them this environment's",
        "  position 1: 1 GPU, waited ",
        "    command: sh -c true # my-own-cmd",
        "    waits for: 1 GPU needed: 0 free GPUs",
        "  and 1 request of other environments",
    ):
        assert line in out, out
    for secret in ("their-cmd", a.task_id, b.task_id, str(a.pid), str(b.pid), str(other.pid)):
        assert secret not in out

    r = gpushare_run("--endpoint", c, "--status", "--json")
    assert r.returncode == 0, r.stderr
    view = json.loads(r.stdout)
    assert view["env"] == "c" and view["others"] == 1 and view["waiting"] == 2
    assert [w["position"] for w in view["mine"]] == [1]
    assert sorted(h["env"] for g in view["gpus"] for h in g["holders"]) == ["a", "b"]

    a.close()
    assert waiter.wait(30) == 0
    b.close()
    assert other.wait(30) == 0


def test_status_exit_codes(node: Any, tmp_path: Path) -> None:
    ep = node.env("c")
    r = gpushare_run("--endpoint", ep, "--status", "true")
    assert r.returncode == 2 and "--status runs no command" in r.stderr
    r = gpushare_run("--endpoint", ep, "--json", "true")
    assert r.returncode == 2 and "--json goes with --status" in r.stderr
    r = gpushare_run("--endpoint", ep)
    assert r.returncode == 2 and "Missing argument" in r.stderr
    r = gpushare_run("--endpoint", f"ipc://{tmp_path}/none.sock", "--status")
    assert r.returncode == 69 and "cannot reach nodemgr" in r.stderr
    r = gpushare_run("--endpoint", ep, "--status")
    assert r.returncode == 0 and "queue: empty" in r.stdout and "free" in r.stdout
