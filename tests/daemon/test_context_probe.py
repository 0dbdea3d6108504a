"""gpus.context_memory = "auto" (docs/operations.md, "Context memory") through a real
nodemgr on simulated GPUs: the probe measures the simulated driver's context size
(gpus.simulated_context_memory) once per GPU model, nodemgr charges it on every GPU of
that model and shows it; a size in the config overrides it; a probe that fails or hangs
leaves the documented default and a WARNING that names the fix."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpushare.envvars import SIM_GPUS, SIM_STATE_DIR
from nodemgr.config import CONTEXT_FALLBACK
from nodemgr.host import ctxprobe
from nodemgr.host.backend import NvmlBackend, ProbeDriver, SimulatedBackend
from nodemgr.host.gpus import Gpu
from tests.conftest import invoke
from tests.daemon.conftest import free_port, scrape

MiB = 1 << 20
GiB = 1 << 30
MEASURED = "a CUDA context takes"


@pytest.fixture(autouse=True)
def registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A simulated process table of this test's own, for nodemgr, its probe and its tasks
    (they inherit the variable)."""
    path = tmp_path / "usage"
    path.mkdir()
    monkeypatch.setenv("GPUSHARE_SIM_STATE_DIR", str(path))
    return path


def contexts(d: Any) -> list[tuple[int, str]]:
    return [(g["context"], g["context_source"]) for g in d.admin("status")["gpus"]]


def test_auto_measures_the_simulated_context_once_and_charges_it(
    daemon_factory: Any, run_task: Any, cbin: dict[str, Path]
) -> None:
    port = free_port()
    # 301 MiB: the simulated driver takes it, NVML shows it, nodemgr rounds it to the page.
    d = daemon_factory({"gpus": {"simulated_context_memory": "301MiB"}, "metrics": {"port": port}})
    assert contexts(d) == [(302 * MiB, "measured")] * 4
    log = d.logtext()
    # One model (four GPUs of one name and size): one probe, charged on all four.
    assert log.count(MEASURED) == 1
    assert (
        f"{MEASURED} 302MiB on gpushare Simulated GPU (measured on GPU 0): charged per "
        "process on GPUs 0, 1, 2, 3"
    ) in log
    assert "WARNING" not in log
    samples = scrape(port)
    assert (
        samples[
            'gpushare_gpu_context_bytes{gpu="3",uuid="GPU-5349d000-0000-4000-8000-000000000003"}'
        ]
        == 302 * MiB
    )
    # The shim charges a task's process the measured figure for its context.
    ep = d.env("alice", gpus=1, memory=GiB)
    p = run_task(ep, str(cbin["client"]), "info")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert out.split() == ["info", f"free={GiB - 302 * MiB}", f"total={GiB}"]

    shown = invoke(d, "status")
    assert shown.exit_code == 0, shown.output
    assert "context charge: 302MiB per process on GPUs 0,1,2,3 (measured at start)" in (
        shown.output
    )


def test_a_size_in_the_config_overrides_auto(daemon_factory: Any) -> None:
    d = daemon_factory({"gpus": {"simulated_context_memory": "301MiB", "context_memory": "100MiB"}})
    assert contexts(d) == [(100 * MiB, "configured")] * 4
    assert MEASURED not in d.logtext()


def test_a_simulated_context_larger_than_its_gpu_is_a_bad_config(tmp_path: Path) -> None:
    """What the simulated driver is told a context takes must leave room on its GPU: a
    probe could only fail there, and the charge it falls back to (that very size) could
    never be granted."""
    from nodemgr import config

    (tmp_path / "c.toml").write_text('[gpus]\nsimulated_context_memory = "16GiB"\n')
    with pytest.raises(config.ConfigError) as e:
        config.load(tmp_path / "c.toml")
    assert str(e.value) == (
        "gpus.simulated_context_memory (16GiB) must be less than gpus.simulated_memory (16GiB)"
    )


def test_a_probe_that_fails_falls_back_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A probe that fails (here: the simulated driver refuses its context, as a full GPU
    would): a WARNING naming the fix, and the fallback charge: on NVML GPUs the estimate
    CONTEXT_FALLBACK, on simulated ones the size their driver is told a context takes."""
    from nodemgr import config
    from nodemgr.host import gpus

    def full(gpu: Gpu, *args: Any, **kwargs: Any) -> int:
        raise ctxprobe.ProbeError(
            "cuDevicePrimaryCtxRetain failed: CUDA error 2 (CUDA_ERROR_OUT_OF_MEMORY)"
        )

    monkeypatch.setattr(ctxprobe, "measure", full)
    (tmp_path / "c.toml").write_text(
        '[gpus]\nsource = "simulated"\nsimulated_count = 2\nsimulated_context_memory = "300MiB"\n'
    )
    cfg = config.load(tmp_path / "c.toml")
    assert ctxprobe.charges(cfg, SimulatedBackend(cfg)) == {
        0: (300 * MiB, "fallback"),
        1: (300 * MiB, "fallback"),
    }
    assert (
        'gpus.context_memory = "auto": cannot measure a CUDA context on gpushare Simulated '
        "GPU (GPUs 0, 1): cuDevicePrimaryCtxRetain "
        "failed: CUDA error 2 (CUDA_ERROR_OUT_OF_MEMORY); charging 300MiB per process there "
        f"instead. Set gpus.context_memory in {cfg.path}"
    ) in caplog.text
    caplog.clear()
    nvml = [gpus.Gpu(0, "GPU-5349d000-0000-4000-8000-000000000000", "NVIDIA H200", 141 * GiB)]
    monkeypatch.setattr(ctxprobe, "_measure_model", lambda *a: full(nvml[0]))
    assert ctxprobe.charges(cfg, NvmlBackend(nvml)) == {0: (CONTEXT_FALLBACK, "fallback")}
    assert "charging 512MiB per process there instead" in caplog.text


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[subprocess.Popen[bytes]]:
    """The processes subprocess.Popen starts from here on, as they start."""
    made: list[subprocess.Popen[bytes]] = []

    class Recorded(subprocess.Popen):  # type: ignore[type-arg]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(subprocess, "Popen", Recorded)
    return made


def test_a_probe_that_hangs_is_ended_at_its_timeout(
    started: list[subprocess.Popen[bytes]],
) -> None:
    """The probe's time limit: a probe that never says it is ready (it ignores its stdin
    too) is killed and reaped, and its measurement fails, naming the limit."""
    hang = [sys.executable, "-c", "import signal, time; signal.pause()"]
    gpu = Gpu(0, "GPU-5349d000-0000-4000-8000-000000000000", "Sim", 16 * GiB)
    with pytest.raises(ctxprobe.ProbeError, match=r"^no context within 0.5s$"):
        ctxprobe.measure(
            gpu, ProbeDriver("libcuda.so.1"), NvmlBackend([gpu]), timeout=0.5, command=hang
        )
    [proc] = started
    assert proc.returncode is not None  # reaped, not left running


def test_a_probe_whose_child_holds_its_stderr_fails_without_waiting_for_it(
    started: list[subprocess.Popen[bytes]],
) -> None:
    """A probe that fails and leaves a process of its own holding its stderr open: its
    last line of stderr is the error, read without waiting for the end of the file, which
    never comes (start-up would hang)."""
    leaves = (
        "import os, signal, sys\n"
        "if os.fork() == 0:\n"
        "    os.close(1)\n"
        "    signal.pause()\n"
        "sys.exit('cuInit failed: CUDA error 100 (CUDA_ERROR_NO_DEVICE)')\n"
    )
    gpu = Gpu(0, "GPU-5349d000-0000-4000-8000-000000000000", "Sim", 16 * GiB)
    try:
        with pytest.raises(ctxprobe.ProbeError, match=r"^cuInit failed: CUDA error 100 "):
            ctxprobe.measure(
                gpu,
                ProbeDriver("libcuda.so.1"),
                NvmlBackend([gpu]),
                timeout=120,
                command=[sys.executable, "-c", leaves],
            )
    finally:
        # Its child, still in its group (which keeps the group's id from being reused).
        [proc] = started
        os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1


def test_the_probe_runs_without_the_shim_or_a_tasks_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A nodemgr started from a task's shell: its probe gets neither the shim nor the task's
    gpushare variables, on NVML GPUs as on simulated ones, where it keeps the simulator's."""
    monkeypatch.setenv("LD_PRELOAD", "libgpushare.so")
    monkeypatch.setenv("GPUSHARE_LEDGER", "/run/gpushare/envs/a/ledger")
    monkeypatch.setenv("GPUSHARE_TASK_ID", "0123456789abcdef")
    monkeypatch.setenv("OTHER", "kept")
    # Another node's simulated GPUs (the shell's): the probe's are its nodemgr's.
    monkeypatch.setenv(SIM_STATE_DIR, "/elsewhere/sim")
    gpu = Gpu(1, "GPU-5349d000-0000-4000-8000-000000000001", "Sim", 16 * GiB)
    node = Path("/run/gpushare/sim")
    for sim_gpus in (None, "Sim|GPU-5349d000-0000-4000-8000-000000000001|17179869184"):
        env = ctxprobe._probe_env(gpu, sim_gpus, None if sim_gpus is None else node)
        gpushare = {k for k in env if k.startswith("GPUSHARE_")}
        if sim_gpus is None:
            assert gpushare == set()
        else:
            assert all(k.startswith("GPUSHARE_SIM_") for k in gpushare)
            assert env[SIM_GPUS] == sim_gpus and env[SIM_STATE_DIR] == str(node)
        assert "LD_PRELOAD" not in env and env["OTHER"] == "kept"
        assert env["CUDA_VISIBLE_DEVICES"] == gpu.uuid


def test_the_probe_gets_neither_the_simulators_trace_nor_its_knobs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """nodemgr's own GPUSHARE_SIM_TRACE (or kernel timing) is not the probe's: it would
    append the probe's calls to that file."""
    monkeypatch.setenv("GPUSHARE_SIM_TRACE", str(tmp_path / "trace"))
    monkeypatch.setenv("GPUSHARE_SIM_KERNEL_US", "5")
    gpu = Gpu(1, "GPU-5349d000-0000-4000-8000-000000000001", "Sim", 16 * GiB)
    env = ctxprobe._probe_env(gpu, "Sim|GPU-5349d000-0000-4000-8000-000000000001|17179869184")
    assert {k for k in env if k.startswith("GPUSHARE_")} == {SIM_GPUS, "GPUSHARE_SIM_STATE_DIR"}


def test_the_probe_imports_no_nodemgr_of_its_working_directory(tmp_path: Path) -> None:
    """The probe's command line keeps its working directory off sys.path: a nodemgr/
    there is not the probe that runs."""
    stand_in = tmp_path / "nodemgr"
    stand_in.mkdir()
    (stand_in / "__init__.py").write_text("")
    (stand_in / "ctxprobe.py").write_text("import sys\nsys.exit('a stand-in ran')\n")
    argv = ctxprobe.probe_argv(str(tmp_path / "no-libcuda.so.1"))
    p = subprocess.run(
        argv, cwd=tmp_path, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 1
    assert "a stand-in ran" not in p.stderr
    assert f"cannot load the CUDA driver {tmp_path / 'no-libcuda.so.1'}" in p.stderr


def test_a_simulated_nvml_that_cannot_be_loaded_is_a_failed_probe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A simulated NVML that cannot be loaded (a broken install, a sanitizer build) fails
    the measurement as a probe that fails does: the fallback charge (on simulated GPUs the
    size their driver is told a context takes) and a WARNING, not a nodemgr that cannot
    start."""
    from nodemgr import config
    from nodemgr.host import backend

    dirs = []

    def broken(spec: str, state_dir: Path) -> None:
        dirs.append(state_dir)
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    monkeypatch.setattr(backend, "load_simulated", broken)
    (tmp_path / "c.toml").write_text('[gpus]\nsource = "simulated"\nsimulated_count = 2\n')
    cfg = config.load(tmp_path / "c.toml")
    assert ctxprobe.charges(cfg, SimulatedBackend(cfg)) == {
        0: (0, "fallback"),
        1: (0, "fallback"),
    }
    assert "the simulated NVML: libnvidia-ml.so.1: cannot open shared object file" in caplog.text
    assert dirs == [cfg.sim_state_dir]  # the node's simulated NVML, whose table tasks share


def test_page_up() -> None:
    assert ctxprobe.page_up(0) == 0
    assert ctxprobe.page_up(1) == 2 * MiB
    assert ctxprobe.page_up(518 * MiB) == 518 * MiB
    assert ctxprobe.page_up(518 * MiB + 1) == 520 * MiB
