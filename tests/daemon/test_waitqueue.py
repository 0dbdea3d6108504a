"""The wait queue: order, position updates, timeouts, and no starvation (a real daemon)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import pytest

from gpushare.client import (
    Connection,
    NodeError,
    NoResources,
    QuotaExceeded,
    QuotaZero,
    Unreachable,
)
from tests.daemon.conftest import Waiting

GiB = 1 << 30


def grant(endpoint: str, gpus: int = 1) -> tuple[Connection, str]:
    conn = Connection(endpoint)
    return conn, str(conn.call("request", gpus=gpus)["task_id"])


def fill(node: Any) -> tuple[tuple[Connection, str], tuple[Connection, str]]:
    """Tasks of a and b, one on each GPU: the node is full. Their grants, in that order."""
    return grant(node.env("a")), grant(node.env("b"))


def queue_len(daemon: Any) -> int:
    return len(daemon.admin("queue")["waiting"])


def test_typed_errors_distinguish_zero_quota_beyond_quota_and_busy(node: Any) -> None:
    zero = node.env("zero", gpus=0)
    small = node.env("small", gpus=1)
    with Connection(zero) as c, pytest.raises(QuotaZero):
        c.call("request", gpus=1)
    with Connection(small) as c, pytest.raises(QuotaExceeded) as e:
        c.call("request", gpus=2)
    assert not e.value.retryable
    (hold_a, _), (hold_b, _) = fill(node)
    with Connection(small) as c, pytest.raises(NoResources) as busy:
        c.call("request", gpus=1)
    assert busy.value.retryable
    # A non-retryable refusal never waits, whatever the client asks.
    with Connection(small) as c, pytest.raises(QuotaExceeded):
        c.call("request", gpus=2, wait=30)
    assert queue_len(node) == 0
    hold_a.close()
    hold_b.close()


def test_waiters_are_served_in_order_and_told_their_position(node: Any, wait_for: Any) -> None:
    (a_conn, a_task), (b_conn, b_task) = fill(node)
    first = Waiting(node.env("c"), 60, gpus=1)
    wait_for(lambda: queue_len(node) == 1, 5)
    second = Waiting(node.env("d"), 60, gpus=1)
    wait_for(lambda: queue_len(node) == 2, 5)
    third = Waiting(node.env("e"), 60, gpus=1)
    wait_for(lambda: queue_len(node) == 3, 5)
    assert [w["env"] for w in node.admin("queue")["waiting"]] == ["c", "d", "e"]

    a_conn.call("done", task_id=a_task)
    got = first.finish()
    assert got["type"] == "grant" and got["env"] == "c"
    # The others moved up one place and were told.
    wait_for(lambda: second.updates[-1:] == [1] and third.updates[-1:] == [2], 5)
    assert first.updates == [1]
    assert second.updates == [2, 1]
    assert third.updates == [3, 2]
    assert second.is_alive() and third.is_alive()

    b_conn.call("done", task_id=b_task)
    assert second.finish()["env"] == "d"
    assert third.is_alive()
    wait_for(lambda: third.updates[-1:] == [1], 5)
    for c in (a_conn, b_conn, first.conn, second.conn):
        c.close()
    third.conn.close()


def test_a_wait_that_times_out_is_refused_as_retryable(node: Any) -> None:
    (hold_a, _), (hold_b, _) = fill(node)
    start = time.monotonic()
    w = Waiting(node.env("c"), 0.5, gpus=1)
    with pytest.raises(NoResources, match="willing to wait"):
        w.finish()
    assert 0.45 < time.monotonic() - start < 3
    assert queue_len(node) == 0
    for c in (hold_a, hold_b, w.conn):
        c.close()


def test_a_large_request_is_not_starved_by_a_stream_of_small_ones(
    daemon_factory: Any, wait_for: Any
) -> None:
    """Policy: a waiting request may be overtaken queue_max_bypass times; after that
    nothing overtakes it until it is served."""
    node = daemon_factory(
        {
            "scheduler": {"task_threshold": 1, "queue_max_bypass": 2},
            "gpus": {"simulated_count": 2},
        },
        heartbeat_timeout=600.0,
    )
    (a_conn, a_task), (b_conn, b_task) = fill(node)
    big = Waiting(node.env("big", gpus=2), 60, gpus=2)
    wait_for(lambda: queue_len(node) == 1, 5)

    a_conn.call("done", task_id=a_task)  # one GPU free: not enough for big
    small_ep = node.env("small")
    for overtaken in (1, 2):
        conn, task = grant(small_ep)  # overtakes big
        assert node.admin("queue")["waiting"][0]["bypassed"] == overtaken
        conn.call("done", task_id=task)
        conn.close()
    # Big has been overtaken as often as it may be: the free GPU waits for it.
    with Connection(small_ep) as c, pytest.raises(NoResources, match="may not be overtaken"):
        c.call("request", gpus=1)
    assert big.is_alive()

    b_conn.call("done", task_id=b_task)
    got = big.finish()
    assert sorted(g["index"] for g in got["gpus"]) == [0, 1]
    for c in (a_conn, b_conn, big.conn):
        c.close()


def c_waits_behind_a_and_b(
    node: Any, run_task: Any, wait_for: Any
) -> tuple[tuple[Connection, str], tuple[Connection, str], subprocess.Popen[str]]:
    """Tasks of a and b hold both GPUs; gpushare-run of c waits in the queue for one."""
    a, b = fill(node)
    p = run_task(node.env("c"), "true", env={"GPUSHARE_WAIT_TIMEOUT": "60"})
    wait_for(lambda: queue_len(node) == 1, 10)
    return a, b, p


def test_a_waiter_whose_client_dies_leaves_the_queue(
    node: Any, run_task: Any, wait_for: Any
) -> None:
    (hold_a, _), (hold_b, _), p = c_waits_behind_a_and_b(node, run_task, wait_for)
    p.kill()
    p.wait(30)
    wait_for(lambda: queue_len(node) == 0, 2)
    for c in (hold_a, hold_b):
        c.close()


def test_gpushare_run_waits_and_reports_its_position(
    node: Any, run_task: Any, wait_for: Any
) -> None:
    (a_conn, a_task), (hold_b, _), p = c_waits_behind_a_and_b(node, run_task, wait_for)
    a_conn.call("done", task_id=a_task)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    assert "waiting for 1 GPU: position 1 of 1" in err
    records = node.admin("history", env="c")["records"]
    assert [r["reason"] for r in records] == ["done"]
    for c in (a_conn, hold_b):
        c.close()


def test_a_request_sent_again_keeps_its_place_and_never_waits_twice(
    node: Any, run_task: Any, wait_for: Any
) -> None:
    (hold_a, _), (hold_b, _) = fill(node)
    ep = node.env("c")
    positions: list[int] = []

    def ask(conn: Connection, **fields: Any) -> None:
        # No final reply comes while the GPUs are held: only the `queued` answers.
        with pytest.raises(Unreachable):
            conn.call(
                "request",
                timeout=1.0,
                on_queued=lambda m: positions.append(int(m["position"])),
                gpus=1,
                wait=60,
                **fields,
            )

    first, again = Connection(ep), Connection(ep)
    ask(first)
    later = run_task(node.env("d"), "true")
    wait_for(lambda: queue_len(node) == 2, 10)
    # The same client sends it again on a new connection, as after losing the first; it
    # claims no wait at all, yet keeps the place it had.
    ask(again, waited=0.0)
    assert positions == [1, 1]
    assert [w["pid"] for w in node.admin("queue")["waiting"]] == [os.getpid(), later.pid]
    for c in (first, again, hold_a, hold_b):
        c.close()


WAITER = """
import sys, msgpack, zmq
s = zmq.Context().socket(zmq.DEALER)
s.connect(sys.argv[1])
for i in range(int(sys.argv[2])):
    s.send(msgpack.packb({"v": 1, "type": "request", "id": i + 1, "gpus": 1, "wait": 60}))
for i in range(int(sys.argv[2])):
    print(msgpack.unpackb(s.recv())["type"], flush=True)
sys.stdin.read()
"""


def test_waiting_requests_are_capped_per_client_and_per_environment(
    node: Any, wait_for: Any
) -> None:
    """Each waiting request holds a descriptor of its client process: a client may have 4
    waiting, an environment 64 (MAX_WAITING_PER_CLIENT, MAX_WAITING_PER_ENV); one more is
    refused with `busy`, and the queue, and nodemgr, go on."""
    (hold_a, _), (hold_b, _) = fill(node)
    ep = node.env("c")
    mine = [Waiting(ep, 60) for _ in range(4)]
    wait_for(lambda: queue_len(node) == 4, 5)
    with Connection(ep) as c, pytest.raises(NodeError, match="already has 4 requests waiting"):
        c.call("request", gpus=1, wait=60)
    others = [
        subprocess.Popen(
            [sys.executable, "-c", WAITER, ep, "4"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(15)
    ]
    try:
        for p in others:
            assert p.stdout is not None
            assert [p.stdout.readline().strip() for _ in range(4)] == ["queued"] * 4
        assert queue_len(node) == 64
        last = subprocess.run(
            [sys.executable, "-c", WAITER, ep, "1"],
            input="",
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert last.stdout.split() == ["error"]  # busy: 64 already wait
        assert queue_len(node) == 64
        assert node.admin("status")["gpus"]  # nodemgr serves on
    finally:
        for p in others:
            p.kill()
            p.communicate(timeout=30)
    # Deleting the environment answers its waiting requests (unknown_env): threads end.
    node.admin("quota_delete", env="c", force=True)
    for w in mine:
        w.join(10)
        w.conn.close()
    hold_a.close()
    hold_b.close()


def test_a_waiter_is_told_when_the_reason_it_waits_changes(node: Any, wait_for: Any) -> None:
    (a_conn, a_task), (b_conn, _) = fill(node)
    waiter = Waiting(node.env("c"), 60, gpus=1)
    wait_for(lambda: waiter.updates == [1], 5)
    assert "free GPU" in waiter.reasons[0] and "drained" not in waiter.reasons[0]
    node.admin("drain", gpu=0, drained=True)
    # The same place in the queue, another reason: a `queued` says so.
    wait_for(lambda: len(waiter.updates) == 2, 5)
    assert waiter.updates == [1, 1]
    assert "GPU 0 drained by an admin" in waiter.reasons[1]
    node.admin("drain", gpu=0, drained=False)
    wait_for(lambda: len(waiter.updates) == 3, 5)
    assert waiter.reasons[2] == waiter.reasons[0]
    a_conn.call("done", task_id=a_task)
    assert waiter.finish()["type"] == "grant"
    a_conn.close()
    b_conn.close()
