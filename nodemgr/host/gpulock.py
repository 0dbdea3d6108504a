"""One nodemgr per GPU: a lock file per GPU UUID, held (flock) for as long as nodemgr runs.

The locks of NVML GPUs are in a node-wide directory every nodemgr of the node sees, whoever
runs it (``NVML_LOCK_DIRS``); those of simulated GPUs in their directory
(gpus.simulated_state_dir), which is their node. The kernel lets a lock go with the last
descriptor of it, so a nodemgr killed in any way frees its GPUs at once. A refusal names the
holder: its pid from /proc/locks (whoever made the file), and the run directory it wrote
there when it could.

Any user may make a file in those directories, and a GPU's UUID is no secret: a nodemgr run
by root honours only a lock file of root's. Another user's file at a lock's name is not a
nodemgr's that root must yield to (a nodemgr of that user's on the same GPUs, started before
any root nodemgr made the file, is not seen either): root replaces it, atomically and with a
WARNING, so no unprivileged user can keep the node's nodemgr from starting.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import pwd
import secrets
import stat
from collections.abc import Sequence
from pathlib import Path

from nodemgr.host.gpus import Gpu

# Where NVML GPUs' locks live: the first of these that exists. /run/lock is the FHS's
# directory for lock files (world-writable, sticky), so nodemgrs of any user meet there.
NVML_LOCK_DIRS = (Path("/run/lock"), Path("/tmp"))
_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # never a link, never a FIFO's wait

log = logging.getLogger("nodemgr")


class GpuHeld(Exception):
    """A GPU is another nodemgr's, or its lock cannot be taken; the message says which."""


def nvml_lock_dir() -> Path:
    for path in NVML_LOCK_DIRS:
        if path.is_dir():
            return path
    return NVML_LOCK_DIRS[-1]


def lock_path(directory: Path, gpu: Gpu) -> Path:
    return directory / f"gpushare-{gpu.uuid}.lock"


def _open(path: Path) -> int:
    """The lock file, made if missing. Another user's may be open only for reading, which
    is enough to lock it; in a sticky directory it must not be opened with O_CREAT
    (fs.protected_regular refuses that even to root)."""
    for _ in range(3):
        try:
            return os.open(path, os.O_RDWR | _FLAGS)
        except FileNotFoundError:
            pass
        except PermissionError:
            return os.open(path, os.O_RDONLY | _FLAGS)
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _FLAGS, 0o644)
        except FileExistsError:
            continue  # made by another nodemgr meanwhile: open it as it is
    raise OSError(errno.EAGAIN, "made and removed again while being opened", str(path))


def _locker(st: os.stat_result) -> int | None:
    """The pid holding a flock on the file ``st`` describes, from /proc/locks."""
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        # "N: FLOCK ADVISORY WRITE PID MAJ:MIN:INODE START END"; "N: -> ..." waits.
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == dev:
            with contextlib.suppress(ValueError):
                return int(fields[4])
    return None


def holder(fd: int) -> str:
    """Who holds the lock on ``fd``, in words."""
    pid = _locker(os.fstat(fd))
    run_dir = None
    with contextlib.suppress(OSError, UnicodeDecodeError, ValueError):
        written, _, where = os.pread(fd, 4096, 0).decode().strip().partition(" ")
        if pid is not None and int(written) == pid:
            run_dir = where
    if pid is None:
        return "another nodemgr"
    return f"nodemgr pid {pid}" + (f", run directory {run_dir}" if run_dir else "")


def hold(gpus: Sequence[Gpu], directory: Path, run_dir: Path, fix: str) -> list[int]:
    """Lock every GPU of ``gpus`` in ``directory`` for this nodemgr, or none: the locks'
    descriptors (closing them lets the GPUs go). Raises GpuHeld naming the first GPU that
    is another's, its holder, the lock file and then ``fix``."""
    fds: list[int] = []
    try:
        for gpu in gpus:
            fds.append(_hold(gpu, lock_path(directory, gpu), run_dir, fix))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


def _owner(uid: int) -> str:
    with contextlib.suppress(KeyError):
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    return f"uid {uid}"


def _claim(path: Path) -> None:
    """As root: make ``path`` a lock file of root's if anything else is there (another
    user's file, link, FIFO or directory). A fresh file takes its place in one rename,
    which root may do over another user's file in a sticky directory and which no user can
    undo there; a file removed first could be made again by them before root's. A
    directory, which no file can replace, is moved aside first."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if st.st_uid == 0:
        return
    fresh = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
    fd = os.open(fresh, os.O_RDWR | os.O_CREAT | os.O_EXCL | _FLAGS, 0o644)
    try:
        os.fchmod(fd, 0o644)
        for _ in range(3):
            try:
                os.rename(fresh, path)
                break
            except OSError as e:
                if e.errno not in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST):
                    raise
            # A directory cannot be renamed over: move it aside (it may be made again).
            aside = path.with_name(f".{path.name}.moved-{secrets.token_hex(4)}")
            os.rename(path, aside)
            log.warning("%s was a directory: moved it aside to %s", path, aside)
        else:
            raise OSError(errno.EAGAIN, "a directory was made there again and again", str(path))
    except BaseException:
        with contextlib.suppress(OSError):
            fresh.unlink()
        raise
    finally:
        os.close(fd)
    log.warning(
        "replaced the GPU lock file %s: it was %s's, not root's, so no nodemgr of root's",
        path,
        _owner(st.st_uid),
    )


def _open_honoured(path: Path) -> int:
    """The lock file's descriptor; as root, one of root's (see _claim). Another user may
    make the file between _claim finding none and _open making it: then it is claimed
    again, and stays root's (a sticky directory lets no one else replace it)."""
    for _ in range(3):
        if os.geteuid() == 0:
            _claim(path)
        fd = _open(path)
        if os.geteuid() != 0 or os.fstat(fd).st_uid == 0:
            return fd
        os.close(fd)
    raise OSError(errno.EAGAIN, "replaced by another user's file while being taken", str(path))


def _hold(gpu: Gpu, path: Path, run_dir: Path, fix: str) -> int:
    try:
        fd = _open_honoured(path)
    except OSError as e:
        raise GpuHeld(f"cannot open the lock {path} of GPU {gpu.index}: {e.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise GpuHeld(f"the lock {path} of GPU {gpu.index} is not a regular file")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise GpuHeld(
                f"GPU {gpu.index} ({gpu.uuid}) is already served by {holder(fd)} "
                f"(lock {path}): {fix}"
            ) from None
        with contextlib.suppress(OSError):  # read-only: another user's file
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {run_dir}\n".encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return fd
