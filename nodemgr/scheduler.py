"""GPU selection, seed 001 figure 3: state in, decision out, no I/O.

``select`` decides which GPUs a task of an environment gets. The caller
(nodemgr.state) applies the decision: charges memory on GPUs new to the
environment and records the task.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Refusal:
    code: str  # a nodemgr.protocol.Err code
    message: str


@dataclass(frozen=True)
class Choice:
    gpus: tuple[int, ...]  # chosen GPU indices
    new: tuple[int, ...]  # those not yet used by the environment


@dataclass(frozen=True)
class GpuView:
    index: int
    tasks: int  # tasks of all environments on this GPU
    fits: bool  # the environment's memory quota fits in what is left of it


def select(
    need: int,
    quota: int,
    env_gpus: frozenset[int],
    gpus: list[GpuView],
    threshold: int,
) -> Choice | Refusal:
    """Choose ``need`` GPUs for an environment with GPU-count ``quota``.

    ``env_gpus`` are the GPUs its running tasks use. New GPUs must have
    fewer than ``threshold`` tasks and room for the environment's memory
    quota; GPUs the environment already uses are shared by its tasks and may
    be reused, least-loaded first. Ties go to the lower index.
    """
    if quota == 0:
        return Refusal("quota_zero", "this environment's GPU quota is 0; ask an admin for a quota")
    if need > quota:
        return Refusal(
            "quota_exceeded",
            f"asked for {need} GPUs but this environment's quota is {quota}",
        )
    by_index = {g.index: g for g in gpus}
    used = len(env_gpus)
    new_allowed = quota - used
    reusable = sorted(env_gpus, key=lambda i: (by_index[i].tasks if i in by_index else 0, i))
    if new_allowed <= 0:
        if used < need:
            return Refusal("no_resources", f"this environment already uses {used} GPUs")
        return Choice(tuple(reusable[:need]), ())
    candidates = sorted(
        (g for g in gpus if g.index not in env_gpus and g.tasks < threshold and g.fits),
        key=lambda g: (g.tasks, g.index),
    )[:new_allowed]
    if len(candidates) >= need:
        chosen = tuple(g.index for g in candidates[:need])
        return Choice(chosen, chosen)
    reuse = need - len(candidates)
    if used < reuse:
        return Refusal(
            "no_resources",
            f"{len(candidates)} free GPUs and {used} in use by this environment; {need} needed",
        )
    new = tuple(g.index for g in candidates)
    return Choice(new + tuple(reusable[:reuse]), new)
