"""nodemgr's side of an environment's shared-memory ledger (shim/ledger_layout.h).

nodemgr creates the file, writes the per-GPU limits and context charges,
keeps one task entry per running task (whose pause word holds the task's
kernel launches), reads usage and reaps the slots of dead processes. The C
code doing so is the same ledger.c the shim is built from, reached through
cffi.

The file is mapped writable into the environment's processes, so its owner may
write anything there. This class is the one place nodemgr reads it, and every
figure leaves it within bounds: the GPUs are the node's (never the header's
count), bytes at most the GPU's memory (all GPUs: the node's), counters at most
MAX_COUNT; a task entry whose id nodemgr cannot have written is reported as
malformed. What only nodemgr writes (limits, context charges, GPU UUIDs, the GPU
count) is checked and written again by ``repair`` (docs/containers.md, "Trust").
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import secrets
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nodemgr._ledger import ffi, lib
from nodemgr.host import procfs

MAX_GPUS: int = lib.GS_MAX_GPUS
PAUSE_ADMIN: int = lib.GS_PAUSE_ADMIN
PAUSE_TURN: int = lib.GS_PAUSE_TURN
PAUSE_CLASS: int = lib.GS_PAUSE_CLASS
PAUSE_COMPUTE: int = lib.GS_PAUSE_COMPUTE
TASK_TIMESLICED: int = lib.GS_TASK_TIMESLICED
LEDGER_COMPUTE: int = lib.GS_LEDGER_COMPUTE
COMPUTE_WINDOW: int = lib.GS_COMPUTE_WINDOW
COMPUTE_LS_PUBLISH: int = lib.GS_COMPUTE_LS_PUBLISH
COMPUTE_YIELD_LS: int = lib.GS_COMPUTE_YIELD_LS
MAX_SLOTS: int = lib.GS_MAX_SLOTS
MAX_TASKS: int = lib.GS_MAX_TASKS
SIZE: int = ffi.sizeof("struct gs_ledger")
# The most any counter read from a ledger is taken to be: what sqlite and msgpack's signed
# integers hold, so that no sum of a few of them overflows a record or a reply.
MAX_COUNT: int = (1 << 63) - 1
# A GPU's memory where the caller names none (a ledger mapped only to look at it).
MAX_GPU_BYTES: int = 1 << 50


@dataclass
class SlotTotals:
    processes: int = 0
    used: int = 0  # bytes now, all GPUs
    # The most bytes the task's processes held at once (the task entry's count); where the
    # task has no entry, the sum of each process's own peak, an upper bound.
    peak: int = 0
    launches: int = 0


@dataclass(frozen=True)
class TaskEntry:
    """A task's entry in the ledger, as read now."""

    index: int
    paused: bool  # an operator paused it (GS_PAUSE_ADMIN)
    last_launch_ns: int  # wall clock of the last sweep that saw its launches move; 0: none
    gated: bool = False  # a time-sliced GPU of it is another task's turn (GS_PAUSE_TURN)
    iterations: int = 0  # the most iteration boundaries one of its processes reported
    turn_until: int = 0  # the boundary count that ends its turn; 0: not gated
    flags: int = 0  # GS_TASK_* bits
    # A best-effort task held for a latency-sensitive one (GS_PAUSE_CLASS).
    class_paused: bool = False


@dataclass(frozen=True)
class Regions:
    """A task's memory by region, persistent and temporary (docs/timeslicing.md), summed
    over its live processes."""

    processes: int
    used: tuple[int, ...]  # bytes now, per ledger GPU
    persistent: tuple[int, ...]
    temp_peak: tuple[int, ...]
    settled: tuple[int, ...]  # persistent bytes right after the last release
    iterations: int  # the most boundaries one process reported
    releases: int  # the fewest releases one iterating process made; 0: not settled yet
    min_iterations: int = 0  # the fewest boundaries one process that reported any reported

    def temporary(self, gpu: int) -> int:
        """Temporary bytes held now on ``gpu``."""
        return max(0, self.used[gpu] - self.persistent[gpu])


@dataclass(frozen=True)
class Schedule:
    """A task's compute schedule as the ledger carries it (docs/compute.md): its window
    [offset, offset + length) of every period, in nanoseconds of CLOCK_MONOTONIC, and its
    GS_COMPUTE_* flags. The default: no schedule, never gated."""

    flags: int = 0
    share: int = 0  # percent, for reports
    gpu_mask: int = 0  # bit i: node GPU i (its board entries)
    period_ns: int = 0
    offset_ns: int = 0
    length_ns: int = 0
    poll_ns: int = 0
    ls_idle_ns: int = 0


@dataclass(frozen=True)
class Pacing:
    """What a task's pacers measured, summed over its live processes (nanoseconds)."""

    device_ns: int = 0
    overrun_ns: int = 0
    gated_ns: int = 0
    windows: int = 0
    unmeasured: int = 0
    processes: int = 0  # the task's live processes
    pacers: int = 0  # of which run a pacer


class LedgerError(Exception):
    pass


@contextlib.contextmanager
def _dir(path: Path) -> Iterator[int]:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)


class Ledger:
    """One environment's ledger, owned by nodemgr."""

    def __init__(
        self, path: Path, fd: int, mem: mmap.mmap, uuids: Sequence[bytes], memory: Sequence[int]
    ) -> None:
        self.path = path
        self._fd = fd
        self._mem = mem
        self._buf = ffi.from_buffer(mem)
        self._l = ffi.cast("struct gs_ledger *", self._buf)
        self._info = ffi.new("struct gs_slot_info[]", MAX_SLOTS)
        # The node's GPUs: their count, UUIDs and memory bound what is read here.
        self.ngpus = len(uuids)
        self._uuids = [bytes(u) for u in uuids] + [bytes(16)] * (MAX_GPUS - len(uuids))
        self._memory = list(memory)
        self._total = sum(self._memory)
        # What nodemgr wrote (repair() puts it back), and per GPU the most the environment
        # may hold there: the highest limit published since what it holds last fitted
        # the limit in force (a lowered quota, a GPU it no longer holds).
        self._limits = [0] * MAX_GPUS
        self._ctx = [0] * MAX_GPUS
        self._ceiling = [0] * MAX_GPUS
        self._topup = [0] * MAX_GPUS
        self._topup_wait = 0
        self._file_id: tuple[int, int] | None = None  # file_id(), once read

    @classmethod
    def create(
        cls,
        path: Path,
        uuids: list[bytes],
        mode: int = 0o600,
        owner: tuple[int, int] | None = None,
        dir_fd: int | None = None,
        memory: Sequence[int] | None = None,
    ) -> Ledger:
        """Write a fresh ledger for GPUs with these 16-byte UUIDs (and ``memory``, bytes
        each; default MAX_GPU_BYTES), give it ``owner`` (uid, gid; default: ours) and
        ``mode`` and publish it at ``path``. ``dir_fd``, when given, is ``path``'s
        directory, held open.

        Built under a fresh temporary name and renamed into place, so a process
        never maps a half-written header. The directory may be writable by the
        environment's user: the file is created with O_EXCL|O_NOFOLLOW (never an
        entry someone left there) and owner and mode are set through its
        descriptor, so no link is ever followed.
        """
        if len(uuids) > MAX_GPUS:
            raise LedgerError(f"a ledger holds at most {MAX_GPUS} GPUs, this node has {len(uuids)}")
        if dir_fd is None:
            with _dir(path.parent) as fd:
                return cls.create(path, uuids, mode, owner, fd, memory)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        while True:
            tmp = f"{path.name}.new-{secrets.token_hex(8)}"
            try:
                fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
                break
            except FileExistsError:
                continue  # someone guessed the name: take another
        try:
            if owner is not None:
                os.fchown(fd, *owner)
            os.fchmod(fd, mode)
            os.ftruncate(fd, SIZE)
            mem = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            ledger = cls(path, fd, mem, uuids, _memory(uuids, memory))
            for i, uuid in enumerate(uuids):
                ffi.memmove(ledger._l.gpu[i].uuid, uuid, 16)
                ledger._l.gpu[i].node_index = i
            rc = lib.gs_ledger_init(ledger._l, len(uuids))
            if rc != 0:
                raise LedgerError(f"cannot initialise ledger: {os.strerror(-rc)}")
            os.rename(tmp, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise
        return ledger

    @classmethod
    def reopen(
        cls,
        path: Path,
        uuids: list[bytes],
        dir_fd: int | None = None,
        memory: Sequence[int] | None = None,
    ) -> Ledger | None:
        """Map the ledger an earlier nodemgr left at ``path`` (in the directory ``dir_fd``, when
        given), if it is valid and for these GPUs (of ``memory`` bytes each, as in
        create()); None otherwise.

        Running processes have it mapped and charge to it: after a restart
        nodemgr must adopt that very file, not replace it. Only a regular file
        with no other name is taken: a link (symbolic or hard) to another file
        is not a ledger nodemgr made.
        """
        flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        try:
            fd = os.open(path if dir_fd is None else path.name, flags, dir_fd=dir_fd)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_size != SIZE:
                raise LedgerError("not a ledger nodemgr made")
            mem = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, LedgerError):
            os.close(fd)
            return None
        ledger = cls(path, fd, mem, uuids, _memory(uuids, memory))
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

    def is_at_path(self) -> bool:
        """Whether ``path`` still names this very file: a run_dir removed or replaced under
        nodemgr leaves processes charging a file new processes cannot open."""
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except OSError:
            return False
        own = os.fstat(self._fd)
        return own.st_nlink > 0 and (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)

    def file_id(self) -> tuple[int, int]:
        """The file's (device, inode) as /proc/PID/maps shows it: how a process mapping it
        is recognised (nodemgr.host.procfs.maps_files). Taken from nodemgr's own mapping of
        it, not from fstat: maps shows the device of the filesystem's superblock, which on
        btrfs (a subvolume's st_dev) differs from fstat's, and on overlayfs the underlying
        file's device and inode."""
        if self._file_id is None:
            address = int(ffi.cast("uintptr_t", self._buf))
            self._file_id = procfs.mapping_at(procfs.maps("self") or b"", address)
        if self._file_id is None:  # /proc not mounted: what fstat says, not remembered
            st = os.fstat(self._fd)
            return (st.st_dev, st.st_ino)
        return self._file_id

    def close(self) -> None:
        self._l = ffi.NULL
        ffi.release(self._buf)
        self._mem.close()
        os.close(self._fd)

    def set_limit(self, gpu: int, nbytes: int) -> None:
        lib.gs_ledger_set_limit(self._l, gpu, nbytes)
        if 0 <= gpu < MAX_GPUS:
            self._limits[gpu] = nbytes
            # Where what the slots hold fits the new limit, an earlier, higher one no
            # longer counts (held()): a GPU granted again under a lowered quota.
            fits = self.used(gpu) <= nbytes
            self._ceiling[gpu] = nbytes if fits else max(self._ceiling[gpu], nbytes)

    def limit(self, gpu: int) -> int:
        """The limit nodemgr set on ``gpu`` (what the file says may differ until repair())."""
        return self._limits[gpu] if 0 <= gpu < MAX_GPUS else 0

    def may_hold(self, gpu: int, nbytes: int) -> None:
        """An earlier nodemgr let the environment hold up to ``nbytes`` on ``gpu``: believe
        its slots that far there (held()) until what they hold fits the limit now."""
        if 0 <= gpu < self.ngpus:
            self._ceiling[gpu] = max(self._ceiling[gpu], nbytes)

    def set_ctx_charge(self, gpu: int, nbytes: int) -> None:
        """What the shim charges a process for its CUDA context on ``gpu``, from its next
        context there."""
        if not 0 <= gpu < MAX_GPUS:
            raise LedgerError(f"no GPU {gpu} in a ledger (at most {MAX_GPUS})")
        lib.gs_ledger_set_ctx_charge(self._l, gpu, nbytes)
        self._ctx[gpu] = nbytes

    def set_topup(self, gpu: int, nbytes: int) -> None:
        """How far nodemgr may raise ``gpu``'s limit when a process asks (0: never);
        docs/prediction.md#admission."""
        if not 0 <= gpu < MAX_GPUS:
            raise LedgerError(f"no GPU {gpu} in a ledger (at most {MAX_GPUS})")
        lib.gs_ledger_set_topup_limit(self._l, gpu, nbytes)
        self._topup[gpu] = nbytes

    def set_topup_wait(self, seconds: float) -> None:
        """How long a process whose charge is refused waits for a top-up (0: never)."""
        self._topup_wait = max(0, min(int(seconds * 1000), 0xFFFFFFFF))
        lib.gs_ledger_set_topup_wait(self._l, self._topup_wait)

    def wanted(self, gpu: int) -> int:
        """The count a refused charge on ``gpu`` asked nodemgr to raise the limit to (0:
        none since the last answer), as written: the file is the environment's to write,
        so the caller compares it with what the environment may hold before any use, and
        answers with it (answer())."""
        if not 0 <= gpu < self.ngpus:
            return 0
        return int(lib.gs_ledger_wanted(self._l, gpu))

    def answer(self, gpu: int, seen: int) -> None:
        """nodemgr has answered the ask on ``gpu`` it read as ``seen`` (after any new
        limit); a larger one made since stands."""
        if 0 <= gpu < MAX_GPUS:
            lib.gs_ledger_clear_ask(self._l, gpu, seen)

    def repair(self) -> list[str]:
        """Write again what only nodemgr writes (the GPU count, each GPU entry's UUID, limit
        and context charge) where the file says otherwise; what was wrong, in words."""
        fixed = []
        if self._l.topup_wait_ms != self._topup_wait:
            fixed.append(
                f"top-up wait {int(self._l.topup_wait_ms)} ms (nodemgr's: {self._topup_wait})"
            )
            lib.gs_ledger_set_topup_wait(self._l, self._topup_wait)
        if self._l.ngpus != self.ngpus:
            fixed.append(f"GPU count {int(self._l.ngpus)} (nodemgr's: {self.ngpus})")
            self._l.ngpus = self.ngpus
        for g in range(MAX_GPUS):
            e = self._l.gpu[g]
            if bytes(ffi.buffer(e.uuid, 16)) != self._uuids[g]:
                fixed.append(f"UUID of GPU entry {g}")
                ffi.memmove(e.uuid, self._uuids[g], 16)
            if e.limit != self._limits[g]:
                fixed.append(f"limit on GPU {g} {int(e.limit)} (nodemgr's: {self._limits[g]})")
                lib.gs_ledger_set_limit(self._l, g, self._limits[g])
            if e.topup_limit != self._topup[g]:
                fixed.append(
                    f"top-up limit on GPU {g} {int(e.topup_limit)} (nodemgr's: {self._topup[g]})"
                )
                lib.gs_ledger_set_topup_limit(self._l, g, self._topup[g])
            if e.ctx_charge != self._ctx[g]:
                ctx = int(e.ctx_charge)
                fixed.append(f"context charge on GPU {g} {ctx} (nodemgr's: {self._ctx[g]})")
                lib.gs_ledger_set_ctx_charge(self._l, g, self._ctx[g])
        return fixed

    def ctx_charge(self, gpu: int) -> int:
        if not 0 <= gpu < MAX_GPUS:
            raise LedgerError(f"no GPU {gpu} in a ledger (at most {MAX_GPUS})")
        return self._bytes(gpu, self._l.gpu[gpu].ctx_charge)

    # --- bounds of what is read: the file is the environment's to write ---------------

    def _bytes(self, gpu: int, nbytes: int) -> int:
        """Bytes read for ``gpu``: at most its memory (0 for a GPU the node lacks)."""
        return min(int(nbytes), self._memory[gpu]) if 0 <= gpu < self.ngpus else 0

    def _all(self, nbytes: int) -> int:
        """Bytes read for all GPUs: at most the node's memory."""
        return min(int(nbytes), self._total)

    def _bound(self, gpu: int) -> int:
        """The most the environment may hold on ``gpu``: see held()."""
        return min(self._memory[gpu], self._ceiling[gpu])

    # --- task entries: nodemgr alone writes them, from one thread -------------------

    def task_add(self, task_id: str) -> int:
        """Give ``task_id`` an entry (or find the one it has, pause word untouched); return
        its index. Raises LedgerError when all MAX_TASKS entries are in use."""
        rc = int(lib.gs_ledger_task_add(self._l, _task_key(task_id)))
        if rc == -errno.ENOSPC:
            raise LedgerError(
                f"{self.path}: all {MAX_TASKS} task entries are in use; "
                f"task {task_id} gets none and cannot be paused"
            )
        if rc < 0:
            raise LedgerError(f"{self.path}: adding task {task_id}: {os.strerror(-rc)}")
        return rc

    def task_remove(self, task_id: str) -> bool:
        """Free the task's entry, waking any launch it held; False if it had none."""
        rc = int(lib.gs_ledger_task_remove(self._l, _task_key(task_id)))
        if rc == -errno.ENOENT:
            return False
        if rc < 0:
            raise LedgerError(f"{self.path}: removing task {task_id}: {os.strerror(-rc)}")
        return True

    def task_pause(self, task_id: str, paused: bool) -> None:
        """Hold (``paused``) or let go the task's kernel launches and allocations for an
        operator; once nothing holds them, every waiting process is woken. Raises
        LedgerError if the task has no entry."""
        rc = int(lib.gs_ledger_task_pause(self._l, _task_key(task_id), 1 if paused else 0))
        self._check(rc, task_id, "pausing")

    def task_gate(self, task_id: str, gated: bool) -> None:
        """The same for time slicing: hold the task while another has its GPU's turn."""
        rc = int(lib.gs_ledger_task_gate(self._l, _task_key(task_id), 1 if gated else 0))
        self._check(rc, task_id, "gating")

    def task_hold_class(self, task_id: str, held: bool) -> None:
        """The same for classes (docs/scheduling.md, "Classes"): hold a best-effort task
        while a latency-sensitive one uses what it gave up (GS_PAUSE_CLASS)."""
        rc = int(lib.gs_ledger_task_hold_class(self._l, _task_key(task_id), 1 if held else 0))
        self._check(rc, task_id, "holding")

    def task_turn(self, task_id: str, turn_until: int, flags: int) -> None:
        """Publish the boundary count that ends the task's turn (0: not gated) and its
        GS_TASK_* flags."""
        rc = int(lib.gs_ledger_task_turn(self._l, _task_key(task_id), turn_until, flags))
        self._check(rc, task_id, "setting the turn of")

    def set_compute(self, on: bool) -> None:
        """Turn compute control on (each process claiming a slot from now on starts a
        pacer thread, which sleeps while its task has no schedule) or off."""
        flags = int(lib.gs_ledger_flags(self._l))
        flags = flags | LEDGER_COMPUTE if on else flags & ~LEDGER_COMPUTE
        lib.gs_ledger_set_flags(self._l, flags)

    def task_schedule(self, task_id: str, schedule: Schedule) -> None:
        """Publish the task's compute schedule and wake its pacers. Raises LedgerError if
        the task has no entry."""
        c = ffi.new("struct gs_schedule *")
        for name, value in vars(schedule).items():
            setattr(c, name, value)
        rc = int(lib.gs_ledger_task_schedule(self._l, _task_key(task_id), c))
        self._check(rc, task_id, "scheduling")

    def task_wake_pacers(self, task_id: str, on: bool) -> None:
        """Set (a schedule does it itself) or clear GS_PAUSE_COMPUTE in the task's pause
        word: while it is set, a launch of a process of the task that runs no pacer starts
        one. Raises LedgerError if the task has no entry."""
        rc = int(lib.gs_ledger_task_wake_pacers(self._l, _task_key(task_id), 1 if on else 0))
        self._check(rc, task_id, "waking the pacers of")

    def schedule_of(self, task_id: str) -> Schedule | None:
        """The schedule the task's entry holds now; None if it has no entry."""
        i = int(lib.gs_ledger_task_find(self._l, _task_key(task_id)))
        if i < 0:
            return None
        c = ffi.new("struct gs_schedule *")
        lib.gs_ledger_entry_schedule(self._l, i, c)
        return Schedule(
            **{f: min(int(getattr(c, f)), MAX_COUNT) for f in Schedule.__dataclass_fields__}
        )

    def task_pacing(self, task_id: str) -> Pacing:
        """What the pacers of the task's live processes measured (each figure at most
        MAX_COUNT: the slots are the environment's to write)."""
        out = ffi.new("struct gs_pacing *")
        lib.gs_ledger_task_pacing(self._l, task_id.encode(), out)
        return Pacing(
            **{f: min(int(getattr(out, f)), MAX_COUNT) for f in Pacing.__dataclass_fields__}
        )

    def _check(self, rc: int, task_id: str, doing: str) -> None:
        if rc == -errno.ENOENT:
            raise LedgerError(f"{self.path}: task {task_id} has no entry")
        if rc < 0:
            raise LedgerError(f"{self.path}: {doing} task {task_id}: {os.strerror(-rc)}")

    def task_regions(self, task_id: str) -> Regions:
        """The task's memory by region, summed over its live processes; per GPU at most what
        the environment may hold there (held())."""
        out = ffi.new("struct gs_regions *")
        n = int(lib.gs_ledger_task_regions(self._l, task_id.encode(), out))
        bound = [self._bound(g) for g in range(self.ngpus)]

        def per_gpu(figures: Any) -> tuple[int, ...]:
            return tuple(min(int(figures[g]), bound[g]) for g in range(self.ngpus))

        return Regions(
            n,
            per_gpu(out.used),
            per_gpu(out.persistent),
            per_gpu(out.temp_peak),
            per_gpu(out.settled),
            min(int(out.iterations), MAX_COUNT),
            min(int(out.releases), MAX_COUNT),
            min(int(out.min_iterations), MAX_COUNT),
        )

    def task_barrier(self, task_id: str, since_ns: int) -> tuple[int, int]:
        """The turn's barrier: (how many of the task's processes reported a boundary at or
        after ``since_ns``, the fewest boundaries among them; 0 when none did). Times are
        CLOCK_MONOTONIC nanoseconds (time.monotonic_ns())."""
        out = ffi.new("uint64_t *")
        n = int(lib.gs_ledger_task_barrier(self._l, task_id.encode(), max(0, since_ns), out))
        return n, min(int(out[0]), MAX_COUNT)

    def task_entry(self, task_id: str) -> TaskEntry | None:
        """The task's entry, or None if it has none."""
        i = int(lib.gs_ledger_task_find(self._l, _task_key(task_id)))
        if i < 0:
            return None
        t = self._l.task[i]
        word = int(t.paused)
        return TaskEntry(
            i,
            bool(word & PAUSE_ADMIN),
            min(int(t.last_launch_ns), MAX_COUNT),
            bool(word & PAUSE_TURN),
            min(int(t.iterations), MAX_COUNT),
            min(int(t.turn_until), MAX_COUNT),
            int(t.flags),
            bool(word & PAUSE_CLASS),
        )

    def task_ids(self) -> list[str]:
        """The ids of every task with a well-formed entry (free_malformed()), in entry order."""
        out = []
        for i in range(MAX_TASKS):
            t = self._l.task[i]
            if t.state == lib.GS_SLOT_USED:
                tid = _entry_id(bytes(ffi.buffer(t.task_id, lib.GS_TASK_ID_LEN)))
                if tid is not None:
                    out.append(tid)
        return out

    def free_malformed(self) -> int:
        """Free every task entry in use whose id nodemgr cannot have written (no end within
        the field, empty, not UTF-8, bytes after its end); return how many. A process
        waiting on such an entry's pause word sees it cleared at its next timed re-read."""
        n = 0
        for i in range(MAX_TASKS):
            t = self._l.task[i]
            if t.state != lib.GS_SLOT_FREE and (
                t.state != lib.GS_SLOT_USED
                or _entry_id(bytes(ffi.buffer(t.task_id, lib.GS_TASK_ID_LEN))) is None
            ):
                t.paused = 0
                t.state = lib.GS_SLOT_FREE
                n += 1
        return n

    def stamp_launches(self, now_ns: int) -> None:
        """Record ``now_ns`` as the last launch time of every task whose processes launched
        kernels since the previous call (the shim only counts launches)."""
        lib.gs_ledger_stamp_launches(self._l, now_ns)

    def used(self, gpu: int) -> int:
        """What the slots hold on ``gpu``, as they say (at most its memory): for reports."""
        return self._bytes(gpu, lib.gs_ledger_used(self._l, gpu)) if 0 <= gpu < self.ngpus else 0

    def held(self, gpu: int) -> int:
        """What the environment is counted as holding on ``gpu`` when others' grants are
        decided: what its slots say, but never more than nodemgr let it hold there, the
        highest limit published since what they hold last fitted the limit in force (so a
        lowered quota or a GPU given back still counts what the environment kept until it
        frees it). A slot written to hold more cannot cost another environment anything."""
        used = self.used(gpu)
        if not 0 <= gpu < self.ngpus:
            return 0
        if used <= self._limits[gpu]:
            self._ceiling[gpu] = self._limits[gpu]
        return min(used, self._ceiling[gpu])

    def task_usage(self, task_id: str) -> SlotTotals:
        """The totals of the live processes of ``task_id``."""
        used = ffi.new("uint64_t[]", MAX_GPUS)
        launches = ffi.new("uint64_t *")
        peak = ffi.new("uint64_t *")
        n = lib.gs_ledger_task_usage(self._l, task_id.encode(), used, launches, peak)
        total = self._all(sum(self._bytes(g, used[g]) for g in range(self.ngpus)))
        return SlotTotals(int(n), total, self._all(peak[0]), min(int(launches[0]), MAX_COUNT))

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
            t.used = self._all(t.used + int(info.used))
            t.peak = self._all(t.peak + int(info.peak))
            t.launches = min(t.launches + int(info.launches), MAX_COUNT)
        for tid, t in out.items():
            with contextlib.suppress(LedgerError):
                i = int(lib.gs_ledger_task_find(self._l, _task_key(tid)))
                if i >= 0 and self._l.task[i].peak:
                    t.peak = self._all(self._l.task[i].peak)
        return out

    def slots(self) -> list[tuple[int, str, tuple[int, ...]]]:
        """Each live slot as (pid the process recorded, task id, bytes it holds per ledger
        GPU), read now (the bypass audit, nodemgr.host.audit)."""
        n = int(lib.gs_ledger_summary(self._l, self._info, MAX_SLOTS))
        out = []
        for i in range(n):
            info = self._info[i]
            used = self._l.slot[info.slot].used
            tid = ffi.string(info.task_id).decode(errors="replace")
            out.append(
                (int(info.pid), tid, tuple(self._bytes(g, used[g]) for g in range(self.ngpus)))
            )
        return out

    def boundaries(self) -> dict[str, tuple[int, int]]:
        """Per task, the latest boundary of its live processes: (the most iterations one
        reported, when that one reported it, CLOCK_MONOTONIC ns; docs/prediction.md#step-time)."""
        n = int(lib.gs_ledger_summary(self._l, self._info, MAX_SLOTS))
        out: dict[str, tuple[int, int]] = {}
        for i in range(n):
            info = self._info[i]
            s = self._l.slot[info.slot]
            seen = (min(int(s.iterations), MAX_COUNT), min(int(s.boundary_ns), MAX_COUNT))
            tid = ffi.string(info.task_id).decode(errors="replace")
            if seen[0] and seen > out.get(tid, (0, 0)):
                out[tid] = seen
        return out

    def reap(self) -> int:
        """Free the slots of processes that have died; return how many."""
        rc = int(lib.gs_ledger_reap(self._l, self._fd, self._info, MAX_SLOTS))
        if rc < 0:
            raise LedgerError(f"reaping {self.path}: {os.strerror(-rc)}")
        return rc

    def live_pids(self) -> list[int]:
        """Free the slots of dead processes; the pids of the processes still using it."""
        self.reap()
        n = int(lib.gs_ledger_summary(self._l, self._info, MAX_SLOTS))
        return sorted({int(self._info[i].pid) for i in range(n)})

    def reap_totals(self) -> dict[str, SlotTotals]:
        """Free the slots of processes that have died; per task id, what they had used."""
        rc = self.reap()
        return self._totals(min(rc, MAX_SLOTS))


def _memory(uuids: Sequence[bytes], memory: Sequence[int] | None) -> list[int]:
    if memory is None:
        return [MAX_GPU_BYTES] * len(uuids)
    if len(memory) != len(uuids):
        raise LedgerError(f"{len(uuids)} GPUs named, the memory of {len(memory)} given")
    return list(memory)


def _entry_id(raw: bytes) -> str | None:
    """A task entry's id field as nodemgr writes it (the id, then zeros to the end), or None
    when it cannot be one nodemgr wrote."""
    key, nul, rest = raw.partition(b"\0")
    if not key or not nul or rest.strip(b"\0"):
        return None
    try:
        return key.decode()
    except UnicodeDecodeError:
        return None


def _task_key(task_id: str) -> bytes:
    """``task_id`` as the C side compares it; an id that cannot fit would alias another."""
    key = task_id.encode()
    if not key or len(key) >= lib.GS_TASK_ID_LEN or b"\0" in key:
        raise LedgerError(f"task id {task_id!r} cannot name a ledger task entry")
    return key
