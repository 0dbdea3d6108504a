"""A real PyTorch training loop for test_torch_qos.py: it runs in the pinned torch venv, on
the simulated driver with its device timeline on, under gpushare-run (so gpushare's
optimizer step hook is in: every ``optimizer.step()`` is an iteration boundary).

    torch_qos_case.py OUT GO STOP THINK_MS MICRO

It imports torch and waits until the file GO exists before it touches the GPU (so that a
test can start several jobs at once and let each go when it wants it on the GPU). Then it
trains a small MLP until the file STOP exists, and exits 0. A step is MICRO micro-batches,
each a forward and backward pass ended by ``loss.item()`` (a synchronisation, as a notebook
that prints its loss makes), then ``optimizer.step()`` and ``torch.cuda.synchronize()``;
after each step it sleeps THINK_MS. THINK_MS 0 and MICRO 1 is a busy training job; an
interactive one alternates steps of several synchronisations with thinking. It writes JSON
lines to OUT: first, once its context is up, its pid and what gpushare-run gave it to find
the simulated node (``GPUSHARE_SIM_GPUS``, ``GPUSHARE_SIM_STATE_DIR``), for the test's
reader of device time; then one line per step, ``t0`` and ``t1`` (``time.monotonic()``,
which every process on the machine shares): from the step's first launch to the end of its
synchronisation.

Runs under the torch venv, not the project's: torch is looked up at run time (``Any``).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
import warnings
from typing import Any

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
torch: Any = importlib.import_module("torch")

WARMUP = 2  # steps before the first line: cuBLAS' handles and the allocator's first pools


def main() -> None:
    out, go, stop = sys.argv[1:4]
    think_ms, micro = float(sys.argv[4]), int(sys.argv[5])
    while not os.path.exists(go):
        time.sleep(0.01)
    torch.manual_seed(0)
    nn = torch.nn
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(64, 256, device="cuda")
    y = torch.randint(0, 10, (64,), device="cuda")

    def step() -> None:
        opt.zero_grad()
        for _ in range(micro):
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            loss.item()
        opt.step()

    for _ in range(WARMUP):
        step()
    torch.cuda.synchronize()
    with open(out, "a", buffering=1) as f:
        node = {k: os.environ.get(k, "") for k in ("GPUSHARE_SIM_GPUS", "GPUSHARE_SIM_STATE_DIR")}
        f.write(json.dumps({"pid": os.getpid(), "node": node}) + "\n")
        while not os.path.exists(stop):
            t0 = time.monotonic()
            step()
            torch.cuda.synchronize()
            f.write(json.dumps({"t0": t0, "t1": time.monotonic()}) + "\n")
            if think_ms:
                time.sleep(think_ms / 1000)


if __name__ == "__main__":
    main()
