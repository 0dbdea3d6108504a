"""gpushare's own policies, rule by rule: displacement of best-effort work, migration,
CPU-only tasks, seed 000's node and GPU choice; and the replay's classes."""

from __future__ import annotations

import dataclasses

import numpy as np

from placement.cluster import ClusterState, Placement, Pod
from placement.policies.gpushare import MAX_MOVES, Gpushare
from placement.policies.room import room_below
from placement.policies.seed000 import Seed000
from placement.replay import replay
from tests.placement.conftest import nodes, pod


def rng() -> np.random.Generator:
    return np.random.default_rng(5)


def ready(policy: Gpushare | Seed000, state: ClusterState, *typical: Pod) -> Gpushare | Seed000:
    policy.setup(state, list(typical) or [pod("t", milli=500)])
    return policy


def test_a_latency_sensitive_task_displaces_the_least_best_effort_work() -> None:
    s = ClusterState(nodes((16000, 1000, 2, "T4")))
    s.place(pod("be-whole", qos="BE"), Placement(0, (0,)))
    s.place(pod("be-share", milli=300, qos="BE"), Placement(0, (1,)))
    where = ready(Gpushare(), s).decide(s, pod("ls", qos="LS"), rng())
    # Evicting the 300 share frees GPU 1; evicting the whole GPU would cost 1000.
    assert where == Placement(0, (1,), evict=("be-share",))
    assert [p.name for p in s.carry_out(pod("ls"), where)] == ["be-share"]


def test_displacement_evicts_the_best_effort_part_of_a_shared_gpu() -> None:
    s = ClusterState(nodes((16000, 1000, 1, "T4")))
    s.place(pod("ls-300", milli=300), Placement(0, (0,)))
    s.place(pod("be-600", milli=600, qos="BE"), Placement(0, (0,)))
    where = ready(Gpushare(), s).decide(s, pod("ls", milli=500), rng())
    assert where == Placement(0, (0,), evict=("be-600",))


def test_displacement_evicts_the_smallest_task_that_makes_room() -> None:
    s = ClusterState(nodes((16000, 1000, 1, "T4")))
    s.place(pod("be-800", milli=800, qos="BE"), Placement(0, (0,)))
    s.place(pod("be-150", milli=150, qos="BE"), Placement(0, (0,)))
    # 50 free; a 150 task needs 100 more: the 150 alone, not the 800.
    where = ready(Gpushare(), s).decide(s, pod("ls", milli=150), rng())
    assert where == Placement(0, (0,), evict=("be-150",))


def test_what_found_no_room_in_one_state_is_tried_again_in_another() -> None:
    policy = Gpushare()
    full = ClusterState(nodes((16000, 1000, 1, "T4")))
    full.place(pod("a", milli=500), Placement(0, (0,)))
    full.place(pod("b", milli=500), Placement(0, (0,)))  # two changes, as in the other
    ready(policy, full)
    assert policy.decide(full, pod("whole"), rng()) is None
    other = ClusterState(nodes((16000, 1000, 1, "T4"), (16000, 1000, 1, "T4")))
    other.place(pod("x", milli=400), Placement(0, (0,)))
    other.place(pod("y", milli=500), Placement(1, (0,)))
    assert policy.decide(other, pod("whole"), rng()) is not None


def test_latency_sensitive_work_is_never_displaced_nor_displacing_for_best_effort() -> None:
    s = ClusterState(nodes((16000, 1000, 1, "T4")))
    s.place(pod("ls-share", milli=600), Placement(0, (0,)))
    policy = ready(Gpushare(), s)
    assert policy.decide(s, pod("ls"), rng()) is None  # only LS work there, nowhere to move
    s2 = ClusterState(nodes((16000, 1000, 1, "T4")))
    s2.place(pod("be-share", milli=600, qos="BE"), Placement(0, (0,)))
    assert ready(Gpushare(), s2).decide(s2, pod("be", qos="BE"), rng()) is None
    # The trace's Guaranteed pods are latency-sensitive, its Burstable ones best-effort.
    assert pod(qos="Guaranteed").latency_sensitive and not pod(qos="Burstable").latency_sensitive


def test_a_task_that_fits_nowhere_gets_room_by_migration() -> None:
    s = ClusterState(nodes((16000, 1000, 1, "T4"), (16000, 1000, 1, "T4")))
    s.place(pod("x", milli=400), Placement(0, (0,)))
    s.place(pod("y", milli=500), Placement(1, (0,)))
    where = ready(Gpushare(), s).decide(s, pod("whole"), rng())
    # x (400) moves to node 1's 500 free: node 0's GPU is then idle. Or y to node 0.
    assert where in (
        Placement(0, (0,), moves=(("x", Placement(1, (0,))),)),
        Placement(1, (0,), moves=(("y", Placement(0, (0,))),)),
    )
    assert where is not None and s.carry_out(pod("whole"), where) == []
    assert len(s.placed) == 3 and s.gpu_allocated == 1900


def test_migration_packs_a_node_s_own_gpus() -> None:
    s = ClusterState(nodes((16000, 1000, 2, "T4")))
    s.place(pod("a", milli=300), Placement(0, (0,)))
    s.place(pod("b", milli=600), Placement(0, (1,)))
    where = ready(Gpushare(), s).decide(s, pod("whole"), rng())
    assert where == Placement(0, (0,), moves=(("a", Placement(0, (1,))),))


def test_migration_moves_at_most_max_moves_tasks() -> None:
    n = MAX_MOVES + 1
    s = ClusterState(nodes((64000, 1000, 2, "T4"), (70000, 1000, 1, "T4")))
    for i in range(n):  # GPU 0 of node 0 holds n small shares; node 1 has room for them
        s.place(pod(f"s{i}", milli=100), Placement(0, (0,)))
    s.place(pod("blocker", milli=1000), Placement(0, (1,)))
    # Node 1: 550 free, room for all n; its task needs more CPU than node 0 has left.
    s.place(pod("most", milli=450, cpu=60000), Placement(1, (0,)))
    assert ready(Gpushare(), s).decide(s, pod("whole"), rng()) is None
    s.remove("s0")  # now MAX_MOVES tasks are in the way
    where = ready(Gpushare(), s).decide(s, pod("whole"), rng())
    assert where is not None and len(where.moves) == MAX_MOVES


def test_cpu_only_tasks_go_where_they_strand_the_least_gpu() -> None:
    s = ClusterState(nodes((64000, 1000, 2, "G2"), (64000, 1000, 2, "T4"), (32000, 1000, 2, "T4")))
    s.place(pod("a"), Placement(1, (0,)))
    s.place(pod("b"), Placement(1, (1,)))
    s.place(pod("c"), Placement(2, (0,)))
    s.place(pod("d"), Placement(2, (1,)))
    # Nodes 1 and 2 have no free GPU; node 1 has the more CPU left.
    where = ready(Gpushare(), s).decide(s, pod("cpu", gpus=0, cpu=4000), rng())
    assert where == Placement(1, ())


def test_seed000_spreads_and_sends_classes_to_different_gpus() -> None:
    s = ClusterState(nodes((64000, 1000, 4, "T4"), (64000, 1000, 4, "T4")))
    busy = dataclasses.replace(pod("busy", milli=200, qos="BE"), predicted_seconds=3600.0)
    s.place(busy, Placement(0, (0,)))
    s.place(pod("roomy", milli=300, qos="BE"), Placement(0, (1,)))
    s.place(pod("tight", milli=700, qos="BE"), Placement(0, (2,)))
    s.place(pod("full", milli=1000), Placement(0, (3,)))
    policy = ready(Seed000(), s)
    # The node with the most left after the task.
    assert policy.decide(s, pod("ls", milli=200), rng()) == Placement(1, (0,))
    # On node 0 alone: LS to the GPU with the most room (GPU 0, 800 free); BE to the GPU
    # whose tasks end soonest: GPUs 1 and 2 hold tasks without predictions (0 s), GPU 0
    # an hour of work; GPU 1 has the more room.
    assert policy.devices(s, 0, pod("ls", milli=200), rng()) == (0,)
    assert policy.devices(s, 0, pod("be", milli=200, qos="BE"), rng()) == (1,)
    s.place(
        dataclasses.replace(pod("long", milli=100, qos="BE"), predicted_seconds=7200.0),
        Placement(0, (1,)),
    )
    assert policy.devices(s, 0, pod("be", milli=200, qos="BE"), rng()) == (2,)


def test_replay_counts_displacement_by_class() -> None:
    cluster = nodes((64000, 100_000, 2, "T4"))
    pods = [pod(f"be{i}", cpu=100, qos="BE") for i in range(2)] + [pod("ls", cpu=100, qos="LS")]
    pods = [dataclasses.replace(p, name=f"{i}{p.name}") for i, p in enumerate(pods)]
    for seed in range(4):
        r = replay(cluster, pods, "gpushare", seed=seed, tune=1.5)
        assert r.failed_by_class["LS"] == 0
        if r.evicted:  # the LS pod came after both BE pods
            assert r.evicted_unplaced == r.evicted == 1 and r.alloc_by_class == {
                "LS": 50.0,
                "BE": 50.0,
            }
        blind = replay(cluster, pods, "gpushare", seed=seed, tune=1.5, classes=False)
        assert blind.evicted == 0 and not blind.classes
        assert blind.failed_by_class["BE"] == 0 and blind.alloc_by_class["BE"] == 0


def test_room_below_bounds_what_displacement_can_do() -> None:
    state = ClusterState(nodes((8000, 0, 2, "T4"), (8000, 0, 1, "V100")))
    state.place(pod("be", qos="BE"), Placement(0, (0,)))
    state.place(pod("ls", qos="LS"), Placement(0, (1,)))
    state.place(pod("v", qos="BE"), Placement(1, (0,)))
    assert room_below(state, pod("one", qos="LS"))  # either BE pod's GPU
    assert not room_below(state, pod("two", gpus=2, qos="LS"))  # "ls" holds the other
    assert not room_below(state, pod("t4", spec=("T4",), gpus=2, qos="LS"))
    assert not room_below(state, pod("be2", qos="BE"))  # nobody below a BE pod


def test_the_arrival_protocol_counts_failures_displacement_might_have_avoided() -> None:
    cluster = nodes((8000, 0, 1, "T4"))
    trace = [pod("a", qos="BE"), pod("b", qos="LS")]
    first = set()
    for seed in range(8):
        blind = replay(cluster, trace, "bestfit", seed, tune=10)  # displaces nobody
        ls_failed = blind.failed_by_class["LS"]
        if blind.alloc_by_class["BE"] > 0:  # a BE pod came first and holds the GPU
            assert blind.failed_with_room_by_class["LS"] == ls_failed > 0
        else:
            assert blind.failed_with_room_by_class["LS"] == 0
        first.add(blind.alloc_by_class["BE"] > 0)
        room = replay(cluster, trace, "gpushare", seed, tune=10)
        assert room.failed_with_room_by_class == {"LS": 0, "BE": 0}
    assert first == {True, False}  # both orders were seen
