"""tests/c_coverage.py: the shim's C coverage from gcov, and its floor (`make c-coverage`).

A small program of two C files and a header stands for the shim: built with --coverage,
run by several processes at once, then measured."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests import c_coverage

HEADER = """static inline int twice(int x)
{
	if (x > 100)
		return x;
	return 2 * x;
}
"""
MAIN = """#include <stdlib.h>
#include "twice.h"
int pick(int);
int main(int argc, char **argv)
{
	(void)argc;
	return pick(twice(atoi(argv[1]))) == 1 ? 0 : 3;
}
"""
PICK = """#include "twice.h"
int pick(int x)
{
	if (x == 2)
		return twice(0) + 1;
	if (x == 4)
		return 1;
	return 0;
}
"""


@pytest.fixture
def program(tmp_path: Path) -> tuple[Path, Path]:
    """The sources and the directory of the --coverage build (its .gcno beside it)."""
    if shutil.which("gcc") is None or shutil.which("gcov") is None:
        pytest.skip("needs gcc and its gcov")
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    out.mkdir()
    for name, text in {"twice.h": HEADER, "main.c": MAIN, "pick.c": PICK}.items():
        (src / name).write_text(text)
    subprocess.run(
        [
            "gcc",
            "--coverage",
            "-O0",
            "-o",
            str(out / "prog"),
            str(src / "main.c"),
            str(src / "pick.c"),
        ],
        check=True,
        timeout=120,
    )
    return src, out


def measure(src: Path, out: Path, *args: str) -> tuple[int, dict[str, object]]:
    report = out / "c.json"
    rc = c_coverage.main([str(out), "--sources", str(src), "--out", str(report), *args])
    return rc, json.loads(report.read_text())


def test_processes_exiting_at_once_all_count(program: tuple[Path, Path]) -> None:
    src, out = program
    procs = [subprocess.Popen([str(out / "prog"), arg]) for arg in ("1", "2", "1", "2")]
    for p in procs:
        assert p.wait(timeout=60) == 0
    rc, doc = measure(src, out, "--lines", "0", "--branches", "0")
    assert rc == 0
    files = doc["files"]
    assert isinstance(files, dict)
    assert sorted(files) == ["src/main.c", "src/pick.c", "src/twice.h"]
    pick = files["src/pick.c"]
    # x == 2 and x == 4 both taken (1 and 2 doubled), the last return never reached
    assert pick["lines_run"] == pick["lines"] - 1
    assert pick["lines_not_run"] == [8]
    total = doc["total"]
    assert isinstance(total, dict)
    assert total["lines"] == sum(f["lines"] for f in files.values())
    assert 0 < total["branches_taken"] < total["branches"]


def test_a_floor_not_met_fails_and_no_floor_reports(program: tuple[Path, Path]) -> None:
    src, out = program
    subprocess.run([str(out / "prog"), "1"], check=True, timeout=60)
    rc, doc = measure(src, out, "--lines", "100", "--branches", "0")
    assert rc == 1
    assert doc["passed"] is False
    rc, doc = measure(src, out, "--lines", "100", "--no-floor")
    assert rc == 0
    assert doc["floor"] is None


def test_a_build_no_process_ran_is_no_figure(program: tuple[Path, Path]) -> None:
    src, out = program
    with pytest.raises(SystemExit) as e:
        c_coverage.main([str(out), "--sources", str(src)])
    assert e.value.code == 2
