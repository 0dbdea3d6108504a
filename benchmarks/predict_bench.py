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

- ``time``: step time on simulated GPUs with the device timeline
  (docs/prediction.md#step-time): driver_loop.py jobs and, with PyTorch, jobs of the zoo,
  each run 6 times with ``gpushare-run --shape predicted``; nodemgr's estimate of the step
  time against the one it measured. Target: median error <= 10% once 5 runs of the
  configuration are recorded.
- ``admission``: the same mix of 24 jobs of tests/fixtures/driver_loop.py (12 with
  ``--quick``), each in an environment of its own (1 GPU x 8 GiB), submitted at once to a
  nodemgr of 4 simulated 16 GiB GPUs, once with whole-quota grants and once with
  ``gpushare-run --shape predicted``; a quarter of them grow past their prediction and must
  be topped up. Target: by prediction at least 1.5x the tasks at once, and no job out of
  memory (docs/prediction.md#admission).

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
import subprocess
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


# --- admission by prediction (docs/prediction.md#admission) ---------------------------------

LOOP = SELF.parent.parent / "tests" / "fixtures" / "driver_loop.py"
ADMIT_GPUS = 4
ADMIT_GPU_MEMORY = 16 * GiB
ADMIT_QUOTA = 8 * GiB  # each task's environment: half a GPU, a common dev-environment quota
ADMIT_TARGET = 1.5  # concurrent tasks by prediction over whole-quota grants


@dataclass(frozen=True)
class Job:
    """One task of the admission mix: driver_loop.py's persistent and temporary MiB, and
    the MiB more each step takes from step 6 on (0: none), beyond what the dry run sees."""

    persistent: int
    temporary: int
    grow: int = 0

    def argv(self, steps: int, step_s: float) -> list[str]:
        argv = [sys.executable, str(LOOP), str(self.persistent), str(self.temporary), str(steps)]
        argv += ["--step-seconds", str(step_s)]
        if self.grow:
            argv += ["--grow-after", str(DRY_ITERATIONS + 3), str(self.grow)]
        return argv


def admission_mix(quick: bool) -> list[Job]:
    """The mix: persistent 0.5 to 4 GiB, temporary 0.25 to 2 GiB, every fourth job
    growing by 1 GiB after the dry run's steps. Fixed, so each run admits the same mix."""
    persistent = (512, 1024, 2048, 3072, 4096, 1536)
    temporary = (256, 512, 1024, 2048)
    n = 12 if quick else 24
    return [
        Job(persistent[i % len(persistent)], temporary[i % len(temporary)], 1024 * (i % 4 == 3))
        for i in range(n)
    ]


def _admit(mix: list[Job], shape: str, steps: int, step_s: float) -> dict[str, Any]:
    """Submit the whole mix at once, each job in an environment of its own, all waiting in
    the queue; poll nodemgr until every one has ended."""
    gpus = {
        "simulated_count": ADMIT_GPUS,
        "simulated_memory": f"{ADMIT_GPU_MEMORY // GiB}GiB",
        "context_memory": "0",
        "utilization_interval": 0.0,
    }
    with daemon(gpus=gpus, scheduler={"memory_reserve": "0"}) as d:
        procs = []
        started = time.monotonic()
        for i, job in enumerate(mix):
            endpoint = d.env(f"job{i}", gpus=1, memory=ADMIT_QUOTA)
            argv = [str(BIN / "gpushare-run"), "--endpoint", endpoint, "--shape", shape]
            procs.append(
                subprocess.Popen(
                    [*argv, "--", *job.argv(steps, step_s)],
                    env=base_env(),
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        most, samples, first = 0, [], None
        while any(p.poll() is None for p in procs):
            running = int(d.admin("status")["tasks"])
            if running and first is None:
                first = time.monotonic()
            if first is not None:
                samples.append(running)
            most = max(most, running)
            if time.monotonic() - started > 600:
                raise BenchError(f"admission ({shape}): the mix took over 600 s")
            time.sleep(0.1)
        makespan = time.monotonic() - started
        codes = [p.wait() for p in procs]
        errors = [p.stderr.read() if p.stderr else "" for p in procs]
        records = d.admin("history", limit=len(mix) * 2)["records"]
    oom = sum("failed: 2" in e for e in errors)
    failed = [(c, e[-300:]) for c, e in zip(codes, errors, strict=True) if c != 0]
    if failed and len(failed) != oom:
        raise BenchError(f"admission ({shape}): jobs failed otherwise than out of memory: {failed}")
    predicted = [r for r in records if r.get("predicted") is not None]
    return {
        "max_concurrent": most,
        "mean_concurrent": round(statistics.mean(samples), 2) if samples else 0.0,
        "makespan_s": round(makespan, 1),
        "oom": oom,
        "predicted_tasks": len(predicted),
        "topups": sum(int(r.get("topups") or 0) for r in records),
        "granted_over_peak_median": round(
            statistics.median(r["memory"] / r["peak"] for r in predicted if r["peak"]), 3
        )
        if predicted
        else None,
    }


def bench_admission(quick: bool) -> dict[str, Any]:
    """The same mix admitted by whole-quota grants and by prediction."""
    mix = admission_mix(quick)
    steps, step_s = (20, 0.25) if quick else (40, 0.4)
    say(f"{len(mix)} jobs, whole quotas", "admission")
    whole = _admit(mix, "quota", steps, step_s)
    say(f"{len(mix)} jobs, by prediction", "admission")
    shaped = _admit(mix, "predicted", steps, step_s)
    result = {
        "jobs": len(mix),
        "node": f"{ADMIT_GPUS} simulated GPUs of {ADMIT_GPU_MEMORY // GiB} GiB",
        "quota_per_job": ADMIT_QUOTA,
        "job_seconds": round(steps * step_s, 1),
        "quota": whole,
        "predicted": shaped,
        "concurrency_ratio": round(shaped["max_concurrent"] / max(1, whole["max_concurrent"]), 2),
        "mean_concurrency_ratio": round(
            shaped["mean_concurrent"] / max(0.01, whole["mean_concurrent"]), 2
        ),
        "oom": whole["oom"] + shaped["oom"],
    }
    return harness.judge_all(result, [("concurrency_ratio", ">=", ADMIT_TARGET), ("oom", "<=", 0)])


# --- step time on the device timeline (docs/prediction.md#step-time) -----------------------

TIME_RUNS = 6  # runs of each configuration: the last is estimated from 5 recorded
TIME_TARGET = 10.0  # percent: median error after 5 recorded runs


def time_cases(python: str | None, quick: bool) -> list[tuple[str, list[str]]]:
    """The configurations: driver_loop.py jobs from device-bound to host-bound, and with
    PyTorch (``python``) jobs of the zoo."""
    loops = [
        ("loop-k200", ["--launches", "200", "--reads", "1"]),
        ("loop-k800", ["--launches", "800", "--reads", "1"]),
        ("loop-k400-up8", ["--launches", "400", "--upload", "8", "--reads", "1"]),
        ("loop-k100-host", ["--launches", "100", "--reads", "1", "--step-seconds", "0.01"]),
    ]
    if quick:
        loops = loops[:2]
    out = [(n, [sys.executable, str(LOOP), "64", "32", "300", *a]) for n, a in loops]
    if python is not None:
        # Steps enough for a run of a second or more: nodemgr measures from its sweeps.
        zoo_cases = [("mlp-s", 64, 300), ("resnet-s", 16, 60), ("enc-s", 16, 100)]
        for name, batch, steps in zoo_cases[: 2 if quick else 3]:
            argv = [python, str(ZOO), name, str(batch), "sgd", str(steps)]
            out.append((f"{name}/b{batch}", argv))
    return out


def bench_time(python: str | None, quick: bool) -> dict[str, Any]:
    """Each configuration run TIME_RUNS times with --shape predicted on simulated GPUs
    with the device timeline: nodemgr's estimate against the measured step time."""
    gpus = {
        "simulated_count": 1,
        "simulated_memory": "80GiB",
        "context_memory": "0",
        "simulated_timeline": True,
    }
    rows: list[dict[str, Any]] = []
    with daemon(gpus=gpus, scheduler={"memory_reserve": "0"}) as d:
        endpoint = d.env("time", gpus=1, memory=80 * GiB)
        for name, argv in time_cases(python, quick):
            runs: list[dict[str, Any]] = []
            for k in range(TIME_RUNS):
                cmd = [str(BIN / "gpushare-run"), "--endpoint", endpoint, "--shape", "predicted"]
                _run([*cmd, "--", *argv], base_env(), f"time {name} run {k + 1}")
                command = " ".join(argv)
                [r] = [
                    r
                    for r in d.admin("history", env="time", limit=1)["records"]
                    if r["command"] == command
                ] or [None]
                if r is None or r["step"] is None or r["predicted_step"] is None:
                    raise BenchError(f"time {name} run {k + 1}: no step time recorded: {r}")
                runs.append(
                    {
                        "predicted_s": r["predicted_step"],
                        "measured_s": r["step"],
                        "error_pct": round(_pct(r["predicted_step"], r["step"]), 2),
                        "utilization": r["utilization"],
                        "predicted_utilization": r["predicted_utilization"],
                    }
                )
            say(
                f"{name}: " + ", ".join(f"{x['error_pct']:+.1f}%" for x in runs),
                "time",
            )
            rows.append({"case": name, "runs": runs})

    def at(k: int) -> float:
        return round(float(statistics.median(abs(r["runs"][k]["error_pct"]) for r in rows)), 2)

    result = {
        "cases": len(rows),
        "runs_per_case": TIME_RUNS,
        "median_error_pct_first_run": at(0),
        "median_error_pct_second_run": at(1),
        "median_error_pct_after_5": at(TIME_RUNS - 1),
        "worst_error_pct_after_5": round(max(abs(r["runs"][-1]["error_pct"]) for r in rows), 2),
        "rows": rows,
    }
    return harness.judge(result, "median_error_pct_after_5", "<=", TIME_TARGET)


BENCHES = ("memory", "admission", "time")


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
        failed = False
        if not args.gpu and (not args.only or "admission" in args.only):
            bench = functools.partial(bench_admission, args.quick)
            failed = harness.run_one("admission", bench, errors, results)
        if args.only and "memory" not in args.only and "time" not in args.only:
            return failed
        try:
            if args.gpu:
                python = find_gpu_python(args.python)
                target = real_gpu()
            else:
                python = find_python(args.python)
                target = SIMULATED
        except (BenchError, OSError, ImportError) as e:
            say(f"cannot run: {e}")
            results["memory"] = harness.error_result(e)
            return True
        where["device"] = target.where
        if not args.gpu and (not args.only or "time" in args.only):
            timed = functools.partial(bench_time, python, args.quick)
            failed = harness.run_one("time", timed, errors, results) or failed
        if args.only and "memory" not in args.only:
            return failed
        bench = functools.partial(bench_memory, python, args.margin, target, args.quick)
        return harness.run_one("memory", bench, errors, results) or failed

    return harness.run_and_report(args, run_all, lambda: harness.machine({}, where))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    sys.exit(main())
