"""Late attach: a shim preloaded inert is switched to enforcing inside a running process,
from C (gpushare_attach through dlsym) and from Python (gpushare.shim)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from cffi import FFI

from gpushare import libs
from gpushare._shim_cdef import CDEF
from nodemgr.host import gpus
from nodemgr.host.ledger import SIZE, Ledger
from tests.conftest import ROOT, cc, shim_preload

MiB = 1 << 20
GiB = 1 << 30
TASK = "attach-task"
DEVICE = 16 * GiB
NODE = [gpus.Gpu(i, gpus.simulated_uuid(i), "Attach Sim", DEVICE) for i in range(2)]
# Settings that would change what these tests see: the shim's own at load (they start
# inert) and the devices the driver shows.
AT_LOAD = ("GPUSHARE_LEDGER", "GPUSHARE_TASK_ID", "GPUSHARE_TRACE", "CUDA_VISIBLE_DEVICES")


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    """The node's ledger, as nodemgr makes it for a grant: 1 GiB on GPU 0, the task's entry."""
    led = Ledger.create(tmp_path / "ledger", [g.uuid_bytes for g in NODE])
    led.set_limit(0, GiB)
    led.task_add(TASK)
    yield led
    led.close()


def environment(preload: bool = True, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (*AT_LOAD, "LD_PRELOAD")}
    env["LD_LIBRARY_PATH"] = str(libs.sim_driver_dir())
    env["GPUSHARE_SIM_GPUS"] = gpus.sim_spec(NODE)
    if preload:
        env["LD_PRELOAD"] = shim_preload()
    return {**env, **extra}


def client(
    program: Path, *steps: str, preload: bool = True, **extra: str
) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(
        [str(program), *steps],
        capture_output=True,
        text=True,
        env=environment(preload, **extra),
        timeout=60,
    )
    assert r.returncode == 0, r.stderr  # a sanitizer's report fails here too
    return r


def lines(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if ln]


# --- C: gpushare_attach found with dlsym(RTLD_DEFAULT) -----------------------------------


@pytest.mark.parametrize("program", ["client", "client_linked"])
def test_attach_makes_an_inert_shim_enforce_the_ledger(
    cbin: dict[str, Path], ledger: Ledger, tmp_path: Path, program: str
) -> None:
    """Attached before the first driver call (a lookup on libcuda's handle may come
    first: it calls nothing), the process is charged and limited like one started
    enforcing, and nothing is printed."""
    go = tmp_path / "go"
    steps = ["mode", "lookup", "attach", str(ledger.path), TASK, "mode"]
    steps += ["info", "alloc", "512", "alloc", "768", "info", "waitfile", str(go)]
    p = subprocess.Popen(
        [str(cbin[program]), *steps],
        env=environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        got = [p.stdout.readline().strip() for _ in range(9)] if p.stdout else []
        assert got == [
            "mode inert",
            "lookup libgpushare.so",  # the wrapper, handed out without reaching the driver
            "attach ok",
            "mode enforce",
            f"info free={GiB} total={GiB}",
            "alloc ok",
            "alloc err 2",  # CUDA_ERROR_OUT_OF_MEMORY: 512 + 768 MiB is beyond 1 GiB
            f"info free={512 * MiB} total={GiB}",
            "waiting",
        ]
        usage = ledger.task_usage(TASK)
        assert (usage.processes, usage.used) == (1, 512 * MiB)
        assert ledger.used(0) == 512 * MiB
    finally:
        go.touch()
        _, err = p.communicate(timeout=30)
    assert p.returncode == 0
    assert err == ""


def test_a_driver_call_before_attach_makes_it_too_late(
    cbin: dict[str, Path], ledger: Ledger
) -> None:
    """The client's start-up (cuInit, a primary context) reached the driver uninspected:
    attaching now would leave that unknown to the ledger, so the process stays inert."""
    r = client(cbin["client"], "info", "attach", str(ledger.path), TASK, "mode", "alloc", "2000")
    assert lines(r.stdout) == [
        f"info free={DEVICE} total={DEVICE}",
        "attach err TOO_LATE",
        "mode inert",
        "alloc ok",  # beyond the ledger's 1 GiB: nothing enforces it
    ]
    assert r.returncode == 0
    assert r.stderr == ""
    assert ledger.summary() == {}, "no slot was claimed"


def test_attach_racing_threads_with_the_first_driver_call_is_all_or_nothing(
    cbin: dict[str, Path], ledger: Ledger
) -> None:
    """An attach on one thread races the client's start-up on another: either attach wins
    and every allocation is charged, or the start-up reached the driver first and the
    process stays inert, never a mix. (Run under TSan by make debug-test.)"""
    steps = ["attachbg", str(ledger.path), TASK, "alloc", "600", "alloc", "600"]
    steps += ["attachjoin", "mode", "info"]
    won = [
        "alloc ok",
        "alloc err 2",
        "attach ok",
        "mode enforce",
        f"info free={GiB - 600 * MiB} total={GiB}",
    ]
    lost = [
        "alloc ok",
        "alloc ok",
        "attach err TOO_LATE",
        "mode inert",
        f"info free={DEVICE - 1200 * MiB} total={DEVICE}",
    ]
    for _ in range(8):
        out = lines(client(cbin["client"], *steps).stdout)
        assert out in (won, lost), out
        charged = ledger.task_usage(TASK).used
        assert charged == (600 * MiB if out == won else 0)
        ledger.reap()


def _not_a_ledger(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / f"ledger-{kind}"
    if kind == "zeroes":
        path.write_bytes(bytes(SIZE))  # the right size, no magic: a wrong version reads so
    elif kind == "short":
        path.write_bytes(b"gpushare")
    elif kind == "directory":
        path.mkdir()
    return path


@pytest.mark.parametrize("kind", ["missing", "zeroes", "short", "directory"])
def test_an_unusable_ledger_leaves_the_process_inert(
    cbin: dict[str, Path], tmp_path: Path, kind: str
) -> None:
    path = _not_a_ledger(tmp_path, kind)
    r = client(cbin["client"], "attach", str(path), TASK, "mode", "alloc", "2000", "info")
    assert lines(r.stdout) == [
        "attach err LEDGER",
        "mode inert",
        "alloc ok",
        f"info free={DEVICE - 2000 * MiB} total={DEVICE}",
    ]
    assert r.returncode == 0
    assert r.stderr == "", "a failed attach says nothing: its caller decides"


def test_a_failed_attach_can_be_followed_by_a_good_one(
    cbin: dict[str, Path], ledger: Ledger, tmp_path: Path
) -> None:
    missing = str(tmp_path / "missing")
    r = client(cbin["client"], "attach", missing, TASK, "attach", str(ledger.path), TASK, "mode")
    assert lines(r.stdout) == ["attach err LEDGER", "attach ok", "mode enforce"]


def test_a_second_attach_is_refused(cbin: dict[str, Path], ledger: Ledger) -> None:
    led = str(ledger.path)
    r = client(cbin["client"], "attach", led, TASK, "attach", led, "other", "mode", "alloc", "1025")
    assert lines(r.stdout) == ["attach ok", "attach err ATTACHED", "mode enforce", "alloc err 2"]
    assert ledger.summary()[TASK].processes == 1, "the first attach's task is charged"


@pytest.mark.parametrize("at_load", ["enforce", "broken"])
def test_a_shim_that_loaded_with_a_ledger_refuses_attach(
    cbin: dict[str, Path], ledger: Ledger, tmp_path: Path, at_load: str
) -> None:
    named = str(ledger.path) if at_load == "enforce" else str(tmp_path / "missing")
    r = client(
        cbin["client"],
        *("attach", str(ledger.path), TASK, "mode"),
        GPUSHARE_LEDGER=named,
        GPUSHARE_TASK_ID=TASK,
    )
    assert lines(r.stdout) == ["attach err ATTACHED", f"mode {at_load}"]


def test_bad_arguments_are_refused(cbin: dict[str, Path], ledger: Ledger) -> None:
    led = str(ledger.path)
    steps = ["attach", "", TASK, "attach", led, "", "attach", led, "x" * 24, "mode"]
    steps += ["attach", led, "x" * 23, "mode"]  # the longest id a ledger entry holds
    r = client(cbin["client"], *steps)
    assert lines(r.stdout) == [
        "attach err INVAL",
        "attach err INVAL",
        "attach err INVAL",
        "mode inert",
        "attach ok",
        "mode enforce",
    ]


def test_without_the_shim_there_is_nothing_to_attach(cbin: dict[str, Path], ledger: Ledger) -> None:
    r = client(cbin["client"], "attach", str(ledger.path), TASK, "mode", preload=False)
    assert lines(r.stdout) == ["attach none", "mode none"]


def test_a_fork_child_after_attach_enforces_in_a_slot_of_its_own(
    cbin: dict[str, Path], ledger: Ledger
) -> None:
    """As after a fork of a process that started enforcing: the child maps the ledger
    afresh and claims its own slot; the parent's 600 MiB count against it."""
    steps = ["attach", str(ledger.path), TASK, "alloc", "600", "forkrest"]
    steps += ["mode", "alloc", "600", "alloc", "300", "info"]
    r = client(cbin["client"], *steps)
    assert lines(r.stdout) == [
        "attach ok",
        "alloc ok",
        "mode enforce",  # the child's lines
        "alloc err 2",
        "alloc ok",
        f"info free={GiB - 900 * MiB} total={GiB}",
        "forkrest exit=0",
    ]
    # Both processes have ended; their slots stay until nodemgr reaps them.
    usage = ledger.task_usage(TASK)
    assert (usage.processes, usage.used) == (2, 900 * MiB)
    assert ledger.reap() == 2


def test_counters_fill_the_size_the_caller_gives(cbin: dict[str, Path], ledger: Ledger) -> None:
    """gpushare_counters fills as much of the caller's struct as it says it has: a
    shorter one (an older header's) in part, a longer one (a newer header's) with zeros
    for the fields this shim does not know."""
    ones = str((1 << 64) - 1)
    steps = ["attach", str(ledger.path), TASK, "alloc", "64", "alloc", "32"]
    steps += ["free", "launch", "2"]
    for size in ("16", "32", "8", "12", "0"):
        steps += ["counters", size]
    r = client(cbin["client"], *steps)
    peak = str(96 * MiB)
    assert lines(r.stdout) == [
        "attach ok",
        "alloc ok",
        "alloc ok",
        "free ok",
        "launch ok",
        f"counters 0 {peak} 2 {ones} {ones}",
        f"counters 0 {peak} 2 0 0",
        f"counters 0 {peak} {ones} {ones} {ones}",
        f"counters -1 {ones} {ones} {ones} {ones}",  # not a whole number of fields
        f"counters 0 {ones} {ones} {ones} {ones}",
    ]
    r = client(cbin["client"], "counters", "16")
    assert lines(r.stdout) == [f"counters -1 {ones} {ones} {ones} {ones}"]  # inert
    r = client(cbin["client"], "counters", "16", preload=False)
    assert lines(r.stdout) == ["counters none"]


def test_the_cdef_and_the_header_agree(tmp_path: Path) -> None:
    """gpushare._shim_cdef reads the marked part of gpushare.h: what cffi makes of it
    agrees with the compiler. Its prototypes are compiled against the header (a mismatch
    fails to compile), and every enumerator's value and the layout of every struct are
    compared."""
    header = (ROOT / "shim" / "gpushare.h").read_text()
    names = re.findall(r"^\s*(GPUSHARE_\w+)\s*=", header, flags=re.M)
    assert "GPUSHARE_E_TOO_LATE" in names
    prototypes = [ln for ln in CDEF.splitlines() if re.match(r"(int|void) gpushare_", ln)]
    declared = re.compile(r"^(?:int|void) (gpushare_\w+)\(", flags=re.M)
    assert {m[1] for ln in prototypes if (m := declared.match(ln))} == set(declared.findall(header))
    assert all(declared.match(ln) for ln in prototypes)
    ffi = FFI()
    ffi.cdef(CDEF)
    structs = re.findall(r"^struct (gpushare_\w+) \{", header, flags=re.M)
    assert set(structs) == {"gpushare_memory", "gpushare_counters"}
    layout: dict[str, str] = {}
    in_cdef: dict[str, int] = {}
    for name in structs:
        struct = f"struct {name}"
        for f, _ in ffi.typeof(struct).fields:
            layout[f"{name}.{f}"] = f"offsetof({struct}, {f})"
            in_cdef[f"{name}.{f}"] = ffi.offsetof(struct, f)
        layout[f"{name}.size"] = f"sizeof({struct})"
        in_cdef[f"{name}.size"] = ffi.sizeof(struct)
    src = tmp_path / "agree.c"
    src.write_text(
        '#include <stddef.h>\n#include <stdio.h>\n#include "gpushare.h"\n'
        + "\n".join(prototypes)
        + "\nint main(void)\n{\n"
        + "".join(f'\tprintf("{n} %d\\n", (int){n});\n' for n in names)
        + "".join(f'\tprintf("{k} %d\\n", (int){v});\n' for k, v in layout.items())
        + "\treturn 0;\n}\n"
    )
    out = subprocess.run(
        [str(cc(tmp_path / "agree", str(src)))],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    in_header = {n: int(v) for n, v in (ln.split() for ln in lines(out))}
    for enum in ("enum gpushare_status", "enum gpushare_mode", "enum gpushare_iteration_flags"):
        in_cdef.update(ffi.typeof(enum).relements)
    assert in_cdef == in_header


# --- Python: gpushare.shim in a child interpreter --------------------------------------

DRIVE = """
import ctypes, sys
from gpushare import shim
ledger, task, driver = sys.argv[1:4]

def cuda():
    cu = ctypes.CDLL(driver)
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    assert cu.cuInit(0) == 0
    assert cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
    assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
    assert cu.cuCtxSetCurrent(ctx) == 0
    return cu

def alloc(cu, mib):
    p = ctypes.c_uint64()
    print("alloc", mib, cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(mib << 20)))

def attempt(path, task_id):
    try:
        shim.attach(path, task_id)
        print("attach ok")
    except shim.ShimError as e:
        print("attach", type(e).__name__, "|", e)
"""

ENFORCED = """
print(shim.loaded(), shim.mode())
shim.attach(ledger, task)
print(shim.mode())
cu = cuda()
alloc(cu, 512)
alloc(cu, 768)
free, total = ctypes.c_size_t(), ctypes.c_size_t()
cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
print("info", free.value, total.value)
"""


def python(
    script: str, ledger: Path, cwd: Path, preload: bool = True
) -> subprocess.CompletedProcess[str]:
    """``python -c`` in ``cwd`` (not the checkout: the installed package is imported)."""
    driver = libs.sim_driver_dir() / "libcuda.so.1"
    return subprocess.run(
        [sys.executable, "-c", DRIVE + script, str(ledger), TASK, str(driver)],
        capture_output=True,
        text=True,
        env=environment(preload),
        cwd=cwd,
        timeout=60,
    )


def test_python_attach_then_the_driver_is_enforced(ledger: Ledger, tmp_path: Path) -> None:
    r = python(ENFORCED, ledger.path, tmp_path)
    assert r.returncode == 0, r.stderr
    assert lines(r.stdout) == [
        "True inert",
        "enforce",
        "alloc 512 0",
        "alloc 768 2",  # CUDA_ERROR_OUT_OF_MEMORY beyond the grant
        f"info {512 * MiB} {GiB}",
    ]
    usage = ledger.task_usage(TASK)
    assert (usage.processes, usage.used) == (1, 512 * MiB)


def test_python_attach_after_cuda_was_used_is_too_late(ledger: Ledger, tmp_path: Path) -> None:
    r = python("cu = cuda()\nattempt(ledger, task)\nprint(shim.mode())", ledger.path, tmp_path)
    assert r.returncode == 0, r.stderr
    out = lines(r.stdout)
    assert out[0].startswith("attach ShimTooLate | "), out
    assert "before the framework first uses CUDA" in out[0]
    assert out[1:] == ["inert"]


def test_python_attach_failures_leave_the_shim_as_it_was(ledger: Ledger, tmp_path: Path) -> None:
    script = (
        "attempt(ledger + '.missing', task)\n"
        "attempt(ledger, 'x' * 24)\n"
        "print(shim.mode())\n"
        "attempt(ledger, task)\n"
        "attempt(ledger, task)\n"
        "print(shim.mode())\n"
    )
    r = python(script, ledger.path, tmp_path)
    assert r.returncode == 0, r.stderr
    out = [ln.split(" | ") for ln in lines(r.stdout)]
    assert [o[0] for o in out] == [
        "attach ShimLedgerError",
        "attach ShimError",  # invalid arguments: the base class itself
        "inert",
        "attach ok",
        "attach ShimAlreadyAttached",
        "enforce",
    ]
    assert "No such file or directory" in out[0][1]
    assert r.stderr == ""


def test_without_the_preload_loaded_is_false_and_loads_nothing(
    ledger: Ledger, tmp_path: Path
) -> None:
    script = (
        "print(shim.loaded())\n"
        "attempt(ledger, task)\n"
        "try:\n    shim.mode()\nexcept shim.ShimNotLoaded:\n    print('mode ShimNotLoaded')\n"
        "print('libgpushare' in open('/proc/self/maps').read())\n"
    )
    r = python(script, ledger.path, tmp_path, preload=False)
    assert r.returncode == 0, r.stderr
    out = [ln.split(" | ")[0] for ln in lines(r.stdout)]
    assert out == ["False", "attach ShimNotLoaded", "mode ShimNotLoaded", "False"]


# --- a ledger the process cannot write ---------------------------------------------------

# Runs "$@" with the directory "$0" bind-mounted read-only over itself, in a mount namespace
# of its own (as a container's read-only mount of an environment's directory).
READ_ONLY = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"'
NVML_MEMORY = """
import pynvml
pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByIndex(0)
m1 = pynvml.nvmlDeviceGetMemoryInfo(h)
m2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
print("nvml", m1.total, m1.free, m1.used, m2.total, m2.free, m2.used)
"""


def read_only(directory: Path, *argv: str, **extra: str) -> subprocess.CompletedProcess[str]:
    unshare = ["unshare", "--mount"] if os.geteuid() == 0 else ["unshare", "-r", "--mount"]
    probe = subprocess.run(
        [*unshare, "sh", "-c", READ_ONLY, str(directory), "true"],
        env=environment(preload=False),
        timeout=120,
    )
    if probe.returncode != 0:
        pytest.skip("needs a mount namespace of its own (root, or user namespaces)")
    # The shim only in the program: preloaded in mount, it would hold the ledger open for
    # writing and the remount would be refused.
    program = ["env", "-i", *(f"{k}={v}" for k, v in {**environment(), **extra}.items()), *argv]
    return subprocess.run(
        [*unshare, "sh", "-c", READ_ONLY, str(directory), *program],
        capture_output=True,
        text=True,
        env=environment(preload=False),
        timeout=60,
    )


def test_a_ledger_on_a_read_only_mount_names_the_mount_and_shows_no_memory(
    cbin: dict[str, Path], ledger: Ledger, tmp_path: Path
) -> None:
    """The shim opens the ledger for writing: on a read-only mount it says which
    directory to mount read-write, refuses allocations, and shows no GPU memory, not the
    whole device (which a framework would size itself by)."""
    at_load = {"GPUSHARE_LEDGER": str(ledger.path), "GPUSHARE_TASK_ID": TASK}
    steps = ["mode", "info", "totalmem", "alloc", "1"]
    r = read_only(tmp_path, str(cbin["client"]), *steps, **at_load)
    assert r.returncode == 0, r.stderr
    assert lines(r.stdout) == ["mode broken", "info free=0 total=0", "totalmem 0", "alloc err 800"]
    assert f"cannot open ledger {ledger.path} for writing: Read-only file system" in r.stderr
    hint = "read-only mount: mount the directory read-write (docs/containers.md)"
    assert f"{hint} (directory {tmp_path})" in r.stderr
    assert "is nodemgr running" not in r.stderr
    r = read_only(tmp_path, sys.executable, "-c", NVML_MEMORY, **at_load)
    assert r.returncode == 0, r.stderr
    assert lines(r.stdout) == ["nvml 0 0 0 0 0 0"]
    # Without the shim's ledger the same process sees the simulated GPU whole.
    r = read_only(tmp_path, sys.executable, "-c", NVML_MEMORY)
    assert lines(r.stdout)[0].split()[1] == str(DEVICE)


def test_late_attach_to_a_ledger_on_a_read_only_mount_names_the_mount(
    ledger: Ledger, tmp_path: Path
) -> None:
    code = (
        "import sys\nfrom gpushare import shim\n"
        "try:\n    shim.attach(sys.argv[1], sys.argv[2])\n"
        "except shim.ShimLedgerError as e:\n    print(e)\n"
    )
    r = read_only(tmp_path, sys.executable, "-c", code, str(ledger.path), TASK)
    assert r.returncode == 0, r.stderr
    assert f"on a read-only mount: mount {tmp_path} read-write" in r.stdout, r.stdout
