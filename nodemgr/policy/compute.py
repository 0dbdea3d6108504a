"""Compute shares: the time-division schedule of each GPU (docs/compute.md).

Pure policy: tasks in, one window (or none) per task out. nodemgr writes the windows into
the tasks' ledger entries and each process's pacer enforces its own; windows are aligned to
CLOCK_MONOTONIC multiples of the period, so tasks need no word with each other.

- A GPU where no task has a share (its own or its environment's cap) has no schedule: none
  of its tasks is ever gated.
- Otherwise every task there gets a window within each period, windows never overlapping:
  a task with a share gets that percentage of the period, the others split the rest
  equally. A share is at most its environment's cap, and a task without one in a capped
  environment gets the cap. Shares that leave less than MIN_REST percent to each task
  without one (over 100 when there is none) are scaled down in proportion, and said so.
- A task holding several GPUs gets one window (its processes have one gate), so GPUs
  that tasks join that way are planned as one: every task of such a group gets a window
  apart from every other's.
- Latency classes: ``cls`` "ls" (latency-sensitive) or "be" (best-effort); None, the
  default, is neither. An LS task on a GPU with a BE task publishes its launches on the
  node's board (COMPUTE_LS_PUBLISH); a BE task on a GPU with an LS task launches outside
  its own window only while the LS side is idle (COMPUTE_YIELD_LS). An LS task without a
  share of its own is not part of the time division: it is never gated.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

# The GS_COMPUTE_* bits (shim/ledger_layout.h), kept here so the policy imports no
# bindings; tests/unit/test_compute_policy.py checks they agree.
WINDOW = 1
LS_PUBLISH = 2
YIELD_LS = 4

# What each task without a share keeps at least, in percent of the period.
MIN_REST = 5
LS = "ls"
BE = "be"


@dataclass(frozen=True)
class Member:
    """A running task as the policy sees it."""

    task_id: str
    gpus: tuple[int, ...]  # node GPU indices
    share: int | None = None  # percent it asked for (1..100); None: none
    cap: int | None = None  # its environment's cap (1..100); None: none
    cls: str | None = None  # LS, BE or None


@dataclass(frozen=True)
class Settings:
    period_ns: int = 100_000_000
    poll_ns: int = 500_000
    ls_idle_ns: int = 2_000_000


@dataclass(frozen=True)
class Window:
    """A task's schedule: launches only in [offset, offset + length) of every period (when
    ``flags`` has WINDOW), plus its class flags."""

    flags: int
    share: int  # the percentage its window is (0: no window)
    gpu_mask: int
    period_ns: int
    offset_ns: int
    length_ns: int
    poll_ns: int
    ls_idle_ns: int


@dataclass
class Plan:
    windows: dict[str, Window | None] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # shares scaled down, in words


def effective(m: Member) -> int | None:
    """The share a task is held to: its own within its environment's cap, else the cap."""
    if m.share is None:
        return m.cap
    return m.share if m.cap is None else min(m.share, m.cap)


def groups(members: Iterable[Member]) -> list[list[Member]]:
    """The members in groups that share GPUs (a task on several GPUs joins them), each group
    in the order given, groups ordered by their first member."""
    parent: dict[int, int] = {}

    def find(g: int) -> int:
        while parent.setdefault(g, g) != g:
            parent[g] = parent[parent[g]]
            g = parent[g]
        return g

    members = list(members)
    for m in members:
        for g in m.gpus[1:]:
            parent[find(g)] = find(m.gpus[0])
    out: dict[int, list[Member]] = {}
    for m in members:
        if m.gpus:
            out.setdefault(find(m.gpus[0]), []).append(m)
    return list(out.values())


def _class_flags(m: Member, group: Sequence[Member]) -> int:
    others = [o for o in group if o is not m and set(o.gpus) & set(m.gpus)]
    if m.cls == LS and any(o.cls == BE for o in others):
        return LS_PUBLISH
    if m.cls == BE and any(o.cls == LS for o in others):
        return YIELD_LS
    return 0


def _mask(gpus: Iterable[int]) -> int:
    return sum(1 << g for g in set(gpus))


def plan(members: Iterable[Member], settings: Settings = Settings()) -> Plan:
    """Every member's schedule (None: never gated) and what was scaled, in words."""
    out = Plan()
    period = settings.period_ns
    for group in groups(members):
        timed = [m for m in group if not (m.cls == LS and effective(m) is None)]
        shares = {m.task_id: effective(m) for m in timed}
        asked = {t: s for t, s in shares.items() if s is not None}
        rest = [m for m in timed if shares[m.task_id] is None]
        lengths: dict[str, int] = {}
        if asked:
            budget = 100 - MIN_REST * len(rest) if rest else 100
            total = sum(asked.values())
            scale = min(1.0, budget / total)
            if scale < 1.0:
                gpus = sorted({g for m in group for g in m.gpus})
                out.notes.append(
                    f"shares on GPU {', '.join(map(str, gpus))} ask for {total}% "
                    f"(leaving {100 - budget}% to {len(rest)} tasks without one): "
                    f"scaled to {budget}%"
                )
            for t, s in asked.items():
                lengths[t] = int(period * s * scale) // 100
            left = period - sum(lengths.values())
            for m in rest:
                lengths[m.task_id] = left // len(rest)
        offset = 0
        for m in group:
            flags = _class_flags(m, group)
            length = lengths.get(m.task_id)
            if length is None and not flags:
                out.windows[m.task_id] = None
                continue
            w_off = 0
            if length is not None:
                flags |= WINDOW
                w_off = offset
                offset += length
            out.windows[m.task_id] = Window(
                flags=flags,
                share=0 if length is None else round(100 * length / period),
                gpu_mask=_mask(m.gpus),
                period_ns=period,
                offset_ns=w_off,
                length_ns=length or 0,
                poll_ns=settings.poll_ns,
                ls_idle_ns=settings.ls_idle_ns,
            )
    return out
