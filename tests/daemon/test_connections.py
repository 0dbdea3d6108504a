"""Connections to nodemgr's endpoints: capped, bounded, and never a way to crash it.

An environment's user can open as many connections to its own task endpoint as it likes
and send whatever bytes it likes; nodemgr must refuse what is over its caps with an
answer, hold at most one message's worth of memory per connection, and keep serving the
other environments (docs/protocol.md, "Transport"). The raw client here speaks ZMTP 3.0
as the specification writes it, independently of nodemgr's own transport code.
"""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import struct
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from gpushare import protocol
from gpushare.client import Connection
from gpushare.messages import QuotaSet
from nodemgr.loop import connections
from nodemgr.loop.server import Server
from nodemgr.loop.transport import Conn
from tests.conftest import _wait_for as wait_for
from tests.conftest import die_with_test_run

GiB = 1 << 30
KiB = 1 << 10
MiB = 1 << 20

# A ZMTP 3.0 greeting of a NULL-mechanism client, and the frames around it.
CLIENT_GREETING = b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL" + bytes(16) + b"\x00" + bytes(31)


def _frame(body: bytes, more: bool = False, command: bool = False) -> bytes:
    flags = (1 if more else 0) | (4 if command else 0)
    if len(body) > 255:
        return bytes((flags | 2,)) + struct.pack(">Q", len(body)) + body
    return bytes((flags, len(body))) + body


def _ready(socket_type: bytes) -> bytes:
    prop = b"\x0bSocket-Type" + struct.pack(">I", len(socket_type)) + socket_type
    return _frame(b"\x05READY" + prop, command=True)


def request(kind: str, msg_id: int, **fields: Any) -> bytes:
    return _frame(msgpack.packb({"v": 1, "type": kind, "id": msg_id, **fields}))


class Raw:
    """A hand-made ZMTP client connection to a nodemgr endpoint."""

    def __init__(self, endpoint: str, handshake: bool = True) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(endpoint.removeprefix("ipc://"))
        self.buf = b""
        if handshake:
            self.sock.sendall(CLIENT_GREETING + _ready(b"DEALER"))
            greeting = self._read(64)
            assert greeting[0] == 0xFF and greeting[10] == 3, greeting
            flags, size = self._read(2)
            assert flags & 4, "nodemgr's READY is not a command"
            assert b"ROUTER" in self._read(size)

    def _read(self, n: int) -> bytes:
        while len(self.buf) < n:
            data = self.sock.recv(65536)
            if not data:
                raise EOFError("nodemgr closed the connection")
            self.buf += data
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def call(self, kind: str, msg_id: int = 1, **fields: Any) -> dict[str, Any]:
        self.sock.sendall(request(kind, msg_id, **fields))
        flags, size = self._read(2)
        if flags & 2:
            size = struct.unpack(">Q", bytes([size]) + self._read(7))[0]
        reply: dict[str, Any] = msgpack.unpackb(self._read(size), raw=False)
        return reply

    def closed_by_peer(self, timeout: float = 10) -> bool:
        """Read until nodemgr closes the connection (True) or ``timeout`` passes."""
        self.sock.settimeout(timeout)
        try:
            while self.sock.recv(1 << 20):
                pass
        except TimeoutError:
            return False
        except ConnectionResetError:
            pass
        return True

    def close(self) -> None:
        self.sock.close()


def ask(endpoint: str, kind: str = "quota") -> dict[str, Any]:
    """One request on a fresh raw connection, closed after."""
    raw = Raw(endpoint)
    try:
        return raw.call(kind)
    finally:
        raw.close()


def rss_peak(pid: int) -> int:
    """The peak resident memory of process ``pid`` so far (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * KiB
    raise AssertionError("no VmHWM")


@contextlib.contextmanager
def dealer(endpoint: str) -> Iterator[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]]:
    """A libzmq DEALER connected to ``endpoint``, and a monitor of its connection events."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    monitor = s.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    try:
        s.connect(endpoint)
        yield s, monitor
    finally:
        s.disable_monitor()
        monitor.close(linger=0)
        s.close(linger=0)
        ctx.term()


def next_event(monitor: zmq.Socket[bytes], timeout: float = 10) -> int:
    assert monitor.poll(int(timeout * 1000)), "no connection event"
    return int(recv_monitor_message(monitor)["event"])


def test_a_message_over_the_limit_in_all_its_frames_is_never_held(daemon: Any) -> None:
    """4,000 frames of 64 KiB, each within the frame limit, then a valid map: 256 MiB that a
    ROUTER socket would buffer whole before nodemgr saw a byte. nodemgr drops the sender's
    connection at the frame that passes the limit: its memory does not grow by the
    message, and the sender, once reconnected, is served as before."""
    ep = daemon.env("many", gpus=0, memory=GiB)
    ping = msgpack.packb({"v": 1, "type": "quota", "id": 7})
    before = rss_peak(daemon.proc.pid)
    with dealer(ep) as (s, monitor):
        assert next_event(monitor) == zmq.EVENT_CONNECTED
        s.send_multipart([b"\x00" * (64 * KiB)] * 4000 + [ping])
        assert next_event(monitor) == zmq.EVENT_DISCONNECTED
        assert not s.poll(500), "a message over the limit was answered"
        assert next_event(monitor) == zmq.EVENT_CONNECTED
        s.send(ping)
        assert s.poll(5000), "the sender was not served after its message was dropped"
        assert msgpack.unpackb(s.recv(), raw=False)["type"] == "quota"
    grew = rss_peak(daemon.proc.pid) - before
    assert grew < 32 * MiB, f"nodemgr's memory grew by {grew / MiB:.0f} MiB for one message"


def test_a_message_of_too_many_frames_ends_its_connection(daemon: Any) -> None:
    ep = daemon.env("frames", gpus=0, memory=GiB)
    raw = Raw(ep)
    try:
        frames = [_frame(b"", more=True)] * protocol.MAX_FRAMES
        raw.sock.sendall(b"".join(frames) + request("quota", 1))
        assert raw.closed_by_peer(), "a message of too many frames was read on"
    finally:
        raw.close()
    # Within the limits, stray frames are dropped unanswered on a connection that stays.
    raw = Raw(ep)
    try:
        raw.sock.sendall(_frame(b"x", more=True) + request("quota", 1))
        assert raw.call("quota", 2)["id"] == 2
    finally:
        raw.close()


def test_what_is_not_zmtp_from_a_dealer_is_closed_at_once(daemon: Any) -> None:
    ep = daemon.env("junk", gpus=0, memory=GiB)
    for junk in (b"GET / HTTP/1.1\r\n\r\n", CLIENT_GREETING + _ready(b"PUB")):
        raw = Raw(ep, handshake=False)
        try:
            raw.sock.sendall(junk)
            assert raw.closed_by_peer()
        finally:
            raw.close()
    # A REQ socket is a client like a DEALER: its empty delimiter is echoed back.
    with zmq.Context() as ctx, ctx.socket(zmq.REQ) as s:
        s.setsockopt(zmq.LINGER, 0)
        s.connect(ep)
        s.send(msgpack.packb({"v": 1, "type": "quota", "id": 3}))
        assert s.poll(5000)
        assert msgpack.unpackb(s.recv(), raw=False)["id"] == 3


def test_a_client_that_never_reads_its_replies_is_dropped(daemon: Any) -> None:
    """Requests sent without reading a reply: nodemgr buffers at most about 1 MiB of
    replies for the connection, then drops it, and serves everyone else meanwhile."""
    ep = daemon.env("deaf", gpus=0, memory=GiB)
    before = rss_peak(daemon.proc.pid)
    raw = Raw(ep)
    try:
        flood = request("heartbeat", 1, task_id="nosuchtask") * 60_000
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            raw.sock.sendall(flood)
        assert raw.closed_by_peer(), "a client that never reads was buffered for"
    finally:
        raw.close()
    grew = rss_peak(daemon.proc.pid) - before
    assert grew < 32 * MiB, f"nodemgr's memory grew by {grew / MiB:.0f} MiB"
    assert daemon.admin("quota_show", env="deaf")["quotas"][0]["env"] == "deaf"


def test_connections_of_one_process_are_capped_with_an_answer(daemon: Any) -> None:
    ep = daemon.env("many", gpus=0, memory=GiB)
    held = [Raw(ep) for _ in range(16)]
    try:
        for raw in held[:2]:
            assert raw.call("quota")["type"] == "quota"
        extra = Raw(ep)
        reply = extra.call("quota", 5)
        assert reply["type"] == "error" and reply["error"] == "busy" and reply["id"] == 5
        assert f"process {os.getpid()} already has 16 connections" in reply["message"]
        assert extra.closed_by_peer()
        extra.close()
        held.pop().close()
        # The cap counts connections open now: one closed lets the next in.
        wait_for(lambda: ask(ep)["type"] == "quota", 5)
    finally:
        for raw in held:
            raw.close()


HOLDER = textwrap.dedent(
    """
    import socket, sys
    path, n, greeting = sys.argv[1], int(sys.argv[2]), bytes.fromhex(sys.argv[3])
    held = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        try:
            s.sendall(greeting)
        except OSError:  # closed at once: over every cap
            pass
        held.append(s)
    print("ok", flush=True)
    sys.stdin.read()
    """
)


def hold_connections(endpoint: str, n: int, handshake: bool = True) -> subprocess.Popen[str]:
    """A process that opens ``n`` connections to ``endpoint`` (handshake sent) and keeps
    them until its stdin closes."""
    greeting = CLIENT_GREETING + _ready(b"DEALER") if handshake else b""
    p = subprocess.Popen(
        [sys.executable, "-c", HOLDER, endpoint.removeprefix("ipc://"), str(n), greeting.hex()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=die_with_test_run(),
    )
    assert p.stdout is not None
    return p


def end(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        p.kill()
        p.communicate(timeout=30)


def test_an_environment_over_its_share_of_descriptors_is_refused_others_served(
    daemon_factory: Any,
) -> None:
    """nodemgr at a descriptor limit of 384: about 120 are left for connections, an
    environment may take half. Five processes of one environment open 15 connections each:
    the ones over its share are answered `busy`, nodemgr stays up and another environment is
    served at once."""
    d = daemon_factory(nofile=384)
    a = d.env("A", gpus=0, memory=GiB)
    b = d.env("B", gpus=0, memory=GiB)
    procs = [hold_connections(a, 15) for _ in range(5)]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline() == "ok\n"
        late = Raw(a)
        reply = late.call("quota")
        assert reply["error"] == "busy", reply
        assert "environment A already has" in reply["message"]
        late.close()
        assert ask(b)["env"] == "B"
        assert d.proc.poll() is None
    finally:
        end(procs)
    wait_for(lambda: ask(a).get("env") == "A", 10)


def test_connections_past_the_descriptor_limit_wait_and_nodemgr_stays_up(
    daemon_factory: Any,
) -> None:
    """Processes of three environments open 600 connections against a limit of 384 (the
    same flood made libzmq abort the daemon: `Too many open files`). nodemgr stops accepting
    environments' connections at its budget, answers its admin, and once the flood ends a
    waiting environment's request is served."""
    d = daemon_factory(nofile=384)
    eps = [d.env(name, gpus=0, memory=GiB) for name in ("A", "B", "C")]
    procs = [hold_connections(ep, 50, handshake=False) for ep in eps for _ in range(4)]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline() == "ok\n"
        assert d.proc.poll() is None, d.logtext()
        assert d.admin("status")["gpus"]
        wait_for(lambda: "descriptor limit" in d.logtext(), 5)
    finally:
        end(procs)
    with Connection(eps[2], timeout=15) as conn:
        assert conn.call("quota")["env"] == "C"
    assert d.proc.poll() is None


def test_a_reader_flooding_view_sock_is_refused_busy_while_others_are_served(
    daemon_factory: Any,
) -> None:
    """A user of the read-only admin socket opens connections and sends requests in a loop:
    beyond 16 connections of one process, 64 of one user and its rate, view.sock answers
    `busy` naming the cap or the keys, while admin.sock and an environment are served."""
    d = daemon_factory({"limits": {"reader_requests_per_second": 1, "reader_burst": 5}})
    env = d.env("A", gpus=0, memory=GiB)
    view = f"ipc://{d.run_dir / 'view.sock'}"
    # One process: 16 connections, the 17th refused.
    held = [Raw(view) for _ in range(16)]
    procs: list[subprocess.Popen[str]] = []
    try:
        extra = Raw(view)
        reply = extra.call("status", 5)
        assert reply.get("error") == "busy" and reply["id"] == 5, reply
        assert f"process {os.getpid()} already has 16 connections" in reply["message"]
        assert extra.closed_by_peer()
        extra.close()
        # One user: 64 connections, with three more processes; the next refused over the
        # user's cap, whichever process it comes from.
        procs = [hold_connections(view, 16) for _ in range(3)]
        for p in procs:
            assert p.stdout is not None and p.stdout.readline() == "ok\n"
        late = Raw(view)
        reply = late.call("status")
        assert reply.get("error") == "busy", reply
        assert f"user {os.getuid()} already has 64 connections open to" in reply["message"]
        late.close()
        assert d.admin("status")["gpus"]
        assert ask(env)["env"] == "A"
    finally:
        end(procs)
        for raw in held:
            raw.close()
    # One user's requests: beyond its rate, `busy` naming the keys, on a connection that
    # stays; the others are served meanwhile.
    readers: list[Raw] = []

    def served() -> bool:
        # Once nodemgr saw the holders' connections close, a new one is let in.
        raw = Raw(view)
        if raw.call("status")["type"] == "error":
            raw.close()
            return False
        readers.append(raw)
        return True

    wait_for(served, 10)
    reader = readers[0]
    try:
        for i in range(1000):
            reply = reader.call("status", i)
            if reply["type"] == "error":
                break
        assert reply.get("error") == "busy", reply
        assert "(limits.reader_requests_per_second, limits.reader_burst)" in reply["message"]
        assert not reader.closed_by_peer(0.2)
        assert d.admin("status")["gpus"]
        assert ask(env)["env"] == "A"
        assert d.proc.poll() is None
    finally:
        reader.close()


# --- the loop in this process, stepped by hand -----------------------------------------


def step_until(srv: Server, predicate: Any, timeout: float = 5) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "the loop did not get there"
        srv.step()


def test_a_connection_that_never_finishes_its_handshake_is_closed(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(connections, "HANDSHAKE_TIMEOUT", 0.3)
    ep = server._admin(QuotaSet(env="slow", gpus=0, memory=GiB)).endpoint
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(ep.removeprefix("ipc://"))
        step_until(server, lambda: server.connections.conns == 1)
        step_until(server, lambda: server.connections.conns == 0)
        s.settimeout(5)
        assert s.recv(4096)[:1] == b"\xff"  # nodemgr's greeting, then the end
        assert s.recv(4096) == b""


def test_accept_out_of_descriptors_waits_instead_of_aborting(server: Server) -> None:
    """accept() meets EMFILE for real (this process's limit lowered for the moment): the
    loop stops polling its listeners, says so, and accepts the waiting connections once
    a descriptor is free."""
    ep = server._admin(QuotaSet(env="tight", gpus=0, memory=GiB)).endpoint
    p = hold_connections(ep, 8)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        assert p.stdout is not None and p.stdout.readline() == "ok\n"
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 2, hard))
        step_until(server, lambda: server.connections.paused_admin)
        assert server.connections.conns < 8
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    step_until(
        server, lambda: server.connections.conns == 8 and not server.connections.paused_admin
    )
    end([p])


def test_view_sock_waits_at_the_descriptor_budget_while_admin_sock_is_served(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no descriptor left for connections, a connection to view.sock waits in the
    backlog like an environment's (its listener not polled), while admin.sock's is
    accepted; the waiting one is accepted once there is room."""
    conns = server.connections
    monkeypatch.setattr(conns, "limit", lambda: 0)
    run = server.config.run_dir
    with (
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as reader,
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as admin,
    ):
        reader.connect(str(run / "view.sock"))
        step_until(server, lambda: conns.paused_envs)
        admin.connect(str(run / "admin.sock"))
        step_until(server, lambda: conns.conns == 1)
        accepted = [c for c in server.fds.values() if isinstance(c, Conn)]
        assert [c.readonly for c in accepted] == [False]
        monkeypatch.undo()
        step_until(server, lambda: conns.conns == 2 and not conns.paused_envs)


def test_the_documented_limits_are_the_code_s() -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text()
    for name, value in (
        ("MAX_CONNECTIONS_PER_CLIENT", str(connections.MAX_CONNECTIONS_PER_CLIENT)),
        ("MAX_CONNECTIONS_PER_ENV", str(connections.MAX_CONNECTIONS_PER_ENV)),
        ("MAX_REFUSING_PER_ENV", str(connections.MAX_REFUSING_PER_ENV)),
        ("HANDSHAKE_TIMEOUT", f"{connections.HANDSHAKE_TIMEOUT:g} s"),
        ("MAX_MESSAGE_BYTES", f"{protocol.MAX_MESSAGE_BYTES // KiB} KiB in all its frames"),
        ("MAX_FRAMES", f"{protocol.MAX_FRAMES} frames"),
    ):
        assert f"{value} (`{name}`)" in " ".join(text.split()).replace(" together", ""), name
    assert f"{protocol.MAX_TASK_REPLY_BYTES // MiB} MiB on a task endpoint" in text
    assert f"{protocol.MAX_ADMIN_REPLY_BYTES // MiB} MiB on the admin endpoint" in text
    assert f"less {connections.FD_RESERVE} for its own files" in text
