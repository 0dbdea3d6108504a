"""The plugin's record of what kubelet allocated, and what it follows from (pure: state
in, decision out; docs/kubernetes.md, "How allocations become environments").

Kubelet allocates each extended resource of a container by its own ``Allocate`` call, and
names neither the pod nor the container: only device IDs. It allocates one pod's
containers, and each container's resources, one after another, so a container's
``gpushare.io/gpu-memory`` half follows its ``gpushare.io/gpus`` half (or the other way
round) within moments. The book pairs them so: a half joins the newest allocation that
lacks its resource and began within :data:`PAIR_WINDOW`; otherwise it begins a new one,
whose environment is named after its IDs. An environment's quota is zero until both
halves are in.

The kubelet's pod-resources ``List`` later tells which container holds which IDs; a
:func:`plan` against it removes what no live container holds, restores what nodemgr lost
and takes in what the book lost.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kube.resources import ENV_PREFIX, GPU_MEMORY, GPUS, MEMORY_UNIT, RESOURCES, env_name

# Seconds within which a container's second half is paired with its first.
PAIR_WINDOW = 5.0
BOOK_VERSION = 1


class BookError(ValueError):
    """A book file that cannot be read: the message says why."""


@dataclasses.dataclass
class Allocation:
    """One container's devices, by resource, and the environment they make."""

    env: str
    ids: dict[str, tuple[str, ...]]
    made: float  # when its first half was allocated (the plugin's clock, Unix time)

    @property
    def complete(self) -> bool:
        return all(self.ids.get(r) for r in RESOURCES)

    def quota(self) -> tuple[int, int]:
        """nodemgr's quota for it: (GPUs, bytes per GPU); (0, 0) until both halves are in."""
        if not self.complete:
            return 0, 0
        gpus = len(self.ids[GPUS])
        return gpus, len(self.ids[GPU_MEMORY]) * MEMORY_UNIT // gpus

    def all_ids(self) -> set[str]:
        return {i for ids in self.ids.values() for i in ids}


@dataclasses.dataclass(frozen=True)
class Holder:
    """A live container as the pod-resources API lists it, with the plugin's IDs it
    holds, by resource."""

    namespace: str
    pod: str
    container: str
    ids: Mapping[str, tuple[str, ...]]

    @property
    def name(self) -> str:
        return f"{self.namespace}/{self.pod}/{self.container}"


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a reconciliation does. ``delete``: environments no live container holds;
    ``ensure``: allocations whose environment must exist with its quota (taken in or
    restored); ``adopted``: environments taken into the book from the live list;
    ``notes``: one line per oddity found (a container holding one of the two resources,
    IDs split between environments)."""

    delete: tuple[str, ...] = ()
    ensure: tuple[Allocation, ...] = ()
    adopted: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


class Book:
    """Allocations by environment."""

    def copy(self) -> Book:
        """A book of copies of these allocations (what a change is tried on)."""
        return Book(Allocation(a.env, dict(a.ids), a.made) for a in self.allocations.values())

    def __init__(self, allocations: Iterable[Allocation] = ()) -> None:
        self.allocations: dict[str, Allocation] = {a.env: a for a in allocations}

    def owner(self, ids: Iterable[str]) -> Allocation | None:
        wanted = set(ids)
        for a in self.allocations.values():
            if a.all_ids() & wanted:
                return a
        return None

    def allocate(
        self, resource: str, ids: Sequence[str], now: float
    ) -> tuple[Allocation, list[str]]:
        """Record ``resource``'s ``ids`` for one container: the allocation they make or
        join, and those dropped from the book (left for :func:`plan` to remove).

        Kubelet gives a container devices another allocation holds when that one's
        container is gone, or, within one pod, when app containers reuse an init
        container's. Either way the new container carries on that allocation's
        environment (the one holding most of the IDs): it takes these IDs, and its other
        half is to come, as for a new allocation. Other allocations holding some of the
        IDs are dropped."""
        if resource not in RESOURCES:
            raise ValueError(f"not a gpushare resource: {resource}")
        ids = tuple(sorted(ids))
        wanted = set(ids)
        owners = [a for a in self.allocations.values() if a.all_ids() & wanted]
        if owners:
            kept = max(owners, key=lambda a: (len(a.all_ids() & wanted), a.made, a.env))
            dropped = [a.env for a in owners if a is not kept]
            for env in dropped:
                del self.allocations[env]
            kept.ids = {resource: ids}
            kept.made = now
            return kept, dropped
        open_ = [
            a
            for a in self.allocations.values()
            if resource not in a.ids and now - a.made <= PAIR_WINDOW
        ]
        if open_:
            joined = max(open_, key=lambda a: (a.made, a.env))
            joined.ids[resource] = ids
            return joined, []
        made = Allocation(env_name(ids), {resource: ids}, now)
        self.allocations[made.env] = made
        return made, []

    def wire(self) -> dict[str, Any]:
        """The book as its file holds it (JSON)."""
        return {
            "version": BOOK_VERSION,
            "allocations": [
                {"env": a.env, "ids": {r: list(v) for r, v in a.ids.items()}, "made": a.made}
                for a in sorted(self.allocations.values(), key=lambda a: a.env)
            ],
        }

    @classmethod
    def from_wire(cls, data: Any) -> Book:
        try:
            if data.get("version") != BOOK_VERSION:
                raise BookError(f"version {data.get('version')!r}, not {BOOK_VERSION}")
            return cls(
                Allocation(
                    str(a["env"]),
                    {str(r): tuple(str(i) for i in v) for r, v in a["ids"].items()},
                    float(a["made"]),
                )
                for a in data["allocations"]
            )
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise BookError(f"not a device-plugin book: {e}") from None


def plan(book: Book, live: Sequence[Holder], envs: Iterable[str], now: float, grace: float) -> Plan:
    """What makes nodemgr's environments (``envs``, its names) those of the ``live``
    containers: the book is brought up to date (taken-in allocations added, deleted ones
    removed) and the plan says what to do in nodemgr.

    An allocation no live container holds goes once it is older than ``grace`` (kubelet
    lists a container's devices only after allocating them); an environment of the
    plugin's (named ``k8s-...``) that no allocation owns goes at once."""
    existing = set(envs)
    notes: list[str] = []
    held: set[str] = set()
    adopted: list[Allocation] = []
    changed: list[Allocation] = []
    for holder in live:
        mine = {r: tuple(sorted(v)) for r, v in holder.ids.items() if r in RESOURCES and v}
        if not mine:
            continue
        ids = {i for v in mine.values() for i in v}
        owners = {a.env for a in book.allocations.values() if a.all_ids() & ids}
        if len(owners) > 1:
            notes.append(f"{holder.name}: its devices are in {len(owners)} environments")
        if not owners:
            # The book lost it: the environment named after either half's IDs, whichever
            # nodemgr has (the container mounts that one), else the gpus half's.
            names = [env_name(mine[r]) for r in RESOURCES if r in mine]
            env = next((n for n in names if n in existing), names[0])
            taken = Allocation(env, dict(mine), now)
            book.allocations[env] = taken
            adopted.append(taken)
            owners = {env}
        elif len(owners) == 1:
            # The live list is the truth for an allocation it has had time to show (kubelet
            # lists a container after allocating it): it holds what the container holds.
            owner = book.allocations[next(iter(owners))]
            if now - owner.made > grace:
                before = owner.quota()
                owner.ids.update(mine)
                if owner.quota() != before:
                    changed.append(owner)
        if len(mine) < len(RESOURCES):
            missing = next(r for r in RESOURCES if r not in mine)
            notes.append(f"{holder.name}: asks for no {missing}, so its quota is zero")
        held |= owners
    gone = [a.env for a in book.allocations.values() if a.env not in held and now - a.made > grace]
    for env in gone:
        del book.allocations[env]
    stray = sorted(e for e in existing if e.startswith(ENV_PREFIX) and e not in book.allocations)
    ensure = [a for a in book.allocations.values() if a.env in held and a.env not in existing]
    ensure += [a for a in adopted if a.env in existing]  # its quota may be stale
    ensure += [a for a in changed if a.env in existing]
    return Plan(
        delete=tuple(sorted(set(gone) & existing | set(stray))),
        ensure=tuple(sorted({a.env: a for a in ensure}.values(), key=lambda a: a.env)),
        adopted=tuple(a.env for a in adopted),
        notes=tuple(notes),
    )
