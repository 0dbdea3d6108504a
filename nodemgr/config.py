"""nodemgr's TOML configuration: one place that knows every key and its default.

``KEYS`` (and ``ACCESS_KEYS`` for the owner/group/mode tables) is the one table of them:
``Config``'s defaults, ``load()``'s parsing and checks and the table in
docs/configuration.md (``doc_table()``) all come from it.
"""

from __future__ import annotations

import grp
import math
import os
import pwd
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpushare import paths
from gpushare.protocol import BE, CLASSES, DEVICE_NAME, IDLE_ACTIONS, MAX_WAIT
from gpushare.sizes import format_size, parse_seconds, parse_size

DEFAULT_CONFIG = Path("/etc/gpushare/nodemgr.toml")
CONFIG_ENV = "GPUSHARE_CONFIG"
# gpus.context_memory = "auto" (the default) where the probe cannot measure a context
# (nodemgr.host.ctxprobe): an estimate of what one process's CUDA context takes on a GPU.
CONTEXT_FALLBACK = 512 << 20
# `nodemgr serve`'s flag that starts nodemgr although run_dir holds ledgers, used by no
# process, of environments its database does not know (nodemgr.host.envdirs.check_unknown).
FORGET_FLAG = "--forget-unknown-envs"
# The mode of the admin socket and of every environment's socket and ledger unless the
# config says otherwise.
DEFAULT_MODE = "0600"
# The most simulated GPUs: all a ledger holds (nodemgr.host.ledger.MAX_GPUS, shim/ledger_layout.h's
# GS_MAX_GPUS; a test checks they agree). Not imported from there: the client imports this
# module, and nodemgr.host.ledger loads the compiled ledger bindings.
MAX_SIMULATED = 16


class ConfigError(Exception):
    """The configuration file is missing, unreadable or wrong; the message names the key."""


# The longest any interval or timeout may be: a day. TOML takes nan and inf, and a
# timeout that never expires (a NaN heartbeat timeout) or a sweep that never comes
# would stop nodemgr from reclaiming anything.
DAY = 86400.0


class Parser:
    """How one key's value is read: ``parse(value, "section.key")`` returns it, or raises
    ConfigError naming the key; ``accepts`` says in words what it takes (for the docs)."""

    accepts = ""

    def __call__(self, value: Any, where: str) -> Any:
        raise NotImplementedError


class Seconds(Parser):
    """A duration: finite, from ``lo`` to ``hi`` seconds."""

    def __init__(self, lo: float, hi: float = DAY) -> None:
        self.lo, self.hi = lo, hi
        self.accepts = f"seconds, {lo:g} to {hi:g}"

    def __call__(self, value: Any, where: str) -> float:
        try:
            return parse_seconds(value, self.lo, self.hi)
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from None


class Size(Parser):
    """A size in bytes (``parse_size``'s forms); ``positive``: 0 is refused."""

    def __init__(self, positive: bool = False) -> None:
        self.positive = positive
        self.accepts = "a size above 0" if positive else "a size"

    def __call__(self, value: Any, where: str) -> int:
        try:
            size = parse_size(value)
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from None
        if self.positive and size <= 0:
            raise ConfigError(f"{where} must be positive")
        return size


class ContextSize(Parser):
    """gpus.context_memory: a size, or "auto" (None): measured per GPU model at start."""

    accepts = '"auto" or a size'

    def __call__(self, value: Any, where: str) -> int | None:
        return None if value == "auto" else Size()(value, where)


class Integer(Parser):
    """A whole number from ``lo`` (to ``hi`` when given); ``note`` follows the range in
    the error message."""

    def __init__(self, lo: int, hi: int | None = None, note: str = "") -> None:
        self.lo, self.hi = lo, hi
        self.range = f">= {lo}" if hi is None else f"{lo}..{hi}"
        self.note = note
        self.accepts = f"an integer {self.range}"

    def __call__(self, value: Any, where: str) -> int:
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or value < self.lo
            or (self.hi is not None and value > self.hi)
        ):
            raise ConfigError(f"{where} must be an integer {self.range}{self.note}, not {value!r}")
        return value


class Switch(Parser):
    """On or off: a TOML boolean."""

    accepts = "true or false"

    def __call__(self, value: Any, where: str) -> bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, not {value!r}")
        return value


class Number(Parser):
    """A finite number above 0 (``positive``) or of at least 0."""

    def __init__(self, positive: bool) -> None:
        self.positive = positive
        self.accepts = "a number above 0" if positive else "a number >= 0"

    def __call__(self, value: Any, where: str) -> float:
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not number or not math.isfinite(value) or value < 0 or (self.positive and value == 0):
            raise ConfigError(f"{where} must be {self.accepts}, not {value!r}")
        return float(value)


class Choice(Parser):
    """One of a few words."""

    def __init__(self, *words: str) -> None:
        self.words = words
        self.accepts = ", ".join(words[:-1]) + " or " + words[-1]

    def __call__(self, value: Any, where: str) -> str:
        if value not in self.words:
            raise ConfigError(f"{where} must be {self.accepts}, not {value!r}")
        return str(value)


class Text(Parser):
    """A non-empty string without any of ``forbidden``; ``what`` names it in errors."""

    def __init__(self, what: str, forbidden: str = "", quote: bool = True) -> None:
        self.what, self.forbidden, self.quote = what, forbidden, quote
        self.accepts = what

    def __call__(self, value: Any, where: str) -> str:
        if not isinstance(value, str) or not value or any(c in value for c in self.forbidden):
            shown = f", not {value!r}" if self.quote else ""
            raise ConfigError(f"{where} must be {self.what}{shown}")
        return value


class GpuList(Parser):
    """timeslice.gpus: "all", or a list of GPU indices (integers or digit strings) and
    UUIDs (or unique prefixes of them); which GPUs they name is checked at start-up."""

    accepts = '"all" or a list of GPU indices or UUIDs'

    def __call__(self, value: Any, where: str) -> tuple[str, ...] | str:
        if value == "all":
            return "all"
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be {self.accepts}, not {value!r}")
        names = []
        for v in value:
            if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                names.append(str(v))
            elif isinstance(v, str) and DEVICE_NAME.fullmatch(v):
                names.append(v)
            else:
                raise ConfigError(f"{where}: {v!r} is neither a GPU index nor a GPU UUID (GPU-...)")
        return tuple(names)


@dataclass(frozen=True)
class Key:
    """One key of the config file and the ``Config`` field it sets."""

    section: str
    name: str
    attr: str
    parse: Parser
    # The default as the file would write it; None: it depends on the node, and
    # ``default_doc`` says how.
    default: Any
    doc: str
    default_doc: str = ""

    @property
    def path(self) -> str:
        return f"{self.section}.{self.name}"

    def shown_default(self) -> str:
        """The default as docs/configuration.md's table shows it."""
        if self.default is None:
            return self.default_doc
        if isinstance(self.default, bool):
            return f"`{str(self.default).lower()}`"
        if isinstance(self.default, str):
            return f'`"{self.default}"`'
        if isinstance(self.default, list):
            return f"`{self.default!r}`"
        return str(self.default)


# The timeline's parameters left unset: the simulated driver's own defaults.
_SIM_DEFAULT = "the simulator's ([simulator.md](simulator.md#the-device-timeline))"

# fmt: off
KEYS: tuple[Key, ...] = (
    Key("node", "run_dir", "run_dir", Text("a path"), None,
        "sockets (`admin.sock`, `envs/ENV/task.sock`) and ledgers; relative: to the file's"
        " directory", default_doc="see below"),
    Key("node", "state_dir", "state_dir", Text("a path"), None,
        "the sqlite database (`nodemgr.db`) of quotas and records", default_doc="see below"),
    Key("node", "heartbeat_interval", "heartbeat_interval", Seconds(0.01, 3600.0), 1.0,
        "seconds between a task's heartbeats (told to clients)"),
    Key("node", "heartbeat_timeout", "heartbeat_timeout", Seconds(0.05), 5.0,
        "seconds of silence after which a task is ended and reclaimed (longer than the interval)"),
    Key("node", "sweep_interval", "sweep_interval", Seconds(0.01, 60.0), 0.1,
        "seconds between sweeps for dead processes' ledger slots"),
    Key("node", "reclaim_grace", "reclaim_grace", Seconds(0.0, 3600.0), 5.0,
        "seconds a reclaimed task's client has to hear why and end before it is killed"
        " (at least two heartbeat intervals)"),
    Key("gpus", "source", "gpu_source", Choice("auto", "nvml", "simulated"), "auto",
        "`nvml`, `simulated`, or `auto` (NVML if a driver answers)"),
    Key("gpus", "health_interval", "health_interval", Seconds(0.1, 3600.0), 5.0,
        "seconds between NVML checks for lost GPUs"),
    Key("gpus", "utilization_interval", "utilization_interval", Seconds(0.0, 3600.0), 2.0,
        "seconds between NVML samples of GPU and per-process utilisation; 0 turns them off"),
    Key("gpus", "simulated_count", "sim_count", Integer(1, MAX_SIMULATED), 4, "simulated GPUs"),
    Key("gpus", "simulated_memory", "sim_memory", Size(positive=True), "16GiB",
        "memory of each simulated GPU"),
    Key("gpus", "simulated_name", "sim_name",
        Text("a non-empty string without | ; or newlines", "|;\n", quote=False),
        "gpushare Simulated GPU", "their name"),
    Key("gpus", "context_memory", "context_memory", ContextSize(), "auto",
        "charged per process per GPU for its CUDA context; `auto`: measured at start on one"
        " GPU of each model, `\"" + format_size(CONTEXT_FALLBACK) + "\"` where that fails on"
        " NVML GPUs"
        " ([operations.md](operations.md#context-memory))"),
    Key("gpus", "simulated_context_memory", "sim_context", Size(), "0",
        "memory the simulated driver takes for each process's context on a simulated GPU"
        " (less than gpus.simulated_memory)"),
    Key("gpus", "simulated_state_dir", "simulated_state_dir", Text("a path"), None,
        "the simulated GPUs' directory: the process table of every process of the node's"
        " tasks, which their NVML reads, and the GPUs' locks: one nodemgr per directory"
        " ([simulator.md](simulator.md#nodemgrs-simulated-gpus))",
        default_doc="`RUN_DIR/sim`"),
    Key("gpus", "simulated_timeline", "sim_timeline", Switch(), False,
        "the simulated GPUs' device timeline: their tasks' kernels, copies and memsets take"
        " modelled time, which synchronisations wait for ([simulator.md]"
        "(simulator.md#the-device-timeline))"),
    Key("gpus", "simulated_launch_ns", "sim_launch_ns", Number(positive=False), None,
        "with the timeline: each kernel's launch time, ns", default_doc=_SIM_DEFAULT),
    Key("gpus", "simulated_wave_ns", "sim_wave_ns", Number(positive=False), None,
        "with the timeline: the time of one wave of a kernel's blocks, ns",
        default_doc=_SIM_DEFAULT),
    Key("gpus", "simulated_host_gbps", "sim_host_gbps", Number(positive=True), None,
        "with the timeline: the host link's bandwidth, GB/s", default_doc=_SIM_DEFAULT),
    Key("gpus", "simulated_device_gbps", "sim_device_gbps", Number(positive=True), None,
        "with the timeline: the device memory's bandwidth, GB/s", default_doc=_SIM_DEFAULT),
    Key("gpus", "simulated_time_scale", "sim_time_scale", Number(positive=True), None,
        "with the timeline: what every modelled duration is multiplied by",
        default_doc=_SIM_DEFAULT),
    Key("scheduler", "task_threshold", "task_threshold", Integer(1), 4,
        "tasks on a GPU beyond which it is not chosen as a new GPU"),
    Key("scheduler", "memory_reserve", "memory_reserve", Size(), "0",
        "memory per GPU never granted (driver and overheads the shim does not charge)"),
    Key("scheduler", "queue_max_bypass", "queue_max_bypass", Integer(0), 8,
        "times a waiting request may be overtaken before it blocks the queue"),
    Key("scheduler", "max_wait", "max_wait", Seconds(0.0, MAX_WAIT), 86400.0,
        "the longest a request may wait, seconds"),
    Key("metrics", "address", "metrics_address", Text("an address to listen on"), "127.0.0.1",
        "where Prometheus metrics are served"),
    Key("metrics", "port", "metrics_port", Integer(0, 65535, " (0: off)"), 0,
        "their port; 0 turns them off"),
    Key("kube", "oversubscription", "kube_oversubscription", Integer(1, 64), 4,
        "how many times over the Kubernetes device plugin offers each GPU and its memory"
        " ([kubernetes.md](kubernetes.md#resources))"),
    Key("timeslice", "gpus", "timeslice_gpus", GpuList(), [],
        "GPUs that start time-sliced ([timeslicing.md](timeslicing.md))"),
    Key("timeslice", "quantum", "quantum", Integer(1), 4,
        "iterations per turn on a time-sliced GPU"),
    Key("timeslice", "turn_timeout", "turn_timeout", Seconds(0.01), 30.0,
        "seconds a holder may go without an iteration boundary (without yielding, if it"
        " reports none), or past the end of its turn without yielding, before its turn is"
        " taken"),
    Key("timeslice", "guard", "guard", Size(), "100MiB",
        "memory kept free after each task's persistent slice"),
    Key("compute", "period", "compute_period", Seconds(0.001, 10.0), 0.1,
        "seconds of a GPU's compute schedule: each task with a share, or beside one, launches"
        " in a window of every period ([compute.md](compute.md))"),
    Key("compute", "poll", "compute_poll", Seconds(0.00005, 1.0), 0.0005,
        "seconds between a pacer's looks at the board, where latency classes apply"),
    Key("compute", "ls_idle", "compute_ls_idle", Seconds(0.0, 10.0), 0.002,
        "seconds a latency-sensitive task's GPU must have seen none of its launches before a"
        " best-effort task there may launch outside its own window"),
    Key("compute", "elastic_step", "elastic_step", Integer(1, 100), 10,
        "percent of a GPU the elastic rule moves to a latency-sensitive task that would miss"
        " its target, from best-effort tasks there ([compute.md](compute.md#elastic-share))"),
    Key("compute", "elastic_window", "elastic_window", Seconds(0.1, 600.0), 1.0,
        "seconds over which step times are measured, between two elastic steps on a GPU, and"
        " of use over its share before a latency-sensitive task is held"),
    Key("compute", "elastic_tolerance", "elastic_tolerance", Integer(0, 100), 5,
        "percentage points of its GPU a latency-sensitive task may use above its share"),
    Key("prediction", "margin", "predict_margin", Number(False), 0.1,
        "a task sent with its predicted peak (`gpushare-run --shape predicted`) is granted"
        " that peak times 1 + this on a shared GPU, at most its environment's quota"
        " ([prediction.md](prediction.md#admission))"),
    Key("prediction", "topup_wait", "topup_wait", Seconds(0.0, 3600.0), 30.0,
        "seconds a process of such a task whose allocation passes its grant waits for"
        " nodemgr to top the grant up from the quota, while the GPU has no room for it;"
        " 0: it is refused at once"),
    Key("idle", "timeout", "idle_timeout", Seconds(0.0, 7 * DAY), 0.0,
        "seconds without a kernel launch after which a task is idle ([nodemgr.md]"
        "(nodemgr.md#idle-tasks)); 0 turns the idle policy off; `nodemgr idle` sets it per"
        " environment"),
    Key("idle", "warn_before", "idle_warn_before", Seconds(0.0, 7 * DAY), 300.0,
        "how long before an idle task is reclaimed its user is warned"),
    Key("idle", "action", "idle_action", Choice(*IDLE_ACTIONS), "reclaim",
        "what happens to an idle task: `reclaim` its GPUs, or only `report` it"),
    Key("classes", "default", "class_default", Choice(*CLASSES), BE,
        "the class of a task whose request names none, in an environment without its own "
        "(`nodemgr quota set --class-default`; [scheduling.md](scheduling.md#classes))"),
    Key("classes", "allow_ls_default", "allow_ls_default", Switch(), True,
        "whether an environment without its own setting may run latency-sensitive tasks "
        "(`nodemgr quota set --allow-ls/--no-allow-ls`)"),
    Key("audit", "interval", "audit_interval", Seconds(0.0, 3600.0), 10.0,
        "seconds between bypass audits of NVML's processes against the ledgers; 0 turns them"
        " off ([operations.md](operations.md#bypass-audit))"),
    Key("audit", "action", "audit_action", Choice("report", "kill"), "report",
        "what the audit does with a process found bypassing: `report` (log, metric, status)"
        " or `kill` (also SIGKILL it)"),
    Key("audit", "tolerance", "audit_tolerance", Size(), "64MiB",
        "bytes NVML may see a process hold beyond its slots and gpus.context_memory before"
        " the audit reports it"),
    Key("limits", "tasks_per_env", "tasks_per_env", Integer(1), 1024,
        "running tasks one environment may hold; more are refused `busy` (each holds a"
        " descriptor: [operations.md](operations.md#what-a-node-can-hold))"),
    Key("limits", "tasks_per_client", "tasks_per_client", Integer(1), 64,
        "running tasks one client process may hold in an environment; more are refused `busy`"),
    Key("limits", "views_per_second", "views_per_second", Integer(1, 1_000_000), 20,
        "`view` requests (`gpushare-run --status`) served per second per environment, on"
        " average; more are refused `busy`"),
    Key("limits", "view_burst", "view_burst", Integer(1, 1_000_000), 40,
        "`view` requests an environment may send at once beyond that rate"),
    Key("limits", "reader_requests_per_second", "reader_requests_per_second",
        Integer(1, 1_000_000), 50,
        "requests served per second per user on the read-only admin socket (`view.sock`),"
        " on average; more are refused `busy` (a `nodemgr top` sends 4 a frame)"),
    Key("limits", "reader_burst", "reader_burst", Integer(1, 1_000_000), 100,
        "requests a user may send at once on `view.sock` beyond that rate"),
)
# fmt: on

# The keys of [admin], [env_defaults] and each [env."NAME"]: (key, default, meaning).
ACCESS_KEYS: tuple[tuple[str, str, str], ...] = (
    ("owner", "nodemgr's user", "a user name or id"),
    ("group", "nodemgr's group", "a group name or id"),
    ("mode", f'`"{DEFAULT_MODE}"`', 'an octal string like "0660"; the owner reads and writes'),
)
# The access tables: (table, what it sets).
ACCESS_TABLES: tuple[tuple[str, str], ...] = (
    ("admin", "the admin socket's"),
    ("readers", "the read-only admin socket's (`view.sock`: views only)"),
    ("env_defaults", "every environment's socket and ledger"),
)


def doc_table() -> str:
    """docs/configuration.md's table of keys, made from KEYS and ACCESS_KEYS."""
    rows = ["| key | default | accepts | meaning |", "|---|---|---|---|"]
    for k in KEYS:
        accepts = k.parse.accepts.replace("|", "\\|")
        rows.append(f"| `{k.path}` | {k.shown_default()} | {accepts} | {k.doc} |")
    for table, what in ACCESS_TABLES:
        for name, default, accepts in ACCESS_KEYS:
            rows.append(f"| `{table}.{name}` | {default} | {accepts} | {what} {name} |")
    first, *rest = (name for name, _, _ in ACCESS_KEYS)
    names = ", ".join([f'`env."NAME".{first}`'] + [f"`.{name}`" for name in rest])
    rows.append(f"| {names} | `env_defaults` | as above | one environment's |")
    return "\n".join(rows) + "\n"


_DEFAULTS: dict[str, Any] = {
    k.attr: k.parse(k.default, k.path) for k in KEYS if k.default is not None
}


@dataclass(frozen=True)
class Access:
    """Who may reach a socket (and, for an environment, its ledger)."""

    uid: int
    gid: int
    mode: int

    @property
    def dir_mode(self) -> int:
        """The mode of the directory holding an environment's socket and ledger: its owner
        may list it; group and others may only pass through, when the mode lets them in."""
        mode = 0o700
        if self.mode & 0o060:
            mode |= 0o010
        if self.mode & 0o006:
            mode |= 0o001
        return mode


def _own_access() -> Access:
    return Access(os.geteuid(), os.getegid(), int(DEFAULT_MODE, 8))


@dataclass(frozen=True)
class Config:
    """The loaded configuration; each default is its key's in KEYS."""

    path: Path | None
    run_dir: Path
    state_dir: Path = field(default_factory=lambda: default_state_dir())
    heartbeat_interval: float = _DEFAULTS["heartbeat_interval"]
    heartbeat_timeout: float = _DEFAULTS["heartbeat_timeout"]
    sweep_interval: float = _DEFAULTS["sweep_interval"]
    reclaim_grace: float = _DEFAULTS["reclaim_grace"]
    gpu_source: str = _DEFAULTS["gpu_source"]
    sim_count: int = _DEFAULTS["sim_count"]
    sim_memory: int = _DEFAULTS["sim_memory"]
    sim_name: str = _DEFAULTS["sim_name"]
    sim_context: int = _DEFAULTS["sim_context"]
    # gpus.simulated_state_dir as set; None: in run_dir (sim_state_dir).
    simulated_state_dir: Path | None = None
    # The simulated GPUs' device timeline and its parameters (None: the simulator's own).
    sim_timeline: bool = _DEFAULTS["sim_timeline"]
    sim_launch_ns: float | None = None
    sim_wave_ns: float | None = None
    sim_host_gbps: float | None = None
    sim_device_gbps: float | None = None
    sim_time_scale: float | None = None
    health_interval: float = _DEFAULTS["health_interval"]
    utilization_interval: float = _DEFAULTS["utilization_interval"]
    # Bytes charged per process per GPU for its CUDA context; None: "auto", measured
    # per GPU model at start (nodemgr.host.ctxprobe).
    context_memory: int | None = _DEFAULTS["context_memory"]
    task_threshold: int = _DEFAULTS["task_threshold"]
    memory_reserve: int = _DEFAULTS["memory_reserve"]
    queue_max_bypass: int = _DEFAULTS["queue_max_bypass"]
    max_wait: float = _DEFAULTS["max_wait"]
    metrics_address: str = _DEFAULTS["metrics_address"]
    metrics_port: int = _DEFAULTS["metrics_port"]
    kube_oversubscription: int = _DEFAULTS["kube_oversubscription"]
    admin_access: Access = field(default_factory=_own_access)
    # [readers]: who may reach view.sock, the admin endpoint's views without its changes.
    reader_access: Access = field(default_factory=_own_access)
    env_default_access: Access = field(default_factory=_own_access)
    env_access: dict[str, Access] = field(default_factory=dict)
    # [timeslice] (docs/timeslicing.md): the GPUs that start time-sliced, by index or
    # UUID as written ("all": every GPU), iterations per turn, the longest a holder keeps
    # the turn without yielding, and the default guard after each persistent slice.
    timeslice_gpus: tuple[str, ...] | str = _DEFAULTS["timeslice_gpus"]
    quantum: int = _DEFAULTS["quantum"]
    turn_timeout: float = _DEFAULTS["turn_timeout"]
    guard: int = _DEFAULTS["guard"]
    # [compute] (docs/compute.md): the schedule's period, how often pacers look at the
    # board, and how long LS must be idle before BE launches.
    compute_period: float = _DEFAULTS["compute_period"]
    compute_poll: float = _DEFAULTS["compute_poll"]
    compute_ls_idle: float = _DEFAULTS["compute_ls_idle"]
    # The elastic rule (docs/compute.md, "Elastic share").
    elastic_step: int = _DEFAULTS["elastic_step"]
    elastic_window: float = _DEFAULTS["elastic_window"]
    elastic_tolerance: int = _DEFAULTS["elastic_tolerance"]
    # [idle] (docs/nodemgr.md, "Idle tasks"): the node's idle policy.
    idle_timeout: float = _DEFAULTS["idle_timeout"]
    idle_warn_before: float = _DEFAULTS["idle_warn_before"]
    idle_action: str = _DEFAULTS["idle_action"]
    # [classes] (docs/scheduling.md, "Classes"): what an environment without its own
    # settings gets.
    class_default: str = _DEFAULTS["class_default"]
    allow_ls_default: bool = _DEFAULTS["allow_ls_default"]

    @property
    def grace(self) -> float:
        """Seconds a reclaimed task's client has to end by itself: at least two heartbeat
        intervals, so that it hears why at its next heartbeat."""
        return max(self.reclaim_grace, 2 * self.heartbeat_interval)

    # [prediction] (docs/prediction.md#admission): the margin over a predicted peak, and
    # how long an allocation beyond a predicted grant waits for a top-up.
    predict_margin: float = _DEFAULTS["predict_margin"]
    topup_wait: float = _DEFAULTS["topup_wait"]
    # [audit] (docs/operations.md#bypass-audit): seconds between audits (0: off), what is
    # done with a process found bypassing, and the slack allowed beyond its slots.
    audit_interval: float = _DEFAULTS["audit_interval"]
    audit_action: str = _DEFAULTS["audit_action"]
    audit_tolerance: int = _DEFAULTS["audit_tolerance"]
    # [limits] (docs/operations.md#what-a-node-can-hold): caps on what one environment and
    # one client process may hold.
    tasks_per_env: int = _DEFAULTS["tasks_per_env"]
    tasks_per_client: int = _DEFAULTS["tasks_per_client"]
    views_per_second: int = _DEFAULTS["views_per_second"]
    view_burst: int = _DEFAULTS["view_burst"]
    reader_requests_per_second: int = _DEFAULTS["reader_requests_per_second"]
    reader_burst: int = _DEFAULTS["reader_burst"]

    @property
    def admin_endpoint(self) -> str:
        return paths.endpoint(self.run_dir / paths.ADMIN_SOCKET)

    @property
    def sim_state_dir(self) -> Path:
        """The simulated GPUs' directory (GPUSHARE_SIM_STATE_DIR for the node's tasks and
        its own simulated NVML): one simulated node, so one nodemgr's."""
        return self.simulated_state_dir or self.run_dir / "sim"

    @property
    def sim_timeline_params(self) -> dict[str, float] | None:
        """What the grant tells a task's simulated driver of the device timeline: None when
        it is off, else the parameters set, by name (gpushare.envvars.SIM_TIMELINE_PARAMS)."""
        if not self.sim_timeline:
            return None
        params = {
            "launch_ns": self.sim_launch_ns,
            "wave_ns": self.sim_wave_ns,
            "host_gbps": self.sim_host_gbps,
            "device_gbps": self.sim_device_gbps,
            "time_scale": self.sim_time_scale,
        }
        return {name: v for name, v in params.items() if v is not None}

    @property
    def reader_endpoint(self) -> str:
        """The read-only admin socket's: the views only (docs/operations.md, "Access")."""
        return paths.endpoint(self.run_dir / paths.VIEW_SOCKET)

    @property
    def database(self) -> Path:
        return self.state_dir / "nodemgr.db"

    def env_dir(self, env: str) -> Path:
        return paths.env_dir(self.run_dir, env)

    def env_socket(self, env: str) -> Path:
        """Environment ``env``'s socket, where its clients connect."""
        return self.env_dir(env) / paths.TASK_SOCKET

    def access_for(self, env: str) -> Access:
        return self.env_access.get(env, self.env_default_access)


def check_gpus(config: Config, memories: dict[int, int], contexts: dict[int, int]) -> None:
    """The sizes that only the GPUs found can judge (``memories``: bytes per GPU index;
    ``contexts``: the context charge on each): the reserve and one context must leave room
    for something on every GPU."""
    for index, memory in sorted(memories.items()):
        context = contexts[index]
        if config.memory_reserve >= memory:
            raise ConfigError(
                f"scheduler.memory_reserve ({format_size(config.memory_reserve)}) is not "
                f"less than GPU {index}'s memory ({format_size(memory)})"
            )
        room = memory - config.memory_reserve
        if context >= room:
            raise ConfigError(
                f"gpus.context_memory ({format_size(context)}) leaves nothing of GPU "
                f"{index}'s memory ({format_size(memory)}, less "
                f"scheduler.memory_reserve {format_size(config.memory_reserve)})"
            )


def default_state_dir() -> Path:
    """Where the database of quotas and records lives when the config names no ``state_dir``."""
    if os.geteuid() == 0:
        return Path("/var/lib/gpushare")
    xdg = os.environ.get("XDG_STATE_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "gpushare"
    return Path.home() / ".local" / "state" / "gpushare"


def _path(value: str, file: Path | None) -> Path:
    """A path the config file gives: a relative one is relative to the file's directory,
    and made absolute, so that it names the same place from any working directory (an
    endpoint handed to a client, a socket's path)."""
    if file is None or os.path.isabs(value):
        return Path(value)
    return Path(os.path.normpath(os.path.join(os.path.abspath(file.parent), value)))


_ACCESS_NAMES = {name for name, _, _ in ACCESS_KEYS}
_SECTIONS: dict[str, set[str]] = {}
for _k in KEYS:
    _SECTIONS.setdefault(_k.section, set()).add(_k.name)
for _table, _ in ACCESS_TABLES:
    _SECTIONS[_table] = _ACCESS_NAMES
MAX_ID = (1 << 32) - 1
_MODE = re.compile(r"^0?[0-7]{3}$")


def _account(
    table: dict[str, Any],
    where: str,
    key: str,
    lookup: Callable[[str], int],
    what: str,
    default: int,
) -> int:
    """A user or group given by name or id; KeyError from ``lookup`` means no such name."""
    value = table.get(key)
    if value is None:
        return default
    if isinstance(value, int) and not isinstance(value, bool):
        # An id need not have an account here (a container's user seldom has one), but it
        # must be one: -1 and 2^32-1 mean "leave as it is" to chown.
        if not 0 <= value < MAX_ID:
            raise ConfigError(f"{where}.{key}: {value} is not a {what} id (0 to {MAX_ID - 1})")
        return value
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}.{key} must be a {what} name or id, not {value!r}")
    try:
        return int(lookup(value))
    except (KeyError, ValueError):  # ValueError: a NUL in the name
        raise ConfigError(f"{where}.{key}: no {what} named {value!r} on this node") from None


def _access(table: dict[str, Any], where: str, base: Access) -> Access:
    """owner/group/mode of a [where] table: names or ids, and an octal mode string."""
    uid, gid, mode = base.uid, base.gid, base.mode
    uid = _account(table, where, "owner", lambda n: pwd.getpwnam(n).pw_uid, "user", uid)
    gid = _account(table, where, "group", lambda n: grp.getgrnam(n).gr_gid, "group", gid)
    raw = table.get("mode")
    if raw is not None:
        if not isinstance(raw, str) or not _MODE.match(raw):
            raise ConfigError(f'{where}.mode must be an octal string like "0660", not {raw!r}')
        mode = int(raw, 8)
        if mode & 0o111:
            raise ConfigError(f"{where}.mode {raw}: execute bits make no sense for a socket")
        if not mode & 0o600 == 0o600:
            raise ConfigError(f"{where}.mode {raw}: the owner needs read and write")
    return Access(uid, gid, mode)


def load(path: str | os.PathLike[str] | None = None) -> Config:
    """Load ``path``, or $GPUSHARE_CONFIG, or /etc/gpushare/nodemgr.toml if present.

    With no file at all the defaults apply: NVML GPUs when a driver is
    present, simulated ones otherwise.
    """
    explicit = path if path is not None else os.environ.get(CONFIG_ENV)
    file: Path | None = Path(explicit) if explicit else None
    if file is None and DEFAULT_CONFIG.exists():
        file = DEFAULT_CONFIG
    data: dict[str, Any] = {}
    if file is not None:
        try:
            with open(file, "rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError(f"config file {file} does not exist") from None
        except OSError as e:
            raise ConfigError(f"cannot read config file {file}: {e.strerror}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {file} is not valid TOML: {e}") from None
    for section, table in data.items():
        if section == "env" and isinstance(table, dict):
            for name, sub in table.items():
                if not isinstance(sub, dict):
                    raise ConfigError(f"[env.{name}] must be a table of owner, group, mode")
                for key in sub:
                    if key not in _ACCESS_NAMES:
                        raise ConfigError(f"unknown key env.{name}.{key} in {file}")
            continue
        if section not in _SECTIONS or not isinstance(table, dict):
            raise ConfigError(f"unknown section [{section}] in {file}")
        for key in table:
            if key not in _SECTIONS[section]:
                raise ConfigError(f"unknown key {section}.{key} in {file}")
    values: dict[str, Any] = {}
    for k in KEYS:
        table = data.get(k.section, {})
        if k.name in table:
            values[k.attr] = k.parse(table[k.name], k.path)
        elif k.default is not None:
            values[k.attr] = _DEFAULTS[k.attr]
    if "run_dir" not in values:
        values["run_dir"] = paths.default_run_dir(file)
    if "state_dir" not in values:
        values["state_dir"] = default_state_dir()
    for attr in ("run_dir", "state_dir", "simulated_state_dir"):
        if isinstance(values.get(attr), str):
            values[attr] = _path(values[attr], file)
    if values["heartbeat_timeout"] <= values["heartbeat_interval"]:
        raise ConfigError(
            f"node.heartbeat_timeout ({values['heartbeat_timeout']}) must be longer than "
            f"node.heartbeat_interval ({values['heartbeat_interval']})"
        )
    if values["sim_context"] >= values["sim_memory"]:
        raise ConfigError(
            f"gpus.simulated_context_memory ({format_size(values['sim_context'])}) must be "
            f"less than gpus.simulated_memory ({format_size(values['sim_memory'])})"
        )
    env_default = _access(data.get("env_defaults", {}), "env_defaults", _own_access())
    env_access = {}
    for name, sub in data.get("env", {}).items():
        env_access[name] = _access(sub, f"env.{name}", env_default)
    return Config(
        path=file,
        admin_access=_access(data.get("admin", {}), "admin", _own_access()),
        reader_access=_access(data.get("readers", {}), "readers", _own_access()),
        env_default_access=env_default,
        env_access=env_access,
        **values,
    )


ENV_SOCKET_FIX = "give it a shorter name, or the node a shorter node.run_dir"
