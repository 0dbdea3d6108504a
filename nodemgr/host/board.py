"""The node's board (docs/compute.md#latency-classes): one shared-memory file in the run
directory where latency-sensitive tasks' pacers stamp when they last launched on each GPU
and best-effort tasks' pacers look before they launch (struct gs_board,
shim/ledger_layout.h).

Every task may write it (mode 0666: tasks of every user publish there), so nodemgr
reads nothing from it that decides anything: a writer can at worst hold best-effort tasks
back. Each environment's directory holds a hard link to it (paths.BOARD), so that a
container, which sees only that directory, finds it beside its ledger.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import stat
import time
from pathlib import Path

from nodemgr._ledger import ffi, lib

SIZE: int = ffi.sizeof("struct gs_board")
MODE = 0o666


class Board:
    def __init__(self, path: Path, fd: int, mem: mmap.mmap) -> None:
        self.path = path
        self._fd = fd
        self._mem = mem
        self._buf = ffi.from_buffer(mem)
        self._b = ffi.cast("struct gs_board *", self._buf)

    @classmethod
    def create(cls, path: Path, ngpus: int) -> Board:
        """A fresh board for ``ngpus`` GPUs at ``path`` (built under a temporary name and
        renamed into place, so no pacer maps a half-written one)."""
        tmp = path.with_name(f"{path.name}.new-{secrets.token_hex(8)}")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, MODE)  # not the umask's: every user's tasks write it
            os.ftruncate(fd, SIZE)
            mem = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            board = cls(path, fd, mem)
            if lib.gs_board_init(board._b, ngpus) != 0:
                raise OSError(f"a board holds at most {lib.GS_MAX_GPUS} GPUs")
            os.rename(tmp, path)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return board

    @classmethod
    def open_or_create(cls, path: Path, ngpus: int) -> Board:
        """The board an earlier nodemgr left at ``path``, if it is a valid one for
        ``ngpus`` GPUs (running processes have it mapped: a new one would split LS and BE
        tasks between two), else a fresh one."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            return cls.create(path, ngpus)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != SIZE or st.st_uid != os.geteuid():
                raise OSError("not a board nodemgr made")
            mem = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.close(fd)
            return cls.create(path, ngpus)
        board = cls(path, fd, mem)
        if lib.gs_board_check(board._b, SIZE) != 0 or board._b.ngpus != ngpus:
            board.close()
            return cls.create(path, ngpus)
        os.fchmod(fd, MODE)
        return board

    def link_into(self, dir_fd: int, name: str) -> None:
        """Put a hard link to the board at ``name`` in the directory ``dir_fd`` (an
        environment's), replacing whatever is there."""
        tmp = f"{name}.new-{secrets.token_hex(8)}"
        os.link(self.path, tmp, dst_dir_fd=dir_fd, follow_symlinks=False)
        try:
            os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise

    def ls_last_ns(self, gpu: int) -> int:
        """CLOCK_MONOTONIC of the last LS launch seen on node GPU ``gpu`` (0: none)."""
        return int(self._b.gpu[gpu].ls_last_ns)

    def ls_active(self, gpu_mask: int, idle_ns: int, now_ns: int | None = None) -> bool:
        now = time.monotonic_ns() if now_ns is None else now_ns
        return bool(lib.gs_board_ls_active(self._b, gpu_mask, now, idle_ns))

    def stamp(self, gpu_mask: int, now_ns: int | None = None) -> None:
        """Stamp LS activity on these GPUs, as an LS task's pacer does."""
        lib.gs_board_stamp(self._b, gpu_mask, time.monotonic_ns() if now_ns is None else now_ns)

    def close(self) -> None:
        self._b = ffi.NULL
        ffi.release(self._buf)
        self._mem.close()
        os.close(self._fd)
