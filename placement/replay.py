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

from placement.cluster import MILLI, ClusterState, Node, Placement, Pod
from placement.frag import Workload, fragmentation, typical_pods, workload
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
    pods: int
    placed: int
    failed_pods: int
    alloc_at: dict[int, float]
    frag_at: dict[int, float]
    seconds: float

    def wire(self) -> dict[str, object]:
        """The --json form (docs/placement.md, "Output")."""
        return {
            "policy": self.policy,
            "seed": self.seed,
            "tune": self.tune,
            "pods": self.pods,
            "placed": self.placed,
            "failed_pods": self.failed_pods,
            "alloc_at": {str(a): v for a, v in self.alloc_at.items()},
            "fragmentation": {str(a): v for a, v in self.frag_at.items()},
            "seconds": round(self.seconds, 3),
        }


def tuned(pods: Sequence[Pod], capacity: int, ratio: float, rng: np.random.Generator) -> list[Pod]:
    """The protocol's arrival order: the trace shuffled, then tuned to ``ratio`` of
    ``capacity`` milli-GPUs (steps 1 and 2 above)."""
    by_name = sorted(pods, key=lambda p: p.name)
    order = [by_name[i] for i in rng.permutation(len(by_name))]
    total = sum(p.gpu_request for p in order)
    target = ratio * capacity
    if ratio <= 0 or total == target:
        return order
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
    """Each integer arrived % up to ``reached``: the mean of its arrivals' values, or of
    the arrivals within one point when none rounds to it."""
    out = {}
    for a in range(reached + 1):
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
) -> Result:
    """Run the arrival protocol of ``pods`` on a cluster of ``nodes`` under ``policy``."""
    started = time.perf_counter()
    rng = np.random.default_rng(seed)
    capacity = sum(n.gpus for n in nodes) * MILLI
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
    arrived = allocated = placed = 0
    alloc_points: dict[int, list[float]] = defaultdict(list)
    frag_points: dict[int, list[float]] = defaultdict(list)
    for pod in arrivals:
        arrived += pod.gpu_request
        where = decide.decide(state, pod, rng)
        if where is not None:
            state.place(pod, where)
            allocated += pod.gpu_request
            placed += 1
            total_frag += _refresh(state, frag, where, target)
        bucket = round(arrived / gpus / 10)
        alloc_points[bucket].append(round(allocated / gpus / 10, 2))
        frag_points[bucket].append(total_frag / MILLI / gpus * 100)
    reached = round(arrived / gpus / 10)
    return Result(
        policy=policy,
        seed=seed,
        tune=tune,
        pods=len(arrivals),
        placed=placed,
        failed_pods=len(arrivals) - placed,
        alloc_at=_bucket_means(alloc_points, reached),
        frag_at=_bucket_means(frag_points, reached),
        seconds=time.perf_counter() - started,
    )


def _node_fragmentation(state: ClusterState, w: Workload) -> np.ndarray:
    return fragmentation(state.cpu_left, state.gpu_left, state.model, w)


def _refresh(state: ClusterState, frag: np.ndarray, where: Placement, w: Workload) -> float:
    """Re-measure the node a pod landed on; the change of the cluster's total."""
    i = where.node
    now = float(
        fragmentation(
            state.cpu_left[i : i + 1], state.gpu_left[i : i + 1], state.model[i : i + 1], w
        )[0]
    )
    change = now - float(frag[i])
    frag[i] = now
    return change
