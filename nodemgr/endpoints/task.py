"""The task endpoint's requests (docs/protocol.md, "Task endpoint"): heartbeats, requests
for GPUs (granted, or queued to wait), the user's view and quota, turn yields and the end
of a task. Each environment's socket names the environment a request comes from."""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any, Protocol

from gpushare import protocol
from gpushare.protocol import Err, ProtocolError
from nodemgr.config import Config
from nodemgr.host.procfs import process_start
from nodemgr.node.model import Task
from nodemgr.node.node import Node
from nodemgr.policy.ratelimit import TokenBuckets
from nodemgr.report import env_view, views

if TYPE_CHECKING:
    from nodemgr.host.audit import AuditState
    from nodemgr.loop.connections import Watched
    from nodemgr.loop.reclaim import Reclaims
    from nodemgr.loop.transport import Conn

log = logging.getLogger("nodemgr")


class Loop(Protocol):
    """What these handlers need of the event loop (nodemgr.loop.server.Server)."""

    config: Config
    node: Node
    audit: AuditState
    reclaims: Reclaims
    watched: dict[Watched, int]
    views: TokenBuckets

    def release(self, task_id: str, reason: str, exit_code: int | None = None) -> None: ...

    def register(self, what: Watched, fd: int) -> None: ...

    def watch(self, task: Task) -> None: ...

    def unwatch(self, what: Watched) -> None: ...


def handle(
    loop: Loop,
    env: str,
    kind: str,
    msg_id: int,
    body: dict[str, Any],
    conn: Conn,
    envelope: list[bytes],
) -> dict[str, Any] | None:
    node = loop.node
    if kind == "heartbeat":
        told = loop.reclaims.told(env, body["task_id"])
        if told is not None:
            return protocol.error(Err.RECLAIMED, told[1], msg_id, reason=told[0])
        task = node.task(env, body["task_id"])
        task.last_seen = time.monotonic()
        if task.restored:
            _reattach(loop, task, conn)
        extra: dict[str, Any] = {}
        warning = loop.reclaims.idle_warning(task)
        if warning is not None:
            extra["warning"] = warning
        notices = loop.audit.take_notices(task.task_id)
        if notices:
            extra["notices"] = notices
        return protocol.reply("ack", msg_id, task_id=task.task_id, **extra)
    if kind == "request":
        return _request(loop, env, msg_id, body, conn, envelope)
    if kind == "view":
        # Each view walks every GPU, holder and waiting request: one environment sending
        # them in a loop must not slow the others' grants.
        if not loop.views.take(env, time.monotonic()):
            raise ProtocolError(
                Err.BUSY,
                f"environment {env} sent more than {loop.config.view_burst} view requests "
                f"at once, or more than {loop.config.views_per_second} a second "
                "(limits.views_per_second, limits.view_burst); ask less often",
            )
        return protocol.reply("view", msg_id, **env_view.build(node, env))
    if kind == "quota":
        e = node.env(env)
        return protocol.reply("quota", msg_id, env=e.name, gpus=e.gpus, memory=e.memory)
    if kind == "yield":
        started = time.perf_counter()
        to = (conn, envelope, msg_id)
        task = node.task(env, body["task_id"])
        passed = node.slicing.yield_turn(task, started, body["iterations"], to)
        if passed is None:
            # Held until the task's other processes end the turn too: `held` now, the
            # `turn` reply later (Server._answer_yields).
            return protocol.reply("held", msg_id, task_id=body["task_id"])
        return protocol.reply("turn", msg_id, task_id=body["task_id"], passed=passed)
    # done
    task = node.task(env, body["task_id"])
    reason = "killed" if body["signal"] is not None else "done"
    loop.release(task.task_id, reason, body["exit_code"])
    return protocol.reply("ack", msg_id, task_id=task.task_id)


def _request(
    loop: Loop,
    env: str,
    msg_id: int,
    body: dict[str, Any],
    conn: Conn,
    envelope: list[bytes],
) -> dict[str, Any]:
    node = loop.node
    allowed = node.restriction(body["devices"])
    pid = conn.pid
    pid_start = process_start(pid) if pid is not None else None
    estimate = None
    if body["persistent"] is not None:
        estimate = (body["persistent"], body["temporary"] or 0)
    earlier = None
    if body["waited"] is not None:
        # Sent again by a client that lost its connection: never wait twice.
        earlier = node.queue.take(env, pid)
        if earlier is not None:
            loop.unwatch(("wait", earlier.wid))
    try:
        task = node.grant(
            env,
            body["gpus"],
            body["memory"],
            pid,
            body["command"],
            pid_start,
            overtakes=node.queue.waiters,
            allowed=allowed,
            estimate=estimate,
            guard=body["guard"],
            wrapper=body["wrapper"] is True,
        )
    except ProtocolError as e:
        wait = min(body["wait"] or 0.0, loop.config.max_wait)
        if e.code != Err.NO_RESOURCES or wait <= 0:
            raise
        w = node.queue.enqueue(
            env,
            body["gpus"],
            body["memory"],
            pid,
            pid_start,
            body["command"],
            wait,
            (conn, envelope, msg_id),
            allowed,
            estimate,
            body["guard"],
            body["waited"],
            earlier,
            e.message,
            wrapper=body["wrapper"] is True,
        )
        if pid is not None:
            try:
                loop.register(("wait", w.wid), os.pidfd_open(pid))
            except OSError:
                node.queue.drop(w.wid)
                raise e from None
        log.info("request from env %s waits (position %d): %s", env, w.told, e.message)
        return protocol.reply(
            "queued", msg_id, position=w.told, waiting=len(node.queue), reason=e.message
        )
    loop.watch(task)
    return protocol.reply("grant", msg_id, **views.grant(node, task))


def _reattach(loop: Loop, task: Task, conn: Conn) -> None:
    """A restored task's client is back: from now on it is watched like any other."""
    task.restored = False
    pid = conn.pid
    if pid is not None and ("task", task.task_id) not in loop.watched:
        task.pid = pid
        task.pid_start = process_start(pid)
        loop.node.store.task_attached(task.task_id, pid, task.pid_start)
        loop.watch(task)
    log.info("task %s re-attached (pid %s)", task.task_id, task.pid)
