#!/usr/bin/env python3
"""Latency classes and compute shares (docs/compute.md) on the simulated device timeline,
or on a real NVIDIA GPU.

    python benchmarks/qos_bench.py [--quick] [--only NAME]... [--out FILE] [--check]
                                   [--python PY] [--gpu]

Real PyTorch (the torch venv's Python: ``--python``, else ``$GPUSHARE_TORCH_PYTHON``)
trains small models under ``gpushare-run`` against a ``nodemgr serve`` of this script's
own, on one simulated GPU with the device timeline on (docs/simulator.md): every kernel
and copy takes modelled device time on a timeline all processes share, so contention
between tasks is real and measurable. Each process's device time is read, independently
of the shim, from the simulated NVML (``gpushareSimProcessBusyNs``), sampled every
100 ms; a window is one second of wall time.

With ``--gpu`` (``make bench-gpu-qos``) the same runs go to the node's NVIDIA GPU
(nodemgr on NVML, every job pinned to the GPU with the most free memory), with models
four times as wide on batches four times as large, so that a step is GPU work of
milliseconds; each process's device time is then NVML's per-process utilisation
(``nvmlDeviceGetProcessUtilization``) integrated over its sampling periods. The Python
with PyTorch (``--python``, default this one) needs gpushare installed for its hooks.

- ``ls_with_be``: a latency-sensitive (LS) job (a step of GPU work, then idle "think"
  time, as an interactive user's) alone, then beside one and three best-effort (BE)
  training jobs. Targets: LS step rate >= 0.95 of alone, LS p99 step time <= 1.10x
  alone; BE throughput >= 80% of what the BE jobs would make alone in the device time
  the LS job leaves idle (and their device time against that idle time).
- ``share_tracking``: a task capped at 30% beside 1, 2 and 4 uncapped co-tenants, and a
  30/70 pair: each capped task's percent of its speed alone (step rate) per window after
  the first second, and the largest tracking error (target: within 5 percentage points);
  and its percent of the device's time. A share reserves the device's time: a job that
  keeps the device busy X% of the time alone gets about X% of the share as device time.
- ``share_settling``: a live change of a task's share (30 -> 60 and back, with
  ``nodemgr share``): seconds until its windows (of its speed alone) are within 5 points
  of the new share.
- ``elastic``: an LS job with a step target that a BE job's guaranteed share makes it
  miss: its step time before and after the elastic steps; and how long after the LS
  job ends the BE job has its share back (target: 2 s).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SELF = Path(__file__).resolve()
if str(SELF.parent.parent) not in sys.path:
    sys.path.append(str(SELF.parent.parent))  # last: see benchmarks/harness.py
from benchmarks import harness  # noqa: E402
from benchmarks.harness import BenchError, percentile  # noqa: E402
from benchmarks.torch_bench import PYTHON_ENV, base_env, find_gpu_python, find_python  # noqa: E402

BIN = Path(sys.executable).parent
GiB = 1 << 30
MiB = 1 << 20
QUOTA = 2 * GiB
SAMPLE_S = 0.1  # how often device time is sampled
WINDOW_S = 1.0  # the window a share is judged over


def say(message: str) -> None:
    harness.say(message, "bench-qos")


# --- the job (runs in the torch Python: stdlib and torch only) -------------------------------


def _worker(spec_json: str) -> int:
    """Train until ``seconds`` have passed: one JSON line per step (``ts``, ``te``:
    CLOCK_MONOTONIC at its start and end) into ``out``, its pid first."""
    import importlib

    torch: Any = importlib.import_module("torch")
    spec = json.loads(spec_json)
    nn = torch.nn
    torch.manual_seed(0)
    width = spec["width"]
    layers: list[Any] = []
    for _ in range(spec["depth"]):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(width, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    xb = torch.randn(spec["batch"], width, device="cuda")
    yb = torch.randint(0, 10, (spec["batch"],), device="cuda")
    think = spec["think_ms"] / 1e3
    with open(spec["out"], "a", buffering=1) as out:
        first = {
            "pid": os.getpid(),
            "sim_gpus": os.environ.get("GPUSHARE_SIM_GPUS", ""),
            "sim_state_dir": os.environ.get("GPUSHARE_SIM_STATE_DIR", ""),
        }
        out.write(json.dumps(first) + "\n")
        end = time.monotonic() + spec["seconds"]
        while time.monotonic() < end:
            ts = time.monotonic()
            opt.zero_grad(set_to_none=True)
            loss_fn(model(xb), yb).backward()
            opt.step()
            torch.cuda.synchronize()
            te = time.monotonic()
            out.write(json.dumps({"ts": ts, "te": te}) + "\n")
            if think:
                time.sleep(think)
    return 0


# --- device time -----------------------------------------------------------------------------


class DeviceClock:
    """Each process's cumulative device time on simulated GPU 0, from the simulated NVML."""

    def __init__(self, sim_gpus: str, state_dir: str) -> None:
        from gpushare import libs  # not at the top: the worker's Python may lack it

        os.environ["GPUSHARE_SIM_GPUS"] = sim_gpus
        os.environ["GPUSHARE_SIM_STATE_DIR"] = state_dir
        # A copy of its own for each nodemgr of the run: a library loaded again from the
        # same path is the same, already started on the first nodemgr's GPUs.
        self._dir = tempfile.TemporaryDirectory(prefix="gsq-nvml-")
        copy = Path(self._dir.name) / "libnvidia-ml.so.1"
        shutil.copy(libs.sim_driver_dir() / "libnvidia-ml.so.1", copy)
        self.lib = ctypes.CDLL(str(copy))
        if self.lib.nvmlInit_v2() != 0:
            raise BenchError("the simulated NVML did not start")
        self.dev = ctypes.c_void_p()
        if self.lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(self.dev)) != 0:
            raise BenchError("the simulated NVML has no GPU 0")

    def busy_ns(self, pid: int) -> int:
        ns = ctypes.c_ulonglong()
        if self.lib.gpushareSimProcessBusyNs(self.dev, ctypes.c_uint(pid), ctypes.byref(ns)):
            return 0
        return int(ns.value)

    def refresh(self) -> None:
        """Nothing: the simulated NVML is read at each ``busy_ns``."""

    def describe(self) -> dict[str, Any]:
        return {"source": "gpushareSimProcessBusyNs"}


class NvmlClock:
    """Each process's cumulative device time on one real GPU, from NVML's per-process
    utilisation: each sample is the percent of one sampling period in which a kernel of
    the process ran (smUtil). A process that ran nothing in a period may have no sample
    for it, so a sample is taken to cover the time since the process's previous one up to
    the shortest such gap seen, the sampling period."""

    def __init__(self, uuid: str) -> None:
        import pynvml

        self.nvml: Any = pynvml
        pynvml.nvmlInit()
        self.handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        self.last_seen = 0  # the newest sample's timestamp (microseconds)
        self.previous: dict[int, int] = {}  # per pid: its newest sample's timestamp
        self.period_us: int | None = None  # the shortest gap between two samples of a pid
        self.busy: dict[int, float] = {}  # per pid: device time (ns)
        self.samples = 0
        self._lock = threading.Lock()

    def refresh(self) -> None:
        """Take in the samples NVML has taken since the last refresh."""
        with self._lock:
            try:
                found = self.nvml.nvmlDeviceGetProcessUtilization(self.handle, self.last_seen)
            except self.nvml.NVMLError:  # NOT_FOUND: no sample since; NOT_SUPPORTED
                return
            for sample in sorted(found, key=lambda x: int(x.timeStamp)):
                pid, stamp = int(sample.pid), int(sample.timeStamp)
                before = self.previous.get(pid)
                self.last_seen = max(self.last_seen, stamp)
                if before is not None and stamp <= before:
                    continue
                self.previous[pid] = stamp
                self.samples += 1
                if before is None:
                    continue
                gap = stamp - before
                self.period_us = gap if self.period_us is None else min(self.period_us, gap)
                covered = min(gap, self.period_us)
                self.busy[pid] = (
                    self.busy.get(pid, 0.0) + min(100, int(sample.smUtil)) * covered * 10
                )

    def busy_ns(self, pid: int) -> int:
        with self._lock:
            return int(self.busy.get(pid, 0.0))

    def describe(self) -> dict[str, Any]:
        return {
            "source": "nvmlDeviceGetProcessUtilization",
            "samples": self.samples,
            "sampling_period_ms": None if self.period_us is None else self.period_us / 1e3,
        }


Clock = DeviceClock | NvmlClock


class Sampler:
    """Samples the device time of a set of pids every SAMPLE_S on a thread of its own."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.pids: dict[str, int] = {}
        self.samples: list[tuple[float, dict[str, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.clock.refresh()
            now = time.monotonic()
            self.samples.append((now, {n: self.clock.busy_ns(p) for n, p in self.pids.items()}))

    def shares(self, name: str, since: float, until: float) -> list[float]:
        """``name``'s percent of device time in each whole window between the two times."""
        rows = [(t, s.get(name)) for t, s in self.samples if since <= t <= until]
        rows = [(t, b) for t, b in rows if b is not None]
        out = []
        i = 0
        for j in range(len(rows)):
            if rows[j][0] - rows[i][0] >= WINDOW_S - SAMPLE_S / 2:
                dt = rows[j][0] - rows[i][0]
                out.append(100.0 * (rows[j][1] - rows[i][1]) / (dt * 1e9))  # type: ignore[operator]
                i = j
        return out


# --- running jobs ----------------------------------------------------------------------------


class Job:
    def __init__(self, name: str, proc: subprocess.Popen[bytes], out: Path) -> None:
        self.name = name
        self.proc = proc
        self.out = out

    def first(self, timeout: float = 60.0) -> dict[str, Any]:
        """What the job said of itself when it started: its pid and simulated GPUs."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rows = harness.read_jsonl(self.out) if self.out.exists() else []
            if rows:
                return rows[0]
            if self.proc.poll() is not None:
                raise BenchError(f"{self.name} exited {self.proc.returncode}: {self.err()}")
            time.sleep(0.05)
        raise BenchError(f"{self.name} did not start within {timeout:.0f}s")

    def pid(self) -> int:
        return int(self.first()["pid"])

    def steps(self) -> list[dict[str, Any]]:
        return [r for r in harness.read_jsonl(self.out) if "te" in r]

    def err(self) -> str:
        if self.proc.stderr is None:
            return ""
        with contextlib.suppress(OSError, ValueError):
            return self.proc.stderr.read().decode(errors="replace")[-800:]
        return ""

    def wait(self, timeout: float) -> None:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise BenchError(f"{self.name} did not end within {timeout:.0f}s") from None
        if self.proc.returncode != 0:
            raise BenchError(f"{self.name} exited {self.proc.returncode}: {self.err()}")


@dataclass(frozen=True)
class Device:
    """Where the jobs run: the simulated GPU's timeline, or a real GPU (``uuid``)."""

    gpus: dict[str, Any]  # nodemgr's [gpus] section
    quota: int  # each environment's memory quota
    size: int  # every model's width and batch are multiplied by this
    env: dict[str, str]  # added to each job's environment
    uuid: str | None = None  # the real GPU's, for NVML

    @property
    def by_steps(self) -> bool:
        """A job's device time beside others is inferred from its steps (_step_windows),
        not read from the clock, on a real GPU: on an H200 (driver 580) NVML's per-process
        figures of two identical loops time-slicing it read 22% and 63% (docs/compute.md,
        "The pacer")."""
        return self.uuid is not None


# How long device work takes on the timeline: steps of tens of milliseconds, so the
# host side of torch (milliseconds a step) is small beside it.
TIMELINE: dict[str, Any] = {"simulated_time_scale": 100}
SIMULATED = Device(
    gpus={"simulated_count": 1, "simulated_timeline": True, **TIMELINE}, quota=QUOTA, size=1, env={}
)
GPU_QUOTA = 8 * GiB  # on a real GPU: a CUDA context alone takes over 500 MiB there
GPU_JOBS = 5  # the most jobs at once (share_tracking's 30_with_4)


def real_gpu() -> Device:
    """The node's NVIDIA GPU with the most free memory; BenchError if it has too little."""
    try:
        gpus = harness.nvml_gpus()
    except Exception as e:  # pynvml.NVMLError, a missing library: no GPU to run on
        raise BenchError(f"NVML finds no GPU: {e}") from None
    gpu = harness.pick_gpu(gpus, need=GPU_JOBS * GPU_QUOTA)
    if gpu is None:
        raise BenchError(
            f"no NVIDIA GPU with {GPU_JOBS * GPU_QUOTA // GiB} GiB free (NVML shows {len(gpus)})"
        )
    return Device(
        gpus={"source": "nvml"},
        quota=GPU_QUOTA,
        size=4,
        env=harness.pinned(gpu),
        uuid=gpu.uuid,
    )


class Bench:
    """One nodemgr on one GPU (simulated with the device timeline, or real), and its
    environments."""

    def __init__(self, d: Any, python: str, work: Path, device: Device) -> None:
        self.d = d
        self.python = python
        self.work = work
        self.device = device
        self.n = 0
        self._clock: Clock | None = None
        self._alone: dict[str, Alone] = {}

    def clock(self, job: Job) -> Clock:
        """The device time of each process on the GPU: NVML's on a real GPU, else the
        simulated NVML of the node, as ``job`` was told of it."""
        if self._clock is None:
            if self.device.uuid is not None:
                self._clock = NvmlClock(self.device.uuid)
            else:
                first = job.first()
                self._clock = DeviceClock(first["sim_gpus"], first["sim_state_dir"])
        return self._clock

    def alone(self, seconds: float, **spec: Any) -> Alone:
        """The job ``spec`` describes, run alone once (for ``seconds``)."""
        key = json.dumps(spec, sort_keys=True)
        if key not in self._alone:
            self._alone[key] = _run_alone(self, seconds, **spec)
        return self._alone[key]

    def device_windows(
        self, sampler: Sampler, job: Job, alone: Alone, since: float, until: float
    ) -> list[float]:
        """``job``'s percent of the device's time in each whole window between the two
        times: by the clock, or on a real GPU by its steps (``alone``'s device time each)."""
        if self.device.by_steps:
            return _step_windows(job.steps(), alone.step_device_s, since, until)
        return sampler.shares(job.name, since, until)

    def clock_description(self) -> dict[str, Any] | None:
        """Where the device times came from (and, from NVML, how often it sampled)."""
        return None if self._clock is None else self._clock.describe()

    def start(self, env: str, opts: list[str], **spec: Any) -> Job:
        self.n += 1
        out = self.work / f"{env}-{self.n}.jsonl"
        spec = {"width": 1024, "depth": 4, "batch": 512, "think_ms": 0, "seconds": 10.0} | spec
        spec["width"] *= self.device.size
        spec["batch"] *= self.device.size
        spec["out"] = str(out)
        endpoint = self.d.env(env, gpus=1, memory=self.device.quota)
        argv = [str(BIN / "gpushare-run"), "--endpoint", endpoint, *opts, "--"]
        argv += [self.python, str(SELF), "--worker", json.dumps(spec)]
        proc = harness.start_child(
            argv,
            env=base_env() | self.device.env,
            cwd="/",
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        return Job(f"{env}#{self.n}", proc, out)


def _step_summary(steps: list[dict[str, Any]], skip: int = 3) -> dict[str, Any]:
    times = [(s["te"] - s["ts"]) * 1e3 for s in steps[skip:]]
    if len(times) < 5:
        raise BenchError(f"only {len(times)} steps measured")
    return {
        "steps_per_s": round(harness.steps_per_s(steps, skip), 3),
        "median_ms": round(sorted(times)[len(times) // 2], 3),
        "p99_ms": round(percentile(times, 99), 3),
        "n": len(times),
    }


# The best-effort jobs: many small kernels (an LS kernel waits for at most the BE work
# queued ahead of it: a small batch keeps each BE kernel short beside an LS step).
BE_SPEC: dict[str, Any] = {"batch": 64, "depth": 8}


def _mean(values: list[float]) -> float:
    return sum(values) / max(1, len(values))


def bench_ls_with_be(b: Bench, quick: bool) -> dict[str, Any]:
    seconds = 6.0 if quick else 15.0
    ls_spec = {"think_ms": 30, "seconds": seconds, "depth": 2}
    runs: dict[str, Any] = {}
    be_alone = b.alone(4.0, **BE_SPEC)
    ls_alone = None
    for n_be in (0, 1, 3):
        be_jobs = [
            b.start(f"be{i}", ["--class", "be"], seconds=seconds + 4, **BE_SPEC)
            for i in range(n_be)
        ]
        ls = b.start("ls", ["--class", "ls"], **ls_spec)
        with Sampler(b.clock(ls)) as sampler:
            sampler.pids[ls.name] = ls.pid()
            for j in be_jobs:
                sampler.pids[j.name] = j.pid()
            ls.wait(seconds + 60)
        run = _step_summary(ls.steps())
        t0 = ls.steps()[3]["ts"]
        t1 = ls.steps()[-1]["te"]
        if ls_alone is None:  # the first run: LS alone, its device time by the clock
            ls_alone = _alone_of(sampler, ls)
        ls_busy = _mean(b.device_windows(sampler, ls, ls_alone, t0, t1))
        run["ls_device_pct"] = round(ls_busy, 2)
        if n_be:
            idle = 100.0 - ls_busy
            be_busy = sum(_mean(b.device_windows(sampler, j, be_alone, t0, t1)) for j in be_jobs)
            # Their throughput: what the BE jobs made, against what they could make in the
            # time LS leaves idle: n jobs alone make n times one's rate, and no more than
            # the device's time allows (one's rate over its busy fraction).
            be_speed = sum(_steps_between(j.steps(), t0, t1) for j in be_jobs) / (t1 - t0)
            be_most = min(n_be, 100.0 / be_alone.device_pct) * be_alone.steps_per_s
            run["be_device_pct"] = round(be_busy, 2)
            run["be_of_ls_idle"] = round(be_busy / idle, 3) if idle > 0 else None
            run["be_throughput_of_ls_idle"] = (
                round(be_speed / (be_most * idle / 100.0), 3) if idle > 0 else None
            )
        for j in be_jobs:
            harness.finish(j.proc)
        runs[f"be{n_be}"] = run
    alone = runs["be0"]
    r: dict[str, Any] = {"be_alone": be_alone.describe(), "runs": runs}
    for n_be in (1, 3):
        run = runs[f"be{n_be}"]
        run["rate_vs_alone"] = round(run["steps_per_s"] / alone["steps_per_s"], 3)
        run["p99_vs_alone"] = round(run["p99_ms"] / alone["p99_ms"], 3)
    return harness.judge_all(
        r,
        [
            ("runs.be1.rate_vs_alone", ">=", 0.95),
            ("runs.be3.rate_vs_alone", ">=", 0.95),
            ("runs.be1.p99_vs_alone", "<=", 1.10),
            ("runs.be3.p99_vs_alone", "<=", 1.10),
            ("runs.be1.be_throughput_of_ls_idle", ">=", 0.80),
            ("runs.be3.be_throughput_of_ls_idle", ">=", 0.80),
        ],
    )


@dataclass(frozen=True)
class Alone:
    """A job run alone: its steps a second, and its percent of the device's time (by the
    clock: the one process on the device, so NVML's figure is its own on a real GPU too)."""

    steps_per_s: float
    device_pct: float

    @property
    def step_device_s(self) -> float:
        """The device time of one step."""
        return self.device_pct / 100.0 / self.steps_per_s

    def describe(self) -> dict[str, Any]:
        return {
            "steps_per_s": round(self.steps_per_s, 3),
            "device_pct": round(self.device_pct, 2),
            "step_device_ms": round(1e3 * self.step_device_s, 3),
        }


def _step_windows(
    steps: list[dict[str, Any]], seconds_a_step: float, since: float, until: float
) -> list[float]:
    """Percent of each whole window between the two times that ``steps`` filled at
    ``seconds_a_step`` each (a step counted in proportion to the part of it inside the
    window): with a step's device time, the device time inferred from the step rate; with
    the time a step took alone (1 / its rate), the percent of its speed alone."""
    out = []
    t = since
    while t + WINDOW_S <= until:
        out.append(100.0 * _steps_between(steps, t, t + WINDOW_S) * seconds_a_step / WINDOW_S)
        t += WINDOW_S
    return out


def _steps_between(steps: list[dict[str, Any]], since: float, until: float) -> float:
    """How many of ``steps`` ran between the two times, each in proportion to its part there."""
    done = 0.0
    for s in steps:
        inside = min(s["te"], until) - max(s["ts"], since)
        if inside > 0:
            done += inside / max(s["te"] - s["ts"], 1e-9)
    return done


def _speed_windows(job: Job, alone: Alone, since: float, until: float) -> list[float]:
    """``job``'s percent of its speed alone in each whole window between the two times."""
    return _step_windows(job.steps(), 1.0 / alone.steps_per_s, since, until)


def _run_alone(b: Bench, seconds: float, **spec: Any) -> Alone:
    job = b.start("alone", [], **(spec | {"seconds": seconds}))
    with Sampler(b.clock(job)) as sampler:
        sampler.pids[job.name] = job.pid()
        job.wait(seconds + 60)
    return _alone_of(sampler, job)


def _alone_of(sampler: Sampler, job: Job) -> Alone:
    """What ``job``, which ran alone, made after its first three steps, and its device time."""
    steps = job.steps()[3:]
    if len(steps) < 5:
        raise BenchError(f"{job.name} made {len(steps)} steps alone")
    since, until = steps[0]["ts"], steps[-1]["te"]
    return Alone(len(steps) / (until - since), _device_pct(sampler, job, since, until))


def _device_pct(sampler: Sampler, job: Job, since: float, until: float) -> float:
    """``job``'s mean percent of the device between the two times, by the clock; BenchError
    if the clock saw none (on a real GPU: NVML lists the process under another pid)."""
    windows = sampler.shares(job.name, since, until)
    if not windows or _mean(windows) <= 0:
        raise BenchError(f"no device time measured for {job.name} ({sampler.clock.describe()})")
    return _mean(windows)


def _tracking(b: Bench, shares: list[int | None], seconds: float, alone: Alone) -> dict[str, Any]:
    jobs = []
    for i, share in enumerate(shares):
        opts = ["--compute", str(share)] if share is not None else []
        jobs.append((share, b.start(f"t{i}", opts, seconds=seconds)))
    with Sampler(b.clock(jobs[0][1])) as sampler:
        for _, j in jobs:
            sampler.pids[j.name] = j.pid()
        for _, j in jobs:
            j.wait(seconds + 60)
    # Judged while every job ran: from the last one's first step (and a second more, as
    # the target says) to the first one's last.
    start = max(j.steps()[0]["ts"] for _, j in jobs) + 1.0
    end = min(j.steps()[-1]["te"] for _, j in jobs)
    out: dict[str, Any] = {"shares": shares, "tasks": []}
    worst = {"speed": 0.0, "device": 0.0}
    empty = False
    for share, j in jobs:
        views = {
            "speed": _speed_windows(j, alone, start + 1.0, end),
            "device": b.device_windows(sampler, j, alone, start + 1.0, end),
        }
        entry: dict[str, Any] = {
            "share": share,
            "windows_pct": [round(w, 2) for w in views["speed"]],
            "device_windows_pct": [round(w, 2) for w in views["device"]],
            "clock_windows_pct": [round(w, 2) for w in sampler.shares(j.name, start + 1.0, end)],
        }
        if share is not None:
            for name, windows in views.items():
                if windows:
                    worst[name] = max(worst[name], max(abs(w - share) for w in windows))
            if views["speed"]:
                entry["max_error_pts"] = round(max(abs(w - share) for w in views["speed"]), 2)
            else:
                empty = True  # too short a run to judge: missed, not met
        out["tasks"].append(entry)
    out["max_error_pts"] = None if empty else round(worst["speed"], 2)
    out["device_max_error_pts"] = None if empty else round(worst["device"], 2)
    return out


def bench_share_tracking(b: Bench, quick: bool) -> dict[str, Any]:
    seconds = 5.0 if quick else 10.0
    cases: dict[str, list[int | None]] = {
        "30_with_1": [30, None],
        "30_with_2": [30, None, None],
        "30_with_4": [30, None, None, None, None],
        "30_70": [30, 70],
    }
    alone = b.alone(seconds)
    r: dict[str, Any] = {
        "alone": alone.describe(),
        "cases": {k: _tracking(b, v, seconds, alone) for k, v in cases.items()},
    }
    return harness.judge_all(r, [(f"cases.{k}.max_error_pts", "<=", 5.0) for k in cases])


def bench_share_settling(b: Bench, quick: bool) -> dict[str, Any]:
    seconds = 12.0 if quick else 16.0
    alone = b.alone(4.0)
    job = b.start("settle", ["--compute", "30"], seconds=seconds)
    other = b.start("other", [], seconds=seconds)
    changes = []
    with Sampler(b.clock(job)) as sampler:
        sampler.pids[job.name] = job.pid()
        sampler.pids[other.name] = other.pid()
        task_id = _task_id(b, "settle")
        began = time.monotonic()
        for share, at in ((60, 3.0), (30, 7.0)):
            time.sleep(max(0.0, at - (time.monotonic() - began)))
            b.d.admin("share", task_id=task_id, compute=share)
            changed = time.monotonic()
            changes.append((share, changed))
        job.wait(seconds + 60)
        harness.finish(other.proc)
    r: dict[str, Any] = {"alone": alone.describe(), "changes": []}
    for share, at in changes:
        settled = None
        # Judged for 4 s after the change, while the job still ran.
        until = min(at + 4.0, job.steps()[-1]["te"], sampler.samples[-1][0])
        rows = [(t, s.get(job.name)) for t, s in sampler.samples if t >= at]
        # The first moment from which every following 1 s window is within 5 points.
        for i, (t, _) in enumerate(rows):
            windows = _speed_windows(job, alone, t, until)
            if windows and all(abs(w - share) <= 5.0 for w in windows):
                settled = t - at
                break
            if i > 40:
                break
        after = _speed_windows(job, alone, at, until)
        device = b.device_windows(sampler, job, alone, at, until)
        r["changes"].append(
            {
                "to": share,
                "settled_s": None if settled is None else round(settled, 2),
                "windows_after_pct": [round(w, 2) for w in after],
                "device_windows_after_pct": [round(w, 2) for w in device],
            }
        )
    r["max_settle_s"] = max((c["settled_s"] or 99.0) for c in r["changes"])
    return harness.judge(r, "max_settle_s", "<=", 1.0)


def _task_id(b: Bench, env: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        tasks = b.d.admin("tasks", env=env)["tasks"]
        if tasks:
            return str(tasks[0]["task_id"])
        time.sleep(0.05)
    raise BenchError(f"no task of {env} within {timeout:.0f}s")


def _watch(b: Bench, until: Job, every: float = 0.25) -> list[dict[str, Any]]:
    """nodemgr's view of every task, every ``every`` seconds until ``until`` ends."""
    rows = []
    while until.proc.poll() is None:
        tasks = b.d.admin("tasks")["tasks"]
        rows.append({"t": time.monotonic(), "tasks": {t["env"]: t for t in tasks}})
        time.sleep(every)
    return rows


def bench_elastic(b: Bench, quick: bool) -> dict[str, Any]:
    seconds = 10.0 if quick else 16.0
    ls_spec = {"seconds": 5.0, "depth": 2, "think_ms": 0}
    # The LS job's step time alone, and beside a BE job that holds half of the GPU; its
    # target lies between the two, so the elastic rule must act to meet it.
    alone = b.start("ls", ["--class", "ls"], **ls_spec)
    alone.wait(60)
    alone_ms = _step_summary(alone.steps())["median_ms"]
    be = b.start("be", ["--class", "be", "--compute", "50"], seconds=3 * seconds + 30)
    be.pid()
    time.sleep(2.0)
    beside = b.start("ls", ["--class", "ls"], **ls_spec)
    beside.wait(60)
    beside_ms = _step_summary(beside.steps())["median_ms"]
    target_ms = round((alone_ms + beside_ms) / 2, 1)
    ls = b.start(
        "ls", ["--class", "ls", "--step-target", str(target_ms)], **(ls_spec | {"seconds": seconds})
    )
    ls.pid()
    seen = _watch(b, ls)
    ended = time.monotonic()
    back = None
    while time.monotonic() < ended + 5.0:
        row = {t["env"]: t for t in b.d.admin("tasks")["tasks"]}.get("be")
        if row is not None and row.get("share") == 50 and not row.get("preempted"):
            back = round(time.monotonic() - ended, 2)
            break
        time.sleep(0.05)
    harness.finish(be.proc)
    steps = ls.steps()
    last = [(s["te"] - s["ts"]) * 1e3 for s in steps[-10:]]
    trace = [
        {
            "t": round(r["t"] - seen[0]["t"], 2),
            "be_share": r["tasks"].get("be", {}).get("share"),
            "be_preempted": bool(r["tasks"].get("be", {}).get("preempted")),
            "ls_step_ms": None
            if r["tasks"].get("ls", {}).get("step_time") is None
            else round(1e3 * r["tasks"]["ls"]["step_time"], 1),
        }
        for r in seen[:: max(1, len(seen) // 20)]
    ]
    r: dict[str, Any] = {
        "alone_ms": alone_ms,
        "beside_be_ms": beside_ms,
        "target_ms": target_ms,
        "last_steps_ms": round(sorted(last)[len(last) // 2], 3) if last else None,
        "lowest_be_share": min(
            (x["tasks"]["be"]["share"] for x in seen if "be" in x["tasks"]), default=None
        ),
        "be_back_after_s": back,
        "trace": trace,
    }
    return harness.judge_all(
        r, [("last_steps_ms", "<=", target_ms), ("be_back_after_s", "<=", 2.0)]
    )


BENCHES = {
    "ls_with_be": bench_ls_with_be,
    "share_tracking": bench_share_tracking,
    "share_settling": bench_share_settling,
    "elastic": bench_elastic,
}


@contextlib.contextmanager
def _node(python: str, device: Device, compute: dict[str, float]) -> Iterator[Bench]:
    """A nodemgr of its own on ``device`` for one benchmark (``compute``: its [compute]
    settings other than the defaults)."""
    from benchmarks.nodemgr_bench import daemon  # needs pyzmq: the bench's Python has it

    with (
        daemon(
            gpus=device.gpus,
            compute=compute,
            scheduler={"task_threshold": 16, "memory_reserve": "0"},
            node={"heartbeat_interval": 1.0, "heartbeat_timeout": 30.0},
        ) as d,
        tempfile.TemporaryDirectory(prefix="gsq-") as work,
    ):
        d.env("ls", gpus=1, memory=device.quota)
        d.admin("quota_set", env="ls", allow_ls=True)
        yield Bench(d, python, Path(work), device)


def _one(
    python: str, device: Device, compute: dict[str, float], fn: Any, quick: bool
) -> dict[str, Any]:
    with _node(python, device, compute) as b:
        result: dict[str, Any] = fn(b, quick)
        result["device_time"] = b.clock_description()
        return result


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    if args_in[:1] == ["--worker"]:
        return _worker(args_in[1])
    parser = harness.parser(__doc__, BENCHES, quick="shorter runs (a smoke run)")
    parser.add_argument(
        "--python",
        help=f"the Python with PyTorch (default: ${PYTHON_ENV}; with --gpu, else this one)",
    )
    parser.add_argument(
        "--gpu", action="store_true", help="on the node's NVIDIA GPU, not the simulated one"
    )
    parser.add_argument(
        "--compute",
        action="append",
        default=[],
        metavar="KEY=SECONDS",
        help="a [compute] setting of the benchmark's nodemgr (repeatable), e.g. poll=0.00025",
    )
    args = parser.parse_args(args_in)
    compute: dict[str, float] = {}
    for item in args.compute:
        key, _, value = item.partition("=")
        try:
            compute[key] = float(value)
        except ValueError:
            parser.error(f"--compute {item}: give KEY=SECONDS, e.g. poll=0.00025")
    from gpushare.client import Unreachable  # not at the top: the worker lacks pyzmq

    errors = (BenchError, OSError, Unreachable)
    where: dict[str, Any] = {"device": "simulated timeline", **TIMELINE, "compute": compute}

    def run_all(results: dict[str, Any]) -> bool:
        try:
            if args.gpu:
                python = find_gpu_python(args.python)
                device = real_gpu()
                where.clear()
                where.update(
                    device=device.uuid, gpu_quota=device.quota, size=device.size, compute=compute
                )
            else:
                python = find_python(args.python)
                device = SIMULATED
        except (BenchError, OSError, ImportError) as e:
            say(f"cannot run: {e}")
            results.update({n: harness.error_result(e) for n in args.only or BENCHES})
            return True
        broken = False
        for name in args.only or BENCHES:
            bench = functools.partial(_one, python, device, compute, BENCHES[name], args.quick)
            broken |= harness.run_one(name, bench, errors, results)
        return broken

    return harness.run_and_report(args, run_all, lambda: harness.machine({}, where))


if __name__ == "__main__":
    sys.exit(main())
