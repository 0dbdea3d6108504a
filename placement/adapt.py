"""Batch-size adaptation (seed 003): a job that lands on k times the GPUs it asked for
runs k times its batch, and so its work in about 1/k of the time.

Data-parallel training keeps the per-GPU batch: on k times the GPUs the global batch is
k times larger (seed 003's example: a batch of 6,000 on 2 GPUs becomes 12,000 on 4), and
a step takes about as long as before, so the job goes through its samples about k times
as fast, less what the extra communication costs. :data:`SCALING_EFFICIENCY` is that
loss: Horovod's paper (Sergeev and Del Balso, 2018) measured about 90% of linear scaling
for Inception V3 and ResNet-101 over 128 GPUs. docs/placement.md, "Batch-size
adaptation", gives the rules; the time replay (:mod:`placement.timeline`) uses them.
"""

from __future__ import annotations

import dataclasses

from placement.cluster import MAX_GPUS_PER_NODE, MILLI, PlacementError, Pod

ADAPT_FACTOR = 2  # a job adapted runs on this many times the GPUs it asked for
SCALING_EFFICIENCY = 0.9  # throughput on k times the GPUs: k * this, of the asked size's


def widened(pod: Pod, factor: int = ADAPT_FACTOR) -> Pod | None:
    """The pod asking ``factor`` times its GPUs, or None where it cannot: it takes no
    whole GPUs (a share of one is a service's, not a data-parallel job's), or the wider
    ask exceeds a node."""
    if factor < 1:
        raise PlacementError(f"an adaptation factor of {factor}")
    if pod.num_gpu == 0 or pod.gpu_milli != MILLI or pod.num_gpu * factor > MAX_GPUS_PER_NODE:
        return None
    return dataclasses.replace(pod, num_gpu=pod.num_gpu * factor)


def scaled_batch(batch: int, asked: int, got: int) -> int:
    """The batch a job that asked for ``asked`` GPUs with ``batch`` runs on ``got``:
    the same per-GPU batch."""
    if asked <= 0 or got <= 0 or got % asked:
        raise PlacementError(f"a job of {asked} GPUs adapted to {got}: a whole multiple is needed")
    return batch * (got // asked)


def rate(asked: int, got: int, efficiency: float = SCALING_EFFICIENCY) -> float:
    """How fast a job that asked for ``asked`` GPUs goes through its work on ``got``:
    1 on what it asked for, ``got / asked * efficiency`` on more."""
    if got == asked:
        return 1.0
    return got / asked * efficiency
