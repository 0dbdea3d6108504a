"""A PyTorch program under gpushare-run, for test_torch_gpushare.py, run with
``backend:cudaMallocAsync``: a CUDA graph whose capture allocates, so that its memory is
graph memory (allocation nodes), mapped by the driver's graph memory pool at replay.

It reports each stage as one line ``@@stage NAME JSON`` (with what the driver says the
device's graph pool reserves, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT) and then waits for a
line on stdin, so the test can read nodemgr's view of the task at that point (and what the
device's pool reserves):

- ``captured``: the graph captured, never replayed;
- ``replayed``: after three replays;
- ``reset``: the graph reset, its outputs dropped, ``torch.cuda.empty_cache()``.

Runs under the torch venv, not the project's: torch is looked up at run time (``Any``).
"""

from __future__ import annotations

import ctypes
import importlib
import json
import sys
import warnings
from typing import Any

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
torch: Any = importlib.import_module("torch")

MIB = 1 << 20
RESERVED_MEM_CURRENT = 2  # CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT
POOL_RESERVED_MEM_CURRENT = 5  # CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT
driver = ctypes.CDLL("libcuda.so.1")


def graph_reserved() -> int:
    value = ctypes.c_uint64()
    rc = driver.cuDeviceGetGraphMemAttribute(0, RESERVED_MEM_CURRENT, ctypes.byref(value))
    assert rc == 0, rc
    return value.value


def pool_reserved() -> int:
    """What the device's pool reserves, as the driver says (torch's own figure counts the
    capture's allocations too)."""
    pool, value = ctypes.c_void_p(), ctypes.c_uint64()
    assert driver.cuDeviceGetMemPool(ctypes.byref(pool), 0) == 0
    rc = driver.cuMemPoolGetAttribute(pool, POOL_RESERVED_MEM_CURRENT, ctypes.byref(value))
    assert rc == 0, rc
    return value.value


def stage(name: str, **value: Any) -> None:
    torch.cuda.synchronize()
    value["graph_reserved"] = graph_reserved()
    value["pool_reserved"] = pool_reserved()
    print(f"@@stage {name} {json.dumps(value)}", flush=True)
    sys.stdin.readline()


def main() -> None:
    static_in = torch.zeros(MIB, device="cuda")  # 4 MiB, from the pool
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        scratch = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")
        scratch.zero_()
        static_out = static_in * 2 + 1  # outlives the capture: an output of the graph
        del scratch  # freed inside the graph
    stage("captured")
    for _ in range(3):
        graph.replay()
    stage("replayed", out_shape=list(static_out.shape))
    graph.reset()
    del static_out
    torch.cuda.empty_cache()
    stage("reset")


if __name__ == "__main__":
    main()
