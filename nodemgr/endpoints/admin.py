"""The admin endpoint's requests (docs/protocol.md, "Admin endpoint"): quotas, reclaims,
pauses, modes, and the views of tasks, the queue, history and status."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, cast

from gpushare.messages import (
    AdminRequest,
    DeletedReply,
    Drain,
    DrainsReply,
    ErrorReply,
    History,
    HistoryReply,
    IdleSet,
    Message,
    Mode,
    ModesReply,
    Pause,
    PausedReply,
    Queue,
    QueueReply,
    QuotaDelete,
    QuotaSet,
    QuotaSetReply,
    QuotaShow,
    QuotasReply,
    R,
    Reclaim,
    ReclaimedReply,
    Resume,
    Share,
    SharedReply,
    Status,
    StatusReply,
    Tasks,
    TasksReply,
)
from gpushare.paths import socket_path_problem
from gpushare.protocol import Err, ProtocolError
from gpushare.sizes import format_size, parse_size, plural
from nodemgr.config import ENV_SOCKET_FIX
from nodemgr.node.model import Task
from nodemgr.node.node import Node
from nodemgr.report import views

if TYPE_CHECKING:
    from nodemgr.host.audit import AuditState
    from nodemgr.host.utilization import Utilization
    from nodemgr.loop.connections import Connections, ReplyTo, Watched


class Loop(Protocol):
    """What these handlers need of the event loop (nodemgr.loop.server.Server)."""

    node: Node
    connections: Connections
    audit: AuditState
    utilization: Utilization

    def reclaim(self, task: Task, reason: str, message: str, record: str | None = None) -> None: ...

    def release(self, task_id: str, reason: str, exit_code: int | None = None) -> None: ...

    def unwatch(self, what: Watched) -> None: ...

    def send_later(self, to: ReplyTo, reply: Message) -> bool: ...

    def close_env_later(self, name: str) -> None: ...


def reclaimed_by_operator(reason: str | None) -> str:
    """What the client of a task an operator reclaimed is told (with their reason)."""
    if reason is None:
        return (
            "GPUs reclaimed by an operator (nodemgr reclaim); ask them why, or run the "
            "command again"
        )
    return f"GPUs reclaimed by an operator (nodemgr reclaim): {reason}"


Handler = Callable[[Loop, Any], Message]


def handle(loop: Loop, request: AdminRequest[R]) -> R:
    """Serve ``request``: each admin request is answered with its REPLY class, or refused
    with a ProtocolError."""
    return cast(R, HANDLERS[type(request)](loop, request))


def _quota_set(loop: Loop, req: QuotaSet) -> Message:
    node = loop.node
    gpus, memory = _quota_asked(node, req)
    classes = req.class_default is not None or req.allow_ls is not None
    if req.env not in node.envs:
        _check_socket_path(node, req.env)
    if not req.force:
        charge = node.context_memory
        problem = unservable(
            gpus,
            memory,
            [
                (g.index, g.name, g.memory, node.capacity(g.index), charge[g.index])
                for g in node.gpus
            ],
        )
        if problem is not None:
            raise ProtocolError(Err.QUOTA_EXCEEDED, f"{req.env}: {problem}")
    env = node.set_quota(req.env, gpus, memory)
    if classes:
        node.set_classes(req.env, req.class_default, req.allow_ls)
    if req.compute is not None:
        node.set_compute_cap(req.env, req.compute or None)
    loop.connections.open_env(env)
    return QuotaSetReply(**views.quota(env, node), over=views.over_quota(node, env))


def _quota_delete(loop: Loop, req: QuotaDelete) -> Message:
    return _delete_env(loop, req.env, bool(req.force))


def _reclaim(loop: Loop, req: Reclaim) -> Message:
    task = loop.node.tasks.get(req.task_id)
    if task is None:
        raise ProtocolError(Err.UNKNOWN_TASK, f"no running task {req.task_id!r}")
    loop.reclaim(task, "admin", reclaimed_by_operator(req.reason))
    return ReclaimedReply(task_id=task.task_id, env=task.env)


def _idle_set(loop: Loop, req: IdleSet) -> Message:
    env = loop.node.set_idle(req.env, req.idle_timeout, req.idle_action)
    return QuotasReply(quotas=[views.quota(env, loop.node)])


def _pause(loop: Loop, req: Pause) -> Message:
    task = loop.node.pause(req.task_id, True)
    return PausedReply(task_id=task.task_id, env=task.env, paused=True)


def _resume(loop: Loop, req: Resume) -> Message:
    task = loop.node.pause(req.task_id, False)
    # Only the operator's hold is lifted: one for a latency-sensitive task stays.
    return PausedReply(task_id=task.task_id, env=task.env, paused=task.preempted is not None)


def _share(loop: Loop, req: Share) -> Message:
    task, notes = loop.node.share(req.task_id, req.compute)
    s = task.schedule
    return SharedReply(
        task_id=task.task_id,
        env=task.env,
        compute=task.request.compute,
        share=s.share if s is not None and s.length_ns else 0,
        windows=views.windows(loop.node, task.gpus),
        notes=notes,
    )


def _mode(loop: Loop, req: Mode) -> Message:
    node = loop.node
    indices = node.gpu_indices(req.gpu)
    if req.mode is not None:
        node.set_mode(indices, req.mode)
    return ModesReply(gpus=views.modes(node, indices))


def _drain(loop: Loop, req: Drain) -> Message:
    node = loop.node
    indices = node.gpu_indices(req.gpu)
    if req.drained is not None:
        node.set_drained(indices, req.drained)
    return DrainsReply(gpus=views.drains(node, indices))


def _history(loop: Loop, req: History) -> Message:
    node = loop.node
    name = req.env
    # A deleted environment's records stay: only a name never used is unknown.
    if name is not None and name not in node.envs and not node.store.history(name, None, 1):
        raise ProtocolError(
            Err.UNKNOWN_ENV,
            f"no environment {name!r} now, and no records of one; `nodemgr quota show` "
            "lists the environments",
        )
    limit = req.limit or 1000
    # A running task's peak so far is in its ledger, not yet in its record.
    live = {t["task_id"]: t["peak"] for t in views.tasks(node, req.env, loop.utilization)}
    records = []
    for r in node.store.history(req.env, req.since, limit):
        view = r.view()
        if r.ended is None and r.task_id in live:
            view["peak"] = max(r.peak, live[r.task_id])
        records.append(view)
    return HistoryReply(records=records)


def _queue(loop: Loop, req: Queue) -> Message:
    node = loop.node
    only = node.env(req.env).name if req.env else None
    waiting = [w for w in views.queue(node.queue) if only is None or w["env"] == only]
    return QueueReply(waiting=waiting)


def _quota_show(loop: Loop, req: QuotaShow) -> Message:
    node = loop.node
    envs = [node.env(req.env)] if req.env else list(node.envs.values())
    return QuotasReply(quotas=[views.quota(e, node) for e in sorted(envs, key=lambda e: e.name)])


def _tasks(loop: Loop, req: Tasks) -> Message:
    node = loop.node
    only = node.env(req.env).name if req.env else None
    return TasksReply(tasks=views.tasks(node, only, loop.utilization))


def _status(loop: Loop, req: Status) -> Message:
    return StatusReply(**views.status(loop.node, loop.audit, loop.utilization))


def _check_socket_path(node: Node, name: str) -> None:
    """Refuse a new environment whose socket no client could connect to."""
    where = node.config.env_socket(name)
    problem = socket_path_problem(where, f"environment {name}'s socket", ENV_SOCKET_FIX)
    if problem is not None:
        raise ProtocolError(Err.BAD_REQUEST, problem)


def _quota_asked(node: Node, req: QuotaSet) -> tuple[int, int]:
    """The GPU count and per-GPU memory a ``quota_set`` asks for: a field left out keeps the
    environment's (a new environment needs both)."""
    env = node.envs.get(req.env)
    gpus = env.gpus if req.gpus is None and env else req.gpus
    memory = env.memory if req.memory is None and env else req.memory
    if gpus is None or memory is None:
        raise ProtocolError(
            Err.BAD_REQUEST,
            f"environment {req.env!r} does not exist yet: give both its GPU count and "
            "its memory per GPU (nodemgr quota set ENV --gpus N --memory SIZE)",
        )
    return gpus, memory


def unservable(
    gpus: int, memory: int, node_gpus: list[tuple[int, str, int, int, int]]
) -> str | None:
    """Why a quota of ``gpus`` GPUs of ``memory`` bytes each could never be served on GPUs
    (index, name, memory, capacity: what may be promised of it, context: what a process is
    charged there for its CUDA context); None when it can be: ``gpus`` of them can each
    give ``memory`` with room for a context. A zero GPU count (tasks run on the CPU) is
    always servable."""
    fix = "; set it anyway with --force"
    if gpus == 0:
        return None
    if gpus > len(node_gpus):
        return (
            f"a quota of {plural(gpus, 'GPU')} can never be granted in full: this node has "
            f"{plural(len(node_gpus), 'GPU')}; give --gpus {len(node_gpus)} or fewer{fix}"
        )
    if memory == 0:
        return (
            "0 bytes per GPU grants GPUs on which nothing can be allocated; give --memory, "
            f"or --gpus 0 to run its tasks on the CPU{fix}"
        )
    index, name, total, capacity, _ = max(node_gpus, key=lambda g: (g[3], -g[0]))
    if memory > capacity:
        kept = f", less the {format_size(total - capacity)} reserve" if total > capacity else ""
        most = format_size(capacity)
        if parse_size(most) > capacity:  # rounded up ("16.00GiB" for a little less)
            most = f"{capacity >> 20}MiB"
        return (
            f"{format_size(memory)} per GPU is more than any GPU of this node can give: the "
            f"largest, GPU {index} ({name}), has {format_size(capacity)} ({format_size(total)}"
            f"{kept}); give --memory {most} or less{fix}"
        )
    context = min(g[4] for g in node_gpus)
    if memory <= context:
        return (
            f"{format_size(memory)} per GPU leaves no room for a process's CUDA context, "
            f"charged {format_size(context)} (gpus.context_memory); give more{fix}"
        )
    # GPUs of different models: each of the quota's GPUs must give it all.
    serving = [str(g[0]) for g in node_gpus if g[4] < memory <= g[3]]
    if len(serving) < gpus:
        some = f"only GPU{'s' if len(serving) > 1 else ''} {','.join(serving)} of"
        where = some if serving else "no GPU on"
        return (
            f"a quota of {plural(gpus, 'GPU')} with {format_size(memory)} each can never be "
            f"granted in full: {where} this node can give {format_size(memory)} and a "
            f"process's CUDA context besides; give --gpus {len(serving)} or fewer, or less "
            f"--memory{fix}"
        )
    return None


def _delete_env(loop: Loop, name: str, force: bool) -> Message:
    node = loop.node
    env = node.env(name)
    tasks = [t for t in node.tasks.values() if t.env == name]
    held = sum(env.ledger.used(i) for i in range(len(node.gpus)))
    if (tasks or held) and not force:
        raise ProtocolError(
            Err.BUSY,
            f"environment {name!r} has {plural(len(tasks), 'running task')} and "
            f"{format_size(held)} in use; wait for them, or delete with --force to end them",
        )
    for task in tasks:
        loop.reclaim(
            task,
            "deleted",
            f"GPUs reclaimed: an operator deleted the environment {name!r} (nodemgr quota "
            "delete); ask them to create it again",
            record="admin",
        )
    for w in [w for w in node.queue if w.env == name]:
        node.queue.drop(w.wid)
        loop.unwatch(("wait", w.wid))
        loop.send_later(
            w.reply_to, ErrorReply.of(Err.UNKNOWN_ENV, f"environment {name!r} was deleted")
        )
    # Its clients' connections stay for the grace, so that their heartbeats hear why.
    loop.close_env_later(name)
    node.delete_quota(name)
    loop.audit.forget_env(name)
    return DeletedReply(env=name, tasks_ended=len(tasks))


# One handler per request type the admin endpoint serves (messages.ADMIN_REQUESTS).
HANDLERS: dict[type[AdminRequest[Any]], Handler] = {
    QuotaSet: _quota_set,
    QuotaShow: _quota_show,
    QuotaDelete: _quota_delete,
    Tasks: _tasks,
    Queue: _queue,
    Status: _status,
    Mode: _mode,
    Drain: _drain,
    Reclaim: _reclaim,
    IdleSet: _idle_set,
    Pause: _pause,
    Resume: _resume,
    Share: _share,
    History: _history,
}
