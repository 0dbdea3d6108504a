"""The cluster's state: what fits where, taking and giving back, and bad input refused."""

from __future__ import annotations

import numpy as np
import pytest

from placement.cluster import ClusterState, Node, Placement, PlacementError, Pod, parse_spec
from tests.placement.conftest import nodes, pod


def test_a_pod_is_checked_when_made() -> None:
    cases: list[tuple[dict[str, int], str]] = [
        ({"num_gpu": 2, "gpu_milli": 500}, "is for one GPU, not 2"),
        ({"num_gpu": 1, "gpu_milli": 0}, "gpu_milli 0 out of 1..1000"),
        ({"num_gpu": 1, "gpu_milli": 1001}, "out of 1..1000"),
        ({"num_gpu": 0, "gpu_milli": 300}, "gpu_milli without a GPU"),
        ({"num_gpu": 9, "gpu_milli": 1000}, "num_gpu 9 out of 0..8"),
    ]
    for kwargs, says in cases:
        with pytest.raises(PlacementError, match=says):
            Pod("p", 1000, 0, kwargs["num_gpu"], kwargs["gpu_milli"])
    with pytest.raises(PlacementError, match="negative"):
        Pod("p", -1, 0)
    with pytest.raises(PlacementError, match="9 GPUs"):
        Node("n", 1000, 1000, 9, "A100")


def test_specs_are_sets_of_models() -> None:
    assert parse_spec("") == ()
    # Order and repeats are the trace's: FGD's typical pods are told apart by them.
    assert parse_spec("V100M16|V100M32||V100M32") == ("V100M16", "V100M32", "V100M32")
    assert pod(spec=["T4", "G2"]).shape == (1000, 1000, 1, "T4|G2")


def test_feasible_needs_cpu_memory_and_gpus_of_an_accepted_model() -> None:
    s = ClusterState(
        nodes(
            (8000, 1000, 2, "T4"), (4000, 1000, 8, "G2"), (8000, 100, 4, "G2"), (9000, 9000, 0, "")
        )
    )
    assert s.feasible(pod(cpu=5000, milli=500)).tolist() == [True, False, True, False]
    assert s.feasible(pod(cpu=5000, milli=500, memory=500)).tolist() == [True, False, False, False]
    assert s.feasible(pod(cpu=100, gpus=4)).tolist() == [False, True, True, False]
    assert s.feasible(pod(cpu=100, gpus=8)).tolist() == [False, True, False, False]
    assert s.feasible(pod(cpu=100, memory=500, gpus=0)).tolist() == [True, True, False, True]
    assert s.feasible(pod(cpu=100, spec=["G2"])).tolist() == [False, True, True, False]
    assert s.feasible(pod(cpu=100, spec=["A100"])).tolist() == [False] * 4


def test_place_and_remove_are_exact_inverses() -> None:
    s = ClusterState(nodes((8000, 1000, 2, "T4")))
    before = s.snapshot()
    shared, whole = pod("a", cpu=3000, milli=300, memory=100), pod("b", cpu=1000, memory=50)
    s.place(shared, Placement(0, (1,)))
    s.place(whole, Placement(0, (0,)))
    assert s.snapshot()["n0"] == {"cpu_left": 4000, "memory_left": 850, "gpu_left": [0, 700]}
    assert s.gpu_allocated == 1300
    assert s.tags[0, 0] == 1 and s.tags[0, 1] == 1
    assert s.on_node[0] == {"a", "b"} and s.placed["a"] == (shared, Placement(0, (1,)))
    seen = {int(s.version[0])}
    assert s.remove("b") == (whole, Placement(0, (0,)))
    seen.add(int(s.version[0]))
    s.remove("a")
    seen.add(int(s.version[0]))
    assert s.snapshot() == before and not s.placed and s.on_node[0] == set()
    assert len(seen) == 3  # each change a version never used before


def test_what_does_not_fit_is_refused_and_changes_nothing() -> None:
    s = ClusterState(nodes((8000, 1000, 2, "T4")))
    s.place(pod("a", milli=600), Placement(0, (0,)))
    before = s.snapshot()
    for bad in [
        (pod("b", milli=500), Placement(0, (0,))),  # 400 left there
        (pod("c", gpus=2), Placement(0, (1, 1))),  # one GPU twice
        (pod("d", gpus=1), Placement(0, (2,))),  # no such GPU
        (pod("e", cpu=9000, milli=100), Placement(0, (1,))),
        (pod("f", spec=["G2"]), Placement(0, (1,))),
    ]:
        with pytest.raises(PlacementError, match="does not fit"):
            s.place(*bad)
    assert s.snapshot() == before
    with pytest.raises(PlacementError, match="pod g is not placed"):
        s.remove("g")
    with pytest.raises(PlacementError, match="pod a is placed already"):
        s.place(pod("a", milli=100), Placement(0, (1,)))


def test_a_decision_is_carried_out_whole_or_not_at_all() -> None:
    s = ClusterState(nodes((8000, 1000, 2, "T4"), (8000, 1000, 2, "T4")))
    s.place(pod("a", milli=600), Placement(0, (0,)))
    s.place(pod("b", milli=600), Placement(0, (1,)))
    big = pod("big", gpus=2)
    # Evict a, move b to node 1: node 0's two GPUs are then idle for big.
    evicted = s.carry_out(
        big, Placement(0, (0, 1), evict=("a",), moves=(("b", Placement(1, (0,))),))
    )
    assert [p.name for p in evicted] == ["a"]
    assert s.on_node == [{"big"}, {"b"}]
    before = s.snapshot()
    with pytest.raises(PlacementError):  # the move's target has no room: nothing changes
        s.carry_out(pod("c"), Placement(1, (1,), moves=(("big", Placement(1, (0, 1))),)))
    assert s.snapshot() == before and s.on_node == [{"big"}, {"b"}]
    copy = s.copy()
    copy.remove("b")
    assert "b" in s.placed and s.gpu_left[1, 0] == 400


def test_a_cluster_needs_distinct_nodes_and_a_whole_order() -> None:
    with pytest.raises(PlacementError, match="no nodes"):
        ClusterState([])
    with pytest.raises(PlacementError, match="listed twice"):
        ClusterState([Node("a", 1, 1, 1, "T4"), Node("a", 1, 1, 1, "T4")])
    with pytest.raises(PlacementError, match="rank each node once"):
        ClusterState(nodes((1, 1, 1, "T4"), (1, 1, 1, "T4")), order=[0, 0])
    s = ClusterState(nodes((1, 1, 1, "T4"), (1, 1, 1, "T4")), order=[1, 0])
    assert np.array_equal(s.rank, [1, 0])
