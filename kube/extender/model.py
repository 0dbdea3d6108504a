"""Kubernetes objects as the placement engine sees them, and the extender's decisions
(pure: state in, decision out; docs/kubernetes.md, "How the extender sees a node").

A node's GPUs are *quota* GPUs: each holds ``oversubscription`` times its memory in
quotas, as its device plugin offers them. A pod's ``gpushare.io/gpu-memory`` over its
``gpushare.io/gpus`` is its per-GPU quota; as a share of one quota GPU, in milli-GPUs, it
is the engine's ``gpu_milli``. A pod of several GPUs with a share below a whole quota GPU
is several single-GPU tasks on one node (the engine's shares are of one GPU each), scored
as one of them.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from fractions import Fraction
from typing import Any

import numpy as np

import placement.policies  # noqa: F401  (registers the policies by name)
from gpushare.protocol import LS as LS_WIRE
from kube.resources import (
    GPU_MEMORY,
    GPUS,
    MODEL_ANNOTATION,
    MODEL_LABEL,
    OVERSUBSCRIPTION_LABEL,
    pod_class,
)
from placement.cluster import (
    BE,
    LS,
    MAX_GPUS_PER_NODE,
    MILLI,
    Bools,
    ClusterState,
    Ints,
    Node,
    Placement,
    PlacementError,
    Pod,
)
from placement.policies.base import ScoringPolicy
from placement.registry import make

# kube-scheduler's extender scores run from 0 to this (MaxExtenderPriority).
MAX_SCORE = 10
DEFAULT_POLICY = "gpushare"
UNKNOWN_NODE = "gpushare: node not known to the extender"
MIB = 1 << 20

_QUANTITY = re.compile(
    r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)"
    r"(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)?$"
)
_SUFFIX = {
    None: Fraction(1),
    "m": Fraction(1, 1000),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
    "Ki": Fraction(1 << 10),
    "Mi": Fraction(1 << 20),
    "Gi": Fraction(1 << 30),
    "Ti": Fraction(1 << 40),
    "Pi": Fraction(1 << 50),
    "Ei": Fraction(1 << 60),
}


class ModelError(ValueError):
    """An object the extender cannot read: the message names the object and field."""


def quantity(text: Any, where: str) -> Fraction:
    """A Kubernetes resource quantity (``500m``, ``16Gi``, ``1e3``, ``2``) exactly."""
    m = _QUANTITY.match(str(text).strip())
    if m is None:
        raise ModelError(f"{where}: {text!r} is not a resource quantity")
    return Fraction(m.group(1)) * _SUFFIX[m.group(2)]


@dataclasses.dataclass(frozen=True)
class NodeInfo:
    """A node as the extender places on it."""

    name: str
    cpu: int  # milli-cores allocatable
    memory: int  # MiB allocatable
    gpus: int  # real GPUs
    model: str
    gpu_memory: int  # GiB of one GPU
    factor: int  # its oversubscription

    def placement_node(self) -> Node:
        return Node(self.name, self.cpu, self.memory, self.gpus, self.model)


def node_info(obj: Mapping[str, Any], default_factor: int) -> NodeInfo:
    """A v1 Node's allocatable CPU, memory and gpushare resources, and its labels."""
    meta = obj.get("metadata") or {}
    name = str(meta.get("name") or "")
    if not name:
        raise ModelError("a node without metadata.name")
    labels = meta.get("labels") or {}
    alloc = (obj.get("status") or {}).get("allocatable") or {}
    where = f"node {name}"
    factor = default_factor
    if OVERSUBSCRIPTION_LABEL in labels:
        factor = int(quantity(labels[OVERSUBSCRIPTION_LABEL], f"{where} label"))
        if factor < 1:
            raise ModelError(f"{where}: label {OVERSUBSCRIPTION_LABEL} below 1")
    slots = int(quantity(alloc.get(GPUS, 0), f"{where} {GPUS}"))
    units = int(quantity(alloc.get(GPU_MEMORY, 0), f"{where} {GPU_MEMORY}"))
    gpus = min(slots // factor, MAX_GPUS_PER_NODE)
    return NodeInfo(
        name=name,
        cpu=int(quantity(alloc.get("cpu", 0), f"{where} cpu") * 1000),
        memory=int(quantity(alloc.get("memory", 0), f"{where} memory") / MIB),
        gpus=gpus,
        model=str(labels.get(MODEL_LABEL, "")) if gpus else "",
        gpu_memory=units // slots if slots else 0,
        factor=factor,
    )


@dataclasses.dataclass(frozen=True)
class Ask:
    """What a pod asks for: its containers' requests summed (an init container's when
    larger), its class and the GPU models it accepts."""

    key: str  # namespace/name
    uid: str
    cpu: int  # milli-cores
    memory: int  # MiB
    gpus: int
    gpu_memory: int  # GiB over its GPUs
    qos: str
    models: tuple[str, ...]
    node: str  # spec.nodeName, "" while unbound

    @property
    def ident(self) -> str:
        """What tells this pod from any other, a pod of the same name made again after
        it included: its UID (its key where it has none)."""
        return self.uid or self.key

    def tasks(self, info: NodeInfo) -> list[Pod]:
        try:
            return self._tasks(info)
        except PlacementError as e:  # e.g. more GPUs than any node holds
            raise ModelError(f"pod {self.key}: {e}") from None

    def _tasks(self, info: NodeInfo) -> list[Pod]:
        """The engine's tasks for this pod on a node like ``info``: one, or for several
        GPUs of less than a whole quota GPU each, one per GPU (the first carrying the
        CPU and memory)."""
        if not self.gpus:
            return [self._task(self.ident, 0, 0, self.cpu, self.memory)]
        per_gpu = Fraction(self.gpu_memory, self.gpus)
        capacity = info.gpu_memory * info.factor
        milli = MILLI if not capacity else min(MILLI, max(1, math.ceil(per_gpu / capacity * MILLI)))
        if milli == MILLI or self.gpus == 1:
            return [self._task(self.ident, self.gpus, milli, self.cpu, self.memory)]
        first = self._task(f"{self.ident}#0", 1, milli, self.cpu, self.memory)
        rest = [self._task(f"{self.ident}#{k}", 1, milli, 0, 0) for k in range(1, self.gpus)]
        return [first, *rest]

    def _task(self, name: str, gpus: int, milli: int, cpu: int, memory: int) -> Pod:
        return Pod(name, cpu, memory, num_gpu=gpus, gpu_milli=milli, spec=self.models, qos=self.qos)


def _asked(container: Mapping[str, Any], key: str, where: str) -> Fraction:
    """A container's request of ``key`` (its limit where it has no request; 0: none)."""
    res = container.get("resources") or {}
    value = (res.get("requests") or {}).get(key, (res.get("limits") or {}).get(key))
    if value is None:
        return Fraction(0)
    return quantity(value, f"{where} container {container.get('name')} {key}")


def _containers_sum(spec: Mapping[str, Any], key: str, where: str) -> Fraction:
    """The pod's request of ``key`` as the scheduler counts it: its containers' summed,
    or an init container's where that is more."""
    total = sum((_asked(c, key, where) for c in spec.get("containers") or []), Fraction(0))
    inits = (_asked(c, key, where) for c in spec.get("initContainers") or [])
    return max(total, *inits) if spec.get("initContainers") else total


def ask(obj: Mapping[str, Any]) -> Ask:
    """A v1 Pod's ask."""
    meta = obj.get("metadata") or {}
    key = f"{meta.get('namespace') or 'default'}/{meta.get('name') or ''}"
    spec = obj.get("spec") or {}
    where = f"pod {key}"
    annotations = meta.get("annotations") or {}
    try:
        cls = pod_class(annotations)
    except ValueError as e:
        raise ModelError(f"{where}: {e}") from None
    models = tuple(
        m.strip() for m in str(annotations.get(MODEL_ANNOTATION, "")).split(",") if m.strip()
    )
    gpus = int(_containers_sum(spec, GPUS, where))
    memory = int(_containers_sum(spec, GPU_MEMORY, where))
    if bool(gpus) != bool(memory):
        raise ModelError(
            f"{where}: asks for {GPUS if gpus else GPU_MEMORY} without"
            f" {GPU_MEMORY if gpus else GPUS}; ask for both"
        )
    return Ask(
        key=key,
        uid=str(meta.get("uid") or ""),
        cpu=int(_containers_sum(spec, "cpu", where) * 1000),
        memory=math.ceil(_containers_sum(spec, "memory", where) / MIB),
        gpus=gpus,
        gpu_memory=memory,
        qos=LS if cls == LS_WIRE else BE,
        models=models,
        node=str(spec.get("nodeName") or ""),
    )


class View:
    """The cluster as the extender places on it: its nodes, the pods bound to them (held
    in the order given), the pods waiting for a node, and a placement policy over them.

    The policy learns the workload (FGD's typical pods) from the bound and the waiting
    pods together: what the cluster runs and what it is asked to run next. A waiting
    pod's tasks are taken as on the cluster's first GPU node of the most common kind."""

    def __init__(
        self,
        nodes: Sequence[NodeInfo],
        bound: Iterable[Ask] = (),
        policy: str = DEFAULT_POLICY,
        seed: int = 0,
        waiting: Iterable[Ask] = (),
    ) -> None:
        self.infos = {n.name: n for n in nodes}
        self.index = {n.name: i for i, n in enumerate(nodes)}
        self.state = ClusterState([n.placement_node() for n in nodes])
        made = make(policy)
        if not isinstance(made, ScoringPolicy):
            raise ModelError(f"policy {policy!r} scores no nodes")
        self.policy: ScoringPolicy = made
        self.rng = np.random.default_rng(seed)
        self.unplaced: list[str] = []
        self._by_group: list[Ints] | None = None
        self._group_of: Ints = np.zeros(0, dtype=np.int64)
        self.bound: dict[str, list[str]] = {}
        asks = [a for a in bound if a.node in self.infos]
        expected: list[Pod] = []
        for a in asks:
            try:
                expected += a.tasks(self.infos[a.node])
            except ModelError:
                continue  # held nowhere below either
        gpu_nodes = [n for n in nodes if n.gpus] or list(nodes)
        kinds = Counter((n.gpu_memory, n.factor) for n in gpu_nodes)
        if kinds:
            common = kinds.most_common(1)[0][0]
            typical = next(n for n in gpu_nodes if (n.gpu_memory, n.factor) == common)
            for a in waiting:
                try:
                    expected += a.tasks(typical)
                except ModelError:
                    continue
        self.policy.setup(self.state, expected)
        for a in asks:
            try:
                held = self.place(a, a.node)
            except ModelError:
                held = False
            if not held:
                self.unplaced.append(a.key)

    def place(self, a: Ask, node: str) -> bool:
        """Hold ``a``'s tasks on ``node``, devices as the policy chooses them there; False
        (nothing held) when they do not fit."""
        if a.ident in self.bound:
            return self.bound_node(a.ident) == node
        i = self.index[node]
        trial = self.state.copy()
        made: list[tuple[Pod, Placement]] = []
        for task in a.tasks(self.infos[node]):
            allowed = np.zeros(trial.size, dtype=np.bool_)
            allowed[i] = bool(trial.feasible(task)[i])
            where = self.policy.choose(trial, task, self.rng, allowed)
            if where is None:
                return False
            trial.place(task, where)
            made.append((task, where))
        for task, where in made:
            self.state.place(task, where)
        self.bound[a.ident] = [t.name for t, _ in made]
        return True

    def bound_node(self, ident: str) -> str | None:
        """Where the pod of this :attr:`Ask.ident` is held; None: nowhere."""
        names = self.bound.get(ident)
        if not names:
            return None
        return self.state.nodes[self.state.placed[names[0]][1].node].name

    def release(self, ident: str) -> None:
        for name in self.bound.pop(ident, []):
            self.state.remove(name)

    def _groups(self) -> list[Ints]:
        """Nodes by what a pod's tasks depend on (a quota GPU's size; GPUs or none),
        as index arrays; ``self._group_of[i]``: node i's group."""
        if self._by_group is None:
            keys: dict[tuple[int, int, bool], list[int]] = {}
            for i, node in enumerate(self.state.nodes):
                n = self.infos[node.name]
                keys.setdefault((n.gpu_memory, n.factor, n.gpus > 0), []).append(i)
            self._by_group = [np.array(v, dtype=np.int64) for v in keys.values()]
            self._group_of = np.zeros(self.state.size, dtype=np.int64)
            for g, members in enumerate(self._by_group):
                self._group_of[members] = g
        return self._by_group

    def _fits(self, a: Ask) -> tuple[Bools, list[tuple[Pod, int]]]:
        """Where ``a``'s tasks fit, over every node; per group, its first task and how
        many there are (what scoring and the reasons need)."""
        fits = np.zeros(self.state.size, dtype=np.bool_)
        first: list[tuple[Pod, int]] = []
        for members in self._groups():
            tasks = a.tasks(self.infos[self.state.nodes[int(members[0])].name])
            task = tasks[0]
            ok = self.state.feasible(task)[members]
            if len(tasks) > 1:
                # Every share on the node at once: whole shares left over its GPUs.
                shares = (self.state.gpu_left[members] // task.gpu_milli).sum(axis=1)
                ok &= shares >= len(tasks)
            fits[members] = ok
            first.append((task, len(tasks)))
        return fits, first

    def _indices(self, names: Sequence[str]) -> Ints:
        """The node indices of ``names``; -1 for a name not known."""
        return np.fromiter((self.index.get(n, -1) for n in names), np.int64, len(names))

    def filter(self, a: Ask, names: Sequence[str]) -> tuple[list[str], dict[str, str]]:
        """Of ``names``, those where ``a``'s tasks fit; the others with why."""
        idx = self._indices(names)
        fits, first = self._fits(a)
        known = idx >= 0
        ok = np.zeros(len(names), dtype=np.bool_)
        ok[known] = fits[idx[known]]
        passed = [n for n, good in zip(names, ok.tolist(), strict=True) if good]
        failed = {}
        for n, i, good in zip(names, idx.tolist(), ok.tolist(), strict=True):
            if not good:
                failed[n] = UNKNOWN_NODE if i < 0 else self._why(i, first)
        return passed, failed

    def _why(self, i: int, first: list[tuple[Pod, int]]) -> str:
        task, count = first[int(self._group_of[i])]
        state = self.state
        if state.cpu_left[i] < task.cpu:
            return "gpushare: too little CPU"
        if state.mem_left[i] < task.memory:
            return "gpushare: too little memory"
        if task.num_gpu and not state.access(task.spec)[i]:
            return "gpushare: GPU model not accepted"
        if task.num_gpu:
            shares = count if count > 1 else task.num_gpu
            return f"gpushare: no room for {shares} GPU quota share(s) of {task.gpu_milli} milli"
        return "gpushare: constraints"

    def score(self, a: Ask, names: Sequence[str]) -> dict[str, int]:
        """The policy's scores of those of ``names`` where ``a`` fits, scaled linearly to
        0..MAX_SCORE and rounded down (the policy's best nodes, and only they,
        MAX_SCORE); the others are left out."""
        idx = self._indices(names)
        fits, first = self._fits(a)
        raw = np.full(len(names), -1, dtype=np.int64)
        scored = np.zeros(len(names), dtype=np.bool_)
        groups = self._groups()
        known = np.flatnonzero(idx >= 0)
        known = known[fits[idx[known]]]
        by_group = self._group_of[idx[known]]
        for g in range(len(groups)):
            mine = known[by_group == g]
            if mine.size:
                task, _ = first[g]
                raw[mine] = self.policy.score(self.state, task, idx[mine], self.rng)
                scored[mine] = True
        if not scored.any():
            return {}
        lo, hi = raw[scored].min(), raw[scored].max()
        if hi == lo:
            scaled = np.full(len(names), MAX_SCORE, dtype=np.int64)
        else:
            # Rounded down: MAX_SCORE only where the policy's own score is best, so that
            # the scheduler's pick among the highest is among the policy's best.
            scaled = (MAX_SCORE * (raw - lo) // (hi - lo)).astype(np.int64)
        return {
            n: s for n, s, ok in zip(names, scaled.tolist(), scored.tolist(), strict=True) if ok
        }

    def warm(self, asks: Iterable[Ask]) -> None:
        """Score each distinct shape of ``asks`` on every node once, so that the
        policy's kept scores serve the first requests of those shapes."""
        names = [n.name for n in self.state.nodes]
        seen = set()
        for a in asks:
            shape = (a.gpus, a.gpu_memory, a.cpu, a.memory, a.models, a.qos)
            if shape not in seen:
                seen.add(shape)
                try:
                    self.score(a, names)
                except ModelError:
                    continue
