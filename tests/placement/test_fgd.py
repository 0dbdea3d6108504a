"""Fragmentation and FGD: each rule of the measure, the score, the GPU it picks, and what
it keeps between decisions."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from placement import policies
from placement.cluster import ClusterState, Placement, Pod
from placement.frag import fragmentation, typical_pods, workload
from placement.policies.fgd import Fgd, fgd_score
from tests.placement.conftest import nodes, pod


def frag_of(state: ClusterState, typical: list[Pod]) -> list[float]:
    w = workload(typical_pods(typical), state.models)
    return [
        round(float(x), 6) for x in fragmentation(state.cpu_left, state.gpu_left, state.model, w)
    ]


def test_typical_pods_are_the_most_frequent_shapes_up_to_95_percent() -> None:
    many = [pod(f"a{i}", cpu=1000, milli=500) for i in range(60)]
    many += [pod(f"b{i}", cpu=2000) for i in range(30)]
    many += [pod(f"c{i}", cpu=3000, gpus=0) for i in range(6)]
    many += [pod(f"d{i}", cpu=4000, gpus=2) for i in range(4)]
    got = typical_pods(many)
    # 60 + 30 = 90 < 95 of 100: the CPU-only shape too, then 96 >= 95: stop.
    assert [shape for shape, _ in got] == [
        (1000, 500, 1, ""),
        (2000, 1000, 1, ""),
        (3000, 0, 0, ""),
    ]
    assert [round(p, 4) for _, p in got] == [round(60 / 96, 4), round(30 / 96, 4), round(6 / 96, 4)]
    # Equal counts: the larger shape first.
    tie = typical_pods([pod("x", cpu=1000), pod("y", cpu=2000)], share=0.5)
    assert tie == [((2000, 1000, 1, ""), 1.0)]
    assert typical_pods([]) == []


def test_free_gpus_a_typical_pod_cannot_use_are_fragment() -> None:
    s = ClusterState(nodes((8000, 100, 4, "T4"), (8000, 100, 4, "T4"), (1000, 100, 4, "T4")))
    s.place(pod("a", cpu=0, milli=700), Placement(0, (0,)))  # node 0: 300 1000 1000 1000
    s.place(pod("b", cpu=0, milli=800), Placement(1, (0,)))
    s.place(pod("c", cpu=0, milli=900), Placement(1, (1,)))  # node 1: 200 100 1000 1000
    # Where the task fits, the GPUs with less room than its share; node 2 has 1 core,
    # too little for it, so all its free share.
    assert frag_of(s, [pod(cpu=2000, milli=250)]) == [0, 300, 4000]
    assert frag_of(s, [pod(cpu=2000, milli=150)]) == [0, 100, 4000]
    assert frag_of(s, [pod(cpu=1000, milli=350)]) == [300, 300, 0]


def test_each_reason_for_a_whole_node_of_fragment() -> None:
    s = ClusterState(nodes((8000, 100, 4, "T4"), (1000, 100, 4, "T4"), (8000, 100, 2, "G2")))
    s.place(pod("a", cpu=0, milli=700), Placement(0, (0,)))  # 300 1000 1000 1000: 3300
    free = [3300.0, 4000.0, 2000.0]
    assert frag_of(s, [pod(cpu=100, gpus=0)]) == free  # a CPU-only task uses no GPU
    assert frag_of(s, [pod(cpu=4000, milli=500)]) == [300, 4000, 0]  # node 1: too little CPU
    assert frag_of(s, [pod(cpu=100, gpus=4)]) == [3300, 0, 2000]  # too few idle GPUs
    assert frag_of(s, [pod(cpu=100, milli=500, spec=["G2"])]) == [3300, 4000, 0]  # model
    # Mixed: the expectation over the typical pods.
    mixed = [pod("m1", cpu=100, gpus=0), pod("m2", cpu=100, milli=500)]
    assert frag_of(s, mixed) == [(3300 + 300) / 2, 4000 / 2, 2000 / 2]


def test_the_score_is_the_sigmoid_of_the_fragment_saved() -> None:
    assert fgd_score(np.array([500.0]), np.array([500.0])).tolist() == [50]
    want = math.trunc(100 / (1 + math.exp(-0.3)))
    assert fgd_score(np.array([800.0]), np.array([500.0])).tolist() == [want]
    assert fgd_score(np.array([0.0]), np.array([100.0])).tolist() == [47]


def test_fgd_takes_the_gpu_that_leaves_no_fragment_where_best_fit_would_not() -> None:
    s = ClusterState(nodes((8000, 100, 2, "T4")))
    s.place(pod("a", cpu=0, milli=400), Placement(0, (1,)))  # 1000, 600
    typical = [pod("t", cpu=100, milli=500)]
    fgd = Fgd()
    fgd.setup(s, typical)
    # GPU 0: 500 and 600 left, both fit the typical pod (50); GPU 1: 100 left, lost (47).
    assert fgd.decide(s, pod(cpu=100, milli=500), np.random.default_rng(0)) == Placement(0, (0,))
    best = Placement(0, (1,))
    assert (
        policies.baselines.BestFit().devices(s, 0, pod(milli=500), np.random.default_rng(0))
        == best.gpus
    )


def test_fgd_prefers_the_node_where_the_pod_fills_a_fragment() -> None:
    s = ClusterState(nodes((8000, 100, 2, "T4"), (8000, 100, 2, "T4")))
    s.place(pod("a", cpu=0, milli=700), Placement(1, (0,)))  # node 1: 300, 1000
    typical = [pod("t", cpu=100, milli=500)]
    fgd = Fgd()
    fgd.setup(s, typical)
    # A 300 share on node 1's GPU 0 uses up its 300 of fragment (score 57); on any other
    # GPU it leaves the fragment as it was (50).
    where = fgd.decide(s, pod(cpu=100, milli=300), np.random.default_rng(0))
    assert where == Placement(1, (0,))


def test_whole_gpus_are_the_lowest_idle_ones() -> None:
    s = ClusterState(nodes((8000, 100, 4, "T4")))
    s.place(pod("a", cpu=0), Placement(0, (1,)))
    fgd = Fgd()
    fgd.setup(s, [pod("t", cpu=100, milli=500)])
    assert fgd.decide(s, pod(gpus=2), np.random.default_rng(0)) == Placement(0, (0, 2))


def test_what_fgd_keeps_is_what_it_would_compute_afresh() -> None:
    """Decisions of one FGD instance over a changing cluster, against a new instance at
    each step: the same every time (nothing stale is reused)."""
    rng = np.random.default_rng(3)
    shapes = [(32000, 10_000, 4, "T4"), (64000, 10_000, 8, "G2"), (16000, 10_000, 2, "P100")] * 3
    s = ClusterState(nodes(*shapes))
    kinds = [
        pod("s", cpu=2000, milli=300),
        pod("h", cpu=4000, milli=500),
        pod("w", cpu=6000),
        pod("c", cpu=3000, gpus=0),
        pod("m", cpu=8000, gpus=2),
        pod("g", cpu=1000, milli=250, spec=["G2"]),
    ]
    kept = Fgd()
    kept.setup(s, kinds)
    placed: list[tuple[Pod, Placement]] = []
    for step in range(150):
        p = dataclasses.replace(kinds[int(rng.integers(len(kinds)))], name=f"t{step}")
        fresh = Fgd()
        fresh.setup(s, kinds)
        want = fresh.decide(s, p, np.random.default_rng(step))
        assert kept.decide(s, p, np.random.default_rng(step)) == want, step
        if want is not None:
            s.place(p, want)
            placed.append((p, want))
        if placed and rng.random() < 0.3:  # tasks end too
            s.remove(placed.pop(int(rng.integers(len(placed))))[0].name)


def test_a_node_s_fragmentation_does_not_depend_on_the_nodes_beside_it() -> None:
    rng = np.random.default_rng(1)
    left = rng.integers(0, 1001, size=(300, 8))
    cpu = rng.integers(0, 64001, size=300)
    model = rng.integers(0, 2, size=300)
    typical = [
        pod(f"t{i}", cpu=int(c), milli=int(m))
        for i, (c, m) in enumerate(
            zip(rng.integers(0, 30000, 40), rng.integers(1, 1001, 40), strict=True)
        )
    ]
    w = workload(typical_pods(typical, share=1.0), ("G2", "T4"))
    whole = fragmentation(cpu, left, model, w)
    for i in (0, 17, 299):
        alone = fragmentation(cpu[i : i + 1], left[i : i + 1], model[i : i + 1], w)
        assert alone[0] == whole[i]  # the same bits


def test_fgd_follows_a_cluster_of_other_gpu_models() -> None:
    typical = [pod("t", cpu=100, milli=500, spec=["T4"])]
    fgd = Fgd()
    fgd.setup(ClusterState(nodes((8000, 100, 2, "T4"))), typical)
    other = ClusterState(nodes((8000, 100, 2, "A10"), (8000, 100, 2, "T4")))
    where = fgd.decide(other, pod("p", cpu=100, milli=500, spec=["T4"]), np.random.default_rng(0))
    assert where is not None and where.node == 1


def test_fgd_refuses_to_decide_without_a_workload() -> None:
    s = ClusterState(nodes((8000, 100, 2, "T4")))
    with pytest.raises(RuntimeError, match="no target workload"):
        Fgd().decide(s, pod(), np.random.default_rng(0))
