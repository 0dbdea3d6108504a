"""The simulated driver's device memory, driven through the driver API by ctypes in a child
process: it reads and writes, untouched pages cost nothing and freed ones go back,
cuMemMap maps the very bytes of its handle, and stream-ordered pools keep freed memory
reserved until trimmed or synchronised, as their attributes report.
"""

from __future__ import annotations

import sys

from gpushare import libs
from tests.sim.conftest import run_sim_json

MIB = 1 << 20
GIB = 1 << 30

PRELUDE = """
import ctypes, json, sys
cu = ctypes.CDLL(sys.argv[1])
u64, sz, vp = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p
MIB = 1 << 20
out = {}
def check(rc, what):
    if rc != 0:
        raise SystemExit(f"{what}: {rc}")
def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0
def free_bytes():
    f, t = sz(), sz()
    check(cu.cuMemGetInfo_v2(ctypes.byref(f), ctypes.byref(t)), "meminfo")
    return f.value
def h2d(dst, data):
    return cu.cuMemcpyHtoD_v2(u64(dst), data, sz(len(data)))
def d2h(src, n):
    buf = ctypes.create_string_buffer(n)
    rc = cu.cuMemcpyDtoH_v2(buf, u64(src), sz(n))
    return rc, buf.raw
check(cu.cuInit(0), "cuInit")
count = ctypes.c_int()
check(cu.cuDeviceGetCount(ctypes.byref(count)), "count")
ctxs = []
for i in range(count.value):
    c = vp()
    check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(c), i), "retain")
    ctxs.append(c)
check(cu.cuCtxSetCurrent(ctxs[0]), "current")
"""


def run(script: str) -> dict[str, object]:
    """script after PRELUDE, on the default simulated node; the child prints out."""
    return run_sim_json(
        [
            sys.executable,
            "-c",
            PRELUDE + script + "\nprint(json.dumps(out))",
            str(libs.sim_driver_dir() / "libcuda.so.1"),
        ],
        str(libs.sim_driver_dir()),
    )


FILL_NODE = """
# Nearly all of each of the default node's four 16 GiB devices, a few bytes written at
# both ends of each: the machine running this has less memory than the devices together.
base_shmem = status("RssShmem")
pattern = bytes(range(256)) * 4
ends = []
for i, c in enumerate(ctxs):
    check(cu.cuCtxSetCurrent(c), "current")
    p = u64()
    check(cu.cuMemAlloc_v2(ctypes.byref(p), sz(15 << 30)), f"alloc on {i}")
    for at in (p.value, p.value + (15 << 30) - len(pattern)):
        check(h2d(at, pattern), "h2d")
        ends.append(d2h(at, len(pattern))[1] == pattern)
out["ends"] = ends
out["taken"] = status("RssShmem") - base_shmem
# 64 MiB written, then freed: its pages go back to the system.
check(cu.cuCtxSetCurrent(ctxs[0]), "current")
q = u64()
check(cu.cuMemAlloc_v2(ctypes.byref(q), sz(64 * MIB)), "alloc 64")
check(cu.cuMemsetD8_v2(q, 0x7F, sz(64 * MIB)), "memset")
out["written"] = status("RssShmem") - base_shmem
check(cu.cuMemFree_v2(q), "free")
out["after_free"] = status("RssShmem") - base_shmem
# Reused, the memory reads as zeros, not as what was written before the free.
check(cu.cuMemAlloc_v2(ctypes.byref(q), sz(64 * MIB)), "alloc again")
out["reused_zero"] = d2h(q.value, 4096)[1] == bytes(4096)
"""


def test_device_memory_is_real_and_untouched_pages_cost_nothing() -> None:
    out = run(FILL_NODE)
    assert out["ends"] == [True] * 8
    taken = out["taken"]
    assert isinstance(taken, int) and taken < 16 * MIB  # 60 GiB allocated, 8 KiB written
    written = out["written"]
    assert isinstance(written, int) and written >= 64 * MIB
    after = out["after_free"]
    assert isinstance(after, int) and after < 16 * MIB
    assert out["reused_zero"] is True


VMM_SETUP = """
class Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]
class Flags(ctypes.Structure):
    _fields_ = [("ct", ctypes.c_ubyte), ("rdma", ctypes.c_ubyte), ("usage", ctypes.c_ushort),
                ("r", ctypes.c_ubyte * 4)]
class Prop(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("handles", ctypes.c_int), ("loc", Loc),
                ("win32", vp), ("flags", Flags)]
prop = Prop(1, 0, Loc(1, 0))
gran = sz()
check(cu.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop), 0), "gran")
g = gran.value
"""

VMM = (
    VMM_SETUP
    + """
h = u64()
check(cu.cuMemCreate(ctypes.byref(h), sz(2 * g), ctypes.byref(prop), u64(0)), "create")
a, b = u64(), u64()
check(cu.cuMemAddressReserve(ctypes.byref(a), sz(2 * g), sz(0), u64(0), u64(0)), "reserve a")
check(cu.cuMemAddressReserve(ctypes.byref(b), sz(g), sz(0), u64(0), u64(0)), "reserve b")
check(cu.cuMemMap(a, sz(2 * g), sz(0), h, u64(0)), "map a")
check(cu.cuMemMap(b, sz(g), sz(g), h, u64(0)), "map b, the handle's second granule")
check(cu.cuMemRelease(h), "release")
# Written through one address, read through the other: the same bytes.
data = b"gpushare" * 512
check(h2d(a.value + g + 100, data), "write through a")
out["shared"] = d2h(b.value + 100, len(data)) == (0, data)
# A copy across the whole mapped range, and one past its end.
out["across"] = d2h(a.value, 2 * g)[0]
out["past_end"] = d2h(a.value + g, g + 4096)[0]
check(cu.cuMemUnmap(b, sz(g)), "unmap b")
out["after_unmap"] = d2h(b.value, 16)[0]
out["still_mapped"] = d2h(a.value + g + 100, len(data)) == (0, data)
"""
)


def test_mapped_memory_is_the_handles_own_bytes() -> None:
    out = run(VMM)
    assert out["shared"] is True
    assert out["across"] == 0
    assert out["past_end"] == 1  # CUDA_ERROR_INVALID_VALUE: not mapped memory
    assert out["after_unmap"] == 1
    assert out["still_mapped"] is True


POOL = """
RESERVED, RESERVED_HIGH, USED, USED_HIGH, THRESHOLD = 5, 6, 7, 8, 4
pool = vp()
check(cu.cuDeviceGetDefaultMemPool(ctypes.byref(pool), 0), "pool")
def attr(a):
    v = u64()
    check(cu.cuMemPoolGetAttribute(pool, a, ctypes.byref(v)), "get attribute")
    return v.value
def snap(key):
    out[key] = {"reserved": attr(RESERVED), "used": attr(USED), "free": free_bytes()}
stream = vp()
check(cu.cuStreamCreate(ctypes.byref(stream), 0), "stream")
snap("start")
p = u64()
check(cu.cuMemAllocAsync(ctypes.byref(p), sz(8 * MIB), stream), "alloc")
snap("allocated")
check(cu.cuMemFreeAsync(p, stream), "free")
snap("freed")
# Reused: a smaller request takes part of the idle chunk, and nothing new is reserved.
check(cu.cuMemAllocAsync(ctypes.byref(p), sz(2 * MIB), stream), "alloc again")
snap("reused")
check(cu.cuMemFreeAsync(p, stream), "free again")
check(cu.cuStreamSynchronize(stream), "sync")
snap("synchronised")
out["highs"] = [attr(RESERVED_HIGH), attr(USED_HIGH)]
# A release threshold keeps memory across synchronisations; trimming gives it back.
keep = u64(32 * MIB)
check(cu.cuMemPoolSetAttribute(pool, THRESHOLD, ctypes.byref(keep)), "threshold")
check(cu.cuMemAllocAsync(ctypes.byref(p), sz(8 * MIB), stream), "alloc kept")
check(cu.cuMemFreeAsync(p, stream), "free kept")
check(cu.cuStreamSynchronize(stream), "sync kept")
snap("kept")
# Trimming keeps at least what it is told to keep: two idle 4 MiB chunks, 6 MiB kept.
q = u64()
check(cu.cuMemAllocAsync(ctypes.byref(p), sz(4 * MIB), stream), "alloc a")
check(cu.cuMemAllocAsync(ctypes.byref(q), sz(4 * MIB), stream), "alloc b")
check(cu.cuMemFreeAsync(p, stream), "free a")
check(cu.cuMemFreeAsync(q, stream), "free b")
check(cu.cuMemPoolTrimTo(pool, sz(6 * MIB)), "trim to 6")
out["trim6"] = attr(RESERVED)
check(cu.cuMemPoolTrimTo(pool, sz((1 << 64) - 1)), "trim to all")
out["trim_max"] = attr(RESERVED)
check(cu.cuMemPoolTrimTo(pool, sz(0)), "trim")
snap("trimmed")
zero = u64(0)
check(cu.cuMemPoolSetAttribute(pool, RESERVED_HIGH, ctypes.byref(zero)), "reset high")
out["high_reset"] = attr(RESERVED_HIGH)
out["high_nonzero"] = cu.cuMemPoolSetAttribute(pool, USED_HIGH, ctypes.byref(keep))
"""


def test_pools_keep_freed_memory_until_trimmed_or_synchronised() -> None:
    out = run(POOL)

    def snap(key: str) -> dict[str, int]:
        value = out[key]
        assert isinstance(value, dict)
        return value

    start = snap("start")
    assert (start["reserved"], start["used"]) == (0, 0)
    assert snap("allocated") == {"reserved": 8 * MIB, "used": 8 * MIB,
                                 "free": start["free"] - 8 * MIB}  # fmt: skip
    # Freed into the pool: no longer used, still reserved, still taken from the device.
    assert snap("freed") == {"reserved": 8 * MIB, "used": 0, "free": start["free"] - 8 * MIB}
    assert snap("reused") == {"reserved": 8 * MIB, "used": 2 * MIB,
                              "free": start["free"] - 8 * MIB}  # fmt: skip
    # The default release threshold is 0: a synchronisation gives everything idle back.
    assert snap("synchronised") == start
    assert out["highs"] == [8 * MIB, 8 * MIB]
    assert snap("kept") == {"reserved": 8 * MIB, "used": 0, "free": start["free"] - 8 * MIB}
    assert out["trim6"] == 8 * MIB  # one 4 MiB chunk less would leave 4 < 6
    assert out["trim_max"] == 8 * MIB
    assert snap("trimmed") == start
    assert out["high_reset"] == 0
    assert out["high_nonzero"] == 1  # only 0 resets a high-water mark


BOUNDS = """
class Copy2D(ctypes.Structure):
    _fields_ = [("srcX", sz), ("srcY", sz), ("srcType", ctypes.c_int), ("srcHost", vp),
                ("srcDevice", u64), ("srcArray", vp), ("srcPitch", sz),
                ("dstX", sz), ("dstY", sz), ("dstType", ctypes.c_int), ("dstHost", vp),
                ("dstDevice", u64), ("dstArray", vp), ("dstPitch", sz),
                ("width", sz), ("height", sz)]
HOST, DEVICE = 1, 2
d, e = u64(), u64()
check(cu.cuMemAlloc_v2(ctypes.byref(d), sz(4096)), "alloc d")
check(cu.cuMemAlloc_v2(ctypes.byref(e), sz(4096)), "alloc e")
src = ctypes.create_string_buffer(b"Z" * 16384)
def copy2d(dst, rows):
    c = Copy2D(srcType=HOST, srcHost=ctypes.cast(src, vp), srcPitch=4096,
               dstType=DEVICE, dstDevice=dst, dstPitch=4096, width=4096, height=rows)
    return cu.cuMemcpy2D_v2(ctypes.byref(c))
out["fits"] = copy2d(d.value, 1)
# Four rows into a one-row allocation: refused, and the neighbour is untouched.
check(h2d(e.value, b"e" * 16), "mark e")
out["overflows"] = copy2d(d.value, 4)
out["neighbour"] = d2h(e.value, 16)[1].decode()
out["made_up"] = copy2d(0x1000, 1)
out["memset_wraps"] = cu.cuMemsetD32_v2(d, ctypes.c_uint(0), sz((1 << 62) + 1))
"""


def test_2d_copies_and_memsets_stay_in_their_allocation() -> None:
    out = run(BOUNDS)
    assert out["fits"] == 0
    assert out["overflows"] == 1  # CUDA_ERROR_INVALID_VALUE
    assert out["neighbour"] == "e" * 16
    assert out["made_up"] == 1
    assert out["memset_wraps"] == 1


FORK = """
import os
a = u64()
check(cu.cuMemAlloc_v2(ctypes.byref(a), sz(1 << 20)), "alloc")
check(h2d(a.value, b"P" * 8192), "fill")
pid = os.fork()
if pid == 0:
    # The child's view is its own: its free and its writes leave the parent's bytes be.
    rc = cu.cuMemcpyHtoD_v2(a, b"C" * 4096, sz(4096)) or cu.cuMemFree_v2(a)
    b = u64()
    rc = rc or cu.cuMemAlloc_v2(ctypes.byref(b), sz(1 << 20))
    rc = rc or cu.cuMemsetD8_v2(b, 0x43, sz(1 << 20))
    os._exit(rc)
out["child"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
out["parent"] = d2h(a.value, 8192)[1] == b"P" * 8192
"""


def test_a_forked_child_cannot_touch_its_parents_device_memory() -> None:
    out = run(FORK)
    assert out["child"] == 0
    assert out["parent"] is True


FORK_MAPPING = (
    VMM_SETUP
    + """
import os
h, b = u64(), u64()
check(cu.cuMemCreate(ctypes.byref(h), sz(2 * g), ctypes.byref(prop), u64(0)), "create")
check(cu.cuMemAddressReserve(ctypes.byref(b), sz(g), sz(0), u64(0), u64(0)), "reserve")
check(cu.cuMemMap(b, sz(g), sz(g), h, u64(0)), "map the second granule")
check(h2d(b.value, b"B" * 64), "write")
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.write(w, d2h(b.value, 64)[1][:1])
    os._exit(0)
os.waitpid(pid, 0)
out["child_reads"] = os.read(r, 1).decode()
"""
)


def test_a_forked_child_sees_its_parents_mappings_at_their_offsets() -> None:
    out = run(FORK_MAPPING)
    assert out["child_reads"] == "B"


IPC_PARENT = """
import subprocess
handles = []
for i, (c, byte) in enumerate(zip(ctxs[:2], b"AB")):
    check(cu.cuCtxSetCurrent(c), "current")
    p = u64()
    check(cu.cuMemAlloc_v2(ctypes.byref(p), sz((i + 1) << 20)), "alloc")
    check(cu.cuMemsetD8_v2(p, ctypes.c_ubyte(byte), sz((i + 1) << 20)), "memset")
    h = (ctypes.c_char * 64)()
    check(cu.cuIpcGetMemHandle(h, p), "handle")
    handles.append(bytes(h).hex())
    # By value, as the C prototype takes it: a structure, not an array (a pointer to ctypes).
    by_value = type("Handle", (ctypes.Structure,), {"_fields_": [("r", ctypes.c_ubyte * 64)]})
    own = by_value.from_buffer_copy(bytes(h))
    out["own"] = cu.cuIpcOpenMemHandle_v2(ctypes.byref(u64()), own, ctypes.c_uint(1))
child = subprocess.run([sys.executable, "-c", sys.argv[2], sys.argv[1], *handles],
                       capture_output=True, text=True, timeout=60)
out["child"] = child.stdout.split() if child.returncode == 0 else child.stderr
"""

IPC_CHILD = (
    PRELUDE.replace("out = {}", "out = []")
    + """
class Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]
opened = []
for i, text in enumerate(sys.argv[2:]):  # both open at once
    check(cu.cuCtxSetCurrent(ctxs[i]), "current")
    h = Handle.from_buffer_copy(bytes.fromhex(text))
    p = u64()
    check(cu.cuIpcOpenMemHandle_v2(ctypes.byref(p), h, ctypes.c_uint(1)), "open")
    opened.append(p)
for p in opened:
    size = sz()
    check(cu.cuMemGetAddressRange_v2(None, ctypes.byref(size), p), "range")
    first, last = d2h(p.value, 1)[1], d2h(p.value + size.value - 1, 1)[1]
    out.append(f"{first.decode()}{last.decode()}{size.value >> 20}")
# A forked child of the opener sees the exporter's bytes too (a private view of them).
import os
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.write(w, d2h(opened[1].value, 1)[1])
    os._exit(0)
os.waitpid(pid, 0)
out.append("fork" + os.read(r, 1).decode())
for p in opened:
    check(cu.cuIpcCloseMemHandle(p), "close")
print(" ".join(out))
"""
)


def test_ipc_handles_of_two_devices_open_their_own_memory() -> None:
    """The first allocation of each device sits at the same place in its device's memory:
    the handles must still open each its own bytes, of its own size."""
    out = run_sim_json(
        [
            sys.executable,
            "-c",
            PRELUDE + IPC_PARENT + "\nprint(json.dumps(out))",
            str(libs.sim_driver_dir() / "libcuda.so.1"),
            IPC_CHILD,
        ],
        str(libs.sim_driver_dir()),
    )
    assert out["own"] == 201  # CUDA_ERROR_INVALID_CONTEXT: not in the exporting process
    assert out["child"] == ["AA1", "BB2", "forkB"]
