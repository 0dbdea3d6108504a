"""Compute shares in the shim (docs/compute.md): the pacer thread gates a process's
launches to its task's windows, as the ledger carries them, with no word to anyone on the
launch path; latency classes through the board. Each test sets the ledger itself, as
nodemgr would, and watches busy-launching children (tests/shim/compute_child.py) on the
simulated driver, where launches cost nothing: which bins of time saw launches says when
the gate was open."""

from __future__ import annotations

import statistics
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from nodemgr._ledger import ffi, lib

from nodemgr.host.board import Board
from nodemgr.host.ledger import (
    COMPUTE_LS_PUBLISH,
    COMPUTE_WINDOW,
    COMPUTE_YIELD_LS,
    Ledger,
    Schedule,
)
from tests.shim import compute_child

MS = 1_000_000
PERIOD = 100 * MS
GiB = 1 << 30


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compute_child.build(tmp_path_factory.mktemp("compute"))


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    """An environment's ledger with compute control on and tasks "a" and "b"."""
    led = Ledger.create(tmp_path / "ledger", [g.uuid_bytes for g in compute_child.NODE])
    led.set_limit(0, GiB)
    led.set_compute(True)
    for t in ("a", "b"):
        led.task_add(t)
    yield led
    led.close()


def window(share: int, offset_ms: int = 0, flags: int = COMPUTE_WINDOW) -> Schedule:
    return Schedule(
        flags=flags,
        share=share,
        gpu_mask=1,
        period_ns=PERIOD,
        offset_ns=offset_ms * MS,
        length_ns=share * PERIOD // 100,
        poll_ns=MS // 2,
        ls_idle_ns=2 * MS,
    )


def test_a_share_gates_launches_to_its_window(program: Path, ledger: Ledger) -> None:
    """30%: after the first period the child launches in 30 +/- 5% of the 1 ms bins, and
    all but a sliver of its launches fall in its window; the pacer counted its windows."""
    ledger.task_schedule("a", window(30, offset_ms=20))
    [bins] = compute_child.run_all(program, ledger.path, ["a"], seconds=3)
    start, end = bins.span()
    assert 0.25 <= bins.busy_fraction(start + PERIOD, end - PERIOD) <= 0.35
    assert bins.in_window(PERIOD, 20 * MS, 30 * MS, slack_ns=MS) >= 0.97
    # Its windows' open time (kernels take none on the simulated driver): about 30% of 3 s.
    pacing = ledger.task_pacing("a")
    assert 25 <= pacing.windows <= 32
    assert 0.7e9 <= pacing.device_ns <= 1.1e9


def test_two_shares_take_turns(program: Path, ledger: Ledger) -> None:
    """30/70: each launches in its own share of the time, in windows apart."""
    ledger.task_schedule("a", window(30))
    ledger.task_schedule("b", window(70, offset_ms=30))
    a, b = compute_child.run_all(program, ledger.path, ["a", "b"], seconds=3)
    for bins, share, offset in ((a, 30, 0), (b, 70, 30)):
        start, end = bins.span()
        got = bins.busy_fraction(start + PERIOD, end - PERIOD)
        assert share / 100 - 0.05 <= got <= share / 100 + 0.05, (share, got)
        assert bins.in_window(PERIOD, offset * MS, share * MS, slack_ns=MS) >= 0.97
    # Bins at the two edges (0 and 30 ms) may hold launches of both.
    assert a.overlap(b) <= 2 / 30 + 0.03, "their windows overlap"


def test_without_a_schedule_nothing_is_gated(program: Path, ledger: Ledger) -> None:
    """Compute control on, no schedule: the child launches in (almost) every bin and its
    launches never waited."""
    [bins] = compute_child.run_all(program, ledger.path, ["a"], seconds=2)
    start, end = bins.span()
    assert bins.busy_fraction(start, end) >= 0.75
    pacing = ledger.task_pacing("a")
    assert pacing.gated_ns == 0 and pacing.windows == 0
    assert (pacing.processes, pacing.pacers) == (1, 0), "no pacer thread was started"


def test_a_live_change_is_obeyed_within_a_period(program: Path, ledger: Ledger) -> None:
    """A schedule set while the child runs applies at once (the pacer sleeps on the
    entry's futex word); taking it away lets the child launch freely again."""
    p = compute_child.start(program, ledger.path, "a", seconds=4)
    time.sleep(1)
    assert ledger.task_pacing("a").pacers == 0, "no schedule at its claim: no pacer yet"
    changed = time.monotonic_ns()
    ledger.task_schedule("a", window(20))
    time.sleep(1.5)
    cleared = time.monotonic_ns()
    ledger.task_schedule("a", Schedule())
    pacing = ledger.task_pacing("a")
    bins = compute_child.collect(p)
    assert pacing.pacers == 1, "its next launch started its pacer"
    start, _ = bins.span()
    assert bins.busy_fraction(start, changed) >= 0.75
    assert 0.12 <= bins.busy_fraction(changed + PERIOD, cleared) <= 0.25
    assert bins.busy_fraction(cleared + 10 * MS, cleared + 1000 * MS) >= 0.75


def test_best_effort_yields_while_the_board_shows_latency_sensitive_work(
    program: Path, ledger: Ledger, tmp_path: Path
) -> None:
    """A BE task with YIELD_LS and no window: it launches while the board is quiet, stops
    within a poll of an LS stamp and resumes ls_idle after the last."""
    board = Board.create(tmp_path / "board", 2)
    ledger.task_schedule("a", window(0, flags=COMPUTE_YIELD_LS))
    p = compute_child.start(program, ledger.path, "a", seconds=3, GPUSHARE_BOARD=str(board.path))
    time.sleep(0.8)
    busy_from = time.monotonic_ns()
    while time.monotonic_ns() < busy_from + 800 * MS:
        board.stamp(1)
        time.sleep(0.0005)
    busy_to = time.monotonic_ns()
    bins = compute_child.collect(p)
    board.close()
    start, end = bins.span()
    assert bins.busy_fraction(start, busy_from) >= 0.75
    assert bins.busy_fraction(busy_from + 5 * MS, busy_to) <= 0.05
    assert bins.busy_fraction(busy_to + 10 * MS, end) >= 0.75


def test_a_latency_sensitive_task_publishes_its_launches(
    program: Path, ledger: Ledger, tmp_path: Path
) -> None:
    """An LS task with LS_PUBLISH stamps its GPU's board entry while it launches."""
    board = Board.create(tmp_path / "board", 2)
    ledger.task_schedule("a", window(0, flags=COMPUTE_LS_PUBLISH))
    before = time.monotonic_ns()
    p = compute_child.start(program, ledger.path, "a", seconds=1, GPUSHARE_BOARD=str(board.path))
    compute_child.collect(p)
    assert board.ls_last_ns(0) > before
    assert board.ls_last_ns(1) == 0, "only the GPUs of its mask"
    board.close()


def test_no_synchronisation_while_a_stream_captures(program: Path, ledger: Ledger) -> None:
    """A process whose stream captures all along is still gated to its window, but its
    pacer never synchronises (that would invalidate the capture): every window it launched
    in is counted unmeasured, with no overrun, and the capture ends intact."""
    ledger.task_schedule("a", window(30))
    p = compute_child.start(program, ledger.path, "a", seconds=2, capture=True)
    time.sleep(1.5)
    pacing = ledger.task_pacing("a")
    bins = compute_child.collect(p)
    assert bins.in_window(PERIOD, 0, 30 * MS, slack_ns=MS) >= 0.97
    assert pacing.windows >= 5 and pacing.unmeasured == pacing.windows
    assert pacing.overrun_ns == 0


def test_a_window_runs_over_by_a_bursts_work_not_by_all_it_launched(
    program: Path, ledger: Ledger, tmp_path: Path
) -> None:
    """On the device timeline, a child queues work ten times faster than the device runs
    it (a 1 ms kernel every 100 us). Inside its window the gate opens in bursts, each
    closed until its work has run, so what runs past the window's end is about one burst's
    work (it aims at 4 ms here), not all the window launched (270 ms of it without bursts)."""
    ledger.task_schedule("a", window(30))
    p = compute_child.start(
        program,
        ledger.path,
        "a",
        seconds=3,
        GPUSHARE_SIM_TIMELINE="1",
        GPUSHARE_SIM_STATE_DIR=str(tmp_path),
        GPUSHARE_SIM_LAUNCH_NS="0",
        GPUSHARE_SIM_WAVE_NS=str(MS),
    )
    time.sleep(2)
    pacing = ledger.task_pacing("a")
    compute_child.collect(p)
    measured = pacing.windows - pacing.unmeasured
    assert measured >= 10, pacing
    assert pacing.overrun_ns / measured <= 5 * MS, pacing


def start_be_on_the_timeline(
    program: Path, ledger: Ledger, tmp_path: Path, board: Board
) -> subprocess.Popen[str]:
    """Task "a" best-effort beside LS (YIELD_LS, the board quiet): a child that launches
    1 ms kernels back to back on the simulated device timeline for 2 s."""
    ledger.task_schedule("a", window(0, flags=COMPUTE_YIELD_LS))
    return compute_child.start(
        program,
        ledger.path,
        "a",
        seconds=2,
        gap_us=0,
        GPUSHARE_BOARD=str(board.path),
        GPUSHARE_SIM_TIMELINE="1",
        GPUSHARE_SIM_STATE_DIR=str(tmp_path),
        GPUSHARE_SIM_LAUNCH_NS="0",
        GPUSHARE_SIM_WAVE_NS=str(MS),
    )


def test_a_burst_is_bounded_in_launches_too(program: Path, ledger: Ledger, tmp_path: Path) -> None:
    """A BE task launching 1 ms kernels back to back while the board is quiet: each burst
    may launch only as many kernels as its work should take (here one or two), however
    late its pacer wakes to end it, so it never queues the tens of milliseconds of work
    that would then stand ahead of an LS task's next kernel."""
    board = Board.create(tmp_path / "board", 2)
    p = start_be_on_the_timeline(program, ledger, tmp_path, board)
    bins = compute_child.collect(p)
    board.close()
    start, _ = bins.span()
    later = [n for t, n in bins.counts.items() if t >= start + 200 * MS]
    assert len(later) >= 500, "it launched in most 1 ms bins: bursts went on"
    assert max(later) <= 4, sorted(later)[-10:]


def test_a_best_effort_task_launches_freely_once_its_schedule_goes(
    program: Path, ledger: Ledger, tmp_path: Path
) -> None:
    """A BE task launching 1 ms kernels in bursts bounded in launches (the board quiet):
    when its schedule goes (the LS task ended, and no share is left), its gate opens for
    good, its launches unbounded. A bound left from its last burst would hold its next
    launch for ever: the pacer, with no burst to end, would never lift it."""
    board = Board.create(tmp_path / "board", 2)
    p = start_be_on_the_timeline(program, ledger, tmp_path, board)
    time.sleep(0.8)
    cleared = time.monotonic_ns()
    ledger.task_schedule("a", Schedule())
    bins = compute_child.collect(p)
    board.close()
    _, end = bins.span()
    assert end >= cleared + 900 * MS, "it stopped launching when its schedule went"
    # Unbounded: far more launches in each 1 ms bin than a bounded burst's few (at most 4,
    # test_a_burst_is_bounded_in_launches_too). Judged per bin it launched in, not by the
    # share of bins it launched in: a busy machine leaves the child without a CPU for
    # whole milliseconds, which empties bins whatever its gate does.
    after = [n for t, n in bins.counts.items() if t >= cleared + 10 * MS]
    assert len(after) >= 100, "it hardly launched once its schedule went"
    assert statistics.median(after) >= 20, sorted(after)[:10]


def test_the_debt_arithmetic() -> None:
    """Overrun becomes debt that shortens the next window; lateness pays it; a debt
    beyond the window skips it; debt is capped."""
    debt = ffi.new("uint64_t *", 0)
    assert lib.gs_pace_open(1000, 300, 1000, debt) == 1300
    assert lib.gs_pace_close(1300, 1350, 10_000, debt) == 50
    assert debt[0] == 50
    assert lib.gs_pace_open(2000, 300, 2000, debt) == 2250 and debt[0] == 0
    debt[0] = 40
    assert lib.gs_pace_open(3000, 300, 3030, debt) == 3290 and debt[0] == 0, "late 30 paid"
    debt[0] = 500
    assert lib.gs_pace_open(4000, 300, 4000, debt) == 0 and debt[0] == 200, "skipped"
    assert lib.gs_pace_open(5000, 300, 5400, debt) == 0 and debt[0] == 0, "seen after its end"
    assert lib.gs_pace_close(100, 99_999, 1000, debt) == 99_899 and debt[0] == 1000


def test_window_starts_are_aligned_to_the_period() -> None:
    assert lib.gs_pace_window_start(100, 20, 30, 1010) == 1020
    assert lib.gs_pace_window_start(100, 20, 30, 1025) == 1020, "inside its window"
    assert lib.gs_pace_window_start(100, 20, 30, 1050) == 1120, "after it: the next"
    assert lib.gs_pace_window_start(100, 20, 30, 5) == 20
