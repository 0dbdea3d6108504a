"""What nodemgr's replies say of its state: one TypedDict per shape (docs/protocol.md lists
the replies), built from a Node, the bypass audit's state and the last utilisation sample
without changing them."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from typing import TypedDict

from gpushare import __version__
from nodemgr.host.audit import AuditState, AuditView
from nodemgr.host.audit import view as audit_view
from nodemgr.host.gpus import sim_spec
from nodemgr.host.ledger import SlotTotals
from nodemgr.host.utilization import Utilization
from nodemgr.node.model import Env, Task
from nodemgr.node.node import Node
from nodemgr.policy import timeslice
from nodemgr.policy.waitqueue import Waiter


class QuotaView(TypedDict):
    env: str
    gpus: int
    memory: int
    endpoint: str
    # Its idle policy (docs/nodemgr.md, "Idle tasks"): the timeout (0: off) and action that
    # apply, and whether they are its own (`nodemgr idle`) or the node's.
    idle_timeout: float
    idle_action: str
    idle_own: bool
    # Its task classes (docs/scheduling.md, "Classes"): the class of a request that names
    # none, and whether it may run latency-sensitive tasks (its own or the node's).
    class_default: str
    allow_ls: bool
    compute: int | None  # the cap on each of its tasks' compute share, percent


class ComputeWindow(TypedDict):
    offset: float  # seconds into each period (CLOCK_MONOTONIC multiples of it)
    length: float
    period: float


class WindowView(TypedDict):
    """A task's window on its GPUs, in the `share` reply."""

    task_id: str
    env: str
    gpus: list[int]
    share: int
    offset: float
    length: float
    period: float


class OverQuota(TypedDict):
    gpu: int
    used: int


class TaskRegionView(TypedDict):
    gpu: int
    persistent: int
    temporary: int
    temporary_peak: int
    settled: int


class TaskView(TypedDict):
    task_id: str
    env: str
    pid: int | None
    gpus: list[int]
    memory_limit: int
    memory_used: int
    peak: int
    # Admission by prediction (docs/prediction.md#admission): its predicted peak per GPU,
    # its grant per shared GPU now (both nil: granted the quota), its top-ups.
    predicted: int | None
    granted: int | None
    topups: int
    # Step time (docs/prediction.md#step-time): its first GPU's model, nodemgr's estimate
    # (seconds per iteration, ratio of its GPU kept busy; nil: none) and what is measured.
    gpu_model: str | None
    predicted_step: float | None
    predicted_utilization: float | None
    measured_step: float | None
    launches: int
    processes: int
    started: float
    command: str | None
    attached: bool
    paused: bool
    last_launch: float | None
    # Seconds since its last kernel launch (or its grant, or when it was last paused or
    # gated), as the last sweep saw it; None: not swept yet. The idle timeout that applies
    # to it (0: none).
    idle: float | None
    idle_timeout: float
    gated: bool
    iterations: int
    regions: list[TaskRegionView]
    utilization: list[int | None]  # percent per GPU of `gpus`, from NVML's last sample
    # Classes (docs/scheduling.md): "ls" or "be"; why a best-effort task is held for
    # latency-sensitive ones (None: it is not).
    task_class: str
    preempted: str | None
    # The elastic rule (docs/compute.md, "Elastic share"): why an LS task is held for using
    # more than its share (None: it is not), and its recent seconds per step (None: unknown).
    held: str | None
    step_time: float | None
    # Compute shares (docs/compute.md): the share it asked for (None: none), the share in
    # force (its window's percentage of the period; 0: not gated), its window, and what its
    # live processes' pacers measured: device time of their windows, time launches waited.
    compute: int | None
    share: int
    window: ComputeWindow | None
    device_seconds: float
    gated_seconds: float


class WaiterView(TypedDict):
    position: int
    env: str
    gpus: int
    pid: int | None
    waited: float
    timeout_in: float
    bypassed: int
    command: str | None
    devices: list[int] | None
    memory: int | None
    reason: str
    task_class: str


class SliceView(TypedDict):
    task_id: str
    offset: int
    persistent: int
    temporary: int
    guard: int
    shape: str


class RegionsView(TypedDict):
    persistent: int
    temporary: int
    temporary_used: int
    temporary_peak: int
    slices: list[SliceView]


class TurnView(TypedDict):
    holder: str | None
    held_for: float
    quantum: int
    order: list[str]
    switches: int
    last_switch_ms: float | None


class GpuStatus(TypedDict):
    index: int
    uuid: str
    name: str
    memory: int
    reserve: int
    charged: int
    used: int
    tasks: int
    envs: list[str]
    lost: bool
    drained: bool
    mode: str
    regions: RegionsView | None
    turn: TurnView | None
    bypass: int  # processes the last bypass audit found holding memory there
    utilization: int | None  # percent of the last sample period it was busy; None: unknown
    memory_utilization: int | None  # the same for its memory
    context: int  # bytes charged per process for its CUDA context there
    context_source: str  # "measured", "configured" or "fallback" (nodemgr.host.ctxprobe)


class StatusView(TypedDict):
    version: str
    simulated: bool
    uptime: float
    pid: int
    envs: int
    tasks: int
    waiting: int
    task_threshold: int
    gpus: list[GpuStatus]
    bypass: AuditView


class ModeView(TypedDict):
    index: int
    uuid: str
    mode: str
    source: str
    charged: int
    capacity: int


class GrantGpu(TypedDict):
    index: int
    uuid: str
    name: str
    memory: int


class GrantView(TypedDict):
    task_id: str
    env: str
    gpus: list[GrantGpu]
    memory_limit: int
    ledger: str
    heartbeat_interval: float
    heartbeat_timeout: float
    simulated: bool
    sim_gpus: str | None
    sim_state_dir: str | None
    timesliced: list[int]
    sim_timeline: dict[str, float] | None


def quota(env: Env, node: Node) -> QuotaView:
    policy = node.idle_policy(env)
    return {
        "env": env.name,
        "gpus": env.gpus,
        "memory": env.memory,
        "endpoint": env.endpoint,
        "idle_timeout": policy.timeout,
        "idle_action": policy.action,
        "idle_own": env.idle_timeout is not None or env.idle_action is not None,
        "class_default": node.class_default(env),
        "allow_ls": node.allows_ls(env),
        "compute": env.compute,
    }


def over_quota(node: Node, env: Env) -> list[OverQuota]:
    """Where ``env`` holds more than its quota (after a lowered one), and how much."""
    return [{"gpu": i, "used": used} for i, used in node.over_quota(env).items()]


def task(
    node: Node, task: Task, usage: dict[str, SlotTotals], utilization: Utilization
) -> TaskView:
    totals = usage.get(task.task_id, SlotTotals())
    entry = node.envs[task.env].ledger.task_entry(task.task_id)
    stamped = entry.last_launch_ns if entry is not None else 0
    s = task.schedule
    pacing = node.envs[task.env].ledger.task_pacing(task.task_id)
    window: ComputeWindow | None = None
    if s is not None and s.length_ns:
        window = {
            "offset": s.offset_ns / 1e9,
            "length": s.length_ns / 1e9,
            "period": s.period_ns / 1e9,
        }
    return {
        "task_id": task.task_id,
        "env": task.env,
        "pid": task.pid,
        "gpus": list(task.gpus),
        # The environment's per-GPU quota now: a quota change applies to running tasks.
        "memory_limit": node.envs[task.env].memory,
        "memory_used": totals.used,
        "peak": max(task.peak, totals.peak),
        "predicted": task.request.predicted,
        "granted": task.grant,
        "topups": task.topups,
        "gpu_model": task.gpu_model,
        "predicted_step": None if task.estimate is None else task.estimate.step_s,
        "predicted_utilization": None if task.estimate is None else task.estimate.utilization,
        "measured_step": task.step_time,
        "launches": totals.launches,
        "processes": totals.processes,
        "started": task.started,
        "command": task.command,
        "attached": not task.restored,
        "paused": entry is not None and entry.paused,
        "last_launch": stamped / 1e9 if stamped else None,
        "idle": _idle(
            node,
            task,
            stamped,
            entry is None or entry.paused or entry.gated or entry.class_paused,
        ),
        "idle_timeout": node.idle_policy(node.envs[task.env]).timeout,
        "gated": entry is not None and entry.gated,
        "iterations": entry.iterations if entry is not None else 0,
        "regions": _task_regions(node, task),
        "utilization": utilization.task(task.task_id, task.gpus),
        "task_class": task.task_class,
        "preempted": task.preempted,
        "held": node.elastic.held.get(task.task_id),
        "step_time": node.elastic.step_times.get(task.task_id),
        "compute": task.request.compute,
        "share": s.share if s is not None and s.length_ns else 0,
        "window": window,
        "device_seconds": pacing.device_ns / 1e9,
        "gated_seconds": pacing.gated_ns / 1e9,
    }


def windows(node: Node, gpus: Iterable[int]) -> list[WindowView]:
    """The windows of every task on these GPUs, by offset (the `share` reply)."""
    wanted = set(gpus)
    out: list[WindowView] = []
    for t in node.tasks.values():
        s = t.schedule
        if s is None or not s.length_ns or not wanted & set(t.gpus):
            continue
        out.append(
            {
                "task_id": t.task_id,
                "env": t.env,
                "gpus": list(t.gpus),
                "share": s.share,
                "offset": s.offset_ns / 1e9,
                "length": s.length_ns / 1e9,
                "period": s.period_ns / 1e9,
            }
        )
    return sorted(out, key=lambda w: w["offset"])


def _idle(node: Node, task: Task, stamped: int, blocked: bool) -> float | None:
    """Seconds since the task's last launch (or its start): the idle tracker's figure where
    its environment has an idle policy, which counts a paused or gated spell as active;
    elsewhere worked out here (None while the task is paused or waits for its turn, or has
    no ledger entry to date its launches)."""
    now = time.time()
    tracked = node.idle.idle(task.task_id, now)
    if tracked is not None:
        return tracked
    if blocked:
        return None
    return max(0.0, now - max(task.started, stamped / 1e9))


def _task_regions(node: Node, task: Task) -> list[TaskRegionView]:
    sliced = [i for i in task.gpus if node.slicing.timesliced(i)]
    if not sliced:
        return []
    r = node.envs[task.env].ledger.task_regions(task.task_id)
    return [
        {
            "gpu": i,
            "persistent": r.persistent[i],
            "temporary": r.temporary(i),
            "temporary_peak": r.temp_peak[i],
            "settled": r.settled[i],
        }
        for i in sliced
    ]


def tasks(node: Node, env: str | None, utilization: Utilization) -> list[TaskView]:
    usage = {
        name: e.ledger.summary() for name, e in node.envs.items() if env is None or name == env
    }
    running = sorted(node.tasks.values(), key=lambda t: t.started)
    return [task(node, t, usage[t.env], utilization) for t in running if t.env in usage]


def queue(waiters: Iterable[Waiter]) -> list[WaiterView]:
    now = time.monotonic()
    return [
        {
            "position": pos,
            "env": w.env,
            "gpus": w.request.gpus,
            "pid": w.pid,
            "waited": now - w.enqueued,
            "timeout_in": max(0.0, w.deadline - now),
            "bypassed": w.bypassed,
            "command": w.request.command,
            "devices": None if w.allowed is None else sorted(w.allowed),
            "memory": w.request.memory,
            "reason": w.reason,
            "task_class": w.request.task_class or "",
        }
        for pos, w in enumerate(waiters, 1)
    ]


def status(node: Node, audit: AuditState, utilization: Utilization) -> StatusView:
    gpus: list[GpuStatus] = []
    bypass = audit.per_gpu(len(node.gpus))
    for g, view in zip(node.gpus, node.views(), strict=True):
        holders = {e.name for e in node.envs.values() if g.index in e.held}
        used = sum(e.ledger.used(g.index) for e in node.envs.values())
        sample = utilization.gpu(g.index)
        gpus.append(
            {
                "index": g.index,
                "uuid": g.uuid,
                "name": g.name,
                "memory": g.memory,
                "reserve": min(g.memory, node.config.memory_reserve),
                "charged": node.charged(g.index),
                "used": used,
                "tasks": view.tasks,
                "envs": sorted(holders),
                "lost": g.index in node.lost,
                "drained": g.index in node.drained,
                "mode": node.slicing.mode(g.index),
                "regions": _regions(node, g.index),
                "turn": _turn(node, g.index),
                "bypass": bypass[g.index],
                "utilization": None if sample is None else sample.gpu,
                "memory_utilization": None if sample is None else sample.memory,
                "context": node.contexts[g.index][0],
                "context_source": node.contexts[g.index][1],
            }
        )
    return {
        "version": __version__,
        "simulated": node.simulated,
        "uptime": time.time() - node.started,
        "pid": os.getpid(),
        "envs": len(node.envs),
        "tasks": len(node.tasks),
        "waiting": len(node.queue),
        "task_threshold": node.config.task_threshold,
        "gpus": gpus,
        "bypass": audit_view(audit),
    }


def _regions(node: Node, index: int) -> RegionsView | None:
    if not node.slicing.timesliced(index):
        return None
    members = node.slicing.members(index)
    c = timeslice.charge(members, node.slicing.quotas())
    return {
        "persistent": c.persistent,
        "temporary": c.temporary,
        "temporary_used": sum(m.temporary for m in members),
        "temporary_peak": max((m.temp_peak for m in members), default=0),
        "slices": [
            {
                "task_id": x.task_id,
                "offset": x.offset,
                "persistent": x.persistent,
                "temporary": x.temporary,
                "guard": x.guard,
                "shape": x.shape,
            }
            for x in c.slices
        ],
    }


def _turn(node: Node, index: int) -> TurnView | None:
    slicing = node.slicing
    turn = slicing.turns.gpus.get(index)
    if turn is None:
        return None
    return {
        "holder": turn.holder,
        "held_for": time.monotonic() - turn.since if turn.holder is not None else 0.0,
        "quantum": node.config.quantum,
        "order": turn.order(),
        "switches": slicing.switches.get(index, 0),
        "last_switch_ms": slicing.last_switch_ms.get(index),
    }


class DrainView(TypedDict):
    index: int
    uuid: str
    drained: bool
    tasks: int  # running there, which the drain lets finish


def drains(node: Node, indices: Sequence[int]) -> list[DrainView]:
    return [
        {
            "index": i,
            "uuid": node.gpus[i].uuid,
            "drained": i in node.drained,
            "tasks": node.tasks_on(i),
        }
        for i in indices
    ]


def modes(node: Node, indices: Sequence[int]) -> list[ModeView]:
    return [
        {
            "index": i,
            "uuid": node.gpus[i].uuid,
            "mode": node.slicing.modes[i][0],
            "source": node.slicing.modes[i][1],
            # Above capacity after a switch to shared, the tasks there run at once and
            # may run out of memory: the CLI says so.
            "charged": node.charged(i),
            "capacity": node.capacity(i),
        }
        for i in indices
    ]


def grant(node: Node, task: Task) -> GrantView:
    env = node.envs[task.env]
    chosen = [node.gpus[i] for i in task.gpus]
    return {
        "task_id": task.task_id,
        "env": env.name,
        "gpus": [
            {"index": g.index, "uuid": g.uuid, "name": g.name, "memory": g.memory} for g in chosen
        ],
        "memory_limit": env.memory,
        "ledger": str(env.ledger.path),
        "heartbeat_interval": node.config.heartbeat_interval,
        "heartbeat_timeout": node.config.heartbeat_timeout,
        "simulated": node.simulated,
        "sim_gpus": sim_spec(node.gpus) if node.simulated else None,
        "sim_state_dir": str(node.config.sim_state_dir) if node.simulated else None,
        "timesliced": [i for i in task.gpus if node.slicing.timesliced(i)],
        "sim_timeline": node.config.sim_timeline_params if node.simulated else None,
    }
