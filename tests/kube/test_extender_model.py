"""The extender's model, rule by rule (kube.extender.model; docs/kubernetes.md, "How the
extender sees a node")."""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import pytest

from kube.extender.model import MAX_SCORE, Ask, ModelError, View, ask, node_info, quantity
from placement.cluster import BE, LS
from tests.fixtures.fake_apiserver import node, pod


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("500m", Fraction(1, 2)),
        ("2", 2),
        ("1.5", Fraction(3, 2)),
        ("16Gi", 16 << 30),
        ("1G", 10**9),
        ("1e3", 1000),
        ("128974848", 128974848),
        ("129e6", 129 * 10**6),
        ("123Mi", 123 << 20),
        ("1k", 1000),
    ],
)
def test_quantities_read_as_kubernetes_writes_them(text: str, value: Fraction) -> None:
    assert quantity(text, "x") == value


@pytest.mark.parametrize("text", ["", "1Gb", "abc", "1.2.3", "Gi"])
def test_a_bad_quantity_is_refused_naming_where(text: str) -> None:
    with pytest.raises(ModelError, match=r"^here: "):
        quantity(text, "here")


def test_a_node_s_gpus_come_from_what_its_plugin_offers() -> None:
    info = node_info(
        node("n", gpus=8, gib=141, factor=4, cpu="96", memory="1Ti", model="H200"), default_factor=4
    )
    assert (info.gpus, info.gpu_memory, info.factor, info.model) == (8, 141, 4, "H200")
    assert (info.cpu, info.memory) == (96_000, 1 << 20)
    # A label gives its own factor.
    labelled = node("m", gpus=2, gib=80, factor=2, labels={"gpushare.io/oversubscription": "2"})
    assert node_info(labelled, default_factor=4).gpus == 2
    assert node_info(node("c", gpus=0, gib=0, model="X"), 4).model == ""


def test_a_pod_s_ask_sums_its_containers_and_reads_its_annotations() -> None:
    p = pod(
        "p",
        gpus=2,
        gib=40,
        cpu="1500m",
        memory="3Gi",
        annotations={"gpushare.io/class": "LS", "gpushare.io/gpu-model": "A100, H100"},
    )
    p["spec"]["containers"].append({"name": "side", "resources": {"requests": {"cpu": "500m"}}})
    p["spec"]["initContainers"] = [{"name": "init", "resources": {"requests": {"cpu": "4"}}}]
    a = ask(p)
    assert (a.key, a.cpu, a.memory, a.gpus, a.gpu_memory) == ("team/p", 4000, 3072, 2, 40)
    assert a.qos == LS and a.models == ("A100", "H100") and a.node == ""
    assert ask(pod("q", 0, 0)).qos == BE


def test_a_bad_class_is_refused() -> None:
    with pytest.raises(ModelError, match=r"gpushare\.io/class"):
        ask(pod("p", 1, 8, annotations={"gpushare.io/class": "gold"}))


def test_tasks_are_shares_of_a_quota_gpu() -> None:
    info = node_info(node("n", gpus=2, gib=80, factor=4), 4)  # a quota GPU: 320 GiB
    (one,) = ask(pod("p", 1, 80)).tasks(info)
    assert (one.num_gpu, one.gpu_milli) == (1, 250)
    (whole,) = ask(pod("w", 2, 640)).tasks(info)
    assert (whole.num_gpu, whole.gpu_milli) == (2, 1000)
    first, second = ask(pod("s", 2, 64, cpu="3")).tasks(info)  # 32 GiB on each of 2
    assert (first.num_gpu, first.gpu_milli, first.cpu) == (1, 100, 3000)
    assert (second.num_gpu, second.gpu_milli, second.cpu, second.memory) == (1, 100, 0, 0)


def _passed(view: View, a: Ask, names: list[str]) -> list[str]:
    return view.filter(a, names)[0]


def test_several_shares_are_placed_only_where_all_fit() -> None:
    infos = [
        node_info(node("a", gpus=1, gib=80, factor=1), 1),
        node_info(node("b", gpus=2, gib=80, factor=1), 1),
    ]
    view = View(infos, policy="bestfit")
    two = ask(pod("p", 2, 100))  # two shares of 50 GiB (625 milli)
    passed, failed = view.filter(two, ["a", "b"])
    assert passed == ["b"]
    assert failed == {"a": "gpushare: no room for 2 GPU quota share(s) of 625 milli"}
    assert view.score(two, passed) == {"b": MAX_SCORE}
    assert view.place(two, "b")
    assert _passed(view, ask(pod("q", 1, 50)), ["b"]) == []
    view.release("uid-p")
    assert _passed(view, ask(pod("q", 1, 50)), ["b"]) == ["b"]


def test_bound_pods_are_held_where_they_are() -> None:
    infos = [node_info(node("a", gpus=1, gib=80, factor=1), 1)]
    view = View(infos, [ask(pod("x", 1, 60, node_name="a"))], policy="gpushare")
    assert view.bound_node("uid-x") == "a"
    assert _passed(view, ask(pod("y", 1, 30)), ["a"]) == []
    # One that no longer fits where the API server says it is: counted, not held.
    crowded = View(
        infos, [ask(pod("x", 1, 60, node_name="a")), ask(pod("z", 1, 60, node_name="a"))]
    )
    assert crowded.unplaced == ["team/z"]


def test_a_pod_no_node_could_hold_is_an_error_not_a_crash() -> None:
    infos = [node_info(node("a", gpus=1, gib=80, factor=1), 1)]
    huge = ask(pod("huge", 9, 9 * 80))  # 9 whole GPUs: more than any node holds
    with pytest.raises(ModelError, match="team/huge"):
        huge.tasks(infos[0])
    # Waiting or bound, it leaves the rest of the view whole.
    bound = dataclasses.replace(huge, node="a")
    view = View(infos, [bound, ask(pod("x", 1, 40, node_name="a"))], waiting=[huge])
    assert view.unplaced == ["team/huge"] and view.bound_node("uid-x") == "a"


def test_a_pod_made_again_under_its_name_is_another_pod() -> None:
    infos = [
        node_info(node("a", gpus=1, gib=80, factor=1), 1),
        node_info(node("b", gpus=1, gib=80, factor=1), 1),
    ]
    view = View(infos, [ask(pod("nb", 1, 40, node_name="a"))])
    again = pod("nb", 1, 40)
    again["metadata"]["uid"] = "uid-nb-2"
    assert view.place(ask(again), "b")  # not refused as the old pod held elsewhere
    assert view.bound_node("uid-nb") == "a" and view.bound_node("uid-nb-2") == "b"


def test_waiting_pods_are_shaped_on_the_common_gpu_node() -> None:
    # Three CPU-only nodes and one GPU node: the waiting pod's share is the GPU node's.
    infos = [node_info(node(f"c{k}", gpus=0, gib=0), 4) for k in range(3)]
    infos.append(node_info(node("g", gpus=2, gib=80, factor=4), 4))
    view = View(infos, waiting=[ask(pod("w", 1, 80))], policy="fgd")
    assert view.policy.workload is not None  # type: ignore[attr-defined]
    assert view.policy.workload.shapes == ((2000, 250, 1, ""),)  # type: ignore[attr-defined]
