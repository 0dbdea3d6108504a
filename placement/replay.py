"""Replaying a trace against a policy: the FGD paper's arrival protocol.

The protocol of its public simulator (hkust-adsl/kubernetes-scheduler-simulator;
docs/placement.md, "The arrival protocol"):

1. The trace's pods, ordered by name, are shuffled by the seed.
2. Workload tuning: copies of pods drawn uniformly from the whole trace (with replacement)
   are appended until the GPU requests reach ``tune`` times the cluster's GPU capacity.
   Drawing stops at the first copy whose per-GPU share would pass the target. A trace
   that asks for more is cut: pods drawn at random are removed until it fits.
3. The nodes are put in a random order, the one in which ties between equally good
   nodes are broken. Pods arrive one at a time and are never deleted. One that fits
   nowhere fails and is skipped.
4. After each arrival the allocated and arrived GPU shares of capacity are recorded. The
   table's cell at arrived a% is the mean allocated share over the arrivals whose arrived
   share rounds to a (those within one point when none does).

The seeds are the paper's (42 to 51), but the random streams are numpy's, not Go's: a
run is reproducible with its seed here, not arrival for arrival with the Go simulator.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from collections.abc import Sequence

import numpy as np

import placement.policies  # noqa: F401  (registers the policies by name)
from placement.cluster import BE, LS, MILLI, ClusterState, Node, Pod, gpu_capacity
from placement.frag import Workload, fragmentation, typical_pods, workload
from placement.policies.room import room_below
from placement.registry import make

# The arrived shares (% of GPU capacity) the published table reports.
CHECKPOINTS = (50, 80, 90, 100, 110, 120, 130)
DEFAULT_TUNE = 1.3


@dataclasses.dataclass(frozen=True)
class Result:
    """One run. ``alloc_at[a]``: allocated milli-GPU as % of capacity at arrived a% (every
    integer a reached); ``frag_at[a]``: fragmented milli-GPU (docs/placement.md,
    "Fragmentation") as % of capacity, alike."""

    policy: str
    seed: int
    tune: float
    classes: bool
    pods: int
    placed: int  # holding a place at the end
    failed_pods: int  # found no place when they arrived
    alloc_at: dict[int, float]
    frag_at: dict[int, float]
    seconds: float
    # By class (LS: latency-sensitive, BE: the rest): pods that failed, and the share of
    # the GPUs their placed pods hold at the end (%).
    failed_by_class: dict[str, int] = dataclasses.field(default_factory=dict)
    # Of those, the pods some node would have held were every task of a lower precedence
    # gone from it (placement.policies.room.room_below): failures displacement might
    # have avoided. The others found no room even so.
    failed_with_room_by_class: dict[str, int] = dataclasses.field(default_factory=dict)
    alloc_by_class: dict[str, float] = dataclasses.field(default_factory=dict)
    # Displaced best-effort pods, of them those left without a place at the end; tasks
    # migrated and the milli-GPUs they held.
    evicted: int = 0
    evicted_unplaced: int = 0
    migrations: int = 0
    migrated_milli: int = 0

    def wire(self) -> dict[str, object]:
        """The --json form (docs/placement.md, "Output")."""
        return {
            "policy": self.policy,
            "seed": self.seed,
            "tune": self.tune,
            "classes": self.classes,
            "pods": self.pods,
            "placed": self.placed,
            "failed_pods": self.failed_pods,
            "alloc_at": {str(a): v for a, v in self.alloc_at.items()},
            "fragmentation": {str(a): v for a, v in self.frag_at.items()},
            "failed_by_class": self.failed_by_class,
            "failed_with_room_by_class": self.failed_with_room_by_class,
            "alloc_by_class": self.alloc_by_class,
            "evicted": self.evicted,
            "evicted_unplaced": self.evicted_unplaced,
            "migrations": self.migrations,
            "migrated_milli": self.migrated_milli,
            "seconds": round(self.seconds, 3),
        }


def tuned(pods: Sequence[Pod], capacity: int, ratio: float, rng: np.random.Generator) -> list[Pod]:
    """The protocol's arrival order: the trace shuffled, then tuned to ``ratio`` of
    ``capacity`` milli-GPUs (steps 1 and 2 above)."""
    by_name = sorted(pods, key=lambda p: p.name)
    order = [by_name[i] for i in rng.permutation(len(by_name))]
    total = sum(p.gpu_request for p in order)
    target = ratio * capacity
    if ratio <= 0 or total == target or not any(p.gpu_milli for p in by_name):
        return order  # (a trace of no GPU requests never reaches a GPU target)
    if total < target:
        copy = 0
        while True:
            drawn = by_name[int(rng.integers(len(by_name)))]
            if total + drawn.gpu_milli > target:
                return order
            order.append(dataclasses.replace(drawn, name=f"{drawn.name}-tuned-{copy}"))
            total += drawn.gpu_request
            copy += 1
    while total > target:
        gone = order.pop(int(rng.integers(len(order))))
        total -= gone.gpu_request
    return order


def _bucket_means(points: dict[int, list[float]], reached: int) -> dict[int, float]:
    """Each integer arrived % up to one past ``reached``: the mean of its arrivals' values,
    or of the arrivals within one point when none rounds to it."""
    out = {}
    for a in range(reached + 2):
        values = points.get(a) or [v for b in (a - 1, a, a + 1) for v in points.get(b, [])]
        if values:
            out[a] = round(sum(values) / len(values), 2)
    return out


def replay(
    nodes: Sequence[Node],
    pods: Sequence[Pod],
    policy: str,
    seed: int,
    tune: float = DEFAULT_TUNE,
    classes: bool = True,
) -> Result:
    """Run the arrival protocol of ``pods`` on a cluster of ``nodes`` under ``policy``.
    Without ``classes``, every pod is latency-sensitive: none displaces another."""
    started = time.perf_counter()
    if not classes:
        pods = [dataclasses.replace(p, qos=LS) for p in pods]
    rng = np.random.default_rng(seed)
    capacity = gpu_capacity(nodes)
    arrivals = tuned(pods, capacity, tune, rng)
    # The simulator names its nodes in a seeded random order, which breaks ties.
    state = ClusterState(nodes, order=rng.permutation(len(nodes)))
    decide = make(policy)
    decide.setup(state, pods)
    # Fragmentation is measured against the trace's own typical pods, whatever the policy.
    target = workload(typical_pods(pods), state.models)
    frag = _node_fragmentation(state, target)
    total_frag = float(frag.sum())
    gpus = capacity // MILLI
    arrived = 0
    failed: dict[str, int] = {LS: 0, BE: 0}
    failed_with_room: dict[str, int] = {LS: 0, BE: 0}
    evicted = evicted_unplaced = migrations = migrated = 0
    alloc_points: dict[int, list[float]] = defaultdict(list)
    frag_points: dict[int, list[float]] = defaultdict(list)
    for pod in arrivals:
        arrived += pod.gpu_request
        queue = [pod]
        while queue:  # the arriving pod, then any it displaced, each once
            task = queue.pop(0)
            where = decide.decide(state, task, rng)
            if where is None:
                if task is pod:
                    failed[task.service_class] += 1
                    failed_with_room[task.service_class] += room_below(state, task)
                else:
                    evicted_unplaced += 1
                continue
            touched = {where.node} | {state.placed[n][1].node for n in where.evict}
            touched |= {state.placed[n][1].node for n, _ in where.moves}
            touched |= {target.node for _, target in where.moves}
            migrated += sum(state.placed[n][0].gpu_request for n, _ in where.moves)
            displaced = state.carry_out(task, where)
            evicted += len(displaced)
            migrations += len(where.moves)
            queue.extend(displaced)
            for i in touched:
                total_frag += _refresh(state, frag, i, target)
        bucket = round(arrived / gpus / 10)
        alloc_points[bucket].append(round(state.gpu_allocated / gpus / 10, 2))
        frag_points[bucket].append(total_frag / MILLI / gpus * 100)
    reached = round(arrived / gpus / 10)
    held: dict[str, int] = {LS: 0, BE: 0}
    for task, _ in state.placed.values():
        held[task.service_class] += task.gpu_request
    return Result(
        policy=policy,
        seed=seed,
        tune=tune,
        classes=classes,
        pods=len(arrivals),
        placed=len(state.placed),
        failed_pods=failed[LS] + failed[BE],
        alloc_at=_bucket_means(alloc_points, reached),
        frag_at=_bucket_means(frag_points, reached),
        seconds=time.perf_counter() - started,
        failed_by_class=failed,
        failed_with_room_by_class=failed_with_room,
        alloc_by_class={c: round(100 * v / capacity, 2) for c, v in held.items()},
        evicted=evicted,
        evicted_unplaced=evicted_unplaced,
        migrations=migrations,
        migrated_milli=migrated,
    )


def _node_fragmentation(state: ClusterState, w: Workload) -> np.ndarray:
    return fragmentation(state.cpu_left, state.gpu_left, state.model, w)


def _refresh(state: ClusterState, frag: np.ndarray, i: int, w: Workload) -> float:
    """Re-measure node i after a change; the change of the cluster's total."""
    now = float(
        fragmentation(
            state.cpu_left[i : i + 1], state.gpu_left[i : i + 1], state.model[i : i + 1], w
        )[0]
    )
    change = now - float(frag[i])
    frag[i] = now
    return change
