"""Stream capture on the simulated driver, through the driver API by ctypes in a child
process: what a capture records is not done then, and each launch of the graph does it;
a stream that waits on an event recorded in a capture joins it (work forked onto a side
stream is captured too); a graph launched in a capture is recorded into it.
"""

from __future__ import annotations

from tests.sim.test_sim_memory import run

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
    out = run(CAPTURE)
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


GRAPH_MEMORY = """
RELAXED, AUTO_FREE = 2, 1
USED, USED_HIGH, RESERVED, RESERVED_HIGH = 0, 1, 2, 3
s = vp()
check(cu.cuStreamCreate(ctypes.byref(s), 0), "stream")
def attrs():
    v = []
    for a in (USED, USED_HIGH, RESERVED, RESERVED_HIGH):
        x = u64()
        check(cu.cuDeviceGetGraphMemAttribute(0, a, ctypes.byref(x)), f"attr {a}")
        v.append(x.value // MIB)
    return v
def pool_reserved():
    pool, x = vp(), u64()
    check(cu.cuDeviceGetMemPool(ctypes.byref(pool), 0), "pool")
    check(cu.cuMemPoolGetAttribute(pool, 5, ctypes.byref(x)), "pool reserved")
    return x.value // MIB
def capture(*steps):
    # steps: ("a", MIB) allocates, ("f", i) frees the i-th allocation of this capture
    g, ex, ptrs = vp(), vp(), []
    check(cu.cuStreamBeginCapture_v2(s, RELAXED), "begin")
    for op, n in steps:
        if op == "a":
            p = u64()
            check(cu.cuMemAllocAsync(ctypes.byref(p), sz(n * MIB), s), "captured alloc")
            ptrs.append(p.value)
        else:
            check(cu.cuMemFreeAsync(u64(ptrs[n]), s), "captured free")
    check(cu.cuStreamEndCapture(s, ctypes.byref(g)), "end")
    return g, ptrs
def instantiate(g, flags=0):
    ex = vp()
    check(cu.cuGraphInstantiateWithFlags(ctypes.byref(ex), g, u64(flags)), "instantiate")
    return ex
free0 = free_bytes()
# 64 MiB allocated and freed in the graph, then 32 MiB kept past it: the pool reserves
# the peak of what is live at once, not the sum.
g, ptrs = capture(("a", 64), ("f", 0), ("a", 32), ("a", 16), ("f", 2))
out["captured"] = [attrs(), pool_reserved()]
out["address_taken"] = (free0 - free_bytes()) // MIB
ex = instantiate(g)
out["instantiated"] = attrs()
check(cu.cuGraphUpload(ex, s), "upload")
out["uploaded"] = attrs()
check(cu.cuGraphLaunch(ex, s), "launch")
out["launched"] = attrs()
check(h2d(ptrs[1], b"G" * 4096), "write graph memory")
out["usable"] = d2h(ptrs[1], 4096)[1] == b"G" * 4096
check(cu.cuMemFreeAsync(u64(ptrs[1]), s), "free outside the graph")
out["freed"] = attrs()
check(cu.cuGraphLaunch(ex, s), "relaunch")
check(cu.cuMemFree_v2(u64(ptrs[1])), "free again outside")
out["relaunched"] = attrs()
check(cu.cuDeviceGraphMemTrim(0), "trim")
out["trimmed"] = attrs()
check(cu.cuGraphLaunch(ex, s), "launch after trim")
out["after_trim"] = attrs()
# A high-water mark restarts at current when set to 0; other values and attributes refuse.
zero = u64(0)
check(cu.cuDeviceSetGraphMemAttribute(0, USED_HIGH, ctypes.byref(zero)), "reset used high")
out["reset"] = [
    attrs(),
    cu.cuDeviceSetGraphMemAttribute(0, RESERVED, ctypes.byref(zero)),
    cu.cuDeviceSetGraphMemAttribute(0, RESERVED_HIGH, ctypes.byref(u64(1))),
    cu.cuDeviceGetGraphMemAttribute(0, 4, ctypes.byref(zero)),
]
# Graph and executable graph gone: the live allocation stays (it is freed on its own),
# and the pool holds its memory until a trim.
check(cu.cuGraphExecDestroy(ex), "exec destroy")
check(cu.cuGraphDestroy(g), "graph destroy")
out["destroyed"] = attrs()
check(cu.cuMemFreeAsync(u64(ptrs[1]), s), "last free")
check(cu.cuDeviceGraphMemTrim(0), "trim 2")
out["all_gone"] = [attrs(), (free0 - free_bytes()) // MIB]
# Auto-free on launch: each launch frees what the last one left live, so it is reused.
g, ptrs = capture(("a", 8))
ex = instantiate(g, AUTO_FREE)
for _ in range(3):
    check(cu.cuGraphLaunch(ex, s), "auto-free launch")
out["auto_free"] = attrs()
check(cu.cuGraphExecDestroy(ex), "exec destroy 2")
check(cu.cuGraphDestroy(g), "graph destroy 2")
check(cu.cuMemFree_v2(u64(ptrs[0])), "free auto")
check(cu.cuDeviceGraphMemTrim(0), "trim 3")
out["end"] = [attrs()[0], attrs()[2], (free0 - free_bytes()) // MIB]
"""


def test_graph_memory_is_the_graph_pools_from_launch_until_trimmed() -> None:
    """A captured cuMemAllocAsync is an allocation node: an address now, no pool memory;
    the device's graph pool reserves the peak of what a launch (or an upload) holds at
    once, keeps it for later launches after the graph frees it, and gives back at a trim
    what no live allocation uses. The four graph-memory attributes say so."""
    out = run(GRAPH_MEMORY)
    # [used, used high, reserved, reserved high] in MiB
    assert out["captured"] == [[0, 0, 0, 0], 0]  # nothing from the pool, nothing mapped
    assert out["address_taken"] == 64 + 32 + 16  # the simulator's one address space
    assert out["instantiated"] == [0, 0, 0, 0]
    assert out["uploaded"] == [0, 0, 64, 64]  # max(64, 32 + 16): reused inside the graph
    assert out["launched"] == [32, 64, 64, 64]  # 32 MiB outlive the launch
    assert out["usable"] is True
    assert out["freed"] == [0, 64, 64, 64]  # kept by the pool
    assert out["relaunched"] == [0, 64, 64, 64]  # reused: nothing more reserved
    assert out["trimmed"] == [0, 64, 0, 64]
    assert out["after_trim"] == [32, 64, 64, 64]
    assert out["reset"] == [[32, 32, 64, 64], 1, 1, 1]  # 1: CUDA_ERROR_INVALID_VALUE
    assert out["destroyed"] == [32, 32, 64, 64]
    assert out["all_gone"] == [[0, 32, 0, 64], 0]
    assert out["auto_free"] == [8, 32, 8, 64]
    assert out["end"] == [0, 0, 0]
