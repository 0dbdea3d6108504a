"""The device plugin's book, rule by rule (kube.deviceplugin.book; docs/kubernetes.md,
"How allocations become environments")."""

from __future__ import annotations

import json

import pytest

from kube.deviceplugin.book import PAIR_WINDOW, Allocation, Book, BookError, Holder, plan
from kube.resources import GPU_MEMORY, GPUS, env_name, gpu_of

GIB = 1 << 30


def test_a_container_s_two_halves_make_one_environment_in_either_order() -> None:
    book = Book()
    a, ended = book.allocate(GPUS, ["gpu1-0", "gpu0-0"], now=100.0)
    assert a.env == env_name(["gpu0-0", "gpu1-0"]) and a.quota() == (0, 0) and ended == []
    b, _ = book.allocate(GPU_MEMORY, [f"mem0-{k}" for k in range(10)], now=100.01)
    assert b is a and a.quota() == (2, 5 * GIB)
    # Memory first, then GPUs: the memory half names it.
    c, _ = book.allocate(GPU_MEMORY, ["mem1-0"], now=101.0)
    d, _ = book.allocate(GPUS, ["gpu1-1"], now=101.0)
    assert d is c and c.env == env_name(["mem1-0"]) and c.quota() == (1, GIB)
    assert len(book.allocations) == 2


def test_a_half_after_the_pairing_window_begins_a_new_allocation() -> None:
    book = Book()
    first, _ = book.allocate(GPUS, ["gpu0-0"], now=0.0)
    late, _ = book.allocate(GPU_MEMORY, ["mem0-0"], now=PAIR_WINDOW + 0.01)
    assert late is not first and first.quota() == (0, 0) and late.quota() == (0, 0)


def test_a_half_joins_the_newest_open_allocation() -> None:
    book = Book()
    older, _ = book.allocate(GPUS, ["gpu0-0"], now=0.0)
    newer, _ = book.allocate(GPUS, ["gpu1-0"], now=1.0)
    got, _ = book.allocate(GPU_MEMORY, ["mem0-0"], now=1.1)
    assert got is newer and older.quota() == (0, 0)


def test_ids_given_to_a_new_container_carry_on_the_environment_that_held_them() -> None:
    book = Book()
    a, _ = book.allocate(GPUS, ["gpu0-0", "gpu0-1"], now=0.0)
    book.allocate(GPU_MEMORY, ["mem0-0"], now=0.0)
    # A new container given one of its IDs (its holder gone, or an init container's
    # devices reused): the same environment, a new allocation's state, half to come.
    b, dropped = book.allocate(GPUS, ["gpu0-1"], now=60.0)
    assert b is a and dropped == [] and b.ids == {GPUS: ("gpu0-1",)} and b.made == 60.0
    assert b.quota() == (0, 0)
    c, _ = book.allocate(GPU_MEMORY, ["mem0-5", "mem0-6"], now=60.1)
    assert c is a and c.quota() == (1, 2 * GIB) and list(book.allocations) == [a.env]


def test_ids_spanning_several_allocations_keep_the_one_holding_most() -> None:
    book = Book()
    x, _ = book.allocate(GPUS, ["gpu0-0"], now=0.0)
    book.allocate(GPU_MEMORY, ["mem0-0"], now=0.0)
    y, _ = book.allocate(GPUS, ["gpu1-0", "gpu1-1"], now=10.0)
    book.allocate(GPU_MEMORY, ["mem1-0"], now=10.0)
    got, dropped = book.allocate(GPUS, ["gpu0-0", "gpu1-0", "gpu1-1"], now=100.0)
    assert got is y and dropped == [x.env] and set(book.allocations) == {y.env}


def test_a_trial_on_a_copy_leaves_the_book_as_it_was() -> None:
    book = Book()
    book.allocate(GPUS, ["gpu0-0"], now=0.0)
    trial = book.copy()
    trial.allocate(GPU_MEMORY, ["mem0-0"], now=0.1)
    (kept,) = book.allocations.values()
    assert kept.ids == {GPUS: ("gpu0-0",)} and kept.quota() == (0, 0)


def test_not_a_gpushare_resource_is_refused() -> None:
    with pytest.raises(ValueError, match="not a gpushare resource"):
        Book().allocate("nvidia.com/gpu", ["x"], now=0.0)


def test_the_book_round_trips_through_its_file_form() -> None:
    book = Book()
    book.allocate(GPUS, ["gpu0-0"], now=1.5)
    book.allocate(GPU_MEMORY, ["mem0-0", "mem0-1"], now=1.5)
    again = Book.from_wire(json.loads(json.dumps(book.wire())))
    assert again.wire() == book.wire()
    (a,) = again.allocations.values()
    assert a.quota() == (1, 2 * GIB)


@pytest.mark.parametrize(
    "data",
    [[], {"version": 2, "allocations": []}, {"version": 1}, {"version": 1, "allocations": [{}]}],
)
def test_a_bad_book_file_is_refused_saying_why(data: object) -> None:
    with pytest.raises(BookError):
        Book.from_wire(data)


def _holder(pod: str, gpus: list[str], mem: list[str]) -> Holder:
    ids = {r: tuple(v) for r, v in ((GPUS, gpus), (GPU_MEMORY, mem)) if v}
    return Holder("ns", pod, "c", ids)


def _book_with(env_ids: list[tuple[list[str], list[str]]], made: float) -> Book:
    book = Book()
    for k, (g, m) in enumerate(env_ids):
        book.allocate(GPUS, g, now=made + 10 * k)
        book.allocate(GPU_MEMORY, m, now=made + 10 * k)
    return book


def test_plan_removes_what_no_live_container_holds_once_past_the_grace() -> None:
    book = _book_with([(["gpu0-0"], ["mem0-0"]), (["gpu1-0"], ["mem1-0"])], made=0.0)
    a, b = (env_name(["gpu0-0"]), env_name(["gpu1-0"]))
    live = [_holder("b", ["gpu1-0"], ["mem1-0"])]
    # Within the grace of its allocation (made at 0, grace 5): kept.
    assert plan(book, live, {a, b}, now=4.0, grace=5.0).delete == ()
    got = plan(book, live, {a, b}, now=30.0, grace=5.0)
    assert got.delete == (a,) and set(book.allocations) == {b}


def test_plan_removes_a_stray_environment_of_the_plugin_at_once() -> None:
    book = _book_with([(["gpu0-0"], ["mem0-0"])], made=0.0)
    a = env_name(["gpu0-0"])
    got = plan(book, [_holder("a", ["gpu0-0"], ["mem0-0"])], {a, "k8s-0000", "team-a"}, 1.0, 5.0)
    assert got.delete == ("k8s-0000",)  # never an operator's environment


def test_plan_restores_what_nodemgr_lost() -> None:
    book = _book_with([(["gpu0-0"], ["mem0-0", "mem0-1"])], made=0.0)
    got = plan(book, [_holder("a", ["gpu0-0"], ["mem0-0", "mem0-1"])], set(), 100.0, 5.0)
    (restored,) = got.ensure
    assert restored.env == env_name(["gpu0-0"]) and restored.quota() == (1, 2 * GIB)


def test_plan_takes_back_what_the_book_lost_under_the_name_nodemgr_has() -> None:
    # The memory half came first, so nodemgr's environment is named after it.
    named = env_name(["mem0-0"])
    book = Book()
    got = plan(book, [_holder("a", ["gpu0-0"], ["mem0-0"])], {named}, 100.0, 5.0)
    assert got.adopted == (named,) and got.delete == ()
    assert [a.env for a in got.ensure] == [named]
    assert book.allocations[named].quota() == (1, GIB)
    # Neither name in nodemgr: the gpus half's.
    book = Book()
    got = plan(book, [_holder("a", ["gpu0-0"], ["mem0-0"])], set(), 100.0, 5.0)
    assert got.adopted == (env_name(["gpu0-0"]),)


def test_plan_notes_a_container_with_one_of_the_two_resources() -> None:
    book = Book()
    book.allocate(GPUS, ["gpu0-0"], now=0.0)
    got = plan(book, [_holder("a", ["gpu0-0"], [])], {env_name(["gpu0-0"])}, 100.0, 5.0)
    assert got.delete == ()
    assert got.notes == ("ns/a/c: asks for no gpushare.io/gpu-memory, so its quota is zero",)


def test_plan_sets_the_quota_again_where_the_live_list_changes_it() -> None:
    book = Book()
    book.allocate(GPUS, ["gpu0-0"], now=0.0)
    env = env_name(["gpu0-0"])
    # Its memory half never came by Allocate (a lost half); the live list shows it.
    got = plan(book, [_holder("a", ["gpu0-0"], ["mem0-0", "mem0-1"])], {env}, 100.0, 5.0)
    assert [a.env for a in got.ensure] == [env] and got.ensure[0].quota() == (1, 2 * GIB)
    # A fresh allocation is not yet the live list's to change.
    fresh = Book()
    fresh.allocate(GPUS, ["gpu0-0"], now=99.0)
    got = plan(fresh, [_holder("a", ["gpu0-0"], ["mem0-0"])], {env}, 100.0, 5.0)
    assert got.ensure == () and fresh.allocations[env].quota() == (0, 0)


def test_plan_follows_the_live_list_where_a_pairing_went_wrong() -> None:
    book = Book()
    # Pod x asked only GPUs; pod y's memory half then joined x's allocation.
    x, _ = book.allocate(GPUS, ["gpu0-0"], now=0.0)
    book.allocate(GPU_MEMORY, ["mem0-0"], now=0.1)
    y, _ = book.allocate(GPUS, ["gpu1-0"], now=10.0)
    live = [_holder("x", ["gpu0-0"], []), _holder("y", ["gpu1-0"], ["mem0-0"])]
    got = plan(book, live, {x.env, y.env}, 100.0, 5.0)
    assert any("2 environments" in n for n in got.notes)


def test_device_ids_name_their_gpu() -> None:
    assert gpu_of("gpu3-1") == 3 and gpu_of("mem12-40") == 12
    assert gpu_of("nvidia0") is None and gpu_of("gpu-1") is None and gpu_of("gpux-1") is None


def test_allocation_without_gpus_has_no_quota() -> None:
    assert Allocation("k8s-x", {GPU_MEMORY: ("mem0-0",)}, 0.0).quota() == (0, 0)
