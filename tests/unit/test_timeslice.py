"""nodemgr.policy.timeslice, case by case: shapes, a time-sliced GPU's charge and slices, admission
through the scheduler, and turns (docs/timeslicing.md)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from nodemgr.host.ledger import TASK_TIMESLICED
from nodemgr.policy import scheduler, timeslice
from nodemgr.policy.timeslice import Gate, Member, Situation, Turns

GiB = 1 << 30
MiB = 1 << 20
Q = {"a": 8 * GiB, "b": 8 * GiB}


# --- shapes ------------------------------------------------------------------------------


def test_unknown_shape_is_the_quota_all_persistent() -> None:
    s = timeslice.shape(Member("t", "a", 0), 8 * GiB)
    assert (s.persistent, s.temporary, s.kind) == (8 * GiB, 0, "unknown")


def test_estimate_shape_is_the_request() -> None:
    s = timeslice.shape(Member("t", "a", 0, (2 * GiB, 1 * GiB)), 8 * GiB)
    assert (s.persistent, s.temporary, s.kind) == (2 * GiB, 1 * GiB, "estimate")


def test_learned_after_a_release_and_a_second_boundary() -> None:
    m = Member("t", "a", 0, (2 * GiB, GiB), used=3 * GiB, persistent=3 * GiB, temp_peak=GiB // 2)
    # Not yet: one boundary and a release, or two boundaries without one.
    for it, rel in ((1, 1), (2, 0), (0, 0)):
        m1 = Member(**{**m.__dict__, "settled": GiB, "iterations": it, "releases": rel})
        assert timeslice.shape(m1, 8 * GiB).kind == "estimate"
    m2 = Member(**{**m.__dict__, "settled": GiB, "iterations": 2, "releases": 1})
    s = timeslice.shape(m2, 8 * GiB)
    assert (s.persistent, s.temporary, s.kind) == (GiB, GiB // 2, "learned")


def test_no_boundaries_charges_all_used_as_persistent() -> None:
    m = Member("t", "a", 0, (GiB, GiB), used=5 * GiB)
    s = timeslice.shape(m, 8 * GiB)
    # What it holds beyond its temporary figure is persistent: charged 4 + 1, all it holds.
    assert (s.persistent, s.temporary, s.kind) == (4 * GiB, GiB, "estimate")
    # An estimated task in its first step, within its estimate, is charged its estimate.
    m = Member("t", "a", 0, (GiB, 6 * GiB), used=7 * GiB)
    assert timeslice.shape(m, 8 * GiB).persistent == GiB
    # Unknown: the quota already covers what it holds.
    assert timeslice.shape(Member("t", "a", 0, used=5 * GiB), 8 * GiB).persistent == 8 * GiB
    # Once it reports boundaries, its split counts.
    m = Member("t", "a", 0, (GiB, GiB), used=5 * GiB, persistent=4 * GiB, iterations=1)
    assert timeslice.shape(m, 8 * GiB).persistent == GiB


# --- charge and slices --------------------------------------------------------------------


def test_charge_sums_slices_and_guards_plus_the_largest_temporary() -> None:
    ms = [
        Member("t1", "a", 100 * MiB, (2 * GiB, 1 * GiB)),
        Member("t2", "b", 100 * MiB, (3 * GiB, 2 * GiB)),
    ]
    c = timeslice.charge(ms, Q)
    assert c.persistent == 5 * GiB + 200 * MiB
    assert c.temporary == 2 * GiB
    assert c.total == 7 * GiB + 200 * MiB
    assert [(x.task_id, x.offset, x.guard, x.shape) for x in c.slices] == [
        ("t1", 0, 100 * MiB, "estimate"),
        ("t2", 2 * GiB + 100 * MiB, 100 * MiB, "estimate"),
    ]


def test_an_environment_is_charged_at_most_its_quota() -> None:
    ms = [Member("t1", "a", 0, (5 * GiB, GiB)), Member("t2", "a", 0, (5 * GiB, 2 * GiB))]
    c = timeslice.charge(ms, Q)
    assert (c.persistent, c.temporary) == (8 * GiB, 2 * GiB)
    # Two unknown tasks of one environment cost what a shared GPU charges: one quota.
    ms = [Member("t1", "a", MiB), Member("t2", "a", MiB)]
    assert timeslice.charge(ms, Q).total == 8 * GiB


def test_extra_is_what_a_new_task_adds() -> None:
    ms = [Member("t1", "a", 0, (2 * GiB, GiB))]
    assert timeslice.extra(ms, Q, Member("", "b", 0, (GiB, GiB // 2))) == GiB
    assert timeslice.extra(ms, Q, Member("", "b", 0, (GiB, 3 * GiB))) == 3 * GiB
    assert timeslice.extra(ms, Q, Member("", "b", 0)) == 8 * GiB
    # Its environment at its cap: nothing more, unless the temporary region grows.
    capped = [Member("t1", "a", 0, (8 * GiB, GiB))]
    assert timeslice.extra(capped, Q, Member("", "a", 0, (GiB, GiB))) == 0
    assert timeslice.extra(capped, Q, Member("", "a", 0, (GiB, 2 * GiB))) == GiB
    assert timeslice.extra([], Q, Member("", "a", 100 * MiB, (GiB, GiB))) == 2 * GiB + 100 * MiB


# --- admission through the scheduler -------------------------------------------------------


def view(index: int, tasks: int, free: int, extra: int | None) -> scheduler.GpuView:
    return scheduler.GpuView(index, tasks, 16 * GiB, free, True, extra)


def test_scheduler_admits_on_a_time_sliced_gpu_by_its_extra() -> None:
    ask = scheduler.Ask(1, 1, 8 * GiB, {})
    # Shared: 6 GiB free cannot take an 8 GiB quota; time-sliced, 2 GiB of extra fits.
    assert isinstance(scheduler.select(ask, [view(0, 1, 6 * GiB, None)], 4), scheduler.Refusal)
    assert scheduler.select(ask, [view(0, 1, 6 * GiB, 2 * GiB)], 4) == scheduler.Choice((0,), (0,))
    assert isinstance(scheduler.select(ask, [view(0, 1, 1 * GiB, 2 * GiB)], 4), scheduler.Refusal)


def test_scheduler_reuses_a_time_sliced_gpu_only_with_room() -> None:
    ask = scheduler.Ask(1, 1, 8 * GiB, {0: 1})
    assert scheduler.select(ask, [view(0, 1, GiB, 0)], 4) == scheduler.Choice((0,), ())
    r = scheduler.select(ask, [view(0, 1, GiB, 2 * GiB)], 4)
    assert isinstance(r, scheduler.Refusal) and r.code == "no_resources"
    # A shared GPU is reused without a check, even over its capacity
    # (docs/scheduling.md#the-algorithm, step 5).
    assert scheduler.select(ask, [view(0, 1, -GiB, None)], 4) == scheduler.Choice((0,), ())


def test_scheduler_ranks_time_sliced_gpus_by_room_left_after_the_task() -> None:
    ask = scheduler.Ask(1, 1, 8 * GiB, {})
    # GPU 0 has more free memory, but the task would add more there than it leaves.
    gpus = [view(0, 1, 10 * GiB, 9 * GiB), view(1, 1, 8 * GiB, 2 * GiB)]
    assert scheduler.select(ask, gpus, 4) == scheduler.Choice((1,), (1,))


def test_an_estimate_above_the_quota_is_refused() -> None:
    ask = scheduler.Ask(1, 1, 8 * GiB, {}, estimate=(6 * GiB, 3 * GiB))
    r = scheduler.select(ask, [view(0, 0, 16 * GiB, 9 * GiB)], 4)
    assert isinstance(r, scheduler.Refusal) and r.code == "quota_exceeded"


# --- turns ---------------------------------------------------------------------------------


def sit(
    on: Mapping[int, Sequence[str]],
    now: float,
    iterations: Mapping[str, int] | None = None,
    tasks: Mapping[str, Sequence[int]] | None = None,
    quantum: int = 4,
) -> Situation:
    if tasks is None:
        t: dict[str, list[int]] = {}
        for gpu, ids in on.items():
            for i in ids:
                t.setdefault(i, []).append(gpu)
        tasks = t
    return Situation(on, tasks, dict(iterations or {}), now, quantum)


def test_flag_matches_the_ledger() -> None:
    assert timeslice.FLAG_TIMESLICED == TASK_TIMESLICED


def test_a_single_task_is_never_gated() -> None:
    p = timeslice.settle(Turns(), sit({0: ["a"]}, 0.0))
    assert p.turns.gpus == {}
    assert p.gates == {"a": Gate(False, 0, timeslice.FLAG_TIMESLICED)}
    # Its yield changes nothing.
    y = timeslice.yield_turn(p.turns, sit({0: ["a"]}, 1.0), "a")
    assert not y.passed and y.gates == p.gates


def test_tasks_on_shared_gpus_carry_no_flag() -> None:
    p = timeslice.settle(Turns(), sit({}, 0.0, tasks={"a": [1]}))
    assert p.gates == {"a": Gate(False, 0, 0)}


def test_a_second_task_gates_and_the_first_holds() -> None:
    p = timeslice.settle(Turns(), sit({0: ["a"]}, 0.0))
    p = timeslice.settle(p.turns, sit({0: ["a", "b"]}, 1.0, {"a": 10}))
    turn = p.turns.gpus[0]
    assert turn.holder == "a" and turn.order() == ["a", "b"]
    assert p.gates["a"] == Gate(False, 14, 1)
    assert p.gates["b"] == Gate(True, 0, 1)
    assert p.handed == ()  # gating started: nothing was handed on
    # A task left alone is ungated.
    p = timeslice.settle(p.turns, sit({0: ["b"]}, 2.0))
    assert p.turns.gpus == {} and p.gates == {"b": Gate(False, 0, 1)}


def test_yield_passes_the_turn_round_three_tasks() -> None:
    p = timeslice.settle(Turns(), sit({0: ["a", "b", "c"]}, 0.0))
    assert p.turns.gpus[0].order() == ["a", "b", "c"]
    holders = []
    now = 0.0
    for _ in range(6):
        turn = p.turns.gpus[0]
        expected_next = turn.order()[1]
        now += 1.0
        assert turn.holder is not None
        p = timeslice.yield_turn(
            p.turns, sit({0: ["a", "b", "c"]}, now, {"a": 4, "b": 4}), turn.holder
        )
        assert p.passed and p.turns.gpus[0].holder == expected_next
        assert p.handed == (0,)
        holders.append(p.turns.gpus[0].holder)
    # Equal turns: a plain round.
    assert holders == ["b", "c", "a", "b", "c", "a"]
    # The new holder's turn ends a quantum after its boundary count now.
    assert p.gates["a"].turn_until == 8 and not p.gates["a"].gated
    assert p.gates["b"].gated and p.gates["b"].turn_until == 0


def test_next_is_the_least_held_then_the_longest_waiting() -> None:
    p = timeslice.settle(Turns(), sit({0: ["a", "b", "c"]}, 0.0))
    p = timeslice.yield_turn(p.turns, sit({0: ["a", "b", "c"]}, 5.0), "a")  # a held 5
    p = timeslice.yield_turn(p.turns, sit({0: ["a", "b", "c"]}, 6.0), "b")  # b held 1
    p = timeslice.yield_turn(p.turns, sit({0: ["a", "b", "c"]}, 8.0), "c")  # c held 2
    # b (1s) goes before c (2s) and a (5s).
    assert p.turns.gpus[0].holder == "b"
    assert p.turns.gpus[0].order() == ["b", "c", "a"]


def test_a_new_task_starts_at_the_least_time_of_the_others() -> None:
    p = timeslice.settle(Turns(), sit({0: ["a", "b"]}, 0.0))
    p = timeslice.yield_turn(p.turns, sit({0: ["a", "b"]}, 10.0), "a")  # a 10, b holds
    p = timeslice.settle(p.turns, sit({0: ["a", "b", "c"]}, 13.0))  # b has 3 so far
    turn = p.turns.gpus[0]
    assert turn.held["c"] == 3.0
    # c waits less than a but has held less: it goes next; a after it.
    assert turn.order() == ["b", "c", "a"]


def test_ties_go_to_the_longest_waiting() -> None:
    p = timeslice.settle(Turns(), sit({0: ["a", "b"]}, 0.0))
    p = timeslice.settle(p.turns, sit({0: ["a", "b", "c"]}, 0.0))
    # b and c both at 0 held; b has waited since 0, c too: arrival breaks the tie.
    assert p.turns.gpus[0].order() == ["a", "b", "c"]
    turns = p.turns
    g = turns.gpus[0]
    g2 = timeslice.GpuTurn(g.holder, g.since, g.held, {"b": 5.0, "c": 1.0}, g.arrival)
    assert g2.order() == ["a", "c", "b"]


def test_a_yield_with_nobody_to_pass_to_changes_nothing() -> None:
    # b has gone: a is alone on the GPU, ungated, and keeps running.
    p = timeslice.settle(Turns(), sit({0: ["a", "b"]}, 0.0, {"a": 4}))
    assert p.gates["a"] == Gate(False, 8, 1)
    y = timeslice.yield_turn(p.turns, sit({0: ["a"]}, 1.0, {"a": 8}), "a")
    assert not y.passed and y.gates["a"] == Gate(False, 0, 1)
    # A yield from a task that holds no turn changes nothing.
    y = timeslice.yield_turn(p.turns, sit({0: ["a", "b"]}, 1.0, {"a": 6}), "b")
    assert not y.passed and y.gates == p.gates and y.turns.gpus[0].holder == "a"


def test_a_departed_holder_hands_on_at_once() -> None:
    p = timeslice.settle(Turns(), sit({0: ["a", "b", "c"]}, 0.0, {"b": 2}))
    p = timeslice.settle(p.turns, sit({0: ["b", "c"]}, 1.0, {"b": 2}))
    assert p.turns.gpus[0].holder == "b"
    assert p.gates["b"] == Gate(False, 6, 1) and p.gates["c"].gated
    assert p.handed == (0,)


def test_timeout_passes_the_turn_of_a_holder_that_never_yields() -> None:
    p = timeslice.settle(Turns(), sit({0: ["a", "b"]}, 0.0))
    e = timeslice.expire(p.turns, sit({0: ["a", "b"]}, 5.0), 10.0)
    assert e.turns.gpus[0].holder == "a" and e.handed == ()
    e = timeslice.expire(p.turns, sit({0: ["a", "b"]}, 10.5), 10.0)
    assert e.turns.gpus[0].holder == "b" and e.handed == (0,)
    assert e.gates["a"].gated and not e.gates["b"].gated


def test_mode_change_to_shared_ungates() -> None:
    p = timeslice.settle(Turns(), sit({0: ["a", "b"]}, 0.0))
    assert p.gates["b"].gated
    p = timeslice.settle(p.turns, sit({}, 1.0, tasks={"a": [0], "b": [0]}))
    assert p.turns.gpus == {}
    assert p.gates == {"a": Gate(False, 0, 0), "b": Gate(False, 0, 0)}


def test_a_task_on_two_gated_gpus_runs_only_holding_both() -> None:
    tasks = {"x": [0, 1], "y": [0], "z": [1]}
    on = {0: ["y", "x"], 1: ["x", "z"]}
    p = timeslice.settle(Turns(), sit(on, 0.0, tasks=tasks))
    # GPU 0: y arrived first and runs; x could not then hold GPU 1 too, so z gets it.
    assert p.turns.gpus[0].holder == "y" and p.turns.gpus[1].holder == "z"
    assert p.gates["x"].gated and not p.gates["y"].gated and not p.gates["z"].gated
    # y yields: x cannot run (z runs on GPU 1), so it takes GPU 0 alone and waits there.
    p = timeslice.yield_turn(p.turns, sit(on, 1.0, tasks=tasks), "y")
    assert p.turns.gpus[0].holder == "x" and p.gates["x"].gated
    # z yields: x now holds both and runs.
    p = timeslice.yield_turn(p.turns, sit(on, 2.0, tasks=tasks), "z")
    assert p.turns.gpus[1].holder == "x"
    assert p.gates["x"] == Gate(False, 4, 1)
    # Its yield ends both turns.
    p = timeslice.yield_turn(p.turns, sit(on, 3.0, {"x": 4}, tasks=tasks), "x")
    assert p.passed
    assert p.turns.gpus[0].holder == "y" and p.turns.gpus[1].holder == "z"
    assert p.gates["x"].gated


def running(p: timeslice.Plan) -> set[str]:
    return {t for t, g in p.gates.items() if not g.gated and g.turn_until}


def test_tasks_on_two_gpus_do_not_each_hold_one_and_wait() -> None:
    """x and w on GPUs 0 and 1, z on GPU 0 only: x yields, w yields, z ends. Chosen GPU by
    GPU, x and w ended up holding one each, and every expiry swapped both: neither ran."""
    tasks3 = {"x": [0, 1], "w": [0, 1], "z": [0]}
    on3 = {0: ["x", "w", "z"], 1: ["x", "w"]}
    p = timeslice.settle(Turns(), sit(on3, 0.0, tasks=tasks3))
    assert running(p) == {"x"}
    # x holds its turns 2 s, w 1 s: GPU 0 alone would go to w next, GPU 1 to x.
    p = timeslice.yield_turn(p.turns, sit(on3, 2.0, {"x": 4}, tasks=tasks3), "x")
    assert running(p) == {"w"}
    p = timeslice.yield_turn(p.turns, sit(on3, 3.0, {"x": 4, "w": 4}, tasks=tasks3), "w")
    assert running(p) == {"z"}
    tasks2 = {"x": [0, 1], "w": [0, 1]}
    on2 = {0: ["x", "w"], 1: ["x", "w"]}
    p = timeslice.settle(p.turns, sit(on2, 4.0, {"x": 4, "w": 4}, tasks=tasks2))
    holders = {g: t.holder for g, t in p.turns.gpus.items()}
    assert holders[0] == holders[1] and running(p) == {holders[0]}
    # Each expiry hands both GPUs on together: one of them always runs.
    now = 4.0
    for _ in range(4):
        now += 11.0
        before = p.turns.gpus[0].holder
        p = timeslice.expire(p.turns, sit(on2, now, tasks=tasks2), 10.0)
        assert p.turns.gpus[0].holder == p.turns.gpus[1].holder != before
        assert running(p) == {p.turns.gpus[0].holder}


def test_some_task_always_runs_whatever_happens() -> None:
    """Random joins, yields, ends and expiries on three GPUs: after each, some task runs."""
    import random

    rng = random.Random(2)
    tasks: dict[str, list[int]] = {}
    turns = Turns()
    now = 0.0
    serial = 0
    for _ in range(600):
        now += 1.0
        r = rng.random()
        if r < 0.3 or len(tasks) < 2:
            serial += 1
            tasks[f"t{serial}"] = sorted(rng.sample(range(3), rng.randint(1, 3)))
        elif r < 0.45:
            del tasks[rng.choice(sorted(tasks))]
        on: dict[int, list[str]] = {}
        for t, gs in tasks.items():
            for g in gs:
                on.setdefault(g, []).append(t)
        s = sit(on, now, {t: 1 for t in tasks}, tasks=tasks)
        if r < 0.45:
            p = timeslice.settle(turns, s)
        elif r < 0.9:
            p = timeslice.yield_turn(turns, s, rng.choice(sorted(tasks)))
        else:
            p = timeslice.expire(turns, s, 0.5)
        turns = p.turns
        if turns.gpus:
            assert running(p), (tasks, {g: t.holder for g, t in turns.gpus.items()})
        for g, turn in turns.gpus.items():
            assert turn.holder in on[g]


def test_a_task_on_two_gpus_is_not_starved_by_tasks_on_one() -> None:
    """M on GPUs 0 and 1, two single-GPU tasks on each: a single-GPU task can always take a
    free GPU whole, so M, never whole, was passed over for ever (40 yields, M ran 0 times).
    Passed over PASS_OVER times, it keeps the GPU and waits there for the other."""
    tasks = {"M": [0, 1], "S0": [0], "S0b": [0], "S1": [1], "S1b": [1]}
    on = {0: ["S0", "S0b", "M"], 1: ["S1", "S1b", "M"]}
    p = timeslice.settle(Turns(), sit(on, 0.0, tasks=tasks))
    ran = dict.fromkeys(tasks, 0)
    now = 0.0
    for i in range(40):
        now += 1.0
        r = sorted(running(p))
        assert r
        for t in r:
            ran[t] += 1
        p = timeslice.yield_turn(
            p.turns, sit(on, now, dict.fromkeys(tasks, 1), tasks), r[i % len(r)]
        )
    assert min(ran.values()) >= 4, ran


def test_every_task_runs_within_a_bounded_number_of_events() -> None:
    """Random joins, ends, yields of running tasks and expiries on three GPUs, a few tasks at
        a time: some task always runs, and every task runs within a bounded number of events of
        its arrival or its last run: at most 21 events here; a task on several GPUs passed over
    for good by single-GPU tasks, or a single-GPU task on a GPU that multi-GPU tasks always take
    first, waited up to 161."""
    import random

    bound = 0
    for seed in range(8):
        rng = random.Random(seed)
        tasks: dict[str, list[int]] = {}
        last: dict[str, int] = {}
        turns = Turns()
        serial = 0
        for ev in range(1500):
            r = rng.random()
            if len(tasks) < 2 or (r < 0.05 and len(tasks) < 6):
                serial += 1
                tasks[f"t{serial}"] = sorted(rng.sample(range(3), rng.randint(1, 3)))
                last[f"t{serial}"] = ev
            elif r < 0.1 and len(tasks) > 2:
                del tasks[rng.choice(sorted(tasks))]
            on: dict[int, list[str]] = {}
            for t, gs in tasks.items():
                for g in gs:
                    on.setdefault(g, []).append(t)
            s = sit(on, float(ev + 1), dict.fromkeys(tasks, 1), tasks=tasks)
            if r < 0.1:
                p = timeslice.settle(turns, s)
            elif r < 0.9:
                p = timeslice.settle(turns, s)
                if running(p):
                    p = timeslice.yield_turn(p.turns, s, rng.choice(sorted(running(p))))
            else:
                p = timeslice.expire(turns, s, 0.5)
            turns = p.turns
            if turns.gpus:
                assert running(p)
            for t, gate in p.gates.items():
                if not gate.gated:
                    last[t] = ev
            bound = max(bound, *(ev - last[t] for t in tasks))
            assert bound <= 60, (seed, ev, tasks)
    assert bound > 0


def test_a_holder_within_its_turn_that_reports_boundaries_is_cut_only_when_stuck() -> None:
    on = {0: ["a", "b"]}
    p = timeslice.settle(Turns(), sit(on, 0.0, {"a": 1}))
    # a's turn is 25 s old, but its count moved 2 s ago: it keeps the turn.
    s = Situation(on, {"a": [0], "b": [0]}, {"a": 3}, 25.0, 4, progress={"a": 23.0})
    e = timeslice.expire(p.turns, s, 10.0)
    assert e.turns.gpus[0].holder == "a" and e.handed == ()
    # Its count has not moved for more than 10 s: stuck, gated where it stands.
    s = Situation(on, {"a": [0], "b": [0]}, {"a": 3}, 34.0, 4, progress={"a": 23.0})
    e = timeslice.expire(p.turns, s, 10.0)
    assert e.turns.gpus[0].holder == "b" and e.handed == (0,) and e.gates["a"].gated
    # No progress seen during its turn: counted from the start of the turn.
    s = Situation(on, {"a": [0], "b": [0]}, {"a": 3}, 10.5, 4, progress={"a": -5.0})
    assert timeslice.expire(p.turns, s, 10.0).turns.gpus[0].holder == "b"


def stepping(now: float, a: int, paused: frozenset[str] = frozenset()) -> Situation:
    """a and b on GPU 0; a has reported ``a`` boundaries, the last one just now."""
    on = {0: ["a", "b"]}
    return Situation(on, {"a": [0], "b": [0]}, {"a": a}, now, 4, {"a": now}, paused)


def test_a_holder_past_its_turn_loses_it_after_turn_timeout_whatever_it_reports() -> None:
    """A holder that steps on past its turn_until without yielding (it reports boundaries,
    so it is never stuck) loses the turn turn_timeout seconds after it reached the end of
    its turn: counted from then, not from the start of the turn."""
    p = timeslice.settle(Turns(), stepping(0.0, 0))
    assert p.gates["a"] == Gate(False, 4, 1) and p.turns.overdue == {}
    # Within its turn for 20 s (slow steps): nothing to cut.
    p = timeslice.expire(p.turns, stepping(20.0, 3), 10.0)
    assert p.turns.gpus[0].holder == "a" and p.turns.overdue == {}
    # It reaches turn_until at 21 s and steps on, boundary after boundary.
    for now, a in ((21.0, 4), (25.0, 9), (31.0, 15)):
        p = timeslice.expire(p.turns, stepping(now, a), 10.0)
        assert p.turns.gpus[0].holder == "a" and p.handed == (), now
        assert p.turns.overdue == {"a": 21.0}
    p = timeslice.expire(p.turns, stepping(31.5, 16), 10.0)
    assert p.turns.gpus[0].holder == "b" and p.handed == (0,)
    assert p.gates["a"].gated and not p.gates["b"].gated and p.turns.overdue == {}
    # Its next turn counts a quantum from where it stands then.
    p = timeslice.yield_turn(p.turns, stepping(40.0, 16), "b")
    assert p.turns.gpus[0].holder == "a" and p.gates["a"] == Gate(False, 20, 1)
    assert p.turns.overdue == {}


def test_a_holder_past_its_turn_with_nobody_to_relieve_it_gets_another_quantum() -> None:
    p = timeslice.settle(Turns(), stepping(0.0, 0))
    b = frozenset({"b"})  # paused: it cannot take the turn
    p = timeslice.expire(p.turns, stepping(1.0, 4, b), 10.0)
    assert p.turns.overdue == {"a": 1.0}
    p = timeslice.expire(p.turns, stepping(11.5, 30, b), 10.0)
    assert p.turns.gpus[0].holder == "a" and p.handed == ()
    assert p.gates["a"] == Gate(False, 34, 1) and p.turns.overdue == {}


def test_a_paused_task_is_passed_over() -> None:
    on = {0: ["a", "b", "c"]}
    p = timeslice.settle(Turns(), sit(on, 0.0))
    s = Situation(on, {t: [0] for t in "abc"}, {}, 1.0, 4, paused=frozenset({"b"}))
    p = timeslice.yield_turn(p.turns, s, "a")
    assert p.turns.gpus[0].holder == "c"
    # With nobody else to take it, the yielding task keeps the turn.
    s = Situation(on, {t: [0] for t in "abc"}, {}, 2.0, 4, paused=frozenset({"a", "b"}))
    p = timeslice.yield_turn(p.turns, s, "c")
    assert not p.passed and p.turns.gpus[0].holder == "c"


def test_a_paused_holder_gives_its_turns_to_a_task_that_can_use_them() -> None:
    on = {0: ["a", "b"], 1: ["m", "c"]}
    tasks = {"a": [0], "b": [0], "m": [1], "c": [1]}
    p = timeslice.settle(Turns(), sit(on, 0.0, tasks=tasks))
    assert p.turns.gpus[0].holder == "a" and p.turns.gpus[1].holder == "m"
    # a is paused: at the next planning (the pause's) b gets GPU 0.
    s = Situation(on, tasks, {}, 1.0, 4, paused=frozenset({"a"}))
    p = timeslice.settle(p.turns, s)
    assert p.turns.gpus[0].holder == "b" and not p.gates["b"].gated and p.gates["a"].gated
    # expire takes a paused holder's turns too, without waiting for turn_timeout.
    s = Situation(on, tasks, {}, 2.0, 4, paused=frozenset({"a", "m"}))
    e = timeslice.expire(p.turns, s, 600.0)
    assert e.turns.gpus[1].holder == "c" and e.gates["m"].gated
    # With only paused tasks left to take it, a paused holder keeps its turn.
    s = Situation(on, tasks, {}, 3.0, 4, paused=frozenset({"a", "b", "c", "m"}))
    e2 = timeslice.settle(e.turns, s)
    assert {g: t.holder for g, t in e2.turns.gpus.items()} == {0: "b", 1: "c"}
    assert e2.handed == ()
