"""nodemgr's event loop: its sockets, process-exit descriptors and timers, on one epoll.

One socket per environment (its path tells nodemgr which environment a request comes
from; the client's word is never asked) and one admin socket only the operator can reach.
Clients speak ZeroMQ (DEALER sockets); nodemgr accepts and reads the connections itself
(transport.py), so that each is counted and capped and each message bounded as it arrives.
The kernel names each connection's client process (SO_PEERCRED); a pidfd per task wakes
the loop the moment that process ends.

This module is the loop: set-up, the sweep, the pidfds it watches, the wait queue's
answers, shutdown. The listeners and connections are nodemgr.loop.connections', the
task endpoint's requests nodemgr.endpoints.task', the admin endpoint's
nodemgr.endpoints.admin's, reclaiming nodemgr.loop.reclaim's.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import resource
import select
import signal
import sqlite3
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpushare import __version__, messages, paths, protocol
from gpushare.exitcodes import EXIT_SOFTWARE
from gpushare.messages import (
    AdminRequest,
    ErrorReply,
    GrantReply,
    Message,
    QueuedReply,
    R,
    TurnReply,
)
from gpushare.paths import socket_path_problem
from gpushare.protocol import Err, ProtocolError
from nodemgr.config import Config, ConfigError
from nodemgr.endpoints import admin
from nodemgr.endpoints import task as task_endpoint
from nodemgr.host import envdirs, gpulock
from nodemgr.host.audit import Auditor, AuditState
from nodemgr.host.backend import BackendError, choose
from nodemgr.host.ctxprobe import charges
from nodemgr.host.envdirs import RestoreError
from nodemgr.host.gpus import Gpu
from nodemgr.host.procfs import process_start
from nodemgr.host.utilization import Sampler, Utilization
from nodemgr.loop.connections import (
    Connections,
    Listener,
    Polled,
    ReplyTo,
    Watched,
    describe,
    party_of,
    task_cap,
)
from nodemgr.loop.reclaim import Reclaims
from nodemgr.loop.sdnotify import Notifier
from nodemgr.loop.transport import Conn
from nodemgr.node import recovery
from nodemgr.node.model import Env, Task
from nodemgr.node.node import Node
from nodemgr.node.store import Store, StoreError, cause, startup_error
from nodemgr.policy.ratelimit import ENV_LOG_INTERVAL, LogThrottle, TokenBuckets, log_throttled
from nodemgr.report import views
from nodemgr.report.metrics import Metrics, MetricsError

log = logging.getLogger("nodemgr")

# Turns of the loop that may fail in a row before nodemgr stops (serve_forever): a failure
# that repeats at every turn serves nothing, and a restart starts from the database.
MAX_FAILED_TURNS = 100


class StartupError(Exception):
    pass


def _lock(path: Path, what: str) -> int:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as e:  # a read-only or full disk, a directory in the way
        raise StartupError(f"cannot open {path} in {what}: {e.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EAGAIN, errno.EACCES):
            raise StartupError(f"another nodemgr is already running with {what}") from None
        raise
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def _raise_nofile() -> int:
    """Raise the soft descriptor limit to the hard one; return the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


class Server:
    def __init__(self, config: Config, forget_unknown: bool = False) -> None:
        """``forget_unknown``: `nodemgr serve --forget-unknown-envs` (recovery.restore)."""
        self.config = config
        self.forget_unknown = forget_unknown
        # First: it takes NOTIFY_SOCKET out of the environment before any child starts.
        self.systemd = Notifier()
        # The GPUs and how NVML is asked of them, once: whatever asks the GPUs is handed it.
        self.backend = choose(config)
        gpus, simulated = self.backend.gpus, self.backend.simulated
        self._lock_fds: list[int] = []
        try:
            config.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as e:
            raise StartupError(
                f"cannot create state directory {config.state_dir}: {e.strerror}"
            ) from None
        self._lock_fds.append(
            _lock(config.state_dir / "nodemgr.lock", f"state directory {config.state_dir}")
        )
        try:
            store = Store(config.database)
        except StoreError as e:
            self._unlock()
            raise StartupError(str(e)) from None
        try:
            self._claim_gpus(gpus, simulated)
        except StartupError:
            store.close()
            self._unlock()
            raise
        # Measured (gpus.context_memory = "auto") once the GPUs are this nodemgr's and
        # before anything is served: the probe is no task's, and must be gone before the
        # first bypass audit.
        contexts = charges(config, self.backend)
        try:
            self.node = Node(config, gpus, simulated, store, contexts)
        except (ConfigError, sqlite3.Error) as e:
            store.close()
            self._unlock()
            if isinstance(e, sqlite3.Error):
                raise StartupError(str(startup_error(config.database, e))) from None
            raise StartupError(str(e)) from None
        try:
            self.node.describe(self.backend.describe())
        except BackendError as e:
            log.warning(
                "NVML does not describe the GPUs (step time estimates take defaults): %s", e
            )
        self.nofile = _raise_nofile()
        self.node.max_tasks_per_env = task_cap(config.tasks_per_env, self.nofile)
        self.epoll = select.epoll()
        # Everything the loop polls, by descriptor: listeners, connections, pidfds.
        self.fds: dict[int, Polled] = {}
        self.connections = Connections(config, self.epoll, self.fds, self.node.envs, self.nofile)
        self.pidfds: dict[int, Watched] = {}
        self.watched: dict[Watched, int] = {}
        self._stop = False
        # The read end of the pipe a signal's arrival is written to (serve_forever), polled
        # so that SIGTERM ends the wait at once, however long the sweep interval.
        self._wakeup = -1
        self._next_sweep = 0.0
        # Environments of the tasks released since the last sweep (release()).
        self._released: set[str] = set()
        self._next_health = 0.0
        self.metrics: Metrics | None = None
        # The bypass audit's findings and NVML's last utilisation sample, which the replies
        # and the metrics show.
        self.audit = AuditState()
        self.utilization = Utilization()
        self.auditor = Auditor(self.node, self.backend, self.audit)
        self.sampler = Sampler(self.node, self.backend, self.utilization)
        # Environments whose socket could not be bound again (_check_run_dir).
        self._unbindable: set[str] = set()
        self.reclaims = Reclaims(self)
        # What failed at its last try (_safely): logged once until it succeeds again.
        self._failing: set[str] = set()
        # Lines about an environment its user can provoke in a loop (_check_run_dir).
        self._env_log = LogThrottle(ENV_LOG_INTERVAL)
        # Each environment's `view` requests (nodemgr.endpoints.task).
        self.views = TokenBuckets(config.views_per_second, config.view_burst)
        # Each user's requests on view.sock (_dispatch), keyed by party().
        self.reader_requests = TokenBuckets(config.reader_requests_per_second, config.reader_burst)

    def _unlock(self) -> None:
        for fd in self._lock_fds:
            os.close(fd)
        self._lock_fds.clear()

    # --- set-up --------------------------------------------------------------

    def start(self) -> None:
        run = self.config.run_dir
        try:
            run.mkdir(parents=True, exist_ok=True, mode=0o711)
            (run / paths.ENVS_DIR).mkdir(exist_ok=True, mode=0o711)
        except OSError as e:
            raise StartupError(
                f"cannot create run directory {run}: {e.strerror} (node.run_dir names it)"
            ) from None
        self._lock_fds.append(_lock(run / "nodemgr.lock", f"run directory {run}"))
        if self.node.simulated:
            self._simulated_table()
        try:
            self._open(run)
        except StartupError:
            # Sockets left behind would read as a nodemgr that was killed ("left by ..."):
            # removed, as at a clean stop, so that commands say it is not running.
            self.connections.remove_sockets()
            raise
        log.info(
            "nodemgr %s serving %d %s GPUs; admin endpoint %s; up to %d connections, "
            "%d running tasks per environment (descriptor limit %d)",
            __version__,
            len(self.node.gpus),
            self.backend.kind,
            self.config.admin_endpoint,
            self.connections.limit(),
            self.node.max_tasks_per_env,
            self.nofile,
        )
        # Every socket is bound and every environment restored: clients may come.
        self.systemd.notify(
            "READY=1", f"STATUS=serving {len(self.node.gpus)} {self.backend.kind} GPUs"
        )

    def _open(self, run: Path) -> None:
        """Serve the admin sockets, restore quotas and tasks, serve each environment's
        socket and the metrics; raise StartupError."""
        for name in (paths.ADMIN_SOCKET, paths.VIEW_SOCKET):
            problem = socket_path_problem(
                run / name, "the admin socket", "give the node a shorter node.run_dir"
            )
            if problem is not None:
                raise StartupError(problem)
        try:
            self.connections.bind_admin()
            self.connections.bind_readers()
        except OSError as e:
            raise StartupError(f"cannot create the admin sockets in {run}: {describe(e)}") from None
        try:
            restored = recovery.restore(self.node, self.forget_unknown)
        except sqlite3.Error as e:
            raise StartupError(str(startup_error(self.config.database, e))) from None
        except RestoreError as e:
            raise StartupError(str(e)) from None
        for task in restored:
            self._adopt(task)
        for env in self.node.envs.values():
            with contextlib.suppress(ProtocolError):  # refused: said in the log
                self.connections.open_env(env)
        if self.config.metrics_port:
            self.metrics = Metrics(self.config, self.node, self.audit, self.utilization)
            try:
                self.metrics.start()
            except MetricsError as e:
                raise StartupError(str(e)) from None
            self.node.slicing.on_switch = self.metrics.switched
            self.node.on_predicted_end = self.metrics.predicted_ended
            self.connections.on_refused = self.metrics.refused

    def _hold_gpus(self, gpus: list[Gpu], directory: Path, fix: str) -> None:
        """Take the node's GPUs from any other nodemgr (nodemgr.host.gpulock), or refuse to
        start."""
        try:
            self._lock_fds += gpulock.hold(gpus, directory, self.config.run_dir, fix)
        except gpulock.GpuHeld as e:
            raise StartupError(str(e)) from None

    def _claim_gpus(self, gpus: list[Gpu], simulated: bool) -> None:
        """Hold the node's GPUs: real ones by their locks in a node-wide directory,
        simulated ones by their locks in their directory (docs/simulator.md, "nodemgr's
        simulated GPUs"), made here searchable by every user."""
        if not simulated:
            self._hold_gpus(
                gpus, gpulock.nvml_lock_dir(), "stop that nodemgr first: one nodemgr serves a GPU"
            )
            return
        path = self.config.sim_state_dir
        try:
            path.mkdir(parents=True, exist_ok=True, mode=0o711)
        except OSError as e:
            raise StartupError(
                f"cannot create the simulated GPUs' directory {path} "
                f"(gpus.simulated_state_dir): {e.strerror}"
            ) from None
        self._hold_gpus(
            gpus,
            path,
            "stop that nodemgr first, or give this one a gpus.simulated_state_dir of its own",
        )

    def _simulated_table(self) -> None:
        """Make the simulated GPUs' process table through nodemgr's own simulated NVML, so
        that the table is nodemgr's and every user's processes record there. Without the
        audit and utilisation sampling nodemgr never reads NVML: the first process to use a
        GPU makes the table (as it does when that NVML cannot be loaded, which is logged)."""
        if self.config.audit_interval > 0 or self.config.utilization_interval > 0:
            try:
                self.backend.load()
            except Exception as e:  # a missing or broken library: the audit says so too
                log.warning(
                    "cannot load the simulated NVML to make the process table in %s: %s",
                    self.config.sim_state_dir,
                    e,
                )

    # --- connections' messages ----------------------------------------------------

    def _io(self, conn: Conn, events: int) -> None:
        if events & select.EPOLLOUT:
            conn.flush()
        if events & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR):
            for frames in conn.receive():
                self._serve(conn, frames)
                if conn.closed:
                    break
        self.connections.settle(conn)

    def _adopt(self, task: Task) -> None:
        """Watch a task restored from the database whose client may still run."""
        if task.pid is None:
            return  # its first heartbeat will name it, or the timeout ends it
        try:
            fd = os.pidfd_open(task.pid)
        except OSError:
            fd = -1
        # Checked after opening, so the pidfd cannot name a process that took the pid later.
        if fd < 0 or process_start(task.pid) != task.pid_start:
            if fd >= 0:
                os.close(fd)
            log.info(
                "task %s: its client (pid %d) ended while nodemgr was down", task.task_id, task.pid
            )
            self.release(task.task_id, "exited")
            return
        self.register(("task", task.task_id), fd)

    # --- loop ------------------------------------------------------------------

    def request_stop(self, *_: object) -> None:
        self._stop = True

    def serve_forever(self) -> int:
        """Serve until SIGTERM or SIGINT (0), or until MAX_FAILED_TURNS turns in a row
        failed (EXIT_SOFTWARE): the status for nodemgr to exit with."""
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        # The handler runs between two waits, and the wait it interrupted is resumed with
        # what is left of its timeout (PEP 475): a byte written to a polled pipe as the
        # signal arrives ends that wait, or the next one when it came before.
        self._wakeup, wake = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        was = signal.set_wakeup_fd(wake, warn_on_full_buffer=False)
        self.epoll.register(self._wakeup, select.EPOLLIN)
        try:
            failed = 0
            while not self._stop:
                # One bad record or reply never ends the loop: what failed is logged, once
                # until a turn succeeds again.
                try:
                    self.step()
                except Exception as e:
                    failed += 1
                    if failed == 1:
                        log.exception("internal error in the loop; nodemgr goes on")
                    if failed >= MAX_FAILED_TURNS:
                        self._give_up(failed, e)
                        return EXIT_SOFTWARE
                else:
                    failed = 0
            return 0
        finally:
            signal.set_wakeup_fd(was)
            self.epoll.unregister(self._wakeup)
            os.close(self._wakeup)
            os.close(wake)
            self._wakeup = -1
            self.close()

    def _give_up(self, failed: int, e: Exception) -> None:
        where = traceback.extract_tb(e.__traceback__)[-1]
        log.error(
            "internal error in the loop %d times in a row, the last in %s (%s:%d): %s; "
            "nodemgr stops with exit status %d for its service manager to restart it",
            failed,
            where.name,
            where.filename,
            where.lineno or 0,
            "".join(traceback.format_exception_only(e)).strip(),
            EXIT_SOFTWARE,
            exc_info=e,
        )

    def _safely(self, what: str, fn: Callable[..., object], *args: Any) -> bool:
        """Run ``fn(*args)``; an unexpected exception is logged (once, until ``what``
        succeeds again) and the loop goes on. False when it failed."""
        try:
            fn(*args)
        except Exception:
            if what not in self._failing:
                log.exception("internal error %s; nodemgr goes on", what)
            self._failing.add(what)
            return False
        self._failing.discard(what)
        return True

    def step(self) -> None:
        now = time.monotonic()
        timeout = max(0.0, min(self._next_sweep - now, self.config.sweep_interval))
        if self._released:
            timeout = 0.0  # a task ended after the last turn's reaping (_run_queue)
        # What each descriptor was when the poll returned: serving one event may close a
        # descriptor and open another under the same number, which a stale event must not
        # reach (each is checked to be still registered as what it was).
        events = [(self.fds.get(fd), fd, ev) for fd, ev in self.epoll.poll(timeout)]
        if any(fd == self._wakeup for _, fd, _ in events):
            # Signals' numbers: their handlers have run; emptied, or the pipe stays ready.
            with contextlib.suppress(BlockingIOError):
                os.read(self._wakeup, 4096)
        # Process exits first, for the same reason: serving a message may close a pidfd and
        # open a new one under the same number.
        # Each event is handled on its own: one whose handling failed is put out of the
        # wait (its pidfd unwatched, its listener held, its connection dropped), since it
        # stays ready and would end every later wait, and the others are served.
        for what, fd, _ in events:
            if not isinstance(what, tuple) or self.fds.get(fd) is not what:
                continue
            if not self._safely("handling a client's exit", self._process_exited, fd):
                # A task is left to its heartbeat timeout, a waiting request to its own.
                self.unwatch(what)
        for what, fd, ev in events:
            if what is None or isinstance(what, tuple) or self.fds.get(fd) is not what:
                continue
            if isinstance(what, Listener):
                if self.connections.polled(what) and not self._safely(
                    "accepting a connection", self.connections.accept, what
                ):
                    self.connections.hold(what)
            elif not self._safely("serving a connection", self._io, what, ev):
                self.connections.drop(what)
        now = time.monotonic()
        self.reclaims.step(now)
        if now >= self._next_sweep:
            self._next_sweep = now + self.config.sweep_interval
            self._released.clear()
            if self.connections.young:
                self.connections.expire_young(now)
            self.connections.resume()  # after accept() found no descriptor: try again
            self.connections.retry_held()  # after accept() failed
            wall_ns = time.time_ns()
            # Each environment's ledger on its own: one that fails stops no other's sweep.
            for env in list(self.node.envs.values()):
                self._safely(f"sweeping the ledger of env {env.name}", self._sweep, env, wall_ns)
            if self.node.store.pending:
                self._safely("writing records", self.node.store.flush)
            if self.reclaims.idle_due(now):
                self._safely("checking idle tasks", self.reclaims.check_idle, now)
            self._safely("checking run_dir", self._check_run_dir)
            self._safely("settling draining GPUs", self.node.settle_draining)
            self._safely("settling compute pacers", self.node.settle_pacers)
            self._safely(
                "applying the elastic rule", self.node.elastic.sweep, time.time(), self._used
            )
            for env in list(self.node.envs.values()):
                self._safely(f"sampling the ledger of env {env.name}", self.node.sample_env, env)
            # Time slicing: learn shapes (a charge that drops retries waiting requests),
            # and take the turn from a holder past timeslice.turn_timeout.
            self._safely("reading time-sliced tasks' regions", self.node.read_regions)
            self._safely("ending turns", self.node.slicing.expire_turns)
            if now >= self._next_health:  # simulated GPUs are never lost (backend.lost)
                self._next_health = now + self.config.health_interval
                self._safely("checking GPU health", self._check_health)
            if self.auditor.due(now):
                self._safely("auditing", self.auditor.run, now)
            if self.sampler.due(now):
                self._safely("sampling utilisation", self.sampler.run, now)
            if self.metrics is not None:
                self._safely("taking the metrics' snapshot", self.metrics.snapshot)
        elif self._released:
            # Tasks ended since the last sweep: their environments' dead processes' slots
            # are reaped now, the other environments wait for the sweep.
            wall_ns = time.time_ns()
            for name in self._released:
                released = self.node.envs.get(name)
                if released is not None:
                    self._safely(
                        f"sweeping the ledger of env {name}", self._sweep, released, wall_ns
                    )
                    self._safely(
                        f"sampling the ledger of env {name}", self.node.sample_env, released
                    )
            self._released.clear()
            self._safely("settling draining GPUs", self.node.settle_draining)
        # Held best-effort tasks are let go here too, once what held them has gone.
        if self.node.queue or self.node.held_for_ls:
            self._run_queue(now)
        if self.node.slicing.held_yields:
            self._answer_yields()

    def _used(self, task_id: str, gpu: int) -> int | None:
        """The percent of ``gpu`` the last utilisation sample saw ``task_id`` keep busy."""
        return self.utilization.task(task_id, [gpu])[0]

    def _sweep(self, env: Env, wall_ns: int) -> None:
        # What only nodemgr writes (a limit, a context charge) is put back first, so that
        # a limit an environment raised for itself holds at most until this sweep.
        fixed = env.ledger.repair()
        if self.audit.ledger_checked(env.name, fixed):
            log.warning(
                "env %s wrote in its ledger what only nodemgr writes; written again: %s",
                env.name,
                "; ".join(fixed),
            )
        # Before reaping, so a process that launched and died since the
        # last sweep still dates its task's last launch.
        env.ledger.stamp_launches(wall_ns)
        reaped = env.ledger.reap_totals()
        if reaped:
            self.node.note_usage(reaped)
            log.debug("reaped dead processes' slots in %s", env.name)
        # After the reap: what dead processes held no longer stands in a top-up's way.
        self.node.top_up(env)
        self.node.note_steps(env)

    def _answer_yields(self) -> None:
        """Answer the held `yield` requests whose wait is over (Slicing.answer_yields)."""
        for to, task_id, passed in self.node.slicing.answer_yields():
            self.send_later(to, TurnReply(task_id=task_id, passed=passed))

    def _check_run_dir(self) -> None:
        """Notice sockets, ledgers and the lock removed from run_dir (a tmpfs cleaner, an
        rm -rf) and make what can be made again: clients' sockets reconnect by themselves."""
        node = self.node
        conns = self.connections
        run = self.config.run_dir
        lock = run / "nodemgr.lock"
        if not lock.exists():
            log.error("%s was removed; making run_dir and its sockets again", lock)
            try:
                (run / paths.ENVS_DIR).mkdir(parents=True, exist_ok=True, mode=0o711)
                os.chmod(run, 0o711)
                self._lock_fds.append(_lock(lock, f"run directory {run}"))
            except (OSError, StartupError) as e:
                log.error("cannot make %s again: %s", lock, e)
        admin = run / paths.ADMIN_SOCKET
        if conns.admin is not None and not admin.is_socket():
            log.error("%s was removed; binding it again", admin)
            conns.unbind(conns.admin)
            conns.admin = None
            try:
                conns.bind_admin()
            except (OSError, StartupError) as e:
                log.error("cannot bind %s again: %s", admin, describe(e))
        readers = run / paths.VIEW_SOCKET
        if conns.readers is not None and not readers.is_socket():
            log.error("%s was removed; binding it again", readers)
            conns.unbind(conns.readers)
            conns.readers = None
            try:
                conns.bind_readers()
            except OSError as e:
                log.error("cannot bind %s again: %s", readers, describe(e))
        recovery.check_ledgers(node, self._env_log)
        for name in recovery.repair_ledgers(node, self._env_log):
            self.connections.close_env(name)
        for env in node.envs.values():
            path = Path(env.endpoint.removeprefix(paths.IPC))
            if path.is_socket() and env.name in conns.listeners:
                continue
            if env.name not in self._unbindable:
                # Its directory is its user's, who may remove the socket in a loop.
                log_throttled(
                    log,
                    self._env_log,
                    f"{env.name}/socket",
                    logging.ERROR,
                    f"{path} was removed; binding it again",
                )
            self.connections.close_env(env.name)
            try:
                envdirs.ready(self.config, env.name)
                self.connections.open_env(env)
            except (OSError, StartupError, ProtocolError) as e:
                # Said once; tried again at every sweep.
                if env.name not in self._unbindable:
                    log.error("cannot bind %s again: %s", path, e)
                self._unbindable.add(env.name)
            else:
                self._unbindable.discard(env.name)

    def _check_health(self) -> None:
        lost = self.backend.lost()
        for index in sorted(lost - self.node.lost):
            log.error(
                "GPU %d (%s) is lost: it will not be granted again until nodemgr restarts",
                index,
                self.node.gpus[index].uuid,
            )
        self.node.lost |= lost

    # --- wait queue ----------------------------------------------------------------

    def _run_queue(self, now: float) -> None:
        node = self.node
        for w in node.queue.expired(now):
            node.queue_dirty = True  # what it held for itself goes on (Node.resume_held)
            self.unwatch(("wait", w.wid))
            waited = now - w.enqueued
            self.send_later(
                w.reply_to,
                ErrorReply.of(
                    Err.NO_RESOURCES,
                    f"no GPUs came free within the {waited:.1f}s this request was willing to wait",
                ),
            )
            if self.metrics is not None:
                self.metrics.waited(waited, "timeout")
        if node.queue_dirty:
            granted, failed, evictions = node.serve_queue()
            for w, task in granted:
                self.unwatch(("wait", w.wid))
                if self.metrics is not None:
                    self.metrics.waited(now - w.enqueued, "granted")
                self.watch(task)
                if task.task_id in node.tasks and not self.send_later(
                    w.reply_to, GrantReply(**views.grant(self.node, task))
                ):
                    self.release(task.task_id, "undelivered")
            for w, e in failed:
                self.unwatch(("wait", w.wid))
                self.send_later(w.reply_to, ErrorReply.of(e.code, e.message))
            for ev in evictions:
                if ev.task.task_id in node.tasks:
                    self.reclaim(ev.task, "preempted", ev.message)
        for pos, w in enumerate(list(node.queue), 1):
            if w.told != pos or w.told_reason != w.reason:
                w.told, w.told_reason = pos, w.reason
                update = QueuedReply(position=pos, waiting=len(node.queue), reason=w.reason)
                if not self.send_later(w.reply_to, update):
                    node.queue.drop(w.wid)
                    self.unwatch(("wait", w.wid))

    def send_later(self, to: ReplyTo, reply: Message) -> bool:
        """Send ``reply`` to the request ``to`` names; False when it cannot be (a vanished
        client, a reply that cannot be encoded: its client gets an internal error instead)."""
        conn, envelope, msg_id = to
        data, encoded = self._encode(reply, msg_id)
        sent = conn.send([*envelope, data]) and encoded
        self.connections.settle(conn)
        return sent

    def _encode(self, reply: Message, msg_id: int) -> tuple[bytes, bool]:
        """``reply`` encoded, and True; a reply that cannot be encoded is logged and an
        internal error (False) goes instead, to that request alone."""
        try:
            return messages.encode(reply, msg_id), True
        except Exception:
            log.exception("internal error encoding a %s reply", reply.TYPE)
            failed = ErrorReply.of(Err.INTERNAL, "internal error in nodemgr; see its log")
            return messages.encode(failed, msg_id), False

    def _serve(self, conn: Conn, frames: list[bytes]) -> None:
        """Answer one message that arrived on ``conn``."""
        if not protocol.envelope_ok([len(f) for f in frames]):
            return
        envelope = frames[:-1]
        if conn.refusal is not None:
            # Over a cap (_over_cap): the first request learns why, then the connection ends.
            msg_id = 0
            with contextlib.suppress(ProtocolError):
                msg_id = protocol.decode(frames[-1])["id"]
            conn.close_when_sent = True
            conn.send([*envelope, messages.encode(ErrorReply.of(Err.BUSY, conn.refusal), msg_id)])
            return
        started = time.perf_counter()
        out, msg_id = self._dispatch(frames[-1], conn, envelope)
        if self.metrics is not None:
            self.metrics.served(
                "admin" if conn.env is None else "task", out, time.perf_counter() - started
            )
        data, encoded = self._encode(out, msg_id)
        if not conn.send([*envelope, data]) or not encoded:
            if encoded:
                log.warning("reply to a vanished client dropped")
            if isinstance(out, GrantReply):
                # Its sender is gone, and the pid read for it may already
                # name another process: the grant must not stand.
                self.release(out.task_id, "undelivered")

    def _dispatch(self, frame: bytes, conn: Conn, envelope: list[bytes]) -> tuple[Message, int]:
        """The reply to the message in ``frame``, and the id it carries."""
        msg_id = 0
        try:
            msg = protocol.decode(frame)
            msg_id = msg["id"]
            if conn.env is None:
                if conn.readonly:
                    self._reader_rate(conn)
                request = messages.parse(msg, messages.ADMIN_REQUESTS)
                if conn.readonly and not request.is_view():
                    raise ProtocolError(
                        Err.FORBIDDEN,
                        f"{msg['type']} changes what nodemgr does, and the read-only admin "
                        f"socket {self.config.run_dir / paths.VIEW_SOCKET} serves views only "
                        "(status, tasks, queue, history, quota show, mode and drain --show); "
                        f"it needs the admin socket {self.config.run_dir / 'admin.sock'}, "
                        "which the config's [admin] owner/group/mode let in",
                    )
                return self._admin(request), msg_id
            task_request = messages.parse(msg, messages.TASK_REQUESTS)
            reply = task_endpoint.handle(self, conn.env, task_request, (conn, envelope, msg_id))
            return reply, msg_id
        except ProtocolError as e:
            return ErrorReply.of(e.code, e.message), msg_id
        except sqlite3.Error as e:
            # A quota or mode change is written before it is applied: nothing changed.
            why = cause(e, self.config.database)
            log.error("database error serving a request: %s", why)
            return ErrorReply.of(
                Err.INTERNAL, f"nodemgr cannot use its database {self.config.database}: {why}"
            ), msg_id
        except Exception:
            log.exception("internal error serving a request")
            return ErrorReply.of(Err.INTERNAL, "internal error in nodemgr; see its log"), msg_id

    def _reader_rate(self, conn: Conn) -> None:
        """Spend a token of the view.sock user's bucket, or raise ProtocolError(BUSY): each
        view walks every GPU, task and waiting request, or reads the database, and one
        reader asking in a loop must not slow the environments' grants."""
        who = party_of(conn)
        assert who is not None
        if not self.reader_requests.take(who, time.monotonic()):
            raise ProtocolError(
                Err.BUSY,
                f"user {conn.uid} sent more than {self.config.reader_burst} requests to "
                f"{self.config.run_dir / paths.VIEW_SOCKET} at once, or more than "
                f"{self.config.reader_requests_per_second} a second "
                "(limits.reader_requests_per_second, limits.reader_burst); ask less often",
            )

    # --- clients' processes (pidfds), tasks' ends ------------------------------------

    def register(self, what: Watched, fd: int) -> None:
        self.pidfds[fd] = what
        self.watched[what] = fd
        self.fds[fd] = what
        self.epoll.register(fd, select.EPOLLIN)

    def watch(self, task: Task) -> None:
        if task.pid is None:
            return
        try:
            fd = os.pidfd_open(task.pid)
        except OSError as e:
            if e.errno == errno.ESRCH:
                self.release(task.task_id, "exited")
            return
        self.register(("task", task.task_id), fd)

    def unregister(self, what: Watched) -> int | None:
        """Stop watching ``what``; returns its pidfd, still open, if it was watched."""
        fd = self.watched.pop(what, None)
        if fd is not None:
            self.epoll.unregister(fd)
            del self.pidfds[fd]
            del self.fds[fd]
        return fd

    def unwatch(self, what: Watched) -> None:
        fd = self.unregister(what)
        if fd is not None:
            os.close(fd)

    def release(self, task_id: str, reason: str, exit_code: int | None = None) -> None:
        self.unwatch(("task", task_id))
        self.audit.forget_task(task_id)
        task = self.node.release(task_id, reason, exit_code)
        if task is not None:
            self._released.add(task.env)  # reap its processes' slots now
            if self.metrics is not None:
                self.metrics.reclaimed(reason)

    def _process_exited(self, fd: int) -> None:
        what = self.pidfds.get(fd)
        if what is None:
            return
        kind, key = what
        if kind == "task":
            self.release(str(key), "exited")
        else:
            self.unwatch(what)
            w = self.node.queue.drop(int(key))
            if w is not None:
                self.node.queue_dirty = True
                log.info("a waiting request from env %s went away with its client", w.env)

    def reclaim(self, task: Task, reason: str, message: str, record: str | None = None) -> None:
        """Take a task's GPUs back and tell its client why (Reclaims.reclaim)."""
        self.reclaims.reclaim(task, reason, message, record)

    def close_env_later(self, name: str) -> None:
        """Stop serving a deleted environment (Reclaims.close_env_later)."""
        self.reclaims.close_env_later(name)
        self.views.forget(name)

    # --- admin endpoint ----------------------------------------------------------

    def _admin(self, request: AdminRequest[R]) -> R:
        return admin.handle(self, request)

    # --- shutdown ----------------------------------------------------------------

    def close(self) -> None:
        self.systemd.notify("STOPPING=1")
        if self.metrics is not None:
            self.metrics.stop()
        for what in list(self.fds.values()):
            if isinstance(what, Conn):
                self.connections.drop(what)
        for fd in list(self.pidfds):
            os.close(fd)
        self.reclaims.close()
        self.connections.remove_sockets()
        for listener in self.connections.all_listeners():
            listener.sock.close()
        self.fds.clear()
        self.pidfds.clear()
        self.watched.clear()
        self.connections.listeners.clear()
        self.connections.admin = None
        self.connections.readers = None
        self.epoll.close()
        self.node.close()
        self._unlock()
        log.info("nodemgr stopped")
