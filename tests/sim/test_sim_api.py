"""The driver ABI table sim/cuda_api.gen.h against CUDA's own headers, and the simulated
driver against the table.

sim/gen_api.py writes the table from cuda.h and cudaTypedefs.h; these tests check it is
current, check it against a reading of cudaTypedefs.h of their own (a plain regex, not the
generator's parser), and check that the simulated libcuda.so.1 exports exactly the table's
names and that its cuGetProcAddress answers each name the way the real NVIDIA driver does
(rules measured on driver 535).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from gpushare import libs
from tests.conftest import hook_table
from tests.sim.conftest import Proc, driver_answer, run_probe

ROOT = Path(__file__).resolve().parents[2]
GEN_API = ROOT / "sim" / "gen_api.py"
TABLE = ROOT / "sim" / "cuda_api.gen.h"

SIM_ENTRY = re.compile(r'^SIM_ENTRY\((\w+), (\d+), "([iqpsOIfSxh]*)"\)$', re.M)
SIM_PROC = re.compile(r"^SIM_PROC\((\w+), (\w+), (\d+), ([01])\)$", re.M)
PFN_TYPEDEF = re.compile(
    r"\btypedef\s+CUresult\s*\(\s*CUDAAPI\s*\*\s*PFN_(\w+)_v(\d+)(_pt(?:ds|sz))?\s*\)"
)

# cuGetProcAddress results (cuda.h).
SUCCESS = 0
NOT_FOUND = 500  # CUDA_ERROR_NOT_FOUND
DRIVER_VERSION = 13000  # what the simulated driver reports

# Names the table must hold: a parser that matched nothing, or only part of cuda.h, fails.
KNOWN_ENTRIES = {
    "cuGetProcAddress",
    "cuGetProcAddress_v2",
    "cuGetExportTable",
    "cuInit",
    "cuMemAlloc",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuLaunchKernel",
    "cuLaunchKernel_ptsz",
    "cuMemcpyHtoD_v2_ptds",
    "cuStreamGetCaptureInfo_v3",
    "cuLibraryLoadData",
    "cuKernelGetFunction",
    "cuTensorMapEncodeTiled",
    "cuCtxCreate_v4",
    "cuGraphInstantiateWithFlags",
    "cuIpcOpenMemHandle_v2",
}


def table() -> tuple[dict[str, tuple[int, str]], list[Proc]]:
    """The entries (name: nargs, kinds) and proc rows of sim/cuda_api.gen.h."""
    text = TABLE.read_text()
    entries = {name: (int(n), kinds) for name, n, kinds in SIM_ENTRY.findall(text)}
    rows = [Proc(b, a, int(v), p == "1") for b, a, v, p in SIM_PROC.findall(text)]
    return entries, rows


def include_dir() -> Path:
    """The headers the table is made from: the nvidia-cuda-runtime package's."""
    spec = importlib.util.find_spec("nvidia.cu13")
    assert spec is not None and spec.submodule_search_locations, "nvidia-cuda-runtime missing"
    return Path(next(iter(spec.submodule_search_locations))) / "include"


def test_generated_table_is_current() -> None:
    done = subprocess.run(
        [sys.executable, str(GEN_API), "--check"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr


def test_check_fails_on_a_stale_table(tmp_path: Path) -> None:
    stale = tmp_path / "cuda_api.gen.h"
    stale.write_text(TABLE.read_text().replace("SIM_ENTRY(cuInit, ", "SIM_ENTRY(cuInit2, "))
    done = subprocess.run(
        [sys.executable, str(GEN_API), "--check", "--output", str(stale)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 1
    assert "python sim/gen_api.py" in done.stderr
    assert stale.read_text() != TABLE.read_text()  # --check never writes


def test_table_matches_cuda_typedefs() -> None:
    entries, rows = table()
    assert len(entries) >= 500
    assert KNOWN_ENTRIES - entries.keys() == set()
    assert all(len(kinds) == n for n, kinds in entries.values())
    assert list(entries) == sorted(entries)  # strcmp order, for a binary search

    raw = (include_dir() / "cudaTypedefs.h").read_text()
    typedefs = {(b, int(v), bool(pt)) for b, v, pt in PFN_TYPEDEF.findall(raw)}
    assert len(typedefs) >= 500
    procs = {(r.base, r.version, r.per_thread) for r in rows}
    assert len(procs) == len(rows)
    assert procs == typedefs
    assert not {r.abi for r in rows} - entries.keys()
    # Per-thread rows name per-thread functions, the others do not.
    for r in rows:
        assert r.abi.endswith(("_ptds", "_ptsz")) == r.per_thread, r
        assert r.abi == r.base or r.abi.startswith(r.base + "_"), r


def test_known_rows() -> None:
    _, rows = table()
    found = {(r.base, r.version, r.per_thread): r.abi for r in rows}
    assert found[("cuMemAlloc", 2000, False)] == "cuMemAlloc"
    assert found[("cuMemAlloc", 3020, False)] == "cuMemAlloc_v2"
    assert found[("cuLaunchKernel", 7000, True)] == "cuLaunchKernel_ptsz"
    assert found[("cuMemcpyHtoD", 7000, True)] == "cuMemcpyHtoD_v2_ptds"
    assert found[("cuCtxCreate", 12050, False)] == "cuCtxCreate_v4"
    assert found[("cuGetProcAddress", 12000, False)] == "cuGetProcAddress_v2"
    assert found[("cuStreamGetCaptureInfo", 12030, True)] == "cuStreamGetCaptureInfo_v3_ptsz"


def test_hooks_def_lists_every_variant_of_its_names() -> None:
    """The shim's hook table names, for each base name it hooks, exactly the variants the
    headers give it."""
    _, rows = table()
    hooks = {
        (h.base, h.abi, h.version, h.per_thread)
        for h in hook_table()
        if h.kind in ("GS_HOOK", "GS_VARIANT")
    }
    bases = {base for base, _, _, _ in hooks}
    assert len(bases) >= 10
    assert hooks == {(r.base, r.abi, r.version, r.per_thread) for r in rows if r.base in bases}


def test_sim_driver_exports_exactly_the_table() -> None:
    entries, _ = table()
    lib = libs.sim_driver_dir() / "libcuda.so.1"
    listing = subprocess.run(
        ["nm", "-D", "--defined-only", "--format=posix", str(lib)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    functions = set()
    for line in listing.splitlines():
        name, kind = line.split()[:2]
        if kind in ("T", "W", "i"):
            functions.add(name.split("@")[0])
    # The simulator's own (docs/simulator.md) beside cuda.h's, named apart.
    own = {f for f in functions if f.startswith("gpushareSim")}
    assert own == {"gpushareSimCopyCounters", "gpushareSimKernelCounters"}
    functions -= own
    assert sorted(functions - entries.keys()) == [], "exported, not in cuda.h"
    assert sorted(entries.keys() - functions) == [], "in cuda.h, not exported"


def test_no_entry_with_a_float_parameter_is_implemented() -> None:
    """The export layer forwards integer registers and stack words only: a float travels
    in a vector register and would not reach an implementation. The few such entries
    (texture references, cuParamSetf) must stay unimplemented, answering 801."""
    entries, _ = table()
    floats = {name for name, (_, kinds) in entries.items() if "f" in kinds}
    assert "cuTexRefSetMipmapLevelBias" in floats
    listing = subprocess.run(
        ["nm", "--defined-only", str(libs.sim_driver_dir() / "libcuda.so.1")],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    symbols = [line.split()[-1] for line in listing.splitlines()]
    implemented = {
        name.removeprefix("sim_impl_") for name in symbols if name.startswith("sim_impl_")
    }
    assert "cuMemAlloc_v2" in implemented  # the listing shows the implementations
    assert floats & implemented == set()


def _resolve(probe: Path, stdin: str) -> list[str]:
    lines = run_probe(probe, "resolve", stdin).splitlines()
    assert lines[0] == "init 0"
    return lines[1:]


def test_get_proc_address_answers_like_the_driver(sim_probe: Path) -> None:
    _, rows = table()
    by_base: dict[str, list[Proc]] = defaultdict(list)
    for r in rows:
        by_base[r.base].append(r)
    queries: list[tuple[str, int, int]] = []
    for base, mine in sorted(by_base.items()):
        versions = {1000, DRIVER_VERSION, DRIVER_VERSION + 10, 99999}
        versions |= {r.version + d for r in mine for d in (-1, 0, 10)}
        queries += [(base, v, f) for v in sorted(versions) for f in (0, 1, 2)]
    # Names the driver does not have: the empty one ("-" to the probe) and made-up ones.
    for name in ("-", "cuNoSuchThing", "cuInitX"):
        queries += [(name, v, f) for v in (2000, DRIVER_VERSION) for f in (0, 2)]

    stdin = "".join(f"gpa {b} {v} {f}\ngpa1 {b} {v} {f}\n" for b, v, f in queries)
    found: dict[tuple[str, str, int, int], tuple[str, ...]] = {}
    for line in _resolve(sim_probe, stdin):
        kind, got_base, got_version, got_flags, *answer = line.split()
        found[(kind, got_base, int(got_version), int(got_flags))] = tuple(answer)

    expected: dict[tuple[str, str, int, int], tuple[str, ...]] = {}
    for base, version, flags in queries:
        status, abi = driver_answer(by_base.get(base, []), version, flags)
        expected[("gpa", base, version, flags)] = (str(SUCCESS), str(status), abi or "-")
        # v1: a miss is CUDA_ERROR_NOT_FOUND and leaves *pfn as it was.
        v1 = (str(SUCCESS), abi) if abi else (str(NOT_FOUND), "untouched")
        expected[("gpa1", base, version, flags)] = v1
    mismatched = {k: (found.get(k), v) for k, v in expected.items() if found.get(k) != v}
    assert not mismatched, f"{len(mismatched)} answers differ, e.g. " + "; ".join(
        f"{' '.join(map(str, k))}: got {got}, want {want}"
        for k, (got, want) in list(mismatched.items())[:20]
    )
    assert len(found) == len(expected)
    # Every row was the answer to some request, so each one was checked above.
    answered = {answer[-1] for key, answer in expected.items() if key[0] == "gpa"}
    assert answered - {"-"} == {r.abi for r in rows}


@pytest.mark.parametrize("header", ["cuda.h", "cudaTypedefs.h"])
def test_generator_fails_loudly_on_what_it_cannot_read(tmp_path: Path, header: str) -> None:
    """A declaration of a type the generator does not know stops it, naming the type."""
    include = tmp_path / "include"
    include.mkdir()
    for name in ("cuda.h", "cudaTypedefs.h"):
        (include / name).write_text((include_dir() / name).read_text())
    text = (include / header).read_text()
    if header == "cuda.h":
        text = text.replace(
            "CUresult CUDAAPI cuInit(unsigned int Flags);",
            "CUresult CUDAAPI cuInit(CUmysteryType Flags);",
        )
    else:
        text = text.replace(
            "PFN_cuInit_v2000)(unsigned int Flags);", "PFN_cuInit_v2000)(CUmysteryType Flags);"
        )
    assert "CUmysteryType" in text
    (include / header).write_text(text)
    done = subprocess.run(
        [sys.executable, str(GEN_API), "--include", str(include), "--output", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 2
    assert "CUmysteryType" in done.stderr
    assert not (tmp_path / "o").exists()
