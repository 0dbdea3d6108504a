"""The baselines, rule by rule, on clusters small enough to know the right answer."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from placement import policies  # noqa: F401  (registers them)
from placement.cluster import ClusterState, Placement, PlacementError, Pod
from placement.policies.base import tightest_devices
from placement.registry import Policy, make, names
from tests.placement.conftest import nodes, pod


def decide(policy: str | Policy, state: ClusterState, p: Pod) -> Placement | None:
    chosen = make(policy) if isinstance(policy, str) else policy
    chosen.setup(state, [p])
    return chosen.decide(state, p, np.random.default_rng(7))


def scores(policy: str, state: ClusterState, p: Pod) -> list[int]:
    chosen = make(policy)
    chosen.setup(state, [p])
    feasible = np.flatnonzero(state.feasible(p))
    return chosen.score(state, p, feasible, np.random.default_rng(7)).tolist()  # type: ignore[attr-defined,no-any-return]


def test_the_registry_has_the_baselines_and_refuses_others() -> None:
    assert {"random", "dotprod", "clustering", "packing", "bestfit", "fgd"} <= set(names())
    with pytest.raises(PlacementError, match="no placement policy 'worst'"):
        make("worst")


@pytest.mark.parametrize("policy", ["random", "dotprod", "clustering", "packing", "bestfit", "fgd"])
def test_no_node_with_room_is_no_placement(policy: str) -> None:
    s = ClusterState(nodes((8000, 100, 2, "T4")))
    assert decide(policy, s, pod(cpu=9000)) is None
    assert decide(policy, s, pod(gpus=4)) is None
    assert decide(policy, s, pod(memory=200)) is None


def test_random_spreads_over_every_node_and_gpu_with_room() -> None:
    s = ClusterState(nodes((8000, 100, 2, "T4"), (8000, 100, 2, "T4"), (100, 100, 2, "T4")))
    s.place(pod("x", milli=800), Placement(1, (0,)))
    seen: collections.Counter[tuple[int, tuple[int, ...]]] = collections.Counter()
    policy = make("random")
    rng = np.random.default_rng(7)
    for _ in range(400):
        where = policy.decide(s, pod(cpu=500, milli=300), rng)
        assert where is not None
        seen[(where.node, where.gpus)] += 1
    # Node 2 lacks CPU; node 1's GPU 0 has 200 left.
    assert set(seen) == {(0, (0,)), (0, (1,)), (1, (1,))}
    assert min(seen.values()) > 60


def test_dot_product_prefers_the_node_fuller_where_the_pod_asks() -> None:
    s = ClusterState(nodes((64000, 1000, 8, "G2"), (64000, 1000, 8, "G2")))
    for g in range(6):
        s.place(pod(f"x{g}", cpu=8000), Placement(1, (g,)))
    # Node 0: 64 cores, 8 GPUs free; node 1: 16 cores, 2 GPUs. trunc(100 (1 - d / 2)).
    assert scores("dotprod", s, pod(cpu=4000)) == [92, 98]
    assert decide("dotprod", s, pod(cpu=4000)) == Placement(1, (6,))


def test_gpu_clustering_puts_a_kind_with_its_own_kind() -> None:
    s = ClusterState(nodes(*[(64000, 1000, 8, "G2")] * 4))
    s.place(pod("s0", milli=200), Placement(0, (0,)))  # only shared
    s.place(pod("s1", milli=200), Placement(1, (0,)))  # shared and 1-GPU
    s.place(pod("w1"), Placement(1, (1,)))
    s.place(pod("w3"), Placement(3, (0,)))  # only 1-GPU
    # 25 * (8000 - free GPU) // 8000 on top of 75 / 50 / 25 / 0.
    assert scores("clustering", s, pod(milli=300)) == [75, 50 + 3, 25, 3]
    assert scores("clustering", s, pod()) == [0, 50 + 3, 25, 75 + 3]
    assert scores("clustering", s, pod(gpus=0)) == [0, 0, 0, 0]


def test_gpu_packing_fills_used_gpus_then_busy_nodes_then_idle_ones() -> None:
    s = ClusterState(nodes(*[(64000, 1000, 8, "G2")] * 3, (64000, 1000, 2, "T4")))
    s.place(pod("a", milli=600), Placement(0, (3,)))  # 400 left on GPU 3
    s.place(pod("b", milli=100), Placement(1, (0,)))  # 900 left on GPU 0
    s.place(pod("c", milli=1000), Placement(2, (0,)))  # node 2 busy, GPUs 1-7 idle
    # Tightest used GPU: 100 - (free / 100) // 10 ... a busy node's idle GPU: 50 - 1.
    # Idle nodes: max(33 - idle GPUs, idle GPUs).
    assert scores("packing", s, pod(milli=300)) == [96, 91, 49, 31]
    assert decide("packing", s, pod(milli=300)) == Placement(0, (3,))
    assert scores("packing", s, pod(gpus=2)) == [48, 48, 48, 31]


def test_best_fit_leaves_the_least_and_normalises() -> None:
    s = ClusterState(nodes((64000, 1000, 8, "G2"), (64000, 1000, 8, "G2"), (48000, 1000, 4, "V")))
    s.place(pod("a", cpu=32000, gpus=4), Placement(0, (0, 1, 2, 3)))
    got = scores("bestfit", s, pod(cpu=2000))
    assert got[0] == 100 and got[1] == 0 and 0 < got[2] < 100
    assert decide("bestfit", s, pod(cpu=2000)) == Placement(0, (4,))
    one = ClusterState(nodes((64000, 1000, 8, "G2"), (64000, 1000, 8, "G2")))
    assert scores("bestfit", one, pod()) == [0, 0]  # all equal: 0, as the simulator


@pytest.mark.parametrize("policy", ["dotprod", "clustering", "packing", "bestfit", "fgd"])
def test_equal_nodes_go_to_the_first_in_the_node_order(policy: str) -> None:
    shapes = [(64000, 1000, 8, "G2")] * 4
    for order in ([0, 1, 2, 3], [2, 0, 3, 1], [3, 2, 1, 0]):
        s = ClusterState(nodes(*shapes), order=order)
        where = decide(policy, s, pod(milli=500))
        assert where is not None and where.node == order.index(0)


def test_devices_tightest_fit_and_lowest_whole() -> None:
    s = ClusterState(nodes((64000, 1000, 4, "T4")))
    s.place(pod("a", milli=600), Placement(0, (1,)))
    s.place(pod("b", milli=650), Placement(0, (2,)))
    s.place(pod("c", milli=600), Placement(0, (3,)))
    assert s.gpu_left[0].tolist()[:4] == [1000, 400, 350, 400]
    assert tightest_devices(s, 0, pod(milli=300)) == (2,)
    assert tightest_devices(s, 0, pod(milli=380)) == (1,)
    assert tightest_devices(s, 0, pod(milli=500)) == (0,)
    s2 = ClusterState(nodes((64000, 1000, 4, "T4")))
    s2.place(pod("d"), Placement(0, (1,)))
    assert tightest_devices(s2, 0, pod(gpus=2)) == (0, 2)
