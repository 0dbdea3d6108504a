"""The bypass audit (docs/operations.md, "Bypass audit"): the processes NVML sees holding
memory on each GPU, compared with what the environments' ledgers account for.

A process that holds GPU memory no ledger slot accounts for went around the shim: it was
started without LD_PRELOAD, reached the driver through a copy the shim does not hook (a
``dlmopen``ed libcuda), or rewrote its own slot. The comparison (``compare``) is pure;
reading NVML and /proc and killing are at the edge (``nvml_processes``, ``procfs.own_pid``,
``Auditor``).

Pids: NVML names a process by its pid in the driver's (the host's) pid namespace, a slot
by the pid the process itself got from getpid(), in its container's namespace. nodemgr
turns each NVML pid into the process's own pid through the last entry of NSpid in
/proc/PID/status, and compares that with the slots' pids; where nodemgr cannot read it
(the pid is not in nodemgr's namespace) NVML's pid is compared as it is.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict

from nodemgr import procfs
from nodemgr.sizes import format_size

if TYPE_CHECKING:
    from nodemgr.state import Node

log = logging.getLogger("nodemgr")

# Why a process is a finding.
NO_SLOT = "no slot"  # no ledger slot names it: the shim never charged it
BEYOND_SLOT = "beyond its slot"  # it holds more than its slots account for


@dataclass(frozen=True)
class Seen:
    """One process NVML lists on one GPU."""

    gpu: int  # nodemgr's GPU index
    pid: int  # as NVML reports it (the host's pid namespace)
    own_pid: int  # the pid the process sees itself as (NSpid's last entry)
    bytes: int  # NVML's usedGpuMemory


@dataclass(frozen=True)
class Slot:
    """One live ledger slot."""

    env: str
    task_id: str
    pid: int  # the pid the process recorded: its own getpid()
    used: tuple[int, ...]  # bytes per GPU index


@dataclass(frozen=True)
class Finding:
    """A process holding more GPU memory than the ledgers account for."""

    gpu: int
    pid: int  # NVML's
    seen: int  # bytes NVML sees it hold on the GPU
    accounted: int  # bytes the ledgers' slots of that pid hold there
    reason: str  # NO_SLOT or BEYOND_SLOT
    env: str | None  # the environment, when nodemgr knows the process
    task_id: str | None

    @property
    def key(self) -> tuple[int, int]:
        return (self.pid, self.gpu)


def compare(
    seen: Iterable[Seen],
    slots: Iterable[Slot],
    owners: Mapping[int, tuple[str, str]],
    tolerance: int,
) -> list[Finding]:
    """The processes ``seen`` holding more than ``tolerance`` bytes beyond what ``slots``
    account for on a GPU, in (GPU, pid) order.

    A process is matched to the slots recording its own pid (``Seen.own_pid``); the
    slots of several environments recording the same pid all count for it. ``owners``
    maps an NVML pid to the (environment, task id) it belongs to, for a process without
    a slot (a task's client or its descendant)."""
    by_pid: dict[int, list[Slot]] = {}
    for s in slots:
        by_pid.setdefault(s.pid, []).append(s)
    out = []
    for p in sorted(seen, key=lambda p: (p.gpu, p.pid)):
        mine = by_pid.get(p.own_pid, [])
        accounted = sum(s.used[p.gpu] for s in mine if p.gpu < len(s.used))
        if p.bytes <= accounted + tolerance:
            continue
        env, task_id = (mine[0].env, mine[0].task_id) if mine else owners.get(p.pid, (None, None))
        reason = BEYOND_SLOT if mine else NO_SLOT
        out.append(Finding(p.gpu, p.pid, p.bytes, accounted, reason, env, task_id))
    return out


class FindingView(TypedDict):
    pid: int
    gpu: int
    seen: int
    accounted: int
    reason: str
    env: str | None
    task_id: str | None


class AuditView(TypedDict):
    found: int
    killed: int
    audits: int
    error: str | None
    processes: list[FindingView]


# Notices kept for one task's next heartbeat at most (AuditState.notices).
MAX_NOTICES = 8


@dataclass
class AuditState:
    """What the audits found: the findings of the last one, and counts since start."""

    findings: list[Finding] = field(default_factory=list)
    found: int = 0  # findings of a (pid, GPU) not found by the audit before
    killed: int = 0  # processes the audit killed (audit.action = "kill")
    audits: int = 0
    error: str | None = None  # why the last audit could not ask NVML, if it could not
    # Why the audit killed processes of a task, by task id, for its client's next heartbeat
    # (take_notices); forgotten when the task ends.
    notices: dict[str, list[str]] = field(default_factory=dict)
    _known: set[tuple[int, int]] = field(default_factory=set)

    def take_notices(self, task_id: str) -> list[str]:
        return self.notices.pop(task_id, [])

    def update(self, findings: list[Finding]) -> list[Finding]:
        """Take the findings of a new audit; return those not found by the one before
        (each is logged and counted once, however many audits find it)."""
        self.audits += 1
        self.error = None
        keys = {f.key for f in findings}
        new = [f for f in findings if f.key not in self._known]
        self._known = keys
        self.findings = findings
        self.found += len(new)
        return new

    def per_gpu(self, ngpus: int) -> list[int]:
        """How many processes the last audit found bypassing on each GPU."""
        counts = [0] * ngpus
        for f in self.findings:
            if f.gpu < ngpus:
                counts[f.gpu] += 1
        return counts


# --- the edge: NVML, /proc, signals ---------------------------------------------------


def parent(pid: int) -> int:
    """The parent of ``pid``; 0 when it cannot be read."""
    got = procfs.stat_ints(pid, 1)
    return got[0] if got else 0


def owner(pid: int, clients: Mapping[int, tuple[str, str]]) -> tuple[str, str] | None:
    """The (environment, task id) of the task whose client is ``pid`` or an ancestor."""
    seen: set[int] = set()
    while pid > 1 and pid not in seen:
        if pid in clients:
            return clients[pid]
        seen.add(pid)
        pid = parent(pid)
    return None


def nvml_ready(node: Node) -> None:
    """Make NVML's processes readable: on simulated GPUs, load the packaged simulated NVML
    for the node's GPUs first."""
    if node.simulated:
        from nodemgr.gpus import sim_spec

        load_simulated(sim_spec(node.gpus))


def attribution(node: Node, pids: Iterable[int]) -> tuple[list[Slot], dict[int, tuple[str, str]]]:
    """Every live ledger slot, and for each of ``pids`` that descends from a task's client
    the (environment, task id) of that task: what NVML's processes are matched against."""
    slots = [
        Slot(env.name, tid, pid, used)
        for env in node.envs.values()
        for pid, tid, used in env.ledger.slots()
    ]
    clients = {t.pid: (t.env, t.task_id) for t in node.tasks.values() if t.pid is not None}
    owners = {}
    for pid in pids:
        o = owner(pid, clients)
        if o is not None:
            owners[pid] = o
    return slots, owners


_sim_loaded = False


def load_simulated(spec: str) -> None:
    """Make pynvml reach the simulated NVML of the simulated GPUs ``spec`` (nodemgr.gpus.
    sim_spec): the packaged library, loaded by path before pynvml loads it by name, told
    the GPUs the tasks' simulated driver is told of (GPUSHARE_SIM_GPUS, which it reads at
    its first initialisation in the process; the variable is put back after it)."""
    global _sim_loaded
    if _sim_loaded:
        return
    import pynvml

    from client_plugin import libs
    from client_plugin.envvars import SIM_GPUS

    ctypes.CDLL(str(libs.sim_driver_dir() / "libnvidia-ml.so.1"), mode=ctypes.RTLD_GLOBAL)
    saved = os.environ.get(SIM_GPUS)
    os.environ[SIM_GPUS] = spec
    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
    finally:
        if saved is None:
            del os.environ[SIM_GPUS]
        else:
            os.environ[SIM_GPUS] = saved
    _sim_loaded = True


def nvml_processes(uuids: Sequence[str]) -> list[Seen]:
    """The compute processes NVML lists on each GPU (by UUID, nodemgr's index order).
    Raises pynvml.NVMLError when NVML cannot be asked."""
    import pynvml

    pynvml.nvmlInit()
    try:
        out = []
        for index, uuid in enumerate(uuids):
            h = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            procs: list[Any] = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
            for p in procs:
                used = p.usedGpuMemory
                # NVML reports "not available" (None in pynvml) without the permission.
                nbytes = int(used) if used is not None else 0
                out.append(Seen(index, int(p.pid), procfs.own_pid(int(p.pid)), nbytes))
        return out
    finally:
        pynvml.nvmlShutdown()


def kill(pid: int, own: int) -> bool:
    """SIGKILL process ``pid`` if it is still the process found (the same own pid)."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return False
    try:
        # Checked after opening, so the pidfd cannot name a process that took the pid later.
        if procfs.own_pid(pid) != own:
            return False
        signal.pidfd_send_signal(fd, signal.SIGKILL)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


class Auditor:
    """Runs the audit of a node (nodemgr.state.Node) every ``audit.interval`` seconds."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.config = node.config
        self.state: AuditState = node.audit
        # The first audit one interval after start, like every later one.
        self._next = time.monotonic() + self.config.audit_interval

    def due(self, now: float) -> bool:
        return self.config.audit_interval > 0 and now >= self._next

    def run(self, now: float) -> list[Finding]:
        """Audit now; return the new findings."""
        node = self.node
        self._next = now + self.config.audit_interval
        try:
            nvml_ready(node)
            seen = nvml_processes([g.uuid for g in node.gpus])
        except Exception as e:  # pynvml.NVMLError, a missing library: said once
            if self.state.error is None:
                log.warning("bypass audit: cannot list NVML's processes: %s", e)
            self.state.error = str(e)
            return []
        slots, owners = attribution(node, [p.pid for p in seen])
        tolerance = node.context_memory + self.config.audit_tolerance
        findings = compare(seen, slots, owners, tolerance)
        new = self.state.update(findings)
        for f in new:
            log.warning(
                "bypass: pid %d holds %d bytes on GPU %d, its ledger slots %d (%s%s)",
                f.pid,
                f.seen,
                f.gpu,
                f.accounted,
                f.reason,
                f", env {f.env}, task {f.task_id}" if f.env else ", no task",
            )
        if self.config.audit_action == "kill":
            own = {p.pid: p.own_pid for p in seen}
            for pid in sorted({f.pid for f in findings}):
                if kill(pid, own[pid]):
                    self.state.killed += 1
                    log.warning("bypass: killed pid %d (audit.action = kill)", pid)
                    found = [f for f in findings if f.pid == pid]
                    self._tell(own[pid], found)
        return new

    def _tell(self, pid: int, found: list[Finding]) -> None:
        """Keep why a task's process (``pid``, its own) was killed for its client's next
        heartbeat."""
        task_id = next((f.task_id for f in found if f.task_id is not None), None)
        if task_id is None or task_id not in self.node.tasks:
            return
        notices = self.state.notices.setdefault(task_id, [])
        if len(notices) < MAX_NOTICES:
            notices.append(killed_notice(pid, found))


def killed_notice(pid: int, found: list[Finding]) -> str:
    """What the user of a task whose process ``pid`` (its own pid) the audit killed is told."""
    where = ", ".join(
        f"{format_size(f.seen)} on GPU {f.gpu} where its ledger slots account for "
        f"{format_size(f.accounted)} ({f.reason})"
        for f in found
    )
    return (
        f"nodemgr's bypass audit killed process {pid} of this task (audit.action = kill): "
        f"it held {where}. Run CUDA programs with gpushare's shim preloaded, and load "
        "libcuda only the usual way"
    )


def view(state: AuditState) -> AuditView:
    """The audit's part of the admin ``status`` reply (docs/protocol.md)."""
    return {
        "found": state.found,
        "killed": state.killed,
        "audits": state.audits,
        "error": state.error,
        "processes": [
            {
                "pid": f.pid,
                "gpu": f.gpu,
                "seen": f.seen,
                "accounted": f.accounted,
                "reason": f.reason,
                "env": f.env,
                "task_id": f.task_id,
            }
            for f in state.findings
        ],
    }
