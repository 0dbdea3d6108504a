"""The real-PyTorch tier: the pinned PyTorch (and the real CUDA runtime under it) on the
simulated driver, with no shim: LD_LIBRARY_PATH is the simulated driver's directory, no
LD_PRELOAD, GPUSHARE_SIM_GPUS a small node of two GPUs.

`make test` makes the torch venv (.venv-torch, once) and names its Python in
GPUSHARE_TEST_TORCH_PYTHON. Unset (a plain `pytest`), the tier skips and says so; set to a
Python that is missing or lacks the pinned torch, every test here fails.

The cases themselves are in tests/real_torch/torch_cases.py, which runs under that Python. Each
allocator mode (PYTORCH_CUDA_ALLOC_CONF: native, expandable segments, cudaMallocAsync)
runs all its cases in one process, since torch's import and CUDA start-up cost seconds a
process (a process that dies or hangs is resumed after the case it died in). A case that
failed there, or died, runs again in a process of its own and that run is its verdict, so
no case is failed by another's crash or sticky CUDA error. Every case is its own test,
here, with the expectations; a case that raised fails with its error and traceback.

The simulated driver executes no kernels: results kernels would compute are never
compared, only what copies and memsets wrote. The tier also builds and runs
tests/c/cudart_kernel.cu with nvcc against the pinned CUDA runtime.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gpushare import libs
from nodemgr.host.gpus import Gpu, sim_spec, simulated_uuid

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CASES_SCRIPT = HERE / "torch_cases.py"
KERNEL_SRC = HERE.parent / "c" / "cudart_kernel.cu"

TORCH_VERSION = "2.14.1"  # the Makefile's TORCH_VERSION (test_pin_matches_the_makefile)
TORCH_CUDA = "13.0"
CUDART_VERSION = "13.0.96"  # nvidia-cuda-runtime, the project's test dependency
NVCC_PACKAGES = ["nvidia-cuda-nvcc==13.0.88", "nvidia-cuda-crt==13.0.88", "nvidia-nvvm==13.0.88"]
PYTHON_ENV = "GPUSHARE_TEST_TORCH_PYTHON"

TestFn = Callable[..., None]
GIB = 1 << 30
MIB = 1 << 20
# Two GPUs of different sizes, so that a property read from the wrong device shows.
NODE = [
    Gpu(0, simulated_uuid(0), "gpushare Sim GPU A", 4 * GIB),
    Gpu(1, simulated_uuid(1), "gpushare Sim GPU B", 6 * GIB),
]
SIM_CAPABILITY = (9, 0)  # what the simulated driver reports (H100-like)

MODES = {
    "native": None,
    "expandable": "expandable_segments:True",
    "async": "backend:cudaMallocAsync",
}
ALL = tuple(MODES)
# Each case and the allocator modes it runs in: those where the allocator takes part.
CASES: dict[str, tuple[str, ...]] = {
    "device": ("native",),
    "copy_roundtrip": ALL,
    "copy_d2d": ALL,
    "copy_peer": ALL,
    "copy_noncontiguous": ALL,
    "copy_pinned": ALL,
    "mem_get_info": ALL,
    "oom": ALL,
    "graph": ALL,
    "events": ("native",),
    "dataloader": ("native",),
    "spawn": ("native",),
    "ipc": ALL,  # shared by the native allocator and expandable segments; async refuses
    "train": ALL,
    "matmul": ("native",),
    "linear": ("native",),
}
# Time limits: the script's own per case (it dumps its stacks and exits), and each process's.
CASE_TIMEOUT = 30.0
GROUP_TIMEOUT = 300.0  # one mode's cases in one process
SOLO_TIMEOUT = CASE_TIMEOUT + 30.0  # one case in a process of its own
SOLO_PARALLEL = max(2, min(4, len(os.sched_getaffinity(0)) // 2))  # re-runs at a time
# The first test of a mode runs all its cases (a process resumed after a case that hangs,
# then re-runs alone): more than the suite's per-test limit.
pytestmark = pytest.mark.timeout(3 * GROUP_TIMEOUT)


TEST_CASES: dict[str, str] = {}  # test function name -> the case it checks


def torch_case(case: str) -> Callable[[TestFn], TestFn]:
    """Makes a test the check of one case, parametrized over the case's modes."""

    def mark(fn: TestFn) -> TestFn:
        TEST_CASES[fn.__name__] = case
        modes = [pytest.param(m, id=m) for m in CASES[case]]
        marked: TestFn = pytest.mark.parametrize("mode", modes)(fn)
        return marked

    return mark


def torch_env(mode: str | None) -> dict[str, str]:
    """The environment of a process on the simulated node: no shim, no gpushare, nothing
    of the caller's torch or allocator settings."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("GPUSHARE_", "PYTORCH_", "TORCH_"))
        and k not in ("LD_PRELOAD", "PYTHONPATH", "PYTHONHOME", "CUDA_VISIBLE_DEVICES")
    }
    env["LD_LIBRARY_PATH"] = str(libs.sim_driver_dir())
    env["GPUSHARE_SIM_GPUS"] = sim_spec(NODE)
    env["PYTHONUNBUFFERED"] = "1"
    env["TORCH_CASES_TIMEOUT"] = str(CASE_TIMEOUT)
    if trace := os.environ.get("GPUSHARE_SIM_TRACE"):
        env["GPUSHARE_SIM_TRACE"] = trace  # the simulated driver's call log, when asked for
    if mode is not None and MODES[mode] is not None:
        env["PYTORCH_CUDA_ALLOC_CONF"] = str(MODES[mode])
    return env


@dataclass
class Ran:
    """One process's run: its exit status (None: killed at the timeout), output, time."""

    rc: int | None
    stdout: str
    stderr: str
    seconds: float
    results: dict[str, dict[str, Any]] = field(default_factory=dict)


def run_process(argv: list[str], env: dict[str, str], timeout: float, cwd: Path) -> Ran:
    """Runs argv in a session of its own, output to files (a spawned grandchild that lives
    on cannot hold a pipe open), and kills whatever of its session is left afterwards."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        started = time.monotonic()
        proc = subprocess.Popen(
            argv, env=env, cwd=cwd, stdout=out, stderr=err, start_new_session=True
        )
        rc: int | None
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        seconds = time.monotonic() - started
        out.seek(0)
        err.seek(0)
        ran = Ran(rc, out.read(), err.read(), seconds)
    for line in ran.stdout.splitlines():
        if line.startswith("@@case "):
            result = json.loads(line.removeprefix("@@case "))
            ran.results[result["case"]] = result
    return ran


def tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


# Set-up -------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def torch_python() -> str:
    """The torch venv's Python, checked: the tier skips without one named, and fails when
    the one named is missing or holds another torch."""
    path = os.environ.get(PYTHON_ENV)
    if not path:
        pytest.skip(
            f"{PYTHON_ENV} is unset: the real-PyTorch tier runs under `make test`, which "
            f"makes the pinned torch {TORCH_VERSION} venv (.venv-torch) and sets it"
        )
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        pytest.fail(f"{PYTHON_ENV}={path}: no such Python (run `make torch-env`)")
    p = subprocess.run(
        [path, str(CASES_SCRIPT), "--versions"],
        capture_output=True,
        text=True,
        timeout=120,
        env=torch_env(None),
    )
    if p.returncode != 0:
        pytest.fail(f"{PYTHON_ENV}={path} cannot import torch:\n{tail(p.stderr)}")
    versions = json.loads(p.stdout.strip().splitlines()[-1])
    if versions["torch"].split("+")[0] != TORCH_VERSION or versions["cuda"] != TORCH_CUDA:
        pytest.fail(
            f"{PYTHON_ENV}={path} has torch {versions['torch']} (CUDA {versions['cuda']}), "
            f"not the pinned {TORCH_VERSION} (CUDA {TORCH_CUDA}): `make torch-env` makes it"
        )
    return path


class Runner:
    """Runs the cases: one process per allocator mode, resumed after a case that killed or
    hung it; then each case that failed or died there, unless it was alone in its process,
    once more in a process of its own (several at a time), whose result is the case's."""

    def __init__(self, python: str, workdir: Path, wanted: set[tuple[str, str]]) -> None:
        self.python = python
        self.workdir = workdir
        self.wanted = wanted  # (case, mode) of the tests selected
        self.grouped: dict[str, dict[str, dict[str, Any]]] = {}
        self.seconds: dict[str, float] = {}
        # The run each case's verdict comes from: its group's, or its own.
        self.runs: dict[tuple[str, str], Ran] = {}
        self.solos: set[tuple[str, str]] = set()

    def _run(self, mode: str, cases: list[str], timeout: float) -> Ran:
        return run_process(
            [self.python, str(CASES_SCRIPT), *cases], torch_env(mode), timeout, self.workdir
        )

    def _run_mode(self, mode: str) -> None:
        results: dict[str, dict[str, Any]] = {}
        pending = [c for c in CASES if (c, mode) in self.wanted]
        alone: set[str] = set()
        seconds = 0.0
        while pending:
            ran = self._run(mode, pending, GROUP_TIMEOUT)
            seconds += ran.seconds
            results.update(ran.results)
            self.runs.update(((c, mode), ran) for c in pending)
            if len(pending) == 1:
                alone.add(pending[0])
            missing = [c for c in pending if c not in ran.results]
            if not missing:
                break
            state = "timed out" if ran.rc is None else f"exited {ran.rc}"
            results[missing[0]] = {"ok": False, "error": f"its process {state}"}
            pending = missing[1:]
        self.grouped[mode] = results
        self.seconds[mode] = seconds
        again = [c for c, r in results.items() if not r["ok"] and c not in alone]
        with ThreadPoolExecutor(max_workers=SOLO_PARALLEL) as pool:
            runs = pool.map(lambda c: self._run(mode, [c], SOLO_TIMEOUT), again)
            for c, ran in zip(again, runs, strict=True):
                self.runs[c, mode] = ran
                self.solos.add((c, mode))

    def result(self, case: str, mode: str) -> dict[str, Any]:
        if mode not in self.grouped:
            self._run_mode(mode)
        grouped = self.grouped[mode][case]
        if grouped["ok"]:
            return grouped
        ran = self.runs[case, mode]
        result = ran.results.get(case)
        state = "timed out" if ran.rc is None else f"exited {ran.rc}"
        error = result["error"] if result else f"its process {state}"
        others = ""
        if (case, mode) in self.solos and grouped["error"] != error:
            others = f"\n(run with the other cases: {grouped['error']})"
        if result is None:
            pytest.fail(
                f"{case} [{mode}]: its process {state} after {ran.seconds:.1f}s without a "
                f"result{others}\nstderr:\n{tail(ran.stderr)}",
                pytrace=False,
            )
        if not result["ok"]:
            pytest.fail(
                f"{case} [{mode}] raised {result['error']}{others}\n"
                f"{result['traceback']}\nstderr:\n{tail(ran.stderr, 20)}",
                pytrace=False,
            )
        # Failed among the others only: said in the captured output, not hidden.
        print(f"{case} [{mode}] failed with the other cases ({grouped['error']}), passed alone")
        return result

    def value(self, case: str, mode: str) -> Any:
        return self.result(case, mode)["value"]


@pytest.fixture(scope="module")
def cases(
    request: pytest.FixtureRequest, torch_python: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Runner]:
    # Only the cases of the tests selected run (-k, a node id, ...).
    wanted = {
        (TEST_CASES[item.originalname], str(item.callspec.params["mode"]))
        for item in request.session.items
        if isinstance(item, pytest.Function)
        and item.module is request.module
        and item.originalname in TEST_CASES
    }
    runner = Runner(torch_python, tmp_path_factory.mktemp("torch-cases"), wanted)
    yield runner
    # Where the time went (shown with -rA or -s).
    for mode, results in runner.grouped.items():
        each = ", ".join(f"{c} {r.get('seconds', '-')}" for c, r in results.items())
        print(f"torch cases [{mode}]: {runner.seconds[mode]:.1f}s ({each})")
    for case, mode in sorted(runner.solos):
        print(f"torch case {case} [{mode}] again alone: {runner.runs[case, mode].seconds:.1f}s")


def assert_equal(compared: dict[str, Any], what: str) -> None:
    assert compared["equal"], f"{what}: bytes differ, first at index {compared['first_mismatch']}"


# The pin ------------------------------------------------------------------------------


def test_pin_matches_the_makefile() -> None:
    made = re.search(r"^TORCH_VERSION\s*:?=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M)
    assert made is not None and made.group(1) == TORCH_VERSION


# Devices ------------------------------------------------------------------------------


@torch_case("device")
def test_device_discovery_and_properties(cases: Runner, mode: str) -> None:
    v = cases.value("device", mode)
    assert v["nvml_count"] == len(NODE), "NVML's device count (torch before CUDA init)"
    assert v["available"] is True
    assert v["count"] == len(NODE)
    for gpu, dev in zip(NODE, v["devices"], strict=True):
        assert dev["name"] == gpu.name
        assert dev["total_memory"] == gpu.memory
        assert (dev["major"], dev["minor"]) == SIM_CAPABILITY
        assert tuple(dev["capability"]) == SIM_CAPABILITY
        hex_uuid = gpu.uuid.removeprefix("GPU-").replace("-", "")
        assert hex_uuid in dev["uuid"].replace("-", "").lower()


# Copies -------------------------------------------------------------------------------


@torch_case("copy_roundtrip")
def test_copy_host_device_host(cases: Runner, mode: str) -> None:
    v = cases.value("copy_roundtrip", mode)
    assert set(v) == {"1", "4097", str(3 * MIB + 123), str(64 * MIB), "float32"}
    for what, compared in v.items():
        assert_equal(compared, f"{what} bytes CPU->GPU->CPU")


@torch_case("copy_d2d")
def test_copy_device_to_device(cases: Runner, mode: str) -> None:
    v = cases.value("copy_d2d", mode)
    for what in ("clone", "copy_", "offset"):
        assert_equal(v[what], what)


@torch_case("copy_peer")
def test_copy_between_devices(cases: Runner, mode: str) -> None:
    v = cases.value("copy_peer", mode)
    assert v["devices"] == ["cuda:0", "cuda:1", "cuda:0"]
    assert_equal(v["to_1"], "cuda:0 -> cuda:1")
    assert_equal(v["back_to_0"], "cuda:1 -> cuda:0")


@torch_case("copy_noncontiguous")
def test_copy_noncontiguous(cases: Runner, mode: str) -> None:
    v = cases.value("copy_noncontiguous", mode)
    assert v["source_contiguous"] == [False, False]
    for what in ("transposed", "strided_rows", "row_slice"):
        assert_equal(v[what], what)


@torch_case("copy_pinned")
def test_copy_pinned(cases: Runner, mode: str) -> None:
    v = cases.value("copy_pinned", mode)
    assert v["pinned"] == [True, True]
    assert_equal(v["default_stream"], "pinned, non-blocking, default stream")
    assert_equal(v["side_stream"], "pinned, non-blocking, side stream")


# Memory -------------------------------------------------------------------------------


@torch_case("mem_get_info")
def test_mem_get_info(cases: Runner, mode: str) -> None:
    v = cases.value("mem_get_info", mode)
    free0, total0, reserved0 = v["before"]
    free1, total1, reserved1 = v["holding_1gib"]
    assert total0 == total1 == NODE[0].memory
    assert v["device1"][1] == NODE[1].memory
    assert 0 < v["device1"][0] <= NODE[1].memory
    assert 0 < free0 <= total0
    # 1 GiB taken, rounded up at most to the allocator's granule (expandable segments
    # map whole pages of a few MiB; a pool may round up too).
    assert GIB <= free0 - free1 <= GIB + 64 * MIB, (free0, free1)
    assert v["after_free"] == free0, "empty_cache gave back all it took"
    assert total0 - free0 >= reserved0, "the device counts what the allocator holds"
    if mode != "async":  # the caching allocator's own count moved by what the device's did
        assert free0 - free1 == reserved1 - reserved0, (free0, free1, reserved0, reserved1)


@torch_case("oom")
def test_out_of_memory_at_the_device_size(cases: Runner, mode: str) -> None:
    v = cases.value("oom", mode)
    assert v["size"] == NODE[0].memory
    error = v["error"]
    assert error is not None, "2 GiB more fit beside 3 GiB on a 4 GiB device"
    assert error["is_oom"], f"not torch.OutOfMemoryError: {error['type']}: {error['message']}"
    assert v["free_at_oom"] < NODE[0].memory // 2
    assert_equal(v["after_free"], "an allocation after the OOM and a free")


# Graphs and events --------------------------------------------------------------------


@torch_case("graph")
def test_cuda_graph_capture_and_replay(cases: Runner, mode: str) -> None:
    v = cases.value("graph", mode)
    assert v["replays"] == 3
    assert_equal(v["static_in"], "copy into the graph's static input")
    assert v["out_shape"] == [4096]
    assert v["sum_shape"] == []
    assert v["out_device"] == "cuda:0"


@torch_case("events")
def test_events(cases: Runner, mode: str) -> None:
    v = cases.value("events", mode)
    assert v["elapsed_type"] == "float"
    assert v["elapsed_ms"] >= 0.0
    assert v["end_query"] is True
    assert v["plain_query"] is True
    assert v["stream_query"] is True
    assert_equal(v["copy"], "copy between the timing events")


# Data loading and processes ------------------------------------------------------------


@torch_case("dataloader")
def test_dataloader_workers_and_pinned_memory(cases: Runner, mode: str) -> None:
    v = cases.value("dataloader", mode)
    assert v["batches"] == 12
    assert v["all_pinned"] is True
    assert v["on_cuda"] is True
    assert_equal(v["x"], "inputs through the loader and the GPU")
    assert_equal(v["y"], "labels through the loader and the GPU")


@torch_case("spawn")
def test_spawned_child_uses_cuda(cases: Runner, mode: str) -> None:
    v = cases.value("spawn", mode)
    assert_equal(v["parent"], "the parent's copy before the spawn")
    child = v["child"]
    assert child["ok"], child["error"]
    assert child["values"] == v["values"]
    assert child["count"] == len(NODE)
    assert child["name"] == NODE[0].name
    assert child["pid"] != v["parent_pid"]
    assert v["exitcode"] == 0


@torch_case("ipc")
def test_cuda_tensor_to_another_process(cases: Runner, mode: str) -> None:
    v = cases.value("ipc", mode)
    if mode == "async":
        # torch refuses IPC for cudaMallocAsync memory, plainly, in the sender.
        refused = v["refused"]
        assert refused is not None, "torch shared a cudaMallocAsync tensor"
        assert refused["type"] == "RuntimeError"
        assert "cudaMallocAsync does not yet support shareIpcHandle" in refused["message"]
        return
    # The caching allocator shares the block (cudaIpcGetMemHandle); expandable segments
    # export the pages' handles (cuMemExportToShareableHandle, a POSIX file descriptor).
    assert v["refused"] is None, v["refused"]
    assert v["child"]["ok"], v["child"]["error"]
    assert v["child"]["device"] == "cuda:0"
    assert v["equal"], "the child read other values than the sender's"
    assert v["exitcode"] == 0


# Training and cuBLAS ------------------------------------------------------------------


@torch_case("train")
def test_linear_sgd_loop_runs(cases: Runner, mode: str) -> None:
    v = cases.value("train", mode)
    # The losses are what unexecuted kernels leave: counted, not judged.
    assert v["steps"] == 5
    assert len(v["losses"]) == 5
    assert all(isinstance(x, float) for x in v["losses"])
    assert v["params_on_cuda"] is True
    assert v["grad_shapes_match"] is True


@torch_case("matmul")
def test_matmul_cublas(cases: Runner, mode: str) -> None:
    v = cases.value("matmul", mode)
    assert v["shapes"] == [[128, 32], [128, 32], [4, 32, 32]]
    assert v["dtypes"] == ["torch.float32", "torch.float16", "torch.float32"]
    assert v["devices"] == ["cuda:0"] * 3


@torch_case("linear")
def test_linear_forward_backward(cases: Runner, mode: str) -> None:
    v = cases.value("linear", mode)
    assert v["y_shape"] == [16, 32]
    assert v["grad_shapes"] == [[32, 64], [32], [16, 64]]
    assert v["grads_on_cuda"] is True


# A CUDA runtime program built with nvcc -----------------------------------------------


def pinned_cudart_dir() -> Path:
    """The lib directory of the project's nvidia-cuda-runtime, the pinned version."""
    dist = importlib.metadata.distribution("nvidia-cuda-runtime")
    assert dist.version == CUDART_VERSION, f"nvidia-cuda-runtime {dist.version} is installed"
    for f in dist.files or []:
        if f.name == "libcudart.so.13":
            return Path(str(dist.locate_file(f))).resolve().parent
    pytest.fail(f"nvidia-cuda-runtime {dist.version} has no libcudart.so.13")


def nvcc_release(nvcc: str) -> str | None:
    try:
        p = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
    except OSError:
        return None
    found = re.search(r"release (\d+\.\d+)", p.stdout)
    return found.group(1) if found else None


def find_nvcc(torch_python: str) -> str:
    """An nvcc of the pinned runtime's 13.0 line: PATH's, else the torch venv's, else pip's
    nvidia-cuda-nvcc installed into the torch venv now (once)."""
    on_path = shutil.which("nvcc")
    if on_path and nvcc_release(on_path) == TORCH_CUDA:
        return on_path
    p = subprocess.run(
        [torch_python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    venv_nvcc = Path(p.stdout.strip()) / "nvidia" / "cu13" / "bin" / "nvcc"
    if not venv_nvcc.is_file():
        why = f"nvcc on PATH is release {nvcc_release(on_path)}" if on_path else "no nvcc on PATH"
        print(f"{why}: installing {' '.join(NVCC_PACKAGES)} into the torch venv")
        p = subprocess.run(
            [torch_python, "-m", "pip", "install", "-q", *NVCC_PACKAGES],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if p.returncode != 0 or not venv_nvcc.is_file():
            pytest.fail(
                f"{why}, and pip could not install {' '.join(NVCC_PACKAGES)} into the torch "
                f"venv (exit {p.returncode}):\n{tail(p.stderr)}",
                pytrace=False,
            )
    if nvcc_release(str(venv_nvcc)) != TORCH_CUDA:
        pytest.fail(f"{venv_nvcc} is not CUDA {TORCH_CUDA}'s nvcc", pytrace=False)
    return str(venv_nvcc)


@pytest.fixture(scope="session")
def cudart_kernel(torch_python: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/c/cudart_kernel.cu built with nvcc against the pinned runtime, shared."""
    nvcc = find_nvcc(torch_python)
    cudart = pinned_cudart_dir()
    out = tmp_path_factory.mktemp("cudart-kernel")
    # The wheel ships libcudart.so.13 alone; `-cudart shared` links -lcudart, which finds
    # this link (first on the -L list) and so the pinned library, whatever nvcc ships.
    (out / "libcudart.so").symlink_to(cudart / "libcudart.so.13")
    exe = out / "cudart_kernel"
    p = subprocess.run(
        [
            nvcc,
            "-arch=sm_90",  # the simulated devices' compute capability
            "-cudart",
            "shared",
            f"-L{out}",
            f"-L{cudart}",  # libcudadevrt.a, for a pip-installed nvcc
            "-Xlinker",
            f"-rpath={cudart}",
            "-o",
            str(exe),
            str(KERNEL_SRC),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, f"nvcc failed:\n{p.stdout}{p.stderr}"
    return exe


# Its fixture may install nvcc into the torch venv (600 s at most) and build (300 s).
@pytest.mark.timeout(1200)
def test_cudart_program_built_with_nvcc(cudart_kernel: Path) -> None:
    env = torch_env(None)
    ldd = subprocess.run(
        ["ldd", str(cudart_kernel)], capture_output=True, text=True, env=env, timeout=120
    )
    linked = [line for line in ldd.stdout.splitlines() if "libcudart" in line]
    assert len(linked) == 1 and str(pinned_cudart_dir()) in linked[0], ldd.stdout
    p = subprocess.run([str(cudart_kernel)], capture_output=True, text=True, env=env, timeout=60)
    steps = dict(re.findall(r"^(\w+) err=(-?\d+) ", p.stdout, re.M))
    expected = [
        "cudaRuntimeGetVersion",
        "cudaGetDeviceCount",
        "cudaSetDevice",
        "cudaMalloc",
        "cudaMalloc2",
        "cudaMemset",
        "cudaMemcpyD2H_memset",
        "launch",
        "cudaDeviceSynchronize",
        "cudaMemcpyH2D",
        "cudaMemcpyD2D",
        "cudaMemcpyD2H",
        "cudaFree",
        "cudaFree2",
    ]
    failed = {k: v for k, v in steps.items() if v != "0"}
    assert list(steps) == expected and not failed, f"failed steps {failed}:\n{p.stdout}{p.stderr}"
    assert f"device_count {len(NODE)}" in p.stdout
    # The copies' bytes (never the kernel's: it does not run on the simulator).
    assert re.search(r"^cudaMemcpyD2H_memset err=0 .* match=1$", p.stdout, re.M), p.stdout
    assert re.search(r"^cudaMemcpyD2H err=0 .* match=1$", p.stdout, re.M), p.stdout
    assert p.returncode == 0 and "result ok" in p.stdout, p.stdout
