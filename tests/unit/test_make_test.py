"""`make test` runs every step, whatever failed before it, and fails if any did.

The real Makefile runs, with its tools (ruff, mypy, lint-imports, clang-format, pytest, the
build's python) replaced by stubs that log their calls: its venvs and the real driver's folder are
named, by make's variables, in a temporary directory whose stamps say they are made."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT

STUB = """#!/bin/sh
echo "$(basename "$0") sanitize=${GPUSHARE_TEST_SANITIZE:-none} $*" >> "$STUB_LOG"
case " $STUB_FAIL " in *" $(basename "$0"):${GPUSHARE_TEST_SANITIZE:-none} "*) exit 1 ;; esac
exit 0
"""


def make_test(tmp_path: Path, fail: str, *variables: str) -> tuple[int, str, list[str]]:
    """`make test` with stubs; ``fail``: the calls that fail, as TOOL:SANITIZER words
    (SANITIZER none for the main pytest); ``variables``: make's, as NAME=VALUE. Returns
    make's status, output and the calls."""
    if shutil.which("make") is None:
        pytest.skip("no make")
    version = re.search(r"^TORCH_VERSION\s*:=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M)
    assert version is not None
    venv, torch, driver = tmp_path / "venv", tmp_path / "torch", tmp_path / "driver"
    (venv / "bin").mkdir(parents=True)
    for tool in ("ruff", "mypy", "lint-imports", "clang-format", "pytest", "python"):
        (venv / "bin" / tool).write_text(STUB)
        (venv / "bin" / tool).chmod(0o755)
    torch.mkdir()
    driver.mkdir()
    for stamp in (
        venv / ".deps",
        venv / ".installed",
        venv / ".dev",
        torch / f".torch-{version[1]}",
        torch / ".gpushare",
        driver / "version",
    ):
        stamp.touch()
    log = tmp_path / "calls"
    log.touch()
    # Not this run's make settings either: `make pytest PYTEST_ARGS=...` exports them.
    knobs = ("PYTEST_ARGS", "PYTEST_WORKERS", "COVERAGE")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE") and k not in knobs}
    env.update(STUB_LOG=str(log), STUB_FAIL=fail)
    dirs = [f"VENV={venv}", f"TORCH_VENV={torch}", f"REAL_DRIVER={driver}"]
    p = subprocess.run(
        ["make", "--no-print-directory", "test", *dirs, *variables],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return p.returncode, p.stdout + p.stderr, log.read_text().splitlines()


def tools(calls: list[str]) -> list[str]:
    """The calls as TOOL:SANITIZER, in order."""
    return [":".join(c.split()[:2]).replace("sanitize=", "") for c in calls]


def test_every_step_runs_and_passes(tmp_path: Path) -> None:
    rc, out, calls = make_test(tmp_path, "")
    assert rc == 0, out
    assert "pytest:none" in tools(calls)
    assert tools(calls)[-3:] == ["pytest:address", "pytest:thread", "python:none"], calls
    assert "tests/c_coverage.py build/debug" in calls[-1], calls
    assert "--no-floor" not in calls[-1], calls


def test_the_coverage_floor_holds_only_for_the_whole_tier(tmp_path: Path) -> None:
    rc, out, calls = make_test(tmp_path, "", "PYTEST_ARGS=-k something")
    assert rc == 0, out
    assert "tests/c_coverage.py" in calls[-1], calls
    assert "--no-floor" in calls[-1], calls


def test_a_failed_sanitizer_tier_is_not_measured_and_fails(tmp_path: Path) -> None:
    rc, out, calls = make_test(tmp_path, "pytest:address")
    assert rc != 0, out
    assert tools(calls)[-1] == "pytest:address", calls
    assert not any("c_coverage" in c for c in calls), calls
    assert "make: test FAILED" in out, out


def test_a_failed_pytest_still_runs_the_sanitizer_tier_and_fails(tmp_path: Path) -> None:
    rc, out, calls = make_test(tmp_path, "pytest:none")
    assert rc != 0, out
    ran = tools(calls)
    assert ran.index("pytest:none") < ran.index("pytest:address") < ran.index("pytest:thread")
    assert "make: test FAILED" in out, out
    assert re.search(r"\*\*\* .*pytest\] Error 1", out), out


def test_a_failed_lint_still_runs_the_tests_and_fails(tmp_path: Path) -> None:
    rc, out, calls = make_test(tmp_path, "mypy:none")
    assert rc != 0, out
    ran = tools(calls)
    assert {"pytest:none", "pytest:address", "pytest:thread"} <= set(ran), calls
    assert "make: test FAILED" in out, out
