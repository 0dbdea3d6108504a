"""GPU and per-task utilisation from NVML through a real nodemgr, on the simulated GPUs:
`status`, `tasks`, `top` and the metrics show what the simulated NVML reports for the
kernels a task's process launches (docs/operations.md, "Utilisation")."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from nodemgr.host.audit import Slot
from nodemgr.host.backend import GpuSample
from nodemgr.host.utilization import shares
from tests.conftest import BIN
from tests.daemon.conftest import free_port, scrape
from tests.daemon.test_audit import ready_pid

GPU0 = 'gpu="0",uuid="GPU-5349d000-0000-4000-8000-000000000000"'


def test_a_tasks_kernels_show_as_its_gpus_and_its_own_utilisation(
    daemon_factory: Any,
    run_task: Any,
    wait_for: Any,
    cbin: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 50 ms per launch (the node's simulated GPUs are its own: no other test's processes).
    monkeypatch.setenv("GPUSHARE_SIM_KERNEL_US", "50000")
    port = free_port()
    d = daemon_factory(
        {"gpus": {"utilization_interval": 0.1}, "metrics": {"port": port}, "audit": {"interval": 0}}
    )
    ep = d.env("alice", gpus=1, memory=1 << 30)
    go = tmp_path / "go"
    # Busy for seconds: 4 launches (200 ms of work) every 0.2 s.
    steps = ["launch", "4", "sleep", "0.2"] * 40
    busy = run_task(ep, str(cbin["client"]), "alloc", "64", *steps, "waitfile", str(go))
    idle = run_task(ep, str(cbin["client"]), "alloc", "64", "waitfile", str(go))
    ready_pid(idle, "waiting")
    ready_pid(busy, "launch")
    tasks = {t["pid"]: t["task_id"] for t in d.tasks()}

    def sampled() -> bool:
        st = d.admin("status")
        by_task = {t["task_id"]: t["utilization"] for t in d.tasks()}
        return bool(st["gpus"][0]["utilization"]) and bool(by_task[tasks[busy.pid]][0])

    wait_for(sampled, 15, interval=0.05)
    st = d.admin("status")
    assert st["gpus"][0]["memory_utilization"] == 0  # the simulation moves no memory
    assert (st["gpus"][1]["utilization"], st["gpus"][1]["memory_utilization"]) == (0, 0)
    by_task = {t["task_id"]: t for t in d.tasks()}
    assert by_task[tasks[idle.pid]]["utilization"] == [0]
    assert 0 < by_task[tasks[busy.pid]]["utilization"][0] <= 100

    def scraped() -> bool:
        m = scrape(port)
        return (
            m.get(f"gpushare_gpu_utilization_ratio{{{GPU0}}}", 0) > 0
            and m.get('gpushare_env_utilization_ratio{env="alice"}', 0) > 0
        )

    wait_for(scraped, 10, interval=0.2)
    assert scrape(port)[f"gpushare_gpu_memory_utilization_ratio{{{GPU0}}}"] == 0
    for cmd in (["status"], ["top", "--iterations", "1"]):
        out = subprocess.run(
            [str(BIN / "nodemgr"), *cmd, "--config", str(d.config)],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        header = next(line for line in out.splitlines() if line.startswith("GPU "))
        assert "UTIL" in header.split() and "MEM UTIL" in header, out
        if cmd[0] == "top":
            rows = {line.split()[0]: line.split() for line in out.splitlines() if line}
            assert rows[tasks[idle.pid]][6] == "0%", out
            assert rows[tasks[busy.pid]][6].endswith("%"), out
    go.touch()
    for p in (busy, idle):
        p.kill()


def test_shares_sum_a_tasks_processes_per_gpu() -> None:
    samples = [
        GpuSample(90, 5, {100: 30, 101: 50, 7: 5}),
        GpuSample(70, 0, {100: 70, 8: 20}),
    ]
    slots = [Slot("a", "t1", 1, (0, 0)), Slot("a", "t1", 101, (0, 0)), Slot("b", "t2", 2, (0,))]
    # NVML's pid 100 is pid 1 in its own namespace; 7 has no slot but descends from t2's
    # client; 8 is nobody's.
    got = shares(samples, {100: 1, 101: 101, 7: 7, 8: 8}, slots, {7: ("b", "t2")})
    assert got == {"t1": {0: 80, 1: 70}, "t2": {0: 5}}
    capped = shares([GpuSample(100, 0, {1: 70, 101: 60})], {}, slots, {})
    assert capped == {"t1": {0: 100}}
