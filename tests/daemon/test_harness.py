"""The test harness itself: nothing a test starts may kill the test run or outlive it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from nodemgr.host import procfs
from tests.conftest import Holder


def _alive(pid: int) -> bool:
    return procfs.state(pid) not in (None, "Z")


def test_a_held_grant_is_held_by_a_heartbeating_child(daemon: Any) -> None:
    # The test daemon reclaims a silent task after 1 s by killing its client: that client
    # must never be the test process.
    holder = Holder(daemon.env("a"))
    (task,) = daemon.tasks()
    assert task["pid"] == holder.pid != os.getpid()
    time.sleep(2.5)  # well past heartbeat_timeout
    assert [t["task_id"] for t in daemon.tasks()] == [holder.task_id]
    holder.close()
    assert daemon.tasks() == []
    assert "reclaimed" not in daemon.logtext()


def test_a_daemon_dies_with_the_test_run(wait_for: Any) -> None:
    # A stand-in for pytest starts a daemon as the fixtures do, then is SIGKILLed. The run
    # directory is short: ipc paths must fit in sun_path.
    root = Path(os.environ.get("TMPDIR", "/tmp")) / f"gs-h{os.getpid()}"
    script = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
        from pathlib import Path
        from tests.conftest import Daemon
        d = Daemon(Path({str(root)!r}))
        print(d.proc.pid, flush=True)
        time.sleep(60)
        """
    )
    runner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert runner.stdout is not None
    nodemgr = int(runner.stdout.readline())
    try:
        assert _alive(nodemgr)
        runner.send_signal(signal.SIGKILL)
        runner.communicate(timeout=30)
        wait_for(lambda: not _alive(nodemgr), 5)
    finally:
        if _alive(nodemgr):
            os.kill(nodemgr, signal.SIGKILL)
        subprocess.run(["rm", "-rf", str(root)], check=False, timeout=120)


def test_a_grant_the_test_process_holds_is_kept_alive() -> None:
    # A test process (a child here, so that a failure cannot end this run) holds a grant on
    # a Connection of its own and heartbeats nothing, past the daemon's 1 s timeout.
    root = Path(os.environ.get("TMPDIR", "/tmp")) / f"gs-k{os.getpid()}"
    script = textwrap.dedent(
        f"""
        import os, sys, time
        sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
        from pathlib import Path
        from gpushare.client import Connection
        from tests.conftest import Daemon
        d = Daemon(Path({str(root)!r}))
        try:
            with Connection(d.env("a")) as c:
                task = c.call("request", gpus=1)["task_id"]
            time.sleep(3.0)
            assert [t["pid"] for t in d.tasks()] == [os.getpid()]
            with Connection(d.env("a")) as c:
                c.call("done", task_id=task)
            print("alive", flush=True)
        finally:
            d.stop()
        """
    )
    try:
        r = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
        )
    finally:
        subprocess.run(["rm", "-rf", str(root)], check=False, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "alive\n"
