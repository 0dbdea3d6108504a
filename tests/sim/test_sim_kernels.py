"""The simulated driver's kernel counters (gpushareSimKernelCounters, docs/simulator.md):
a process's launches, their blocks, and their waves of blocks over the launching device's
SMs, which a dry run (docs/prediction.md) reports per iteration."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

from gpushare import libs
from tests.sim.conftest import run_sim_json

PROGRAM = r"""
import ctypes, json
cu = ctypes.CDLL("libcuda.so.1")
vp, u = ctypes.c_void_p, ctypes.c_uint
assert cu.cuInit(0) == 0
cu.cuLaunchKernel.argtypes = [vp, u, u, u, u, u, u, u, vp, vp, vp]

def counters():
    out = (ctypes.c_ulonglong * 3)()
    assert cu.gpushareSimKernelCounters(out, 3) == 0
    return list(out)

def on(index):
    dev, ctx = ctypes.c_int(), vp()
    assert cu.cuDeviceGet(ctypes.byref(dev), index) == 0
    assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
    assert cu.cuCtxSetCurrent(ctx) == 0

fn = vp(0x1234)  # the simulated driver checks a handle, never looks through it
seen = {"start": counters()}
on(0)  # 132 SMs
assert cu.cuLaunchKernel(fn, 1, 1, 1, 128, 1, 1, 0, None, None, None) == 0      # 1 wave
assert cu.cuLaunchKernel(fn, 133, 1, 1, 128, 1, 1, 0, None, None, None) == 0    # 2 waves
assert cu.cuLaunchKernel(fn, 11, 12, 2, 32, 1, 1, 0, None, None, None) == 0     # 264: 2
on(1)  # 10 SMs
assert cu.cuLaunchKernel(fn, 25, 1, 1, 64, 1, 1, 0, None, None, None) == 0      # 3 waves
# A launch the driver refuses counts nothing: an empty grid, one past the device's
# limits, one on a stream destroyed (the device timeline looks at its stream).
assert cu.cuLaunchKernel(fn, 0, 1, 1, 64, 1, 1, 0, None, None, None) != 0
assert cu.cuLaunchKernel(fn, 1, 65536, 1, 64, 1, 1, 0, None, None, None) == 1
stream = vp()
assert cu.cuStreamCreate(ctypes.byref(stream), 0) == 0
assert cu.cuStreamDestroy_v2(stream) == 0
assert cu.cuLaunchKernel(fn, 1, 1, 1, 64, 1, 1, 0, stream, None, None) != 0
seen["end"] = counters()
one = (ctypes.c_ulonglong * 3)(7, 7, 7)
assert cu.gpushareSimKernelCounters(one, 1) == 0
seen["first_only"] = list(one)
seen["null"] = cu.gpushareSimKernelCounters(None, 3)
print(json.dumps(seen))
"""


def test_launches_blocks_and_waves_are_counted(tmp_path: Path) -> None:
    gpus = ";".join([f"A|GPU-{uuid.uuid4()}|1073741824", f"B|GPU-{uuid.uuid4()}|1073741824|sms=10"])
    got = run_sim_json(
        [sys.executable, "-c", PROGRAM],
        str(libs.sim_driver_dir()),
        {
            "GPUSHARE_SIM_STATE_DIR": str(tmp_path),
            "GPUSHARE_SIM_GPUS": gpus,
            "GPUSHARE_SIM_TIMELINE": "1",
        },
    )
    assert got["start"] == [0, 0, 0]
    assert got["end"] == [4, 1 + 133 + 264 + 25, 1 + 2 + 2 + 3]
    assert got["first_only"] == [4, 7, 7]
    assert got["null"] == 1  # CUDA_ERROR_INVALID_VALUE
