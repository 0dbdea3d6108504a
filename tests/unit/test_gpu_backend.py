"""The GPU backend (nodemgr.host.backend) on simulated GPUs: the simulated NVML the package
ships, asked through the seam as the audit, utilisation sampling, the health check and the
context probe ask it, about a process that holds a context and memory through the
simulated driver.

The backend is asked in a child process: the simulated NVML, once loaded, stays loaded
for the process's life with the GPUs and process table it was first told, and would be
this test process's for the tests after it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from nodemgr import config
from nodemgr.host.backend import ProbeDriver, SimulatedBackend, choose
from nodemgr.host.gpus import sim_spec, simulated

MiB = 1 << 20

# Holds GPU 0 as CUDA numbers it: a primary context and ALLOC bytes, until stdin closes.
HOLDER = """\
import ctypes, sys
cuda = ctypes.CDLL(sys.argv[1])
dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
for step, rc in enumerate((
    cuda.cuInit(0),
    cuda.cuDeviceGet(ctypes.byref(dev), 0),
    cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev),
    cuda.cuCtxSetCurrent(ctx),
    cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(int(sys.argv[2]))),
)):
    if rc != 0:
        sys.exit(f"step {step}: CUDA error {rc}")
print("ready", flush=True)
sys.stdin.read()
"""

# What the backend answers, as JSON: before the holder is asked of (argv[2] its pid), and
# the context charges measured through it.
ASK = """\
import dataclasses, json, sys
from nodemgr import config
from nodemgr.host import ctxprobe
from nodemgr.host.backend import choose

cfg = config.load(sys.argv[1])
pid = int(sys.argv[2])
backend = choose(cfg)
one = backend.gpus[1].uuid
with backend.session():
    memory = [backend.process_memory(g.uuid, pid) for g in backend.gpus]
    free = backend.free_memory(one)
print(json.dumps({
    "processes": [dataclasses.asdict(p) for p in backend.processes()],
    "utilization": [dataclasses.asdict(s) for s in backend.utilization()],
    "memory": memory,
    "free": free,
    "lost": sorted(backend.lost()),
    "charges": ctxprobe.charges(cfg, backend),
}))
"""


def load(tmp_path: Path) -> config.Config:
    (tmp_path / "sim").mkdir()
    (tmp_path / "c.toml").write_text(
        f'[gpus]\nsource = "simulated"\nsimulated_count = 2\n'
        f'simulated_context_memory = "300MiB"\nsimulated_state_dir = "{tmp_path / "sim"}"\n'
    )
    return config.load(tmp_path / "c.toml")


def test_the_simulated_backend_is_the_configs_gpus_and_their_driver(tmp_path: Path) -> None:
    """Chosen by gpus.source without asking NVML: the config's simulated GPUs, and for the
    context probe the packaged simulated driver, told the node's GPUs and process table."""
    cfg = load(tmp_path)
    backend = choose(cfg)
    assert isinstance(backend, SimulatedBackend)
    assert (backend.simulated, backend.kind) == (True, "simulated")
    assert backend.gpus == simulated(cfg)
    driver = backend.probe_driver()
    assert driver == ProbeDriver(driver.library, sim_spec(backend.gpus), tmp_path / "sim")
    assert Path(driver.library).name == "libcuda.so.1" and Path(driver.library).is_file()


def test_the_simulated_nvml_through_the_backend(tmp_path: Path) -> None:
    """A process holding a context and 64 MiB on GPU 1 through the simulated driver: the
    backend lists it there with both (what the audit compares with the ledgers), samples
    both GPUs, sees the GPU's free memory less it, loses no GPU, and measures a context as
    the simulated driver is told it takes."""
    cfg = load(tmp_path)
    backend = SimulatedBackend(cfg)
    driver = backend.probe_driver()
    assert driver.sim_gpus is not None
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env.update(
        GPUSHARE_SIM_GPUS=driver.sim_gpus,
        GPUSHARE_SIM_STATE_DIR=str(driver.sim_state_dir),
        CUDA_VISIBLE_DEVICES=backend.gpus[1].uuid,
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, driver.library, str(64 * MiB)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    assert holder.stdin is not None and holder.stdout is not None
    try:
        assert holder.stdout.readline() == "ready\n"
        asked = subprocess.run(
            [sys.executable, "-c", ASK, str(tmp_path / "c.toml"), str(holder.pid)],
            cwd=tmp_path,  # the installed nodemgr, not the source tree's
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
        holder.stdout.close()
    assert asked.returncode == 0, asked.stderr
    got = json.loads(asked.stdout)
    held = 300 * MiB + 64 * MiB
    assert got["processes"] == [{"gpu": 1, "pid": holder.pid, "bytes": held}]
    assert got["memory"] == [None, held]
    assert got["free"] == backend.gpus[1].memory - held
    # No kernel launched: both GPUs idle, the holder listed with no busy share on its own.
    assert got["utilization"] == [
        {"gpu": 0, "memory": 0, "processes": {}},
        {"gpu": 0, "memory": 0, "processes": {str(holder.pid): 0}},
    ]
    assert got["lost"] == []
    assert got["charges"] == {"0": [300 * MiB, "measured"], "1": [300 * MiB, "measured"]}
    assert holder.returncode == 0
