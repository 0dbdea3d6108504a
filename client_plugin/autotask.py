"""What the auto-loader does when a framework is first imported (docs/client.md#auto-load-python).

Request the grant (waiting as the settings allow, progress on stderr); on a
zero quota let the framework see no GPU (or fail, if so configured); else set
CUDA_VISIBLE_DEVICES, put the shim to work on the environment's ledger, and
keep the task alive with heartbeats until the process exits, when it says done.
A crash or ``kill -9`` is nodemgr's to notice: it watches the process.

The shim must be in the process before the framework uses CUDA. Preloaded
(inert) at start, it is attached to the ledger in place; otherwise the
interpreter is restarted with it (same pid, so the grant stays), with the
original command line, working directory and open files.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import sys
import threading
import types
from collections.abc import Callable

from client_plugin import settings as cfg
from client_plugin.grant import (
    Grant,
    Heartbeat,
    Progress,
    acquire,
    cancelled,
    reclaimed_exit,
    release,
    task_environment,
)
from gpushare import envvars, libs
from gpushare.client import NodeError, NoResources, QuotaZero, Unreachable
from gpushare.envvars import AUTOLOAD_HOLDER as HOLDER_ENV
from gpushare.errors import GpushareError as GpushareError  # what start() raises
from gpushare.exitcodes import EXIT_CANCELLED

_task: Task | None = None


def _say(message: str) -> None:
    with contextlib.suppress(OSError, ValueError, AttributeError):
        print(f"gpushare: {message}", file=sys.stderr, flush=True)


class Task:
    """The task this process holds: heartbeats on a thread, done at exit."""

    def __init__(
        self, endpoint: str, task_id: str, interval: float, beat_first: bool = False
    ) -> None:
        self.pid = os.getpid()
        # Beat at once, not an interval from now: the task has been silent since before
        # this interpreter started (a restart), and the timeout does not wait for startup.
        self.beat_first = beat_first
        self.hb = Heartbeat(endpoint, task_id, interval, _say)
        self.lock = threading.Lock()  # one ZeroMQ socket, used by two threads
        self.stopped = threading.Event()
        self.failed = False
        previous: Callable[..., None] = sys.excepthook

        def excepthook(
            kind: type[BaseException],
            value: BaseException,
            tb: types.TracebackType | None,
        ) -> None:
            self.failed = True
            previous(kind, value, tb)

        sys.excepthook = excepthook
        os.register_at_fork(after_in_child=self._forked)
        atexit.register(self.end)
        threading.Thread(target=self._beat, name="gpushare-heartbeat", daemon=True).start()

    def _beat(self) -> None:
        wait = 0.0 if self.beat_first else self.hb.interval
        while not self.stopped.wait(wait):
            wait = self.hb.interval
            with self.lock:
                if not self.stopped.is_set():
                    self.hb.beat()
                    if self.hb.reclaimed is not None and os.getpid() == self.pid:
                        # Its GPUs are gone: this process is the task, and ends now
                        # (its CUDA work cannot go on), with the reason's exit code.
                        line, code = reclaimed_exit(self.hb.reclaimed)
                        _say(line)
                        os._exit(code)

    def _forked(self) -> None:
        # A forked child (a DataLoader worker) shares the grant; the parent reports.
        self.pid = -1

    def end(self) -> None:
        if os.getpid() != self.pid or self.stopped.is_set():
            return
        self.stopped.set()
        with self.lock:
            # The exit status is not known here; an uncaught exception means 1.
            self.hb.done(1 if self.failed else None)


def _no_gpu(message: str) -> None:
    """Go on without a GPU: the framework sees none, and this process's children ask
    for none either."""
    _say(message)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ[envvars.TASK_OWNER] = str(os.getpid())


def _command() -> str:
    return " ".join(getattr(sys, "orig_argv", sys.argv))


def start(module: str, cwd: str | None, started: int) -> None:
    """The first import of ``module`` (a framework) is under way: get its GPUs.
    ``cwd`` and ``started`` are the directory and pid the interpreter started with."""
    try:
        s = cfg.from_environment()
    except cfg.SettingsError as e:
        raise GpushareError(f"gpushare: {e}") from None
    if s.devices == ():
        return  # CUDA_VISIBLE_DEVICES="": the user wants no GPU here
    if not s.endpoint:
        _no_gpu(
            f"{envvars.AUTOLOAD} is on but {envvars.ENDPOINT} is not set, so {module} runs "
            f"without a GPU (set it to the environment's endpoint, or {envvars.AUTOLOAD}=0)"
        )
        return
    progress = Progress("gpushare", s.gpus, interval=s.progress_interval)
    try:
        grant = acquire(s, _command(), progress)
    except KeyboardInterrupt:
        # Interrupted inside an import: a traceback through the import system would bury
        # the one thing to say. A script ends as gpushare-run's wait does (130); an
        # interactive session keeps going, without the framework.
        _say(f"{cancelled(s.endpoint, progress)}; {module} was not imported")
        if sys.flags.interactive or hasattr(sys, "ps1"):
            raise KeyboardInterrupt from None
        raise SystemExit(EXIT_CANCELLED) from None
    except QuotaZero as e:
        if s.zero_quota == "error":
            raise GpushareError(
                f"gpushare: {e.message}; {envvars.ZERO_QUOTA}=error makes that an error "
                f"({envvars.ZERO_QUOTA}=warn runs {module} on the CPU)"
            ) from None
        _no_gpu(f"this environment's GPU quota is 0: {module} runs without a GPU")
        return
    except NoResources as e:
        if s.cpu_fallback:
            _no_gpu(f"no GPU free ({e.message}): {module} runs without a GPU")
            return
        fix = (
            f"{envvars.WAIT}=1 waits for one"
            if not s.wait
            else f"a longer {envvars.WAIT_TIMEOUT} waits longer"
        )
        raise GpushareError(
            f"gpushare: no GPU for {module}: {e.message} ({fix}; {envvars.CPU_FALLBACK}=1 "
            "runs without a GPU)"
        ) from None
    except Unreachable as e:
        raise GpushareError(
            f"gpushare: cannot reach nodemgr: {e} (is nodemgr running, and is "
            f"{envvars.ENDPOINT} the environment's endpoint? {envvars.AUTOLOAD}=0 turns "
            "auto-load off)"
        ) from None
    except NodeError as e:
        raise GpushareError(f"gpushare: request refused ({e.code}): {e.message}") from None
    _enter(s.endpoint, grant, cwd, started)


def _enter(endpoint: str, grant: Grant, cwd: str | None, started: int) -> None:
    from gpushare import shim

    global _task
    pid = os.getpid()
    too_late = False
    if shim.loaded():
        saved = dict(os.environ)
        try:
            os.environ.update(task_environment(grant, os.environ, pid, preload=False))
            if grant.simulated:
                # The loader read LD_LIBRARY_PATH at start; loading the simulated
                # driver by path makes a later dlopen by soname find it.
                sim = libs.sim_driver_dir()
                for lib in ("libcuda.so.1", "libnvidia-ml.so.1"):
                    ctypes.CDLL(str(sim / lib), mode=ctypes.RTLD_GLOBAL)
            shim.attach(grant.ledger, grant.task_id)
        except (shim.ShimError, OSError) as e:
            # The process goes on unenforced, or restarts from its own environment:
            # nothing of a grant it does not hold here may reach its children.
            os.environ.clear()
            os.environ.update(saved)
            if not isinstance(e, shim.ShimTooLate):
                release(endpoint, grant.task_id)
                raise GpushareError(f"gpushare: {e}") from None
            too_late = True  # CUDA was used before the grant: only a restart charges it all
        else:
            os.environ[HOLDER_ENV] = f"{pid},{grant.heartbeat_interval}"
            _task = Task(endpoint, grant.task_id, grant.heartbeat_interval)
            return
    _restart(endpoint, grant, cwd, started, too_late)


def _restartable(started: int) -> bool:
    """Can this process run again from the start? Not a forked child (it would run its
    parent's program), not an interactive session, not a script read from stdin."""
    interactive = sys.flags.interactive or "IPython" in sys.modules or "ipykernel" in sys.modules
    argv = getattr(sys, "orig_argv", None)
    return (
        bool(argv) and os.getpid() == started and not interactive and sys.argv[0] not in ("", "-")
    )


def _restart(
    endpoint: str, grant: Grant, cwd: str | None, started: int, too_late: bool = False
) -> None:
    """Run this interpreter again from the start, with the shim preloaded (``too_late``:
    it is, but the process used CUDA before the grant)."""
    pid = os.getpid()
    argv = getattr(sys, "orig_argv", [])
    if not _restartable(started):
        release(endpoint, grant.task_id)
        no_restart = (
            "an interactive session, a script read from stdin or a forked process cannot be "
            "restarted with it"
        )
        if too_late:
            raise GpushareError(
                "gpushare: this process used CUDA before the framework's import asked for "
                f"its GPUs, so the shim cannot enforce the grant here, and {no_restart}: "
                "import the framework before anything uses CUDA, or run under gpushare-run"
            )
        raise GpushareError(
            f"gpushare: the shim is not loaded in this process, and {no_restart}: "
            "preload it (LD_PRELOAD=$(python -c 'import gpushare.libs as l; "
            "print(l.shim_path())')) or run under gpushare-run"
        )
    try:
        env = task_environment(grant, os.environ, pid, preload=True)
    except FileNotFoundError as e:
        release(endpoint, grant.task_id)
        raise GpushareError(f"gpushare: {e}") from None
    env[HOLDER_ENV] = f"{pid},{grant.heartbeat_interval}"
    env[envvars.ENDPOINT] = endpoint
    with contextlib.suppress(OSError):
        if cwd is not None:
            os.chdir(cwd)
    # Output still buffered is dropped, not written: the restarted run writes it again.
    try:
        os.execve(sys.executable, argv, env)
    except OSError as e:
        release(endpoint, grant.task_id)
        raise GpushareError(f"gpushare: cannot restart {sys.executable}: {e}") from None


def resume() -> None:
    """In the restarted interpreter (or a Python program the holder exec'd), before any
    user code: keep the task alive."""
    global _task
    # Kept in the environment: a program this process execs holds the same task.
    raw = os.environ.get(HOLDER_ENV, "")
    try:
        interval = float(raw.split(",")[1])
        endpoint = os.environ[envvars.ENDPOINT]
        task_id = os.environ[envvars.TASK_ID]
    except (IndexError, ValueError, KeyError):
        _say(f"ignoring a malformed {HOLDER_ENV}={raw!r}")
        return
    _task = Task(endpoint, task_id, interval, beat_first=True)
