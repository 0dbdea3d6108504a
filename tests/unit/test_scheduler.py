"""GPU selection (nodemgr.policy.scheduler, docs/scheduling.md), branch by branch, and its
invariants."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from nodemgr.policy.scheduler import Ask, Choice, GpuView, Refusal, select

GiB = 1 << 30
T = 4  # threshold


def gpus(*tasks: int, free: int = 16 * GiB, capacity: int = 16 * GiB) -> list[GpuView]:
    return [GpuView(i, t, capacity, free) for i, t in enumerate(tasks)]


def ask(need: int, quota: int, env: dict[int, int] | None = None, memory: int = GiB) -> Ask:
    return Ask(need, quota, memory, env or {})


def refused(r: Choice | Refusal, code: str) -> bool:
    return isinstance(r, Refusal) and r.code == code


# --- refusals that come before the algorithm -------------------------------------


def test_zero_quota_is_its_own_error_so_the_client_can_fall_back_to_cpu() -> None:
    r = select(ask(1, 0), gpus(0, 0), T)
    assert refused(r, "quota_zero")
    assert isinstance(r, Refusal) and not r.retryable and "CPU" in r.message


def test_more_gpus_than_the_quota_is_never_satisfiable() -> None:
    r = select(ask(3, 2), gpus(0, 0, 0, 0), T)
    assert refused(r, "quota_exceeded")
    assert isinstance(r, Refusal) and not r.retryable and "quota is 2" in r.message


def test_new_allowed_zero_and_used_below_need_is_beyond_quota() -> None:
    # new_allowed = 2 - 2 = 0 and used (2) < need (3): it implies need > quota, so it is
    # refused as never satisfiable (docs/scheduling.md#the-algorithm, step 3).
    r = select(ask(3, 2, {0: 1, 1: 1}), gpus(1, 1, 0, 0), T)
    assert refused(r, "quota_exceeded")


def test_memory_hint_beyond_the_quota_is_refused_and_says_so() -> None:
    r = select(Ask(1, 2, GiB, {}, memory_hint=2 * GiB), gpus(0), T)
    assert refused(r, "quota_exceeded")
    assert isinstance(r, Refusal) and "memory quota is 1GiB per GPU" in r.message


def test_a_drained_gpu_is_never_chosen_and_a_request_for_it_may_wait() -> None:
    """Unlike a lost GPU, a drained one comes back: a request only it could serve is
    retryable (no_resources, naming the drain), never quota_exceeded; nor is it reused by
    an environment that holds it."""
    views = [GpuView(0, 0, 16 * GiB, 16 * GiB, drained=True), GpuView(1, 0, 16 * GiB, 16 * GiB)]
    assert select(ask(1, 2), views, T) == Choice((1,), (1,))
    r = select(ask(2, 2), views, T)
    assert refused(r, "no_resources") and isinstance(r, Refusal)
    assert "GPU 0 drained by an admin" in r.message
    assert refused(select(ask(1, 1, {0: 1}), views, T), "no_resources")
    undrained = [replace(v, drained=False) for v in views]
    assert select(ask(1, 1, {0: 1}), undrained, T) == Choice((0,), ())


def test_a_refusal_says_only_an_undrain_helps_when_no_other_gpu_could_serve() -> None:
    """Waiting for other tasks cannot help a request that, with every task gone, still has
    too few GPUs that are not drained: its refusal says what does."""
    only = [GpuView(0, 0, 16 * GiB, 16 * GiB, drained=True), GpuView(1, T, 16 * GiB, 16 * GiB)]
    r = select(ask(2, 2), only, T)
    assert isinstance(r, Refusal) and r.code == "no_resources"
    assert "only an admin's undrain (nodemgr undrain) lets it through" in r.message
    assert "wait for other tasks" not in r.message
    assert r.message.endswith("(GPU 0 drained by an admin)")
    # GPU 1 alone could serve one GPU once its tasks end: either helps.
    r = select(ask(1, 1), only, T)
    assert isinstance(r, Refusal) and r.code == "no_resources"
    assert "wait for other tasks to end, or an admin's undrain (nodemgr undrain)" in r.message
    # No GPU drained: only the tasks.
    r = select(ask(1, 1), [replace(v, drained=False, tasks=T) for v in only], T)
    assert isinstance(r, Refusal) and r.message.endswith("wait for other tasks to end")


def test_more_gpus_than_the_node_can_ever_give_is_not_retryable() -> None:
    r = select(ask(3, 4), gpus(0, 0), T)
    assert refused(r, "quota_exceeded")
    # ... counting only GPUs big enough for the environment's memory quota.
    views = [GpuView(0, 0, 16 * GiB, 16 * GiB), GpuView(1, 0, 8 * GiB, 8 * GiB)]
    assert refused(select(ask(2, 2, memory=12 * GiB), views, T), "quota_exceeded")
    assert select(ask(1, 2, memory=12 * GiB), views, T) == Choice((0,), (0,))


def test_lost_gpus_are_never_chosen_nor_counted() -> None:
    views = [GpuView(0, 0, 16 * GiB, 16 * GiB, usable=False), GpuView(1, 0, 16 * GiB, 16 * GiB)]
    assert select(ask(1, 2), views, T) == Choice((1,), (1,))
    assert refused(select(ask(2, 2), views, T), "quota_exceeded")
    # An environment that holds a GPU which is then lost does not reuse it.
    assert refused(select(ask(1, 1, {0: 1}), views, T), "no_resources")


# --- new_allowed <= 0: reuse ---------------------------------------------------------


def test_quota_used_up_reuses_the_least_loaded_of_its_gpus() -> None:
    # quota 2, holds GPUs 0 and 2; GPU 2 has fewer tasks.
    assert select(ask(1, 2, {0: 3, 2: 1}), gpus(3, 0, 1), T) == Choice((2,), ())
    assert select(ask(2, 2, {0: 3, 2: 1}), gpus(3, 0, 1), T) == Choice((2, 0), ())


def test_reuse_ignores_the_threshold_and_memory_of_the_gpus_it_holds() -> None:
    # The environment's memory quota is charged once per GPU and shared.
    views = gpus(9, 9, free=0)
    assert select(ask(2, 2, {0: 1, 1: 1}), views, T) == Choice((0, 1), ())


def test_quota_lowered_below_what_is_held_still_reuses() -> None:
    assert select(ask(1, 1, {0: 1, 1: 2}), gpus(1, 2), T) == Choice((0,), ())


# --- new_allowed > 0: new GPUs --------------------------------------------------------


def test_enough_candidates_takes_new_gpus_with_most_free_memory_first() -> None:
    views = [
        GpuView(0, 1, 16 * GiB, 4 * GiB),
        GpuView(1, 0, 16 * GiB, 16 * GiB),
        GpuView(2, 2, 16 * GiB, 8 * GiB),
        GpuView(3, 0, 16 * GiB, 16 * GiB),
    ]
    assert select(ask(2, 4), views, T) == Choice((1, 3), (1, 3))
    assert select(ask(3, 4), views, T) == Choice((1, 3, 2), (1, 3, 2))


def test_equal_free_memory_prefers_fewer_tasks_then_lower_index() -> None:
    assert select(ask(2, 4), gpus(2, 0, 1, 0), T) == Choice((1, 3), (1, 3))


def test_candidates_exclude_gpus_at_the_threshold() -> None:
    assert select(ask(1, 2), gpus(T, T - 1), T) == Choice((1,), (1,))
    assert select(ask(1, 2), gpus(T, T), 5) == Choice((0,), (0,))


def test_candidates_exclude_gpus_without_room_for_the_memory_quota() -> None:
    views = [GpuView(0, 0, 16 * GiB, GiB - 1), GpuView(1, 3, 16 * GiB, GiB)]
    assert select(ask(1, 2), views, T) == Choice((1,), (1,))


def test_candidates_are_capped_at_new_allowed() -> None:
    # quota 3, holds GPU 0: at most 2 new GPUs, the third comes from reuse.
    assert select(ask(3, 3, {0: 1}), gpus(1, 0, 0, 0), T) == Choice((1, 2, 0), (1, 2))


def test_too_few_candidates_mixes_new_and_reused_gpus() -> None:
    # quota 3, holds GPU 0; GPUs 1, 2 at the threshold, GPU 3 free: one new + one reused.
    assert select(ask(2, 3, {0: 1}), gpus(1, T, T, 0), T) == Choice((3, 0), (3,))


def test_too_few_candidates_and_too_few_held_gpus_is_retryable() -> None:
    r = select(ask(2, 3, {0: 1}), gpus(1, T), T)
    assert refused(r, "no_resources")
    assert isinstance(r, Refusal) and r.retryable
    r = select(ask(1, 1), gpus(T, T), T)
    assert refused(r, "no_resources")


# --- a restriction to some GPUs (the user's CUDA_VISIBLE_DEVICES) ---------------------


def only(a: Ask, *allowed: int) -> Ask:
    return replace(a, allowed=frozenset(allowed))


def test_a_restricted_request_gets_an_allowed_gpu_even_if_others_are_freer() -> None:
    views = [
        GpuView(0, 0, 16 * GiB, 16 * GiB),
        GpuView(1, 2, 16 * GiB, 4 * GiB),
        GpuView(2, 1, 16 * GiB, 8 * GiB),
    ]
    assert select(ask(1, 2), views, T) == Choice((0,), (0,))
    assert select(only(ask(1, 2), 1), views, T) == Choice((1,), (1,))
    assert select(only(ask(1, 2), 1, 2), views, T) == Choice((2,), (2,))


def test_the_grant_follows_the_scheduler_order_not_the_list() -> None:
    views = [GpuView(0, 0, 16 * GiB, 4 * GiB), GpuView(1, 0, 16 * GiB, 16 * GiB)]
    assert select(only(ask(2, 2), 0, 1), views, T) == Choice((1, 0), (1, 0))


def test_a_restriction_to_every_gpu_is_no_restriction() -> None:
    a = ask(2, 3, {0: 1})
    views = gpus(1, T, 0, 2)
    assert select(only(a, 0, 1, 2, 3), views, T) == select(a, views, T) == Choice((2, 3), (2, 3))


def test_a_restricted_request_reuses_only_allowed_gpus_of_its_environment() -> None:
    # quota 3, holds GPUs 0 and 2: one new GPU may be added, the other is reused.
    a = ask(2, 3, {0: 1, 2: 1})
    views = gpus(1, 0, 1, 0)
    assert select(a, views, T) == Choice((1, 0), (1,))
    assert select(only(a, 2, 3), views, T) == Choice((3, 2), (3,))
    # Its own GPU is shared without threshold or memory checks, as unrestricted.
    assert select(only(ask(1, 2, {0: 1}), 0), gpus(9, 0, free=0), T) == Choice((0,), ())


def test_a_restriction_never_reuses_a_gpu_it_does_not_allow() -> None:
    # The quota is used up on GPU 0; GPU 1 is allowed but would be a second GPU.
    r = select(only(ask(1, 1, {0: 1}), 1), gpus(1, 0), T)
    assert refused(r, "no_resources")
    assert isinstance(r, Refusal) and r.retryable
    assert "CUDA_VISIBLE_DEVICES allows (GPU 1)" in r.message
    assert "other tasks to end" in r.message
    # Too few new GPUs allowed and free, and the held one is not allowed.
    r = select(only(ask(2, 3, {0: 1}), 1, 2), gpus(1, 0, T), T)
    assert refused(r, "no_resources")
    assert isinstance(r, Refusal) and r.retryable
    assert "of those CUDA_VISIBLE_DEVICES allows (GPUs 1, 2)" in r.message


def test_allowed_gpus_that_are_busy_now_are_retryable() -> None:
    # GPU 0 is free; the allowed GPU 1 is at the threshold, then without free memory.
    for views in (gpus(0, T), [GpuView(0, 0, 16 * GiB, 16 * GiB), GpuView(1, 1, 16 * GiB, 0)]):
        assert select(ask(1, 2), views, T) == Choice((0,), (0,))
        r = select(only(ask(1, 2), 1), views, T)
        assert refused(r, "no_resources")
        assert isinstance(r, Refusal) and r.retryable and "CUDA_VISIBLE_DEVICES" in r.message


def test_fewer_allowed_gpus_than_needed_is_never_satisfiable() -> None:
    r = select(only(ask(2, 4), 1), gpus(0, 0, 0, 0), T)
    assert refused(r, "quota_exceeded")
    assert isinstance(r, Refusal) and not r.retryable
    assert "CUDA_VISIBLE_DEVICES allows GPU 1, of which 1 can hold" in r.message


def test_allowed_gpus_too_small_or_lost_are_never_satisfiable() -> None:
    views = [
        GpuView(0, 0, 16 * GiB, 16 * GiB),
        GpuView(1, 0, 8 * GiB, 8 * GiB),
        GpuView(2, 0, 16 * GiB, 16 * GiB, usable=False),
    ]
    assert select(ask(1, 2, memory=12 * GiB), views, T) == Choice((0,), (0,))
    for allowed in ((1,), (2,), (1, 2)):
        r = select(only(ask(1, 2, memory=12 * GiB), *allowed), views, T)
        assert refused(r, "quota_exceeded")
        assert isinstance(r, Refusal) and "of which 0 can hold" in r.message
        assert "unset CUDA_VISIBLE_DEVICES" in r.message


def test_refusals_that_come_first_are_unchanged_by_a_restriction() -> None:
    assert refused(select(only(ask(1, 0), 0), gpus(0), T), "quota_zero")
    r = select(only(ask(3, 2), 0, 1, 2), gpus(0, 0, 0), T)
    assert refused(r, "quota_exceeded")
    assert isinstance(r, Refusal) and "quota is 2" in r.message


# --- properties ---------------------------------------------------------------------


# A request, the node's GPUs as the scheduler sees them, and the per-GPU task threshold.
Scenario = tuple[Ask, list[GpuView], int]


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    n = draw(st.integers(1, 8))
    threshold = draw(st.integers(1, 6))
    views = []
    for i in range(n):
        capacity = draw(st.integers(0, 32)) * GiB
        free = draw(st.integers(0, capacity // GiB)) * GiB
        views.append(
            GpuView(i, draw(st.integers(0, 8)), capacity, free, usable=draw(st.booleans()))
        )
    held = draw(st.lists(st.integers(0, n - 1), unique=True, max_size=n))
    env = {i: draw(st.integers(1, 4)) for i in held}
    quota = draw(st.integers(0, 8))
    need = draw(st.integers(1, 8))
    memory = draw(st.integers(0, 32)) * GiB
    allowed = draw(st.none() | st.frozensets(st.integers(0, n - 1), min_size=1))
    return Ask(need, quota, memory, env, allowed=allowed), views, threshold


@settings(max_examples=1500, deadline=None, database=None)
@given(scenarios())
def test_a_grant_respects_quota_memory_and_threshold(case: Scenario) -> None:
    a, views, threshold = case
    r = select(a, views, threshold)
    if isinstance(r, Refusal):
        assert r.code in ("quota_zero", "quota_exceeded", "no_resources")
        return
    by = {g.index: g for g in views}
    assert len(r.gpus) == a.need
    assert len(set(r.gpus)) == a.need
    assert set(r.new) == set(r.gpus) - set(a.env_gpus)
    # Never beyond the count quota: the environment ends up with at most
    # max(quota, what it held) GPUs.
    assert len(set(a.env_gpus) | set(r.gpus)) <= max(a.quota, len(a.env_gpus))
    assert len(r.gpus) <= a.quota
    for i in r.new:
        # Never beyond a GPU's memory, never on a GPU at the threshold.
        assert by[i].free >= a.memory
        assert by[i].tasks < threshold
    for i in r.gpus:
        assert by[i].usable
        # Only GPUs the request allows, new or reused.
        assert a.allowed is None or i in a.allowed


@settings(max_examples=800, deadline=None, database=None)
@given(scenarios())
def test_refusals_are_classified_by_whether_waiting_can_help(case: Scenario) -> None:
    a, views, threshold = case
    r = select(a, views, threshold)
    if not isinstance(r, Refusal) or r.code != "no_resources":
        return
    # Once every task has ended, a retryable request succeeds, within its restriction.
    empty = [GpuView(g.index, 0, g.capacity, g.capacity, g.usable) for g in views]
    again = Ask(a.need, a.quota, a.memory, {}, allowed=a.allowed)
    assert isinstance(select(again, empty, threshold), Choice)


@settings(max_examples=800, deadline=None, database=None)
@given(scenarios())
def test_allowing_every_gpu_decides_as_no_restriction_does(case: Scenario) -> None:
    a, views, threshold = case
    free = select(replace(a, allowed=None), views, threshold)
    every = select(replace(a, allowed=frozenset(g.index for g in views)), views, threshold)
    if isinstance(free, Choice):
        assert every == free
    else:
        assert isinstance(every, Refusal) and every.code == free.code
