"""What an environment sees of the node through its own task endpoint (docs/protocol.md,
``view``): who holds each GPU, by environment, and the wait queue, its own requests in full
and the other environments' only counted.

Nothing here names another environment's task, command, pid or user: an environment's
users learn which environments share the node and how much they hold, never what runs
there. The admin endpoint's views (nodemgr.report.views) show the rest.
"""

from __future__ import annotations

import time
from typing import TypedDict

from nodemgr.node.model import Env
from nodemgr.node.node import Node
from nodemgr.policy import timeslice


class HolderView(TypedDict):
    env: str
    tasks: int  # its tasks on the GPU; 0: only memory a finished task's processes still hold
    used: int  # bytes its processes hold there now
    promised: int  # bytes the GPU is charged for it


class UserGpuView(TypedDict):
    index: int
    uuid: str
    name: str
    memory: int
    capacity: int
    charged: int
    mode: str
    drained: bool
    lost: bool
    holders: list[HolderView]


class OwnWaiterView(TypedDict):
    position: int
    gpus: int
    memory: int | None
    devices: list[int] | None
    waited: float
    timeout_in: float
    reason: str
    command: str | None
    task_class: str


class OwnTaskView(TypedDict):
    """One of the environment's running tasks (docs/scheduling.md, "Classes")."""

    task_id: str
    gpus: list[int]
    task_class: str
    preempted: str | None  # why it is held for a latency-sensitive task; None: it is not
    command: str | None


class UserView(TypedDict):
    env: str
    gpus: list[UserGpuView]
    waiting: int
    mine: list[OwnWaiterView]
    others: int
    # Its classes: the default of its requests, whether it may run LS tasks; its tasks.
    class_default: str
    allow_ls: bool
    running: list[OwnTaskView]


def _promised(env: Env, index: int, slices: dict[str, int] | None) -> int:
    """What GPU ``index`` is charged for ``env``, as Node.charged adds it up: on a shared
    GPU its per-GPU quota (or what it holds, when more); on a time-sliced one its tasks'
    persistent slices and guards (the temporary region is shared by all); memory held on
    a GPU it only drains."""
    used = env.ledger.used(index)
    if index not in env.held:
        return used
    if slices is None:
        return max(env.memory, used)
    return max(sum(slices.get(t, 0) for t in env.held[index]), used)


def _gpu(node: Node, index: int) -> UserGpuView:
    g = node.gpus[index]
    slices = None
    if node.slicing.timesliced(index):
        charge = timeslice.charge(node.slicing.members(index), node.slicing.quotas())
        slices = {x.task_id: x.persistent + x.guard for x in charge.slices}
    holders: list[HolderView] = [
        {
            "env": e.name,
            "tasks": len(e.held.get(index, ())),
            "used": e.ledger.used(index),
            "promised": _promised(e, index, slices),
        }
        for e in sorted(node.envs.values(), key=lambda e: e.name)
        if index in e.held or index in e.draining
    ]
    return {
        "index": g.index,
        "uuid": g.uuid,
        "name": g.name,
        "memory": g.memory,
        "capacity": node.capacity(index),
        "charged": node.charged(index),
        "mode": node.slicing.mode(index),
        "drained": index in node.drained,
        "lost": index in node.lost,
        "holders": holders,
    }


def build(node: Node, env: str) -> UserView:
    """The node as environment ``env`` may see it."""
    e = node.env(env)
    name = e.name
    now = time.monotonic()
    mine: list[OwnWaiterView] = []
    others = 0
    for pos, w in enumerate(node.queue, 1):
        if w.env != name:
            others += 1
            continue
        mine.append(
            {
                "position": pos,
                "gpus": w.request.gpus,
                "memory": w.request.memory,
                "devices": None if w.allowed is None else sorted(w.allowed),
                "waited": now - w.enqueued,
                "timeout_in": max(0.0, w.deadline - now),
                "reason": w.reason,
                "command": w.request.command,
                "task_class": w.request.task_class or "",
            }
        )
    running: list[OwnTaskView] = [
        {
            "task_id": t.task_id,
            "gpus": list(t.gpus),
            "task_class": t.task_class,
            "preempted": t.preempted,
            "command": t.command,
        }
        for t in sorted(node.tasks.values(), key=lambda t: t.started)
        if t.env == name
    ]
    return {
        "env": name,
        "gpus": [_gpu(node, g.index) for g in node.gpus],
        "waiting": len(node.queue),
        "mine": mine,
        "others": others,
        "class_default": node.class_default(e),
        "allow_ls": node.allows_ls(e),
        "running": running,
    }
