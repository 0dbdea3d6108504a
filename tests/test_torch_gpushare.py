"""Real PyTorch under gpushare: the pinned torch (tests/test_torch_sim.py's venv) run by a
real gpushare-run, with the shim preloaded, against a real nodemgr on simulated GPUs.

The environment's memory quota is what torch sees as the device (``mem_get_info``), going
past it is torch's own ``torch.OutOfMemoryError`` in each allocator mode, and what the
allocator holds is what nodemgr charges the task, down to nothing after
``torch.cuda.empty_cache()``.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Daemon
from tests.test_torch_sim import MODES, torch_python  # noqa: F401 (a fixture)

HERE = Path(__file__).resolve().parent
CASE = HERE / "torch_quota_case.py"
GIB = 1 << 30
MIB = 1 << 20
QUOTA = 2 * GIB
MARK = "@@stage "
# The simulated driver's context charge and allocator rounding: what a task holds beyond
# its tensors (docs/architecture.md: a per-process context charge).
SLACK = 64 * MIB


def read_stage(p: subprocess.Popen[str], name: str) -> dict[str, Any]:
    assert p.stdout is not None
    for line in p.stdout:
        if line.startswith(MARK):
            got, _, value = line[len(MARK) :].partition(" ")
            assert got == name, line
            result: dict[str, Any] = json.loads(value)
            return result
    assert p.stderr is not None
    raise AssertionError(f"the program ended before stage {name}: {p.stderr.read()[-4000:]}")


def go_on(p: subprocess.Popen[str]) -> None:
    assert p.stdin is not None
    p.stdin.write("\n")
    p.stdin.flush()


def memory_used(daemon: Daemon) -> int:
    (task,) = daemon.tasks()
    return int(task["memory_used"])


@pytest.mark.parametrize("mode", list(MODES))
def test_the_quota_is_torchs_device_and_its_out_of_memory_error(
    daemon: Daemon,
    run_task: Any,
    torch_python: str,  # noqa: F811 (the fixture imported above)
    mode: str,
) -> None:
    endpoint = daemon.env("alice", gpus=1, memory=QUOTA)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTORCH_", "TORCH_"))}
    if MODES[mode]:
        env["PYTORCH_CUDA_ALLOC_CONF"] = MODES[mode]
    p = run_task(endpoint, torch_python, str(CASE), env=env, stdin=subprocess.PIPE)

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

    read_stage(p, "freed")
    go_on(p)

    emptied = read_stage(p, "emptied")
    assert emptied["reserved"] == 0
    assert memory_used(daemon) <= SLACK  # back to the environment's pool
    go_on(p)
    assert p.wait(60) == 0
