"""The simulated driver's device memory, driven through the driver API by ctypes in a child
process: it reads and writes, untouched pages cost nothing and freed ones go back,
cuMemMap maps the very bytes of its handle, and stream-ordered pools keep freed memory
reserved until trimmed or synchronised, as their attributes report.
"""

from __future__ import annotations

import sys

from client_plugin import libs
from tests.conftest import run_sim_json

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


VMM = """
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
    assert snap("trimmed") == start
    assert out["high_reset"] == 0
    assert out["high_nonzero"] == 1  # only 0 resets a high-water mark
