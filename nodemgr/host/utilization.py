"""GPU utilisation from NVML (docs/operations.md, "Utilisation"): each GPU's busy share and
memory-controller share (nvmlDeviceGetUtilizationRates), and each process's busy share
(nvmlDeviceGetProcessUtilization), summed per task.

Sampled every ``gpus.utilization_interval`` seconds by the event loop, through the node's
GPU backend (nodemgr.host.backend); ``shares`` (which task each process's figure belongs
to) is pure. Processes are matched to tasks as the bypass audit matches them
(nodemgr.host.audit): by the pid recorded in a ledger slot, compared with the process's own
pid, else by descent from a task's client.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nodemgr.host import audit, procfs
from nodemgr.host.backend import GpuSample

if TYPE_CHECKING:
    from nodemgr.host.backend import GpuBackend
    from nodemgr.node.node import Node

log = logging.getLogger("nodemgr")


@dataclass
class Utilization:
    """The last sample: per GPU, and per task (task id -> GPU index -> percent)."""

    gpus: list[GpuSample] = field(default_factory=list)
    tasks: dict[str, dict[int, int]] = field(default_factory=dict)
    error: str | None = None  # why the last sample could not ask NVML, if it could not

    def gpu(self, index: int) -> GpuSample | None:
        return self.gpus[index] if index < len(self.gpus) else None

    def task(self, task_id: str, gpus: Iterable[int]) -> list[int | None]:
        """The task's busy share of each of ``gpus`` (None before any sample)."""
        if not self.gpus:
            return [None for _ in gpus]
        mine = self.tasks.get(task_id, {})
        return [mine.get(g, 0) for g in gpus]


def shares(
    samples: Sequence[GpuSample],
    own: Mapping[int, int],
    slots: Iterable[audit.Slot],
    owners: Mapping[int, tuple[str, str]],
) -> dict[str, dict[int, int]]:
    """Per task id, per GPU index, the sum of its processes' busy shares (at most 100).

    ``own`` maps NVML's pid to the process's own pid, which ``slots`` record; ``owners``
    maps NVML's pid to the (environment, task id) of a process no slot records."""
    task_of = {s.pid: s.task_id for s in slots}
    out: dict[str, dict[int, int]] = {}
    for index, sample in enumerate(samples):
        for pid, util in sample.processes.items():
            task_id = task_of.get(own.get(pid, pid))
            if task_id is None and pid in owners:
                task_id = owners[pid][1]
            if task_id is None:
                continue
            per_gpu = out.setdefault(task_id, {})
            per_gpu[index] = min(100, per_gpu.get(index, 0) + util)
    return out


class Sampler:
    """Samples a node's (nodemgr.node.node.Node) utilisation on its GPUs' backend every
    gpus.utilization_interval, keeping the last sample in ``state``."""

    def __init__(self, node: Node, backend: GpuBackend, state: Utilization) -> None:
        self.node = node
        self.backend = backend
        self.state = state
        self._next = time.monotonic() + node.config.utilization_interval

    def due(self, now: float) -> bool:
        interval = self.node.config.utilization_interval
        return interval > 0 and now >= self._next

    def run(self, now: float) -> None:
        node = self.node
        self._next = now + node.config.utilization_interval
        try:
            samples = self.backend.utilization()
        except Exception as e:  # BackendError, a missing library: said once
            if self.state.error is None:
                log.warning("utilisation: cannot ask NVML: %s", e)
            self.state.error = str(e)
            self.state.gpus = []
            self.state.tasks = {}
            return
        self.state.error = None
        pids = {pid for s in samples for pid in s.processes}
        own = {pid: procfs.own_pid(pid) for pid in pids}
        slots, owners = audit.attribution(node, pids)
        self.state.gpus = samples
        self.state.tasks = shares(samples, own, slots, owners)
        node.note_utilization(self.state.tasks)
