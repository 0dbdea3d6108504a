"""The policies by name: each policy module registers itself here, and nothing here names
one (docs/placement.md, "Policies")."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from placement.cluster import ClusterState, Placement, PlacementError, Pod


class Policy(Protocol):
    """State in, decision out: where ``pod`` goes in ``state``, or None when it fits
    nowhere. A policy may keep what it computed per node until that node's version
    changes; it never changes the state (the caller places the decision)."""

    def setup(self, state: ClusterState, expected: Sequence[Pod]) -> None:
        """Called once before deciding: the cluster, and the tasks it expects (a trace, or
        the recent history), from which a policy may learn the workload's shape."""

    def decide(self, state: ClusterState, pod: Pod, rng: np.random.Generator) -> Placement | None:
        """The node and devices for ``pod``; None: no node has room for it."""


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str
    summary: str
    make: Callable[[], Policy]


_POLICIES: dict[str, Entry] = {}


def register(name: str, summary: str) -> Callable[[Callable[[], Policy]], Callable[[], Policy]]:
    """Register a policy's factory under ``name`` (one line of ``summary`` for --help)."""

    def add(make: Callable[[], Policy]) -> Callable[[], Policy]:
        if name in _POLICIES:
            raise PlacementError(f"policy {name!r} is registered twice")
        _POLICIES[name] = Entry(name, summary, make)
        return make

    return add


def names() -> tuple[str, ...]:
    """The registered policies, in the order they registered."""
    return tuple(_POLICIES)


def entry(name: str) -> Entry:
    try:
        return _POLICIES[name]
    except KeyError:
        raise PlacementError(
            f"no placement policy {name!r} (known: {', '.join(_POLICIES)})"
        ) from None


def make(name: str) -> Policy:
    """A fresh instance of the named policy."""
    return entry(name).make()
