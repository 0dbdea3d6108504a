"""The simulated driver's copy counters (gpushareSimCopyCounters, docs/simulator.md): what a
process's copies moved, by direction, and its copies to the host, which a dry run
(docs/prediction.md) reports per iteration."""

from __future__ import annotations

import sys
from pathlib import Path

from gpushare import libs
from tests.sim.conftest import run_sim_json

MIB = 1 << 20

PROGRAM = r"""
import ctypes, json
cu = ctypes.CDLL("libcuda.so.1")
u64, vp, sz = ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t
dev, ctx = ctypes.c_int(), vp()
assert cu.cuInit(0) == 0
assert cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
assert cu.cuCtxSetCurrent(ctx) == 0
cu.cuMemAlloc_v2.argtypes = [ctypes.POINTER(u64), sz]
cu.cuMemcpyHtoD_v2.argtypes = [u64, vp, sz]
cu.cuMemcpyDtoH_v2.argtypes = [vp, u64, sz]
cu.cuMemcpyDtoD_v2.argtypes = [u64, u64, sz]
cu.cuMemcpy.argtypes = [u64, u64, sz]
cu.cuMemHostAlloc.argtypes = [ctypes.POINTER(vp), sz, ctypes.c_uint]
MIB = 1 << 20

def counters():
    out = (ctypes.c_ulonglong * 4)()
    assert cu.gpushareSimCopyCounters(out, 4) == 0
    return list(out)

a, b = u64(), u64()
assert cu.cuMemAlloc_v2(ctypes.byref(a), 8 * MIB) == 0
assert cu.cuMemAlloc_v2(ctypes.byref(b), 8 * MIB) == 0
host = ctypes.create_string_buffer(8 * MIB)
pinned = vp()
assert cu.cuMemHostAlloc(ctypes.byref(pinned), 4 * MIB, 0) == 0
seen = {"start": counters()}
assert cu.cuMemcpyHtoD_v2(a.value, host, 1 * MIB) == 0
assert cu.cuMemcpyDtoH_v2(host, a.value, 2 * MIB) == 0
assert cu.cuMemcpyDtoH_v2(host, a.value, 2 * MIB) == 0
assert cu.cuMemcpyDtoD_v2(b.value, a.value, 3 * MIB) == 0
# Unified copies: told by their addresses (page-locked memory is the host's).
assert cu.cuMemcpy(a.value, ctypes.addressof(host), 1 * MIB) == 0
assert cu.cuMemcpy(pinned.value, b.value, 4 * MIB) == 0
assert cu.cuMemcpy(b.value, a.value, 1 * MIB) == 0
class Copy2D(ctypes.Structure):  # CUDA_MEMCPY2D
    _fields_ = [("srcXInBytes", sz), ("srcY", sz), ("srcMemoryType", ctypes.c_int),
                ("srcHost", vp), ("srcDevice", u64), ("srcArray", vp), ("srcPitch", sz),
                ("dstXInBytes", sz), ("dstY", sz), ("dstMemoryType", ctypes.c_int),
                ("dstHost", vp), ("dstDevice", u64), ("dstArray", vp), ("dstPitch", sz),
                ("WidthInBytes", sz), ("Height", sz)]

# Four rows of 1 KiB, device to host: one copy, one read.
rows = Copy2D(srcMemoryType=2, srcDevice=a.value, srcPitch=4096, dstMemoryType=1,
              dstHost=ctypes.addressof(host), dstPitch=1024, WidthInBytes=1024, Height=4)
assert cu.cuMemcpy2D_v2(ctypes.byref(rows)) == 0
# A copy that fails (beyond its allocation) counts nothing.
assert cu.cuMemcpyDtoH_v2(host, a.value, 9 * MIB) != 0
seen["end"] = counters()
one = (ctypes.c_ulonglong * 4)(7, 7, 7, 7)
assert cu.gpushareSimCopyCounters(one, 1) == 0
seen["first_only"] = list(one)
seen["null"] = cu.gpushareSimCopyCounters(None, 4)
print(json.dumps(seen))
"""


def test_copies_are_counted_by_direction(tmp_path: Path) -> None:
    got = run_sim_json(
        [sys.executable, "-c", PROGRAM],
        str(libs.sim_driver_dir()),
        {"GPUSHARE_SIM_STATE_DIR": str(tmp_path)},
    )
    assert got["start"] == [0, 0, 0, 0]
    h2d, d2h, d2d, reads = got["end"]
    assert h2d == 1 * MIB + 1 * MIB
    assert d2h == 2 * 2 * MIB + 4 * MIB + 4 * 1024
    assert d2d == 3 * MIB + 1 * MIB
    # The two DtoH copies, the unified one into page-locked memory, the 2D one.
    assert reads == 4
    assert got["first_only"] == [h2d, 7, 7, 7]
    assert got["null"] == 1  # CUDA_ERROR_INVALID_VALUE
