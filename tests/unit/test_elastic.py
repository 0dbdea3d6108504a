"""The elastic rule (nodemgr.policy.elastic): state in, decisions out, over time."""

from __future__ import annotations

import pytest

from nodemgr.policy.elastic import (
    Be,
    Elastic,
    Ls,
    Settings,
    StepRates,
    Target,
    misses,
    required_step_time,
)

STEP_100MS = Target(step_time=0.1)


def ls(
    step_time: float | None,
    *,
    target: Target = STEP_100MS,
    base: int = 50,
    used: float | None = None,
    gpu: int = 0,
    task_id: str = "ls",
    iterations: int = 10,
) -> Ls:
    return Ls(task_id, gpu, target, base, iterations, step_time, used)


def test_required_step_time_of_a_step_target_and_of_a_deadline() -> None:
    assert required_step_time(Target(), 0, 0.0) is None
    assert required_step_time(Target(step_time=0.2), 5, 100.0) == 0.2
    # 50 steps left and 10 s to the deadline: 0.2 s a step.
    assert required_step_time(Target(deadline=110.0, steps=60), 10, 100.0) == pytest.approx(0.2)
    # Both: the stricter one.
    both = Target(step_time=0.1, deadline=110.0, steps=60)
    assert required_step_time(both, 10, 100.0) == pytest.approx(0.1)
    # Done: nothing required; past the deadline with steps left: nothing is fast enough.
    assert required_step_time(Target(deadline=110.0, steps=60), 60, 100.0) is None
    assert required_step_time(Target(deadline=90.0, steps=60), 10, 100.0) == 0.0
    # A deadline without a step count is no target.
    assert not Target(deadline=110.0).stated


def test_misses_with_and_without_slack() -> None:
    assert misses(ls(0.12), 0.0) is True
    assert misses(ls(0.095), 0.0) is False
    assert misses(ls(0.095), 0.0, slack=0.1) is True  # met, but without 10% room
    assert misses(ls(None), 0.0) is None
    assert misses(ls(0.5, target=Target()), 0.0) is None


def test_a_missed_target_takes_a_step_from_the_largest_best_effort_share() -> None:
    e = Elastic(Settings(step=10, window=1.0))
    bes = [Be("be-a", 0, 20), Be("be-b", 0, 30)]
    plan = e.sweep(0.0, [ls(0.15)], bes)
    assert dict(plan.shares) == {"be-b": 20, "ls": 60}
    assert not plan.paused
    # Within the window nothing more moves, however late the task is.
    assert dict(e.sweep(0.5, [ls(0.15)], bes).shares) == {"be-b": 20, "ls": 60}
    # A window later: the next step, from whichever BE task now has most (ties: by id).
    plan = e.sweep(1.0, [ls(0.15)], bes)
    assert dict(plan.shares) == {"be-a": 10, "be-b": 20, "ls": 70}


def test_nothing_moves_while_the_target_is_met_or_unknown() -> None:
    e = Elastic()
    bes = [Be("be", 0, 30)]
    for now in range(5):
        assert e.sweep(float(now), [ls(0.08)], bes).shares == {}
        assert e.sweep(float(now) + 0.5, [ls(None)], bes).shares == {}
        assert e.sweep(float(now) + 0.7, [ls(0.5, target=Target())], bes).shares == {}


def test_best_effort_tasks_are_paused_once_they_have_no_share_left() -> None:
    e = Elastic(Settings(step=10, window=1.0))
    bes = [Be("be", 0, 10), Be("be-idle", 0, 0)]
    plan = e.sweep(0.0, [ls(0.2)], bes)
    assert dict(plan.shares) == {"be": 0, "ls": 60}
    plan = e.sweep(1.0, [ls(0.2)], bes)
    assert plan.paused == {"be", "be-idle"}
    # Still late with everything paused: nothing more to take.
    plan = e.sweep(2.0, [ls(0.2)], bes)
    assert plan.paused == {"be", "be-idle"}


def test_a_target_met_with_room_gives_back_one_step_a_window_pauses_first() -> None:
    e = Elastic(Settings(step=10, window=1.0, slack=0.1))
    bes = [Be("be", 0, 10)]
    e.sweep(0.0, [ls(0.2)], bes)
    assert e.sweep(1.0, [ls(0.2)], bes).paused == {"be"}
    # Met, but not with 10% room: kept as it is.
    assert e.sweep(2.0, [ls(0.095)], bes).paused == {"be"}
    plan = e.sweep(3.0, [ls(0.05)], bes)
    assert not plan.paused and dict(plan.shares) == {"be": 0, "ls": 60}
    plan = e.sweep(4.0, [ls(0.05)], bes)
    assert plan == e.sweep(4.1, [ls(0.05)], bes)
    assert plan.shares == {} and not plan.paused


def test_everything_goes_back_at_once_when_the_latency_sensitive_task_ends() -> None:
    e = Elastic(Settings(step=10, window=1.0))
    bes = [Be("be-a", 0, 20), Be("be-b", 0, 10)]
    for now in range(4):
        e.sweep(float(now), [ls(0.3)], bes)
    assert e.sweep(3.5, [ls(0.3)], bes).paused == {"be-a", "be-b"}
    plan = e.sweep(3.6, [], bes)
    assert plan.shares == {} and not plan.paused


def test_gpus_are_independent() -> None:
    e = Elastic(Settings(step=10, window=1.0))
    bes = [Be("be0", 0, 30), Be("be1", 1, 30)]
    plan = e.sweep(0.0, [ls(0.2, gpu=0, task_id="ls0"), ls(0.05, gpu=1, task_id="ls1")], bes)
    assert dict(plan.shares) == {"be0": 20, "ls0": 60}


def test_a_finished_deadline_run_is_given_no_more() -> None:
    e = Elastic()
    done = ls(1.0, target=Target(deadline=100.0, steps=10), iterations=10)
    assert e.sweep(50.0, [done], [Be("be", 0, 30)]).shares == {}


def test_a_deadline_the_step_rate_would_miss_takes_share() -> None:
    e = Elastic()
    # 100 steps left at 0.2 s each is 20 s; the deadline is 15 s away.
    late = ls(0.2, target=Target(deadline=115.0, steps=110), iterations=10)
    assert dict(e.sweep(100.0, [late], [Be("be", 0, 30)]).shares) == {"be": 20, "ls": 60}


def test_over_use_beyond_a_window_is_held_until_it_falls_back() -> None:
    e = Elastic(Settings(window=1.0, tolerance=5.0))
    assert e.sweep(0.0, [ls(None, base=40, used=44.0)], []).held == {}
    assert e.sweep(0.5, [ls(None, base=40, used=60.0)], []).held == {}
    assert e.sweep(1.4, [ls(None, base=40, used=60.0)], []).held == {}
    held = e.sweep(1.6, [ls(None, base=40, used=60.0)], []).held
    assert set(held) == {"ls"} and "over its share of 40%" in held["ls"]
    # Held, its use falls: still held until it is back within its share.
    assert set(e.sweep(2.0, [ls(None, base=40, used=42.0)], []).held) == {"ls"}
    assert e.sweep(2.5, [ls(None, base=40, used=30.0)], []).held == {}
    # A spell over the share that ends within the window is no hold.
    e.sweep(3.0, [ls(None, base=40, used=70.0)], [])
    e.sweep(3.8, [ls(None, base=40, used=20.0)], [])
    assert e.sweep(4.5, [ls(None, base=40, used=70.0)], []).held == {}


def test_the_share_an_ls_task_is_held_to_counts_its_elastic_steps() -> None:
    e = Elastic(Settings(step=10, window=1.0, tolerance=5.0))
    bes = [Be("be", 0, 50)]
    e.sweep(0.0, [ls(0.2, base=40, used=48.0)], bes)  # given 10: its share is now 50
    e.sweep(0.5, [ls(0.2, base=40, used=48.0)], bes)
    assert e.sweep(0.9, [ls(0.2, base=40, used=48.0)], bes).held == {}


def test_step_rates_over_a_window() -> None:
    rates = StepRates(window=1.0)
    assert rates.feed("t", 0.0, 0) is None
    assert rates.feed("t", 5.0, 0) is None  # no boundary yet: start-up, not a step
    assert rates.feed("t", 5.1, 1) is None
    assert rates.feed("t", 5.2, 2) == pytest.approx(0.1)
    assert rates.feed("t", 5.4, 4) == pytest.approx(0.1)
    # Slower now: the window's samples say so once the old ones are out of it.
    for i, now in enumerate((6.0, 6.5, 7.0, 7.5), start=5):
        step = rates.feed("t", now, i)
    assert step == pytest.approx(0.5)
    # Stalled: the time since its last boundary counts.
    assert rates.feed("t", 9.0, 8) == pytest.approx(1.5)
    rates.forget(set())
    assert rates.feed("t", 10.0, 8) is None
