"""Real PyTorch under gpushare: the pinned torch (test_torch_sim.py's venv) run by a
real gpushare-run, with the shim preloaded, against a real nodemgr on simulated GPUs.

The environment's memory quota is what torch sees as the device (``mem_get_info``), going
past it is torch's own ``torch.OutOfMemoryError`` in each allocator mode, and what the
allocator holds is what nodemgr charges the task, down to nothing after
``torch.cuda.empty_cache()``. A training-like loop's kernel launches and CUDA graph replays
reach the shim (nodemgr counts them) and stop while the task is paused; killed with
SIGKILL, its memory comes back at once.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Daemon
from tests.real_torch.test_torch_sim import MODES, torch_python  # noqa: F401 (a fixture)

HERE = Path(__file__).resolve().parent
CASE = HERE / "torch_quota_case.py"
GIB = 1 << 30
MIB = 1 << 20
QUOTA = 2 * GIB
MARK = "@@stage "
# The simulated driver's context charge and allocator rounding: what a task holds beyond
# its tensors (docs/architecture.md: a per-process context charge).
SLACK = 64 * MIB


def start_torch(
    run_task: Any, endpoint: str, python: str, script: Path, mode: str = "native", **popen: Any
) -> subprocess.Popen[str]:
    """script under gpushare-run, in allocator mode `mode`, whatever this process's
    environment says (run_task starts from it: an empty setting is torch's default)."""
    env = {"PYTORCH_CUDA_ALLOC_CONF": MODES[mode] or ""}
    proc: subprocess.Popen[str] = run_task(endpoint, python, str(script), env=env, **popen)
    return proc


@pytest.fixture
def torch_case(
    daemon: Daemon,
    run_task: Any,
    torch_python: str,  # noqa: F811 (the fixture imported above)
) -> Callable[..., subprocess.Popen[str]]:
    """Starts a staged program (start_torch, its stdin a pipe for go_on) in environment
    alice: one GPU, QUOTA of memory."""

    def start(script: Path, mode: str = "native") -> subprocess.Popen[str]:
        endpoint = daemon.env("alice", gpus=1, memory=QUOTA)
        return start_torch(run_task, endpoint, torch_python, script, mode, stdin=subprocess.PIPE)

    return start


def read_stage(p: subprocess.Popen[str], name: str) -> dict[str, Any]:
    assert p.stdout is not None
    for line in p.stdout:
        if line.startswith(MARK):
            got, _, value = line[len(MARK) :].partition(" ")
            assert got == name, line
            result: dict[str, Any] = json.loads(value)
            return result
    assert p.stderr is not None
    err = p.stderr.read()[-4000:]
    raise AssertionError(f"the program ended (status {p.wait(30)}) before stage {name}: {err}")


def go_on(p: subprocess.Popen[str]) -> None:
    assert p.stdin is not None
    p.stdin.write("\n")
    p.stdin.flush()


def memory_used(daemon: Daemon) -> int:
    (task,) = daemon.tasks()
    return int(task["memory_used"])


@pytest.mark.parametrize("mode", list(MODES))
def test_the_quota_is_torchs_device_and_its_out_of_memory_error(
    daemon: Daemon, torch_case: Any, mode: str
) -> None:
    p = torch_case(CASE, mode)

    start = read_stage(p, "start")
    assert start["mem_get_info"] == [QUOTA, QUOTA]  # the quota is the device torch sees
    go_on(p)

    held = read_stage(p, "held")
    assert held["reserved"] >= GIB + GIB // 2
    assert GIB + GIB // 2 <= memory_used(daemon) <= GIB + GIB // 2 + SLACK
    free, total = held["mem_get_info"]
    assert total == QUOTA and free <= QUOTA - (GIB + GIB // 2)
    go_on(p)

    refused = read_stage(p, "refused")["refused"]
    assert refused is not None, "1 GiB more than the quota's 2 GiB was granted"
    assert refused["type"] == "torch.OutOfMemoryError", refused
    assert "out of memory" in refused["message"].lower()
    assert memory_used(daemon) <= GIB + GIB // 2 + SLACK  # nothing of the refused GiB
    go_on(p)

    # Freed, the memory stays in torch's cache or in its pool (cudaMallocAsync keeps all it
    # frees): still the environment's, and charged as such.
    freed = read_stage(p, "freed")
    assert freed["reserved"] >= GIB + GIB // 2
    assert freed["reserved"] <= memory_used(daemon) <= freed["reserved"] + SLACK
    go_on(p)

    emptied = read_stage(p, "emptied")
    assert emptied["reserved"] == 0
    assert memory_used(daemon) <= SLACK  # back to the environment's pool
    go_on(p)
    assert p.wait(60) == 0


LOOP = HERE / "torch_loop_case.py"


class Loop:
    """The loop program under gpushare-run; its output read by a thread, line by line."""

    def __init__(self, run_task: Any, endpoint: str, python: str) -> None:
        self.p = start_torch(run_task, endpoint, python, LOOP)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        first = self.next(120)
        assert first.startswith("pid "), first
        self.pid = int(first.split()[1])

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.lines.put(line.strip())

    def next(self, timeout: float) -> str:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no line from the loop within {timeout}s") from None

    def steps_within(self, seconds: float) -> int:
        """How many steps the loop reports in the next `seconds`."""
        deadline, n = time.monotonic() + seconds, 0
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            n += line.startswith("step ")
        return n


def test_pause_holds_real_torch_launches_and_graph_replays(
    daemon: Daemon,
    run_task: Any,
    torch_python: str,  # noqa: F811 (the fixture imported above)
    wait_for: Any,
) -> None:
    """cudart's launches reach the shim's cuLaunchKernel* and cuGraphLaunch: nodemgr counts
    them, and a paused task stops in them until it is resumed."""
    endpoint = daemon.env("alice", gpus=1, memory=QUOTA)
    loop = Loop(run_task, endpoint, torch_python)
    assert loop.steps_within(1.0) >= 3
    [task] = daemon.tasks()
    assert task["launches"] > 0  # counted by the shim's launch wrappers
    daemon.admin("pause", task_id=task["task_id"])
    loop.steps_within(0.5)  # a step already past its launches may still finish
    assert loop.steps_within(1.0) == 0, "a paused task went on launching"
    held = daemon.tasks()[0]["launches"]
    daemon.admin("resume", task_id=task["task_id"])
    assert loop.steps_within(1.0) >= 3
    wait_for(lambda: daemon.tasks()[0]["launches"] > held, 5)


def test_kill9_of_real_torch_gives_its_memory_back(
    daemon: Daemon,
    run_task: Any,
    torch_python: str,  # noqa: F811 (the fixture imported above)
    wait_for: Any,
) -> None:
    endpoint = daemon.env("alice", gpus=1, memory=QUOTA)
    loop = Loop(run_task, endpoint, torch_python)
    assert loop.steps_within(0.5) >= 1
    assert memory_used(daemon) >= 512 * MIB
    os.kill(loop.pid, signal.SIGKILL)
    took = wait_for(lambda: daemon.tasks() == [] and daemon.gpu_used(0) == 0, timeout=5.0)
    assert took < 1.0  # the reclaim target: nodemgr sees the process end (pidfd)
    assert loop.p.wait(10) == 128 + signal.SIGKILL


POOL = HERE / "torch_pool_case.py"


def test_a_tasks_processes_share_one_pool_and_ipc_is_charged_once(
    daemon: Daemon, torch_case: Any
) -> None:
    """A spawned child draws on the same quota as its parent; a CUDA tensor the parent
    sends it (torch.multiprocessing, CUDA IPC) is the parent's memory, not new memory."""
    p = torch_case(POOL)

    read_stage(p, "parent")
    assert GIB <= memory_used(daemon) <= GIB + SLACK
    go_on(p)

    child = read_stage(p, "child")
    # 1 GiB + 512 MiB held: 1 GiB more is past the 2 GiB the two share.
    assert child["refused"] == "torch.OutOfMemoryError"
    assert GIB + 512 * MIB <= memory_used(daemon) <= GIB + 512 * MIB + 2 * SLACK
    go_on(p)

    shared = read_stage(p, "shared")
    assert shared["same"] is True
    # The 256 MiB tensor once, though two processes map it.
    assert GIB + 768 * MIB <= memory_used(daemon) <= GIB + 768 * MIB + 2 * SLACK
    go_on(p)
    assert p.wait(60) == 0


GRAPH_MEMORY = HERE / "torch_graph_memory_case.py"


def test_graph_memory_of_a_cudamallocasync_capture_is_charged_while_mapped(
    daemon: Daemon, torch_case: Any
) -> None:
    """With backend:cudaMallocAsync a capture's allocations are graph memory, which the
    driver's graph pool maps at replay: nodemgr's charge covers it from the first replay,
    not before. Torch's reset and empty_cache free the graph's allocations but do not trim
    the graph pool (cudaDeviceGraphMemTrim), so the driver keeps the memory: so does the
    charge."""
    p = torch_case(GRAPH_MEMORY, "async")

    captured = read_stage(p, "captured")
    assert captured["graph_reserved"] == 0  # nodes only: nothing mapped yet
    assert memory_used(daemon) <= captured["pool_reserved"] + SLACK  # not the 256 MiB
    go_on(p)

    replayed = read_stage(p, "replayed")
    assert replayed["out_shape"] == [MIB]
    assert replayed["graph_reserved"] >= 256 * MIB
    charged = memory_used(daemon)
    assert charged >= replayed["graph_reserved"] + replayed["pool_reserved"]
    assert charged <= replayed["graph_reserved"] + replayed["pool_reserved"] + SLACK
    go_on(p)

    reset = read_stage(p, "reset")
    assert reset["graph_reserved"] == replayed["graph_reserved"]
    charged = memory_used(daemon)
    assert reset["graph_reserved"] + reset["pool_reserved"] <= charged
    assert charged <= reset["graph_reserved"] + reset["pool_reserved"] + SLACK
    go_on(p)
    assert p.wait(60) == 0
