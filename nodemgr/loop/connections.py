"""nodemgr's sockets: the listeners (one per environment, one for the admin) and the
connections accepted on them, counted and capped (docs/protocol.md, "Transport").

Connections speak ZMTP through nodemgr.loop.transport; what their messages ask is the
server's (nodemgr.loop.server) to answer. The constants below are the caps docs/protocol.md
lists.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import os
import secrets
import select
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from gpushare import paths
from gpushare.paths import socket_path_problem
from gpushare.protocol import MAX_ADMIN_REPLY_BYTES, MAX_TASK_REPLY_BYTES, Err, ProtocolError
from nodemgr.config import ENV_SOCKET_FIX, Access, Config
from nodemgr.loop.transport import Conn, peer_cred
from nodemgr.node.model import Env

log = logging.getLogger("nodemgr")

# Connections (docs/protocol.md, "Transport"). An environment may hold at most
# MAX_CONNECTIONS_PER_ENV, and never more than half of what the descriptor limit leaves for
# connections, so another environment always gets in; one user on the read-only admin
# socket (view.sock) MAX_CONNECTIONS_PER_READER (a `nodemgr top` holds 1), no more than
# half either; one client process at most MAX_CONNECTIONS_PER_CLIENT on either (a
# gpushare-run holds 2 to 3). A connection beyond a cap gets a `busy` answer to its first
# request and is closed. The admin socket (admin.sock) is not capped: who may reach it may
# stop nodemgr anyway.
MAX_CONNECTIONS_PER_ENV = 4096
MAX_CONNECTIONS_PER_READER = 64
MAX_CONNECTIONS_PER_CLIENT = 16
# Connections being refused at once per environment (or view.sock user); beyond this one
# is closed unanswered.
MAX_REFUSING_PER_ENV = 16
# Descriptors kept out of the connections' share of the limit: the database, NVML, the
# metrics server, ledgers being re-made, pidfds opened while connections are at their cap.
FD_RESERVE = 256
# The share of the descriptors left beside FD_RESERVE that one environment's running tasks
# may hold at most (each holds a pidfd of its client): a quarter, whatever
# limits.tasks_per_env says, so that another environment always gets in.
TASK_SHARE = 4


def task_cap(tasks_per_env: int, nofile: int) -> int:
    """The running tasks one environment may hold: limits.tasks_per_env, or less where the
    descriptor limit ``nofile`` leaves less (docs/operations.md, "What a node can hold")."""
    return max(1, min(tasks_per_env, (nofile - FD_RESERVE) // TASK_SHARE))


# Seconds a connection has to finish the ZMTP handshake, and a refused one to be answered.
HANDSHAKE_TIMEOUT = 10.0
# Connections accepted per listener per turn of the loop.
ACCEPT_BATCH = 64

# Errors of accept() that mean "no descriptor or memory for one now", not "a bad peer".
_ACCEPT_EXHAUSTED = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


@dataclass(eq=False)
class Listener:
    """A listening socket: an environment's (env is its name) or the admin's (None);
    ``readonly``: the read-only admin socket's, which serves views only."""

    sock: socket.socket
    env: str | None
    path: Path
    # The socket file's (st_dev, st_ino): what remove_sockets may remove.
    ident: tuple[int, int] = (0, 0)
    readonly: bool = False

    @property
    def fd(self) -> int:
        return self.sock.fileno()

    @property
    def limited(self) -> bool:
        """Whether its connections are capped and wait at the descriptor budget: an
        environment's and view.sock's; the admin socket's are not."""
        return self.env is not None or self.readonly


def party(env: str | None, readonly: bool, uid: int | None) -> str | None:
    """Who a connection counts against for the caps: its environment, or on view.sock its
    user (``uid N``, never an environment's name: those have no space); None on the
    admin socket, which is not capped."""
    if env is not None:
        return env
    return f"uid {uid}" if readonly else None


def party_of(conn: Conn) -> str | None:
    return party(conn.env, conn.readonly, conn.uid)


@contextlib.contextmanager
def open_dir(path: Path) -> Iterator[int]:
    """A descriptor of the directory ``path`` (not of a link there) for the ``with``."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)


def describe(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return str(e)


# What a pidfd watches: a task's client, or the client of a waiting request.
Watched = tuple[str, str | int]
# How a reply reaches a requester later: its connection, envelope and message id.
ReplyTo = tuple[Conn, list[bytes], int]
# What each descriptor the loop polls is.
Polled = Listener | Conn | Watched


class Connections:
    """The listening sockets and the connections on them, all polled by the loop's
    ``epoll``; ``fds`` is the loop's map of what each descriptor is, shared with it."""

    def __init__(
        self,
        config: Config,
        epoll: select.epoll,
        fds: dict[int, Polled],
        envs: Mapping[str, Env],
        nofile: int,
    ) -> None:
        self.config = config
        self.epoll = epoll
        self.fds = fds
        self.envs = envs  # the node's environments: each holds a ledger's descriptor
        self.nofile = nofile
        self.admin: Listener | None = None
        self.readers: Listener | None = None
        self.listeners: dict[str, Listener] = {}
        self.conns = 0
        # Keyed by party(): an environment's name, or a view.sock user's "uid N".
        self.conns_of_env: collections.Counter[str] = collections.Counter()
        self.conns_of_client: collections.Counter[tuple[str, int]] = collections.Counter()
        self.refusing: collections.Counter[str] = collections.Counter()
        # Connections still in their handshake, or being refused: dropped at their deadline.
        self.young: set[Conn] = set()
        # Listeners not polled now: the limited ones, environments' and view.sock
        # (connections at the descriptor budget), or all (accept() found no descriptor);
        # polled again when one is free.
        self.paused_envs = False
        self.paused_admin = False
        self._pause_said = -60.0
        # Listeners not polled until the next sweep (retry_held): accepting on them failed.
        self.held: set[Listener] = set()
        self._bind_dir = config.run_dir / ".bind"
        self._binds = 0
        # Called with the cap's name for each connection refused over a cap; the metrics'.
        self.on_refused: Callable[[str], None] | None = None

    # --- listeners ---------------------------------------------------------------

    def bind_admin(self) -> None:
        """Serve the admin endpoint (run_dir/admin.sock). Raises OSError."""
        run = self.config.run_dir
        self._prepare_bind_dir()
        with open_dir(run) as fd:
            self.admin = self._bind(fd, run / paths.ADMIN_SOCKET, self.config.admin_access)

    def bind_readers(self) -> None:
        """Serve the read-only admin endpoint (run_dir/view.sock). Raises OSError."""
        run = self.config.run_dir
        with open_dir(run) as fd:
            self.readers = self._bind(
                fd, run / paths.VIEW_SOCKET, self.config.reader_access, readonly=True
            )

    def polled(self, listener: Listener) -> bool:
        """Whether ``listener`` is polled now (not paused)."""
        return not (self.paused_admin or (listener.limited and self.paused_envs))

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

    def _bind(
        self,
        dir_fd: int,
        path: Path,
        access: Access,
        env: str | None = None,
        readonly: bool = False,
    ) -> Listener:
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
            st = os.stat(private)
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
        listener = Listener(sock, env, path, (st.st_dev, st.st_ino), readonly)
        self.fds[listener.fd] = listener
        self.epoll.register(listener.fd, select.EPOLLIN if self.polled(listener) else 0)
        return listener

    def remove_sockets(self) -> None:
        """Remove every listener's socket file, at a clean stop: a client then finds no
        socket and says at once that nodemgr is not running, where a socket left behind
        would have it wait for an answer. Only a file that is still the one bound is
        removed (an environment's directory is its owner's), through its directory's
        descriptor; the listeners stay open."""
        for listener in self.all_listeners():
            path = listener.path
            with contextlib.suppress(OSError), open_dir(path.parent) as fd:
                st = os.stat(path.name, dir_fd=fd, follow_symlinks=False)
                if (st.st_dev, st.st_ino) == listener.ident:
                    os.unlink(path.name, dir_fd=fd)

    def unbind(self, listener: Listener) -> None:
        self.epoll.unregister(listener.fd)
        del self.fds[listener.fd]
        listener.sock.close()

    def open_env(self, env: Env) -> None:
        """Serve ``env`` on its socket. A socket that cannot be placed refuses this
        environment only (said in the log and to the operator's ``quota set``); the others
        go on, and a later ``quota set`` of it tries again."""
        if env.name in self.listeners:
            return
        path = Path(env.endpoint.removeprefix(paths.IPC))
        problem = socket_path_problem(path, f"environment {env.name}'s socket", ENV_SOCKET_FIX)
        if problem is not None:
            why = f"environment {env.name} refused: {problem}"
            log.error("%s", why)
            raise ProtocolError(Err.BAD_REQUEST, why)
        try:
            with open_dir(path.parent) as fd:
                listener = self._bind(fd, path, self.config.access_for(env.name), env=env.name)
        except OSError as e:
            why = f"environment {env.name} refused: cannot create its socket {path}: {describe(e)}"
            log.error("%s", why)
            raise ProtocolError(Err.INTERNAL, why) from None
        self.listeners[env.name] = listener

    def close_env(self, name: str) -> None:
        """Stop serving environment ``name``: its socket, and every connection to it."""
        for conn in self.unbind_env(name):
            self.drop(conn)

    def unbind_env(self, name: str) -> list[Conn]:
        """Close environment ``name``'s socket, so no new connection comes; its connections
        now, which stay open until dropped."""
        listener = self.listeners.pop(name, None)
        if listener is not None:
            self.unbind(listener)
        return [c for c in self.fds.values() if isinstance(c, Conn) and c.env == name]

    # --- connections -------------------------------------------------------------

    def limit(self) -> int:
        """Connections the descriptor limit leaves room for, beside everything else open."""
        others = len(self.fds) - self.conns + len(self.envs)  # + a ledger per env
        return max(0, self.nofile - FD_RESERVE - others)

    def accept(self, listener: Listener) -> None:
        env = listener.env
        for _ in range(ACCEPT_BATCH):
            if listener.limited and self.conns >= self.limit():
                self._pause(admin=False, why=f"{self.conns} connections open")
                return
            try:
                sock, _ = listener.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in _ACCEPT_EXHAUSTED:
                    self._pause(admin=True, why=describe(e))
                    return
                continue  # ECONNABORTED, EPROTO: that client gave up; the next may not
            sock.setblocking(False)
            pid, uid = peer_cred(sock)
            now = time.monotonic()
            out_limit = MAX_ADMIN_REPLY_BYTES if env is None else MAX_TASK_REPLY_BYTES
            who = party(env, listener.readonly, uid)
            refusal = None if who is None else self._over_cap(who, env is None, pid)
            if refusal is not None:
                assert who is not None
                if self.on_refused is not None:
                    self.on_refused(refusal[0])
                if self.refusing[who] >= MAX_REFUSING_PER_ENV:
                    sock.close()
                    continue
            conn = Conn(sock, env, pid, out_limit, now + HANDSHAKE_TIMEOUT)
            conn.readonly = listener.readonly
            conn.uid = uid
            self.fds[conn.fd] = conn
            self.conns += 1
            self.young.add(conn)
            if refusal is not None:
                assert who is not None
                conn.refusal = refusal[1]
                self.refusing[who] += 1
            elif who is not None:
                self.conns_of_env[who] += 1
                if pid is not None:
                    self.conns_of_client[who, pid] += 1
            self.epoll.register(conn.fd, select.EPOLLIN)
            self.settle(conn)

    def _over_cap(self, who: str, reader: bool, pid: int | None) -> tuple[str, str] | None:
        """(reason, message) when a new connection of ``who`` (party(): an environment,
        or with ``reader`` a view.sock user) from ``pid`` is over a cap."""
        most = MAX_CONNECTIONS_PER_READER if reader else MAX_CONNECTIONS_PER_ENV
        cap = min(most, max(1, self.limit() // 2))
        held = self.conns_of_env[who]
        if held >= cap and reader:
            return "reader", (
                f"user {who.removeprefix('uid ')} already has {held} connections open to "
                f"{self.config.run_dir / paths.VIEW_SOCKET}, the most one user may have ({cap}, "
                "MAX_CONNECTIONS_PER_READER); end the commands of theirs that hold them"
            )
        if held >= cap:
            return "env", (
                f"environment {who} already has {held} connections open to "
                f"nodemgr, the most one environment may have ({cap}); end processes of it that "
                "hold connections they do not use"
            )
        if pid is not None and self.conns_of_client[who, pid] >= MAX_CONNECTIONS_PER_CLIENT:
            return "client", (
                f"process {pid} already has {MAX_CONNECTIONS_PER_CLIENT} connections open to "
                "nodemgr, the most one process may have; close the ones it does not use"
            )
        return None

    def _pause(self, admin: bool, why: str) -> None:
        """Stop polling the listeners (the environments', or all) until a descriptor frees:
        a connection waits in its socket's backlog meanwhile, and nothing aborts."""
        if admin and not self.paused_admin:
            self.paused_admin = self.paused_envs = True
            what = f"cannot accept connections ({why}): waiting for one to close"
        elif not admin and not self.paused_envs:
            self.paused_envs = True
            what = (
                f"environments' connections at their share of the descriptor limit ({why}, "
                f"limit {self.nofile}): new ones wait until one closes"
            )
        else:
            return
        for listener in self.all_listeners():
            if admin or listener.limited:
                self.epoll.modify(listener.fd, 0)
        # Once a minute at most: accept() is tried again at every sweep while it fails.
        now = time.monotonic()
        if now >= self._pause_said + 60:
            self._pause_said = now
            log.warning("%s", what)

    def resume(self) -> None:
        if not (self.paused_admin or self.paused_envs):
            return
        envs = not (self.paused_envs and self.conns >= self.limit())
        if not envs and not self.paused_admin:
            return
        for listener in self.all_listeners():
            if not listener.limited or envs:
                self.epoll.modify(listener.fd, select.EPOLLIN)
        self.paused_admin = False
        self.paused_envs = not envs

    def hold(self, listener: Listener) -> None:
        """Stop polling ``listener`` until the next sweep: accepting on it failed, and
        its waiting connection, still there, must not end every wait until then."""
        if self.fds.get(listener.fd) is listener:
            self.epoll.modify(listener.fd, 0)
            self.held.add(listener)

    def retry_held(self) -> None:
        """Poll the listeners held (hold) again, unless paused (resume polls them then)."""
        for listener in self.held:
            if self.fds.get(listener.fd) is listener and self.polled(listener):
                self.epoll.modify(listener.fd, select.EPOLLIN)
        self.held.clear()

    def all_listeners(self) -> list[Listener]:
        admins = [x for x in (self.admin, self.readers) if x is not None]
        return [*self.listeners.values(), *admins]

    def settle(self, conn: Conn) -> None:
        """Drop ``conn`` if it broke, else poll it for writing exactly while it has output."""
        if conn.closed:
            self.drop(conn)
            return
        if conn.deadline is None:
            self.young.discard(conn)
        if conn.wants_write != conn.watching_out:
            conn.watching_out = conn.wants_write
            mask = select.EPOLLIN | (select.EPOLLOUT if conn.watching_out else 0)
            self.epoll.modify(conn.fd, mask)

    def drop(self, conn: Conn) -> None:
        if self.fds.get(conn.fd) is not conn:
            return
        self.epoll.unregister(conn.fd)
        del self.fds[conn.fd]
        self.conns -= 1
        self.young.discard(conn)
        who = party_of(conn)
        if conn.refusal is not None:
            assert who is not None
            self.refusing[who] -= 1
        elif who is not None:
            self.conns_of_env[who] -= 1
            if not self.conns_of_env[who]:
                del self.conns_of_env[who]
            if conn.pid is not None:
                self.conns_of_client[who, conn.pid] -= 1
                if not self.conns_of_client[who, conn.pid]:
                    del self.conns_of_client[who, conn.pid]
        conn.close()
        self.resume()

    def expire_young(self, now: float) -> None:
        """Drop connections that did not finish their handshake, or were not answered, in
        time: a connection that says nothing must not hold a descriptor for long."""
        for conn in list(self.young):
            if conn.deadline is None:
                self.young.discard(conn)
            elif now >= conn.deadline:
                self.drop(conn)
