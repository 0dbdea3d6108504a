"""A PyTorch input pipeline under gpushare-run, for test_torch_processes.py: a real
DataLoader with two forked workers and pinned memory feeding a model's memory on the GPU.

Stages, each ``@@stage NAME JSON`` and then a line read from stdin, as torch_quota_case.py:

- ``running``: the main process holds 256 MiB of "model" on the GPU and has copied a few
  pinned 64 MiB batches to it; ``workers`` are the loader's worker pids, ``pinned`` what the
  caching host allocator holds, ``reserved`` what the device allocator holds;
- ``epoch`` (no line is read after it): the epoch is under way, its first batch copied.
  A worker killed from now on is an error of the loop. One killed earlier, while the main
  process still waits at ``running``, would raise there, from torch's SIGCHLD handler;
- ``ended``: the epoch, far longer than a test waits, went on until the loop raised
  (the test kills a worker): ``error`` says what it raised.

While the file named by ``HOLD`` exists, a worker that starts on a sample creates
``HOLD.PID`` and waits in ``__getitem__`` until the file is gone (a slow sample).

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
data: Any = importlib.import_module("torch.utils.data")

MIB = 1 << 20
ITEM = 16 * MIB  # one sample's bytes; a batch is 4 samples, 64 MiB
STEPS = 1 << 20  # batches in the epoch: far more than a test waits for


def stage(name: str, wait: bool = True, **value: Any) -> None:
    value["reserved"] = torch.cuda.memory_reserved()
    value["pid"] = os.getpid()
    print(f"@@stage {name} {json.dumps(value)}", flush=True)
    if wait:
        sys.stdin.readline()


class Samples(data.Dataset):  # type: ignore[misc]
    """CPU tensors made in the worker: what a decoding pipeline hands on."""

    def __len__(self) -> int:
        return STEPS * 4

    def __getitem__(self, i: int) -> Any:
        hold = os.environ.get("HOLD", "")
        if hold and os.path.exists(hold):
            open(f"{hold}.{os.getpid()}", "w").close()
            while os.path.exists(hold):
                time.sleep(0.01)
        return torch.full((ITEM // 4,), float(i), dtype=torch.float32)


def pinned_bytes() -> int:
    return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))


def main() -> None:
    model = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")
    loader = data.DataLoader(
        Samples(),
        batch_size=4,
        num_workers=2,
        pin_memory=True,
        multiprocessing_context="fork",
        prefetch_factor=2,
    )
    batches = iter(loader)
    on_gpu = None
    for step, batch in enumerate(batches):
        assert batch.is_pinned()
        on_gpu = batch.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        if step == 3:
            # The values came through the workers, the pinned buffer and the copy.
            assert on_gpu[0, 0].item() == float(step * 4)
            workers = [w.pid for w in batches._workers]
            stage("running", workers=workers, pinned=pinned_bytes())
            break
    error = None
    try:
        for step, batch in enumerate(batches):
            on_gpu = batch.to("cuda", non_blocking=True)
            torch.cuda.synchronize()
            if step == 0:
                stage("epoch", wait=False)
    except Exception as e:  # the test says which exception it must be
        error = {"type": f"{type(e).__module__}.{type(e).__qualname__}", "message": str(e)}
    stage("ended", error=error)
    del model, on_gpu


if __name__ == "__main__":
    main()
