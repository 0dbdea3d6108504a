"""The elastic unit (seed 000; docs/compute.md, "Elastic share"): at each sweep, the
latency-sensitive (LS) tasks' step rates against their targets, and what
nodemgr.policy.elastic decides made so: best-effort (BE) shares through the compute
schedule, BE tasks held for an LS task that still misses its target (GS_PAUSE_CLASS, as
for an LS request that does not fit: docs/scheduling.md, "Classes"), and LS tasks held
while they use more of their GPU than their share.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from gpushare.protocol import LS
from nodemgr.policy import compute, elastic

if TYPE_CHECKING:
    from nodemgr.node.model import Task
    from nodemgr.node.node import Node

log = logging.getLogger("nodemgr")

# What the last utilisation sample says a task kept a GPU busy, percent (None: unknown).
Used = Callable[[str, int], "int | None"]


class ElasticUnit:
    def __init__(self, node: Node) -> None:
        c = node.config
        self.node = node
        self.policy = elastic.Elastic(
            elastic.Settings(
                step=c.elastic_step, window=c.elastic_window, tolerance=float(c.elastic_tolerance)
            )
        )
        self.rates = elastic.StepRates(c.elastic_window)
        self.shares: dict[str, int] = {}  # task -> the share the rule gives it now
        self.paused: dict[str, str] = {}  # BE task -> the LS task it is held for
        self.held: dict[str, str] = {}  # LS task -> why it is held
        self.step_times: dict[str, float] = {}  # LS task -> its recent seconds per step

    def share(self, task: Task) -> int | None:
        """The share ``task`` runs with: the rule's, else what it asked for."""
        return self.shares.get(task.task_id, task.request.compute)

    def _base(self, task: Task) -> int | None:
        env = self.node.envs[task.env]
        member = compute.Member(task.task_id, task.gpus, task.request.compute, env.compute)
        return compute.effective(member)

    def sweep(self, now: float, used: Used) -> None:
        """One look at every LS task (``now``: wall clock)."""
        node = self.node
        tasks = node.tasks
        ls_tasks = [t for t in tasks.values() if t.task_class == LS]
        if not ls_tasks and not (self.shares or self.paused or self.held):
            return
        be_base: dict[int, list[elastic.Be]] = {}
        for t in tasks.values():
            if t.task_class != LS:
                for g in t.gpus:
                    be_base.setdefault(g, []).append(elastic.Be(t.task_id, g, self._base(t) or 0))
        seen: list[elastic.Ls] = []
        for t in ls_tasks:
            entry = node.envs[t.env].ledger.task_entry(t.task_id)
            iterations = entry.iterations if entry else 0
            step = self.rates.feed(t.task_id, now, iterations)
            if step is not None:
                self.step_times[t.task_id] = step
            r = t.request
            target = elastic.Target(
                r.step_target, None if r.deadline is None else t.started + r.deadline, r.steps
            )
            own = self._base(t)
            for g in t.gpus:
                rest = 100 - sum(b.base for b in be_base.get(g, []))
                base = own if own is not None else max(0, rest)
                # Held for use over its share only with a share of its own: without one,
                # what BE shares leave is no limit (BE windows left idle are its to use).
                u = used(t.task_id, g) if own is not None else None
                seen.append(
                    elastic.Ls(
                        t.task_id,
                        g,
                        target,
                        base,
                        iterations,
                        step,
                        None if u is None else float(u),
                    )
                )
        self.rates.forget({t.task_id for t in ls_tasks})
        for task_id in [t for t in self.step_times if t not in tasks]:
            del self.step_times[task_id]
        plan = self.policy.sweep(now, seen, [b for bs in be_base.values() for b in bs])
        self._apply_shares(plan, tasks)
        self._apply_pauses(plan, tasks)
        self._apply_holds(plan, tasks)

    def _apply_shares(self, plan: elastic.Plan, tasks: dict[str, Task]) -> None:
        # An LS task without a share of its own is never gated: what the rule gives it is
        # what it takes from the BE tasks, whose windows shrink.
        shares = {
            t: s
            for t, s in plan.shares.items()
            if t in tasks and (tasks[t].task_class != LS or self._base(tasks[t]) is not None)
        }
        if shares != self.shares:
            log.info("elastic shares: %s", shares or "none")
            self.shares = shares
            self.node.apply_compute()

    def _apply_pauses(self, plan: elastic.Plan, tasks: dict[str, Task]) -> None:
        node = self.node
        for task_id in sorted(plan.paused - set(self.paused)):
            task = tasks.get(task_id)
            if task is None:
                continue
            ls = next(
                (t for t in tasks.values() if t.task_class == LS and set(t.gpus) & set(task.gpus)),
                None,
            )
            if ls is None:
                continue
            self.paused[task_id] = ls.task_id
            node.hold_for_ls(
                task,
                ls.task_id,
                f"paused for latency-sensitive task {ls.task_id} of {ls.env}, which misses its"
                " target with no share left to take (the elastic rule)",
            )
        for task_id in sorted(set(self.paused) - plan.paused):
            key = self.paused.pop(task_id)
            held = tasks.get(task_id)
            if held is not None:
                # resume_held (each run of the queue) lets it go once nothing else holds it.
                held.preempted_by.discard(key)
                node.queue_dirty = True

    def _apply_holds(self, plan: elastic.Plan, tasks: dict[str, Task]) -> None:
        for task_id, why in plan.held.items():
            if task_id not in self.held and task_id in tasks:
                task = tasks[task_id]
                self.node.envs[task.env].ledger.task_hold_class(task_id, True)
                log.info("hold %s env=%s: %s", task_id, task.env, why)
            self.held[task_id] = why
        for task_id in [t for t in self.held if t not in plan.held]:
            del self.held[task_id]
            back = tasks.get(task_id)
            if back is not None:
                self.node.envs[back.env].ledger.task_hold_class(task_id, False)
                log.info("release %s env=%s: back within its share", task_id, back.env)
