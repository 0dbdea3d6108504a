"""The benchmarks' verdicts and reports (benchmarks/harness.py): every target shape the
benchmarks use is judged, and a finished run's report is written whatever its results
hold, with the real harness entry point (``harness.main``) writing its ``--out`` file."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # last, as the benchmarks do: installed gpushare wins
from benchmarks import gpu_timeslice_bench, harness  # noqa: E402


def test_one_condition_is_judged_and_shown() -> None:
    r = harness.judge({"p99_ms": 1.5}, "p99_ms", "<=", 2.0)
    assert r["met"] is True
    assert harness.verdict(r) == "met (p99_ms = 1.5, target <= 2.0)"
    r = harness.judge({"ratio": 0.941}, "ratio", ">=", 0.995)
    assert r["met"] is False
    assert harness.verdict(r) == "MISSED (ratio = 0.941, target >= 0.995)"


def test_a_missing_figure_misses_its_target_and_reads() -> None:
    r = harness.judge({"n": 3}, "p99_ms", "<=", 2.0)
    assert r["met"] is False
    assert harness.verdict(r) == "MISSED (p99_ms = missing, target <= 2.0)"


def test_a_list_of_conditions_with_dotted_figures() -> None:
    figures = {"exit": 75, "fraction": {"a": 0.5, "b": 0.4}, "switch_ms": {"p50": 0.8}}
    conditions = [
        ("exit", "==", 75),
        ("fraction.a", ">=", 0.35),
        ("fraction.b", ">=", 0.35),
        ("switch_ms.p50", "<=", 10.0),
    ]
    r = harness.judge_all(dict(figures), conditions)
    assert r["met"] is True
    assert harness.verdict(r) == (
        "met (exit = 75, target == 75; fraction.a = 0.5, target >= 0.35; "
        "fraction.b = 0.4, target >= 0.35; switch_ms.p50 = 0.8, target <= 10.0)"
    )
    slow = harness.judge_all({**figures, "fraction": {"a": 0.5, "b": 0.2}}, conditions)
    assert slow["met"] is False
    assert "fraction.b = 0.2, target >= 0.35" in harness.verdict(slow)
    without = {k: v for k, v in figures.items() if k != "switch_ms"}
    no_switch = harness.judge_all(without, conditions)
    assert no_switch["met"] is False
    assert "switch_ms.p50 = missing" in harness.verdict(no_switch)
    assert harness.judge_all({}, [])["met"] is False  # nothing to hold is not a pass


def test_a_target_of_an_unknown_shape_reads_as_it_is() -> None:
    """The shape the GPU time-slicing benchmark once gave (KeyError 'metric' in verdict)."""
    r = {
        "met": True,
        "target": {"shared_second_job_exit": 75, "switch_after_release_ms.p50": "<= 10"},
    }
    text = harness.verdict(r)
    assert text.startswith("met (target not judged here: ")
    assert '"shared_second_job_exit": 75' in text
    assert harness.verdict({"target": "fast"}) == 'NOT JUDGED (target not judged here: "fast")'
    assert harness.verdict({"error": "OSError: no GPU", "met": False}) == "ERROR OSError: no GPU"


def run_main(tmp_path: Path, benches: dict[str, Any], *opts: str) -> tuple[int, dict[str, Any]]:
    out = tmp_path / "bench.json"
    rc = harness.main(
        "a test",
        benches,
        (harness.BenchError,),
        lambda: {"what": "test"},
        ["--out", str(out), *opts],
    )
    return rc, json.loads(out.read_text())


def test_the_report_is_written_for_any_target_shape(tmp_path: Path) -> None:
    odd = {"figure": 1, "met": True, "target": {"figure": "<= 2 each"}}
    benches = {
        "odd": lambda quick: dict(odd),
        "listed": lambda quick: harness.judge_all({"x": 1}, [("x", "<=", 2)]),
        "plain": lambda quick: harness.judge({"y": 3}, "y", "<=", 2),
    }
    rc, doc = run_main(tmp_path, benches)
    assert rc == 0
    assert doc["benchmarks"]["odd"] == odd
    assert doc["benchmarks"]["listed"]["met"] is True
    assert doc["benchmarks"]["plain"]["met"] is False
    rc, _ = run_main(tmp_path, benches, "--check")
    assert rc == 1  # plain missed its target


def test_a_fault_in_one_benchmark_is_reported_and_the_rest_run(tmp_path: Path) -> None:
    def broken(quick: bool) -> dict[str, Any]:
        rows: list[dict[str, Any]] = []
        return rows[0]

    benches = {
        "broken": broken,
        "fine": lambda quick: harness.judge({"y": 1}, "y", "<=", 2),
    }
    rc, doc = run_main(tmp_path, benches)
    assert rc == 2
    assert doc["benchmarks"]["broken"] == {
        "error": "IndexError: list index out of range",
        "met": False,
    }
    assert doc["benchmarks"]["fine"]["met"] is True


def steps(job: str, start: float, n: int, period: float, waited: float = 0.0) -> list[Any]:
    """Made-up step rows of a time-sliced job: each step's first launch waited ``waited``
    seconds, its boundary released and yielded."""
    rows = []
    for i in range(n):
        t0 = start + i * period
        t1 = t0 + waited
        tb = t1 + period / 4
        rows.append(
            {"job": job, "i": i, "t0": t0, "t1": t1, "tb": tb, "te": tb + 0.001,
             "release_start": tb, "release_end": tb + 0.0005, "yield_end": tb + 0.001}
        )  # fmt: skip
    return rows


@pytest.mark.parametrize(("refused_exit", "met"), [(75, True), (0, False)])
def test_the_gpu_timeslice_result_is_judged(refused_exit: int, met: bool) -> None:
    """The GPU time-slicing benchmark's analysis on made-up rows of two jobs taking turns:
    its target is one the harness judges, and the verdict reads."""
    a = steps("a", 100.0, 20, 0.2)
    b = steps("b", 100.1, 20, 0.2, waited=0.05)
    # b's first launch waits across a's boundary: each such step is a switch
    for row, other in zip(b, a, strict=True):
        row["t0"] = other["tb"] - 0.01
        row["t1"] = other["release_end"] + 0.002
    r: dict[str, Any] = {"alone_iterations_per_s": 7.0, "shared_second_job_exit": refused_exit}
    r = gpu_timeslice_bench.analyse(r, {"a": a, "b": b})
    assert r["switches"] == 20
    assert r["switch_after_release_ms"]["p50"] == pytest.approx(2.0, abs=0.01)
    assert r["met"] is met
    assert [c["metric"] for c in r["target"]] == [
        "shared_second_job_exit",
        "timesliced_fraction_of_alone.a",
        "timesliced_fraction_of_alone.b",
        "switch_after_release_ms.p50",
    ]
    assert harness.verdict(r).startswith("met (" if met else "MISSED (")


def test_the_gpu_timeslice_analysis_refuses_a_job_without_steps() -> None:
    r: dict[str, Any] = {"alone_iterations_per_s": 7.0, "shared_second_job_exit": 75}
    with pytest.raises(harness.BenchError, match="time-sliced job"):
        gpu_timeslice_bench.analyse(r, {"a": steps("a", 1.0, 5, 0.2), "b": []})
