"""gpushare-run --predict: the dry run on a private simulated node, run for real (the real
gpushare-run, a real private nodemgr, the real shim on the simulated driver), with programs
that call the driver themselves. PyTorch's dry runs: tests/real_torch/test_torch_predict.py."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.client.conftest import gpushare_run
from tests.conftest import ROOT, SANITIZER_PRELOAD

MIB = 1 << 20
LOOP = str(ROOT / "tests" / "fixtures" / "driver_loop.py")


@pytest.fixture
def tmpdir_short() -> Iterator[Path]:
    """A TMPDIR of the test's own, short enough for the private node's sockets, so that
    what the dry run leaves there can be seen."""
    root = Path(tempfile.mkdtemp(prefix="gsp-", dir="/tmp"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def predict(*args: str, tmpdir: Path | None = None, **env: str) -> Any:
    extra = dict(env)
    if tmpdir is not None:
        extra["TMPDIR"] = str(tmpdir)
    if SANITIZER_PRELOAD:
        extra["LD_PRELOAD"] = " ".join(SANITIZER_PRELOAD)
    return gpushare_run("--predict", *args, env=extra)


def node_processes(root: Path) -> list[int]:
    """Processes whose command line names ``root`` or a path under it (a private
    nodemgr's, or a command's own file)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if str(root).encode() in cmdline:
            found.append(int(pid))
    return found


def test_a_dry_run_reports_the_shape_and_stops_at_its_iterations(
    tmp_path: Path, tmpdir_short: Path
) -> None:
    steps = tmp_path / "steps"
    r = predict(
        "--json",
        "--iterations",
        "4",
        "--",
        sys.executable,
        LOOP,
        "64",
        "32",
        "50",
        "--launches",
        "7",
        "--blocks",
        "200",
        "--upload",
        "2",
        "--reads",
        "3",
        "--out",
        str(steps),
        tmpdir=tmpdir_short,
        # Not the node's: the dry run asks no nodemgr but its own.
        GPUSHARE_ENDPOINT="ipc:///nonexistent/task.sock",
    )
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)  # the prediction alone on standard output
    assert got["predicted"] is True
    # Four iterations as on a shared GPU, then one after the release.
    assert got["iterations"] == 5 and got["exit_code"] is None
    assert got["peak"] == 96 * MIB
    assert (got["persistent"], got["temporary"]) == (64 * MIB, 32 * MIB)
    assert got["gpus"] == [{"gpu": 0, "persistent": 64 * MIB, "temporary": 32 * MIB}]
    assert got["kernels_per_step"] == 7
    assert got["waves_per_step"] == 7 * 2  # 200 blocks over 132 SMs
    # No framework, no operator profile.
    assert got["flops_per_step"] is None and got["operators"] is None and got["batch"] is None
    assert got["copies_per_step"] == {
        "host_to_device_bytes": 2 * MIB,
        "device_to_host_bytes": 3 * 4096,
        "device_to_device_bytes": 0,
        "reads": 3,
    }
    # It waited at its 5th boundary to be stopped: steps 0-3 were written, no more.
    assert steps.read_text().split() == ["0", "1", "2", "3"]
    # Its node is gone: no directory left, no process; nor is the command.
    assert list(tmpdir_short.iterdir()) == []
    assert node_processes(tmpdir_short) == []
    assert node_processes(steps) == []


def test_the_command_output_goes_to_stderr_with_json(tmpdir_short: Path) -> None:
    r = predict("--json", "--", sys.executable, LOOP, "8", "8", "1", tmpdir=tmpdir_short)
    assert r.returncode == 0, r.stderr
    assert "done" in r.stderr and "done" not in r.stdout
    got = json.loads(r.stdout)
    # It ended of itself after one boundary of the 3: a peak, but no shape (that takes 4).
    assert got["exit_code"] == 0 and got["iterations"] == 1 and got["predicted"] is True
    assert got["peak"] == 16 * MIB
    assert got["persistent"] is None and got["temporary"] is None


def test_the_text_report_names_the_figures(tmpdir_short: Path) -> None:
    r = predict("--", sys.executable, LOOP, "64", "32", "10", tmpdir=tmpdir_short)
    assert r.returncode == 0, r.stderr
    assert "stopped after 3 iterations and one more after a release" in r.stdout
    assert "peak: 96MiB" in r.stdout
    assert "GPU 0: persistent 64MiB, temporary 32MiB per iteration" in r.stdout
    # It reads nothing back: nothing to warn of.
    assert "copies per iteration: 0B host to device, 0B device to host" in r.stdout
    assert "results back" not in r.stdout
    r = predict("--", sys.executable, LOOP, "8", "8", "10", "--reads", "2", tmpdir=tmpdir_short)
    assert r.returncode == 0, r.stderr
    assert "it reads 2 results back from the GPU per iteration" in r.stdout


def test_a_command_that_fails_in_the_dry_run_predicts_nothing(tmpdir_short: Path) -> None:
    r = predict("--json", "--", sys.executable, "-c", "raise SystemExit(5)", tmpdir=tmpdir_short)
    assert r.returncode == 97, r.stderr
    got = json.loads(r.stdout)
    assert got["predicted"] is False and got["exit_code"] == 5 and got["iterations"] == 0
    r = predict("--", sys.executable, "-c", "raise SystemExit(5)", tmpdir=tmpdir_short)
    assert r.returncode == 97
    assert "no prediction" in r.stdout
    assert list(tmpdir_short.iterdir()) == []


def test_a_command_that_cannot_run_says_so(tmpdir_short: Path) -> None:
    r = predict("--", str(tmpdir_short / "missing"), tmpdir=tmpdir_short)
    assert r.returncode == 127
    assert "missing" in r.stderr
    assert list(tmpdir_short.iterdir()) == []


@pytest.mark.parametrize(
    ("args", "env", "says"),
    [
        (["--iterations", "3", "true"], {}, "--iterations goes with --predict"),
        (["--predict", "--status"], {}, "either --status or --predict"),
        (["--predict", "--class", "be", "true"], {}, "--class"),
        (["--predict", "--compute", "30", "true"], {}, "--compute"),
        (["--predict", "--no-wait", "true"], {}, "--wait/--no-wait"),
        (
            ["--predict", "--iterations", "0", "true"],
            {},
            "'0' is not a whole number from 1 to 1000",
        ),
        (["--predict", "--endpoint", "ipc:///x/task.sock", "true"], {}, "--endpoint"),
        (["--predict", "true"], {"GPUSHARE_PREDICT_ITERATIONS": "x"}, "PREDICT_ITERATIONS"),
        (["--json", "true"], {}, "--json goes with --status or --predict"),
    ],
)
def test_predict_usage_errors(args: list[str], env: dict[str, str], says: str) -> None:
    r = gpushare_run(*args, env=env)
    assert r.returncode == 2
    assert says in r.stderr


def test_iterations_come_from_the_environment(tmpdir_short: Path) -> None:
    r = predict(
        "--json",
        "--",
        sys.executable,
        LOOP,
        "8",
        "8",
        "50",
        tmpdir=tmpdir_short,
        GPUSHARE_PREDICT_ITERATIONS="2",
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["iterations"] == 3


def test_every_process_of_the_task_runs_its_iterations_and_is_counted(
    tmp_path: Path, tmpdir_short: Path
) -> None:
    """Two processes of one task (ranks that start together), of different sizes and
    speeds: the dry run waits for both to run their iterations and the one after the
    release, and adds them up."""
    a, b, go = tmp_path / "a", tmp_path / "b", tmp_path / "go"
    script = (
        f"{sys.executable} {LOOP} 64 32 50 --barrier {go} 2 --out {a} & "
        f"{sys.executable} {LOOP} 16 8 50 --barrier {go} 2 --launches 200 --out {b}; wait"
    )
    r = predict("--json", "--", "sh", "-c", script, tmpdir=tmpdir_short)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert a.read_text().split() == b.read_text().split() == ["0", "1", "2"]
    assert got["peak"] == (64 + 32 + 16 + 8) * MIB
    assert (got["persistent"], got["temporary"]) == (80 * MIB, 40 * MIB)
    assert got["kernels_per_step"] == 200
    assert node_processes(a) == node_processes(b) == []


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace(
    tmp_path: Path, tmpdir_short: Path
) -> None:
    steps = tmp_path / "steps"
    r = predict(
        "--json",
        "--grace",
        "1",
        "--",
        "sh",
        "-c",
        f"{sys.executable} {LOOP} 8 8 50 --ignore-term --out {steps}; echo after >&2",
        tmpdir=tmpdir_short,
    )
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["exit_code"] is None and got["persistent"] == 8 * MIB
    assert steps.read_text().split() == ["0", "1", "2"]
    assert node_processes(steps) == []


def test_the_environments_nodemgr_estimates_the_step_time(daemon: Any, tmpdir_short: Path) -> None:
    """With the environment's endpoint, the report adds nodemgr's step time estimate per
    GPU model of its node (docs/prediction.md#step-time); nothing is granted there."""
    ep = daemon.env("alice", gpus=1, memory=1 << 30)
    cmd = ("--", sys.executable, LOOP, "64", "32", "10", "--launches", "20")
    r = predict("--json", *cmd, tmpdir=tmpdir_short, GPUSHARE_ENDPOINT=ep)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["host_seconds_per_step"] > 0
    [est] = got["step_time"]
    assert est["model"] == "gpushare Simulated GPU" and est["source"] == "analytic"
    assert est["step"] >= got["host_seconds_per_step"] and 0 <= est["utilization"] <= 1
    assert daemon.admin("history", env="alice")["records"] == []
    text = predict(*cmd, tmpdir=tmpdir_short, GPUSHARE_ENDPOINT=ep)
    assert text.returncode == 0, text.stderr
    assert "on gpushare Simulated GPU:" in text.stdout and "analytic estimate" in text.stdout
    # An endpoint nobody serves: said, and the prediction stands.
    gone = predict(*cmd, tmpdir=tmpdir_short, GPUSHARE_ENDPOINT="ipc:///nonexistent/task.sock")
    assert gone.returncode == 0, gone.stderr
    assert "no step time estimate: nodemgr at ipc:///nonexistent/task.sock" in gone.stdout
