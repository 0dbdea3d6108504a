"""nodemgr's event loop, stepped by hand so that events can be made to coincide."""

from __future__ import annotations

import collections
import os
import select
import socket
import subprocess
import sys
import textwrap

import msgpack
import pytest
import zmq

from gpushare.messages import QuotaSet, Request
from nodemgr.loop.connections import Listener
from nodemgr.loop.server import Server
from nodemgr.loop.transport import Conn

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
        env: server._admin(QuotaSet(env=env, gpus=1, memory=1 << 30)).endpoint for env in ("A", "B")
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
            p.communicate(timeout=30)


def test_expired_finds_every_silent_task_and_only_those(server: Server) -> None:
    """The heartbeat check runs every turn but looks at the tasks only when the one silent
    longest may be past the timeout: a heartbeat, a task granted after a look, a task
    reclaimed, none may hide a silent task from it or show a live one."""
    node = server.node
    node.set_quota("alice", 1, 1 << 30)
    limit = node.config.heartbeat_timeout
    a = node.grant("alice", Request(gpus=1, command="a"), None)
    b = node.grant("alice", Request(gpus=1, command="b"), None)
    t0 = max(a.last_seen, b.last_seen)
    assert node.expired(t0) == []
    a.last_seen = t0 + limit  # a heartbeat
    assert node.expired(t0 + limit + 0.01) == [b]
    assert node.expired(t0 + limit + 0.02) == [b]  # until it is released
    node.release(b.task_id, "timeout")
    assert node.expired(t0 + limit + 0.03) == []
    # Granted after that look (which found a, heard from last at t0 + limit), so silent
    # since well before a.
    c = node.grant("alice", Request(gpus=1, command="c"), None)
    assert c.last_seen < a.last_seen
    assert node.expired(c.last_seen + limit) == []
    assert node.expired(c.last_seen + limit + 0.01) == [c]
    node.release(c.task_id, "timeout")
    node.release(a.task_id, "done")
    assert node.expired(t0 + 10 * limit) == []


class Admin:
    """A client of the in-process server's admin socket, answered as the test steps it."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.connect(f"ipc://{server.config.run_dir / 'admin.sock'}")
        self.sent = 0

    def status(self) -> None:
        """Ask for the status; step the loop until the answer comes."""
        self.sent += 1
        self.sock.send(msgpack.packb({"v": 1, "type": "status", "id": self.sent}))
        while not self.sock.poll(0):
            self.server.step()
        reply = msgpack.unpackb(self.sock.recv())
        assert (reply["type"], reply["id"]) == ("status", self.sent), reply

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def test_a_client_whose_events_fail_is_put_out_of_the_wait(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Handling a client's exit, and serving its connection, raise every time. Each event
    stays ready until handled: failed, it is handled once and put out of the wait (the
    pidfd unwatched, the connection dropped), so that no later turn fails or ends its wait
    on it, and the admin socket is served all along."""
    ep = server._admin(QuotaSet(env="A", gpus=1, memory=1 << 30)).endpoint
    p = subprocess.Popen(
        [sys.executable, "-c", CLIENT, ep, "hold"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdout is not None
        while not select.select([p.stdout], [], [], 0.02)[0]:
            server.step()
        task_id = p.stdout.readline().strip()
        assert ("task", task_id) in server.watched
    finally:
        p.kill()
        p.communicate(timeout=30)
    exits: list[int] = []
    served: collections.Counter[Conn] = collections.Counter()

    def exited(fd: int) -> None:
        exits.append(fd)
        raise RuntimeError("a client's exit that cannot be handled")

    serve = server._io

    def io(conn: Conn, events: int) -> None:
        if conn.env == "A":
            served[conn] += 1
            raise RuntimeError("a connection that cannot be served")
        serve(conn, events)

    monkeypatch.setattr(server, "_process_exited", exited)
    monkeypatch.setattr(server, "_io", io)
    admin = Admin(server)
    try:
        for _ in range(10):
            admin.status()
    finally:
        admin.close()
    assert len(exits) == 1
    assert ("task", task_id) not in server.watched
    [(conn, times)] = served.items()
    assert times == 1
    assert conn.closed and server.fds.get(conn.fd) is not conn


def test_a_listener_whose_accept_fails_waits_for_the_sweep(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Accepting on A's socket raises: its waiting connection stays there, so the listener
    is not polled until the next sweep (none comes here until the test lets it), and the
    admin socket is served meanwhile. At the sweep it is polled, and accepts, again."""
    ep = server._admin(QuotaSet(env="A", gpus=1, memory=1 << 30)).endpoint
    listener = server.connections.listeners["A"]
    tries: list[Listener] = []
    accept = server.connections.accept

    def failing(what: Listener) -> None:
        if what is listener:
            tries.append(what)
            raise RuntimeError("a listener that cannot accept")
        accept(what)

    monkeypatch.setattr(server.connections, "accept", failing)
    server.step()  # the first turn sweeps
    server._next_sweep = float("inf")  # and no other until the test says so
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        client.connect(ep.removeprefix("ipc://"))
        admin = Admin(server)
        try:
            while not tries:
                server.step()
            for _ in range(10):
                admin.status()
        finally:
            admin.close()
        assert len(tries) == 1
        assert not any(isinstance(c, Conn) and c.env == "A" for c in server.fds.values())
        monkeypatch.setattr(server.connections, "accept", accept)
        server._next_sweep = 0.0
        while not any(isinstance(c, Conn) and c.env == "A" for c in server.fds.values()):
            server.step()
        assert len(tries) == 1
    finally:
        client.close()
