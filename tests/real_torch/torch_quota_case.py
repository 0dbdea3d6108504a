"""A PyTorch program under gpushare-run, for test_torch_gpushare.py: it runs in the
pinned torch venv, on the simulated driver, with gpushare's shim preloaded by gpushare-run.

It reports each stage as one line ``@@stage NAME JSON`` and then waits for a line on stdin,
so the test can read nodemgr's view of the task at that point:

- ``start``: ``mem_get_info`` before any allocation;
- ``held``: 1.5 GiB allocated and held;
- ``refused``: a further 1 GiB asked for: the exception's type and message, if any;
- ``freed``: the tensor deleted (the allocator keeps its cache);
- ``emptied``: after ``torch.cuda.empty_cache()``.

Runs under the torch venv, not the project's: torch is looked up at run time (``Any``).
"""

from __future__ import annotations

import importlib
import json
import sys
import warnings
from typing import Any

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
torch: Any = importlib.import_module("torch")

GIB = 1 << 30


def stage(name: str, **value: Any) -> None:
    value["mem_get_info"] = list(torch.cuda.mem_get_info())
    value["reserved"] = torch.cuda.memory_reserved()
    print(f"@@stage {name} {json.dumps(value)}", flush=True)
    sys.stdin.readline()


def main() -> None:
    stage("start")
    held = torch.empty(GIB + GIB // 2, dtype=torch.uint8, device="cuda")
    stage("held")
    refused: dict[str, str] | None = None
    try:
        extra = torch.empty(GIB, dtype=torch.uint8, device="cuda")
        del extra
    except Exception as e:  # the test says which exception it must be
        refused = {"type": f"{type(e).__module__}.{type(e).__qualname__}", "message": str(e)}
    stage("refused", refused=refused)
    del held
    stage("freed")
    torch.cuda.empty_cache()
    stage("emptied")


if __name__ == "__main__":
    main()
