"""A scripted training job: the shape seed 002 is about, on whatever driver is loaded.

Run under gpushare-run with the stand-in torch (demo/standin) on PYTHONPATH:
it allocates its "model" once (persistent), then each iteration allocates
its "activations" (temporary), launches kernels, works for a while, frees the
activations to the allocator's cache and calls ``optimizer.step()``, which is
where gpushare's PyTorch hook marks the iteration boundary. Times are written
as one JSON line per iteration (time.monotonic(), which every process on the
machine shares), so a test or benchmark can see when each job held the GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

MiB = 1 << 20


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--name", default="job")
    ap.add_argument("--persistent", type=int, default=256, help="MiB allocated once")
    ap.add_argument("--temporary", type=int, default=1024, help="MiB allocated per iteration")
    ap.add_argument("--blocks", type=int, default=4, help="temporary blocks per iteration")
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--launches", type=int, default=4, help="kernel launches per iteration (≥1)")
    ap.add_argument("--work-ms", type=float, default=5.0, help="time spent per iteration")
    ap.add_argument("--out", default="-", help="file for the JSON lines (- : stdout)")
    ap.add_argument(
        "--start-file",
        help="create FILE.NAME.ready, then wait until FILE exists before allocating anything "
        "(to start jobs together)",
    )
    ap.add_argument(
        "--boundary",
        choices=("optimizer", "api", "none"),
        default="optimizer",
        help="how an iteration ends: optimizer.step() (the PyTorch hook), "
        "client_plugin.iteration_boundary(), or nothing",
    )
    args = ap.parse_args(argv)

    import importlib

    # The stand-in (demo/standin); importing it puts gpushare's hooks in.
    torch: Any = importlib.import_module("torch")

    try:
        from client_plugin import iterations
    except ImportError:  # run without gpushare: no boundaries to time
        iterations = None  # type: ignore[assignment]

    out = sys.stdout if args.out == "-" else open(args.out, "a", buffering=1)  # noqa: SIM115
    if args.start_file:
        import os

        # Say it is ready (imports done), then wait for the word.
        open(f"{args.start_file}.{args.name}.ready", "w").close()
        while not os.path.exists(args.start_file):
            time.sleep(0.01)
    model = torch.cuda.alloc(args.persistent * MiB)
    opt = torch.optim.SGD(model)
    block = args.temporary * MiB // args.blocks
    for i in range(args.iterations):
        t0 = time.monotonic()
        torch.cuda.launch()  # a task waiting for its turn waits here (or in an allocation)
        t1 = time.monotonic()
        blocks = [torch.cuda.alloc(block) for _ in range(args.blocks)]
        for _ in range(args.launches - 1):
            torch.cuda.launch()
        end = time.monotonic() + args.work_ms / 1000
        while time.monotonic() < end:
            pass
        for b in blocks:
            torch.cuda.free(b)
        tb = time.monotonic()
        if args.boundary == "optimizer":
            opt.step()  # the iteration boundary: release and yield happen in here
        elif args.boundary == "api":
            import client_plugin

            client_plugin.iteration_boundary()
        te = time.monotonic()
        row = {"job": args.name, "i": i, "t0": t0, "t1": t1, "tb": tb, "te": te}
        if iterations is not None and iterations.last.get("release_start", 0) >= tb:
            row.update({k: v for k, v in iterations.last.items()})
        out.write(json.dumps(row) + "\n")
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
