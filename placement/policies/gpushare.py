"""gpushare's default policy: FGD, then room made for a task that fits nowhere.

1. The node and GPUs as FGD chooses them (:mod:`placement.policies.fgd`).
2. A task that fits nowhere displaces tasks of a lower precedence: best-effort tasks for
   a latency-sensitive one (seed 000), lower priorities for a higher one (seed 003): on
   the node where the least of them make room for it. They are evicted, to be queued
   again.
3. A latency-sensitive task (or one of a priority above 0) that still fits nowhere gets
   room by migration (seed 003's defragmentation by checkpoint): up to
   :data:`MAX_MOVES` tasks of one node move, each where FGD puts it once the task holds
   the node, so that the task fits there. Any other task waits instead.

The displacement and migration are :mod:`placement.policies.room`'s; docs/placement.md,
"gpushare", gives the rules and their costs.
"""

from __future__ import annotations

import numpy as np

from placement.cluster import MAX_GPUS_PER_NODE, MILLI, ClusterState, Ints, Placement, Pod
from placement.policies.fgd import Fgd
from placement.policies.room import MAX_MOVES, RoomMaker
from placement.registry import register


class Gpushare(RoomMaker, Fgd):
    """FGD (CPU-only tasks where they strand the least GPU); then displacement of tasks
    of a lower precedence; then migration of up to MAX_MOVES tasks."""

    def score(self, state: ClusterState, pod: Pod, nodes: Ints, rng: np.random.Generator) -> Ints:
        if pod.num_gpu:
            return super().score(state, pod, nodes, rng)
        # A task without GPUs: the node with the least free GPU share, whose CPU it takes
        # from the fewest GPU tasks to come; then the most CPU left.
        free_gpu = state.gpu_left[nodes].sum(axis=1)
        scores: Ints = (MAX_GPUS_PER_NODE * MILLI - free_gpu) * (1 << 32) + state.cpu_left[nodes]
        return scores

    def decide(self, state: ClusterState, pod: Pod, rng: np.random.Generator) -> Placement | None:
        where = super().decide(state, pod, rng)
        return where if where is not None else self.make_room(state, pod, rng)


register("gpushare", "FGD; lower precedence displaced, then migration")(Gpushare)

__all__ = ["MAX_MOVES", "Gpushare"]
