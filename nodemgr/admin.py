"""The admin endpoint's requests (docs/protocol.md, "Admin endpoint"): quotas, reclaims,
pauses, modes, and the views of tasks, the queue, history and status."""

from __future__ import annotations

from typing import Any, Protocol

from nodemgr import protocol, views
from nodemgr.connections import Connections, ReplyTo, Watched
from nodemgr.model import Task
from nodemgr.protocol import Err, ProtocolError
from nodemgr.sizes import plural
from nodemgr.state import Node


class Loop(Protocol):
    """What these handlers need of the event loop (nodemgr.server.Server)."""

    node: Node
    connections: Connections

    def reclaim(self, task: Task, reason: str, message: str, record: str | None = None) -> None: ...

    def release(self, task_id: str, reason: str, exit_code: int | None = None) -> None: ...

    def unwatch(self, what: Watched) -> None: ...

    def send_later(self, to: ReplyTo, msg: dict[str, Any]) -> bool: ...

    def close_env_later(self, name: str) -> None: ...


def reclaimed_by_operator(reason: str | None) -> str:
    """What the client of a task an operator reclaimed is told (with their reason)."""
    if reason is None:
        return (
            "GPUs reclaimed by an operator (nodemgr reclaim); ask them why, or run the "
            "command again"
        )
    return f"GPUs reclaimed by an operator (nodemgr reclaim): {reason}"


def handle(loop: Loop, kind: str, msg_id: int, body: dict[str, Any]) -> dict[str, Any]:
    node = loop.node
    if kind == "quota_set":
        env = node.set_quota(body["env"], body["gpus"], body["memory"])
        loop.connections.open_env(env)
        return protocol.reply(
            "quota", msg_id, **views.quota(env, node), over=views.over_quota(node, env)
        )
    if kind == "quota_delete":
        return _delete_env(loop, body["env"], bool(body["force"]), msg_id)
    if kind == "reclaim":
        task = node.tasks.get(body["task_id"])
        if task is None:
            raise ProtocolError(Err.UNKNOWN_TASK, f"no running task {body['task_id']!r}")
        loop.reclaim(task, "admin", reclaimed_by_operator(body["reason"]))
        return protocol.reply("reclaimed", msg_id, task_id=task.task_id, env=task.env)
    if kind == "idle_set":
        env = node.set_idle(body["env"], body["idle_timeout"], body["idle_action"])
        return protocol.reply("quotas", msg_id, quotas=[views.quota(env, node)])
    if kind in ("pause", "resume"):
        paused = kind == "pause"
        task = node.pause(body["task_id"], paused)
        return protocol.reply("paused", msg_id, task_id=task.task_id, env=task.env, paused=paused)
    if kind == "mode":
        indices = node.gpu_indices(body["gpu"])
        if body["mode"] is not None:
            node.set_mode(indices, body["mode"])
        return protocol.reply("modes", msg_id, gpus=views.modes(node, indices))
    if kind == "drain":
        indices = node.gpu_indices(body["gpu"])
        if body["drained"] is not None:
            node.set_drained(indices, body["drained"])
        return protocol.reply("drains", msg_id, gpus=views.drains(node, indices))
    if kind == "history":
        limit = body["limit"] or 1000
        # A running task's peak so far is in its ledger, not yet in its record.
        live = {t["task_id"]: t["peak"] for t in views.tasks(node, body["env"])}
        records = []
        for r in node.store.history(body["env"], body["since"], limit):
            view = r.view()
            if r.ended is None and r.task_id in live:
                view["peak"] = max(r.peak, live[r.task_id])
            records.append(view)
        return protocol.reply("history", msg_id, records=records)
    if kind == "queue":
        return protocol.reply("queue", msg_id, waiting=views.queue(node.queue))
    if kind == "quota_show":
        envs = [node.env(body["env"])] if body["env"] else list(node.envs.values())
        quotas = [views.quota(e, node) for e in sorted(envs, key=lambda e: e.name)]
        return protocol.reply("quotas", msg_id, quotas=quotas)
    if kind == "tasks":
        only = node.env(body["env"]).name if body["env"] else None
        return protocol.reply("tasks", msg_id, tasks=views.tasks(node, only))
    return protocol.reply("status", msg_id, **views.status(node))


def _delete_env(loop: Loop, name: str, force: bool, msg_id: int) -> dict[str, Any]:
    node = loop.node
    env = node.env(name)
    tasks = [t for t in node.tasks.values() if t.env == name]
    held = sum(env.ledger.used(i) for i in range(len(node.gpus)))
    if (tasks or held) and not force:
        raise ProtocolError(
            Err.BUSY,
            f"environment {name!r} has {plural(len(tasks), 'running task')} and {held} bytes "
            "in use; wait for them, or delete with --force to end them",
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
            w.reply_to,
            protocol.error(Err.UNKNOWN_ENV, f"environment {name!r} was deleted", w.reply_to[2]),
        )
    # Its clients' connections stay for the grace, so that their heartbeats hear why.
    loop.close_env_later(name)
    node.delete_quota(name)
    return protocol.reply("deleted", msg_id, env=name, tasks_ended=len(tasks))
