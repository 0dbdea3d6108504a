"""The task endpoint's requests (docs/protocol.md, "Task endpoint"): heartbeats, requests
for GPUs (granted, or queued to wait), the user's view and quota, turn yields and the end
of a task. Each environment's socket names the environment a request comes from."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from gpushare.messages import (
    AckReply,
    Done,
    ErrorReply,
    Estimate,
    EstimateReply,
    GrantReply,
    Heartbeat,
    HeldReply,
    Message,
    QueuedReply,
    Quota,
    QuotaReply,
    Request,
    TaskRequest,
    TurnReply,
    View,
    ViewReply,
    Yield,
)
from gpushare.protocol import LS, Err, ProtocolError
from nodemgr.config import Config
from nodemgr.host.procfs import process_start
from nodemgr.node.model import Task
from nodemgr.node.node import Node
from nodemgr.policy.ratelimit import TokenBuckets
from nodemgr.report import env_view, views

if TYPE_CHECKING:
    from nodemgr.host.audit import AuditState
    from nodemgr.loop.connections import ReplyTo, Watched
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


Handler = Callable[[Loop, str, Any, "ReplyTo"], Message]


def handle(loop: Loop, env: str, request: TaskRequest[Any], to: ReplyTo) -> Message:
    """Serve ``request`` from environment ``env``; ``to`` answers it later (a waiting
    request's `grant`, a held yield's `turn`)."""
    return HANDLERS[type(request)](loop, env, request, to)


def _heartbeat(loop: Loop, env: str, req: Heartbeat, to: ReplyTo) -> Message:
    node = loop.node
    told = loop.reclaims.told(env, req.task_id)
    if told is not None:
        return ErrorReply.of(Err.RECLAIMED, told[1], reason=told[0])
    task = node.task(env, req.task_id)
    task.last_seen = time.monotonic()
    if task.restored:
        _reattach(loop, task, to[0])
    return AckReply(
        task_id=task.task_id,
        warning=loop.reclaims.idle_warning(task),
        notices=loop.audit.take_notices(task.task_id) or None,
    )


def _view(loop: Loop, env: str, req: View, to: ReplyTo) -> Message:
    # Each view walks every GPU, holder and waiting request: one environment sending
    # them in a loop must not slow the others' grants.
    if not loop.views.take(env, time.monotonic()):
        raise ProtocolError(
            Err.BUSY,
            f"environment {env} sent more than {loop.config.view_burst} view requests "
            f"at once, or more than {loop.config.views_per_second} a second "
            "(limits.views_per_second, limits.view_burst); ask less often",
        )
    return ViewReply(**env_view.build(loop.node, env))


def _quota(loop: Loop, env: str, req: Quota, to: ReplyTo) -> Message:
    e = loop.node.env(env)
    return QuotaReply(env=e.name, gpus=e.gpus, memory=e.memory)


def _estimate(loop: Loop, env: str, req: Estimate, to: ReplyTo) -> Message:
    node = loop.node
    e = node.env(env)
    out = []
    for model in dict.fromkeys(g.name for g in node.gpus):  # each model once, in GPU order
        est = node.estimate(e, req, model)
        assert est is not None  # an estimate carries all four features
        out.append(
            {
                "model": model,
                "step": est.step_s,
                "utilization": est.utilization,
                "source": est.source,
            }
        )
    return EstimateReply(gpus=out)


def _yield(loop: Loop, env: str, req: Yield, to: ReplyTo) -> Message:
    started = time.perf_counter()
    task = loop.node.task(env, req.task_id)
    passed = loop.node.slicing.yield_turn(task, started, req.iterations, to)
    if passed is None:
        # Held until the task's other processes end the turn too: `held` now, the
        # `turn` reply later (Server._answer_yields).
        return HeldReply(task_id=req.task_id)
    return TurnReply(task_id=req.task_id, passed=passed)


def _done(loop: Loop, env: str, req: Done, to: ReplyTo) -> Message:
    task = loop.node.task(env, req.task_id)
    reason = "killed" if req.signal is not None else "done"
    loop.release(task.task_id, reason, req.exit_code)
    return AckReply(task_id=task.task_id)


def _request(loop: Loop, env: str, req: Request, to: ReplyTo) -> Message:
    node = loop.node
    # Its class resolved before it may wait: the queue orders requests by class.
    req = node.classed(node.env(env), req)
    allowed = node.restriction(req.devices)
    conn = to[0]
    pid = conn.pid
    pid_start = process_start(pid) if pid is not None else None
    earlier = None
    if req.waited is not None:
        # Sent again by a client that lost its connection: never wait twice.
        earlier = node.queue.take(env, pid)
        if earlier is not None:
            loop.unwatch(("wait", earlier.wid))
    try:
        task = node.grant(env, req, pid, pid_start, overtakes=node.queue.waiters, allowed=allowed)
    except ProtocolError as e:
        wait = min(req.wait or 0.0, loop.config.max_wait)
        if e.code != Err.NO_RESOURCES or wait <= 0:
            raise
        w = node.queue.enqueue(env, req, pid, pid_start, wait, to, allowed, earlier, e.message)
        if pid is not None:
            try:
                loop.register(("wait", w.wid), os.pidfd_open(pid))
            except OSError:
                node.queue.drop(w.wid)
                raise e from None
        if req.task_class == LS:
            node.queue_dirty = True  # it may preempt best-effort tasks (Node.serve_queue)
        log.info("request from env %s waits (position %d): %s", env, w.told, e.message)
        return QueuedReply(position=w.told, waiting=len(node.queue), reason=e.message)
    loop.watch(task)
    return GrantReply(**views.grant(node, task))


# One handler per request type the task endpoint serves (messages.TASK_REQUESTS).
HANDLERS: dict[type[TaskRequest[Any]], Handler] = {
    Request: _request,
    Yield: _yield,
    Heartbeat: _heartbeat,
    Done: _done,
    Quota: _quota,
    View: _view,
    Estimate: _estimate,
}


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
