"""Seed 004: the failure model, the batch simulator and the policy network, rule by rule,
on pools small enough that each right answer is worked out by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from placement.cluster import Ints
from placement.failures import (
    FLEET_RATE_PER_GPU_DAY,
    FailureDraw,
    FailureModel,
    Floats,
    Job,
    Outcome,
    Pool,
    View,
    Workload,
    best_of_random,
    draw_failures,
    instance,
    packing,
    random_choice,
    sample_pool,
    simulate,
)
from placement.policies.seed004 import (
    FEATURES,
    Network,
    Placer,
    Training,
    features,
    plackett_luce,
    sample_n,
    top_n,
    train,
)

MODEL = FailureModel(checkpoint_hours=2.0, restart_overhead_hours=0.5, repair_hours=24.0)


def quiet_pool(gpus: int) -> Pool:
    """A pool with no history and no hazard: failures come only from the test's draw."""
    return Pool(
        np.zeros(gpus),
        np.zeros(gpus, dtype=np.bool_),
        np.zeros(gpus, dtype=np.int64),
        np.full(gpus, np.inf),
    )


def failing(*at: tuple[float, int]) -> FailureDraw:
    """A draw of failures (hour, GPU), in the order given."""
    return FailureDraw(
        np.array([h for h, _ in at], dtype=np.float64),
        np.array([g for _, g in at], dtype=np.int64),
        1000.0,
    )


def run(gpus: int, jobs: list[Job], *at: tuple[float, int]) -> Outcome:
    return simulate(quiet_pool(gpus), jobs, failing(*at), packing, MODEL, np.random.default_rng(0))


# The model.


def test_the_fleet_rate_is_the_llama_3_report_s() -> None:
    assert math.isclose(FLEET_RATE_PER_GPU_DAY, 419 / (54 * 16_384))
    assert math.isclose(FLEET_RATE_PER_GPU_DAY, 4.74e-4, rel_tol=1e-3)


def test_error_prone_gpus_are_the_share_asked_at_the_factor_asked() -> None:
    pool = sample_pool(FailureModel(), 10_000, np.random.default_rng(1))
    assert int(pool.prone.sum()) == 200  # 2% exactly
    assert set(np.unique(pool.hazard / FailureModel().base_rate).round(9)) == {1.0, 25.0}
    assert (pool.hazard[pool.prone] == FailureModel().base_rate * 25).all()


def test_the_fleet_mean_hazard_is_the_published_rate() -> None:
    model = FailureModel()
    pool = sample_pool(model, 100_000, np.random.default_rng(2))
    assert pool.hazard.mean() == pytest.approx(FLEET_RATE_PER_GPU_DAY, rel=1e-9)
    # The draws too: history counts and failure times, within a few standard deviations.
    expected = FLEET_RATE_PER_GPU_DAY * model.history_days * pool.size  # about 8,500
    assert pool.history.sum() == pytest.approx(expected, rel=0.05)
    draw = draw_failures(pool, 24.0 * 180, np.random.default_rng(3))
    assert draw.gpus.size == pytest.approx(expected, rel=0.05)
    assert (np.diff(draw.hours) >= 0).all() and draw.hours.max() <= 24.0 * 180


def test_history_marks_the_error_prone_gpus() -> None:
    pool = sample_pool(FailureModel(), 50_000, np.random.default_rng(4))
    prone, other = pool.history[pool.prone].mean(), pool.history[~pool.prone].mean()
    assert prone / other == pytest.approx(25, rel=0.2)
    never = pool.history == 0
    assert np.isinf(pool.days_since[never]).all()
    assert ((pool.days_since[~never] >= 0) & (pool.days_since[~never] <= 180)).all()


# The simulator.


def test_a_job_without_failures_runs_its_run_time() -> None:
    out = run(4, [Job(2, 10.0), Job(2, 7.0)])
    assert out.finish_hours == (10.0, 7.0)
    assert (out.makespan_hours, out.restarts, out.lost_gpu_hours) == (10.0, 0, 0.0)


def test_a_restart_loses_the_work_since_the_last_checkpoint() -> None:
    # 10 h of work, a checkpoint every 2 h, its GPU fails at 5 h: 4 h saved, 1 h lost. It
    # restarts at once on the other GPU, reloads for 0.5 h and does the 6 h left.
    out = run(2, [Job(1, 10.0)], (5.0, 0))
    assert out.restarts == 1
    assert out.lost_gpu_hours == pytest.approx(1.0)
    assert out.makespan_hours == pytest.approx(5.0 + 0.5 + 6.0)


def test_the_lost_work_counts_every_gpu_of_the_job_and_the_reload() -> None:
    # 2 GPUs; the first failure at 3 h (2 h saved, 1 h lost); the second at 3.25 h,
    # during the reload (nothing done, 0.25 h lost); the third at 8.5 h: 4.75 h of work
    # since the reload of 3.25 to 3.75, 4 h of it saved.
    out = run(8, [Job(2, 10.0)], (3.0, 0), (3.25, 2), (8.5, 3))
    assert out.restarts == 3
    assert out.lost_gpu_hours == pytest.approx(2 * (1.0 + 0.25 + 0.75 + 0.5))
    # Saved: 2 + 0 + 4 = 6 h; the last run reloads for 0.5 h and does the 4 h left.
    assert out.makespan_hours == pytest.approx(8.5 + 0.5 + 4.0)


def test_a_failed_gpu_is_out_until_repaired() -> None:
    # One GPU: the job waits the 24 h repair, then reloads and does the 6 h left.
    out = run(1, [Job(1, 10.0)], (5.0, 0))
    assert out.makespan_hours == pytest.approx(5.0 + 24.0 + 0.5 + 6.0)


def test_a_gpu_in_repair_does_not_fail_again() -> None:
    out = run(1, [Job(1, 10.0)], (5.0, 0), (6.0, 0), (28.0, 0))
    assert out.restarts == 1


def test_jobs_wait_for_enough_healthy_gpus_first_come_first_served() -> None:
    # a takes GPU 0 of 2; b wants both; GPU 1 fails idle at 1 h (no restart) and is out
    # until 25 h: b waits for it, though a frees GPU 0 at 2 h. c, behind b, waits too.
    out = run(2, [Job(1, 2.0), Job(2, 1.0), Job(1, 1.0)], (1.0, 1))
    assert out.restarts == 0 and out.lost_gpu_hours == 0
    assert out.finish_hours == (2.0, 26.0, 27.0)


def test_a_restarted_job_goes_first() -> None:
    # a (2 GPUs of 2) fails at 5 h; b waits for 2 GPUs; a gets them back first after the
    # repair, b after a.
    out = run(2, [Job(2, 10.0), Job(2, 1.0)], (5.0, 0))
    assert out.finish_hours[0] == pytest.approx(29.0 + 0.5 + 6.0)
    assert out.finish_hours[1] == pytest.approx(35.5 + 1.0)


def test_a_placement_of_a_busy_gpu_is_refused() -> None:
    def greedy(view: View, job: Job, rng: np.random.Generator) -> Ints:
        return np.arange(job.gpus, dtype=np.int64)

    with pytest.raises(ValueError, match="busy or failed"):
        simulate(
            quiet_pool(4), [Job(2, 1), Job(2, 1)], failing(), greedy, MODEL, np.random.default_rng()
        )
    with pytest.raises(ValueError, match="more than the pool"):
        run(2, [Job(3, 1.0)])


def test_the_best_of_k_is_at_most_each_of_its_draws() -> None:
    model = FailureModel()
    workload = Workload(gpus=512, sizes=(64, 128), min_days=5, max_days=10)
    pool, jobs, draw = instance(model, workload, np.random.default_rng(5))
    best, runs = best_of_random(pool, jobs, draw, model, 10, np.random.default_rng(6))
    assert len(runs) == 10 and best in runs
    assert all(best.makespan_hours <= r.makespan_hours for r in runs)


def test_the_workload_fills_at_most_its_share() -> None:
    workload = Workload()
    _, jobs, draw = instance(FailureModel(), workload, np.random.default_rng(7))
    assert 0 < sum(j.gpus for j in jobs) <= workload.fill * workload.gpus
    assert all(24 * 14 <= j.hours <= 24 * 28 and j.gpus in workload.sizes for j in jobs)
    assert draw.horizon == 6 * 24 * 28


# The policy's choice.


def test_the_top_n_are_the_best_scored_in_order_lower_number_first_among_equals() -> None:
    free = np.ones(5, dtype=np.bool_)
    assert top_n(np.array([0.1, 0.9, 0.5, 0.7, 0.5]), free, 4).tolist() == [1, 3, 2, 4]


def test_busy_and_faulty_gpus_are_never_chosen_even_with_the_best_score() -> None:
    scores = np.array([9.0, 8.0, 0.0, 0.0, 0.0, 0.0])
    free = np.array([False, False, True, True, True, True])
    assert set(top_n(scores, free, 3).tolist()) <= {2, 3, 4, 5}
    rng = np.random.default_rng(8)
    for _ in range(200):
        got = sample_n(scores, free, 4, rng)
        assert sorted(got.tolist()) == [2, 3, 4, 5]
    with pytest.raises(ValueError, match="3 GPUs wanted, 2 free"):
        top_n(scores, np.array([True, True, False, False, False, False]), 3)


def test_exactly_n_distinct_gpus_are_chosen() -> None:
    rng = np.random.default_rng(9)
    free = rng.random(64) < 0.7
    scores = rng.normal(size=64)
    for n in (1, 5, int(free.sum())):
        for got in (top_n(scores, free, n), sample_n(scores, free, n, rng)):
            assert got.size == n == np.unique(got).size and free[got].all()


def test_plackett_luce_draws_follow_the_softmax() -> None:
    scores = np.log(np.array([1.0, 2.0, 3.0, 4.0]))
    free = np.ones(4, dtype=np.bool_)
    rng = np.random.default_rng(10)
    first = np.bincount([int(sample_n(scores, free, 2, rng)[0]) for _ in range(4000)], minlength=4)
    assert first / 4000 == pytest.approx([0.1, 0.2, 0.3, 0.4], abs=0.025)


def test_the_plackett_luce_gradient_is_its_log_probability_s() -> None:
    rng = np.random.default_rng(11)
    scores = rng.normal(size=7) * 2
    free = np.array([1, 1, 0, 1, 1, 0, 1], dtype=np.bool_)
    order = np.array([3, 0, 6])
    logp, grad = plackett_luce(scores, free, order)
    # By hand: draw by draw, the chosen one's share of what is left.
    left, want = [0, 1, 3, 4, 6], 0.0
    for a in order:
        want += scores[a] - math.log(np.exp(scores[left]).sum())
        left.remove(int(a))
    assert logp == pytest.approx(want)
    eps = 1e-6
    for g in range(7):
        bump = np.eye(7)[g] * eps
        numeric = (
            plackett_luce(scores + bump, free, order)[0]
            - plackett_luce(scores - bump, free, order)[0]
        ) / (2 * eps)
        assert grad[g] == pytest.approx(numeric, abs=1e-6)
    assert grad[~free].tolist() == [0.0, 0.0]


def test_the_network_s_gradient_is_its_scores_s() -> None:
    rng = np.random.default_rng(12)
    net = Network.initial(rng, scale=0.5)
    x, d = rng.normal(size=(6, FEATURES)), rng.normal(size=6)
    grads = net.backward(x, d)
    eps = 1e-6
    for p, g in zip(net.params(), grads, strict=True):
        flat, gflat = p.reshape(-1), g.reshape(-1)
        for i in range(flat.size):
            flat[i] += eps
            up = float(d @ net.scores(x))
            flat[i] -= 2 * eps
            down = float(d @ net.scores(x))
            flat[i] += eps
            assert gflat[i] == pytest.approx((up - down) / (2 * eps), abs=1e-6)


def test_features_read_the_history_and_the_job() -> None:
    view = View(
        0.0,
        np.array([True, True, False, True]),
        np.array([0, 3, 0, 1]),
        np.array([np.inf, 0.0, np.inf, 90.0]),
    )
    x: Floats = features(view, Job(3, 24.0 * 30))
    assert x[:, 0] == pytest.approx(np.log1p([0, 3, 0, 1]))
    assert x[:, 1] == pytest.approx([0.0, 1.0, 0.0, math.exp(-1)])
    assert x[:, 2] == pytest.approx(1.0) and x[:, 3] == pytest.approx(1.0)


# Training, on a pool whose right answer is known.


def two_bad_gpus(rng: np.random.Generator) -> tuple[Pool, list[Job], FailureDraw]:
    """8 GPUs; GPUs 0 and 1 failed 6 times each in their history and fail about once a
    day; the others never. One 4-GPU job of 2 days: the right placement is any 4 of GPUs
    2 to 7. Packing, and an untrained network's ties, take 0 to 3."""
    hazard = np.array([1.0, 1.0, 0, 0, 0, 0, 0, 0])
    pool = Pool(
        hazard,
        hazard > 0,
        np.array([6, 6, 0, 0, 0, 0, 0, 0], dtype=np.int64),
        np.array([3.0, 5.0] + [np.inf] * 6),
    )
    return pool, [Job(4, 48.0)], draw_failures(pool, 24.0 * 20, rng)


def test_a_short_training_learns_to_avoid_the_gpus_that_fail() -> None:
    model = FailureModel()
    settings = Training(episodes=40, samples=4, randoms=4, learning_rate=0.1, seed=2)
    pool, jobs, draw = two_bad_gpus(np.random.default_rng(13))
    view = View(0.0, np.ones(8, dtype=np.bool_), pool.history, pool.days_since)
    # Untrained (train's first draw from its seed is the network), it prefers them.
    untrained = Network.initial(np.random.default_rng(settings.seed))
    assert {0, 1} <= set(Placer(untrained)(view, jobs[0], np.random.default_rng()).tolist())
    net, _ = train(model, two_bad_gpus, settings)
    assert set(Placer(net)(view, jobs[0], np.random.default_rng()).tolist()).isdisjoint({0, 1})
    placed = simulate(pool, jobs, draw, Placer(net), model, np.random.default_rng())
    packed = simulate(pool, jobs, draw, packing, model, np.random.default_rng())
    assert placed.restarts == 0 < packed.restarts
    assert placed.makespan_hours == 48.0 < packed.makespan_hours


def test_training_is_deterministic_for_a_seed() -> None:
    settings = Training(episodes=5, samples=3, randoms=2, seed=4)
    a, ra = train(FailureModel(), two_bad_gpus, settings)
    b, rb = train(FailureModel(), two_bad_gpus, settings)
    assert ra == rb
    assert all((p == q).all() for p, q in zip(a.params(), b.params(), strict=True))


def test_random_choice_takes_free_gpus_only() -> None:
    view = View(0.0, np.array([True, False, True, True]), np.zeros(4, np.int64), np.full(4, np.inf))
    rng = np.random.default_rng(14)
    for _ in range(50):
        got = random_choice(view, Job(2, 1.0), rng)
        assert got.size == 2 and set(got.tolist()) <= {0, 2, 3}
