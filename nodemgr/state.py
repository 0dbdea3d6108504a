"""What nodemgr knows: environments, their quotas and ledgers, running tasks, the wait queue.

Decisions about GPUs come from nodemgr.scheduler; this module applies them,
keeps each environment's ledger limits and task entries in step with what it
holds, and writes quotas and records through nodemgr.store before a reply
leaves.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nodemgr import scheduler, timeslice
from nodemgr.config import Config, ConfigError, check_gpus
from nodemgr.gpus import Gpu, resolve
from nodemgr.ledger import MAX_TASKS, Ledger, LedgerError, Regions, SlotTotals, TaskEntry
from nodemgr.protocol import MODES, SHARED, TIMESLICED, Err, ProtocolError
from nodemgr.store import Record, Store

log = logging.getLogger("nodemgr")

# A task entry's turn fields as nodemgr creates them: not gated, no turn, no flags.
_UNGATED = timeslice.Gate(False, 0, 0)

# Why a task ended, as records and metrics name it (docs/operations.md).
REASONS = ("done", "killed", "exited", "timeout", "admin", "undelivered")


@dataclass
class Env:
    name: str
    gpus: int  # GPU-count quota
    memory: int  # per-GPU memory quota, bytes
    ledger: Ledger
    endpoint: str
    held: dict[int, set[str]] = field(default_factory=dict)  # GPU index -> task ids
    # GPUs whose last task ended while processes of the environment still held
    # memory there (e.g. a backgrounded child that outlived the command). No
    # new allocation is allowed (limit 0), but the memory stays charged until
    # the ledger shows it returned.
    draining: set[int] = field(default_factory=set)
    usage: dict[str, SlotTotals] = field(default_factory=dict)  # last ledger summary
    launches_done: int = 0  # kernel launches of its ended tasks, since nodemgr started
    # Its ledger's task table was full at the last grant: said once, not per grant.
    tasks_full: bool = False
    # Why its processes may charge a ledger file other than the one at its path (run_dir
    # removed or replaced): no task is granted until they end, then a new ledger replaces
    # it (docs/operations.md, "Storage faults"). None: the ledger is in order.
    orphaned: str | None = None
    adopted: bool = False  # its ledger was the one an earlier nodemgr left


@dataclass
class Task:
    task_id: str
    env: str
    gpus: tuple[int, ...]
    memory: int  # per-GPU memory granted
    pid: int | None  # the client's pid as the kernel reports it, if known
    pid_start: int | None  # its start time, so a reused pid is not mistaken for it
    command: str | None
    started: float  # wall clock
    last_seen: float  # monotonic
    restored: bool = False  # loaded at start-up; its client has not been heard since
    peak: int = 0
    launches: int = 0  # the most kernel launches its live processes counted at once
    # Time slicing (docs/timeslicing.md): its request's estimate (persistent, temporary),
    # the guard after its persistent slices, its place in the order of arrival, and its
    # memory by region as the last sweep read it (tasks on time-sliced GPUs only).
    estimate: tuple[int, int] | None = None
    guard: int = 0
    arrival: int = 0
    regions: Regions | None = None


@dataclass
class HeldYield:
    """``yield`` requests of a task waiting for its other processes (docs/timeslicing.md,
    "Tasks of several processes"): answered when the turn it ends passes, or ends
    otherwise."""

    until: int  # the turn_until of the turn they end
    reply_to: list[Any] = field(default_factory=list)  # the server's handles


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
    need: int
    memory: int | None
    pid: int | None
    pid_start: int | None
    command: str | None
    enqueued: float  # monotonic
    deadline: float  # monotonic
    reply_to: Any  # the server's handle for answering it
    allowed: frozenset[int] | None = None  # the only GPUs it may get; None: any
    bypassed: int = 0  # grants given to later requests while this one waited
    told: int = 0  # the position it was last told
    estimate: tuple[int, int] | None = None  # request.persistent, request.temporary
    guard: int | None = None  # request.guard; None: timeslice.guard


def competes(w: Waiter, env: str, gpus: tuple[int, ...]) -> bool:
    """Whether granting ``gpus`` to a request of ``env`` overtakes the waiting ``w``
    (docs/scheduling.md, "Wait queue").

    Any grant overtakes a request that may get any GPU. A request restricted to
    some GPUs is overtaken only by grants that could delay it: one of its own
    environment (which uses up its GPU-count quota) or one of a GPU it allows.
    A grant of other GPUs to another environment changes nothing it waits for.
    """
    return w.allowed is None or w.env == env or not w.allowed.isdisjoint(gpus)


def process_start(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks after boot, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name may hold spaces and parentheses; fields resume after the last ')'.
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


class RestoreError(Exception):
    """What nodemgr finds at start contradicts its database: serving would lose track of
    memory in use."""


def _open_env_dir(path: Path) -> int:
    """Make ``path`` an empty directory and return a descriptor of it, keeping the directory
    itself if there is one: containers bind-mount it, and a mount keeps showing a replaced
    directory's old, deleted self.

    Its parent is nodemgr's; its entries may be the environment user's doing, so
    they are removed through the descriptor and no link among them is followed."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink()
    path.mkdir(parents=True, mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for name in os.listdir(fd):  # left by an earlier run, or made by a mount: not usable
            try:
                os.unlink(name, dir_fd=fd)
            except IsADirectoryError:
                shutil.rmtree(name, dir_fd=fd)
            except FileNotFoundError:
                pass
    except BaseException:
        os.close(fd)
        raise
    return fd


class Node:
    def __init__(self, config: Config, gpus: list[Gpu], simulated: bool, store: Store) -> None:
        check_gpus(config, {g.index: g.memory for g in gpus}, simulated)
        self.config = config
        self.gpus = gpus
        self.simulated = simulated
        self.store = store
        self.envs: dict[str, Env] = {}
        self.tasks: dict[str, Task] = {}
        self.queue: list[Waiter] = []
        self.lost: set[int] = set()  # GPUs NVML reported lost; never granted again
        self.context_memory = config.context_memory_for(simulated)
        self.started = time.time()
        self._wids = 0
        # Set when something that could serve a waiter has changed.
        self.queue_dirty = False
        # Time slicing: each GPU's mode and where it comes from, the turns, what each task's
        # ledger entry was last told, and the hand-ons made per GPU.
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

    def restore(self) -> list[Task]:
        """Load quotas and running tasks from the database, adopting the ledgers running
        processes still map. Returns the tasks restored; their GPUs stay held, so nothing
        is granted twice while their clients come back."""
        rows = self.store.envs()
        self._check_unknown_ledgers({row.name for row in rows})
        for row in rows:
            try:
                self._open_env(row.name, row.gpus, row.memory, adopt=True)
            except (OSError, LedgerError) as e:
                # Its directory holds something nodemgr cannot clear or write: this
                # environment alone is refused until a `quota set` of it succeeds.
                why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
                log.error(
                    "environment %s refused: cannot prepare %s: %s",
                    row.name,
                    self.config.env_dir(row.name),
                    why,
                )
        now = time.monotonic()
        restored = []
        shapes = self.store.task_shapes()
        for rec in self.store.running():
            env = self.envs.get(rec.env)
            if env is None or any(i >= len(self.gpus) for i in rec.gpus):
                # Its environment or GPU is gone; nothing can be held for it.
                self.store.task_ended(rec.task_id, time.time(), "admin", rec.peak, None)
                continue
            task = Task(
                rec.task_id,
                rec.env,
                rec.gpus,
                rec.memory,
                rec.pid,
                rec.pid_start,
                rec.command,
                rec.started,
                last_seen=now,
                restored=True,
                peak=rec.peak,
                estimate=shapes.get(rec.task_id, (None, 0))[0],
                guard=shapes[rec.task_id][1] if rec.task_id in shapes else self.config.guard,
                arrival=self._arrive(),
            )
            self.tasks[task.task_id] = task
            for index in task.gpus:
                env.held.setdefault(index, set()).add(task.task_id)
            restored.append(task)
        for env in self.envs.values():
            self._restore_entries(env)
            for index in range(len(self.gpus)):
                if index in env.held:
                    env.ledger.set_limit(index, env.memory)
                else:
                    env.ledger.set_limit(index, 0)
                    if env.ledger.used(index):
                        env.draining.add(index)
        if restored:
            log.info("restored %d running tasks; waiting for their clients", len(restored))
        for env in self.envs.values():
            if not env.adopted and any(t.env == env.name for t in restored):
                # Their processes charge a ledger file nodemgr can no longer see: a second
                # quota beside it would overcommit.
                env.orphaned = (
                    "its ledger was missing or invalid at start while it had running tasks, "
                    "whose processes may still charge the old one"
                )
                log.error("env %s: %s; no task is granted until they end", env.name, env.orphaned)
            env.ledger.reap()
            unknown = sorted(set(env.ledger.summary()) - set(self.tasks))
            if unknown:
                # The database lost their records (a lost WAL, kept records a crash took):
                # their memory stays charged to the environment until they end.
                log.error(
                    "env %s: processes of tasks the database has no running record of "
                    "(%s) still use its ledger; their memory stays charged to it",
                    env.name,
                    ", ".join(unknown),
                )
        # What the adopted entries say now (an earlier nodemgr may have left tasks gated,
        # holding a turn or flagged): the first plan corrects whatever it must. The turns
        # start from the entries, so the task that held a GPU's turn keeps it.
        entries = {}
        for task in self.tasks.values():
            entry = self.envs[task.env].ledger.task_entry(task.task_id)
            if entry is not None:
                entries[task.task_id] = entry
                gate = timeslice.Gate(entry.gated, entry.turn_until, entry.flags)
                if gate != _UNGATED:
                    self.gates[task.task_id] = gate
        self.turns = self._adopted_turns(entries)
        self.read_regions()
        self.retime(time.perf_counter())
        return restored

    def _check_unknown_ledgers(self, known: set[str]) -> None:
        """Refuse to start beside live ledgers of environments the database does not know:
        it was emptied, replaced or lost its WAL, and creating such an environment again
        would give it a second quota beside the memory its processes hold."""
        root = self.config.run_dir / "envs"
        try:
            names = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.is_symlink())
        except OSError:
            return
        uuids = [g.uuid_bytes for g in self.gpus]
        live: dict[str, list[int]] = {}
        for name in names:
            if name in known:
                continue
            ledger = Ledger.reopen(root / name / "ledger", uuids)
            if ledger is None:
                continue
            try:
                pids = ledger.live_pids()
            finally:
                ledger.close()
            if pids:
                live[name] = pids
            else:
                log.warning(
                    "%s is left from environment %s, which the database does not know; "
                    "it is replaced if that environment is created",
                    root / name,
                    name,
                )
        if live:
            what = "; ".join(
                f"{name} (pids {', '.join(map(str, pids))})" for name, pids in live.items()
            )
            raise RestoreError(
                f"the database {self.store.path} knows no environment {', '.join(live)}, "
                f"but live processes use their ledgers in {root}: {what}. The database was "
                "emptied, replaced or lost its -wal file: restore it from a backup with its "
                "-wal, or end those processes, then start nodemgr again"
            )

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

    def _restore_entries(self, env: Env) -> None:
        """Free the task entries of tasks that did not survive the restart; give restored
        tasks theirs. An adopted entry is kept as it is, pause word included: the task's
        processes may be waiting on it."""
        for task_id in env.ledger.task_ids():
            task = self.tasks.get(task_id)
            if task is None or task.env != env.name:
                env.ledger.task_remove(task_id)
        for task in self.tasks.values():
            if task.env == env.name:
                self._add_entry(env, task.task_id)

    def _add_entry(self, env: Env, task_id: str) -> None:
        try:
            env.ledger.task_add(task_id)
        except LedgerError as e:
            # The task runs all the same; only pausing it is impossible.
            if env.tasks_full:
                log.debug("env %s: %s", env.name, e)
            else:
                log.warning("env %s: %s (said once until an entry is free)", env.name, e)
            env.tasks_full = True

    # --- quotas --------------------------------------------------------------------

    def _open_env(self, name: str, gpus: int, memory: int, adopt: bool) -> Env:
        env_dir = self.config.env_dir(name)
        access = self.config.access_for(name)
        uuids = [g.uuid_bytes for g in self.gpus]
        path = env_dir / "ledger"
        # Everything inside the directory goes through a descriptor of it: its owner
        # may write there, and nodemgr, as root, must follow nothing it left.
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = -1
        ledger = None
        if adopt:
            with contextlib.suppress(OSError):
                fd = os.open(env_dir, flags)
            ledger = Ledger.reopen(path, uuids, dir_fd=fd) if fd >= 0 else None
        adopted = ledger is not None
        try:
            if ledger is None:
                if fd >= 0:
                    os.close(fd)
                fd = _open_env_dir(env_dir)
                owner = (access.uid, access.gid)
                ledger = Ledger.create(path, uuids, access.mode, owner, dir_fd=fd)
            ledger.chown(access.uid, access.gid, access.mode)
            # The directory's owner is the environment's user; nodemgr, root or
            # the same user, keeps its way in either way.
            os.fchown(fd, access.uid, access.gid)
            os.fchmod(fd, access.dir_mode)
        finally:
            os.close(fd)
        for index in range(len(self.gpus)):
            ledger.set_ctx_charge(index, self.context_memory)
        env = Env(name, gpus, memory, ledger, f"ipc://{env_dir / 'task.sock'}")
        env.adopted = adopted
        self.envs[name] = env
        return env

    def set_quota(self, name: str, gpus: int, memory: int) -> Env:
        """Create or change an environment's quota. A change applies at once to the GPUs
        it holds, where it fits: a raise that would promise a GPU more than its capacity is
        refused (ProtocolError, nothing changed); a lowered one stops new allocations there
        while the environment holds more, and it is charged what it holds until it frees it
        (charged()), so no GPU is ever promised beyond its capacity."""
        env = self.envs.get(name)
        if env is not None and memory > env.memory:
            self._check_raise(env, memory)
        self.store.put_env(name, gpus, memory, time.time())
        if env is None:
            env = self._open_env(name, gpus, memory, adopt=False)
        env.gpus = gpus
        env.memory = memory
        for index in env.held:
            env.ledger.set_limit(index, memory)
        self.queue_dirty = True
        log.info("quota %s: %d GPUs x %d bytes", name, gpus, memory)
        return env

    def over_quota(self, env: Env) -> dict[int, int]:
        """The GPUs where ``env`` holds more than its memory quota, and what it holds."""
        held = {i: env.ledger.used(i) for i in sorted(env.held)}
        return {i: used for i, used in held.items() if used > env.memory}

    def _check_raise(self, env: Env, memory: int) -> None:
        old = env.memory
        env.memory = memory
        try:
            over = [
                (i, self.charged(i), self.capacity(i))
                for i in sorted(env.held)
                if self.charged(i) > self.capacity(i)
            ]
        finally:
            env.memory = old
        if over:
            where = "; ".join(
                f"GPU {i} would be promised {promised} of its {cap} bytes"
                for i, promised, cap in over
            )
            raise ProtocolError(
                Err.NO_RESOURCES,
                f"environment {env.name} cannot have {memory} bytes per GPU while it runs: "
                f"{where}. Raise it by less, or once its tasks there have ended",
            )

    def capacity(self, index: int) -> int:
        """What GPU ``index`` may be promised: its memory less the configured reserve."""
        return max(0, self.gpus[index].memory - self.config.memory_reserve)

    def delete_quota(self, name: str) -> Env:
        """Forget an environment; the caller has ended its tasks and waiters."""
        env = self.env(name)
        self.store.delete_env(name)
        del self.envs[name]
        env.ledger.close()
        shutil.rmtree(self.config.env_dir(name), ignore_errors=True)
        self.queue_dirty = True
        log.info("quota %s deleted", name)
        return env

    def env(self, name: str) -> Env:
        env = self.envs.get(name)
        if env is None:
            raise ProtocolError(
                Err.UNKNOWN_ENV,
                f"no environment {name!r}; create it with: nodemgr quota set {name} "
                "--gpus N --memory SIZE",
            )
        return env

    # --- grants ------------------------------------------------------------------------

    def charged(self, index: int) -> int:
        """Memory promised on a GPU: each holding environment's per-GPU quota, or what it
        holds there when that is more (its quota was lowered below it); on a time-sliced
        GPU, the regions' charge instead, and never less than what is held there; and what
        draining environments still hold there."""
        if self.timesliced(index):
            draining = sum(
                e.ledger.used(index)
                for e in self.envs.values()
                if index in e.draining and index not in e.held
            )
            held = sum(e.ledger.used(index) for e in self.envs.values() if index in e.held)
            return max(self.region_charge(index).total, held) + draining
        return sum(
            max(e.memory, e.ledger.used(index)) if index in e.held else e.ledger.used(index)
            for e in self.envs.values()
            if index in e.held or index in e.draining
        )

    # --- time slicing (docs/timeslicing.md; decisions in nodemgr.timeslice) ---------------

    def _arrive(self) -> int:
        self._arrivals += 1
        return self._arrivals

    def mode(self, index: int) -> str:
        return self.modes[index][0]

    def timesliced(self, index: int) -> bool:
        return self.modes[index][0] == TIMESLICED

    def _quotas(self) -> dict[str, int]:
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
                out.append(timeslice.Member(t.task_id, t.env, t.guard, t.estimate))
                continue
            out.append(
                timeslice.Member(
                    t.task_id,
                    t.env,
                    t.guard,
                    t.estimate,
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
        return timeslice.charge(self.members(index), self._quotas())

    def read_regions(self) -> None:
        """Read the regions of every task on a time-sliced GPU from its ledger; a GPU whose
        charge dropped may now admit a waiting request."""
        sliced = [g.index for g in self.gpus if self.timesliced(g.index)]
        if not sliced:
            return
        before = {i: self.region_charge(i).total for i in sliced}
        for t in self.tasks.values():
            if any(i in sliced for i in t.gpus):
                t.regions = self.envs[t.env].ledger.task_regions(t.task_id)
            else:
                t.regions = None
        if any(self.region_charge(i).total < before[i] for i in sliced):
            self.queue_dirty = True

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
            if entry is not None and entry.paused:
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
            (tid, _UNGATED)
            for tid, g in self.gates.items()
            if tid not in plan.gates and g != _UNGATED
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
        self.gates = {tid: g for tid, g in plan.gates.items() if g != _UNGATED}
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
        env_name: str,
        task_id: str,
        started: float,
        iterations: int | None = None,
        reply_to: Any = None,
    ) -> bool | None:
        """A process of the task yields (docs/timeslicing.md): whether a turn of the task
        went on; None when the answer waits (``reply_to`` is kept, see ``answer_yields``)
        for the task's other iterating processes to reach the end of the turn.

        A yield whose ``iterations`` (the sending process's boundary count) is below the
        task's turn_until is stale or early for this turn: ``False``, nothing changed."""
        task = self.task(env_name, task_id)
        until = self.turns.until.get(task.task_id)
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
                else:
                    continue
                helds.remove(held)
                out += [(to, task_id, passed) for to in held.reply_to]
            if not helds:
                del self.held_yields[task_id]
        return out

    def expire_turns(self) -> None:
        """Pass on the turns of holders stuck for timeslice.turn_timeout (no boundary for
        that long, or never one and a turn that old)."""
        if self._idle():
            return
        started = time.perf_counter()
        plan = timeslice.expire(self.turns, self._situation(), self.config.turn_timeout)
        self._apply(plan, started)

    def gpu_index(self, name: int | str) -> int:
        """The GPU an admin names by index or UUID (or a prefix of one), or ProtocolError."""
        if isinstance(name, int):
            if name >= len(self.gpus):
                raise ProtocolError(
                    Err.BAD_REQUEST,
                    f"no GPU {name} on this node (`nodemgr status` lists its GPUs)",
                )
            return name
        try:
            [index] = resolve([name], self.gpus)
        except ValueError:
            raise ProtocolError(
                Err.BAD_REQUEST,
                f"{name!r} names no single GPU of this node (`nodemgr status` lists them)",
            ) from None
        return index

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
        self.queue_dirty = True

    def modes_view(self, indices: Sequence[int]) -> list[dict[str, object]]:
        return [
            {
                "index": i,
                "uuid": self.gpus[i].uuid,
                "mode": self.modes[i][0],
                "source": self.modes[i][1],
                # Above capacity after a switch to shared, the tasks there run at once and
                # may run out of memory: the CLI says so.
                "charged": self.charged(i),
                "capacity": self.capacity(i),
            }
            for i in indices
        ]

    def check_ledgers(self) -> None:
        """Notice a ledger whose path no longer names it (run_dir removed or replaced)."""
        for env in self.envs.values():
            if env.orphaned is None and not env.ledger.is_at_path():
                env.orphaned = f"its ledger {env.ledger.path} was removed or replaced while in use"
                log.error(
                    "env %s: %s; its running tasks go on, no task is granted until they "
                    "and their processes end, then a new ledger replaces it",
                    env.name,
                    env.orphaned,
                )

    def repair_ledgers(self) -> list[str]:
        """Give each orphaned environment whose tasks and processes have all ended a new
        ledger; returns their names (their sockets went with their old directory)."""
        repaired = []
        for env in list(self.envs.values()):
            if env.orphaned is None or any(t.env == env.name for t in self.tasks.values()):
                continue
            if env.ledger.is_at_path():
                # Made at start beside the lost one: in order once the restored tasks end.
                env.orphaned = None
                log.warning(
                    "env %s: its restored tasks have ended; tasks are granted again", env.name
                )
                self.queue_dirty = True
                continue
            if env.ledger.live_pids():
                continue
            env.ledger.close()
            new = self._open_env(env.name, env.gpus, env.memory, adopt=False)
            new.launches_done = env.launches_done
            log.warning(
                "env %s: a new ledger replaces the lost one; tasks are granted again", env.name
            )
            repaired.append(env.name)
            self.queue_dirty = True
        return repaired

    def env_dir_ready(self, env: Env) -> None:
        """Make an environment's directory again if it went with run_dir."""
        env_dir = self.config.env_dir(env.name)
        if env_dir.is_dir():
            return
        access = self.config.access_for(env.name)
        env_dir.mkdir(parents=True, mode=0o700, exist_ok=True)
        os.chown(env_dir, access.uid, access.gid)
        os.chmod(env_dir, access.dir_mode)

    def settle_draining(self) -> None:
        for env in self.envs.values():
            for index in [i for i in env.draining if env.ledger.used(i) == 0]:
                env.draining.discard(index)
                self.queue_dirty = True
                log.info("env %s released the last of its memory on GPU %d", env.name, index)

    def tasks_on(self, index: int) -> int:
        return sum(len(e.held.get(index, ())) for e in self.envs.values())

    def views(self, new: timeslice.Member | None = None) -> list[scheduler.GpuView]:
        """Every GPU as the scheduler sees it; with ``new`` (a request, its task id
        empty), each time-sliced GPU also says what that request would add to its charge."""
        out = []
        quotas = self._quotas()
        for g in self.gpus:
            capacity = self.capacity(g.index)
            extra = None
            if new is not None and self.timesliced(g.index):
                extra = timeslice.extra(self.members(g.index), quotas, new)
            out.append(
                scheduler.GpuView(
                    g.index,
                    self.tasks_on(g.index),
                    capacity,
                    capacity - self.charged(g.index),
                    g.index not in self.lost,
                    extra,
                )
            )
        return out

    def restriction(self, devices: list[str] | None) -> frozenset[int] | None:
        """The GPUs a request's ``devices`` allow (None: any), or ProtocolError."""
        if devices is None:
            return None
        try:
            return resolve(devices, self.gpus)
        except ValueError as e:
            raise ProtocolError(Err.BAD_REQUEST, str(e)) from None

    def decide(
        self,
        env: Env,
        need: int,
        memory: int | None,
        allowed: frozenset[int] | None = None,
        estimate: tuple[int, int] | None = None,
        guard: int | None = None,
    ) -> scheduler.Choice | scheduler.Refusal:
        ask = scheduler.Ask(
            need,
            env.gpus,
            env.memory,
            {i: len(t) for i, t in env.held.items()},
            memory,
            allowed,
            estimate,
        )
        new = timeslice.Member("", env.name, self._guard(guard), estimate)
        return scheduler.select(ask, self.views(new), self.config.task_threshold)

    def _guard(self, guard: int | None) -> int:
        return self.config.guard if guard is None else guard

    def grant(
        self,
        env_name: str,
        need: int,
        memory: int | None,
        pid: int | None,
        command: str | None,
        pid_start: int | None = None,
        overtakes: Sequence[Waiter] = (),
        allowed: frozenset[int] | None = None,
        estimate: tuple[int, int] | None = None,
        guard: int | None = None,
    ) -> Task:
        """Grant a task, or raise ProtocolError (retryable when the code is no_resources).

        ``overtakes``: the waiting requests this grant would pass. Those it
        competes with (``competes``: all, unless restricted to some GPUs) count
        one more overtaking each if it is made, and it is not made if one of
        them has been overtaken too often already. ``allowed``: the only GPUs
        it may get (None: any). ``estimate`` and ``guard``: the task's shape and guard
        on time-sliced GPUs (docs/timeslicing.md).
        """
        started = time.perf_counter()
        env = self.env(env_name)
        if env.orphaned is not None:
            raise ProtocolError(
                Err.NO_RESOURCES,
                f"environment {env.name}: {env.orphaned}; no task is granted until they end",
            )
        decision = self.decide(env, need, memory, allowed, estimate, guard)
        if isinstance(decision, scheduler.Refusal):
            raise ProtocolError(decision.code, decision.message)
        passed = [w for w in overtakes if competes(w, env.name, decision.gpus)]
        if any(w.bypassed >= self.config.queue_max_bypass for w in passed):
            raise ProtocolError(
                Err.NO_RESOURCES,
                f"{len(overtakes)} earlier requests are waiting and one of them "
                "may not be overtaken again",
            )
        task = Task(
            task_id=secrets.token_hex(8),
            env=env.name,
            gpus=decision.gpus,
            memory=env.memory,
            pid=pid,
            pid_start=pid_start,
            command=command,
            started=time.time(),
            last_seen=time.monotonic(),
            estimate=estimate,
            guard=self._guard(guard),
            arrival=self._arrive(),
        )
        self.store.task_started(
            Record(
                task.task_id,
                env.name,
                task.gpus,
                task.memory,
                pid,
                pid_start,
                command,
                task.started,
                None,
                None,
                0,
                None,
            ),
            task.estimate,
            task.guard,
        )
        # Before the grant leaves: the command's processes look their task up
        # when they claim their ledger slots.
        self._add_entry(env, task.task_id)
        for index in decision.gpus:
            env.held.setdefault(index, set()).add(task.task_id)
            env.draining.discard(index)
        for index in decision.new:
            env.ledger.set_limit(index, env.memory)
        self.tasks[task.task_id] = task
        # Before the grant leaves: on a gated GPU its first allocation must wait its turn.
        self.retime(started)
        for w in passed:
            w.bypassed += 1
        log.info("grant %s env=%s gpus=%s pid=%s", task.task_id, env.name, task.gpus, pid)
        return task

    def task(self, env_name: str, task_id: str) -> Task:
        """The task ``task_id`` of ``env_name``; another environment's task is unknown here."""
        task = self.tasks.get(task_id)
        if task is None or task.env != env_name:
            raise ProtocolError(
                Err.UNKNOWN_TASK, f"no running task {task_id!r} in this environment"
            )
        return task

    def release(self, task_id: str, reason: str, exit_code: int | None = None) -> Task | None:
        """Give back what a task holds and record why; None if it was already gone."""
        started = time.perf_counter()
        task = self.tasks.pop(task_id, None)
        if task is None:
            return None
        env = self.envs[task.env]
        # Read while the task's entry is there: it holds the task's exact peak.
        totals = env.ledger.task_usage(task_id)
        # Freeing the entry also lets go of any launch a pause still holds.
        if env.ledger.task_remove(task_id):
            env.tasks_full = False
        task.peak = max(task.peak, totals.peak)
        task.launches = max(task.launches, totals.launches)
        env.launches_done += task.launches
        for index in task.gpus:
            holders = env.held.get(index)
            if holders is None:
                continue
            holders.discard(task_id)
            if not holders:
                del env.held[index]
                env.ledger.set_limit(index, 0)
                env.draining.add(index)
        # Its turns go on at once (a holder that has gone hands on).
        self.gates.pop(task_id, None)
        self.progress.pop(task_id, None)
        self._unsliced.discard(task_id)
        self.retime(started)
        self.store.task_ended(task_id, time.time(), reason, task.peak, exit_code)
        self.queue_dirty = True
        log.info("release %s env=%s reason=%s", task_id, task.env, reason)
        return task

    def pause(self, task_id: str, paused: bool) -> Task:
        """Hold (or let go) a running task's kernel launches through its ledger entry.

        The pause word lives only in the ledger, which survives a nodemgr
        restart: views read it from there, so they never disagree with it.
        """
        task = self.tasks.get(task_id)
        if task is None:
            raise ProtocolError(Err.UNKNOWN_TASK, f"no running task {task_id!r}")
        try:
            self.envs[task.env].ledger.task_pause(task_id, paused)
        except LedgerError:
            raise ProtocolError(
                Err.NOT_PAUSABLE,
                f"task {task_id} has no entry in its environment's ledger (all "
                f"{MAX_TASKS} were in use when it started), so its launches cannot be held",
            ) from None
        log.info("%s %s env=%s", "pause" if paused else "resume", task_id, task.env)
        # A paused holder gives its turns to a task that can use them; resumed, it waits.
        self.retime(time.perf_counter())
        return task

    def expired(self, now: float) -> list[Task]:
        limit = self.config.heartbeat_timeout
        return [t for t in self.tasks.values() if now - t.last_seen > limit]

    def sample(self) -> None:
        """Read every ledger once: what tasks use now and the most they have used."""
        for env in self.envs.values():
            env.usage = env.ledger.summary()
            self.note_usage(env.usage)

    def note_usage(self, usage: dict[str, SlotTotals]) -> None:
        """Fold slot totals (live, or of processes just reaped) into their tasks' peaks."""
        for task_id, totals in usage.items():
            task = self.tasks.get(task_id)
            if task is not None:
                task.peak = max(task.peak, totals.peak)
                task.launches = max(task.launches, totals.launches)

    # --- wait queue --------------------------------------------------------------------

    def _check_room(self, env: str, pid: int | None) -> None:
        """Refuse a request beyond MAX_WAITING_PER_ENV or MAX_WAITING_PER_CLIENT."""
        of_env = [w for w in self.queue if w.env == env]
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
        need: int,
        memory: int | None,
        pid: int | None,
        pid_start: int | None,
        command: str | None,
        wait: float,
        reply_to: Any,
        allowed: frozenset[int] | None = None,
        estimate: tuple[int, int] | None = None,
        guard: int | None = None,
        waited: float | None = None,
        earlier: Waiter | None = None,
    ) -> Waiter:
        """Put a request at the end of the queue; it is told its position at once.

        A request its client sent again (``waited`` set; docs/scheduling.md, "Wait queue")
        takes the place of ``earlier``, the same client's request still waiting here, or
        just after start the place its ``waited`` gives it; else it goes last."""
        self._check_room(env, pid)
        self._wids += 1
        now = time.monotonic()
        enqueued, bypassed = now, 0
        if earlier is not None:
            enqueued, bypassed = earlier.enqueued, earlier.bypassed
        elif waited is not None and time.time() - self.started < RESEND_GRACE:
            enqueued = now - min(waited, self.config.max_wait)
        at = next((i for i, q in enumerate(self.queue) if q.enqueued > enqueued), len(self.queue))
        w = Waiter(
            self._wids,
            env,
            need,
            memory,
            pid,
            pid_start,
            command,
            enqueued=enqueued,
            deadline=now + wait,
            reply_to=reply_to,
            allowed=allowed,
            bypassed=bypassed,
            told=at + 1,
            estimate=estimate,
            guard=guard,
        )
        self.queue.insert(at, w)
        return w

    def take_waiter(self, env: str, pid: int | None) -> Waiter | None:
        """Take out the request client ``pid`` has waiting in ``env``, if any: it is being
        sent again."""
        for i, w in enumerate(self.queue):
            if pid is not None and w.pid == pid and w.env == env:
                return self.queue.pop(i)
        return None

    def serve_queue(self) -> tuple[list[tuple[Waiter, Task]], list[tuple[Waiter, ProtocolError]]]:
        """Grant waiting requests in order as far as the policy allows.

        A request that cannot be served yet is passed over, unless it has been
        overtaken ``queue_max_bypass`` times: then nothing behind it that
        competes with it is served until it is (for a request that may get any
        GPU, nothing behind it at all). Returns the grants made and the
        requests that can never be served (their quota changed, say).
        """
        granted: list[tuple[Waiter, Task]] = []
        failed: list[tuple[Waiter, ProtocolError]] = []
        self.queue_dirty = False
        i = 0
        while i < len(self.queue):
            w = self.queue[i]
            try:
                # Those ahead of it were passed over without reaching the limit.
                task = self.grant(
                    w.env,
                    w.need,
                    w.memory,
                    w.pid,
                    w.command,
                    w.pid_start,
                    self.queue[:i],
                    w.allowed,
                    w.estimate,
                    w.guard,
                )
            except ProtocolError as e:
                if e.code != Err.NO_RESOURCES:
                    self.queue.pop(i)
                    failed.append((w, e))
                    continue
                if w.bypassed >= self.config.queue_max_bypass and w.allowed is None:
                    break
                i += 1
                continue
            self.queue.pop(i)
            granted.append((w, task))
        return granted, failed

    def drop_waiter(self, wid: int) -> Waiter | None:
        for i, w in enumerate(self.queue):
            if w.wid == wid:
                return self.queue.pop(i)
        return None

    def expired_waiters(self, now: float) -> list[Waiter]:
        gone = [w for w in self.queue if now >= w.deadline]
        if gone:
            self.queue = [w for w in self.queue if now < w.deadline]
        return gone

    # --- views -----------------------------------------------------------------

    def quota_view(self, env: Env) -> dict[str, object]:
        return {"env": env.name, "gpus": env.gpus, "memory": env.memory, "endpoint": env.endpoint}

    def task_view(self, task: Task, usage: dict[str, SlotTotals]) -> dict[str, object]:
        totals = usage.get(task.task_id, SlotTotals())
        entry = self.envs[task.env].ledger.task_entry(task.task_id)
        stamped = entry.last_launch_ns if entry is not None else 0
        return {
            "task_id": task.task_id,
            "env": task.env,
            "pid": task.pid,
            "gpus": list(task.gpus),
            "memory_limit": task.memory,
            "memory_used": totals.used,
            "peak": max(task.peak, totals.peak),
            "launches": totals.launches,
            "processes": totals.processes,
            "started": task.started,
            "command": task.command,
            "attached": not task.restored,
            "paused": entry is not None and entry.paused,
            "last_launch": stamped / 1e9 if stamped else None,
            "gated": entry is not None and entry.gated,
            "iterations": entry.iterations if entry is not None else 0,
            "regions": self._task_regions(task),
        }

    def _task_regions(self, task: Task) -> list[dict[str, int]]:
        sliced = [i for i in task.gpus if self.timesliced(i)]
        if not sliced:
            return []
        r = self.envs[task.env].ledger.task_regions(task.task_id)
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

    def tasks_view(self, env: str | None) -> list[dict[str, object]]:
        usage = {
            name: e.ledger.summary() for name, e in self.envs.items() if env is None or name == env
        }
        tasks = sorted(self.tasks.values(), key=lambda t: t.started)
        return [self.task_view(t, usage[t.env]) for t in tasks if t.env in usage]

    def queue_view(self) -> list[dict[str, object]]:
        now = time.monotonic()
        return [
            {
                "position": pos,
                "env": w.env,
                "gpus": w.need,
                "pid": w.pid,
                "waited": now - w.enqueued,
                "timeout_in": max(0.0, w.deadline - now),
                "bypassed": w.bypassed,
                "command": w.command,
                "devices": None if w.allowed is None else sorted(w.allowed),
            }
            for pos, w in enumerate(self.queue, 1)
        ]

    def status_view(self) -> dict[str, object]:
        gpus = []
        for g, view in zip(self.gpus, self.views(), strict=True):
            holders = {e.name for e in self.envs.values() if g.index in e.held}
            used = sum(e.ledger.used(g.index) for e in self.envs.values())
            gpus.append(
                {
                    "index": g.index,
                    "uuid": g.uuid,
                    "name": g.name,
                    "memory": g.memory,
                    "reserve": min(g.memory, self.config.memory_reserve),
                    "charged": self.charged(g.index),
                    "used": used,
                    "tasks": view.tasks,
                    "envs": sorted(holders),
                    "lost": g.index in self.lost,
                    "mode": self.mode(g.index),
                    "regions": self._regions_view(g.index),
                    "turn": self._turn_view(g.index),
                }
            )
        return {
            "version": _version(),
            "simulated": self.simulated,
            "uptime": time.time() - self.started,
            "pid": os.getpid(),
            "envs": len(self.envs),
            "tasks": len(self.tasks),
            "waiting": len(self.queue),
            "task_threshold": self.config.task_threshold,
            "gpus": gpus,
        }

    def _regions_view(self, index: int) -> dict[str, object] | None:
        if not self.timesliced(index):
            return None
        members = self.members(index)
        c = timeslice.charge(members, self._quotas())
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

    def _turn_view(self, index: int) -> dict[str, object] | None:
        turn = self.turns.gpus.get(index)
        if turn is None:
            return None
        return {
            "holder": turn.holder,
            "held_for": time.monotonic() - turn.since if turn.holder is not None else 0.0,
            "quantum": self.config.quantum,
            "order": turn.order(),
            "switches": self.switches.get(index, 0),
            "last_switch_ms": self.last_switch_ms.get(index),
        }

    def close(self) -> None:
        for env in self.envs.values():
            env.ledger.close()
        self.store.close()


def _version() -> str:
    from nodemgr import __version__

    return __version__
