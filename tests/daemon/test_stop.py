"""How clients find nodemgr gone (docs/nodemgr.md, `serve` and `top`): a clean stop
removes its sockets, so they fail at once; a killed nodemgr's socket, which nothing listens
on, is told at once too; only a nodemgr that is alive and silent costs the wait for its
answer. `nodemgr top` waits for nodemgr to come back."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

from gpushare.client import FIRST_ANSWER
from gpushare.exitcodes import EXIT_SOFTWARE
from nodemgr.loop.server import MAX_FAILED_TURNS
from tests.conftest import BIN, die_with_test_run, invoke
from tests.daemon.conftest import CLI_AS


def stopped(d: Any, sig: int) -> None:
    d.proc.send_signal(sig)
    assert d.proc.wait(30) == 0, d.logtext()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_clean_stop_removes_the_sockets_and_clients_fail_at_once(
    daemon: Any, run_task: Any, sig: int
) -> None:
    ep = daemon.env("alice")
    env_dir = daemon.run_dir / "envs" / "alice"
    stopped(daemon, sig)
    assert not (daemon.run_dir / "admin.sock").exists()
    assert not (daemon.run_dir / "view.sock").exists()
    assert not (env_dir / "task.sock").exists()
    assert (env_dir / "ledger").is_file()  # kept for the next start to adopt
    r = invoke(daemon, "status")
    assert r.exit_code == 69, r.output
    assert (
        f"nodemgr is not running: no socket at {daemon.run_dir}/admin.sock (start it with: "
        f"nodemgr serve --config {daemon.config}, or give this command the config nodemgr "
        "runs with)"
    ) in r.output
    p = run_task(ep, "true")
    _, err = p.communicate(timeout=60)
    assert p.returncode == 69, err
    assert f"no nodemgr socket at {env_dir}/task.sock" in err
    assert "did not answer" not in err
    daemon.start()
    assert daemon.admin("quota_show", env="alice")["quotas"][0]["endpoint"] == ep
    assert run_task(ep, "true").wait(60) == 0


def test_sigterm_ends_the_wait_whatever_the_sweep_interval(daemon_factory: Any) -> None:
    """nodemgr waits for its next event or sweep; a signal is one of its events. With a
    sweep a minute away and no client to wake it, SIGTERM still stops it cleanly at once
    (20 s: a loaded machine's bound, a third of that sweep interval)."""
    d = daemon_factory(sweep_interval=60)
    d.env("alice")
    d.keeper.stop()  # its heartbeats would wake the loop
    d.proc.send_signal(signal.SIGTERM)
    try:
        code = d.proc.wait(20)
    except subprocess.TimeoutExpired:
        pytest.fail("nodemgr did not stop within 20 s of SIGTERM")
    assert code == 0, d.logtext()
    assert "nodemgr stopped" in d.logtext()
    assert not (d.run_dir / "admin.sock").exists()
    assert not (d.run_dir / "envs" / "alice" / "task.sock").exists()


# `nodemgr serve` with a fault that fails every turn of its loop: its reclaims' step raises.
BROKEN = textwrap.dedent(
    """
    import sys
    from nodemgr.loop import reclaim
    from nodemgr.cli import main

    def failing_step(self, now):
        raise RuntimeError("a turn that always fails")

    reclaim.Reclaims.step = failing_step
    sys.argv[1:] = ["serve", "--config", sys.argv[1]]
    main()
    """
)


def test_a_loop_that_fails_at_every_turn_stops_to_be_restarted() -> None:
    """A failure at every turn serves nothing reliably and leaves the wait no time (the
    sweep never comes to set it): nodemgr does not spin, it stops cleanly with
    EXIT_SOFTWARE, for systemd's Restart=on-failure, naming what failed."""
    root = Path(tempfile.mkdtemp(prefix="gs-", dir="/tmp"))  # short: sun_path
    try:
        config = root / "nodemgr.toml"
        config.write_text(
            f'[node]\nrun_dir = "{root}/run"\nstate_dir = "{root}/state"\n'
            '[gpus]\nsource = "simulated"\n'
        )
        p = subprocess.run(
            [sys.executable, "-c", BROKEN, str(config)],
            cwd=root,  # not the source tree, where the ledger bindings are not built
            capture_output=True,
            text=True,
            timeout=120,
            preexec_fn=die_with_test_run(),
        )
        log = p.stdout + p.stderr
        assert p.returncode == EXIT_SOFTWARE, log
        assert log.count("internal error in the loop; nodemgr goes on") == 1, log
        assert (
            f"internal error in the loop {MAX_FAILED_TURNS} times in a row, the last in "
            "failing_step (<string>:"
        ) in log
        assert (
            "RuntimeError: a turn that always fails; nodemgr stops with exit status "
            f"{EXIT_SOFTWARE} for its service manager to restart it"
        ) in log
        assert "nodemgr stopped" in log
        assert not (root / "run" / "admin.sock").exists()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_killed_nodemgr_is_told_at_once_and_a_silent_one_after_the_wait(
    daemon: Any,
) -> None:
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        r = invoke(daemon, "status")
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    assert r.exit_code == 69, r.output
    assert (
        f"nodemgr did not answer at ipc://{daemon.run_dir}/admin.sock within "
        f"{FIRST_ANSWER:g}s (its process is alive but does not answer"
    ) in r.output
    daemon.kill()
    assert (daemon.run_dir / "admin.sock").is_socket()  # left behind
    r = invoke(daemon, "status")
    assert r.exit_code == 69, r.output
    assert (
        f"nodemgr is not running: nothing listens at {daemon.run_dir}/admin.sock (left by a "
        "nodemgr that was killed)"
    ) in r.output


class Lines(threading.Thread):
    """A process's output, line by line, as it comes."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        super().__init__(daemon=True)
        self.proc = proc
        self.lines: list[str] = []
        self.start()

    def run(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def interrupt(self) -> None:
        """Ctrl-C the process, as a user ends `top`; it must exit 0."""
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(30)
        self.join(30)
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        assert self.proc.returncode == 0, "".join(self.lines)

    def since(self, mark: int, text: str) -> int | None:
        """The index of the first line from ``mark`` on that holds ``text``."""
        for i, line in enumerate(self.lines[mark:], mark):
            if text in line:
                return i
        return None


def test_top_waits_while_nodemgr_is_away_and_resumes(daemon: Any, wait_for: Any) -> None:
    daemon.env("alice")
    top = subprocess.Popen(
        [str(BIN / "nodemgr"), "top", "--interval", "0.1", "--config", str(daemon.config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    out = Lines(top)
    try:
        wait_for(lambda: out.since(0, "GPU  MEMORY") is not None, 30)
        stopped(daemon, signal.SIGTERM)
        mark = len(out.lines)
        wait_for(lambda: out.since(mark, "nodemgr is not running: no socket at") is not None, 30)
        away = out.since(mark, "waiting for it to come back")
        assert away is not None and top.poll() is None
        daemon.start()
        wait_for(lambda: out.since(away, "GPU  MEMORY") is not None, 30)
        assert top.poll() is None
    finally:
        out.interrupt()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_a_readers_top_started_while_nodemgr_is_away_finds_it_back(
    daemon_factory: Any, wait_for: Any
) -> None:
    """A user [readers] lets in, but not [admin], runs `top` while nodemgr is stopped:
    when nodemgr is back, top shows it through view.sock (only then can it tell which
    socket lets the user in)."""
    d = daemon_factory({"readers": {"mode": "0666"}})
    d.env("alice")
    os.chmod(d.root, 0o755)
    os.chmod(d.run_dir, 0o711)
    stopped(d, signal.SIGTERM)
    nobody = pwd.getpwnam("nobody")
    with tempfile.TemporaryDirectory(dir="/tmp") as public:
        os.chmod(public, 0o755)
        cfg = Path(public) / "c.toml"
        cfg.write_text(d.config.read_text())
        cfg.chmod(0o644)
        ids = [str(nobody.pw_gid), str(nobody.pw_uid)]
        top = subprocess.Popen(
            [sys.executable, "-c", CLI_AS, *ids, "", "top", "--delay", "0.1", "--config", str(cfg)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            cwd="/",
        )
        out = Lines(top)
        try:
            wait_for(lambda: out.since(0, "nodemgr is not running: no socket at") is not None, 30)
            mark = len(out.lines)
            d.start()
            wait_for(lambda: out.since(mark, "GPU  MEMORY") is not None, 60)
            assert out.since(mark, "alice") is not None
        finally:
            out.interrupt()
