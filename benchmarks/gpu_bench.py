#!/usr/bin/env python3
"""What the shim costs a PyTorch program on a real NVIDIA GPU, with machine-readable output.

    python benchmarks/gpu_bench.py [--quick] [--only NAME]... [--out FILE] [--check]
                                   [--python PY]

The same measuring program (this file run with ``--worker measure``) runs again and
again, alternately as a gpushare task (``gpushare-run`` against a ``nodemgr serve`` of
its own on the node's NVML GPUs, so the shim is preloaded and enforcing) and directly
on the same GPU without the shim. It times kernel launches and training steps inside
the process, after warm-up, so process start-up is not measured. The JSON document goes
to stdout and to ``--out``; progress to stderr. Exit status: 0 when every measurement
ran; 1 with ``--check`` when a target was missed; 2 when it could not run (no PyTorch
with CUDA, no NVIDIA GPU, nodemgr did not start, a run failed).

The measuring program needs PyTorch with CUDA: ``--python``, else
``$GPUSHARE_TORCH_PYTHON``, else this Python if it has torch, else ``python3`` on PATH.
It imports nothing of gpushare, so that Python need not have gpushare installed.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SELF = Path(__file__).resolve()
ROOT = SELF.parent.parent
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # last: see benchmarks/harness.py
from benchmarks import harness  # noqa: E402

BIN = Path(sys.executable).parent
GiB = 1 << 30
QUOTA = 8 * GiB  # the benchmark environment's per-GPU memory quota
RUN_TIMEOUT = 600.0  # seconds one measuring run may take


def say(message: str) -> None:
    harness.say(message, "bench-gpu")


class BenchError(harness.BenchError):
    """The benchmark could not run, for a reason found here (one from the nodemgr_bench
    helpers it uses is reported with its type's name, as an OSError is)."""


# --- the measuring program (runs in the torch Python; stdlib and torch only) ----------------


def _shim_loaded() -> bool:
    """Whether a gpushare preload library is mapped into this process."""
    with open("/proc/self/maps") as maps:
        return any("gpushare" in os.path.basename(line.split()[-1]) for line in maps)


def _launch_rate(torch: Any, launches: int, batches: int) -> float:
    """Best launches/s over ``batches`` loops of ``launches`` one-element in-place adds."""
    x = torch.zeros(1, device="cuda")
    for _ in range(1000):
        x.add_(1)
    torch.cuda.synchronize()
    best = 0.0
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(launches):
            x.add_(1)
        torch.cuda.synchronize()
        best = max(best, launches / (time.perf_counter() - start))
    return best


def _train_step_ms(torch: Any, steps: int, batches: int) -> float:
    """Best mean milliseconds per SGD step of a 2-layer MLP, batch 256, over ``batches``
    loops of ``steps`` steps after 50 warm-up steps."""
    torch.manual_seed(0)
    nn = torch.nn
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    xb = torch.randn(256, 1024, device="cuda")
    yb = torch.randint(0, 10, (256,), device="cuda")

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(model(xb), yb).backward()
        opt.step()

    for _ in range(50):
        step()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / steps)
    return best * 1e3


def _worker(kind: str, spec_json: str) -> int:
    """``probe``: what torch sees, as JSON; ``measure``: the measurements ``spec`` names."""
    try:
        torch: Any = importlib.import_module("torch")
    except ImportError as e:
        print(json.dumps({"error": f"cannot import torch: {e}"}), flush=True)
        return 1
    available = bool(torch.cuda.is_available())
    info: dict[str, Any] = {
        "torch": str(torch.__version__),
        "torch_cuda": torch.version.cuda,
        "cuda_available": available,
        "shim": _shim_loaded(),
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
    }
    if not available:
        print(json.dumps({**info, "error": "torch finds no CUDA device"}), flush=True)
        return 1
    info["gpu"] = str(torch.cuda.get_device_name(0))
    if kind == "measure":
        spec = json.loads(spec_json)
        if "launch_rate" in spec["only"]:
            info["launches_per_s"] = _launch_rate(torch, spec["launches"], spec["batches"])
        if "train_step" in spec["only"]:
            info["step_ms"] = _train_step_ms(torch, spec["steps"], spec["batches"])
    print(json.dumps(info), flush=True)
    return 0


# --- the benchmark -------------------------------------------------------------------------


def _worker_output(argv: list[str], env: dict[str, str], what: str) -> dict[str, Any]:
    """Run a measuring program; its last stdout line, parsed. BenchError if it fails."""
    try:
        r = subprocess.run(
            argv, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT, check=False
        )
    except subprocess.TimeoutExpired:
        raise BenchError(f"{what}: no result within {RUN_TIMEOUT:.0f}s") from None
    lines = r.stdout.strip().splitlines()
    try:
        doc: dict[str, Any] = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        doc = {}
    if r.returncode != 0 or not doc or "error" in doc:
        tail = "\n".join(r.stderr.strip().splitlines()[-15:])
        why = doc.get("error") or f"exit {r.returncode}"
        raise BenchError(f"{what}: {why}\n{tail}")
    return doc


def _probe(python: str) -> dict[str, Any] | None:
    """What ``python`` finds of torch and CUDA; None if it cannot import torch."""
    r = harness.run_captured([python, str(SELF), "--worker", "probe", "{}"], _plain_env())
    if r is None:
        return None
    lines = r.stdout.strip().splitlines()
    try:
        doc: dict[str, Any] = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        return None
    return doc if "torch" in doc else None


def find_python(explicit: str | None) -> tuple[str, dict[str, Any]]:
    """The Python to measure with and its probe; BenchError naming what was tried."""
    candidates: list[str | None] = [explicit]
    if not explicit:
        candidates = [
            os.environ.get("GPUSHARE_TORCH_PYTHON"),
            sys.executable,
            shutil.which("python3"),
        ]
    tried = []
    for python in dict.fromkeys(c for c in candidates if c):
        probe = _probe(python)
        if probe is None:
            tried.append(f"{python} (no torch)")
            continue
        if not probe["cuda_available"]:
            raise BenchError(
                f"torch {probe['torch']} in {python} finds no CUDA device: "
                "this benchmark needs an NVIDIA GPU and driver"
            )
        return python, probe
    raise BenchError(
        "no Python with PyTorch found (tried " + ", ".join(tried) + "); install torch "
        "or name a Python that has it with --python or GPUSHARE_TORCH_PYTHON"
    )


def _plain_env(visible: str | None = None) -> dict[str, str]:
    """This environment without any gpushare preload or ledger: the baseline's."""
    env = {k: v for k, v in os.environ.items() if k not in ("GPUSHARE_LEDGER", "GPUSHARE_TASK_ID")}
    preload = [p for p in env.get("LD_PRELOAD", "").split() if "gpushare" not in p]
    if preload:
        env["LD_PRELOAD"] = " ".join(preload)
    else:
        env.pop("LD_PRELOAD", None)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    return env


def ratio_result(
    runs: dict[bool, list[dict[str, Any]]], key: str, unit: str, op: str, target: float
) -> dict[str, Any]:
    """Medians of key over the runs with (runs[True]) and without the shim, their ratio
    and its target."""
    with_shim = [r[key] for r in runs[True]]
    without = [r[key] for r in runs[False]]
    w, wo = statistics.median(with_shim), statistics.median(without)
    result = {
        f"with_shim_{unit}": [round(x, 4) for x in with_shim],
        f"without_shim_{unit}": [round(x, 4) for x in without],
        f"median_with_shim_{unit}": round(w, 4),
        f"median_without_shim_{unit}": round(wo, 4),
        "ratio": round(w / wo, 5),
    }
    return harness.judge(result, "ratio", op, target)


def run_benchmarks(
    python: str, only: list[str], quick: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Interleaved runs with and without the shim: the results per benchmark, and the
    machine's description."""
    # Here, not at the top: the measuring program's Python need not have pyzmq or nodemgr.
    import benchmarks.nodemgr_bench as nb
    from nodemgr.client import Unreachable

    pairs = 2 if quick else 8
    spec = {
        "only": only,
        "launches": 20_000 if quick else 50_000,
        "steps": 200,
        "batches": 3 if quick else 5,
    }
    measure = [python, str(SELF), "--worker", "measure", json.dumps(spec)]
    runs: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
    try:
        with nb.daemon(gpus={"source": "nvml"}) as d:
            memory = min(QUOTA, min(int(g["memory"]) for g in d.admin("status")["gpus"]))
            ep = d.env("bench", gpus=1, memory=memory)
            shim_argv = [str(BIN / "gpushare-run"), "--endpoint", ep, "--", *measure]

            def run(shim: bool, visible: str | None) -> dict[str, Any]:
                what = "run with the shim" if shim else "run without the shim"
                if shim:
                    doc = _worker_output(shim_argv, _plain_env(), what)
                else:
                    doc = _worker_output(measure, _plain_env(visible), what)
                if doc["shim"] != shim:
                    raise BenchError(f"{what}: the shim is {'not ' if shim else ''}loaded")
                return doc

            # A first run with the shim learns the granted GPU (runs without the shim use
            # the one the last run with it was granted) and warms caches; it is not counted.
            say("warm-up run with the shim ...")
            visible = run(True, None)["visible"]
            for i in range(pairs):
                for shim in (False, True) if i % 2 == 0 else (True, False):
                    say(f"pair {i + 1}/{pairs}: {'with' if shim else 'without'} the shim ...")
                    doc = run(shim, visible)
                    visible = doc["visible"]
                    runs[shim].append(doc)
    except BenchError:
        raise
    except (harness.BenchError, OSError, Unreachable) as e:
        raise BenchError(f"{type(e).__name__}: {e}") from None
    results: dict[str, Any] = {}
    if "launch_rate" in only:
        results["launch_rate"] = {
            **ratio_result(runs, "launches_per_s", "per_s", ">=", 0.995),
            "setup": (
                f"launches/s of x.add_(1) on a 1-element CUDA tensor: best of "
                f"{spec['batches']} loops of {spec['launches']} launches (then synchronize) "
                f"per process, median over {pairs} processes each with and without the shim, "
                "interleaved; ratio = with / without"
            ),
        }
    if "train_step" in only:
        results["train_step"] = {
            **ratio_result(runs, "step_ms", "ms", "<=", 1.005),
            "setup": (
                "ms per SGD step of Linear(1024,1024)-ReLU-Linear(1024,10), batch 256, "
                f"cross-entropy: best mean of {spec['batches']} loops of {spec['steps']} steps "
                f"after 50 warm-up steps per process, median over {pairs} processes each with "
                "and without the shim, interleaved; ratio = with / without"
            ),
        }
    gpus = sorted({r["visible"] for r in runs[True] + runs[False]})
    return results, {**nb.machine(), "gpu_uuids": gpus}


BENCHMARKS = ("launch_rate", "train_step")


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    if args_in[:1] == ["--worker"]:
        return _worker(args_in[1], args_in[2])
    parser = harness.parser(__doc__, BENCHMARKS, quick="fewer runs (a smoke run)")
    parser.add_argument("--python", help="the Python (with PyTorch) that runs the measurements")
    args = parser.parse_args(args_in)

    harness.stop_children_on_exit()
    only = [b for b in BENCHMARKS if b in (args.only or BENCHMARKS)]
    load_before = harness.loadavg()
    try:
        python, probe = find_python(args.python)
        say(f"measuring with {python}: torch {probe['torch']}, GPU {probe['gpu']}")
        start = time.monotonic()
        results, machine = run_benchmarks(python, only, args.quick)
    except BenchError as e:
        say(f"cannot run: {e}")
        return 2
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    for name, r in results.items():
        say(f"{name}: {harness.verdict(r)}")
    say(f"done in {time.monotonic() - start:.0f}s")
    gpu = {k: probe[k] for k in ("gpu", "torch", "torch_cuda")}
    return harness.report(
        args, lambda: {**machine, **gpu, "measuring_python": python}, load_before, results
    )


if __name__ == "__main__":
    sys.exit(main())
