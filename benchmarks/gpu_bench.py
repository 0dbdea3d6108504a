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
It imports nothing of gpushare but ``nodemgr.host.procfs`` (standard library only, found in
this checkout when not installed), so that Python need not have gpushare installed.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

SELF = Path(__file__).resolve()
ROOT = SELF.parent.parent
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # last: see benchmarks/harness.py
from benchmarks import harness  # noqa: E402
from nodemgr.host import procfs  # noqa: E402 (standard library only: the measuring Python has it)

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


def _launch_rates(torch: Any, launches: int, batches: int) -> list[float]:
    """Launches/s of each of ``batches`` loops of ``launches`` one-element in-place adds."""
    x = torch.zeros(1, device="cuda")
    for _ in range(1000):
        x.add_(1)
    torch.cuda.synchronize()
    rates = []
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(launches):
            x.add_(1)
        torch.cuda.synchronize()
        rates.append(launches / (time.perf_counter() - start))
    return rates


def _train_step_ms(torch: Any, steps: int, batches: int) -> list[float]:
    """Mean milliseconds per SGD step of a 2-layer MLP, batch 256, in each of ``batches``
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
    means = []
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        means.append((time.perf_counter() - start) / steps * 1e3)
    return means


# --- what could explain a slow run (docs/benchmarks.md: "runs") ----------------------------


def this_cpu() -> int | None:
    """The CPU this process last ran on (proc(5): stat field 39, ``processor``)."""
    got = procfs.stat_ints(os.getpid(), 36)
    return got[0] if got else None


def cpu_mhz(
    cpu: int | None, sysfs: Path = Path("/sys/devices/system/cpu"), cpuinfo: str = ""
) -> float | None:
    """CPU ``cpu``'s clock now, MHz: cpufreq's figure, else /proc/cpuinfo's (a virtual
    machine's is often its host's nominal clock); None when neither is readable."""
    if cpu is None:
        return None
    try:
        return int((sysfs / f"cpu{cpu}/cpufreq/scaling_cur_freq").read_text()) / 1000
    except (OSError, ValueError):
        pass
    if not cpuinfo:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    for block in cpuinfo.split("\n\n"):
        fields = dict(
            (k.strip(), v.strip()) for k, _, v in (x.partition(":") for x in block.splitlines())
        )
        if fields.get("processor") == str(cpu) and "cpu MHz" in fields:
            try:
                return float(fields["cpu MHz"])
            except ValueError:
                return None
    return None


RUSAGE_FIELDS = ("ru_utime", "ru_stime", "ru_nvcsw", "ru_nivcsw", "ru_minflt", "ru_majflt")


def rusage_delta(before: Any, after: Any) -> dict[str, float]:
    """CPU seconds (user, system), context switches (voluntary, involuntary: preempted)
    and page faults (minor, major) between two getrusage() results."""
    return {f[3:]: round(getattr(after, f) - getattr(before, f), 4) for f in RUSAGE_FIELDS}


def _where(when: str) -> dict[str, Any]:
    cpu = this_cpu()
    return {f"cpu_{when}": cpu, f"cpu_mhz_{when}": cpu_mhz(cpu)}


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
        cpus = spec.get("cpus")
        if cpus:
            os.sched_setaffinity(0, cpus)  # this thread; torch's later threads inherit it
            torch.set_num_threads(len(cpus))
        diag: dict[str, Any] = {"affinity": sorted(os.sched_getaffinity(0)), **_where("start")}
        usage = resource.getrusage(resource.RUSAGE_SELF)
        if "launch_rate" in spec["only"]:
            rates = _launch_rates(torch, spec["launches"], spec["batches"])
            info["launches_per_s"] = max(rates)
            diag["launches_per_s_loops"] = [round(x, 1) for x in rates]
        if "train_step" in spec["only"]:
            means = _train_step_ms(torch, spec["steps"], spec["batches"])
            info["step_ms"] = min(means)
            diag["step_ms_loops"] = [round(x, 5) for x in means]
        diag["rusage"] = rusage_delta(usage, resource.getrusage(resource.RUSAGE_SELF))
        diag.update(_where("end"))
        diag["threads"] = len(os.listdir("/proc/self/task"))
        info["diag"] = diag
    print(json.dumps(info), flush=True)
    return 0


# --- what the benchmark sees around each run (the main venv's Python) ---------------------

# /proc/stat's columns of a cpu line, in order (proc(5)); guest time is counted in user.
_JIFFIES = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def cpu_lines(text: str) -> dict[str, list[int]]:
    """/proc/stat's cpu lines: "cpu" (all CPUs) and "cpuN" -> their jiffies."""
    out = {}
    for line in text.splitlines():
        name, *fields = line.split() or [""]
        if name.startswith("cpu"):
            out[name] = [int(x) for x in fields[: len(_JIFFIES)]]
    return out


def cpu_delta(
    before: Mapping[str, list[int]], after: Mapping[str, list[int]], name: str, hz: int
) -> dict[str, float] | None:
    """Seconds CPU ``name`` was busy, idle (iowait included) and stolen by the hypervisor
    (another guest ran on it) between two :func:`cpu_lines`; None if either lacks it."""
    if name not in before or name not in after:
        return None
    diffs = [y - x for x, y in zip(before[name], after[name], strict=True)]
    d = dict(zip(_JIFFIES, diffs, strict=False))  # older kernels give fewer columns
    idle = d.get("idle", 0) + d.get("iowait", 0)
    steal = d.get("steal", 0)
    busy = sum(d.values()) - idle - steal
    return {"busy_s": busy / hz, "idle_s": idle / hz, "steal_s": steal / hz}


def process_ticks() -> dict[int, tuple[str, int]]:
    """Every process's command name and CPU time so far (user + system, clock ticks)."""
    out = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        ticks = procfs.stat_ints(pid, 11, 12)
        if ticks is None:
            continue
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        out[pid] = (comm, sum(ticks))
    return out


def busiest(
    before: Mapping[int, tuple[str, int]],
    after: Mapping[int, tuple[str, int]],
    exclude: Iterable[int],
    hz: int,
    n: int = 3,
) -> tuple[float, list[dict[str, Any]]]:
    """CPU seconds other processes used between two :func:`process_ticks` (those alive at
    the second; one started in between counts whole), and the ``n`` that used most."""
    skip = set(exclude)
    used = []
    for pid, (comm, ticks) in after.items():
        if pid in skip:
            continue
        prior = before.get(pid)
        delta = ticks - prior[1] if prior and prior[0] == comm else ticks
        if delta > 0:
            used.append((delta, pid, comm))
    used.sort(reverse=True)
    top = [{"pid": pid, "comm": comm, "cpu_s": d / hz} for d, pid, comm in used[:n]]
    return sum(d for d, _, _ in used) / hz, top


def read_trace(path: Path) -> dict[str, Any]:
    """What a GPUSHARE_TRACE file says of one process (docs/shim.md): its mode, launch
    counter and waits for the pause word, and the calls of each hook it used."""
    out: dict[str, Any] = {}
    calls: dict[str, int] = {}
    try:
        text = path.read_text()
    except OSError:
        return {"error": f"no trace at {path}"}
    for line in text.splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if "hook" in fields:
            calls[fields["hook"]] = calls.get(fields["hook"], 0) + int(fields.get("calls", 0))
        elif "mode" in fields:
            out["mode"] = fields["mode"]
            for key in ("slot", "launches", "pause_waits", "pause_wait_us"):
                if key in fields:
                    out[key] = int(fields[key])
    out["calls"] = {k: v for k, v in sorted(calls.items()) if v}
    return out


# NVML's figures of a GPU that bear on its speed; each None where the GPU or driver gives none.
_NVML_CLOCKS = {"sm_mhz": "NVML_CLOCK_SM", "memory_mhz": "NVML_CLOCK_MEM"}


def nvml_state(nv: Any, handle: Any) -> dict[str, Any]:
    """A GPU's clocks, utilisation, temperature, power, performance state and the reasons
    its clocks are held down (a bit mask: nvmlClocksEventReasons), from pynvml ``nv``."""

    def ask(fn: str, *args: Any) -> Any:
        try:
            return getattr(nv, fn)(handle, *args)
        except Exception:  # NVMLError (not supported), or a pynvml without the function
            return None

    out: dict[str, Any] = {
        k: ask("nvmlDeviceGetClockInfo", getattr(nv, c, None)) for k, c in _NVML_CLOCKS.items()
    }
    rates = ask("nvmlDeviceGetUtilizationRates")
    out["utilization_gpu"] = getattr(rates, "gpu", None)
    out["utilization_memory"] = getattr(rates, "memory", None)
    out["temperature_c"] = ask("nvmlDeviceGetTemperature", getattr(nv, "NVML_TEMPERATURE_GPU", 0))
    power = ask("nvmlDeviceGetPowerUsage")
    out["power_w"] = power / 1000 if isinstance(power, int) else None
    out["pstate"] = ask("nvmlDeviceGetPerformanceState")
    reasons = ask("nvmlDeviceGetCurrentClocksEventReasons")
    if reasons is None:
        reasons = ask("nvmlDeviceGetCurrentClocksThrottleReasons")
    out["clocks_event_reasons"] = reasons
    return out


class Observer:
    """What the benchmark records around each measuring run, beside the run's own figures
    (docs/benchmarks.md): load, CPU use by CPU and by process, nodemgr's CPU time, the
    run's processes' resource use, and the GPU's state from NVML before and after."""

    def __init__(self, nodemgr_pid: int) -> None:
        self.nodemgr_pid = nodemgr_pid
        self.hz = os.sysconf("SC_CLK_TCK")
        self.nv: Any = None
        self.handle: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nv = pynvml
        except Exception:  # no NVML here: the runs are recorded without it
            self.nv = None

    def close(self) -> None:
        if self.nv is not None:
            with_nv, self.nv = self.nv, None
            with contextlib.suppress(Exception):
                with_nv.nvmlShutdown()

    def gpu(self, visible: str) -> None:
        """Watch the GPU a run was given (CUDA_VISIBLE_DEVICES: a UUID or an index)."""
        if self.nv is None:
            return
        first = visible.split(",")[0].strip()
        try:
            if first.isdigit():
                self.handle = self.nv.nvmlDeviceGetHandleByIndex(int(first))
            else:
                self.handle = self.nv.nvmlDeviceGetHandleByUUID(first)
        except Exception:
            self.handle = None

    def _snapshot(self) -> dict[str, Any]:
        return {
            "t": time.monotonic(),
            "load": os.getloadavg()[0],
            "cpus": cpu_lines(Path("/proc/stat").read_text()),
            "procs": process_ticks(),
            "children": resource.getrusage(resource.RUSAGE_CHILDREN),
            "nvml": None if self.handle is None else nvml_state(self.nv, self.handle),
        }

    def before(self) -> dict[str, Any]:
        return self._snapshot()

    def after(self, start: dict[str, Any], worker: Mapping[str, Any]) -> dict[str, Any]:
        """The run's record: ``start`` (from :meth:`before`) against now; ``worker`` is
        the measuring program's own ``diag``."""
        end = self._snapshot()
        cpus: dict[str, Any] = {"all": cpu_delta(start["cpus"], end["cpus"], "cpu", self.hz)}
        where = {worker[k] for k in ("cpu_start", "cpu_end") if isinstance(worker.get(k), int)}
        for cpu in sorted(where):
            cpus[f"cpu{cpu}"] = cpu_delta(start["cpus"], end["cpus"], f"cpu{cpu}", self.hz)
        nodemgr = [x.get(self.nodemgr_pid, ("", 0))[1] for x in (start["procs"], end["procs"])]
        others, top = busiest(
            start["procs"], end["procs"], (os.getpid(), self.nodemgr_pid), self.hz
        )
        return {
            "wall_s": round(end["t"] - start["t"], 3),
            "loadavg_1m_before": round(start["load"], 2),
            "loadavg_1m_after": round(end["load"], 2),
            "cpu_time": cpus,
            "nodemgr_cpu_s": (nodemgr[1] - nodemgr[0]) / self.hz,
            "others_cpu_s": others,
            "others_busiest": top,
            "run_processes": rusage_delta(start["children"], end["children"]),
            "gpu_before": start["nvml"],
            "gpu_after": end["nvml"],
            **worker,
        }


def slow_runs(runs: list[dict[str, Any]], key: str, higher_is_better: bool) -> list[int]:
    """The runs (by their place in ``runs``) more than 10% worse than their side's median:
    where to look first in the records."""
    out = []
    for shim in (True, False):
        side = [(i, r[key]) for i, r in enumerate(runs) if r["shim"] == shim and key in r]
        if not side:
            continue
        median = statistics.median(v for _, v in side)
        for i, v in side:
            if (v < 0.9 * median) if higher_is_better else (v > median / 0.9):
                out.append(i)
    return sorted(out)


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
        "ratio": w / wo,  # unrounded: the target is judged on it as given
    }
    return harness.judge(result, "ratio", op, target)


def pin_cpus(usable: Iterable[int]) -> tuple[list[int], set[int]] | None:
    """Where the measuring processes run and where nodemgr does (the other CPUs), so that
    where the scheduler happens to put them is the same for both sides and nodemgr never
    takes a measuring CPU: the highest two CPUs (one on a machine of fewer than four,
    since PyTorch's autograd thread takes turns with the launching one); None with fewer
    than two CPUs."""
    cpus = sorted(usable)
    if len(cpus) < 2:
        return None
    n = 2 if len(cpus) >= 4 else 1
    return cpus[-n:], set(cpus[:-n])


def run_benchmarks(
    python: str, only: list[str], quick: bool, records: list[dict[str, Any]], pin: bool = True
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Interleaved runs with and without the shim: the results per benchmark and the
    machine's description; each run's record goes to ``records`` as it ends (so that
    they are kept when a later run fails)."""
    # Here, not at the top: the measuring program's Python need not have pyzmq or nodemgr.
    import benchmarks.nodemgr_bench as nb
    from gpushare.client import Unreachable

    pairs = 2 if quick else 8
    pinned = pin_cpus(os.sched_getaffinity(0)) if pin else None
    spec = {
        "only": only,
        "launches": 20_000 if quick else 50_000,
        "steps": 200,
        "batches": 3 if quick else 5,
        "cpus": pinned[0] if pinned else None,
    }
    measure = [python, str(SELF), "--worker", "measure", json.dumps(spec)]
    runs: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
    try:
        with (
            tempfile.TemporaryDirectory(prefix="gsgb-") as tmp,
            nb.daemon(cpus=pinned[1] if pinned else None, gpus={"source": "nvml"}) as d,
        ):
            memory = min(QUOTA, min(int(g["memory"]) for g in d.admin("status")["gpus"]))
            ep = d.env("bench", gpus=1, memory=memory)
            shim_argv = [str(BIN / "gpushare-run"), "--endpoint", ep, "--", *measure]
            observer = Observer(d.pid)

            def run(shim: bool, visible: str | None, pair: int) -> dict[str, Any]:
                what = "run with the shim" if shim else "run without the shim"
                trace = Path(tmp) / f"trace-{len(records)}"
                if visible is not None:
                    observer.gpu(visible)
                start = observer.before()
                if shim:
                    # The trace costs one add per driver call, to the shim's side only.
                    env = {**_plain_env(), "GPUSHARE_TRACE": str(trace)}
                    doc = _worker_output(shim_argv, env, what)
                else:
                    doc = _worker_output(measure, _plain_env(visible), what)
                record: dict[str, Any] = {"order": len(records), "pair": pair, "shim": shim}
                record.update({k: doc[k] for k in ("launches_per_s", "step_ms") if k in doc})
                record["visible"] = doc.get("visible")
                record.update(observer.after(start, doc.get("diag", {})))
                if shim:
                    record["shim_trace"] = read_trace(trace)
                records.append(record)
                if doc["shim"] != shim:
                    raise BenchError(f"{what}: the shim is {'not ' if shim else ''}loaded")
                return doc

            # A first run with the shim learns the granted GPU (runs without the shim use
            # the one the last run with it was granted) and warms caches; it is not counted.
            try:
                say("warm-up run with the shim ...")
                visible = run(True, None, 0)["visible"]
                for i in range(pairs):
                    for shim in (False, True) if i % 2 == 0 else (True, False):
                        say(f"pair {i + 1}/{pairs}: {'with' if shim else 'without'} the shim ...")
                        doc = run(shim, visible, i + 1)
                        visible = doc["visible"]
                        runs[shim].append(doc)
            finally:
                observer.close()
    except BenchError:
        raise
    except (harness.BenchError, OSError, Unreachable) as e:
        raise BenchError(f"{type(e).__name__}: {e}") from None
    counted = [r for r in records if r["pair"] > 0]
    where = f"pinned to CPUs {pinned[0]}" if pinned else "not pinned"
    results: dict[str, Any] = {}
    if "launch_rate" in only:
        results["launch_rate"] = {
            **ratio_result(runs, "launches_per_s", "per_s", ">=", 0.995),
            "slow_runs": [counted[i]["order"] for i in slow_runs(counted, "launches_per_s", True)],
            "setup": (
                f"launches/s of x.add_(1) on a 1-element CUDA tensor: best of "
                f"{spec['batches']} loops of {spec['launches']} launches (then synchronize) "
                f"per process ({where}), median over {pairs} processes each with and without "
                "the shim, interleaved; ratio = with / without"
            ),
        }
    if "train_step" in only:
        results["train_step"] = {
            **ratio_result(runs, "step_ms", "ms", "<=", 1.005),
            "slow_runs": [counted[i]["order"] for i in slow_runs(counted, "step_ms", False)],
            "setup": (
                "ms per SGD step of Linear(1024,1024)-ReLU-Linear(1024,10), batch 256, "
                f"cross-entropy: best mean of {spec['batches']} loops of {spec['steps']} steps "
                f"after 50 warm-up steps per process ({where}), median over {pairs} processes "
                "each with and without the shim, interleaved; ratio = with / without"
            ),
        }
    gpus = sorted({r["visible"] for r in runs[True] + runs[False]})
    pins = {"measuring_cpus": spec["cpus"], "nodemgr_cpus": sorted(pinned[1]) if pinned else None}
    return results, {**nb.machine(), "gpu_uuids": gpus, **pins}


BENCHMARKS = ("launch_rate", "train_step")


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    if args_in[:1] == ["--worker"]:
        return _worker(args_in[1], args_in[2])
    parser = harness.parser(__doc__, BENCHMARKS, quick="fewer runs (a smoke run)")
    parser.add_argument("--python", help="the Python (with PyTorch) that runs the measurements")
    parser.add_argument(
        "--no-pin",
        action="store_true",
        help="leave the measuring processes and nodemgr where the scheduler puts them",
    )
    args = parser.parse_args(args_in)

    harness.stop_children_on_exit()
    only = [b for b in BENCHMARKS if b in (args.only or BENCHMARKS)]
    load_before = harness.loadavg()
    records: list[dict[str, Any]] = []
    describe: dict[str, Any] = {}
    try:
        python, probe = find_python(args.python)
        say(f"measuring with {python}: torch {probe['torch']}, GPU {probe['gpu']}")
        describe = {k: probe[k] for k in ("gpu", "torch", "torch_cuda")}
        describe["measuring_python"] = python
        start = time.monotonic()
        results, machine = run_benchmarks(python, only, args.quick, records, not args.no_pin)
    except BenchError as e:
        say(f"cannot run: {e}")
        if not records:
            return 2  # nothing ran: no document
        # Some runs ended before one failed: their records are kept, in a document that
        # says why the benchmarks could not run.
        failed = {name: harness.error_result(e) for name in only}
        return harness.report(
            args, lambda: describe, load_before, failed, broken=True, extra={"runs": records}
        )
    except (KeyboardInterrupt, SystemExit) as e:
        # Ctrl-C, or SIGTERM (harness.stop_children_on_exit: a time limit, say): the runs
        # that ended are kept as above; the status says how it was stopped.
        status = 130 if isinstance(e, KeyboardInterrupt) else e.code
        say(f"interrupted (exit {status})")
        if records:
            stopped = BenchError(f"stopped (exit {status}) after {len(records)} runs")
            failed = {name: harness.error_result(stopped) for name in only}
            harness.report(
                args, lambda: describe, load_before, failed, broken=True, extra={"runs": records}
            )
        return status if isinstance(status, int) else 1
    for name, r in results.items():
        say(f"{name}: {harness.verdict(r)}")
    say(f"done in {time.monotonic() - start:.0f}s")
    return harness.report(
        args,
        lambda: {**machine, **describe},
        load_before,
        results,
        extra={"runs": records},
    )


if __name__ == "__main__":
    sys.exit(main())
