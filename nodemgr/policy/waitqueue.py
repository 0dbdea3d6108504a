"""The wait queue (docs/scheduling.md, "Wait queue"): requests waiting for GPUs, in order
of arrival, each with its deadline and the handle the server answers it through.

Which of them can be granted is nodemgr.node.node's decision (Node.serve_queue); this module
keeps their order and the caps on how many may wait.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from gpushare.messages import Request
from gpushare.protocol import LS, Err, ProtocolError
from nodemgr.config import Config

# Seconds after nodemgr starts in which a request sent again by its client (`waited`:
# how long it had waited before the restart) is placed by that wait rather than last:
# clients reconnect within a second of the restart, and a later claim is not believed.
RESEND_GRACE = 30.0
# The most requests that may wait at once for one environment, and for one client process
# (each holds a descriptor of its client's process): more are refused with `busy`, so no
# environment's user can exhaust nodemgr's descriptors through the wait queue.
MAX_WAITING_PER_ENV = 64
MAX_WAITING_PER_CLIENT = 4


@dataclass
class Waiter:
    """A request waiting for GPUs (docs/scheduling.md, "Wait queue")."""

    wid: int
    env: str
    request: Request
    pid: int | None
    pid_start: int | None
    enqueued: float  # monotonic
    deadline: float  # monotonic
    reply_to: Any  # the server's handle for answering it
    allowed: frozenset[int] | None = None  # the only GPUs it may get (request.devices); None: any
    bypassed: int = 0  # grants given to later requests while this one waited
    told: int = 0  # the position it was last told
    reason: str = ""  # why it was not granted when last tried (the scheduler's refusal)
    told_reason: str = ""  # the reason it was last told
    # A latency-sensitive request waiting for what the best-effort tasks it preempted free:
    # nothing that competes with it is granted past it meanwhile (docs/scheduling.md).
    preempting: bool = False

    @property
    def rank(self) -> int:
        """Its class's place: latency-sensitive requests are served before best-effort
        ones (docs/scheduling.md, "Classes")."""
        return 0 if self.request.task_class == LS else 1


def competes(w: Waiter, env: str, gpus: tuple[int, ...]) -> bool:
    """Whether granting ``gpus`` to a request of ``env`` overtakes the waiting ``w``
    (docs/scheduling.md, "Wait queue").

    Any grant overtakes a request that may get any GPU. A request restricted to
    some GPUs is overtaken only by grants that could delay it: one of its own
    environment (which uses up its GPU-count quota) or one of a GPU it allows.
    A grant of other GPUs to another environment changes nothing it waits for.
    """
    return w.allowed is None or w.env == env or not w.allowed.isdisjoint(gpus)


class WaitQueue:
    """The waiting requests, in the order they are served."""

    def __init__(self, config: Config, started: float) -> None:
        self.config = config
        self.started = started  # when nodemgr started (wall clock)
        self.waiters: list[Waiter] = []
        self._wids = 0

    def __len__(self) -> int:
        return len(self.waiters)

    def __iter__(self) -> Iterator[Waiter]:
        return iter(self.waiters)

    def _check_room(self, env: str, pid: int | None) -> None:
        """Refuse a request beyond MAX_WAITING_PER_ENV or MAX_WAITING_PER_CLIENT."""
        of_env = [w for w in self.waiters if w.env == env]
        if len(of_env) >= MAX_WAITING_PER_ENV:
            raise ProtocolError(
                Err.BUSY,
                f"environment {env} already has {len(of_env)} requests waiting, the most "
                "nodemgr keeps for one environment; try again when some have been granted",
            )
        if pid is not None and sum(w.pid == pid for w in of_env) >= MAX_WAITING_PER_CLIENT:
            raise ProtocolError(
                Err.BUSY,
                f"process {pid} already has {MAX_WAITING_PER_CLIENT} requests waiting in "
                f"environment {env}, the most nodemgr keeps for one process",
            )

    def enqueue(
        self,
        env: str,
        request: Request,
        pid: int | None,
        pid_start: int | None,
        wait: float,
        reply_to: Any,
        allowed: frozenset[int] | None = None,
        earlier: Waiter | None = None,
        reason: str = "",
    ) -> Waiter:
        """Put a request that may wait ``wait`` seconds at the end of the queue; it is told
        its position at once.

        A request its client sent again (``request.waited`` set; docs/scheduling.md, "Wait
        queue") takes the place of ``earlier``, the same client's request still waiting here,
        or just after start the place its ``waited`` gives it; else it goes last."""
        self._check_room(env, pid)
        self._wids += 1
        now = time.monotonic()
        enqueued, bypassed = now, 0
        if earlier is not None:
            enqueued, bypassed = earlier.enqueued, earlier.bypassed
        elif request.waited is not None and time.time() - self.started < RESEND_GRACE:
            enqueued = now - min(request.waited, self.config.max_wait)
        rank = 0 if request.task_class == LS else 1
        at = next(
            (i for i, q in enumerate(self.waiters) if (q.rank, q.enqueued) > (rank, enqueued)),
            len(self.waiters),
        )
        w = Waiter(
            self._wids,
            env,
            request,
            pid,
            pid_start,
            enqueued=enqueued,
            deadline=now + wait,
            reply_to=reply_to,
            allowed=allowed,
            bypassed=bypassed,
            told=at + 1,
            reason=reason,
            told_reason=reason,
        )
        self.waiters.insert(at, w)
        return w

    def take(self, env: str, pid: int | None) -> Waiter | None:
        """Take out the request client ``pid`` has waiting in ``env``, if any: it is being
        sent again."""
        for i, w in enumerate(self.waiters):
            if pid is not None and w.pid == pid and w.env == env:
                return self.waiters.pop(i)
        return None

    def drop(self, wid: int) -> Waiter | None:
        for i, w in enumerate(self.waiters):
            if w.wid == wid:
                return self.waiters.pop(i)
        return None

    def expired(self, now: float) -> list[Waiter]:
        gone = [w for w in self.waiters if now >= w.deadline]
        if gone:
            self.waiters = [w for w in self.waiters if now < w.deadline]
        return gone
