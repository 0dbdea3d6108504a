"""Taking GPUs back from running tasks: why (an operator, a deleted environment, a silent
or idle task), telling their clients on their next heartbeat, and killing those clients
that outlive the grace (docs/operations.md). Idle tasks are found here too, by the policies
nodemgr.policy.idle applies.

The event loop (nodemgr.loop.server) holds one Reclaims and calls it every turn (step) and at
the idle checks; the admin endpoint reclaims through the loop.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from typing import Protocol

from gpushare.sizes import format_duration
from nodemgr.config import Config
from nodemgr.host import procfs
from nodemgr.loop.connections import Connections, Watched
from nodemgr.loop.transport import Conn
from nodemgr.node.model import Task
from nodemgr.node.node import Node
from nodemgr.policy import idle
from nodemgr.report.metrics import Metrics

log = logging.getLogger("nodemgr")

# Reclaimed tasks whose reason a heartbeat can still be told (Reclaims.reclaim).
MAX_TOLD = 4096
# Idle times are brought up to date once a second, not every sweep: idle timeouts are
# minutes, and each check reads every watched task's ledger entry.
IDLE_CHECK_INTERVAL = 1.0


def _children(pid: int) -> list[int] | None:
    """The children of process ``pid`` (every thread's), or None if they cannot be read."""
    found: list[int] = []
    try:
        threads = os.listdir(f"/proc/{pid}/task")
        for tid in threads:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                found += [int(c) for c in f.read().split()]
    except (OSError, ValueError):
        return None
    return found


def kill_commands(client: int, client_fd: int) -> bool:
    """SIGKILL the process group of each child of the wrapper ``client`` (its pid as
    nodemgr sees it; ``client_fd`` its pidfd): gpushare-run runs its command as a child
    leading a process group of its own. Only when every child is such a leader; False
    (nothing killed) when a child is not, or none is found, or the client has ended."""
    children = _children(client)
    # Alive after the read: the children read were this client's, not a later process's.
    try:
        signal.pidfd_send_signal(client_fd, 0)
    except OSError:
        return False
    if not children:
        return False
    fds: list[int] = []
    try:
        for child in children:
            try:
                fds.append(os.pidfd_open(child))
            except OSError:
                return False  # ended meanwhile: the client is killed instead
            # Read after the pidfd is open and checked alive after: the same process.
            # (parent, process group): the client's child, leading a group of its own.
            if procfs.stat_ints(child, 1, 2) != (client, child):
                return False
            try:
                signal.pidfd_send_signal(fds[-1], 0)
            except OSError:
                return False
        for child in children:
            with contextlib.suppress(OSError):
                os.killpg(child, signal.SIGKILL)
        return True
    finally:
        for fd in fds:
            os.close(fd)


class Loop(Protocol):
    """What reclaiming needs of the event loop (nodemgr.loop.server.Server)."""

    config: Config
    node: Node
    connections: Connections
    metrics: Metrics | None

    def release(self, task_id: str, reason: str, exit_code: int | None = None) -> None: ...

    def unregister(self, what: Watched) -> int | None: ...


class Reclaims:
    def __init__(self, loop: Loop) -> None:
        self.loop = loop
        # Reclaimed tasks (reclaim()): why, for their clients' next heartbeat, by task id
        # (env, reason, message), the most recent MAX_TOLD; the pidfds of their clients,
        # killed at the time given unless they ended first.
        self._told: dict[str, tuple[str, str, str]] = {}
        self._doomed: list[tuple[float, int]] = []
        # Connections of deleted environments, and when to drop them.
        self._closing: list[tuple[float, list[Conn]]] = []
        self._next_idle = 0.0

    def reclaim(self, task: Task, reason: str, message: str, record: str | None = None) -> None:
        """Take a task's GPUs back now (its ledger limits drop to 0 at once) and tell its
        client why: the answer to its next heartbeat is a `reclaimed` error with ``reason``
        (protocol.RECLAIM_REASONS) and ``message``, and the client ends its command (or
        itself) and exits with the reason's code. A client still running config.grace
        seconds later is killed, so that nothing keeps using memory that is given back (its
        command dies with it: gpushare-run sets PDEATHSIG). For ``timeout`` the client is
        killed at once, except a wrapper (request.wrapper: gpushare-run) whose command's
        process groups can be killed instead (kill_commands): it stays, holding no memory,
        to hear why when it runs again. ``record``: the end reason the task's record keeps,
        when it is not ``reason``."""
        loop = self.loop
        fd = loop.unregister(("task", task.task_id))
        if fd is not None:
            # A silent gpushare-run (stopped, or starved) holds no GPU memory; its command
            # does. The command is killed now, and gpushare-run, once it runs again, hears
            # why and exits with the reason's code.
            pid = task.pid if reason == "timeout" and task.request.wrapper else None
            if pid is not None and kill_commands(pid, fd):
                log.info("task %s: killed its command; its client stays", task.task_id)
                os.close(fd)
                fd = None
            if fd is not None and reason == "timeout":
                # Presumed hung: killed now, as nothing else would end it.
                with contextlib.suppress(OSError):
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
            if fd is not None:
                self._doomed.append((time.monotonic() + loop.config.grace, fd))
        self._told[task.task_id] = (task.env, reason, message)
        while len(self._told) > MAX_TOLD:
            del self._told[next(iter(self._told))]
        loop.release(task.task_id, record or reason)

    def told(self, env: str, task_id: str) -> tuple[str, str] | None:
        """Why a task of ``env`` that is no longer running was reclaimed (reason, message),
        if it was and that is still known."""
        told = self._told.get(task_id)
        if told is None or told[0] != env or task_id in self.loop.node.tasks:
            return None
        return told[1], told[2]

    def close_env_later(self, name: str) -> None:
        """Stop serving a deleted environment: its socket now, its connections after the
        grace (the clients of its reclaimed tasks hear why on their next heartbeat)."""
        conns = self.loop.connections.unbind_env(name)
        self._closing.append((time.monotonic() + self.loop.config.grace, conns))

    def step(self, now: float) -> None:
        """Every turn of the loop (``now``: monotonic): reclaim the tasks silent past the
        heartbeat timeout, kill the clients that outlived the grace, drop the connections
        of deleted environments whose grace is over."""
        loop = self.loop
        for task in loop.node.expired(now):
            self._reclaim_hung(task)
        # In the order they were reclaimed, each given the same grace: due ones come first.
        if self._doomed and self._doomed[0][0] <= now:
            self._end_doomed(now)
        if self._closing and self._closing[0][0] <= now:
            for conn in self._closing.pop(0)[1]:
                loop.connections.drop(conn)

    def _end_doomed(self, now: float) -> None:
        """Kill the clients of reclaimed tasks that outlived the grace."""
        due = [fd for at, fd in self._doomed if at <= now]
        self._doomed = [(at, fd) for at, fd in self._doomed if at > now]
        for fd in due:
            with contextlib.suppress(OSError):  # ESRCH: it ended by itself
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            os.close(fd)

    def _reclaim_hung(self, task: Task) -> None:
        timeout = self.loop.config.heartbeat_timeout
        log.warning("task %s sent no heartbeat for %.1fs", task.task_id, timeout)
        self.reclaim(
            task,
            "timeout",
            f"GPUs reclaimed: nodemgr heard no heartbeat from this task for {timeout:g}s (was "
            "gpushare-run stopped, or the process too busy to heartbeat?); run the command "
            "again",
        )

    def close(self) -> None:
        """At shutdown: kill the clients of reclaimed tasks that have not ended."""
        for _, fd in self._doomed:
            # Reclaimed, and not yet ended: they were to be killed; nothing may keep memory
            # that the next nodemgr gives out.
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            os.close(fd)
        self._doomed.clear()

    # --- idle tasks (nodemgr.policy.idle) ---------------------------------------------------

    def idle_due(self, now: float) -> bool:
        return now >= self._next_idle

    def check_idle(self, now: float) -> None:
        """Bring idle times up to date; warn, report or reclaim as the policies say.
        ``now``: monotonic, when the next check is due from."""
        self._next_idle = now + IDLE_CHECK_INTERVAL
        node = self.loop.node
        wall = time.time()
        policies = {name: node.idle_policy(e) for name, e in node.envs.items()}
        # Only the tasks of environments with a policy: this reads each task's ledger
        # entry, which with thousands of tasks would cost every turn what it saves.
        watched = {name for name, p in policies.items() if p.on}
        seen = []
        for t in node.tasks.values():
            if t.env not in watched:
                continue
            entry = node.envs[t.env].ledger.task_entry(t.task_id)
            last = (
                entry.last_launch_ns / 1e9 if entry is not None and entry.last_launch_ns else None
            )
            # Without an entry (all were in use) its launches are never dated: never idle.
            blocked = entry is None or entry.paused or entry.gated or entry.class_paused
            seen.append(idle.Seen(t.task_id, t.started, last, blocked, policies[t.env]))
        for d in node.idle.sweep(wall, seen):
            task = node.tasks[d.task_id]
            spent = format_duration(d.idle)
            policy = policies[task.env]
            if d.action == "warn":
                log.info(
                    "task %s env=%s idle for %s: warned",
                    task.task_id,
                    task.env,
                    spent,
                )
            elif d.action == idle.REPORT:
                log.warning(
                    "task %s env=%s idle for %s (launched no kernel; its GPUs could serve others)",
                    task.task_id,
                    task.env,
                    spent,
                )
            else:
                log.warning(
                    "task %s env=%s idle for %s: reclaimed",
                    task.task_id,
                    task.env,
                    spent,
                )
                if self.loop.metrics is not None:
                    self.loop.metrics.idle_reclaimed(d.idle * len(task.gpus))
                self.reclaim(task, "idle", idle.reclaimed(d.idle, policy))

    def idle_warning(self, task: Task) -> str | None:
        """The warning a heartbeat's answer carries while the task is about to be reclaimed
        for idleness."""
        node = self.loop.node
        if not node.idle.warned(task.task_id):
            return None
        spent = node.idle.idle(task.task_id, time.time()) or 0.0
        return idle.warning(spent, node.idle_policy(node.envs[task.env]), task.task_id)
