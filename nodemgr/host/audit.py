"""The bypass audit (docs/operations.md, "Bypass audit"): the processes NVML sees holding
memory on each GPU, compared with what the environments' ledgers account for.

A process that holds GPU memory no ledger slot accounts for went around the shim: it was
started without LD_PRELOAD, reached the driver through a copy the shim does not hook (a
``dlmopen``ed libcuda), or rewrote its own slot. The other way round, a ledger is its
environment's to write: a slot claiming memory NVML does not see its process hold, or a
slot written for a process that does not map that ledger (a process without the shim,
covered by a slot another process wrote), is reported too. The comparison (``compare``)
is pure; reading NVML (through the node's nodemgr.host.backend) and /proc and killing are
at the edge (``Auditor``, ``procfs.own_pid``, ``procfs.maps_files``).

Pids: NVML names a process by its pid in the driver's (the host's) pid namespace, a slot
by the pid the process itself got from getpid(), in its container's namespace. nodemgr
turns each NVML pid into the process's own pid through the last entry of NSpid in
/proc/PID/status, and compares that with the slots' pids; where nodemgr cannot read it
(the pid is not in nodemgr's namespace) NVML's pid is compared as it is.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypedDict

from gpushare.sizes import format_size
from nodemgr.host import procfs

if TYPE_CHECKING:
    from nodemgr.host.backend import GpuBackend
    from nodemgr.node.node import Node

log = logging.getLogger("nodemgr")

# Why a process is a finding.
NO_SLOT = "no slot"  # no ledger slot names it: the shim never charged it
BEYOND_SLOT = "beyond its slot"  # it holds more than its slots account for
# Slots name it, but it maps none of their ledgers: someone else wrote them (it runs
# without the shim).
NOT_ITS_SLOT = "slot not its own"
# Its slots say it holds more than NVML sees it hold: the ledger was written to say so.
UNSEEN = "ledger beyond NVML"
# The findings of processes that hold memory around the shim: counted per GPU, and what
# audit.action = "kill" kills. An UNSEEN finding holds nothing NVML sees.
BYPASSES = (NO_SLOT, BEYOND_SLOT, NOT_ITS_SLOT)


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
    ledger: tuple[int, int] | None = None  # its ledger file (Ledger.file_id)


@dataclass(frozen=True)
class Finding:
    """A process holding more GPU memory than the ledgers account for."""

    gpu: int
    pid: int  # NVML's; for UNSEEN, the slots' where NVML lists no such process
    seen: int  # bytes NVML sees it hold on the GPU
    accounted: int  # bytes the ledgers' slots of that pid hold there
    reason: str  # NO_SLOT, BEYOND_SLOT, NOT_ITS_SLOT or UNSEEN
    env: str | None  # the environment, when nodemgr knows the process
    task_id: str | None

    @property
    def key(self) -> tuple[int, int, str]:
        return (self.pid, self.gpu, self.reason)


def _accounted(slots: Iterable[Slot]) -> dict[tuple[int, int], int]:
    """Bytes per (pid, GPU) that ``slots`` account for."""
    out: dict[tuple[int, int], int] = {}
    for s in slots:
        for gpu, nbytes in enumerate(s.used):
            if nbytes:
                out[(s.pid, gpu)] = out.get((s.pid, gpu), 0) + nbytes
    return out


def compare(
    seen: Iterable[Seen],
    slots: Iterable[Slot],
    owners: Mapping[int, tuple[str, str]],
    tolerance: int,
    mapped: Mapping[int, frozenset[tuple[int, int]]] | None = None,
) -> list[Finding]:
    """The processes ``seen`` holding more than ``tolerance`` bytes beyond what ``slots``
    account for on a GPU, in (GPU, pid) order.

    A process is matched to the slots recording its own pid (``Seen.own_pid``); the
    slots of several environments recording the same pid all count for it. ``owners``
    maps an NVML pid to the (environment, task id) it belongs to, for a process without
    a slot (a task's client or its descendant). ``mapped``: the files (device, inode)
    each NVML pid maps, where they could be read; a process holding memory that maps none
    of the ledgers of the slots naming it is NOT_ITS_SLOT, whatever they say."""
    by_pid: dict[int, list[Slot]] = {}
    for s in slots:
        by_pid.setdefault(s.pid, []).append(s)
    mapped = mapped or {}
    out = []
    for p in sorted(seen, key=lambda p: (p.gpu, p.pid)):
        mine = by_pid.get(p.own_pid, [])
        accounted = sum(s.used[p.gpu] for s in mine if p.gpu < len(s.used))
        files = mapped.get(p.pid)
        if (
            mine
            and files is not None
            and p.bytes > tolerance
            and not any(s.ledger in files for s in mine if s.ledger is not None)
        ):
            out.append(
                Finding(
                    p.gpu, p.pid, p.bytes, accounted, NOT_ITS_SLOT, mine[0].env, mine[0].task_id
                )
            )
            continue
        if p.bytes <= accounted + tolerance:
            continue
        env, task_id = (mine[0].env, mine[0].task_id) if mine else owners.get(p.pid, (None, None))
        reason = BEYOND_SLOT if mine else NO_SLOT
        out.append(Finding(p.gpu, p.pid, p.bytes, accounted, reason, env, task_id))
    return out


def unconfirmed(
    seen: Iterable[Seen], slots: Iterable[Slot], tolerance: int, earlier: Iterable[Slot]
) -> list[Finding]:
    """The slots (summed per own pid and GPU) that say their process holds more than
    ``tolerance`` bytes beyond what NVML sees it hold (UNSEEN), in (GPU, pid) order: a
    ledger written to say so. ``earlier``: the slots as read before NVML was asked; a
    figure counts only as far as it was there in both reads (a charge precedes the
    driver's allocation, so a slot read after NVML may hold one NVML did not see yet)."""
    nvml: dict[tuple[int, int], int] = {}
    nvml_pid: dict[int, int] = {}
    for p in seen:
        nvml[(p.own_pid, p.gpu)] = nvml.get((p.own_pid, p.gpu), 0) + p.bytes
        nvml_pid[p.own_pid] = p.pid
    slots = list(slots)
    named = {s.pid: s for s in slots}
    before = _accounted(earlier)
    out = []
    for (pid, gpu), nbytes in sorted(_accounted(slots).items(), key=lambda kv: kv[0][::-1]):
        nbytes = min(nbytes, before.get((pid, gpu), 0))
        sees = nvml.get((pid, gpu), 0)
        if nbytes > sees + tolerance:
            s = named[pid]
            out.append(Finding(gpu, nvml_pid.get(pid, pid), sees, nbytes, UNSEEN, s.env, s.task_id))
    return out


class FindingView(TypedDict):
    pid: int
    gpu: int
    seen: int
    accounted: int
    reason: str
    env: str | None
    task_id: str | None


class RewriteView(TypedDict):
    env: str
    rewrote: str


class AuditView(TypedDict):
    found: int
    killed: int
    audits: int
    error: str | None
    processes: list[FindingView]
    rewrites: int
    ledgers: list[RewriteView]


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
    _known: set[tuple[int, int, str]] = field(default_factory=set)
    # Ledgers in which nodemgr found what only it writes changed (a raised limit), and
    # wrote it again: how many times, and per environment what it last wrote again.
    rewrites: int = 0
    rewritten: dict[str, str] = field(default_factory=dict)
    _tampered: set[str] = field(default_factory=set)

    def ledger_checked(self, env: str, fixed: list[str]) -> bool:
        """Take what a sweep wrote again in ``env``'s ledger (nothing: it was intact);
        return whether to log it (the ledger was intact at the check before)."""
        if not fixed:
            self._tampered.discard(env)
            return False
        self.rewrites += 1
        self.rewritten[env] = "; ".join(fixed)
        new = env not in self._tampered
        self._tampered.add(env)
        return new

    def forget_env(self, env: str) -> None:
        self.rewritten.pop(env, None)
        self._tampered.discard(env)

    # Why the audit killed processes of a task, by task id, for its client's next heartbeat
    # (take_notices); forgotten when the task ends (forget_task).
    notices: dict[str, list[str]] = field(default_factory=dict)

    def take_notices(self, task_id: str) -> list[str]:
        return self.notices.pop(task_id, [])

    def forget_task(self, task_id: str) -> None:
        self.notices.pop(task_id, None)

    def update(self, findings: list[Finding]) -> list[Finding]:
        """Take the findings of a new audit; return those not found by the one before
        (each, by its key (pid, GPU, reason), is logged and counted once, however many
        audits in a row find it)."""
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
            if f.gpu < ngpus and f.reason in BYPASSES:
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


def ledger_slots(node: Node) -> list[Slot]:
    """Every live slot of every environment's ledger, read now."""
    out = []
    for env in node.envs.values():
        fid = env.ledger.file_id()
        out += [Slot(env.name, tid, pid, used, fid) for pid, tid, used in env.ledger.slots()]
    return out


def attribution(node: Node, pids: Iterable[int]) -> tuple[list[Slot], dict[int, tuple[str, str]]]:
    """Every live ledger slot, and for each of ``pids`` that descends from a task's client
    the (environment, task id) of that task: what NVML's processes are matched against."""
    slots = ledger_slots(node)
    clients = {t.pid: (t.env, t.task_id) for t in node.tasks.values() if t.pid is not None}
    owners = {}
    for pid in pids:
        o = owner(pid, clients)
        if o is not None:
            owners[pid] = o
    return slots, owners


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
    """Runs the audit of a node (nodemgr.node.node.Node) on its GPUs' backend every
    ``audit.interval`` seconds, keeping what it finds in ``state``."""

    def __init__(self, node: Node, backend: GpuBackend, state: AuditState) -> None:
        self.node = node
        self.config = node.config
        self.backend = backend
        self.state = state
        # The first audit one interval after start, like every later one.
        self._next = time.monotonic() + self.config.audit_interval
        # The ledgers (Ledger.file_id) each process, by (pid, start time), was found mapping.
        self._maps_ledgers: dict[tuple[int, int], frozenset[tuple[int, int]]] = {}

    def due(self, now: float) -> bool:
        return self.config.audit_interval > 0 and now >= self._next

    def run(self, now: float) -> list[Finding]:
        """Audit now; return the new findings."""
        node = self.node
        self._next = now + self.config.audit_interval
        earlier = ledger_slots(node)
        try:
            seen = [
                Seen(p.gpu, p.pid, procfs.own_pid(p.pid), p.bytes) for p in self.backend.processes()
            ]
        except Exception as e:  # BackendError, a missing library: said once
            if self.state.error is None:
                log.warning("bypass audit: cannot list NVML's processes: %s", e)
            self.state.error = str(e)
            return []
        slots, owners = attribution(node, [p.pid for p in seen])
        mapped = self._mapped(seen, slots)
        # A process may hold its GPU's context charge beyond its slots, and the slack.
        findings = []
        for g in node.gpus:
            tolerance = node.context_memory[g.index] + self.config.audit_tolerance
            on_gpu = [p for p in seen if p.gpu == g.index]
            findings += compare(on_gpu, slots, owners, tolerance, mapped)
            findings += [
                f for f in unconfirmed(seen, slots, tolerance, earlier) if f.gpu == g.index
            ]
        findings.sort(key=lambda f: (f.gpu, f.pid))
        new = self.state.update(findings)
        for f in new:
            what = "ledger: pid %d holds %d bytes on GPU %d, NVML sees %d (%s%s)"
            args = (f.pid, f.accounted, f.gpu, f.seen)
            if f.reason != UNSEEN:
                what = "bypass: pid %d holds %d bytes on GPU %d, its ledger slots %d (%s%s)"
                args = (f.pid, f.seen, f.gpu, f.accounted)
            log.warning(
                what, *args, f.reason, f", env {f.env}, task {f.task_id}" if f.env else ", no task"
            )
        if self.config.audit_action == "kill":
            own = {p.pid: p.own_pid for p in seen}
            for pid in sorted({f.pid for f in findings if f.reason in BYPASSES}):
                if kill(pid, own[pid]):
                    self.state.killed += 1
                    log.warning("bypass: killed pid %d (audit.action = kill)", pid)
                    found = [f for f in findings if f.pid == pid]
                    self._tell(own[pid], found)
        return new

    def _mapped(
        self, seen: Iterable[Seen], slots: Iterable[Slot]
    ) -> dict[int, frozenset[tuple[int, int]]]:
        """compare()'s ``mapped``: per NVML pid of ``seen`` that ``slots`` name, which of
        their ledgers it maps, where that can be read. A process once found mapping a
        ledger is remembered (by pid and start time) as mapping it, and its maps not read
        again for it: the audit runs every few seconds, a process may map thousands of
        files, and a process that unmaps its ledger gains nothing it could not by mapping
        it in the first place."""
        ledgers: dict[int, set[tuple[int, int]]] = {}
        for s in slots:
            if s.ledger is not None:
                ledgers.setdefault(s.pid, set()).add(s.ledger)
        mapped: dict[int, frozenset[tuple[int, int]]] = {}
        known: dict[tuple[int, int], frozenset[tuple[int, int]]] = {}
        for pid, own in {(p.pid, p.own_pid) for p in seen}:  # once per process, not per GPU
            wanted = ledgers.get(own)
            start = procfs.process_start(pid)
            if not wanted or start is None:
                continue
            was = self._maps_ledgers.get((pid, start), frozenset())
            files = was & wanted or procfs.maps_files(pid, wanted)
            if files is not None:
                mapped[pid] = files
                known[(pid, start)] = was | files
        # Only the processes NVML still lists are remembered.
        self._maps_ledgers = known
        return mapped

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
        "rewrites": state.rewrites,
        "ledgers": [{"env": e, "rewrote": w} for e, w in sorted(state.rewritten.items())],
    }
