"""benchmarks/kube_bench.py runs, and writes the figures docs/benchmarks.md names (the
targets are the benchmark's, not a test's: nothing here is timed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_kube_benchmark_runs_and_reports_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "kube.json"
    got = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "kube_bench.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert got.returncode == 0, got.stderr[-3000:]
    doc = json.loads(out.read_text())["benchmarks"]
    extender, allocate = doc["extender"], doc["allocate"]
    assert "error" not in extender and "error" not in allocate
    assert (extender["nodes"], extender["pending_pods"], extender["unplaced"]) == (1000, 100, 0)
    assert set(extender["filter_prioritize"]) == {"p50_ms", "p99_ms", "max_ms"}
    assert allocate["containers"] == 40
    assert 0 < allocate["allocate"]["p50_ms"] <= allocate["allocate"]["max_ms"]
    assert isinstance(extender["met"], bool) and isinstance(allocate["met"], bool)
