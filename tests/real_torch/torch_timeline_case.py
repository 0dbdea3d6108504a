"""A small matmul training loop on the simulated driver with its device timeline on, for
test_torch_timeline.py: it runs in the pinned torch venv, with no shim.

After two warm-up steps it times STEPS steps, each ended by torch.cuda.synchronize(), and
reads the device time the process's work occupied from the simulated NVML
(gpushareSimProcessBusyNs). It prints one JSON line: the mean step's wall time and device
time, and how long a torch.cuda.synchronize() right after queuing a step waited.

Runs under the torch venv, not the project's: torch is looked up at run time (``Any``).
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import time
import warnings
from typing import Any

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
torch: Any = importlib.import_module("torch")

STEPS = 4


def busy_ns() -> int:
    """The device time this process's work occupied on GPU 0 so far."""
    nv = ctypes.CDLL("libnvidia-ml.so.1")
    handle, ns = ctypes.c_void_p(), ctypes.c_ulonglong()
    assert nv.nvmlInit_v2() == 0
    assert nv.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(handle)) == 0
    rc = nv.gpushareSimProcessBusyNs(handle, os.getpid(), ctypes.byref(ns))
    assert rc == 0, rc
    return ns.value


def main() -> None:
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)
    ).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(64, 256, device="cuda")
    y = torch.randint(0, 10, (64,), device="cuda")

    def step() -> None:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    busy0, t0 = busy_ns(), time.monotonic()
    for _ in range(STEPS):
        step()
        torch.cuda.synchronize()
    wall, busy = time.monotonic() - t0, busy_ns() - busy0
    step()
    queued = time.monotonic()
    torch.cuda.synchronize()
    waited = time.monotonic() - queued
    print(json.dumps({"step_wall": wall / STEPS, "step_busy": busy / 1e9 / STEPS, "sync": waited}))


if __name__ == "__main__":
    main()
