"""What nodemgr keeps of each environment and each running task.

nodemgr.node.node changes them; nodemgr.node.turns, nodemgr.policy.waitqueue and
nodemgr.report.views read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpushare.messages import Request
from gpushare.protocol import BE
from nodemgr.host.ledger import Ledger, Regions, Schedule, SlotTotals
from nodemgr.policy.steptime import Estimate


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
    usage: dict[str, SlotTotals] = field(default_factory=dict)  # last ledger summary
    launches_done: int = 0  # kernel launches of its ended tasks, since nodemgr started
    # Its ledger's task table was full at the last grant: said once, not per grant.
    tasks_full: bool = False
    # Why its processes may charge a ledger file other than the one at its path (run_dir
    # removed or replaced): no task is granted until they end, then a new ledger replaces
    # it (docs/operations.md, "Storage faults"). None: the ledger is in order.
    orphaned: str | None = None
    adopted: bool = False  # its ledger was the one an earlier nodemgr left
    # Its own idle policy (`nodemgr idle`, docs/nodemgr.md "Idle tasks"); None: the node's.
    idle_timeout: float | None = None
    idle_action: str | None = None
    # Its own task classes (`nodemgr quota set --class-default/--allow-ls`, docs/scheduling.md
    # "Classes"); None: the node's ([classes]).
    class_default: str | None = None
    allow_ls: bool | None = None
    # The cap on each of its tasks' compute share, percent (docs/compute.md); None: none.
    compute: int | None = None


@dataclass
class Task:
    task_id: str
    env: str
    gpus: tuple[int, ...]
    memory: int  # per-GPU memory granted
    pid: int | None  # the client's pid as the kernel reports it, if known
    pid_start: int | None  # its start time, so a reused pid is not mistaken for it
    command: str | None
    started: float  # wall clock
    last_seen: float  # monotonic
    # The request it was granted for, with its guard filled in (Node.grant), as the store
    # keeps it: what its client asked (request.wrapper, its estimate on time-sliced GPUs)
    # survives a restart with the task.
    request: Request
    restored: bool = False  # loaded at start-up; its client has not been heard since
    peak: int = 0
    launches: int = 0  # the most kernel launches its live processes counted at once
    # Time slicing (docs/timeslicing.md): its place in the order of arrival, and its memory
    # by region as the last sweep read it (tasks on time-sliced GPUs only).
    arrival: int = 0
    regions: Regions | None = None
    # A best-effort task held for latency-sensitive ones (docs/scheduling.md, "Classes"):
    # why, and what holds it (LS task ids, or "wait:WID" for a waiting LS request); it
    # resumes once none of them is left and its quota fits again. None: not held so.
    preempted: str | None = None
    preempted_by: set[str] = field(default_factory=set)

    @property
    def task_class(self) -> str:
        """ "ls" or "be": its request's, resolved when it was granted (a request kept before
        classes existed is best-effort)."""
        return self.request.task_class or BE

    # Compute shares (docs/compute.md): the schedule its ledger entry was last given, and
    # whether its pause word still asks its processes to start their pacers.
    schedule: Schedule | None = None
    waking_pacers: bool = False

    @property
    def grant(self) -> int | None:
        """Its per-GPU grant on shared GPUs when it was granted by prediction (its
        ``memory``, topped up as it ran; docs/prediction.md#admission); None: its
        environment's quota."""
        return None if self.request.predicted is None else self.memory

    # Top-ups of its grant by prediction while it ran (docs/prediction.md#admission).
    topups: int = 0
    # Step time (docs/prediction.md#step-time): the model of its first GPU and nodemgr's
    # estimate there (tasks sent with features); its processes' boundaries as sweeps saw
    # them, the first from its second iteration on and the last (count, CLOCK_MONOTONIC
    # ns); its utilisation samples (their sum, as ratios of its GPUs, and count).
    gpu_model: str | None = None
    estimate: Estimate | None = None
    first_boundary: tuple[int, int] | None = None
    last_boundary: tuple[int, int] | None = None
    util_sum: float = 0.0
    util_samples: int = 0

    def note_boundary(self, n: int, ns: int) -> None:
        """Its processes' latest boundary as a sweep read it: the ``n``th, at ``ns``
        (CLOCK_MONOTONIC); counted from its second on."""
        if n < 2:
            return
        if self.first_boundary is None:
            self.first_boundary = (n, ns)
        elif n > self.first_boundary[0] and ns >= self.first_boundary[1]:
            self.last_boundary = (n, ns)

    @property
    def step_time(self) -> float | None:
        """Its measured seconds per iteration so far: from its second boundary to its
        last, once two iterations lie between them; None before."""
        if self.first_boundary is None or self.last_boundary is None:
            return None
        (n0, t0), (n1, t1) = self.first_boundary, self.last_boundary
        return (t1 - t0) / 1e9 / (n1 - n0) if n1 - n0 >= 2 else None

    @property
    def utilization(self) -> float | None:
        """The mean of its utilisation samples, a ratio of its GPUs; None: none taken."""
        return self.util_sum / self.util_samples if self.util_samples else None

    @property
    def guard(self) -> int:
        """Bytes kept free after its persistent slices on time-sliced GPUs: its request's,
        or the node's ``timeslice.guard`` as it was when the task was granted."""
        return self.request.guard or 0
