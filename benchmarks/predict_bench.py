#!/usr/bin/env python3
"""Prediction (docs/prediction.md): what ``gpushare-run --predict`` says a training job
will need, against what the job then takes when it runs under gpushare.

    python benchmarks/predict_bench.py [--quick] [--only NAME]... [--out FILE] [--check]
                                       [--python PY] [--margin PERCENT] [--gpu]

Real PyTorch (the torch venv's Python: ``--python``, else ``$GPUSHARE_TORCH_PYTHON``)
trains the model zoo of predict_zoo.py: 20 configurations (MLPs, ResNet-style and
VGG-style CNNs, transformer encoders, decoder-only language models, embedding-heavy
models, bfloat16 and float16 mixed precision), each at its 3 batch sizes with SGD and
with Adam: 120 cases (``--quick``: the middle batch size with Adam, 20).

- ``memory``: each case is run twice. The **dry run**: ``gpushare-run --predict --json``
  (3 iterations, then one more after a release); its ``peak`` is the prediction. The
  **real run**: the same job for 8 steps under ``gpushare-run`` against this script's own
  ``nodemgr serve`` on one simulated GPU like the dry run's (80 GiB, shared, not
  time-sliced); its peak is what nodemgr's history records, the most its process held at
  once. Targets: the median relative error of the predicted peak <= 2%, the worst <= 10%,
  and the OOM-safe rate (the share of cases whose prediction plus the margin, ``--margin``
  percent, 5 by default, is at least the measured peak) >= 95%. Reported beside them:
  the dry run's persistent and temporary memory (a shared GPU learns no shape to hold them
  against), the median error by model family, the dry run's wall time, and that time as a
  multiple of one step of the real run on the simulated driver (whose steps are the
  host's work alone: kernels take no time there).

With ``--gpu`` (``make bench-gpu-predict``) the real runs go to the node's NVIDIA GPU
(nodemgr on NVML, every job pinned to the GPU with the most free memory), while the dry
runs stay on the simulated driver, as a user's would: the errors are then the simulator's
against a GPU (cuBLAS' and cuDNN's choices there), the dry run's wall time is set against
a real step, and the Python with PyTorch (``--python``, default this one) needs gpushare
installed.

JSON on stdout and in ``--out``; progress on stderr; exit status as the other scripts (2:
no torch Python, nodemgr did not start, a run failed).
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SELF = Path(__file__).resolve()
if str(SELF.parent.parent) not in sys.path:
    sys.path.append(str(SELF.parent.parent))  # last: see benchmarks/harness.py

from benchmarks import harness  # noqa: E402
from benchmarks.harness import BenchError, say  # noqa: E402
from benchmarks.nodemgr_bench import Daemon, daemon  # noqa: E402
from benchmarks.torch_bench import _run, base_env, find_gpu_python, find_python  # noqa: E402

BIN = Path(sys.executable).parent
ZOO = SELF.parent / "predict_zoo.py"
GiB = 1 << 30
DRY_ITERATIONS = 3
REAL_STEPS = 8
DEFAULT_MARGIN = 5.0  # percent added to a predicted peak before it is judged OOM-safe
MEDIAN_TARGET = 2.0  # percent
WORST_TARGET = 10.0  # percent
SAFE_TARGET = 95.0  # percent of cases


@dataclass(frozen=True)
class Case:
    name: str
    family: str
    batch: int
    optimizer: str

    def argv(self, python: str, steps: int) -> list[str]:
        return [python, str(ZOO), self.name, str(self.batch), self.optimizer, str(steps)]

    def key(self) -> str:
        return f"{self.name}/b{self.batch}/{self.optimizer}"


def cases(python: str, quick: bool) -> list[Case]:
    _, out = _run([python, str(ZOO), "--list"], base_env(), "the zoo's list")
    found = []
    for line in out.splitlines():
        c = json.loads(line)
        batches = [c["batches"][1]] if quick else c["batches"]
        for batch in batches:
            for optimizer in ("adam",) if quick else ("sgd", "adam"):
                found.append(Case(c["name"], c["family"], int(batch), optimizer))
    return found


def dry_run(python: str, case: Case) -> dict[str, Any]:
    argv = [
        str(BIN / "gpushare-run"),
        "--predict",
        "--json",
        "--iterations",
        str(DRY_ITERATIONS),
        "--",
        *case.argv(python, REAL_STEPS),
    ]
    doc: dict[str, Any] = json.loads(_run(argv, base_env(), f"dry run {case.key()}")[1])
    if not doc["predicted"] or doc["iterations"] != DRY_ITERATIONS + 1:
        raise BenchError(f"dry run {case.key()}: no prediction: {doc}")
    return doc


def real_run(
    python: str, d: Daemon, endpoint: str, case: Case, pin: dict[str, str]
) -> dict[str, Any]:
    argv = [str(BIN / "gpushare-run"), "--endpoint", endpoint, "--", *case.argv(python, REAL_STEPS)]
    _, out = _run(argv, {**base_env(), **pin}, f"real run {case.key()}")
    times = [float(line.split()[2]) for line in out.splitlines() if line.startswith("step ")]
    if len(times) != REAL_STEPS:
        raise BenchError(f"real run {case.key()}: {len(times)} steps of {REAL_STEPS}")
    command = " ".join(case.argv(python, REAL_STEPS))
    records = [t for t in d.admin("history", env="zoo")["records"] if t["command"] == command]
    if not records:
        raise BenchError(f"real run {case.key()}: no record in nodemgr's history")
    gaps = [b - a for a, b in itertools.pairwise(times[1:])]  # the first step warms up
    return {"peak": int(records[0]["peak"]), "step_s": statistics.median(gaps)}


def _pct(predicted: int, measured: int) -> float:
    return 100.0 * (predicted - measured) / measured if measured else 0.0


@dataclass(frozen=True)
class Target:
    """Where the real runs go: nodemgr's [gpus] table, the environment's quota, and the
    variables that pin a job to one GPU."""

    gpus: dict[str, Any]
    quota: int
    pin: dict[str, str]
    where: str


SIMULATED = Target(
    gpus={
        "simulated_count": 1,
        "simulated_memory": "80GiB",
        "context_memory": "0",
        "utilization_interval": 0.0,
    },
    quota=80 * GiB,
    pin={},
    where="simulated",
)
GPU_QUOTA = 16 * GiB  # on a real GPU: the zoo's largest job takes under 3 GiB


def real_gpu() -> Target:
    """The node's NVIDIA GPU with the most free memory; BenchError without one."""
    try:
        gpus = harness.nvml_gpus()
    except Exception as e:  # pynvml.NVMLError, a missing library: no GPU to run on
        raise BenchError(f"NVML finds no GPU: {e}") from None
    gpu = harness.pick_gpu(gpus, need=GPU_QUOTA)
    if gpu is None:
        raise BenchError(f"no NVIDIA GPU with {GPU_QUOTA // GiB} GiB free ({len(gpus)} found)")
    return Target({"source": "nvml"}, GPU_QUOTA, harness.pinned(gpu), gpu.uuid)


def bench_memory(python: str, margin: float, target: Target, quick: bool) -> dict[str, Any]:
    todo = cases(python, quick)
    rows = []
    with daemon(gpus=target.gpus, scheduler={"memory_reserve": "0"}) as d:
        endpoint = d.env("zoo", gpus=1, memory=target.quota)
        for n, case in enumerate(todo, 1):
            started = time.monotonic()
            dry = dry_run(python, case)
            real = real_run(python, d, endpoint, case, target.pin)
            err = _pct(int(dry["peak"]), real["peak"])
            rows.append(
                {
                    "case": case.key(),
                    "family": case.family,
                    "predicted_peak": int(dry["peak"]),
                    "measured_peak": real["peak"],
                    "error_pct": round(err, 3),
                    "persistent": dry["persistent"],
                    "temporary": dry["temporary"],
                    "dry_run_s": dry["seconds"],
                    "real_step_s": round(real["step_s"], 4),
                }
            )
            say(
                f"[{n}/{len(todo)}] {case.key()}: predicted {dry['peak'] / 2**20:.1f} MiB, "
                f"measured {real['peak'] / 2**20:.1f} MiB ({err:+.2f}%), "
                f"{time.monotonic() - started:.1f}s",
                "predict",
            )
    errors = [abs(r["error_pct"]) for r in rows]
    safe = [r["predicted_peak"] * (1 + margin / 100) >= r["measured_peak"] for r in rows]
    exact = [r["predicted_peak"] >= r["measured_peak"] for r in rows]
    dry_s = [r["dry_run_s"] for r in rows]
    ratio = [r["dry_run_s"] / r["real_step_s"] for r in rows if r["real_step_s"] > 0]
    result = {
        "cases": len(rows),
        "median_error_pct": round(statistics.median(errors), 3),
        "worst_error_pct": round(max(errors), 3),
        # The case of the worst error; None where every prediction was exact.
        "worst_case": max(rows, key=lambda r: abs(r["error_pct"]))["case"] if any(errors) else None,
        "margin_pct": margin,
        "oom_safe_pct": round(100.0 * sum(safe) / len(rows), 2),
        "oom_safe_without_margin_pct": round(100.0 * sum(exact) / len(rows), 2),
        "dry_run_s_median": round(statistics.median(dry_s), 3),
        "dry_run_in_real_steps_median": round(statistics.median(ratio), 1) if ratio else None,
        "by_family": {
            fam: round(
                statistics.median(abs(r["error_pct"]) for r in rows if r["family"] == fam), 3
            )
            for fam in sorted({r["family"] for r in rows})
        },
        "rows": rows,
    }
    return harness.judge_all(
        result,
        [
            ("median_error_pct", "<=", MEDIAN_TARGET),
            ("worst_error_pct", "<=", WORST_TARGET),
            ("oom_safe_pct", ">=", SAFE_TARGET),
        ],
    )


BENCHES = ("memory",)


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__doc__, BENCHES, quick="the middle batch size with Adam only")
    parser.add_argument("--python", help="the Python with PyTorch [$GPUSHARE_TORCH_PYTHON]")
    parser.add_argument(
        "--margin",
        type=float,
        default=DEFAULT_MARGIN,
        metavar="PERCENT",
        help=f"added to a predicted peak before it is judged OOM-safe [{DEFAULT_MARGIN:g}]",
    )
    parser.add_argument(
        "--gpu",
        action="store_true",
        help="run the real runs on the node's NVIDIA GPU (the dry runs stay simulated)",
    )
    args = parser.parse_args(argv)
    from gpushare.client import Unreachable  # not at the top: see harness's module doc

    errors = (BenchError, OSError, Unreachable, json.JSONDecodeError, KeyError)
    where: dict[str, Any] = {"dry_run_iterations": DRY_ITERATIONS, "real_steps": REAL_STEPS}

    def run_all(results: dict[str, Any]) -> bool:
        try:
            if args.gpu:
                python = find_gpu_python(args.python)
                target = real_gpu()
            else:
                python = find_python(args.python)
                target = SIMULATED
        except (BenchError, OSError, ImportError) as e:
            say(f"cannot run: {e}")
            results.update({n: harness.error_result(e) for n in args.only or BENCHES})
            return True
        where["device"] = target.where
        bench = functools.partial(bench_memory, python, args.margin, target, args.quick)
        return harness.run_one("memory", bench, errors, results)

    return harness.run_and_report(args, run_all, lambda: harness.machine({}, where))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    sys.exit(main())
