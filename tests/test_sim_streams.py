"""Stream capture on the simulated driver, through the driver API by ctypes in a child
process: what a capture records is not done then, and each launch of the graph does it;
a stream that waits on an event recorded in a capture joins it (work forked onto a side
stream is captured too); a graph launched in a capture is recorded into it.
"""

from __future__ import annotations

import sys

from client_plugin import libs
from tests.conftest import run_sim_json
from tests.test_sim_memory import PRELUDE

CAPTURE = """
RELAXED, NONE, ACTIVE = 2, 0, 1
s1, s2, e1, e2 = vp(), vp(), vp(), vp()
check(cu.cuStreamCreate(ctypes.byref(s1), 0), "s1")
check(cu.cuStreamCreate(ctypes.byref(s2), 0), "s2")
check(cu.cuEventCreate(ctypes.byref(e1), 2), "e1")
check(cu.cuEventCreate(ctypes.byref(e2), 2), "e2")
src, dst = u64(), u64()
check(cu.cuMemAlloc_v2(ctypes.byref(src), sz(4096)), "src")
check(cu.cuMemAlloc_v2(ctypes.byref(dst), sz(4096)), "dst")
check(h2d(src.value, b"A" * 4096), "A")
check(h2d(dst.value, b"0" * 4096), "0")
def capturing(s):
    st = ctypes.c_int(-1)
    check(cu.cuStreamIsCapturing(s, ctypes.byref(st)), "is capturing")
    return st.value
out["legacy"] = cu.cuStreamBeginCapture_v2(None, RELAXED)
check(cu.cuStreamBeginCapture_v2(s1, RELAXED), "begin")
check(cu.cuEventRecord(e1, s1), "record e1")
check(cu.cuStreamWaitEvent(s2, e1, 0), "s2 waits: joins")
out["joined"] = capturing(s2)
check(cu.cuMemcpyDtoDAsync_v2(dst, src, sz(4096), s2), "copy on s2")
check(cu.cuEventRecord(e2, s2), "record e2")
check(cu.cuStreamWaitEvent(s1, e2, 0), "s1 waits: rejoin")
g = vp()
out["end_joined"] = cu.cuStreamEndCapture(s2, ctypes.byref(g))
check(cu.cuStreamEndCapture(s1, ctypes.byref(g)), "end")
out["after_end"] = [capturing(s1), capturing(s2)]
out["during_capture"] = d2h(dst.value, 1)[1].decode()
ex = vp()
check(cu.cuGraphInstantiateWithFlags(ctypes.byref(ex), g, u64(0)), "instantiate")
check(h2d(src.value, b"B" * 4096), "B")
check(cu.cuGraphLaunch(ex, s1), "launch")
out["replayed"] = d2h(dst.value, 4096)[1] == b"B" * 4096
# A graph launched in a capture is recorded into it.
check(cu.cuStreamBeginCapture_v2(s1, RELAXED), "begin 2")
check(cu.cuGraphLaunch(ex, s1), "launch in capture")
g2, ex2 = vp(), vp()
check(cu.cuStreamEndCapture(s1, ctypes.byref(g2)), "end 2")
check(h2d(src.value, b"C" * 4096), "C")
out["launched_in_capture"] = d2h(dst.value, 1)[1].decode()
check(cu.cuGraphInstantiateWithFlags(ctypes.byref(ex2), g2, u64(0)), "instantiate 2")
check(cu.cuGraphLaunch(ex2, s2), "launch 2")
out["nested"] = d2h(dst.value, 1)[1].decode()
ms = ctypes.c_float()
t1, t2 = vp(), vp()
check(cu.cuEventCreate(ctypes.byref(t1), 0), "t1")
check(cu.cuEventCreate(ctypes.byref(t2), 0), "t2")
out["never_recorded"] = cu.cuEventElapsedTime_v2(ctypes.byref(ms), t1, t2)
# A stream destroyed in the middle of its capture takes the capture with it.
check(cu.cuStreamBeginCapture_v2(s1, RELAXED), "begin 3")
check(cu.cuEventRecord(e1, s1), "record e1 again")
check(cu.cuStreamWaitEvent(s2, e1, 0), "s2 joins again")
check(cu.cuStreamDestroy_v2(s1), "destroy s1")
out["orphan"] = capturing(s2)
"""


def test_capture_records_forks_onto_other_streams_and_replays() -> None:
    out = run_sim_json(
        [
            sys.executable,
            "-c",
            PRELUDE + CAPTURE + "\nprint(json.dumps(out))",
            str(libs.sim_driver_dir() / "libcuda.so.1"),
        ],
        str(libs.sim_driver_dir()),
    )
    assert out["legacy"] == 900  # CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
    assert out["joined"] == 1  # CU_STREAM_CAPTURE_STATUS_ACTIVE
    assert out["end_joined"] == 903  # CUDA_ERROR_STREAM_CAPTURE_UNMATCHED
    assert out["after_end"] == [0, 0]
    assert out["during_capture"] == "0"  # recorded, not done
    assert out["replayed"] is True
    assert out["launched_in_capture"] == "B"
    assert out["nested"] == "C"
    assert out["never_recorded"] == 400  # CUDA_ERROR_INVALID_HANDLE
    assert out["orphan"] == 0
