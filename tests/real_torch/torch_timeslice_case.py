"""A real PyTorch training loop for test_torch_timeslice.py: it runs in the pinned
torch venv, on the simulated driver, under gpushare-run (so gpushare's optimizer step hook
is in: every ``optimizer.step()`` is an iteration boundary).

    torch_timeslice_case.py NAME OPTIMIZER STEPS OUT GO [eager|graph]

It imports torch, creates ``GO.NAME.ready`` and waits until ``GO`` exists before it touches
the GPU (so that both tasks of a test are on the GPU before either allocates). Then it trains
an MLP with ``torch.optim.OPTIMIZER`` (``SGD`` with momentum, or ``Adam``) for STEPS steps
and writes one JSON line per step to OUT, its times from ``time.monotonic()`` (which every
process on the machine shares):

- ``t1``: after the step's first kernel launch (where a task waiting for its turn waits),
  ``tb``: its work done, before ``optimizer.step()`` (or the replay); ``te``: after it
  returned (release and yield happen in there);
- ``flags``, ``release_end``, ``yield_end``: what gpushare's boundary did in this step's
  ``optimizer.step()`` (gpushare.iterations.last; absent when it did nothing);
- ``peak``: ``torch.cuda.max_memory_reserved()`` over the step (the peak is reset after each
  step), ``reserved``: ``torch.cuda.memory_reserved()`` after ``optimizer.step()``, and
  ``held``: what the device (under gpushare: the task's quota) has in use then, by
  ``torch.cuda.mem_get_info()``: torch's allocator's memory and what the libraries under
  it allocate themselves (cuBLAS' handles); ``shim``: the process's ``used`` and
  ``persistent`` bytes as gpushare's shim counts them then; after a step that released,
  ``emptied``: ``memory_reserved()`` after one more ``torch.cuda.empty_cache()``.

In the ``graph`` style the first steps run eagerly (warm-up), then one whole step (forward,
backward, ``optimizer.step()``) is captured in a CUDA graph, and the other steps replay it;
a line ``{"captured": N}`` says how many boundaries the process had counted after the
capture.

At the end it prints ``done`` and waits for a line on stdin, so that the test can read
nodemgr's view of the task while it is still there.

Runs under the torch venv, not the project's: torch is looked up at run time (``Any``).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import time
import warnings
from typing import Any

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
torch: Any = importlib.import_module("torch")

HIDDEN = 1024
LAYERS = 4
BATCH = 4096
WORK_S = 0.02  # a step's compute: the simulated driver runs no kernels
WARMUP = 3  # eager steps before the capture, in the graph style


def step(x: Any, model: Any, opt: Any, graph: Any, side: Any) -> dict[str, Any]:
    """One training step, eager or (with ``graph``) a replay of the captured one, with its
    times and what gpushare's boundary did in it."""
    from gpushare import iterations, shim

    if x is None:  # a new batch: the step's first allocation and launch
        x = torch.randn(BATCH, HIDDEN, device="cuda")
    else:
        x.normal_()  # a new batch in the captured input: the step's first launch
    t1 = time.monotonic()  # a task waiting for its turn waited in there
    if graph is None:
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            opt.zero_grad(set_to_none=True)
            model(x).pow(2).mean().backward()
        torch.cuda.synchronize()
    time.sleep(WORK_S)
    tb = time.monotonic()
    if graph is None:
        opt.step()  # gpushare's hook: the boundary (release, yield)
    else:
        graph.replay()  # the captured step, its optimizer step included
    te = time.monotonic()
    row: dict[str, Any] = {"t1": t1, "tb": tb, "te": te}
    if iterations.last.get("release_start", 0.0) >= tb:
        row.update(iterations.last)
    # Measured while the step's tensors (its batch) are still there, as at the boundary.
    row["peak"] = torch.cuda.max_memory_reserved()
    row["reserved"] = torch.cuda.memory_reserved()
    free, total = torch.cuda.mem_get_info()
    row["held"] = total - free
    mem = shim.memory()
    row["shim"] = {"used": mem.used, "persistent": mem.persistent} if mem else None
    if "release_end" in row:
        # Whatever the release left is in use: emptying the cache again frees nothing.
        torch.cuda.empty_cache()
        row["emptied"] = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    return row


def capture(x: Any, model: Any, opt: Any, side: Any) -> Any:
    """A whole training step captured in a CUDA graph, as PyTorch's documentation shows it
    (after warm-up steps on a side stream): its replays are the steps from then on."""
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        model(x).pow(2).mean().backward()
        opt.step()
    return graph


def main() -> None:
    name, optimizer, steps, out, go = sys.argv[1:6]
    style = sys.argv[6] if len(sys.argv) > 6 else "eager"
    from gpushare import shim

    open(f"{go}.{name}.ready", "w").close()
    while not os.path.exists(go):
        time.sleep(0.01)
    torch.manual_seed(0)
    nn = torch.nn
    layers: list[Any] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(HIDDEN, HIDDEN), nn.ReLU()]
    model = nn.Sequential(*layers).cuda()
    if optimizer == "SGD":
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    else:
        # Captured in a graph, its step must keep its step count on the GPU.
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=style == "graph")
    torch.cuda.reset_peak_memory_stats()
    graph: Any = None
    x = torch.randn(BATCH, HIDDEN, device="cuda") if style == "graph" else None
    side = torch.cuda.Stream() if style == "graph" else None
    with open(out, "a", buffering=1) as f:
        for i in range(int(steps)):
            if graph is None and style == "graph" and i == WARMUP:
                graph = capture(x, model, opt, side)
                memory = shim.memory()
                assert memory is not None
                f.write(json.dumps({"job": name, "captured": memory.iterations}) + "\n")
            row = step(x, model, opt, graph, side)
            row.update(job=name, i=i)
            f.write(json.dumps(row) + "\n")
    print("done", flush=True)
    sys.stdin.readline()


if __name__ == "__main__":
    main()
