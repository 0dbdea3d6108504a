"""nodemgr's event loop: its sockets, process-exit descriptors and timers, on one epoll.

One socket per environment (its path tells nodemgr which environment a request comes
from; the client's word is never asked) and one admin socket only the operator can reach.
Clients speak ZeroMQ (DEALER sockets); nodemgr accepts and reads the connections itself
(transport.py), so that each is counted and capped and each message bounded as it arrives.
The kernel names each connection's client process (SO_PEERCRED); a pidfd per task wakes
the loop the moment that process ends.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import logging
import os
import resource
import secrets
import select
import signal
import socket
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nodemgr import __version__, envdirs, protocol, views
from nodemgr.config import Access, Config, ConfigError
from nodemgr.envdirs import RestoreError
from nodemgr.gpus import discover, lost_gpus
from nodemgr.model import Env, Task
from nodemgr.protocol import Err, ProtocolError
from nodemgr.state import Node, process_start
from nodemgr.store import Store, StoreError, cause, startup_error
from nodemgr.transport import Conn, peer_credentials

log = logging.getLogger("nodemgr")

# Connections (docs/protocol.md, "Transport"). An environment may hold at most
# MAX_CONNECTIONS_PER_ENV, and never more than half of what the descriptor limit leaves for
# connections, so another environment always gets in; one client process at most
# MAX_CONNECTIONS_PER_CLIENT (a gpushare-run holds 2 to 3). A connection beyond a cap gets a
# `busy` answer to its first request and is closed.
MAX_CONNECTIONS_PER_ENV = 4096
MAX_CONNECTIONS_PER_CLIENT = 16
# Connections being refused at once per environment; beyond this one is closed unanswered.
MAX_REFUSING_PER_ENV = 16
# Descriptors kept out of the connections' share of the limit: the database, NVML, the
# metrics server, ledgers being re-made, pidfds opened while connections are at their cap.
FD_RESERVE = 256
# Seconds a connection has to finish the ZMTP handshake, and a refused one to be answered.
HANDSHAKE_TIMEOUT = 10.0
# Bytes of replies a client may leave unread before its connection is dropped: a task
# endpoint's replies are a few KiB; the admin's `tasks` or `history` can be megabytes.
TASK_OUT_LIMIT = 1 << 20
ADMIN_OUT_LIMIT = 256 << 20
# Connections accepted per listener per turn of the loop.
ACCEPT_BATCH = 64

# Errors of accept() that mean "no descriptor or memory for one now", not "a bad peer".
_ACCEPT_EXHAUSTED = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class StartupError(Exception):
    pass


@dataclass(eq=False)
class Listener:
    """A listening socket: an environment's (env is its name) or the admin's (None)."""

    sock: socket.socket
    env: str | None
    path: Path

    @property
    def fd(self) -> int:
        return self.sock.fileno()


# What a pidfd watches: a task's client, or the client of a waiting request.
Watched = tuple[str, str | int]

# How a reply reaches a requester later: its connection, envelope and message id.
ReplyTo = tuple[Conn, list[bytes], int]


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


@contextlib.contextmanager
def _open_dir(path: Path) -> Iterator[int]:
    """A descriptor of the directory ``path`` (not of a link there) for the ``with``."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)


def _why(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return str(e)


def _raise_nofile() -> int:
    """Raise the soft descriptor limit to the hard one; return the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


class Server:
    def __init__(self, config: Config) -> None:
        self.config = config
        gpus, simulated = discover(config)
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
            self.node = Node(config, gpus, simulated, store)
        except (ConfigError, sqlite3.Error) as e:
            store.close()
            self._unlock()
            if isinstance(e, sqlite3.Error):
                raise StartupError(str(startup_error(config.database, e))) from None
            raise StartupError(str(e)) from None
        self.nofile = _raise_nofile()
        self.epoll = select.epoll()
        # Everything the loop polls, by descriptor: listeners, connections, pidfds.
        self.fds: dict[int, Listener | Conn | Watched] = {}
        self.admin: Listener | None = None
        self.listeners: dict[str, Listener] = {}
        self.pidfds: dict[int, Watched] = {}
        self.watched: dict[Watched, int] = {}
        self.conns = 0
        self.conns_of_env: collections.Counter[str] = collections.Counter()
        self.conns_of_client: collections.Counter[tuple[str, int]] = collections.Counter()
        self.refusing: collections.Counter[str] = collections.Counter()
        # Connections still in their handshake, or being refused: dropped at their deadline.
        self._young: set[Conn] = set()
        # Listeners not polled now: the environments' (connections at the descriptor
        # budget) or all (accept() found no descriptor); polled again when one is free.
        self._paused_envs = False
        self._paused_admin = False
        self._pause_said = -60.0
        self._stop = False
        self._next_sweep = 0.0
        self._next_health = 0.0
        self.metrics: Any = None
        self._bind_dir = config.run_dir / ".bind"
        self._binds = 0
        # Environments whose socket could not be bound again (_check_run_dir).
        self._unbindable: set[str] = set()

    def _unlock(self) -> None:
        for fd in self._lock_fds:
            os.close(fd)
        self._lock_fds.clear()

    # --- set-up --------------------------------------------------------------

    def start(self) -> None:
        run = self.config.run_dir
        try:
            run.mkdir(parents=True, exist_ok=True, mode=0o711)
            (run / "envs").mkdir(exist_ok=True, mode=0o711)
        except OSError as e:
            raise StartupError(f"cannot create run directory {run}: {e.strerror}") from None
        self._lock_fds.append(_lock(run / "nodemgr.lock", f"run directory {run}"))
        try:
            self._prepare_bind_dir()
            with _open_dir(run) as fd:
                self.admin = self._bind(fd, run / "admin.sock", self.config.admin_access, None)
        except OSError as e:
            raise StartupError(f"cannot create {run / 'admin.sock'}: {_why(e)}") from None
        try:
            restored = self.node.restore()
        except sqlite3.Error as e:
            raise StartupError(str(startup_error(self.config.database, e))) from None
        except RestoreError as e:
            raise StartupError(str(e)) from None
        for task in restored:
            self._adopt(task)
        for env in self.node.envs.values():
            with contextlib.suppress(ProtocolError):  # refused: said in the log
                self._open_env(env)
        if self.config.metrics_port:
            from nodemgr.metrics import Metrics

            self.metrics = Metrics(self)
            self.metrics.start()
            self.node.slicing.on_switch = self.metrics.switched
        kind = "simulated" if self.node.simulated else "NVML"
        log.info(
            "nodemgr %s serving %d %s GPUs; admin endpoint %s; up to %d connections",
            __version__,
            len(self.node.gpus),
            kind,
            self.config.admin_endpoint,
            self._conn_limit(),
        )

    def _prepare_bind_dir(self) -> None:
        """Empty nodemgr's private directory for binding sockets (see _bind)."""
        path = self._bind_dir
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            path.unlink()
        path.mkdir(mode=0o700, exist_ok=True)
        os.chown(path, os.geteuid(), os.getegid())
        os.chmod(path, 0o700)
        for entry in path.iterdir():
            entry.unlink()

    def _bind(self, dir_fd: int, path: Path, access: Access, env: str | None) -> Listener:
        """A listening socket with ``access``, placed at ``path`` in the directory ``dir_fd``.

        An environment's directory is writable by its user, so nothing there is
        touched by name with privileges: the socket is bound in nodemgr's private
        directory, given its owner and mode there, and renamed into place through
        ``dir_fd``; a rename replaces whatever non-directory was there and follows
        no link. A directory in the way is moved aside. Raises OSError.
        """
        self._binds += 1
        private = self._bind_dir / str(self._binds)
        sock = socket.socket(
            socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC
        )
        try:
            # The socket appears with the umask's mode; keep it private from the start.
            old = os.umask(0o177)
            try:
                sock.bind(str(private))
            finally:
                os.umask(old)
            sock.listen(socket.SOMAXCONN)
            os.chown(private, access.uid, access.gid)
            os.chmod(private, access.mode)
            try:
                os.rename(private, path.name, dst_dir_fd=dir_fd)
            except OSError as e:
                if e.errno not in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST):
                    raise
                aside = f"{path.name}.moved-{secrets.token_hex(4)}"
                os.rename(path.name, aside, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                log.warning("%s was a directory: moved it aside to %s", path, path.with_name(aside))
                os.rename(private, path.name, dst_dir_fd=dir_fd)
        except BaseException:
            sock.close()
            with contextlib.suppress(OSError):
                private.unlink()
            raise
        listener = Listener(sock, env, path)
        self.fds[listener.fd] = listener
        paused = self._paused_admin or (env is not None and self._paused_envs)
        self.epoll.register(listener.fd, 0 if paused else select.EPOLLIN)
        return listener

    def _unbind(self, listener: Listener) -> None:
        self.epoll.unregister(listener.fd)
        del self.fds[listener.fd]
        listener.sock.close()

    def _open_env(self, env: Env) -> None:
        """Serve ``env`` on its socket. A socket that cannot be placed refuses this
        environment only (said in the log and to the operator's ``quota set``); the others
        go on, and a later ``quota set`` of it tries again."""
        if env.name in self.listeners:
            return
        path = Path(env.endpoint.removeprefix("ipc://"))
        try:
            with _open_dir(path.parent) as fd:
                listener = self._bind(fd, path, self.config.access_for(env.name), env.name)
        except OSError as e:
            why = f"environment {env.name} refused: cannot create its socket {path}: {_why(e)}"
            log.error("%s", why)
            raise ProtocolError(Err.INTERNAL, why) from None
        self.listeners[env.name] = listener

    def _close_env(self, name: str) -> None:
        """Stop serving environment ``name``: its socket, and every connection to it."""
        listener = self.listeners.pop(name, None)
        if listener is not None:
            self._unbind(listener)
        for conn in [c for c in self.fds.values() if isinstance(c, Conn) and c.env == name]:
            self._drop(conn)

    # --- connections -------------------------------------------------------------

    def _conn_limit(self) -> int:
        """Connections the descriptor limit leaves room for, beside everything else open."""
        others = len(self.fds) - self.conns + len(self.node.envs)  # + a ledger per env
        return max(0, self.nofile - FD_RESERVE - others)

    def _accept(self, listener: Listener) -> None:
        env = listener.env
        for _ in range(ACCEPT_BATCH):
            if env is not None and self.conns >= self._conn_limit():
                self._pause(admin=False, why=f"{self.conns} connections open")
                return
            try:
                sock, _ = listener.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in _ACCEPT_EXHAUSTED:
                    self._pause(admin=True, why=_why(e))
                    return
                continue  # ECONNABORTED, EPROTO: that client gave up; the next may not
            sock.setblocking(False)
            pid, uid = peer_credentials(sock)
            now = time.monotonic()
            out_limit = ADMIN_OUT_LIMIT if env is None else TASK_OUT_LIMIT
            refusal = self._over_cap(env, pid)
            if refusal is not None:
                assert env is not None
                if self.metrics is not None:
                    self.metrics.refused(refusal[0])
                if self.refusing[env] >= MAX_REFUSING_PER_ENV:
                    sock.close()
                    continue
            conn = Conn(sock, env, pid, uid, out_limit, now + HANDSHAKE_TIMEOUT)
            self.fds[conn.fd] = conn
            self.conns += 1
            self._young.add(conn)
            if refusal is not None:
                assert env is not None
                conn.refusal = refusal[1]
                self.refusing[env] += 1
            elif env is not None:
                self.conns_of_env[env] += 1
                if pid is not None:
                    self.conns_of_client[env, pid] += 1
            self.epoll.register(conn.fd, select.EPOLLIN)
            self._settle(conn)

    def _over_cap(self, env: str | None, pid: int | None) -> tuple[str, str] | None:
        """(reason, message) when a new connection to ``env`` from ``pid`` is over a cap."""
        if env is None:
            return None
        cap = min(MAX_CONNECTIONS_PER_ENV, max(1, self._conn_limit() // 2))
        if self.conns_of_env[env] >= cap:
            return "env", (
                f"environment {env} already has {self.conns_of_env[env]} connections open to "
                f"nodemgr, the most one environment may have ({cap}); end processes of it that "
                "hold connections they do not use"
            )
        if pid is not None and self.conns_of_client[env, pid] >= MAX_CONNECTIONS_PER_CLIENT:
            return "client", (
                f"process {pid} already has {MAX_CONNECTIONS_PER_CLIENT} connections open to "
                "nodemgr, the most one process may have; close the ones it does not use"
            )
        return None

    def _pause(self, admin: bool, why: str) -> None:
        """Stop polling the listeners (the environments', or all) until a descriptor frees:
        a connection waits in its socket's backlog meanwhile, and nothing aborts."""
        if admin and not self._paused_admin:
            self._paused_admin = self._paused_envs = True
            what = f"cannot accept connections ({why}): waiting for one to close"
        elif not admin and not self._paused_envs:
            self._paused_envs = True
            what = (
                f"environments' connections at their share of the descriptor limit ({why}, "
                f"limit {self.nofile}): new ones wait until one closes"
            )
        else:
            return
        for listener in self._all_listeners():
            if admin or listener.env is not None:
                self.epoll.modify(listener.fd, 0)
        # Once a minute at most: accept() is tried again at every sweep while it fails.
        now = time.monotonic()
        if now >= self._pause_said + 60:
            self._pause_said = now
            log.warning("%s", what)

    def _resume(self) -> None:
        if not (self._paused_admin or self._paused_envs):
            return
        envs = not (self._paused_envs and self.conns >= self._conn_limit())
        if not envs and not self._paused_admin:
            return
        for listener in self._all_listeners():
            if listener.env is None or envs:
                self.epoll.modify(listener.fd, select.EPOLLIN)
        self._paused_admin = False
        self._paused_envs = not envs

    def _all_listeners(self) -> list[Listener]:
        return [*self.listeners.values(), *([self.admin] if self.admin is not None else [])]

    def _io(self, conn: Conn, events: int) -> None:
        if events & select.EPOLLOUT:
            conn.flush()
        if events & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR):
            for frames in conn.receive():
                self._serve(conn, frames)
                if conn.closed:
                    break
        self._settle(conn)

    def _settle(self, conn: Conn) -> None:
        """Drop ``conn`` if it broke, else poll it for writing exactly while it has output."""
        if conn.closed:
            self._drop(conn)
            return
        if conn.deadline is None:
            self._young.discard(conn)
        if conn.wants_write != conn.watching_out:
            conn.watching_out = conn.wants_write
            mask = select.EPOLLIN | (select.EPOLLOUT if conn.watching_out else 0)
            self.epoll.modify(conn.fd, mask)

    def _drop(self, conn: Conn) -> None:
        if self.fds.get(conn.fd) is not conn:
            return
        self.epoll.unregister(conn.fd)
        del self.fds[conn.fd]
        self.conns -= 1
        self._young.discard(conn)
        env = conn.env
        if conn.refusal is not None:
            assert env is not None
            self.refusing[env] -= 1
        elif env is not None:
            self.conns_of_env[env] -= 1
            if conn.pid is not None:
                self.conns_of_client[env, conn.pid] -= 1
                if not self.conns_of_client[env, conn.pid]:
                    del self.conns_of_client[env, conn.pid]
        conn.closed = True
        conn.close()
        self._resume()

    def _expire_young(self, now: float) -> None:
        """Drop connections that did not finish their handshake, or were not answered, in
        time: a connection that says nothing must not hold a descriptor for long."""
        for conn in list(self._young):
            if conn.deadline is None:
                self._young.discard(conn)
            elif now >= conn.deadline:
                self._drop(conn)

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
            self._release(task.task_id, "exited")
            return
        self._register(("task", task.task_id), fd)

    # --- loop ------------------------------------------------------------------

    def request_stop(self, *_: object) -> None:
        self._stop = True

    def serve_forever(self) -> None:
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        try:
            while not self._stop:
                self.step()
        finally:
            self.close()

    def step(self) -> None:
        now = time.monotonic()
        timeout = max(0.0, min(self._next_sweep - now, self.config.sweep_interval))
        # What each descriptor was when the poll returned: serving one event may close a
        # descriptor and open another under the same number, which a stale event must not
        # reach (each is checked to be still registered as what it was).
        events = [(self.fds.get(fd), fd, ev) for fd, ev in self.epoll.poll(timeout)]
        # Process exits first, for the same reason: serving a message may close a pidfd and
        # open a new one under the same number.
        for what, fd, _ in events:
            if isinstance(what, tuple) and self.fds.get(fd) is what:
                self._process_exited(fd)
        for what, fd, ev in events:
            if what is None or isinstance(what, tuple) or self.fds.get(fd) is not what:
                continue
            if isinstance(what, Listener):
                if not (self._paused_admin or (what.env is not None and self._paused_envs)):
                    self._accept(what)
            else:
                self._io(what, ev)
        now = time.monotonic()
        for task in self.node.expired(now):
            self._reclaim_hung(task)
        if now >= self._next_sweep:
            self._next_sweep = now + self.config.sweep_interval
            if self._young:
                self._expire_young(now)
            self._resume()  # after accept() found no descriptor: try again
            wall_ns = time.time_ns()
            for env in self.node.envs.values():
                # Before reaping, so a process that launched and died since the
                # last sweep still dates its task's last launch.
                env.ledger.stamp_launches(wall_ns)
                reaped = env.ledger.reap_totals()
                if reaped:
                    self.node.note_usage(reaped)
                    log.debug("reaped dead processes' slots in %s", env.name)
            if self.node.store.pending:
                self.node.store.flush()
            self._check_run_dir()
            self.node.settle_draining()
            self.node.sample()
            # Time slicing: learn shapes (a charge that drops retries waiting requests),
            # and take the turn from a holder past timeslice.turn_timeout.
            self.node.read_regions()
            self.node.slicing.expire_turns()
            if not self.node.simulated and now >= self._next_health:
                self._next_health = now + self.config.health_interval
                self._check_health()
            if self.metrics is not None:
                self.metrics.snapshot()
        if self.node.queue:
            self._run_queue(now)
        if self.node.slicing.held_yields:
            self._answer_yields()

    def _answer_yields(self) -> None:
        """Answer the held `yield` requests whose wait is over (Slicing.answer_yields)."""
        for to, task_id, passed in self.node.slicing.answer_yields():
            self._send_later(to, protocol.reply("turn", to[2], task_id=task_id, passed=passed))

    def _check_run_dir(self) -> None:
        """Notice sockets, ledgers and the lock removed from run_dir (a tmpfs cleaner, an
        rm -rf) and make what can be made again: clients' sockets reconnect by themselves."""
        node = self.node
        run = self.config.run_dir
        lock = run / "nodemgr.lock"
        if not lock.exists():
            log.error("%s was removed; making run_dir and its sockets again", lock)
            try:
                (run / "envs").mkdir(parents=True, exist_ok=True, mode=0o711)
                os.chmod(run, 0o711)
                self._lock_fds.append(_lock(lock, f"run directory {run}"))
            except (OSError, StartupError) as e:
                log.error("cannot make %s again: %s", lock, e)
        admin = run / "admin.sock"
        if self.admin is not None and not admin.is_socket():
            log.error("%s was removed; binding it again", admin)
            self._unbind(self.admin)
            self.admin = None
            try:
                self._prepare_bind_dir()
                with _open_dir(run) as fd:
                    self.admin = self._bind(fd, admin, self.config.admin_access, None)
            except (OSError, StartupError) as e:
                log.error("cannot bind %s again: %s", admin, _why(e))
        node.check_ledgers()
        for name in node.repair_ledgers():
            self._close_env(name)
        for env in node.envs.values():
            path = Path(env.endpoint.removeprefix("ipc://"))
            if path.is_socket() and env.name in self.listeners:
                continue
            if env.name not in self._unbindable:
                log.error("%s was removed; binding it again", path)
            self._close_env(env.name)
            try:
                envdirs.ready(self.config, env.name)
                self._open_env(env)
            except (OSError, StartupError, ProtocolError) as e:
                # Said once; tried again at every sweep.
                if env.name not in self._unbindable:
                    log.error("cannot bind %s again: %s", path, e)
                self._unbindable.add(env.name)
            else:
                self._unbindable.discard(env.name)

    def _check_health(self) -> None:
        lost = lost_gpus(self.node.gpus)
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
            self._unwatch(("wait", w.wid))
            waited = now - w.enqueued
            self._send_later(
                w.reply_to,
                protocol.error(
                    Err.NO_RESOURCES,
                    f"no GPUs came free within the {waited:.1f}s this request was willing to wait",
                    w.reply_to[2],
                ),
            )
            if self.metrics is not None:
                self.metrics.waited(waited, "timeout")
        if node.queue_dirty:
            granted, failed = node.serve_queue()
            for w, task in granted:
                self._unwatch(("wait", w.wid))
                if self.metrics is not None:
                    self.metrics.waited(now - w.enqueued, "granted")
                self._watch(task)
                if task.task_id in node.tasks and not self._send_later(
                    w.reply_to,
                    protocol.reply("grant", w.reply_to[2], **views.grant(self.node, task)),
                ):
                    self._release(task.task_id, "undelivered")
            for w, e in failed:
                self._unwatch(("wait", w.wid))
                self._send_later(w.reply_to, protocol.error(e.code, e.message, w.reply_to[2]))
        for pos, w in enumerate(list(node.queue), 1):
            if w.told != pos:
                w.told = pos
                update = protocol.reply(
                    "queued", w.reply_to[2], position=pos, waiting=len(node.queue)
                )
                if not self._send_later(w.reply_to, update):
                    node.queue.drop(w.wid)
                    self._unwatch(("wait", w.wid))

    def _send_later(self, to: ReplyTo, msg: dict[str, Any]) -> bool:
        conn, envelope, _ = to
        sent = conn.send([*envelope, protocol.encode(msg)])
        self._settle(conn)
        return sent

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
            conn.send([*envelope, protocol.encode(protocol.error(Err.BUSY, conn.refusal, msg_id))])
            return
        started = time.perf_counter()
        out = self._dispatch(frames[-1], conn, envelope)
        if out is None:
            return
        if self.metrics is not None:
            self.metrics.served(
                "admin" if conn.env is None else "task", out, time.perf_counter() - started
            )
        if not conn.send([*envelope, protocol.encode(out)]):
            log.warning("reply to a vanished client dropped")
            if out["type"] == "grant":
                # Its sender is gone, and the pid read for it may already
                # name another process: the grant must not stand.
                self._release(out["task_id"], "undelivered")

    def _dispatch(self, frame: bytes, conn: Conn, envelope: list[bytes]) -> dict[str, Any] | None:
        msg_id = 0
        try:
            msg = protocol.decode(frame)
            msg_id = msg["id"]
            if conn.env is None:
                body = protocol.validate(msg, protocol.ADMIN_REQUESTS)
                return self._admin(msg["type"], msg_id, body)
            body = protocol.validate(msg, protocol.TASK_REQUESTS)
            return self._task(conn.env, msg["type"], msg_id, body, conn, envelope)
        except ProtocolError as e:
            return protocol.error(e.code, e.message, msg_id)
        except sqlite3.Error as e:
            # A quota or mode change is written before it is applied: nothing changed.
            why = cause(e, self.config.database)
            log.error("database error serving a request: %s", why)
            return protocol.error(
                Err.INTERNAL,
                f"nodemgr cannot use its database {self.config.database}: {why}",
                msg_id,
            )
        except Exception:
            log.exception("internal error serving a request")
            return protocol.error(Err.INTERNAL, "internal error in nodemgr; see its log", msg_id)

    # --- task endpoint -----------------------------------------------------------

    def _task(
        self,
        env: str,
        kind: str,
        msg_id: int,
        body: dict[str, Any],
        conn: Conn,
        envelope: list[bytes],
    ) -> dict[str, Any] | None:
        node = self.node
        if kind == "heartbeat":
            task = node.task(env, body["task_id"])
            task.last_seen = time.monotonic()
            if task.restored:
                self._reattach(task, conn)
            return protocol.reply("ack", msg_id, task_id=task.task_id)
        if kind == "request":
            return self._request(env, msg_id, body, conn, envelope)
        if kind == "quota":
            e = node.env(env)
            return protocol.reply("quota", msg_id, env=e.name, gpus=e.gpus, memory=e.memory)
        if kind == "yield":
            started = time.perf_counter()
            to = (conn, envelope, msg_id)
            task = node.task(env, body["task_id"])
            passed = node.slicing.yield_turn(task, started, body["iterations"], to)
            if passed is None:
                # Held until the task's other processes end the turn too: `held` now, the
                # `turn` reply later (_answer_yields).
                return protocol.reply("held", msg_id, task_id=body["task_id"])
            return protocol.reply("turn", msg_id, task_id=body["task_id"], passed=passed)
        # done
        task = node.task(env, body["task_id"])
        reason = "killed" if body["signal"] is not None else "done"
        self._release(task.task_id, reason, body["exit_code"])
        return protocol.reply("ack", msg_id, task_id=task.task_id)

    def _request(
        self,
        env: str,
        msg_id: int,
        body: dict[str, Any],
        conn: Conn,
        envelope: list[bytes],
    ) -> dict[str, Any]:
        node = self.node
        allowed = node.restriction(body["devices"])
        pid = conn.pid
        pid_start = process_start(pid) if pid is not None else None
        estimate = None
        if body["persistent"] is not None:
            estimate = (body["persistent"], body["temporary"] or 0)
        earlier = None
        if body["waited"] is not None:
            # Sent again by a client that lost its connection: never wait twice.
            earlier = node.queue.take(env, pid)
            if earlier is not None:
                self._unwatch(("wait", earlier.wid))
        try:
            task = node.grant(
                env,
                body["gpus"],
                body["memory"],
                pid,
                body["command"],
                pid_start,
                overtakes=node.queue.waiters,
                allowed=allowed,
                estimate=estimate,
                guard=body["guard"],
            )
        except ProtocolError as e:
            wait = min(body["wait"] or 0.0, self.config.max_wait)
            if e.code != Err.NO_RESOURCES or wait <= 0:
                raise
            w = node.queue.enqueue(
                env,
                body["gpus"],
                body["memory"],
                pid,
                pid_start,
                body["command"],
                wait,
                (conn, envelope, msg_id),
                allowed,
                estimate,
                body["guard"],
                body["waited"],
                earlier,
            )
            if pid is not None:
                try:
                    self._register(("wait", w.wid), os.pidfd_open(pid))
                except OSError:
                    node.queue.drop(w.wid)
                    raise e from None
            log.info("request from env %s waits (position %d): %s", env, w.told, e.message)
            return protocol.reply(
                "queued", msg_id, position=w.told, waiting=len(node.queue), reason=e.message
            )
        self._watch(task)
        return protocol.reply("grant", msg_id, **views.grant(self.node, task))

    def _reattach(self, task: Task, conn: Conn) -> None:
        """A restored task's client is back: from now on it is watched like any other."""
        task.restored = False
        pid = conn.pid
        if pid is not None and ("task", task.task_id) not in self.watched:
            task.pid = pid
            task.pid_start = process_start(pid)
            self.node.store.task_attached(task.task_id, pid, task.pid_start)
            self._watch(task)
        log.info("task %s re-attached (pid %s)", task.task_id, task.pid)

    def _register(self, what: Watched, fd: int) -> None:
        self.pidfds[fd] = what
        self.watched[what] = fd
        self.fds[fd] = what
        self.epoll.register(fd, select.EPOLLIN)

    def _watch(self, task: Task) -> None:
        if task.pid is None:
            return
        try:
            fd = os.pidfd_open(task.pid)
        except OSError as e:
            if e.errno == errno.ESRCH:
                self._release(task.task_id, "exited")
            return
        self._register(("task", task.task_id), fd)

    def _unwatch(self, what: Watched) -> None:
        fd = self.watched.pop(what, None)
        if fd is not None:
            self.epoll.unregister(fd)
            del self.pidfds[fd]
            del self.fds[fd]
            os.close(fd)

    def _release(self, task_id: str, reason: str, exit_code: int | None = None) -> None:
        self._unwatch(("task", task_id))
        if self.node.release(task_id, reason, exit_code) is not None:
            self._next_sweep = 0.0  # reap the task's processes' slots now
            if self.metrics is not None:
                self.metrics.reclaimed(reason)

    def _process_exited(self, fd: int) -> None:
        what = self.pidfds.get(fd)
        if what is None:
            return
        kind, key = what
        if kind == "task":
            self._release(str(key), "exited")
        else:
            self._unwatch(what)
            w = self.node.queue.drop(int(key))
            if w is not None:
                log.info("a waiting request from env %s went away with its client", w.env)

    def _kill_client(self, task: Task) -> None:
        """End a task's client so nothing keeps using memory that is given back; its
        command dies with it (gpushare-run sets PDEATHSIG)."""
        fd = self.watched.get(("task", task.task_id))
        if fd is not None:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(fd, signal.SIGKILL)

    def _reclaim_hung(self, task: Task) -> None:
        log.warning(
            "task %s sent no heartbeat for %.1fs", task.task_id, self.config.heartbeat_timeout
        )
        self._kill_client(task)
        self._release(task.task_id, "timeout")

    # --- admin endpoint ----------------------------------------------------------

    def _admin(self, kind: str, msg_id: int, body: dict[str, Any]) -> dict[str, Any]:
        node = self.node
        if kind == "quota_set":
            env = node.set_quota(body["env"], body["gpus"], body["memory"])
            self._open_env(env)
            over = [{"gpu": i, "used": used} for i, used in node.over_quota(env).items()]
            return protocol.reply("quota", msg_id, **views.quota(env), over=over)
        if kind == "quota_delete":
            return self._delete_env(body["env"], bool(body["force"]), msg_id)
        if kind == "reclaim":
            task = node.tasks.get(body["task_id"])
            if task is None:
                raise ProtocolError(Err.UNKNOWN_TASK, f"no running task {body['task_id']!r}")
            self._kill_client(task)
            self._release(task.task_id, "admin")
            return protocol.reply("reclaimed", msg_id, task_id=task.task_id, env=task.env)
        if kind in ("pause", "resume"):
            paused = kind == "pause"
            task = node.pause(body["task_id"], paused)
            return protocol.reply(
                "paused", msg_id, task_id=task.task_id, env=task.env, paused=paused
            )
        if kind == "mode":
            every = range(len(node.gpus))
            indices = list(every) if body["gpu"] is None else [node.gpu_index(body["gpu"])]
            if body["mode"] is not None:
                node.set_mode(indices, body["mode"])
            return protocol.reply("modes", msg_id, gpus=views.modes(node, indices))
        if kind == "history":
            limit = body["limit"] or 1000
            records = node.store.history(body["env"], body["since"], limit)
            return protocol.reply("history", msg_id, records=[r.view() for r in records])
        if kind == "queue":
            return protocol.reply("queue", msg_id, waiting=views.queue(node.queue))
        if kind == "quota_show":
            envs = [node.env(body["env"])] if body["env"] else list(node.envs.values())
            quotas = [views.quota(e) for e in sorted(envs, key=lambda e: e.name)]
            return protocol.reply("quotas", msg_id, quotas=quotas)
        if kind == "tasks":
            only = node.env(body["env"]).name if body["env"] else None
            return protocol.reply("tasks", msg_id, tasks=views.tasks(node, only))
        return protocol.reply("status", msg_id, **views.status(node))

    def _delete_env(self, name: str, force: bool, msg_id: int) -> dict[str, Any]:
        node = self.node
        env = node.env(name)
        tasks = [t for t in node.tasks.values() if t.env == name]
        held = sum(env.ledger.used(i) for i in range(len(node.gpus)))
        if (tasks or held) and not force:
            raise ProtocolError(
                Err.BUSY,
                f"environment {name!r} has {len(tasks)} running tasks and {held} bytes in use; "
                "wait for them, or delete with --force to end them",
            )
        for task in tasks:
            self._kill_client(task)
            self._release(task.task_id, "admin")
        for w in [w for w in node.queue if w.env == name]:
            node.queue.drop(w.wid)
            self._unwatch(("wait", w.wid))
            self._send_later(
                w.reply_to,
                protocol.error(Err.UNKNOWN_ENV, f"environment {name!r} was deleted", w.reply_to[2]),
            )
        self._close_env(name)
        node.delete_quota(name)
        return protocol.reply("deleted", msg_id, env=name, tasks_ended=len(tasks))

    # --- shutdown ----------------------------------------------------------------

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.stop()
        for what in list(self.fds.values()):
            if isinstance(what, Conn):
                self._drop(what)
        for fd in list(self.pidfds):
            os.close(fd)
        for listener in self._all_listeners():
            listener.sock.close()
        self.fds.clear()
        self.pidfds.clear()
        self.watched.clear()
        self.listeners.clear()
        self.admin = None
        self.epoll.close()
        self.node.close()
        self._unlock()
        log.info("nodemgr stopped")
