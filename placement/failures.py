"""GPU failures and a batch of long training jobs placed on a pool of GPUs (seed 004).

docs/placement.md, "Seed 004: failure-aware placement". The trace has no failures, so
they come from a model: each GPU fails as a Poisson process at its own hazard rate, the
fleet's mean calibrated to a published figure (Meta's Llama 3 report), a few GPUs
error-prone at a multiple of the others' rate. Each GPU's past failures (a history
window before the batch) are what a placement can know of its hazard; the hazard itself
is hidden.

The simulator runs a batch: jobs of N GPUs and a run time start in order (first come,
first served; a restarted job first) when N healthy free GPUs exist; a failure of one
of a running job's GPUs restarts the job from its last checkpoint, and the failed GPU
is out until repaired. Failures belong to the GPUs, not to a placement: one draw of
every GPU's failure times serves every placement compared on it (common random
numbers), so that two placements differ only by where they put the jobs.

Pure: numpy, no I/O. A placement is a function (the view of the pool, the job, a
generator) to N distinct GPU indices among the free ones.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from placement.cluster import Bools, Ints

Floats = npt.NDArray[np.float64]

# Meta's Llama 3 report (The Llama 3 Herd of Models, 2024, section 3.3.4): 419
# unexpected interruptions over a 54-day snapshot of pre-training on 16,384 H100 GPUs
# (78% of them hardware: GPUs, HBM3, the host). Every one is counted as a GPU's failure:
# the model's fleet mean, about 4.74e-4 failures per GPU-day, one per 5.8 GPU-years.
LLAMA3_INTERRUPTIONS = 419
LLAMA3_DAYS = 54
LLAMA3_GPUS = 16_384
FLEET_RATE_PER_GPU_DAY = LLAMA3_INTERRUPTIONS / (LLAMA3_DAYS * LLAMA3_GPUS)


@dataclasses.dataclass(frozen=True)
class FailureModel:
    """The model's constants (docs/placement.md gives each one's source).

    ``error_prone_share`` of the GPUs fail ``error_prone_factor`` times as often as the
    others; the others' rate is set so that the fleet's mean stays ``fleet_rate``.
    """

    fleet_rate: float = FLEET_RATE_PER_GPU_DAY  # failures per GPU-day, fleet mean
    error_prone_share: float = 0.02
    error_prone_factor: float = 25.0
    history_days: float = 180.0  # the failures observed per GPU before the batch
    repair_hours: float = 24.0  # a failed GPU is out (masked) this long
    checkpoint_hours: float = 2.0  # a job saves its work this often
    restart_overhead_hours: float = 0.5  # a restart's reload before work resumes

    @property
    def base_rate(self) -> float:
        """The rate of a GPU that is not error-prone (per GPU-day)."""
        share = self.error_prone_share
        return self.fleet_rate / (1.0 - share + share * self.error_prone_factor)


@dataclasses.dataclass(frozen=True)
class Pool:
    """A pool of GPUs before the batch: each one's hidden hazard and its known history."""

    hazard: Floats  # failures per GPU-day (hidden from placements)
    prone: Bools  # error-prone (hidden)
    history: Ints  # failures in the history window (known)
    days_since: Floats  # days from the last of them to the batch's start; inf: none

    @property
    def size(self) -> int:
        return int(self.hazard.size)


def sample_pool(model: FailureModel, gpus: int, rng: np.random.Generator) -> Pool:
    """A pool of ``gpus``: exactly ``round(share * gpus)`` error-prone GPUs, at random
    places, and each GPU's history drawn from its own hazard."""
    prone = np.zeros(gpus, dtype=np.bool_)
    prone[rng.choice(gpus, round(model.error_prone_share * gpus), replace=False)] = True
    hazard = np.where(prone, model.base_rate * model.error_prone_factor, model.base_rate)
    history = rng.poisson(hazard * model.history_days).astype(np.int64)
    # The last of k uniform times in the window is 1 - U^(1/k) of it before the end.
    u = rng.random(gpus)
    with np.errstate(divide="ignore"):
        since = model.history_days * (1.0 - u ** (1.0 / np.maximum(history, 1)))
    days_since = np.where(history > 0, since, np.inf)
    return Pool(hazard.astype(np.float64), prone, history, days_since.astype(np.float64))


@dataclasses.dataclass(frozen=True)
class FailureDraw:
    """Every GPU's failure times (hours from the batch's start) up to ``horizon``, in
    time order. Failures past the horizon are not drawn: a horizon well past any
    makespan (the benchmark's is several times the longest) leaves out nothing that
    matters."""

    hours: Floats
    gpus: Ints
    horizon: float


def draw_failures(pool: Pool, horizon_hours: float, rng: np.random.Generator) -> FailureDraw:
    """One draw of each GPU's Poisson failures over ``horizon_hours``."""
    counts = rng.poisson(pool.hazard / 24.0 * horizon_hours)
    gpus = np.repeat(np.arange(pool.size, dtype=np.int64), counts)
    hours = rng.random(gpus.size) * horizon_hours
    order = np.argsort(hours, kind="stable")
    return FailureDraw(hours[order], gpus[order], horizon_hours)


@dataclasses.dataclass(frozen=True)
class Job:
    """A training job: ``gpus`` GPUs for ``hours`` of work without failures."""

    gpus: int
    hours: float


@dataclasses.dataclass(frozen=True)
class View:
    """What a placement sees when it places a job: the GPUs it may take (``free``:
    neither busy nor in repair) and each GPU's known failures (the history window's
    and the batch's so far) and days since the last of them (inf: none)."""

    now_hours: float
    free: Bools
    failures: Ints
    days_since: Floats


Choose = Callable[[View, Job, np.random.Generator], Ints]


@dataclasses.dataclass(frozen=True)
class Outcome:
    """A batch's result: the last job's finish, the restarts (failures of a running
    job's GPU), the GPU-hours they lost (work since the checkpoint and the reloads, times
    the job's GPUs) and each job's finish."""

    makespan_hours: float
    restarts: int
    lost_gpu_hours: float
    finish_hours: tuple[float, ...]


def simulate(
    pool: Pool,
    jobs: Sequence[Job],
    draw: FailureDraw,
    choose: Choose,
    model: FailureModel,
    rng: np.random.Generator,
) -> Outcome:
    """Run the batch (the rules: docs/placement.md, "The batch simulator").

    - Jobs start in order, first come first served: the first waiting job starts when
      ``choose`` can have N free healthy GPUs; the others wait behind it. A restarted
      job goes first.
    - A failure of a GPU marks it out until ``repair_hours`` later (a GPU in repair does
      not fail again). If a job ran on it, the job stops and keeps the work of its last
      checkpoint: every ``checkpoint_hours`` of work since this run started (after its
      reload) is saved; the rest, and the time of the reload, is lost. Its GPUs are
      freed and it waits again, first; its next run starts with
      ``restart_overhead_hours`` of reload.
    - At one moment, finishes come before failures, and both before starts.
    """
    size = pool.size
    if any(job.gpus < 1 or job.gpus > size for job in jobs):
        raise ValueError(f"a job asks for no GPU or more than the pool's {size}")
    busy = np.full(size, -1, dtype=np.int64)
    out_until = np.zeros(size)
    failures = pool.history.copy()
    last = -pool.days_since * 24.0  # hours of each GPU's last failure (-inf: none)
    saved = [0.0] * len(jobs)  # checkpointed work per job
    overhead = [0.0] * len(jobs)  # the reload the job's next run starts with
    started = [math.nan] * len(jobs)
    finish = [math.inf] * len(jobs)  # of the current run; inf: not running
    ended = [math.nan] * len(jobs)
    waiting = deque(range(len(jobs)))
    restarts, lost = 0, 0.0
    now, k = 0.0, 0

    while True:
        # Starts: the first waiting job while it fits.
        while waiting:
            j = waiting[0]
            free = (busy < 0) & (out_until <= now)
            if int(free.sum()) < jobs[j].gpus:
                break
            view = View(now, free, failures.copy(), (now - last) / 24.0)
            chosen = np.asarray(choose(view, jobs[j], rng), dtype=np.int64)
            if chosen.size != jobs[j].gpus or np.unique(chosen).size != chosen.size:
                raise ValueError(f"job {j}: {chosen.size} GPUs chosen for {jobs[j].gpus}")
            if not free[chosen].all():
                raise ValueError(f"job {j}: a busy or failed GPU chosen")
            waiting.popleft()
            busy[chosen] = j
            started[j] = now
            finish[j] = now + overhead[j] + jobs[j].hours - saved[j]
        next_finish = min(finish, default=math.inf)
        next_failure = float(draw.hours[k]) if k < draw.hours.size else math.inf
        repairs = out_until[out_until > now]
        next_repair = float(repairs.min()) if repairs.size else math.inf
        if next_finish == math.inf and not waiting:
            break
        now = min(next_finish, next_failure, next_repair)
        if now == math.inf:
            raise ValueError("jobs wait for GPUs that never come back")
        for j, at in enumerate(finish):
            if at <= now:
                busy[busy == j] = -1
                finish[j] = math.inf
                ended[j] = at
        while k < draw.hours.size and draw.hours[k] <= now:
            g = int(draw.gpus[k])
            k += 1
            if out_until[g] > now:
                continue  # in repair: it cannot fail again
            failures[g] += 1
            last[g] = now
            out_until[g] = now + model.repair_hours
            j = int(busy[g])
            if j < 0:
                continue
            ran = now - started[j]
            work = max(0.0, ran - overhead[j])
            kept = math.floor(work / model.checkpoint_hours) * model.checkpoint_hours
            saved[j] += kept
            lost += (ran - kept) * jobs[j].gpus
            restarts += 1
            overhead[j] = model.restart_overhead_hours
            busy[busy == j] = -1
            finish[j] = math.inf
            waiting.appendleft(j)
    return Outcome(max(ended, default=0.0), restarts, lost, tuple(ended))


# Placements that know nothing of failures beyond the mask: the baselines.


def random_choice(view: View, job: Job, rng: np.random.Generator) -> Ints:
    """N of the free GPUs, uniformly at random."""
    return rng.choice(np.flatnonzero(view.free), job.gpus, replace=False).astype(np.int64)


def packing(view: View, job: Job, rng: np.random.Generator) -> Ints:
    """Failure-blind packing: the N lowest-numbered free GPUs (GPUs are numbered node by
    node, so a job fills whole nodes, as a topology-minded scheduler would)."""
    return np.flatnonzero(view.free)[: job.gpus].astype(np.int64)


def best_of_random(
    pool: Pool,
    jobs: Sequence[Job],
    draw: FailureDraw,
    model: FailureModel,
    k: int,
    rng: np.random.Generator,
) -> tuple[Outcome, list[Outcome]]:
    """The best (least makespan, then fewest restarts) of ``k`` random placements of the
    batch, on the same failure draw: chosen in hindsight, as the seed's reward chooses
    it. Returns it and all ``k``."""
    runs = [simulate(pool, jobs, draw, random_choice, model, rng) for _ in range(k)]
    return min(runs, key=lambda o: (o.makespan_hours, o.restarts)), runs


@dataclasses.dataclass(frozen=True)
class Workload:
    """A batch of large, long training jobs on a pool (the benchmark's regime; why this
    one: docs/placement.md). Jobs of ``sizes`` GPUs and a run time log-uniform in
    [``min_days``, ``max_days``] are drawn until the next would take the batch past
    ``fill`` of the pool: every job starts at once, and the rest is headroom."""

    gpus: int = 4096
    fill: float = 0.75
    sizes: tuple[int, ...] = (512, 1024, 2048)
    min_days: float = 14.0
    max_days: float = 28.0
    horizon_factor: float = 6.0  # failures are drawn up to this many longest run times


def instance(
    model: FailureModel, workload: Workload, rng: np.random.Generator
) -> tuple[Pool, list[Job], FailureDraw]:
    """One pool (with its history), one batch and one failure draw."""
    pool = sample_pool(model, workload.gpus, rng)
    jobs: list[Job] = []
    low, high = math.log(workload.min_days), math.log(workload.max_days)
    while True:
        job = Job(int(rng.choice(workload.sizes)), 24.0 * math.exp(rng.uniform(low, high)))
        if sum(j.gpus for j in jobs) + job.gpus > workload.fill * workload.gpus:
            break
        jobs.append(job)
    draw = draw_failures(pool, workload.horizon_factor * 24.0 * workload.max_days, rng)
    return pool, jobs, draw
