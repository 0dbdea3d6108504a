"""Prometheus metrics (docs/operations.md lists them).

The HTTP endpoint runs in prometheus-client's thread and never touches
nodemgr's state: the event loop publishes an immutable snapshot at most once
a second, and event counters are prometheus-client's own thread-safe types.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypedDict, TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gpushare.messages import ErrorReply, Message
from gpushare.protocol import BE, CLASSES, TIMESLICED, Err
from nodemgr.config import Config
from nodemgr.host.audit import AuditState
from nodemgr.host.ledger import SlotTotals
from nodemgr.host.utilization import Utilization
from nodemgr.node.node import REASONS, Node
from nodemgr.report import views

# The caps a connection can be refused over (nodemgr.loop.connections), as the metrics
# label them.
CAPS = ("env", "reader", "client")

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.1, 1.0)
SWITCH_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05)
WAIT_BUCKETS = (0.1, 0.5, 1, 5, 15, 60, 300, 900, 3600, 14400)
# A task's measured peak over its predicted one (docs/prediction.md#admission).
PREDICTION_BUCKETS = (0.5, 0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.25, 1.5, 2.0)
# The `endpoint` label of request metrics, and the `outcome` of a wait's.
ENDPOINTS = ("admin", "task")
WAIT_OUTCOMES = ("granted", "timeout")

Row = TypeVar("Row")
_NONE = SlotTotals()


class GpuMetrics(views.GpuStatus):
    gated: int  # tasks on the GPU waiting for its turn


class EnvMetrics(TypedDict):
    env: str
    quota_gpus: int
    quota_memory: int
    gpus: int
    granted: int
    used: int
    tasks: int
    launches: int
    utilization: float  # the ratio its tasks' processes kept its GPUs busy, summed


class TaskPrediction(NamedTuple):
    """A running task sent with its predicted peak (docs/prediction.md#admission)."""

    task_id: str
    env: str
    predicted: int  # bytes per GPU
    granted: int  # bytes per shared GPU, top-ups included
    peak: int  # bytes per GPU its processes held at once, so far


class TaskCompute(NamedTuple):
    """A task with a compute share (docs/compute.md) and what its pacers measured."""

    task_id: str
    env: str
    share: int  # percent in force
    device_seconds: float


@dataclass(frozen=True)
class Snapshot:
    gpus: list[GpuMetrics]
    envs: list[EnvMetrics]
    queue_length: int
    tasks: int
    # By class (docs/scheduling.md, "Classes"): running tasks, waiting requests, and the
    # best-effort tasks held for latency-sensitive ones.
    by_class: dict[str, int] = field(default_factory=dict)
    waiting_by_class: dict[str, int] = field(default_factory=dict)
    preempted: int = 0
    bypass_found: int = 0
    bypass_killed: int = 0
    ledger_rewrites: int = 0
    compute: tuple[TaskCompute, ...] = ()
    predictions: tuple[TaskPrediction, ...] = ()
    # Tasks with a step time estimate: (task, env, estimated, measured or None) seconds.
    steps: tuple[tuple[str, str, float, float | None], ...] = ()
    topups: int = 0
    topups_refused: int = 0


def _region(x: GpuMetrics, key: str) -> int:
    regions = x["regions"]
    return regions[key] if regions else 0  # type: ignore[literal-required]


def _ratio(percent: int | None) -> float | None:
    return None if percent is None else percent / 100


# The gauges of each GPU (labels gpu, uuid): name, help, its value (None: absent).
GPU_GAUGES: tuple[tuple[str, str, Callable[[GpuMetrics], float | None]], ...] = (
    ("gpushare_gpu_memory_bytes", "GPU memory", lambda x: x["memory"]),
    ("gpushare_gpu_reserved_bytes", "GPU memory kept out of every grant", lambda x: x["reserve"]),
    (
        "gpushare_gpu_charged_bytes",
        "Memory promised on a GPU: holding environments' per-GPU quotas",
        lambda x: x["charged"],
    ),
    ("gpushare_gpu_used_bytes", "Memory allocated on a GPU through the shim", lambda x: x["used"]),
    (
        "gpushare_gpu_context_bytes",
        "Memory charged per process for its CUDA context on a GPU (gpus.context_memory)",
        lambda x: x["context"],
    ),
    ("gpushare_gpu_tasks", "Tasks granted a GPU", lambda x: x["tasks"]),
    ("gpushare_gpu_lost", "1 if NVML reported the GPU lost", lambda x: 1 if x["lost"] else 0),
    (
        "gpushare_bypass_processes",
        "Processes the last bypass audit found holding GPU memory no ledger accounts for",
        lambda x: x["bypass"],
    ),
    (
        "gpushare_gpu_utilization_ratio",
        "Share of NVML's last sample period the GPU was busy (absent: unknown)",
        lambda x: _ratio(x["utilization"]),
    ),
    (
        "gpushare_gpu_memory_utilization_ratio",
        "Share of NVML's last sample period the GPU's memory was read or written",
        lambda x: _ratio(x["memory_utilization"]),
    ),
    (
        "gpushare_gpu_timesliced",
        "1 if the GPU is time-sliced, 0 if shared",
        lambda x: 1 if x["mode"] == TIMESLICED else 0,
    ),
    (
        "gpushare_gpu_persistent_region_bytes",
        "Time-sliced GPU: bytes charged for its persistent region (slices and guards)",
        lambda x: _region(x, "persistent"),
    ),
    (
        "gpushare_gpu_temporary_region_bytes",
        "Time-sliced GPU: bytes charged for its temporary region",
        lambda x: _region(x, "temporary"),
    ),
    (
        "gpushare_gpu_temporary_used_bytes",
        "Time-sliced GPU: temporary bytes its tasks hold now",
        lambda x: _region(x, "temporary_used"),
    ),
    ("gpushare_gpu_gated_tasks", "Tasks on the GPU waiting for its turn", lambda x: x["gated"]),
)

# The gauges of each environment (label env), as GPU_GAUGES.
ENV_GAUGES: tuple[tuple[str, str, Callable[[EnvMetrics], float | None]], ...] = (
    ("gpushare_env_quota_gpus", "GPU-count quota", lambda y: y["quota_gpus"]),
    ("gpushare_env_quota_memory_bytes", "Per-GPU memory quota", lambda y: y["quota_memory"]),
    ("gpushare_env_gpus", "GPUs the environment holds", lambda y: y["gpus"]),
    (
        "gpushare_env_granted_bytes",
        "Memory granted: quota times GPUs held",
        lambda y: y["granted"],
    ),
    (
        "gpushare_env_used_bytes",
        "Memory the environment's processes hold",
        lambda y: y["used"],
    ),
    ("gpushare_env_tasks", "Running tasks", lambda y: y["tasks"]),
    (
        "gpushare_env_utilization_ratio",
        "Summed over the GPUs it holds, the share of NVML's last sample period its "
        "processes kept them busy",
        lambda y: y["utilization"],
    ),
)


def _gauges(
    table: tuple[tuple[str, str, Callable[[Row], float | None]], ...],
    labels: list[str],
    rows: list[tuple[list[str], Row]],
) -> Iterator[GaugeMetricFamily]:
    """One family per entry of ``table``, a sample per row (label values, row)."""
    for name, doc, value in table:
        family = GaugeMetricFamily(name, doc, labels=labels)
        for lv, row in rows:
            v = value(row)
            if v is not None:
                family.add_metric(lv, v)
        yield family


def _per_task(*families: tuple[str, str]) -> list[GaugeMetricFamily]:
    """Gauges with a series per task: (name, help) each."""
    return [GaugeMetricFamily(name, doc, labels=["task", "env"]) for name, doc in families]


class _StateCollector(Collector):
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Any]:
        snap = self.metrics.last
        if snap is None:
            return
        gpus = [([str(x["index"]), x["uuid"]], x) for x in snap.gpus]
        yield from _gauges(GPU_GAUGES, ["gpu", "uuid"], gpus)
        yield CounterMetricFamily(
            "gpushare_bypass_findings",
            "Bypass audit findings, each (process, GPU, reason) counted once",
            value=snap.bypass_found,
        )
        yield CounterMetricFamily(
            "gpushare_bypass_kills",
            "Processes the bypass audit killed (audit.action = kill)",
            value=snap.bypass_killed,
        )
        yield CounterMetricFamily(
            "gpushare_ledger_rewrites",
            "Sweeps that wrote back in an environment's ledger what only nodemgr writes",
            value=snap.ledger_rewrites,
        )
        envs = [([y["env"]], y) for y in snap.envs]
        yield from _gauges(ENV_GAUGES, ["env"], envs)
        launches = CounterMetricFamily(
            "gpushare_env_kernel_launches", "Kernel launches counted in the ledger", labels=["env"]
        )
        for lv, y in envs:
            launches.add_metric(lv, y["launches"])
        yield launches
        share = GaugeMetricFamily(
            "gpushare_task_compute_share",
            "A task's compute share in force: the ratio of its GPUs' time it may take",
            labels=["task", "env"],
        )
        device = CounterMetricFamily(
            "gpushare_task_device_seconds",
            "Device time a task's pacers measured for its windows (live processes)",
            labels=["task", "env"],
        )
        for c in snap.compute:
            share.add_metric([c.task_id, c.env], c.share / 100)
            device.add_metric([c.task_id, c.env], c.device_seconds)
        yield share
        yield device
        families = _per_task(
            ("gpushare_task_predicted_bytes", "A running task's predicted peak per GPU"),
            ("gpushare_task_granted_bytes", "Its grant per shared GPU, top-ups included"),
            ("gpushare_task_peak_bytes", "Its measured peak per GPU so far"),
        )
        for p in snap.predictions:
            for family, value in zip(families, (p.predicted, p.granted, p.peak), strict=True):
                family.add_metric([p.task_id, p.env], value)
        yield from families
        estimated, measured = _per_task(
            (
                "gpushare_task_predicted_step_seconds",
                "A running task's estimated seconds per iteration (docs/prediction.md#step-time)",
            ),
            ("gpushare_task_step_seconds", "Its measured seconds per iteration so far"),
        )
        for task_id, env, est, meas in snap.steps:
            estimated.add_metric([task_id, env], est)
            if meas is not None:
                measured.add_metric([task_id, env], meas)
        yield estimated
        yield measured
        yield CounterMetricFamily(
            "gpushare_prediction_topups",
            "Grants by prediction topped up from the quota while their tasks ran",
            value=snap.topups,
        )
        yield CounterMetricFamily(
            "gpushare_prediction_topups_refused",
            "Top-ups asked for in vain: beyond the quota, or no room came free in time",
            value=snap.topups_refused,
        )
        yield GaugeMetricFamily(
            "gpushare_queue_length", "Requests waiting for GPUs", value=snap.queue_length
        )
        running = GaugeMetricFamily("gpushare_tasks", "Running tasks", labels=["class"])
        waiting = GaugeMetricFamily(
            "gpushare_queue_class_length", "Requests waiting for GPUs", labels=["class"]
        )
        for cls in CLASSES:
            running.add_metric([cls], snap.by_class.get(cls, 0))
            waiting.add_metric([cls], snap.waiting_by_class.get(cls, 0))
        yield running
        yield waiting
        yield GaugeMetricFamily(
            "gpushare_preempted_tasks",
            "Best-effort tasks paused for latency-sensitive ones",
            value=snap.preempted,
        )


class MetricsError(Exception):
    """The metrics endpoint cannot listen where the config says."""


class Metrics:
    """The metrics of ``node``, with what the bypass audit found (``audit``) and NVML's last
    utilisation sample (``utilization``), served where ``config`` says once started."""

    def __init__(
        self, config: Config, node: Node, audit: AuditState, utilization: Utilization
    ) -> None:
        self.config = config
        self.node = node
        self.audit = audit
        self.utilization = utilization
        self.registry = CollectorRegistry()
        self.last: Snapshot | None = None
        self._next = 0.0
        self._http: Any = None
        self.requests = self._histogram(
            "gpushare_request_seconds",
            "Time nodemgr took to serve a request",
            LATENCY_BUCKETS,
            "endpoint",
            "type",
        )
        self.errors = self._counter(
            "gpushare_request_errors", "Requests answered with an error", "endpoint", "code"
        )
        self.reclaims = self._counter("gpushare_reclaims", "Tasks ended, by reason", "reason")
        self.idle_seconds = self._counter(
            "gpushare_idle_reclaimed_gpu_seconds",
            "GPU-seconds that tasks reclaimed for idleness held while idle",
        )
        self.refusals = self._counter(
            "gpushare_connections_refused",
            "Connections to a task endpoint or view.sock refused over a cap, by cap",
            "cap",
        )
        self.waits = self._histogram(
            "gpushare_queue_wait_seconds",
            "Time requests spent waiting, by how the wait ended",
            WAIT_BUCKETS,
            "outcome",
        )
        self.switches = self._counter(
            "gpushare_turn_switches", "Turns of a time-sliced GPU handed on to another task", "gpu"
        )
        self.switch_seconds = self._histogram(
            "gpushare_turn_switch_seconds",
            "Time nodemgr took to hand a turn on, from the event to the next holder ungated",
            SWITCH_BUCKETS,
            "gpu",
        )
        self.predictions = self._histogram(
            "gpushare_prediction_peak_ratio",
            "Ended tasks sent with a prediction: measured peak per GPU over predicted",
            PREDICTION_BUCKETS,
        )
        self.registry.register(_StateCollector(self))
        self._zeros()

    def _zeros(self) -> None:
        """Every labelled series whose labels are known at start exists from the start, at
        0, so that a query or an alert on one needs no `or vector(0)` until it first moves:
        each reason a task ends for, each cap, each error code of each endpoint, each
        outcome of a wait, each GPU's turns."""
        for reason in REASONS:
            self.reclaims.labels(reason)
        for cap in CAPS:
            self.refusals.labels(cap)
        codes = [v for k, v in vars(Err).items() if k.isupper() and isinstance(v, str)]
        for endpoint in ENDPOINTS:
            for code in codes:
                self.errors.labels(endpoint, code)
        for outcome in WAIT_OUTCOMES:
            self.waits.labels(outcome)
        for gpu in self.node.gpus:
            self.switches.labels(str(gpu.index))
            self.switch_seconds.labels(str(gpu.index))

    def _counter(self, name: str, doc: str, *labels: str) -> Counter:
        return Counter(name, doc, list(labels), registry=self.registry)

    def _histogram(
        self, name: str, doc: str, buckets: tuple[float, ...], *labels: str
    ) -> Histogram:
        return Histogram(name, doc, list(labels), buckets=buckets, registry=self.registry)

    def start(self) -> None:
        cfg = self.config
        self.snapshot(force=True)
        try:
            self._http, _ = start_http_server(
                cfg.metrics_port, addr=cfg.metrics_address, registry=self.registry
            )
        except OSError as e:  # the port in use, an address not on this node
            raise MetricsError(
                f"metrics.address {cfg.metrics_address!r}, metrics.port {cfg.metrics_port}: "
                f"cannot listen there: {e.strerror or e}"
            ) from None

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None

    # --- called by the event loop ---------------------------------------------

    def served(self, endpoint: str, reply: Message, seconds: float) -> None:
        self.requests.labels(endpoint, reply.TYPE).observe(seconds)
        if isinstance(reply, ErrorReply):
            self.errors.labels(endpoint, reply.error).inc()

    def reclaimed(self, reason: str) -> None:
        self.reclaims.labels(reason).inc()

    def idle_reclaimed(self, gpu_seconds: float) -> None:
        self.idle_seconds.inc(gpu_seconds)

    def refused(self, cap: str) -> None:
        self.refusals.labels(cap).inc()

    def switched(self, gpu: int, seconds: float) -> None:
        self.switches.labels(str(gpu)).inc()
        self.switch_seconds.labels(str(gpu)).observe(seconds)

    def waited(self, seconds: float, outcome: str) -> None:
        self.waits.labels(outcome).observe(seconds)

    def predicted_ended(self, ratio: float) -> None:
        self.predictions.observe(ratio)

    def snapshot(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now < self._next:
            return
        self._next = now + 1.0
        node = self.node
        status = views.status(node, self.audit, self.utilization)
        # Each environment's tasks, launches and utilisation, in one pass over the tasks.
        tasks: dict[str, int] = {}
        launches: dict[str, int] = {}
        util: dict[str, int] = {}  # percent points of GPU time, summed over its tasks' GPUs
        for t in node.tasks.values():
            tasks[t.env] = tasks.get(t.env, 0) + 1
            launches[t.env] = launches.get(t.env, 0) + t.launches
            util[t.env] = util.get(t.env, 0) + sum(
                self.utilization.tasks.get(t.task_id, {}).values()
            )
        envs: list[EnvMetrics] = []
        for env in node.envs.values():
            live = env.usage
            envs.append(
                {
                    "env": env.name,
                    "quota_gpus": env.gpus,
                    "quota_memory": env.memory,
                    "gpus": len(env.held),
                    "granted": sum(node.allowance(env, i) for i in env.held),
                    "used": sum(t.used for t in live.values()),
                    "tasks": tasks.get(env.name, 0),
                    "launches": env.launches_done + launches.get(env.name, 0),
                    "utilization": util.get(env.name, 0) / 100,
                }
            )
        gpus: list[GpuMetrics] = []
        for x in status["gpus"]:
            turn = x["turn"]
            gated = 0 if turn is None else len(turn["order"]) - (turn["holder"] is not None)
            gpus.append({**x, "gated": gated})
        self.last = Snapshot(
            gpus=gpus,
            envs=envs,
            queue_length=len(node.queue),
            tasks=len(node.tasks),
            by_class=dict(collections.Counter(t.task_class for t in node.tasks.values())),
            waiting_by_class=dict(
                collections.Counter(w.request.task_class or BE for w in node.queue)
            ),
            preempted=len(node.held_for_ls),
            bypass_found=self.audit.found,
            bypass_killed=self.audit.killed,
            ledger_rewrites=self.audit.rewrites,
            compute=tuple(
                TaskCompute(
                    t.task_id,
                    t.env,
                    t.schedule.share,
                    node.envs[t.env].ledger.task_pacing(t.task_id).device_ns / 1e9,
                )
                for t in node.tasks.values()
                if t.schedule is not None and t.schedule.length_ns
            ),
            predictions=tuple(
                TaskPrediction(
                    t.task_id,
                    t.env,
                    t.request.predicted,
                    t.memory,
                    max(t.peak, node.envs[t.env].usage.get(t.task_id, _NONE).peak)
                    // max(1, len(t.gpus)),
                )
                for t in node.tasks.values()
                if t.request.predicted is not None
            ),
            topups=node.topups,
            topups_refused=node.topups_refused,
            steps=tuple(
                (t.task_id, t.env, t.estimate.step_s, t.step_time)
                for t in node.tasks.values()
                if t.estimate is not None
            ),
        )
