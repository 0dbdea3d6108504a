"""One rank of a two-rank PyTorch job started by torch.distributed.run, for
tests/real_torch/test_torch_processes.py: under gpushare-run with two GPUs granted, each rank on
``cuda:LOCAL_RANK``, the ranks joined by a gloo process group.

Rank R holds (R + 1) * 512 MiB on its GPU, all-reduces a small CUDA tensor with the other
rank, and asks its GPU for a whole quota more. It prints one line
``@@rank R JSON`` (its device, the all-reduced values, what the extra allocation raised)
and then waits until the file named by ``GO`` exists.

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
dist: Any = importlib.import_module("torch.distributed")

MIB = 1 << 20


def main() -> None:
    rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("gloo")
    held = torch.empty((rank + 1) * 512 * MIB, dtype=torch.uint8, device=device)
    # A host-to-device copy: the simulated driver runs no kernels, but copies are real.
    values = torch.tensor([float(rank + 1)] * 4).to(device)
    dist.all_reduce(values)
    _, quota = torch.cuda.mem_get_info(device)
    refused = None
    try:
        torch.empty(quota, dtype=torch.uint8, device=device)
    except Exception as e:  # the test says which exception it must be
        refused = f"{type(e).__module__}.{type(e).__qualname__}"
    report = {
        "device": str(values.device),
        "sum": values.cpu().tolist(),
        "quota": quota,
        "refused": refused,
    }
    # One write: the ranks share the launcher's stdout, and print() writes the line and its
    # end separately when the output is unbuffered.
    sys.stdout.write(f"@@rank {rank} {json.dumps(report)}\n")
    sys.stdout.flush()
    while not os.path.exists(os.environ["GO"]):
        time.sleep(0.02)
    dist.barrier()
    dist.destroy_process_group()
    del held


if __name__ == "__main__":
    main()
