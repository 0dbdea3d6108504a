"""What nodemgr knows: environments, their quotas and ledgers, running tasks.

Decisions about GPUs come from nodemgr.policy.scheduler; this module applies them,
keeps each environment's ledger limits and task entries in step with what it
holds, and writes quotas and records through nodemgr.node.store before a reply
leaves. A Node holds the wait queue (nodemgr.policy.waitqueue) and the time slicing
(nodemgr.node.turns); nodemgr.report.views reads it for replies. Restoring it at start, and
replacing ledgers lost while it runs, is nodemgr.node.recovery's.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import os
import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from gpushare import paths
from gpushare.messages import FEATURE_FIELDS, REQUIRED_FEATURES, Estimate, Request, features_of
from gpushare.protocol import BE, CLASS_LONG, LS, Err, ProtocolError
from gpushare.sizes import MAX_SIZE, MiB, format_size
from nodemgr.config import Config, check_gpus
from nodemgr.host import envdirs
from nodemgr.host.board import Board
from nodemgr.host.gpus import Gpu, resolve
from nodemgr.host.ledger import MAX_TASKS, Ledger, LedgerError, Schedule, SlotTotals
from nodemgr.node.elastic_unit import ElasticUnit
from nodemgr.node.model import Env, Task
from nodemgr.node.store import Record, Store
from nodemgr.node.turns import Slicing
from nodemgr.policy import compute, idle, scheduler, steptime, timeslice
from nodemgr.policy.waitqueue import Waiter, WaitQueue, competes

log = logging.getLogger("nodemgr")

# Why a task ended, as records and metrics name it (docs/operations.md).
REASONS = ("done", "killed", "exited", "timeout", "admin", "idle", "undelivered", "preempted")


@dataclass(frozen=True)
class Lending:
    """How a latency-sensitive request sees the node (docs/scheduling.md, "Classes"): a
    best-effort environment whose tasks on a shared GPU are all held for LS tasks is
    charged there what it holds, not its quota, and held tasks do not count toward the task
    threshold. Every other request sees them as if they ran, so that the room they gave up
    is only ever lent to LS tasks and they can take it back when those end.

    A plan (Node.plan_preemption) asks what if: ``paused`` would be held too, ``gone``
    requeued (their memory, and what tasks requeued earlier still drain, counted free:
    it comes back once their processes end); ``resumed`` asks what a held task's resumption
    would charge."""

    paused: frozenset[str] = frozenset()
    gone: frozenset[str] = frozenset()
    resumed: frozenset[str] = frozenset()
    planning: bool = False


# Seconds past prediction.topup_wait after which an ask no process can still wait for is
# dropped (Node.top_up).
TOPUP_GRACE = 2.0

# Recorded runs the step time estimate learns from, the newest (Node.runs).
RUNS_KEPT = 1000

# What an LS request sees without a plan.
LEND = Lending()


class Node:
    def __init__(
        self,
        config: Config,
        gpus: list[Gpu],
        simulated: bool,
        store: Store,
        contexts: dict[int, tuple[int, str]],
    ) -> None:
        # Each GPU's context charge and where it comes from (nodemgr.host.ctxprobe.charges).
        self.contexts = contexts
        self.context_memory = {i: nbytes for i, (nbytes, _) in contexts.items()}
        check_gpus(config, {g.index: g.memory for g in gpus}, self.context_memory)
        self.config = config
        self.gpus = gpus
        self.simulated = simulated
        self.store = store
        # What NVML says of each GPU, by index (describe): none until the server asks.
        self.specs: dict[int, steptime.GpuSpec] = {}
        self.envs: dict[str, Env] = {}
        self.tasks: dict[str, Task] = {}
        # Running tasks by environment and by (environment, client pid as granted), each
        # capped ([limits]; check_task_room): every task holds a pidfd of its client.
        self.tasks_of_env: collections.Counter[str] = collections.Counter()
        self.tasks_of_client: collections.Counter[tuple[str, int]] = collections.Counter()
        self._counted: dict[str, tuple[str, int | None]] = {}
        # The cap per environment: limits.tasks_per_env, lowered by the server to what the
        # descriptor limit allows (connections.task_cap).
        self.max_tasks_per_env = config.tasks_per_env
        # No task has been silent since before this (monotonic): a lower bound of every
        # task's last_seen, kept as tasks are added (a heartbeat only raises one), so that
        # expired() scans the tasks only once the earliest of them may be past the timeout.
        self._seen_floor = math.inf
        self.lost: set[int] = set()  # GPUs NVML reported lost; never granted again
        # GPUs an admin drained (kept in the database): no new grants, tasks run on.
        drained = store.drained_gpus()
        self.drained: set[int] = {g.index for g in gpus if g.uuid in drained}
        self.started = time.time()
        self.queue = WaitQueue(config, self.started)
        # Set when something that could serve a waiter has changed.
        self.queue_dirty = False
        # Time slicing (docs/timeslicing.md): modes, turns, gates, held yields.
        self.slicing = Slicing(config, gpus, store, self.envs, self.tasks)
        # How long each task has launched no kernel (nodemgr.policy.idle).
        self.idle = idle.Tracker()
        # Classes (docs/scheduling.md, "Classes"): the best-effort tasks held for
        # latency-sensitive ones, and the (environment, GPU) pairs where tasks requeued for
        # them still drain.
        self.held_for_ls: set[str] = set()
        self.evicting: set[tuple[str, int]] = set()
        # The node's board of latency-sensitive activity (docs/compute.md), linked into
        # each environment's directory: made with the first environment's directory, once
        # the run directory is this nodemgr's; None where it could not be.
        self.board: Board | None = None
        self._board_tried = False
        # The elastic rule's state (docs/compute.md, "Elastic share").
        self.elastic = ElasticUnit(self)
        # Admission by prediction (docs/prediction.md#admission): per (environment,
        # command), the most per-GPU memory a run measured beyond its prediction, which
        # the next prediction of that command is raised to; and the top-ups given and
        # refused since start.
        self.learned: dict[tuple[str, str | None], int] = store.missed_peaks()
        self.topups = 0
        self.topups_refused = 0
        # Asks for top-ups waiting for room, in the order they came: (environment, GPU)
        # -> the bytes they need beyond its grants there and when first seen (monotonic);
        # and the asks refused, said once until the environment asks no more (top_up).
        self.topup_pending: dict[tuple[str, int], tuple[int, float]] = {}
        self.topup_said: set[tuple[str, int]] = set()
        # Told each ended task's measured peak over its predicted one (the metrics).
        self.on_predicted_end: Callable[[float], None] | None = None
        # Step time (docs/prediction.md#step-time): the recorded runs of tasks sent with
        # features, oldest first, what nodemgr.policy.steptime learns from.
        self.runs: list[steptime.Run] = store.runs(RUNS_KEPT)

    def add_entry(self, env: Env, task_id: str) -> None:
        """Give a task its entry in its environment's ledger (what pauses and gates it)."""
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

    def open_env(self, name: str, gpus: int, memory: int, adopt: bool) -> Env:
        """Make an environment's directory and ledger (``adopt``: keep the ledger there,
        if it is valid, with what running processes charge to it) and hold it."""
        env_dir = self.config.env_dir(name)
        access = self.config.access_for(name)
        uuids = [g.uuid_bytes for g in self.gpus]
        sizes = [g.memory for g in self.gpus]
        path = env_dir / paths.LEDGER
        # Everything inside the directory goes through a descriptor of it: its owner
        # may write there, and nodemgr, as root, must follow nothing it left.
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = -1
        ledger = None
        if adopt:
            with contextlib.suppress(OSError):
                fd = os.open(env_dir, flags)
            ledger = Ledger.reopen(path, uuids, dir_fd=fd, memory=sizes) if fd >= 0 else None
        adopted = ledger is not None
        try:
            if ledger is None:
                if fd >= 0:
                    os.close(fd)
                fd = envdirs.open_empty(env_dir)
                owner = (access.uid, access.gid)
                ledger = Ledger.create(path, uuids, access.mode, owner, dir_fd=fd, memory=sizes)
            ledger.chown(access.uid, access.gid, access.mode)
            # The directory's owner is the environment's user; nodemgr, root or
            # the same user, keeps its way in either way.
            os.fchown(fd, access.uid, access.gid)
            os.fchmod(fd, access.dir_mode)
        finally:
            os.close(fd)
        for index in range(len(self.gpus)):
            ledger.set_ctx_charge(index, self.context_memory[index])
        # Its processes start a pacer, which sleeps until their task has a schedule.
        ledger.set_compute(True)
        ledger.set_topup_wait(self.config.topup_wait)
        self._link_board(env_dir)
        env = Env(name, gpus, memory, ledger, paths.endpoint(self.config.env_socket(name)))
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
            env = self.open_env(name, gpus, memory, adopt=False)
        env.gpus = gpus
        env.memory = memory
        for index in env.held:
            self.set_held_limit(env, index)
        self.queue_dirty = True
        log.info("quota %s: %d GPUs x %d bytes", name, gpus, memory)
        return env

    def _link_board(self, env_dir: os.PathLike[str]) -> None:
        """The board beside the environment's ledger, where its containers see it."""
        if not self._board_tried:
            self._board_tried = True
            try:
                self.board = Board.open_or_create(self.config.run_dir / paths.BOARD, len(self.gpus))
            except OSError as e:
                log.warning("no board of latency classes in %s: %s", self.config.run_dir, e)
        if self.board is None:
            return
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(env_dir, flags)
            try:
                self.board.link_into(fd, paths.BOARD)
            finally:
                os.close(fd)
        except OSError as e:
            log.warning("cannot link the board into %s: %s", env_dir, e)

    def set_compute_cap(self, name: str, cap: int | None) -> Env:
        """An environment's cap on each of its tasks' compute shares (None: none): kept
        across restarts, applied to its running tasks at once."""
        env = self.env(name)
        self.store.put_env_compute(name, cap)
        env.compute = cap
        log.info("compute cap %s: %s", name, "none" if cap is None else f"{cap}%")
        self.apply_compute()
        return env

    def share(self, task_id: str, share: int | None) -> tuple[Task, list[str]]:
        """Change a running task's compute share (None: none), kept with its request, and
        apply every GPU's schedule again; the task and what the policy scaled, in words."""
        task = self.tasks.get(task_id)
        if task is None:
            raise ProtocolError(Err.UNKNOWN_TASK, f"no running task {task_id!r}")
        task.request = replace(task.request, compute=share)
        self.store.task_request(task_id, task.request)
        log.info("share %s env=%s: %s", task_id, task.env, "none" if share is None else share)
        return task, self.apply_compute()

    def compute_members(self) -> list[compute.Member]:
        """The running tasks as the compute policy sees them."""
        return [
            compute.Member(
                t.task_id, t.gpus, self.elastic.share(t), self.envs[t.env].compute, t.task_class
            )
            for t in sorted(self.tasks.values(), key=lambda t: t.arrival)
        ]

    def apply_compute(self) -> list[str]:
        """Plan every GPU's compute schedule (nodemgr.policy.compute) and write each task's
        into its ledger entry where it changed; returns what the policy scaled, in words."""
        c = self.config
        settings = compute.Settings(
            int(c.compute_period * 1e9), int(c.compute_poll * 1e9), int(c.compute_ls_idle * 1e9)
        )
        plan = compute.plan(self.compute_members(), settings)
        for note in plan.notes:
            log.warning("compute: %s", note)
        for task_id, w in plan.windows.items():
            task = self.tasks[task_id]
            schedule = Schedule() if w is None else Schedule(**vars(w))
            if task.schedule == schedule:
                continue
            try:
                ledger = self.envs[task.env].ledger
                ledger.task_schedule(task_id, schedule)
                # A schedule with flags asks processes without a pacer to start one
                # (settle_pacers); without, they need none.
                if task.waking_pacers and not schedule.flags:
                    ledger.task_wake_pacers(task_id, False)
            except LedgerError as e:
                log.warning("task %s: no compute schedule: %s", task_id, e)
                continue
            task.schedule = schedule
            task.waking_pacers = bool(schedule.flags)
        return plan.notes

    def settle_pacers(self) -> None:
        """Once every live process of a task with a schedule runs its pacer, its launches
        no longer need to go out of line to start one: clear GS_PAUSE_COMPUTE. A process
        that claims its slot later starts its pacer there, since its task has a schedule
        (and one that claimed before the schedule was published is counted here: a claim
        marks its slot before it reads its task's schedule)."""
        for task in self.tasks.values():
            if not task.waking_pacers:
                continue
            ledger = self.envs[task.env].ledger
            pacing = ledger.task_pacing(task.task_id)
            if pacing.pacers == pacing.processes:
                with contextlib.suppress(LedgerError):
                    ledger.task_wake_pacers(task.task_id, False)
                task.waking_pacers = False

    def set_idle(self, name: str, timeout: float | None, action: str | None) -> Env:
        """Give an environment its own idle policy (None: the node's), kept across
        restarts; it applies to its running tasks at the next sweep."""
        env = self.env(name)
        self.store.put_env_idle(name, timeout, action)
        env.idle_timeout, env.idle_action = timeout, action
        log.info("idle policy %s: timeout %s, action %s", name, timeout, action)
        return env

    def set_classes(self, name: str, class_default: str | None, allow_ls: bool | None) -> Env:
        """Set an environment's own class default and LS permission (None: unchanged),
        kept across restarts (docs/scheduling.md, "Classes")."""
        env = self.env(name)
        default = env.class_default if class_default is None else class_default
        allowed = env.allow_ls if allow_ls is None else allow_ls
        self.store.put_env_classes(name, default, allowed)
        env.class_default, env.allow_ls = default, allowed
        log.info("classes %s: default %s, LS allowed %s", name, default, allowed)
        return env

    def class_default(self, env: Env) -> str:
        """The class of an environment's tasks whose request names none."""
        return self.config.class_default if env.class_default is None else env.class_default

    def allows_ls(self, env: Env) -> bool:
        return self.config.allow_ls_default if env.allow_ls is None else env.allow_ls

    def classed(self, env: Env, request: Request) -> Request:
        """``request`` with its class resolved (nil: the environment's default), or
        ProtocolError (class_not_allowed) for an LS request the environment may not make."""
        task_class = request.task_class or self.class_default(env)
        if task_class == LS and not self.allows_ls(env):
            raise ProtocolError(
                Err.CLASS_NOT_ALLOWED,
                f"environment {env.name} may not run latency-sensitive tasks; run it as "
                f"best-effort (--class be), or ask an admin to allow them: nodemgr quota set "
                f"{env.name} --allow-ls",
            )
        if task_class != LS and (request.step_target or request.deadline):
            raise ProtocolError(
                Err.BAD_REQUEST,
                "a step target or deadline is for latency-sensitive tasks: run it with "
                '--class ls (docs/compute.md, "Elastic share")',
            )
        if (request.deadline is None) != (request.steps is None):
            raise ProtocolError(
                Err.BAD_REQUEST, "a deadline needs the run's number of steps, and steps a deadline"
            )
        given = {name for name in FEATURE_FIELDS if getattr(request, name) is not None}
        if given and not given.issuperset(REQUIRED_FEATURES):
            raise ProtocolError(
                Err.BAD_REQUEST,
                f"the dry run's features come with {', '.join(REQUIRED_FEATURES[:-1])} and "
                f"{REQUIRED_FEATURES[-1]}: all four, or no feature (docs/protocol.md)",
            )
        if request.task_class == task_class:
            return request
        return replace(request, task_class=task_class)

    def idle_policy(self, env: Env) -> idle.Policy:
        """The idle policy of an environment's tasks: its own, else the node's."""
        c = self.config
        timeout = c.idle_timeout if env.idle_timeout is None else env.idle_timeout
        action = c.idle_action if env.idle_action is None else env.idle_action
        return idle.Policy(timeout, c.idle_warn_before, action)

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
                f"GPU {i} would be promised {format_size(promised)} of its {format_size(cap)}"
                for i, promised, cap in over
            )
            raise ProtocolError(
                Err.NO_RESOURCES,
                f"environment {env.name} cannot have {format_size(memory)} per GPU while it runs: "
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
        envdirs.remove(self.config.env_dir(name))
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

    def charged(self, index: int, lending: Lending | None = None) -> int:
        """Memory promised on a GPU: each holding environment's per-GPU quota, or what it
        holds there when that is more (its quota was lowered below it); on a time-sliced
        GPU, the regions' charge instead, and never less than what is held there; and what
        draining environments still hold there. What an environment holds is what its
        ledger says within what nodemgr let it hold (Ledger.held): a ledger written to say
        more costs the other environments nothing."""
        if self.slicing.timesliced(index):
            draining = sum(
                e.ledger.held(index)
                for e in self.envs.values()
                if index in e.draining and index not in e.held
            )
            held = sum(e.ledger.held(index) for e in self.envs.values() if index in e.held)
            return max(self.slicing.region_charge(index).total, held) + draining
        if lending is not None:
            return self._lent_charge(index, lending)
        return sum(
            max(self.allowance(e, index), e.ledger.held(index))
            if index in e.held
            else e.ledger.held(index)
            for e in self.envs.values()
            if index in e.held or index in e.draining
        )

    def _held_for_ls(self, task_id: str, lending: Lending) -> bool:
        if task_id in lending.resumed:
            return False
        return task_id in lending.paused or task_id in self.held_for_ls

    def _lent_charge(self, index: int, lending: Lending) -> int:
        """A shared GPU's charge as an LS request sees it (Lending)."""
        total = 0
        for e in self.envs.values():
            ids = e.held.get(index, set()) - lending.gone
            if index not in e.held:
                if index not in e.draining:
                    continue
                if lending.planning and (e.name, index) in self.evicting:
                    continue
                total += e.ledger.held(index)
            elif not ids:
                # All requeued: what they hold comes back once their processes end.
                continue
            elif all(self._held_for_ls(t, lending) for t in ids):
                total += e.ledger.held(index)
            else:
                total += max(self.allowance(e, index), e.ledger.held(index))
        return total

    def all_held_for_ls(self, env: Env, index: int) -> bool:
        """Whether every task of ``env`` on GPU ``index`` is held for LS tasks."""
        ids = env.held.get(index, set())
        return bool(ids) and all(t in self.held_for_ls for t in ids)

    def allowance(self, env: Env, index: int, grant: int | None = None) -> int:
        """What ``env`` is charged on GPU ``index`` it holds (with a new task granted
        ``grant`` there, when given): its per-GPU quota, or, on a shared GPU where each of
        its tasks was granted by prediction (docs/prediction.md#admission), the sum of
        their grants, at most the quota."""
        if self.slicing.timesliced(index):
            return env.memory
        grants = [self.tasks[t].grant for t in env.held.get(index, ()) if t in self.tasks]
        if grant is not None:
            grants.append(grant)
        if not grants or None in grants:
            return env.memory
        return min(env.memory, sum(g for g in grants if g is not None))

    def set_held_limit(self, env: Env, index: int) -> None:
        """The ledger limit of a GPU the environment holds: its allowance (its quota, or
        what its tasks there were granted by prediction, topped up to the quota on
        request), or, while all its tasks there are held for LS tasks, what it holds (it
        has lent the rest)."""
        if self.all_held_for_ls(env, index) and not self.slicing.timesliced(index):
            env.ledger.set_limit(index, min(env.memory, env.ledger.held(index)))
            env.ledger.set_topup(index, 0)
            return
        allowed = self.allowance(env, index)
        env.ledger.set_limit(index, allowed)
        env.ledger.set_topup(index, env.memory if allowed < env.memory else 0)

    def predicted_grant(self, env: Env, request: Request) -> int | None:
        """What a task of ``request`` is granted per shared GPU: its predicted peak (or
        the peak an earlier run of the same command measured beyond its prediction, when
        more; at least 1 MiB) times 1 + prediction.margin, in whole MiB, and one process's
        context, at most the quota; None: a request without a prediction, granted the
        quota."""
        if request.predicted is None:
            return None
        need = max(request.predicted, self.learned.get((env.name, request.command), 0), MiB)
        grant = math.ceil(need * (1.0 + self.config.predict_margin) / MiB) * MiB
        # The dry run's context takes nothing; here each process is charged its context
        # (gpus.context_memory): one process's is granted besides.
        return min(env.memory, grant + max(self.context_memory.values(), default=0))

    # --- GPU modes (time slicing itself: nodemgr.node.turns) -------------------------

    def gpu_indices(self, name: int | str | None) -> list[int]:
        """The GPUs an admin request names: one (gpu_index), or every GPU for None."""
        return list(range(len(self.gpus))) if name is None else [self.gpu_index(name)]

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

    def set_drained(self, indices: Sequence[int], drained: bool) -> None:
        """Drain these GPUs (no new grants; their tasks run on) or take them back: kept in
        the database, applied at once; what waits is tried again."""
        now = time.time()
        for index in indices:
            self.store.put_drained(self.gpus[index].uuid, drained, now)
            if drained and index not in self.drained:
                log.info("GPU %d is drained: no new tasks are granted on it", index)
            elif not drained and index in self.drained:
                log.info("GPU %d is no longer drained", index)
            (self.drained.add if drained else self.drained.discard)(index)
        self.queue_dirty = True

    def set_mode(self, indices: Sequence[int], mode: str) -> None:
        """An admin's mode for these GPUs: kept in the database, applied at once."""
        self.slicing.set_mode(indices, mode)
        # A GPU's mode decides its holders' limits (allowance): shared, their grants by
        # prediction; time-sliced, their quotas.
        for env in self.envs.values():
            for index in indices:
                if index in env.held:
                    self.set_held_limit(env, index)
        self.queue_dirty = True

    def read_regions(self) -> None:
        """Read the regions of tasks on time-sliced GPUs (Slicing.read_regions); a GPU whose
        charge dropped may now admit a waiting request."""
        if self.slicing.read_regions():
            self.queue_dirty = True

    def settle_draining(self) -> None:
        for env in self.envs.values():
            for index in [i for i in env.draining if env.ledger.used(i) == 0]:
                env.draining.discard(index)
                self.evicting.discard((env.name, index))
                self.queue_dirty = True
                log.info("env %s released the last of its memory on GPU %d", env.name, index)

    # --- the scheduler's view of the GPUs, and grants -----------------------------

    def tasks_on(self, index: int, lending: Lending | None = None) -> int:
        if lending is None:
            return sum(len(e.held.get(index, ())) for e in self.envs.values())
        return sum(
            not self._held_for_ls(t, lending)
            for e in self.envs.values()
            for t in e.held.get(index, ())
            if t not in lending.gone
        )

    def views(
        self,
        new: timeslice.Member | None = None,
        lending: Lending | None = None,
        shared: tuple[Env, int | None] | None = None,
    ) -> list[scheduler.GpuView]:
        """Every GPU as the scheduler sees it; with ``new`` (a request, its task id
        empty), each time-sliced GPU also says what that request would add to its charge;
        with ``lending``, as a latency-sensitive request sees it (Lending); with
        ``shared`` (an environment and a predicted grant), each shared GPU says what that
        grant would add to the environment's charge there."""
        out = []
        quotas = self.slicing.quotas()
        for g in self.gpus:
            capacity = self.capacity(g.index)
            extra = None
            if new is not None and self.slicing.timesliced(g.index):
                extra = timeslice.extra(self.slicing.members(g.index), quotas, new)
            elif shared is not None and (g.index in shared[0].held or shared[1] is not None):
                extra = self._added(shared[0], g.index, shared[1])
            # Time-sliced GPUs are charged by their regions: nothing is lent there.
            lent = None if self.slicing.timesliced(g.index) else lending
            out.append(
                scheduler.GpuView(
                    g.index,
                    self.tasks_on(g.index, lending),
                    capacity,
                    capacity - self.charged(g.index, lent) - self._held_back(g.index),
                    g.index not in self.lost,
                    extra,
                    drained=g.index in self.drained,
                )
            )
        return out

    def _added(self, env: Env, index: int, grant: int | None) -> int:
        """What a task granted ``grant`` (None: the quota) adds to ``env``'s charge on
        shared GPU ``index``: its allowance there with the task, less its charge there now.
        A GPU it holds only for tasks granted by prediction is charged less than the quota:
        a new task there adds to that, whether sent with a prediction or not."""
        if index not in env.held:
            # What it still drains there stays charged beside the new allowance.
            return env.memory if grant is None else min(env.memory, grant)
        now = max(self.allowance(env, index), env.ledger.held(index))
        return max(0, max(self._allowance_with(env, index, grant), env.ledger.held(index)) - now)

    def _allowance_with(self, env: Env, index: int, grant: int | None) -> int:
        """``env``'s allowance on GPU ``index`` with a new task granted ``grant`` there
        (None: the quota)."""
        return env.memory if grant is None else self.allowance(env, index, grant)

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
        request: Request,
        allowed: frozenset[int] | None = None,
        lending: Lending | None = None,
    ) -> scheduler.Choice | scheduler.Refusal:
        hints = [m for m in (request.memory, request.predicted) if m is not None]
        ask = scheduler.Ask(
            request.gpus,
            env.gpus,
            env.memory,
            {i: len(t) for i, t in env.held.items()},
            max(hints) if hints else None,
            allowed,
            request.estimate,
        )
        new = timeslice.Member("", env.name, self._guard(request), request.estimate)
        shared = (env, self.predicted_grant(env, request))
        return scheduler.select(ask, self.views(new, lending, shared), self.config.task_threshold)

    def _guard(self, request: Request) -> int:
        """The guard a task of ``request`` gets: its own, else ``timeslice.guard``."""
        return self.config.guard if request.guard is None else request.guard

    def grant(
        self,
        env_name: str,
        request: Request,
        pid: int | None,
        pid_start: int | None = None,
        overtakes: Sequence[Waiter] = (),
        allowed: frozenset[int] | None = None,
    ) -> Task:
        """Grant a task for ``request`` from client ``pid`` of ``env_name``, or raise
        ProtocolError (retryable when the code is no_resources).

        ``overtakes``: the waiting requests this grant would pass. Those it
        competes with (``competes``: all, unless restricted to some GPUs) count
        one more overtaking each if it is made, and it is not made if one of
        them has been overtaken too often already. ``allowed``: the only GPUs
        it may get (``request.devices`` resolved; None: any).
        """
        started = time.perf_counter()
        env = self.env(env_name)
        if env.orphaned is not None:
            raise ProtocolError(
                Err.NO_RESOURCES,
                f"environment {env.name}: {env.orphaned}; no task is granted until they end",
            )
        self.check_task_room(env.name, pid)
        request = self.classed(env, request)
        lending = LEND if request.task_class == LS else None
        decision = self.decide(env, request, allowed, lending)
        if isinstance(decision, scheduler.Refusal):
            raise ProtocolError(decision.code, decision.message)
        passed = [w for w in overtakes if competes(w, env.name, decision.gpus)]
        if any(w.bypassed >= self.config.queue_max_bypass or w.preempting for w in passed):
            raise ProtocolError(
                Err.NO_RESOURCES,
                f"{len(overtakes)} earlier requests are waiting and one of them "
                "may not be overtaken again",
            )
        grant = self.predicted_grant(env, request)
        self._check_lent(env, decision, grant)
        model = self.gpus[decision.gpus[0]].name
        estimate = self.estimate(env, request, model)
        task = Task(
            task_id=secrets.token_hex(8),
            env=env.name,
            gpus=decision.gpus,
            memory=env.memory if grant is None else grant,
            pid=pid,
            pid_start=pid_start,
            command=request.command,
            started=time.time(),
            last_seen=time.monotonic(),
            # Kept with its guard: a restart under another timeslice.guard changes no slice.
            request=replace(request, guard=self._guard(request)),
            arrival=self.slicing.arrive(),
            gpu_model=model,
            estimate=estimate,
        )
        self.store.task_started(
            Record(
                task.task_id,
                env.name,
                task.gpus,
                task.memory,
                pid,
                pid_start,
                task.command,
                task.started,
                None,
                None,
                0,
                None,
                request.task_class,
                gpu_model=model,
                predicted_step=None if estimate is None else estimate.step_s,
                predicted_util=None if estimate is None else estimate.utilization,
            ),
            task.request,
        )
        # Before the grant leaves: the command's processes look their task up
        # when they claim their ledger slots.
        self.add_entry(env, task.task_id)
        self.add_task(task)
        for index in decision.gpus:
            env.held.setdefault(index, set()).add(task.task_id)
            env.draining.discard(index)
            # New to it: its quota or grant; reused: a grant by prediction adds to it.
            self.set_held_limit(env, index)
        # Before the grant leaves: on a gated GPU its first allocation must wait its turn,
        # and on a GPU with shares its first launch its window.
        self.slicing.retime(started)
        self.apply_compute()
        for w in passed:
            w.bypassed += 1
        if request.task_class == LS:
            # The held tasks on its GPUs lent it their room: they wait for it too.
            for held_id in self.held_for_ls:
                held = self.tasks[held_id]
                if set(held.gpus) & set(task.gpus):
                    held.preempted_by.add(task.task_id)
        log.info(
            "grant %s env=%s gpus=%s pid=%s class=%s",
            task.task_id,
            env.name,
            task.gpus,
            pid,
            request.task_class,
        )
        return task

    def _check_lent(self, env: Env, decision: scheduler.Choice, grant: int | None) -> None:
        """Refuse (no_resources) a grant on a GPU where all of ``env``'s tasks are held for
        LS tasks, unless its allowance with the new task (granted ``grant``; None: the
        quota) fits there again: the new task would charge it."""
        for index in decision.gpus:
            if index in decision.new or not self.all_held_for_ls(env, index):
                continue
            if self.slicing.timesliced(index):
                continue
            back = Lending(resumed=frozenset(env.held[index]))
            more = self._allowance_with(env, index, grant) - self.allowance(env, index)
            if self.charged(index, back) + more > self.capacity(index):
                raise ProtocolError(
                    Err.NO_RESOURCES,
                    f"environment {env.name}'s tasks on GPU {index} are paused for a "
                    "latency-sensitive task, which uses the room they gave up; wait for it "
                    "to end",
                )

    def describe(self, specs: dict[int, dict[str, Any]]) -> None:
        """What NVML said of each GPU (nodemgr.host.backend.GpuBackend.describe), for the
        step time estimate's rates."""
        self.specs = {i: steptime.GpuSpec(**d) for i, d in specs.items()}

    def rates(self, model: str) -> steptime.GpuRates:
        """A GPU model's rates for the analytic estimate: from what NVML said of its first
        GPU; on simulated GPUs with the device timeline, the timeline's, as the node's
        config sets them (the SMs stay the GPU's)."""
        spec = next(
            (self.specs[g.index] for g in self.gpus if g.name == model and g.index in self.specs),
            steptime.GpuSpec(),
        )
        rates = steptime.rates_of(spec)
        c = self.config
        if not (self.simulated and c.sim_timeline):
            return rates
        d = steptime.SIM_TIMELINE
        scale = c.sim_time_scale or 1.0
        return steptime.GpuRates(
            (d.launch_s if c.sim_launch_ns is None else c.sim_launch_ns / 1e9) * scale,
            (d.wave_s if c.sim_wave_ns is None else c.sim_wave_ns / 1e9) * scale,
            (d.host_bps if c.sim_host_gbps is None else c.sim_host_gbps * 1e9) / scale,
            (d.device_bps if c.sim_device_gbps is None else c.sim_device_gbps * 1e9) / scale,
            sms=rates.sms,
        )

    def estimate(
        self, env: Env, message: Request | Estimate, model: str
    ) -> steptime.Estimate | None:
        """nodemgr's step time and utilisation estimate for a task of ``message``'s
        command and features on a GPU of ``model``; None for one without features."""
        f = features(message)
        if f is None:
            return None
        return steptime.predict(f, env.name, message.command, model, self.rates(model), self.runs)

    def note_steps(self, env: Env) -> None:
        """Each running task's latest boundary (Task.step_time), at a sweep."""
        if not env.held:
            return  # no task runs: no slot to read
        for tid, seen in env.ledger.boundaries().items():
            task = self.tasks.get(tid)
            if task is not None and task.env == env.name:
                task.note_boundary(*seen)

    def note_utilization(self, shares: dict[str, dict[int, int]]) -> None:
        """A utilisation sample (percent of each GPU, per task): each running task's mean."""
        for task in self.tasks.values():
            mine = shares.get(task.task_id, {})
            task.util_sum += sum(mine.get(g, 0) for g in task.gpus) / 100 / len(task.gpus)
            task.util_samples += 1

    def top_up(self, env: Env) -> None:
        """Answer what ``env``'s processes asked beyond grants by prediction
        (docs/prediction.md#admission). On each shared GPU where one asks: raise its
        task's grant to what it needs, with the margin where there is room for it, never
        past the quota; an ask the GPU's free memory cannot hold yet stays unanswered, its
        process waiting, and what it needs is held back from new grants there (views)
        until tasks end and it fits, or prediction.topup_wait (and a grace) has passed;
        one the quota can never hold is answered at once, and its allocation fails."""
        now = time.monotonic()
        on_gpu: dict[tuple[str, int], int] | None = None
        for index in sorted(env.held):
            key = (env.name, index)
            # As written: the environment's to write, so compared with what it may hold
            # before any use, and answered as read.
            asked = env.ledger.wanted(index)
            if not asked:
                self.topup_said.discard(key)
                if self.topup_pending.pop(key, None) is not None:
                    # Its process stopped waiting (prediction.topup_wait) and failed: what
                    # was held back for it may serve a waiting request.
                    self.topups_refused += 1
                    self.queue_dirty = True
                    log.info("top-up given up env=%s gpu=%d: no room came free", *key)
                continue
            allowed = self.allowance(env, index)
            need = min(env.memory, math.ceil(asked / MiB) * MiB) - allowed
            tasks = [
                self.tasks[t]
                for t in env.held[index]
                if t in self.tasks and self.tasks[t].grant is not None
            ]
            if asked <= env.ledger.limit(index):
                # A limit raised since it asked serves it already.
                self.topup_pending.pop(key, None)
                env.ledger.answer(index, asked)
                continue
            if (
                not tasks
                or asked > env.memory
                or need <= 0
                or self.slicing.timesliced(index)
                or self.all_held_for_ls(env, index)
            ):
                self._refuse_topup(env, index, asked, "beyond what it may hold there")
                continue
            if on_gpu is None:
                on_gpu = {}
                for _, tid, used in env.ledger.slots():
                    for i, nbytes in enumerate(used):
                        on_gpu[tid, i] = on_gpu.get((tid, i), 0) + nbytes
            # The task furthest past its grant on this GPU asked, most likely. Its grant
            # is per GPU: what it gains must fit on each of its shared GPUs, beside what
            # asks that came before it hold back there.
            held = on_gpu
            task = max(tasks, key=lambda t: held.get((t.task_id, index), 0) - t.memory)
            free = min(
                self.capacity(i) - self.charged(i) - self._held_back(i, before=key)
                for i in task.gpus
                if not self.slicing.timesliced(i)
            )
            if need > free:
                first = self.topup_pending.get(key, (need, now))[1]
                if now - first > self.config.topup_wait + TOPUP_GRACE:
                    # Its process cannot still be waiting (killed, or an ask the
                    # environment wrote itself): nothing is held back for it any more.
                    self.topup_pending.pop(key, None)
                    self.queue_dirty = True
                    self._refuse_topup(env, index, asked, "no room came free in time")
                    continue
                if key not in self.topup_pending:
                    log.info(
                        "top-up waits env=%s gpu=%d: asked %s, %s free",
                        env.name,
                        index,
                        format_size(asked),
                        format_size(max(0, free)),
                    )
                self.topup_pending[key] = (need, first)
                continue
            margin = math.ceil(asked * (1.0 + self.config.predict_margin) / MiB) * MiB
            add = max(need, min(min(env.memory, margin) - allowed, free))
            self.topup_pending.pop(key, None)
            task.memory += add
            task.topups += 1
            self.topups += 1
            self.store.task_topped_up(task.task_id, task.memory, task.topups)
            for i in task.gpus:
                self.set_held_limit(env, i)
            log.info(
                "top-up %s env=%s gpu=%d +%s (asked %s, grant %s)",
                task.task_id,
                env.name,
                index,
                format_size(add),
                format_size(asked),
                format_size(task.memory),
            )
            # After the new limit: the waiting processes read it once they see the answer.
            env.ledger.answer(index, asked)
        for key in [k for k in self.topup_pending if k[0] == env.name and k[1] not in env.held]:
            # Its tasks there ended while it waited (its process gave up, or ended).
            del self.topup_pending[key]
            self.topups_refused += 1
            self.queue_dirty = True
            log.info("top-up given up env=%s gpu=%d: its tasks there ended", *key)

    def _refuse_topup(self, env: Env, index: int, asked: int, why: str) -> None:
        """Answer an ask on GPU ``index`` without a new limit: its allocation fails. Counted
        and said once until the environment asks no more there (an environment that
        writes its ask again and again is answered at each sweep, said once)."""
        key = (env.name, index)
        self.topup_pending.pop(key, None)
        if key not in self.topup_said:
            self.topup_said.add(key)
            self.topups_refused += 1
            log.info(
                "top-up refused env=%s gpu=%d: asked %s, %s",
                env.name,
                index,
                format_size(min(asked, MAX_SIZE)),
                why,
            )
        env.ledger.answer(index, asked)

    def _held_back(self, index: int, before: tuple[str, int] | None = None) -> int:
        """What asks for top-ups that wait hold back on GPU ``index`` (those that came
        before ``before``, when given): no new grant may take it."""
        total = 0
        for key, (need, _) in self.topup_pending.items():
            if key == before:
                break
            env = self.envs.get(key[0])
            if key[1] == index and env is not None and index in env.held:
                total += need
        return total

    def _record_run(self, task: Task) -> None:
        """An ended task sent with features whose step time was measured: a run the step
        time estimate learns from (nodemgr.policy.steptime)."""
        f = features(task.request)
        step = task.step_time
        if f is None or step is None or task.gpu_model is None:
            return
        self.runs.append(
            steptime.Run(task.env, task.command, task.gpu_model, f, step, task.utilization)
        )
        del self.runs[:-RUNS_KEPT]

    def _learn(self, task: Task) -> None:
        """A task granted by prediction that ended: the next prediction of its command in
        its environment is raised to what it measured when that was more."""
        predicted = task.request.predicted
        if predicted is None:
            return
        per_gpu = task.peak // max(1, len(task.gpus))
        if self.on_predicted_end is not None and predicted > 0:
            self.on_predicted_end(per_gpu / predicted)
        key = (task.env, task.command)
        if per_gpu > max(predicted, self.learned.get(key, 0)):
            self.learned[key] = per_gpu

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
        self._uncount(task_id)
        env = self.envs[task.env]
        # Read while the task's entry is there: it holds the task's exact peak.
        totals = env.ledger.task_usage(task_id)
        # Its last boundaries, while its processes' slots may still be there.
        last = env.ledger.boundaries().get(task_id)
        if last is not None:
            task.note_boundary(*last)
        # Freeing the entry also lets go of any launch a pause still holds.
        if env.ledger.task_remove(task_id):
            env.tasks_full = False
        task.peak = max(task.peak, totals.peak)
        task.launches = max(task.launches, totals.launches)
        self._learn(task)
        self._record_run(task)
        env.launches_done += task.launches
        for index in task.gpus:
            holders = env.held.get(index)
            if holders is None:
                continue
            holders.discard(task_id)
            if not holders:
                del env.held[index]
                env.ledger.set_limit(index, 0)
                env.ledger.set_topup(index, 0)
                env.draining.add(index)
            else:
                self.set_held_limit(env, index)
        # Its turns go on at once (a holder that has gone hands on).
        self.slicing.forget(task_id)
        self.held_for_ls.discard(task_id)
        self.apply_compute()
        self.store.task_ended(
            task_id, time.time(), reason, task.peak, exit_code, task.step_time, task.utilization
        )
        self.queue_dirty = True
        log.info("release %s env=%s reason=%s", task_id, task.env, reason)
        # In the same turn: the BE tasks an LS task held go on once nothing else holds them.
        self.resume_held(waiting=frozenset(w.wid for w in self.queue))
        self.slicing.retime(started)
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
        if not paused and task.preempted is not None:
            # Only the operator's hold is lifted: the LS task's stays (docs/nodemgr.md).
            log.info("%s stays held: %s", task_id, task.preempted)
        # A paused holder gives its turns to a task that can use them; resumed, it waits.
        self.slicing.retime(time.perf_counter())
        return task

    def check_task_room(self, env: str, pid: int | None) -> None:
        """Refuse (``busy``) a task beyond limits.tasks_per_env or limits.tasks_per_client."""
        cap = self.max_tasks_per_env
        if self.tasks_of_env[env] >= cap:
            raise ProtocolError(
                Err.BUSY,
                f"environment {env} already has {self.tasks_of_env[env]} running tasks, the "
                f"most one environment may hold (limits.tasks_per_env, {cap}); end some of "
                "them first",
            )
        cap = self.config.tasks_per_client
        if pid is not None and self.tasks_of_client[env, pid] >= cap:
            raise ProtocolError(
                Err.BUSY,
                f"process {pid} already holds {self.tasks_of_client[env, pid]} running tasks "
                f"in environment {env}, the most one process may hold "
                f"(limits.tasks_per_client, {cap}); end some of them first",
            )

    def add_task(self, task: Task) -> None:
        """Hold a running task (a new grant, or one restored)."""
        self.tasks[task.task_id] = task
        self._counted[task.task_id] = (task.env, task.pid)
        self.tasks_of_env[task.env] += 1
        if task.pid is not None:
            self.tasks_of_client[task.env, task.pid] += 1
        self._seen_floor = min(self._seen_floor, task.last_seen)

    def _uncount(self, task_id: str) -> None:
        env, pid = self._counted.pop(task_id)
        self.tasks_of_env[env] -= 1
        if not self.tasks_of_env[env]:
            del self.tasks_of_env[env]
        if pid is not None:
            self.tasks_of_client[env, pid] -= 1
            if not self.tasks_of_client[env, pid]:
                del self.tasks_of_client[env, pid]

    def expired(self, now: float) -> list[Task]:
        """The tasks silent for more than heartbeat_timeout at ``now`` (monotonic). Called
        every turn of the loop: it looks at every task only when the one silent longest
        may be past the timeout, not at every call."""
        limit = self.config.heartbeat_timeout
        if now - self._seen_floor <= limit:
            return []
        out = [t for t in self.tasks.values() if now - t.last_seen > limit]
        # Those returned count too: until they are released they are returned again.
        self._seen_floor = min((t.last_seen for t in self.tasks.values()), default=math.inf)
        return out

    def sample_env(self, env: Env) -> None:
        """Read one environment's ledger: what its tasks use now and the most they have
        used (the sweep reads each environment's on its own, so that one failing stops no
        other's)."""
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

    def serve_queue(
        self,
    ) -> tuple[list[tuple[Waiter, Task]], list[tuple[Waiter, ProtocolError]], list[Eviction]]:
        """Grant waiting requests in order as far as the policy allows.

        A request that cannot be served yet is passed over, unless it has been
        overtaken ``queue_max_bypass`` times: then nothing behind it that
        competes with it is served until it is (for a request that may get any
        GPU, nothing behind it at all). A latency-sensitive request that does not fit
        holds best-effort tasks, or has them requeued (plan_preemption), and while it waits
        for what they free nothing behind it that competes is served. Returns the grants
        made, the requests that can never be served (their quota changed, say) and the
        best-effort tasks to requeue, which the caller reclaims.
        """
        granted: list[tuple[Waiter, Task]] = []
        failed: list[tuple[Waiter, ProtocolError]] = []
        evictions: list[Eviction] = []
        self.queue_dirty = False
        self.resume_held(waiting=frozenset(w.wid for w in self.queue))
        i = 0
        while i < len(self.queue.waiters):
            w = self.queue.waiters[i]
            try:
                # Those ahead of it were passed over without reaching the limit.
                task = self.grant(
                    w.env, w.request, w.pid, w.pid_start, self.queue.waiters[:i], w.allowed
                )
            except ProtocolError as e:
                if e.code != Err.NO_RESOURCES:
                    self.queue.waiters.pop(i)
                    failed.append((w, e))
                    continue
                w.reason = e.message
                preempted = self._preempt_for(w, i, evictions)
                if preempted is None:
                    if (
                        w.bypassed >= self.config.queue_max_bypass or w.preempting
                    ) and w.allowed is None:
                        break
                    i += 1
                    continue
                task = preempted
            self.queue.waiters.pop(i)
            granted.append((w, task))
        return granted, failed, evictions

    # --- classes: holding and requeueing best-effort tasks (docs/scheduling.md) --------

    def _preempt_for(self, w: Waiter, i: int, evictions: list[Eviction]) -> Task | None:
        """Make room for the waiting ``w`` (the ``i``-th) if it is latency-sensitive: hold
        the best-effort tasks a plan names and grant it, or requeue those the plan names
        (added to ``evictions``) and leave it waiting for what they free."""
        if w.request.task_class != LS or w.env not in self.envs:
            return None
        plan = self.plan_preemption(w)
        if plan is None:
            w.preempting = False
            return None
        hold, requeue = plan
        if not hold and not requeue:
            # It fits once what requeued tasks hold has drained (or it was refused for
            # another reason): it keeps its hold on what is draining.
            w.preempting = w.preempting and bool(self.evicting)
            return None
        key = f"wait:{w.wid}"
        why = _for_whom(w)
        for t in hold:
            self.hold_for_ls(t, key, f"paused for {why}")
        for t in requeue:
            self.evicting.update((t.env, index) for index in t.gpus)
            evictions.append(
                Eviction(
                    t,
                    f"GPUs reclaimed for {why}: this best-effort task is requeued (it "
                    "waits for GPUs again, and gpushare-run runs the command again once "
                    "granted)",
                )
            )
            log.info("requeue %s env=%s for %s", t.task_id, t.env, why)
        if requeue:
            w.preempting = True
            w.reason = f"best-effort tasks are being requeued to make room for it ({len(requeue)})"
            return None
        try:
            task = self.grant(
                w.env, w.request, w.pid, w.pid_start, self.queue.waiters[:i], w.allowed
            )
        except ProtocolError as e:
            w.preempting = e.code == Err.NO_RESOURCES
            w.reason = e.message
            return None
        for held_id in self.held_for_ls:
            held = self.tasks[held_id]
            if key in held.preempted_by:
                held.preempted_by.discard(key)
                held.preempted_by.add(task.task_id)
                held.preempted = f"paused for latency-sensitive task {task.task_id} of {task.env}"
        return task

    def plan_preemption(self, w: Waiter) -> tuple[list[Task], list[Task]] | None:
        """Which best-effort tasks to hold, and which to requeue, so that the waiting LS
        request ``w`` fits; None when none would make it fit. Holding comes first (a held
        task loses nothing); requeueing only when holding cannot make room. Within each,
        the newest tasks go first (they have the least work to lose), and of those taken,
        only the ones on the GPUs the request then gets are kept."""
        env = self.envs[w.env]
        be = sorted(
            (t for t in self.tasks.values() if t.task_class == BE and t.env in self.envs),
            key=lambda t: (-t.started, t.task_id),
        )
        holdable = [
            t
            for t in be
            if t.task_id not in self.held_for_ls
            and self.envs[t.env].ledger.task_entry(t.task_id) is not None
        ]

        def fits(hold: Iterable[Task], gone: Iterable[Task]) -> scheduler.Choice | None:
            lending = Lending(
                paused=frozenset(t.task_id for t in hold),
                gone=frozenset(t.task_id for t in gone),
                planning=True,
            )
            d = self.decide(env, w.request, w.allowed, lending)
            return d if isinstance(d, scheduler.Choice) else None

        def least(hold: list[Task], gone: list[Task]) -> tuple[list[Task], list[Task]]:
            chosen = fits(hold, gone)
            assert chosen is not None
            on = set(chosen.gpus)
            hold2 = [t for t in hold if on & set(t.gpus)]
            gone2 = [t for t in gone if on & set(t.gpus)]
            return (hold2, gone2) if fits(hold2, gone2) is not None else (hold, gone)

        if fits([], []) is not None:
            return [], []  # already fits as an LS request sees the node
        hold: list[Task] = []
        for t in holdable:
            hold.append(t)
            if fits(hold, []) is not None:
                return least(hold, [])
        gone: list[Task] = []
        for t in be:
            gone.append(t)
            rest = [h for h in holdable if h not in gone]
            if fits(rest, gone) is None:
                continue
            hold = []
            for h in rest:
                if fits(hold, gone) is not None:
                    break
                hold.append(h)
            return least(hold, gone)
        return None

    def hold_for_ls(self, task: Task, key: str, why: str) -> None:
        """Hold a best-effort task for a latency-sensitive one (GS_PAUSE_CLASS): its
        launches and allocations wait; its memory stays; where all its environment's tasks
        on a GPU are held, the environment's limit there drops to what it holds."""
        env = self.envs[task.env]
        if task.task_id not in self.held_for_ls:
            env.ledger.task_hold_class(task.task_id, True)
            self.held_for_ls.add(task.task_id)
            task.preempted = why
            log.info("hold %s env=%s: %s", task.task_id, task.env, why)
        task.preempted_by.add(key)
        for index in task.gpus:
            self.set_held_limit(env, index)
        self.slicing.retime(time.perf_counter())

    def resume_held(self, waiting: frozenset[int]) -> None:
        """Let go the held best-effort tasks that nothing holds any more (their LS tasks
        ended, or their LS requests left the queue; ``waiting``: the ids of the waiting
        requests) and whose environment's quota fits again on their GPUs."""
        for task_id in sorted(self.held_for_ls):
            task = self.tasks[task_id]
            task.preempted_by = {
                k
                for k in task.preempted_by
                if (int(k[5:]) in waiting if k.startswith("wait:") else k in self.tasks)
            }
            if task.preempted_by:
                continue
            back = Lending(resumed=frozenset({task_id}))
            env = self.envs[task.env]
            if any(
                not self.slicing.timesliced(i)
                and self.charged(i, back) > max(self.capacity(i), self.charged(i, LEND))
                for i in task.gpus
            ):
                continue
            self.held_for_ls.discard(task_id)
            task.preempted = None
            env.ledger.task_hold_class(task_id, False)
            for index in task.gpus:
                self.set_held_limit(env, index)
            self.queue_dirty = True
            log.info("resume %s env=%s: no latency-sensitive task holds it", task_id, task.env)

    def close(self) -> None:
        for env in self.envs.values():
            env.ledger.close()
        if self.board is not None:
            self.board.close()
        self.store.close()


@dataclass(frozen=True)
class Eviction:
    """A best-effort task to requeue for a latency-sensitive request, and what its client
    is told (reason ``preempted``)."""

    task: Task
    message: str


def features(message: Request | Estimate) -> steptime.Features | None:
    """A message's dry-run features (docs/prediction.md#step-time); None without them."""
    f = features_of(message)
    return None if f is None else steptime.decoded(f)


def _for_whom(w: Waiter) -> str:
    """The LS request a held or requeued task makes room for, in a message."""
    what = f" ({w.request.command[:60]})" if w.request.command else ""
    pid = f", pid {w.pid}" if w.pid is not None else ""
    return f"a {CLASS_LONG[LS]} request of environment {w.env}{what}{pid}"
