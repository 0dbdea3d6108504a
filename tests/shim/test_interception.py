"""The shim catches every way into the driver and leaves other lookups alone."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpushare import libs
from tests.conftest import CSRC, ROOT, cc, hook_table, shim_preload
from tests.shim.conftest import Result, driver_env, run_ways

GPUSHARE_H = ROOT / "shim" / "gpushare.h"


def test_rtld_next_and_default_unchanged_by_the_shim(cbin: dict[str, Path]) -> None:
    plain = subprocess.run(
        [cbin["probe"]], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    hooked = subprocess.run(
        [cbin["probe"]],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "LD_PRELOAD": shim_preload()},
        timeout=120,
    ).stdout
    assert hooked == plain
    # And plain is what glibc promises, so the comparison means something.
    assert "first_next=second\n" in plain
    assert "first_default=first\n" in plain
    assert "second_next=none\n" in plain
    assert "main_next=first\n" in plain
    assert "by_handle=second\n" in plain
    assert "getpid_next=1\n" in plain


def public_api() -> set[str]:
    """The functions shim/gpushare.h declares: the shim's public API."""
    text = GPUSHARE_H.read_text()
    names = set(re.findall(r"^(?:int|void) (gpushare_\w+)\(", text, flags=re.M))
    assert "gpushare_attach" in names
    return names


def test_shim_exports_only_its_hooks_and_api_and_needs_no_libpython() -> None:
    shim = str(libs.shim_path())
    dyn = subprocess.run(
        ["readelf", "-dW", shim], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    needed = [ln.split("[")[1].rstrip("]") for ln in dyn.splitlines() if "(NEEDED)" in ln]
    assert not [n for n in needed if "python" in n], needed
    syms = subprocess.run(
        ["nm", "-D", "--defined-only", shim],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.split()
    exported = {s for s in syms[2::3]}
    table = hook_table()
    hooked = {e.abi for e in table if e.kind in ("GS_HOOK", "GS_NVML_HOOK")}
    # dlsym, the hooks, and the public API: nothing of the shim's own internals.
    assert exported == {"dlsym", *hooked, *public_api()}
    # Variants and reals are the driver's alone: exporting one would capture -lcuda programs.
    assert not exported & {e.abi for e in table if e.kind not in ("GS_HOOK", "GS_NVML_HOOK")}


def _cudart() -> str:
    import nvidia  # type: ignore[import-untyped]

    found = []
    for base in nvidia.__path__:
        found += glob.glob(os.path.join(base, "cu1*", "lib", "libcudart.so.1*"))
    if not found:
        pytest.fail("the nvidia-cuda-runtime test dependency provides no libcudart")
    return sorted(found)[-1]


def test_real_libcudart_startup_goes_through_the_shim(
    daemon: Any, run_task: Any, tmp_path: Path
) -> None:
    ep = daemon.env("alice", gpus=1, memory=1 << 30)
    trace = tmp_path / "trace"
    script = (
        "import ctypes, sys\n"
        "rt = ctypes.CDLL(sys.argv[1])\n"
        "n = ctypes.c_int(-1)\n"
        "print('rc', rt.cudaGetDeviceCount(ctypes.byref(n)))\n"
    )
    p = run_task(ep, sys.executable, "-c", script, _cudart(), env={"GPUSHARE_TRACE": str(trace)})
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    hooks = {}
    for line in trace.read_text().splitlines():
        fields = dict(f.split("=", 1) for f in line.split())
        if "hook" in fields:
            hooks[fields["hook"]] = fields
    # libcudart found cuGetProcAddress_v2 by dlsym on libcuda's handle and got the wrapper ...
    assert int(hooks["cuGetProcAddress_v2"]["dlsym"]) == 1
    # ... fetched cuGetProcAddress itself through it and kept using the wrapper ...
    assert int(hooks["cuGetProcAddress_v2"]["gpa"]) >= 1
    assert int(hooks["cuGetProcAddress_v2"]["calls"]) > 100
    # ... and its own start-up calls into the driver went through the shim.
    for name in ("cuInit", "cuDeviceGetCount", "cuDeviceTotalMem_v2"):
        assert int(hooks[name]["calls"]) >= 1, (name, out)


# --- global lookups of hooked names ----------------------------------------------------

SHIM = "libgpushare.so"  # the file name of every build of the shim
DRIVER = "libcuda.so.1"


def hooked_abis() -> list[str]:
    """Every name the shim exports as a hook, CUDA's and NVML's."""
    return sorted(e.abi for e in hook_table() if e.kind in ("GS_HOOK", "GS_NVML_HOOK"))


def lookups(out: str) -> dict[tuple[str, str], str]:
    """(kind, name) -> answer, for the probe's sym and hsym lines."""
    found = {}
    for line in out.splitlines():
        kind, name, *answer = line.split()
        if kind in ("sym", "hsym"):
            found[(kind, name)] = " ".join(answer)
    return found


def check_global_lookups(runs: dict[str, Result], how: str, has: set[str]) -> None:
    """A global lookup finds the shim's wrapper of a name the driver has (the driver's own
    definition without the shim, where it is global), and nothing where the driver lacks
    the name, with dlerror() set, as without the shim."""
    for way, r in runs.items():
        assert r.rc == 0 and r.err == "", (way, r.err)
        got = lookups(r.out)
        for name in hooked_abis():
            if name not in has:
                want = "- err"
            elif way == "plain":
                want = f"{DRIVER}:{name} ok" if how == "global" else "- err"
            else:
                want = f"{SHIM}:{name} ok"
            assert got[("sym", name)] == want, (way, how, name)


def driver_has(runs: dict[str, Result]) -> set[str]:
    """The hooked names the driver defines, from the run without the shim."""
    got = lookups(runs["plain"].out)
    return {n for n in hooked_abis() if got[("hsym", n)] == f"{DRIVER}:{n}"}


@pytest.fixture(scope="module")
def partial_driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder whose libcuda.so.1 has only cuInit and cuCtxCreate_v2."""
    d = tmp_path_factory.mktemp("partial")
    cc(d / DRIVER, "-shared", "-fPIC", f"-Wl,-soname,{DRIVER}", str(CSRC / "partial_driver.c"))
    return d


@pytest.mark.parametrize("how", ["local", "global", "none"])
def test_a_hooked_name_the_driver_lacks_is_not_found_globally(
    partial_driver: Path, driver_probe: Path, daemon: Any, run_task: Any, how: str
) -> None:
    stdin = "".join(f"hsym {n}\nsym {n}\n" for n in hooked_abis())
    runs = run_ways(daemon, run_task, partial_driver, [str(driver_probe), how], stdin)
    has = driver_has(runs)
    assert has == (set() if how == "none" else {"cuInit", "cuCtxCreate_v2"})
    check_global_lookups(runs, how, has)


def test_a_program_linked_with_a_name_the_driver_lacks_gets_not_found(
    partial_driver: Path, tmp_path: Path
) -> None:
    """The documented limit: a direct reference binds to the shim's export when the program
    loads, so where it would stop with an undefined symbol without the shim, it runs and
    the call returns CUDA_ERROR_NOT_FOUND (500)."""
    sim = libs.sim_driver_dir()
    prog = cc(tmp_path / "linked_v4", str(CSRC / "linked_v4.c"), f"-L{sim}", "-l:libcuda.so.1")
    plain = subprocess.run(
        [prog], capture_output=True, text=True, env=driver_env(partial_driver), timeout=120
    )
    assert plain.returncode != 0
    assert "undefined symbol: cuCtxCreate_v4" in plain.stderr
    shim = subprocess.run(
        [prog],
        capture_output=True,
        text=True,
        env=driver_env(partial_driver, LD_PRELOAD=shim_preload()),
        timeout=120,
    )
    assert (shim.returncode, shim.stdout, shim.stderr) == (0, "cuCtxCreate_v4 500\n", "")
