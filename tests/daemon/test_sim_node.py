"""Each nodemgr's simulated GPUs are its own (docs/simulator.md, "nodemgr's simulated
GPUs"): nodemgrs of one user on one machine never see each other's tasks, and one
nodemgr sees the processes of every user of its node, as NVML does."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import sys
from pathlib import Path
from typing import Any

import pytest

from gpushare import envvars, libs
from tests.conftest import CSRC, cc
from tests.daemon.test_audit import findings, ready_pid

MiB = 1 << 20


def audits(d: Any) -> int:
    return int(d.admin("status")["bypass"]["audits"])


def test_two_nodemgrs_never_take_each_others_tasks_for_bypasses(
    daemon_factory: Any, run_task: Any, wait_for: Any, cbin: Any, tmp_path: Path
) -> None:
    """`make run` beside `make test`: two nodemgrs of one user on the same simulated GPUs
    (the same names, UUIDs and sizes), each auditing with action "kill"."""
    go = tmp_path / "go"
    nodes = [daemon_factory({"audit": {"interval": 0.2, "action": "kill"}}) for _ in range(2)]
    tasks = []
    for d in nodes:
        ep = d.env("alice", gpus=1, memory=4 << 30)
        p = run_task(ep, str(cbin["client"]), "alloc", "256", "waitfile", str(go))
        ready_pid(p, "waiting")
        tasks.append(p)
    for d in nodes:
        assert (d.config.parent / "run" / "sim").is_dir()
    # Three audits of each nodemgr after both tasks hold their memory.
    marks = [audits(d) for d in nodes]
    for d, mark in zip(nodes, marks, strict=True):
        wait_for(lambda d=d, mark=mark: audits(d) >= mark + 3, 20)
    for d in nodes:
        assert findings(d) == {}, d.logtext()
        assert d.admin("status")["bypass"]["killed"] == 0
    assert all(p.poll() is None for p in tasks)
    go.touch()
    for p in tasks:
        assert p.wait(30) == 0


AS_USER = """
import os, sys
os.setgid(int(sys.argv[1])); os.setgroups([]); os.setuid(int(sys.argv[2]))
os.environ.pop("LD_PRELOAD", None)
os.execv(sys.argv[3], sys.argv[3:])
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_a_root_nodemgr_sees_another_users_process_on_its_gpus(
    daemon_factory: Any, run_task: Any, wait_for: Any
) -> None:
    """A task whose process runs as another user and holds memory around the shim: the
    audit of a nodemgr running as root finds it, as NVML would list it."""
    nobody = pwd.getpwnam("nobody")
    d = daemon_factory({"audit": {"interval": 0.2}})
    os.chmod(d.root, 0o755)
    os.chmod(d.run_dir, 0o711)
    sim = d.run_dir / "sim"
    assert stat.S_IMODE(sim.stat().st_mode) == 0o711
    tables = list(sim.glob("gpushare-sim-usage-*"))
    assert len(tables) == 1 and stat.S_IMODE(tables[0].stat().st_mode) == 0o666
    client = cc(d.root / "client", str(CSRC / "cuda_client.c"), "-ldl")
    # The task's user loads the shim and the simulated driver: copies where it may read
    # them, as the checkout's own may sit in a directory only its owner enters.
    libs_dir = d.root / "lib"
    shutil.copytree(libs.sim_driver_dir(), libs_dir / "sim")
    shutil.copy(libs.shim_path(), libs_dir / "libgpushare.so")
    for path in (libs_dir, *libs_dir.rglob("*")):
        os.chmod(path, 0o755)
    go = d.root / "go"
    ep = d.env("alice", gpus=1, memory=4 << 30)
    p = run_task(
        ep,
        sys.executable,
        "-c",
        AS_USER,
        str(nobody.pw_gid),
        str(nobody.pw_uid),
        str(client),
        "alloc",
        "128",
        "waitfile",
        str(go),
        env={
            envvars.SIM_DIR: str(libs_dir / "sim"),
            envvars.SHIM: str(libs_dir / "libgpushare.so"),
        },
    )
    ready_pid(p, "waiting")
    task = d.tasks()[0]["task_id"]
    wait_for(lambda: len(findings(d)) == 1, 20)
    (found,) = findings(d).values()
    assert (found["seen"], found["reason"], found["task_id"]) == (128 * MiB, "no slot", task)
    go.touch()
    assert p.wait(30) == 0


TIMED_TASK = """
import ctypes, json, os, time
cu = ctypes.CDLL("libcuda.so.1")
vp = ctypes.c_void_p
assert cu.cuInit(0) == 0
c = vp()
assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(c), 0) == 0
assert cu.cuCtxSetCurrent(c) == 0
t0 = time.monotonic()
assert cu.cuLaunchKernel(vp(1), 5 * 132, 1, 1, 1, 1, 1, 0, None, None, None) == 0
assert cu.cuCtxSynchronize() == 0
sim = {k: v for k, v in os.environ.items() if k.startswith("GPUSHARE_SIM_")}
sim.pop("GPUSHARE_SIM_GPUS", None)
print(json.dumps({"waited": time.monotonic() - t0, "env": sim}))
"""


@pytest.mark.parametrize("on", [True, False])
def test_the_node_switches_its_tasks_device_timeline_on(
    daemon_factory: Any, run_task: Any, on: bool
) -> None:
    """gpus.simulated_timeline and its parameters reach every task's simulated driver
    through the grant (docs/simulator.md, "The device timeline")."""
    gpus = {"simulated_timeline": on, "simulated_wave_ns": 20_000_000, "simulated_time_scale": 2}
    d = daemon_factory({"gpus": gpus})
    ep = d.env("alice", gpus=1, memory=4 << 30)
    p = run_task(ep, sys.executable, "-c", TIMED_TASK, env={envvars.SIM_TIMELINE: ""})
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    report = json.loads(out)
    state = str(d.run_dir / "sim")
    if on:
        assert report["env"] == {
            envvars.SIM_STATE_DIR: state,
            envvars.SIM_TIMELINE: "1",
            envvars.SIM_WAVE_NS: "20000000.0",
            envvars.SIM_TIME_SCALE: "2.0",
        }
        assert report["waited"] >= 0.2  # 5 waves of 20 ms, twice as long
    else:
        assert report["env"] == {envvars.SIM_STATE_DIR: state, envvars.SIM_TIMELINE: ""}
