"""Environments' directories in run_dir, where their sockets and ledgers are: making them,
and finding at start the ledgers of environments the database does not know."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from pathlib import Path

from gpushare import paths
from nodemgr.config import FORGET_FLAG, Config
from nodemgr.host.gpus import Gpu
from nodemgr.host.ledger import Ledger

log = logging.getLogger("nodemgr")


class RestoreError(Exception):
    """What nodemgr finds at start contradicts its database: serving would lose track of
    memory in use."""


# The names nodemgr makes in an environment's directory (its socket and its ledger).
OWN_NAMES = paths.ENV_DIR_NAMES
# The most entries nodemgr removes from an environment's directory at once (those in its
# subdirectories counted, MAX_DEPTH deep at most): its user may have planted any number
# there, and nodemgr's start (or a `quota set`, a `quota delete`) must not wait on them.
# Those beyond are left, said in the log.
MAX_CLEARED = 1024
MAX_DEPTH = 16


def _remove(dir_fd: int, name: str, budget: list[int], depth: int = 0) -> bool:
    """Remove entry ``name`` of the directory ``dir_fd``, a subdirectory with what it holds,
    spending ``budget[0]`` per entry; False when the budget or MAX_DEPTH ran out first (what
    is left stays). No link is followed: a directory is opened O_NOFOLLOW."""
    try:
        os.unlink(name, dir_fd=dir_fd)
        return True
    except FileNotFoundError:
        return True
    except IsADirectoryError:
        pass
    if depth >= MAX_DEPTH:
        return False
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        with os.scandir(fd) as entries:
            for entry in entries:
                if budget[0] <= 0:
                    return False
                budget[0] -= 1
                if not _remove(fd, entry.name, budget, depth + 1):
                    return False
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)
    return True


def _clear(fd: int, path: Path) -> bool:
    """Clear the directory ``fd`` (at ``path``, for the log) for a new ledger and socket:
    whatever is at OWN_NAMES goes (a directory is moved aside, to be removed with the
    rest), then every other entry, MAX_CLEARED at most. Returns whether it is empty.
    Its entries may be the environment user's doing: they are removed through the
    descriptor and no link among them is followed."""
    for name in OWN_NAMES:
        try:
            os.unlink(name, dir_fd=fd)
        except FileNotFoundError:
            pass
        except IsADirectoryError:
            aside = f"{name}.moved-{secrets.token_hex(4)}"
            os.rename(name, aside, src_dir_fd=fd, dst_dir_fd=fd)
            log.warning("%s was a directory: moved it aside to %s", path / name, path / aside)
    budget = [MAX_CLEARED]
    with os.scandir(fd) as entries:
        for entry in entries:
            if budget[0] > 0:
                budget[0] -= 1
                if _remove(fd, entry.name, budget):
                    continue
            log.warning(
                "%s: removed %d entries its user made there, the most nodemgr removes at "
                "once (or %d levels deep); left the rest",
                path,
                MAX_CLEARED - budget[0],
                MAX_DEPTH,
            )
            return False
    return True


def open_empty(path: Path) -> int:
    """Make ``path`` a directory cleared for a new ledger and socket (_clear) and return a
    descriptor of it, keeping the directory itself if there is one: containers bind-mount
    it, and a mount keeps showing a replaced directory's old, deleted self.

    Its parent is nodemgr's; its entries may be the environment user's doing."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink()
    path.mkdir(parents=True, mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        _clear(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def remove(path: Path) -> None:
    """Remove a deleted environment's directory, as far as _clear can empty it (what its
    user left beyond stays, with the directory)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        empty = _clear(fd, path)
    except OSError as e:
        log.warning("cannot clear %s: %s", path, e.strerror or e)
        empty = False
    finally:
        os.close(fd)
    if empty:
        with contextlib.suppress(OSError):
            path.rmdir()


def check_unknown(
    config: Config, gpus: list[Gpu], known: set[str], database: Path, forget: bool = False
) -> None:
    """Refuse to start beside ledgers of environments the database does not know: it was
    emptied, replaced or lost its WAL. Live ones (processes use them) always: creating such
    an environment again would give it a second quota beside the memory its processes hold.
    Unused ones unless ``forget`` (FORGET_FLAG): starting would quietly lose their quotas."""
    root = config.run_dir / paths.ENVS_DIR
    try:
        names = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.is_symlink())
    except OSError:
        return
    uuids = [g.uuid_bytes for g in gpus]
    live: dict[str, list[int]] = {}
    unused: list[str] = []
    for name in names:
        if name in known:
            continue
        ledger = Ledger.reopen(root / name / paths.LEDGER, uuids)
        if ledger is None:
            continue
        try:
            pids = ledger.live_pids()
        finally:
            ledger.close()
        if pids:
            live[name] = pids
        else:
            unused.append(name)
    if live:
        what = "; ".join(
            f"{name} (pids {', '.join(map(str, pids))})" for name, pids in live.items()
        )
        raise RestoreError(
            f"the database {database} knows no environment {', '.join(live)}, "
            f"but live processes use their ledgers in {root}: {what}. The database was "
            "emptied, replaced or lost its -wal file: restore it from a backup with its "
            "-wal, or end those processes, then start nodemgr again"
        )
    if unused and not forget:
        raise RestoreError(
            f"the database {database} knows no environment {', '.join(unused)}, but their "
            f"ledgers are in {root}: the database was emptied, replaced or lost its -wal "
            "file, and their quotas with it. Restore it from a backup with its -wal; or, to "
            f"start without them, run `nodemgr serve {FORGET_FLAG}` once"
        )
    for name in unused:
        log.warning(
            "%s is left from environment %s, which the database does not know (%s); "
            "it is replaced if that environment is created",
            root / name,
            name,
            FORGET_FLAG,
        )


def ready(config: Config, name: str) -> None:
    """Make an environment's directory again if it went with run_dir."""
    env_dir = config.env_dir(name)
    if env_dir.is_dir():
        return
    access = config.access_for(name)
    env_dir.mkdir(parents=True, mode=0o700, exist_ok=True)
    os.chown(env_dir, access.uid, access.gid)
    os.chmod(env_dir, access.dir_mode)
