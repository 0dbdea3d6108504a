"""Taking up what an earlier nodemgr left, and what nodemgr lost while it ran.

At start (restore): the quotas and running tasks in the database, and the ledgers their
processes still map, so that nothing is granted twice while their clients come back. While
it runs (check_ledgers, repair_ledgers): a ledger removed with run_dir (a tmpfs cleaner, an
rm -rf), replaced once its environment's tasks and processes have ended. The server calls
these; what they change is the Node's (nodemgr.node.node).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from gpushare.messages import Request
from nodemgr.host import envdirs
from nodemgr.host.ledger import LedgerError, TaskEntry
from nodemgr.node.model import Env, Task
from nodemgr.node.node import Node
from nodemgr.policy.ratelimit import LogThrottle, log_throttled
from nodemgr.policy.steptime import Estimate

log = logging.getLogger("nodemgr")


def restore(node: Node, forget_unknown: bool = False) -> list[Task]:
    """Load quotas and running tasks from the database, adopting the ledgers running
    processes still map. Returns the tasks restored; their GPUs stay held, so nothing
    is granted twice while their clients come back. ``forget_unknown``: start although
    unused ledgers of environments the database does not know are left
    (envdirs.check_unknown)."""
    rows = node.store.envs()
    known = {row.name for row in rows}
    envdirs.check_unknown(node.config, node.gpus, known, node.store.path, forget_unknown)
    for row in rows:
        try:
            node.open_env(row.name, row.gpus, row.memory, adopt=True)
        except (OSError, LedgerError) as e:
            # Its directory holds something nodemgr cannot clear or write: this
            # environment alone is refused until a `quota set` of it succeeds.
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            log.error(
                "environment %s refused: cannot prepare %s: %s",
                row.name,
                node.config.env_dir(row.name),
                why,
            )
    for name, (timeout, action) in node.store.env_idle().items():
        if name in node.envs:
            node.envs[name].idle_timeout = timeout
            node.envs[name].idle_action = action
    for name, (class_default, allow_ls) in node.store.env_classes().items():
        if name in node.envs:
            node.envs[name].class_default = class_default
            node.envs[name].allow_ls = allow_ls
    for name, cap in node.store.env_compute().items():
        if name in node.envs:
            node.envs[name].compute = cap
    now = time.monotonic()
    restored = []
    requests = node.store.task_requests()
    for rec in node.store.running():
        env = node.envs.get(rec.env)
        if env is None or any(i >= len(node.gpus) for i in rec.gpus):
            # Its environment or GPU is gone; nothing can be held for it.
            node.store.task_ended(rec.task_id, time.time(), "admin", rec.peak, None)
            continue
        # A request the database lost (a damaged row) is known only by what the record says.
        request = requests.get(rec.task_id) or Request(gpus=len(rec.gpus), command=rec.command)
        if request.guard is None:
            request = replace(request, guard=node.config.guard)
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
            request=request,
            restored=True,
            peak=rec.peak,
            arrival=node.slicing.arrive(),
            topups=rec.topups,
            gpu_model=rec.gpu_model,
            estimate=None
            if rec.predicted_step is None
            else Estimate(rec.predicted_step, rec.predicted_util or 0.0, "recorded"),
        )
        node.add_task(task)
        for index in task.gpus:
            env.held.setdefault(index, set()).add(task.task_id)
        restored.append(task)
    for env in node.envs.values():
        _restore_entries(node, env)
        for index in range(len(node.gpus)):
            if index in env.held:
                # An earlier nodemgr may have let it hold its quota there (a top-up not yet
                # in the database, a task the database lost): believed that far until what
                # it holds fits its allowance.
                env.ledger.may_hold(index, env.memory)
                node.set_held_limit(env, index)
            else:
                env.ledger.set_limit(index, 0)
                if env.ledger.used(index):
                    # Its processes may keep what the last limit there let them hold.
                    env.ledger.may_hold(index, env.memory)
                    env.draining.add(index)
    if restored:
        log.info("restored %d running tasks; waiting for their clients", len(restored))
    for env in node.envs.values():
        if not env.adopted and any(t.env == env.name for t in restored):
            # Their processes charge a ledger file nodemgr can no longer see: a second
            # quota beside it would overcommit.
            env.orphaned = (
                "its ledger was missing or invalid at start while it had running tasks, "
                "whose processes may still charge the old one"
            )
            log.error("env %s: %s; no task is granted until they end", env.name, env.orphaned)
        env.ledger.reap()
        unknown = sorted(set(env.ledger.summary()) - set(node.tasks))
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
    entries: dict[str, TaskEntry] = {}
    for task in node.tasks.values():
        entry = node.envs[task.env].ledger.task_entry(task.task_id)
        if entry is not None:
            entries[task.task_id] = entry
            if entry.class_paused:
                # Held for an LS task before the restart: it goes on once its quota fits
                # again (Node.resume_held), which nothing holding it any more may allow.
                node.held_for_ls.add(task.task_id)
                task.preempted = "paused for a latency-sensitive task before nodemgr restarted"
    for env in node.envs.values():
        for index in env.held:
            node.set_held_limit(env, index)
    node.queue_dirty = True
    node.slicing.adopt(entries)
    # Every restored task's window, written again (an adopted entry may hold an old one).
    node.apply_compute()
    node.read_regions()
    node.slicing.retime(time.perf_counter())
    return restored


def _restore_entries(node: Node, env: Env) -> None:
    """Free the task entries of tasks that did not survive the restart; give restored
    tasks theirs. An adopted entry is kept as it is, pause word included: the task's
    processes may be waiting on it. An entry whose id nodemgr cannot have written (the
    environment's processes may write the file) is freed."""
    malformed = env.ledger.free_malformed()
    if malformed:
        log.warning(
            "env %s: freed %d task entries of its ledger whose ids nodemgr never wrote",
            env.name,
            malformed,
        )
    for task_id in env.ledger.task_ids():
        task = node.tasks.get(task_id)
        if task is None or task.env != env.name:
            env.ledger.task_remove(task_id)
    for task in node.tasks.values():
        if task.env == env.name:
            node.add_entry(env, task.task_id)


# --- ledgers lost with run_dir -------------------------------------------------


def check_ledgers(node: Node, throttle: LogThrottle) -> None:
    """Notice a ledger whose path no longer names it (run_dir removed or replaced). Said
    once per environment per ``throttle`` interval: its user may replace it in a loop."""
    for env in node.envs.values():
        if env.orphaned is None and not env.ledger.is_at_path():
            env.orphaned = f"its ledger {env.ledger.path} was removed or replaced while in use"
            log_throttled(
                log,
                throttle,
                f"{env.name}/ledger",
                logging.ERROR,
                f"env {env.name}: {env.orphaned}; its running tasks go on, no task is granted "
                "until they and their processes end, then a new ledger replaces it",
            )


def repair_ledgers(node: Node, throttle: LogThrottle) -> list[str]:
    """Give each orphaned environment whose tasks and processes have all ended a new
    ledger; returns their names (their sockets went with their old directory)."""
    repaired = []
    for env in list(node.envs.values()):
        if env.orphaned is None or any(t.env == env.name for t in node.tasks.values()):
            continue
        if env.ledger.is_at_path():
            # Made at start beside the lost one: in order once the restored tasks end.
            env.orphaned = None
            log.warning("env %s: its restored tasks have ended; tasks are granted again", env.name)
            node.queue_dirty = True
            continue
        if env.ledger.live_pids():
            continue
        env.ledger.close()
        new = node.open_env(env.name, env.gpus, env.memory, adopt=False)
        new.launches_done = env.launches_done
        log_throttled(
            log,
            throttle,
            f"{env.name}/new-ledger",
            logging.WARNING,
            f"env {env.name}: a new ledger replaces the lost one; tasks are granted again",
        )
        repaired.append(env.name)
        node.queue_dirty = True
    return repaired
