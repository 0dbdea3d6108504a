"""Processes of one task under gpushare-run share its pool, for test_torch_gpushare.py:
the pinned torch venv, the simulated driver, gpushare's shim preloaded.

Stages, each ``@@stage NAME JSON`` and then a line read from stdin, as torch_quota_case.py:

- ``parent``: the parent holds 1 GiB;
- ``child``: a spawned child holds 512 MiB more; ``refused`` says what asking it for 1 GiB
  more raised, if anything;
- ``shared``: the parent made a 256 MiB tensor and sent it to the child through
  torch.multiprocessing; ``same`` says whether the child read the parent's values.

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
mp: Any = importlib.import_module("torch.multiprocessing")

MIB = 1 << 20


def stage(name: str, **value: Any) -> None:
    print(f"@@stage {name} {json.dumps(value)}", flush=True)
    sys.stdin.readline()


def child(commands: Any, answers: Any) -> None:
    held = torch.empty(512 * MIB, dtype=torch.uint8, device="cuda")
    refused = None
    try:
        torch.empty(1024 * MIB, dtype=torch.uint8, device="cuda")
    except Exception as e:  # the test says which exception it must be
        refused = f"{type(e).__module__}.{type(e).__qualname__}"
    answers.put({"refused": refused})
    shared = commands.get()
    answers.put({"same": bool(torch.equal(shared.cpu(), torch.arange(64 * MIB).float()))})
    commands.get()  # until the parent is done
    del held, shared


def main() -> None:
    ctx = mp.get_context("spawn")
    held = torch.empty(1024 * MIB, dtype=torch.uint8, device="cuda")
    stage("parent")
    commands, answers = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(commands, answers))
    p.start()
    stage("child", **answers.get(timeout=120))
    tensor = torch.arange(64 * MIB).float().cuda()  # 256 MiB, real values
    commands.put(tensor)
    stage("shared", **answers.get(timeout=120))
    commands.put("done")
    p.join(60)
    del held, tensor


if __name__ == "__main__":
    main()
