"""nodemgr.policy.compute: the windows of each GPU's time-division schedule, caps, shares
over 100, multi-GPU groups and the latency-class flags."""

from __future__ import annotations

import itertools

from nodemgr._ledger import lib

from nodemgr.policy import compute
from nodemgr.policy.compute import BE, LS, Member, Settings, Window, plan

P = 100_000_000
S = Settings(period_ns=P, poll_ns=500_000, ls_idle_ns=2_000_000)


def spans(windows: dict[str, Window | None]) -> dict[str, tuple[int, int]]:
    return {t: (w.offset_ns, w.length_ns) for t, w in windows.items() if w is not None}


def assert_apart(windows: dict[str, Window | None]) -> None:
    taken = sorted(spans(windows).values())
    for (o1, l1), (o2, _) in itertools.pairwise(taken):
        assert o1 + l1 <= o2, taken
    assert all(o + n <= P for o, n in taken)


def test_the_flag_bits_are_the_shims() -> None:
    assert compute.WINDOW == lib.GS_COMPUTE_WINDOW
    assert compute.LS_PUBLISH == lib.GS_COMPUTE_LS_PUBLISH
    assert compute.YIELD_LS == lib.GS_COMPUTE_YIELD_LS


def test_no_share_no_schedule() -> None:
    p = plan([Member("a", (0,)), Member("b", (0,))], S)
    assert p.windows == {"a": None, "b": None}
    assert p.notes == []


def test_a_share_and_the_rest_split_equally() -> None:
    p = plan([Member("a", (0,), 30), Member("b", (0,)), Member("c", (0,))], S)
    w = p.windows
    assert spans(w) == {
        "a": (0, 30 * P // 100),
        "b": (30 * P // 100, 35 * P // 100),
        "c": (65 * P // 100, 35 * P // 100),
    }
    assert all(x is not None and x.flags == compute.WINDOW for x in w.values())
    assert w["a"] is not None and w["a"].share == 30
    assert_apart(w)


def test_a_lone_share_holds_its_task() -> None:
    [w] = plan([Member("a", (0,), 30)], S).windows.values()
    assert w is not None and (w.offset_ns, w.length_ns, w.period_ns) == (0, 30 * P // 100, P)


def test_gpus_are_planned_apart() -> None:
    p = plan([Member("a", (0,), 30), Member("b", (1,))], S)
    assert p.windows["b"] is None, "no share on GPU 1"
    assert p.windows["a"] is not None


def test_a_share_is_capped_by_its_environment_and_a_cap_alone_applies() -> None:
    p = plan([Member("a", (0,), 80, cap=50), Member("b", (0,), None, cap=20)], S)
    assert spans(p.windows) == {"a": (0, P // 2), "b": (P // 2, P // 5)}


def test_shares_over_100_are_scaled_and_said() -> None:
    p = plan([Member("a", (0,), 60), Member("b", (0,), 60)], S)
    assert spans(p.windows) == {"a": (0, P // 2), "b": (P // 2, P // 2)}
    assert len(p.notes) == 1 and "120%" in p.notes[0] and "100%" in p.notes[0]
    assert_apart(p.windows)


def test_tasks_without_a_share_keep_a_floor() -> None:
    p = plan([Member("a", (0,), 100), Member("b", (0,))], S)
    a, b = p.windows["a"], p.windows["b"]
    assert a is not None and b is not None
    assert a.length_ns == 95 * P // 100 and b.length_ns == 5 * P // 100
    assert p.notes
    assert_apart(p.windows)


def test_a_task_on_two_gpus_joins_their_schedules() -> None:
    p = plan([Member("a", (0,), 40), Member("ab", (0, 1), 20), Member("b", (1,), 30)], S)
    assert_apart(p.windows)
    ab = p.windows["ab"]
    assert ab is not None and ab.gpu_mask == 0b11
    assert len(compute.groups([Member("x", (2,)), Member("y", (3,))])) == 2


def test_latency_classes_get_their_flags() -> None:
    p = plan([Member("ls", (0,), cls=LS), Member("be", (0,), cls=BE), Member("o", (1,), cls=BE)], S)
    ls, be = p.windows["ls"], p.windows["be"]
    assert ls is not None and ls.flags == compute.LS_PUBLISH and ls.gpu_mask == 1
    assert be is not None and be.flags == compute.YIELD_LS
    assert p.windows["o"] is None, "no LS task on its GPU"
    assert be.poll_ns == S.poll_ns and be.ls_idle_ns == S.ls_idle_ns


def test_an_ls_task_without_a_share_is_never_windowed() -> None:
    p = plan([Member("ls", (0,), cls=LS), Member("be", (0,), 30, cls=BE)], S)
    ls, be = p.windows["ls"], p.windows["be"]
    assert ls is not None and not ls.flags & compute.WINDOW
    assert be is not None and be.flags == compute.WINDOW | compute.YIELD_LS
    assert be.length_ns == 30 * P // 100
