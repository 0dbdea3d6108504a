"""The simulated driver and NVML on their own, with no shim loaded.

Every allocation path takes its bytes from the device and gives them back
(when the context it was made in ends, too), bad arguments get the driver's
documented errors, and cuGetProcAddress resolves every name in shim/hooks.def
the way the real driver does. The expectations come from hooks.def itself,
not from a second table.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from gpushare import libs
from tests.sim.conftest import Proc, driver_answer, run_probe

HOOKS_DEF = Path(__file__).resolve().parents[2] / "shim" / "hooks.def"
ENTRY = re.compile(r"^GS_(?:HOOK|VARIANT)\(\s*(\w+),\s*(\w+),\s*(\d+),\s*([01])\s*[,)]", re.M)
REAL = re.compile(r"^GS_REAL\(\s*(\w+),", re.M)

# CUresult values (cuda.h); cuGetProcAddress's are conftest's.
SUCCESS = 0
INVALID_VALUE = 1
OUT_OF_MEMORY = 2
INVALID_DEVICE = 101
INVALID_CONTEXT = 201
INVALID_HANDLE = 400
NOT_SUPPORTED = 801

SIM_DRIVER_VERSION = 13000
MIB = 1 << 20
HEAP_ALIGN = 512  # the simulated heap's allocation granule


def hook_variants() -> list[Proc]:
    found = [
        Proc(base, abi, int(ver), ptsz == "1")
        for abi, base, ver, ptsz in ENTRY.findall(HOOKS_DEF.read_text())
    ]
    # A parser that silently matched nothing would make every check below vacuous.
    abis = {v.abi for v in found}
    assert {"cuMemAlloc", "cuMemAlloc_v2", "cuGraphLaunch_ptsz", "cuCtxCreate_v4"} <= abis
    return found


def _heap(nbytes: int) -> int:
    return -(-nbytes // HEAP_ALIGN) * HEAP_ALIGN


def _mip_bytes(w: int, h: int, d: int, elem: int, levels: int) -> int:
    dims = [max(w, 1), max(h, 1), max(d, 1)]
    total = 0
    for level in range(levels):
        n = elem
        for dim in dims:
            n *= max(dim >> level, 1)
        total += n
    return total


def test_every_allocation_path_takes_from_the_device_and_gives_back(sim_probe: Path) -> None:
    observed = {
        key: int(value)
        for key, value in (line.split() for line in run_probe(sim_probe, "mem").splitlines())
    }
    pitch_row = 1024  # a 1000-byte row padded to 512
    gran = 2 * MIB
    # what probe_teardown allocates in context a (device 2) besides its 3 MiB on device 3
    in_a = 4 * MIB + 1024 * 1024 + MIB + 2 * MIB + _heap(256 * 256 * 4)
    in_a += _heap(_mip_bytes(64, 64, 0, 1, 3))
    expected = {
        "init": SUCCESS,
        "ctx_v3.rc": SUCCESS,
        # cuMemAllocPitch_v2
        "pitch.rc": SUCCESS,
        "pitch.pitch": pitch_row,
        "pitch.taken": pitch_row * 100,
        "pitch.free": SUCCESS,
        "pitch.back": 0,
        "pitch.elem3": INVALID_VALUE,
        "pitch.elem32": INVALID_VALUE,
        "pitch.width0": INVALID_VALUE,
        "pitch.nullpitch": INVALID_VALUE,
        "pitch.huge": OUT_OF_MEMORY,
        # cuMemAllocManaged
        "managed.rc": SUCCESS,
        "managed.taken": 3 * MIB,
        "managed.free": SUCCESS,
        "managed.back": 0,
        "managed_host.rc": SUCCESS,
        "managed_host.free": SUCCESS,
        "managed.flags0": INVALID_VALUE,
        "managed.flags3": INVALID_VALUE,
        "managed.size0": INVALID_VALUE,
        # cuMemAllocAsync / cuMemFreeAsync and their _ptsz
        "async.stream": SUCCESS,
        "async.rc": SUCCESS,
        "async.taken": 5 * MIB,
        "async.free": SUCCESS,
        # Freed stream-ordered memory stays reserved by its pool until a synchronisation.
        "async.pooled.taken": 5 * MIB,
        "async.back": 0,
        "async_ptsz.rc": SUCCESS,
        "async_ptsz.taken": 6 * MIB,
        "async_ptsz.free": SUCCESS,
        "async_ptsz.back": 0,
        "async.size0": INVALID_VALUE,
        "async.double_free": INVALID_VALUE,
        # pools: the pool's device pays, whatever context is current
        "defpool.rc": SUCCESS,
        "defpool1.rc": SUCCESS,
        "defpool.baddev": INVALID_DEVICE,
        "defpool.distinct": 1,
        "frompool1.rc": SUCCESS,
        "frompool1.taken": 7 * MIB,
        "frompool1.dev0.taken": 0,
        "frompool1.free": SUCCESS,
        "frompool1.back": 0,
        "frompool0_ptsz.rc": SUCCESS,
        "frompool0_ptsz.taken": 2 * MIB,
        "frompool0_ptsz.free": SUCCESS,
        "frompool0_ptsz.back": 0,
        "frompool.madeup": INVALID_VALUE,
        "frompool.null": INVALID_VALUE,
        "pool.create": SUCCESS,
        "pool.alloc": SUCCESS,
        "pool.taken": 9 * MIB,
        "pool.destroy": SUCCESS,
        "pool.after_destroy.taken": 9 * MIB,
        "pool.free": SUCCESS,
        "pool.back": 0,
        "pool.destroy_again": INVALID_VALUE,
        "pool.destroy_default": INVALID_VALUE,
        "pool.host": INVALID_VALUE,
        "pool.baddev": INVALID_VALUE,
        "async.stream_destroy": SUCCESS,
        # streams: bound to the context current at creation; NULL, legacy and
        # per-thread name the current context's default stream
        "stream.create": SUCCESS,
        "stream.create_nonblocking": SUCCESS,
        "stream.destroy_nonblocking": SUCCESS,
        "stream.create_badflags": INVALID_VALUE,
        "stream.create_null": INVALID_VALUE,
        "stream.getctx": SUCCESS,
        "stream.getctx.same": 1,
        "stream.getctx_ptsz": SUCCESS,
        "stream.getctx_ptsz.same": 1,
        "stream.getctx_v2": SUCCESS,
        "stream.getctx_v2.same": 1,  # and no green context
        "stream.getctx_v2.nullgreen": INVALID_VALUE,
        "stream.getctx_nullout": INVALID_VALUE,
        "stream.getctx_default": SUCCESS,
        "stream.getctx_default.same": 1,
        "stream.getctx_legacy": SUCCESS,
        "stream.getctx_legacy.same": 1,
        "stream.getctx_per_thread": SUCCESS,
        "stream.getctx_per_thread.same": 1,
        "stream.getctx_madeup": INVALID_HANDLE,
        "stream.sync": SUCCESS,
        "stream.sync_default": SUCCESS,
        "stream.sync_ptsz": SUCCESS,
        # a stream of device 1: cuMemAllocAsync takes from device 1 with device 0
        # current; cuMemAllocFromPoolAsync from the pool's device
        "stream1.create": SUCCESS,
        "stream1.getctx": SUCCESS,
        "stream1.getctx.same": 1,
        "stream1.async": SUCCESS,
        "stream1.async.taken": 3 * MIB,
        "stream1.async.dev0.taken": 0,
        "stream1.free": SUCCESS,
        "stream1.async.back": 0,
        "stream1.async_ptsz": SUCCESS,
        "stream1.async_ptsz.taken": 2 * MIB,
        "stream1.free_ptsz": SUCCESS,
        "stream1.frompool0": SUCCESS,
        "stream1.frompool0.taken": 4 * MIB,
        "stream1.frompool0.dev1.taken": 0,
        "stream1.frompool0.free": SUCCESS,
        "stream1.destroy": SUCCESS,
        "stream.destroy": SUCCESS,
        "stream.destroy_again": INVALID_HANDLE,
        "stream.destroy_null": INVALID_HANDLE,
        "stream.destroyed.getctx": INVALID_HANDLE,
        "stream.destroyed.sync": INVALID_HANDLE,
        "stream.destroyed.async": INVALID_HANDLE,
        "stream.destroyed.frompool": INVALID_HANDLE,
        # cuDeviceGetMemPool / cuDeviceSetMemPool
        "mempool.get": SUCCESS,
        "mempool.get.default": 1,
        "mempool.set": SUCCESS,
        "mempool.set.current": 1,
        "mempool.async": SUCCESS,
        "mempool.async.taken": MIB,
        "mempool.async.free": SUCCESS,
        "mempool.set_other_device": INVALID_VALUE,
        "mempool.set_other_default": INVALID_VALUE,
        "mempool.set_null": INVALID_VALUE,
        "mempool.set_baddev": INVALID_DEVICE,
        "mempool.get_baddev": INVALID_DEVICE,
        "mempool.get_null": INVALID_VALUE,
        "mempool.after_destroy.default": 1,
        "mempool.set_destroyed": INVALID_VALUE,
        "mempool.set_default": SUCCESS,
        # cuMemGetAllocationGranularity / cuMemCreate / cuMemRelease
        "gran.rc": SUCCESS,
        "gran.min": gran,
        "gran.recommended": gran,
        "gran.badoption": INVALID_VALUE,
        "create.rc": SUCCESS,
        "create.nonzero": 1,
        "create.taken": 4 * gran,
        "create.memfree": INVALID_VALUE,
        "create.release": SUCCESS,
        "create.back": 0,
        "create.release_again": INVALID_VALUE,
        "create.release_madeup": INVALID_VALUE,
        "create.unaligned": INVALID_VALUE,
        "create.size0": INVALID_VALUE,
        "create.flags": INVALID_VALUE,
        "create.oom": OUT_OF_MEMORY,
        "create.baddev": INVALID_VALUE,
        "gran.baddev": INVALID_VALUE,
        "create.badtype": INVALID_VALUE,
        "create.host": INVALID_VALUE,
        # cuMemAddressReserve / cuMemAddressFree: address space, no memory
        "reserve.rc": SUCCESS,
        "reserve.granule_aligned": 1,
        "reserve.taken": 0,
        "reserve.page": SUCCESS,  # documented: sizes in host pages
        "reserve.page.free": SUCCESS,
        "reserve.align64m": SUCCESS,
        "reserve.align64m.aligned": 1,
        "reserve.align64m.free": SUCCESS,
        "reserve.odd_size": INVALID_VALUE,
        "reserve.align3g": INVALID_VALUE,  # not a power of two
        "reserve.odd_hint": INVALID_VALUE,
        "reserve.size0": INVALID_VALUE,
        "reserve.flags": INVALID_VALUE,
        "reserve.null": INVALID_VALUE,
        # cuMemMap / cuMemSetAccess
        "map.create": SUCCESS,
        "map.first": SUCCESS,
        "map.second": SUCCESS,
        "map.taken": 4 * gran,  # mapped twice, taken once
        "map.overlap": INVALID_VALUE,
        "map.unaligned_offset": INVALID_VALUE,
        "map.unaligned_size": INVALID_VALUE,
        "map.past_allocation": INVALID_VALUE,
        "map.past_reservation": INVALID_VALUE,
        "map.unreserved": INVALID_VALUE,
        "map.flags": INVALID_VALUE,
        "map.size0": INVALID_VALUE,
        "map.madeup_handle": INVALID_VALUE,
        "access.rc": SUCCESS,
        "access.one": SUCCESS,
        "access.part": INVALID_VALUE,
        "access.unmapped": INVALID_VALUE,
        "access.count0": INVALID_VALUE,
        "access.null": INVALID_VALUE,
        "access.badflags": INVALID_VALUE,
        "access.read": SUCCESS,
        "access.baddev": INVALID_DEVICE,
        "access.host": INVALID_VALUE,
        # released while mapped: the mappings keep the memory
        "map.release": SUCCESS,
        "map.released.taken": 4 * gran,
        "map.release_again": INVALID_VALUE,
        "map.map_released": INVALID_VALUE,
        # cuMemRetainAllocationHandle: cuMemCreate's handle, one more reference
        "retain.rc": SUCCESS,
        "retain.same": 1,
        "retain.unmapped": INVALID_VALUE,
        "retain.unreserved": INVALID_VALUE,
        "retain.null": INVALID_VALUE,
        # cuMemUnmap: whole mappings only
        "unmap.part": INVALID_VALUE,
        "unmap.past": INVALID_VALUE,
        "unmap.first": SUCCESS,
        "unmap.first.taken": 4 * gran,
        "unmap.first_again": INVALID_VALUE,
        "retain.after_unmap": INVALID_VALUE,
        "addrfree.mapped": INVALID_VALUE,
        "unmap.second": SUCCESS,
        "unmap.second.taken": 4 * gran,  # the retained reference holds it
        "retain.release": SUCCESS,
        "map.back": 0,
        "retain.release_again": INVALID_VALUE,
        # one unmap over two adjacent mappings
        "pair.map_a": SUCCESS,
        "pair.map_b": SUCCESS,
        "pair.release_a": SUCCESS,
        "pair.release_b": SUCCESS,
        "pair.taken": 3 * gran,
        "pair.access": SUCCESS,
        "pair.unmap_past": INVALID_VALUE,
        "pair.unmap": SUCCESS,
        "pair.back": 0,
        "addrfree.wrong_size": INVALID_VALUE,
        "addrfree.inside": INVALID_VALUE,
        "addrfree.rc": SUCCESS,
        "addrfree.again": INVALID_VALUE,
        "map.freed_range": INVALID_VALUE,
        "vmm.back": 0,
        # arrays: extents x channels x element size
        "array2d.rc": SUCCESS,
        "array2d.taken": _heap(1000 * 10 * 4 * 4),
        "array2d.destroy": SUCCESS,
        "array2d.back": 0,
        "array2d.destroy_again": INVALID_HANDLE,
        "array.destroy_null": INVALID_HANDLE,
        "array.destroy_madeup": INVALID_HANDLE,
        "array1d.rc": SUCCESS,
        "array1d.taken": _heap(1000 * 4 * 4),
        "array1d.destroy": SUCCESS,
        "array.width0": INVALID_VALUE,
        "array.channels3": INVALID_VALUE,
        "array.badformat": INVALID_VALUE,
        "array.nulldesc": INVALID_VALUE,
        "array3d.rc": SUCCESS,
        "array3d.taken": _heap(64 * 32 * 8 * 2 * 2),
        "array3d.mipmap_destroy": INVALID_HANDLE,
        "array3d.destroy": SUCCESS,
        "array3d.back": 0,
        "array3d.w0d": INVALID_VALUE,
        "layered1d.rc": SUCCESS,
        "layered1d.taken": _heap(64 * 8 * 2 * 2),
        "layered1d.destroy": SUCCESS,
        "mipmap.rc": SUCCESS,
        "mipmap.taken": _heap(_mip_bytes(64, 32, 0, 1, 4)),
        "mipmap.array_destroy": INVALID_HANDLE,
        "mipmap.destroy": SUCCESS,
        "mipmap.back": 0,
        "mipmap.destroy_again": INVALID_HANDLE,
        "mipmap_full.rc": SUCCESS,
        "mipmap_full.taken": _heap(_mip_bytes(64, 32, 0, 1, 7)),
        "mipmap_full.destroy": SUCCESS,
        "mipmap.levels0": INVALID_VALUE,
        "mipmap.levels8": INVALID_VALUE,  # 64 wide: 7 levels down to 1x1
        # launches
        "ex.rc": SUCCESS,
        "ex_ptsz.rc": SUCCESS,
        "ex.nullconfig": INVALID_VALUE,
        "ex_ptsz.nullconfig": INVALID_VALUE,
        "ex.nullfunc": INVALID_HANDLE,
        "ex.nullattrs": INVALID_VALUE,
        "ex.grid0": INVALID_VALUE,
        "coop.rc": SUCCESS,
        "coop_ptsz.rc": SUCCESS,
        "coop.nullfunc": INVALID_HANDLE,
        "coop_ptsz.nullfunc": INVALID_HANDLE,
        "coop.block0": INVALID_VALUE,
        "graph.rc": SUCCESS,
        "graph_ptsz.rc": SUCCESS,
        "graph.null": INVALID_VALUE,
        "graph_ptsz.null": INVALID_VALUE,
        # the 32-bit ABI: refused
        **{
            f"v1.{name}": NOT_SUPPORTED
            for name in (
                "cuDeviceTotalMem",
                "cuMemGetInfo",
                "cuMemAlloc",
                "cuMemAllocPitch",
                "cuMemFree",
                "cuArrayCreate",
                "cuArray3DCreate",
                "cuCtxCreate",
            )
        },
        "all.back": 0,
        "ctx_v3.destroy": SUCCESS,
        # no current context
        "noctx.pitch": INVALID_CONTEXT,
        "noctx.managed": INVALID_CONTEXT,
        "noctx.async": INVALID_CONTEXT,
        "noctx.array": INVALID_CONTEXT,
        "noctx.ex": INVALID_CONTEXT,
        "noctx.graph": INVALID_CONTEXT,
        "noctx.stream_create": INVALID_CONTEXT,
        "noctx.stream_getctx": INVALID_CONTEXT,
        "noctx.stream_sync": INVALID_CONTEXT,
        "noctx.free_async": INVALID_CONTEXT,
        # cuCtxDestroy_v2 frees what was allocated in the context, on any device,
        # and destroys its arrays and streams; not another context's memory, nor
        # cuMemCreate's
        "teardown.create": SUCCESS,
        "teardown.alloc": SUCCESS,
        "teardown.pitch": SUCCESS,
        "teardown.managed": SUCCESS,
        "teardown.stream": SUCCESS,
        "teardown.async": SUCCESS,
        "teardown.array": SUCCESS,
        "teardown.mipmap": SUCCESS,
        "teardown.frompool3": SUCCESS,
        "teardown.memcreate": SUCCESS,
        "teardown.create_b": SUCCESS,
        "teardown.alloc_b": SUCCESS,
        "teardown.taken": in_a + 2 * MIB + 5 * MIB,
        "teardown.dev3.taken": 3 * MIB,
        "teardown.destroy": SUCCESS,
        "teardown.current_after": 1,
        # cuCtxDestroy does not free cuMemCreate or stream-ordered (pool) memory
        "teardown.destroyed.taken": 2 * MIB + 5 * MIB + 2 * MIB,
        "teardown.dev3_kept.taken": 3 * MIB,
        "teardown.free_freed": INVALID_VALUE,
        "teardown.free_freed_pitch": INVALID_VALUE,
        "teardown.free_freed_managed": INVALID_VALUE,
        "teardown.free_pool3": SUCCESS,
        "teardown.free_async": SUCCESS,
        "teardown.dev3.back": 0,
        "teardown.array_destroy": INVALID_HANDLE,
        "teardown.mipmap_destroy": INVALID_HANDLE,
        "teardown.stream_getctx": INVALID_HANDLE,
        "teardown.stream_destroy": INVALID_HANDLE,
        "teardown.destroy_again": INVALID_CONTEXT,
        "teardown.release": SUCCESS,
        "teardown.destroy_b": SUCCESS,
        "teardown.back": 0,
        "teardown.free_freed_b": INVALID_VALUE,
        # the primary context: reset frees and keeps it retained; the last
        # release destroys it and frees
        "primary.retain": SUCCESS,
        "primary.alloc": SUCCESS,
        "primary.array": SUCCESS,
        "primary.taken": 6 * MIB + _heap(128 * 128 * 4),
        "reset.rc": SUCCESS,
        "reset.back": 0,
        "reset.free_freed": INVALID_VALUE,
        "reset.array_destroy": INVALID_HANDLE,
        "reset.still_active": 1,
        "reset.baddev": INVALID_DEVICE,
        "release.alloc": SUCCESS,
        "release.retain_again": SUCCESS,
        "release.same_handle": 1,
        "release.one": SUCCESS,
        "release.one.taken": 7 * MIB,
        "release.last": SUCCESS,
        "release.last.back": 0,
        "release.inactive": 0,
        "release.free_freed": INVALID_VALUE,
        "release.again": INVALID_CONTEXT,
    }
    assert observed == expected


def test_get_proc_address_resolves_hooks_def_like_the_driver(sim_probe: Path) -> None:
    variants = hook_variants()
    queries: list[tuple[str, int, int]] = []
    for base in sorted({v.base for v in variants}):
        firsts = {v.version for v in variants if v.base == base}
        versions = {1000, 2000, SIM_DRIVER_VERSION, SIM_DRIVER_VERSION + 10, 99999}
        versions |= {f + d for f in firsts for d in (-10, -1, 0, 10)}
        queries += [(base, ver, flags) for ver in sorted(versions) for flags in (0, 1, 2)]
    # "-" asks for the empty name.
    queries += [(name, SIM_DRIVER_VERSION, 0) for name in ("cuNoSuchThing", "-")]
    stdin = "".join(f"gpa {base} {ver} {flags}\n" for base, ver, flags in queries)
    lines = run_probe(sim_probe, "resolve", stdin).splitlines()
    assert lines[0] == "init 0"

    found = {}
    for line in lines[1:]:
        _, got_base, got_ver, got_flags, rc, got_status, name = line.split()
        found[(got_base, int(got_ver), int(got_flags))] = (int(rc), int(got_status), name)
    expected = {}
    for base, ver, flags in queries:
        # cuGetProcAddress_v2 succeeds for every name and version and says in its status
        # whether it found one; a miss sets the pointer to NULL.
        status, abi = driver_answer([v for v in variants if v.base == base], ver, flags)
        expected[(base, ver, flags)] = (SUCCESS, status, abi or "-")
    assert found == expected
    # Every variant is reached by some request, so each one was checked above.
    assert {name for _, _, name in found.values()} - {"-"} == {v.abi for v in variants}


def test_every_listed_entry_point_is_its_own_export(sim_probe: Path) -> None:
    text = HOOKS_DEF.read_text()
    names = sorted({v.abi for v in hook_variants()} | set(REAL.findall(text)))
    stdin = "".join(f"sym {name}\n" for name in names)
    lines = run_probe(sim_probe, "resolve", stdin).splitlines()[1:]
    # dladdr names the symbol itself: no variant is an alias of another.
    assert lines == [f"sym {name} {name}" for name in names]


NVML_SCRIPT = """
import json, pynvml
pynvml.nvmlInit()
out = {"driver": pynvml.nvmlSystemGetDriverVersion(), "devices": []}
for i in range(pynvml.nvmlDeviceGetCount()):
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    m1 = pynvml.nvmlDeviceGetMemoryInfo(h)
    m2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
    uuid = pynvml.nvmlDeviceGetUUID(h)
    by_uuid = pynvml.nvmlDeviceGetHandleByUUID(uuid)
    out["devices"].append({
        "name": pynvml.nvmlDeviceGetName(h),
        "uuid": uuid,
        "index": pynvml.nvmlDeviceGetIndex(by_uuid),
        "v1": [m1.total, m1.free, m1.used],
        "v2": [m2.total, m2.reserved, m2.free, m2.used],
    })
try:
    pynvml.nvmlDeviceGetHandleByUUID("GPU-00000000-0000-4000-8000-00000000ffff")
except pynvml.NVMLError as e:
    out["unknown_uuid"] = e.value
try:
    pynvml.nvmlDeviceGetMemoryInfo(h, version=0x01000028)
except pynvml.NVMLError as e:
    out["bad_version"] = e.value
pynvml.nvmlInit()
pynvml.nvmlShutdown()
out["after_one_shutdown"] = pynvml.nvmlDeviceGetCount()
pynvml.nvmlShutdown()
try:
    pynvml.nvmlDeviceGetCount()
except pynvml.NVMLError as e:
    out["after_last_shutdown"] = e.value
print(json.dumps(out))
"""


def _pynvml(gpus: str | None) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env["LD_LIBRARY_PATH"] = str(libs.sim_driver_dir())
    # NVML lists every GPU on the node, whatever CUDA_VISIBLE_DEVICES says.
    env["CUDA_VISIBLE_DEVICES"] = "1"
    env.pop("GPUSHARE_SIM_GPUS", None)
    if gpus is not None:
        env["GPUSHARE_SIM_GPUS"] = gpus
    run = subprocess.run(
        [sys.executable, "-c", NVML_SCRIPT],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=120,
    )
    result: dict[str, object] = json.loads(run.stdout)
    return result


def test_pynvml_sees_the_simulated_devices() -> None:
    a = "GPU-0a1b2c3d-0000-4000-8000-000000000001"
    b = "GPU-0A1B2C3D-0000-4000-8000-0000000000BC"
    out = _pynvml(f"Sim A100|{a}|42949672960;Sim L4|{b}|24000000000")
    assert out["devices"] == [
        {
            "name": "Sim A100",
            "uuid": a,
            "index": 0,
            "v1": [42949672960, 42949672960, 0],
            "v2": [42949672960, 0, 42949672960, 0],
        },
        {
            "name": "Sim L4",
            "uuid": "GPU-" + b[4:].lower(),  # stored lowercased, as the driver shows it
            "index": 1,
            "v1": [24000000000, 24000000000, 0],
            "v2": [24000000000, 0, 24000000000, 0],
        },
    ]
    assert out["unknown_uuid"] == 6  # NVML_ERROR_NOT_FOUND
    assert out["bad_version"] == 25  # NVML_ERROR_ARGUMENT_VERSION_MISMATCH
    assert out["after_one_shutdown"] == 2  # init is reference counted
    assert out["after_last_shutdown"] == 1  # NVML_ERROR_UNINITIALIZED
    assert out["driver"]


def test_pynvml_default_node_matches_the_simulated_driver() -> None:
    out = _pynvml(None)
    devices = out["devices"]
    assert isinstance(devices, list)
    assert [(d["name"], d["uuid"], d["v1"][0]) for d in devices] == [
        ("gpushare Simulated GPU", f"GPU-5349d000-0000-4000-8000-{i:012x}", 16 << 30)
        for i in range(4)
    ]
