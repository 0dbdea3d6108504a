"""Time-sliced GPUs (docs/timeslicing.md): state in, decision out, no I/O.

Two parts, both pure:

* **Regions**: a task's shape on a GPU (``shape``), a time-sliced GPU's charge
  and the placement of its slices (``charge``), and what a new request would
  add to it (``extra``), for admission by nodemgr.policy.scheduler.
* **Turns**: who holds each gated GPU's turn (a time-sliced GPU with two or
  more tasks), in which order the others get it, and what each task's ledger
  entry must say (``Gate``). ``settle`` follows grants, releases, mode changes;
  ``yield_turn`` a task's ``yield``; ``expire`` applies ``turn_timeout`` (to a
  holder stuck, and to one past its turn that does not yield). Each returns a
  ``Plan`` that nodemgr.node.node writes to the ledgers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

LEARNED = "learned"
ESTIMATE = "estimate"
UNKNOWN = "unknown"

# GS_TASK_TIMESLICED (shim/ledger_layout.h): the task runs on a time-sliced GPU.
FLAG_TIMESLICED = 1

# How many times the first task in a GPU's order that cannot take all its GPUs may be passed
# over there for one that can, before the GPU is kept for it (docs/timeslicing.md).
PASS_OVER = 2


# --- regions -------------------------------------------------------------------------


@dataclass(frozen=True)
class Member:
    """A task on one time-sliced GPU, as nodemgr knows it."""

    task_id: str
    env: str
    guard: int  # bytes kept free after its persistent slice
    estimate: tuple[int, int] | None = None  # the request's (persistent, temporary)
    # Measured on this GPU, summed over the task's live processes (nodemgr.host.ledger.Regions).
    used: int = 0
    persistent: int = 0
    temp_peak: int = 0
    settled: int = 0
    iterations: int = 0  # the most boundaries one of its processes reported
    releases: int = 0  # the fewest releases one iterating process made

    @property
    def temporary(self) -> int:
        """Temporary bytes it holds now."""
        return max(0, self.used - self.persistent)


@dataclass(frozen=True)
class Shape:
    persistent: int
    temporary: int
    kind: str  # LEARNED, ESTIMATE or UNKNOWN


def shape(m: Member, quota: int) -> Shape:
    """The task's (persistent, temporary) figures on the GPU.

    Learned once it released once and reported a second boundary; else its
    request's estimate; else unknown: its environment's quota, all persistent.
    A task that has reported no boundary is charged at least all it holds: as
    persistent, what exceeds its temporary figure (an estimated task in its first
    step holds its estimate, no more; one that never steps, all it holds).
    """
    if m.releases >= 1 and m.iterations >= 2:
        s = Shape(m.settled, m.temp_peak, LEARNED)
    elif m.estimate is not None:
        s = Shape(m.estimate[0], m.estimate[1], ESTIMATE)
    else:
        s = Shape(quota, 0, UNKNOWN)
    if m.iterations == 0 and m.used > s.persistent + s.temporary:
        s = Shape(m.used - s.temporary, s.temporary, s.kind)
    return s


@dataclass(frozen=True)
class Slice:
    """A task's place in a GPU's persistent region."""

    task_id: str
    offset: int  # bytes from the region's start
    persistent: int
    temporary: int
    guard: int
    shape: str


@dataclass(frozen=True)
class Charge:
    """What a time-sliced GPU is charged."""

    persistent: int  # per environment min(quota, its slices and guards), summed
    temporary: int  # the largest temporary figure of its tasks
    slices: tuple[Slice, ...] = ()

    @property
    def total(self) -> int:
        return self.persistent + self.temporary


def charge(members: Sequence[Member], quotas: Mapping[str, int]) -> Charge:
    """The GPU's charge and its slices, placed in the order of ``members`` (arrival)."""
    per_env: dict[str, int] = {}
    temporary = 0
    offset = 0
    slices = []
    for m in members:
        s = shape(m, quotas[m.env])
        per_env[m.env] = per_env.get(m.env, 0) + s.persistent + m.guard
        temporary = max(temporary, s.temporary)
        slices.append(Slice(m.task_id, offset, s.persistent, s.temporary, m.guard, s.kind))
        offset += s.persistent + m.guard
    persistent = sum(min(quotas[env], n) for env, n in per_env.items())
    return Charge(persistent, temporary, tuple(slices))


def extra(members: Sequence[Member], quotas: Mapping[str, int], new: Member) -> int:
    """The charge a new task ``new`` would add to the GPU (0 when its environment is at its
    quota there and its temporary figure is no larger than the GPU's)."""
    return charge([*members, new], quotas).total - charge(members, quotas).total


# --- turns ---------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuTurn:
    """One gated GPU's turn."""

    holder: str | None  # None only between turns
    since: float  # when the holder got the turn (monotonic seconds)
    held: Mapping[str, float]  # per task: turn time before the holder's current turn
    waiting: Mapping[str, float]  # per task other than the holder: since when it waits
    arrival: tuple[str, ...]  # the GPU's tasks in order of arrival (last tie-break)
    # per task: times it was first in the order when the GPU came free, could not take all
    # its GPUs, and the GPU went to another task (reset when it gets the GPU)
    passed: Mapping[str, int] = field(default_factory=dict)

    def held_now(self, task_id: str, now: float) -> float:
        """The task's turn time on this GPU so far, the current turn included."""
        ongoing = now - self.since if task_id == self.holder else 0.0
        return self.held.get(task_id, 0.0) + ongoing

    def order(self) -> list[str]:
        """The holder, then the others in the order they get the turn next."""
        rank = {t: i for i, t in enumerate(self.arrival)}
        rest = sorted(
            self.waiting, key=lambda t: (self.held.get(t, 0.0), self.waiting[t], rank.get(t, 0))
        )
        return ([self.holder] if self.holder is not None else []) + rest


@dataclass(frozen=True)
class Turns:
    """Every gated GPU's turn, and the turn_until of each task that holds all of its."""

    gpus: Mapping[int, GpuTurn] = field(default_factory=dict)
    until: Mapping[str, int] = field(default_factory=dict)
    # per task of ``until`` whose boundary count has reached its turn_until (its turn is
    # over, it should have yielded): since when it is seen so (monotonic seconds)
    overdue: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Situation:
    """What the turns depend on, as nodemgr sees it now."""

    on: Mapping[int, Sequence[str]]  # time-sliced GPU -> its tasks in order of arrival
    tasks: Mapping[str, Sequence[int]]  # every running task -> its GPUs
    # task -> the most boundaries one of its live processes reported (its turn counts from it)
    iterations: Mapping[str, int]
    now: float  # monotonic seconds
    quantum: int  # iterations per turn
    # task -> when its boundary counts last moved (monotonic seconds; absent: never seen to)
    progress: Mapping[str, float] = field(default_factory=dict)
    paused: frozenset[str] = frozenset()  # tasks an operator paused: given no turn if avoidable


@dataclass(frozen=True)
class Gate:
    """What a task's ledger entry must say."""

    gated: bool  # GS_PAUSE_TURN: another task holds one of its gated GPUs' turn
    turn_until: int  # the boundary count that ends its turn; 0: not its turn / not gated
    flags: int  # GS_TASK_* bits


@dataclass(frozen=True)
class Plan:
    turns: Turns
    gates: Mapping[str, Gate]  # every task of the situation
    handed: tuple[int, ...] = ()  # GPUs whose turn went on to another task
    passed: bool = False  # yield_turn: some turn of the task went to another task


def _hand_on(turn: GpuTurn, now: float, to: str | None) -> GpuTurn:
    """End the holder's turn (if any) and give it to ``to``; the old holder waits."""
    held = dict(turn.held)
    waiting = dict(turn.waiting)
    passed = dict(turn.passed)
    if turn.holder is not None:
        held[turn.holder] = turn.held_now(turn.holder, now)
        waiting[turn.holder] = now
    if to is not None:
        waiting.pop(to, None)
    return GpuTurn(to, now, held, waiting, turn.arrival, passed)


def _join(old: GpuTurn | None, tasks: Sequence[str], now: float) -> GpuTurn:
    """The GPU's turn with exactly ``tasks`` on it: departed ones dropped (a departed holder
    leaves the GPU between turns), new ones waiting from now with the least turn time of
    the others. A GPU left between turns is given a holder by ``_assign``."""
    passed: dict[str, int] = {}
    if old is None:
        turn = GpuTurn(None, now, dict.fromkeys(tasks, 0.0), dict.fromkeys(tasks, now), ())
    else:
        passed = {t: n for t, n in old.passed.items() if t in tasks}
        present = [t for t in tasks if t in old.held or t == old.holder]
        least = min((old.held_now(t, now) for t in present), default=0.0)
        held = {t: old.held.get(t, 0.0) for t in present}
        waiting = {t: old.waiting[t] for t in present if t != old.holder and t in old.waiting}
        holder = old.holder if old.holder in tasks else None
        since = old.since if holder is not None else now
        for t in tasks:
            if t not in held:
                held[t] = least
                waiting[t] = now
            elif t != holder and t not in waiting:
                waiting[t] = now
        turn = GpuTurn(holder, since, held, waiting, ())
    return GpuTurn(turn.holder, turn.since, turn.held, turn.waiting, tuple(tasks), passed)


def _gated(gpus: Mapping[int, GpuTurn], s: Situation, task_id: str) -> list[int]:
    return [g for g in s.tasks.get(task_id, ()) if g in gpus]


def _holds_all(gpus: Mapping[int, GpuTurn], s: Situation, task_id: str) -> bool:
    """Whether the task holds the turn of every gated GPU of it."""
    gated = _gated(gpus, s, task_id)
    return bool(gated) and all(gpus[g].holder == task_id for g in gated)


def _runs(gpus: Mapping[int, GpuTurn], s: Situation, task_id: str) -> bool:
    """Whether the task holds the turn of every gated GPU of it and is not paused (it runs;
    a paused holder is one that does not run, and gives its turns up as one that waits)."""
    return task_id not in s.paused and _holds_all(gpus, s, task_id)


def _first(turn: GpuTurn, s: Situation, skip: str | None) -> str | None:
    """The first task in the GPU's order that is not paused (nor ``skip``)."""
    return next((t for t in turn.order() if t != skip and t not in s.paused), None)


def _kept_for(
    gpus: Mapping[int, GpuTurn], s: Situation, g: int, skip: Mapping[int, str]
) -> str | None:
    """The task a GPU is kept for: its holder, or when it is between turns the first in its
    order, once that task was passed over there PASS_OVER times without running since.
    No other task takes the GPU from it."""
    turn = gpus[g]
    t = turn.holder if turn.holder is not None else _first(turn, s, skip.get(g))
    if t is None or t in s.paused:
        return None
    return t if turn.passed.get(t, 0) >= PASS_OVER else None


def _whole(
    gpus: Mapping[int, GpuTurn], s: Situation, task_id: str, skip: Mapping[int, str]
) -> bool:
    """Whether the task can take every gated GPU of it at once: each is already its own, or
    between turns, or held by a task that does not run (it waits for another GPU), and not
    kept for another task."""
    for g in _gated(gpus, s, task_id):
        holder = gpus[g].holder
        if holder == task_id:
            continue
        if holder is not None and _runs(gpus, s, holder):
            return False
        kept = _kept_for(gpus, s, g, skip)
        if kept is not None and kept != task_id:
            return False
    return True


def _assign(
    gpus: dict[int, GpuTurn], s: Situation, exclude: Mapping[int, str] | None = None
) -> None:
    """Give a holder to every GPU between turns, jointly (docs/timeslicing.md, "A task on
    several GPUs"): for each such GPU, in index order, the first task in its order (least
    turn time, then longest waiting) that can then hold all its gated GPUs gets all of them
    at once, taken from holders that do not run; only if there is none, the first task in
    its order gets this GPU alone and waits there for the others. A task first in the order
    of a GPU between turns that goes to another task is passed over there; once passed over
    PASS_OVER times the GPU is kept for it: no other task takes it, so it gets it alone (and
    waits there for its other GPUs, which are kept for it in turn) or with all its GPUs.
    Paused tasks come last; ``exclude[gpu]`` (a task that just yielded or timed out there)
    is never chosen, and a GPU with nobody else (or only paused tasks) stays between turns
    for the caller."""
    skip = exclude or {}
    for g in sorted(gpus):
        turn = gpus[g]
        if turn.holder is not None:
            continue
        order = [t for t in turn.order() if t != skip.get(g)]
        ready = [t for t in order if t not in s.paused]
        paused = [t for t in order if t in s.paused]
        pick = next((t for t in ready if _whole(gpus, s, t, skip)), None)
        if pick is None and ready:
            gpus[g] = _hand_on(turn, s.now, ready[0])  # it waits here for its other GPUs
            continue
        if pick is None and g in skip:
            continue  # only paused tasks besides the one that had it: it keeps the turn
        if pick is None:
            pick = next((t for t in paused if _whole(gpus, s, t, skip)), None)
        if pick is None:
            if paused:
                gpus[g] = _hand_on(turn, s.now, paused[0])
            continue
        for h in _gated(gpus, s, pick):
            other = gpus[h]
            if other.holder == pick:
                continue
            # The holder that waited there, or the first in its order: passed over.
            over = other.holder if other.holder is not None else _first(other, s, skip.get(h))
            if over is not None:
                passed = {**other.passed, over: other.passed.get(over, 0) + 1}
                other = replace(other, passed=passed)
            gpus[h] = _hand_on(other, s.now, pick)
    # A task that runs is no longer passed over anywhere.
    for g, turn in gpus.items():
        if any(_runs(gpus, s, t) for t in turn.passed):
            passed = {t: n for t, n in turn.passed.items() if not _runs(gpus, s, t)}
            gpus[g] = replace(turn, passed=passed)


def _progress(gpus: dict[int, GpuTurn], s: Situation) -> None:
    """Some task runs whenever a GPU is gated: if every holder waits for another GPU (a
    state only a restart's adopted turns, or GPUs kept for tasks that each wait for
    another's, can leave), all turns are handed out afresh, with no GPU kept for anyone."""
    if not gpus or any(_holds_all(gpus, s, t.holder) for t in gpus.values() if t.holder):
        return
    for g, turn in gpus.items():
        gpus[g] = replace(_hand_on(turn, s.now, None), passed={})
    _assign(gpus, s)


def _reconcile(prev: Turns, s: Situation) -> dict[int, GpuTurn]:
    gpus = {
        gpu: _join(prev.gpus.get(gpu), tasks, s.now)
        for gpu, tasks in s.on.items()
        if len(tasks) >= 2
    }
    _assign(gpus, s)
    _progress(gpus, s)
    return gpus


def _plan(
    prev: Turns,
    s: Situation,
    gpus: dict[int, GpuTurn],
    renewed: frozenset[str] = frozenset(),
    passed: bool = False,
) -> Plan:
    until: dict[str, int] = {}
    gates: dict[str, Gate] = {}
    for task_id, its in s.tasks.items():
        flags = FLAG_TIMESLICED if any(g in s.on for g in its) else 0
        gated = [g for g in its if g in gpus]
        if not gated:
            gates[task_id] = Gate(False, 0, flags)
        elif all(gpus[g].holder == task_id for g in gated):
            u = prev.until.get(task_id)
            if u is None or task_id in renewed:
                u = s.iterations.get(task_id, 0) + s.quantum
            until[task_id] = u
            gates[task_id] = Gate(False, u, flags)
        else:
            gates[task_id] = Gate(True, 0, flags)
    overdue = {
        t: prev.overdue.get(t, s.now) if prev.until.get(t) == u else s.now
        for t, u in until.items()
        if s.iterations.get(t, 0) >= u
    }
    handed = tuple(
        sorted(
            g
            for g, turn in gpus.items()
            if g in prev.gpus and turn.holder is not None and turn.holder != prev.gpus[g].holder
        )
    )
    return Plan(Turns(gpus, until, overdue), gates, handed, passed)


def settle(prev: Turns, s: Situation) -> Plan:
    """The turns after tasks came or went, GPUs changed mode or tasks were paused or
    resumed: a GPU with two or more tasks is gated (its first holder is the task that
    arrived first), one left with fewer is not; a holder that has gone hands its turn on at
    once, and so does a paused holder where a task that is not paused can take it."""
    gpus = _reconcile(prev, s)
    _pass_on(gpus, s, _paused_holders(gpus, s))
    return _plan(prev, s, gpus)


def _paused_holders(gpus: Mapping[int, GpuTurn], s: Situation) -> list[str]:
    return sorted(
        {t.holder for t in gpus.values() if t.holder is not None and t.holder in s.paused}
    )


def _pass_on(gpus: dict[int, GpuTurn], s: Situation, cut: Sequence[str]) -> tuple[set[str], bool]:
    """End every turn the tasks ``cut`` hold and give them out again jointly; a GPU where
    nobody else can take the turn goes back to the task that had it. Returns the tasks
    that got back all they held, and whether some turn went to another task."""
    exclude: dict[int, str] = {}
    for task_id in cut:
        for g, turn in gpus.items():
            if turn.holder == task_id:
                gpus[g] = _hand_on(turn, s.now, None)
                exclude[g] = task_id
    _assign(gpus, s, exclude)
    kept = set(cut)
    for g, task_id in exclude.items():
        if gpus[g].holder is None:
            gpus[g] = _hand_on(gpus[g], s.now, task_id)
        elif gpus[g].holder != task_id:
            kept.discard(task_id)
    _progress(gpus, s)
    return kept, len(kept) < len(set(cut))


def yield_turn(prev: Turns, s: Situation, task_id: str) -> Plan:
    """``task_id`` yields: every turn it holds goes to the next task there, chosen jointly
    (``_assign``). A task that holds no turn, or has nobody to pass it to, keeps what it
    has (for another quantum)."""
    gpus = _reconcile(prev, s)
    held = any(t.holder == task_id for t in gpus.values())
    kept, passed = _pass_on(gpus, s, [task_id] if held else [])
    renewed = set(kept)
    if not passed and task_id in prev.until:
        renewed.add(task_id)
    return _plan(prev, s, gpus, frozenset(renewed), passed)


def stuck(gpus: Mapping[int, GpuTurn], s: Situation, task_id: str, timeout: float) -> bool:
    """Whether a running holder is past ``timeout``: one that has reported boundaries when
    they have not moved for ``timeout`` seconds of its turn; one that never reported any
    when its turn is ``timeout`` seconds old. Its turn began when it got its last GPU."""
    gated = _gated(gpus, s, task_id)
    start = max(gpus[g].since for g in gated)
    last = start
    if s.iterations.get(task_id, 0) > 0:
        last = max(start, s.progress.get(task_id, start))
    return s.now - last > timeout


def overran(turns: Turns, s: Situation, task_id: str, timeout: float) -> bool:
    """Whether a holder is past its turn by ``timeout``: its boundary count reached its
    turn_until (where it should have yielded) more than ``timeout`` seconds ago, whatever
    it has reported since."""
    since = turns.overdue.get(task_id)
    return since is not None and s.now - since > timeout


def expire(prev: Turns, s: Situation, timeout: float) -> Plan:
    """Pass on the turns of every running holder that is ``stuck`` or has ``overran`` its
    turn, and of every paused holder (where a task that is not paused can take them). A
    holder waiting for another GPU is not cut: the task it waits for is. One past its turn
    that nobody else can relieve keeps it for another quantum, as if it had yielded."""
    gpus = _reconcile(prev, s)
    holders = sorted({t.holder for t in gpus.values() if t.holder is not None})
    running = [t for t in holders if _runs(gpus, s, t)]
    over = {t for t in running if overran(prev, s, t, timeout)}
    cut = [t for t in running if t in over or stuck(gpus, s, t, timeout)]
    kept, _ = _pass_on(gpus, s, cut + _paused_holders(gpus, s))
    return _plan(prev, s, gpus, frozenset(kept & over))
