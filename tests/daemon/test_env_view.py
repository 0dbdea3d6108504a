"""The `view` request on a task endpoint (a real daemon, real client processes): who holds
the GPUs by environment, the asking environment's own waiting requests in full and the
other environments' only counted; never another environment's task, command or pid."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import msgpack
import pytest

from gpushare.client import Connection

GiB = 1 << 30


def view(endpoint: str) -> dict[str, Any]:
    with Connection(endpoint) as conn:
        reply = conn.call("view")
    assert reply["type"] == "view"
    return reply


def test_an_environment_sees_holders_and_its_own_place_in_the_queue(
    node: Any, run_task: Any, tmp_path: Path, wait_for: Any
) -> None:
    go = tmp_path / "go"
    a, b = node.env("a", memory=2 * GiB), node.env("b", memory=GiB)
    c, d = node.env("c"), node.env("d")
    holders = [
        run_task(ep, "sh", "-c", f"echo up; while [ ! -e {go} ]; do sleep 0.05; done # {name}-cmd")
        for ep, name in ((a, "a"), (b, "b"))
    ]
    for h in holders:
        assert h.stdout.readline() == "up\n"
    running = node.tasks()
    assert len(running) == 2
    # One after the other, each once the one before waits: c, d, c in the queue.
    for n, (ep, cmd, opts, env) in enumerate(
        (
            (c, "true # c-first-cmd", ["--memory", "1GiB"], {}),
            (d, "true # d-second-cmd", [], {}),
            (c, "true # c-third-cmd", [], {"CUDA_VISIBLE_DEVICES": "1"}),
        ),
        1,
    ):
        run_task(ep, "sh", "-c", cmd, opts=opts, env=env)
        wait_for(lambda n=n: len(node.admin("queue")["waiting"]) == n, 10)
    assert [w["env"] for w in node.admin("queue")["waiting"]] == ["c", "d", "c"]

    seen = view(c)
    assert seen["env"] == "c"
    assert seen["waiting"] == 3 and seen["others"] == 1
    mine = seen["mine"]
    assert [w["position"] for w in mine] == [1, 3]
    assert [w["command"] for w in mine] == [
        "sh -c true # c-first-cmd",
        "sh -c true # c-third-cmd",
    ]
    assert [w["gpus"] for w in mine] == [1, 1]
    assert mine[0]["memory"] == GiB and mine[1]["memory"] is None
    assert mine[0]["devices"] is None and mine[1]["devices"] == [1]
    for w in mine:
        assert "free GPU" in w["reason"] and w["waited"] >= 0 and w["timeout_in"] > 0
    by_env = {h["env"]: (g["index"], h) for g in seen["gpus"] for h in g["holders"]}
    assert set(by_env) == {"a", "b"}
    assert by_env["a"][1]["tasks"] == 1 and by_env["a"][1]["promised"] == 2 * GiB
    assert by_env["b"][1]["tasks"] == 1 and by_env["b"][1]["promised"] == GiB
    for g in seen["gpus"]:
        assert g["mode"] == "shared" and g["drained"] is False and g["lost"] is False
        assert g["charged"] == sum(h["promised"] for h in g["holders"])
        assert g["capacity"] <= g["memory"]
    assert {by_env["a"][0], by_env["b"][0]} == {0, 1}

    # d sees its own request, and c's two only as a count.
    other = view(d)
    assert [(w["position"], w["command"]) for w in other["mine"]] == [
        (2, "sh -c true # d-second-cmd")
    ]
    assert other["others"] == 2
    # An environment holding a GPU and waiting for nothing.
    holding = view(a)
    assert holding["mine"] == [] and holding["others"] == 3

    # Nothing of another environment's tasks or requests, in any field, anywhere.
    secrets = [t["task_id"] for t in running]
    secrets += ["a-cmd", "b-cmd", "d-second-cmd"]
    pids = [t["pid"] for t in running] + [holders[0].pid, holders[1].pid]
    for w in node.admin("queue")["waiting"]:
        if w["env"] != "c":
            pids.append(w["pid"])
    text = json.dumps(seen) + repr(msgpack.packb(seen))
    for secret in secrets:
        assert secret not in text, secret
    # A pid is a number: as a number of its own, not as digits inside another one (pid
    # 717 stands in the 16 GiB of 17179869184).
    numbers = {int(n) for n in re.findall(r"(?<![\w.])\d+(?![\w.])", json.dumps(seen))}
    for pid in pids:
        assert pid not in numbers, pid
    # Nor of c's in what d sees.
    text = json.dumps(other)
    for secret in ("c-first-cmd", "c-third-cmd", *[t["task_id"] for t in running]):
        assert secret not in text

    go.touch()
    for h in holders:
        h.communicate(timeout=30)
        assert h.returncode == 0


def test_view_is_a_task_endpoint_request_only(node: Any) -> None:
    """The admin endpoint has its own views; `view` is an environment's."""
    from gpushare.client import NodeError

    with pytest.raises(NodeError) as e:
        node.admin("view")
    assert e.value.code == "unknown_type"
    empty = view(node.env("solo"))
    assert empty["waiting"] == 0 and empty["mine"] == [] and empty["others"] == 0
    assert [g["holders"] for g in empty["gpus"]] == [[], []]
