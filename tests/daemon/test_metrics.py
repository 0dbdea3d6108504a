"""Prometheus metrics from a live daemon, and GPUs NVML reports lost."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from gpushare.client import Connection, QuotaExceeded
from nodemgr.host.backend import NvmlBackend
from nodemgr.host.gpus import Gpu
from nodemgr.node.node import REASONS
from nodemgr.report.metrics import CAPS
from tests.daemon.conftest import free_port, scrape


def _uuid(d: Any, index: int) -> str:
    return str(d.admin("status")["gpus"][index]["uuid"])


def test_metrics_show_quota_grants_use_reclaims_and_latency(
    daemon_factory: Any, run_task: Any, wait_for: Any, cbin: Any
) -> None:
    port = free_port()
    d = daemon_factory({"metrics": {"port": port}})
    ep = d.env("alice", gpus=2, memory=1 << 30)
    p = run_task(ep, str(cbin["client"]), "alloc", "256", "launch", "5", "sleep", "30")
    wait_for(lambda: d.tasks() and d.tasks()[0]["launches"] == 5, 10)

    def settled() -> bool:
        m = scrape(port)
        return m.get('gpushare_env_kernel_launches_total{env="alice"}') == 5.0

    wait_for(settled, 5, interval=0.2)
    m = scrape(port)
    assert m['gpushare_env_quota_gpus{env="alice"}'] == 2
    assert m['gpushare_env_quota_memory_bytes{env="alice"}'] == 1 << 30
    assert m['gpushare_env_granted_bytes{env="alice"}'] == 1 << 30
    assert m['gpushare_env_used_bytes{env="alice"}'] == 256 << 20
    assert m['gpushare_env_tasks{env="alice"}'] == 1
    assert m[
        'gpushare_gpu_used_bytes{gpu="0",uuid="GPU-5349d000-0000-4000-8000-000000000000"}'
    ] == (256 << 20)
    assert m['gpushare_request_seconds_count{endpoint="task",type="grant"}'] == 1
    assert m["gpushare_queue_length"] == 0
    p.kill()
    wait_for(lambda: not d.tasks(), 5)
    wait_for(lambda: scrape(port).get('gpushare_reclaims_total{reason="exited"}') == 1, 5)
    with Connection(ep) as c:
        c.call("request", gpus=1, wait=0.0, command="x", memory=None)
        with pytest.raises(QuotaExceeded):
            c.call("request", gpus=3)
    m = scrape(port)
    assert m['gpushare_request_errors_total{code="quota_exceeded",endpoint="task"}'] == 1


def test_a_gpu_nvml_reports_lost_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    class NVMLError(Exception):
        def __init__(self, value: int) -> None:
            self.value = value

    calls: list[str] = []

    def handle(uuid: str) -> str:
        calls.append(uuid)
        if uuid.endswith("1"):
            raise NVMLError(15)  # NVML_ERROR_GPU_IS_LOST
        if uuid.endswith("2"):
            raise NVMLError(999)  # unknown: says nothing about the GPU
        return uuid

    fake = types.SimpleNamespace(
        NVMLError=NVMLError,
        NVML_ERROR_GPU_IS_LOST=15,
        NVML_ERROR_NOT_FOUND=6,
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetHandleByUUID=handle,
        nvmlDeviceGetMemoryInfo=lambda h: None,
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    gpus = [Gpu(i, f"GPU-0000000{i}", "x", 1) for i in range(3)]
    assert NvmlBackend(gpus).lost() == {1}
    assert len(calls) == 3


def test_labelled_series_exist_at_zero_from_the_start(daemon_factory: Any) -> None:
    """Before anything has happened, every series whose labels are known is there at 0: each
    reason a task ends for, each cap, each error code of each endpoint, each wait outcome,
    each GPU's and each environment's."""
    port = free_port()
    d = daemon_factory({"metrics": {"port": port}, "gpus": {"simulated_count": 2}})
    d.env("alice")
    d.stop()
    d.log = open(d.root / "nodemgr.log", "a")  # noqa: SIM115 (closed by d.stop)
    d.start()  # alice is known from the start
    m = scrape(port)
    for reason in REASONS:
        assert m[f'gpushare_reclaims_total{{reason="{reason}"}}'] == 0, reason
    for cap in CAPS:
        assert m[f'gpushare_connections_refused_total{{cap="{cap}"}}'] == 0
    for endpoint in ("admin", "task"):
        for code in ("busy", "bad_request", "no_resources", "internal"):
            assert m[f'gpushare_request_errors_total{{code="{code}",endpoint="{endpoint}"}}'] == 0
    for outcome in ("granted", "timeout"):
        assert m[f'gpushare_queue_wait_seconds_count{{outcome="{outcome}"}}'] == 0
    for gpu in ("0", "1"):
        assert m[f'gpushare_turn_switches_total{{gpu="{gpu}"}}'] == 0
        assert m[f'gpushare_turn_switch_seconds_count{{gpu="{gpu}"}}'] == 0
        assert m[f'gpushare_gpu_tasks{{gpu="{gpu}",uuid="{_uuid(d, int(gpu))}"}}'] == 0
    for name in ("gpus", "used_bytes", "tasks", "kernel_launches_total", "utilization_ratio"):
        assert m[f'gpushare_env_{name}{{env="alice"}}'] == 0, name
