"""A database an older nodemgr wrote (schema version 2) is brought up to date at start: each
running task's request is made again from what that version kept of it (task_shapes,
task_wrappers), and a restart restores the tasks with it."""

from __future__ import annotations

import shutil
import sqlite3
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpushare.messages import Request
from nodemgr.loop.server import Server
from nodemgr.node.store import SCHEMA_VERSION, Store
from tests.daemon.conftest import in_process_server

GiB = 1 << 30
MiB = 1 << 20

# The schema of version 2, as nodemgr.node.store wrote it.
V2_SCHEMA = """
CREATE TABLE IF NOT EXISTS envs (
    name    TEXT PRIMARY KEY,
    gpus    INTEGER NOT NULL,
    memory  INTEGER NOT NULL,
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS tasks (
    task_id   TEXT PRIMARY KEY,
    env       TEXT NOT NULL,
    gpus      TEXT NOT NULL,          -- node GPU indices, comma-separated
    memory    INTEGER NOT NULL,       -- per-GPU memory granted, bytes
    pid       INTEGER,                -- the client process, as the kernel named it
    pid_start INTEGER,                -- its start time (clock ticks after boot)
    command   TEXT,
    started   REAL NOT NULL,          -- Unix time
    ended     REAL,                   -- NULL while the task runs
    reason    TEXT,                   -- why it ended: see docs/operations.md
    peak      INTEGER NOT NULL DEFAULT 0,
    exit_code INTEGER
);
CREATE TABLE IF NOT EXISTS gpu_modes (
    uuid    TEXT PRIMARY KEY,         -- the GPU's UUID (GPU-...)
    mode    TEXT NOT NULL,            -- "shared" or "timesliced", set by an admin
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS gpu_drains (
    uuid    TEXT PRIMARY KEY,         -- a GPU an admin drained: no new grants on it
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS task_shapes (
    task_id    TEXT PRIMARY KEY,      -- a running task's, for time slicing after a restart
    persistent INTEGER,               -- its request's estimate, bytes; NULL: none stated
    temporary  INTEGER,
    guard      INTEGER NOT NULL       -- bytes after its persistent slice
);
CREATE TABLE IF NOT EXISTS task_wrappers (
    task_id TEXT PRIMARY KEY          -- a running task whose client runs its command as its
);                                    -- children (request.wrapper), kept for after a restart
CREATE TABLE IF NOT EXISTS env_idle (
    name    TEXT PRIMARY KEY,         -- an environment whose idle policy is not the node's
    timeout REAL,                     -- seconds; 0: off; NULL: the node's
    action  TEXT                      -- "reclaim" or "report"; NULL: the node's
);
CREATE INDEX IF NOT EXISTS tasks_running ON tasks (task_id) WHERE ended IS NULL;
CREATE INDEX IF NOT EXISTS tasks_started ON tasks (started);
"""

# Running: "wrapped" (gpushare-run, with an estimate), "plain" (the auto-loader, no
# estimate), "bare" (no shape kept: the node's guard); ended: "over".
EXPECTED = {
    "wrapped": Request(
        gpus=2, command="train", persistent=2 * GiB, temporary=GiB, guard=64 * MiB, wrapper=True
    ),
    "plain": Request(gpus=1, command="python x.py", guard=100 * MiB),
    "bare": Request(gpus=1, command=None),
}


def make_v2(path: Path) -> None:
    db = sqlite3.connect(path)
    db.executescript(V2_SCHEMA)
    db.execute("INSERT INTO envs VALUES ('alice', 4, ?, 1.0, 1.0)", (4 * GiB,))
    tasks = [
        ("wrapped", "0,1", "train", None),
        ("plain", "2", "python x.py", None),
        ("bare", "3", None, None),
        ("over", "0", "done before", 5.0),
    ]
    for tid, gpus, command, ended in tasks:
        db.execute(
            "INSERT INTO tasks (task_id, env, gpus, memory, pid, pid_start, command, started, "
            "ended, reason) VALUES (?, 'alice', ?, ?, NULL, NULL, ?, 2.0, ?, ?)",
            (tid, gpus, 4 * GiB, command, ended, None if ended is None else "done"),
        )
    db.execute("INSERT INTO task_shapes VALUES ('wrapped', ?, ?, ?)", (2 * GiB, GiB, 64 * MiB))
    db.execute("INSERT INTO task_shapes VALUES ('plain', NULL, NULL, ?)", (100 * MiB,))
    db.execute("INSERT INTO task_wrappers VALUES ('wrapped')")
    db.execute("PRAGMA user_version=2")
    db.commit()
    db.close()


def test_a_version_2_database_keeps_each_running_tasks_request(tmp_path: Path) -> None:
    path = tmp_path / "nodemgr.db"
    make_v2(path)
    store = Store(path)
    try:
        assert store.task_requests() == EXPECTED
        assert [r.task_id for r in store.history(None, None, 10)] == [
            "over",
            "bare",
            "plain",
            "wrapped",
        ]
        # A task that ends no longer needs its request.
        store.task_ended("bare", 3.0, "done", 0, 0)
        assert set(store.task_requests()) == {"wrapped", "plain"}
    finally:
        store.close()
    db = sqlite3.connect(path)
    try:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 7
        tables = {n for (n,) in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        assert "task_shapes" not in tables and "task_wrappers" not in tables
        assert "env_compute" in tables
        ended = "SELECT request FROM tasks WHERE task_id IN ('over', 'bare')"
        assert db.execute(ended).fetchall() == [(None,), (None,)]
    finally:
        db.close()
    # Opened again: already up to date, nothing changes.
    store = Store(path)
    try:
        assert set(store.task_requests()) == {"wrapped", "plain"}
    finally:
        store.close()


def test_an_unreadable_request_is_said_and_left_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "nodemgr.db"
    make_v2(path)
    Store(path).close()
    db = sqlite3.connect(path)
    db.execute("UPDATE tasks SET request = x'c1' WHERE task_id = 'plain'")
    db.commit()
    db.close()
    store = Store(path)
    try:
        assert set(store.task_requests()) == {"wrapped", "bare"}
        assert "task plain: its request in the database cannot be read" in caplog.text
    finally:
        store.close()


@pytest.fixture
def upgraded() -> Iterator[Server]:
    """nodemgr's loop in this process (as the ``server`` fixture's), started on a state
    directory holding a version-2 database with running tasks."""
    root = Path(tempfile.mkdtemp(prefix="gs-", dir="/tmp"))
    (root / "state").mkdir()
    make_v2(root / "state" / "nodemgr.db")
    with in_process_server(root) as srv:
        yield srv
    shutil.rmtree(root, ignore_errors=True)


def test_a_restart_on_a_version_2_database_restores_the_tasks_requests(upgraded: Server) -> None:
    tasks = upgraded.node.tasks
    assert set(tasks) == {"wrapped", "plain", "bare"}
    wrapped, plain, bare = tasks["wrapped"], tasks["plain"], tasks["bare"]
    assert wrapped.request == EXPECTED["wrapped"]
    assert (wrapped.request.wrapper, wrapped.request.estimate, wrapped.guard) == (
        True,
        (2 * GiB, GiB),
        64 * MiB,
    )
    assert (plain.request.wrapper, plain.request.estimate, plain.guard) == (None, None, 100 * MiB)
    # Without a kept shape a task gets the node's guard, as it did before.
    assert bare.guard == upgraded.config.guard
    assert (bare.gpus, plain.gpus, wrapped.gpus) == ((3,), (2,), (0, 1))


def _older(tmp_path: Path, version: int, *sql: str) -> Path:
    """A database as a nodemgr of schema ``version`` left it: today's, taken back by
    ``sql``."""
    path = tmp_path / "nodemgr.db"
    Store(path).close()
    db = sqlite3.connect(path)
    for statement in sql:
        db.execute(statement)
    db.execute(f"PRAGMA user_version={version}")
    db.commit()
    db.close()
    return path


def _version(path: Path) -> int:
    db = sqlite3.connect(path)
    try:
        return int(db.execute("PRAGMA user_version").fetchone()[0])
    finally:
        db.close()


def test_a_version_4_database_gains_the_compute_caps(tmp_path: Path) -> None:
    """Schema 4 to 5 (its own step): the env_compute table is made, and caps written after
    are read back."""
    path = _older(tmp_path, 4, "DROP TABLE env_compute")
    store = Store(path)
    try:
        store.put_env_compute("alice", 30)
        store.put_env_compute("bob", 40)
        store.put_env_compute("bob", None)
        assert store.env_compute() == {"alice": 30}
    finally:
        store.close()
    assert _version(path) == SCHEMA_VERSION == 7


def test_a_version_5_database_gains_predictions_and_top_ups(tmp_path: Path) -> None:
    """Schema 5 to 6 (its own step): each task's prediction and top-ups; a record written
    before reads as one without a prediction."""
    path = _older(
        tmp_path,
        5,
        "ALTER TABLE tasks DROP COLUMN predicted",
        "ALTER TABLE tasks DROP COLUMN topups",
        "INSERT INTO tasks (task_id, env, gpus, memory, started, ended, reason, peak) "
        "VALUES ('t1', 'alice', '0', 1024, 1.0, 2.0, 'done', 512)",
    )
    store = Store(path)
    try:
        [old] = store.history("alice", None, 10)
        assert (old.predicted, old.topups, old.peak) == (None, 0, 512)
        assert store.missed_peaks() == {}
    finally:
        store.close()
    assert _version(path) == SCHEMA_VERSION


def test_a_version_6_database_gains_step_times(tmp_path: Path) -> None:
    """Schema 6 to 7 (its own step): each task's step time, estimated and measured."""
    columns = ("features", "gpu_model", "predicted_step", "predicted_util", "step", "util")
    path = _older(
        tmp_path,
        6,
        *(f"ALTER TABLE tasks DROP COLUMN {c}" for c in columns),
        "INSERT INTO tasks (task_id, env, gpus, memory, started, ended, reason, peak, predicted) "
        "VALUES ('t1', 'alice', '0', 1024, 1.0, 2.0, 'done', 512, 256)",
    )
    store = Store(path)
    try:
        [old] = store.history("alice", None, 10)
        assert (old.predicted, old.gpu_model, old.predicted_step, old.step) == (
            256,
            None,
            None,
            None,
        )
        assert store.runs(10) == []
    finally:
        store.close()
    assert _version(path) == SCHEMA_VERSION
