"""Idle tasks (docs/nodemgr.md, "Idle tasks"): how long each task has launched no kernel,
and what the idle policy makes of it. State in, decisions out: the event loop
(nodemgr.loop.server) feeds each sweep's view of the tasks and acts on the decisions.

A task is idle from its last kernel launch (as the sweeps stamp it in the ledger), or from
its grant when it never launched. A task that cannot launch is not idle: while paused by an
operator, or waiting for its turn on a time-sliced GPU, its idle time starts again.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from gpushare.protocol import IDLE_ACTIONS
from gpushare.sizes import format_duration

ACTIONS = IDLE_ACTIONS
RECLAIM, REPORT = ACTIONS


@dataclass(frozen=True)
class Policy:
    """An environment's idle policy: seconds of no launch before the action (0: off), how
    long before a reclaim its user is warned, and the action."""

    timeout: float
    warn_before: float
    action: str

    @property
    def on(self) -> bool:
        return self.timeout > 0


@dataclass(frozen=True)
class Seen:
    """One task as a sweep saw it: wall-clock times in seconds."""

    task_id: str
    started: float  # its grant
    last_launch: float | None  # its processes' last kernel launch, None: never
    blocked: bool  # paused, or waiting for a time-sliced GPU's turn: it cannot launch
    policy: Policy


@dataclass
class _State:
    since: float  # idle since (wall clock)
    warned: bool = False  # its user has been warned of the reclaim to come
    reported: bool = False  # report-only: said once in the log


@dataclass(frozen=True)
class Decision:
    task_id: str
    action: str  # "warn", "reclaim" or "report"
    idle: float  # seconds idle


class Tracker:
    """Each running task's idle time, and where it stands with its policy."""

    def __init__(self) -> None:
        self._tasks: dict[str, _State] = {}

    def sweep(self, now: float, tasks: Iterable[Seen]) -> list[Decision]:
        """Bring every task's idle time up to ``now``; the actions its policy calls for.
        A warning is decided once per idle spell, a report once per task."""
        decisions = []
        seen = set()
        for t in tasks:
            seen.add(t.task_id)
            active = max(t.started, t.last_launch or 0.0)
            state = self._tasks.get(t.task_id)
            if state is None:
                state = self._tasks[t.task_id] = _State(min(active, now))
            if t.blocked:
                active = now
            if active > state.since:
                state.since = min(active, now)
                state.warned = False  # a launch ends the spell
            idle = now - state.since
            p = t.policy
            if not p.on:
                continue
            if p.action == RECLAIM:
                if idle >= p.timeout:
                    decisions.append(Decision(t.task_id, RECLAIM, idle))
                elif idle >= p.timeout - p.warn_before and not state.warned:
                    state.warned = True
                    decisions.append(Decision(t.task_id, "warn", idle))
            elif idle >= p.timeout and not state.reported:
                state.reported = True
                decisions.append(Decision(t.task_id, REPORT, idle))
        for gone in set(self._tasks) - seen:
            del self._tasks[gone]
        return decisions

    def idle(self, task_id: str, now: float) -> float | None:
        """Seconds the task has been idle as of the last sweep's view, None: not yet seen."""
        state = self._tasks.get(task_id)
        return None if state is None else max(0.0, now - state.since)

    def warned(self, task_id: str) -> bool:
        state = self._tasks.get(task_id)
        return state is not None and state.warned


def warning(idle: float, policy: Policy, task_id: str) -> str:
    """What the user of a task about to be reclaimed is told (once, on stderr). The idle
    time is rounded down and the time left up, so the two add up to the timeout (not one
    second short) and time left is never said as 0s."""
    left = math.ceil(max(0.0, policy.timeout - idle))
    return (
        f"task {task_id} has launched no kernel for {format_duration(idle)}: its GPUs are "
        f"reclaimed in {format_duration(left)} unless a kernel runs (the idle timeout of its "
        f"environment is {format_duration(policy.timeout)})"
    )


def reclaimed(idle: float, policy: Policy) -> str:
    """Why an idle task was reclaimed, and what to do: its client prints it."""
    return (
        f"GPUs reclaimed: no kernel launched for {format_duration(idle)} (the environment's "
        f"idle timeout is {format_duration(policy.timeout)}); run the command again to get "
        "GPUs, and end idle sessions when done"
    )
