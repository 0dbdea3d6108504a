"""A request restricted to some GPUs (request.devices, the user's CUDA_VISIBLE_DEVICES):
its wire form, how names resolve to GPUs, and a real daemon granting, refusing and
queueing within the restriction."""

from __future__ import annotations

import time
from typing import Any

import pytest

from gpushare.client import Connection, NodeError, NoResources, QuotaExceeded
from gpushare.messages import Request
from gpushare.protocol import Err, ProtocolError
from nodemgr.host.gpus import Gpu, resolve, simulated_uuid
from tests.daemon.conftest import Waiting

GiB = 1 << 30


# --- the wire form (gpushare.protocol) ----------------------------------------------------


def validated(devices: Any) -> Any:
    msg = {"v": 1, "type": "request", "id": 0, "gpus": 1, "devices": devices}
    return Request.from_wire(msg).devices


def test_devices_is_optional_and_nil_means_any() -> None:
    body = Request.from_wire({"v": 1, "type": "request", "id": 0, "gpus": 1})
    assert body.devices is None
    assert validated(None) is None


@pytest.mark.parametrize(
    "devices",
    [
        ["0"],
        ["3", "1"],
        ["007"],
        [simulated_uuid(2)],
        [simulated_uuid(2).upper()],
        ["GPU-5349"],
        [str(i) for i in range(64)],
    ],
)
def test_indices_uuids_and_uuid_prefixes_are_accepted(devices: list[str]) -> None:
    assert validated(devices) == devices


@pytest.mark.parametrize(
    "devices",
    [
        [],  # empty: send nil for no restriction
        [str(i) for i in range(65)],  # longer than any request's GPU count
        "0",  # not a list
        "0,1",
        0,
        [0],  # entries are strings
        [b"0"],
        [None],
        [""],
        ["-1"],
        [" 0"],
        ["0 "],
        ["0\n"],
        ["1,2"],
        ["1234567890"],  # more than 9 digits
        ["²"],  # a digit, but not an ASCII one
        ["GPU-"],  # a prefix shorter than GPU- and 4 characters
        ["GPU-534"],
        ["gpu-5349d000"],
        ["GPU-xyzw"],
        ["MIG-5349d000-0000-4000-8000-000000000000"],
        ["GPU-" + "a" * 61],  # longer than 64 characters
        ["x" * 4096],
    ],
)
def test_malformed_devices_are_bad_requests(devices: Any) -> None:
    with pytest.raises(ProtocolError) as e:
        validated(devices)
    assert e.value.code == Err.BAD_REQUEST
    assert "'devices'" in e.value.message
    assert "\n" not in e.value.message and len(e.value.message) < 400


# --- names to GPUs (nodemgr.host.gpus.resolve) ----------------------------------------------


NODE = [
    Gpu(0, "GPU-8e2c41f0-1111-2222-3333-444444444444", "A", 16 * GiB),
    Gpu(1, "GPU-8e2c9a7b-5555-6666-7777-888888888888", "A", 16 * GiB),
    Gpu(2, "GPU-d00dfeed-9999-aaaa-bbbb-cccccccccccc", "A", 16 * GiB),
]


def test_names_resolve_to_node_indices() -> None:
    assert resolve(["2", "0"], NODE) == frozenset({0, 2})
    assert resolve(["01"], NODE) == frozenset({1})
    assert resolve([NODE[1].uuid], NODE) == frozenset({1})
    assert resolve([NODE[1].uuid.upper()], NODE) == frozenset({1})
    assert resolve(["GPU-d00d", "GPU-8e2c9"], NODE) == frozenset({1, 2})
    assert resolve(["GPU-D00DFEED"], NODE) == frozenset({2})


def test_a_name_of_no_gpu_is_named_with_the_way_to_list_gpus() -> None:
    for name in ("3", "99", "GPU-ffff", NODE[0].uuid + "0"):
        with pytest.raises(ValueError) as e:
            resolve(["0", name], NODE)
        assert repr(name) in str(e.value)
        assert "names no GPU" in str(e.value) and "GPUs 0-2" in str(e.value)
        assert "nodemgr status" in str(e.value)
    with pytest.raises(ValueError, match="it has GPU 0;"):
        resolve(["1"], NODE[:1])


def test_an_ambiguous_prefix_names_the_gpus_it_starts() -> None:
    with pytest.raises(ValueError) as e:
        resolve(["GPU-8e2c"], NODE)
    assert "'GPU-8e2c'" in str(e.value) and "GPUs 0, 1" in str(e.value)
    assert "nodemgr status" in str(e.value)


def test_a_gpu_named_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="names GPU 1 '1' twice"):
        resolve(["1", "2", "1"], NODE)
    with pytest.raises(ValueError, match="names GPU 2 '2' and 'GPU-d00d'"):
        resolve(["2", "GPU-d00d"], NODE)


# --- a real daemon -----------------------------------------------------------------


def request(endpoint: str, **fields: Any) -> dict[str, Any]:
    with Connection(endpoint) as c:
        return c.call("request", **fields)


def indices(grant: dict[str, Any]) -> list[int]:
    return [g["index"] for g in grant["gpus"]]


def test_a_restricted_grant_lands_on_an_allowed_gpu(daemon: Any) -> None:
    ep = daemon.env("dev", gpus=2, memory=GiB)
    uuids = [g["uuid"] for g in daemon.admin("status")["gpus"]]
    assert len(uuids) == 4
    # Unrestricted, the first of four idle GPUs would be GPU 0.
    for devices, expected in [
        (["2"], [2]),
        ([uuids[3]], [3]),
        ([uuids[1].upper()], [1]),
        (["3", "1"], [1, 3]),
    ]:
        with Connection(ep) as c:
            got = c.call("request", gpus=len(expected), devices=devices)
            assert sorted(indices(got)) == expected, devices
            c.call("done", task_id=got["task_id"])
    # nil is no restriction.
    with Connection(ep) as c:
        got = c.call("request", gpus=1, devices=None)
        assert indices(got) == [0]
        c.call("done", task_id=got["task_id"])


def test_a_device_the_node_lacks_is_refused_naming_it(daemon: Any) -> None:
    ep = daemon.env("dev", gpus=2, memory=GiB)
    zero = daemon.admin("status")["gpus"][0]["uuid"]
    for devices, says in [
        (["7"], "'7' names no GPU of this node (it has GPUs 0-3"),
        (["1", "GPU-ffffffff"], "'GPU-ffffffff' names no GPU"),
        # The simulated GPUs' UUIDs differ only at the end.
        (["GPU-5349d000"], "'GPU-5349d000' is the start of the UUIDs of GPUs 0, 1, 2, 3"),
        (["0", zero], f"names GPU 0 '0' and {zero!r}"),
    ]:
        with pytest.raises(NodeError) as e:
            request(ep, gpus=1, devices=devices, wait=30)
        assert e.value.code == Err.BAD_REQUEST and not e.value.retryable
        assert says in e.value.message
        assert "nodemgr status" in e.value.message or "name each GPU once" in e.value.message
    with pytest.raises(NodeError) as e:
        request(ep, gpus=1, devices=[])
    assert e.value.code == Err.BAD_REQUEST and "'devices'" in e.value.message
    assert daemon.tasks() == [] and daemon.admin("queue")["waiting"] == []


def test_a_restriction_that_can_never_be_met_is_quota_exceeded(daemon: Any) -> None:
    ep = daemon.env("dev", gpus=2, memory=GiB)
    # Even with a wait: waiting cannot help.
    with pytest.raises(QuotaExceeded) as e:
        request(ep, gpus=2, devices=["1"], wait=30)
    assert not e.value.retryable
    assert "CUDA_VISIBLE_DEVICES allows GPU 1, of which 1 can hold" in e.value.message
    # The quota comes first: asking beyond it says so, restricted or not.
    with pytest.raises(QuotaExceeded, match="quota is 2"):
        request(ep, gpus=3, devices=["0", "1", "2"])
    assert daemon.admin("queue")["waiting"] == []


def test_a_busy_allowed_gpu_is_retryable_and_a_waiter_gets_only_it(
    node: Any, wait_for: Any
) -> None:
    with Connection(node.env("a")) as hold:
        held = hold.call("request", gpus=1, devices=["0"])
        assert indices(held) == [0]
        ep = node.env("c")
        # GPU 1 is free, but the request allows only GPU 0.
        with pytest.raises(NoResources) as e:
            request(ep, gpus=1, devices=["0"])
        assert e.value.retryable and "CUDA_VISIBLE_DEVICES allows (GPU 0)" in e.value.message

        w = Waiting(ep, 60, devices=["0"])
        wait_for(lambda: len(node.admin("queue")["waiting"]) == 1, 5)
        (entry,) = node.admin("queue")["waiting"]
        assert entry["env"] == "c" and entry["devices"] == [0]
        # Another task starts on GPU 1 and ends: the queue is tried again, and the waiter
        # must not take GPU 1, which is free again.
        other = node.env("b")
        with Connection(other) as c:
            got = c.call("request", gpus=1)
            assert indices(got) == [1]
            c.call("done", task_id=got["task_id"])
        time.sleep(0.3)
        assert w.is_alive() and len(node.admin("queue")["waiting"]) == 1
        assert [t["env"] for t in node.tasks()] == ["a"]

        hold.call("done", task_id=held["task_id"])
        got = w.finish()
        assert got["type"] == "grant" and got["env"] == "c" and indices(got) == [0]
        assert node.admin("queue")["waiting"] == []


def test_an_unrestricted_waiter_shows_no_devices(node: Any, wait_for: Any) -> None:
    holds = [Connection(node.env(name)) for name in ("a", "b")]
    for h in holds:
        h.call("request", gpus=1)
    w = Waiting(node.env("c"), 1, devices=None)
    wait_for(lambda: len(node.admin("queue")["waiting"]) == 1, 5)
    assert node.admin("queue")["waiting"][0]["devices"] is None
    with pytest.raises(NoResources, match="willing to wait"):
        w.finish()
    for h in holds:
        h.close()


def test_a_restricted_waiter_is_overtaken_only_by_grants_that_could_delay_it(
    daemon_factory: Any, wait_for: Any
) -> None:
    """Policy (docs/scheduling.md, "Wait queue"): grants of GPUs it does not allow to other
    environments neither count as overtaking a restricted waiter nor are held back by it."""
    node = daemon_factory(
        {
            "scheduler": {"task_threshold": 1, "queue_max_bypass": 2},
            "gpus": {"simulated_count": 2},
        },
        heartbeat_timeout=600.0,
    )

    def bypassed() -> int:
        (entry,) = node.admin("queue")["waiting"]
        return int(entry["bypassed"])

    def run_once(endpoint: str) -> None:
        with Connection(endpoint) as c:
            got = c.call("request", gpus=1)
            assert indices(got) == [1]
            c.call("done", task_id=got["task_id"])

    with Connection(node.env("a")) as hold:
        held = hold.call("request", gpus=1, devices=["0"])
        ep = node.env("c")
        w = Waiting(ep, 60, devices=["0"])
        wait_for(lambda: len(node.admin("queue")["waiting"]) == 1, 5)
        other = node.env("b")
        for _ in range(3):  # more than queue_max_bypass: GPU 1 is none of its business
            run_once(other)
        assert bypassed() == 0
        # Its own environment's grants use its quota (1 GPU): they count.
        for overtaken in (1, 2):
            run_once(ep)
            assert bypassed() == overtaken
        with Connection(ep) as c, pytest.raises(NoResources, match="may not be overtaken"):
            c.call("request", gpus=1)
        # ... while another environment still gets GPU 1.
        run_once(other)
        assert bypassed() == 2 and w.is_alive()

        hold.call("done", task_id=held["task_id"])
        assert indices(w.finish()) == [0]
