"""``gpushare-run``: run one command under a GPU grant from nodemgr.

Requests the grant, starts the command with the shim preloaded and
CUDA_VISIBLE_DEVICES set to the granted GPUs, heartbeats while it runs,
reports its exit status and exits with the command's exit code.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import types
from typing import Any

import click

from client_plugin import libs
from nodemgr.client import Connection, NodeError, Unreachable
from nodemgr.protocol import MAX_WAIT, Err
from nodemgr.sizes import parse_size

ENDPOINT_ENV = "GPUSHARE_ENDPOINT"
MAX_COMMAND = 4096  # what nodemgr keeps of a command line, for display

EXIT_USAGE = 2
EXIT_UNREACHABLE = 69
EXIT_NO_RESOURCES = 75
EXIT_REFUSED = 77
EXIT_INTERNAL = 125
EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127

_PR_SET_PDEATHSIG = 1


def _say(message: str) -> None:
    print(f"gpushare-run: {message}", file=sys.stderr, flush=True)


def _prepare_child(parent: int, sigint: signal.Handlers) -> None:
    """In the child before exec: die if gpushare-run dies, so no orphan keeps GPU memory,
    and take back the SIGINT disposition gpushare-run was started with."""
    signal.signal(signal.SIGINT, sigint)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(EXIT_INTERNAL)


def child_environment(grant: dict[str, Any], base: dict[str, str]) -> dict[str, str]:
    """The command's environment: the grant's GPUs, the shim, and the driver to use."""
    env = dict(base)
    preload = [str(libs.shim_path())]
    if env.get("LD_PRELOAD"):
        preload.append(env["LD_PRELOAD"])
    env["LD_PRELOAD"] = " ".join(preload)
    env["CUDA_VISIBLE_DEVICES"] = ",".join(g["uuid"] for g in grant["gpus"])
    env["GPUSHARE_LEDGER"] = grant["ledger"]
    env["GPUSHARE_TASK_ID"] = grant["task_id"]
    if grant.get("simulated"):
        paths = [str(libs.sim_driver_dir())]
        if env.get("LD_LIBRARY_PATH"):
            paths.append(env["LD_LIBRARY_PATH"])
        env["LD_LIBRARY_PATH"] = ":".join(paths)
        env["GPUSHARE_SIM_GPUS"] = grant["sim_gpus"]
    return env


def exit_code(returncode: int) -> int:
    """A shell's view of a child's status: 128+N for death by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def _queued(update: dict[str, Any]) -> None:
    _say(f"waiting for GPUs: position {update.get('position')} of {update.get('waiting')}")


def request_grant(
    endpoint: str, gpus: int, memory: int | None, command: str, wait: float = 0.0
) -> dict[str, Any]:
    try:
        with Connection(endpoint, timeout=10.0) as conn:
            return conn.call(
                "request",
                timeout=10.0 + wait,
                on_queued=_queued,
                gpus=gpus,
                memory=memory,
                command=command,
                wait=wait or None,
            )
    except Unreachable as e:
        _say(
            f"cannot reach nodemgr: {e} (is nodemgr running, and is this the "
            f"environment's endpoint? nodemgr quota show ENV prints it)"
        )
        sys.exit(EXIT_UNREACHABLE)
    except NodeError as e:
        _say(f"request refused ({e.code}): {e.message}")
        sys.exit(EXIT_NO_RESOURCES if e.code == Err.NO_RESOURCES else EXIT_REFUSED)


class Heartbeat:
    """Keeps nodemgr told that the task lives; warns once when it stops answering."""

    def __init__(self, endpoint: str, task_id: str, interval: float) -> None:
        self.task_id = task_id
        self.interval = interval
        self.conn = Connection(endpoint, timeout=max(interval, 0.5))
        self.warned = False

    def beat(self) -> None:
        try:
            self.conn.call("heartbeat", task_id=self.task_id)
            if self.warned:
                _say("nodemgr answers again")
                self.warned = False
        except (Unreachable, NodeError) as e:
            if not self.warned:
                _say(f"heartbeat failed, the task keeps running: {e}")
                self.warned = True

    def done(self, code: int, signum: int | None = None) -> None:
        try:
            report_done(self.conn, self.task_id, code, signum)
        finally:
            self.conn.close()


def report_done(conn: Connection, task_id: str, code: int, signum: int | None = None) -> None:
    try:
        conn.call("done", task_id=task_id, exit_code=code, signal=signum)
    except (Unreachable, NodeError) as e:
        _say(f"could not report the end of the task (nodemgr reclaims it anyway): {e}")


def fail_before_start(endpoint: str, task_id: str, message: str, code: int) -> int:
    _say(message)
    with Connection(endpoint, timeout=5.0) as conn:
        report_done(conn, task_id, code)
    return code


def run(endpoint: str, gpus: int, memory: int | None, cmd: list[str], wait: float = 0.0) -> int:
    grant = request_grant(endpoint, gpus, memory, " ".join(cmd)[:MAX_COMMAND], wait)
    task_id = grant["task_id"]
    try:
        env = child_environment(grant, dict(os.environ))
    except FileNotFoundError as e:
        return fail_before_start(endpoint, task_id, str(e), EXIT_INTERNAL)
    # Handlers go in before the command starts, so a signal that arrives
    # while it starts is held and passed on rather than killing gpushare-run.
    child: subprocess.Popen[bytes] | None = None
    pending: list[int] = []

    def forward(signum: int, _frame: types.FrameType | None) -> None:
        if child is None:
            pending.append(signum)
        else:
            child.send_signal(signum)

    # Ctrl-C reaches the command straight from the terminal (same process
    # group); forwarding it too would interrupt the command's own clean-up.
    sigint = signal.getsignal(signal.SIGINT)
    child_sigint = signal.SIG_IGN if sigint == signal.SIG_IGN else signal.SIG_DFL
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, forward)
    parent = os.getpid()
    # No ZeroMQ context exists at this point (the request's was closed), so
    # the command is forked from a process without ZeroMQ's I/O threads.
    try:
        child = subprocess.Popen(
            cmd, env=env, preexec_fn=lambda: _prepare_child(parent, child_sigint)
        )
    except FileNotFoundError:
        return fail_before_start(endpoint, task_id, f"command not found: {cmd[0]}", EXIT_NOT_FOUND)
    except OSError as e:
        return fail_before_start(
            endpoint, task_id, f"cannot execute {cmd[0]}: {e.strerror}", EXIT_NOT_EXECUTABLE
        )
    hb = Heartbeat(endpoint, task_id, float(grant["heartbeat_interval"]))
    for signum in pending:
        child.send_signal(signum)
    while True:
        try:
            returncode = child.wait(timeout=hb.interval)
            break
        except subprocess.TimeoutExpired:
            hb.beat()
    code = exit_code(returncode)
    hb.done(code, -returncode if returncode < 0 else None)
    return code


@click.command(
    context_settings={
        "help_option_names": ["-h", "--help"],
        "ignore_unknown_options": True,
        "allow_interspersed_args": False,
    }
)
@click.option(
    "--gpus",
    type=click.IntRange(1, 64),
    default=1,
    show_default=True,
    help="How many GPUs the command needs.",
)
@click.option(
    "--memory",
    default=None,
    metavar="SIZE",
    help="Memory per GPU the command expects (refused if above the quota).",
)
@click.option(
    "--wait",
    type=click.FloatRange(0, MAX_WAIT),
    default=0,
    envvar="GPUSHARE_WAIT",
    metavar="SECONDS",
    help="When no GPUs are free, wait up to this long in nodemgr's queue (default: "
    "$GPUSHARE_WAIT, else 0: fail at once with exit code 75).",
)
@click.option(
    "--endpoint",
    envvar=ENDPOINT_ENV,
    metavar="URL",
    help=f"The environment's nodemgr endpoint (default: ${ENDPOINT_ENV}).",
)
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
def main(
    gpus: int, memory: str | None, wait: float, endpoint: str | None, cmd: tuple[str, ...]
) -> None:
    """Run CMD on GPUs granted by nodemgr, within the environment's quota.

    \b
    Examples:
      gpushare-run python train.py
      gpushare-run --gpus 2 -- torchrun --nproc-per-node 2 train.py

    \b
    Exit codes: CMD's own (128+N if killed by signal N); 2 bad usage;
    69 nodemgr unreachable; 75 no GPUs free now (or within --wait); 77 request refused (zero or
    exceeded quota, unknown environment); 125 gpushare-run failed;
    126 CMD not executable; 127 CMD not found.
    """
    if not endpoint:
        _say(
            f"no nodemgr endpoint: pass --endpoint or set {ENDPOINT_ENV} "
            "(nodemgr quota show ENV prints it)"
        )
        sys.exit(EXIT_USAGE)
    mem: int | None = None
    if memory is not None:
        try:
            mem = parse_size(memory)
        except ValueError as e:
            _say(f"--memory: {e}")
            sys.exit(EXIT_USAGE)
    sys.exit(run(endpoint, gpus, mem, list(cmd), wait))
