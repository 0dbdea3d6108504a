"""What the benchmark scripts share: progress lines, helper processes, the JSON document.

The scripts are run directly (``python benchmarks/NAME_bench.py``), so ``sys.path[0]``
is this folder; each appends the repository root to the end of ``sys.path`` and imports
this module as ``benchmarks.harness``. Appended, not put first: the installed nodemgr,
with its compiled parts, must win over the source tree beside this folder.

Only the standard library is imported at the top: gpu_bench.py runs its measuring
program in a Python that need not have gpushare (or pyzmq) installed.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import functools
import json
import operator
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def say(message: str, prefix: str = "bench") -> None:
    """A progress line on stderr."""
    print(f"{prefix}: {message}", file=sys.stderr, flush=True)


class BenchError(Exception):
    """A benchmark could not run (as opposed to a target being missed)."""


# --- helper processes ------------------------------------------------------------------------

_children: list[subprocess.Popen[Any]] = []


def start_child(argv: list[str], **popen: Any) -> subprocess.Popen[Any]:
    """Start ``argv`` in a session of its own; every such process is killed by :func:`kill_all`.

    Its own session: a Ctrl-C at the terminal reaches only the benchmark, which then
    stops its children in order.
    """
    proc: subprocess.Popen[Any] = subprocess.Popen(argv, start_new_session=True, **popen)
    _children.append(proc)
    return proc


def finish(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL ``proc`` if it still runs (stopped or not), reap it and close its pipes."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()
    with contextlib.suppress(ValueError):
        _children.remove(proc)


def kill_all() -> None:
    """:func:`finish` every child still known."""
    while _children:
        finish(_children[-1])


def _terminate(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through every finally: children are stopped


def stop_children_on_exit() -> None:
    """Stop every helper process however the run ends: SIGTERM exits through every
    ``finally`` (status 128 + 15), and :func:`kill_all` runs at exit."""
    signal.signal(signal.SIGTERM, _terminate)
    atexit.register(kill_all)


# --- statistics and verdicts -----------------------------------------------------------------


def alternating(rounds: int, first: T, second: T) -> Iterator[tuple[int, T]]:
    """(round, side) for both sides of each round, the side that goes first alternating
    from round to round, so that a drift of the machine falls on both alike."""
    for i in range(rounds):
        for side in (first, second) if i % 2 == 0 else (second, first):
            yield i, side


def percentile(samples: list[float], q: float) -> float:
    """Nearest-rank percentile: the smallest sample with at least q% at or below it."""
    ordered = sorted(samples)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON lines a job wrote (none if it wrote no file)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def steps_per_s(steps: list[dict[str, Any]], skip: int = 0) -> float:
    """Steps per second of a training job's step rows (each with ``te``, when the step
    ended), after the first ``skip``; 0 with fewer than two."""
    steps = steps[skip:]
    if len(steps) < 2:
        return 0.0
    return float((len(steps) - 1) / (steps[-1]["te"] - steps[0]["te"]))


def turn_switches(
    steps: list[dict[str, Any]],
    other: list[dict[str, Any]],
    ended: Callable[[dict[str, Any]], bool] = lambda _step: True,
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Turn switches between two jobs sharing a time-sliced GPU, from their step rows
    (``t0`` the step began, ``t1`` its first launch returned, ``tb`` its boundary began):
    each step of ``steps`` whose first launch waited (a millisecond or more), with the last
    step of ``other`` whose boundary came within that wait and that ``ended`` the turn."""
    out = []
    for step in steps:
        if step["t1"] - step["t0"] < 0.001:
            continue  # it did not wait: its turn went on
        inside = [x for x in other if ended(x) and step["t0"] <= x["tb"] <= step["t1"]]
        if inside:
            out.append((step, max(inside, key=lambda x: x["tb"])))
    return out


# A target is one condition {"metric", "op", "value"} or a list of them, all of which must
# hold; a metric names a figure of the result, a dotted path reaching into nested ones
# ("switch_after_release_ms.p50").
_OPS: dict[str, Callable[[Any, Any], bool]] = {
    "<=": operator.le,
    ">=": operator.ge,
    "<": operator.lt,
    ">": operator.gt,
    "==": operator.eq,
}


def figure(result: Mapping[str, Any], metric: str) -> Any:
    """The figure ``metric`` (a dotted path) names in ``result``; None when it has none."""
    got: Any = result
    for part in metric.split("."):
        if not isinstance(got, Mapping) or part not in got:
            return None
        got = got[part]
    return got


def _holds(result: Mapping[str, Any], condition: Mapping[str, Any]) -> bool:
    """Whether one condition holds; never, when its figure is missing or not a number."""
    got = figure(result, condition["metric"])
    if isinstance(got, bool) or not isinstance(got, (int, float)):
        return False
    return bool(_OPS[condition["op"]](got, condition["value"]))


def judge(result: dict[str, Any], metric: str, op: str, value: float) -> dict[str, Any]:
    """Add the target (``metric`` ``op`` ``value``) and whether it was met to ``result``."""
    result["target"] = {"metric": metric, "op": op, "value": value}
    result["met"] = _holds(result, result["target"])
    return result


def judge_all(result: dict[str, Any], conditions: list[tuple[str, str, float]]) -> dict[str, Any]:
    """Add a target of several conditions (metric, op, value), met when every one holds."""
    result["target"] = [{"metric": m, "op": op, "value": v} for m, op, v in conditions]
    result["met"] = bool(conditions) and all(_holds(result, c) for c in result["target"])
    return result


def error_result(e: BaseException) -> dict[str, Any]:
    """The entry of a benchmark that could not run."""
    return {"error": f"{type(e).__name__}: {e}", "met": False}


def _is_condition(target: Any) -> bool:
    return (
        isinstance(target, Mapping)
        and isinstance(target.get("metric"), str)
        and target.get("op") in _OPS
        and "value" in target
    )


def _describe_target(result: Mapping[str, Any], target: Any) -> str:
    conditions = target if isinstance(target, list) else [target]
    if not conditions or not all(_is_condition(c) for c in conditions):
        return f"target not judged here: {json.dumps(target, default=str)}"
    parts = []
    for c in conditions:
        got = figure(result, c["metric"])
        shown = "missing" if got is None else got
        parts.append(f"{c['metric']} = {shown}, target {c['op']} {c['value']}")
    return "; ".join(parts)


def verdict(result: Mapping[str, Any]) -> str:
    """How a benchmark's result reads in a progress line: met, MISSED or ERROR, and the
    figures its target is about. Any result reads, whatever its target's shape: one this
    module cannot judge is shown as it is, so that the report of a run is never lost."""
    r = result
    if "error" in r:
        text = f"ERROR {r['error']}"
    elif "met" not in r:
        text = "NOT JUDGED"
    else:
        text = "met" if r["met"] else "MISSED"
    if "target" in r:
        text += f" ({_describe_target(r, r['target'])})"
    return text


def run_one(
    name: str,
    bench: Callable[[], dict[str, Any]],
    errors: tuple[type[BaseException], ...],
    results: dict[str, Any],
) -> bool:
    """Run benchmark ``name`` into ``results``, saying so; True if it could not run.

    One of ``errors`` makes its entry an error instead, and so does any other exception
    (a fault of the benchmark itself, its traceback said on stderr), so that the other
    benchmarks still run and the report is written; the helper processes it started are
    stopped however it ends.
    """
    say(f"{name} ...")
    start = time.monotonic()
    broken = False
    try:
        results[name] = bench()
    except errors as e:
        broken = True
        results[name] = error_result(e)
    except Exception as e:
        broken = True
        say(f"{name}: unexpected error\n{traceback.format_exc().rstrip()}")
        results[name] = error_result(e)
    finally:
        kill_all()
    say(f"{name}: {verdict(results[name])} [{time.monotonic() - start:.1f}s]")
    return broken


# --- the GPU benchmarks' and tests' choices ---------------------------------------------------


@dataclass(frozen=True)
class NvmlGpu:
    """One GPU as NVML reports it, with what choosing a GPU looks at."""

    index: int
    uuid: str
    total: int
    used: int

    @property
    def free(self) -> int:
        return self.total - self.used


def nvml_gpus() -> list[NvmlGpu]:
    """The node's GPUs as NVML reports them now (pynvml: the main venv's, not the torch one's)."""
    import pynvml

    from nodemgr.host.backend import nvml_text

    pynvml.nvmlInit()
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            uuid = nvml_text(pynvml.nvmlDeviceGetUUID(h))
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            gpus.append(NvmlGpu(i, uuid, int(mem.total), int(mem.used)))
        return gpus
    finally:
        pynvml.nvmlShutdown()


def pick_gpu(gpus: Sequence[NvmlGpu], need: int = 0) -> NvmlGpu | None:
    """The one GPU that two jobs meant to take turns are pinned to: the one with the most
    free memory, the lowest index among equals; None when none has ``need`` bytes free.

    On a node of several GPUs nodemgr grants two one-GPU tasks of two environments two
    different GPUs (most free memory first), and they never take turns. So the choice is
    made here: that GPU alone is time-sliced (``timeslice.gpus``) and each job is started
    with :func:`pinned` (``CUDA_VISIBLE_DEVICES``, which nodemgr honours as a restriction).
    """
    fit = [g for g in gpus if g.free >= need]
    return max(fit, key=lambda g: (g.free, -g.index)) if fit else None


def pinned(gpu: NvmlGpu) -> dict[str, str]:
    """The environment that restricts a gpushare-run task to ``gpu``: by UUID, which means
    the same GPU to nodemgr and to NVML whatever order CUDA would number them in."""
    return {"CUDA_VISIBLE_DEVICES": gpu.uuid}


# A job's Python is asked where it imports gpushare from, from the root directory and
# without PYTHONPATH: a `-c` run from a checkout would otherwise find the source tree.
_FIND_SPEC = (
    "import importlib.util, sys\n"
    "spec = importlib.util.find_spec(sys.argv[1])\n"
    "print(spec.origin if spec and spec.origin else '')"
)


def run_captured(
    argv: Sequence[str], env: Mapping[str, str], cwd: str | None = None
) -> subprocess.CompletedProcess[str] | None:
    """argv run to its end, five minutes at most, its output captured; None when it could
    not start or ran out of time."""
    try:
        return subprocess.run(
            argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None


def installed_origin(python: str, module: str = "gpushare.iterations") -> str | None:
    """The file ``python`` imports ``module`` from when it starts a job (gpushare's
    iteration hooks, by default), or None when that Python has no installed gpushare."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    r = run_captured([python, "-c", _FIND_SPEC, module], env, cwd="/")
    if r is None:
        return None
    origin = r.stdout.strip()
    return origin if r.returncode == 0 and origin else None


# --- the command line and the JSON document ---------------------------------------------------


def parser(
    doc: str | None, names: Iterable[str], quick: str = "fewer iterations (a smoke run)"
) -> argparse.ArgumentParser:
    """The options every script takes: --quick, --only NAME, --out FILE, --check."""
    names = list(names)
    p = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=quick)
    p.add_argument(
        "--only",
        action="append",
        choices=names,
        metavar="NAME",
        help=f"run only this benchmark (repeatable): {', '.join(names)}",
    )
    p.add_argument("--out", type=Path, help="also write the JSON document to this file")
    p.add_argument("--check", action="store_true", help="exit 1 if any target is missed")
    return p


def loadavg() -> float:
    """The 1-minute load average, as the document gives it."""
    return round(os.getloadavg()[0], 2)


def machine(versions: dict[str, Any], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The machine's description: CPUs, Python and platform, then ``versions`` (of what
    the script itself uses), nodemgr's version, then ``extra``."""
    from gpushare import __version__ as nodemgr_version  # not at the top: see the module doc

    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "cpu_model": model,
        "python": platform.python_version(),
        "platform": platform.platform(),
        **versions,
        "nodemgr": nodemgr_version,
        **(extra or {}),
    }


def run_and_report(
    args: argparse.Namespace,
    run_all: Callable[[dict[str, Any]], bool],
    describe: Callable[[], dict[str, Any]],
) -> int:
    """Run the benchmarks and report them; the exit status (130 on Ctrl-C).

    ``run_all`` fills the results it is given and says whether one could not run;
    helper processes are stopped however the run ends. The rest as :func:`report`.
    """
    stop_children_on_exit()
    load_before = loadavg()
    results: dict[str, Any] = {}
    try:
        broken = run_all(results)
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    finally:
        kill_all()
    return report(args, describe, load_before, results, broken)


def report(
    args: argparse.Namespace,
    describe: Callable[[], dict[str, Any]],
    load_before: float,
    results: dict[str, Any],
    broken: bool = False,
    extra: Mapping[str, Any] | None = None,
) -> int:
    """Print the JSON document (and write it to ``--out``); return the exit status.

    The document: ``machine`` (what ``describe`` returns, then the load averages),
    ``quick``, ``benchmarks`` (``results``) and what ``extra`` holds. The status: 2 if a
    benchmark could not run (``broken``), 1 if ``--check`` is given and a target was
    missed, else 0.
    """
    # Other work on the machine shows in the figures; the load average says how much.
    load = {"loadavg_1m_before": load_before, "loadavg_1m_after": loadavg()}
    doc = {"machine": {**describe(), **load}, "quick": args.quick, "benchmarks": results}
    doc.update(extra or {})
    text = json.dumps(doc, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
    if broken:
        return 2
    if args.check and not all(r.get("met") for r in results.values()):
        return 1
    return 0


def main(
    doc: str | None,
    benchmarks: Mapping[str, Callable[[bool], dict[str, Any]]],
    errors: tuple[type[BaseException], ...],
    describe: Callable[[], dict[str, Any]],
    argv: list[str] | None = None,
) -> int:
    """A script's whole run: parse the common options, run the benchmarks chosen (each
    called with ``--quick``'s value) and report them; the exit status."""
    args = parser(doc, benchmarks).parse_args(argv)

    def run_all(results: dict[str, Any]) -> bool:
        broken = False
        for name in args.only or benchmarks:
            bench = functools.partial(benchmarks[name], args.quick)
            broken |= run_one(name, bench, errors, results)
        return broken

    return run_and_report(args, run_all, describe)
