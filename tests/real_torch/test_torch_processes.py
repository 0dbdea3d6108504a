"""Real PyTorch's processes under gpushare: auto-load without gpushare-run, a DataLoader's
forked workers with pinned memory, two ranks of torch.distributed.run on two GPUs, and
kill -9 of a worker and of the process that holds the memory.

The pinned torch (tests/real_torch/test_torch_sim.py's venv, gpushare installed into it) on the
simulated driver, a real nodemgr, the real shim. Each program reports its stages on stdout
(``@@stage NAME JSON``, then waits for a line on stdin) so the test reads nodemgr's view of
the task at each point, as tests/real_torch/test_torch_gpushare.py does.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpushare import libs
from nodemgr.host import procfs
from tests.conftest import Daemon, shim_preload
from tests.real_torch.test_torch_gpushare import (
    GIB,
    MIB,
    QUOTA,
    SLACK,
    go_on,
    read_stage,
    torch_case,  # noqa: F401 (a fixture)
)
from tests.real_torch.test_torch_sim import torch_python  # noqa: F401 (a fixture)

HERE = Path(__file__).resolve().parent
AUTOLOAD = HERE / "torch_autoload_case.py"
DATALOADER = HERE / "torch_dataloader_case.py"
RANKS = HERE / "torch_ranks_case.py"
# nodemgr sees a process end through its pidfd: the task's memory is back well within this
# (tests/real_torch/test_torch_gpushare.py's kill -9 test measures the same; the benchmark's
# reclaim_kill, unloaded, 100 ms).
RECLAIM = 1.0
# An auto-loaded task heartbeats from a thread of its own process, which needs the GIL, and
# torch's import holds the GIL while the dynamic loader maps and relocates its libraries
# (up to 0.34 s at a time on an idle 2-core machine, longer on a loaded one). The test
# daemon's 1 s heartbeat timeout is shorter than that can take: a silent task is killed at
# once, before its next stage. These tests are about grants and processes, not about
# reclaiming a silent task (tests/daemon covers that), so their nodemgr waits as long as
# this; the node's default is 5 s (docs/client.md#auto-load-python).
HEARTBEAT_TIMEOUT = 1.0


def container_env(endpoint: str, **extra: str) -> dict[str, str]:
    """A dev container's environment: auto-load on, the environment's endpoint, the node's
    driver on the library path (here the simulated one: without gpushare, torch would see
    its four GPUs), and nothing of this process's gpushare, CUDA or torch settings."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("GPUSHARE_", "PYTORCH_", "TORCH_", "CUDA_"))
        and k not in ("LD_PRELOAD", "PYTHONPATH", "PYTHONHOME")
    }
    env.update(
        GPUSHARE_AUTOLOAD="1",
        GPUSHARE_ENDPOINT=endpoint,
        LD_LIBRARY_PATH=str(libs.sim_driver_dir()),
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


@pytest.fixture
def daemon(daemon_factory: Any) -> Daemon:
    """The suite's daemon, with HEARTBEAT_TIMEOUT."""
    d: Daemon = daemon_factory(heartbeat_timeout=HEARTBEAT_TIMEOUT)
    return d


@pytest.fixture
def container() -> Iterator[Any]:
    """Starts a command in a container-like environment (no gpushare-run), in a session
    of its own; whatever is left of it is killed afterwards."""
    started: list[subprocess.Popen[str]] = []

    def start(argv: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
        p = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        started.append(p)
        return p

    yield start
    for p in started:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.communicate(timeout=30)


@pytest.fixture
def autoload_case(
    container: Any,
    torch_python: str,  # noqa: F811 (the fixture imported above)
) -> Any:
    """Starts tests/real_torch/torch_autoload_case.py under the pinned torch in a
    container-like environment (``container``), given that environment."""

    def start(env: dict[str, str]) -> subprocess.Popen[str]:
        p: subprocess.Popen[str] = container([torch_python, str(AUTOLOAD)], env)
        return p

    return start


def records(daemon: Daemon, env: str) -> list[dict[str, Any]]:
    return list(daemon.admin("history", env=env)["records"])


def gone(pid: int) -> bool:
    """Whether process pid has ended (a zombie has)."""
    return procfs.state(pid) in (None, "Z", "X")


def uuid(daemon: Daemon, index: int) -> str:
    return str(daemon.admin("status")["gpus"][index]["uuid"])


# Auto-load ------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["preloaded", "restarted"])
def test_autoload_grants_before_torchs_first_cuda_call(
    daemon: Daemon, autoload_case: Any, how: str
) -> None:
    """`python script.py` in a dev container: `import torch` gets the grant before torch's
    code runs, the shim enforces it (a preloaded inert shim attached in place, or the
    interpreter restarted with it), and torch sees the quota as its device."""
    endpoint = daemon.env("alice", gpus=1, memory=QUOTA)
    extra = {"LD_PRELOAD": shim_preload()} if how == "preloaded" else {}
    p = autoload_case(container_env(endpoint, **extra))

    before = read_stage(p, "before")
    assert before == {"pid": p.pid, "torch": False}
    assert daemon.tasks() == []  # nothing is asked before the import
    go_on(p)
    if how == "restarted":
        # The import got the grant, then ran the interpreter again (same pid) with the shim.
        assert read_stage(p, "before") == before
        [task] = daemon.tasks()
        assert task["pid"] == p.pid
        go_on(p)

    imported = read_stage(p, "imported")
    assert imported["pid"] == p.pid
    assert imported["mode"] == "enforce"
    [task] = daemon.tasks()
    assert imported["visible"] == uuid(daemon, task["gpus"][0])
    # The grant is in place and torch has not called into CUDA yet: no process of the task
    # has claimed a ledger slot.
    assert imported["initialized"] is False
    assert task["pid"] == p.pid and task["processes"] == 0 and task["memory_used"] == 0
    go_on(p)

    held = read_stage(p, "held")
    assert held["mem_get_info"] == [QUOTA, QUOTA]
    assert held["reserved"] == 512 * MIB
    assert 512 * MIB <= daemon.tasks()[0]["memory_used"] <= 512 * MIB + SLACK
    assert held["refused"]["type"] == "torch.OutOfMemoryError", held["refused"]
    assert "out of memory" in held["refused"]["message"].lower()
    go_on(p)

    _, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    [rec] = records(daemon, "alice")
    assert rec["pid"] == p.pid and rec["reason"] == "done"  # said at exit
    assert daemon.tasks() == [] and daemon.gpu_used(task["gpus"][0]) == 0


@pytest.mark.parametrize("setting", ["warn", "error"])
def test_autoload_with_a_zero_quota_runs_torch_on_the_cpu_or_fails_clearly(
    daemon: Daemon, autoload_case: Any, setting: str
) -> None:
    """docs/client.md, "What a refusal does on import": by default one warning and torch
    sees no GPU; GPUSHARE_ZERO_QUOTA=error makes the import raise GpushareError."""
    endpoint = daemon.env("zero", gpus=0)
    env = container_env(endpoint, LD_PRELOAD=shim_preload(), GPUSHARE_ZERO_QUOTA=setting)
    p = autoload_case(env)
    read_stage(p, "before")
    go_on(p)
    if setting == "error":
        out, err = p.communicate(timeout=60)
        assert p.returncode == 1
        assert "@@stage imported" not in out  # the import never finished
        assert "GpushareError" in err and "GPUSHARE_ZERO_QUOTA=error" in err
        assert err.count("GPU quota is 0") == 1, err
    else:
        imported = read_stage(p, "imported")
        # The preloaded shim stays inert; the driver is there, but no GPU is visible.
        assert imported["mode"] == "inert" and imported["visible"] == ""
        go_on(p)
        no_gpu = read_stage(p, "no_gpu")
        assert no_gpu["device_count"] == 0
        assert no_gpu["refused"]["type"] == "builtins.RuntimeError", no_gpu["refused"]
        go_on(p)
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        said = [line for line in err.splitlines() if line.startswith("gpushare:")]
        assert len(said) == 1 and "GPU quota is 0" in said[0], err
    assert records(daemon, "zero") == []


# DataLoader workers ---------------------------------------------------------------------


def test_dataloader_workers_share_the_task_and_pinned_memory_is_not_charged(
    daemon: Daemon,
    torch_case: Any,  # noqa: F811 (the fixture imported above)
    wait_for: Any,
) -> None:
    """Two forked workers feed pinned batches to the GPU: the task is charged what the main
    process's allocator holds, not the pinned host memory. A worker killed with SIGKILL is
    torch's own DataLoader error in the main process, and leaves the ledger as it was."""
    p = torch_case(DATALOADER)

    running = read_stage(p, "running")
    main, workers = running["pid"], running["workers"]
    assert len(workers) == 2
    for w in workers:  # forked by the main process, part of the task's process tree
        assert procfs.stat_ints(w, 1) == (main,)  # its parent
    assert running["pinned"] >= 128 * MIB  # batches pinned by the loader
    [task] = daemon.tasks()
    gpu = task["gpus"][0]
    # 256 MiB of model and the batches copied to the GPU; not one pinned byte.
    assert running["reserved"] >= 256 * MIB + 64 * MIB
    assert running["reserved"] <= task["memory_used"] <= running["reserved"] + SLACK
    assert task["processes"] == 1  # the workers never called into CUDA
    go_on(p)

    # Mid-epoch: the main process is copying batches. Killed before it left the stage
    # above, the worker would be an error there instead, from torch's SIGCHLD handler.
    read_stage(p, "epoch")
    os.kill(workers[0], signal.SIGKILL)
    ended = read_stage(p, "ended")
    error = ended["error"]
    assert error is not None and error["type"] == "builtins.RuntimeError", error
    assert "DataLoader worker" in error["message"] and str(workers[0]) in error["message"]
    [task] = daemon.tasks()
    assert ended["reserved"] <= task["memory_used"] <= ended["reserved"] + SLACK
    assert daemon.gpu_used(gpu) == task["memory_used"]  # nothing else on the GPU's ledger
    assert task["processes"] == 1
    go_on(p)

    assert p.wait(60) == 0
    wait_for(lambda: daemon.tasks() == [] and daemon.gpu_used(gpu) == 0, 5)
    [rec] = records(daemon, "alice")
    assert rec["reason"] == "done" and rec["exit_code"] == 0


@pytest.mark.parametrize("launch", ["gpushare-run", "autoload"])
def test_kill9_of_the_main_process_reclaims_while_its_workers_live(
    daemon: Daemon,
    run_task: Any,
    container: Any,
    torch_python: str,  # noqa: F811 (the fixture imported above)
    wait_for: Any,
    tmp_path: Path,
    launch: str,
) -> None:
    """The forked workers inherited the main process's descriptors (the ledger's, and with
    auto-load the heartbeat's connection); one of them is held in a slow sample, so it
    certainly outlives the main process: the memory comes back all the same, within the
    reclaim target, and the workers end by themselves once the sample is done."""
    endpoint = daemon.env("alice", gpus=1, memory=QUOTA)
    hold = tmp_path / "hold"
    if launch == "gpushare-run":
        env = {"PYTORCH_CUDA_ALLOC_CONF": "", "HOLD": str(hold)}
        p = run_task(endpoint, torch_python, str(DATALOADER), env=env, stdin=subprocess.PIPE)
    else:
        env = container_env(endpoint, LD_PRELOAD=shim_preload(), HOLD=str(hold))
        p = container([torch_python, str(DATALOADER)], env)
    running = read_stage(p, "running")
    [task] = daemon.tasks()
    gpu = task["gpus"][0]
    assert task["memory_used"] >= 256 * MIB
    hold.touch()
    try:
        go_on(p)  # the main process asks for more batches; a worker starts on a sample
        wait_for(lambda: any(tmp_path.glob("hold.*")), 30)
        held = int(next(tmp_path.glob("hold.*")).suffix[1:])
        assert held in running["workers"]

        os.kill(running["pid"], signal.SIGKILL)
        took = wait_for(lambda: daemon.tasks() == [] and daemon.gpu_used(gpu) == 0, 5)
        assert not gone(held)  # it still holds what it inherited
        assert took < RECLAIM
        # gpushare-run exits as its command did; the auto-loaded process is the one killed.
        killed = 128 + signal.SIGKILL if launch == "gpushare-run" else -signal.SIGKILL
        assert p.wait(10) == killed
    finally:
        hold.unlink()  # else the held worker (outside gpushare-run's group) never ends
    # torch's workers watch their parent and leave when it is gone.
    wait_for(lambda: all(gone(w) for w in running["workers"]), 20)
    [rec] = records(daemon, "alice")
    if launch == "gpushare-run":  # it saw its command killed, and said so
        assert rec["reason"] == "killed" and rec["exit_code"] == 128 + signal.SIGKILL, rec
    else:  # the holder itself was killed: nodemgr saw it end
        assert rec["reason"] == "exited", rec


# Ranks ----------------------------------------------------------------------------------


@pytest.mark.parametrize("launch", ["gpushare-run", "autoload"])
def test_two_ranks_each_on_its_own_granted_gpu(
    daemon_factory: Any,
    run_task: Any,
    container: Any,
    torch_python: str,  # noqa: F811 (the fixture imported above)
    tmp_path: Path,
    launch: str,
) -> None:
    """`python -m torch.distributed.run --nproc_per_node=2` on a two-GPU node, granted both:
    under gpushare-run --gpus 2, or auto-loaded with GPUSHARE_GPUS=2 (the launcher's own
    `import torch` asks). Rank R works on cuda:R; nodemgr charges each GPU what its rank
    holds, all to the one task, and the quota holds per GPU."""
    daemon: Daemon = daemon_factory(
        {"gpus": {"simulated_count": 2}}, heartbeat_timeout=HEARTBEAT_TIMEOUT
    )
    endpoint = daemon.env("alice", gpus=2, memory=QUOTA)
    go = tmp_path / "go"
    argv = [torch_python, "-m", "torch.distributed.run", "--nproc_per_node=2", str(RANKS)]
    if launch == "gpushare-run":
        p = run_task(endpoint, *argv, gpus=2, env={"GO": str(go)})
    else:
        p = container(argv, container_env(endpoint, GPUSHARE_GPUS="2", GO=str(go)))

    reports: dict[int, dict[str, Any]] = {}
    assert p.stdout is not None
    for line in p.stdout:
        if line.startswith("@@rank "):
            rank, _, value = line.removeprefix("@@rank ").partition(" ")
            reports[int(rank)] = json.loads(value)
            if len(reports) == 2:
                break
    assert sorted(reports) == [0, 1], p.stderr.read() if p.stderr else ""
    for rank, report in reports.items():
        assert report["device"] == f"cuda:{rank}"
        assert report["sum"] == [3.0] * 4  # gloo's all-reduce of the two ranks' values
        assert report["quota"] == QUOTA  # each GPU's quota, as torch sees its device
        assert report["refused"] == "torch.OutOfMemoryError"
    [task] = daemon.tasks()
    assert len(task["gpus"]) == 2
    # The launcher (it asks CUDA how many GPUs there are, and holds nothing) and two ranks.
    assert task["processes"] == 3
    used = [daemon.gpu_used(g) for g in task["gpus"]]  # in the order CUDA numbers them
    for rank, held in enumerate(used):
        want = (rank + 1) * 512 * MIB
        assert want <= held <= want + SLACK, used
    assert task["memory_used"] == sum(used)
    assert sum(used) < GIB + GIB // 2 + 2 * SLACK  # nothing of the refused allocations

    go.touch()
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert daemon.tasks() == [] and all(daemon.gpu_used(g) == 0 for g in task["gpus"])
    [rec] = records(daemon, "alice")
    assert rec["reason"] == "done" and rec["gpus"] == task["gpus"]
