"""Fragmentation gradient descent (FGD; Weng et al., USENIX ATC'23): the node, and the GPU
on it, where the pod grows the cluster's expected fragmentation least.

A node's score is sigmoid((F before - F after) / 1000) x 100, truncated to an integer: 50
when the pod leaves its fragmentation as it was, more when it lowers it. A shared pod
tries each GPU with room and takes the best (the lowest-numbered of equals); whole GPUs
are the lowest-numbered idle ones. Ties between nodes go to the first in the node order
(:class:`placement.policies.base.ScoringPolicy`).

What it computes for a node is kept until the node changes (its version), per pod shape.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from placement.cluster import MAX_GPUS_PER_NODE, ClusterState, Ints, Pod
from placement.frag import Floats, Workload, fragmentation, typical_pods, workload
from placement.policies.base import ScoringPolicy, after_taking
from placement.registry import register

# F differences are divided by this before the sigmoid (milli-GPU: one GPU's worth).
SCALE = 1000.0
UNSCORED = -1


def fgd_score(before: Floats, after: Floats) -> Ints:
    """The integer score of moving a node's fragmentation from ``before`` to ``after``."""
    gain = (before - after) / SCALE
    return np.trunc(100.0 / (1.0 + np.exp(-gain))).astype(np.int64)


@dataclasses.dataclass
class _Scores:
    """One pod shape's scores and chosen devices per node, and the node versions they
    were computed at (-1: never)."""

    score: Ints
    device: Ints
    version: Ints


class Fgd(ScoringPolicy):
    """FGD against a target workload (typical pods, :func:`placement.frag.typical_pods`);
    :meth:`setup` gives it before it decides."""

    def __init__(self) -> None:
        self.workload: Workload | None = None
        self._typical: list[tuple[tuple[int, int, int, str], float]] = []
        self._models: tuple[str, ...] = ()
        self._frag: Floats = np.zeros(0)
        self._frag_version: Ints = np.zeros(0, dtype=np.int64)
        self._by_shape: dict[tuple[int, int, int, str], _Scores] = {}

    def setup(self, state: ClusterState, expected: Sequence[Pod]) -> None:
        """The target workload: the typical pods of ``expected``."""
        self._typical = typical_pods(expected)
        self.for_cluster(workload(self._typical, state.models), state.models)

    def for_cluster(self, w: Workload, models: tuple[str, ...]) -> None:
        """Measure fragmentation against ``w``, made for a cluster of these GPU models,
        from now on (what was kept is dropped)."""
        self.workload = w
        self._models = models
        self._frag_version = np.zeros(0, dtype=np.int64)
        self._by_shape.clear()

    def node_fragmentation(self, state: ClusterState, nodes: Ints) -> Floats:
        """F of the given nodes as they are now (of the cluster set up)."""
        w = self._need_workload()
        if self._frag_version.size != state.size:
            self._frag = np.zeros(state.size)
            self._frag_version = np.full(state.size, -1, dtype=np.int64)
        stale = nodes[self._frag_version[nodes] != state.version[nodes]]
        if stale.size:
            self._frag[stale] = fragmentation(
                state.cpu_left[stale], state.gpu_left[stale], state.model[stale], w
            )
            self._frag_version[stale] = state.version[stale]
        return self._frag[nodes]

    def score(self, state: ClusterState, pod: Pod, nodes: Ints, rng: np.random.Generator) -> Ints:
        if self.workload is not None and state.models != self._models:
            # Another cluster's GPU models: the workload's model columns are remade.
            self.for_cluster(workload(self._typical, state.models), state.models)
        kept = self._by_shape.get(pod.shape)
        if kept is None or kept.score.size != state.size:
            kept = _Scores(
                np.full(state.size, UNSCORED, dtype=np.int64),
                np.zeros(state.size, dtype=np.int64),
                np.full(state.size, -1, dtype=np.int64),
            )
            self._by_shape[pod.shape] = kept
        stale = nodes[kept.version[nodes] != state.version[nodes]]
        if stale.size:
            score, device = self._score_now(state, pod, stale)
            kept.score[stale] = score
            kept.device[stale] = device
            kept.version[stale] = state.version[stale]
        return kept.score[nodes]

    def shared_device(
        self, state: ClusterState, node: int, pod: Pod, rng: np.random.Generator
    ) -> int:
        kept = self._by_shape[pod.shape]
        assert kept.version[node] == state.version[node]
        return int(kept.device[node])

    def _score_now(self, state: ClusterState, pod: Pod, nodes: Ints) -> tuple[Ints, Ints]:
        """Scores and devices of ``nodes``, all with room for the pod."""
        w = self._need_workload()
        before = self.node_fragmentation(state, nodes)
        cpu = state.cpu_left[nodes] - pod.cpu
        left = state.gpu_left[nodes]
        if not pod.shares_a_gpu:
            after = fragmentation(cpu, after_taking(left, pod), state.model[nodes], w)
            return fgd_score(before, after), np.zeros(nodes.size, dtype=np.int64)
        # One hypothetical node per (node, GPU): the pod's share taken from that GPU.
        g = MAX_GPUS_PER_NODE
        trial = np.repeat(left[:, None, :], g, axis=1)  # [node, tried GPU, device]
        trial[:, np.arange(g), np.arange(g)] -= pod.gpu_milli
        after = fragmentation(
            np.repeat(cpu, g), trial.reshape(-1, g), np.repeat(state.model[nodes], g), w
        ).reshape(-1, g)
        scores = np.where(left >= pod.gpu_milli, fgd_score(before[:, None], after), UNSCORED)
        device = np.argmax(scores, axis=1)  # the first of the best
        return scores[np.arange(nodes.size), device], device

    def _need_workload(self) -> Workload:
        if self.workload is None:
            raise RuntimeError("FGD has no target workload: call setup() first")
        return self.workload


register("fgd", "fragmentation gradient descent (FGD, USENIX ATC'23)")(Fgd)
