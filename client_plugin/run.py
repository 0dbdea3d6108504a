"""``gpushare-run``: run one command under a GPU grant from nodemgr.

Requests the grant (waiting in nodemgr's queue if need be), starts the command
in a process group of its own with the shim preloaded and CUDA_VISIBLE_DEVICES
set to the granted GPUs, heartbeats while it runs, passes signals on, reports
its end and exits with the command's exit code.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import click
from click.core import ParameterSource

from client_plugin import predict, status
from client_plugin import settings as cfg
from client_plugin.grant import (
    Grant,
    Heartbeat,
    Progress,
    acquire,
    cancelled,
    cpu_environment,
    inherited_owner,
    release,
    task_environment,
)
from client_plugin.supervise import Supervisor, Terminal, exit_code, say, spawn
from gpushare import __version__, envvars
from gpushare.client import ClassNotAllowed, NodeError, NoResources, QuotaZero, Unreachable
from gpushare.exitcodes import (
    EXIT_CANCELLED,
    EXIT_CLASS_REFUSED,
    EXIT_INTERNAL,
    EXIT_NO_RESOURCES,
    EXIT_NOT_EXECUTABLE,
    EXIT_NOT_FOUND,
    EXIT_NOT_PREDICTED,
    EXIT_PREEMPTED,
    EXIT_RECLAIMED_ADMIN,
    EXIT_RECLAIMED_DELETED,
    EXIT_RECLAIMED_IDLE,
    EXIT_RECLAIMED_OTHER,
    EXIT_RECLAIMED_TIMEOUT,
    EXIT_REFUSED,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
)
from gpushare.params import ClassType, CountType, SecondsType, SizeType
from gpushare.protocol import MAX_GPUS_PER_REQUEST, MAX_WAIT
from gpushare.sizes import format_size


def fail_before_start(endpoint: str, grant: Grant | None, message: str, code: int) -> int:
    say(message)
    if grant is not None:
        release(endpoint, grant.task_id, code, say)
    return code


def _not_started(cmd: list[str], e: OSError) -> tuple[str, int]:
    """Why CMD could not be started, and the exit code that says so."""
    if isinstance(e, FileNotFoundError):
        return f"command not found: {cmd[0]}", EXIT_NOT_FOUND
    return f"cannot execute {cmd[0]}: {e.strerror}", EXIT_NOT_EXECUTABLE


def _start(
    cmd: list[str], env: Mapping[str, str], endpoint: str, grant: Grant | None, term: Terminal
) -> subprocess.Popen[bytes] | int:
    try:
        return spawn(cmd, env, term)
    except OSError as e:
        return fail_before_start(endpoint, grant, *_not_started(cmd, e))


def _refused(e: NodeError, s: cfg.Settings) -> int:
    if isinstance(e, ClassNotAllowed):
        return _refusal(e, EXIT_CLASS_REFUSED, "")
    if isinstance(e, QuotaZero):
        fix = "--cpu-fallback runs it without a GPU"
        return _refusal(e, EXIT_REFUSED, fix if not s.cpu_fallback else "")
    if isinstance(e, NoResources):
        fix = (
            "--wait lets it wait in the queue; --cpu-fallback runs it without a GPU"
            if not s.wait
            else "a longer --wait-timeout, or --cpu-fallback to run it without a GPU"
        )
        return _refusal(e, EXIT_NO_RESOURCES, fix)
    return _refusal(e, EXIT_REFUSED, "")


def _unreachable(e: Unreachable) -> int:
    say(
        f"cannot reach nodemgr: {e} (is nodemgr running, and is this the "
        f"environment's endpoint? nodemgr quota show ENV prints it)"
    )
    return EXIT_UNREACHABLE


def _refusal(e: NodeError, code: int, fix: str) -> int:
    say(f"request refused ({e.code}): {e.message}" + (f" ({fix})" if fix else ""))
    return code


def run(s: cfg.Settings, cmd: list[str]) -> int:
    """Everything after option parsing; returns gpushare-run's exit code."""
    assert s.endpoint is not None
    owner = inherited_owner()
    if owner is not None and owner != os.getpid():
        # Inside a task already (or a CPU-only run): share it, never ask for another.
        for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # Python ignores these; CMD must not
            signal.signal(sig, signal.SIG_DFL)
        try:
            os.execvp(cmd[0], cmd)
        except OSError as e:
            return fail_before_start(s.endpoint, None, *_not_started(cmd, e))
    if s.devices == () and s.cpu_fallback:
        say("CUDA_VISIBLE_DEVICES allows no GPU: running without one")
        return _supervise(s, cmd, None)[0]
    if s.shape == "predicted":
        shaped = _predicted(s, cmd)
        if isinstance(shaped, int):
            return shaped
        s = shaped
    endpoint = s.endpoint
    assert endpoint is not None
    while True:
        progress = Progress("gpushare-run", s.gpus, interval=s.progress_interval)
        try:
            grant = acquire(s, " ".join(cmd), progress, wrapper=True)
        except KeyboardInterrupt:
            say(cancelled(endpoint, progress))
            return EXIT_CANCELLED
        except Unreachable as e:
            return _unreachable(e)
        except (QuotaZero, NoResources) as e:
            if not s.cpu_fallback:
                return _refused(e, s)
            say(f"running without a GPU ({e.code}): {e.message}")
            return _supervise(s, cmd, None)[0]
        except NodeError as e:
            return _refused(e, s)
        code, reason = _supervise(s, cmd, grant)
        if reason != "preempted" or not s.requeue:
            return code
        # Requeued for a latency-sensitive task (docs/client.md, "Classes"): from the start.
        say("waiting for GPUs again to run the command again (--no-requeue exits instead)")


def _predicted(s: cfg.Settings, cmd: list[str]) -> cfg.Settings | int:
    """--shape predicted (docs/prediction.md#admission): a dry run of CMD first; the
    settings with its prediction, as they were when it made none, or the exit code when
    CMD cannot run at all (or the user interrupted)."""
    try:
        # What CMD prints in its dry run is not its run's output: dropped.
        with tempfile.TemporaryFile() as out:
            result = predict.dry_run(cmd, s.gpus, s.predict_iterations, s.grace, out.fileno())
    except KeyboardInterrupt:
        say("interrupted")
        return EXIT_CANCELLED
    except (predict.PredictError, Unreachable, NodeError) as e:
        say(f"the dry run failed ({e}); asking for the whole quota")
        return s
    if isinstance(result, int):
        return result
    if not result.made:
        say(
            f"the dry run made no prediction (the command ended with exit code "
            f"{result.exit_code} after {result.iterations} of its {result.wanted} iterations); "
            "asking for the whole quota"
        )
        return s
    per_gpu = -(-result.peak // s.gpus)
    say(
        f"predicted peak {format_size(per_gpu)} per GPU ({result.seconds:.1f} s of dry run); "
        "asking for it"
    )
    first = result.gpus[0] if result.gpus else None
    if s.persistent is None and first is not None and first.persistent is not None:
        s = s.but(persistent=first.persistent, temporary=first.temporary)
    return s.but(predicted=per_gpu, features=result.features)


def _supervise(s: cfg.Settings, cmd: list[str], grant: Grant | None) -> tuple[int, str | None]:
    """Run CMD to its end; its exit code, and why nodemgr reclaimed the task if it did."""
    assert s.endpoint is not None
    # An inherited SIGCHLD=SIG_IGN would have the kernel reap the command unseen.
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    me = os.getpid()
    term = Terminal()
    try:
        if grant is None:
            env = cpu_environment(os.environ, me)
        else:
            try:
                env = task_environment(grant, os.environ, me)
            except FileNotFoundError as e:
                return fail_before_start(s.endpoint, grant, str(e), EXIT_INTERNAL), None
        # No ZeroMQ context exists at this point (the request's was closed), so
        # the command is forked from a process without ZeroMQ's I/O threads.
        child = _start(cmd, env, s.endpoint, grant, term)
        if isinstance(child, int):
            return child, None
        hb = None
        if grant is not None:
            hb = Heartbeat(s.endpoint, grant.task_id, grant.heartbeat_interval, say)
        supervisor = Supervisor(child, term, s.grace, hb)
        returncode = supervisor.run()
        code = exit_code(returncode) if supervisor.reclaimed is None else supervisor.reclaimed
        if hb is not None:
            hb.done(code, -returncode if returncode < 0 else None)
        return code, supervisor.reason
    finally:
        term.close()


def show(endpoint: str, as_json: bool) -> int:
    """``--status``: print the node as this environment sees it; returns the exit code."""
    try:
        status.show(endpoint, as_json, lambda text: print(text, end="", flush=True))
    except Unreachable as e:
        return _unreachable(e)
    except NodeError as e:
        say(f"nodemgr refused the status request ({e.code}): {e.message}")
        return EXIT_REFUSED
    return 0


EXIT_HELP = (
    f"Exit codes: CMD's own (128+N if killed by signal N); {EXIT_USAGE} bad usage;\n"
    f"{EXIT_UNREACHABLE} nodemgr unreachable (or no such environment); "
    f"{EXIT_NO_RESOURCES} no GPUs free (now, or\nwithin the wait); "
    f"{EXIT_REFUSED} request refused (zero or exceeded quota, CUDA_VISIBLE_DEVICES no GPU\n"
    f"can satisfy, busy); {EXIT_INTERNAL} gpushare-run failed; "
    f"{EXIT_NOT_EXECUTABLE} CMD not\n"
    f"executable; {EXIT_NOT_FOUND} CMD not found; "
    f"{EXIT_CANCELLED} interrupted while waiting for GPUs;\n"
    f"nodemgr took the GPUs back and CMD was killed: {EXIT_RECLAIMED_IDLE} idle, "
    f"{EXIT_RECLAIMED_TIMEOUT} no heartbeat, {EXIT_RECLAIMED_ADMIN} an\n"
    f"operator's reclaim, {EXIT_RECLAIMED_DELETED} environment deleted, "
    f"{EXIT_RECLAIMED_OTHER} another reason,\n"
    f"{EXIT_PREEMPTED} requeued for a latency-sensitive task with --no-requeue; "
    f"{EXIT_CLASS_REFUSED} --class ls refused\n(the environment may not run "
    f"latency-sensitive tasks); {EXIT_NOT_PREDICTED} --predict made no prediction (CMD\n"
    "failed in the dry run)."
)

F = TypeVar("F", bound=Callable[..., Any])


# What --predict takes besides CMD: the rest asks the node's nodemgr.
_PREDICT_PARAMS = frozenset({"predict_run", "iterations", "gpus", "grace", "as_json", "cmd"})


def _check_predict_options(ctx: click.Context) -> None:
    """--predict runs on a node of its own: the options that ask anything of the node's
    nodemgr mean nothing there, and are refused rather than ignored."""
    for param in ctx.command.params:
        given = param.name and ctx.get_parameter_source(param.name) is ParameterSource.COMMANDLINE
        if given and param.name not in _PREDICT_PARAMS:
            option = "/".join([*param.opts, *param.secondary_opts])
            raise click.UsageError(
                f"{option} asks the node's nodemgr: it has no meaning with "
                "--predict, which runs on a private simulated node"
            )


def size_option(name: str, help_text: str) -> Callable[[F], F]:
    """An option taking a size such as 8GiB, read by the ParamType nodemgr's commands use."""
    return click.option(name, type=SizeType(), default=None, help=help_text)


EPILOG = f"""\b
Examples:
  gpushare-run python train.py
  gpushare-run --gpus 2 -- torchrun --nproc-per-node 2 train.py
  gpushare-run --no-wait --cpu-fallback -- python evaluate.py
  {envvars.WAIT_TIMEOUT}=600 gpushare-run python train.py
  gpushare-run --persistent 6GiB --temporary 20GiB python train.py
  gpushare-run --predict --json -- python train.py

\b
Every option has an environment variable, used when the option is not given:
{textwrap.fill(envvars.run_help(), 72)}
A CUDA_VISIBLE_DEVICES already set restricts the GPUs nodemgr may grant.

\b
{EXIT_HELP}
"""


@click.command(
    context_settings={
        "help_option_names": ["-h", "--help"],
        "allow_interspersed_args": False,
    },
    epilog=EPILOG,
)
@click.version_option(__version__, prog_name="gpushare-run")
@click.option(
    "--gpus",
    type=CountType(1, MAX_GPUS_PER_REQUEST),
    default=None,
    help="How many GPUs the command needs [default: 1].",
)
@size_option(
    "--memory", "Memory per GPU the command expects, e.g. 8GiB (refused if above the quota)."
)
@size_option(
    "--persistent",
    "Time-sliced GPUs: the task's estimated persistent memory per GPU (model, "
    "optimizer state), so it can start beside others before its shape is measured.",
)
@size_option(
    "--temporary",
    "Time-sliced GPUs: its estimated temporary memory per iteration (with --persistent).",
)
@size_option(
    "--guard", "Time-sliced GPUs: space kept after its persistent memory [default: the node's]."
)
@click.option(
    "--class",
    "task_class",
    type=ClassType(),
    default=None,
    help="The task's class: ls (latency-sensitive) or be (best-effort), or the long forms "
    "[default: the environment's].",
)
@click.option(
    "--shape",
    type=click.Choice(cfg.SHAPES),
    default=None,
    help="What the request says of the command's memory: `quota` asks for the whole "
    "quota; `predicted` runs a dry run of it first (as --predict) and asks for its "
    "predicted peak, which nodemgr grants with a margin and tops up when the command needs "
    "more (docs/prediction.md#admission) [default: quota].",
)
@click.option(
    "--requeue/--no-requeue",
    default=None,
    help="When nodemgr requeues the task for a latency-sensitive one, wait for GPUs again "
    f"and run CMD again (the default), or exit {EXIT_PREEMPTED}.",
)
@click.option(
    "--compute",
    type=CountType(1, 100),
    default=None,
    metavar="PERCENT",
    help="The share of its GPUs' time the command may take, 1 to 100 (docs/compute.md) "
    "[default: none, or the environment's cap].",
)
@click.option(
    "--step-target",
    type=click.FloatRange(1.0, 3_600_000.0),
    default=None,
    metavar="MS",
    help="Latency-sensitive: milliseconds one iteration may take; nodemgr gives the task "
    "more of its GPUs, from best-effort tasks, when it would take longer (docs/compute.md).",
)
@click.option(
    "--deadline",
    type=SecondsType(1, MAX_WAIT),
    default=None,
    metavar="SECONDS",
    help="Latency-sensitive: the time the whole run may take (with --steps).",
)
@click.option(
    "--steps",
    type=CountType(1),
    default=None,
    metavar="N",
    help="The run's number of iterations, for --deadline.",
)
@click.option(
    "--wait/--no-wait",
    default=None,
    help="When no GPUs are free, wait in nodemgr's queue (the default), or fail at once.",
)
@click.option(
    "--wait-timeout",
    type=SecondsType(0, MAX_WAIT),
    default=None,
    metavar="SECONDS",
    help="Give up waiting after this long (exit 75) [default: no limit].",
)
@click.option(
    "--cpu-fallback",
    is_flag=True,
    default=None,
    help="Run CMD with no GPU instead of failing when the quota is zero or nothing is free.",
)
@click.option(
    "--grace",
    type=SecondsType(0, 3600),
    default=None,
    metavar="SECONDS",
    help="After passing on SIGINT/SIGTERM/SIGHUP, kill CMD's process group this much "
    f"later if it still runs [default: {cfg.DEFAULT_GRACE:g}].",
)
@click.option(
    "--endpoint",
    metavar="URL",
    default=None,
    help=f"The environment's nodemgr endpoint [default: ${envvars.ENDPOINT}].",
)
@click.option(
    "--status",
    "show_status",
    is_flag=True,
    help="Run nothing: show who holds the node's GPUs (by environment) and this "
    "environment's place in the queue.",
)
@click.option(
    "--predict",
    "predict_run",
    is_flag=True,
    help="Run CMD as a dry run on a private simulated GPU (no GPU, no grant, no quota) "
    "until it reports --iterations iteration boundaries or ends, then print the memory it "
    "will need (docs/prediction.md).",
)
@click.option(
    "--iterations",
    type=CountType(1, cfg.MAX_PREDICT_ITERATIONS),
    default=None,
    metavar="N",
    help=f"With --predict: the iterations to run [default: {cfg.DEFAULT_PREDICT_ITERATIONS}].",
)
@click.option(
    "--json", "as_json", is_flag=True, help="With --status or --predict: print it as JSON."
)
@click.argument("cmd", nargs=-1, type=click.UNPROCESSED)
def main(
    gpus: int | None,
    memory: int | None,
    persistent: int | None,
    temporary: int | None,
    guard: int | None,
    task_class: str | None,
    shape: str | None,
    requeue: bool | None,
    compute: int | None,
    step_target: float | None,
    deadline: float | None,
    steps: int | None,
    wait: bool | None,
    wait_timeout: float | None,
    cpu_fallback: bool | None,
    grace: float | None,
    endpoint: str | None,
    show_status: bool,
    predict_run: bool,
    iterations: int | None,
    as_json: bool,
    cmd: tuple[str, ...],
) -> None:
    """Run CMD on GPUs granted by nodemgr, within the environment's quota; with --status,
    show the node as this environment sees it."""
    if show_status and cmd:
        raise click.UsageError("--status runs no command: give either --status or CMD")
    if not show_status and not cmd:
        raise click.UsageError("Missing argument 'CMD...'.")
    if as_json and not (show_status or predict_run):
        raise click.UsageError("--json goes with --status or --predict")
    if iterations is not None and not predict_run and shape != "predicted":
        raise click.UsageError("--iterations goes with --predict or --shape predicted")
    if predict_run:
        if show_status:
            raise click.UsageError("--status runs no command: give either --status or --predict")
        _check_predict_options(click.get_current_context())
    try:
        s = cfg.from_environment()
    except cfg.SettingsError as e:
        say(str(e))
        sys.exit(EXIT_USAGE)
    s = s.but(
        memory=memory,
        persistent=persistent,
        temporary=temporary,
        guard=guard,
        compute=compute,
        step_target=None if step_target is None else step_target / 1000.0,
        deadline=deadline,
        steps=steps,
    )
    try:
        if endpoint is not None:
            endpoint = cfg.parse_endpoint("--endpoint", endpoint)
        cfg.check_shape(s)
        cfg.check_target(s)
    except cfg.SettingsError as e:
        say(str(e))
        sys.exit(EXIT_USAGE)
    if predict_run:
        s = s.but(gpus=gpus, grace=grace, predict_iterations=iterations)
        try:
            code = predict.run(list(cmd), s.gpus, s.predict_iterations, s.grace, as_json)
        except Exception as e:  # a bug: say it in one line, exit with the documented code
            say(f"internal error: {type(e).__name__}: {e}")
            code = EXIT_INTERNAL
        sys.exit(code)
    s = s.but(
        endpoint=endpoint,
        gpus=gpus,
        wait=wait,
        wait_timeout=wait_timeout,
        cpu_fallback=cpu_fallback,
        grace=grace,
        task_class=task_class,
        requeue=requeue,
        shape=shape,
        predict_iterations=iterations,
    )
    if not s.endpoint:
        say(
            f"no nodemgr endpoint: pass --endpoint or set {envvars.ENDPOINT} "
            "(nodemgr quota show ENV prints it)"
        )
        sys.exit(EXIT_USAGE)
    try:
        code = show(s.endpoint, as_json) if show_status else run(s, list(cmd))
    except Exception as e:  # a bug: say it in one line, exit with the documented code
        say(f"internal error: {type(e).__name__}: {e}")
        code = EXIT_INTERNAL
    sys.exit(code)
