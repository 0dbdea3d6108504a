#!/usr/bin/env python3
"""Cluster placement (docs/placement.md) on the Alibaba GPU v2023 trace, against the
FGD paper's published figures.

    python benchmarks/cluster_bench.py [--quick] [--only NAME]... [--out FILE] [--check]

The trace and the published table are read from ``$GPUSHARE_TRACES``, by default the
``shared/traces`` folder beside the repository: ``alibaba-gpu-v2023/`` (the node list and
the pod lists) and ``fgd-anchor.md`` (the FGD simulator's expected allocation ratios).

- ``anchor``: each baseline (random, dotprod, clustering, packing, bestfit, fgd) on each
  trace of the table, 10 seeds (42 to 51) of the arrival protocol at tune 1.3; the mean
  and standard deviation of the allocation ratio at each arrived share of the table,
  and its difference from the published mean. Target: FGD within 0.5 points of the
  table at 100% and 130% arrived on every trace. ``--quick``: the default trace, seeds
  42 and 43, whose means are then no test of the target.
- ``speed``: one run of each policy on the 8,152-pod default trace, in one process.
  Target: under 10 s each.
- ``policies``: gpushare's policies (gpushare, seed000) against FGD on each trace, 10
  seeds at tune 1.3, class-blind (every pod latency-sensitive: none displaced) and with
  the trace's classes. Targets: class-blind gpushare at 130% arrived at least FGD's on
  every trace and above it on the default trace; with classes, no latency-sensitive pod
  failed, and none that a node would have held with every lower-precedence task gone
  (a failure displacement might have avoided).
- ``adaptation``: seed 003's batch-size adaptation and migration on the time replay
  (placement.timeline) of the default trace, gpushare's policy, 3 seeds (42 to 44), in
  two regimes: light (arrivals 1,000 times closer together, the trace as it is: nothing
  waits), adaptation off and on; contended (100,000 times closer, tuned to 1.3, so that
  pods contend), with the trace's classes each of {adaptation off, on} x {migration on,
  off}, and class-blind (every pod latency-sensitive: migration is the only way to make
  room) migration on and off. Per setting, the means over the seeds of JCT and wait by
  class (mean, p99, max), makespan, GPU-hours, runs adapted and narrowed back,
  displacements, migrations. Target: adaptation lowers the mean JCT of both classes in
  both regimes. ``--quick``: seed 42, without the class-blind runs.
- ``failures``: seed 004's failure-aware placement (placement.failures,
  placement.policies.seed004), no trace needed. In three settings (the calibrated
  failure model and one with fewer, worse error-prone GPUs, each on a 4,096-GPU pool,
  the network trained once on each, seed 0; and the fleet: the calibrated model on
  16,384 GPUs with jobs of 2,048 to 8,192, placed by the network trained on the
  calibrated pool), the network is placed, with random, the best of 10 random
  placements (chosen in hindsight on the same failure draw) and failure-blind packing,
  on 10 held-out instances (seeds 42 to 51): makespan and restarts, mean and standard
  deviation; and, as a ceiling rather than a baseline, an oracle that knows the hidden
  hazards. Targets: in each setting, the policy's mean makespan and mean restarts below
  the best of 10 random's. ``--quick``: 30 episodes, seeds 42 and 43.

The anchor's runs go to as many processes as there are usable CPUs (``$GPUSHARE_BENCH_JOBS``
sets another number). JSON on stdout and in ``--out``; progress on stderr; exit status 2
when the trace is missing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.append(str(Path(__file__).resolve().parent.parent))

from benchmarks import harness

if TYPE_CHECKING:  # placement needs numpy: imported where a benchmark runs
    from placement.cluster import Ints
    from placement.failures import Choose, Floats, Job, View

TRACES_ENV = "GPUSHARE_TRACES"
ROOT = Path(__file__).resolve().parent.parent
SEEDS = tuple(range(42, 52))
TOLERANCE = 0.5  # points of allocation ratio, FGD against the published table
SPEED_LIMIT = 10.0  # seconds per policy on the default trace
# The published table's names of the baselines, and ours.
PUBLISHED = {
    "Random": "random",
    "DotProd": "dotprod",
    "GpuClustering": "clustering",
    "GpuPacking": "packing",
    "BestFit": "bestfit",
    "FGD": "fgd",
}


def traces_dir() -> Path:
    """Where the trace and the published table are ($GPUSHARE_TRACES, else the shared
    folder beside the repository)."""
    env = os.environ.get(TRACES_ENV)
    return Path(env) if env else ROOT.parent / "shared" / "traces"


def trace_files() -> tuple[Path, Path]:
    """The node list and the folder of pod lists; BenchError when they are missing."""
    folder = traces_dir() / "alibaba-gpu-v2023"
    nodes = folder / "openb_node_list_gpu_node.csv"
    if not nodes.is_file():
        raise harness.BenchError(
            f"no trace at {folder}: set {TRACES_ENV} to the folder holding alibaba-gpu-v2023/"
        )
    return nodes, folder


def published() -> dict[str, dict[str, dict[int, float]]]:
    """fgd-anchor.md's table: trace -> our policy name -> arrived % -> allocation %."""
    path = traces_dir() / "fgd-anchor.md"
    try:
        text = path.read_text()
    except OSError as e:
        raise harness.BenchError(f"cannot read {path}: {e}") from None
    table: dict[str, dict[str, dict[int, float]]] = {}
    columns: list[int] = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[:2] == ["trace", "policy"]:
            columns = [int(re.sub(r"\D", "", c)) for c in cells[2:]]
        elif columns and len(cells) == 2 + len(columns) and cells[1] in PUBLISHED:
            row = {a: float(v) for a, v in zip(columns, cells[2:], strict=True)}
            table.setdefault(cells[0], {})[PUBLISHED[cells[1]]] = row
    if not table:
        raise harness.BenchError(f"{path} has no table of trace, policy and arrived %")
    return table


def _run(job: tuple[str, str, str, int, bool]) -> dict[str, Any]:
    """One replay in a worker process: (node file, pod file, policy, seed, classes)."""
    from placement.replay import replay
    from placement.trace import read_nodes, read_pods

    nodes, pods, policy, seed, classes = job
    return replay(
        read_nodes(Path(nodes)), read_pods(Path(pods)), policy, seed, classes=classes
    ).wire()


def _replays(jobs: list[tuple[str, str, str, int, bool]]) -> list[dict[str, Any]]:
    harness.say(f"{len(jobs)} runs in {_jobs()} processes")
    with ProcessPoolExecutor(_jobs()) as pool:
        return list(pool.map(_run, jobs))


def _jobs() -> int:
    return int(os.environ.get("GPUSHARE_BENCH_JOBS") or len(os.sched_getaffinity(0)))


def bench_anchor(quick: bool) -> dict[str, Any]:
    nodes, folder = trace_files()
    table = published()
    traces = ["default"] if quick else list(table)
    seeds = SEEDS[:2] if quick else SEEDS
    jobs = [
        (str(nodes), str(folder / f"openb_pod_list_{t}.csv"), policy, seed, True)
        for t in traces
        for policy in table[t]
        for seed in seeds
    ]
    runs = _replays(jobs)
    results: dict[str, Any] = {}
    worst = 0.0
    for (_, pods, policy, _, _), run in zip(jobs, runs, strict=True):
        trace = Path(pods).stem.removeprefix("openb_pod_list_")
        results.setdefault(trace, {}).setdefault(policy, []).append(run)
    out: dict[str, Any] = {}
    for trace, by_policy in results.items():
        for policy, policy_runs in by_policy.items():
            row: dict[str, Any] = {}
            for a, want in table[trace][policy].items():
                got = [r["alloc_at"][str(a)] for r in policy_runs]
                mean = statistics.fmean(got)
                row[str(a)] = {
                    "mean": round(mean, 2),
                    "sd": round(statistics.pstdev(got), 2),
                    "published": want,
                    "diff": round(mean - want, 2),
                }
                if policy == "fgd" and a in (100, 130):
                    worst = max(worst, abs(mean - want))
            row["failed_pods"] = statistics.fmean(r["failed_pods"] for r in policy_runs)
            row["seconds"] = round(statistics.fmean(r["seconds"] for r in policy_runs), 2)
            out.setdefault(trace, {})[policy] = row
    result = {"seeds": list(seeds), "traces": out, "fgd_worst_diff_100_130": round(worst, 2)}
    return harness.judge(result, "fgd_worst_diff_100_130", "<=", TOLERANCE)


def bench_speed(quick: bool) -> dict[str, Any]:
    from placement.registry import names
    from placement.replay import replay
    from placement.trace import read_nodes, read_pods

    nodes_file, folder = trace_files()
    nodes = read_nodes(nodes_file)
    pods = read_pods(folder / "openb_pod_list_default.csv")
    seconds: dict[str, float] = {}
    for policy in names():
        started = time.perf_counter()
        replay(nodes, pods, policy, SEEDS[0])
        seconds[policy] = round(time.perf_counter() - started, 2)
    result = {"pods": len(pods), "seconds": seconds, "slowest": max(seconds.values())}
    return harness.judge(result, "slowest", "<", SPEED_LIMIT)


def _mean(runs: list[dict[str, Any]], get: Callable[[dict[str, Any]], float]) -> float:
    return round(statistics.fmean(get(r) for r in runs), 2)


def _spread(runs: list[dict[str, Any]], get: Callable[[dict[str, Any]], float]) -> float:
    return round(statistics.pstdev([get(r) for r in runs]), 2)


def _has_classes(pods: Path) -> bool:
    """Whether a pod list gives its pods' classes (multigpu20's has no qos column: every
    pod is latency-sensitive, and its failures are no class's doing)."""
    with pods.open() as f:
        return "qos" in f.readline().strip().split(",")


def bench_policies(quick: bool) -> dict[str, Any]:
    """gpushare's policies against FGD on each trace, 10 seeds: class-blind (every pod
    latency-sensitive: none is displaced, though gpushare still migrates) and with the
    trace's classes."""
    nodes, folder = trace_files()
    traces = ["default"] if quick else list(published())
    seeds = SEEDS[:2] if quick else SEEDS
    ours = ("gpushare", "seed000")
    plan = [("fgd", False)] + [(p, c) for p in ours for c in (False, True)]
    jobs = [
        (str(nodes), str(folder / f"openb_pod_list_{t}.csv"), policy, seed, classes)
        for t in traces
        for policy, classes in plan
        for seed in seeds
    ]
    runs = _replays(jobs)
    grouped: dict[tuple[str, str, bool], list[dict[str, Any]]] = {}
    for (_, pods, policy, _, classes), run in zip(jobs, runs, strict=True):
        trace = Path(pods).stem.removeprefix("openb_pod_list_")
        grouped.setdefault((trace, policy, classes), []).append(run)
    out: dict[str, Any] = {}
    margins: list[float] = []
    ls_failed = ls_failed_with_room = 0
    for (trace, policy, classes), group in grouped.items():
        row = {
            "alloc_130": _mean(group, lambda r: r["alloc_at"]["130"]),
            "alloc_130_sd": _spread(group, lambda r: r["alloc_at"]["130"]),
            "alloc_100": _mean(group, lambda r: r["alloc_at"]["100"]),
            "failed_pods": _mean(group, lambda r: r["failed_pods"]),
            "migrations": _mean(group, lambda r: r["migrations"]),
            "seconds": _mean(group, lambda r: r["seconds"]),
        }
        if classes:
            row.update(
                ls_failed=sum(r["failed_by_class"]["LS"] for r in group),
                ls_failed_with_room=sum(r["failed_with_room_by_class"]["LS"] for r in group),
                be_alloc=_mean(group, lambda r: r["alloc_by_class"]["BE"]),
                ls_alloc=_mean(group, lambda r: r["alloc_by_class"]["LS"]),
                evicted=_mean(group, lambda r: r["evicted"]),
                evicted_unplaced=_mean(group, lambda r: r["evicted_unplaced"]),
            )
            if policy == "gpushare" and _has_classes(folder / f"openb_pod_list_{trace}.csv"):
                ls_failed += int(row["ls_failed"])
                ls_failed_with_room += int(row["ls_failed_with_room"])
        name = policy + ("" if classes else " (class-blind)")
        out.setdefault(trace, {})[name] = row
    for rows in out.values():
        fgd = rows["fgd (class-blind)"]["alloc_130"]
        margin = round(rows["gpushare (class-blind)"]["alloc_130"] - fgd, 2)
        rows["gpushare_over_fgd_130"] = margin
        margins.append(margin)
    result = {
        "seeds": list(seeds),
        "traces": out,
        "worst_margin_over_fgd_130": min(margins),
        "default_margin_over_fgd_130": out["default"]["gpushare_over_fgd_130"],
        "ls_failed_with_classes": ls_failed,
        "ls_failed_with_room_below": ls_failed_with_room,
    }
    return harness.judge_all(
        result,
        [
            ("worst_margin_over_fgd_130", ">=", 0.0),
            ("default_margin_over_fgd_130", ">", 0.0),
            ("ls_failed_with_classes", "==", 0),
            ("ls_failed_with_room_below", "==", 0),
        ],
    )


FAILURE_RANDOMS = 10
# A fleet the size of Llama 3's (16,384 GPUs) running a few jobs of 2,048 to 8,192 GPUs:
# the regime where a job's GPUs are many enough that luck (the best of 10 random draws)
# evens out and what the history tells decides.
FLEET_GPUS = 16_384
FLEET_SIZES = (2048, 4096, 8192)


def _figures(values: list[float]) -> dict[str, float]:
    return {"mean": round(statistics.fmean(values), 2), "sd": round(statistics.pstdev(values), 2)}


def _oracle(hazard: Floats) -> Choose:
    """Not a baseline: a placement that knows each GPU's hidden hazard (the least first),
    to show how much any placement from the GPUs' history could gain."""
    import numpy as np

    def choose(view: View, job: Job, rng: np.random.Generator) -> Ints:
        free = np.flatnonzero(view.free)
        chosen: Ints = free[np.lexsort((free, hazard[free]))[: job.gpus]]
        return chosen

    return choose


def bench_failures(quick: bool) -> dict[str, Any]:
    """Seed 004: the trained network against random, best of 10 random and packing."""
    import numpy as np

    from placement import failures
    from placement.policies import seed004

    seeds = SEEDS[:2] if quick else SEEDS
    settings = seed004.Training(episodes=30) if quick else seed004.Training()
    workload = failures.Workload()
    calibrated = failures.FailureModel()
    # (name, failure model, workload, the setting whose network it uses: its own, or
    # one trained elsewhere, placed as it is on a pool it never saw)
    settings_of = {
        "calibrated": (calibrated, workload, "calibrated"),
        "lemons": (
            failures.FailureModel(error_prone_share=0.01, error_prone_factor=100.0),
            workload,
            "lemons",
        ),
        "fleet": (
            calibrated,
            failures.Workload(gpus=FLEET_GPUS, sizes=FLEET_SIZES),
            "calibrated",
        ),
    }
    result: dict[str, Any] = {"seeds": list(seeds), "episodes": settings.episodes}
    conditions: list[tuple[str, str, float]] = []
    nets: dict[str, Any] = {}
    for name, (model, pool_workload, trained_on) in settings_of.items():

        def make(
            rng: np.random.Generator,
            model: failures.FailureModel = model,
            pool_workload: failures.Workload = pool_workload,
        ) -> Any:
            return failures.instance(model, pool_workload, rng)

        started = time.perf_counter()
        rewards: list[float] = []
        if trained_on == name:
            nets[name], rewards = seed004.train(model, make, settings)
        net = nets[trained_on]
        trained = time.perf_counter() - started
        runs: dict[str, list[tuple[float, float]]] = {
            k: [] for k in ("policy", "random", "best_of_10_random", "packing", "oracle")
        }
        for seed in seeds:
            rng = np.random.default_rng(seed)
            pool, jobs, draw = make(rng)
            best, randoms = failures.best_of_random(pool, jobs, draw, model, FAILURE_RANDOMS, rng)
            runs["best_of_10_random"].append((best.makespan_hours, best.restarts))
            runs["random"].append(
                (
                    statistics.fmean(o.makespan_hours for o in randoms),
                    statistics.fmean(o.restarts for o in randoms),
                )
            )
            for label, choose in (
                ("policy", seed004.Placer(net)),
                ("packing", failures.packing),
                ("oracle", _oracle(pool.hazard)),
            ):
                o = failures.simulate(pool, jobs, draw, choose, model, rng)
                runs[label].append((o.makespan_hours, o.restarts))
        rows = {
            label: {
                "makespan_h": _figures([m for m, _ in got]),
                "restarts": _figures([r for _, r in got]),
            }
            for label, got in runs.items()
        }
        policy, best_rows = rows["policy"], rows["best_of_10_random"]
        paired = [
            (p[0] - b[0], p[1] - b[1])
            for p, b in zip(runs["policy"], runs["best_of_10_random"], strict=True)
        ]
        wins = sum(
            p[0] < b[0] for p, b in zip(runs["policy"], runs["best_of_10_random"], strict=True)
        )
        result[name] = {
            "model": dataclasses.asdict(model),
            "placements": rows,
            "policy_minus_best": {
                "makespan_h": round(
                    policy["makespan_h"]["mean"] - best_rows["makespan_h"]["mean"], 2
                ),
                "restarts": round(policy["restarts"]["mean"] - best_rows["restarts"]["mean"], 2),
            },
            "policy_minus_best_per_seed": {
                "makespan_h": _figures([m for m, _ in paired]),
                "restarts": _figures([r for _, r in paired]),
            },
            "seeds_policy_makespan_below_best": wins,
            "train_seconds": round(trained, 1),
            "trained_on": trained_on,
            "train_reward_first_last_quarter": [
                round(statistics.fmean(rewards[: len(rewards) // 4]), 4),
                round(statistics.fmean(rewards[-(len(rewards) // 4) :]), 4),
            ]
            if rewards
            else None,
            "workload": dataclasses.asdict(pool_workload),
        }
        conditions += [
            (f"{name}.policy_minus_best.makespan_h", "<", 0.0),
            (f"{name}.policy_minus_best.restarts", "<", 0.0),
        ]
        harness.say(f"failures, {name}: {json.dumps(result[name]['policy_minus_best'])}")
    result["workload"] = dataclasses.asdict(workload)
    return harness.judge_all(result, conditions)


# Seed 003's time replay, in two regimes: "light", the trace as it is with arrivals 1,000
# times closer together (nothing waits); "contended", 100,000 times closer and tuned to
# 1.3 times the cluster's GPUs, so that pods contend for room.
ADAPT_REGIMES = {"light": (1_000.0, 0.0), "contended": (100_000.0, 1.3)}
ADAPT_SEEDS = SEEDS[:3]

_TimelineJob = tuple[str, str, int, float, float, bool, bool, bool]


def _timeline(job: _TimelineJob) -> dict[str, Any]:
    """One time replay in a worker process: (node file, pod file, seed, speedup, tune,
    adapt, migrate, classes), gpushare's policy."""
    from placement.timeline import replay_in_time
    from placement.trace import read_nodes, read_pods

    nodes, pods, seed, speedup, tune, adapt, migrate, classes = job
    return replay_in_time(
        read_nodes(Path(nodes)),
        read_pods(Path(pods)),
        "gpushare",
        seed,
        speedup,
        tune,
        adapt=adapt,
        migrate=migrate,
        classes=classes,
    ).wire()


def _timeline_summary(got: list[dict[str, Any]], classes: bool) -> dict[str, Any]:
    """The means over the seeds of one setting's replays."""

    def mean(*path: str) -> float:
        values = []
        for r in got:
            value: Any = r
            for key in path:
                value = value[key]
            values.append(float(value))
        return round(statistics.fmean(values), 1)

    out: dict[str, Any] = {}
    for cls in ("LS", "BE") if classes else ("LS",):
        for what in ("jct", "wait"):
            out[f"{cls}_{what}"] = {k: mean(what, cls, k) for k in ("mean", "p99", "max")}
    for key in ("makespan", "gpu_hours", "adapted", "narrowed", "adapted_gpu_hours"):
        out[key] = mean(key)
    for key in ("evicted", "migrations", "seconds"):
        out[key] = mean(key)
    return out


def bench_adaptation(quick: bool) -> dict[str, Any]:
    """Seed 003: batch-size adaptation and migration, each against the same run without."""
    nodes, folder = trace_files()
    pods = folder / "openb_pod_list_default.csv"
    seeds = ADAPT_SEEDS[:1] if quick else ADAPT_SEEDS
    # (regime, group, adapt, migrate, classes)
    settings: list[tuple[str, str, bool, bool, bool]] = [
        ("light", "classes", a, True, True) for a in (False, True)
    ]
    settings += [("contended", "classes", a, m, True) for a in (False, True) for m in (True, False)]
    if not quick:
        settings += [("contended", "class_blind", False, m, False) for m in (True, False)]
    jobs: dict[_TimelineJob, tuple[str, str, bool, bool, bool]] = {}
    for setting in settings:
        regime, _, adapt, migrate, classes = setting
        speedup, tune = ADAPT_REGIMES[regime]
        for seed in seeds:
            job = (str(nodes), str(pods), seed, speedup, tune, adapt, migrate, classes)
            jobs[job] = setting
    with ProcessPoolExecutor(max_workers=min(_jobs(), len(jobs))) as pool:
        done = dict(zip(jobs, pool.map(_timeline, list(jobs)), strict=True))
    result: dict[str, Any] = {
        "trace": pods.name,
        "policy": "gpushare",
        "regimes": {k: {"speedup": v[0], "tune": v[1]} for k, v in ADAPT_REGIMES.items()},
        "seeds": list(seeds),
    }
    for setting in settings:
        regime, group, adapt, migrate, classes = setting
        got = [done[job] for job, s in jobs.items() if s == setting]
        name = f"{'adapt' if adapt else 'no_adapt'}_{'migrate' if migrate else 'no_migrate'}"
        result.setdefault(regime, {}).setdefault(group, {})[name] = _timeline_summary(got, classes)
    conditions: list[tuple[str, str, float]] = []
    for regime in ADAPT_REGIMES:
        runs = result[regime]["classes"]
        for cls in ("LS", "BE"):
            before = runs["no_adapt_migrate"][f"{cls}_jct"]["mean"]
            after = runs["adapt_migrate"][f"{cls}_jct"]["mean"]
            metric = f"adaptation_{regime}_{cls}_jct_mean_change_pct"
            result[metric] = round(100 * (after - before) / before, 2)
            conditions.append((metric, "<", 0.0))
    harness.say(
        "adaptation: "
        + json.dumps({k: v for k, v in result.items() if k.startswith("adaptation_")})
    )
    return harness.judge_all(result, conditions)


BENCHMARKS = {
    "anchor": bench_anchor,
    "speed": bench_speed,
    "policies": bench_policies,
    "failures": bench_failures,
    "adaptation": bench_adaptation,
}


def describe() -> dict[str, Any]:
    import numpy

    return harness.machine({"numpy": numpy.__version__}, {"traces": str(traces_dir())})


def main(argv: list[str] | None = None) -> int:
    import placement.policies  # noqa: F401  (registers the policies)

    return harness.main(__doc__, BENCHMARKS, (harness.BenchError,), describe, argv)


if __name__ == "__main__":
    sys.exit(main())
