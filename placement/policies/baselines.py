"""The published baselines of GPU-sharing placement, as the FGD paper's simulator runs
them (docs/placement.md, "Baselines"): random, dot-product, GPU clustering, GPU packing,
best fit."""

from __future__ import annotations

import numpy as np

from placement.cluster import MILLI, ClusterState, Ints, Pod
from placement.policies.base import (
    CPU_SCALE,
    GPU_SCALE,
    ScoringPolicy,
    tightest_devices,
)
from placement.registry import register


class RandomFit(ScoringPolicy):
    """Any node with room, uniformly; a shared pod on any GPU with room, uniformly."""

    def score(self, state: ClusterState, pod: Pod, nodes: Ints, rng: np.random.Generator) -> Ints:
        scores = np.zeros(nodes.size, dtype=np.int64)
        scores[rng.integers(nodes.size)] = 1
        return scores

    def shared_device(
        self, state: ClusterState, node: int, pod: Pod, rng: np.random.Generator
    ) -> int:
        fit = np.flatnonzero(state.gpu_left[node, : state.gpus[node]] >= pod.gpu_milli)
        return int(fit[rng.integers(fit.size)])


class DotProduct(ScoringPolicy):
    """The node whose free (CPU, GPU) vector has the smallest dot product with the pod's
    request: the fullest node in the dimensions the pod uses."""

    def score(self, state: ClusterState, pod: Pod, nodes: Ints, rng: np.random.Generator) -> Ints:
        cpu = state.cpu_left[nodes] / CPU_SCALE * (pod.cpu / CPU_SCALE)
        gpu = state.gpu_left[nodes].sum(axis=1) / GPU_SCALE * (pod.gpu_request / GPU_SCALE)
        scores: Ints = np.trunc(100 * (1 - (cpu + gpu) / 2)).astype(np.int64)
        return scores


class GpuClustering(ScoringPolicy):
    """Pods of one kind together: a node running only pods of the pod's kind (a shared
    GPU, or k whole GPUs) first, then nodes that run it among others, then empty nodes;
    fuller nodes first within each."""

    def score(self, state: ClusterState, pod: Pod, nodes: Ints, rng: np.random.Generator) -> Ints:
        if pod.num_gpu == 0:
            return np.zeros(nodes.size, dtype=np.int64)
        tags = state.tags[nodes]
        mine = tags[:, pod.affinity_tag] > 0
        kinds = (tags > 0).sum(axis=1)
        level = np.select([mine & (kinds == 1), mine, kinds == 0], [75, 50, 25], 0)
        base = 25 * (GPU_SCALE - state.gpu_left[nodes].sum(axis=1)) // GPU_SCALE
        scores: Ints = (level + base).astype(np.int64)
        return scores


class GpuPacking(ScoringPolicy):
    """Fill GPUs already in use first, then idle GPUs of busy nodes, then idle nodes."""

    def score(self, state: ClusterState, pod: Pod, nodes: Ints, rng: np.random.Generator) -> Ints:
        if pod.num_gpu == 0:
            return np.zeros(nodes.size, dtype=np.int64)
        left = state.gpu_left[nodes]
        idle = (left == MILLI).sum(axis=1)
        all_idle = idle == state.gpus[nodes]
        if pod.shares_a_gpu:
            room = np.where(left >= pod.gpu_milli, left, MILLI + 1)
            tightest = room.min(axis=1)
            used_idle = (tightest == MILLI).astype(np.int64)
            tight = np.maximum(100 - (tightest * 100 // MILLI) // 10, 50)
        else:  # whole GPUs: always idle ones
            used_idle = np.full(nodes.size, pod.num_gpu, dtype=np.int64)
            tight = np.zeros(nodes.size, dtype=np.int64)
        some_idle = np.maximum(50 - used_idle, 33)
        scores = np.where(
            all_idle, np.maximum(33 - idle, idle), np.where(used_idle > 0, some_idle, tight)
        )
        out: Ints = scores.astype(np.int64)
        return out


class BestFit(ScoringPolicy):
    """The node with the least CPU and GPU left after the pod (half weight each),
    min-max normalised over the nodes with room."""

    def score(self, state: ClusterState, pod: Pod, nodes: Ints, rng: np.random.Generator) -> Ints:
        cpu = (state.cpu_left[nodes] - pod.cpu) / CPU_SCALE
        gpu = (state.gpu_left[nodes].sum(axis=1) - pod.gpu_request) / GPU_SCALE
        raw = np.trunc((1 - (0.5 * cpu + 0.5 * gpu)) * 100).astype(np.int64)
        low, high = int(raw.min()), int(raw.max())
        if high == low:
            return np.zeros(nodes.size, dtype=np.int64)
        scores: Ints = (raw - low) * 100 // (high - low)
        return scores


register("random", "any node with room, uniformly (random fit)")(RandomFit)
register("dotprod", "smallest dot product of free and requested (CPU, GPU)")(DotProduct)
register("clustering", "pods of one GPU kind together (GPU clustering)")(GpuClustering)
register("packing", "used GPUs first, then idle GPUs of busy nodes (GPU packing)")(GpuPacking)
register("bestfit", "least CPU and GPU left after the pod (best fit)")(BestFit)

__all__ = ["BestFit", "DotProduct", "GpuClustering", "GpuPacking", "RandomFit", "tightest_devices"]
