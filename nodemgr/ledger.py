"""nodemgr's side of an environment's shared-memory ledger (shim/ledger_layout.h).

nodemgr creates the file, writes the per-GPU limits, reads usage and reaps
the slots of dead processes. The C code doing so is the same ledger.c the
shim is built from, reached through cffi.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path

from nodemgr._ledger import ffi, lib

MAX_GPUS: int = lib.GS_MAX_GPUS
MAX_SLOTS: int = lib.GS_MAX_SLOTS
SIZE: int = ffi.sizeof("struct gs_ledger")


@dataclass
class SlotTotals:
    processes: int = 0
    used: int = 0  # bytes now, all GPUs
    peak: int = 0  # sum of each process's most bytes at once
    launches: int = 0


class LedgerError(Exception):
    pass


class Ledger:
    """One environment's ledger, owned by nodemgr."""

    def __init__(self, path: Path, fd: int, mem: mmap.mmap) -> None:
        self.path = path
        self._fd = fd
        self._mem = mem
        self._buf = ffi.from_buffer(mem)
        self._l = ffi.cast("struct gs_ledger *", self._buf)
        self._info = ffi.new("struct gs_slot_info[]", MAX_SLOTS)

    @classmethod
    def create(cls, path: Path, uuids: list[bytes], mode: int = 0o600) -> Ledger:
        """Write a fresh ledger for GPUs with these 16-byte UUIDs and publish it at ``path``.

        Built under a temporary name and renamed into place, so a process
        never maps a half-written header.
        """
        if len(uuids) > MAX_GPUS:
            raise LedgerError(f"a ledger holds at most {MAX_GPUS} GPUs, this node has {len(uuids)}")
        tmp = path.with_name(path.name + ".new")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
        try:
            os.ftruncate(fd, SIZE)
            mem = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            ledger = cls(path, fd, mem)
            for i, uuid in enumerate(uuids):
                ffi.memmove(ledger._l.gpu[i].uuid, uuid, 16)
                ledger._l.gpu[i].node_index = i
            rc = lib.gs_ledger_init(ledger._l, len(uuids))
            if rc != 0:
                raise LedgerError(f"cannot initialise ledger: {os.strerror(-rc)}")
            os.replace(tmp, path)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        return ledger

    @classmethod
    def reopen(cls, path: Path, uuids: list[bytes]) -> Ledger | None:
        """Map the ledger an earlier nodemgr left at ``path``, if it is valid and for these
        GPUs; None otherwise.

        Running processes have it mapped and charge to it: after a restart
        nodemgr must adopt that very file, not replace it.
        """
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            return None
        try:
            if os.fstat(fd).st_size != SIZE:
                raise LedgerError("wrong size")
            mem = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, LedgerError):
            os.close(fd)
            return None
        ledger = cls(path, fd, mem)
        ok = lib.gs_ledger_check(ledger._l, SIZE) == 0 and ledger._l.ngpus == len(uuids)
        ok = ok and all(
            bytes(ffi.buffer(ledger._l.gpu[i].uuid, 16)) == uuid for i, uuid in enumerate(uuids)
        )
        if not ok:
            ledger.close()
            return None
        return ledger

    def chown(self, uid: int, gid: int, mode: int) -> None:
        os.fchown(self._fd, uid, gid)
        os.fchmod(self._fd, mode)

    def close(self) -> None:
        self._l = ffi.NULL
        ffi.release(self._buf)
        self._mem.close()
        os.close(self._fd)

    def set_limit(self, gpu: int, nbytes: int) -> None:
        lib.gs_ledger_set_limit(self._l, gpu, nbytes)

    def limit(self, gpu: int) -> int:
        return int(lib.gs_ledger_limit(self._l, gpu))

    def used(self, gpu: int) -> int:
        return int(lib.gs_ledger_used(self._l, gpu))

    def task_usage(self, task_id: str) -> SlotTotals:
        """The totals of the live processes of ``task_id``."""
        used = ffi.new("uint64_t[]", MAX_GPUS)
        launches = ffi.new("uint64_t *")
        peak = ffi.new("uint64_t *")
        n = lib.gs_ledger_task_usage(self._l, task_id.encode(), used, launches, peak)
        return SlotTotals(int(n), sum(int(x) for x in used), int(peak[0]), int(launches[0]))

    def summary(self) -> dict[str, SlotTotals]:
        """Per task id, the totals of its live processes' slots (one pass over the ledger)."""
        return self._totals(int(lib.gs_ledger_summary(self._l, self._info, MAX_SLOTS)))

    def _totals(self, n: int) -> dict[str, SlotTotals]:
        out: dict[str, SlotTotals] = {}
        for i in range(n):
            info = self._info[i]
            tid = ffi.string(info.task_id).decode(errors="replace")
            t = out.get(tid)
            if t is None:
                t = out[tid] = SlotTotals()
            t.processes += 1
            t.used += int(info.used)
            t.peak += int(info.peak)
            t.launches += int(info.launches)
        return out

    def reap(self) -> int:
        """Free the slots of processes that have died; return how many."""
        rc = int(lib.gs_ledger_reap(self._l, self._fd, self._info, MAX_SLOTS))
        if rc < 0:
            raise LedgerError(f"reaping {self.path}: {os.strerror(-rc)}")
        return rc

    def reap_totals(self) -> dict[str, SlotTotals]:
        """Free the slots of processes that have died; per task id, what they had used."""
        rc = self.reap()
        return self._totals(min(rc, MAX_SLOTS))
