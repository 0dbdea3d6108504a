"""The full shim in real child processes: every allocation path, exact lookups, the edges."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from nodemgr._ledger import ffi, lib

from gpushare import libs
from nodemgr.host.ledger import Ledger
from tests.conftest import CSRC, ROOT, SANITIZER, cc, hook_table, let_finish, shim_preload

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


def lines(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if ln]


def run(run_task: Any, ep: str, *cmd: str, gpus: int = 1, timeout: float = 60) -> list[str]:
    p = run_task(ep, *cmd, gpus=gpus)
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, err
    return lines(out)


# The C client run in a task of environment alice (1 GPU, 1 GiB quota): its output lines.
Client = Callable[..., list[str]]


@pytest.fixture
def alice(daemon: Any, run_task: Any, cbin: dict[str, Path]) -> Client:
    ep = daemon.env("alice", gpus=1, memory=GiB)
    return lambda *steps: run(run_task, ep, str(cbin["client"]), *steps)


def info(used: int = 0) -> str:
    """The client's ``info`` line with ``used`` bytes of alice's 1 GiB taken."""
    return f"info free={GiB - used} total={GiB}"


# --- cuGetProcAddress: the wrapper for exactly the requests that resolve to a hooked ABI ----


def _gpa_requests() -> list[tuple[str, int, int]]:
    table = [e for e in hook_table() if e.kind in ("GS_HOOK", "GS_VARIANT")]
    requests = []
    for base in sorted({e.base for e in table if e.base}):
        versions = {13000, 13010, 99999}
        for e in table:
            if e.base == base:
                versions |= {e.version - 1, e.version, e.version + 10}
        requests += [(base, v, f) for v in sorted(versions) for f in (0, 1, 2)]
    # Names the shim does not wrap, and one no driver has, keep the driver's answer too.
    requests += [(n, 12000, 0) for n in ("cuCtxGetDevice", "cuDeviceGet", "cuNotAThing")]
    return requests


def test_get_proc_address_wraps_exactly_the_variants_it_hooks(cbin: dict[str, Path]) -> None:
    args = [str(a) for req in _gpa_requests() for a in ("gpa", *req)]
    env = {**os.environ, "LD_LIBRARY_PATH": str(libs.sim_driver_dir())}
    plain = subprocess.run(
        [cbin["client"], *args], capture_output=True, text=True, env=env, check=True, timeout=120
    ).stdout
    hooked = subprocess.run(
        [cbin["client"], *args],
        capture_output=True,
        text=True,
        env={**env, "LD_PRELOAD": shim_preload()},
        check=True,
        timeout=120,
    ).stdout
    wrapped = {e.abi for e in hook_table() if e.kind == "GS_HOOK"}
    plain_rows, hooked_rows = lines(plain), lines(hooked)
    assert len(plain_rows) == len(hooked_rows) == len(_gpa_requests())
    seen_wrapped: set[str] = set()
    for want, got in zip(plain_rows, hooked_rows, strict=True):
        *request, where = want.split()
        *got_request, got_where = got.split()
        # Return code and symbolStatus are always the driver's own.
        assert got_request == request, (want, got)
        lib, _, symbol = where.partition(":")
        if lib == "libcuda.so.1" and symbol in wrapped:
            # The wrapper of that very ABI variant, never of another.
            assert got_where == f"libgpushare.so:{symbol}", (want, got)
            seen_wrapped.add(symbol)
        else:
            assert got_where == where, (want, got)
    # Every hook is reachable by its base name, the per-thread ones included.
    assert seen_wrapped == wrapped


def test_old_abi_variants_are_the_drivers_own(cbin: dict[str, Path]) -> None:
    """cuMemAlloc asked for at 2000 is the 32-bit v1 entry: no wrapper of _v2 may stand in."""
    env = {
        **os.environ,
        "LD_LIBRARY_PATH": str(libs.sim_driver_dir()),
        "LD_PRELOAD": shim_preload(),
    }
    out = subprocess.run(
        [cbin["client"], "gpa", "cuMemAlloc", "2000", "0", "gpa", "cuMemAlloc", "3020", "0"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=120,
    ).stdout
    assert lines(out) == [
        "gpa cuMemAlloc 2000 0 rc=0 status=0 libcuda.so.1:cuMemAlloc",
        "gpa cuMemAlloc 3020 0 rc=0 status=0 libgpushare.so:cuMemAlloc_v2",
    ]


# --- memory: every path is charged what the driver takes, and given back ------------------


def _mip_bytes(w: int, h: int, levels: int) -> int:
    total = 0
    for _ in range(levels):
        total += w * h * 4
        w, h = max(w // 2, 1), max(h // 2, 1)
    return total


def _footprint(n: int) -> int:
    align = 2 * MiB if n >= 2 * MiB else 512
    return -(-n // align) * align


PATHS = [
    ("alloc", ["64"], 64 * MiB),
    ("allocb", ["1000"], 1024),  # small: 512-byte granules
    ("allocb", [str(3 * MiB + 1)], 4 * MiB),  # large: 2 MiB pages
    ("pitch", ["1000", "100"], 1024 * 100),  # pitch x height, the driver's pitch
    ("managed", ["64"], 64 * MiB),
    ("async", ["64"], 64 * MiB),
    ("asyncpt", ["64"], 64 * MiB),
    ("pool", ["64"], 64 * MiB),
    ("create", ["64"], 64 * MiB),
    ("array", ["1024", "1024"], 4 * MiB),
    ("array3d", ["256", "256", "16"], 4 * MiB),
    ("mipmap", ["1024", "1024", "3"], _footprint(_mip_bytes(1024, 1024, 3))),
]


@pytest.mark.parametrize(("step", "args", "charged"), PATHS, ids=[f"{p[0]}-{p[1]}" for p in PATHS])
def test_every_allocation_path_is_charged_and_given_back(
    daemon: Any, run_task: Any, cbin: dict[str, Path], step: str, args: list[str], charged: int
) -> None:
    ep = daemon.env("alice", gpus=1, memory=GiB)
    name = "alloc" if step == "allocb" else step
    # ssync: a stream-ordered pool gives what it keeps back at a synchronisation (below).
    out = run(
        run_task, ep, str(cbin["client"]), "info", step, *args, "info", "free", "ssync", "info"
    )
    assert out[0] == info()
    assert out[1].startswith(f"{name} ok")
    assert out[2] == info(charged)
    assert out[3:] == ["free ok", "ssync ok", info()]


POOL_PATHS = [("async", ["64"]), ("asyncpt", ["64"]), ("pool", ["64"])]


@pytest.mark.parametrize(("step", "args"), POOL_PATHS, ids=[p[0] for p in POOL_PATHS])
def test_a_pool_stays_charged_for_what_it_keeps(
    daemon: Any, run_task: Any, cbin: dict[str, Path], step: str, args: list[str]
) -> None:
    """Freed stream-ordered memory stays the environment's while its pool keeps it (PyTorch's
    cudaMallocAsync keeps all: an unbounded release threshold); a trim gives it back, down to
    what the trim keeps."""
    ep = daemon.env("alice", gpus=1, memory=GiB)
    steps = ["keep", "max", step, *args, "free", "ssync", "info", "reserved", "trim", "32"]
    out = run(run_task, ep, str(cbin["client"]), *steps, "info", "trim", "0", "info", "reserved")
    held = info(64 * MiB)
    assert out == [
        "keep ok",
        f"{step} ok",
        "free ok",
        "ssync ok",
        held,
        f"reserved {64 * MiB}",
        "trim ok",
        held,  # 32 MiB kept: the 64 MiB chunk stays whole
        "trim ok",
        info(),
        "reserved 0",
    ]


SYNCS = ["sync", "sync2", "ssync", "esync"]


@pytest.mark.parametrize("sync", SYNCS)
def test_a_synchronisation_gives_back_what_a_pool_releases(
    daemon: Any, run_task: Any, cbin: dict[str, Path], sync: str
) -> None:
    """With the driver's default release threshold (0) a pool keeps what is freed into it
    until a synchronisation, whichever kind."""
    ep = daemon.env("alice", gpus=1, memory=GiB)
    out = run(run_task, ep, str(cbin["client"]), "async", "64", "free", "info", sync, "info")
    assert out == [
        "async ok",
        "free ok",
        info(64 * MiB),
        f"{sync} ok",
        info(),
    ]


def test_a_pool_takes_from_what_it_keeps_and_never_holds_beyond_the_quota(
    daemon: Any, run_task: Any, cbin: dict[str, Path]
) -> None:
    """An allocation is served first from what the pool keeps, charged once. One the kept
    chunk cannot serve makes the pool reserve anew: the quota has no room for both, so the
    pool is trimmed of its idle chunk rather than hold more than the quota."""
    ep = daemon.env("alice", gpus=1, memory=GiB)
    client = str(cbin["client"])
    kept = ["keep", "max", "async", "600", "free"]
    out = run(run_task, ep, client, *kept, "async", "600", "info", "async", "500")
    assert out[3:] == [
        "async ok",
        info(600 * MiB),  # the kept 600 MiB, charged once
        "async err 2",  # 600 + 500 MiB in use is beyond the quota
    ]
    out = run(run_task, ep, client, *kept, "async", "900", "info", "reserved")
    assert out[3:] == [
        "async ok",
        info(900 * MiB),
        f"reserved {900 * MiB}",  # not 1500: the idle 600 MiB chunk went back
    ]
    # What the pool keeps adds up to the request but no kept chunk holds it: the pool
    # reserves a new one beside them, and holds, and is charged, both.
    frag = ["keep", "max", "async", "32", "async", "64", "free", "free", "async", "96"]
    out = run(run_task, ep, client, *frag, "info", "reserved")
    assert out[-3:] == [
        "async ok",
        info(192 * MiB),
        f"reserved {192 * MiB}",
    ]


@pytest.mark.parametrize("setter", ["setpool", "setlocpool"])
def test_async_allocations_follow_the_devices_current_pool(
    daemon: Any, run_task: Any, cbin: dict[str, Path], setter: str
) -> None:
    """cuMemAllocAsync takes from the pool cuDeviceSetMemPool or CUDA 13's cuMemSetMemPool
    made current: that pool's threshold and reservation are what count."""
    ep = daemon.env("alice", gpus=1, memory=GiB)
    steps = ["newpool", setter, "keep", "max", "async", "64", "free", "ssync", "info"]
    out = run(run_task, ep, str(cbin["client"]), *steps, "trim", "0", "info")
    assert out == [
        "newpool ok",
        f"{setter} ok",
        "keep ok",
        "async ok",
        "free ok",
        "ssync ok",
        info(64 * MiB),  # the new pool keeps it
        "trim ok",
        info(),
    ]


def test_a_destroyed_pool_gives_back_what_it_kept_and_later_what_is_freed(alice: Client) -> None:
    """The driver gives a destroyed pool's idle memory back at once, and what is still in
    use when it is freed."""
    steps = ["poolon", "0", "64", "free", "info", "pooldestroy", "info"]
    out = alice(*steps, "poolon", "0", "32", "pooldestroy")
    out += alice("poolon", "0", "32", "pooldestroy", "info")
    assert out == [
        "poolon ok",
        "free ok",
        info(64 * MiB),  # kept by the pool
        "pooldestroy ok",
        info(),
        "poolon ok",  # a new pool, perhaps at the destroyed one's address
        "pooldestroy ok",
        "poolon ok",
        "pooldestroy ok",
        info(32 * MiB),  # still in use
    ]


BEYOND = [
    ("alloc", ["1025"]),
    ("pitch", [str(64 * KiB), "16400"]),
    ("managed", ["1025"]),
    ("async", ["1025"]),
    ("asyncpt", ["1025"]),
    ("pool", ["1025"]),
    ("create", ["1026"]),
    ("array", ["16384", "16400"]),
    ("array3d", ["1024", "1024", "257"]),
    ("mipmap", ["16384", "16384", "2"]),
]


@pytest.mark.parametrize(("step", "args"), BEYOND, ids=[b[0] for b in BEYOND])
def test_every_allocation_path_is_refused_beyond_the_quota(
    daemon: Any, run_task: Any, cbin: dict[str, Path], step: str, args: list[str]
) -> None:
    ep = daemon.env("alice", gpus=1, memory=GiB)
    out = run(run_task, ep, str(cbin["client"]), step, *args, "info")
    assert out == [f"{step} err 2", info()]
    assert daemon.tasks() == []


def test_bad_arguments_get_the_drivers_answer_and_charge_nothing(
    daemon: Any, run_task: Any, cbin: dict[str, Path]
) -> None:
    ep = daemon.env("alice", gpus=1, memory=GiB)
    client = str(cbin["client"])
    shimmed = run(run_task, ep, client, "edge", "info")
    # The same task's environment without the shim: the simulated driver alone.
    plain = run(run_task, ep, "sh", "-c", f'unset LD_PRELOAD; exec "{client}" edge info')
    edges = [ln for ln in shimmed if ln.startswith("edge ")]
    assert len(edges) >= 20
    assert edges == [ln for ln in plain if ln.startswith("edge ")]
    # Double frees and unknown pointers were the driver's business; nothing stayed charged.
    assert shimmed[-1] == info()


def test_64_threads_never_exceed_the_limit_and_end_at_zero(alice: Client) -> None:
    out = alice("threads", "64", "300", "96", "info")
    fields = dict(f.split("=") for f in out[0].split()[1:])
    assert int(fields["failed"]) == 0, "every free of a live allocation succeeds"
    assert int(fields["ok"]) > 1000
    held = int(fields["maxheld"])
    assert held <= GiB
    assert held > GiB // 2, "the threads did press against the limit"
    assert out[1] == info()


def test_a_changed_limit_applies_to_a_running_process(
    daemon: Any, run_task: Any, cbin: dict[str, Path], tmp_path: Path
) -> None:
    ep = daemon.env("alice", gpus=1, memory=GiB)
    a, b = tmp_path / "a", tmp_path / "b"
    p = run_task(
        ep,
        str(cbin["client"]),
        *("alloc", "512", "waitfile", str(a), "alloc", "256", "info"),
        *("waitfile", str(b), "alloc", "1024", "info"),
    )
    assert p.stdout.readline() == "alloc ok\n"
    assert p.stdout.readline() == "waiting\n"
    daemon.admin("quota_set", env="alice", gpus=1, memory=600 * MiB)
    a.touch()
    assert p.stdout.readline() == "alloc err 2\n"
    assert p.stdout.readline() == f"info free={88 * MiB} total={600 * MiB}\n"
    assert p.stdout.readline() == "waiting\n"
    daemon.admin("quota_set", env="alice", gpus=1, memory=2 * GiB)
    b.touch()
    assert p.stdout.readline() == "alloc ok\n"
    assert p.stdout.readline() == f"info free={512 * MiB} total={2 * GiB}\n"
    assert p.wait(30) == 0


@pytest.mark.parametrize("form", ["uuids", "indices"])
def test_reordered_visible_devices_charge_the_right_gpu(
    daemon: Any, run_task: Any, cbin: dict[str, Path], tmp_path: Path, form: str
) -> None:
    """Inside a task the user reorders CUDA_VISIBLE_DEVICES over all the node's GPUs: each
    charge lands on the GPU really used, and GPUs outside the grant stay closed."""
    ep = daemon.env("alice", gpus=2, memory=GiB)
    node = daemon.admin("status")["gpus"]
    order = list(reversed(range(len(node))))
    visible = ",".join(node[i]["uuid"] if form == "uuids" else str(i) for i in order)
    go = tmp_path / "go"
    steps = []
    for k in range(len(order)):
        steps += ["dev", str(k), "alloc", str(100 * (k + 1))]
    script = (
        f'CUDA_VISIBLE_DEVICES={visible} exec "{cbin["client"]}" {" ".join(steps)} waitfile {go}'
    )
    p = run_task(ep, "sh", "-c", script, gpus=2)
    got = [p.stdout.readline().strip() for _ in range(2 * len(order) + 1)]
    [task] = daemon.tasks()
    granted = set(task["gpus"])
    for k, index in enumerate(order):
        assert got[2 * k] == "dev ok"
        want = "alloc ok" if index in granted else "alloc err 2"
        assert got[2 * k + 1] == want, (k, index, granted)
    status = daemon.admin("status")["gpus"]
    for k, index in enumerate(order):
        expect = 100 * (k + 1) * MiB if index in granted else 0
        assert status[index]["used"] == expect, (index, status[index])
    let_finish(p, go, daemon)


# --- launches -------------------------------------------------------------------------


def test_every_launch_path_is_counted(
    daemon: Any, run_task: Any, cbin: dict[str, Path], tmp_path: Path
) -> None:
    ep = daemon.env("alice", gpus=1, memory=GiB)
    go = tmp_path / "go"
    kinds = {"launch": 2, "launchpt": 3, "launchex": 4, "coop": 5, "graph": 6}
    steps = [str(a) for k, n in kinds.items() for a in (k, n)]
    p = run_task(ep, str(cbin["client"]), *steps, "waitfile", str(go))
    assert [p.stdout.readline() for _ in kinds] == [f"{k} ok\n" for k in kinds]
    assert p.stdout.readline() == "waiting\n"
    [task] = daemon.tasks()
    assert task["launches"] == sum(kinds.values())
    go.touch()
    assert p.wait(30) == 0


def test_linked_client_reaches_every_path_through_the_exports(
    daemon: Any, run_task: Any, cbin: dict[str, Path]
) -> None:
    """A -lcuda program's cuGetProcAddress is the shim's export: what it fetches is charged."""
    ep = daemon.env("alice", gpus=1, memory=GiB)
    out = run(run_task, ep, str(cbin["client_linked"]), "create", "64", "async", "32", "info")
    assert out == ["create ok", "async ok", info(96 * MiB)]


# --- NVML inside a task --------------------------------------------------------------


NVML_SCRIPT = """
import sys, time, pynvml
pynvml.nvmlInit()
want = int(sys.argv[1])
for _ in range(500):
    rows = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        m1 = pynvml.nvmlDeviceGetMemoryInfo(h)
        m2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
        rows.append((pynvml.nvmlDeviceGetUUID(h), m1.total, m1.used, m1.free,
                     m2.total, m2.used, m2.free))
    if any(r[2] == want for r in rows):
        break
    time.sleep(0.01)
for r in rows:
    print(*r)
"""


def test_nvml_in_a_task_reports_the_environments_share(
    daemon: Any, run_task: Any, cbin: dict[str, Path], tmp_path: Path
) -> None:
    ep = daemon.env("alice", gpus=1, memory=GiB)
    go = tmp_path / "go"
    script = (
        f'"{cbin["client"]}" alloc 100 waitfile {go} & '
        f'"{sys.executable}" -c "$NVML" {100 * MiB}; touch {go}; wait'
    )
    p = run_task(ep, "sh", "-c", script, env={"NVML": NVML_SCRIPT})
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    [task] = [t for t in daemon.admin("history")["records"]]
    granted = daemon.admin("status")["gpus"][task["gpus"][0]]["uuid"]
    # The client's own lines share the task's stdout.
    rows = [ln.split() for ln in lines(out) if ln.startswith("GPU-")]
    assert len(rows) == len(daemon.admin("status")["gpus"])
    for uuid, *nums in rows:
        total, used, free, total2, used2, free2 = map(int, nums)
        if uuid == granted:
            assert (total, used, free) == (GiB, 100 * MiB, GiB - 100 * MiB)
            assert (total2, used2, free2) == (GiB, 100 * MiB, GiB - 100 * MiB)
        else:
            # A GPU the environment does not hold has no share to show.
            assert (total, used, free) == (0, 0, 0), uuid


# --- what the known peer gets wrong, each made impossible here --------------------------


def test_a_burst_of_processes_all_get_through_cuinit(
    daemon: Any, run_task: Any, cbin: dict[str, Path]
) -> None:
    """128 processes of one task start at once: every one claims its own slot and runs (no
    global lock, no hang); the slots go back when they end."""
    ep = daemon.env("alice", gpus=1, memory=GiB)
    script = f'for i in $(seq 128); do "{cbin["client"]}" launch 1 & done; wait'
    p = run_task(ep, "sh", "-c", script)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert lines(out) == ["launch ok"] * 128


def test_an_uncharge_beyond_the_charge_never_wraps(tmp_path: Path) -> None:
    """An unguarded subtraction would turn a slot's usage into ~2**64."""
    ledger = Ledger.create(tmp_path / "ledger", [bytes(16)])
    try:
        ledger.set_limit(0, GiB)
        raw = ffi.cast("struct gs_ledger *", ffi.from_buffer(ledger._mem))
        fd = os.open(tmp_path / "ledger", os.O_RDWR)
        slot = lib.gs_ledger_claim(raw, fd, os.getpid(), b"t")
        assert slot >= 0
        assert lib.gs_ledger_charge(raw, slot, 0, 10 * MiB) == 0
        lib.gs_ledger_uncharge(raw, slot, 0, 20 * MiB)
        assert ledger.used(0) == 0
        assert lib.gs_ledger_charge(raw, slot, 0, GiB) == 0, "the whole pool is usable again"
        os.close(fd)
    finally:
        ledger.close()


def test_the_shim_says_nothing_while_it_works(
    daemon: Any, run_task: Any, cbin: dict[str, Path]
) -> None:
    """No per-call logging: thousands of calls, refusals included, and not one line."""
    ep = daemon.env("alice", gpus=1, memory=GiB)
    p = run_task(
        ep, str(cbin["client"]), "fill", "2", "alloc", "2", "launch", "1000", "edge", "info"
    )
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert "fill 512" in out
    assert err == ""


def test_each_process_pays_for_its_context_once(
    daemon_factory: Any, run_task: Any, cbin: dict[str, Path], tmp_path: Path
) -> None:
    d = daemon_factory(sections={"gpus": {"context_memory": "96MiB"}})
    ep = d.env("alice", gpus=1, memory=GiB)
    client = str(cbin["client"])
    go, first = tmp_path / "go", tmp_path / "first"
    # A first process holds its context; a second retains its own twice (one charge) and
    # allocates: two contexts and one allocation are charged.
    script = (
        f'"{client}" waitfile {go} > {first} & '
        f"until grep -q waiting {first}; do sleep 0.01; done; "
        f'"{client}" dev 0 alloc 64 info; touch {go}; wait'
    )
    out = run(run_task, ep, "sh", "-c", script)
    assert out == ["dev ok", "alloc ok", info(2 * 96 * MiB + 64 * MiB)]


def test_a_context_that_does_not_fit_is_refused(
    daemon_factory: Any, run_task: Any, cbin: dict[str, Path]
) -> None:
    d = daemon_factory(sections={"gpus": {"context_memory": "96MiB"}})
    # A quota no context fits in: nodemgr refuses it unless forced.
    ep = d.env("small", gpus=1, memory=64 * MiB, force=True)
    p = run_task(ep, str(cbin["client"]), "info")
    out, _ = p.communicate(timeout=60)
    assert lines(out) == ["init err 2"]  # CUDA_ERROR_OUT_OF_MEMORY from the retain
    assert p.returncode == 4


# --- memory whose lifetime is not one call pair ---------------------------------------


def test_cumemcreate_memory_stays_charged_while_mapped(
    daemon: Any, run_task: Any, cbin: dict[str, Path]
) -> None:
    """Releasing right after mapping is legal: the memory lives until the unmap."""
    ep = daemon.env("alice", gpus=1, memory=GiB)
    out = run(
        run_task, ep, str(cbin["client"]), "vmm", "64", "vmmrelease", "info", "vmmunmap", "info"
    )
    assert out == [
        "vmm ok",
        "vmmrelease ok",
        info(64 * MiB),
        "vmmunmap ok",
        info(),
    ]


def test_a_retained_handle_keeps_its_memory_charged(alice: Client) -> None:
    """NCCL retains and releases handles of memory PyTorch still holds."""
    steps = ["vmm", "64", "vmmretain", "vmmunmap", "vmmrelease", "info", "vmmrelease", "info"]
    out = alice(*steps)
    assert out == [
        "vmm ok",
        "vmmretain ok same",
        "vmmunmap ok",
        "vmmrelease ok",
        info(64 * MiB),  # the retain's reference is still held
        "vmmrelease ok",
        info(),
    ]


def test_a_double_release_changes_nothing(alice: Client) -> None:
    """The driver refuses the second release; the memory still goes with the unmap."""
    steps = ["vmm", "64", "vmmrelease", "vmmrelease", "info", "vmmunmap", "info"]
    out = alice(*steps)
    assert out[:2] == ["vmm ok", "vmmrelease ok"]
    assert out[2].startswith("vmmrelease err ")
    assert out[3:] == [
        info(64 * MiB),
        "vmmunmap ok",
        info(),
    ]


def test_a_refused_unmap_leaves_every_mapping_charged(alice: Client) -> None:
    """One handle mapped twice; an unmap of more than is mapped is refused and undone whole."""
    steps = ["vmmtwice", "64", "vmmrelease", "unmapat", "0", "192", "info"]
    steps += ["unmapat", "0", "64", "info", "unmapat", "64", "64", "info"]
    out = alice(*steps)
    held = info(64 * MiB)
    assert out[:2] == ["vmmtwice ok", "vmmrelease ok"]
    assert out[2].startswith("unmapat err ")
    assert out[3:] == [held, "unmapat ok", held, "unmapat ok", info()]


def test_create_map_release_cannot_run_past_the_quota(alice: Client) -> None:
    out = alice("vmm", "600", "vmmrelease", "vmm", "600")
    assert out == ["vmm ok", "vmmrelease ok", "vmm err 2"]


@pytest.mark.parametrize(
    "teardown",
    [["ctx", "0", "alloc", "300", "ctxdestroy"], ["alloc", "300", "primreset"]],
    ids=["destroy", "primary-reset"],
)
def test_memory_a_context_takes_with_it_is_uncharged(
    daemon: Any, run_task: Any, cbin: dict[str, Path], teardown: list[str]
) -> None:
    """cudaDeviceReset or a destroyed context frees everything allocated in it: four rounds of
    300 MiB in a 1 GiB pool only fit if each round's charge went with its context."""
    ep = daemon.env("alice", gpus=1, memory=GiB)
    out = run(run_task, ep, str(cbin["client"]), *(teardown * 4), "info")
    steps = [s for s in teardown if not s.isdigit()]
    assert out == [f"{s} ok" for s in steps] * 4 + [info()]


def test_stream_ordered_memory_outlives_its_context(alice: Client) -> None:
    """cuCtxDestroy does not free pool memory: it stays charged until it is freed (and the
    pool, whose release threshold is the driver's default, trimmed)."""
    steps = ["ctx", "0", "async", "300", "ctxdestroy", "info", "free", "trim", "0", "info"]
    out = alice(*steps)
    assert out == [
        "ctx ok",
        "async ok",
        "ctxdestroy ok",
        info(300 * MiB),
        "free ok",
        "trim ok",
        info(),
    ]


def test_a_contexts_heap_and_stacks_are_charged_as_they_are_set(alice: Client) -> None:
    """cuCtxSetLimit's device malloc heap (8 MiB by default) and per-thread stack (1 KiB by
    default, reserved for every thread the device holds at once: the simulated H100's 132
    SMs x 2048) are device memory: charged beyond their defaults, refused beyond the quota,
    given back by a smaller value and by the context's end."""
    stack = 1024 * 132 * 2048  # 1 KiB more per thread: 264 MiB
    steps = ["heap", "264", "info", "stack", "2048", "info", "heap", "8", "info", "heap", "2000"]
    out = alice(*steps, "info", "stack", "1024", "info")
    assert out == [
        "heap ok",
        info(256 * MiB),
        "stack ok",
        info(256 * MiB + stack),
        "heap ok",
        info(stack),
        "heap err 2",  # the driver's CUDA_ERROR_OUT_OF_MEMORY
        info(stack),
        "stack ok",
        info(),
    ]
    out = alice("ctx", "0", "heap", "520", "info", "ctxdestroy")
    out += alice("ctx", "0", "heap", "520", "ctxdestroy", "info")
    assert out == [
        "ctx ok",
        "heap ok",
        info(512 * MiB),
        "ctxdestroy ok",
        "ctx ok",
        "heap ok",
        "ctxdestroy ok",
        info(),
    ]


def test_releasing_the_last_primary_retain_uncharges_its_memory(alice: Client) -> None:
    out = alice("alloc", "300", "primrelease", "dev", "0", "info")
    assert out == ["alloc ok", "primrelease ok", "dev ok", info()]


@pytest.mark.parametrize(
    "step",
    [["stream", "1", "asyncs", "100"], ["poolon", "1", "100"], ["locpoolon", "1", "100"]],
)
def test_stream_ordered_memory_is_charged_where_it_lives(
    daemon: Any, run_task: Any, cbin: dict[str, Path], tmp_path: Path, step: list[str]
) -> None:
    """The current device is 0; the stream (or the pool, made or got through CUDA 13's
    location calls) is on device 1."""
    ep = daemon.env("alice", gpus=2, memory=GiB)
    go = tmp_path / "go"
    p = run_task(ep, str(cbin["client"]), *step, "waitfile", str(go), gpus=2)
    got = [p.stdout.readline().strip() for _ in range(len([s for s in step if s.isalpha()]))]
    assert got[-1].endswith("ok"), got
    assert p.stdout.readline() == "waiting\n"
    [task] = daemon.tasks()
    status = daemon.admin("status")["gpus"]
    used = {g: status[g]["used"] for g in task["gpus"]}
    # Inside the task device k is the k-th granted GPU.
    assert used == {task["gpus"][0]: 0, task["gpus"][1]: 100 * MiB}
    go.touch()
    assert p.wait(30) == 0


def test_graph_memory_is_charged_when_the_graph_pool_maps_it(alice: Client) -> None:
    """A captured cuMemAllocAsync is a graph's allocation node: nothing is charged at
    capture. The device's graph memory pool maps it at the upload, keeps it for every later
    launch (charged once), and keeps it after the executable graph goes, until a trim."""
    steps = ["gcapture", "256", "info", "greserved", "gupload", "info", "glaunch", "3", "info"]
    steps += ["greserved", "gdestroy", "info", "gtrim", "info", "greserved"]
    out = alice(*steps)
    held = info(256 * MiB)
    assert out == [
        "gcapture ok",
        info(),  # a node, not pool memory
        "greserved 0",
        "gupload ok",
        held,
        "glaunch ok",
        held,  # three launches reuse what the upload mapped
        f"greserved {256 * MiB}",
        "gdestroy ok",
        held,  # the pool keeps it
        "gtrim ok",
        info(),
        "greserved 0",
    ]


def test_graph_memory_beyond_the_quota_is_trimmed_or_left_uncharged_until_it_fits(
    daemon: Any, run_task: Any, cbin: dict[str, Path]
) -> None:
    """A launch has taken its graph memory by the time the shim learns of it. Where the
    quota has no room, the shim trims the graph pool: memory the graph freed goes back.
    Memory a launch left allocated cannot: it stays uncharged until a later launch finds
    room for it, and is charged from then on."""
    ep = daemon.env("alice", gpus=1, memory=GiB)
    client = str(cbin["client"])
    rest = ["info", "greserved", "free", "glaunch", "1", "info"]
    out = run(run_task, ep, client, "alloc", "700", "gcapture", "512", "glaunch", "1", *rest)
    assert out == [
        "alloc ok",
        "gcapture ok",
        "glaunch ok",
        info(700 * MiB),
        "greserved 0",  # freed in the graph: trimmed
        "free ok",
        "glaunch ok",
        info(512 * MiB),
    ]
    kept = ["alloc", "700", "gkeep", "512", "glaunch", "1", *rest, "async", "600"]
    out = run(run_task, ep, client, *kept)
    assert out == [
        "alloc ok",
        "gkeep ok",
        "glaunch ok",
        info(700 * MiB),
        f"greserved {512 * MiB}",  # still allocated: no trim gives it back
        "free ok",
        "glaunch ok",  # auto-frees the last launch's allocation and takes it again
        info(512 * MiB),
        "async err 2",  # charged now: 512 + 600 MiB is beyond the quota
    ]


def test_the_allocation_map_alone_with_threads(tmp_path: Path) -> None:
    """The shim's allocation map (shim/alloc_map.c) with no driver and no ledger
    (tests/c/alloc_map_test.c): insert, look up, replace, remove across every shard as
    they grow, a handle's counts, updates in place, walks, a fork child's reset, and eight
    threads at once. Under `make debug-test` it is built with that run's sanitizer."""
    asan = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]
    prog = cc(
        tmp_path / "alloc_map_test",
        *(asan if SANITIZER == "address" else []),
        str(CSRC / "alloc_map_test.c"),
        str(ROOT / "shim/alloc_map.c"),
    )
    out = subprocess.run([str(prog), "8", "20000"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ok", f"records={8 * 10000}"], out.stdout
