"""Admission by prediction (docs/prediction.md#admission): ``gpushare-run --shape predicted``
against a real nodemgr on simulated GPUs, with the real dry run, shim and ledger, and
programs that call the driver themselves (tests/fixtures/driver_loop.py). PyTorch's:
tests/real_torch/test_torch_predict.py."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gpushare.client import Connection, NodeError
from gpushare.exitcodes import EXIT_NO_RESOURCES
from gpushare.messages import Estimate, Request
from gpushare.protocol import Err
from tests.conftest import ROOT, Holder
from tests.daemon.conftest import free_port, scrape

MIB = 1 << 20
GIB = 1 << 30
LOOP = str(ROOT / "tests" / "fixtures" / "driver_loop.py")
PREDICTED = ["--shape", "predicted"]


def loop(run_task: Any, ep: str, *args: str, opts: list[str] = PREDICTED) -> Any:
    return run_task(ep, sys.executable, LOOP, *args, opts=opts)


def granted(mib: int, margin: float = 0.1) -> int:
    """What nodemgr grants for a predicted peak of ``mib`` MiB: with the margin, whole MiB."""
    return math.ceil(mib * MIB * (1 + margin) / MIB) * MIB


def record(daemon: Any, env: str) -> dict[str, Any]:
    """The newest history record of ``env``."""
    records = daemon.admin("history", env=env)["records"]
    assert records, f"no record of {env}"
    return dict(records[0])


def running(daemon: Any, count: int, timeout: float = 90.0) -> list[dict[str, Any]]:
    """Wait until ``count`` tasks run (their dry runs come first); the tasks."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        tasks = daemon.tasks()
        if len(tasks) >= count:
            return list(tasks)
        time.sleep(0.05)
    raise AssertionError(f"{count} tasks never ran at once: {daemon.tasks()}")


def test_a_predicted_task_is_granted_its_peak_and_the_margin(
    daemon: Any, run_task: Any, tmp_path: Path
) -> None:
    ep = daemon.env("alice", gpus=1, memory=8 * GIB)
    gate = tmp_path / "gate"
    p = loop(run_task, ep, "512", "256", "5", "--gate", str(gate))
    (task,) = running(daemon, 1)
    assert task["predicted"] == 768 * MIB
    assert task["granted"] == granted(768) and task["topups"] == 0
    gpu = daemon.admin("status")["gpus"][task["gpus"][0]]
    # The GPU is charged the grant, not the 8 GiB quota.
    assert gpu["charged"] == granted(768)
    gate.touch()
    _, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert "predicted peak 768MiB per GPU" in err
    r = record(daemon, "alice")
    assert (r["predicted"], r["topups"], r["memory"]) == (768 * MIB, 0, granted(768))
    assert r["peak"] == 768 * MIB


def test_a_task_past_its_prediction_is_topped_up_and_its_next_run_learns(
    daemon: Any, run_task: Any
) -> None:
    ep = daemon.env("alice", gpus=1, memory=8 * GIB)
    # From step 6 on, beyond what the dry run's 4 steps saw, each step takes 512 MiB more.
    args = ("512", "256", "8", "--grow-after", "6", "512")
    p = loop(run_task, ep, *args)
    _, err = p.communicate(timeout=90)
    assert p.returncode == 0, err  # not killed, not out of memory: topped up
    first = record(daemon, "alice")
    assert first["predicted"] == 768 * MIB and first["topups"] == 1
    assert first["peak"] == 1280 * MIB
    # Topped up to what it asked for, with the margin.
    assert first["memory"] == granted(1280)
    # The same command again: granted what the last run measured, nothing to top up.
    p = loop(run_task, ep, *args)
    _, err = p.communicate(timeout=90)
    assert p.returncode == 0, err
    second = record(daemon, "alice")
    assert second["task_id"] != first["task_id"]
    assert (second["topups"], second["memory"]) == (0, granted(1280))


def small_node(daemon_factory: Any, topup_wait: float) -> Any:
    """One 4 GiB simulated GPU."""
    return daemon_factory(
        {
            "gpus": {"simulated_count": 1, "simulated_memory": "4GiB"},
            "prediction": {"topup_wait": topup_wait},
        }
    )


def test_a_top_up_waits_for_room_and_holds_it_back_from_new_grants(
    daemon_factory: Any, run_task: Any, wait_for: Any
) -> None:
    daemon = small_node(daemon_factory, 60.0)
    ep = daemon.env("alice", gpus=1, memory=3 * GIB)
    carol = daemon.env("carol", gpus=1, memory=GIB)
    bob = Holder(daemon.env("bob", gpus=1, memory=2 * GIB))  # charged its whole quota
    try:
        # 768 MiB predicted (845 granted) beside bob's 2 GiB; it then asks for 2.25 GiB,
        # which only bob's end can make room for.
        p = loop(run_task, ep, "512", "256", "8", "--grow-after", "6", "1536")
        wait_for(lambda: "top-up waits env=alice gpu=0" in daemon.logtext(), 60)
        # 1.15 GiB is free, but held back for alice's ask: carol's 1 GiB is not granted.
        q = run_task(carol, "true", opts=["--no-wait"])
        _, err = q.communicate(timeout=60)
        assert q.returncode == EXIT_NO_RESOURCES, err
    finally:
        bob.close()
    _, err = p.communicate(timeout=90)
    assert p.returncode == 0, err
    r = record(daemon, "alice")
    assert (r["topups"], r["peak"]) == (1, 2304 * MIB)
    assert r["memory"] >= 2304 * MIB


def test_a_top_up_without_room_in_time_fails_the_allocation(
    daemon_factory: Any, run_task: Any, wait_for: Any
) -> None:
    daemon = small_node(daemon_factory, 0.5)
    ep = daemon.env("alice", gpus=1, memory=3 * GIB)
    bob = Holder(daemon.env("bob", gpus=1, memory=2 * GIB))
    try:
        p = loop(run_task, ep, "512", "256", "8", "--grow-after", "6", "1536")
        _, err = p.communicate(timeout=90)
        assert p.returncode == 3, err
        assert "cuMemAlloc (temporary) failed: 2" in err  # CUDA_ERROR_OUT_OF_MEMORY
        r = record(daemon, "alice")
        assert (r["topups"], r["memory"]) == (0, granted(768))
        # It waited for room that never came (bob holds on), then gave up.
        wait_for(lambda: "top-up given up env=alice gpu=0" in daemon.logtext(), 10)
    finally:
        bob.close()


def test_an_ask_beyond_the_quota_is_refused_at_once(daemon_factory: Any, run_task: Any) -> None:
    # An hour's wait: a process that waited at all would outlive the test's timeout.
    daemon = daemon_factory({"prediction": {"topup_wait": 3600.0}})
    ep = daemon.env("alice", gpus=1, memory=GIB)
    p = loop(run_task, ep, "512", "256", "8", "--grow-after", "6", "512")
    _, err = p.communicate(timeout=90)
    # The quota can never hold 1.25 GiB: refused without a wait.
    assert p.returncode == 3, err
    assert record(daemon, "alice")["topups"] == 0


def test_prediction_admits_tasks_the_whole_quota_would_not(
    daemon_factory: Any, run_task: Any, tmp_path: Path
) -> None:
    daemon = daemon_factory({"gpus": {"simulated_count": 1, "simulated_memory": "16GiB"}})
    eps = [daemon.env(name, gpus=1, memory=7 * GIB) for name in ("a", "b", "c")]
    gate = tmp_path / "gate"
    args = ("1024", "512", "3", "--gate", str(gate))
    # Whole quotas: two of 7 GiB fit on the 16 GiB GPU; the third is refused.
    whole = [loop(run_task, ep, *args, opts=["--no-wait"]) for ep in eps[:2]]
    running(daemon, 2)
    third = loop(run_task, eps[2], *args, opts=["--no-wait"])
    _, err = third.communicate(timeout=60)
    assert third.returncode == EXIT_NO_RESOURCES, err
    gate.touch()
    for p in whole:
        assert p.wait(60) == 0
    gate.unlink()
    # By prediction: 1.5 GiB each and the margin; all three at once.
    shaped = [loop(run_task, ep, *args, opts=[*PREDICTED, "--no-wait"]) for ep in eps]
    tasks = running(daemon, 3)
    assert sorted(t["granted"] for t in tasks) == [granted(1536)] * 3
    gate.touch()
    for p in shaped:
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, err


def test_a_dry_run_that_predicts_nothing_asks_for_the_whole_quota(
    daemon: Any, run_task: Any
) -> None:
    ep = daemon.env("alice", gpus=1, memory=2 * GIB)
    # A command that fails on its own: the dry run says so, the run goes on without a
    # prediction and ends as the command does.
    p = run_task(ep, sys.executable, "-c", "raise SystemExit(4)", opts=PREDICTED)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 4, err
    assert "the dry run made no prediction" in err and "asking for the whole quota" in err
    r = record(daemon, "alice")
    assert r["predicted"] is None and r["memory"] == 2 * GIB


def test_metrics_show_predicted_granted_and_measured(
    daemon_factory: Any, run_task: Any, wait_for: Any, tmp_path: Path
) -> None:
    port = free_port()
    daemon = daemon_factory({"metrics": {"port": port}})
    ep = daemon.env("alice", gpus=1, memory=8 * GIB)
    gate = tmp_path / "gate"
    p = loop(run_task, ep, "512", "256", "8", "--gate", str(gate), "--grow-after", "6", "512")
    (task,) = running(daemon, 1)
    series = f'{{env="alice",task="{task["task_id"]}"}}'

    def shown() -> bool:
        return scrape(port).get(f"gpushare_task_predicted_bytes{series}") == 768 * MIB

    wait_for(shown, 10, interval=0.2)
    m = scrape(port)
    assert m[f"gpushare_task_granted_bytes{series}"] == granted(768)
    assert m['gpushare_env_granted_bytes{env="alice"}'] == granted(768)
    assert m["gpushare_prediction_topups_total"] == 0
    gate.touch()
    _, err = p.communicate(timeout=90)
    assert p.returncode == 0, err

    def counted() -> bool:
        m = scrape(port)
        # The histogram counts at once; the top-ups are in the next snapshot (each second).
        return (
            m.get("gpushare_prediction_peak_ratio_count") == 1
            and m.get("gpushare_prediction_topups_total") == 1
        )

    wait_for(counted, 10, interval=0.2)
    m = scrape(port)
    assert m["gpushare_prediction_topups_refused_total"] == 0
    # Measured 1280 MiB against 768 predicted: a ratio of 1.67, above the 1.5 bucket.
    assert m['gpushare_prediction_peak_ratio_bucket{le="1.5"}'] == 0
    assert m['gpushare_prediction_peak_ratio_bucket{le="2.0"}'] == 1


def test_a_grant_by_prediction_survives_a_restart(
    daemon: Any, run_task: Any, tmp_path: Path
) -> None:
    ep = daemon.env("alice", gpus=1, memory=8 * GIB)
    gate = tmp_path / "gate"
    p = loop(run_task, ep, "512", "256", "8", "--gate", str(gate), "--grow-after", "6", "512")
    (before,) = running(daemon, 1)
    daemon.kill()
    daemon.start()
    (after,) = daemon.tasks()
    assert after["task_id"] == before["task_id"]
    assert (after["predicted"], after["granted"]) == (768 * MIB, granted(768))
    gpu = daemon.admin("status")["gpus"][after["gpus"][0]]
    assert gpu["charged"] == granted(768)
    # The restarted nodemgr tops it up as the first would have.
    gate.touch()
    _, err = p.communicate(timeout=90)
    assert p.returncode == 0, err
    r = record(daemon, "alice")
    assert (r["topups"], r["memory"], r["peak"]) == (1, granted(1280), 1280 * MIB)


def test_step_time_is_estimated_measured_and_learned(daemon_factory: Any, run_task: Any) -> None:
    """docs/prediction.md#step-time, on simulated GPUs with the device timeline: the first
    run of a command is estimated from its dry run's features, each run's step time is
    measured, and the next run of the command is estimated from the last."""
    daemon = daemon_factory({"gpus": {"simulated_timeline": True}})
    ep = daemon.env("alice", gpus=1, memory=4 * GIB)
    # 500 launches of 8 us each and a read back per step: 4 ms of device time a step,
    # and 20 ms of the host's: steps that several of nodemgr's sweeps see.
    args = ("64", "32", "30", "--launches", "500", "--reads", "1", "--step-seconds", "0.02")
    p = loop(run_task, ep, *args)
    _, err = p.communicate(timeout=90)
    assert p.returncode == 0, err
    first = record(daemon, "alice")
    assert first["gpu_model"] == "gpushare Simulated GPU"
    assert first["predicted_step"] is not None and first["predicted_step"] >= 0.004
    assert 0 < first["predicted_utilization"] <= 1
    assert first["step"] is not None and first["step"] >= 0.004
    p = loop(run_task, ep, *args)
    _, err = p.communicate(timeout=90)
    assert p.returncode == 0, err
    second = record(daemon, "alice")
    assert second["task_id"] != first["task_id"]
    # The median of the one earlier run of the command: its measured step time.
    assert second["predicted_step"] == pytest.approx(first["step"])
    assert second["step"] is not None


# What the simulated NVML says of its default device, an H100 SXM5 (sim/sim_attrs.c): the
# estimate's peaks, worked out here from the vendor's figures.
H100_FP32 = 16896 * 2 * 1.98e9  # cores, a multiply-add each, at 1980 MHz
H100_BF16 = 132 * 4096 * 1.98e9  # SMs, dense tensor core operations a clock
H100_HBM = 2619e6 * 2 * 5120 / 8  # memory clock, two transfers, 5120-bit bus


def test_the_analytic_estimate_takes_what_nvml_says_of_the_gpu(daemon: Any) -> None:
    """docs/prediction.md#step-time: without history, nodemgr's estimate is the roofline
    of the dry run's features against the rates NVML's description of the GPU gives:
    1000 launches of 3 us, and the longest of their waves (5 us each), their arithmetic
    and their operators' bytes."""
    ep = daemon.env("alice", gpus=1, memory=GIB)
    core = {
        "kernels_per_step": 1000.0,
        "host_bytes_per_step": 0.0,
        "device_bytes_per_step": 0.0,
        "host_step": 0.0,
    }
    cases = [
        ({}, 1000 * 5e-6),
        ({"waves_per_step": 4000.0}, 4000 * 5e-6),
        ({"waves_per_step": 1000.0, "flops_per_step": 1e12}, 1e12 / H100_FP32),
        ({"half_flops_per_step": 1e13}, 1e13 / H100_BF16),
        ({"flops_per_step": 1e9, "op_bytes_per_step": 1e11}, 1e11 / H100_HBM),
    ]
    with Connection(ep, timeout=10.0) as c:
        for extra, work in cases:
            [est] = c.send(Estimate(command="train", **core, **extra)).gpus
            assert est["source"] == "analytic"
            assert est["step"] == pytest.approx(1000 * 3e-6 + work, rel=1e-3), extra
            assert est["utilization"] == 1.0
        # The other features only with the first four.
        with pytest.raises(NodeError) as e:
            c.send(Request(gpus=1, command="train", waves_per_step=10.0, wait=0.0))
        assert e.value.code == Err.BAD_REQUEST and "all four" in e.value.message
    assert daemon.tasks() == []


def test_a_task_without_a_prediction_beside_predicted_ones_is_charged_the_quota(
    daemon_factory: Any, run_task: Any, tmp_path: Path
) -> None:
    """An environment holding a GPU for tasks granted by prediction is charged their
    grants there; a task of it sent without a prediction brings the whole quota, and is
    granted only where the GPU has room for that."""
    daemon = daemon_factory({"gpus": {"simulated_count": 1, "simulated_memory": "16GiB"}})
    ep = daemon.env("alice", gpus=1, memory=8 * GIB)
    gate = tmp_path / "gate"
    p = loop(run_task, ep, "512", "256", "3", "--gate", str(gate))
    running(daemon, 1)
    bob = Holder(daemon.env("bob", gpus=1, memory=10 * GIB))
    try:
        # 845 MiB and bob's 10 GiB fit; alice's 8 GiB quota beside bob's 10 would not.
        q = run_task(ep, "true", opts=["--no-wait"])
        _, err = q.communicate(timeout=60)
        assert q.returncode == EXIT_NO_RESOURCES, err
        assert daemon.admin("status")["gpus"][0]["charged"] == granted(768) + 10 * GIB
    finally:
        bob.close()
        gate.touch()
    _, err = p.communicate(timeout=60)
    assert p.returncode == 0, err


def test_the_grant_holds_one_process_context(daemon_factory: Any, run_task: Any) -> None:
    daemon = daemon_factory({"gpus": {"context_memory": "64MiB"}})
    ep = daemon.env("alice", gpus=1, memory=4 * GIB)
    p = loop(run_task, ep, "512", "256", "8")
    _, err = p.communicate(timeout=90)
    assert p.returncode == 0, err
    r = record(daemon, "alice")
    # The dry run's context takes nothing; the run's is charged 64 MiB, granted besides.
    assert (r["memory"], r["topups"]) == (granted(768) + 64 * MIB, 0)
