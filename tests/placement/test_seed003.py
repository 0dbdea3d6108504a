"""Seed 003's rules, case by case, on clusters whose right answer is known: constraints
between tasks, priority preemption, heterogeneous matching, batch-size adaptation and
migration in the time replay."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from placement.adapt import ADAPT_FACTOR, SCALING_EFFICIENCY, rate, scaled_batch, widened
from placement.cli import cli
from placement.cluster import ClusterState, Ints, Placement, PlacementError, Pod
from placement.policies.room import held_below, room_below
from placement.policies.seed003 import RESOLUTION, Seed003, scarcity
from placement.registry import Policy, make, names, register
from placement.timeline import MIGRATION_SECONDS, Stats, replay_in_time
from tests.placement.conftest import nodes, pod

RNG = np.random.default_rng(0)


def grouped(name: str, **constraints: object) -> Pod:
    return dataclasses.replace(pod(name, gpus=1, milli=100), **constraints)  # type: ignore[arg-type]


def ready(policy: str, state: ClusterState, *expected: Pod) -> Policy:
    chooser = make(policy)
    chooser.setup(state, expected or [pod("typical", gpus=1, milli=100)])
    return chooser


def decide_and_place(state: ClusterState, policy: str, p: Pod) -> Placement | None:
    where = ready(policy, state).decide(state, p, RNG)
    if where is not None:
        state.carry_out(p, where)
    return where


# -- constraints --------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["bestfit", "fgd", "gpushare", "seed000", "seed003"])
def test_together_puts_a_gang_on_the_node_of_its_first(policy: str) -> None:
    state = ClusterState(nodes(*[(64000, 0, 8, "A")] * 3))
    decide_and_place(state, "random", pod("filler", gpus=2))  # nodes differ in what is left
    first = decide_and_place(state, policy, grouped("g0", group="job", together=("job",)))
    assert first is not None
    for i in range(1, 6):
        where = decide_and_place(state, policy, grouped(f"g{i}", group="job", together=("job",)))
        assert where is not None and where.node == first.node


def test_together_waits_when_the_group_s_node_is_full() -> None:
    state = ClusterState(nodes((8000, 0, 1, "A"), (8000, 0, 1, "A")))
    state.place(pod("a", gpus=1).__class__("a", 1000, 0, 1, 1000, group="job"), Placement(0, (0,)))
    follower = dataclasses.replace(pod("b"), group="job", together=("job",))
    assert state.feasible(follower).tolist() == [False, False]  # node 1 is free but apart
    # Nor does migration move the gang's first away to make room: it is tied there.
    assert ready("gpushare", state).decide(state, follower, RNG) is None


def test_apart_spreads_replicas_and_is_kept_both_ways() -> None:
    state = ClusterState(nodes(*[(64000, 0, 8, "A")] * 3))
    for i in range(3):
        where = decide_and_place(state, "bestfit", grouped(f"r{i}", group="web", apart=("web",)))
        assert where is not None and where.node == i  # best fit would stack them: it may not
    assert make("bestfit").decide(state, grouped("r3", group="web", apart=("web",)), RNG) is None
    # A task of another group that keeps apart from "web" finds no node either; a "web"
    # task with no constraint of its own may not join a node whose task keeps apart from it.
    assert not state.feasible(grouped("x", group="db", apart=("web",))).any()
    state2 = ClusterState(nodes((64000, 0, 8, "A"), (64000, 0, 8, "A")))
    state2.place(grouped("loner", group="db", apart=("web",)), Placement(0, (0,)))
    assert state2.feasible(grouped("w", group="web")).tolist() == [False, True]
    state2.remove("loner")
    assert state2.feasible(grouped("w", group="web")).tolist() == [True, True]
    assert state2.repel_count == {} and state2.group_count == {}


def test_near_prefers_the_group_s_node_but_does_not_wait_for_it() -> None:
    state = ClusterState(nodes((64000, 0, 2, "A"), (64000, 0, 8, "A")))
    state.place(grouped("data", group="cache"), Placement(1, (0,)))
    # Best fit alone picks node 0 (the fuller one); near the cache it is node 1.
    assert make("bestfit").decide(state, grouped("plain"), RNG) == Placement(0, (0,))
    assert make("bestfit").decide(state, grouped("n", near=("cache",)), RNG).node == 1  # type: ignore[union-attr]
    state.place(pod("fill", gpus=7), Placement(1, tuple(range(1, 8))))
    big = dataclasses.replace(pod("big", gpus=2), near=("cache",))
    assert make("bestfit").decide(state, big, RNG) == Placement(0, (0, 1))


def test_place_refuses_a_decision_that_breaks_a_constraint() -> None:
    state = ClusterState(nodes((64000, 0, 8, "A"), (64000, 0, 8, "A")))
    state.place(grouped("a", group="g"), Placement(0, (0,)))
    with pytest.raises(PlacementError, match="does not fit"):
        state.place(grouped("b", apart=("g",)), Placement(0, (1,)))
    with pytest.raises(PlacementError, match="both together with and apart"):
        grouped("c", group="g", together=("g",), apart=("g",))


def test_copies_keep_their_own_group_counts() -> None:
    state = ClusterState(nodes((64000, 0, 8, "A"), (64000, 0, 8, "A")))
    trial = state.copy()
    trial.place(grouped("a", group="g"), Placement(1, (0,)))
    assert "g" not in state.group_count and trial.group_count["g"].tolist() == [0, 1]


# -- priority preemption ------------------------------------------------------------


def test_a_higher_priority_task_preempts_the_lowest_priority_ones_first() -> None:
    state = ClusterState(nodes((64000, 0, 2, "A"), (64000, 0, 2, "A")))
    for name, prio, node, gpu in [
        ("low", 1, 0, 0),
        ("mid", 5, 0, 1),
        ("hi1", 5, 1, 0),
        ("hi2", 5, 1, 1),
    ]:
        state.place(dataclasses.replace(pod(name), priority=prio), Placement(node, (gpu,)))
    urgent = dataclasses.replace(pod("urgent"), priority=9)
    where = ready("gpushare", state).decide(state, urgent, RNG)
    assert where is not None and where.evict == ("low",) and where.node == 0
    # A task of priority 5 may preempt only the one of 1; one of priority 1, nobody.
    peer = dataclasses.replace(pod("peer"), priority=5)
    where = ready("seed003", state).decide(state, peer, RNG)
    assert where is not None and where.evict == ("low",)
    blocked = dataclasses.replace(pod("blocked"), priority=1)
    assert ready("seed003", state).decide(state, blocked, RNG) is None


def test_precedence_orders_priority_before_class() -> None:
    ls0 = pod("a", qos="LS")
    be0 = pod("b", qos="BE")
    be1 = dataclasses.replace(pod("c", qos="BE"), priority=1)
    assert be0.precedence < ls0.precedence < be1.precedence
    state = ClusterState(nodes((64000, 0, 2, "A")))
    state.place(ls0, Placement(0, (0,)))
    state.place(be0, Placement(0, (1,)))
    # A best-effort task of priority 1 may stop both; a latency-sensitive one of 0 only
    # the best-effort one (seed 000's rule); a best-effort one of 0, nobody.
    held = held_below(state, be1)
    assert held is not None and held[2][0, :2].tolist() == [1000, 1000]
    held = held_below(state, pod("d", qos="LS"))
    assert held is not None and held[2][0, :2].tolist() == [0, 1000]
    assert held_below(state, pod("e", qos="BE")) is None


def test_preempted_tasks_are_requeued_and_resume_with_their_work() -> None:
    cluster = nodes((8000, 1000, 1, "T4"))
    low = dataclasses.replace(pod("low"), created=0.0, deleted=100.0)
    high = dataclasses.replace(pod("high"), priority=3, created=10.0, deleted=30.0)
    r = replay_in_time(cluster, [low, high], "seed003")
    # high preempts low at 10 and ends at 30; low resumes with 90 s to go: ends at 120.
    assert r.evicted == 1 and r.wait["LS"].max == 0.0
    assert r.jct["LS"] == Stats(2, (20 + 120) / 2, 120.0, 120.0)


def test_the_queue_of_the_highest_priority_goes_first() -> None:
    cluster = nodes((8000, 1000, 1, "T4"))
    first = dataclasses.replace(pod("first", qos="BE"), created=0.0, deleted=100.0)
    ls = dataclasses.replace(pod("ls"), created=1.0, deleted=2.0)  # waits: same priority
    be9 = dataclasses.replace(pod("be9", qos="BE"), priority=9, created=2.0, deleted=3.0)
    r = replay_in_time(cluster, [first, ls, be9], "bestfit")  # bestfit preempts nobody
    # At 100 both wait; the priority-9 one runs first (100 to 101), then ls (101 to 102).
    assert r.jct["BE"] == Stats(2, (100 + 99) / 2, 100.0, 100.0)
    assert r.jct["LS"].max == 101.0


# -- heterogeneous matching ---------------------------------------------------------


def test_scarcity_counts_a_task_of_k_models_one_kth_on_each() -> None:
    state = ClusterState(nodes((8000, 0, 4, "A"), (8000, 0, 4, "B")))
    expected = [pod("x", gpus=2, spec=("A",)), pod("y", gpus=2, spec=("A", "B")), pod("z", gpus=8)]
    # A: 2 + 1 GPUs of 4; B: 1 of 4; z accepts any and counts nowhere.
    assert scarcity(state, expected).tolist() == [3 * RESOLUTION // 4, RESOLUTION // 4]


def test_seed003_keeps_the_sought_model_for_the_tasks_bound_to_it() -> None:
    cluster = nodes((8000, 0, 2, "V100"), (8000, 0, 4, "T4"))
    bound = [pod(f"v{i}", spec=("V100",)) for i in range(2)]
    free = pod("any", gpus=1)
    for policy, expect in (("bestfit", 0), ("seed003", 1)):
        state = ClusterState(cluster)
        chooser = make(policy)
        chooser.setup(state, [free, *bound])
        where = chooser.decide(state, free, RNG)
        assert where is not None and where.node == expect, policy
        state.place(free, where)
        placed = [decide_and_place(state, policy, b) for b in bound]
        assert (None in placed) == (policy == "bestfit")


# -- batch-size adaptation ----------------------------------------------------------


def test_widening_doubles_whole_gpus_only_and_within_a_node() -> None:
    assert widened(pod("a", gpus=2)) == dataclasses.replace(pod("a", gpus=2), num_gpu=4)
    assert widened(pod("b", gpus=1, milli=500)) is None
    assert widened(pod("c", gpus=0)) is None
    assert widened(pod("d", gpus=8)) is None
    assert scaled_batch(6000, 2, 4) == 12000  # seed 003's example
    with pytest.raises(PlacementError):
        scaled_batch(6000, 2, 3)
    assert rate(2, 2) == 1.0 and rate(2, 4) == pytest.approx(2 * SCALING_EFFICIENCY)


def test_an_adapted_job_runs_on_twice_its_gpus_and_finishes_sooner() -> None:
    cluster = nodes((8000, 1000, 4, "T4"))
    job = dataclasses.replace(pod("train", gpus=2), created=0.0, deleted=180.0)
    plain = replay_in_time(cluster, [job], "bestfit")
    wide = replay_in_time(cluster, [job], "bestfit", adapt=True)
    assert plain.jct["LS"].max == 180.0 and plain.adapted == 0
    assert wide.adapted == 1
    speed = ADAPT_FACTOR * SCALING_EFFICIENCY
    assert wide.jct["LS"].max == pytest.approx(180.0 / speed)
    assert wide.gpu_hours == pytest.approx(4 * 180.0 / speed / 3600)
    assert wide.adapted_gpu_hours == pytest.approx(wide.gpu_hours)


def test_no_job_is_adapted_while_another_waits_or_where_no_node_has_room() -> None:
    cluster = nodes((8000, 1000, 4, "T4"))
    a = dataclasses.replace(pod("a", gpus=2), created=0.0, deleted=100.0)
    b = dataclasses.replace(pod("b", gpus=2), created=0.0, deleted=100.0)
    r = replay_in_time(cluster, [a, b], "bestfit", adapt=True)
    # a starts while b waits: not adapted; b then has room for 2 GPUs only.
    assert r.adapted == 0 and r.jct["LS"].max == 100.0
    three = dataclasses.replace(pod("c", gpus=3), created=0.0, deleted=100.0)
    assert replay_in_time(cluster, [three], "bestfit", adapt=True).adapted == 0


class _Spreads(Seed003):
    """Seed 003's rules, on the node with the most free GPU (worst fit)."""

    def score(self, state: ClusterState, p: Pod, nodes: Ints, rng: np.random.Generator) -> Ints:
        free: Ints = state.gpu_left[nodes].sum(axis=1)
        return free


if "test-spreads" not in names():  # this module imported once more in a process
    register("test-spreads", "worst fit with seed 003's room making, for the test below")(_Spreads)


def test_migration_can_be_turned_off() -> None:
    # x and y spread, one on each node; z wants 2 GPUs of one node: y moves to x's.
    cluster = nodes((8000, 1000, 2, "T4"), (8000, 1000, 2, "T4"))
    x = dataclasses.replace(pod("x"), created=0.0, deleted=1000.0)
    y = dataclasses.replace(pod("y"), created=0.0, deleted=1000.0)
    z = dataclasses.replace(pod("z", gpus=2), created=10.0, deleted=20.0)
    with_moves = replay_in_time(cluster, [x, y, z], "test-spreads")
    without = replay_in_time(cluster, [x, y, z], "test-spreads", migrate=False)
    assert with_moves.migrations == 1 and with_moves.wait["LS"].max == 0.0
    assert without.migrations == 0 and without.wait["LS"].max == 990.0


# -- the trace's columns and the command --------------------------------------------


def test_replay_reads_priorities_and_constraints_and_adapts(tmp_path: Path) -> None:
    (tmp_path / "n.csv").write_text(
        "sn,cpu_milli,memory_mib,gpu,model\nn0,64000,1000,8,T4\nn1,64000,1000,8,T4\n"
    )
    (tmp_path / "p.csv").write_text(
        "name,cpu_milli,num_gpu,gpu_milli,creation_time,deletion_time,priority,group,apart\n"
        "web0,1000,1,100,0,1000,0,web,web\n"
        "web1,1000,1,100,0,1000,0,web,web\n"
        "train,1000,2,1000,5,185,3,,\n"
    )
    args = ["replay", "--nodes", str(tmp_path / "n.csv"), "--pods", str(tmp_path / "p.csv")]
    r = CliRunner().invoke(cli, [*args, "--policy", "seed003", "--adapt", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    # The replicas keep apart (one per node: neither is adapted, having no whole GPUs);
    # the job starts alone at 5 and runs on 4 GPUs: 180 s of work at 1.8 times the speed.
    assert doc["adapted"] == 1 and doc["narrowed"] == 0
    assert doc["adapt"] is True and doc["migrate"] is True
    assert doc["jct"]["LS"]["max"] == pytest.approx(1000.0)
    assert doc["jct"]["LS"]["mean"] == pytest.approx((1000 + 1000 + 100) / 3, abs=0.1)
    plain = CliRunner().invoke(cli, [*args, "--policy", "seed003", "--no-migrate"])
    assert plain.exit_code == 0 and "adapted" not in plain.output, plain.output
    (tmp_path / "bad.csv").write_text(
        "name,cpu_milli,num_gpu,gpu_milli,priority\nx,1000,1,1000,high\n"
    )
    files = ["--nodes", str(tmp_path / "n.csv"), "--pods", str(tmp_path / "bad.csv")]
    bad = CliRunner().invoke(cli, ["replay", *files, "--policy", "fgd"])
    assert bad.exit_code == 65 and "bad.csv:2: priority 'high' is not valid" in bad.output


def test_an_adapted_job_is_narrowed_back_for_a_pod_that_finds_no_room() -> None:
    cluster = nodes((8000, 1000, 4, "T4"))
    job = dataclasses.replace(pod("train", gpus=2), created=0.0, deleted=180.0)
    late = dataclasses.replace(pod("late", gpus=1), created=10.0, deleted=20.0)
    r = replay_in_time(cluster, [job, late], "bestfit", adapt=True)
    # train runs 0-10 on 4 GPUs (18 s of work at 1.8x), is narrowed back to 2 GPUs at
    # 10 for a checkpoint's worth, and does the remaining 162 + 60 s at its own size.
    assert (r.adapted, r.narrowed) == (1, 1)
    assert r.wait["LS"].max == 0.0  # late starts at 10, beside it
    speed = ADAPT_FACTOR * SCALING_EFFICIENCY
    assert r.jct["LS"].max == pytest.approx(10 + (180 - 10 * speed) + MIGRATION_SECONDS)
    gpu_seconds = 4 * 10 + 2 * (180 - 10 * speed + MIGRATION_SECONDS) + 1 * 10
    assert r.gpu_hours == pytest.approx(gpu_seconds / 3600)
    # A pod the narrowing would not make room for (3 GPUs: 2 free at most) waits instead.
    big = dataclasses.replace(pod("big", gpus=3), created=10.0, deleted=20.0)
    r = replay_in_time(cluster, [job, big], "bestfit", adapt=True)
    assert r.narrowed == 0 and r.wait["LS"].max == pytest.approx(180 / speed - 10)


# -- constraints meet displacement and narrowing ------------------------------------


def test_displacement_evicts_what_keeps_a_task_away_but_never_its_gang() -> None:
    state = ClusterState(nodes((8000, 1000, 2, "T4")))
    state.place(grouped("h", group="H", qos="BE"), Placement(0, (0,)))
    keeps_off = grouped("p", apart=("H",))
    for policy in ("gpushare", "seed000", "seed003"):  # GPU 1 is free: only "h" is in the way
        where = ready(policy, state).decide(state, keeps_off, RNG)
        assert where is not None and where.evict == ("h",), policy
    repelling = ClusterState(nodes((8000, 1000, 2, "T4")))
    repelling.place(grouped("r", apart=("P",), qos="BE"), Placement(0, (0,)))
    where = ready("seed003", repelling).decide(repelling, grouped("q", group="P"), RNG)
    assert where is not None and where.evict == ("r",)
    # A task must be together with group G, whose only task is best-effort on a full
    # node: evicting it would let the task go anywhere, so it waits.
    gang = ClusterState(nodes((8000, 1000, 1, "T4"), (8000, 1000, 1, "T4")))
    gang.place(dataclasses.replace(pod("g", qos="BE"), group="G"), Placement(0, (0,)))
    gang.place(pod("x"), Placement(1, (0,)))
    follower = dataclasses.replace(pod("f"), together=("G",))
    assert ready("seed003", gang).decide(gang, follower, RNG) is None
    assert not room_below(gang, follower)


def test_room_below_heeds_the_constraints_displacement_cannot_lift() -> None:
    state = ClusterState(nodes((8000, 1000, 1, "T4")))
    state.place(dataclasses.replace(pod("h", gpus=0), group="H"), Placement(0, ()))
    state.place(pod("e", qos="BE"), Placement(0, (0,)))
    apart = dataclasses.replace(pod("p"), apart=("H",))  # "h" is latency-sensitive: it stays
    assert ready("seed003", state).decide(state, apart, RNG) is None
    assert not room_below(state, apart)
    assert room_below(state, pod("free"))  # without the constraint, "e" would make room


def test_narrowing_keeps_a_task_whose_constraint_no_longer_holds() -> None:
    # j joins G on node a and is widened there; G's task leaves, another lands on node
    # b; narrowing j for p must not check j's constraint again ("ignored during
    # execution"): it does not move.
    cluster = nodes((64000, 1000, 2, "T4"), (64000, 1000, 2, "T4"))
    pods = [
        Pod("g1", 1000, 0, apart=("Y",), group="G", created=0, deleted=100),
        Pod("y", 1000, 0, num_gpu=2, gpu_milli=1000, group="Y", created=0, deleted=10000),
        Pod("j", 1000, 0, num_gpu=1, gpu_milli=1000, together=("G",), created=1, deleted=5000),
        Pod("g2", 1000, 0, group="G", near=("Y",), created=200, deleted=10000),
        Pod("p", 1000, 0, num_gpu=1, gpu_milli=1000, created=300, deleted=400),
    ]
    for policy in ("seed003", "gpushare"):
        r = replay_in_time(cluster, pods, policy, adapt=True)
        assert (r.adapted, r.narrowed, r.completed) == (1, 1, 5), policy
        assert r.wait["LS"].max == 0.0


def test_narrow_shrinks_a_task_in_place_only() -> None:
    state = ClusterState(nodes((8000, 1000, 4, "T4")))
    state.place(pod("w", gpus=4), Placement(0, (0, 1, 2, 3)))
    with pytest.raises(PlacementError, match="cannot narrow"):
        state.narrow("w", pod("w", gpus=2), (0, 5))
    with pytest.raises(PlacementError, match="GPU count only"):
        state.narrow("w", pod("w", gpus=2, cpu=5), (0, 1))
    state.narrow("w", pod("w", gpus=2), (0, 1))
    assert state.gpu_left[0, :4].tolist() == [0, 0, 1000, 1000]
    assert state.placed["w"][1] == Placement(0, (0, 1))


def test_a_task_together_with_and_apart_from_one_group_is_refused() -> None:
    with pytest.raises(PlacementError, match="both together with and apart from group X"):
        dataclasses.replace(pod("c"), together=("X",), apart=("X",))


def test_narrowing_takes_as_few_adapted_jobs_of_one_node_as_make_room() -> None:
    cluster = nodes((8000, 1000, 8, "T4"))
    a = dataclasses.replace(pod("a", gpus=2), created=0.0, deleted=1000.0)
    b = dataclasses.replace(pod("b", gpus=2), created=1.0, deleted=1000.0)
    # a and b each start alone on 4 GPUs: the node is full. c wants 3: narrowing b (the
    # latest) frees 2, so a is narrowed too; a pod of 2 needs b's alone.
    c = dataclasses.replace(pod("c", gpus=3), created=5.0, deleted=10.0)
    r = replay_in_time(cluster, [a, b, c], "bestfit", adapt=True)
    assert (r.adapted, r.narrowed) == (2, 2) and r.wait["LS"].max == 0.0
    one = dataclasses.replace(pod("c", gpus=2), created=5.0, deleted=10.0)
    r = replay_in_time(cluster, [a, b, one], "bestfit", adapt=True)
    assert (r.adapted, r.narrowed) == (2, 1) and r.wait["LS"].max == 0.0
