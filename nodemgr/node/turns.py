"""Time slicing as nodemgr applies it (docs/timeslicing.md): each GPU's mode, the turns,
what each task's ledger entry was last told, the held `yield` requests and the hand-ons
counted per GPU.

The decisions are nodemgr.policy.timeslice's; this module gathers the situation they are made
from (tasks, their ledger entries and regions) and writes each plan into the ledgers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpushare.protocol import MODES, SHARED, TIMESLICED
from nodemgr.config import Config, ConfigError
from nodemgr.host.gpus import Gpu, resolve
from nodemgr.host.ledger import LedgerError, TaskEntry
from nodemgr.node.model import Env, Task
from nodemgr.node.store import Store
from nodemgr.policy import timeslice

log = logging.getLogger("nodemgr")

# A task entry's turn fields as nodemgr creates them: not gated, no turn, no flags.
UNGATED = timeslice.Gate(False, 0, 0)


@dataclass
class HeldYield:
    """``yield`` requests of a task waiting for its other processes (docs/timeslicing.md,
    "Tasks of several processes"): answered when the turn it ends passes, or ends
    otherwise."""

    until: int  # the turn_until of the turn they end
    reply_to: list[Any] = field(default_factory=list)  # the server's handles


class Slicing:
    """The time-slicing state of a node. ``envs`` and ``tasks`` are the node's own
    dictionaries, read here and never changed."""

    def __init__(
        self,
        config: Config,
        gpus: list[Gpu],
        store: Store,
        envs: dict[str, Env],
        tasks: dict[str, Task],
    ) -> None:
        self.config = config
        self.gpus = gpus
        self.store = store
        self.envs = envs
        self.tasks = tasks
        # Each GPU's mode and where it comes from, the turns, what each task's ledger entry
        # was last told, and the hand-ons made per GPU.
        self.modes: dict[int, tuple[str, str]] = self._initial_modes()
        self.turns = timeslice.Turns()
        self.gates: dict[str, timeslice.Gate] = {}
        self.switches: dict[int, int] = {}
        self.last_switch_ms: dict[int, float] = {}
        # Called with (GPU index, seconds) for each hand-on; the server's metrics.
        self.on_switch: Callable[[int, float], None] | None = None
        self._arrivals = 0
        # Per task on a time-sliced GPU: its boundary counts (most, fewest of its processes)
        # as last read, and when they last moved (monotonic); turn_timeout counts from then.
        self.progress: dict[str, tuple[tuple[int, int], float]] = {}
        # Held `yield` requests, per task: one HeldYield per turn they end, oldest first.
        self.held_yields: dict[str, list[HeldYield]] = {}
        # Per task: the turn_until of its last turn that a yield or its barrier ended. A
        # yield for that boundary that comes after (another process of the task got there
        # first) is answered as the one that ended it was.
        self.ended_until: dict[str, int] = {}
        # Tasks told once that they cannot take turns (their ledger has no entry for them).
        self._unsliced: set[str] = set()

    def _initial_modes(self) -> dict[int, tuple[str, str]]:
        """Per GPU index (mode, source): an admin's choice beats the config, which beats
        the default."""
        names = self.config.timeslice_gpus
        if names == "all":
            configured = frozenset(g.index for g in self.gpus)
        else:
            try:
                configured = (
                    resolve(list(names), self.gpus, "timeslice.gpus", None)
                    if names
                    else frozenset()
                )
            except ValueError as e:
                raise ConfigError(str(e)) from None
        admin = self.store.gpu_modes()
        modes = {}
        for g in self.gpus:
            if g.uuid in admin and admin[g.uuid] in MODES:
                modes[g.index] = (admin[g.uuid], "admin")
            elif g.index in configured:
                modes[g.index] = (TIMESLICED, "config")
            else:
                modes[g.index] = (SHARED, "default")
        return modes

    # --- start-up ----------------------------------------------------------------

    def adopt(self, entries: dict[str, TaskEntry]) -> None:
        """Start from the task entries an earlier nodemgr left (restored tasks'): the gates
        they show, and the turns, so the task that held a GPU's turn keeps it."""
        for task_id, entry in entries.items():
            gate = timeslice.Gate(entry.gated, entry.turn_until, entry.flags)
            if gate != UNGATED:
                self.gates[task_id] = gate
        self.turns = self._adopted_turns(entries)

    def _adopted_turns(self, entries: dict[str, TaskEntry]) -> timeslice.Turns:
        """The turns the adopted entries show: on each gated GPU, the holder is its task whose
        entry is not gated and has a turn_until; it keeps that turn_until."""
        now = time.monotonic()
        gpus: dict[int, timeslice.GpuTurn] = {}
        until: dict[str, int] = {}
        order = sorted(self.tasks.values(), key=lambda t: t.arrival)
        for g in self.gpus:
            if not self.timesliced(g.index):
                continue
            on = [t.task_id for t in order if g.index in t.gpus]
            if len(on) < 2:
                continue
            holders = [
                t for t in on if t in entries and not entries[t].gated and entries[t].turn_until
            ]
            holder = holders[0] if holders else None
            if holder is not None:
                until[holder] = entries[holder].turn_until
            waiting = {t: now for t in on if t != holder}
            gpus[g.index] = timeslice.GpuTurn(
                holder, now, dict.fromkeys(on, 0.0), waiting, tuple(on)
            )
        return timeslice.Turns(gpus, until)

    def arrive(self) -> int:
        self._arrivals += 1
        return self._arrivals

    def mode(self, index: int) -> str:
        return self.modes[index][0]

    def timesliced(self, index: int) -> bool:
        return self.modes[index][0] == TIMESLICED

    def quotas(self) -> dict[str, int]:
        return {e.name: e.memory for e in self.envs.values()}

    def members(self, index: int) -> list[timeslice.Member]:
        """The tasks on GPU ``index`` in order of arrival, with what is known of their
        memory there."""
        out = []
        for t in sorted(self.tasks.values(), key=lambda t: t.arrival):
            if index not in t.gpus:
                continue
            r = t.regions
            if r is None or index >= len(r.used):
                out.append(timeslice.Member(t.task_id, t.env, t.guard, t.request.estimate))
                continue
            out.append(
                timeslice.Member(
                    t.task_id,
                    t.env,
                    t.guard,
                    t.request.estimate,
                    r.used[index],
                    r.persistent[index],
                    r.temp_peak[index],
                    r.settled[index],
                    r.iterations,
                    r.releases,
                )
            )
        return out

    def region_charge(self, index: int) -> timeslice.Charge:
        return timeslice.charge(self.members(index), self.quotas())

    def read_regions(self) -> bool:
        """Read the regions of every task on a time-sliced GPU from its ledger; returns
        whether a GPU's charge dropped (it may now admit a waiting request)."""
        sliced = [g.index for g in self.gpus if self.timesliced(g.index)]
        if not sliced:
            return False
        before = {i: self.region_charge(i).total for i in sliced}
        for t in self.tasks.values():
            if any(i in sliced for i in t.gpus):
                t.regions = self.envs[t.env].ledger.task_regions(t.task_id)
            else:
                t.regions = None
        return any(self.region_charge(i).total < before[i] for i in sliced)

    def _idle(self) -> bool:
        """No GPU is time-sliced and no task is gated or holds a turn: nothing to plan. On
        a node of shared GPUs, grants and sweeps then cost nothing here."""
        return (
            not self.gates
            and not self.turns.gpus
            and not any(m == TIMESLICED for m, _ in self.modes.values())
        )

    def _situation(self) -> timeslice.Situation:
        """The tasks that touch a time-sliced GPU, with what the turns need of them; a task
        on shared GPUs only keeps its ledger entry's defaults (not gated, no turn, no
        flags), which _apply restores when a task leaves time slicing."""
        sliced = [t for t in self.tasks.values() if any(self.timesliced(i) for i in t.gpus)]
        sliced.sort(key=lambda t: t.arrival)
        on: dict[int, list[str]] = {}
        iterations = {}
        paused = set()
        now = time.monotonic()
        progress: dict[str, tuple[tuple[int, int], float]] = {}
        for t in sliced:
            for i in t.gpus:
                if self.timesliced(i):
                    on.setdefault(i, []).append(t.task_id)
            ledger = self.envs[t.env].ledger
            entry = ledger.task_entry(t.task_id)
            # Each process yields at its own count: a turn is counted from the most
            # boundaries among the task's live processes, not the entry's all-time count
            # (a process started after another ended begins again at 0).
            live = ledger.task_regions(t.task_id)
            iterations[t.task_id] = live.iterations
            # Held by an operator, or for a latency-sensitive task: its turns go to others.
            if entry is not None and (entry.paused or entry.class_paused):
                paused.add(t.task_id)
            # Progress: the most or the fewest boundaries of its processes moved.
            counts = (live.iterations, live.min_iterations)
            last = self.progress.get(t.task_id)
            progress[t.task_id] = last if last is not None and last[0] == counts else (counts, now)
        self.progress = progress
        return timeslice.Situation(
            on,
            {t.task_id: t.gpus for t in sliced},
            iterations,
            now,
            self.config.quantum,
            {tid: when for tid, (_, when) in progress.items()},
            frozenset(paused),
        )

    def _apply(self, plan: timeslice.Plan, started: float) -> None:
        """Write what changed of each task's gate, turn and flags into its ledger entry:
        first every task that must wait, then those whose turn it is, so two never run
        at once; then count the hand-ons, timed from ``started`` (perf_counter)."""
        self.turns = plan.turns
        changed = [(tid, g) for tid, g in plan.gates.items() if self.gates.get(tid) != g]
        # Tasks no longer on a time-sliced GPU go back to their entries' defaults.
        changed += [
            (tid, UNGATED)
            for tid, g in self.gates.items()
            if tid not in plan.gates and g != UNGATED
        ]
        changed.sort(key=lambda c: not c[1].gated)
        for task_id, gate in changed:
            task = self.tasks.get(task_id)
            if task is None:
                continue
            ledger = self.envs[task.env].ledger
            try:
                if gate.gated:
                    ledger.task_gate(task_id, True)
                    ledger.task_turn(task_id, 0, gate.flags)
                else:
                    ledger.task_turn(task_id, gate.turn_until, gate.flags)
                    ledger.task_gate(task_id, False)
            except LedgerError as e:
                # Its ledger had no free task entry when it started: it runs unsliced.
                if task_id in self._unsliced:
                    log.debug("task %s cannot take turns: %s", task_id, e)
                else:
                    self._unsliced.add(task_id)
                    log.warning(
                        "task %s cannot take turns on its time-sliced GPUs and runs unsliced: %s",
                        task_id,
                        e,
                    )
        self.gates = {tid: g for tid, g in plan.gates.items() if g != UNGATED}
        if plan.handed:
            seconds = time.perf_counter() - started
            for index in plan.handed:
                self.switches[index] = self.switches.get(index, 0) + 1
                self.last_switch_ms[index] = seconds * 1000
                holder = plan.turns.gpus[index].holder
                log.debug("GPU %d: turn to %s in %.3f ms", index, holder, seconds * 1000)
                if self.on_switch is not None:
                    self.on_switch(index, seconds)

    def retime(self, started: float) -> None:
        """Bring the turns in line with the tasks and modes now (after a grant, a release,
        a mode change); ``started``: when the event began (perf_counter)."""
        if self._idle():
            return
        self._apply(timeslice.settle(self.turns, self._situation()), started)

    def yield_turn(
        self,
        task: Task,
        started: float,
        iterations: int | None = None,
        reply_to: Any = None,
    ) -> bool | None:
        """A process of the task yields (docs/timeslicing.md): whether a turn of the task
        went on; None when the answer waits (``reply_to`` is kept, see ``answer_yields``)
        for the task's other iterating processes to reach the end of the turn.

        A yield whose ``iterations`` (the sending process's boundary count) is below the
        task's turn_until is stale or early for this turn: ``False``, nothing changed."""
        until = self.turns.until.get(task.task_id)
        if until is None:
            ended = self.ended_until.get(task.task_id)
            gate = self.gates.get(task.task_id)
            holds = any(t.holder == task.task_id for t in self.turns.gpus.values())
            if ended is not None and iterations is not None and iterations >= ended and not holds:
                # The turn this yield ends is over already, passed at the same boundary by
                # another process's yield or by the barrier (answer_yields).
                return gate is not None and gate.gated
        if until is not None:
            if iterations is not None and iterations < until:
                return False
            if reply_to is not None and not self._barrier_met(task, until):
                # Older held yields (of an earlier turn) stay until they are answered.
                helds = self.held_yields.setdefault(task.task_id, [])
                if not helds or helds[-1].until != until:
                    helds.append(HeldYield(until))
                helds[-1].reply_to.append(reply_to)
                return None
        plan = timeslice.yield_turn(self.turns, self._situation(), task.task_id)
        self._apply(plan, started)
        if plan.passed and until is not None:
            self.ended_until[task.task_id] = until
        return plan.passed

    def _barrier_met(self, task: Task, until: int) -> bool:
        """Every process of the task that steps has reached ``until``: those that reported
        a boundary within the last turn_timeout seconds (one that stopped stepping, a
        parent waiting for its children, say, is not waited for)."""
        since = time.monotonic_ns() - int(self.config.turn_timeout * 1e9)
        _, fewest = self.envs[task.env].ledger.task_barrier(task.task_id, since)
        return fewest == 0 or fewest >= until

    def answer_yields(self) -> list[tuple[Any, str, bool]]:
        """The held yields whose wait is over, as (reply_to, task id, passed): the task's
        iterating processes all reached the end of its turn (the turn passes now), or the
        turn ended otherwise (turn_timeout; passed: true if the task is gated now), or the
        task has ended (passed: false)."""
        out: list[tuple[Any, str, bool]] = []
        for task_id, helds in list(self.held_yields.items()):
            for held in list(helds):
                task = self.tasks.get(task_id)
                if task is None:
                    passed = False
                elif self.turns.until.get(task_id) != held.until:
                    gate = self.gates.get(task_id)
                    passed = gate is not None and gate.gated
                elif self._barrier_met(task, held.until):
                    plan = timeslice.yield_turn(self.turns, self._situation(), task_id)
                    self._apply(plan, time.perf_counter())
                    passed = plan.passed
                    if passed:
                        self.ended_until[task_id] = held.until
                else:
                    continue
                helds.remove(held)
                out += [(to, task_id, passed) for to in held.reply_to]
            if not helds:
                del self.held_yields[task_id]
        return out

    def expire_turns(self) -> None:
        """Pass on the turns of holders stuck for timeslice.turn_timeout (no boundary for
        that long, or never one and a turn that old) or past the end of their turn for that
        long without yielding (timeslice.expire)."""
        if self._idle():
            return
        started = time.perf_counter()
        plan = timeslice.expire(self.turns, self._situation(), self.config.turn_timeout)
        self._apply(plan, started)

    def forget(self, task_id: str) -> None:
        """A task has ended: nothing of its turns is kept (retime hands them on)."""
        self.gates.pop(task_id, None)
        self.progress.pop(task_id, None)
        self.ended_until.pop(task_id, None)
        self._unsliced.discard(task_id)

    def set_mode(self, indices: Sequence[int], mode: str) -> None:
        """An admin's mode for these GPUs: kept in the database, applied at once."""
        started = time.perf_counter()
        now = time.time()
        for index in indices:
            self.store.put_gpu_mode(self.gpus[index].uuid, mode, now)
            old = self.modes[index][0]
            self.modes[index] = (mode, "admin")
            if old != mode:
                log.info("GPU %d is now %s", index, mode)
        self.read_regions()
        self.retime(started)
