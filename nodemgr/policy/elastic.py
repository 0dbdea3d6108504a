"""The elastic share of latency-sensitive tasks (seed 000; docs/compute.md, "Elastic
share"). State in, decisions out: the event loop feeds each sweep's view of the GPUs'
latency-sensitive (LS) and best-effort (BE) tasks, and applies the shares, pauses and holds
this module decides through the compute schedule (nodemgr.policy.compute) and the ledger.

An LS task may state a target: a time per step, or a deadline for the whole run together
with its number of steps. Each sweep compares what the task's step rate so far predicts
with the target. When the target would be missed, the task is given ``step`` more percent
of its GPU, taken from the BE tasks there (the one with the largest share first); once no
BE task has any share left to give and the target is still missed, the BE tasks on that GPU
are paused (the daemon pauses them with their state kept, or requeues them when pausing
frees nothing, as for an LS request: docs/scheduling.md, "Classes"). After each change the
policy waits ``window`` seconds, so the change can show in the step rate, before the next.
When the target is met with room to spare (``slack``) the steps are given back, pauses
first, one per window; when the LS task ends, everything taken for it goes back at once.

An LS task that uses more of its GPU than its share (by more than ``tolerance``) for longer
than ``window`` is held, with the reason said, until a sweep sees it back within its share.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Settings:
    """The elastic rule's knobs: ``[compute]`` in the config."""

    step: int = 10  # percent of a GPU moved per change
    window: float = 1.0  # seconds between two changes on one GPU, and of over-use before a hold
    slack: float = 0.1  # the target is met with room when predicted <= (1 - slack) * target
    tolerance: float = 5.0  # percentage points of use above its share an LS task is allowed


@dataclass(frozen=True)
class Target:
    """What an LS task asked for: seconds per step, or a deadline (wall clock, seconds)
    for a run of ``steps`` steps. A task with neither has no target: it is never given
    more, and its share is what the schedule gives it."""

    step_time: float | None = None
    deadline: float | None = None
    steps: int | None = None

    @property
    def stated(self) -> bool:
        return self.step_time is not None or (self.deadline is not None and self.steps is not None)


@dataclass(frozen=True)
class Ls:
    """A latency-sensitive task on one GPU, as a sweep saw it."""

    task_id: str
    gpu: int
    target: Target
    base: int  # its share without elastic steps: percent of the GPU the schedule gives it
    iterations: int  # steps it has reported
    step_time: float | None  # its recent seconds per step; None until measured
    used: float | None = None  # percent of the GPU's device time it got over the last window


@dataclass(frozen=True)
class Be:
    """A best-effort task on one GPU: ``base`` is the share it was given (percent; 0: it
    runs only in the time LS tasks leave idle)."""

    task_id: str
    gpu: int
    base: int


@dataclass(frozen=True)
class Plan:
    """A sweep's decisions. ``shares``: the share each task of a GPU with an LS target
    runs with now, where it differs from its base; ``paused``: BE tasks that can no
    longer run for an LS task (the whole set: a task not in it runs); ``held``: LS tasks
    held for using more than their share, with the reason."""

    shares: Mapping[str, int] = field(default_factory=dict)
    paused: frozenset[str] = frozenset()
    held: Mapping[str, str] = field(default_factory=dict)


def required_step_time(target: Target, iterations: int, now: float) -> float | None:
    """The seconds per step that meets ``target`` from now on; None when nothing is
    required (no target, or a deadline run that has done all its steps); 0.0 when the
    deadline has passed with steps still to do (nothing is fast enough)."""
    required: list[float] = []
    if target.step_time is not None:
        required.append(target.step_time)
    if target.deadline is not None and target.steps is not None:
        left = target.steps - iterations
        if left > 0:
            required.append(max(0.0, target.deadline - now) / left)
    return min(required) if required else None


def misses(ls: Ls, now: float, slack: float = 0.0) -> bool | None:
    """Whether ``ls`` at its recent step rate misses its target (by ``slack`` of it:
    with slack > 0, whether it fails to meet it with that much room). None: unknown (no
    target, or no step time measured yet)."""
    required = required_step_time(ls.target, ls.iterations, now)
    if required is None or ls.step_time is None:
        return None
    return ls.step_time > required * (1.0 - slack)


@dataclass
class _Gpu:
    taken: dict[str, int] = field(default_factory=dict)  # BE task -> percent taken from it
    # LS task -> percent given to it; an entry at 0 holds the pauses made for it
    given: dict[str, int] = field(default_factory=dict)
    paused: list[str] = field(default_factory=list)  # BE tasks paused, in pause order
    changed: float = -math.inf  # when the last change was made


class Elastic:
    """The elastic rule over time: what has been taken from whom on each GPU."""

    def __init__(self, settings: Settings | None = None) -> None:
        self.settings = settings or Settings()
        self._gpus: dict[int, _Gpu] = {}
        self._over: dict[str, float] = {}  # LS task -> since when it uses more than its share
        self._held: dict[str, str] = {}

    def sweep(self, now: float, ls_tasks: Iterable[Ls], be_tasks: Iterable[Be]) -> Plan:
        ls_by_gpu: dict[int, list[Ls]] = {}
        be_by_gpu: dict[int, list[Be]] = {}
        for ls in ls_tasks:
            ls_by_gpu.setdefault(ls.gpu, []).append(ls)
        for be in be_tasks:
            be_by_gpu.setdefault(be.gpu, []).append(be)

        shares: dict[str, int] = {}
        paused: set[str] = set()
        for gpu in sorted(set(self._gpus) | set(ls_by_gpu)):
            state = self._gpus.setdefault(gpu, _Gpu())
            lss = ls_by_gpu.get(gpu, [])
            bes = {b.task_id: b for b in be_by_gpu.get(gpu, [])}
            self._forget(state, {t.task_id for t in lss}, bes)
            due = lss and now - state.changed >= self.settings.window
            if due and self._change(state, now, lss, bes):
                state.changed = now
            if not state.taken and not state.given and not state.paused:
                del self._gpus[gpu]
                continue
            for task_id, taken in state.taken.items():
                shares[task_id] = bes[task_id].base - taken
            for ls in lss:
                if state.given.get(ls.task_id):
                    shares[ls.task_id] = ls.base + state.given[ls.task_id]
            paused.update(state.paused)

        held = self._holds(now, [t for ts in ls_by_gpu.values() for t in ts], shares)
        return Plan(shares=shares, paused=frozenset(paused), held=held)

    def _forget(self, state: _Gpu, ls_ids: set[str], bes: Mapping[str, Be]) -> None:
        """Drop what belongs to tasks gone from the GPU; when no LS task is left that was
        given anything, give everything back at once."""
        for task_id in [t for t in state.given if t not in ls_ids]:
            del state.given[task_id]
        for task_id in [t for t in state.taken if t not in bes]:
            del state.taken[task_id]
        state.paused = [t for t in state.paused if t in bes]
        if not state.given:
            state.taken.clear()
            state.paused.clear()

    def _change(self, state: _Gpu, now: float, lss: list[Ls], bes: Mapping[str, Be]) -> bool:
        """One elastic step on a GPU, if its LS tasks call for one: more for the LS task
        furthest from its target, or one step back when every LS task meets its target
        with room. Whether anything changed."""
        step = self.settings.step
        missing = [t for t in lss if misses(t, now)]
        if missing:
            worst = max(missing, key=lambda t: _lateness(t, now))
            donors = sorted(
                (b for b in bes.values() if b.task_id not in state.paused),
                key=lambda b: (-(b.base - state.taken.get(b.task_id, 0)), b.task_id),
            )
            if donors and donors[0].base - state.taken.get(donors[0].task_id, 0) > 0:
                donor = donors[0]
                moved = min(step, donor.base - state.taken.get(donor.task_id, 0))
                state.taken[donor.task_id] = state.taken.get(donor.task_id, 0) + moved
                state.given[worst.task_id] = state.given.get(worst.task_id, 0) + moved
                return True
            if donors:
                # No share left to take: the BE tasks there can no longer run beside it.
                state.paused.extend(sorted(b.task_id for b in donors))
                state.given.setdefault(worst.task_id, 0)
                return True
            return False
        roomy = all(misses(t, now, self.settings.slack) is False for t in lss if t.target.stated)
        if not roomy or not (state.taken or state.paused):
            return False
        if state.paused:
            state.paused.pop()
            return True
        donor_id = max(state.taken, key=lambda t: (state.taken[t], t))
        back = min(step, state.taken[donor_id])
        state.taken[donor_id] -= back
        if not state.taken[donor_id]:
            del state.taken[donor_id]
        receiver = max(state.given, key=lambda t: (state.given[t], t))
        state.given[receiver] = max(0, state.given[receiver] - back)
        if not state.taken:
            state.given.clear()
        return True

    def _holds(self, now: float, lss: list[Ls], shares: Mapping[str, int]) -> dict[str, str]:
        """Seed 000's last rule: an LS task over its share for longer than a window is
        held until a sweep sees it back within it."""
        tol = self.settings.tolerance
        live = {t.task_id for t in lss}
        for task_id in [t for t in self._over if t not in live]:
            del self._over[task_id]
        for task_id in [t for t in self._held if t not in live]:
            del self._held[task_id]
        for t in lss:
            share = shares.get(t.task_id, t.base)
            if t.used is None:
                continue
            if t.task_id in self._held:
                if t.used <= share:
                    del self._held[t.task_id]
                    self._over.pop(t.task_id, None)
                continue
            if t.used <= share + tol:
                self._over.pop(t.task_id, None)
                continue
            since = self._over.setdefault(t.task_id, now)
            if now - since > self.settings.window:
                self._held[t.task_id] = (
                    f"used {t.used:.0f}% of its GPU for {now - since:.1f}s,"
                    f" over its share of {share}%"
                )
        return dict(self._held)


def _lateness(ls: Ls, now: float) -> float:
    """How far ``ls`` is from its target: its step time over the one it needs."""
    required = required_step_time(ls.target, ls.iterations, now)
    if not required or ls.step_time is None:
        return math.inf
    return ls.step_time / required


class StepRates:
    """Each task's recent seconds per step, from the boundary counts the sweeps read:
    over the last ``window`` seconds, once at least two boundaries fell within it (a
    task slower than that is measured from its last two boundaries seen)."""

    def __init__(self, window: float) -> None:
        self.window = window
        self._seen: dict[str, list[tuple[float, int]]] = {}

    def feed(self, task_id: str, now: float, iterations: int) -> float | None:
        """Note ``task_id``'s boundary count at ``now``; its step time, None until known.
        Counted from its first boundary: the time before it is start-up (imports, model
        set-up), no step."""
        if iterations < 1:
            return None
        seen = self._seen.setdefault(task_id, [])
        if not seen or iterations != seen[-1][1]:
            seen.append((now, iterations))
        # Keep the samples of the window, and the newest two changes before it.
        while len(seen) > 2 and seen[1][0] < now - self.window:
            seen.pop(0)
        if len(seen) < 2 or seen[-1][1] <= seen[0][1]:
            return None
        (t0, i0), (t1, i1) = seen[0], seen[-1]
        # Time since the last boundary counts once it exceeds the measured step time: a
        # task that slowed down is seen slow before its next boundary.
        step = (t1 - t0) / (i1 - i0)
        return max(step, now - t1)

    def forget(self, live: set[str]) -> None:
        for task_id in [t for t in self._seen if t not in live]:
            del self._seen[task_id]
