"""What the scoring policies share: score the nodes with room, take the best (the first in
the node order among equals), then choose the devices on it.

This is the shape of a Kubernetes scheduler's filter / score / select-host / reserve
cycle, which the FGD simulator (hkust-adsl/kubernetes-scheduler-simulator) runs its
baselines in; docs/placement.md gives each policy's formulas.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from placement.cluster import MILLI, Bools, ClusterState, Ints, Placement, Pod

# The scales a node's CPU and GPU are divided by in the dot-product and best-fit scores:
# the largest node of the trace the published baselines were tuned on (128 cores, 8 GPUs).
CPU_SCALE = 128_000
GPU_SCALE = 8 * MILLI


class ScoringPolicy:
    """A policy that scores each feasible node and takes the best, the first in the
    cluster's node order (:attr:`ClusterState.rank`) among equals; subclasses give
    :meth:`score` and :meth:`devices`."""

    def setup(self, state: ClusterState, expected: Sequence[Pod]) -> None:
        """Nothing to learn by default."""

    def decide(self, state: ClusterState, pod: Pod, rng: np.random.Generator) -> Placement | None:
        return self.choose(state, pod, rng, state.feasible(pod))

    def choose(
        self, state: ClusterState, pod: Pod, rng: np.random.Generator, allowed: Bools
    ) -> Placement | None:
        """The best of the ``allowed`` nodes, which must all have room for the pod; of
        those near a group it prefers (seed 003's soft affinity), where there are any."""
        if pod.near:
            near = state.near(pod)
            if near is not None and (allowed & near).any():
                allowed = allowed & near
        nodes = np.flatnonzero(allowed)
        if nodes.size == 0:
            return None
        scores = self.score(state, pod, nodes, rng)
        best = nodes[scores == scores.max()]
        # Equal scores: the first in the cluster's node order. The published baselines
        # were measured so; a random pick among equals scatters tasks, and fills up to
        # 6 points less (docs/placement.md, "Ties").
        node = int(best[np.argmin(state.rank[best])])
        return Placement(node, self.devices(state, node, pod, rng))

    def score(self, state: ClusterState, pod: Pod, nodes: Ints, rng: np.random.Generator) -> Ints:
        """Each feasible node's score (higher is better), as integers."""
        raise NotImplementedError

    def devices(
        self, state: ClusterState, node: int, pod: Pod, rng: np.random.Generator
    ) -> tuple[int, ...]:
        """The devices of ``node`` the pod gets: the lowest-numbered idle GPUs for whole
        ones; for a shared pod, :meth:`shared_device`'s."""
        if not pod.shares_a_gpu:
            return whole_devices(state, node, pod)
        return (self.shared_device(state, node, pod, rng),)

    def shared_device(
        self, state: ClusterState, node: int, pod: Pod, rng: np.random.Generator
    ) -> int:
        """The GPU of ``node`` a pod that shares one gets: by default the tightest fit."""
        return tightest_devices(state, node, pod)[0]


def whole_devices(state: ClusterState, node: int, pod: Pod) -> tuple[int, ...]:
    """The lowest-numbered GPUs with room for the pod's share, as many as it asks."""
    fit = np.flatnonzero(state.gpu_left[node, : state.gpus[node]] >= pod.gpu_milli)
    return tuple(int(g) for g in fit[: pod.num_gpu])


def tightest_devices(state: ClusterState, node: int, pod: Pod) -> tuple[int, ...]:
    """Best fit on the node: a shared pod on the GPU with the least room that fits it
    (the lowest-numbered of equals); whole GPUs as :func:`whole_devices`."""
    if not pod.shares_a_gpu:
        return whole_devices(state, node, pod)
    left = state.gpu_left[node, : state.gpus[node]]
    room = np.where(left >= pod.gpu_milli, left, MILLI + 1)
    return (int(np.argmin(room)),)


def after_taking(left: Ints, pod: Pod) -> Ints:
    """Nodes' GPU rows after the pod takes its GPUs the way the FGD simulator's resource
    arithmetic does: each of its GPUs from the device with the least room that fits
    (the lowest-numbered of equals). ``left``: rows of free milli-GPU, one per node."""
    out = left.copy()
    if pod.num_gpu == 0:
        return out
    rows = np.arange(out.shape[0])
    for _ in range(pod.num_gpu):
        room = np.where(out >= pod.gpu_milli, out, MILLI + 1)
        g = np.argmin(room, axis=1)
        out[rows, g] -= pod.gpu_milli
    return out
