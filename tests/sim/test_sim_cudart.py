"""The real CUDA runtime (libcudart 13.0.96, the nvidia-cuda-runtime test dependency) on the
simulated driver, without torch: it starts, allocates, copies real bytes and frees; its
integrity check is computed, not recorded (one flipped bit and cudart refuses with 103);
and the trace mode logs every call, every pointer handed out and every unimplemented entry
point. Each runs in a child process with the simulated driver on LD_LIBRARY_PATH.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpushare import libs
from tests.conftest import CSRC, cc
from tests.sim.conftest import run_sim_json

# cudaError_t values (driver_types.h).
CUDA_SUCCESS = 0
SOFTWARE_VALIDITY_NOT_ESTABLISHED = 103
NODE = "Sim A|GPU-0a1b2c3d-0000-4000-8000-000000000001|4294967296"


def cudart_path() -> Path:
    spec = importlib.util.find_spec("nvidia.cu13")
    assert spec is not None and spec.submodule_search_locations, "nvidia-cuda-runtime missing"
    lib = Path(next(iter(spec.submodule_search_locations))) / "lib" / "libcudart.so.13"
    assert lib.is_file(), lib
    return lib


# What the child does through the runtime; it prints one JSON object.
CUDART_SCRIPT = """
import ctypes, json, sys
rt = ctypes.CDLL(sys.argv[1])
out = {}
n = ctypes.c_int(-1)
out["count"] = [rt.cudaGetDeviceCount(ctypes.byref(n)), n.value]
if out["count"][0] == 0:
    p = ctypes.c_void_p()
    out["malloc"] = rt.cudaMalloc(ctypes.byref(p), 1 << 20)
    data = bytes(range(256)) * 16
    back = ctypes.create_string_buffer(len(data))
    out["h2d"] = rt.cudaMemcpy(p, data, len(data), 1)
    out["memset"] = rt.cudaMemset(ctypes.c_void_p(p.value + len(data)), 0x5A, 64)
    out["d2h"] = rt.cudaMemcpy(back, p, len(data), 2)
    out["same"] = back.raw == data
    tail = ctypes.create_string_buffer(64)
    rt.cudaMemcpy(tail, ctypes.c_void_p(p.value + len(data)), 64, 2)
    out["memset_bytes"] = tail.raw == b"\\x5a" * 64
    free_b, total_b = ctypes.c_size_t(), ctypes.c_size_t()
    out["meminfo"] = [rt.cudaMemGetInfo(ctypes.byref(free_b), ctypes.byref(total_b)),
                      free_b.value, total_b.value]
    out["free"] = rt.cudaFree(p)
    out["free_null"] = rt.cudaFree(None)
print(json.dumps(out))
"""


def run_cudart(env_extra: dict[str, str], library_path: str) -> dict[str, object]:
    return run_sim_json(
        [sys.executable, "-c", CUDART_SCRIPT, str(cudart_path())],
        library_path,
        {**env_extra, "GPUSHARE_SIM_GPUS": NODE},
    )


def test_real_cudart_allocates_copies_and_frees() -> None:
    out = run_cudart({}, str(libs.sim_driver_dir()))
    assert out["count"] == [CUDA_SUCCESS, 1]
    assert out["malloc"] == CUDA_SUCCESS
    assert out["h2d"] == out["d2h"] == out["memset"] == CUDA_SUCCESS
    assert out["same"] is True
    assert out["memset_bytes"] is True
    meminfo = out["meminfo"]
    assert isinstance(meminfo, list)
    rc, free_b, total_b = meminfo
    assert rc == CUDA_SUCCESS and total_b == 4 << 30
    assert total_b - free_b >= 1 << 20  # the 1 MiB allocation is taken from the device
    assert out["free"] == CUDA_SUCCESS
    assert out["free_null"] == CUDA_SUCCESS


@pytest.fixture(scope="module")
def flip_driver_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/c/integrity_flip.c as a libcuda.so.1 of its own, in front of the simulated one."""
    d = tmp_path_factory.mktemp("flip")
    cc(
        d / "libcuda.so.1",
        "-shared",
        "-fPIC",
        "-Wl,-soname,libcuda.so.1",
        str(CSRC / "integrity_flip.c"),
        "-ldl",
    )
    return d


@pytest.mark.parametrize("flip", [False, True])
def test_integrity_check_is_computed_one_bit_makes_cudart_refuse(
    flip_driver_dir: Path, flip: bool
) -> None:
    """The same wrapper both ways: unflipped, cudart accepts the driver's answer (so the
    wrapper changes nothing else); one bit flipped, cudart refuses with exactly 103."""
    out = run_cudart(
        {
            "SIM_DRIVER": str(libs.sim_driver_dir() / "libcuda.so.1"),
            "FLIP_BIT": "1" if flip else "0",
        },
        f"{flip_driver_dir}:{libs.sim_driver_dir()}",
    )
    count_answer = out["count"]
    assert isinstance(count_answer, list)
    rc, count = count_answer
    if flip:
        assert rc == SOFTWARE_VALIDITY_NOT_ESTABLISHED
    else:
        assert (rc, count) == (CUDA_SUCCESS, 1)
        assert out["same"] is True


def test_trace_logs_calls_pointers_tables_and_unimplemented_calls(tmp_path: Path) -> None:
    trace = tmp_path / "trace"
    out = run_cudart({"GPUSHARE_SIM_TRACE": str(trace)}, str(libs.sim_driver_dir()))
    assert out["same"] is True
    lines = trace.read_text().splitlines()
    pid = {line.split()[0] for line in lines}
    assert len(pid) == 1 and pid.pop().isdigit()
    text = "\n".join(lines)
    # Every call with its return code; out values after "->".
    assert re.search(r" cuInit\(0\) = 0$", text, re.M)
    assert re.search(r' cuGetProcAddress_v2\("cuMemAlloc", 0x[0-9a-f]+->0x[0-9a-f]+, ', text)
    assert re.search(r" cuMemAlloc_v2\(0x[0-9a-f]+->0x[0-9a-f]+, 0x100000\) = 0$", text, re.M)
    # Export tables: the UUID asked for, every slot handed out, and the slots' own calls.
    assert "  table D4082055-BDE6-704B-8D34-BA123C66E1F2" in text
    assert re.search(r"  integrity\[1\] = 0x[0-9a-f]+", text)
    assert re.search(r" integrity\[1\]\(13002, \d+, 0x[0-9a-f]+->\{0x", text)
    assert re.search(r" cudart_interface\[2\]\(", text)


UNIMPLEMENTED = """
import ctypes, sys
cu = ctypes.CDLL(sys.argv[1])
assert cu.cuInit(0) == 0
# Graphics interop is not simulated: a clear CUDA_ERROR_NOT_SUPPORTED, no crash.
print(cu.cuGraphicsUnregisterResource(ctypes.c_void_p(0x1234)),
      cu.cuTexRefSetAddress_v2(None, None, ctypes.c_uint64(0), ctypes.c_size_t(0)))
"""


def test_unimplemented_entry_points_answer_not_supported_in_the_trace(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env["GPUSHARE_SIM_TRACE"] = str(tmp_path / "trace")
    run = subprocess.run(
        [sys.executable, "-c", UNIMPLEMENTED, str(libs.sim_driver_dir() / "libcuda.so.1")],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )
    assert run.stdout.split() == ["801", "801"]
    text = (tmp_path / "trace").read_text()
    assert re.search(r" cuGraphicsUnregisterResource\(0x1234\) = 801$", text, re.M)
    assert re.search(r" cuTexRefSetAddress_v2\(0, 0, 0, 0\) = 801$", text, re.M)
