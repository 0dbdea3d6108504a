"""Line and branch coverage of the shim's C, measured by gcc's gcov; fails below a floor.

`make c-coverage` (a step of `make test`) runs this after `make debug-test`, whose
ASan+UBSan shim in build/debug is built with ``shim/build.py --coverage``: every process
the sanitizer tier runs with that shim adds its counts to the ``.gcda`` files beside it
when it exits (gcc's runtime locks each file while it merges, so processes exiting at once
add up; a fork child adds what it ran too). A process that never exits normally (SIGKILL,
``_exit``, an exec that replaces it) adds nothing: what only such processes ran counts as
not run. The build removes the counts of an earlier build, and each `make debug-test`
builds afresh, so the figures are those of one run.

Every ``.gcno`` in the build directory is read (gcc writes one per C source the build
compiles, and the build removes older ones), and the files under shim/ kept, headers
included. A line counts as run if any translation unit ran it; a branch counts once for
each place it is compiled into, as gcov counts code inlined in several places (most of
shim.h's branches are those of its always-inline functions, once per hook). Prints a
table, writes the figures as JSON (``--out``), and exits 1 when the lines or branches run
in all are below their floors (2 when there is nothing to measure)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

ROOT = Path(__file__).resolve().parent.parent

# The floors, in whole percent of all lines and branches under shim/: what the full
# sanitizer tier measured, rounded down.
LINE_FLOOR = 81
BRANCH_FLOOR = 52


@dataclass
class FileCoverage:
    """One source file's lines (number: run) and branches (line: taken, one per arc)."""

    lines: dict[int, bool] = field(default_factory=dict)
    branches: dict[int, list[bool]] = field(default_factory=dict)

    def add(self, line: dict[str, Any]) -> None:
        """Add one line of gcov's JSON (a header's come once per translation unit)."""
        number = int(line["line_number"])
        self.lines[number] = self.lines.get(number, False) or int(line["count"]) > 0
        taken = [int(b["count"]) > 0 for b in line["branches"]]
        self.branches.setdefault(number, []).extend(taken)

    def summary(self) -> dict[str, Any]:
        branches = [t for arcs in self.branches.values() for t in arcs]
        return {
            "lines": len(self.lines),
            "lines_run": sum(self.lines.values()),
            "branches": len(branches),
            "branches_taken": sum(branches),
            "lines_not_run": sorted(n for n, run in self.lines.items() if not run),
        }


def fail(message: str) -> NoReturn:
    """Nothing to measure, or gcov could not: exit 2, apart from a floor not met (1)."""
    print(f"c_coverage: {message}", file=sys.stderr)
    raise SystemExit(2)


def gcov_json(notes: list[Path], gcov: str) -> list[dict[str, Any]]:
    """gcov's JSON for each translation unit (one document a line on stdout)."""
    try:
        p = subprocess.run(
            [gcov, "--json-format", "--stdout", "--branch-probabilities", *map(str, notes)],
            capture_output=True,
            text=True,
            timeout=300,
        )
    except OSError as e:
        fail(f"cannot run {gcov} (gcc's; GCOV names another): {e}")
    # A unit no process ran has no .gcda: gcov says so and counts it as not run.
    trouble = [
        line
        for line in p.stderr.splitlines()
        if line.strip() and "assuming not executed" not in line
    ]
    if p.returncode != 0 or trouble:
        fail(f"{gcov} failed ({p.returncode}):\n{p.stderr}")
    return [json.loads(line) for line in p.stdout.splitlines() if line.strip()]


def measure(build: Path, sources: Path, gcov: str) -> tuple[dict[str, FileCoverage], list[str]]:
    """Coverage per file under ``sources`` (named relative to its parent), and the
    translation units that no process ran (no .gcda)."""
    notes = sorted(build.glob("*.gcno"))
    if not notes:
        fail(f"no .gcno in {build}: build with shim/build.py --coverage")
    not_run = [n.name for n in notes if not n.with_suffix(".gcda").exists()]
    if len(not_run) == len(notes):
        fail(f"no .gcda in {build}: no process has used this build yet")
    files: dict[str, FileCoverage] = {}
    for unit in gcov_json(notes, gcov):
        cwd = Path(unit["current_working_directory"])
        for f in unit["files"]:
            path = (cwd / f["file"]).resolve()
            if not path.is_relative_to(sources):
                continue  # system headers
            cov = files.setdefault(str(path.relative_to(sources.parent)), FileCoverage())
            for line in f["lines"]:
                cov.add(line)
    return files, not_run


def percent(part: int, whole: int) -> float:
    return 100.0 * part / whole if whole else 100.0


def report(
    files: dict[str, FileCoverage],
    not_run: list[str],
    build: Path,
    sources: Path,
    floors: tuple[int, int] | None,
) -> dict[str, Any]:
    per_file = {name: files[name].summary() for name in sorted(files)}
    total = {
        key: sum(s[key] for s in per_file.values())
        for key in ("lines", "lines_run", "branches", "branches_taken")
    }
    lines = percent(total["lines_run"], total["lines"])
    branches = percent(total["branches_taken"], total["branches"])
    total["line_percent"] = round(lines, 2)
    total["branch_percent"] = round(branches, 2)
    passed = floors is None or (lines >= floors[0] and branches >= floors[1])
    return {
        "build": str(build),
        "sources": sources.name,
        "files": per_file,
        "total": total,
        "units_not_run": not_run,
        "floor": None if floors is None else {"lines": floors[0], "branches": floors[1]},
        "passed": passed,
    }


def table(doc: dict[str, Any]) -> str:
    width = max(len(name) for name in [*doc["files"], "total"])

    def row(name: str, s: dict[str, Any]) -> str:
        lines = f"{s['lines_run']:>5}/{s['lines']:<5} {percent(s['lines_run'], s['lines']):5.1f}%"
        branches = (
            f"{s['branches_taken']:>5}/{s['branches']:<5} "
            f"{percent(s['branches_taken'], s['branches']):5.1f}%"
            if s["branches"]
            else f"{'-':>18}"
        )
        return f"{name:<{width}} {lines}  {branches}"

    out = [
        f"C coverage of {doc['sources']}/ by gcov, from {doc['build']}",
        f"{'file':<{width}} {'lines run':>18}  {'branches taken':>18}",
    ]
    out += [row(name, s) for name, s in doc["files"].items()]
    out.append(row("total", doc["total"]))
    if doc["units_not_run"]:
        out.append(f"run by no process: {', '.join(doc['units_not_run'])}")
    if doc["floor"] is not None:
        verdict = "met" if doc["passed"] else "NOT MET"
        out.append(
            f"floor: {doc['floor']['lines']}% of lines, "
            f"{doc['floor']['branches']}% of branches: {verdict}"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("build", type=Path, help="the directory of the --coverage build of the shim")
    ap.add_argument("--out", type=Path, help="write the figures here as JSON")
    ap.add_argument("--sources", type=Path, default=ROOT / "shim", help="the files measured")
    ap.add_argument("--lines", type=int, default=LINE_FLOOR, help="line floor, in percent")
    ap.add_argument("--branches", type=int, default=BRANCH_FLOOR, help="branch floor, in percent")
    ap.add_argument(
        "--no-floor", action="store_true", help="report only (a partial run: PYTEST_ARGS)"
    )
    args = ap.parse_args(argv)
    gcov = os.environ.get("GCOV", "gcov")
    files, not_run = measure(args.build.resolve(), args.sources.resolve(), gcov)
    floors = None if args.no_floor else (args.lines, args.branches)
    doc = report(files, not_run, args.build, args.sources, floors)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(table(doc))
    if not doc["passed"]:
        print(
            "c_coverage: the shim's C coverage is below its floor: test the code added, "
            "or see lines_not_run in the JSON report",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
