"""A cluster's state and the tasks that ask for it: what every policy reads.

Units: CPU in milli-cores, memory in MiB, GPU in milli-GPUs (1000 = one whole GPU). A task
asks for ``num_gpu`` GPUs of ``gpu_milli`` each: one GPU shared (``num_gpu == 1``,
``gpu_milli < 1000``), whole GPUs (``gpu_milli == 1000``), or none. Each GPU's free share is
tracked on its own, in the node's device order.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

MILLI = 1000  # milli-GPUs in one GPU
MAX_GPUS_PER_NODE = 8  # the widest node the state holds; more is refused at load

# Quality-of-service classes (seed 000): latency-sensitive, best-effort. The trace's
# Guaranteed pods are latency-sensitive too, its Burstable ones best-effort.
LS = "LS"
BE = "BE"
LATENCY_SENSITIVE = frozenset({LS, "Guaranteed"})

Ints = npt.NDArray[np.int64]
Bools = npt.NDArray[np.bool_]


class PlacementError(ValueError):
    """A cluster or task that cannot be: the message says which and why."""


@dataclasses.dataclass(frozen=True, slots=True)
class Node:
    """One node as it is built: its name, capacity and GPU model (``""``: no GPUs)."""

    name: str
    cpu: int
    memory: int
    gpus: int
    model: str

    def __post_init__(self) -> None:
        if self.cpu < 0 or self.memory < 0:
            raise PlacementError(f"node {self.name}: negative CPU or memory")
        if not 0 <= self.gpus <= MAX_GPUS_PER_NODE:
            raise PlacementError(
                f"node {self.name}: {self.gpus} GPUs (0 to {MAX_GPUS_PER_NODE} are supported)"
            )


@dataclasses.dataclass(frozen=True, slots=True)
class Pod:
    """One task: what it asks for, which GPU models it accepts and its class.

    ``spec``: the accepted GPU models as the trace lists them (empty: any); its order and
    repeats are kept, as the shape FGD counts typical pods by keeps them.
    ``created``/``deleted``: seconds in the trace's clock (``deleted`` None: never).
    ``predicted_seconds``: its predicted run time where a prediction is known (seed 000),
    else None.
    ``priority``: a higher one may preempt tasks of a lower one (seed 003); between equal
    priorities a latency-sensitive task may displace a best-effort one (seed 000).
    ``group``: the label the placement constraints of other tasks name (seed 003), e.g.
    its job; ``together``: on a node that holds a task of each of these groups, where
    one is placed anywhere (a gang that shares a node); ``apart``: on no node that holds
    a task of these groups, which in turn keep away from it; ``near``: preferably on a
    node that holds a task of one of these groups.
    """

    name: str
    cpu: int
    memory: int
    num_gpu: int = 0
    gpu_milli: int = 0
    spec: tuple[str, ...] = ()
    qos: str = LS
    created: float = 0.0
    deleted: float | None = None
    predicted_seconds: float | None = None
    priority: int = 0
    group: str = ""
    together: tuple[str, ...] = ()
    apart: tuple[str, ...] = ()
    near: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.cpu < 0 or self.memory < 0:
            raise PlacementError(f"pod {self.name}: negative CPU or memory")
        both = sorted(set(self.together) & set(self.apart))
        if both:
            raise PlacementError(
                f"pod {self.name}: both together with and apart from group {both[0]}"
            )
        if not 0 <= self.num_gpu <= MAX_GPUS_PER_NODE:
            raise PlacementError(f"pod {self.name}: num_gpu {self.num_gpu} out of 0..8")
        if self.num_gpu == 0 and self.gpu_milli != 0:
            raise PlacementError(f"pod {self.name}: gpu_milli without a GPU")
        if self.num_gpu > 0 and not 0 < self.gpu_milli <= MILLI:
            raise PlacementError(f"pod {self.name}: gpu_milli {self.gpu_milli} out of 1..1000")
        if self.num_gpu > 1 and self.gpu_milli != MILLI:
            raise PlacementError(
                f"pod {self.name}: a share of a GPU ({self.gpu_milli} milli) is for one GPU, "
                f"not {self.num_gpu}"
            )

    @property
    def gpu_request(self) -> int:
        """Milli-GPUs asked for in all."""
        return self.num_gpu * self.gpu_milli

    @property
    def latency_sensitive(self) -> bool:
        """Of a latency-sensitive class: it may displace best-effort tasks."""
        return self.qos in LATENCY_SENSITIVE

    @property
    def service_class(self) -> str:
        """LS or BE, the class its queue and its figures go by."""
        return LS if self.latency_sensitive else BE

    @property
    def precedence(self) -> tuple[int, bool]:
        """What it may displace by: a task may displace the tasks of a lower precedence
        (a lower priority; or the same one and best-effort where it is
        latency-sensitive)."""
        return (self.priority, self.latency_sensitive)

    @property
    def constrained(self) -> bool:
        """Whether it names other tasks' groups: its room depends on where they are."""
        return bool(self.together or self.apart or self.near)

    @property
    def room_key(self) -> tuple[object, ...]:
        """What decides whether it has room in a state: tasks of the same key fit in the
        same places (the replays remember which keys found none)."""
        return (self.shape, self.memory, self.group, self.together, self.apart)

    @property
    def shares_a_gpu(self) -> bool:
        return self.num_gpu == 1 and self.gpu_milli < MILLI

    @property
    def shape(self) -> tuple[int, int, int, str]:
        """What a policy's score depends on: CPU, GPU share, GPU count, accepted models."""
        return (self.cpu, self.gpu_milli, self.num_gpu, "|".join(self.spec))

    @property
    def affinity_tag(self) -> int:
        """GPU clustering's tag: 0 for a shared GPU, k for k whole GPUs, -1 for none."""
        if self.num_gpu == 0:
            return -1
        return 0 if self.shares_a_gpu else self.num_gpu


def parse_spec(text: str) -> tuple[str, ...]:
    """``"V100M16|V100M32"`` -> its models, in order; empty parts are dropped, ``""`` is
    any model."""
    return tuple(part.strip() for part in text.split("|") if part.strip())


def gpu_capacity(nodes: Iterable[Node]) -> int:
    """Milli-GPUs in a cluster of these nodes."""
    return sum(n.gpus for n in nodes) * MILLI


@dataclasses.dataclass(frozen=True, slots=True)
class Placement:
    """A policy's decision: the node's index and the device indices of its GPUs; and the
    placed tasks it displaces: those to ``evict`` (by name: to be queued again) and those
    to ``move`` (by name, each with its new placement: a migration by checkpoint). They
    are carried out in this order: the evicted and the moved tasks leave, the task is
    placed, then the moved tasks land."""

    node: int
    gpus: tuple[int, ...]
    evict: tuple[str, ...] = ()
    moves: tuple[tuple[str, Placement], ...] = ()


# Versions come from one counter for every state, copies included: a version names one
# content of one node (or one whole state), so what a policy kept for it is never taken
# for another's.
_versions = itertools.count(1)


class ClusterState:
    """The nodes and what is left on each, as arrays a policy reads in one pass.

    ``gpu_left[i, g]``: free milli-GPU of node i's GPU g (0 where node i has fewer GPUs);
    ``version[i]`` changes each time node i changes (to a number no state has used), so
    that a policy may keep what it computed for a node until then. Only :meth:`place`
    and :meth:`remove` change it. ``placed``: each placed task by name, with its
    placement; ``on_node[i]``: the names of the tasks on node i; ``generation``: a
    number no state has used, renewed at every change (the whole state's version).
    ``be_cpu``, ``be_mem`` and ``be_gpu`` (per GPU): what best-effort tasks hold on each
    node, which a latency-sensitive task may take (seed 000).
    ``rank[i]``: node i's place in the cluster's node order, which breaks ties between
    equally good nodes (the list's order unless ``order`` gives another: a permutation
    of the node indices, ``order[i]`` being node i's rank).
    """

    def __init__(self, nodes: Sequence[Node], order: Sequence[int] | Ints | None = None) -> None:
        if not nodes:
            raise PlacementError("a cluster of no nodes")
        names = [n.name for n in nodes]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise PlacementError(f"node {dup} is listed twice")
        self.nodes = tuple(nodes)
        self.models: tuple[str, ...] = tuple(sorted({n.model for n in nodes}))
        self.model = np.array([self.models.index(n.model) for n in nodes], dtype=np.int64)
        self.cpu_cap = np.array([n.cpu for n in nodes], dtype=np.int64)
        self.mem_cap = np.array([n.memory for n in nodes], dtype=np.int64)
        self.gpus = np.array([n.gpus for n in nodes], dtype=np.int64)
        self.cpu_left = self.cpu_cap.copy()
        self.mem_left = self.mem_cap.copy()
        present = np.arange(MAX_GPUS_PER_NODE)[None, :] < self.gpus[:, None]
        self.gpu_left: Ints = np.where(present, MILLI, 0).astype(np.int64)
        # Tasks on each node by GPU clustering's tag: column 0 shared, k: k whole GPUs.
        self.tags: Ints = np.zeros((len(nodes), MAX_GPUS_PER_NODE + 1), dtype=np.int64)
        self.version: Ints = np.array([next(_versions) for _ in nodes], dtype=np.int64)
        self.placed: dict[str, tuple[Pod, Placement]] = {}
        self.be_cpu: Ints = np.zeros(len(nodes), dtype=np.int64)
        self.be_mem: Ints = np.zeros(len(nodes), dtype=np.int64)
        self.be_gpu: Ints = np.zeros_like(self.gpu_left)
        self.on_node: list[frozenset[str]] = [frozenset() for _ in nodes]
        # Per group, how many of its tasks each node holds, and how many tasks that keep
        # apart from it (seed 003's constraints). Arrays are replaced, never changed, so
        # copies share them; a group with none left is dropped.
        self.group_count: dict[str, Ints] = {}
        self.repel_count: dict[str, Ints] = {}
        self.priority_count: dict[int, int] = {}  # placed tasks by priority (seed 003)
        self.generation = next(_versions)  # renewed at every change, as versions are
        self.rank: Ints = np.arange(len(nodes), dtype=np.int64)
        if order is not None:
            rank = np.asarray(order, dtype=np.int64)
            if sorted(rank.tolist()) != list(range(len(nodes))):
                raise PlacementError("a node order must rank each node once, from 0")
            self.rank = rank
        self._access: dict[frozenset[str], Bools] = {}

    @property
    def size(self) -> int:
        return len(self.nodes)

    @property
    def gpu_capacity(self) -> int:
        """Milli-GPUs in the whole cluster."""
        return gpu_capacity(self.nodes)

    @property
    def gpu_allocated(self) -> int:
        return self.gpu_capacity - int(self.gpu_left.sum())

    def access(self, spec: Iterable[str]) -> Bools:
        """Nodes whose GPU model the spec accepts (an empty spec accepts any; a node without
        GPUs is accepted by none but the empty spec)."""
        models = frozenset(spec)
        mask = self._access.get(models)
        if mask is None:
            if not models:
                mask = np.ones(self.size, dtype=np.bool_)
            else:
                ok = np.array([m in models for m in self.models], dtype=np.bool_)
                mask = ok[self.model]
            self._access[models] = mask
        return mask

    def feasible(self, pod: Pod) -> Bools:
        """Nodes with room for the pod: CPU, memory, its GPUs of a model it accepts, and
        its constraints (:meth:`allowed`)."""
        fits = (self.cpu_left >= pod.cpu) & (self.mem_left >= pod.memory)
        if pod.num_gpu:
            enough = (self.gpu_left >= pod.gpu_milli).sum(axis=1) >= pod.num_gpu
            fits &= enough & self.access(pod.spec)
        allowed = self.allowed(pod)
        if allowed is not None:
            fits &= allowed
        return fits

    def allowed(self, pod: Pod) -> Bools | None:
        """Nodes the pod's constraints allow (None: all of them): with a task of each
        group it is ``together`` with, where that group has one placed; with none of the
        groups it keeps ``apart`` from; with no task that keeps apart from its group."""
        repelled = self.repel_count.get(pod.group) if pod.group else None
        if not (pod.together or pod.apart or repelled is not None):
            return None
        ok = self.with_partners(pod)
        for group in pod.apart:
            count = self.group_count.get(group)
            if count is not None:
                ok &= count == 0
        if repelled is not None:
            ok &= repelled == 0
        return ok

    def with_partners(self, pod: Pod) -> Bools:
        """Nodes holding a task of each group the pod must be ``together`` with, where
        that group has one placed (all nodes for a pod with none)."""
        ok = np.ones(self.size, dtype=np.bool_)
        for group in pod.together:
            count = self.group_count.get(group)
            if count is not None:
                ok &= count > 0
        return ok

    def near(self, pod: Pod) -> Bools | None:
        """Nodes holding a task of a group the pod prefers to be near (None: it names
        none, or none of theirs is placed)."""
        counts = [self.group_count[g] for g in pod.near if g in self.group_count]
        if not counts:
            return None
        mask: Bools = np.logical_or.reduce([c > 0 for c in counts])
        return mask

    def fits_on(self, node: int, pod: Pod, gpus: Sequence[int]) -> bool:
        """Whether the pod fits node ``node`` on exactly those device indices."""
        if self.cpu_left[node] < pod.cpu or self.mem_left[node] < pod.memory:
            return False
        if len(gpus) != pod.num_gpu or len(set(gpus)) != len(gpus):
            return False
        if pod.num_gpu and not self.access(pod.spec)[node]:
            return False
        allowed = self.allowed(pod)
        if allowed is not None and not allowed[node]:
            return False
        return all(
            0 <= g < self.gpus[node] and self.gpu_left[node, g] >= pod.gpu_milli for g in gpus
        )

    def place(self, pod: Pod, where: Placement) -> None:
        """Take the pod's resources on the decided node and devices (``where``'s
        evictions and moves are the caller's to carry out first)."""
        i = where.node
        if pod.name in self.placed:
            raise PlacementError(f"pod {pod.name} is placed already")
        if not self.fits_on(i, pod, where.gpus):
            raise PlacementError(
                f"pod {pod.name} does not fit node {self.nodes[i].name} on GPUs {where.gpus}"
            )
        self._take(pod, where)

    def narrow(self, name: str, pod: Pod, gpus: Sequence[int]) -> None:
        """Shrink the named placed task, in place, to ``pod`` (the same task asking for
        fewer GPUs) on ``gpus``, a subset of its devices. Its constraints were checked
        when it was placed and are not again: it does not move."""
        before, where = self.placed[name]
        if pod.name != name or not set(gpus) <= set(where.gpus) or len(gpus) != pod.num_gpu:
            raise PlacementError(f"pod {name} cannot narrow to GPUs {tuple(gpus)}")
        if (pod.cpu, pod.memory, pod.gpu_milli) != (before.cpu, before.memory, before.gpu_milli):
            raise PlacementError(f"pod {name} narrows its GPU count only")
        self.remove(name)
        self._take(pod, Placement(where.node, tuple(gpus)))

    def _take(self, pod: Pod, where: Placement) -> None:
        i = where.node
        self.cpu_left[i] -= pod.cpu
        self.mem_left[i] -= pod.memory
        for g in where.gpus:
            self.gpu_left[i, g] -= pod.gpu_milli
        if pod.num_gpu:
            self.tags[i, pod.affinity_tag] += 1
        if not pod.latency_sensitive:
            self._best_effort(i, pod, where.gpus, 1)
        self._grouped(i, pod, 1)
        self.placed[pod.name] = (pod, Placement(i, where.gpus))
        self.on_node[i] = self.on_node[i] | {pod.name}  # a new set: copies share them
        self.version[i] = self.generation = next(_versions)

    def remove(self, name: str) -> tuple[Pod, Placement]:
        """Give back what :meth:`place` took for the named pod (it ended, was displaced or
        is migrating); the pod and where it was."""
        try:
            pod, where = self.placed.pop(name)
        except KeyError:
            raise PlacementError(f"pod {name} is not placed") from None
        i = where.node
        self.cpu_left[i] += pod.cpu
        self.mem_left[i] += pod.memory
        for g in where.gpus:
            self.gpu_left[i, g] += pod.gpu_milli
        if pod.num_gpu:
            self.tags[i, pod.affinity_tag] -= 1
        if not pod.latency_sensitive:
            self._best_effort(i, pod, where.gpus, -1)
        self._grouped(i, pod, -1)
        self.on_node[i] = self.on_node[i] - {name}
        self.version[i] = self.generation = next(_versions)
        return pod, where

    def _best_effort(self, node: int, pod: Pod, gpus: Sequence[int], sign: int) -> None:
        self.be_cpu[node] += sign * pod.cpu
        self.be_mem[node] += sign * pod.memory
        for g in gpus:
            self.be_gpu[node, g] += sign * pod.gpu_milli

    def _grouped(self, node: int, pod: Pod, sign: int) -> None:
        left = self.priority_count.get(pod.priority, 0) + sign
        if left:
            self.priority_count[pod.priority] = left
        else:
            del self.priority_count[pod.priority]
        tables = [(self.group_count, pod.group)] if pod.group else []
        tables += [(self.repel_count, group) for group in pod.apart]
        for table, group in tables:
            count = table.get(group)
            count = np.zeros(self.size, dtype=np.int64) if count is None else count.copy()
            count[node] += sign
            if count.any():
                table[group] = count
            else:
                del table[group]

    def carry_out(self, pod: Pod, where: Placement) -> list[Pod]:
        """Carry out a whole decision (in :class:`Placement`'s order); the evicted pods.
        Nothing is changed when a step cannot be done."""
        if not where.evict and not where.moves:
            self.place(pod, where)
            return []
        trial = self.copy()
        evicted = [trial.remove(name)[0] for name in where.evict]
        moved = [trial.remove(name)[0] for name, _ in where.moves]
        trial.place(pod, Placement(where.node, where.gpus))
        for task, (_, target) in zip(moved, where.moves, strict=True):
            trial.place(task, target)
        self.__dict__.update(trial.__dict__)
        return evicted

    def copy(self) -> ClusterState:
        """A state of its own with the same content (what a policy may try changes on)."""
        other = object.__new__(ClusterState)
        other.__dict__.update(self.__dict__)
        for name in (
            "cpu_left",
            "mem_left",
            "gpu_left",
            "tags",
            "version",
            "be_cpu",
            "be_mem",
            "be_gpu",
        ):
            setattr(other, name, getattr(self, name).copy())
        other.placed = dict(self.placed)
        other.on_node = list(self.on_node)  # each set is replaced, never changed
        other.group_count = dict(self.group_count)  # as are the counts' arrays
        other.repel_count = dict(self.repel_count)
        other.priority_count = dict(self.priority_count)
        return other

    def snapshot(self) -> dict[str, Any]:
        """The state as plain data (for reports and tests)."""
        return {
            n.name: {
                "cpu_left": int(self.cpu_left[i]),
                "memory_left": int(self.mem_left[i]),
                "gpu_left": [int(x) for x in self.gpu_left[i, : n.gpus]],
            }
            for i, n in enumerate(self.nodes)
        }
