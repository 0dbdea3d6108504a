"""Time slicing in the shim (docs/timeslicing.md#classification-in-the-shim): persistent
and temporary memory by iteration boundaries, release and turn flags, and allocations and
launches held while the task's pause word has a bit set.

Each test drives a real Python process with the real shim preloaded against the simulated
driver, one command at a time over its stdin, and reads the results from the ledger as
nodemgr does."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpushare import libs
from nodemgr.host import gpus
from nodemgr.host.ledger import TASK_TIMESLICED, Ledger
from tests.conftest import shim_preload

MiB = 1 << 20
GiB = 1 << 30
TASK = "regions-task"
NODE = [gpus.Gpu(i, gpus.simulated_uuid(i), "Regions Sim", 16 * GiB) for i in range(2)]
AT_LOAD = ("GPUSHARE_LEDGER", "GPUSHARE_TASK_ID", "GPUSHARE_TRACE", "CUDA_VISIBLE_DEVICES")
RELEASE, YIELD = 1, 2
# x86_64's futex system call and its plain (shared) FUTEX_WAIT operation: the shim waits
# with that on the ledger's pause word, unlike the interpreter's own (private) waits.
SYS_FUTEX, FUTEX_WAIT = 202, 0
TIMEOUT = 60.0  # for anything the child should do soon: generous, for a loaded machine

# The child: one command a line on stdin, one answer a line on stdout.
CHILD = r"""
import ctypes, os, sys
from gpushare import shim

cu = ctypes.CDLL(sys.argv[1])
u64, vp, ui = ctypes.c_uint64, ctypes.c_void_p, ctypes.c_uint
cu.cuMemAlloc_v2.argtypes = [ctypes.POINTER(u64), ctypes.c_size_t]
cu.cuMemFree_v2.argtypes = [u64]
cu.cuLaunchKernel.argtypes = [vp, ui, ui, ui, ui, ui, ui, ui, vp, vp, vp]
dev, ctx = ctypes.c_int(), vp()
assert cu.cuInit(0) == 0
assert cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
assert cu.cuCtxSetCurrent(ctx) == 0
ptrs, sizes = {}, {}

class Prop(ctypes.Structure):  # CUmemAllocationProp: pinned device memory on device 0
    _fields_ = [("type", ctypes.c_int), ("handle_types", ctypes.c_int),
                ("loc_type", ctypes.c_int), ("loc_id", ctypes.c_int), ("win32", vp),
                ("flags", ctypes.c_ubyte * 8)]

def vmm(name, mib):
    # cuMemCreate, mapped into a reserved range, the handle released at once (common).
    h, p, size = u64(), u64(), mib << 20
    rcs = [cu.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(size), ctypes.byref(Prop(1, 0, 1, 0)),
                          u64(0)),
           cu.cuMemAddressReserve(ctypes.byref(p), ctypes.c_size_t(size), ctypes.c_size_t(0),
                                  u64(0), u64(0)),
           cu.cuMemMap(p, ctypes.c_size_t(size), ctypes.c_size_t(0), h, u64(0)),
           cu.cuMemRelease(h)]
    ptrs[name], sizes[name] = p.value, size
    return f"vmm {name} {max(rcs)}"

def unmap(name):
    p, size = u64(ptrs.pop(name)), ctypes.c_size_t(sizes.pop(name))
    return f"unmap {name} {max(cu.cuMemUnmap(p, size), cu.cuMemAddressFree(p, size))}"

def reset():
    # The primary context's reset frees everything allocated in it; a new one is made current.
    rcs = [cu.cuDevicePrimaryCtxReset_v2(dev), cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev),
           cu.cuCtxSetCurrent(ctx)]
    ptrs.clear()
    return f"reset {max(rcs)}"

def alloc(name, mib):
    p = u64()
    rc = cu.cuMemAlloc_v2(ctypes.byref(p), mib << 20)
    ptrs[name] = p.value
    return f"alloc {name} {rc}"

def memory():
    m = shim.memory()
    if m is None:
        return "memory None"
    mib = [v >> 20 for v in (m.used, m.persistent, m.temporary, m.temporary_peak)]
    return "memory " + " ".join(map(str, [*mib, m.iterations]))

def counters():
    c = shim.counters()
    return "counters None" if c is None else f"counters {c.peak >> 20} {c.launches}"

def mark(what):
    try:
        shim.mark_persistent(ptrs[what] if what in ptrs else int(what, 0))
        return "mark ok"
    except shim.ShimError as e:
        return f"mark {type(e).__name__} | {e}"

def fork():
    pid = os.fork()
    if pid == 0:
        print("child", alloc("c", 64), "iter", shim.iteration(), memory(), flush=True)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    return f"forked {status}"

print("ready", flush=True)
for line in sys.stdin:
    cmd, *args = line.split()
    if cmd == "alloc":
        out = alloc(args[0], int(args[1]))
    elif cmd == "free":
        out = f"free {args[0]} {cu.cuMemFree_v2(ptrs.pop(args[0]))}"
    elif cmd == "launch":
        out = f"launch {cu.cuLaunchKernel(1, 1, 1, 1, 1, 1, 1, 0, None, None, None)}"
    elif cmd == "iter":
        out = f"iter {shim.iteration()}"
    elif cmd == "released":
        shim.released()
        out = "released"
    elif cmd == "mark":
        out = mark(args[0])
    elif cmd == "memory":
        out = memory()
    elif cmd == "counters":
        out = counters()
    elif cmd == "vmm":
        out = vmm(args[0], int(args[1]))
    elif cmd == "unmap":
        out = unmap(args[0])
    elif cmd == "reset":
        out = reset()
    elif cmd == "fork":
        out = fork()
    elif cmd == "exit":
        break
    else:
        out = f"unknown {cmd}"
    print(out, flush=True)
"""


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    """An environment's ledger as nodemgr makes it for a grant: 4 GiB on GPU 0, the task's
    entry."""
    led = Ledger.create(tmp_path / "ledger", [g.uuid_bytes for g in NODE])
    led.set_limit(0, 4 * GiB)
    led.task_add(TASK)
    yield led
    led.close()


class Child:
    """The CHILD program under the shim: enforcing ``ledger`` for TASK, or inert (None),
    or without the shim at all (``preload=False``)."""

    def __init__(
        self,
        ledger: Ledger | None,
        cwd: Path,
        preload: bool = True,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        env = {k: v for k, v in os.environ.items() if k not in (*AT_LOAD, "LD_PRELOAD")}
        env.update(extra_env or {})
        env["LD_LIBRARY_PATH"] = str(libs.sim_driver_dir())
        env["GPUSHARE_SIM_GPUS"] = gpus.sim_spec(NODE)
        if preload:
            env["LD_PRELOAD"] = shim_preload()
        if ledger is not None:
            env["GPUSHARE_LEDGER"] = str(ledger.path)
            env["GPUSHARE_TASK_ID"] = TASK
        driver = libs.sim_driver_dir() / "libcuda.so.1"
        # In cwd, not the checkout: the installed package is what is imported.
        self.p = subprocess.Popen(
            [sys.executable, "-u", "-c", CHILD, str(driver)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=cwd,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        assert self.readline() == "ready"

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def readline(self) -> str:
        try:
            line = self.lines.get(timeout=TIMEOUT)
        except queue.Empty:
            raise AssertionError(f"no answer from the child within {TIMEOUT}s") from None
        if line is None:
            raise AssertionError(f"the child ended: {self.finish()}")
        return line

    def send(self, command: str) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(command + "\n")
        self.p.stdin.flush()

    def __call__(self, command: str) -> str:
        self.send(command)
        return self.readline()

    def finish(self) -> str:
        """End the child; its stderr, which the caller checks is empty (a sanitizer
        reports there). Its stdout is the reader thread's alone."""
        assert self.p.stdin is not None and self.p.stderr is not None
        if not self.p.stdin.closed:
            if self.p.poll() is None:
                self.send("exit")
            self.p.stdin.close()
        err = self.p.stderr.read()
        assert self.p.wait(TIMEOUT) == 0, err
        return err

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(30)
        for f in (self.p.stdin, self.p.stdout, self.p.stderr):
            if f is not None:
                f.close()

    def waits_on(self, word: int) -> None:
        """Until the child sleeps in the shim's wait on a pause word that held ``word``
        when it was read: proof that it waits, and of what it saw."""
        path = Path(f"/proc/{self.p.pid}/syscall")
        deadline = time.monotonic() + TIMEOUT
        fields: list[str] = []
        while time.monotonic() < deadline:
            try:
                fields = path.read_text().split()
            except PermissionError:
                pytest.skip("/proc/PID/syscall is not readable here")
            if (
                len(fields) > 3
                and fields[0] == str(SYS_FUTEX)
                and int(fields[2], 16) == FUTEX_WAIT
                and int(fields[3], 16) == word
            ):
                return
            time.sleep(0.01)
        raise AssertionError(f"the child is not waiting on pause word {word}: {fields}")


@pytest.fixture
def child(ledger: Ledger, tmp_path: Path) -> Iterator[Child]:
    c = Child(ledger, tmp_path)
    yield c
    c.kill()


def regions(ledger: Ledger) -> tuple[int, ...]:
    """GPU 0's used, persistent, temporary peak and settled MiB; iterations, releases."""
    r = ledger.task_regions(TASK)
    assert r.processes == 1
    mib = [v[0] >> 20 for v in (r.used, r.persistent, r.temp_peak, r.settled)]
    return (*mib, r.iterations, r.releases)


def used_mib(ledger: Ledger) -> int:
    return ledger.task_usage(TASK).used >> 20


# --- classification -------------------------------------------------------------------------


def test_set_up_before_the_first_boundary_is_not_temporary(child: Child, ledger: Ledger) -> None:
    assert child("alloc model 100") == "alloc model 0"
    assert child("alloc optim 50") == "alloc optim 0"
    # Before any boundary nothing is persistent, and no temporary peak is kept yet.
    assert child("memory") == "memory 150 0 150 0 0"
    assert regions(ledger) == (150, 0, 0, 0, 0, 0)
    assert child("iter") == "iter 0"  # a task that is not time-sliced is asked nothing
    assert child("memory") == "memory 150 150 0 0 1"
    assert regions(ledger) == (150, 150, 0, 0, 1, 0)
    entry = ledger.task_entry(TASK)
    assert entry is not None and entry.iterations == 1
    assert child.finish() == ""


def test_temporary_memory_and_its_peak_across_iterations(child: Child, ledger: Ledger) -> None:
    assert child("alloc model 100") == "alloc model 0"
    assert child("iter") == "iter 0"
    # Iteration 1: 30 + 20 MiB of activations at once, then freed.
    assert child("alloc act1 30") == "alloc act1 0"
    assert child("alloc act2 20") == "alloc act2 0"
    assert child("memory") == "memory 150 100 50 50 1"
    assert child("free act1") == "free act1 0"
    assert child("free act2") == "free act2 0"
    assert child("memory") == "memory 100 100 0 50 1"
    assert child("iter") == "iter 0"
    # Iteration 2 takes less: the peak stays. Its buffer outlives the next boundary...
    assert child("alloc act3 40") == "alloc act3 0"
    assert child("memory") == "memory 140 100 40 50 2"
    assert child("iter") == "iter 0"
    assert regions(ledger) == (140, 140, 50, 0, 3, 0)
    # ...so it is persistent now, and its free lowers the persistent share again.
    assert child("free act3") == "free act3 0"
    assert child("memory") == "memory 100 100 0 50 3"
    # Memory allocated before the first boundary leaves the persistent share the same way.
    assert child("free model") == "free model 0"
    assert child("memory") == "memory 0 0 0 50 3"
    assert regions(ledger) == (0, 0, 50, 0, 3, 0)
    assert child.finish() == ""


def test_a_release_settles_the_persistent_bytes(child: Child, ledger: Ledger) -> None:
    """A task on a time-sliced GPU is asked to release at its process's first boundary,
    so that its shape can be learned; released() records what it keeps."""
    ledger.task_turn(TASK, 0, TASK_TIMESLICED)
    assert child("alloc model 100") == "alloc model 0"
    assert child("alloc cache 60") == "alloc cache 0"  # a framework's cached block
    assert child("iter") == f"iter {RELEASE}"
    assert regions(ledger) == (160, 160, 0, 0, 1, 0)
    assert child("free cache") == "free cache 0"  # the release empties the cache
    assert child("released") == "released"
    assert regions(ledger) == (100, 100, 0, 100, 1, 1)
    assert child("alloc act 30") == "alloc act 0"
    assert child("iter") == "iter 0"  # once only: no turn is set
    assert child("free act") == "free act 0"
    assert regions(ledger) == (100, 100, 30, 100, 2, 1)
    assert child.finish() == ""


def test_the_boundary_that_reaches_turn_until_asks_for_release_and_yield(
    child: Child, ledger: Ledger
) -> None:
    ledger.task_turn(TASK, 3, TASK_TIMESLICED)
    assert child("alloc model 10") == "alloc model 0"
    assert child("iter") == f"iter {RELEASE}"  # the first boundary
    assert child("released") == "released"
    assert [child("iter") for _ in range(3)] == [
        "iter 0",
        f"iter {RELEASE | YIELD}",  # the process's count reached turn_until
        f"iter {RELEASE | YIELD}",  # and stays there until nodemgr moves the turn on
    ]
    ledger.task_turn(TASK, 7, TASK_TIMESLICED)
    assert [child("iter") for _ in range(3)] == ["iter 0", "iter 0", f"iter {RELEASE | YIELD}"]
    entry = ledger.task_entry(TASK)
    assert entry is not None and entry.iterations == 7
    assert child.finish() == ""


def test_a_task_already_running_releases_once_when_its_gpu_becomes_time_sliced(
    child: Child, ledger: Ledger
) -> None:
    """Not only at the first boundary: a process that has never released does so at its
    first boundary after the task is flagged time-sliced, and once only."""
    assert child("alloc model 100") == "alloc model 0"
    assert [child("iter") for _ in range(2)] == ["iter 0", "iter 0"]
    ledger.task_turn(TASK, 0, TASK_TIMESLICED)
    assert child("iter") == f"iter {RELEASE}"
    assert child("iter") == f"iter {RELEASE}"  # asked again until it has released
    assert child("released") == "released"
    assert child("iter") == "iter 0"
    assert regions(ledger)[4:] == (5, 1)
    assert child.finish() == ""


def test_mark_persistent(child: Child, ledger: Ledger) -> None:
    assert child("alloc model 100") == "alloc model 0"
    assert child("alloc early 8") == "alloc early 0"
    assert child("mark early") == "mark ok"  # before the first boundary: persistent at once
    assert child("memory") == "memory 108 8 100 0 0"
    assert child("free early") == "free early 0"
    assert child("memory") == "memory 100 0 100 0 0"
    assert child("iter") == "iter 0"
    # Allocated during an iteration but kept (an optimizer's lazily made state).
    assert child("alloc state 40") == "alloc state 0"
    assert child("memory") == "memory 140 100 40 40 1"
    assert child("mark state") == "mark ok"
    assert child("mark state") == "mark ok"  # twice counts once
    assert child("memory") == "memory 140 140 0 40 1"
    assert child("mark model") == "mark ok"  # persistent already: nothing changes
    assert child("memory") == "memory 140 140 0 40 1"
    assert child("free state") == "free state 0"
    assert child("memory") == "memory 100 100 0 40 1"
    # An address the shim handed out no allocation at, or inside one: refused, aloud.
    out = child("mark 0xdead0000")
    assert out.startswith("mark ShimError | the shim knows no allocation starting at "), out
    assert "0xdead0000" in out
    assert child("alloc act 4") == "alloc act 0"
    assert child("mark act") == "mark ok"
    assert regions(ledger) == (104, 104, 40, 0, 1, 0)
    assert child.finish() == ""


def test_memory_freed_by_unmapping_or_a_context_reset_leaves_the_persistent_share(
    child: Child, ledger: Ledger
) -> None:
    """Every way memory goes back, not only cuMemFree: the last unmap of a released
    cuMemCreate handle, and the teardown of the context the memory was allocated in."""
    assert child("vmm weights 100") == "vmm weights 0"
    assert child("alloc model 20") == "alloc model 0"
    assert child("iter") == "iter 0"
    assert child("vmm act 30") == "vmm act 0"
    assert child("memory") == "memory 150 120 30 30 1"
    assert child("unmap act") == "unmap act 0"
    assert child("memory") == "memory 120 120 0 30 1"
    assert child("unmap weights") == "unmap weights 0"
    assert child("memory") == "memory 20 20 0 30 1"
    # A handle's memory is marked through where it is mapped.
    assert child("vmm kept 10") == "vmm kept 0"
    assert child("mark kept") == "mark ok"
    assert child("memory") == "memory 30 30 0 30 1"
    assert child("unmap kept") == "unmap kept 0"
    assert child("memory") == "memory 20 20 0 30 1"
    # A reset frees what the context held, set-up and temporary alike.
    assert child("alloc act 40") == "alloc act 0"
    assert child("memory") == "memory 60 20 40 40 1"
    assert child("reset") == "reset 0"
    assert child("memory") == "memory 0 0 0 40 1"
    assert child("alloc act 8") == "alloc act 0"
    assert child("memory") == "memory 8 0 8 40 1"
    assert child.finish() == ""


def test_a_fork_child_counts_its_own_boundaries_from_zero(child: Child, ledger: Ledger) -> None:
    ledger.task_turn(TASK, 0, TASK_TIMESLICED)
    assert child("alloc model 100") == "alloc model 0"
    assert child("iter") == f"iter {RELEASE}"
    assert child("released") == "released"
    assert child("iter") == "iter 0"
    # The child's slot is its own: its first boundary is its first, and what it holds is
    # only its own allocation.
    assert child("fork") == "child alloc c 0 iter 1 memory 64 64 0 0 1"
    assert child.readline() == "forked 0"
    assert child("memory") == "memory 100 100 0 0 2"
    assert child.finish() == ""


def test_the_counters_hold_the_peak_and_the_launches(child: Child, ledger: Ledger) -> None:
    assert child("counters") == "counters 0 0"
    for cmd in ("alloc a 64", "alloc b 32", "free a", "alloc c 16"):
        assert child(cmd).endswith(" 0")
    assert [child("launch") for _ in range(3)] == ["launch 0"] * 3
    # The most it held at once (a and b), not what it holds now (b and c); its launches.
    assert child("counters") == "counters 96 3"
    assert child("memory").startswith("memory 48 ")
    assert child.finish() == ""


@pytest.mark.parametrize("preload", [True, False], ids=["inert", "no-shim"])
def test_without_a_ledger_the_api_does_nothing(tmp_path: Path, preload: bool) -> None:
    c = Child(None, tmp_path, preload=preload)
    try:
        assert c("alloc a 64") == "alloc a 0"
        assert c("iter") == "iter 0"
        assert c("released") == "released"
        assert c("memory") == "memory None"
        assert c("counters") == "counters None"
        out = c("mark a")
        if preload:
            assert out.startswith("mark ShimError | the shim in this process is inert"), out
        else:
            assert out.startswith("mark ShimNotLoaded | "), out
        assert c.finish() == ""
    finally:
        c.kill()


# --- gating: allocations and launches wait while the pause word has a bit set ---------------


def test_an_allocation_waits_while_the_task_is_gated(child: Child, ledger: Ledger) -> None:
    assert child("alloc model 100") == "alloc model 0"
    assert child("alloc spare 10") == "alloc spare 0"
    ledger.task_gate(TASK, True)
    # Frees, boundaries and reports are never held; a boundary while the task waits for
    # its turn asks for a release (the step that was under way when the turn ended).
    assert child("free spare") == "free spare 0"
    assert child("iter") == f"iter {RELEASE}"
    assert child("memory") == "memory 100 100 0 0 1"
    child.send("alloc act 64")
    child.waits_on(2)  # GS_PAUSE_TURN
    assert used_mib(ledger) == 100, "nothing is charged while the allocation waits"
    ledger.task_gate(TASK, False)
    assert child.readline() == "alloc act 0"
    assert used_mib(ledger) == 164
    assert child.finish() == ""


def test_a_launch_waits_while_the_task_is_gated(child: Child, ledger: Ledger) -> None:
    assert child("launch") == "launch 0"
    ledger.task_gate(TASK, True)
    child.send("launch")
    child.waits_on(2)
    assert ledger.task_usage(TASK).launches == 1
    ledger.task_gate(TASK, False)
    assert child.readline() == "launch 0"
    assert ledger.task_usage(TASK).launches == 2
    assert child.finish() == ""


def test_the_trace_counts_launches_and_waits_on_the_pause_word(
    ledger: Ledger, tmp_path: Path
) -> None:
    """GPUSHARE_TRACE's first line of a process: its launch counter and how many launches
    and allocations waited for the pause word (what the GPU benchmark records per run)."""
    trace = tmp_path / "trace"
    c = Child(ledger, tmp_path, extra_env={"GPUSHARE_TRACE": str(trace)})
    try:
        assert c("launch") == "launch 0"
        assert c("launch") == "launch 0"
        ledger.task_gate(TASK, True)
        c.send("launch")
        c.waits_on(2)
        ledger.task_gate(TASK, False)
        assert c.readline() == "launch 0"
        ledger.task_pause(TASK, True)
        c.send("alloc a 1")
        c.waits_on(1)
        ledger.task_pause(TASK, False)
        assert c.readline() == "alloc a 0"
        [slot] = [i for i in range(1024) if ledger._l.slot[i].pid == c.p.pid]
        assert c.finish() == ""
    finally:
        c.kill()
    [line] = [x for x in trace.read_text().splitlines() if " mode=" in x]
    fields = dict(f.split("=", 1) for f in line.split())
    assert fields["pid"] == str(c.p.pid)
    assert fields["mode"] == "enforce"
    assert fields["slot"] == str(slot)
    assert fields["launches"] == "3"
    assert fields["pause_waits"] == "2"
    assert int(fields["pause_wait_us"]) > 0


def test_admin_pause_and_turn_gate_combine(child: Child, ledger: Ledger) -> None:
    """Either bit holds the task; clearing one of two keeps it waiting, on the new word."""
    assert child("alloc model 100") == "alloc model 0"
    ledger.task_pause(TASK, True)
    ledger.task_gate(TASK, True)
    child.send("alloc act 64")
    child.waits_on(3)
    ledger.task_pause(TASK, False)
    child.waits_on(2)  # it read the word again and still waits
    assert used_mib(ledger) == 100
    ledger.task_pause(TASK, True)
    ledger.task_gate(TASK, False)
    child.waits_on(1)
    assert used_mib(ledger) == 100
    ledger.task_pause(TASK, False)
    assert child.readline() == "alloc act 0"
    assert used_mib(ledger) == 164
    # And the same for a launch.
    ledger.task_gate(TASK, True)
    ledger.task_pause(TASK, True)
    child.send("launch")
    child.waits_on(3)
    ledger.task_gate(TASK, False)
    child.waits_on(1)
    assert ledger.task_usage(TASK).launches == 0
    ledger.task_pause(TASK, False)
    assert child.readline() == "launch 0"
    assert child.finish() == ""


# --- the turn's barrier ---------------------------------------------------------------------


def test_the_barrier_counts_only_processes_with_a_recent_boundary(
    ledger: Ledger, tmp_path: Path
) -> None:
    """A process that reported boundaries long ago (a parent waiting in join() for its
    children) does not hold the end of a turn: only boundaries at or after ``since_ns``
    count, as the slot's boundary_ns (CLOCK_MONOTONIC) says."""
    from nodemgr._ledger import lib

    fds = [os.open(ledger.path, os.O_RDWR) for _ in range(3)]
    try:
        led = ledger._l
        slots = [lib.gs_ledger_claim(led, fd, os.getpid(), TASK.encode()) for fd in fds]
        assert min(slots) >= 0 and len(set(slots)) == 3
        before = time.monotonic_ns()
        lib.gs_ledger_boundary(led, slots[0], 100)  # the parent's lr_find, then join()
        assert before <= led.slot[slots[0]].boundary_ns <= time.monotonic_ns()
        middle = time.monotonic_ns()
        while time.monotonic_ns() == middle:
            pass
        lib.gs_ledger_boundary(led, slots[1], 7)
        lib.gs_ledger_boundary(led, slots[1], 8)
        # slots[2] reported none: never waited for.
        assert ledger.task_barrier(TASK, 0) == (2, 8)
        assert ledger.task_barrier(TASK, middle + 1) == (1, 8)
        assert ledger.task_barrier(TASK, time.monotonic_ns() + 10**9) == (0, 0)
        assert ledger.task_regions(TASK).min_iterations == 8
        assert ledger.task_barrier("another-task", 0) == (0, 0)
    finally:
        for fd in fds:
            os.close(fd)
    # Reaped slots are cleared, their boundary times too.
    assert ledger.reap() == 3
    assert ledger.task_barrier(TASK, 0) == (0, 0)
    assert all(ledger._l.slot[s].boundary_ns == 0 for s in slots)
