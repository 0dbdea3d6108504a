"""What one environment, or one of its processes, may take of nodemgr: running tasks are
capped per environment and per client process ([limits]), as connections and waiting
requests are, so that no environment's user can exhaust nodemgr's descriptors and starve
the others (docs/operations.md, "What a node can hold")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from gpushare.client import Connection
from nodemgr.loop.connections import FD_RESERVE, TASK_SHARE
from tests.conftest import die_with_test_run

MiB = 1 << 20

# Asks for one GPU N times in a row on one connection, printing each answer's type and
# error code; then holds its tasks until its stdin closes.
GRABBER = """
import sys, msgpack, zmq
s = zmq.Context().socket(zmq.DEALER)
s.connect(sys.argv[1])
for i in range(int(sys.argv[2])):
    s.send(msgpack.packb({"v": 1, "type": "request", "id": i + 1, "gpus": 1}))
    r = msgpack.unpackb(s.recv())
    print(r["type"], r.get("error", "-"), r.get("message", "-"), flush=True)
sys.stdin.read()
"""


class Grabber:
    def __init__(self, endpoint: str, n: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", GRABBER, endpoint, str(n)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=die_with_test_run(),
        )
        assert self.proc.stdout is not None
        self.answers = [self.proc.stdout.readline().split(" ", 2) for _ in range(n)]

    def kinds(self) -> list[str]:
        return [a[0] if a[0] == "grant" else a[1] for a in self.answers]

    def close(self) -> None:
        self.proc.kill()
        self.proc.communicate(timeout=30)


def test_running_tasks_are_capped_per_client_and_per_environment(
    daemon_factory: Any, wait_for: Any
) -> None:
    d = daemon_factory(
        {"limits": {"tasks_per_env": 10, "tasks_per_client": 4}}, heartbeat_timeout=600.0
    )
    ep = d.env("a", gpus=1, memory=MiB)
    first = Grabber(ep, 6)
    second = Grabber(ep, 4)
    third = Grabber(ep, 3)
    try:
        assert first.kinds() == ["grant"] * 4 + ["busy"] * 2
        assert "limits.tasks_per_client, 4" in first.answers[4][2]
        assert f"process {first.proc.pid} already holds 4 running tasks" in first.answers[4][2]
        assert second.kinds() == ["grant"] * 4
        assert third.kinds() == ["grant", "grant", "busy"]
        assert "environment a already has 10 running tasks" in third.answers[2][2]
        assert "limits.tasks_per_env, 10" in third.answers[2][2]
        assert len(d.tasks()) == 10
        # Another environment is served all the same.
        with Connection(d.env("b", gpus=1, memory=MiB)) as c:
            grant = c.call("request", gpus=1)
            c.call("done", task_id=grant["task_id"])
        # The first process's tasks end with it, and their room is free again.
        first.close()
        wait_for(lambda: len(d.tasks()) == 6, 10)
        fourth = Grabber(ep, 4)
        assert fourth.kinds() == ["grant"] * 4
        fourth.close()
    finally:
        for g in (first, second, third):
            g.close()


def test_a_loop_of_requests_from_one_process_stops_at_its_cap(
    daemon_factory: Any,
) -> None:
    """With the defaults, a process asking for grants in a loop gets 64 and then `busy`,
    and the other environments are served; nodemgr's descriptors are not used up."""
    d = daemon_factory(heartbeat_timeout=600.0)
    greedy = Grabber(d.env("greedy", gpus=1, memory=MiB), 100)
    try:
        assert greedy.kinds() == ["grant"] * 64 + ["busy"] * 36
        assert "limits.tasks_per_client, 64" in greedy.answers[-1][2]
        with Connection(d.env("other", gpus=1, memory=MiB)) as c:
            grant = c.call("request", gpus=1)
            c.call("done", task_id=grant["task_id"])
    finally:
        greedy.close()


def _limits(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/limits") as f:
        for line in f:
            if line.startswith("Max open files"):
                soft, hard = line.split()[3:5]
                return int(soft), int(hard)
    raise AssertionError("no Max open files line")


def test_nodemgr_raises_its_descriptor_limit_and_caps_tasks_by_it(daemon_factory: Any) -> None:
    """Started with a soft limit below the hard one, nodemgr raises it to the hard one, and
    an environment's running tasks are capped to a share of what it leaves."""
    hard = FD_RESERVE + 40 * TASK_SHARE
    d = daemon_factory(nofile=(FD_RESERVE + 16, hard), heartbeat_timeout=600.0)
    assert _limits(d.proc.pid) == (hard, hard)
    assert f"40 running tasks per environment (descriptor limit {hard})" in d.logtext()
    ep = d.env("a", gpus=1, memory=MiB)
    grabbers = [Grabber(ep, 20), Grabber(ep, 21)]
    try:
        assert grabbers[0].kinds() == ["grant"] * 20
        assert grabbers[1].kinds() == ["grant"] * 20 + ["busy"]
        assert "limits.tasks_per_env, 40" in grabbers[1].answers[-1][2]
    finally:
        for g in grabbers:
            g.close()


# Sends N `view` requests at once on one connection and prints each answer's type and code.
VIEWER = """
import sys, msgpack, zmq
s = zmq.Context().socket(zmq.DEALER)
s.connect(sys.argv[1])
n = int(sys.argv[2])
for i in range(n):
    s.send(msgpack.packb({"v": 1, "type": "view", "id": i + 1}))
answers = {}
for _ in range(n):
    r = msgpack.unpackb(s.recv())
    answers[r["id"]] = (r["type"], r.get("error", "-"), r.get("message", "-"))
for i in range(n):
    print(*answers[i + 1], flush=True)
"""


def _views(endpoint: str, n: int) -> list[list[str]]:
    out = subprocess.run(
        [sys.executable, "-c", VIEWER, endpoint, str(n)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return [line.split(" ", 2) for line in out.splitlines()]


def test_views_are_rate_limited_per_environment(daemon_factory: Any) -> None:
    """An environment sending `view`s in a loop gets `busy` past its burst; another
    environment's views and grants are served as before."""
    d = daemon_factory({"limits": {"views_per_second": 1, "view_burst": 5}})
    flood = _views(d.env("a", gpus=1, memory=MiB), 200)
    kinds = [a[0] if a[0] == "view" else a[1] for a in flood]
    assert kinds[:5] == ["view"] * 5
    assert kinds.count("busy") >= 150, kinds
    busy = next(a for a in flood if a[1] == "busy")[2]
    assert "limits.views_per_second" in busy and "environment a" in busy
    ep = d.env("b", gpus=1, memory=MiB)
    assert [a[0] for a in _views(ep, 5)] == ["view"] * 5
    with Connection(ep) as c:
        grant = c.call("request", gpus=1)
        c.call("done", task_id=grant["task_id"])


def _size(path: Path) -> int | None:
    try:
        return os.stat(path, follow_symlinks=False).st_size
    except FileNotFoundError:
        return None


def test_a_ledger_and_socket_replaced_in_a_loop_log_once(
    daemon_factory: Any, wait_for: Any
) -> None:
    """An environment's user may replace its ledger and socket over and over; each kind of
    line about it is logged once per interval, not once per replacement."""
    d = daemon_factory()
    d.env("a", gpus=1, memory=MiB)
    env_dir = d.run_dir / "envs" / "a"
    rounds = 8
    for i in range(rounds):
        fake = env_dir / f"fake{i}"
        fake.write_bytes(b"\0" * 4096)
        os.rename(fake, env_dir / "ledger")
        # nodemgr makes a new ledger in its place (no ledger is 4096 zeros), and binds the
        # socket again.
        wait_for(
            lambda: (
                _size(env_dir / "ledger") not in (4096, None)
                and (env_dir / "task.sock").is_socket()
            ),
            15,
        )
        (env_dir / "task.sock").unlink()
        wait_for(lambda: (env_dir / "task.sock").is_socket(), 15)
    log = d.logtext()
    for line in (
        "env a: its ledger",
        "env a: a new ledger replaces the lost one",
        "task.sock was removed; binding it again",
    ):
        said = log.count(line)
        assert 1 <= said < rounds, (line, said, log)
    # nodemgr serves it still.
    assert [a[0] for a in _views(d.env("a", gpus=1, memory=MiB), 1)] == ["view"]
