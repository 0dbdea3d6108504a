"""gpushare-run's contract: environment of the child, exit codes, errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpushare import libs
from gpushare.client import FIRST_ANSWER
from tests.client.conftest import threads_of
from tests.conftest import _wait_for

GiB = 1 << 30
PRINT_ENV = (
    "import os; print(*[os.environ.get(k, '') for k in ("
    "'CUDA_VISIBLE_DEVICES', 'LD_PRELOAD', 'GPUSHARE_TASK_ID', 'GPUSHARE_LEDGER')], sep='\\n')"
)


def gpushare_run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """gpushare-run with args, outside any task: its exit code and what it printed."""
    return subprocess.run(
        [Path(sys.executable).parent / "gpushare-run", *args],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )


def test_child_gets_granted_gpus_and_the_shim(daemon: Any, run_task: Any) -> None:
    ep = daemon.env("alice", gpus=2, memory=GiB)
    p = run_task(ep, sys.executable, "-c", PRINT_ENV, gpus=2)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    visible, preload, task_id, ledger = out.splitlines()
    assert (
        visible
        == "GPU-5349d000-0000-4000-8000-000000000000,GPU-5349d000-0000-4000-8000-000000000001"
    )
    assert preload.split()[0] == str(libs.shim_path())
    assert len(task_id) == 16
    assert ledger == str(daemon.run_dir / "envs" / "alice" / "ledger")


def test_exit_code_is_the_commands(daemon: Any, run_task: Any) -> None:
    ep = daemon.env("alice")
    p = run_task(ep, "sh", "-c", "exit 7")
    p.communicate(timeout=30)
    assert p.returncode == 7
    p = run_task(ep, "sh", "-c", "kill -TERM $$")
    p.communicate(timeout=30)
    assert p.returncode == 128 + 15
    assert daemon.tasks() == []


def test_command_not_found_and_not_executable(daemon: Any, run_task: Any, tmp_path: Path) -> None:
    ep = daemon.env("alice")
    p = run_task(ep, str(tmp_path / "missing"))
    _, err = p.communicate(timeout=30)
    assert p.returncode == 127
    assert "command not found" in err
    f = tmp_path / "plain"
    f.write_text("x")
    p = run_task(ep, str(f))
    _, err = p.communicate(timeout=30)
    assert p.returncode == 126
    assert daemon.tasks() == []


def test_refusals_have_distinct_exit_codes(daemon: Any, run_task: Any) -> None:
    zero = daemon.env("zero", gpus=0)
    p = run_task(zero, "true")
    _, err = p.communicate(timeout=30)
    assert p.returncode == 77
    assert "quota_zero" in err and "quota is 0" in err

    one = daemon.env("one", gpus=1)
    p = run_task(one, "true", gpus=2)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 77
    assert "quota is 1" in err


def test_memory_hint_beyond_quota_is_refused(daemon: Any) -> None:
    ep = daemon.env("alice", memory=GiB)
    r = gpushare_run("--endpoint", ep, "--memory", "2GiB", "true")
    assert r.returncode == 77
    assert "needs 2GiB per GPU but this environment's memory quota is 1GiB per GPU" in r.stderr


def test_no_free_gpu_is_a_retryable_refusal(daemon: Any, run_task: Any, tmp_path: Path) -> None:
    """threshold 4 tasks per GPU, 4 GPUs: the 17th single-GPU task of 17 envs finds none."""
    holders = []
    go = tmp_path / "go"
    for i in range(16):
        ep = daemon.env(f"e{i}", gpus=1, memory=GiB)
        holders.append(
            run_task(ep, "sh", "-c", f"echo up; while [ ! -e {go} ]; do sleep 0.05; done")
        )
    for h in holders:
        assert h.stdout.readline() == "up\n"
    ep = daemon.env("late", gpus=1, memory=GiB)
    p = run_task(ep, "true", opts=["--no-wait"])
    _, err = p.communicate(timeout=30)
    assert p.returncode == 75
    assert "no_resources" in err and "--wait lets it wait" in err
    p = run_task(ep, "true", env={"GPUSHARE_WAIT": "0"})
    _, err = p.communicate(timeout=30)
    assert p.returncode == 75, err
    go.touch()
    for h in holders:
        h.communicate(timeout=30)
        assert h.returncode == 0


def test_unreachable_daemon(tmp_path: Path) -> None:
    r = gpushare_run("--endpoint", f"ipc://{tmp_path}/nothing.sock", "true")
    assert r.returncode == 69
    assert "cannot reach nodemgr" in r.stderr


def test_a_dead_nodemgr_is_reported_not_waited_for(daemon: Any, run_task: Any) -> None:
    # Killed, nodemgr leaves its socket file: a connect succeeds, nothing ever answers.
    ep = daemon.env("alice")
    daemon.kill()
    assert os.path.exists(ep.removeprefix("ipc://"))
    for opts in ([], ["--no-wait"], ["--wait-timeout", "600"]):
        start = time.monotonic()
        p = run_task(ep, "true", opts=opts)
        _, err = p.communicate(timeout=FIRST_ANSWER + 20)
        took = time.monotonic() - start
        assert p.returncode == 69, (opts, err)
        assert f"nodemgr did not answer at {ep} within {FIRST_ANSWER:g}s" in err
        assert FIRST_ANSWER <= took < FIRST_ANSWER + 10, (opts, took)


def test_ctrl_c_before_nodemgr_answers_says_so(daemon: Any, run_task: Any) -> None:
    ep = daemon.env("alice")
    daemon.kill()
    p = run_task(ep, "true")
    _wait_for(lambda: threads_of(p.pid) > 1, 10)  # waiting for nodemgr's first answer
    os.kill(p.pid, signal.SIGINT)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 130, err
    assert f"cancelled before nodemgr answered at {ep}" in err
    assert "waiting for GPUs" not in err


def test_endpoints_other_than_ipc_are_a_usage_error(tmp_path: Path) -> None:
    for ep in ("tcp://127.0.0.1:9", f"{tmp_path}/task.sock", "ipc://", "inproc://x"):
        r = gpushare_run("--endpoint", ep, "true")
        assert r.returncode == 2, (ep, r.stderr)
        assert f"--endpoint={ep!r}: expected ipc://PATH" in r.stderr
        r = gpushare_run("true", env={**os.environ, "GPUSHARE_ENDPOINT": ep})
        assert r.returncode == 2, (ep, r.stderr)
        assert f"GPUSHARE_ENDPOINT={ep!r}: expected ipc://PATH" in r.stderr


def test_no_endpoint_is_a_usage_error(tmp_path: Path) -> None:
    r = gpushare_run("true", env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 2
    assert "GPUSHARE_ENDPOINT" in r.stderr


def test_sigterm_is_passed_to_the_command(daemon: Any, run_task: Any) -> None:
    ep = daemon.env("alice")
    p = run_task(
        ep, "sh", "-c", "trap 'echo got-term; exit 3' TERM; echo up; while :; do sleep 0.05; done"
    )
    assert p.stdout.readline() == "up\n"
    p.terminate()
    out, _ = p.communicate(timeout=30)
    assert out == "got-term\n"
    assert p.returncode == 3
    assert daemon.tasks() == []


def test_command_can_still_be_interrupted(daemon: Any, run_task: Any) -> None:
    """gpushare-run ignores SIGINT itself (the terminal delivers it to the command);
    the command must not inherit that."""
    ep = daemon.env("alice")
    p = run_task(
        ep,
        sys.executable,
        "-c",
        "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)",
    )
    out, err = p.communicate(timeout=30)
    assert (p.returncode, out) == (0, "True\n"), err


def test_requests_no_node_can_satisfy_are_refused_not_retried(daemon: Any, run_task: Any) -> None:
    many = daemon.env("many", gpus=8, force=True)
    p = run_task(many, "true", gpus=5)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 77
    assert "only 4 GPUs of this node" in err
    huge = daemon.env("huge", gpus=1, memory=17 * GiB, force=True)
    p = run_task(huge, "true")
    _, err = p.communicate(timeout=30)
    assert p.returncode == 77
    assert "more than any GPU" in err


def test_long_command_lines_and_unexecutable_files(
    daemon: Any, run_task: Any, tmp_path: Path
) -> None:
    ep = daemon.env("alice")
    p = run_task(ep, "sh", "-c", "exit 0", "x" * 5000)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    bad = tmp_path / "bad-elf"
    bad.write_bytes(b"\x7fELF" + b"\x00" * 60)
    bad.chmod(0o755)
    p = run_task(ep, str(bad))
    _, err = p.communicate(timeout=30)
    assert p.returncode == 126
    assert "cannot execute" in err
    assert daemon.tasks() == []
