"""Iteration boundaries: where each training step ends (docs/timeslicing.md#iteration-boundaries).

The shim classifies memory as persistent or temporary at each boundary, and
on a time-sliced GPU it says when the task must release its cached memory
and when its turn is over (docs/timeslicing.md). This module turns a
boundary into those actions:

- :func:`iteration_boundary` after each training step (the PyTorch and Keras
  hooks call it; so can any program), or ``with iteration(): step()``;
- the framework's cached memory is released through the release functions
  registered for it (PyTorch: synchronize, then ``empty_cache``);
- a finished turn is handed back to nodemgr with a ``yield`` request.

Nothing here may break a training loop: a failure to reach nodemgr is said
once on stderr and the step goes on (the task then keeps the GPU until nodemgr's
turn timeout passes the turn on).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from gpushare import shim
from gpushare.envvars import DRY_RUN as DRY_RUN_ENV
from gpushare.envvars import DRY_RUN_REPORT as DRY_RUN_REPORT_ENV
from gpushare.envvars import ENDPOINT as ENDPOINT_ENV
from gpushare.envvars import TASK_ID as TASK_ENV
from gpushare.envvars import TIMESLICED as TIMESLICED_ENV
from gpushare.envvars import hooks_wanted

# A yield is answered once the turn has passed, which waits for the task's other
# processes to reach the end of their turn too: allow for their longest step. nodemgr
# says at once when it holds a yield; with no word from it at all the wait is short.
YIELD_TIMEOUT = 120.0
YIELD_BACKOFF = 30.0  # seconds without yields after nodemgr did not answer one

_release: list[Callable[[], None]] = []
_lock = threading.Lock()  # one boundary at a time in a process
_conn: Any = None  # gpushare.client.Connection of this process, made on the first yield
_conn_pid = 0
_warned = False
_quiet_until = 0.0
# When the last boundary that did something did it (time.monotonic()), for those who
# measure turn switches: flags, release_start, release_end, yield_end (0: not done).
last: dict[str, float] = {}
# Frameworks imported in this process whose hooks could not be put in, and why.
unhooked: dict[str, str] = {}


def register_release(fn: Callable[[], None]) -> None:
    """Have ``fn`` called when the shim asks for the framework's cached memory back."""
    if fn not in _release:
        _release.append(fn)


# A dry run's operator profilers (gpushare.opprofile), one per framework that has one:
# each starts counting and returns what stops it and gives the profile (None: it cannot
# count this process's steps).
_profilers: list[Callable[[], Callable[[], dict[str, Any] | None] | None]] = []
_profiling: list[Callable[[], dict[str, Any] | None]] = []  # those counting now


def _dry_run_stop(value: str | None) -> int:
    """GPUSHARE_DRY_RUN: the iterations a dry run's process runs as on a shared GPU
    before its release (it waits to be stopped at the boundary after); 0 (not a dry run)
    when unset or not a positive whole number."""
    try:
        return max(0, int(value or "0"))
    except ValueError:
        return 0


# Read once: gpushare-run --predict sets them for its command's processes only.
_stop_at = _dry_run_stop(os.environ.get(DRY_RUN_ENV))
_dry_report = os.environ.get(DRY_RUN_REPORT_ENV) or None if _stop_at else None
_dry_released = False  # this process released its cache after its iterations
_dry_spent = 0.0  # seconds this process spent on the dry run's own work at its boundaries
_sim_functions: dict[str, Any] = {}  # the simulated driver's counter functions, once found
# How often a dry run's process that waits to be stopped looks for its report file: once
# gpushare-run has gone (the file with it), nobody will stop it, and it ends itself.
_HOLD_LOOK = 0.5


def _forked() -> None:
    """A fork child's slot is its own, its boundaries counted afresh (docs/timeslicing.md):
    it releases after its own iterations."""
    global _dry_released
    _dry_released = False


if _stop_at:
    os.register_at_fork(after_in_child=_forked)


def iteration_boundary() -> int:
    """One training step has ended. Returns the shim's flags (``shim.RELEASE``,
    ``shim.YIELD``; 0 outside a task), after acting on them."""
    entered = time.monotonic()
    flags = int(shim.iteration())
    if _stop_at:
        # A dry run's GPU is time-sliced, so that its task's shape is learned and shown;
        # alone there it is never gated, and it makes the release itself, later.
        flags &= ~shim.RELEASE
    if flags:
        _act(flags)
    if _stop_at:
        _dry_run_boundary(entered)
    return flags


def _dry_run_boundary(entered: float) -> None:
    """A dry run's process (gpushare-run --predict, docs/prediction.md) runs the iterations
    asked for as on a shared GPU, then releases the framework's cached memory (so that the
    one more iteration it runs shows what it allocates anew: its temporary memory, as a
    time-sliced GPU's release shows it), and at the end of that iteration waits until
    gpushare-run, having read its figures, stops it: nothing it would do next can change
    what was read."""
    global _dry_released, _dry_spent
    m = shim.memory()
    if m is None or m.iterations == 0:
        return  # no slot, or no boundary counted: nothing of this process to report
    with _lock:
        # The operator profile of the iteration after the release, which ends here.
        ops = [p for p in (stop() for stop in _profiling) if p is not None]
        _profiling.clear()
        # The host's clock without the dry run's own work at its boundaries (reading and
        # writing its figures, the release): a run outside a dry run does none of it.
        clock = entered - _dry_spent
    _report_boundary(m, ops[0] if ops else None, clock)
    with _lock:
        # At or past it: a count that moved by more than one (threads stepping at once)
        # still releases, once, and runs its iteration after the release.
        release = m.iterations >= _stop_at and not _dry_released
        if release:
            _dry_released = True
            _release_cache()
            # Counted in the iteration after the release alone: the iterations whose
            # host time and launches the dry run measures run without it (opprofile).
            for start in _profilers:
                with contextlib.suppress(Exception):
                    stop = start()
                    if stop is not None:
                        _profiling.append(stop)
        _dry_spent += time.monotonic() - entered
    if not release and m.iterations > _stop_at:
        _hold()


def _hold() -> None:
    """Wait to be stopped (SIGTERM, then SIGKILL); should the report file go (gpushare-run
    ended without stopping this process: killed, or the process left its group), end."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    while _dry_report is None or os.path.exists(_dry_report):
        time.sleep(_HOLD_LOOK)
    os._exit(0)


def _report_boundary(m: shim.Memory, ops: dict[str, Any] | None, clock: float) -> None:
    """A dry run's figures of this process at this boundary, before anything the boundary
    does: one JSON line appended to GPUSHARE_DRY_RUN_REPORT (one write, whole). ``ops``:
    the operator profile of the iteration that ends here, if one was counted; ``clock``:
    when the boundary was reached, in CLOCK_MONOTONIC seconds less the dry run's own work
    at the boundaries before."""
    if _dry_report is None:
        return
    c = shim.counters()
    line: dict[str, Any] = {
        "pid": os.getpid(),
        "iterations": m.iterations,
        "peak": c.peak if c else None,
        "launches": c.launches if c else None,
        "copies": _sim_counters("gpushareSimCopyCounters", 4),
        "kernels": _sim_counters("gpushareSimKernelCounters", 3),
        "t": clock,
    }
    if ops is not None:
        line["ops"] = ops
    import json

    try:
        fd = os.open(_dry_report, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        try:
            os.write(fd, (json.dumps(line) + "\n").encode())
        finally:
            os.close(fd)
    except OSError as e:
        _say_once(f"cannot write the dry run's report {_dry_report}: {e}")


def _sim_counters(name: str, n: int) -> list[int] | None:
    """The simulated driver's counters of this process (docs/simulator.md): ``n`` of
    those its function ``name`` gives (gpushareSimCopyCounters: bytes host to device,
    device to host, device to device, copies to the host; gpushareSimKernelCounters:
    launches, blocks, waves); None where the driver loaded is not the simulator (or none
    is)."""
    import ctypes

    fn = _sim_functions.get(name)
    if fn is None:
        try:
            # RTLD_NOLOAD: the driver the process has loaded, never a new one.
            fn = getattr(ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD), name)
        except (OSError, AttributeError):
            return None
        _sim_functions[name] = fn
    out = (ctypes.c_ulonglong * n)()
    if fn(out, ctypes.c_uint(n)) != 0:
        return None
    return [int(v) for v in out]


def _release_cache() -> None:
    """Release the framework's cached memory, then tell the shim (which settles the
    process's persistent bytes at what is left)."""
    for fn in _release:
        try:
            fn()
        except Exception as e:  # a framework in a state we cannot help
            _say_once(f"releasing cached GPU memory failed: {type(e).__name__}: {e}")
    shim.released()


def _act(flags: int) -> None:
    with _lock:
        now = time.monotonic()
        done = {"flags": float(flags), "release_start": now, "release_end": now, "yield_end": 0.0}
        if flags & shim.RELEASE:
            _release_cache()
            done["release_end"] = time.monotonic()
        if flags & shim.YIELD:
            _yield_turn()
            done["yield_end"] = time.monotonic()
        elif _conn is None or _conn_pid != os.getpid():
            # A release without a yield (the first boundary on a time-sliced GPU): connect
            # now, not in the first turn switch.
            _connection()
        last.update(done)


@contextlib.contextmanager
def iteration() -> Iterator[None]:
    """``with iteration(): train_step()``: a boundary when the block ends without error."""
    yield
    iteration_boundary()


def mark_persistent(dptr: int) -> None:
    """Count the allocation starting at device pointer ``dptr`` (as the driver returned
    it) as persistent from now on. Raises shim.ShimError if the shim knows none."""
    shim.mark_persistent(int(dptr))


def _connection() -> Any:
    """This process's connection to nodemgr (made on first use, and again after a fork:
    a child must not use its parent's ZeroMQ context); None without an endpoint."""
    global _conn, _conn_pid
    endpoint = os.environ.get(ENDPOINT_ENV)
    if not endpoint:
        return None
    if _conn is None or _conn_pid != os.getpid():
        from gpushare.client import Connection, Unreachable

        try:
            _conn = Connection(endpoint, timeout=YIELD_TIMEOUT)
        except Unreachable as e:
            _say_once(f"cannot reach nodemgr to hand turns back: {e}")
            return None
        _conn_pid = os.getpid()
    return _conn


def _yield_turn() -> None:
    global _conn, _quiet_until
    if time.monotonic() < _quiet_until:
        return  # nodemgr did not answer lately: a step must not wait for it every time
    task_id = os.environ.get(TASK_ENV)
    conn = _connection() if task_id else None
    if conn is None or not task_id:
        _say_once(
            f"the turn on a time-sliced GPU is over but {ENDPOINT_ENV} or {TASK_ENV} is "
            "not set, so nodemgr cannot be told; it passes the turn on after its timeout"
        )
        return
    from gpushare.client import FIRST_ANSWER, Unreachable
    from gpushare.errors import GpushareError
    from gpushare.messages import HeldReply, QueuedReply, Yield

    mem = shim.memory()
    held = False

    def on_held(_msg: QueuedReply | HeldReply) -> None:
        nonlocal held
        held = True

    try:
        # The process's own boundary count: nodemgr ignores a yield from an earlier turn.
        # nodemgr answers at once, `held` while the task's other processes finish their
        # turn, and with the turn once it has passed.
        conn.send(
            Yield(task_id=task_id, iterations=mem.iterations if mem else None),
            timeout=YIELD_TIMEOUT,
            on_queued=on_held,
            first_answer=FIRST_ANSWER,
        )
    except GpushareError as e:  # nodemgr refused, or did not answer
        if isinstance(e, Unreachable):
            _conn = None  # its socket may hold an unanswered request: start afresh
            if not held:
                # No nodemgr there: the next steps must not each wait for it.
                _quiet_until = time.monotonic() + YIELD_BACKOFF
        _say_once(f"could not hand the GPU's turn back to nodemgr: {e}")


def _say_once(message: str) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    with contextlib.suppress(OSError, ValueError, AttributeError):
        print(f"gpushare: {message}", file=sys.stderr, flush=True)


# --- frameworks ------------------------------------------------------------------


def framework_loaded(name: str, module: ModuleType) -> None:
    """Called by the auto-loader right after ``name`` was imported: put in its hooks.
    Only a process of a task gets them. A framework without the API they need (PyTorch
    before 2.0, say) gets none, silently: the task then shows no iterations, which
    ``nodemgr tasks`` says, and is charged all its memory as persistent."""
    if not os.environ.get(TASK_ENV) or not hooks_wanted(os.environ):
        return
    install = {"torch": install_torch, "keras": install_keras}.get(name)
    if install is None:
        return
    try:
        install(module)
    except Exception as e:
        unhooked[name] = f"{type(e).__name__}: {e}"
        return
    # Both cost tens of milliseconds once: here, not in the task's first turn switch. Only
    # the import: the connection itself is quick, and most processes that import a
    # framework (data loader workers, say) never reach a boundary.
    shim.prepare()
    if os.environ.get(TIMESLICED_ENV):
        import gpushare.client  # noqa: F401


def install_torch(torch: ModuleType) -> None:
    """A global optimizer step post-hook: every ``optimizer.step()`` ends an iteration, but
    one captured in a CUDA graph, which ends one at each replay of that graph instead."""
    optimizer = sys.modules.get("torch.optim.optimizer")
    if optimizer is None:
        import importlib

        optimizer = importlib.import_module("torch.optim.optimizer")
    if getattr(torch, "_gpushare_hooked", False):
        return
    optimizer.register_optimizer_step_post_hook(functools.partial(_torch_step, torch))
    register_release(functools.partial(_torch_release, torch))
    if _stop_at:
        _profilers.append(functools.partial(_torch_profile, torch))
    graphs = getattr(torch.cuda, "graphs", None)
    # PyTorch's global graph hooks (newer releases): without them a captured step ends
    # no iteration, at its capture or its replays.
    hooks = ("capture_start", "capture_end", "replay_end")
    if graphs is not None and all(hasattr(graphs, f"register_graph_{h}_hook") for h in hooks):
        graphs.register_graph_capture_start_hook(_graph_capture_start)
        graphs.register_graph_capture_end_hook(_graph_capture_end)
        graphs.register_graph_replay_end_hook(_graph_replayed)
    torch._gpushare_hooked = True  # type: ignore[attr-defined]


# The CUDA graph this thread is capturing (torch's capture start hook says which).
_capturing = threading.local()


def _torch_step(torch: Any, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
    if _capturing_now(torch):
        # Captured, not run: it ends an iteration each time the graph is replayed. Nothing
        # may synchronise inside a capture, so there is no boundary here either.
        graph = getattr(_capturing, "graph", None)
        if graph is not None:
            with contextlib.suppress(AttributeError, TypeError):
                graph._gpushare_steps = getattr(graph, "_gpushare_steps", 0) + 1
        return
    iteration_boundary()


def _capturing_now(torch: Any) -> bool:
    """Whether this thread's current CUDA stream is capturing a graph (without starting
    CUDA in a process that has not)."""
    capturing = getattr(torch.cuda, "is_current_stream_capturing", None)
    try:
        return bool(torch.cuda.is_initialized() and capturing is not None and capturing())
    except Exception:  # a CUDA error of the program's own: its next call will say it
        return False


def _graph_capture_start(graph: Any) -> None:
    _capturing.graph = graph


def _graph_capture_end(_graph: Any) -> None:
    _capturing.graph = None


def _graph_replayed(graph: Any) -> None:
    # Once per optimizer step captured in it (most graphs have none). The replay is only
    # enqueued: a release synchronises first.
    for _ in range(getattr(graph, "_gpushare_steps", 0)):
        iteration_boundary()


def _torch_profile(torch: Any) -> Callable[[], dict[str, Any] | None] | None:
    from gpushare import opprofile

    if opprofile.compiled(torch):
        return None
    return functools.partial(opprofile.stop, opprofile.start(torch))


def _torch_release(torch: Any) -> None:
    # Unfinished kernels still use the blocks; and the next task's turn starts only once
    # this one's work is done, on every GPU the process holds memory on, not only the
    # current one. A GPU it never used is left alone: synchronising would make a context.
    if not torch.cuda.is_initialized():
        return
    current = torch.cuda.current_device()
    for device in range(torch.cuda.device_count()):
        if device == current or torch.cuda.memory_reserved(device) > 0:
            torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


# Model.fit(x, y, batch_size, epochs, verbose, callbacks, ...): callbacks' position.
_FIT_CALLBACKS_ARG = 5


def install_keras(keras: ModuleType) -> None:
    """A callback ending an iteration after each training batch, added to every fit."""
    model = keras.Model
    if getattr(model.fit, "_gpushare", False):
        return

    class GpushareIterations(keras.callbacks.Callback):  # type: ignore[misc,name-defined]
        """Reports an iteration boundary to gpushare after each training batch."""

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            iteration_boundary()

    fit = model.fit

    callback_list = getattr(keras.callbacks, "CallbackList", None)

    def with_ours(given: Any) -> Any:
        """The callbacks fit is given, with ours added once."""
        if callback_list is not None and isinstance(given, callback_list):
            # A CallbackList the caller built is used as it is (fit adds nothing to it):
            # ours goes into it, if it is not there yet.
            if not any(isinstance(c, GpushareIterations) for c in given.callbacks):
                given.append(GpushareIterations())
            return given
        callbacks = list(given or [])
        if not any(isinstance(c, GpushareIterations) for c in callbacks):
            callbacks.append(GpushareIterations())
        return callbacks

    @functools.wraps(fit)
    def fit_with_boundaries(self: Any, *args: Any, **kwargs: Any) -> Any:
        positional = len(args) > _FIT_CALLBACKS_ARG
        try:
            given = args[_FIT_CALLBACKS_ARG] if positional else kwargs.get("callbacks")
            callbacks = with_ours(given)
        except Exception as e:  # a callbacks argument of a kind we do not know
            unhooked["keras.fit"] = f"{type(e).__name__}: {e}"
            return fit(self, *args, **kwargs)
        if positional:
            args = (*args[:_FIT_CALLBACKS_ARG], callbacks, *args[_FIT_CALLBACKS_ARG + 1 :])
        else:
            kwargs["callbacks"] = callbacks
        return fit(self, *args, **kwargs)

    fit_with_boundaries._gpushare = True  # type: ignore[attr-defined]
    model.fit = fit_with_boundaries
