"""The logic of the GPU benchmarks (benchmarks/gpu_timeslice_bench.py, benchmarks/gpu_bench.py)
proven without a GPU: how the time-slicing benchmark sizes its jobs and quota from the GPU's
memory, and what the launch-rate benchmark records of each run (the whole benchmark run on the
simulated driver, with a fake torch)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # last, as the benchmarks do: installed gpushare wins
from benchmarks import gpu_timeslice_bench as ts  # noqa: E402
from benchmarks import harness  # noqa: E402
from nodemgr.host import procfs  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20

# NVML's total of GPUs of several sizes: 16 GiB, 24 GB, 40 GB and 80 GB (A100), the H200.
GPU_TOTALS = [16 * GiB, 24_576 * MiB, 40_960 * MiB, 81_920 * MiB, 143_771 * MiB]


@pytest.mark.parametrize("total", GPU_TOTALS)
def test_one_job_fits_its_quota_and_two_quotas_do_not_fit_the_gpu(total: int) -> None:
    plan = ts.plan_job(total)
    assert plan.gpu_total == total
    assert plan.batch > 0 and plan.batch % ts.ROW_STEP == 0
    # alone: the job's modelled peak, with room to spare, within its quota within the GPU
    assert plan.peak <= plan.quota * ts.FILL
    assert plan.quota < total
    # shared: nodemgr must refuse a second job, its quota does not fit beside the first's
    assert 2 * plan.quota > total
    # time-sliced: both fit when each states its shape plus the margin
    assert ts.timesliced_charge(plan) <= total
    # a job worth sharing: its temporary memory is most of what it uses
    assert plan.temporary > plan.persistent


def test_the_h200_job_is_what_ran_there_and_fits_where_the_fixed_one_did_not() -> None:
    """The H200 (143,771 MiB): the fixed 60 GiB quota was too small for a job that took
    about 63 GiB with PyTorch 2.11; the plan gives the quota room beyond that."""
    measured = 15_760_000_000 + 51_500_000_000  # settled + temporary peak, 2^20 rows, 2 GiB
    plan = ts.plan_job(143_771 * MiB)
    assert plan.quota > 60 * GiB
    assert plan.quota >= measured * plan.batch / 2**20 * 1.1
    assert 2**20 * 0.9 <= plan.batch <= 2**20 * 1.1  # about the job measured


def test_the_model_is_not_below_what_was_measured() -> None:
    persistent, temporary = ts.job_shape(2**20, 2 * GiB)
    assert persistent >= 15_760_000_000
    assert temporary >= 51_500_000_000


def test_a_gpu_too_small_is_refused_with_its_size() -> None:
    with pytest.raises(harness.BenchError, match="a GPU of 1024 MiB is too small"):
        ts.plan_job(1 * GiB)


# --- the launch-rate benchmark's records of each run, on the simulated driver ---------------

# A stand-in for the little of torch gpu_bench's measuring program uses: x.add_(1) is one
# cuLaunchKernel through the simulated driver (the stand-in torch's launch), so that under
# gpushare-run the shim counts it as it counts a real torch's.
FAKE_TORCH = """
import importlib.util, os, sys, time
# Each process that imports this torch adds a line to GPUSHARE_TEST_COUNT (if set); the Nth
# fails if GPUSHARE_TEST_FAIL_AT=N, or waits until its parent is gone if GPUSHARE_TEST_HOLD_AT=N.
if os.environ.get("GPUSHARE_TEST_COUNT"):
    with open(os.environ["GPUSHARE_TEST_COUNT"], "a+") as f:
        f.write(f"{{os.getpid()}}\\n")
        f.seek(0)
        nth = str(len(f.read().splitlines()))
    if nth == os.environ.get("GPUSHARE_TEST_FAIL_AT"):
        sys.exit("fake torch: failing as told")
    if nth == os.environ.get("GPUSHARE_TEST_HOLD_AT"):
        parent = os.getppid()
        while os.getppid() == parent:
            time.sleep(0.05)
        sys.exit("fake torch: held until its parent ended")
spec = importlib.util.spec_from_file_location("torch.cuda", {cuda!r})
cuda = importlib.util.module_from_spec(spec)
sys.modules["torch.cuda"] = cuda
spec.loader.exec_module(cuda)
cuda.is_available = lambda: True
cuda.get_device_name = lambda index=0: "Simulated for gpu_bench"
__version__ = "0.0-gpu-bench-test"

class version:
    cuda = "sim"

class _Tensor:
    def add_(self, value):
        cuda.launch()
        return self

def zeros(*shape, device=None):
    return _Tensor()

def set_num_threads(n):
    pass
"""


@pytest.fixture
def fake_torch_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """This Python with the fake torch first on its path and the simulated driver (4 GPUs,
    as the benchmark's nodemgr below simulates them) for runs with and without the shim."""
    from gpushare import libs
    from nodemgr.config import Config
    from nodemgr.host import gpus

    pkg = tmp_path / "fake" / "torch"
    pkg.mkdir(parents=True)
    standin = ROOT / "tests" / "fixtures" / "standin" / "torch" / "cuda.py"
    (pkg / "__init__.py").write_text(FAKE_TORCH.format(cuda=str(standin)))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))
    monkeypatch.setenv("LD_LIBRARY_PATH", str(libs.sim_driver_dir()))
    config = Config(tmp_path / "unused.toml", tmp_path / "unused-run")
    monkeypatch.setenv("GPUSHARE_SIM_GPUS", gpus.sim_spec(gpus.simulated(config)))
    return sys.executable


def test_each_run_is_recorded_with_what_could_explain_it(
    fake_torch_python: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gpu_bench's whole run (--quick, launch_rate) with nodemgr on simulated GPUs instead of
    NVML's: every measuring run's record is in the document, with the shim's trace of the
    runs under gpushare-run (every launch counted, no wait for the pause word), the CPUs
    it ran on (pinned, nodemgr elsewhere), its resource use, nodemgr's CPU time, other
    processes' CPU use, and no GPU figures where NVML has none."""
    import benchmarks.nodemgr_bench as nb
    from benchmarks import gpu_bench

    real_daemon = nb.daemon

    def simulated_daemon(cpus: set[int] | None = None, **config: Any) -> Any:
        assert config == {"gpus": {"source": "nvml"}}
        return real_daemon(cpus)  # nodemgr_bench's simulated GPUs, as the fake torch sees

    monkeypatch.setattr(nb, "daemon", simulated_daemon)
    out = tmp_path / "gpu.json"
    argv = ["--quick", "--only", "launch_rate", "--python", fake_torch_python, "--out", str(out)]
    assert gpu_bench.main(argv) == 0
    doc = json.loads(out.read_text())
    lr = doc["benchmarks"]["launch_rate"]
    assert lr["target"] == {"metric": "ratio", "op": ">=", "value": 0.995}
    assert len(lr["with_shim_per_s"]) == len(lr["without_shim_per_s"]) == 2
    assert isinstance(lr["slow_runs"], list)
    runs = doc["runs"]
    # the warm-up (with the shim, not counted), then two pairs, the side going first alternating
    assert [(r["order"], r["pair"], r["shim"]) for r in runs] == [
        (0, 0, True), (1, 1, False), (2, 1, True), (3, 2, True), (4, 2, False)
    ]  # fmt: skip
    pins = gpu_bench.pin_cpus(os.sched_getaffinity(0))
    pinned = pins[0] if pins else None
    assert doc["machine"]["measuring_cpus"] == pinned
    launches = 1000 + 3 * 20_000  # warm-up loop, then --quick's loops
    for r in runs:
        assert len(r["launches_per_s_loops"]) == 3
        assert r["launches_per_s"] == pytest.approx(max(r["launches_per_s_loops"]), abs=0.1)
        if pinned:
            assert r["affinity"] == pinned
            assert r["cpu_start"] in pinned and r["cpu_end"] in pinned
            ran_on = {f"cpu{r['cpu_start']}", f"cpu{r['cpu_end']}"}
            assert set(r["cpu_time"]) == {"all", *ran_on}
        assert r["cpu_time"]["all"]["busy_s"] >= 0
        assert r["run_processes"]["utime"] > 0
        assert r["nodemgr_cpu_s"] >= 0
        assert r["others_cpu_s"] >= 0 and len(r["others_busiest"]) <= 3
        assert r["gpu_before"] is None and r["gpu_after"] is None  # no NVML here
        assert r["wall_s"] > 0
        if r["shim"]:
            trace = r["shim_trace"]
            assert trace["mode"] == "enforce"
            assert trace["slot"] >= 0
            assert trace["launches"] == launches
            assert trace["pause_waits"] == 0
            assert trace["calls"]["cuLaunchKernel"] == launches
        else:
            assert "shim_trace" not in r


def test_runs_that_ended_are_kept_when_a_later_one_fails(
    fake_torch_python: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fourth process (the probe, the warm-up and the first run without the shim came
    before it) fails: the benchmark exits 2 and its document is still written, with the
    records of the two runs that ended and each benchmark's error."""
    import benchmarks.nodemgr_bench as nb
    from benchmarks import gpu_bench

    real_daemon = nb.daemon
    monkeypatch.setattr(nb, "daemon", lambda cpus=None, **config: real_daemon(cpus))
    monkeypatch.setenv("GPUSHARE_TEST_FAIL_AT", "4")
    monkeypatch.setenv("GPUSHARE_TEST_COUNT", str(tmp_path / "count"))
    out = tmp_path / "gpu.json"
    argv = ["--quick", "--only", "launch_rate", "--python", fake_torch_python, "--out", str(out)]
    assert gpu_bench.main(argv) == 2
    doc = json.loads(out.read_text())
    assert [(r["pair"], r["shim"]) for r in doc["runs"]] == [(0, True), (1, False)]
    assert list(doc["benchmarks"]) == ["launch_rate"]
    error = doc["benchmarks"]["launch_rate"]["error"]
    assert error.startswith("BenchError: run with the shim: exit 1"), error
    assert "fake torch: failing as told" in error
    assert doc["machine"]["torch"] == "0.0-gpu-bench-test"


# gpu_bench.py as a process of its own, nodemgr on simulated GPUs instead of NVML's.
SIMULATED_GPU_BENCH = """
import sys
sys.path.append(sys.argv[1])
import benchmarks.nodemgr_bench as nb
from benchmarks import gpu_bench
real_daemon = nb.daemon
nb.daemon = lambda cpus=None, **config: real_daemon(cpus)
sys.exit(gpu_bench.main(sys.argv[2:]))
"""


def test_a_stopped_benchmark_keeps_the_runs_that_ended(
    fake_torch_python: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM (a time limit's) while the fourth process runs: the benchmark stops its
    helpers, writes its document with the runs that ended, and exits 143."""
    count = tmp_path / "count"
    monkeypatch.setenv("GPUSHARE_TEST_COUNT", str(count))
    monkeypatch.setenv("GPUSHARE_TEST_HOLD_AT", "4")
    out = tmp_path / "gpu.json"
    argv = ["--quick", "--only", "launch_rate", "--python", fake_torch_python, "--out", str(out)]
    bench = subprocess.Popen(
        [sys.executable, "-c", SIMULATED_GPU_BENCH, str(ROOT), *argv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (count.exists() and len(count.read_text().splitlines()) >= 4):
            assert bench.poll() is None, bench.communicate(timeout=30)[1]
            assert time.monotonic() < deadline, "the fourth process never started"
            time.sleep(0.05)
        bench.terminate()
        _, err = bench.communicate(timeout=120)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait(timeout=30)
    assert bench.returncode == 143, err
    doc = json.loads(out.read_text())
    assert [(r["pair"], r["shim"]) for r in doc["runs"]] == [(0, True), (1, False)]
    assert (
        doc["benchmarks"]["launch_rate"]["error"] == "BenchError: stopped (exit 143) after 2 runs"
    )
    held = int(count.read_text().splitlines()[3])
    deadline = time.monotonic() + 60
    while Path(f"/proc/{held}").exists() and procfs.state(held) not in (None, "Z"):
        assert time.monotonic() < deadline, "the held measuring process outlived its run"
        time.sleep(0.05)


def test_cpu_figures_from_proc_stat() -> None:
    before = gpu_bench_mod().cpu_lines(
        "cpu  100 0 50 1000 10 0 0 5 0 0\ncpu0 60 0 30 500 5 0 0 5 0 0\nintr 1 2\n"
    )
    after = gpu_bench_mod().cpu_lines(
        "cpu  200 0 70 1100 30 0 0 45 0 0\ncpu0 150 0 40 510 5 0 0 45 0 0\nintr 1 2\n"
    )
    assert set(before) == {"cpu", "cpu0"}
    assert gpu_bench_mod().cpu_delta(before, after, "cpu", 100) == {
        "busy_s": 1.2,
        "idle_s": 1.2,
        "steal_s": 0.4,
    }
    assert gpu_bench_mod().cpu_delta(before, after, "cpu0", 100) == {
        "busy_s": 1.0,
        "idle_s": 0.1,
        "steal_s": 0.4,
    }
    assert gpu_bench_mod().cpu_delta(before, after, "cpu1", 100) is None


def test_the_busiest_other_processes() -> None:
    before = {1: ("init", 10), 50: ("nodemgr", 100), 60: ("python3", 500), 70: ("kworker", 3)}
    after = {
        1: ("init", 10),
        50: ("nodemgr", 300),  # excluded: reported on its own
        60: ("python3", 800),
        70: ("kworker", 4),
        80: ("stress", 120),  # started during the run: all of its time counts
        60_000: ("bash", 0),
    }
    total, top = gpu_bench_mod().busiest(before, after, [50], 100, n=2)
    assert total == pytest.approx(4.21)
    assert top == [
        {"pid": 60, "comm": "python3", "cpu_s": 3.0},
        {"pid": 80, "comm": "stress", "cpu_s": 1.2},
    ]


def test_a_trace_read_for_the_record(tmp_path: Path) -> None:
    trace = tmp_path / "trace"
    trace.write_text(
        "pid=7 mode=enforce slot=3 launches=120 pause_waits=2 pause_wait_us=5000\n"
        "pid=7 hook=cuLaunchKernel calls=120 dlsym=0 gpa=1\n"
        "pid=7 hook=cuGetProcAddress_v2 calls=0 dlsym=1 gpa=0\n"
        "pid=7 hook=cuMemAlloc_v2 calls=3 dlsym=0 gpa=1\n"
    )
    assert gpu_bench_mod().read_trace(trace) == {
        "mode": "enforce",
        "slot": 3,
        "launches": 120,
        "pause_waits": 2,
        "pause_wait_us": 5000,
        "calls": {"cuLaunchKernel": 120, "cuMemAlloc_v2": 3},
    }
    assert gpu_bench_mod().read_trace(tmp_path / "none") == {
        "error": f"no trace at {tmp_path / 'none'}"
    }


def test_cpu_clock_from_cpufreq_else_cpuinfo(tmp_path: Path) -> None:
    (tmp_path / "cpu3" / "cpufreq").mkdir(parents=True)
    (tmp_path / "cpu3" / "cpufreq" / "scaling_cur_freq").write_text("2450000\n")
    info = "processor\t: 0\ncpu MHz\t\t: 1999.998\n\nprocessor\t: 1\ncpu MHz\t\t: 2100.5\n"
    g = gpu_bench_mod()
    assert g.cpu_mhz(3, tmp_path, info) == 2450.0
    assert g.cpu_mhz(1, tmp_path, info) == 2100.5
    assert g.cpu_mhz(2, tmp_path, info) is None
    assert g.cpu_mhz(None, tmp_path, info) is None


def test_slow_runs_are_pointed_out_per_side() -> None:
    runs = [
        {"shim": True, "v": 158.0},
        {"shim": False, "v": 164.0},
        {"shim": True, "v": 114.0},
        {"shim": False, "v": 160.0},
        {"shim": True, "v": 157.0},
        {"shim": False, "v": 140.0},
        {"shim": True, "v": 107.0},
    ]
    assert gpu_bench_mod().slow_runs(runs, "v", True) == [2, 5, 6]
    step = [{"shim": True, "v": 1.0}, {"shim": True, "v": 1.2}, {"shim": True, "v": 1.0}]
    assert gpu_bench_mod().slow_runs(step, "v", False) == [1]


def test_pinning_needs_two_cpus() -> None:
    assert gpu_bench_mod().pin_cpus([3, 0, 7, 5]) == ([5, 7], {0, 3})
    assert gpu_bench_mod().pin_cpus(range(16)) == ([14, 15], set(range(14)))
    assert gpu_bench_mod().pin_cpus([4, 1, 2]) == ([4], {1, 2})
    assert gpu_bench_mod().pin_cpus([2]) is None


def gpu_bench_mod() -> Any:
    from benchmarks import gpu_bench

    return gpu_bench


# --- benchmarks/gpu_lease.sh: every step runs and is recorded, whatever the others did ------

# A stand-in for the GPU machine's Python: pip succeeds (the wheel it builds is an empty file),
# the GPU tests fail, bench-gpu writes a document whose target was missed, bench-gpu-qos and
# bench-gpu-predict one whose target was met, and the time-slicing benchmark cannot run;
# each call is logged.
# Anything else (the summary at the end) goes to the real Python.
FAKE_PYTHON = """#!/usr/bin/env bash
printf '%s\\n' "GPUSHARE_TEST_TORCH_PYTHON=${{GPUSHARE_TEST_TORCH_PYTHON:-}} $*" >>{calls}
case "$1 $2 ${{3:-}}" in
"-m pip wheel")
	whl=gpushare-0.1.0-py3-none-any.whl
	while [ $# -gt 0 ]; do [ "$1" = -w ] && mkdir -p "$2" && : >"$2/$whl"; shift; done
	exit 0 ;;
"-m pip "*) exit 0 ;;
"-m pytest "*) echo "1 failed, 8 passed"; exit 1 ;;
"-c "*) echo "no torch here"; exit 1 ;;
esac
# doc NAME METRIC OP VALUE FIGURE MET ARGS...: a document of one benchmark at ARGS' --out.
doc() {{
	local name=$1 metric=$2 op=$3 value=$4 figure=$5 met=$6 out
	shift 6
	while [ $# -gt 0 ]; do [ "$1" = --out ] && out=$2; shift; done
	printf '{{"benchmarks": {{"%s": {{"%s": %s, "met": %s, ' \
		"$name" "$metric" "$figure" "$met" >"$out"
	printf '"target": {{"metric": "%s", "op": "%s", "value": %s}}}}}}}}' \
		"$metric" "$op" "$value" >>"$out"
}}
case "$1" in
benchmarks/gpu_bench.py) doc launch_rate ratio ">=" 0.995 0.9 false "$@"; exit 0 ;;
benchmarks/qos_bench.py) doc share_settling max_settle_s "<=" 1.0 0.2 true "$@"; exit 0 ;;
benchmarks/predict_bench.py) doc memory worst_error_pct "<=" 10.0 3.5 true "$@"; exit 0 ;;
benchmarks/gpu_timeslice_bench.py) echo "cannot run: no GPU" >&2; exit 2 ;;
esac
exec {python} "$@"
"""


def fake_python(tmp_path: Path) -> tuple[Path, Path]:
    """FAKE_PYTHON written to ``tmp_path``: the file its calls are logged in, and itself."""
    calls = tmp_path / "calls"
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON.format(calls=calls, python=sys.executable))
    fake.chmod(0o755)
    return calls, fake


def run_lease(fake: Path, out: Path, wheels: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """benchmarks/gpu_lease.sh OUT WHEELS with ``fake`` as its Python, no GPUSHARE_ or
    GPU_LEASE_ variable but ``env``."""
    mine = {k: v for k, v in os.environ.items() if not k.startswith(("GPUSHARE_", "GPU_LEASE_"))}
    return subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_lease.sh"), str(out), str(wheels)],
        env={**mine, "PYTHON": str(fake), **env},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_the_lease_script_runs_every_step_and_records_each(tmp_path: Path) -> None:
    calls, fake = fake_python(tmp_path)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "pyzmq-27.3.0-cp312-abi3-manylinux_2_28_x86_64.whl").write_bytes(b"")
    out = tmp_path / "out"
    r = run_lease(fake, out, wheels)
    assert r.returncode == 1, r.stderr
    steps = (out / "steps.txt").read_text().splitlines()
    assert [line.split(" seconds=")[0] for line in steps[:8]] == [
        "wheels rc=0",
        "build rc=0",
        "install rc=0",
        "tests-gpu rc=1",
        "bench-gpu-qos rc=0",
        "bench-gpu-timeslice rc=2",
        "bench-gpu-predict rc=0",
        "bench-gpu rc=0",
    ]
    assert steps[8:] == [
        "share_settling: met (max_settle_s = 0.2, target <= 1.0)",
        "memory: met (worst_error_pct = 3.5, target <= 10.0)",
        "launch_rate: MISSED (ratio = 0.9, target >= 0.995)",
    ]
    assert sorted(p.name for p in out.iterdir()) == [
        "gpu.json",
        "gpu.log",
        "gpu_predict.json",
        "gpu_predict.log",
        "gpu_qos.json",
        "gpu_qos.log",
        "gpu_timeslice.log",
        "setup.log",
        "steps.txt",
        "tests-gpu.log",
    ]
    assert "cannot run: no GPU" in (out / "gpu_timeslice.log").read_text()
    assert "1 failed, 8 passed" in (out / "tests-gpu.log").read_text()
    made = calls.read_text().splitlines()
    assert any("-m pip install --no-index --no-deps" in c and "pyzmq-27.3.0" in c for c in made)
    assert any("--force-reinstall" in c and "gpushare-0.1.0-py3-none-any.whl" in c for c in made)
    assert f"GPUSHARE_TEST_TORCH_PYTHON={fake} -m pytest -p no:cacheprovider -m gpu tests/gpu" in (
        "\n".join(made)
    )
    assert any(c.endswith(f"--python {fake} --out {out}/gpu.json") for c in made)
    assert any(f"gpu_timeslice_bench.py --quick --out {out}/gpu_timeslice.json" in c for c in made)
    assert any(
        f"qos_bench.py --gpu --quick --python {fake} --out {out}/gpu_qos.json" in c for c in made
    )
    assert any(
        f"predict_bench.py --gpu --quick --python {fake} --out {out}/gpu_predict.json" in c
        for c in made
    )


def test_the_lease_script_runs_only_the_steps_asked_for(tmp_path: Path) -> None:
    """GPU_LEASE_STEPS names the steps after the install that run; the others are not
    started, nor recorded."""
    calls, fake = fake_python(tmp_path)
    out = tmp_path / "out"
    r = run_lease(fake, out, tmp_path / "none", GPU_LEASE_STEPS="bench-gpu-qos tests-gpu")
    assert r.returncode == 1, r.stderr
    steps = (out / "steps.txt").read_text().splitlines()
    assert [line.split(" seconds=")[0] for line in steps[1:5]] == [
        "build rc=0",
        "install rc=0",
        "tests-gpu rc=1",
        "bench-gpu-qos rc=0",
    ]
    assert steps[5:] == ["share_settling: met (max_settle_s = 0.2, target <= 1.0)"]
    made = calls.read_text().splitlines()
    assert not [c for c in made if "gpu_bench.py" in c or "gpu_timeslice_bench.py" in c], made
    # A document an earlier run left for a step not run now is not summarised.
    (out / "gpu.json").write_text('{"benchmarks": {"launch_rate": {"ratio": 0.9, "met": false}}}')
    r = run_lease(fake, out, tmp_path / "none", GPU_LEASE_STEPS="bench-gpu-qos")
    steps = (out / "steps.txt").read_text().splitlines()
    assert not [line for line in steps if "launch_rate" in line], steps
    # A step that does not exist is refused before anything runs.
    r = run_lease(fake, out, tmp_path / "none", GPU_LEASE_STEPS="bench-qpu-qos")
    assert r.returncode == 2
    assert "GPU_LEASE_STEPS: no step bench-qpu-qos" in r.stderr


def test_the_lease_script_skips_steps_past_its_budget(tmp_path: Path) -> None:
    """With no budget left every step is skipped and said so; nothing is run."""
    calls, fake = fake_python(tmp_path)
    out = tmp_path / "out"
    r = run_lease(fake, out, tmp_path / "none", GPU_LEASE_BUDGET="10")
    assert r.returncode == 1, r.stderr
    steps = (out / "steps.txt").read_text().splitlines()
    assert steps[0] == f"wheels: none in {tmp_path / 'none'}"
    assert [line.split(":")[0] for line in steps[1:]] == [
        "build skipped",
        "install skipped",
        "tests-gpu skipped",
        "bench-gpu-qos skipped",
        "bench-gpu-timeslice skipped",
        "bench-gpu-predict skipped",
        "bench-gpu skipped",
    ]
    made = calls.read_text().splitlines() if calls.exists() else []
    ran = [c for c in made if " -m pip install" in c or " -m pip wheel" in c]
    ran += [c for c in made if " -m pytest" in c or "benchmarks/" in c]
    assert not ran, made


def test_the_gpu_state_is_read_where_nvml_answers_and_null_where_not(tmp_path: Path) -> None:
    """The records' NVML figures, read by the benchmark's observer in a process on the
    simulated NVML (which answers some of the questions asked): a figure NVML does not give
    is null, and none stops the record."""
    from gpushare import libs
    from nodemgr.config import Config
    from nodemgr.host import gpus

    config = Config(tmp_path / "unused.toml", tmp_path / "unused-run")
    script = (
        "import json, sys\n"
        f"sys.path.append({str(ROOT)!r})\n"
        "from benchmarks import gpu_bench\n"
        "o = gpu_bench.Observer(1)\n"
        "o.gpu(sys.argv[1])\n"
        "print(json.dumps(o.before()['nvml']))\n"
        "o.close()\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "CUDA_VISIBLE_DEVICES")}
    env["LD_LIBRARY_PATH"] = str(libs.sim_driver_dir())
    env["GPUSHARE_SIM_GPUS"] = gpus.sim_spec(gpus.simulated(config))
    r = subprocess.run(
        [sys.executable, "-c", script, gpus.simulated_uuid(1)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=tmp_path,
    )
    state = json.loads(r.stdout)
    assert set(state) == {
        "sm_mhz",
        "memory_mhz",
        "utilization_gpu",
        "utilization_memory",
        "temperature_c",
        "power_w",
        "pstate",
        "clocks_event_reasons",
    }
    assert any(v is not None for v in state.values()), state  # the GPU was found
