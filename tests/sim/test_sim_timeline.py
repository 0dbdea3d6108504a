"""The simulated driver's device timeline (GPUSHARE_SIM_TIMELINE, docs/simulator.md): each
kernel, copy and memset occupies its device for a modelled time, in order on its stream and
one at a time on the device, whichever process submitted it; synchronisations sleep until
the modelled completion and queries answer CUDA_ERROR_NOT_READY before it; the simulated
NVML reports each process's busy device time.

Every test runs the driver in child processes (through ctypes, no shim) on a node
directory of its own (GPUSHARE_SIM_STATE_DIR). Times are asserted from the model's own
arithmetic (event times, busy nanoseconds) exactly, and from the wall clock only as lower
bounds: a loaded machine makes everything slower, never faster.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from gpushare import libs
from tests.sim.conftest import run_sim_json
from tests.sim.test_sim_memory import PRELUDE

MS = 1_000_000  # ns
SMS = 132  # the default simulated device's SM count: blocks per wave
NOT_READY = 600  # CUDA_ERROR_NOT_READY

# Launches, events and elapsed times, after the PRELUDE of test_sim_memory.
HELPERS = """
import time
F = vp(1)  # functions are taken on trust: a made-up one launches
def launch(waves, stream=None):
    return cu.cuLaunchKernel(F, waves * 132, 1, 1, 128, 1, 1, 0, stream, None, None)
def stream(flags=0):
    s = vp()
    check(cu.cuStreamCreate(ctypes.byref(s), flags), "stream")
    return s
def event():
    e = vp()
    check(cu.cuEventCreate(ctypes.byref(e), 0), "event")
    return e
def record(s=None):
    e = event()
    check(cu.cuEventRecord(e, s), "record")
    return e
def blocker(s, waves=3):
    # Work ahead of what is measured: the events around it are then the device's times,
    # whatever the host's own delays between the calls.
    check(launch(waves, s), "blocker")
def elapsed(a, b):
    ms = ctypes.c_float()
    check(cu.cuEventElapsedTime(ctypes.byref(ms), a, b), "elapsed")
    return round(ms.value * 1000)  # microseconds
"""


def timeline_env(state: Path, on: str | None = "1", **params: str) -> dict[str, str]:
    """The variables of a child on a node of its own: the timeline switched by ``on`` (None:
    unset), no launch time, and the model's other parameters as given."""
    env = {"GPUSHARE_SIM_STATE_DIR": str(state), "GPUSHARE_SIM_LAUNCH_NS": "0", **params}
    if on is not None:
        env["GPUSHARE_SIM_TIMELINE"] = on
    return env


def run(script: str, env: dict[str, str]) -> dict[str, Any]:
    """script after PRELUDE and HELPERS in a child on the simulated driver; it prints out."""
    return run_sim_json(
        [
            sys.executable,
            "-c",
            PRELUDE + HELPERS + script + "\nprint(json.dumps(out))",
            str(libs.sim_driver_dir() / "libcuda.so.1"),
        ],
        str(libs.sim_driver_dir()),
        env,
    )


WAVES = """
s = stream()
blocker(s)
e1 = record(s)
t0 = time.monotonic()
check(launch(3, s), "kernel")
e2 = record(s)
out["query_before"] = cu.cuStreamQuery(s)
out["event_before"] = cu.cuEventQuery(e2)
out["elapsed_before"] = cu.cuEventElapsedTime(ctypes.byref(ctypes.c_float()), e1, e2)
check(cu.cuStreamSynchronize(s), "sync")
out["waited"] = time.monotonic() - t0
out["query_after"] = cu.cuStreamQuery(s)
out["event_after"] = cu.cuEventQuery(e2)
out["elapsed"] = elapsed(e1, e2)
# One block more than three waves' worth is a fourth wave.
blocker(s)
e3 = record(s)
check(cu.cuLaunchKernel(F, 3 * 132 + 1, 1, 1, 1, 1, 1, 0, s, None, None), "4 waves")
e4 = record(s)
check(cu.cuEventSynchronize(e4), "event sync")
out["partial_wave"] = elapsed(e3, e4)
"""


def test_a_kernel_occupies_its_waves_and_synchronisation_waits(tmp_path: Path) -> None:
    out = run(WAVES, timeline_env(tmp_path, GPUSHARE_SIM_WAVE_NS=str(100 * MS)))
    assert out["query_before"] == NOT_READY
    assert out["event_before"] == NOT_READY
    assert out["elapsed_before"] == NOT_READY
    assert out["elapsed"] == 300_000  # 3 waves of 100 ms, in microseconds
    assert out["waited"] >= 0.3
    assert out["query_after"] == 0
    assert out["event_after"] == 0
    assert out["partial_wave"] == 400_000


LAUNCH_AND_COPIES = """
s = stream()
p, q = u64(), u64()
check(cu.cuMemAlloc_v2(ctypes.byref(p), sz(8 * MIB)), "alloc p")
check(cu.cuMemAlloc_v2(ctypes.byref(q), sz(8 * MIB)), "alloc q")
host = ctypes.create_string_buffer(8 * MIB)
for x in (p, q):  # their pages made before the clock starts
    check(cu.cuMemsetD8_v2(x, 1, sz(8 * MIB)), "touch")
blocker(s, 15)
marks = [record(s)]
check(cu.cuLaunchKernel(F, 1, 1, 1, 1, 1, 1, 0, s, None, None), "one block")
marks.append(record(s))
check(cu.cuMemcpyHtoDAsync_v2(p, host, sz(8 * MIB), s), "h2d")
marks.append(record(s))
check(cu.cuMemcpyDtoDAsync_v2(q, p, sz(8 * MIB), s), "d2d")
marks.append(record(s))
check(cu.cuMemsetD32Async(q, 7, sz(2 * MIB), s), "memset")
marks.append(record(s))
check(cu.cuStreamSynchronize(s), "sync")
out["spans"] = [elapsed(a, b) for a, b in zip(marks, marks[1:])]
# A synchronous copy returns when it is done on the timeline, after the legacy stream's work.
check(launch(2), "legacy kernel")
t0 = time.monotonic()
check(cu.cuMemcpyDtoH_v2(host, p, sz(8 * MIB)), "d2h")
out["sync_copy_waited"] = time.monotonic() - t0
out["legacy_query"] = cu.cuStreamQuery(None)
"""


def test_launch_time_copies_and_memsets_take_their_bandwidth(tmp_path: Path) -> None:
    env = timeline_env(
        tmp_path,
        GPUSHARE_SIM_LAUNCH_NS=str(MS),
        GPUSHARE_SIM_WAVE_NS=str(20 * MS),
        GPUSHARE_SIM_HOST_GBPS="0.8",  # 8 MiB in 10.49 ms
        GPUSHARE_SIM_DEVICE_GBPS="1.6",
    )
    out = run(LAUNCH_AND_COPIES, env)
    mib8 = 8 << 20
    assert out["spans"] == [
        21_000,  # one wave and the launch
        round(mib8 / 0.8 / 1000),
        round(mib8 / 1.6 / 1000),
        round(mib8 / 1.6 / 1000),  # 2 Mi 4-byte elements, at the device's bandwidth
    ]
    assert out["sync_copy_waited"] >= 0.041 + mib8 / 0.8 / 1e9
    assert out["legacy_query"] == 0


SCALE = """
s = stream()
blocker(s, 12)
e1 = record(s)
check(launch(2, s), "kernel")
e2 = record(s)
check(cu.cuEventSynchronize(e2), "sync")
out["elapsed"] = elapsed(e1, e2)
"""


def test_the_time_scale_multiplies_every_duration(tmp_path: Path) -> None:
    env = timeline_env(tmp_path, GPUSHARE_SIM_WAVE_NS=str(MS), GPUSHARE_SIM_TIME_SCALE="25")
    assert run(SCALE, env)["elapsed"] == 50_000


STREAMS = """
NON_BLOCKING = 1
s1, s2, s3 = stream(), stream(), stream(NON_BLOCKING)
blocker(s1)
e0 = record(s1)
check(launch(2, s1), "a1")
check(launch(1, s1), "a2")
a = record(s1)
check(launch(1, s2), "b")  # its stream is idle, the device is not: after a2
b = record(s2)
# The legacy stream waits for the blocking streams' work; a non-blocking stream does not.
legacy = record(None)
check(cu.cuEventSynchronize(legacy), "sync legacy")
out["in_order"] = elapsed(e0, a)
out["device_fifo"] = elapsed(a, b)
out["legacy_after_blocking"] = elapsed(b, legacy)
check(launch(3, s1), "c")
c = record(s1)
lg = record(None)
nb = record(s3)
out["nonblocking_query"] = cu.cuEventQuery(nb)
out["legacy_query"] = cu.cuEventQuery(lg)
check(cu.cuEventSynchronize(lg), "sync legacy")
out["legacy_after_c"] = elapsed(c, lg)
# Blocking streams wait for the legacy stream's work; a non-blocking one does not.
check(launch(3, None), "legacy kernel")
d = record(None)
after = record(s2)
free = record(s3)
out["free_query"] = cu.cuEventQuery(free)
out["blocking_query"] = cu.cuEventQuery(after)
check(cu.cuCtxSynchronize(), "ctx sync")
out["blocking_after_legacy"] = elapsed(d, after)
out["ctx_sync_done"] = [cu.cuStreamQuery(x) for x in (None, s1, s2, s3)]
"""


def test_streams_run_in_order_on_a_device_shared_in_submission_order(tmp_path: Path) -> None:
    out = run(STREAMS, timeline_env(tmp_path, GPUSHARE_SIM_WAVE_NS=str(100 * MS)))
    assert out["in_order"] == 300_000
    assert out["device_fifo"] == 100_000
    assert out["legacy_after_blocking"] == 0
    assert out["nonblocking_query"] == 0
    assert out["legacy_query"] == NOT_READY
    assert out["legacy_after_c"] == 0
    assert out["free_query"] == 0
    assert out["blocking_query"] == NOT_READY
    assert out["blocking_after_legacy"] == 0
    assert out["ctx_sync_done"] == [0, 0, 0, 0]


WAIT_EVENT = """
NON_BLOCKING = 1
s1, s3 = stream(), stream(NON_BLOCKING)
blocker(s1)
e = record(s1)
before = record(s3)
out["before_wait"] = cu.cuEventQuery(before)
check(cu.cuStreamWaitEvent(s3, e, 0), "wait")
after = record(s3)
out["after_wait"] = cu.cuEventQuery(after)
check(cu.cuEventSynchronize(after), "sync")
out["waited_for"] = elapsed(e, after)
"""


def test_a_stream_waits_for_an_event(tmp_path: Path) -> None:
    out = run(WAIT_EVENT, timeline_env(tmp_path, GPUSHARE_SIM_WAVE_NS=str(100 * MS)))
    assert out["before_wait"] == 0
    assert out["after_wait"] == NOT_READY
    assert out["waited_for"] == 0


GRAPH = """
RELAXED = 2
s = stream()
check(cu.cuStreamBeginCapture_v2(s, RELAXED), "begin")
check(launch(2, s), "captured 2")
check(launch(1, s), "captured 1")
g, ex = vp(), vp()
check(cu.cuStreamEndCapture(s, ctypes.byref(g)), "end")
out["captured_query"] = cu.cuStreamQuery(s)  # recorded, not timed
check(cu.cuGraphInstantiateWithFlags(ctypes.byref(ex), g, u64(0)), "instantiate")
blocker(s)
e1 = record(s)
check(cu.cuGraphLaunch(ex, s), "replay")
e2 = record(s)
check(cu.cuStreamSynchronize(s), "sync")
out["replay"] = elapsed(e1, e2)
"""


def test_a_graph_replay_times_its_kernels(tmp_path: Path) -> None:
    out = run(GRAPH, timeline_env(tmp_path, GPUSHARE_SIM_WAVE_NS=str(100 * MS)))
    assert out["captured_query"] == 0
    assert out["replay"] == 300_000


HOST = """
s = stream()
calls = []
HOSTFN = ctypes.CFUNCTYPE(None, vp)
CALLBACK = ctypes.CFUNCTYPE(None, vp, ctypes.c_int, vp)
fn = HOSTFN(lambda _: calls.append(time.monotonic()))
cb = CALLBACK(lambda *_: calls.append(time.monotonic()))
t0 = time.monotonic()
check(launch(2, s), "kernel")
check(cu.cuLaunchHostFunc(s, fn, None), "host fn")
check(launch(1, s), "kernel")
check(cu.cuStreamAddCallback(s, cb, None, 0), "callback")
out["after"] = [t - t0 for t in calls]
"""


def test_host_functions_run_when_their_stream_reaches_them(tmp_path: Path) -> None:
    out = run(HOST, timeline_env(tmp_path, GPUSHARE_SIM_WAVE_NS=str(100 * MS)))
    first, second = out["after"]
    assert first >= 0.2 and second >= 0.3


OFF = """
s = stream()
t0 = time.monotonic()
for _ in range(10):
    check(launch(1000, s), "kernel")  # 10,000 waves of 1 s each, if timed
host = ctypes.create_string_buffer(1 << 20)
p = u64()
check(cu.cuMemAlloc_v2(ctypes.byref(p), sz(1 << 20)), "alloc")
check(cu.cuMemcpyHtoD_v2(p, host, sz(1 << 20)), "copy")
out["query"] = cu.cuStreamQuery(s)
e = record(s)
out["event_query"] = cu.cuEventQuery(e)
check(cu.cuStreamSynchronize(s), "sync")
check(cu.cuCtxSynchronize(), "ctx sync")
out["wall"] = time.monotonic() - t0
"""


def test_off_unless_switched_on(tmp_path: Path) -> None:
    slow = {"GPUSHARE_SIM_WAVE_NS": str(1000 * MS), "GPUSHARE_SIM_HOST_GBPS": "0.000001"}
    for on in (None, "0", "off", " False "):
        out = run(OFF, timeline_env(tmp_path, on, **slow))
        assert out["query"] == 0 and out["event_query"] == 0, on
        assert out["wall"] < 60, on  # against 10,000 s modelled


THREADS = """
import threading
s = stream()
done = threading.Event()
syncs = []
def pacer():
    while not done.is_set():
        check(cu.cuCtxSynchronize(), "pacer sync")
        syncs.append(1)
        time.sleep(0.001)
t = threading.Thread(target=pacer)
t.start()
e1 = record(s)
for _ in range(200):
    check(launch(1, s), "kernel")
e2 = record(s)
check(cu.cuStreamSynchronize(s), "sync")
done.set()
t.join(30)
out["alive"] = t.is_alive()
out["syncs"] = len(syncs) > 0
out["elapsed"] = elapsed(e1, e2)
"""


def test_threads_launch_and_synchronise_at_once(tmp_path: Path) -> None:
    out = run(THREADS, timeline_env(tmp_path, GPUSHARE_SIM_WAVE_NS=str(MS)))
    assert out["alive"] is False and out["syncs"] is True
    assert out["elapsed"] >= 200_000


# Two processes on one GPU: each keeps a few kernels queued (as a training loop's host runs
# a little ahead of its device), then reports the busy time NVML gives it and the other.
WORKER = """
import ctypes, json, os, sys
cu = ctypes.CDLL(sys.argv[1])
nv = ctypes.CDLL(sys.argv[2])
vp = ctypes.c_void_p
def check(rc, what):
    if rc != 0:
        raise SystemExit(f"{what}: {rc}")
check(cu.cuInit(0), "init")
c = vp()
check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(c), 0), "retain")
check(cu.cuCtxSetCurrent(c), "current")
check(nv.nvmlInit_v2(), "nvml")
h = vp()
check(nv.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(h)), "handle")
def busy(pid):
    ns = ctypes.c_ulonglong()
    check(nv.gpushareSimProcessBusyNs(h, pid, ctypes.byref(ns)), f"busy {pid}")
    return ns.value
print("ready", flush=True)
other = int(sys.stdin.readline())
events = []
for i in range(KERNELS):
    check(cu.cuLaunchKernel(vp(1), 132, 1, 1, 1, 1, 1, 0, None, None, None), "launch")
    e = vp()
    check(cu.cuEventCreate(ctypes.byref(e), 2), "event")
    check(cu.cuEventRecord(e, None), "record")
    events.append(e)
    if len(events) > QUEUED:
        check(cu.cuEventSynchronize(events.pop(0)), "sync")
check(cu.cuCtxSynchronize(), "drain")
print(json.dumps({"mine": busy(os.getpid()), "other": busy(other)}), flush=True)
sys.stdin.readline()
dev = ctypes.c_ulonglong()
check(nv.gpushareSimDeviceBusyNs(h, ctypes.byref(dev)), "device busy")
print(json.dumps({"mine": busy(os.getpid()), "other": busy(other), "device": dev.value}),
      flush=True)
sys.stdin.readline()
"""

KERNELS, WAVE_MS = 100, 5


def test_two_processes_share_one_device_and_their_busy_time_adds_up(tmp_path: Path) -> None:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("GPUSHARE_", "CUDA_")) and k != "LD_PRELOAD"
    }
    env.update(timeline_env(tmp_path, GPUSHARE_SIM_WAVE_NS=str(WAVE_MS * MS)))
    env["LD_LIBRARY_PATH"] = str(libs.sim_driver_dir())
    script = WORKER.replace("KERNELS", str(KERNELS)).replace("QUEUED", "4")
    args = [
        sys.executable,
        "-c",
        script,
        str(libs.sim_driver_dir() / "libcuda.so.1"),
        str(libs.sim_driver_dir() / "libnvidia-ml.so.1"),
    ]
    workers = [
        subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        for _ in range(2)
    ]
    try:
        for w in workers:
            assert w.stdout is not None and w.stdout.readline().strip() == "ready"
        a, b = workers
        for w, other in ((a, b), (b, a)):
            assert w.stdin is not None
            w.stdin.write(f"{other.pid}\n")
            w.stdin.flush()
        first = [json.loads(w.stdout.readline()) for w in workers if w.stdout]
        for w in workers:
            assert w.stdin is not None
            w.stdin.write("\n")
            w.stdin.flush()
        final = [json.loads(w.stdout.readline()) for w in workers if w.stdout]
    finally:
        for w in workers:
            if w.stdin:
                w.stdin.close()
            w.wait(timeout=30)
            if w.stdout:
                w.stdout.close()
    each = KERNELS * WAVE_MS * MS
    # When one had all its work done, the other had had about as much of the device: they
    # took turns, neither ran alone.
    for report in first:
        assert report["mine"] == each
        assert report["other"] >= each // 2
    # Every nanosecond of the device's time is one process's: the sum is exact.
    for report in final:
        assert report["mine"] == report["other"] == each
        assert report["device"] == 2 * each
