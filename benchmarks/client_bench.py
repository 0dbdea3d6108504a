#!/usr/bin/env python3
"""What the client side costs processes that never touch a GPU, with machine-readable output.

    python benchmarks/client_bench.py [--quick] [--only NAME]... [--out FILE] [--check]

``autoload_startup``: the start-up of a Python process (the venv's interpreter,
which has gpushare's start-up hook installed) that imports no framework, with
GPUSHARE_AUTOLOAD=1 and without it. The two sides alternate, run after run, so
drift of the machine falls on both; the figure is the median of the pairs' differences.
The JSON document goes to stdout and to ``--out``; progress to stderr.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SELF = Path(__file__).resolve()
if str(SELF.parent.parent) not in sys.path:
    sys.path.append(str(SELF.parent.parent))  # last: see benchmarks/harness.py
from benchmarks import harness  # noqa: E402
from benchmarks.harness import BenchError  # noqa: E402

# A process that does some ordinary importing (each import passes the finder) and no
# framework: what most Python processes in a dev container are.
WORKLOAD = "import json, email.parser, http.client, decimal, argparse"


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSHARE_")}
    env.pop("LD_PRELOAD", None)
    return env


def _time_run(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    r = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, capture_output=True)
    took = time.perf_counter() - start
    if r.returncode != 0:
        raise BenchError(f"{argv} failed: {r.stderr.decode(errors='replace')[-500:]}")
    return took * 1000


def bench_autoload_startup(quick: bool) -> dict[str, Any]:
    runs = 20 if quick else 200
    off = _clean_env()
    on = {**off, "GPUSHARE_AUTOLOAD": "1", "GPUSHARE_ENDPOINT": "ipc:///nonexistent/task.sock"}
    check = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; print(any(type(f).__name__ == 'FrameworkFinder' for f in sys.meta_path))",
        ],
        env=on,
        capture_output=True,
        text=True,
    )
    if check.stdout.strip() != "True":
        raise BenchError("the start-up hook is not installed: run `make install` first")
    result: dict[str, Any] = {"runs_per_side": runs, "python": sys.executable}
    for name, code in (("bare", "pass"), ("imports", WORKLOAD)):
        argv = [sys.executable, "-c", code]
        for _ in range(3):  # warm the page cache
            _time_run(argv, off)
            _time_run(argv, on)
        times: dict[str, list[float]] = {"off": [], "on": []}
        for _ in range(runs):
            times["off"].append(_time_run(argv, off))
            times["on"].append(_time_run(argv, on))
        side: dict[str, Any] = {}
        for key, samples in times.items():
            side[key] = {
                "median_ms": round(statistics.median(samples), 3),
                "p90_ms": round(harness.percentile(samples, 90), 3),
                "min_ms": round(min(samples), 3),
            }
        # Each pair ran back to back, so its difference is free of the machine's drift.
        pairs = [on - off for on, off in zip(times["on"], times["off"], strict=True)]
        side["added_ms"] = round(statistics.median(pairs), 3)
        result[name] = side
    result["added_ms"] = max(result["bare"]["added_ms"], result["imports"]["added_ms"])
    result["setup"] = (
        f"{runs} runs per side of `python -c pass` and of `python -c '{WORKLOAD}'`, "
        "alternating GPUSHARE_AUTOLOAD=1 and unset; added_ms is the larger of the two medians "
        "of the back-to-back pairs' differences (wall time of the whole process, spawn to exit)"
    )
    return harness.judge(result, "added_ms", "<=", 5.0)


BENCHMARKS: dict[str, Callable[[bool], dict[str, Any]]] = {
    "autoload_startup": bench_autoload_startup,
}
ERRORS = (BenchError, OSError)


def machine() -> dict[str, Any]:
    return harness.machine({})


def main(argv: list[str] | None = None) -> int:
    return harness.main(__doc__, BENCHMARKS, ERRORS, machine, argv)


if __name__ == "__main__":
    sys.exit(main())
