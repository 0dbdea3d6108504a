"""Draining a GPU for maintenance: no new task gets it, its tasks run on, the queue waits,
and the drain outlives a restart (docs/nodemgr.md, drain)."""

from __future__ import annotations

import json
from typing import Any

from gpushare.client import Connection
from tests.conftest import Holder, invoke
from tests.daemon.conftest import Waiting

GiB = 1 << 30


def drained(daemon: Any) -> list[bool]:
    return [bool(g["drained"]) for g in daemon.admin("status")["gpus"]]


def test_a_drained_gpu_takes_no_new_task_while_its_tasks_run_on(
    daemon_factory: Any, wait_for: Any
) -> None:
    d = daemon_factory({"gpus": {"simulated_count": 2}})
    ep = d.env("a", gpus=2, memory=GiB)
    held = Holder(ep)
    [task] = d.tasks()
    gpu = task["gpus"][0]
    r = invoke(d, "drain", str(gpu), "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output) == [
        {"index": gpu, "uuid": d.admin("status")["gpus"][gpu]["uuid"], "drained": True, "tasks": 1}
    ]
    assert drained(d)[gpu] and not drained(d)[1 - gpu]
    assert [t["task_id"] for t in d.tasks()] == [held.task_id]  # it runs on
    # A new task of the same environment goes to the other GPU, never to the drained one.
    with Connection(ep) as c:
        grant = c.call("request", gpus=1)
        assert [g["index"] for g in grant["gpus"]] == [1 - gpu]
        c.call("done", task_id=grant["task_id"])
    # With every GPU drained, a request that may wait waits; undrain serves it at once.
    assert invoke(d, "drain", "all").exit_code == 0
    waiting = Waiting(ep, wait=60)
    wait_for(lambda: len(d.admin("queue")["waiting"]) == 1, 10)
    assert waiting.is_alive()
    r = invoke(d, "undrain", str(1 - gpu))
    assert r.exit_code == 0 and "open" in r.output
    grant = waiting.finish()
    assert [g["index"] for g in grant["gpus"]] == [1 - gpu]
    with Connection(ep) as c:
        c.call("done", task_id=grant["task_id"])
    held.close()
    # A request that only the drained GPU could serve waits rather than failing for good.
    with Connection(ep) as c:
        try:
            c.call("request", gpus=2)
        except Exception as e:
            assert getattr(e, "code", None) == "no_resources", e
            assert f"GPU {gpu} drained by an admin" in str(e)
        else:
            raise AssertionError("a request for a drained GPU was granted")


def test_a_drain_outlives_a_crash_and_status_shows_it(daemon_factory: Any) -> None:
    d = daemon_factory({"gpus": {"simulated_count": 2}})
    assert invoke(d, "drain", "1").exit_code == 0
    d.kill()  # as a crash: the drain was written before it was answered
    d.start()
    assert drained(d) == [False, True]
    r = invoke(d, "status")
    assert r.output.splitlines()[3].split()[:2] == ["1", "drained"], r.output
    r = invoke(d, "top", "--iterations", "1", "--interval", "0.1")
    assert "1 DRAINED" in r.output, r.output
    r = invoke(d, "drain", "--show")
    assert r.exit_code == 0 and "drained" in r.output and "open" in r.output
    assert invoke(d, "undrain", "all").exit_code == 0
    assert drained(d) == [False, False]


def test_drain_needs_a_gpu_and_names_an_unknown_one(daemon: Any) -> None:
    r = invoke(daemon, "drain")
    assert r.exit_code == 2 and "name the GPU to drain" in r.output
    r = invoke(daemon, "drain", "9")
    assert r.exit_code == 1, r.output
