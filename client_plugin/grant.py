"""Getting, keeping and ending a grant: what gpushare-run and the auto-loader share.

The client's flow (docs/client.md): request GPUs; when it is for lack of resources, wait
(nodemgr's queue) and ask again; on success run, heartbeat, and say done at
the end. Refusals arrive as :mod:`gpushare.client` exceptions.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, TextIO

from client_plugin.settings import DEFAULT_PROGRESS_INTERVAL, Settings, wait_seconds
from gpushare import libs, messages, paths
from gpushare.client import (
    FIRST_ANSWER,
    Connection,
    NoResources,
    QuotaExceeded,
    Reclaimed,
    Unreachable,
)
from gpushare.envvars import (
    BOARD,
    ENDPOINT,
    LEDGER,
    SIM_GPUS,
    SIM_STATE_DIR,
    SIM_TIMELINE,
    SIM_TIMELINE_PARAMS,
    TASK_ID,
    TASK_OWNER,
    TIMESLICED,
)
from gpushare.errors import GpushareError
from gpushare.exitcodes import EXIT_RECLAIMED_OTHER, RECLAIM_EXIT_CODES
from gpushare.messages import AckReply, Done, HeldReply, QueuedReply, Request
from gpushare.protocol import names_gpu
from gpushare.sizes import format_clock, plural

MAX_COMMAND = 4096  # what nodemgr keeps of a command line, for display
REQUEST_TIMEOUT = 10.0  # seconds for nodemgr to answer, on top of any wait


class Progress:
    """The wait for a grant, on stderr: redrawn in place on a terminal, else plain lines.

    Plain lines come when the queue position or the reason for the wait changes, and at
    least every ``interval`` seconds in between, so a log shows the wait goes on without
    being flooded."""

    def __init__(
        self,
        prefix: str,
        gpus: int,
        stream: TextIO | None = None,
        interval: float = DEFAULT_PROGRESS_INTERVAL,
    ) -> None:
        self.prefix = prefix
        self.gpus = gpus
        self.stream = stream if stream is not None else sys.stderr
        self.interval = interval
        try:
            self.tty = self.stream.isatty()
        except (AttributeError, ValueError):
            self.tty = False
        self.started = time.monotonic()
        self.position: int | None = None
        self.waiting: int | None = None
        self.reason = ""
        self.drawn = False
        self.said = self.started  # when the last plain line was written

    def _status(self) -> str:
        where = f"position {self.position} of {self.waiting}" if self.position else "queued"
        waited = format_clock(time.monotonic() - self.started)
        return f"{self.prefix}: waiting for {plural(self.gpus, 'GPU')}: {where}, waited {waited}"

    def _line(self) -> None:
        """A plain line: position, time waited, and why."""
        reason = f" ({self.reason})" if self.reason else ""
        self._write(self._status() + reason + "\n")
        self.said = time.monotonic()

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):
            pass  # a closed stderr must not end the wait

    def queued(self, update: QueuedReply) -> None:
        first = self.position is None
        self.position = update.position or None
        self.waiting = update.waiting or None
        reason = update.reason
        if reason and reason != self.reason:
            self.reason = reason
            self.clear()
            said = "no GPUs free now" if first else "still waiting"
            self._write(f"{self.prefix}: {said}: {reason}\n")
        if self.tty:
            self.tick()
        else:
            self._line()

    def lost(self, endpoint: str, lost: bool) -> None:
        """nodemgr's connection broke (``lost``), or is back and the request sent again."""
        self.clear()
        if lost:
            self._write(
                f"{self.prefix}: nodemgr is not answering at {endpoint}; the request is "
                "sent again when it is back, and keeps waiting\n"
            )
        else:
            self._write(f"{self.prefix}: nodemgr is back; the request was sent again\n")

    def tick(self) -> None:
        if self.position is None:
            return
        if self.tty:
            self._write("\r" + self._status() + "\x1b[K")
            self.drawn = True
        elif time.monotonic() - self.said >= self.interval:
            self._line()

    def clear(self) -> None:
        if self.drawn:
            self._write("\r\x1b[K")
            self.drawn = False

    def done(self, granted: bool) -> None:
        """End the display: on a grant after a wait, one line saying how long it took."""
        waited = self.position is not None
        self.clear()
        if granted and waited:
            took = format_clock(time.monotonic() - self.started)
            self._write(f"{self.prefix}: granted after waiting {took}\n")


def cancelled(endpoint: str, progress: Progress) -> str:
    """What to say when the user interrupts the wait for a grant: before nodemgr answered
    at all, that is what was being waited for."""
    if progress.position is None:
        return f"cancelled before nodemgr answered at {endpoint} (is it running?)"
    return "cancelled while waiting for GPUs"


@dataclass(frozen=True)
class Grant:
    task_id: str
    gpus: tuple[Mapping[str, Any], ...]
    ledger: str  # the path as this process sees it
    memory_limit: int
    heartbeat_interval: float
    simulated: bool
    sim_gpus: str | None
    # The simulated node's process table's directory (None: a nodemgr that names none).
    sim_state_dir: str | None = None
    endpoint: str = ""  # where it was granted: the task's processes reach nodemgr there
    timesliced: tuple[int, ...] = ()  # node indices of its time-sliced GPUs
    # The simulated device timeline's parameters by name when it is on; None: off.
    sim_timeline: Mapping[str, Any] | None = None

    @property
    def uuids(self) -> str:
        return ",".join(str(g["uuid"]) for g in self.gpus)


def local_ledger(granted: str, endpoint: str) -> str:
    """The ledger's path here. nodemgr names it as it sees it; in a container the
    environment's directory is mounted elsewhere, with the ledger beside the socket."""
    if endpoint.startswith(paths.IPC):
        beside = paths.ledger_beside(endpoint)
        if os.path.exists(beside):
            return beside
    return granted


def _request_once(
    s: Settings, endpoint: str, command: str, wait: float, progress: Progress, wrapper: bool
) -> Grant:
    request = Request(
        gpus=s.gpus,
        memory=s.memory,
        command=command[:MAX_COMMAND],
        wait=wait or None,
        devices=list(s.devices) if s.devices else None,
        persistent=s.persistent,
        temporary=s.temporary,
        guard=s.guard,
        compute=s.compute,
        wrapper=True if wrapper else None,
        task_class=s.task_class,
        step_target=s.step_target,
        deadline=s.deadline or None,
        steps=s.steps,
        predicted=s.predicted,
        **(s.features or {}),
    )
    asked = time.monotonic()
    queued_at: list[float] = []

    def queued(update: QueuedReply | HeldReply) -> None:
        if not queued_at:
            queued_at.append(time.monotonic())
        if isinstance(update, QueuedReply):
            progress.queued(update)

    def resend() -> Request:
        """The same request to a restarted nodemgr: the wait left, and how long it waited
        (docs/protocol.md, "Restarts"), so it keeps its place."""
        now = time.monotonic()
        waited = now - queued_at[0] if queued_at else 0.0
        return replace(request, wait=max(0.0, wait - (now - asked)) or None, waited=waited)

    with Connection(endpoint, timeout=REQUEST_TIMEOUT) as conn:
        reply = conn.send(
            request,
            timeout=REQUEST_TIMEOUT + wait,
            on_queued=queued,
            on_tick=progress.tick if wait else None,
            first_answer=FIRST_ANSWER,
            resend=resend if wait else None,
            on_lost=lambda lost: progress.lost(endpoint, lost),
        )
    return Grant(
        task_id=reply.task_id,
        gpus=tuple(reply.gpus),
        ledger=local_ledger(reply.ledger, endpoint),
        memory_limit=reply.memory_limit,
        heartbeat_interval=reply.heartbeat_interval,
        simulated=reply.simulated,
        sim_gpus=reply.sim_gpus,
        sim_state_dir=reply.sim_state_dir,
        endpoint=endpoint,
        timesliced=tuple(reply.timesliced),
        sim_timeline=reply.sim_timeline,
    )


def acquire(s: Settings, command: str, progress: Progress, wrapper: bool = False) -> Grant:
    """Request a grant, waiting as the settings allow. ``wrapper``: the caller runs the
    task's command as its children and holds no GPU memory itself (gpushare-run). Raises
    Unreachable or a NodeError subclass (QuotaZero, QuotaExceeded, NoResources, ...)."""
    if not s.endpoint:
        raise ValueError("no endpoint")
    if s.devices == ():
        raise QuotaExceeded(
            "quota_exceeded",
            "CUDA_VISIBLE_DEVICES is set but empty, which allows no GPU: unset it, or name "
            "the GPUs this task may use",
        )
    deadline = None if s.wait_timeout is None else time.monotonic() + s.wait_timeout
    granted = False
    try:
        while True:
            asked = time.monotonic()
            left = None if deadline is None else max(0.0, deadline - asked)
            wait = wait_seconds(s) if left is None else min(wait_seconds(s), left)
            try:
                grant = _request_once(s, s.endpoint, command, wait, progress, wrapper)
                granted = True
                _check_restriction(s, grant)
                return grant
            except NoResources:
                # The node cuts each wait to its own limit: ask again while ours lasts.
                if not wait or (deadline is not None and time.monotonic() >= deadline):
                    raise
                time.sleep(max(0.0, min(1.0, asked + 1.0 - time.monotonic())))
    finally:
        progress.done(granted)


def _allowed(gpu: Mapping[str, Any], devices: tuple[str, ...]) -> bool:
    index, uuid = int(gpu.get("index", -1)), str(gpu.get("uuid", ""))
    return any(names_gpu(d, index, uuid) for d in devices)


def _check_restriction(s: Settings, grant: Grant) -> None:
    """A nodemgr older than the ``devices`` field ignores it: never run outside it."""
    if not s.devices or all(_allowed(g, s.devices) for g in grant.gpus):
        return
    assert s.endpoint is not None
    release(s.endpoint, grant.task_id)
    raise QuotaExceeded(
        "quota_exceeded",
        f"nodemgr granted GPUs outside CUDA_VISIBLE_DEVICES={','.join(s.devices)} (it is "
        "older than this client and ignores the restriction): upgrade nodemgr, or unset "
        "CUDA_VISIBLE_DEVICES",
    )


def task_environment(
    grant: Grant, base: Mapping[str, str], owner: int, preload: bool = True
) -> dict[str, str]:
    """A task process's environment: the grant's GPUs, the shim, the driver to use."""
    env = dict(base)
    if preload:
        shim = str(libs.shim_path())
        present = env.get("LD_PRELOAD", "").replace(":", " ").split()
        if shim not in present:
            env["LD_PRELOAD"] = " ".join([shim, *present])
    env["CUDA_VISIBLE_DEVICES"] = grant.uuids
    env[LEDGER] = grant.ledger
    env[TASK_ID] = grant.task_id
    board = paths.board_beside(grant.ledger)
    if os.path.exists(board):
        env[BOARD] = board
    else:
        env.pop(BOARD, None)
    if grant.endpoint:
        # A process of the task tells nodemgr itself when its turn on a time-sliced GPU ends.
        env[ENDPOINT] = grant.endpoint
    if grant.timesliced:
        env[TIMESLICED] = ",".join(str(i) for i in grant.timesliced)
    else:
        env.pop(TIMESLICED, None)
    env[TASK_OWNER] = str(owner)
    if grant.simulated:
        dirs = [str(libs.sim_driver_dir())]
        if env.get("LD_LIBRARY_PATH"):
            dirs.append(env["LD_LIBRARY_PATH"])
        env["LD_LIBRARY_PATH"] = ":".join(dirs)
        env[SIM_GPUS] = grant.sim_gpus or ""
        if grant.sim_state_dir:
            # Every process of the task records in its nodemgr's table, and no other's.
            env[SIM_STATE_DIR] = grant.sim_state_dir
        _sim_timeline(env, grant.sim_timeline)
    return env


def _sim_timeline(env: dict[str, str], params: Mapping[str, Any] | None) -> None:
    """A node whose simulated GPUs keep a device timeline has every task's processes time
    their work, with the node's parameters."""
    if params is None:
        return
    env[SIM_TIMELINE] = "1"
    for key, name in SIM_TIMELINE_PARAMS.items():
        value = params.get(key)
        # A number, as nodemgr sends it; anything else leaves the driver its default.
        if isinstance(value, int | float) and not isinstance(value, bool):
            env[name] = repr(value)


def cpu_environment(base: Mapping[str, str], owner: int) -> dict[str, str]:
    """A CPU-only run's environment: no GPU visible, and no process of it asks for one."""
    env = dict(base)
    env["CUDA_VISIBLE_DEVICES"] = ""
    env[TASK_OWNER] = str(owner)
    for key in (LEDGER, TASK_ID, BOARD):
        env.pop(key, None)
    return env


def inherited_owner(environ: Mapping[str, str] | None = None) -> int | None:
    """The pid holding the task this process belongs to, if an ancestor holds one."""
    env = os.environ if environ is None else environ
    try:
        owner = int(env.get(TASK_OWNER, ""))
    except ValueError:
        return None
    return owner if owner > 0 else None


class Heartbeat:
    """Keeps nodemgr told that the task lives; warns once when it stops answering, and
    once when nodemgr warns that the task is about to be reclaimed (docs/client.md,
    "Reclaimed tasks"). When nodemgr has reclaimed the task, ``reclaimed`` says why."""

    def __init__(
        self, endpoint: str, task_id: str, interval: float, say: Callable[[str], None]
    ) -> None:
        self.task_id = task_id
        self.interval = interval
        self.say = say
        self.conn = Connection(endpoint, timeout=max(min(interval, 5.0), 0.5))
        self.warned = False
        self.idle_warned = False
        self.reclaimed: Reclaimed | None = None

    def beat(self) -> None:
        if self.reclaimed is not None:
            return
        try:
            reply = self.conn.send(messages.Heartbeat(task_id=self.task_id))
            if self.warned:
                self.say("nodemgr answers again")
                self.warned = False
            warning = reply.warning
            if warning and not self.idle_warned:
                self.say(warning)
            self.idle_warned = bool(warning)
            self._notices(reply)
        except Reclaimed as e:
            self.reclaimed = e
        except GpushareError as e:  # nodemgr refused, or did not answer
            if not self.warned:
                self.say(f"heartbeat failed, the task keeps running: {e}")
                self.warned = True

    def ask_reclaimed(self) -> None:
        """One heartbeat only to learn whether nodemgr has reclaimed the task (then
        ``reclaimed`` says why), or killed a process of it (its notices are said); nothing
        else is said."""
        if self.reclaimed is not None:
            return
        try:
            self._notices(self.conn.send(messages.Heartbeat(task_id=self.task_id)))
        except Reclaimed as e:
            self.reclaimed = e
        except GpushareError:
            pass

    def _notices(self, ack: AckReply) -> None:
        """Say what nodemgr tells the task once (an `ack`'s ``notices``: why the bypass
        audit killed one of its processes)."""
        for notice in ack.notices or ():
            self.say(notice)

    def done(self, code: int | None, signum: int | None = None) -> None:
        if self.reclaimed is not None:
            self.conn.close()  # nodemgr ended the task already
            return
        try:
            report_done(self.conn, self.task_id, code, signum, self.say)
        finally:
            self.conn.close()


def reclaimed_exit(e: Reclaimed) -> tuple[str, int]:
    """The line to print for a reclaimed task, and the exit code of its reason."""
    return e.message, RECLAIM_EXIT_CODES.get(e.reason, EXIT_RECLAIMED_OTHER)


def report_done(
    conn: Connection,
    task_id: str,
    code: int | None,
    signum: int | None,
    say: Callable[[str], None] | None,
) -> None:
    """Say ``done`` for a task; a failure is said through ``say`` (None: silently), since
    nodemgr reclaims the task anyway once its client is gone."""
    try:
        conn.send(Done(task_id=task_id, exit_code=code, signal=signum))
    except GpushareError as e:  # nodemgr refused, or did not answer
        if say is not None:
            say(f"could not report the end of the task (nodemgr reclaims it anyway): {e}")


def release(
    endpoint: str,
    task_id: str,
    code: int | None = None,
    say: Callable[[str], None] | None = None,
) -> None:
    """End a task at once, before anything ran under it, on a connection of its own."""
    try:
        with Connection(endpoint, timeout=5.0) as conn:
            report_done(conn, task_id, code, None, say)
    except Unreachable as e:
        if say is not None:
            say(f"could not report the end of the task (nodemgr reclaims it anyway): {e}")
