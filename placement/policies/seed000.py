"""Seed 000's placement, as its document gives it: latency-sensitive tasks first, spread.

- The node: the one with the most resource remaining after the task (CPU, memory and GPU
  shares left, each as a fraction of the node's, summed).
- On it, a latency-sensitive task goes to the GPU with the most room; a best-effort one
  to the GPU whose tasks have the shortest predicted run time (the sum of their
  predictions: the GPU that frees soonest), the most room among equals.
- A task that fits nowhere displaces tasks of a lower precedence: best-effort tasks, for
  a latency-sensitive one (:mod:`placement.policies.room`); the displaced are queued
  again by the caller. The two
  queues (latency-sensitive first) are the replay's (:mod:`placement.timeline`).

Predicted run times are each task's ``predicted_seconds`` where known; a task without one
counts as 0.
"""

from __future__ import annotations

import numpy as np

from placement.cluster import MILLI, ClusterState, Ints, Placement, Pod
from placement.policies.room import RoomMaker
from placement.registry import register

# Remaining fractions are scored in these steps (an integer score, ties in node order).
RESOLUTION = 10_000


class Seed000(RoomMaker):
    """Most remaining resource; LS to the roomiest GPU, BE to the soonest-free GPU."""

    def score(self, state: ClusterState, pod: Pod, nodes: Ints, rng: np.random.Generator) -> Ints:
        cpu = (state.cpu_left[nodes] - pod.cpu) / np.maximum(state.cpu_cap[nodes], 1)
        mem = (state.mem_left[nodes] - pod.memory) / np.maximum(state.mem_cap[nodes], 1)
        capacity = np.maximum(state.gpus[nodes] * MILLI, 1)
        gpu = (state.gpu_left[nodes].sum(axis=1) - pod.gpu_request) / capacity
        scores: Ints = np.trunc((cpu + mem + gpu) * RESOLUTION).astype(np.int64)
        return scores

    def shared_device(
        self, state: ClusterState, node: int, pod: Pod, rng: np.random.Generator
    ) -> int:
        left = state.gpu_left[node, : state.gpus[node]]
        fits = np.flatnonzero(left >= pod.gpu_milli)
        if pod.latency_sensitive:
            return int(fits[np.argmax(left[fits])])
        busy = np.zeros(left.size)
        for name in state.on_node[node]:
            task, where = state.placed[name]
            for g in where.gpus:
                busy[g] += task.predicted_seconds or 0.0
        # The least predicted work, then the most room, then the lowest number.
        order = np.lexsort((fits, -left[fits], busy[fits]))
        return int(fits[order[0]])

    def decide(self, state: ClusterState, pod: Pod, rng: np.random.Generator) -> Placement | None:
        where = super().decide(state, pod, rng)
        if where is None:
            where = self.displace(state, pod, rng)
        return where


register("seed000", "most remaining resource; latency-sensitive tasks displace best-effort")(
    Seed000
)
