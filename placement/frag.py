"""GPU fragmentation as FGD measures it (Weng et al., USENIX ATC'23): the free GPU share of
a node that a task drawn from the target workload could not use.

The target workload is the cluster's typical pods: the most frequent task shapes that
together make 95% of the trace (:func:`typical_pods`). For each typical pod t, with
probability p_t, a node's free GPUs count as fragment:

- all of them, when t asks for no GPU, cannot use the node's GPU model, or does not fit
  the node (too little CPU, or too few GPUs with room for its share);
- else those GPUs whose free share is less than t's.

F(node) = sum over t of p_t times that, in milli-GPUs: the expected free share an
arriving task could not use. docs/placement.md, "Fragmentation", works an example.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

from placement.cluster import ClusterState, Ints, Pod, parse_spec

# Typical pods: the most frequent shapes, until they cover this share of all pods.
TYPICAL_SHARE = 0.95

Floats = npt.NDArray[np.float64]


@dataclasses.dataclass(frozen=True)
class Workload:
    """Typical pods as arrays: CPU, GPU share, GPU count, probability, and which of a
    cluster's GPU models each accepts (``access[t, model]``)."""

    shapes: tuple[tuple[int, int, int, str], ...]
    cpu: Ints
    milli: Ints
    count: Ints
    prob: Floats
    access: npt.NDArray[np.bool_]


def typical_pods(
    pods: Iterable[Pod], share: float = TYPICAL_SHARE
) -> list[tuple[tuple[int, int, int, str], float]]:
    """The most frequent pod shapes (CPU, GPU share, GPU count, accepted models), each
    with its probability among them, until their pods reach ``share`` of all pods.
    Equal counts are ordered by the larger shape first."""
    counts = Counter(p.shape for p in pods)
    if not counts:
        return []
    total = sum(counts.values())
    ranked = sorted(counts.items(), key=lambda kv: (kv[1], kv[0]), reverse=True)
    chosen: list[tuple[tuple[int, int, int, str], int]] = []
    covered = 0
    for shape, n in ranked:
        if covered >= share * total:
            break
        chosen.append((shape, n))
        covered += n
    return [(shape, n / covered) for shape, n in chosen]


def workload(
    typical: list[tuple[tuple[int, int, int, str], float]], models: tuple[str, ...]
) -> Workload:
    """The typical pods as arrays over a cluster's GPU models."""
    shapes = tuple(s for s, _ in typical)
    access = np.zeros((len(typical), len(models)), dtype=np.bool_)
    for t, (_, _, _, spec) in enumerate(shapes):
        accepted = parse_spec(spec)
        access[t] = [m != "" and (not accepted or m in accepted) for m in models]
    return Workload(
        shapes=shapes,
        cpu=np.array([s[0] for s in shapes], dtype=np.int64),
        milli=np.array([s[1] for s in shapes], dtype=np.int64),
        count=np.array([s[2] for s in shapes], dtype=np.int64),
        prob=np.array([p for _, p in typical], dtype=np.float64),
        access=access,
    )


def fragmentation(cpu_left: Ints, gpu_left: Ints, model: Ints, w: Workload) -> Floats:
    """F of each node given as rows: free CPU, free milli-GPU per device, GPU model index."""
    free = gpu_left.sum(axis=-1).astype(np.float64)
    if w.prob.size == 0:
        return np.zeros(free.shape, dtype=np.float64)
    # [node, typical pod, device]
    roomy = gpu_left[..., None, :] >= w.milli[:, None]
    fits = roomy.sum(axis=-1) >= w.count
    fits &= cpu_left[..., None] >= w.cpu
    fits &= w.access[:, model].T
    fits &= w.milli > 0
    small = np.where(roomy, 0, gpu_left[..., None, :]).sum(axis=-1)
    lost = np.where(fits, small, free[..., None])
    # Summed row by row (not a matrix product, whose blocking depends on the other rows):
    # a node's F is the same number whatever nodes it is computed with.
    out: Floats = (lost * w.prob).sum(axis=-1)
    return out


def cluster_fragmentation(state: ClusterState, w: Workload) -> float:
    """Fragmented milli-GPUs of the whole cluster."""
    return float(fragmentation(state.cpu_left, state.gpu_left, state.model, w).sum())
