"""How gpushare-run --predict reads its dry run's report (client_plugin.predict): the
lines its processes write at their boundaries, made into the peak and the launches per
iteration. The dry run itself: tests/client/test_predict.py."""

from __future__ import annotations

import json
from pathlib import Path

from client_plugin.predict import (
    Boundary,
    _copies_per_step,
    _kernels_per_step,
    _read_report,
    _shared_peak,
)

MIB = 1 << 20


def b(pid: int, iterations: int, peak_mib: int, launches: int) -> Boundary:
    return Boundary(pid, iterations, peak_mib * MIB, launches)


def test_the_peak_is_each_process_peak_before_the_release_summed() -> None:
    # Two processes, N = 2: their peaks at boundary 2 (before the release) add up; what
    # one held after the release (boundary 3) does not count.
    report = [b(1, 1, 100, 10), b(1, 2, 120, 20), b(1, 3, 150, 30)]
    report += [b(2, 1, 50, 5), b(2, 2, 60, 9), b(2, 3, 70, 13)]
    assert _shared_peak(report, 2, final=999 * MIB) == 180 * MIB


def test_without_a_release_everywhere_the_task_peak_stands() -> None:
    # Process 2 ended before boundary 2: nothing says what it held at once with the other.
    report = [b(1, 1, 100, 10), b(1, 2, 120, 20), b(2, 1, 50, 5)]
    assert _shared_peak(report, 2, final=170 * MIB) == 170 * MIB
    assert _shared_peak([], 2, final=7) == 7
    assert _shared_peak(report, 3, final=8) == 8  # none got to its release


def test_launches_per_iteration_from_each_process_first_boundary_to_its_last() -> None:
    report = [b(1, 1, 1, 10), b(1, 2, 1, 30), b(1, 3, 1, 50)]
    report += [b(2, 1, 1, 0), b(2, 3, 1, 7)]
    assert _kernels_per_step(report) == 20 + 3.5
    assert _kernels_per_step([b(1, 1, 1, 10)]) is None
    assert _kernels_per_step([]) is None


def test_copies_per_iteration_where_the_counters_were_read() -> None:
    one = [Boundary(1, 1, 0, 0, (10, 20, 30, 1)), Boundary(1, 3, 0, 0, (30, 60, 30, 5))]
    two = [Boundary(2, 1, 0, 0, None), Boundary(2, 2, 0, 0, None)]  # a real driver's
    assert _copies_per_step(one + two) == {
        "host_to_device_bytes": 10,
        "device_to_host_bytes": 20,
        "device_to_device_bytes": 0,
        "reads": 2,
    }
    assert _copies_per_step(two) is None


def test_a_line_that_is_not_whole_is_left_out(tmp_path: Path) -> None:
    path = tmp_path / "report"
    good = {"pid": 4, "iterations": 1, "time": 1.0, "used": 0, "peak": 5, "launches": 6}
    text = json.dumps({**good, "copies": [1, 2, 3, 4]}) + "\n"
    text += json.dumps({**good, "peak": None}) + "\n"  # a shim without counters
    text += '{"pid": 4, "iterat'  # cut short
    path.write_text(text)
    assert _read_report(path) == [Boundary(4, 1, 5, 6, (1, 2, 3, 4))]
    assert _read_report(tmp_path / "missing") == []
