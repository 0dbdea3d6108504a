"""A PyTorch training-like loop under gpushare-run, for test_torch_gpushare.py: it runs
in the pinned torch venv, on the simulated driver, with gpushare's shim preloaded.

It prints ``pid PID`` once it holds 512 MiB and has captured a CUDA graph, then one line
``step N`` per step: an eager kernel launch (through the CUDA runtime, as every PyTorch
kernel is), a replay of the graph, and a synchronisation. It runs until it is killed.

Runs under the torch venv, not the project's: torch is looked up at run time (``Any``).
"""

from __future__ import annotations

import importlib
import os
import time
import warnings
from typing import Any

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
torch: Any = importlib.import_module("torch")


def main() -> None:
    held = torch.zeros(512 << 20, dtype=torch.uint8, device="cuda")
    static = torch.zeros(1024, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        static.add_(1)  # warm-up outside the capture, as torch requires
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static.add_(1)
    print(f"pid {os.getpid()}", flush=True)
    step = 0
    while True:
        held[:16].add_(1)  # an eager kernel
        graph.replay()
        torch.cuda.synchronize()
        step += 1
        print(f"step {step}", flush=True)
        time.sleep(0.02)


if __name__ == "__main__":
    main()
