"""Real PyTorch auto-loaded, for test_torch_processes.py: the pinned torch venv with
gpushare installed, GPUSHARE_AUTOLOAD=1 and no gpushare-run, as in a dev container.

Stages, each ``@@stage NAME JSON`` and then a line read from stdin, as torch_quota_case.py:

- ``before``: torch not imported yet (printed again after a restart);
- ``imported``: ``import torch`` is done and nothing has called into CUDA: the shim's mode,
  the process's CUDA_VISIBLE_DEVICES, whether torch initialised CUDA;
- ``held`` (with a grant): ``mem_get_info`` and 512 MiB held; ``refused`` says what a
  further allocation beyond the quota raised, if anything;
- ``no_gpu`` (without one): what torch says of its GPUs, and what putting a tensor on
  ``cuda`` raised.

Runs under the torch venv, not the project's: torch is looked up at run time (``Any``).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import warnings
from typing import Any

from gpushare import shim

MIB = 1 << 20


def stage(name: str, **value: Any) -> None:
    print(f"@@stage {name} {json.dumps(value)}", flush=True)
    sys.stdin.readline()


def raised(fn: Any) -> dict[str, str] | None:
    try:
        fn()
    except Exception as e:  # the test says which exception it must be
        return {"type": f"{type(e).__module__}.{type(e).__qualname__}", "message": str(e)}
    return None


def main() -> None:
    stage("before", pid=os.getpid(), torch="torch" in sys.modules)
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    torch: Any = importlib.import_module("torch")
    stage(
        "imported",
        pid=os.getpid(),
        mode=shim.mode() if shim.loaded() else None,
        visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
        initialized=torch.cuda.is_initialized(),
    )
    if not torch.cuda.is_available():
        stage(
            "no_gpu",
            device_count=torch.cuda.device_count(),
            refused=raised(lambda: torch.zeros(1, device="cuda")),
        )
        return
    info = list(torch.cuda.mem_get_info())
    held = torch.empty(512 * MIB, dtype=torch.uint8, device="cuda")
    refused = raised(lambda: torch.empty(info[1], dtype=torch.uint8, device="cuda"))
    stage("held", mem_get_info=info, reserved=torch.cuda.memory_reserved(), refused=refused)
    del held


if __name__ == "__main__":
    main()
