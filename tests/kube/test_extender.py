"""The scheduler extender as its own process (`gpushare-cluster extender`), driven with
real HTTP requests in kube-scheduler's JSON shapes (k8s.io/kube-scheduler/extender/v1:
ExtenderArgs with full Pod and Node objects, or node names with nodeCacheCapable), over a
fake API server; answers checked field by field (docs/kubernetes.md)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import BIN, _wait_for
from tests.fixtures.fake_apiserver import FakeApiServer, node, pod
from tests.kube.conftest import ExtenderProcess


@pytest.fixture
def start() -> Iterator[Callable[..., ExtenderProcess]]:
    made: list[ExtenderProcess] = []

    def make(*args: str) -> ExtenderProcess:
        made.append(ExtenderProcess(*args))
        return made[-1]

    yield make
    for e in made:
        e.stop()


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    server = FakeApiServer()
    yield server
    server.stop()


def _args(
    p: dict[str, Any], nodes: list[dict[str, Any]] | None = None, names: list[str] | None = None
) -> dict[str, Any]:
    """ExtenderArgs: the Pod, and full Nodes or (nodeCacheCapable) NodeNames."""
    return {
        "Pod": p,
        "Nodes": {"items": nodes} if nodes is not None else None,
        "NodeNames": names,
    }


NODES = [
    node("a100-1", gpus=2, gib=80),  # 2 GPUs of 80 GiB, offered 4 times: 640 GiB of quota
    node("a100-2", gpus=2, gib=80, cpu="1"),  # 1 core: too little CPU for the pod
    node("v100-1", gpus=4, gib=32, model="V100"),
    node("cpu-1", gpus=0, gib=0, model=""),
]


def test_filter_with_full_nodes_answers_field_by_field(
    start: Callable[..., ExtenderProcess],
) -> None:
    ext = start("--api-server", "none")
    p = pod("nb-1", gpus=1, gib=40, annotations={"gpushare.io/gpu-model": "A100"})
    code, got = ext.post("filter", _args(p, nodes=NODES))
    assert code == 200
    assert set(got) == {"Nodes", "NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"}
    assert got["Error"] == ""
    assert got["NodeNames"] is None  # full nodes in, full nodes out
    assert [n["metadata"]["name"] for n in got["Nodes"]["items"]] == ["a100-1"]
    assert got["Nodes"]["items"][0] == NODES[0]  # the object as it came
    assert got["FailedNodes"] == {
        "a100-2": "gpushare: too little CPU",
        "v100-1": "gpushare: GPU model not accepted",
        "cpu-1": "gpushare: GPU model not accepted",
    }
    assert got["FailedAndUnresolvableNodes"] == {}


def test_filter_refuses_a_pod_asking_one_of_the_two_resources(
    start: Callable[..., ExtenderProcess],
) -> None:
    ext = start("--api-server", "none")
    p = pod("nb-1", gpus=1, gib=40)
    del p["spec"]["containers"][0]["resources"]["requests"]["gpushare.io/gpu-memory"]
    del p["spec"]["containers"][0]["resources"]["limits"]["gpushare.io/gpu-memory"]
    code, got = ext.post("filter", _args(p, nodes=NODES))
    assert code == 200
    assert "without gpushare.io/gpu-memory" in got["Error"]


def test_prioritize_scores_every_node_by_the_policy(
    start: Callable[..., ExtenderProcess], api: FakeApiServer
) -> None:
    # Best fit: the node with the least left after the pod scores MAX (10).
    api.nodes = [node("n1", gpus=1, gib=80), node("n2", gpus=1, gib=80), node("n3", gpus=1, gib=80)]
    api.pods = [
        pod("old", gpus=1, gib=160, node_name="n2"),  # half of n2's quota GPU
        pod("older", gpus=1, gib=80, node_name="n3"),
    ]  # a quarter of n3's
    ext = start("--api-server", api.url, "--policy", "bestfit", "--refresh", "0.2")
    _wait_for(lambda: "refresh failed" not in ext.log(), 5)
    p = pod("nb-1", gpus=1, gib=80)

    def answer() -> list[dict[str, Any]]:
        return ext.post("prioritize", _args(p, names=["n1", "n2", "n3"]))[1]  # type: ignore[no-any-return]

    _wait_for(lambda: answer()[1]["Score"] == 10, 10)  # the view has the bound pods
    got = answer()
    assert [h["Host"] for h in got] == ["n1", "n2", "n3"]
    assert all(set(h) == {"Host", "Score"} and isinstance(h["Score"], int) for h in got)
    scores = {h["Host"]: h["Score"] for h in got}
    assert scores["n2"] == 10 and scores["n1"] == 0 and 0 < scores["n3"] < 10


def test_bind_binds_through_the_api_server_and_holds_the_room(
    start: Callable[..., ExtenderProcess], api: FakeApiServer
) -> None:
    api.nodes = [node("n1", gpus=1, gib=80, factor=1)]  # one GPU's quota: 80 GiB
    api.pods = [pod("a", gpus=1, gib=60), pod("b", gpus=1, gib=60)]
    ext = start("--api-server", api.url, "--oversubscription", "1", "--refresh", "0.2")
    _wait_for(
        lambda: ext.post("filter", _args(api.pods[0], names=["n1"]))[1]["NodeNames"] == ["n1"], 10
    )
    code, got = ext.post(
        "bind", {"PodName": "a", "PodNamespace": "team", "PodUID": "uid-a", "Node": "n1"}
    )
    assert (code, got) == (200, {"Error": ""})
    ((path, body),) = api.bindings
    assert path == "/api/v1/namespaces/team/pods/a/binding"
    assert body == {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": "a", "namespace": "team", "uid": "uid-a"},
        "target": {"apiVersion": "v1", "kind": "Node", "name": "n1"},
    }
    # At once, before any refresh: b no longer fits where a is.
    code, got = ext.post("filter", _args(api.pods[1], names=["n1"]))
    assert got["NodeNames"] == [] and "no room" in got["FailedNodes"]["n1"]
    # And after refreshes, from the API server's own record.
    time.sleep(0.6)
    assert ext.post("filter", _args(api.pods[1], names=["n1"]))[1]["NodeNames"] == []
    code, got = ext.post(
        "bind", {"PodName": "b", "PodNamespace": "team", "PodUID": "uid-b", "Node": "n1"}
    )
    assert "no longer fits" in got["Error"]
    code, got = ext.post(
        "bind", {"PodName": "zz", "PodNamespace": "team", "PodUID": "u", "Node": "n1"}
    )
    assert got == {"Error": "gpushare: no pod team/zz"}


def test_bad_requests_are_answered_with_an_error(
    start: Callable[..., ExtenderProcess],
) -> None:
    ext = start("--api-server", "none")
    assert ext.post("filter", b"{not json")[0] == 400
    assert ext.post("filter", [1, 2])[0] == 400
    code, got = ext.post("preempt", {})
    assert code == 404 and "filter, prioritize, bind" in got["Error"]
    code, got = ext.post("bind", {"PodName": "a", "PodNamespace": "t", "Node": "n"})
    assert "no API server" in got["Error"]
    code, got = ext.post("filter", _args(pod("x", 1, 8), names=["nowhere"]))
    assert got["FailedNodes"] == {"nowhere": "gpushare: node not known to the extender"}


def test_options_that_cannot_work_exit_78_and_a_taken_port_69(
    start: Callable[..., ExtenderProcess],
) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(BIN / "gpushare-cluster"), "extender", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )

    got = run("--api-server", "none", "--policy", "nosuch")
    assert got.returncode == 78 and "no placement policy 'nosuch'" in got.stderr
    got = run("--listen", "127.0.0.1:0")  # not in a cluster, no --api-server
    assert got.returncode == 78 and "--api-server" in got.stderr
    ext = start("--api-server", "none")
    got = run("--api-server", "none", "--listen", ext.url.removeprefix("http://"))
    assert got.returncode == 69 and "cannot listen" in got.stderr
    assert run("--listen", "nonsense").returncode == 2


def test_a_node_that_cannot_be_read_is_left_out_not_the_view(
    start: Callable[..., ExtenderProcess], api: FakeApiServer
) -> None:
    bad = node("bad", gpus=1, gib=80, labels={"gpushare.io/oversubscription": "lots"})
    api.nodes = [bad, node("good", gpus=1, gib=80)]
    api.pods = [pod("huge", 9, 720)]  # waiting, and more GPUs than any node holds
    ext = start("--api-server", api.url, "--refresh", "0.2")
    p = pod("nb", 1, 40)

    def passed() -> Any:
        return ext.post("filter", _args(p, names=["bad", "good"]))[1]

    _wait_for(lambda: passed()["NodeNames"] == ["good"], 10)
    assert passed()["FailedNodes"] == {"bad": "gpushare: node not known to the extender"}
    assert "left out of the view" in ext.log()


def test_the_token_file_is_read_again(tmp_path: Path) -> None:
    from kube.apiserver import TOKEN_REREAD, ApiServer

    f = tmp_path / "token"
    f.write_text("first\n")
    server = ApiServer("https://127.0.0.1:1", token_file=f)
    assert server._bearer() == "first"
    f.write_text("second\n")
    assert server._bearer() == "first"  # within TOKEN_REREAD
    server._token_read -= TOKEN_REREAD
    assert server._bearer() == "second"
