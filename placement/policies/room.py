"""Making room for a task that fits nowhere: tasks of a lower precedence displaced for it
(best-effort work for a latency-sensitive task, seed 000; lower priorities for a higher
one, seed 003's preemption), and tasks migrated by checkpoint to defragment (seed 003).
docs/placement.md, "Making room", gives the rules.

:class:`RoomMaker` adds both to a scoring policy, whose :meth:`choose` decides where
the task and the tasks that move go.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np

from placement.cluster import MAX_GPUS_PER_NODE, MILLI, Bools, ClusterState, Ints, Placement, Pod
from placement.policies.base import ScoringPolicy

# Tasks one placement may migrate; the nodes it looks at (those with the least GPU share
# in the way) and tries moving tasks from.
MAX_MOVES = 4
MAX_LOOKED_AT = 16
MAX_TRIED_NODES = 8
# The nodes a displacement looks at (best-effort work is evicted, never moved: no cost
# but the eviction, so more are weighed).
MAX_DISPLACE_LOOKED_AT = 128


def _covering(sizes: list[tuple[int, str]], need: int) -> list[str] | None:
    """Names whose sizes sum to at least ``need``, few and small: the smallest one that
    covers it alone, else the largest first, then any left out that is not needed."""
    alone = [(size, name) for size, name in sizes if size >= need]
    if alone:
        return [min(alone)[1]]
    chosen, freed = [], 0
    for size, name in sorted(sizes, reverse=True):
        if freed >= need:
            break
        chosen.append((size, name))
        freed += size
    if freed < need:
        return None
    for size, name in sorted(chosen):  # the smallest first: is it needed after all?
        if freed - size >= need:
            chosen.remove((size, name))
            freed -= size
    return [name for _, name in chosen]


def clearing(
    state: ClusterState, node: int, pod: Pod, movable: Callable[[Pod], bool]
) -> list[str] | None:
    """Movable tasks on ``node`` whose leaving makes room there for ``pod`` (its GPUs,
    then CPU and memory), with little GPU share among them; None when no such set exists.

    Per GPU, the fewest milli-GPUs of movable tasks that leave it room for the pod's share
    (:func:`_covering`); the GPUs that need the least, as many as the pod asks for. Then,
    for CPU and memory, the other movable tasks with the least GPU share first (CPU-only
    ones), the largest CPU first."""
    if pod.num_gpu and not state.access(pod.spec)[node]:
        return None
    tasks = [state.placed[name][0] for name in sorted(state.on_node[node])]
    # The tasks that keep the pod off the node by a constraint go first, or nothing does.
    blocking = [task for task in tasks if _blocks(pod, task)]
    if not all(movable(task) for task in blocking):
        return None
    gone: list[str] = [task.name for task in blocking]
    freed = np.zeros(MAX_GPUS_PER_NODE, dtype=np.int64)
    for task in blocking:
        for g in state.placed[task.name][1].gpus:
            freed[g] += task.gpu_milli
    if pod.num_gpu:
        on_gpu: dict[int, list[tuple[int, str]]] = {}
        for task in tasks:
            if movable(task) and task.name not in gone:
                for g in state.placed[task.name][1].gpus:
                    on_gpu.setdefault(g, []).append((task.gpu_milli, task.name))
        options: list[tuple[int, int, list[str]]] = []
        for g in range(int(state.gpus[node])):
            need = pod.gpu_milli - int(state.gpu_left[node, g] + freed[g])
            names = [] if need <= 0 else _covering(on_gpu.get(g, []), need)
            if names is not None:
                milli = sum(state.placed[n][0].gpu_request for n in names)
                options.append((milli, g, names))
        if len(options) < pod.num_gpu:
            return None
        options.sort(key=lambda o: (o[0], o[1]))
        for _, _, names in options[: pod.num_gpu]:
            gone.extend(n for n in names if n not in gone)
    cpu = int(state.cpu_left[node]) + sum(state.placed[n][0].cpu for n in gone)
    mem = int(state.mem_left[node]) + sum(state.placed[n][0].memory for n in gone)
    rest = sorted(
        (t for t in tasks if t.name not in gone and movable(t)),
        key=lambda t: (t.gpu_request, -t.cpu, t.name),
    )
    for task in rest:
        if cpu >= pod.cpu and mem >= pod.memory:
            break
        gone.append(task.name)
        cpu += task.cpu
        mem += task.memory
    if cpu < pod.cpu or mem < pod.memory:
        return None
    return gone


def displaceable(pod: Pod) -> Callable[[Pod], bool]:
    """Which tasks ``pod`` may displace: those of a lower precedence, but for those of
    the groups it must be together with (evicting them would let it go anywhere)."""
    return lambda task: task.precedence < pod.precedence and task.group not in pod.together


def _blocks(pod: Pod, task: Pod) -> bool:
    """Whether ``task`` keeps ``pod`` off its node: one of them keeps apart from the
    other's group."""
    return bool(task.group and task.group in pod.apart) or bool(
        pod.group and pod.group in task.apart
    )


def lifted(state: ClusterState, pod: Pod, movable: Callable[[Pod], bool]) -> Bools | None:
    """Nodes whose constraints would allow ``pod`` once the ``movable`` tasks on them were
    gone (None: it has none): with a task of each group it must be together with, and
    with no task that blocks it (:func:`_blocks`) that may not go."""
    repelled = bool(pod.group) and pod.group in state.repel_count
    if not (pod.together or pod.apart or repelled):
        return None
    ok = state.with_partners(pod)
    if pod.apart or repelled:
        for task, where in state.placed.values():
            if _blocks(pod, task) and not movable(task):
                ok[where.node] = False
    return ok


def held_below(state: ClusterState, pod: Pod) -> tuple[Ints, Ints, Ints] | None:
    """The CPU, memory and per-GPU share (as :class:`ClusterState`'s arrays) that the
    tasks ``pod`` may displace (:func:`displaceable`) hold on each node; None when
    none is of a lower precedence."""
    levels = state.priority_count
    if not levels or pod.precedence <= (min(levels), False):
        return None
    if len(levels) == 1 and pod.priority in levels and not pod.together:
        # One priority, the pod's: what best-effort tasks hold, which the state keeps.
        return state.be_cpu, state.be_mem, state.be_gpu
    below = displaceable(pod)
    cpu = np.zeros_like(state.cpu_left)
    mem = np.zeros_like(state.mem_left)
    gpu = np.zeros_like(state.gpu_left)
    for task, where in state.placed.values():
        if below(task):
            cpu[where.node] += task.cpu
            mem[where.node] += task.memory
            for g in where.gpus:
                gpu[where.node, g] += task.gpu_milli
    return cpu, mem, gpu


def room_below(state: ClusterState, pod: Pod) -> bool:
    """Whether some node would hold ``pod`` were every task of a lower precedence gone
    from it (an upper bound on what displacement can do: a task that fits nowhere and
    has no such node cannot be given room by displacing anyone)."""
    held = held_below(state, pod)
    if held is None:
        return False
    fits = (state.cpu_left + held[0] >= pod.cpu) & (state.mem_left + held[1] >= pod.memory)
    if pod.num_gpu:
        room = state.gpu_left + held[2]
        fits &= ((room >= pod.gpu_milli).sum(axis=1) >= pod.num_gpu) & state.access(pod.spec)
    allowed = lifted(state, pod, displaceable(pod))
    if allowed is not None:
        fits &= allowed
    return bool(fits.any())


def unbound(task: Pod) -> bool:
    """Movable by migration: a task that no constraint ties to where it is (it is in no
    group and names none: moving a gang's task would break the gang)."""
    return not (task.group or task.constrained)


class RoomMaker(ScoringPolicy):
    """Displacement and migration for a scoring policy: :meth:`displace` and
    :meth:`migrate` (None when they find no room). Migration remembers the task shapes it
    found no room for in a state, until the state changes. ``migrates`` False: no
    migration (displacement only)."""

    def __init__(self) -> None:
        super().__init__()
        self.migrates = True
        self._no_room: dict[tuple[object, ...], int] = {}

    def setup(self, state: ClusterState, expected: Sequence[Pod]) -> None:
        self._no_room.clear()
        super().setup(state, expected)

    def make_room(
        self, state: ClusterState, pod: Pod, rng: np.random.Generator
    ) -> Placement | None:
        """Displacement of tasks of a lower precedence; then, for a latency-sensitive
        task or one of a priority above the default, migration. Any other task waits
        instead (a migration costs the moved tasks a checkpoint)."""
        where = self.displace(state, pod, rng)
        if where is None and self.migrates and (pod.latency_sensitive or pod.priority > 0):
            key = pod.room_key
            if self._no_room.get(key) == state.generation:
                return None
            where = self.migrate(state, pod, rng)
            if where is None:
                self._no_room[key] = state.generation
        return where

    def _candidates(
        self, state: ClusterState, pod: Pod, held: tuple[Ints, Ints, Ints] | None
    ) -> Iterable[int]:
        """Nodes that could hold the pod once their tasks leave (only those holding
        ``held``, where given: what the tasks it may displace hold), the least GPU share
        in its way first (a lower bound: on its GPUs with the most room), then in node
        order; at most MAX_LOOKED_AT (MAX_DISPLACE_LOOKED_AT with ``held``)."""
        cpu, mem, room = state.cpu_cap, state.mem_cap, np.full_like(state.gpu_left, MILLI)
        if held is not None:
            cpu, mem = state.cpu_left + held[0], state.mem_left + held[1]
            room = state.gpu_left + held[2]
        big = (cpu >= pod.cpu) & (mem >= pod.memory)
        if pod.num_gpu:
            enough = (room >= pod.gpu_milli).sum(axis=1) >= pod.num_gpu
            big &= enough & (state.gpus >= pod.num_gpu) & state.access(pod.spec)
        allowed = lifted(state, pod, displaceable(pod) if held is not None else unbound)
        if allowed is not None:
            big &= allowed
        nodes = np.flatnonzero(big)
        if nodes.size == 0:
            return ()
        in_way = np.zeros(nodes.size, dtype=np.int64)
        if pod.num_gpu:
            need = np.maximum(pod.gpu_milli - state.gpu_left[nodes], 0)
            usable = room[nodes] >= pod.gpu_milli
            need = np.where(usable, need, MAX_GPUS_PER_NODE * MILLI)
            in_way = np.sort(need, axis=1)[:, : pod.num_gpu].sum(axis=1)
        limit = MAX_DISPLACE_LOOKED_AT if held is not None else MAX_LOOKED_AT
        order = np.lexsort((state.rank[nodes], in_way))[:limit]
        return (int(i) for i in nodes[order])

    def _cheapest(
        self,
        state: ClusterState,
        pod: Pod,
        movable: Callable[[Pod], bool],
        held: tuple[Ints, Ints, Ints] | None,
        limit: int,
    ) -> list[tuple[int, int, list[str]]]:
        """(GPU milli moved, node, tasks) of the nodes where moving ``movable`` tasks
        makes room, at most ``limit`` tasks each, the cheapest first; for a displacement
        (``held`` given), the lowest precedence among the highest stopped first, as
        Kubernetes' preemption weighs its victims."""
        found = []
        for node in self._candidates(state, pod, held):
            names = clearing(state, node, pod, movable)
            if names is None or len(names) > limit:
                continue
            tasks = [state.placed[n][0] for n in names]
            # Migration kills nothing: only a displacement weighs whom it stops.
            top = max((t.precedence for t in tasks), default=(0, False)) if held else (0, False)
            cost = sum(t.gpu_request for t in tasks)
            found.append((top, cost, len(names), int(state.rank[node]), node, names))
        found.sort()
        return [(cost, node, names) for _, cost, _, _, node, names in found]

    def _on(
        self, state: ClusterState, node: int, pod: Pod, rng: np.random.Generator
    ) -> Placement | None:
        """The pod on ``node``, devices as FGD chooses them; None if it does not fit."""
        allowed = np.zeros(state.size, dtype=np.bool_)
        allowed[node] = bool(state.feasible(pod)[node])
        return self.choose(state, pod, rng, allowed)

    def displace(self, state: ClusterState, pod: Pod, rng: np.random.Generator) -> Placement | None:
        held = held_below(state, pod)
        if held is None:
            return None
        found = self._cheapest(state, pod, displaceable(pod), held, limit=len(state.placed))
        for _, node, names in found:
            trial = state.copy()
            for name in names:
                trial.remove(name)
            where = self._on(trial, node, pod, rng)
            if where is not None:
                return Placement(node, where.gpus, evict=tuple(names))
        return None

    def migrate(self, state: ClusterState, pod: Pod, rng: np.random.Generator) -> Placement | None:
        tried = 0
        somewhere: dict[tuple[object, ...], bool] = {}

        def has_room(task: Pod) -> bool:
            key = task.room_key
            if key not in somewhere:
                somewhere[key] = bool(state.feasible(task).any())
            return somewhere[key]

        for _, node, names in self._cheapest(state, pod, unbound, None, limit=MAX_MOVES):
            if tried == MAX_TRIED_NODES:
                break
            # A task with no room anywhere now rarely finds some once the pod is in (the
            # room the others leave is mostly the pod's): most tries end here, before any
            # copy, losing few chances.
            if not all(has_room(state.placed[n][0]) for n in names):
                continue
            tried += 1
            trial = state.copy()
            leaving = [trial.remove(name)[0] for name in names]
            where = self._on(trial, node, pod, rng)
            if where is None:
                continue
            trial.place(pod, where)
            moves = []
            for task in leaving:  # anywhere FGD puts it, the same node's other GPUs too
                target = self.choose(trial, task, rng, trial.feasible(task))
                if target is None:
                    break
                trial.place(task, target)
                before = state.placed[task.name][1]
                if (target.node, target.gpus) != (before.node, before.gpus):
                    moves.append((task.name, target))  # one that lands back stays
            else:
                return Placement(node, where.gpus, moves=tuple(moves))
        return None
