"""The simulated NVML beyond the basics of test_sim_driver.py: the entry points PyTorch
asserts on at load (PCI bus ids, NVLink, fabric, CUDA driver version, compute processes),
the node-wide usage registry that lets NVML list the simulated driver's processes, and the
per-GPU device attribute overrides of GPUSHARE_SIM_GPUS.

Each test runs NVML and the driver in child processes, as the libraries are found by
LD_LIBRARY_PATH at start, and gives the registry a directory of its own
(GPUSHARE_SIM_STATE_DIR) so that no other test's processes show up.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import signal
import stat
import struct
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpushare import libs
from nodemgr.host import procfs

MIB = 1 << 20
GIB = 1 << 30
SIM_DRIVER_VERSION = 13000

# nvmlReturn_t values (nvml.h).
NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
NVML_ERROR_UNKNOWN = 999
# CUresult values (cuda.h).
CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2

H100_PCI_DEVICE_ID = 0x233010DE
H100_PCI_SUBSYSTEM_ID = 0x16C110DE

# The registry (sim_usage.c): a head (each of 64 devices' timeline: free_at, then the time
# scheduled on it), then the slots: key = pid << 8 | (device + 1), start time + 1, bytes,
# then the busy time (busy_until, 20 buckets of period and busy ns, the timeline's seq,
# done total and 128 pending spans), zero here.
HEAD = 2 * 64 * 8
SLOT = struct.Struct("<QQQ2408x")
SLOTS = 1024
# In a state directory (GPUSHARE_SIM_STATE_DIR) the table is every user's: named for the
# node alone.
REGISTRY_NAME = re.compile(r"gpushare-sim-usage-v3-[0-9a-f]{16}")


def _uuid() -> str:
    return f"GPU-{uuid.uuid4()}"


def node(*entries: str) -> str:
    """A GPUSHARE_SIM_GPUS of fresh UUIDs: NAME|BYTES[|OVERRIDES] per entry."""
    out = []
    for e in entries:
        name, rest = e.split("|", 1)
        out.append(f"{name}|{_uuid()}|{rest}")
    return ";".join(out)


def _env(gpus: str | None, state: Path | None) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("LD_PRELOAD", "CUDA_VISIBLE_DEVICES", "GPUSHARE_SIM_GPUS")
    }
    env["LD_LIBRARY_PATH"] = str(libs.sim_driver_dir())
    if gpus is not None:
        env["GPUSHARE_SIM_GPUS"] = gpus
    if state is not None:
        env["GPUSHARE_SIM_STATE_DIR"] = str(state)
    return env


def _python(script: str, env: dict[str, str], *args: str) -> Any:
    run = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


# --- The entry points PyTorch asserts on, and their older ABI variants ---------------------

SYMBOLS_SCRIPT = r"""
import ctypes, json, pynvml
from ctypes import byref, c_int, c_uint, c_void_p

lib = ctypes.CDLL("libnvidia-ml.so.1")
out = {}
def text(v):  # pynvml's structures give str, ctypes' own give bytes
    return v.decode() if isinstance(v, bytes) else v
def err(fn, *args):
    try:
        fn(*args)
    except pynvml.NVMLError as e:
        return e.value
    return 0

ver = c_int()
out["cuda_driver_before_init"] = [lib.nvmlSystemGetCudaDriverVersion(byref(ver)), ver.value]
out["bus_id_before_init"] = lib.nvmlDeviceGetHandleByPciBusId_v2(b"00000000:01:00.0",
                                                                  byref(c_void_p()))
pynvml.nvmlInit()
out["cuda_driver"] = pynvml.nvmlSystemGetCudaDriverVersion()
out["cuda_driver_v2"] = pynvml.nvmlSystemGetCudaDriverVersion_v2()
out["cuda_driver_null"] = [lib.nvmlSystemGetCudaDriverVersion(None),
                           lib.nvmlSystemGetCudaDriverVersion_v2(None)]

out["devices"] = []
for i in range(pynvml.nvmlDeviceGetCount()):
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    pci = pynvml.nvmlDeviceGetPciInfo(h)
    legacy = {}
    for name in ("nvmlDeviceGetPciInfo", "nvmlDeviceGetPciInfo_v2"):
        info = pynvml.nvmlPciInfo_v2_t()
        rc = getattr(lib, name)(h, byref(info))
        legacy[name] = [rc, text(info.busId), info.domain, info.bus, info.device,
                        info.pciDeviceId, info.pciSubSystemId]
    by_bus = []
    for bus_id in (text(pci.busId), text(pci.busId).lower(), text(pci.busIdLegacy),
                   text(pci.busIdLegacy).lower(), f"{i + 1:x}:0.0", f"0:{i + 1:x}:0",
                   f"0:{i + 1:X}:00.0"):
        h2 = pynvml.nvmlDeviceGetHandleByPciBusId(bus_id)
        by_bus.append([bus_id, pynvml.nvmlDeviceGetIndex(h2)])
    v1 = c_void_p()
    rc = lib.nvmlDeviceGetHandleByPciBusId(text(pci.busId).encode(), byref(v1))
    by_bus_v1 = [rc, pynvml.nvmlDeviceGetIndex(ctypes.cast(v1, pynvml.c_nvmlDevice_t))]

    fabric = {}
    for cls in (pynvml.c_nvmlGpuFabricInfo_v2_t, pynvml.c_nvmlGpuFabricInfo_v3_t):
        f = cls()
        ctypes.memset(ctypes.addressof(f) + 4, 0xAB, ctypes.sizeof(f) - 4)
        pynvml.nvmlDeviceGetGpuFabricInfoV(h, byref(f))
        fabric[cls.__name__] = [f.version, f.state, f.cliqueId, f.healthMask, list(f.clusterUuid)]
    bad = pynvml.c_nvmlGpuFabricInfo_v2_t()
    bad.version = 0x01000024
    fabric["bad_version"] = lib.nvmlDeviceGetGpuFabricInfoV(h, byref(bad))
    fabric["null"] = lib.nvmlDeviceGetGpuFabricInfoV(h, None)

    count = c_uint(0)
    procs_v1 = lib.nvmlDeviceGetComputeRunningProcesses(h, byref(count), None)
    out["devices"].append({
        "pci": [text(pci.busId), text(pci.busIdLegacy), pci.domain, pci.bus, pci.device,
                pci.pciDeviceId, pci.pciSubSystemId],
        "legacy": legacy,
        "by_bus": by_bus,
        "by_bus_v1": by_bus_v1,
        "cc": list(pynvml.nvmlDeviceGetCudaComputeCapability(h)),
        "nvlink": {
            "state": err(pynvml.nvmlDeviceGetNvLinkState, h, 0),
            "remote_type": err(pynvml.nvmlDeviceGetNvLinkRemoteDeviceType, h, 0),
            "remote_pci_v2": err(pynvml.nvmlDeviceGetNvLinkRemotePciInfo, h, 17),
            "remote_pci_v1": lib.nvmlDeviceGetNvLinkRemotePciInfo(
                h, 0, byref(pynvml.nvmlPciInfo_v2_t())),
            "state_link_18": err(pynvml.nvmlDeviceGetNvLinkState, h, 18),
            "remote_type_null": lib.nvmlDeviceGetNvLinkRemoteDeviceType(h, 0, None),
        },
        "fabric": fabric,
        "procs": [pynvml.nvmlDeviceGetComputeRunningProcesses(h),
                  pynvml.nvmlDeviceGetComputeRunningProcesses_v2(h), [procs_v1, count.value]],
        "procs_null_count": lib.nvmlDeviceGetComputeRunningProcesses_v3(h, None, None),
    })

for bus_id in ("00000000:63:00.0", "0001:01:00.0", "01:01.0", "01:00.1"):
    out.setdefault("unknown", {})[bus_id] = err(pynvml.nvmlDeviceGetHandleByPciBusId, bus_id)
for bus_id in ("", "zz", "0000:01", "0000:01:00.0 ", "0000:01:00.0.0", "01:00", "0000:100:00.0",
               "0000:01:20.0", "0000:01:00.8", "123456789:01:00.0"):
    out.setdefault("invalid", {})[bus_id] = err(pynvml.nvmlDeviceGetHandleByPciBusId, bus_id)
out["bus_id_null"] = lib.nvmlDeviceGetHandleByPciBusId_v2(None, byref(c_void_p()))
pynvml.nvmlShutdown()
out["pci_after_shutdown"] = lib.nvmlDeviceGetHandleByPciBusId_v2(b"00000000:01:00.0",
                                                                  byref(c_void_p()))
print(json.dumps(out))
"""


def test_nvml_entry_points_pytorch_asserts_on(tmp_path: Path) -> None:
    # Eleven GPUs, so that a bus id has a hex letter (0x0a) to be matched in either case.
    entries = [f"Sim {i}|{(i + 1) * GIB}" for i in range(11)]
    entries[2] += "|cc=8.6,sms=84"
    out = _python(SYMBOLS_SCRIPT, _env(node(*entries), tmp_path))

    # The CUDA version is the simulated driver's cuDriverGetVersion; asked without
    # nvmlInit too (the reference lists no error for that).
    assert out["cuda_driver_before_init"] == [NVML_SUCCESS, SIM_DRIVER_VERSION]
    assert out["cuda_driver"] == out["cuda_driver_v2"] == SIM_DRIVER_VERSION
    assert out["cuda_driver_null"] == [NVML_ERROR_INVALID_ARGUMENT] * 2
    assert out["bus_id_before_init"] == NVML_ERROR_UNINITIALIZED
    assert out["pci_after_shutdown"] == NVML_ERROR_UNINITIALIZED

    devices = out["devices"]
    assert len(devices) == 11
    for i, d in enumerate(devices):
        bus = i + 1  # cuDeviceGetPCIBusId's "0000:%02x:00.0": the position + 1
        assert d["pci"] == [
            f"00000000:{bus:02X}:00.0",
            f"0000:{bus:02X}:00.0",
            0,
            bus,
            0,
            H100_PCI_DEVICE_ID,
            H100_PCI_SUBSYSTEM_ID,
        ]
        # v1 and _v2 fill the legacy layout: a 16-byte bus id, then reserved words.
        legacy = [NVML_SUCCESS, f"0000:{bus:02X}:00.0", 0, bus, 0]
        legacy += [H100_PCI_DEVICE_ID, H100_PCI_SUBSYSTEM_ID]
        assert d["legacy"] == {
            "nvmlDeviceGetPciInfo": legacy,
            "nvmlDeviceGetPciInfo_v2": legacy,
        }
        # Every documented form, of either case, finds the device; v1 too.
        assert d["by_bus_v1"] == [NVML_SUCCESS, i]
        assert d["by_bus"] == [
            [f"00000000:{bus:02X}:00.0", i],
            [f"00000000:{bus:02x}:00.0", i],
            [f"0000:{bus:02X}:00.0", i],
            [f"0000:{bus:02x}:00.0", i],
            [f"{bus:x}:0.0", i],
            [f"0:{bus:x}:0", i],
            [f"0:{bus:X}:00.0", i],
        ]
        # No NVLink: a link index in range is unsupported, one past the end invalid.
        assert d["nvlink"] == {
            "state": NVML_ERROR_NOT_SUPPORTED,
            "remote_type": NVML_ERROR_NOT_SUPPORTED,
            "remote_pci_v2": NVML_ERROR_NOT_SUPPORTED,
            "remote_pci_v1": NVML_ERROR_NOT_SUPPORTED,
            "state_link_18": NVML_ERROR_INVALID_ARGUMENT,
            "remote_type_null": NVML_ERROR_INVALID_ARGUMENT,
        }
        # No fabric: the call succeeds (PyTorch checks it does) and says so in state,
        # every field after the version zeroed.
        assert d["fabric"] == {
            "c_nvmlGpuFabricInfo_v2_t": [0x02000024, 0, 0, 0, [0] * 16],
            "c_nvmlGpuFabricInfo_v3_t": [0x03000028, 0, 0, 0, [0] * 16],
            "bad_version": NVML_ERROR_ARGUMENT_VERSION_MISMATCH,
            "null": NVML_ERROR_INVALID_ARGUMENT,
        }
        # Nobody uses the node: empty lists from every version.
        assert d["procs"] == [[], [], [NVML_SUCCESS, 0]]
        assert d["procs_null_count"] == NVML_ERROR_INVALID_ARGUMENT

    assert [d["cc"] for d in devices] == [[9, 0], [9, 0], [8, 6], *[[9, 0]] * 8]
    assert out["unknown"] == dict.fromkeys(out["unknown"], NVML_ERROR_NOT_FOUND)
    assert out["invalid"] == dict.fromkeys(out["invalid"], NVML_ERROR_INVALID_ARGUMENT)
    assert out["bus_id_null"] == NVML_ERROR_INVALID_ARGUMENT


# --- Process lists and memory used, from the simulated driver's processes ------------------

DRIVER_USER = r"""
import ctypes, os, sys
cuda = ctypes.CDLL(sys.argv[1])
dev, nbytes = int(sys.argv[2]), int(sys.argv[3])
if len(sys.argv) > 4:  # as another user (gid, uid): started as root, who may read Python
    os.setgid(int(sys.argv[4])); os.setgroups([]); os.setuid(int(sys.argv[5]))
def check(rc, what):
    if rc:
        print(f"{what} failed: {rc}", flush=True)
        sys.exit(1)
check(cuda.cuInit(0), "cuInit")
ctx = ctypes.c_void_p()
check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
check(cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
if nbytes:
    p = ctypes.c_uint64()
    check(cuda.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(nbytes)), "cuMemAlloc_v2")
print("ready", flush=True)
sys.stdin.read()
"""

NVML_READER = r"""
import ctypes, json, pynvml
from ctypes import byref, c_uint, c_ulonglong

class ProcV1(ctypes.Structure):
    _fields_ = [("pid", c_uint), ("usedGpuMemory", c_ulonglong)]

lib = ctypes.CDLL("libnvidia-ml.so.1")
pynvml.nvmlInit()
out = []
for i in range(pynvml.nvmlDeviceGetCount()):
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    count = c_uint(0)
    rc = lib.nvmlDeviceGetComputeRunningProcesses(h, byref(count), None)
    needed = count.value
    short = c_uint(max(needed - 1, 0))
    rc_short = lib.nvmlDeviceGetComputeRunningProcesses(h, byref(short), (ProcV1 * 8)())
    arr = (ProcV1 * (needed + 1))()
    count = c_uint(needed + 1)
    rc_full = lib.nvmlDeviceGetComputeRunningProcesses(h, byref(count), arr)
    v1 = sorted([p.pid, p.usedGpuMemory] for p in arr[:count.value])
    m1 = pynvml.nvmlDeviceGetMemoryInfo(h)
    m2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
    out.append({
        "probe": [rc, needed],
        "short": [rc_short, short.value],
        "v1": [rc_full, v1],
        "v2": sorted([p.pid, p.usedGpuMemory, p.gpuInstanceId, p.computeInstanceId]
                     for p in pynvml.nvmlDeviceGetComputeRunningProcesses_v2(h)),
        "v3": sorted([p.pid, p.usedGpuMemory, p.gpuInstanceId, p.computeInstanceId]
                     for p in pynvml.nvmlDeviceGetComputeRunningProcesses_v3(h)),
        "mem": [m1.total, m1.used, m1.free],
        "mem_v2": [m2.total, m2.used, m2.free],
    })
print(json.dumps(out))
"""

NO_INSTANCE = 0xFFFFFFFF  # gpuInstanceId / computeInstanceId outside MIG


class Node:
    """A simulated node of its own: its spec, its registry directory, its processes."""

    def __init__(self, gpus: str, state: Path) -> None:
        self.gpus = gpus
        self.state = state
        self.env = _env(gpus, state)
        self.children: list[subprocess.Popen[str]] = []

    def use(
        self, dev: int, nbytes: int, user: pwd.struct_passwd | None = None
    ) -> subprocess.Popen[str]:
        """A process holding a context on dev (its position) and nbytes of its memory; run
        as ``user`` when given."""
        lib = str(libs.sim_driver_dir() / "libcuda.so.1")
        who = [] if user is None else [str(user.pw_gid), str(user.pw_uid)]
        child = subprocess.Popen(
            [sys.executable, "-c", DRIVER_USER, lib, str(dev), str(nbytes), *who],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=self.env,
        )
        self.children.append(child)
        assert child.stdout is not None
        assert child.stdout.readline() == "ready\n"
        return child

    def read(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = _python(NVML_READER, self.env)
        return result

    def listed(self) -> list[list[list[int]]]:
        """Per device, [pid, usedGpuMemory] of each process, as the v1 ABI lists them."""
        return [d["v1"][1] for d in self.read()]

    def stop(self) -> None:
        for child in self.children:
            if child.poll() is None:
                child.kill()
            child.wait(timeout=30)
            for pipe in (child.stdin, child.stdout):
                if pipe is not None:
                    pipe.close()


@pytest.fixture
def sim_node(tmp_path: Path) -> Iterator[Node]:
    n = Node(node("Sim A|17179869184", "Sim B|8589934592"), tmp_path)
    try:
        yield n
    finally:
        n.stop()


def _consistent(d: dict[str, Any], total: int) -> None:
    """Every version lists the same processes, and memory used is their sum."""
    rc, listed = d["v1"]
    assert rc == NVML_SUCCESS
    assert d["probe"] == [
        NVML_ERROR_INSUFFICIENT_SIZE if listed else NVML_SUCCESS,
        len(listed),
    ]
    if listed:
        assert d["short"] == [NVML_ERROR_INSUFFICIENT_SIZE, len(listed)]
    expanded = [[pid, used, NO_INSTANCE, NO_INSTANCE] for pid, used in listed]
    assert d["v2"] == d["v3"] == expanded
    used = sum(u for _, u in listed)
    assert d["mem"] == [total, used, total - used]
    assert d["mem_v2"] == [total, used, total - used]


def test_nvml_lists_the_processes_that_use_each_gpu(sim_node: Node) -> None:
    totals = [16 * GIB, 8 * GIB]
    before = sim_node.read()
    for d, total in zip(before, totals, strict=True):
        _consistent(d, total)
    assert [d["v1"][1] for d in before] == [[], []]

    a = sim_node.use(1, 256 * MIB)
    after = sim_node.read()
    for d, total in zip(after, totals, strict=True):
        _consistent(d, total)
    gpu0, gpu1 = (d["v1"][1] for d in after)
    assert gpu0 == []
    assert [pid for pid, _ in gpu1] == [a.pid]
    assert gpu1[0][1] >= 256 * MIB

    # A second process on the same GPU, and one holding a context but no memory.
    b = sim_node.use(1, 3 * GIB)
    c = sim_node.use(0, 0)
    listed = sim_node.listed()
    assert [[pid for pid, _ in gpu] for gpu in listed] == [[c.pid], sorted([a.pid, b.pid])]
    used = {pid: size for pid, size in listed[1]}
    assert used[a.pid] >= 256 * MIB
    assert used[b.pid] >= 3 * GIB
    assert listed[0][0][1] < 256 * MIB  # a context alone takes little or nothing
    for d, total in zip(sim_node.read(), totals, strict=True):
        _consistent(d, total)

    # Gone, whichever way it goes: an ordinary exit, or SIGKILL with no chance to clean up.
    assert a.stdin is not None
    a.stdin.close()
    assert a.wait(timeout=30) == 0
    b.kill()
    assert b.wait(timeout=30) == -signal.SIGKILL
    assert sim_node.listed() == [[[c.pid, listed[0][0][1]]], []]
    c.kill()
    c.wait(timeout=30)
    final = sim_node.read()
    assert [d["v1"][1] for d in final] == [[], []]
    for d, total in zip(final, totals, strict=True):
        _consistent(d, total)

    # One table, in the directory given, named for this node.
    files = [p.name for p in sim_node.state.iterdir()]
    assert len(files) == 1
    assert REGISTRY_NAME.fullmatch(files[0])


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_a_state_dir_table_shows_every_users_processes(open_dir: Callable[[int], Path]) -> None:
    """NVML lists every user's processes: the table its start makes in a state directory is
    open to all (nodemgr, as root, sees what its users' processes hold)."""
    shared = open_dir(0o711)
    nobody = pwd.getpwnam("nobody")
    n = Node(node("Sim A|17179869184", "Sim B|8589934592"), shared)
    try:
        assert n.listed() == [[], []]
        table = _registry(shared)
        st = table.stat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o666)
        theirs = n.use(1, 64 * MIB, user=nobody)
        mine = n.use(0, 0)
        assert [[pid for pid, _ in gpu] for gpu in n.listed()] == [[mine.pid], [theirs.pid]]
        assert list(shared.iterdir()) == [table]
    finally:
        n.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_a_table_another_user_planted_is_not_trusted(open_dir: Callable[[int], Path]) -> None:
    """In a directory open to all, a table that another user made (and could take away
    from everyone, or fill) is used by nobody but that user."""
    shared = open_dir(0o711)
    os.chmod(shared, 0o1777)
    nobody = pwd.getpwnam("nobody")
    n = Node(node("Sim A|17179869184"), shared)
    try:
        theirs = n.use(0, 64 * MIB, user=nobody)
        assert _registry(shared).stat().st_uid == nobody.pw_uid
        mine = n.use(0, 0)
        assert n.listed() == [[]]
        assert theirs.poll() is None and mine.poll() is None
    finally:
        n.stop()


def test_nodes_with_other_gpus_do_not_see_each_other(tmp_path: Path) -> None:
    first = Node(node("Sim A|17179869184", "Sim B|8589934592"), tmp_path)
    second = Node(node("Sim A|17179869184", "Sim B|8589934592"), tmp_path)
    try:
        child = first.use(1, 64 * MIB)
        assert [[pid for pid, _ in gpu] for gpu in first.listed()] == [[], [child.pid]]
        assert second.listed() == [[], []]
        other = second.use(1, 0)
        assert [[pid for pid, _ in gpu] for gpu in second.listed()] == [[], [other.pid]]
        assert [[pid for pid, _ in gpu] for gpu in first.listed()] == [[], [child.pid]]
        assert len(list(tmp_path.iterdir())) == 2
    finally:
        first.stop()
        second.stop()


# Retains device argv[2]'s primary context and reports (the CUDA status, and cuMemGetInfo's
# free bytes once it has one); on "release" releases it; ends when its stdin closes.
CONTEXT_USER = r"""
import ctypes, sys
cuda = ctypes.CDLL(sys.argv[1])
dev = int(sys.argv[2])
ctx = ctypes.c_void_p()
assert cuda.cuInit(0) == 0
rc = cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
free, total = ctypes.c_size_t(), ctypes.c_size_t()
if rc == 0:
    assert cuda.cuCtxSetCurrent(ctx) == 0
    assert cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) == 0
print("retain", rc, free.value, flush=True)
for line in sys.stdin:
    print("release", cuda.cuDevicePrimaryCtxRelease_v2(dev), flush=True)
"""


def test_a_context_takes_the_devices_context_size(tmp_path: Path) -> None:
    """The spec's ``context`` key: a process's first context on a device takes that many
    bytes of it (rounded to the heap's 512-byte granule), which cuMemGetInfo and NVML count,
    until its last context there is released; a device too small for it fails the
    context with CUDA_ERROR_OUT_OF_MEMORY, as a real GPU does."""
    taken = 300 * MIB + 512
    sim = Node(
        node(f"Sim A|{16 * GIB}|context={300 * MIB + 100}", f"Sim B|{GIB}|context={2 * GIB}"),
        tmp_path,
    )
    lib = str(libs.sim_driver_dir() / "libcuda.so.1")
    users = []
    try:
        for dev in (0, 1):
            users.append(
                subprocess.Popen(
                    [sys.executable, "-c", CONTEXT_USER, lib, str(dev)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    env=sim.env,
                )
            )
        a, b = users
        assert a.stdout is not None and a.stdin is not None and b.stdout is not None
        assert a.stdout.readline().split() == ["retain", "0", str(16 * GIB - taken)]
        assert b.stdout.readline().split() == ["retain", str(CUDA_ERROR_OUT_OF_MEMORY), "0"]
        assert sim.listed() == [[[a.pid, taken]], []]
        for d, total in zip(sim.read(), [16 * GIB, GIB], strict=True):
            _consistent(d, total)
        a.stdin.write("release\n")
        a.stdin.flush()
        assert a.stdout.readline().split() == ["release", "0"]
        assert sim.listed() == [[], []]
        for d, total in zip(sim.read(), [16 * GIB, GIB], strict=True):
            _consistent(d, total)
    finally:
        for user in users:
            user.kill()
            user.communicate(timeout=30)


def _registry(state: Path) -> Path:
    (path,) = state.iterdir()
    assert REGISTRY_NAME.fullmatch(path.name)
    return path


def _start_time(pid: int) -> int:
    """What the registry records for pid: its start time (clock ticks) + 1."""
    got = procfs.stat_ints(pid, 19)
    assert got is not None, pid
    return got[0] + 1


def test_a_reused_pid_is_not_taken_for_the_old_process(sim_node: Node) -> None:
    child = sim_node.use(0, MIB)
    child.kill()
    child.wait(timeout=30)
    path = _registry(sim_node.state)
    # A slot that names a live process (this one) with another start time: the pid
    # was reused, and the process that used the GPU is gone.
    me = os.getpid()
    slot = SLOT.pack(me << 8 | 2, _start_time(me) + 12345, 5 * MIB)
    with path.open("r+b") as f:
        f.seek(HEAD)
        f.write(slot)
    assert sim_node.listed() == [[], []]
    with path.open("rb") as f:
        f.seek(HEAD)
        key, _, _ = SLOT.unpack(f.read(SLOT.size))
    assert key == 0  # reclaimed by the reader
    # With its own start time it counts: that is what tells the two apart.
    with path.open("r+b") as f:
        f.seek(HEAD)
        f.write(SLOT.pack(me << 8 | 2, _start_time(me), 5 * MIB))
    assert sim_node.listed() == [[], [[me, 5 * MIB]]]


def test_a_full_registry_costs_nvml_the_process_never_the_driver(sim_node: Node) -> None:
    first = sim_node.use(0, 0)
    path = _registry(sim_node.state)
    # Every slot taken by live processes: the first child and this one.
    me, start = os.getpid(), _start_time(os.getpid())
    with path.open("r+b") as f:
        f.seek(HEAD + SLOT.size)
        f.write(SLOT.pack(me << 8 | 1, start, MIB) * (SLOTS - 1))
    late = sim_node.use(1, 512 * MIB)  # its allocation succeeds all the same
    listed = sim_node.listed()
    assert listed[1] == []
    assert [first.pid, 0] in listed[0]
    assert late.pid not in [pid for pid, _ in listed[0] + listed[1]]
    # Once a holder is gone, the next process to use a GPU takes its slot.
    first.kill()
    first.wait(timeout=30)
    again = sim_node.use(1, 0)
    assert [pid for pid, _ in sim_node.listed()[1]] == [again.pid]


# --- Utilisation ---------------------------------------------------------------------------

UTIL_READER = r"""
import ctypes, json, pynvml
from ctypes import byref, c_uint

lib = ctypes.CDLL("libnvidia-ml.so.1")
pynvml.nvmlInit()

def device(i):
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    rates = pynvml.nvmlDeviceGetUtilizationRates(h)
    count = c_uint(0)
    probe = lib.nvmlDeviceGetProcessUtilization(h, None, byref(count), ctypes.c_ulonglong(0))
    try:
        procs = {p.pid: [p.smUtil, p.memUtil, p.encUtil, p.decUtil]
                 for p in pynvml.nvmlDeviceGetProcessUtilization(h, 0)}
        err = 0
    except pynvml.NVMLError as e:
        procs, err = {}, e.value
    after = pynvml.nvmlDeviceGetUtilizationRates(h)
    same = [rates.gpu, rates.memory] == [after.gpu, after.memory]
    return {"gpu": rates.gpu, "memory": rates.memory, "probe": [probe, count.value],
            "procs": procs, "err": err, "same": same}

out = []
for i in range(pynvml.nvmlDeviceGetCount()):
    d = device(i)
    while not d["same"]:  # read across a sample period's end: read again
        d = device(i)
    out.append(d)
print(json.dumps(out))
"""


def test_utilisation_is_the_share_of_the_last_second_kernels_ran(
    sim_node: Node, cbin: dict[str, Path], wait_for: Any, tmp_path: Path
) -> None:
    """Each launch keeps its device busy GPUSHARE_SIM_KERNEL_US (here 50 ms): 10 launches
    are half a second of work, at most 50% of any second. A process's figure is its share,
    the device's the sum of its processes'; a process that launched nothing is at 0, and
    all fall back to 0 a second after the work ends."""
    env = {**sim_node.env, "GPUSHARE_SIM_KERNEL_US": "50000"}
    go = tmp_path / "go"
    client = str(cbin["client"])
    busy, idle = (
        subprocess.Popen(
            [client, "alloc", "1", *steps, "waitfile", str(go)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for steps in (["launch", "10"], [])
    )
    try:
        for p in (busy, idle):
            assert p.stdout is not None
            while p.stdout.readline() not in ("waiting\n", ""):
                pass

        def read() -> list[dict[str, Any]]:
            result: list[dict[str, Any]] = _python(UTIL_READER, sim_node.env)
            return result

        seen: list[list[dict[str, Any]]] = []

        def share() -> int:
            return int(seen[-1][0]["procs"].get(str(busy.pid), [0])[0])

        def running() -> bool:
            seen.append(read())
            return share() > 0

        wait_for(running, 10)
        # Then idle again, a second after the work ended.
        wait_for(lambda: not running(), 10)
        for gpu0, gpu1 in seen:
            procs = gpu0["procs"]
            assert set(procs) == {str(busy.pid), str(idle.pid)}
            assert gpu0["probe"] == [NVML_ERROR_INSUFFICIENT_SIZE, 2]
            assert procs[str(idle.pid)] == [0, 0, 0, 0]
            assert 0 <= procs[str(busy.pid)][0] <= 50
            assert procs[str(busy.pid)][1:] == [0, 0, 0]
            assert (gpu0["gpu"], gpu0["memory"]) == (procs[str(busy.pid)][0], 0)
            # No process on the other GPU: no samples, and an idle device.
            assert (gpu1["gpu"], gpu1["memory"], gpu1["err"]) == (0, 0, NVML_ERROR_NOT_FOUND)
            assert gpu1["probe"] == [NVML_ERROR_NOT_FOUND, 0]
        assert seen[-1][0]["gpu"] == 0
    finally:
        go.touch()
        for p in (busy, idle):
            p.communicate(timeout=30)


# --- Device attributes and their overrides -------------------------------------------------

ATTRS_SCRIPT = r"""
import ctypes, json, sys
cuda = ctypes.CDLL(sys.argv[1])
ids = json.loads(sys.argv[2])
rc = cuda.cuInit(0)
out = {"init": rc, "devices": []}
if rc == 0:
    n = ctypes.c_int()
    cuda.cuDeviceGetCount(ctypes.byref(n))
    for dev in range(n.value):
        values = {}
        for attr in ids:
            v = ctypes.c_int(-12345)
            r = cuda.cuDeviceGetAttribute(ctypes.byref(v), attr, dev)
            values[attr] = v.value if r == 0 else ["error", r]
        bus = ctypes.create_string_buffer(32)
        cuda.cuDeviceGetPCIBusId(bus, 32, dev)
        out["devices"].append({"attrs": values, "bus": bus.value.decode()})
print(json.dumps(out))
"""

NVML_INIT_SCRIPT = r"""
import json, pynvml
try:
    pynvml.nvmlInit()
    out = [list(pynvml.nvmlDeviceGetCudaComputeCapability(pynvml.nvmlDeviceGetHandleByIndex(i)))
           for i in range(pynvml.nvmlDeviceGetCount())]
except pynvml.NVMLError as e:
    out = e.value
print(json.dumps(out))
"""

# What an H100 SXM5 answers, for the attributes libraries size their work by.
H100 = {
    1: 1024,  # max threads per block
    2: 1024,
    3: 1024,
    4: 64,  # max block dims
    5: 2147483647,
    6: 65535,
    7: 65535,  # max grid dims
    8: 49152,  # shared memory per block
    10: 32,  # warp size
    12: 65536,  # registers per block
    13: 1980000,  # clock rate, kHz
    16: 132,  # multiprocessors
    18: 0,  # integrated
    20: 0,  # compute mode: default
    35: 0,  # TCC driver
    36: 2619000,  # memory clock rate, kHz
    37: 5120,  # memory bus width
    38: 50331648,  # L2 cache
    39: 2048,  # max threads per multiprocessor
    41: 1,  # unified addressing
    50: 0,  # PCI domain
    34: 0,  # PCI device
    75: 9,
    76: 0,  # compute capability 9.0
    78: 1,  # stream priorities
    81: 233472,  # shared memory per multiprocessor
    82: 65536,  # registers per multiprocessor
    83: 1,  # managed memory
    86: 0,  # host native atomics
    88: 0,  # pageable memory access
    89: 1,  # concurrent managed access
    95: 1,  # cooperative launch
    97: 232448,  # shared memory per block, opt-in
    102: 1,  # virtual memory management
    103: 1,  # POSIX fd handles
    106: 32,  # max blocks per multiprocessor
    111: 1024,  # reserved shared memory per block
    114: 0,  # timeline semaphore interop
    115: 1,  # memory pools
    116: 0,  # GPUDirect RDMA
    119: 1,  # mempool handle types: POSIX fd
    120: 1,  # cluster launch
    124: 0,  # dma_buf
    125: 1,  # IPC events
    130: 0,  # NUMA config
}


def _attrs(gpus: str, ids: list[int]) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:
    lib = str(libs.sim_driver_dir() / "libcuda.so.1")
    run = subprocess.run(
        [sys.executable, "-c", ATTRS_SCRIPT, lib, json.dumps(ids)],
        capture_output=True,
        text=True,
        env=_env(gpus, None),
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    result: dict[str, Any] = json.loads(run.stdout)
    return result, run


def test_default_attributes_are_an_h100s() -> None:
    out, _ = _attrs(node("Sim A|17179869184", "Sim B|17179869184"), [*H100, 33, 40])
    assert out["init"] == CUDA_SUCCESS
    for i, d in enumerate(out["devices"]):
        attrs = {int(k): v for k, v in d["attrs"].items()}
        assert attrs[33] == i + 1  # PCI bus: cuDeviceGetPCIBusId's, and NVML's
        assert d["bus"] == f"0000:{i + 1:02x}:00.0"
        assert attrs[40] >= 3  # async engines
        assert {k: attrs[k] for k in H100} == H100


def test_every_cuda_13_attribute_has_an_answer() -> None:
    ids = [-1, 0, *range(1, 148), 148, 149, 1000]
    out, _ = _attrs(node("Sim A|17179869184"), ids)
    attrs = {int(k): v for k, v in out["devices"][0]["attrs"].items()}
    assert [k for k, v in attrs.items() if isinstance(v, list)] == [-1, 0, 148, 149, 1000]
    assert {attrs[k][1] for k in (-1, 0, 148, 149, 1000)} == {CUDA_ERROR_INVALID_VALUE}


def test_overrides_reach_the_driver_and_nvml() -> None:
    overrides = (
        "cc=8.0,sms=108,38=41943040,max_shared_memory_per_block_optin=166912,"
        "MEMORY_CLOCK_RATE=1593000,gpu_pci_device_id=0x20B010DE,numa_id=-1,host_numa_id=+0"
    )
    gpus = node(f"Sim A100|42949672960|{overrides}", "Sim H100|85899345920", "Sim X|1|")
    out, _ = _attrs(gpus, [75, 76, 16, 38, 97, 36, 139, 131, 134, 33, 39])
    assert out["init"] == CUDA_SUCCESS
    a100, h100, empty = ({int(k): v for k, v in d["attrs"].items()} for d in out["devices"])
    assert a100 == {
        75: 8,
        76: 0,
        16: 108,
        38: 41943040,
        97: 166912,
        36: 1593000,
        139: 0x20B010DE,
        131: -1,
        134: 0,
        33: 1,
        39: 2048,  # not overridden: the default
    }
    assert (h100[75], h100[76], h100[16], h100[33]) == (9, 0, 132, 2)
    assert (empty[75], empty[16], empty[33]) == (9, 132, 3)  # an empty 4th field: no overrides
    nvml = _python(NVML_INIT_SCRIPT, _env(gpus, None))
    assert nvml == [[8, 0], [9, 0], [9, 0]]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ("sms", 'bad override "sms": expected KEY=VALUE'),
        ("=5", 'bad override "=5": expected KEY=VALUE'),
        ("sms=", 'bad value "" for multiprocessor_count (16): expected an integer'),
        ("sms=lots", 'bad value "lots" for multiprocessor_count (16): expected an integer'),
        ("sms=2147483648", 'bad value "2147483648" for multiprocessor_count (16)'),
        ("sms=0x1ffffffff", 'bad value "0x1ffffffff" for multiprocessor_count (16)'),
        ("cc=8", 'bad value "8" for cc: expected MAJOR.MINOR'),
        ("cc=8.", 'bad value "8." for cc: expected MAJOR.MINOR'),
        ("cc=-8.0", 'bad value "-8.0" for cc: expected MAJOR.MINOR'),
        ("cc=8.0.1", 'bad value "8.0.1" for cc: expected MAJOR.MINOR'),
        ("warp=32", 'unknown attribute "warp"'),
        ("0=1", 'unknown attribute "0"'),
        ("148=1", 'unknown attribute "148"'),
        ("33=4", "attribute pci_bus_id (33) follows the device's position in the list"),
        ("pci_domain_id=1", "attribute pci_domain_id (50) follows the device's position"),
        ("sms=1,16=2", "attribute multiprocessor_count (16) is set twice"),
        ("cc=8.0,75=9", "attribute compute_capability_major (75) is set twice"),
        ("sms=1,,cc=8.0", "empty override"),
        ("sms=1,", "empty override"),
        ("sms=1|cc=8.0", "expected NAME|UUID|BYTES or NAME|UUID|BYTES|KEY=VALUE,..."),
        ("context=12x", 'bad value "12x" for context: expected a byte count'),
        ("context=1,context=2", "the context size is set twice"),
    ],
)
def test_bad_overrides_are_refused_at_init(overrides: str, message: str) -> None:
    entry = f"Sim A|{_uuid()}|17179869184|{overrides}"
    gpus = f"Sim Good|{_uuid()}|17179869184;{entry}"
    out, run = _attrs(gpus, [75])
    assert out == {"init": CUDA_ERROR_INVALID_VALUE, "devices": []}
    assert f'gpushare sim: GPUSHARE_SIM_GPUS: bad entry "{entry}": {message}' in run.stderr
    assert _python(NVML_INIT_SCRIPT, _env(gpus, None)) == NVML_ERROR_UNKNOWN


# --- What a step time estimate takes of a GPU (nodemgr's GPU description) -----------------

DESCRIBE_SCRIPT = r"""
import ctypes, json, pynvml
pynvml.nvmlInit()
lib = ctypes.CDLL("libnvidia-ml.so.1")
out = []
for i in range(pynvml.nvmlDeviceGetCount()):
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    out.append({
        "cc": list(pynvml.nvmlDeviceGetCudaComputeCapability(h)),
        "cores": pynvml.nvmlDeviceGetNumGpuCores(h),
        "clocks": [pynvml.nvmlDeviceGetMaxClockInfo(h, t) for t in range(4)],
        "bus": pynvml.nvmlDeviceGetMemoryBusWidth(h),
        "pcie": [pynvml.nvmlDeviceGetMaxPcieLinkGeneration(h),
                 pynvml.nvmlDeviceGetMaxPcieLinkWidth(h)],
        "bad_clock": lib.nvmlDeviceGetMaxClockInfo(h, 4, ctypes.byref(ctypes.c_uint())),
        "nulls": [lib.nvmlDeviceGetNumGpuCores(h, None),
                  lib.nvmlDeviceGetMaxClockInfo(h, 1, None),
                  lib.nvmlDeviceGetMemoryBusWidth(h, None),
                  lib.nvmlDeviceGetMaxPcieLinkGeneration(h, None),
                  lib.nvmlDeviceGetMaxPcieLinkWidth(h, None)],
    })
print(json.dumps(out))
"""


NOT_SUPPORTED_SCRIPT = r"""
import ctypes, json, pynvml
pynvml.nvmlInit()
lib = ctypes.CDLL("libnvidia-ml.so.1")
h = pynvml.nvmlDeviceGetHandleByIndex(0)
v = ctypes.c_uint()
print(json.dumps([lib.nvmlDeviceGetMaxClockInfo(h, 1, ctypes.byref(v)),
                  lib.nvmlDeviceGetMaxClockInfo(h, 0, ctypes.byref(v)),
                  lib.nvmlDeviceGetMemoryBusWidth(h, ctypes.byref(v))]))
"""


def test_nvml_describes_each_device_from_its_attributes() -> None:
    """Cores, clocks and bus come from the same attributes the driver answers, overrides
    included; the cores are the SMs times the FP32 lanes nodemgr's estimate divides by
    (nodemgr.policy.steptime.ARCH), for every capability of that table."""
    from nodemgr.policy import steptime

    ccs = sorted(steptime.ARCH)
    entries = [f"H|{80 << 30}"] + [
        f"X|{1 << 30}|cc={major}.{minor},sms={10 + i},clock_rate=1410000,memory_clock_rate=1215000,"
        "global_memory_bus_width=4096"
        for i, (major, minor) in enumerate(ccs)
    ]
    got = _python(DESCRIBE_SCRIPT, _env(node(*entries), None))
    h100 = got[0]
    assert h100["cc"] == [9, 0] and h100["cores"] == 132 * 128
    assert h100["clocks"] == [1980, 1980, 2619, 1980]  # graphics, SM, memory, video
    assert h100["bus"] == 5120 and h100["pcie"] == [5, 16]
    assert h100["bad_clock"] == 2 and h100["nulls"] == [2] * 5  # NVML_ERROR_INVALID_ARGUMENT
    for i, (cc, d) in enumerate(zip(ccs, got[1:], strict=True)):
        lanes = steptime.ARCH[cc][0]
        assert d["cc"] == list(cc) and d["cores"] == (10 + i) * lanes, cc
        assert d["clocks"][1:3] == [1410, 1215] and d["bus"] == 4096
        spec = steptime.GpuSpec(cc=cc, cores=d["cores"], sm_mhz=1410)
        assert steptime.rates_of(spec).sms == 10 + i
    # Capabilities between the table's rows and beyond it: the same lanes on both sides.
    between = [(3, 7), (5, 2), (6, 2), (7, 2), (8, 7), (11, 0), (13, 0)]
    entries = [f"X|{1 << 30}|cc={major}.{minor},sms=10" for major, minor in between]
    for cc, d in zip(between, _python(DESCRIBE_SCRIPT, _env(node(*entries), None)), strict=True):
        assert d["cores"] == 10 * steptime.arch(cc)[0], cc
    # An override that is no count or clock: NVML does not say, rather than wrap around.
    bad = _env(node(f"X|{1 << 30}|clock_rate=0,global_memory_bus_width=0"), None)
    assert _python(NOT_SUPPORTED_SCRIPT, bad) == [3, 3, 3]  # NVML_ERROR_NOT_SUPPORTED
