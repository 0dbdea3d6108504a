"""How gpushare-run --predict reads its dry run's report (client_plugin.predict): the
lines its processes write at their boundaries, made into the peak and the launches per
iteration. The dry run itself: tests/client/test_predict.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from client_plugin.predict import (
    Boundary,
    _copies_per_step,
    _host_step,
    _kernels_per_step,
    _operator_profile,
    _read_report,
    _shared_peak,
    _waves_per_step,
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


def test_launches_per_iteration_from_each_process_first_boundary_to_its_nth() -> None:
    report = [b(1, 1, 1, 10), b(1, 2, 1, 30), b(1, 3, 1, 50)]
    report += [b(2, 1, 1, 0), b(2, 3, 1, 7)]
    assert _kernels_per_step(report, 3) == 20 + 3.5
    # The iteration after the release (under the operator profile) is left out...
    profiled = [*report, b(1, 4, 1, 500), b(2, 4, 1, 500)]
    assert _kernels_per_step(profiled, 3) == 20 + 3.5
    # ...but for a process that reported fewer than two boundaries by the Nth.
    late = [b(3, 3, 1, 0), b(3, 4, 1, 9)]
    assert _kernels_per_step(profiled + late, 3) == 20 + 3.5 + 9
    assert _kernels_per_step([b(1, 1, 1, 10)], 3) is None
    assert _kernels_per_step([], 3) is None


def test_copies_per_iteration_where_the_counters_were_read() -> None:
    one = [Boundary(1, 1, 0, 0, (10, 20, 30, 1)), Boundary(1, 3, 0, 0, (30, 60, 30, 5))]
    two = [Boundary(2, 1, 0, 0, None), Boundary(2, 2, 0, 0, None)]  # a real driver's
    assert _copies_per_step(one + two, 3) == {
        "host_to_device_bytes": 10,
        "device_to_host_bytes": 20,
        "device_to_device_bytes": 0,
        "reads": 2,
    }
    assert _copies_per_step(two, 3) is None


def test_a_line_that_is_not_whole_is_left_out(tmp_path: Path) -> None:
    path = tmp_path / "report"
    good = {"pid": 4, "iterations": 1, "time": 1.0, "used": 0, "peak": 5, "launches": 6}
    text = json.dumps({**good, "copies": [1, 2, 3, 4]}) + "\n"
    text += json.dumps({**good, "peak": None}) + "\n"  # a shim without counters
    text += '{"pid": 4, "iterat'  # cut short
    path.write_text(text)
    assert _read_report(path) == [Boundary(4, 1, 5, 6, (1, 2, 3, 4))]
    assert _read_report(tmp_path / "missing") == []


def test_waves_per_iteration_where_the_kernel_counters_were_read() -> None:
    one = [Boundary(1, 1, 0, 0, kernels=(5, 50, 6)), Boundary(1, 3, 0, 0, kernels=(25, 850, 46))]
    two = [Boundary(2, 1, 0, 0), Boundary(2, 2, 0, 0)]  # a real driver's: no counters
    assert _waves_per_step(one + two, 3) == 20
    assert _waves_per_step(two, 3) is None


def profile(flops: float, batch: int | None, ops: dict[str, list[float]]) -> dict[str, Any]:
    return {"flops": flops, "half_flops": 1.0, "bytes": 10.0, "batch": batch, "ops": ops}


def test_the_operator_profile_is_each_process_first_summed(tmp_path: Path) -> None:
    """Each process's profile (the first its report has), summed; an operator's largest
    input the largest of any process's; the batch the first process's."""
    lines = [
        {"pid": 1, "iterations": 3, "peak": 0, "launches": 0},
        {"pid": 1, "iterations": 4, "peak": 0, "launches": 0,
         "ops": profile(100.0, 8, {"mm": [2, 100.0, 5.0, 64], "relu": [1, 0.0, 5.0, 32]})},
        {"pid": 2, "iterations": 4, "peak": 0, "launches": 0,
         "ops": profile(50.0, 4, {"mm": [1, 50.0, 5.0, 128]})},
        {"pid": 2, "iterations": 5, "peak": 0, "launches": 0,
         "ops": profile(999.0, 2, {"mm": [9, 999.0, 9.0, 999]})},
        # Not of the profile's form: left out, the line kept.
        {"pid": 3, "iterations": 4, "peak": 0, "launches": 0, "ops": {"flops": "x"}},
    ]  # fmt: skip
    path = tmp_path / "report"
    path.write_text("".join(json.dumps(ln) + "\n" for ln in lines))
    report = _read_report(path)
    assert len(report) == 5 and report[-1].ops is None
    assert _operator_profile(report) == {
        "flops": 150.0,
        "half_flops": 2.0,
        "bytes": 20.0,
        "batch": 8,
        "ops": {"mm": [3, 150.0, 10.0, 128], "relu": [1, 0.0, 5.0, 32]},
    }
    assert _operator_profile(report[:1]) is None


def test_host_time_is_the_shortest_iteration_before_the_release() -> None:
    """Warm-up makes the first iterations the longest: each process's shortest up to the
    Nth, the slowest process's of those."""

    def at(pid: int, iterations: int, t: float) -> Boundary:
        return Boundary(pid, iterations, 0, 0, t=t)

    one = [at(1, 1, 0.0), at(1, 2, 2.0), at(1, 3, 3.0), at(1, 4, 4.5), at(1, 5, 4.6)]
    two = [at(2, 1, 0.0), at(2, 3, 2.4), at(2, 4, 4.0)]  # two iterations in one span
    assert _host_step(one, 4) == 1.0
    assert _host_step(one + two, 4) == 1.2
    assert _host_step(one[:1], 4) is None
