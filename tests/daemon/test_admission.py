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

from gpushare.exitcodes import EXIT_NO_RESOURCES
from tests.conftest import ROOT, Holder

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


def test_a_top_up_without_room_is_refused_and_the_allocation_fails(
    daemon_factory: Any, run_task: Any
) -> None:
    daemon = daemon_factory(
        {
            "gpus": {"simulated_count": 1, "simulated_memory": "4GiB"},
            "prediction": {"topup_wait": 0.5},
        }
    )
    ep = daemon.env("alice", gpus=1, memory=3 * GIB)
    bob = Holder(daemon.env("bob", gpus=1, memory=2 * GIB))  # charged its whole quota
    try:
        # 768 MiB predicted (845 granted) beside bob's 2 GiB; it then asks for 2.25 GiB.
        p = loop(run_task, ep, "512", "256", "8", "--grow-after", "6", "1536")
        _, err = p.communicate(timeout=90)
        assert p.returncode == 3, err
        assert "cuMemAlloc (temporary) failed: 2" in err  # CUDA_ERROR_OUT_OF_MEMORY
        r = record(daemon, "alice")
        assert (r["topups"], r["memory"]) == (0, granted(768))
        assert "top-up refused env=alice gpu=0" in daemon.logtext()
    finally:
        bob.close()


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
