"""nodemgr's durable state: quotas and allocation records, in one sqlite database.

The database is written in WAL mode. Quota changes are committed with a full
sync before nodemgr answers; task records with the WAL's normal sync, which
survives any crash of nodemgr itself (a power loss may take the last few
records, never a quota). Heartbeats never touch it.

A record that cannot be written (a full or read-only disk) is kept in memory,
in order, and written at the next flush that succeeds: nodemgr keeps serving
meanwhile (docs/operations.md, "Faults").
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from gpushare import messages, protocol
from gpushare.messages import Request
from gpushare.protocol import Err, ProtocolError
from nodemgr.policy import steptime

log = logging.getLogger("nodemgr")

_REQUEST = {Request.TYPE: Request}


def _encoded(request: Request) -> bytes:
    """A task's request as its column keeps it: the message as the wire carries it."""
    return messages.encode(request, 0)


# 2: env_idle, task_wrappers. 3: tasks.request, in place of task_shapes and task_wrappers.
# 4: env_classes, tasks.class. 5: env_compute (compute caps; a step of its own in _upgrade).
# An older database is brought up to date at start (_upgrade).
SCHEMA_VERSION = 7

_SCHEMA = """
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
    exit_code INTEGER,
    request   BLOB,                   -- the request it was granted for, as the wire encodes
                                      -- it (gpushare.messages.Request), its guard filled in
    class     TEXT,                   -- "ls" or "be"; NULL: a task of a schema before 4
    predicted INTEGER,                -- its predicted peak per GPU, bytes; NULL: none
    topups    INTEGER NOT NULL DEFAULT 0, -- times its grant by prediction was topped up
    features  TEXT,                   -- its dry run's features, JSON [kernels, host bytes,
                                      -- device bytes, host seconds, waves, flops, 16-bit
                                      -- flops, operator bytes] per iteration and GPU (the
                                      -- last four null where not measured, or left out in
                                      -- rows made before them); NULL: none
    gpu_model TEXT,                   -- the model of its first GPU
    predicted_step REAL,              -- nodemgr's estimate: seconds per iteration
    predicted_util REAL,              -- and the ratio of its GPU kept busy
    step      REAL,                   -- measured seconds per iteration; NULL: not measured
    util      REAL                    -- measured ratio of its GPUs kept busy; NULL: no sample
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
CREATE TABLE IF NOT EXISTS env_idle (
    name    TEXT PRIMARY KEY,         -- an environment whose idle policy is not the node's
    timeout REAL,                     -- seconds; 0: off; NULL: the node's
    action  TEXT                      -- "reclaim" or "report"; NULL: the node's
);
CREATE TABLE IF NOT EXISTS env_classes (
    name          TEXT PRIMARY KEY,   -- an environment whose class settings are not the node's
    class_default TEXT,               -- "ls" or "be"; NULL: the node's ([classes] default)
    allow_ls      INTEGER             -- 1 or 0; NULL: the node's ([classes] allow_ls_default)
);
CREATE TABLE IF NOT EXISTS env_compute (
    name    TEXT PRIMARY KEY,         -- an environment with a cap on its tasks' compute shares
    cap     INTEGER NOT NULL          -- percent, 1..100 (docs/compute.md)
);
CREATE INDEX IF NOT EXISTS tasks_running ON tasks (task_id) WHERE ended IS NULL;
CREATE INDEX IF NOT EXISTS tasks_started ON tasks (started);
"""


def _add_columns(db: sqlite3.Connection, columns: tuple[tuple[str, str], ...]) -> None:
    """Add to the tasks table each (name, type) it lacks."""
    have = {str(row[1]) for row in db.execute("PRAGMA table_info(tasks)")}
    for name, kind in columns:
        if name not in have:
            db.execute(f"ALTER TABLE tasks ADD COLUMN {name} {kind}")


def _to_7(db: sqlite3.Connection) -> None:
    """Schema 6 to 7: each task's step time, estimated and measured
    (docs/prediction.md#step-time)."""
    _add_columns(
        db,
        (
            ("features", "TEXT"),
            ("gpu_model", "TEXT"),
            ("predicted_step", "REAL"),
            ("predicted_util", "REAL"),
            ("step", "REAL"),
            ("util", "REAL"),
        ),
    )


def _to_6(db: sqlite3.Connection) -> None:
    """Schema 5 to 6: each task's prediction and top-ups (docs/prediction.md#admission)."""
    _add_columns(db, (("predicted", "INTEGER"), ("topups", "INTEGER NOT NULL DEFAULT 0")))


def _to_5(db: sqlite3.Connection) -> None:
    """Schema 4 to 5: the table of compute caps (made by _SCHEMA for a new database)."""
    db.execute(
        "CREATE TABLE IF NOT EXISTS env_compute (name TEXT PRIMARY KEY, cap INTEGER NOT NULL)"
    )


class StoreError(Exception):
    """The database cannot be opened or is not one this nodemgr understands."""


# sqlite's primary result codes (https://sqlite.org/rescode.html) that name a cause
# an operator can act on.
_CAUSES = {
    3: "nodemgr may not access it (permissions)",  # SQLITE_PERM
    8: "it is read-only (a read-only file system, or a file nodemgr may not write)",
    10: "the disk reported an I/O error",  # SQLITE_IOERR
    11: "it is malformed (a damaged page)",  # SQLITE_CORRUPT
    13: "the disk holding it is full",  # SQLITE_FULL
    14: "it cannot be opened (its directory or permissions)",  # SQLITE_CANTOPEN
    26: "it is malformed (not a database)",  # SQLITE_NOTADB
}
_MALFORMED = (11, 26)


def _primary(e: sqlite3.Error, path: Path | None) -> int:
    primary = int(getattr(e, "sqlite_errorcode", 0) or 0) & 0xFF
    if primary in (10, 14) and path is not None:
        # sqlite reports some writes a full disk refused (its shared-memory index) as
        # I/O errors: the file system says which it was.
        try:
            st = os.statvfs(path.parent)
        except OSError:
            return primary
        if st.f_flag & os.ST_RDONLY:
            return 8
        if st.f_bavail * st.f_frsize < _NEARLY_FULL:
            return 13
    return primary


# Less free space than this where the database lives: full, for sqlite's purposes.
_NEARLY_FULL = 64 << 10


def cause(e: sqlite3.Error, path: Path | None = None) -> str:
    """What went wrong with the database at ``path``, in an operator's words, with
    sqlite's own message."""
    what = _CAUSES.get(_primary(e, path))
    return f"{what} ({e})" if what else str(e)


def advice(e: sqlite3.Error, path: Path | None = None) -> str:
    """What to do about ``e`` at start-up."""
    primary = _primary(e, path)
    if primary in _MALFORMED:
        return (
            "restore it from a backup, or move it away with its -wal and -shm files "
            "to start afresh (quotas and records are then lost)"
        )
    if primary == 13:
        return "free space on that file system and start nodemgr again"
    if primary in (3, 8, 14):
        return "make it and its directory writable by nodemgr and start nodemgr again"
    return "fix the disk and start nodemgr again"


def startup_error(path: Path, e: sqlite3.Error) -> StoreError:
    return StoreError(f"the database {path} cannot be used: {cause(e, path)}; {advice(e, path)}")


@dataclass(frozen=True)
class EnvRow:
    name: str
    gpus: int
    memory: int


@dataclass(frozen=True)
class Record:
    task_id: str
    env: str
    gpus: tuple[int, ...]
    memory: int
    pid: int | None
    pid_start: int | None
    command: str | None
    started: float
    ended: float | None
    reason: str | None
    peak: int
    exit_code: int | None
    task_class: str | None = None  # "ls" or "be"; None: recorded before classes
    predicted: int | None = None  # its predicted peak per GPU; None: granted the quota
    topups: int = 0  # times its grant by prediction was topped up
    gpu_model: str | None = None
    predicted_step: float | None = None  # seconds per iteration; None: no estimate
    predicted_util: float | None = None
    step: float | None = None  # measured seconds per iteration; None: not measured
    util: float | None = None  # measured ratio of its GPUs kept busy

    def view(self) -> dict[str, object]:
        return {
            "task_id": self.task_id,
            "env": self.env,
            "gpus": list(self.gpus),
            "memory": self.memory,
            "pid": self.pid,
            "command": self.command,
            "started": self.started,
            "ended": self.ended,
            "reason": self.reason,
            "peak": self.peak,
            "exit_code": self.exit_code,
            "task_class": self.task_class,
            "predicted": self.predicted,
            "topups": self.topups,
            "gpu_model": self.gpu_model,
            "predicted_step": self.predicted_step,
            "predicted_utilization": self.predicted_util,
            "step": self.step,
            "utilization": self.util,
        }


def _record(row: tuple[object, ...]) -> Record:
    (task_id, env, gpus, memory, pid, pid_start, command, started, ended, reason, peak, code) = row[
        :12
    ]
    task_class, predicted, topups, model, p_step, p_util, step, util = row[12:20]
    return Record(
        str(task_id),
        str(env),
        tuple(int(x) for x in str(gpus).split(",") if x),
        int(memory),  # type: ignore[call-overload]
        None if pid is None else int(pid),  # type: ignore[call-overload]
        None if pid_start is None else int(pid_start),  # type: ignore[call-overload]
        None if command is None else str(command),
        float(started),  # type: ignore[arg-type]
        None if ended is None else float(ended),  # type: ignore[arg-type]
        None if reason is None else str(reason),
        int(peak),  # type: ignore[call-overload]
        None if code is None else int(code),  # type: ignore[call-overload]
        None if task_class is None else str(task_class),
        None if predicted is None else int(predicted),  # type: ignore[call-overload]
        int(topups or 0),  # type: ignore[call-overload]
        None if model is None else str(model),
        _real(p_step),
        _real(p_util),
        _real(step),
        _real(util),
    )


def _real(v: object) -> float | None:
    return None if v is None else float(v)  # type: ignore[arg-type]


_COLUMNS = (
    "task_id, env, gpus, memory, pid, pid_start, command, started, ended, reason, peak, "
    "exit_code, class, predicted, topups, gpu_model, predicted_step, predicted_util, step, util"
)


class Store:
    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            self.db = sqlite3.connect(path, isolation_level=None)
        except (OSError, sqlite3.Error) as e:
            raise StoreError(f"cannot open the database {path}: {e}") from None
        try:
            # Only when needed: a database on a read-only disk is still read at start.
            if os.stat(path).st_mode & 0o777 != 0o600:
                os.chmod(path, 0o600)
        except OSError as e:
            self.db.close()
            raise StoreError(f"cannot make the database {path} private: {e.strerror}") from None
        try:
            version = self.db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise StoreError(
                    f"the database {path} was written by a newer nodemgr (schema {version}); "
                    "run that version, or move the file away to start afresh"
                )
            self.db.execute("PRAGMA synchronous=NORMAL")
            mode = self.db.execute("PRAGMA journal_mode").fetchone()[0]
            # A database already in shape is only read here: nodemgr starts on a full
            # disk, serves, and keeps its records until they can be written.
            if mode != "wal":
                self.db.execute("PRAGMA journal_mode=WAL")
            if version != SCHEMA_VERSION:
                self._upgrade()
        except sqlite3.DatabaseError as e:
            self.db.close()
            raise startup_error(path, e) from None
        except BaseException:
            self.db.close()
            raise
        # Record writes not yet in the database, oldest first, and why the last failed.
        self.pending: deque[Callable[[sqlite3.Connection], None]] = deque()
        self.failing: str | None = None

    def _upgrade(self) -> None:
        """Bring a new or older database to SCHEMA_VERSION: the tables it lacks are made;
        then, in one transaction, each running task of a version 1 or 2 database gets its
        request made again from what they kept of it (task_shapes: its estimate and guard;
        task_wrappers: request.wrapper), and those tables go."""
        self.db.executescript(_SCHEMA)  # commits: a failure below leaves what it made, unused

        def op(db: sqlite3.Connection) -> None:
            columns = {str(row[1]) for row in db.execute("PRAGMA table_info(tasks)")}
            if "request" not in columns:
                db.execute("ALTER TABLE tasks ADD COLUMN request BLOB")
            if "class" not in columns:
                db.execute("ALTER TABLE tasks ADD COLUMN class TEXT")
            tables = {str(n) for (n,) in db.execute("SELECT name FROM sqlite_master")}
            shapes: dict[str, tuple[int | None, int | None, int]] = {}
            if "task_shapes" in tables:
                for tid, persistent, temporary, guard in db.execute(
                    "SELECT task_id, persistent, temporary, guard FROM task_shapes"
                ):
                    shapes[str(tid)] = (persistent, temporary, int(guard))
            wrappers: set[str] = set()
            if "task_wrappers" in tables:
                wrappers = {str(t) for (t,) in db.execute("SELECT task_id FROM task_wrappers")}
            running = db.execute(
                "SELECT task_id, gpus, command FROM tasks WHERE ended IS NULL AND request IS NULL"
            ).fetchall()
            for tid, gpus, command in running:
                persistent, temporary, guard = shapes.get(str(tid), (None, None, None))
                request = Request(
                    gpus=len(str(gpus).split(",")),
                    command=None if command is None else str(command),
                    persistent=persistent,
                    temporary=temporary,
                    guard=guard,
                    wrapper=True if str(tid) in wrappers else None,
                )
                db.execute(
                    "UPDATE tasks SET request = ? WHERE task_id = ?", (_encoded(request), tid)
                )
            db.execute("DROP TABLE IF EXISTS task_shapes")
            db.execute("DROP TABLE IF EXISTS task_wrappers")
            _to_5(db)
            _to_6(db)
            _to_7(db)
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

        self._transaction(op)

    def close(self) -> None:
        if not self.flush():
            log.error(
                "%d records could not be written to the database %s and are lost",
                len(self.pending),
                self.path,
            )
        self.db.close()

    @contextmanager
    def _durable(self) -> Iterator[sqlite3.Connection]:
        """A transaction fsynced before it returns: quotas must survive a power loss."""
        self.db.execute("PRAGMA synchronous=FULL")
        try:
            with self.db:
                self.db.execute("BEGIN IMMEDIATE")
                yield self.db
        finally:
            self.db.execute("PRAGMA synchronous=NORMAL")

    # --- quotas --------------------------------------------------------------

    def envs(self) -> list[EnvRow]:
        rows = self.db.execute("SELECT name, gpus, memory FROM envs ORDER BY name").fetchall()
        return [EnvRow(str(n), int(g), int(m)) for n, g, m in rows]

    def put_env(self, name: str, gpus: int, memory: int, now: float) -> None:
        with self._durable() as db:
            db.execute(
                "INSERT INTO envs (name, gpus, memory, created, updated) VALUES (?, ?, ?, ?, ?) "
                "ON CONFLICT (name) DO UPDATE SET gpus = excluded.gpus, "
                "memory = excluded.memory, updated = excluded.updated",
                (name, gpus, memory, now, now),
            )

    def delete_env(self, name: str) -> None:
        with self._durable() as db:
            db.execute("DELETE FROM envs WHERE name = ?", (name,))
            db.execute("DELETE FROM env_idle WHERE name = ?", (name,))
            db.execute("DELETE FROM env_classes WHERE name = ?", (name,))
            db.execute("DELETE FROM env_compute WHERE name = ?", (name,))

    def env_idle(self) -> dict[str, tuple[float | None, str | None]]:
        """Each environment's own idle timeout and action (None: the node's)."""
        rows = self.db.execute("SELECT name, timeout, action FROM env_idle").fetchall()
        return {str(n): (None if t is None else float(t), a) for n, t, a in rows}

    def put_env_idle(self, name: str, timeout: float | None, action: str | None) -> None:
        with self._durable() as db:
            if timeout is None and action is None:
                db.execute("DELETE FROM env_idle WHERE name = ?", (name,))
            else:
                db.execute(
                    "INSERT INTO env_idle (name, timeout, action) VALUES (?, ?, ?) "
                    "ON CONFLICT (name) DO UPDATE SET timeout = excluded.timeout, "
                    "action = excluded.action",
                    (name, timeout, action),
                )

    def env_classes(self) -> dict[str, tuple[str | None, bool | None]]:
        """Each environment's own class default and LS permission (None: the node's)."""
        rows = self.db.execute("SELECT name, class_default, allow_ls FROM env_classes").fetchall()
        return {
            str(n): (None if c is None else str(c), None if a is None else bool(a))
            for n, c, a in rows
        }

    def put_env_classes(self, name: str, class_default: str | None, allow_ls: bool | None) -> None:
        with self._durable() as db:
            if class_default is None and allow_ls is None:
                db.execute("DELETE FROM env_classes WHERE name = ?", (name,))
            else:
                db.execute(
                    "INSERT INTO env_classes (name, class_default, allow_ls) VALUES (?, ?, ?) "
                    "ON CONFLICT (name) DO UPDATE SET class_default = excluded.class_default, "
                    "allow_ls = excluded.allow_ls",
                    (name, class_default, allow_ls),
                )

    def env_compute(self) -> dict[str, int]:
        """Each environment's cap on its tasks' compute shares (docs/compute.md)."""
        rows = self.db.execute("SELECT name, cap FROM env_compute").fetchall()
        return {str(n): int(c) for n, c in rows}

    def put_env_compute(self, name: str, cap: int | None) -> None:
        with self._durable() as db:
            if cap is None:
                db.execute("DELETE FROM env_compute WHERE name = ?", (name,))
            else:
                db.execute(
                    "INSERT INTO env_compute (name, cap) VALUES (?, ?) "
                    "ON CONFLICT (name) DO UPDATE SET cap = excluded.cap",
                    (name, cap),
                )

    # --- GPU modes (docs/timeslicing.md) ----------------------------------------

    def gpu_modes(self) -> dict[str, str]:
        """The mode an admin set, per GPU UUID."""
        rows = self.db.execute("SELECT uuid, mode FROM gpu_modes").fetchall()
        return {str(u): str(m) for u, m in rows}

    def put_gpu_mode(self, uuid: str, mode: str, now: float) -> None:
        with self._durable() as db:
            db.execute(
                "INSERT INTO gpu_modes (uuid, mode, updated) VALUES (?, ?, ?) "
                "ON CONFLICT (uuid) DO UPDATE SET mode = excluded.mode, "
                "updated = excluded.updated",
                (uuid, mode, now),
            )

    # --- drained GPUs (docs/nodemgr.md, drain) -----------------------------------

    def drained_gpus(self) -> set[str]:
        """The UUIDs of the GPUs an admin drained."""
        return {str(u) for (u,) in self.db.execute("SELECT uuid FROM gpu_drains").fetchall()}

    def put_drained(self, uuid: str, drained: bool, now: float) -> None:
        with self._durable() as db:
            if drained:
                db.execute(
                    "INSERT INTO gpu_drains (uuid, updated) VALUES (?, ?) "
                    "ON CONFLICT (uuid) DO UPDATE SET updated = excluded.updated",
                    (uuid, now),
                )
            else:
                db.execute("DELETE FROM gpu_drains WHERE uuid = ?", (uuid,))

    # --- records ---------------------------------------------------------------

    def task_started(self, r: Record, request: Request) -> None:
        """A task began, granted for ``request``: kept with it until it ends, for a restart
        (task_requests)."""
        f = messages.features_of(request)
        features = None if f is None else json.dumps(f)

        def op(db: sqlite3.Connection) -> None:
            db.execute(
                f"INSERT INTO tasks ({_COLUMNS}, request, features) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, NULL, NULL, 0, NULL, ?, ?, 0, ?, ?, ?, NULL, "
                "NULL, ?, ?)",
                (
                    r.task_id,
                    r.env,
                    ",".join(map(str, r.gpus)),
                    r.memory,
                    r.pid,
                    r.pid_start,
                    r.command,
                    r.started,
                    r.task_class,
                    request.predicted,
                    r.gpu_model,
                    r.predicted_step,
                    r.predicted_util,
                    _encoded(request),
                    features,
                ),
            )

        self._write(op)

    def task_request(self, task_id: str, request: Request) -> None:
        """A running task's request changed (`nodemgr share`): kept for a restart."""

        def op(db: sqlite3.Connection) -> None:
            db.execute(
                "UPDATE tasks SET request = ? WHERE task_id = ?", (_encoded(request), task_id)
            )

        self._write(op)

    def task_requests(self) -> dict[str, Request]:
        """The requests of the running tasks. One that cannot be read back (a damaged row)
        is left out, and said."""
        rows = self.db.execute(
            "SELECT task_id, request FROM tasks WHERE ended IS NULL AND request IS NOT NULL"
        ).fetchall()
        out: dict[str, Request] = {}
        for tid, blob in rows:
            try:
                if not isinstance(blob, bytes):
                    raise ProtocolError(Err.BAD_REQUEST, f"a {type(blob).__name__}, not a blob")
                out[str(tid)] = messages.parse(protocol.decode(blob), _REQUEST)
            except ProtocolError as e:
                log.error("task %s: its request in the database cannot be read: %s", tid, e)
        return out

    def task_ended(
        self,
        task_id: str,
        ended: float,
        reason: str,
        peak: int,
        exit_code: int | None,
        step: float | None = None,
        util: float | None = None,
    ) -> None:
        def op(db: sqlite3.Connection) -> None:
            # Its request was kept for a restart only; the record says what history shows.
            db.execute(
                "UPDATE tasks SET ended = ?, reason = ?, peak = MAX(peak, ?), exit_code = ?, "
                "step = ?, util = ?, request = NULL WHERE task_id = ? AND ended IS NULL",
                (ended, reason, peak, exit_code, step, util, task_id),
            )

        self._write(op)

    def task_topped_up(self, task_id: str, memory: int, topups: int) -> None:
        """A task granted by prediction was topped up: its grant now, and how often."""

        def op(db: sqlite3.Connection) -> None:
            db.execute(
                "UPDATE tasks SET memory = ?, topups = ? WHERE task_id = ?",
                (memory, topups, task_id),
            )

        self._write(op)

    def runs(self, limit: int) -> list[steptime.Run]:
        """The newest ``limit`` ended runs with features and a measured step time, oldest
        first (Node.runs)."""
        rows = self.db.execute(
            "SELECT env, command, gpu_model, features, step, util FROM tasks "
            "WHERE features IS NOT NULL AND step IS NOT NULL AND gpu_model IS NOT NULL "
            "ORDER BY started DESC LIMIT ?",
            (limit,),
        ).fetchall()
        out = []
        for env, command, model, blob, step, util in reversed(rows):
            try:
                # Four figures, or eight (with None) since the operator profile.
                f = steptime.decoded(json.loads(blob))
            except (ValueError, TypeError):
                continue  # a damaged row: left out
            out.append(
                steptime.Run(
                    str(env),
                    None if command is None else str(command),
                    str(model),
                    f,
                    float(step),
                    _real(util),
                )
            )
        return out

    def missed_peaks(self) -> dict[tuple[str, str | None], int]:
        """Per (environment, command), the most per-GPU memory an ended task granted by
        prediction measured beyond its prediction (Node.learned)."""
        rows = self.db.execute(
            "SELECT env, command, MAX(peak / (LENGTH(gpus) - LENGTH(REPLACE(gpus, ',', '')) + 1)) "
            "AS per_gpu FROM tasks WHERE predicted IS NOT NULL AND ended IS NOT NULL "
            "AND peak / (LENGTH(gpus) - LENGTH(REPLACE(gpus, ',', '')) + 1) > predicted "
            "GROUP BY env, command"
        ).fetchall()
        return {(str(e), None if c is None else str(c)): int(p) for e, c, p in rows}

    def task_attached(self, task_id: str, pid: int | None, pid_start: int | None) -> None:
        """A restored task's client came back, possibly seen under a new pid."""

        def op(db: sqlite3.Connection) -> None:
            db.execute(
                "UPDATE tasks SET pid = ?, pid_start = ? WHERE task_id = ?",
                (pid, pid_start, task_id),
            )

        self._write(op)

    def _write(self, op: Callable[[sqlite3.Connection], None]) -> None:
        """Write a record now, or keep it (after those already kept) for flush()."""
        self.pending.append(op)
        self.flush()

    def flush(self) -> bool:
        """Write the kept records in order; True when none is left. A failure is logged
        once until a write succeeds again: the records stay kept, nodemgr serves on."""
        written = 0
        while self.pending:
            try:
                self._transaction(self.pending[0])
            except sqlite3.Error as e:
                if self.failing is None:
                    log.error(
                        "cannot write records to the database %s: %s; keeping them in memory "
                        "and retrying at every sweep",
                        self.path,
                        cause(e, self.path),
                    )
                self.failing = cause(e, self.path)
                return False
            except Exception:
                # Not the database's doing (a value it cannot take): this record can never
                # be written, and kept first it would hold back every later one.
                log.exception("a record nodemgr cannot write is dropped")
            self.pending.popleft()
            written += 1
        if self.failing is not None:
            log.warning(
                "the database %s takes records again: %d kept records written",
                self.path,
                written,
            )
            self.failing = None
        return True

    def _transaction(self, op: Callable[[sqlite3.Connection], None]) -> None:
        db = self.db
        try:
            db.execute("BEGIN IMMEDIATE")
            op(db)
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                with suppress(sqlite3.Error):
                    db.execute("ROLLBACK")
            raise

    def running(self) -> list[Record]:
        rows = self.db.execute(
            f"SELECT {_COLUMNS} FROM tasks WHERE ended IS NULL ORDER BY started"
        ).fetchall()
        return [_record(r) for r in rows]

    def history(self, env: str | None, since: float | None, limit: int) -> list[Record]:
        """Records, newest first: of ``env`` (or all), started at or after ``since``."""
        where: list[str] = []
        args: list[object] = []
        if env is not None:
            where.append("env = ?")
            args.append(env)
        if since is not None:
            where.append("started >= ?")
            args.append(since)
        sql = f"SELECT {_COLUMNS} FROM tasks"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY started DESC, rowid DESC LIMIT ?"
        rows = self.db.execute(sql, (*args, limit)).fetchall()
        return [_record(r) for r in rows]
