"""gpushare.messages: each message class is its own schema, the maps they write are the
ones the wire has always carried, and each endpoint has one handler per request class."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from gpushare import messages, protocol
from gpushare.messages import (
    AckReply,
    AdminRequest,
    Done,
    Drain,
    ErrorReply,
    GrantReply,
    Heartbeat,
    Message,
    Mode,
    QueuedReply,
    QuotaSet,
    QuotaShow,
    Request,
    Status,
    TaskRequest,
    Yield,
)
from gpushare.protocol import Err, ProtocolError
from nodemgr.endpoints import admin, task

REQUESTS: list[type[Message]] = [
    *messages.TASK_REQUESTS.values(),
    *messages.ADMIN_REQUESTS.values(),
]


def wire(msg_id: int, kind: str, **fields: Any) -> bytes:
    """A map as the client and nodemgr built them by hand before there were classes."""
    packed: bytes = msgpack.packb({"v": 1, "type": kind, "id": msg_id, **fields}, use_bin_type=True)
    return packed


def test_each_endpoint_has_one_handler_per_request_class() -> None:
    assert set(task.HANDLERS) == set(messages.TASK_REQUESTS.values())
    assert set(admin.HANDLERS) == set(messages.ADMIN_REQUESTS.values())


def test_tables_hold_each_endpoints_classes_by_type() -> None:
    for table, base in (
        (messages.TASK_REQUESTS, TaskRequest),
        (messages.ADMIN_REQUESTS, AdminRequest),
    ):
        for kind, cls in table.items():
            assert kind == cls.TYPE and issubclass(cls, base)
    assert not set(messages.TASK_REQUESTS) & set(messages.ADMIN_REQUESTS)


@pytest.mark.parametrize("cls", REQUESTS, ids=lambda c: c.TYPE)
def test_every_request_names_its_reply_and_validates_each_field(cls: Any) -> None:
    assert issubclass(cls.REPLY, Message) and cls.REPLY.TYPE
    for f in messages.fields_of(cls):
        with pytest.raises(ValueError):
            f.check(object())  # nothing on the wire is this


def test_a_field_without_a_validator_is_refused() -> None:
    import dataclasses

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Loose(Message):
        TYPE = "loose"
        x: int

    with pytest.raises(TypeError, match=r"Loose\.x"):
        messages.fields_of(Loose)


def test_requests_write_the_maps_clients_always_sent() -> None:
    # gpushare-run: every field but wrapper and waited, nil where unset; wrapper only when
    # true, waited only when the request is sent again.
    old = dict(gpus=1, memory=None, command="c", wait=None, devices=None)
    old |= dict(persistent=None, temporary=None, guard=None)
    req = Request(gpus=1, command="c")
    assert messages.encode(req, 1) == wire(1, "request", **old)
    again = Request(gpus=1, command="c", wait=5.0, wrapper=True, waited=2.5)
    assert messages.encode(again, 1) == wire(
        1, "request", **{**old, "wait": 5.0, "wrapper": True, "waited": 2.5}
    )
    assert messages.encode(Heartbeat(task_id="t"), 2) == wire(2, "heartbeat", task_id="t")
    assert messages.encode(Done(task_id="t", exit_code=0), 3) == wire(
        3, "done", task_id="t", exit_code=0, signal=None
    )
    assert messages.encode(Yield(task_id="t"), 4) == wire(4, "yield", task_id="t", iterations=None)
    assert messages.encode(QuotaShow(env=None), 5) == wire(5, "quota_show", env=None)
    assert messages.encode(QuotaSet(env="e", gpus=1, memory=2, force=False), 6) == wire(
        6, "quota_set", env="e", gpus=1, memory=2, force=False
    )
    # `nodemgr mode` and `drain`: a GPU and a change only when given.
    assert messages.encode(Mode(), 7) == wire(7, "mode")
    assert messages.encode(Drain(gpu=2, drained=True), 8) == wire(8, "drain", gpu=2, drained=True)
    assert messages.encode(Status(), 9) == wire(9, "status")


def test_replies_write_the_maps_nodemgr_always_sent() -> None:
    assert messages.encode(AckReply(task_id="t"), 1) == wire(1, "ack", task_id="t")
    ack = AckReply(task_id="t", warning="w", notices=["n"])
    assert messages.encode(ack, 1) == wire(1, "ack", task_id="t", warning="w", notices=["n"])
    assert messages.encode(ErrorReply.of(Err.RECLAIMED, "m", reason="idle"), 2) == wire(
        2, "error", error="reclaimed", message="m", retryable=False, reason="idle"
    )
    assert messages.encode(ErrorReply.of(Err.NO_RESOURCES, "m"), 3) == wire(
        3, "error", error="no_resources", message="m", retryable=True
    )


def test_a_request_reads_back_as_itself() -> None:
    req = Request(gpus=2, memory=1 << 30, devices=["0", "GPU-abcd"], wrapper=True, waited=1.0)
    msg = protocol.decode(messages.encode(req, 7))
    assert messages.parse(msg, messages.TASK_REQUESTS) == req
    assert req.estimate is None
    assert Request(gpus=1, persistent=5).estimate == (5, 0)
    assert Request(gpus=1, persistent=5, temporary=6).estimate == (5, 6)


def test_a_reply_reads_back_as_its_requests_reply_class() -> None:
    grant = GrantReply(
        task_id="t",
        env="e",
        gpus=[{"index": 0, "uuid": "GPU-x", "name": "n", "memory": 1}],
        memory_limit=1,
        ledger="/l",
        heartbeat_interval=1.0,
        heartbeat_timeout=5.0,
        simulated=True,
        sim_gpus="x",
        sim_state_dir="/s",
        timesliced=[0],
    )
    msg = protocol.decode(messages.encode(grant, 1))
    assert messages.read_reply(Request(gpus=1), msg) == grant
    # A nodemgr older than sim_state_dir and timesliced leaves them out.
    del msg["sim_state_dir"], msg["timesliced"]
    older = messages.read_reply(Request(gpus=1), msg)
    assert (older.sim_state_dir, tuple(older.timesliced)) == (None, ())
    with pytest.raises(ProtocolError, match="answered with 'queued'"):
        messages.read_reply(Request(gpus=1), {"type": "queued", "position": 1, "waiting": 1})
    with pytest.raises(ProtocolError, match="'memory_limit' must be an integer"):
        messages.read_reply(Request(gpus=1), {**msg, "memory_limit": "1"})
    queued = {"type": "queued", "position": 2, "waiting": 3}
    assert messages.INTERIM["queued"].from_wire(queued) == QueuedReply(position=2, waiting=3)


def test_only_requests_that_change_nothing_are_views() -> None:
    views = {
        kind
        for kind, cls in messages.ADMIN_REQUESTS.items()
        if cls.from_wire({"env": "e", "task_id": "t"}).is_view()
    }
    assert views == {"quota_show", "tasks", "queue", "status", "history", "mode", "drain"}
    assert not Mode(mode="shared").is_view() and Mode(gpu=1).is_view()
    assert not Drain(drained=False).is_view() and Drain(gpu=1).is_view()
