"""GPU utilisation from NVML (docs/operations.md, "Utilisation"): each GPU's busy share and
memory-controller share (nvmlDeviceGetUtilizationRates), and each process's busy share
(nvmlDeviceGetProcessUtilization), summed per task.

Sampled every ``gpus.utilization_interval`` seconds by the event loop; ``shares`` (which
task each process's figure belongs to) is pure. Processes are matched to tasks as the
bypass audit matches them (nodemgr.host.audit): by the pid recorded in a ledger slot, compared
with the process's own pid, else by descent from a task's client.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nodemgr.host import audit, procfs

if TYPE_CHECKING:
    from nodemgr.node.node import Node

log = logging.getLogger("nodemgr")


@dataclass(frozen=True)
class GpuSample:
    """One GPU's figures, percent; None where NVML gives none."""

    gpu: int | None
    memory: int | None
    processes: dict[int, int]  # NVML's pid -> its busy share of the GPU


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


def sample(uuids: Sequence[str]) -> list[GpuSample]:
    """Every GPU's figures (by UUID, nodemgr's index order). Raises pynvml.NVMLError when
    NVML cannot be asked at all; a figure a GPU does not support is None (or no
    processes)."""
    import pynvml

    pynvml.nvmlInit()
    try:
        out = []
        for uuid in uuids:
            h = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            gpu: int | None = None
            memory: int | None = None
            try:
                rates = pynvml.nvmlDeviceGetUtilizationRates(h)
                gpu, memory = int(rates.gpu), int(rates.memory)
            except pynvml.NVMLError:
                pass
            procs: dict[int, int] = {}
            try:
                found: list[Any] = pynvml.nvmlDeviceGetProcessUtilization(h, 0)
            except pynvml.NVMLError:  # NOT_FOUND: no samples; NOT_SUPPORTED
                found = []
            newest: dict[int, int] = {}
            for p in found:
                # Several samples of one process: the newest.
                if int(p.timeStamp) >= newest.get(int(p.pid), -1):
                    newest[int(p.pid)] = int(p.timeStamp)
                    procs[int(p.pid)] = min(100, int(p.smUtil))
            out.append(GpuSample(gpu, memory, procs))
        return out
    finally:
        pynvml.nvmlShutdown()


class Sampler:
    """Samples a node's (nodemgr.node.node.Node) utilisation every gpus.utilization_interval."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.state: Utilization = node.utilization
        self._next = time.monotonic() + node.config.utilization_interval

    def due(self, now: float) -> bool:
        interval = self.node.config.utilization_interval
        return interval > 0 and now >= self._next

    def run(self, now: float) -> None:
        node = self.node
        self._next = now + node.config.utilization_interval
        try:
            audit.nvml_ready(node)
            samples = sample([g.uuid for g in node.gpus])
        except Exception as e:  # pynvml.NVMLError, a missing library: said once
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
