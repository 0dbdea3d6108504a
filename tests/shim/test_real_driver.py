"""The shim over NVIDIA's real user-space driver, on a machine without a GPU.

`make real-driver` unpacks Debian's non-free libcuda1, libnvidia-ml1 and nvidia-smi (no
kernel module) into build/real-driver, and `make test` names that folder in
GPUSHARE_TEST_REAL_DRIVER. Every program here runs three ways, each a real child process:
without the shim, with it preloaded inert (no ledger), and enforcing under a real nodemgr
grant; the driver's answers must be the same each way, and the shim must print nothing.
Without a GPU the driver fails cuInit, but cuGetProcAddress, libcudart, NVML and nvidia-smi
all give real answers. (test_interception.py checks global lookups on a stand-in driver
that needs no NVIDIA package.)
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import hook_table
from tests.shim.conftest import run_ways
from tests.shim.test_interception import (
    DRIVER,
    SHIM,
    _cudart,
    check_global_lookups,
    driver_has,
    hooked_abis,
)
from tests.sim.test_sim_api import table

REAL_DRIVER_ENV = "GPUSHARE_TEST_REAL_DRIVER"
MODE_INERT, MODE_ENFORCE = "0", "1"  # gpushare.h's GPUSHARE_MODE_*


@dataclass(frozen=True)
class RealDriver:
    lib: Path  # libcuda.so.1 and libnvidia-ml.so.1
    smi: Path
    version: str


@pytest.fixture(scope="session")
def real_driver() -> RealDriver:
    where = os.environ.get(REAL_DRIVER_ENV)
    if not where:
        pytest.skip(
            f"real NVIDIA driver tier: {REAL_DRIVER_ENV} is not set; `make test` sets it "
            "(after `make real-driver` unpacks the driver into build/real-driver)"
        )
    folder = Path(where)
    if (folder / "unavailable").is_file():
        pytest.skip(
            "real NVIDIA driver tier: the driver packages could not be unpacked: "
            + (folder / "unavailable").read_text().strip()
            + ". Fix: a Debian system with apt-get, dpkg-deb and its package mirror "
            "reachable, then `make real-driver`"
        )
    if not (folder / "version").is_file():
        pytest.fail(f"{folder} holds neither an unpacked driver nor a reason it has none")
    return RealDriver(
        folder / "lib", folder / "bin" / "nvidia-smi", (folder / "version").read_text().strip()
    )


# --- cuGetProcAddress ------------------------------------------------------------------------


def _grid() -> list[str]:
    """Every base name hooks.def knows, a sample of the others CUDA 13.0 has, and names no
    driver has; each at versions from 2000 to 14000 (every introduction of one of its
    variants, and the version before), flags 0, 1 and 2, through v2 and v1."""
    hooks = [e for e in hook_table() if e.base]
    _, rows = table()
    hooked = sorted({e.base for e in hooks if e.base})
    others = sorted({r.base for r in rows} - set(hooked))
    names = [*hooked, *others[::10], "-", "cuNoSuchThing"]
    introduced: dict[str, set[int]] = {}
    for base, version in [(e.base, e.version) for e in hooks] + [(r.base, r.version) for r in rows]:
        introduced.setdefault(str(base), set()).add(version)
    lines = []
    for name in names:
        versions = set(range(2000, 14001, 1000)) | {12020, 12090, 13010}
        versions |= {v + d for v in introduced.get(name, set()) for d in (-1, 0)}
        for v in sorted(x for x in versions if 2000 <= x <= 14000):
            for flags in (0, 1, 2):
                lines += [f"gpa {name} {v} {flags}", f"gpa1 {name} {v} {flags}"]
    return lines


def _answers(out: str) -> tuple[str, dict[tuple[str, ...], list[str]]]:
    """The probe's mode line, and every lookup's answer keyed by (phase, kind, name,
    version, flags), the phase being before or after cuInit."""
    lines = out.splitlines()
    mode = lines[0]
    answers: dict[tuple[str, ...], list[str]] = {}
    phase = "before"
    for line in lines[1:]:
        if line.startswith("init "):
            phase = "after"
            continue
        kind, name, version, flags, *answer = line.split()
        answers[(phase, kind, name, version, flags)] = answer
    return mode, answers


def _same(plain: list[str], shim: list[str]) -> bool:
    """The driver's rc and status, and its own function or the shim's wrapper of the same
    ABI name."""
    *codes, fn = plain
    *shim_codes, shim_fn = shim
    if codes != shim_codes:
        return False
    return shim_fn == fn or (
        fn.startswith(f"{DRIVER}:") and shim_fn == f"{SHIM}:{fn.split(':', 1)[1]}"
    )


def test_get_proc_address_grid_is_the_drivers_with_the_shim(
    real_driver: RealDriver, driver_probe: Path, daemon: Any, run_task: Any
) -> None:
    grid = _grid()
    stdin = "mode\n" + "\n".join(grid) + "\ninit\n" + "\n".join(grid) + "\n"
    runs = run_ways(daemon, run_task, real_driver.lib, [str(driver_probe)], stdin)
    for way, r in runs.items():
        assert r.rc == 0 and r.err == "", (way, r.err)
    modes = {way: _answers(r.out)[0] for way, r in runs.items()}
    assert modes == {
        "plain": "mode none",
        "inert": f"mode {MODE_INERT}",
        "enforcing": f"mode {MODE_ENFORCE}",
    }
    plain = _answers(runs["plain"].out)[1]
    assert len(plain) == 2 * len(grid)  # each lookup before and after cuInit
    # The driver really answered: cuInit failed without a GPU, lookups found functions.
    assert "\ninit 100\n" in runs["plain"].out
    assert sum(a[-1].startswith(f"{DRIVER}:") for a in plain.values()) > 1000
    for way in ("inert", "enforcing"):
        shim = _answers(runs[way].out)[1]
        assert shim.keys() == plain.keys()
        differ = [(k, plain[k], shim[k]) for k in plain if not _same(plain[k], shim[k])]
        assert not differ, f"{way}: {len(differ)} answers differ, e.g. {differ[:10]}"
        wrapped = sum(a[-1].startswith(f"{SHIM}:") for a in shim.values())
        assert wrapped > 100, f"{way}: the shim handed out only {wrapped} wrappers"


# --- libcudart, NVML, nvidia-smi ----------------------------------------------------------

CUDART_SCRIPT = """
import ctypes, sys
rt = ctypes.CDLL(sys.argv[1])
for name in ("cudaRuntimeGetVersion", "cudaDriverGetVersion", "cudaGetDeviceCount"):
    n = ctypes.c_int(-1)
    print(name, getattr(rt, name)(ctypes.byref(n)), n.value)
"""


def _cudart12() -> str:
    spec = importlib.util.find_spec("nvidia.cuda_runtime")
    places = spec.submodule_search_locations if spec else None
    found = [Path(p) / "lib" / "libcudart.so.12" for p in places or []]
    found = [p for p in found if p.is_file()]
    if not found:
        pytest.fail("the nvidia-cuda-runtime-cu12 test dependency provides no libcudart.so.12")
    return str(found[0])


@pytest.mark.parametrize("runtime", ["12", "13"])
def test_real_libcudart_answers_the_same_with_the_shim(
    real_driver: RealDriver, daemon: Any, run_task: Any, runtime: str
) -> None:
    cudart = _cudart12() if runtime == "12" else _cudart()
    assert f"libcudart.so.{runtime}" in cudart
    runs = run_ways(
        daemon, run_task, real_driver.lib, [sys.executable, "-c", CUDART_SCRIPT, cudart]
    )
    plain = runs["plain"]
    assert plain.rc == 0, plain.err
    got = {line.split()[0]: line.split()[1:] for line in plain.out.splitlines()}
    assert got["cudaRuntimeGetVersion"][1].startswith(runtime)
    assert got["cudaDriverGetVersion"] == ["0", got["cudaDriverGetVersion"][1]]
    assert int(got["cudaDriverGetVersion"][1]) >= 12000  # the real driver answered
    assert got["cudaGetDeviceCount"][0] != "0"  # no GPU
    assert runs["inert"] == plain
    assert runs["enforcing"] == plain


PYNVML_SCRIPT = """
import pynvml
try:
    pynvml.nvmlInit()
    print("init", 0, pynvml.nvmlDeviceGetCount())
except pynvml.NVMLError as e:
    print("init", e.value, e)
"""


def test_pynvml_answers_the_same_with_the_shim(
    real_driver: RealDriver, daemon: Any, run_task: Any
) -> None:
    runs = run_ways(daemon, run_task, real_driver.lib, [sys.executable, "-c", PYNVML_SCRIPT])
    plain = runs["plain"]
    assert plain.rc == 0, plain.err
    assert plain.out.startswith("init 9 ")  # NVML_ERROR_DRIVER_NOT_LOADED: it really ran
    assert runs["inert"] == plain
    assert runs["enforcing"] == plain


def test_nvidia_smi_answers_the_same_with_the_shim(
    real_driver: RealDriver, daemon: Any, run_task: Any
) -> None:
    runs = run_ways(daemon, run_task, real_driver.lib, [str(real_driver.smi)])
    plain = runs["plain"]
    assert plain.rc == 9, plain  # no driver to talk to: it really ran
    assert "NVIDIA" in plain.out + plain.err
    assert runs["inert"] == plain
    assert runs["enforcing"] == plain


# --- global lookups of hooked names ----------------------------------------------------------


@pytest.mark.parametrize("how", ["local", "global"])
def test_a_hooked_name_the_real_driver_lacks_is_not_found_globally(
    real_driver: RealDriver, driver_probe: Path, daemon: Any, run_task: Any, how: str
) -> None:
    stdin = "".join(f"hsym {n}\nsym {n}\n" for n in hooked_abis())
    runs = run_ways(daemon, run_task, real_driver.lib, [str(driver_probe), how], stdin)
    has = driver_has(runs)
    lacks = {n for n in hooked_abis() if n not in has}
    assert "cuMemAlloc_v2" in has
    assert lacks, "the driver has every hooked name: nothing here was tested"
    if real_driver.version.startswith("535."):
        assert "cuCtxCreate_v4" in lacks  # the issue's example: CUDA 12.5's, on CUDA 12.2
    check_global_lookups(runs, how, has)
