"""nodemgr's event loop, stepped by hand so that events can be made to coincide."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import textwrap

from nodemgr.server import Server
from nodemgr.transport import Conn

CLIENT = textwrap.dedent(
    """
    import sys, time, zmq, msgpack
    ep, mode = sys.argv[1], sys.argv[2]
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.connect(ep)
    s.send(msgpack.packb({"v": 1, "type": "request", "id": 1, "gpus": 1}))
    task_id = msgpack.unpackb(s.recv())["task_id"]
    print(task_id, flush=True)
    sys.stdin.readline()
    if mode == "done":
        s.send(msgpack.packb({"v": 1, "type": "done", "id": 2, "task_id": task_id}))
        time.sleep(0.2)
        sys.exit(0)
    s.send(msgpack.packb({"v": 1, "type": "request", "id": 3, "gpus": 1}))
    time.sleep(60)
    """
)


def test_an_exit_event_never_ends_a_task_granted_in_the_same_step(server: Server) -> None:
    """A's client sends done and exits while B asks for a second task; all three events
    land in one poll. Serving A's done frees its pidfd number and B's new task may get it:
    the stale exit event must not end B's task."""
    eps = {
        env: server._admin("quota_set", 0, {"env": env, "gpus": 1, "memory": 1 << 30})["endpoint"]
        for env in ("A", "B")
    }
    procs = {}
    for env, mode in (("A", "done"), ("B", "hold")):
        p = subprocess.Popen(
            [sys.executable, "-c", CLIENT, eps[env], mode],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        procs[env] = p
        assert p.stdout is not None
        while not select.select([p.stdout], [], [], 0.02)[0]:
            server.step()
        p.stdout.readline()
    try:
        a, b = procs["A"], procs["B"]
        assert a.stdin is not None and b.stdin is not None
        a.stdin.write("\n")
        a.stdin.flush()
        a.wait(10)
        b.stdin.write("\n")
        b.stdin.flush()
        # Not stepped yet: wait until B's second request is there to read.
        [b_conn] = [c for c in server.fds.values() if isinstance(c, Conn) and c.env == "B"]
        ready = select.poll()
        ready.register(b_conn.fd, select.POLLIN)
        assert ready.poll(10_000), "B's second request did not arrive"
        # Take every free descriptor below A's pidfd, so that the pidfd B's new task
        # gets is the very number A's had.
        [a_fd] = [
            fd for fd, (_, t) in server.pidfds.items() if server.node.tasks[str(t)].env == "A"
        ]
        fillers = []
        while (fd := os.open("/dev/null", os.O_RDONLY)) < a_fd:
            fillers.append(fd)
        os.close(fd)
        try:
            server.step()
        finally:
            for fd in fillers:
                os.close(fd)
        server.step()
        envs = sorted(t.env for t in server.node.tasks.values())
        assert envs == ["B", "B"], server.node.tasks
        assert all(t.pid == b.pid for t in server.node.tasks.values())
        assert server.node.envs["B"].ledger.limit(server.node.tasks.popitem()[1].gpus[0]) > 0
    finally:
        for p in procs.values():
            p.kill()
            p.communicate()
