"""The suite's own limits (pyproject.toml's pytest settings, tests/conftest.py's watchdog): no
test can hang the run. Each case runs pytest, with this project's configuration and
conftest, on a few small test files in a directory of their own."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import textwrap
import time
import tomllib
from pathlib import Path

from tests.conftest import ROOT

# What an inner run may take; one that hangs fails here instead.
RUN_TIMEOUT = 120


def run_pytest(tmp_path: Path, files: dict[str, str], *args: str) -> tuple[int, str, float]:
    """pytest on ``files`` (name -> source) in ``tmp_path``: its status, output and time."""
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    for name, source in files.items():
        (tmp_path / name).write_text(textwrap.dedent(source))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    argv = [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml")]
    argv += ["--rootdir", str(tmp_path), "-p", "no:cacheprovider", *args, *files]
    start = time.monotonic()
    p = subprocess.run(
        argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT
    )
    return p.returncode, p.stdout + p.stderr, time.monotonic() - start


def test_a_test_past_its_limit_fails_and_the_run_goes_on(tmp_path: Path) -> None:
    """Every test has the configured limit, by SIGALRM; a test past its own fails alone."""
    pytest_ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]
    limit = pytest_ini["ini_options"]["timeout"]
    rc, out, _ = run_pytest(
        tmp_path,
        {
            "test_slow.py": """
                import time
                import pytest

                @pytest.mark.timeout(2)
                def test_slow():
                    time.sleep(600)

                def test_after():
                    pass
            """
        },
        "-n",
        "0",
    )
    assert rc == 1, out
    assert f"timeout: {float(limit)}s\ntimeout method: signal\n" in out, out
    assert "Timeout" in out and "test_slow.py::test_slow" in out, out
    assert "1 failed, 1 passed" in out, out


def test_a_test_no_signal_can_end_is_ended_by_the_watchdog(tmp_path: Path) -> None:
    """SIGALRM blocked: pytest-timeout's signal cannot fail the test; the watchdog ends the
    process, printing where each thread was, at twice the 2 s limit."""
    rc, out, _ = run_pytest(
        tmp_path,
        {
            "test_stuck.py": """
                import signal
                import time
                import pytest

                @pytest.mark.timeout(2)
                def test_stuck():
                    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
                    time.sleep(600)
            """
        },
        "-n",
        "0",
    )
    assert rc != 0, out
    assert "Timeout (0:00:04)!" in out, out
    assert "in test_stuck" in out, out


def test_a_crashed_worker_ends_the_run(tmp_path: Path) -> None:
    """Under xdist's --dist loadfile, a worker replaced after a crash waits for good: the
    run must end at the crash, failing and naming the test."""
    crash = """
        import os
        import signal

        def test_crash():
            os.kill(os.getpid(), signal.SIGKILL)
    """
    rc, out, _ = run_pytest(
        tmp_path,
        {"test_a.py": crash, "test_b.py": crash},
        "-n",
        "1",
        "--dist",
        "loadfile",
    )
    assert rc == 1, out
    assert "crashed while running 'test_a.py::test_crash'" in out, out


# subprocess's calls that wait for a process, and the Popen methods that do.
WAITING_CALLS = frozenset({"run", "call", "check_call", "check_output"})


def untimed_waits(source: str) -> list[int]:
    """Lines of ``source`` that wait for a process without a timeout: subprocess.run (and
    the like) without ``timeout=``, ``.communicate()`` without ``timeout=``, and a bare
    ``.wait()``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        name = node.func.attr
        keywords = {k.arg for k in node.keywords}
        on_subprocess = isinstance(node.func.value, ast.Name) and node.func.value.id == "subprocess"
        if (
            (on_subprocess and name in WAITING_CALLS and not keywords & {"timeout", None})
            or (name == "communicate" and "timeout" not in keywords)
            or (name == "wait" and not node.args and not node.keywords)
        ):
            lines.append(node.lineno)
    return lines


def test_every_process_a_test_waits_for_has_a_timeout() -> None:
    """A child that hangs fails its test at its own timeout, saying which it was, before
    the test's time limit; none waits for good."""
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in sorted((ROOT / "tests").rglob("*.py"))
        for line in untimed_waits(path.read_text())
    ]
    assert not found, "waits for a process without a timeout:\n" + "\n".join(found)
    assert untimed_waits("import subprocess\nsubprocess.run(['true'])\np.communicate()\n") == [2, 3]
