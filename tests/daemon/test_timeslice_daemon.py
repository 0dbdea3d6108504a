"""Time-sliced GPUs against a live nodemgr (docs/timeslicing.md): admission by regions,
learned shapes, turns and their order, a holder that dies or never yields, and mode
changes. A task's processes are played without the shim by child processes that claim a
slot in their environment's ledger and charge it through the real ledger.c, as the shim
does."""

from __future__ import annotations

import contextlib
import json
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from click.testing import CliRunner

from gpushare.client import Connection, NodeError
from nodemgr.cli import cli
from nodemgr.host.gpus import simulated_uuid
from nodemgr.host.ledger import TASK_TIMESLICED, Ledger
from tests.daemon.conftest import free_port, scrape
from tests.daemon.conftest import ledger_of as env_ledger

GiB = 1 << 30
MiB = 1 << 20

# A task played by a child process: it asks for one GPU (the request's fields in argv),
# claims a ledger slot for the task, then obeys one command per line on stdin and answers
# one JSON line per command. It is the task's client: killing it ends the task.
TASK = r"""
import json, mmap, os, sys
from nodemgr._ledger import ffi, lib
from gpushare.client import Connection

endpoint, fields = sys.argv[1], json.loads(sys.argv[2])
conn = Connection(endpoint, timeout=60)
# "join": another process of a running task (its grant as the first process printed it).
grant = fields["join"] if "join" in fields else conn.call("request", timeout=60, **fields)
tid = grant["task_id"]
fd = os.open(grant["ledger"], os.O_RDWR)
mem = mmap.mmap(fd, os.fstat(fd).st_size)
l = ffi.cast("struct gs_ledger *", ffi.from_buffer(mem))
slot = lib.gs_ledger_claim(l, fd, os.getpid(), tid.encode())
print(json.dumps({"grant": grant, "slot": slot}), flush=True)
for line in sys.stdin:
    cmd, *args = line.split()
    n = [int(a) for a in args]
    out = None
    if cmd == "charge":
        out = lib.gs_ledger_charge(l, slot, n[0], n[1])
    elif cmd == "uncharge":
        lib.gs_ledger_uncharge(l, slot, n[0], n[1])
    elif cmd == "boundary":
        out = lib.gs_ledger_boundary(l, slot, n[0])
    elif cmd == "note":
        lib.gs_ledger_note_temp(l, slot, n[0])
    elif cmd == "settle":
        lib.gs_ledger_settle(l, slot)
    elif cmd == "yield":
        extra = {"iterations": n[0]} if n else {}
        # nodemgr's `held` (it waits for the task's other processes) is a line of its own.
        def held(m):
            print(json.dumps({"held": m["type"] == "held"}), flush=True)
        out = conn.call("yield", task_id=tid, on_queued=held, **extra)["passed"]
    elif cmd == "done":
        conn.call("done", task_id=tid)
        print(json.dumps({"out": None}), flush=True)
        break
    print(json.dumps({"out": out}), flush=True)
"""


class Proc:
    """A task played by a child process (TASK)."""

    def __init__(self, endpoint: str, **fields: Any) -> None:
        self.p = subprocess.Popen(
            [sys.executable, "-c", TASK, endpoint, json.dumps({"gpus": 1, **fields})],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd="/",  # the installed nodemgr (with its compiled ledger), not the source tree
        )
        self._first: dict[str, Any] | None = None

    def started(self) -> dict[str, Any]:
        """The grant (blocks until the request is answered)."""
        if self._first is None:
            assert self.p.stdout is not None
            line = self.p.stdout.readline()
            assert line, "the task's process ended without a grant"
            self._first = json.loads(line)
            assert self._first["slot"] >= 0
        return dict(self._first["grant"])

    @property
    def task_id(self) -> str:
        return str(self.started()["task_id"])

    def do(self, *cmd: object) -> Any:
        self.send(*cmd)
        return self.answer()

    def send(self, *cmd: object) -> None:
        """Give a command without waiting for its answer (``answer`` reads it)."""
        self.started()
        assert self.p.stdin is not None
        self.p.stdin.write(" ".join(map(str, cmd)) + "\n")
        self.p.stdin.flush()

    def answer(self) -> Any:
        """The answer to the last command (a `held` line before it is counted, not taken)."""
        while True:
            line = self._line()
            if "held" not in line:
                return line["out"]

    def held(self) -> None:
        """Block until nodemgr answered the last command, a `yield`, with `held`."""
        line = self._line()
        assert line == {"held": True}, line

    def _line(self) -> dict[str, Any]:
        assert self.p.stdout is not None
        return dict(json.loads(self.p.stdout.readline()))

    def pending(self) -> bool:
        """Whether the answer to the last command has not come (yet)."""
        assert self.p.stdout is not None
        return not select.select([self.p.stdout], [], [], 0)[0]

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.p.send_signal(signal.SIGKILL)
        self.p.wait(10)

    def close(self) -> None:
        self.kill()
        for f in (self.p.stdin, self.p.stdout):
            if f is not None:
                f.close()


@pytest.fixture
def procs() -> Iterator[Any]:
    made: list[Proc] = []

    def start(endpoint: str, **fields: Any) -> Proc:
        p = Proc(endpoint, **fields)
        made.append(p)
        return p

    yield start
    for p in made:
        p.close()


def ts_daemon(
    factory: Any, count: int = 1, heartbeat_timeout: float = 60.0, **timeslice: Any
) -> Any:
    """A nodemgr whose GPU 0 is time-sliced; long heartbeat timeouts, as the test's tasks
    send none, and (unless the test says otherwise) a turn_timeout no slow machine reaches,
    so only the test moves the turn."""
    return factory(
        {
            "gpus": {"simulated_count": count},
            "scheduler": {"task_threshold": 16},
            "timeslice": {"gpus": [0], "turn_timeout": 600.0, **timeslice},
        },
        heartbeat_interval=1.0,
        heartbeat_timeout=heartbeat_timeout,
    )


def ledger_of(daemon: Any, env: str) -> contextlib.AbstractContextManager[Ledger]:
    """The environment's ledger, for a daemon of however many simulated GPUs."""
    return env_ledger(daemon, env, len(daemon.admin("status")["gpus"]))


def gated(daemon: Any, env: str, task_id: str) -> bool:
    with ledger_of(daemon, env) as ledger:
        entry = ledger.task_entry(task_id)
        assert entry is not None
        return entry.gated


def gpu0(daemon: Any) -> dict[str, Any]:
    return dict(daemon.admin("status")["gpus"][0])


def request(conn: Connection, **fields: Any) -> dict[str, Any]:
    return conn.call("request", **{"gpus": 1, **fields})


@contextlib.contextmanager
def two_tasks_of_a(d: Any) -> Iterator[tuple[Connection, str, str]]:
    """Two tasks of environment a (4 GiB), one GPU each, granted one after the other and
    connected while the block runs: the first one's connection, both task ids."""
    ep = d.env("a", memory=4 * GiB)
    with Connection(ep) as c1, Connection(ep) as c2:
        t1 = request(c1)["task_id"]
        t2 = request(c2)["task_id"]
        yield c1, t1, t2


def admitted(daemon: Any, n: int, **fields: Any) -> int:
    """How many of ``n`` environments (quota 8 GiB) get GPU 0 at once."""
    conns = []
    count = 0
    try:
        for i in range(n):
            conn = Connection(daemon.env(f"e{i}", memory=8 * GiB))
            conns.append(conn)
            try:
                request(conn, **fields)
                count += 1
            except NodeError as e:
                assert e.code == "no_resources", e.message
    finally:
        for c in conns:
            c.close()
    return count


# --- admission ------------------------------------------------------------------------


def test_timesliced_admits_more_tasks_with_estimates_than_shared(daemon_factory: Any) -> None:
    est = {"persistent": 2 * GiB, "temporary": 2 * GiB}
    shared = daemon_factory(
        {"gpus": {"simulated_count": 1}, "scheduler": {"task_threshold": 16}},
        heartbeat_timeout=60.0,
    )
    assert admitted(shared, 8, **est) == 2  # 16 GiB: two 8 GiB quotas
    assert gpu0(shared)["mode"] == "shared" and gpu0(shared)["regions"] is None
    ts = ts_daemon(daemon_factory)
    # Each 2 GiB + 100 MiB guard, plus one 2 GiB temporary region: 6 fit in 16 GiB.
    assert admitted(ts, 8, **est) == 6
    g = gpu0(ts)
    assert g["mode"] == "timesliced"
    assert g["regions"]["persistent"] == 6 * (2 * GiB + 100 * MiB)
    assert g["regions"]["temporary"] == 2 * GiB
    assert g["charged"] == 6 * (2 * GiB + 100 * MiB) + 2 * GiB
    slices = g["regions"]["slices"]
    assert [s["offset"] for s in slices] == [i * (2 * GiB + 100 * MiB) for i in range(6)]
    assert {s["shape"] for s in slices} == {"estimate"}


def test_grant_names_timesliced_gpus_and_estimates_above_the_quota_are_refused(
    daemon_factory: Any,
) -> None:
    d = ts_daemon(daemon_factory, count=2)
    with Connection(d.env("a", gpus=2, memory=4 * GiB)) as conn:
        grant = request(conn, gpus=2)
        assert grant["timesliced"] == [0]
        with pytest.raises(NodeError) as e:
            request(conn, persistent=3 * GiB, temporary=2 * GiB)
        assert e.value.code == "quota_exceeded"
        # Unknown fields are tolerated.
        with pytest.raises(NodeError) as e:
            conn.call("request", gpus=3, colour="red")
        assert e.value.code == "quota_exceeded"


def test_unknown_shape_is_charged_at_the_quota(daemon_factory: Any) -> None:
    d = ts_daemon(daemon_factory)
    assert admitted(d, 4) == 2  # as on a shared GPU
    g = gpu0(d)
    assert [s["shape"] for s in g["regions"]["slices"]] == ["unknown", "unknown"]
    assert g["charged"] == 16 * GiB and g["regions"]["temporary"] == 0


def test_a_learned_shape_frees_room_for_a_waiting_request(
    daemon_factory: Any, procs: Any, wait_for: Any
) -> None:
    d = ts_daemon(daemon_factory)
    a = procs(d.env("a", memory=6 * GiB))
    a.started()
    b = procs(d.env("b", memory=6 * GiB))
    b.started()
    assert gpu0(d)["charged"] == 12 * GiB
    c = procs(d.env("c", memory=6 * GiB), wait=60)
    wait_for(lambda: len(d.admin("queue")["waiting"]) == 1, 20)
    # a runs two iterations: 1 GiB persistent, 1 GiB temporary released in between.
    assert a.do("charge", 0, GiB) == 0
    assert a.do("boundary", 1) >= 1
    assert a.do("charge", 0, GiB) == 0
    a.do("note", 0)
    a.do("uncharge", 0, GiB)
    a.do("settle")
    a.do("boundary", 2)
    # a: 1 GiB + guard, b: 6 GiB, temporary 1 GiB; c's 6 GiB now fits.
    assert c.started()["gpus"][0]["index"] == 0
    g = gpu0(d)
    shapes = {s["task_id"]: s for s in g["regions"]["slices"]}
    assert shapes[a.task_id]["shape"] == "learned"
    assert (shapes[a.task_id]["persistent"], shapes[a.task_id]["temporary"]) == (GiB, GiB)
    [ta] = [t for t in d.tasks() if t["task_id"] == a.task_id]
    assert ta["iterations"] == 2
    assert ta["regions"] == [
        {"gpu": 0, "persistent": GiB, "temporary": 0, "temporary_peak": GiB, "settled": GiB}
    ]


# --- turns ------------------------------------------------------------------------------


def test_three_tasks_take_turns_by_yield_in_the_order_status_shows(daemon_factory: Any) -> None:
    d = ts_daemon(daemon_factory)
    ep = d.env("a", memory=4 * GiB)
    conns = [Connection(ep) for _ in range(3)]
    try:
        ids = [request(c)["task_id"] for c in conns]
        by_id = dict(zip(ids, conns, strict=True))
        turn = gpu0(d)["turn"]
        assert turn["holder"] == ids[0] and turn["order"] == ids
        assert turn["quantum"] == 4
        assert [gated(d, "a", t) for t in ids] == [False, True, True]
        tasks = {t["task_id"]: t for t in d.tasks()}
        assert [tasks[t]["gated"] for t in ids] == [False, True, True]
        with ledger_of(d, "a") as ledger:
            entry = ledger.task_entry(ids[0])
            assert entry is not None and entry.turn_until == 4
            assert entry.flags & TASK_TIMESLICED
        holders = []
        for _ in range(6):
            before = gpu0(d)["turn"]
            holder, expected = before["holder"], before["order"][1]
            reply = by_id[holder].call("yield", task_id=holder)
            assert (reply["type"], reply["task_id"], reply["passed"]) == ("turn", holder, True)
            # The reply leaves after the next holder was let go.
            assert not gated(d, "a", expected)
            assert gated(d, "a", holder)
            after = gpu0(d)["turn"]
            assert after["holder"] == expected and after["order"][0] == expected
            assert sorted(after["order"]) == sorted(ids)
            holders.append(expected)
        # The first turns go in order of arrival (none of the others had held the GPU);
        # after that, to whoever has held it least, as `order` said each time.
        assert holders[:2] == [ids[1], ids[2]]
        turn = gpu0(d)["turn"]
        assert turn["switches"] == 6 and turn["last_switch_ms"] is not None
    finally:
        for c in conns:
            c.close()


def test_a_single_task_is_never_gated_and_keeps_the_turn_on_yield(daemon_factory: Any) -> None:
    d = ts_daemon(daemon_factory)
    with Connection(d.env("a", memory=4 * GiB)) as conn:
        tid = request(conn)["task_id"]
        assert not gated(d, "a", tid)
        assert gpu0(d)["turn"] is None
        reply = conn.call("yield", task_id=tid)
        assert reply["passed"] is False
        assert not gated(d, "a", tid)
        [task] = d.tasks()
        assert task["gated"] is False and task["paused"] is False
        with pytest.raises(NodeError) as e:
            conn.call("yield", task_id="0123456789abcdef")
        assert e.value.code == "unknown_task"


def test_a_killed_holder_hands_the_turn_on_at_once(
    daemon_factory: Any, procs: Any, wait_for: Any
) -> None:
    d = ts_daemon(daemon_factory)
    ep = d.env("a", memory=4 * GiB)
    first = procs(ep)
    first.started()
    second = procs(ep)
    second.started()
    assert gpu0(d)["turn"]["holder"] == first.task_id
    assert gated(d, "a", second.task_id)
    first.kill()
    # heartbeat_timeout is 60 s: only the client's exit can have ended the turn.
    took = wait_for(lambda: not gated(d, "a", second.task_id), 20)
    assert took < 30
    assert [t["task_id"] for t in d.tasks()] == [second.task_id]
    assert gpu0(d)["turn"] is None


def test_turn_timeout_passes_the_turn_of_a_task_that_never_yields(
    daemon_factory: Any, wait_for: Any
) -> None:
    d = ts_daemon(daemon_factory, turn_timeout=0.5)
    with two_tasks_of_a(d) as (_, t1, t2):
        assert gpu0(d)["turn"]["holder"] == t1
        wait_for(lambda: gpu0(d)["turn"]["holder"] == t2, 20, 0.05)
        assert not gated(d, "a", t2)
        # And back: neither yields.
        wait_for(lambda: gpu0(d)["turn"]["holder"] == t1, 20, 0.05)
        assert gpu0(d)["turn"]["switches"] >= 2


def test_a_holder_that_steps_on_past_its_turn_loses_it_after_turn_timeout(
    daemon_factory: Any, procs: Any, wait_for: Any
) -> None:
    """A task that reports a boundary every step but never yields (its plugin ignores the
    end of its turn) is never stuck; past the end of its turn by turn_timeout, it is gated
    all the same and the other task gets the turn, again at each of its turns. The other
    task reports no boundaries: it loses the turn at its yield or, should this test be
    slow to send it, when its turn is turn_timeout old; either way a gets it back.

    a steps every 10 ms; only a stall of this test of turn_timeout between two of its steps
    could cut a as stuck instead (before the end of its turn: the test fails), so
    turn_timeout is 10 s, which no loaded machine stalls for, and the heartbeat timeout
    (the tasks send none) far beyond the two rounds."""
    turn_timeout = 10.0
    d = ts_daemon(daemon_factory, heartbeat_timeout=600.0, turn_timeout=turn_timeout)
    ep = d.env("a", memory=4 * GiB)
    a = procs(ep)
    a.started()
    b = procs(ep)
    b.started()
    i = 0
    for _ in range(2):
        wait_for(lambda: gpu0(d)["turn"]["holder"] == a.task_id, 30)
        switches = gpu0(d)["turn"]["switches"]
        with ledger_of(d, "a") as ledger:
            entry = ledger.task_entry(a.task_id)
            assert entry is not None and entry.turn_until == i + 4
        # a steps on past its turn_until until it is gated, far more often than
        # turn_timeout: its count never stops moving.
        give_up = time.monotonic() + 6 * turn_timeout  # within heartbeat_timeout
        while not gated(d, "a", a.task_id):
            assert time.monotonic() < give_up, f"the holder kept the turn to boundary {i}"
            i += 1
            a.do("boundary", i)
            time.sleep(0.01)
        assert i > entry.turn_until  # gated past the end of its turn, not within it
        assert gpu0(d)["turn"]["switches"] > switches  # the turn went to b
        b.do("yield")


def two_processes_and_another(d: Any, procs: Any) -> tuple[Any, Any, Any]:
    """Task a of two processes (the second joins the first's grant), then task b, on GPU 0:
    a holds the turn and b waits."""
    ep = d.env("a", memory=4 * GiB)
    a1 = procs(ep)
    a2 = procs(ep, join=a1.started())
    a2.started()
    b = procs(ep)
    b.started()
    assert gpu0(d)["turn"]["holder"] == a1.task_id
    return a1, a2, b


def first_process_held_at_the_end_of_the_turn(d: Any, procs: Any) -> tuple[Any, Any, Any]:
    """Task a's two processes and task b (two_processes_and_another); a1 reached the end of
    a's turn (4 boundaries) and yields, held, while a2, past its first boundary, steps."""
    a1, a2, b = two_processes_and_another(d, procs)
    for i in (1, 2, 3, 4):
        a1.do("boundary", i)
    a2.do("boundary", 1)
    a1.send("yield", 4)
    a1.held()
    return a1, a2, b


def test_the_turn_ends_when_every_process_of_the_task_reached_it(
    daemon_factory: Any, procs: Any, wait_for: Any
) -> None:
    """A task of two processes (torchrun's, say): the first to reach the end of the turn
    waits for the other, whose step is not over; a stale yield changes nothing."""
    d = ts_daemon(daemon_factory)
    a1, a2, b = first_process_held_at_the_end_of_the_turn(d, procs)
    a = a1.task_id
    # Held: a2 is in its second step. Both of a's processes run on; b waits.
    assert gpu0(d)["turn"]["holder"] == a
    assert a1.pending()
    assert not gated(d, "a", a) and gated(d, "a", b.task_id)
    # a2's boundaries before the end of the turn: its yield there is early, and answered so.
    for i in (2, 3):
        a2.do("boundary", i)
    assert a2.do("yield", 3) is False
    assert a1.pending() and not gated(d, "a", a)
    a2.do("boundary", 4)
    assert a2.do("yield", 4) is True
    assert a1.answer() is True
    assert gated(d, "a", a) and not gated(d, "a", b.task_id)
    assert gpu0(d)["turn"]["holder"] == b.task_id
    # The turn comes back to a (turn_until 8); a yield of its last turn, late, is ignored.
    assert b.do("yield") is True
    assert gpu0(d)["turn"]["holder"] == a
    with ledger_of(d, "a") as ledger:
        entry = ledger.task_entry(a)
        assert entry is not None and entry.turn_until == 8
        assert ledger.task_regions(a).min_iterations == 4
    assert a1.do("yield", 4) is False
    assert gpu0(d)["turn"]["holder"] == a and not gated(d, "a", a)


def test_a_yield_after_the_barrier_passed_the_turn_is_answered_as_passed(
    daemon_factory: Any, procs: Any
) -> None:
    """Two processes of a task reach the end of the turn; the one that yields second may be
    heard after the barrier has passed the turn already (a sweep between its boundary and
    its yield): it is answered as the first was, passed, not as a stale yield."""
    d = ts_daemon(daemon_factory)
    a1, a2, b = first_process_held_at_the_end_of_the_turn(d, procs)
    a = a1.task_id
    for i in (2, 3, 4):
        a2.do("boundary", i)
    # The barrier is met: the sweep passes the turn and answers a1's held yield.
    assert a1.answer() is True
    assert gpu0(d)["turn"]["holder"] == b.task_id and gated(d, "a", a)
    assert a2.do("yield", 4) is True
    assert a2.do("yield", 3) is False  # an older boundary's yield is stale still
    assert gpu0(d)["turn"]["holder"] == b.task_id


def test_the_end_of_a_turn_does_not_wait_for_a_process_that_stopped_stepping(
    daemon_factory: Any, procs: Any
) -> None:
    """A process of the task that reported a boundary once, long ago (a parent that ran a
    few steps, then waits for its children), is not waited for: the yield of the process
    that steps passes the turn at once, never held."""
    # A quantum a1 does not reach while it waits: the turn is not over (and overrun) yet.
    d = ts_daemon(daemon_factory, turn_timeout=2.0, quantum=100)
    a1, a2, b = two_processes_and_another(d, procs)
    a = a1.task_id
    a2.do("boundary", 1)  # and no more
    # a1 steps on, often enough that its turn is never taken for want of progress, until
    # a2's last boundary is older than turn_timeout.
    stepped_at = time.monotonic()
    i = 0
    while time.monotonic() - stepped_at < 2.5 or i < 3:
        i += 1
        a1.do("boundary", i)
        time.sleep(0.2)
    assert gpu0(d)["turn"]["holder"] == a
    with ledger_of(d, "a") as ledger:
        entry = ledger.task_entry(a)
        assert entry is not None
        until = entry.turn_until
    while i < until:
        i += 1
        a1.do("boundary", i)
    a1.send("yield", i)
    assert a1._line() == {"out": True}  # the turn itself, no `held` before it
    assert gated(d, "a", a) and not gated(d, "a", b.task_id)


def test_a_held_yield_is_answered_when_the_process_it_waits_for_dies(
    daemon_factory: Any, procs: Any, wait_for: Any
) -> None:
    d = ts_daemon(daemon_factory)
    a1, a2, b = first_process_held_at_the_end_of_the_turn(d, procs)
    assert gated(d, "a", b.task_id) and a1.pending()
    a2.kill()
    # Its slot reaped, every process left of the task is at the end of the turn.
    wait_for(lambda: not gated(d, "a", b.task_id), 30)
    assert a1.answer() is True
    assert gated(d, "a", a1.task_id)


def test_a_new_process_s_turn_counts_from_its_own_boundaries(
    daemon_factory: Any, procs: Any, wait_for: Any
) -> None:
    """`sh -c 'python pretrain.py; python finetune.py'`: pretrain reports many boundaries
    and exits; finetune starts at 0, and its turn ends a quantum after its own count, not
    after pretrain's."""
    d = ts_daemon(daemon_factory)
    ep = d.env("a", memory=4 * GiB)
    a = procs(ep)  # the task's client: it reports no boundaries
    pretrain = procs(ep, join=a.started())
    pretrain.started()
    b = procs(ep)
    b.started()
    assert gpu0(d)["turn"]["holder"] == a.task_id
    for i in range(1, 21):
        pretrain.do("boundary", i)
    assert pretrain.do("yield", 20) is True
    pretrain.kill()
    with ledger_of(d, "a") as ledger:
        wait_for(lambda: ledger.task_regions(a.task_id).processes == 1, 20)
        finetune = procs(ep, join=a.started())
        finetune.started()
        assert b.do("yield") is True
        assert gpu0(d)["turn"]["holder"] == a.task_id
        entry = ledger.task_entry(a.task_id)
        assert entry is not None and entry.iterations == 20  # the entry's all-time count
        assert entry.turn_until == 4
    for i in (1, 2, 3, 4):
        finetune.do("boundary", i)
    assert finetune.do("yield", 4) is True
    assert gpu0(d)["turn"]["holder"] == b.task_id


def test_a_restart_keeps_the_turn_with_the_task_that_held_it(daemon_factory: Any) -> None:
    d = ts_daemon(daemon_factory)
    with two_tasks_of_a(d) as (c1, t1, t2):
        assert c1.call("yield", task_id=t1)["passed"] is True
        assert gpu0(d)["turn"]["holder"] == t2
        d.kill()
        d.start()
        assert gpu0(d)["turn"]["holder"] == t2
        assert gated(d, "a", t1) and not gated(d, "a", t2)
        with ledger_of(d, "a") as ledger:
            entry = ledger.task_entry(t2)
            assert entry is not None and entry.turn_until == 4


def test_mode_switch_through_the_cli_ungates_at_once_and_is_kept(daemon_factory: Any) -> None:
    d = ts_daemon(daemon_factory, count=2)
    ep = d.env("a", memory=4 * GiB)

    def mode(*args: str) -> Any:
        r = CliRunner().invoke(cli, ["mode", *args, "--config", str(d.config)])
        assert r.exit_code == 0, r.output
        return r

    rows = json.loads(mode("--json").output)
    assert [(g["index"], g["mode"], g["source"]) for g in rows] == [
        (0, "timesliced", "config"),
        (1, "shared", "default"),
    ]
    with Connection(ep) as c1, Connection(ep) as c2:
        request(c1)
        t2 = request(c2)["task_id"]
        assert gated(d, "a", t2)
        out = mode("0", "shared").output
        assert out.splitlines()[0].split() == ["GPU", "UUID", "MODE", "SOURCE"]
        assert out.splitlines()[1].split()[2:] == ["shared", "admin"]
        assert not gated(d, "a", t2)
        assert gpu0(d)["turn"] is None and gpu0(d)["regions"] is None
        assert gpu0(d)["charged"] == 4 * GiB
        # Back to time-sliced: turns start at once with the tasks there.
        mode(simulated_uuid(0), "timesliced")
        assert gated(d, "a", t2)
        assert gpu0(d)["turn"]["order"][1] == t2
        mode("0", "shared")
    d.kill()
    d.start()
    assert json.loads(mode("0", "--json").output) == [
        {
            "index": 0,
            "uuid": simulated_uuid(0),
            "mode": "shared",
            "source": "admin",
            "charged": 4 * GiB,  # the restored tasks' environment, its quota
            "capacity": 16 * GiB,
        }
    ]
    r = CliRunner().invoke(cli, ["mode", "7", "shared", "--config", str(d.config)])
    assert r.exit_code == 1 and "no GPU 7" in r.output
    r = CliRunner().invoke(cli, ["mode", "0", "fast", "--config", str(d.config)])
    assert r.exit_code == 2


def test_a_restart_without_time_slicing_ungates_what_the_last_run_gated(
    daemon_factory: Any,
) -> None:
    """nodemgr dies with a task gated in its ledger and comes back with GPU 0 no longer
    time-sliced in its config: the task runs on at once, not after some later event."""
    d = ts_daemon(daemon_factory)
    ep = d.env("a", memory=4 * GiB)
    with Connection(ep) as c1, Connection(ep) as c2:
        request(c1)
        t2 = request(c2)["task_id"]
        assert gated(d, "a", t2)
        d.kill()
        text = d.config.read_text()
        assert "gpus = [0]" in text
        d.config.write_text(text.replace("gpus = [0]", "gpus = []"))
        d.start()
        assert gpu0(d)["mode"] == "shared"
        assert not gated(d, "a", t2)


def test_a_restart_keeps_a_running_task_s_estimate_and_guard(daemon_factory: Any) -> None:
    """What a request stated of its shape still counts after nodemgr restarts, so the
    restored task is not charged its whole quota until its shape is learned again."""
    d = ts_daemon(daemon_factory)
    with Connection(d.env("a", memory=8 * GiB)) as c:
        request(c, persistent=GiB, temporary=2 * GiB, guard=64 * MiB)

        def slice_() -> tuple[Any, ...]:
            [s] = gpu0(d)["regions"]["slices"]
            return (s["shape"], s["persistent"], s["temporary"], s["guard"])

        before = slice_()
        assert before == ("estimate", GiB, 2 * GiB, 64 * MiB)
        d.kill()
        d.start()
        assert slice_() == before
        assert gpu0(d)["charged"] == GiB + 64 * MiB + 2 * GiB


def test_switching_an_overcommitted_gpu_to_shared_warns(daemon_factory: Any) -> None:
    """Three 8 GiB environments fit a 16 GiB time-sliced GPU by their estimates; shared,
    they are charged their quotas, 24 GiB: the switch is made, with a warning."""
    d = ts_daemon(daemon_factory)
    conns = [Connection(d.env(f"e{i}", memory=8 * GiB)) for i in range(3)]
    try:
        for c in conns:
            request(c, persistent=GiB, temporary=2 * GiB)
        args = ["mode", "0", "shared", "--config", str(d.config)]
        r = CliRunner().invoke(cli, args)
        assert r.exit_code == 0, r.output
        assert "warning: GPU 0 is charged 24GiB, more than its 16GiB" in r.output
        assert "time-slice it again, or end some tasks with nodemgr reclaim" in r.output
        assert gpu0(d)["mode"] == "shared"
        [row] = d.admin("mode", gpu=0)["gpus"]
        assert (row["charged"], row["capacity"]) == (24 * GiB, 16 * GiB)
        r = CliRunner().invoke(cli, ["mode", "0", "timesliced", "--config", str(d.config)])
        assert r.exit_code == 0 and "warning" not in r.output
    finally:
        for c in conns:
            c.close()


def test_top_shows_regions_and_the_turn_order(daemon_factory: Any) -> None:
    d = ts_daemon(daemon_factory)
    ep = d.env("a", memory=4 * GiB)
    with Connection(ep) as c1, Connection(ep) as c2:
        t1 = request(c1, persistent=GiB, temporary=GiB)["task_id"]
        t2 = request(c2)["task_id"]
        r = CliRunner().invoke(cli, ["top", "--iterations", "1", "--config", str(d.config)])
        assert r.exit_code == 0, r.output
        lines = r.output.splitlines()
        [head] = [i for i, line in enumerate(lines) if line.startswith("GPU 0 time-sliced")]
        assert lines[head + 1].split()[:2] == ["TASK", "TURN"]
        assert lines[head + 2].split()[:2] == [t1, "holder"]
        assert lines[head + 3].split()[:2] == [t2, "waiting"]
        assert "estimate" in lines[head + 2] and "unknown" in lines[head + 3]
        r = CliRunner().invoke(cli, ["tasks", "--config", str(d.config)])
        assert "gated" in r.output


def test_metrics_show_modes_regions_gated_tasks_and_switches(
    daemon_factory: Any, wait_for: Any
) -> None:
    port = free_port()
    d = daemon_factory(
        {
            "gpus": {"simulated_count": 2},
            "timeslice": {"gpus": [0]},
            "metrics": {"port": port},
        },
        heartbeat_timeout=60.0,
    )

    ep = d.env("a", memory=4 * GiB)
    g0 = f'gpu="0",uuid="{simulated_uuid(0)}"'
    g1 = f'gpu="1",uuid="{simulated_uuid(1)}"'
    with Connection(ep) as c1, Connection(ep) as c2:
        t1 = request(c1, persistent=GiB, temporary=GiB)["task_id"]
        request(c2, persistent=GiB, temporary=2 * GiB)
        assert c1.call("yield", task_id=t1)["passed"] is True
        wait_for(lambda: scrape(port).get(f"gpushare_gpu_gated_tasks{{{g0}}}") == 1, 10, 0.2)
        m = scrape(port)
        assert m[f"gpushare_gpu_timesliced{{{g0}}}"] == 1
        assert m[f"gpushare_gpu_timesliced{{{g1}}}"] == 0
        assert m[f"gpushare_gpu_persistent_region_bytes{{{g0}}}"] == 2 * (GiB + 100 * MiB)
        assert m[f"gpushare_gpu_temporary_region_bytes{{{g0}}}"] == 2 * GiB
        assert m[f"gpushare_gpu_temporary_used_bytes{{{g0}}}"] == 0
        assert m['gpushare_turn_switches_total{gpu="0"}'] == 1
        assert m['gpushare_turn_switch_seconds_count{gpu="0"}'] == 1


def test_cli_mode_without_nodemgr_exits_69(tmp_path: Any) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[node]\nrun_dir = "{tmp_path}"\n')
    r = CliRunner().invoke(cli, ["mode", "--config", str(cfg)])
    assert r.exit_code == 69


def test_pausing_the_holder_hands_its_turn_on(daemon_factory: Any) -> None:
    d = ts_daemon(daemon_factory)
    with two_tasks_of_a(d) as (_, t1, t2):
        assert gpu0(d)["turn"]["holder"] == t1 and gated(d, "a", t2)
        d.admin("pause", task_id=t1)
        assert gpu0(d)["turn"]["holder"] == t2 and not gated(d, "a", t2)
        d.admin("resume", task_id=t1)
        assert gpu0(d)["turn"]["holder"] == t2 and gated(d, "a", t1)
