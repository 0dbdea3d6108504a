"""Replaying a trace in time: pods arrive at their creation times, run for their run
times and leave, and wait in two queues while nothing has room for them.

docs/placement.md, "The time replay":

- A pod arrives at ``created / speedup`` (``speedup`` squeezes the trace's arrivals
  together) and runs for its run time: the trace's ``deleted - created`` (a pod that is
  never deleted runs to the end and is counted apart). With ``tune``, copies of pods
  drawn as the arrival protocol draws them (:func:`placement.replay.tuned`) arrive with
  their originals, until the GPU requests reach ``tune`` times the cluster's: the
  trace's own pods ask for less than the cluster holds, and wait for nothing. A pod that
  would fit nowhere even in the empty cluster is refused at arrival.
- A queue per priority and class: the highest priority first (seed 003), and within
  one, latency-sensitive first (seed 000), each in arrival order. Whenever pods arrive
  or leave, the queues are tried in that order; a pod whose shape found no room is not
  tried again until something changed.
- A displaced (evicted or preempted) pod keeps the work it did (its state is saved) and
  goes back to the front of its queue. A migrated pod loses :data:`MIGRATION_SECONDS`
  of progress (a checkpoint and a restore); ``migrate`` False: the policy migrates none.
- ``adapt`` (seed 003's batch-size adaptation, :mod:`placement.adapt`): a pod of whole
  GPUs that starts while no other pod waits is placed on
  :data:`~placement.adapt.ADAPT_FACTOR` times its GPUs where a node has them, and runs
  that many times its batch, its work :func:`~placement.adapt.rate` times as fast. A
  pod that then finds no room narrows adapted ones back to what they asked for, as few
  of one node's as give it room there, before anything is displaced: each keeps its
  first GPUs and loses :data:`MIGRATION_SECONDS` (a checkpoint, restarted at the smaller
  size).

Metrics: each pod's job completion time (finish - arrival) and wait (first start -
arrival), by class; the makespan (the last finish); the GPU-hours the pods held; the
runs adapted and the migrations.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Sequence

import numpy as np

import placement.policies  # noqa: F401  (registers the policies by name)
from placement.adapt import ADAPT_FACTOR, rate, widened
from placement.cluster import BE, LS, MILLI, ClusterState, Node, Placement, Pod, gpu_capacity
from placement.policies.room import RoomMaker
from placement.registry import make
from placement.replay import tuned

# Progress a migrated pod loses: a checkpoint written and read back.
MIGRATION_SECONDS = 60.0


@dataclasses.dataclass(frozen=True)
class Stats:
    """A distribution's count, mean, 99th percentile and maximum (seconds)."""

    count: int
    mean: float
    p99: float
    max: float

    @staticmethod
    def of(values: Sequence[float]) -> Stats:
        if not values:
            return Stats(0, 0.0, 0.0, 0.0)
        ordered = sorted(values)
        p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
        return Stats(len(ordered), sum(ordered) / len(ordered), p99, ordered[-1])

    def wire(self) -> dict[str, float]:
        return {
            "count": self.count,
            "mean": round(self.mean, 1),
            "p99": round(self.p99, 1),
            "max": round(self.max, 1),
        }


@dataclasses.dataclass(frozen=True)
class TimelineResult:
    policy: str
    seed: int
    speedup: float
    tune: float
    pods: int
    completed: int
    refused: int  # fit nowhere, even in the empty cluster
    unfinished: int  # still queued or running (never deleted) at the end
    jct: dict[str, Stats]  # by class, of the pods that finished
    wait: dict[str, Stats]  # by class, of the pods that started
    makespan: float
    gpu_hours: float
    evicted: int
    migrations: int
    adapted: int  # runs on ADAPT_FACTOR times the GPUs asked for, at that times the batch
    narrowed: int  # adapted runs narrowed back for a pod that found no room
    adapted_gpu_hours: float  # GPU-hours those runs held
    adapt: bool
    migrate: bool
    classes: bool
    seconds: float

    def wire(self) -> dict[str, object]:
        return {
            "policy": self.policy,
            "seed": self.seed,
            "speedup": self.speedup,
            "tune": self.tune,
            "pods": self.pods,
            "completed": self.completed,
            "refused": self.refused,
            "unfinished": self.unfinished,
            "jct": {c: s.wire() for c, s in self.jct.items()},
            "wait": {c: s.wire() for c, s in self.wait.items()},
            "makespan": round(self.makespan, 1),
            "gpu_hours": round(self.gpu_hours, 1),
            "evicted": self.evicted,
            "migrations": self.migrations,
            "adapted": self.adapted,
            "narrowed": self.narrowed,
            "adapted_gpu_hours": round(self.adapted_gpu_hours, 1),
            "adapt": self.adapt,
            "migrate": self.migrate,
            "classes": self.classes,
            "seconds": round(self.seconds, 3),
        }


@dataclasses.dataclass
class _Job:
    pod: Pod
    arrival: float
    work: float  # seconds of running, at the size asked for, still to do (inf: never deleted)
    first_start: float | None = None
    started: float = 0.0  # of the current run
    token: int = 0  # the current run's finish event
    rate: float = 1.0  # of the current run: work done per second (above 1: adapted)
    gpus: float = 0.0  # GPUs the current run holds


def run_time(pod: Pod) -> float:
    """Seconds the pod runs: its lifetime in the trace, at least one; inf if never
    deleted."""
    if pod.deleted is None:
        return math.inf
    return max(pod.deleted - pod.created, 1.0)


def replay_in_time(
    nodes: Sequence[Node],
    pods: Sequence[Pod],
    policy: str,
    seed: int = 42,
    speedup: float = 1.0,
    tune: float = 0.0,
    adapt: bool = False,
    migrate: bool = True,
    classes: bool = True,
) -> TimelineResult:
    """Replay ``pods`` in time on ``nodes`` under ``policy`` (``tune`` 0: the trace's pods
    alone); ``adapt``: with batch-size adaptation; ``migrate`` False: without
    migration; ``classes`` False: every pod latency-sensitive, as in
    :func:`placement.replay.replay`."""
    if not speedup > 0:
        raise ValueError("speedup must be above 0")
    if not classes:
        pods = [dataclasses.replace(p, qos=LS) for p in pods]
    started = time.perf_counter()
    rng = np.random.default_rng(seed)
    expected = pods
    if tune > 0:
        pods = tuned(pods, gpu_capacity(nodes), tune, rng)
    state = ClusterState(nodes, order=rng.permutation(len(nodes)))
    empty = ClusterState(nodes)
    decide = make(policy)
    if isinstance(decide, RoomMaker):
        decide.migrates = migrate
    decide.setup(state, expected)
    seq = itertools.count()
    events: list[tuple[float, int, str, str, int]] = []
    jobs: dict[str, _Job] = {}
    for pod in sorted(pods, key=lambda p: (p.created, p.name)):
        t = pod.created / speedup
        jobs[pod.name] = _Job(pod, t, run_time(pod))
        heapq.heappush(events, (t, next(seq), "arrive", pod.name, 0))
    # A queue per (priority, class), tried highest priority first, LS before BE.
    queues: dict[tuple[int, bool], deque[str]] = {}
    refused = evicted = migrations = adapted = narrowed = 0
    wide: dict[str, None] = {}  # the adapted pods running, in the order they started
    gpu_seconds = adapted_seconds = 0.0
    finish: dict[str, float] = {}
    fits_empty: dict[tuple[object, ...], bool] = {}
    now = 0.0

    def stop(name: str) -> None:
        """End the named pod's current run (it finished, was evicted or moved)."""
        nonlocal gpu_seconds, adapted_seconds
        job = jobs[name]
        ran = now - job.started
        gpu_seconds += ran * job.gpus
        if job.rate != 1.0:
            adapted_seconds += ran * job.gpus
        job.work = max(job.work - ran * job.rate, 0.0)

    def start(name: str) -> None:
        job = jobs[name]
        running = state.placed[name][0]
        job.started = now
        job.gpus = running.gpu_request / MILLI
        job.rate = rate(job.pod.num_gpu, running.num_gpu)
        if job.first_start is None:
            job.first_start = now
        job.token += 1
        if math.isfinite(job.work):
            ends = now + job.work / job.rate
            heapq.heappush(events, (ends, next(seq), "finish", name, job.token))

    def enqueue(pod: Pod, front: bool = False) -> None:
        queue = queues.setdefault((-pod.priority, not pod.latency_sensitive), deque())
        if front:
            queue.appendleft(pod.name)
        else:
            queue.append(pod.name)

    def widening(pod: Pod) -> tuple[Pod, Placement] | None:
        """The pod widened and where, where adaptation is on, nobody else waits and a
        node has room for it as it is (widening never stops another task)."""
        if not adapt or any(queues.values()):
            return None
        wider = widened(pod, ADAPT_FACTOR)
        if wider is None or not state.feasible(wider).any():
            return None
        where = decide.decide(state, wider, rng)
        if where is None or where.evict or where.moves:
            return None
        return wider, where

    def narrowing(pod: Pod) -> None:
        """Narrow adapted pods of one node back, the latest adapted first, as few as give
        ``pod`` (which fits nowhere) room there; none where no node's would."""
        nonlocal narrowed
        if not wide or not pod.num_gpu or state.feasible(pod).any():
            return
        allowed = state.allowed(pod)
        on_node: dict[int, list[str]] = {}
        for name in reversed(wide):
            on_node.setdefault(state.placed[name][1].node, []).append(name)
        for i, names in on_node.items():
            if state.cpu_left[i] < pod.cpu or state.mem_left[i] < pod.memory:
                continue
            if not state.access(pod.spec)[i] or (allowed is not None and not allowed[i]):
                continue
            left = state.gpu_left[i, : state.gpus[i]].copy()
            chosen: list[str] = []
            for name in names:
                running, where = state.placed[name]
                for g in where.gpus[jobs[name].pod.num_gpu :]:
                    left[g] += running.gpu_milli
                chosen.append(name)
                if (left >= pod.gpu_milli).sum() >= pod.num_gpu:
                    break
            else:
                continue
            for name in chosen:
                asked, where = jobs[name].pod, state.placed[name][1]
                stop(name)
                state.narrow(name, asked, where.gpus[: asked.num_gpu])
                jobs[name].work += MIGRATION_SECONDS  # at rate 1: 60 s of its time
                start(name)
                del wide[name]
                narrowed += 1
            return

    def schedule() -> None:
        nonlocal evicted, migrations, adapted
        no_room: dict[tuple[object, ...], int] = {}
        for cls in sorted(queues):
            queue = queues[cls]
            waiting = len(queue)
            for _ in range(waiting):
                name = queue.popleft()
                pod = jobs[name].pod
                key = pod.room_key
                if no_room.get(key) == state.generation:
                    queue.append(name)
                    continue
                widened_to = widening(pod)
                if widened_to is not None:
                    state.carry_out(*widened_to)
                    adapted += 1
                    wide[name] = None
                    start(name)
                    continue
                narrowing(pod)
                where = decide.decide(state, pod, rng)
                if where is None:
                    no_room[key] = state.generation
                    queue.append(name)
                    continue
                displaced = state.carry_out(pod, where)
                for gone in where.evict:
                    stop(gone)
                    wide.pop(gone, None)
                for moved, _ in where.moves:
                    stop(moved)
                    # 60 s of its time, at the rate of the run it restarts (adapted or not).
                    running = state.placed[moved][0]
                    jobs[moved].work += MIGRATION_SECONDS * rate(
                        jobs[moved].pod.num_gpu, running.num_gpu
                    )
                start(name)
                for moved, _ in where.moves:
                    start(moved)
                evicted += len(displaced)
                migrations += len(where.moves)
                for task in reversed(displaced):
                    enqueue(jobs[task.name].pod, front=True)

    while events:
        now = events[0][0]
        while events and events[0][0] == now:
            _, _, kind, name, token = heapq.heappop(events)
            job = jobs[name]
            if kind == "arrive":
                key = job.pod.room_key
                if key not in fits_empty:
                    fits_empty[key] = bool(empty.feasible(job.pod).any())
                if fits_empty[key]:
                    enqueue(job.pod)
                else:
                    refused += 1
            elif token == job.token and name in state.placed:  # a finish still current
                stop(name)
                state.remove(name)
                wide.pop(name, None)
                finish[name] = now
        schedule()
    for name in state.placed:  # never deleted: count what they held until the end
        stop(name)
    jct: dict[str, list[float]] = {LS: [], BE: []}
    wait: dict[str, list[float]] = {LS: [], BE: []}
    for name, job in jobs.items():
        if job.first_start is not None:
            wait[job.pod.service_class].append(job.first_start - job.arrival)
        if name in finish:
            jct[job.pod.service_class].append(finish[name] - job.arrival)
    return TimelineResult(
        policy=policy,
        seed=seed,
        speedup=speedup,
        tune=tune,
        pods=len(pods),
        completed=len(finish),
        refused=refused,
        unfinished=len(pods) - len(finish) - refused,
        jct={c: Stats.of(v) for c, v in jct.items()},
        wait={c: Stats.of(v) for c, v in wait.items()},
        makespan=max(finish.values(), default=0.0),
        gpu_hours=gpu_seconds / 3600,
        evicted=evicted,
        migrations=migrations,
        adapted=adapted,
        narrowed=narrowed,
        adapted_gpu_hours=adapted_seconds / 3600,
        adapt=adapt,
        migrate=migrate,
        classes=classes,
        seconds=time.perf_counter() - started,
    )
