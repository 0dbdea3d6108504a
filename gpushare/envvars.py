"""Every ``GPUSHARE_*`` environment variable the client reads or sets, defined once: its
name, the gpushare-run option that overrides it, the value it takes and what it does.

client_plugin.settings parses the settings among them; the auto-loader, the iteration
hooks, gpushare-run's help and docs/client.md (``doc_table()``, checked by a test) take
the names from here. The auto-loader imports this module at every interpreter start, so
it imports nothing.
"""

from __future__ import annotations

TYPE_CHECKING = False  # not typing's: this module is imported at every interpreter start
if TYPE_CHECKING:
    from collections.abc import Mapping

# The words a yes/no variable takes, any case, spaces around ignored; the one list
# (gpushare-autoload.pth repeats FALSE_WORDS inline: a test holds the two together).
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def is_off(value: str) -> bool:
    """Whether ``value`` is one of FALSE_WORDS."""
    return value.strip().lower() in FALSE_WORDS


def switched_on(value: str | None) -> bool:
    """A switch that is off unless set: unset, empty or a false word is off."""
    return value is not None and value.strip() != "" and not is_off(value)


# Settings: set by the user (or a dev container), read by gpushare-run and the auto-loader.
ENDPOINT = "GPUSHARE_ENDPOINT"
GPUS = "GPUSHARE_GPUS"
MEMORY = "GPUSHARE_MEMORY"
WAIT = "GPUSHARE_WAIT"
WAIT_TIMEOUT = "GPUSHARE_WAIT_TIMEOUT"
CPU_FALLBACK = "GPUSHARE_CPU_FALLBACK"
GRACE = "GPUSHARE_GRACE"
# Waiting without a terminal: the longest time between two progress lines.
PROGRESS_INTERVAL = "GPUSHARE_PROGRESS_INTERVAL"
# Time-sliced GPUs (docs/timeslicing.md): the task's estimated shape, and the space
# nodemgr keeps after its persistent slice.
PERSISTENT = "GPUSHARE_PERSISTENT"
TEMPORARY = "GPUSHARE_TEMPORARY"
GUARD = "GPUSHARE_GUARD"
# The task's class (docs/scheduling.md, "Classes"), and whether gpushare-run runs its
# command again when nodemgr requeues it for a latency-sensitive task.
CLASS = "GPUSHARE_CLASS"
REQUEUE = "GPUSHARE_REQUEUE"
# Compute shares (docs/compute.md): the percentage of its GPUs' time the task may take.
COMPUTE = "GPUSHARE_COMPUTE"
# A latency-sensitive task's target (docs/compute.md, "Elastic share").
STEP_TARGET = "GPUSHARE_STEP_TARGET"
DEADLINE = "GPUSHARE_DEADLINE"
STEPS = "GPUSHARE_STEPS"
# gpushare-run --predict (docs/prediction.md): the iterations its dry run waits for.
PREDICT_ITERATIONS = "GPUSHARE_PREDICT_ITERATIONS"
# gpushare-run --shape (docs/prediction.md#admission): ask by the dry run's prediction.
SHAPE = "GPUSHARE_SHAPE"
# The auto-loader's own settings.
AUTOLOAD = "GPUSHARE_AUTOLOAD"
FRAMEWORKS = "GPUSHARE_FRAMEWORKS"
ZERO_QUOTA = "GPUSHARE_ZERO_QUOTA"
ITERATION_HOOKS = "GPUSHARE_ITERATION_HOOKS"
# Set by the client for a task's processes.
LEDGER = "GPUSHARE_LEDGER"
# Set by gpushare-run --predict for its dry run's processes: the iterations each runs before
# it releases its cached memory and runs one more (docs/prediction.md).
DRY_RUN = "GPUSHARE_DRY_RUN"
# ... and the file each of its processes appends a JSON line to at each boundary.
DRY_RUN_REPORT = "GPUSHARE_DRY_RUN_REPORT"
TASK_ID = "GPUSHARE_TASK_ID"
# The node's board beside the ledger, when there is one (docs/compute.md).
BOARD = "GPUSHARE_BOARD"
# Set for a task's processes when some of its GPUs were time-sliced at the grant: the node
# indices. A hint only (a GPU's mode can change later): it has the iteration hooks connect
# to nodemgr up front rather than in the task's first turn switch.
TIMESLICED = "GPUSHARE_TIMESLICED"
# Set for every process of a task (or of a CPU-only run): the pid of the process
# that holds it. Any other process seeing it shares that grant and asks for none.
TASK_OWNER = "GPUSHARE_TASK_OWNER"
# "PID,HEARTBEAT_INTERVAL" of the process that holds an auto-loaded task, so that the
# same process, restarted with the shim or exec'ing another program, keeps it alive.
AUTOLOAD_HOLDER = "GPUSHARE_AUTOLOAD_HOLDER"
SIM_GPUS = "GPUSHARE_SIM_GPUS"
SIM_STATE_DIR = "GPUSHARE_SIM_STATE_DIR"
# The simulated driver's device timeline (docs/simulator.md), and its parameters by the
# names the grant gives them (gpus.simulated_* of nodemgr's config).
SIM_TIMELINE = "GPUSHARE_SIM_TIMELINE"
SIM_LAUNCH_NS = "GPUSHARE_SIM_LAUNCH_NS"
SIM_WAVE_NS = "GPUSHARE_SIM_WAVE_NS"
SIM_HOST_GBPS = "GPUSHARE_SIM_HOST_GBPS"
SIM_DEVICE_GBPS = "GPUSHARE_SIM_DEVICE_GBPS"
SIM_TIME_SCALE = "GPUSHARE_SIM_TIME_SCALE"
SIM_TIMELINE_PARAMS = {
    "launch_ns": SIM_LAUNCH_NS,
    "wave_ns": SIM_WAVE_NS,
    "host_gbps": SIM_HOST_GBPS,
    "device_gbps": SIM_DEVICE_GBPS,
    "time_scale": SIM_TIME_SCALE,
}
# Builds other than the packaged ones (a debug or sanitizer build).
SHIM = "GPUSHARE_SHIM"
SIM_DIR = "GPUSHARE_SIM_DIR"

# (name, gpushare-run's option, the value it takes, what it does); "" where none.
SETTINGS: tuple[tuple[str, str, str, str], ...] = (
    (ENDPOINT, "--endpoint", "`ipc://PATH`", "the environment's task endpoint"),
    (GPUS, "--gpus", "N, 1 to 64", "GPUs the task needs"),
    (MEMORY, "--memory", "SIZE", "memory per GPU the task expects"),
    (WAIT, "--wait / --no-wait", "1/0", "wait in nodemgr's queue when no GPUs are free"),
    (WAIT_TIMEOUT, "--wait-timeout", "SECONDS", "give up waiting after this long"),
    (CPU_FALLBACK, "--cpu-fallback", "1/0", "run with no GPU on zero quota or none free"),
    (GRACE, "--grace", "SECONDS", "from a passed-on signal to killing CMD's process group"),
    (
        PROGRESS_INTERVAL,
        "",
        "SECONDS",
        "waiting with stderr not a terminal: a progress line at least this often (30)",
    ),
    (PERSISTENT, "--persistent", "SIZE", "time-sliced GPUs: estimated persistent memory"),
    (TEMPORARY, "--temporary", "SIZE", "time-sliced GPUs: estimated temporary memory"),
    (GUARD, "--guard", "SIZE", "time-sliced GPUs: space kept after the persistent memory"),
    (
        CLASS,
        "--class",
        "ls/be",
        "the task's class: latency-sensitive or best-effort (also the long forms); "
        "unset: the environment's default",
    ),
    (
        REQUEUE,
        "--requeue / --no-requeue",
        "1/0",
        "requeued for a latency-sensitive task: wait and run CMD again (on by default)",
    ),
    (COMPUTE, "--compute", "PERCENT, 1 to 100", "the share of its GPUs' time the task may take"),
    (STEP_TARGET, "--step-target", "MS", "latency-sensitive: the time one iteration may take"),
    (DEADLINE, "--deadline", "SECONDS", "latency-sensitive: the time the run may take, with steps"),
    (STEPS, "--steps", "N", "latency-sensitive: the iterations of the run, with a deadline"),
    (
        PREDICT_ITERATIONS,
        "--iterations",
        "N, 1 to 1000",
        "`--predict`: the iterations the dry run runs as on a shared GPU (3)",
    ),
    (
        SHAPE,
        "--shape",
        "quota/predicted",
        "`predicted`: a dry run first, and the request carries its prediction (nodemgr grants "
        "the predicted peak plus a margin); `quota`: the whole quota (the default)",
    ),
    (AUTOLOAD, "", "1/0", "the auto-loader requests a grant when a framework is imported"),
    (FRAMEWORKS, "", "NAME,...", "more top-level modules whose import starts a task"),
    (ZERO_QUOTA, "", "warn/error", "the auto-loader on a zero quota"),
    (ITERATION_HOOKS, "", "1/0", "the iteration hooks in a task's framework (on by default)"),
    (SHIM, "", "PATH", "the preload library to use instead of the packaged one"),
    (SIM_DIR, "", "PATH", "the simulated driver's directory instead of the packaged one"),
)
# Set by gpushare-run and the auto-loader for the processes of a task: (name, value).
TASK_VARIABLES: tuple[tuple[str, str], ...] = (
    (LEDGER, "the environment's ledger, read by the shim"),
    (TASK_ID, "the task's id"),
    (BOARD, "the node's board of latency-sensitive activity, beside the ledger (docs/compute.md)"),
    (TIMESLICED, "the granted GPUs that were time-sliced: node indices, comma-separated"),
    (TASK_OWNER, "the pid of the process holding the grant: others ask for none"),
    (DRY_RUN, "`--predict` only: the iterations each process runs before its release and one more"),
    (
        DRY_RUN_REPORT,
        "`--predict` only: the file each process appends its figures to at a boundary",
    ),
    (AUTOLOAD_HOLDER, "the auto-loaded task's holder: PID,HEARTBEAT_INTERVAL"),
    (SIM_GPUS, "simulated nodes only: the simulated driver's GPUs"),
    (SIM_STATE_DIR, "simulated nodes only: the directory of the node's shared process table"),
    (SIM_TIMELINE, "simulated nodes with `gpus.simulated_timeline` only: the device timeline on"),
    *(
        (name, "the same, where nodemgr's config sets it: a parameter of the timeline")
        for name in SIM_TIMELINE_PARAMS.values()
    ),
)


def run_help() -> str:
    """gpushare-run's help: the variables behind its options."""
    named = []
    for name, option, form, _ in SETTINGS:
        if option:
            named.append(f"{name} ({form})" if form == "1/0" else name)
    return ", ".join(named) + "."


def doc_table() -> str:
    """docs/client.md's table of variables, made from SETTINGS and TASK_VARIABLES."""
    rows = [
        "| variable | set by | gpushare-run option | value | meaning |",
        "|---|---|---|---|---|",
    ]
    for name, option, form, doc in SETTINGS:
        shown = f"`{option}`" if option else "—"
        rows.append(f"| `{name}` | you | {shown} | {form} | {doc} |")
    for name, doc in TASK_VARIABLES:
        rows.append(f"| `{name}` | gpushare | — | — | {doc} |")
    return "\n".join(rows) + "\n"


def hooks_wanted(environ: Mapping[str, str]) -> bool:
    """GPUSHARE_ITERATION_HOOKS: on unless it says off (unset or empty: on)."""
    return not is_off(environ.get(ITERATION_HOOKS, ""))
