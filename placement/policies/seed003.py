"""Seed 003's placement in a heterogeneous cluster: needs matched to resources, the
constraints between tasks, priorities, and migration to defragment.

- Heterogeneous matching: a GPU task goes to the GPU model that the tasks bound to some
  models need the least (each model's demand over its capacity, from the expected
  tasks: a task that accepts k models counts 1/k on each), so that a model some tasks
  cannot do without is kept for them; among nodes of equally sought models, the best
  fit (the least CPU and GPU left after the task). A task without GPUs: the best fit.
- Constraints (``together``, ``apart``, ``near``) are the engine's
  (:meth:`placement.cluster.ClusterState.allowed`), kept by every policy.
- A task that fits nowhere preempts tasks of a lower precedence, then migrates up to
  :data:`~placement.policies.room.MAX_MOVES` tasks (:mod:`placement.policies.room`).
- Batch-size adaptation is the replay's (:mod:`placement.adapt`), with any policy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from placement.cluster import MILLI, ClusterState, Ints, Placement, Pod
from placement.policies.baselines import BestFit
from placement.policies.room import RoomMaker
from placement.registry import register

# Demand over capacity is scored in these steps; within one step, the best fit decides.
RESOLUTION = 1000


def scarcity(state: ClusterState, expected: Sequence[Pod]) -> Ints:
    """Per GPU model (``state.models``' order): the milli-GPUs that the expected tasks
    bound to some models ask of it, over its capacity, in :data:`RESOLUTION` steps."""
    demand = np.zeros(len(state.models))
    capacity = np.zeros(len(state.models))
    np.add.at(capacity, state.model, state.gpus * MILLI)
    index = {model: i for i, model in enumerate(state.models)}
    for pod in expected:
        if not (pod.num_gpu and pod.spec):
            continue
        accepted = {index[m] for m in pod.spec if m in index}
        for m in accepted:
            demand[m] += pod.gpu_request / len(accepted)
    steps: Ints = np.trunc(demand / np.maximum(capacity, 1) * RESOLUTION).astype(np.int64)
    return steps


class Seed003(RoomMaker, BestFit):
    """The least sought GPU model, then the best fit; preemption, then migration."""

    def __init__(self) -> None:
        super().__init__()
        self._scarcity: Ints = np.zeros(0, dtype=np.int64)

    def setup(self, state: ClusterState, expected: Sequence[Pod]) -> None:
        super().setup(state, expected)
        self._scarcity = scarcity(state, expected)

    def score(self, state: ClusterState, pod: Pod, nodes: Ints, rng: np.random.Generator) -> Ints:
        fit = super().score(state, pod, nodes, rng)  # 0 to 100
        if not pod.num_gpu or self._scarcity.size != len(state.models):
            return fit
        scores: Ints = -self._scarcity[state.model[nodes]] * 101 + fit
        return scores

    def decide(self, state: ClusterState, pod: Pod, rng: np.random.Generator) -> Placement | None:
        where = super().decide(state, pod, rng)
        return where if where is not None else self.make_room(state, pod, rng)


register("seed003", "least sought GPU model, best fit; preemption, then migration")(Seed003)

__all__ = ["RESOLUTION", "Seed003", "scarcity"]
