"""GPU selection (docs/scheduling.md#the-algorithm): state in, decision out, no I/O.

``select`` decides which GPUs a task of an environment gets, or why it gets
none. The caller (nodemgr.node.node) applies a Choice: charges the environment's
memory quota on GPUs new to it and records the task. docs/scheduling.md
is the specification, case by case.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gpushare.sizes import format_size, plural

# Refusal codes; the same strings as gpushare.protocol.Err.
QUOTA_ZERO = "quota_zero"  # the environment may not use GPUs at all
QUOTA_EXCEEDED = "quota_exceeded"  # never satisfiable as things stand
NO_RESOURCES = "no_resources"  # may succeed once other tasks end


@dataclass(frozen=True)
class Refusal:
    code: str
    message: str

    @property
    def retryable(self) -> bool:
        return self.code == NO_RESOURCES


@dataclass(frozen=True)
class Choice:
    gpus: tuple[int, ...]  # chosen GPU indices, in the order the task sees them
    new: tuple[int, ...]  # those not yet used by the environment


@dataclass(frozen=True)
class GpuView:
    """One GPU of the node as the scheduler sees it."""

    index: int
    tasks: int  # tasks of all environments on it
    capacity: int  # bytes environments may be charged in all: memory less the reserve
    free: int  # capacity less what is charged now
    usable: bool = True  # False once NVML reports the GPU lost
    # A time-sliced GPU (docs/timeslicing.md): the charge this request would add to it,
    # whether new to the environment or not. None: a shared GPU, charged the
    # environment's memory quota when new to it and nothing when reused.
    extra: int | None = None
    # An admin drained it: no new task gets it (its tasks run on); unlike a lost GPU, a
    # request that only it could serve waits, it is not refused for good.
    drained: bool = False


@dataclass(frozen=True)
class Ask:
    """A task's request, with its environment's quota and holdings."""

    need: int  # GPUs the task asks for, >= 1
    quota: int  # the environment's GPU-count quota
    memory: int  # the environment's per-GPU memory quota, bytes
    env_gpus: Mapping[int, int]  # GPUs the environment uses -> its tasks there
    memory_hint: int | None = None  # per-GPU bytes the task says it needs
    # The only GPUs the task may get (the user's CUDA_VISIBLE_DEVICES); None: any.
    allowed: frozenset[int] | None = None
    # Time-sliced GPUs: the task's estimated (persistent, temporary) bytes per GPU.
    estimate: tuple[int, int] | None = None


def select(ask: Ask, gpus: Sequence[GpuView], threshold: int) -> Choice | Refusal:
    """Choose ``ask.need`` GPUs, or refuse with a code that says whether waiting can help.

    docs/scheduling.md#the-algorithm, with ``used`` the environment's GPUs and
    ``new_allowed = quota - used``:

    * ``new_allowed <= 0``: reuse the ``need`` least-loaded of the
      environment's GPUs.
    * ``new_allowed > 0``: candidates are GPUs the environment does not use,
      with fewer than ``threshold`` tasks and room for its memory quota, at
      most ``new_allowed`` of them, most free memory first (on a time-sliced
      GPU: most left after what the task adds to its charge). Enough of them:
      take ``need``. Too few: take them all and reuse
      ``need - len(candidates)`` of the environment's least-loaded GPUs; if
      it uses fewer than that, refuse.

    ``ask.allowed``, when set, keeps both new and reused GPUs to that set; a
    request it makes impossible is refused as ``quota_exceeded``, one whose
    allowed GPUs are busy as ``no_resources``.
    """
    if ask.quota == 0:
        return Refusal(
            QUOTA_ZERO,
            "this environment's GPU quota is 0: run on the CPU, or ask an admin for a quota",
        )
    if ask.memory_hint is not None and ask.memory_hint > ask.memory:
        return Refusal(
            QUOTA_EXCEEDED,
            f"the task says it needs {format_size(ask.memory_hint)} per GPU but this "
            f"environment's memory quota is {format_size(ask.memory)} per GPU; ask for less "
            "or ask an admin "
            "to raise the quota",
        )
    if ask.estimate is not None and sum(ask.estimate) > ask.memory:
        return Refusal(
            QUOTA_EXCEEDED,
            f"the task estimates {format_size(ask.estimate[0])} persistent and "
            f"{format_size(ask.estimate[1])} temporary per GPU but this environment's memory "
            f"quota is {format_size(ask.memory)} per GPU; "
            "ask for less or ask an admin to raise the quota",
        )
    # An environment that may take no new GPU yet holds fewer than it asks for
    # (new_allowed == 0 and used < need) implies need > quota: it can never succeed,
    # so it is refused as such here.
    if ask.need > ask.quota:
        return Refusal(
            QUOTA_EXCEEDED,
            f"asked for {plural(ask.need, 'GPU')} but this environment's quota is {ask.quota}",
        )
    usable = [g for g in gpus if g.usable]
    could_hold = [g for g in usable if g.capacity >= ask.memory]
    if not could_hold:
        return Refusal(
            QUOTA_EXCEEDED,
            f"this environment's per-GPU memory quota of {format_size(ask.memory)} is more "
            "than any "
            "GPU of this node can give; ask an admin to lower it",
        )
    if ask.need > len(could_hold):
        return Refusal(
            QUOTA_EXCEEDED,
            f"asked for {plural(ask.need, 'GPU')} but only {plural(len(could_hold), 'GPU')} "
            f"of this node can hold this environment's memory quota of "
            f"{format_size(ask.memory)} per GPU",
        )
    allowed = ask.allowed
    if allowed is not None:
        could_hold = [g for g in could_hold if g.index in allowed]
        if ask.need > len(could_hold):
            return Refusal(
                QUOTA_EXCEEDED,
                f"asked for {plural(ask.need, 'GPU')} but the request's CUDA_VISIBLE_DEVICES "
                f"allows {_names(allowed)}, of which {len(could_hold)} can hold this environment's "
                f"memory quota of {format_size(ask.memory)} per GPU (the others are lost or too "
                "small); allow more GPUs, or unset CUDA_VISIBLE_DEVICES",
            )
        usable = [g for g in usable if g.index in allowed]
    drained = [g.index for g in usable if g.drained]
    usable = [g for g in usable if not g.drained]
    by_index = {g.index: g for g in gpus}
    used = len(ask.env_gpus)
    reusable = sorted(
        (
            i
            for i in ask.env_gpus
            if i in by_index
            and by_index[i].usable
            and not by_index[i].drained
            and (allowed is None or i in allowed)
            and _room(by_index[i], None)
        ),
        key=lambda i: (by_index[i].tasks, i),
    )
    new_allowed = ask.quota - used
    if new_allowed <= 0:
        if len(reusable) < ask.need:
            if allowed is None:
                why = f"{plural(ask.need, 'GPU')} needed; this environment can use {len(reusable)}"
            else:
                why = (
                    f"{plural(ask.need, 'GPU')} needed; this environment's GPU quota is in use and "
                    f"{len(reusable)} of its GPUs are among those CUDA_VISIBLE_DEVICES allows "
                    f"({_names(allowed)}); wait for its other tasks to end"
                )
            return Refusal(NO_RESOURCES, why + _drained(drained))
        return Choice(tuple(reusable[: ask.need]), ())
    candidates = sorted(
        (
            g
            for g in usable
            if g.index not in ask.env_gpus and g.tasks < threshold and _room(g, ask.memory)
        ),
        key=lambda g: (-_left(g, ask.memory), g.tasks, g.index),
    )[:new_allowed]
    if len(candidates) >= ask.need:
        chosen = tuple(g.index for g in candidates[: ask.need])
        return Choice(chosen, chosen)
    reuse = ask.need - len(candidates)
    if len(reusable) < reuse:
        among, of_them = "", ""
        if allowed is not None:
            among = f" of those CUDA_VISIBLE_DEVICES allows ({_names(allowed)})"
            of_them = " of them"
        return Refusal(
            NO_RESOURCES,
            f"{plural(ask.need, 'GPU')} needed: {plural(len(candidates), 'free GPU')}{among} "
            f"can take this environment and it holds {len(reusable)}{of_them}; "
            + _wait_advice(drained, sum(not g.drained for g in could_hold) < ask.need),
        )
    new = tuple(g.index for g in candidates)
    return Choice(new + tuple(reusable[:reuse]), new)


def _wait_advice(drained: Sequence[int], undrain_only: bool) -> str:
    """What a request refused for want of free GPUs waits for: other tasks to end, or, when
    GPUs it could use are drained and too few others could ever serve it, an undrain."""
    if not drained:
        return "wait for other tasks to end"
    if undrain_only:
        return "only an admin's undrain (nodemgr undrain) lets it through" + _drained(drained)
    return "wait for other tasks to end, or an admin's undrain (nodemgr undrain)" + _drained(
        drained
    )


def _drained(indices: Sequence[int]) -> str:
    """What a refusal that may wait adds when GPUs it could use are drained."""
    if not indices:
        return ""
    return f" ({_names(frozenset(indices))} drained by an admin)"


def _left(g: GpuView, quota: int) -> int:
    """What ranks a candidate GPU: its free memory once the task is charged there (on a
    shared GPU its environment's quota, the same on every shared GPU; on a time-sliced GPU
    what the task adds to the GPU's charge)."""
    return g.free - (g.extra if g.extra is not None else quota)


def _room(g: GpuView, charge: int | None) -> bool:
    """Whether ``g`` can take the task: a shared GPU's free memory holds ``charge`` (the
    quota, for a GPU new to the environment; None: one it holds, shared without a check);
    a time-sliced GPU's free memory holds what the task adds to its charge."""
    if g.extra is not None:
        return g.free >= g.extra
    return charge is None or g.free >= charge


def _names(allowed: frozenset[int]) -> str:
    """``GPU 2`` or ``GPUs 0, 3``: an allowed set in a message."""
    if not allowed:
        return "no GPU"
    listed = ", ".join(str(i) for i in sorted(allowed))
    return f"GPU {listed}" if len(allowed) == 1 else f"GPUs {listed}"
