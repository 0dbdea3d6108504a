"""Storage faults: a full disk under nodemgr's database, a damaged or emptied database.

The full disk is real: the state directory is a small tmpfs filled to the last byte, so
sqlite's writes fail with ENOSPC as they would on a full /var.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import sqlite3
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpushare.client import Connection, NoResources, wait_until_serving
from tests.conftest import BIN, Daemon, invoke

MiB = 1 << 20
GiB = 1 << 30


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs, unmounted afterwards."""
    where = tmp_path / "disk"
    where.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(where)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False, timeout=120)


def fill(disk: Path) -> Path:
    """Write a file on ``disk`` until no byte more fits; return it."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 512)
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler


def history(d: Daemon) -> dict[str, str | None]:
    return {r["task_id"]: r["reason"] for r in d.admin("history")["records"]}


def serve(config: Path) -> subprocess.CompletedProcess[str]:
    """``nodemgr serve`` that is expected to refuse to start."""
    return subprocess.run(
        [str(BIN / "nodemgr"), "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=30,
    )


def running_on(
    daemon_factory: Any, small_disk: Path, run_task: Any, wait_for: Any
) -> tuple[Any, str, subprocess.Popen[str], str]:
    """A daemon whose state is on ``small_disk``, environment alice and one task of it
    running: (daemon, alice's endpoint, the task's process, its task id)."""
    d = daemon_factory(state_dir=str(small_disk / "state"), heartbeat_timeout=3.0)
    alice = d.env("alice")
    p = run_task(alice, "sleep", "60")
    wait_for(lambda: len(d.tasks()) == 1, 10)
    [tid] = [t["task_id"] for t in d.tasks()]
    return d, alice, p, tid


@pytest.fixture
def holder(
    daemon_factory: Any, run_task: Any, cbin: dict[str, Path], wait_for: Any
) -> Callable[..., tuple[Daemon, str, subprocess.Popen[str]]]:
    """Starts a daemon (its heartbeat timeout given), environment alice (the settings
    given) and one task of it that holds `mib` MiB until file `go` is there: (daemon,
    alice's endpoint, the task's process)."""

    def start(
        mib: int, go: Path, heartbeat_timeout: float, **settings: Any
    ) -> tuple[Daemon, str, subprocess.Popen[str]]:
        d = daemon_factory(heartbeat_timeout=heartbeat_timeout)
        alice = d.env("alice", **settings)
        p = run_task(alice, str(cbin["client"]), "alloc", str(mib), "waitfile", str(go))
        wait_for(lambda: [t["memory_used"] for t in d.tasks()] == [mib * MiB], 10)
        return d, alice, p

    return start


def test_full_disk_keeps_records_and_serving(
    daemon_factory: Any, small_disk: Path, run_task: Any, wait_for: Any
) -> None:
    d, alice, before, first = running_on(daemon_factory, small_disk, run_task, wait_for)
    filler = fill(small_disk)

    # The task's end is seen through its pidfd, in the poll loop: the record cannot be
    # written, and nodemgr serves on.
    os.killpg(before.pid, 9)
    wait_for(lambda: d.tasks() == [], 10)
    assert d.proc.poll() is None
    # A task starts and ends while the disk is still full.
    p = run_task(alice, "true")
    assert p.wait(30) == 0, p.communicate(timeout=30)
    assert d.proc.poll() is None
    assert "the disk holding it is full" in d.logtext()
    # A quota change cannot be made durable: refused, naming the cause, nothing changed.
    with pytest.raises(Exception, match="disk holding it is full"):
        d.admin("quota_set", env="bob", gpus=1, memory=MiB)
    assert [q["env"] for q in d.admin("quota_show")["quotas"]] == ["alice"]

    filler.unlink()
    wait_for(lambda: "kept records written" in d.logtext(), 10)
    records = history(d)
    assert records[first] == "exited"
    assert len(records) == 2
    assert all(reason is not None for reason in records.values())
    assert d.proc.poll() is None


def test_restart_on_a_full_disk_serves(
    daemon_factory: Any, small_disk: Path, run_task: Any, wait_for: Any
) -> None:
    d, _, p, tid = running_on(daemon_factory, small_disk, run_task, wait_for)
    filler = fill(small_disk)
    d.kill()
    os.killpg(p.pid, 9)
    p.wait(30)
    # Its client ended while nodemgr was down: the end is kept until it can be written.
    d.start()
    assert d.tasks() == []
    assert d.admin("quota_show")["quotas"][0]["env"] == "alice"
    filler.unlink()
    wait_for(lambda: history(d).get(tid) == "exited", 10)


def test_start_on_a_full_disk_names_the_cause(
    daemon_factory: Any, small_disk: Path, wait_for: Any
) -> None:
    d = daemon_factory(state_dir=str(small_disk / "state"))
    d.env("alice")
    d.stop()
    # A clean stop removes the WAL: starting again must write, and cannot.
    fill(small_disk)
    r = serve(d.config)
    assert r.returncode == 78, r.stderr
    assert "full" in r.stderr
    assert "unreadable" not in r.stderr


def test_start_on_a_read_only_disk_names_the_cause(daemon_factory: Any, small_disk: Path) -> None:
    d = daemon_factory(state_dir=str(small_disk / "state"))
    d.env("alice")
    d.stop()
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True, timeout=120)
    try:
        r = serve(d.config)
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_disk)], check=True, timeout=120)
    assert r.returncode == 78, r.stderr
    assert "Read-only file system" in r.stderr
    assert "Traceback" not in r.stderr


def test_malformed_database_exits_78(daemon_factory: Any) -> None:
    d = daemon_factory()
    d.env("alice")
    d.stop()
    db = d.state_dir / "nodemgr.db"
    with contextlib.closing(sqlite3.connect(db)) as c:
        page = int(c.execute("PRAGMA page_size").fetchone()[0])
        root = int(
            c.execute("SELECT rootpage FROM sqlite_master WHERE name = 'envs'").fetchone()[0]
        )
    with open(db, "r+b") as f:
        f.seek((root - 1) * page)
        f.write(b"\xff" * page)
    r = serve(d.config)
    assert r.returncode == 78, r.stderr
    assert "malformed" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "lost", [("nodemgr.db", "nodemgr.db-wal", "nodemgr.db-shm"), ("nodemgr.db-wal",)]
)
def test_lost_database_beside_live_ledgers_refuses_to_start(
    holder: Any, tmp_path: Path, lost: tuple[str, ...]
) -> None:
    d, _, p = holder(64, tmp_path / "never", heartbeat_timeout=30.0)
    d.kill()
    for name in lost:
        (d.state_dir / name).unlink()
    # Started beside the ledger its processes still use, the emptied database would let
    # `quota set alice` give alice a second, fresh ledger: nodemgr must not start.
    proc = subprocess.Popen(
        [str(BIN / "nodemgr"), "serve", "--config", str(d.config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _, err = proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate(timeout=30)
        pytest.fail(f"nodemgr started beside a live ledger it has no record of: {err}")
    assert proc.returncode == 78, err
    assert "knows no environment alice" in err
    assert str(p.pid) in err or "pids" in err
    assert "Traceback" not in err


def test_emptied_database_beside_unused_ledgers_starts_only_when_told(
    daemon_factory: Any,
) -> None:
    """No process uses alice's ledger, but the database that knew her quota is gone: nodemgr
    does not quietly start with no quotas; `--forget-unknown-envs` starts it without them."""
    d = daemon_factory()
    d.env("alice")
    d.stop()
    for name in ("nodemgr.db", "nodemgr.db-wal", "nodemgr.db-shm"):
        with contextlib.suppress(FileNotFoundError):
            (d.state_dir / name).unlink()
    r = serve(d.config)
    assert r.returncode == 78, r.stderr
    assert "knows no environment alice" in r.stderr
    assert "nodemgr serve --forget-unknown-envs" in r.stderr
    assert "Traceback" not in r.stderr
    # The refused start leaves no socket: commands say nodemgr is not running, not that a
    # nodemgr was killed.
    assert not (d.run_dir / "admin.sock").exists() and not (d.run_dir / "view.sock").exists()
    status = invoke(d, "status")
    assert status.exit_code == 69 and "no socket at" in status.output, status.output
    d.log = open(d.root / "nodemgr.log", "a")  # noqa: SIM115 (closed by d.stop)
    d.proc = subprocess.Popen(
        [str(BIN / "nodemgr"), "serve", "--forget-unknown-envs", "--config", str(d.config)],
        stdout=d.log,
        stderr=subprocess.STDOUT,
    )
    assert wait_until_serving(
        f"ipc://{d.run_dir / 'admin.sock'}", lambda: d.proc.poll() is None, 15
    ), d.logtext()
    assert d.admin("quota_show")["quotas"] == []
    assert "left from environment alice" in d.logtext()
    # Created again, alice gets a new ledger, and the next start needs no flag.
    d.env("alice")
    d.stop()
    d.log = open(d.root / "nodemgr.log", "a")  # noqa: SIM115
    d.start()
    assert [q["env"] for q in d.admin("quota_show")["quotas"]] == ["alice"]


def test_run_dir_removed_under_nodemgr_is_made_again(
    holder: Any, run_task: Any, cbin: dict[str, Path], tmp_path: Path, wait_for: Any
) -> None:
    go = tmp_path / "go"
    d, alice, p = holder(512, go, heartbeat_timeout=2.0, memory=GiB)
    [task] = d.tasks()
    shutil.rmtree(d.run_dir)
    # Sockets come back, so the task's heartbeats reach nodemgr again and it is not
    # killed at the heartbeat timeout.
    wait_for(lambda: (d.run_dir / "admin.sock").is_socket(), 10)
    time.sleep(3.0)
    assert p.poll() is None
    assert [t["task_id"] for t in d.tasks()] == [task["task_id"]]
    assert d.tasks()[0]["memory_used"] == 512 * MiB
    assert "was removed or replaced while in use" in d.logtext()
    # Its processes charge a ledger new processes cannot open: no second one meanwhile.
    with Connection(alice) as conn, pytest.raises(NoResources, match="ledger"):
        conn.call("request", gpus=1)
    go.touch()
    assert p.wait(30) == 0
    wait_for(lambda: "a new ledger replaces the lost one" in d.logtext(), 10)
    q = run_task(alice, str(cbin["client"]), "alloc", "512")
    assert q.wait(30) == 0, q.communicate(timeout=30)


def test_restart_after_run_dir_lost_never_doubles_a_quota(
    holder: Any, run_task: Any, cbin: dict[str, Path], tmp_path: Path, wait_for: Any
) -> None:
    go = tmp_path / "go"
    d, alice, p = holder(900, go, heartbeat_timeout=5.0, memory=GiB)
    d.kill()
    shutil.rmtree(d.run_dir)
    d.start()
    # The restored task's processes charge the removed ledger, which nodemgr cannot see:
    # a new task of alice would get a fresh 1 GiB beside its 900 MiB.
    assert len(d.tasks()) == 1
    with Connection(alice) as conn, pytest.raises(NoResources, match="ledger"):
        conn.call("request", gpus=1)
    assert "no task is granted until they end" in d.logtext()
    go.touch()
    assert p.wait(30) == 0
    wait_for(lambda: d.tasks() == [], 10)
    q = run_task(alice, str(cbin["client"]), "alloc", "512")
    assert q.wait(30) == 0, q.communicate(timeout=30)
