"""What nodemgr knows: environments, their quotas and ledgers, and running tasks.

Decisions about GPUs come from nodemgr.scheduler; this module applies them
and keeps each environment's ledger limits in step with what it holds.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import time
from dataclasses import dataclass, field

from nodemgr import scheduler
from nodemgr.config import Config
from nodemgr.gpus import Gpu
from nodemgr.ledger import Ledger
from nodemgr.protocol import Err, ProtocolError

log = logging.getLogger("nodemgr")


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


@dataclass
class Task:
    task_id: str
    env: str
    gpus: tuple[int, ...]
    pid: int | None  # the client's pid as the kernel reports it, if known
    command: str | None
    started: float  # wall clock
    last_seen: float  # monotonic


class Node:
    def __init__(self, config: Config, gpus: list[Gpu], simulated: bool) -> None:
        self.config = config
        self.gpus = gpus
        self.simulated = simulated
        self.envs: dict[str, Env] = {}
        self.tasks: dict[str, Task] = {}
        self.started = time.time()

    # --- quotas ------------------------------------------------------------

    def set_quota(self, name: str, gpus: int, memory: int) -> Env:
        env = self.envs.get(name)
        if env is None:
            env_dir = self.config.env_dir(name)
            if env_dir.exists():
                shutil.rmtree(env_dir)  # left by an earlier run
            env_dir.mkdir(parents=True, mode=0o700)
            ledger = Ledger.create(env_dir / "ledger", [g.uuid_bytes for g in self.gpus])
            env = Env(name, gpus, memory, ledger, f"ipc://{env_dir / 'task.sock'}")
            self.envs[name] = env
        env.gpus = gpus
        env.memory = memory
        for index in env.held:
            env.ledger.set_limit(index, memory)
        log.info("quota %s: %d GPUs x %d bytes", name, gpus, memory)
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

    # --- grants ------------------------------------------------------------

    def charged(self, index: int) -> int:
        """Memory promised on a GPU: each holding environment's per-GPU quota, and what
        draining environments still hold there."""
        return sum(
            e.memory if index in e.held else e.ledger.used(index)
            for e in self.envs.values()
            if index in e.held or index in e.draining
        )

    def settle_draining(self) -> None:
        for env in self.envs.values():
            for index in [i for i in env.draining if env.ledger.used(i) == 0]:
                env.draining.discard(index)
                log.info("env %s released the last of its memory on GPU %d", env.name, index)

    def tasks_on(self, index: int) -> int:
        return sum(len(e.held.get(index, ())) for e in self.envs.values())

    def grant(
        self, env_name: str, need: int, memory: int | None, pid: int | None, command: str | None
    ) -> Task:
        env = self.env(env_name)
        if memory is not None and memory > env.memory:
            raise ProtocolError(
                Err.QUOTA_EXCEEDED,
                f"asked for {memory} bytes per GPU but environment {env.name!r} may use "
                f"{env.memory} bytes per GPU",
            )
        if need > len(self.gpus):
            raise ProtocolError(
                Err.QUOTA_EXCEEDED, f"asked for {need} GPUs but this node has {len(self.gpus)}"
            )
        if not any(g.memory >= env.memory for g in self.gpus):
            raise ProtocolError(
                Err.QUOTA_EXCEEDED,
                f"environment {env.name!r} has a per-GPU memory quota of {env.memory} bytes, "
                "more than any GPU of this node has; ask an admin to lower it",
            )
        views = [
            scheduler.GpuView(
                g.index,
                self.tasks_on(g.index),
                self.charged(g.index) + env.memory <= g.memory,
            )
            for g in self.gpus
        ]
        decision = scheduler.select(
            need, env.gpus, frozenset(env.held), views, self.config.task_threshold
        )
        if isinstance(decision, scheduler.Refusal):
            raise ProtocolError(decision.code, decision.message)
        task = Task(
            task_id=secrets.token_hex(8),
            env=env.name,
            gpus=decision.gpus,
            pid=pid,
            command=command,
            started=time.time(),
            last_seen=time.monotonic(),
        )
        for index in decision.gpus:
            env.held.setdefault(index, set()).add(task.task_id)
            env.draining.discard(index)
        for index in decision.new:
            env.ledger.set_limit(index, env.memory)
        self.tasks[task.task_id] = task
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

    def release(self, task_id: str, reason: str) -> Task | None:
        """Give back what a task holds; None if it was already gone."""
        task = self.tasks.pop(task_id, None)
        if task is None:
            return None
        env = self.envs[task.env]
        for index in task.gpus:
            holders = env.held.get(index)
            if holders is None:
                continue
            holders.discard(task_id)
            if not holders:
                del env.held[index]
                env.ledger.set_limit(index, 0)
                env.draining.add(index)
        log.info("release %s env=%s reason=%s", task_id, task.env, reason)
        return task

    def expired(self, now: float) -> list[Task]:
        limit = self.config.heartbeat_timeout
        return [t for t in self.tasks.values() if now - t.last_seen > limit]

    # --- views -------------------------------------------------------------

    def quota_view(self, env: Env) -> dict[str, object]:
        return {"env": env.name, "gpus": env.gpus, "memory": env.memory, "endpoint": env.endpoint}

    def task_view(self, task: Task) -> dict[str, object]:
        env = self.envs[task.env]
        used, launches = env.ledger.task_usage(task.task_id)
        return {
            "task_id": task.task_id,
            "env": task.env,
            "pid": task.pid,
            "gpus": list(task.gpus),
            "memory_limit": env.memory,
            "memory_used": sum(used[i] for i in task.gpus),
            "launches": launches,
            "started": task.started,
            "command": task.command,
        }

    def status_view(self) -> dict[str, object]:
        gpus = []
        for g in self.gpus:
            holders = {e.name: e for e in self.envs.values() if g.index in e.held}
            used = sum(e.ledger.used(g.index) for e in self.envs.values())
            gpus.append(
                {
                    "index": g.index,
                    "uuid": g.uuid,
                    "name": g.name,
                    "memory": g.memory,
                    "charged": self.charged(g.index),
                    "used": used,
                    "tasks": self.tasks_on(g.index),
                    "envs": sorted(holders),
                }
            )
        return {
            "version": _version(),
            "simulated": self.simulated,
            "uptime": time.time() - self.started,
            "pid": os.getpid(),
            "envs": len(self.envs),
            "tasks": len(self.tasks),
            "gpus": gpus,
        }

    def close(self) -> None:
        for env in self.envs.values():
            env.ledger.close()


def _version() -> str:
    from nodemgr import __version__

    return __version__
