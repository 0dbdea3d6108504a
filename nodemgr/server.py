"""nodemgr's event loop: ZeroMQ sockets, process-exit descriptors and timers.

One ROUTER socket per environment (its path tells nodemgr which environment
a request comes from; the client's word is never asked) and one admin
socket only the operator can reach. The kernel names each task's client
process (SO_PEERCRED); a pidfd per task wakes the loop the moment that
process ends.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import signal
import socket
import struct
import time
from pathlib import Path
from typing import Any

import zmq

from nodemgr import __version__, protocol
from nodemgr.config import Config
from nodemgr.gpus import discover, sim_spec
from nodemgr.protocol import Err, ProtocolError
from nodemgr.state import Env, Node, Task

log = logging.getLogger("nodemgr")


class StartupError(Exception):
    pass


def peer_pid(frame: zmq.Frame) -> int | None:
    """The pid of the process on the other end of the ipc connection ``frame`` came in on."""
    try:
        fd = frame.get(zmq.SRCFD)
    except zmq.ZMQError:
        return None
    if not isinstance(fd, int) or fd < 0:
        return None
    try:
        with socket.socket(fileno=os.dup(fd)) as s:
            if s.family != socket.AF_UNIX:
                return None
            cred = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    pid = int(struct.unpack("3i", cred)[0])
    return pid if pid > 0 else None


class Server:
    def __init__(self, config: Config) -> None:
        self.config = config
        gpus, simulated = discover(config)
        self.node = Node(config, gpus, simulated)
        self.ctx = zmq.Context()
        self.poller = zmq.Poller()
        self.admin: zmq.Socket[bytes] | None = None
        self.env_socks: dict[zmq.Socket[bytes], str] = {}
        self.pidfds: dict[int, str] = {}  # pidfd -> task id
        self.task_pidfd: dict[str, int] = {}
        self._lock_fd = -1
        self._stop = False
        self._next_sweep = 0.0

    # --- set-up --------------------------------------------------------------

    def start(self) -> None:
        run = self.config.run_dir
        try:
            run.mkdir(parents=True, exist_ok=True, mode=0o711)
            (run / "envs").mkdir(exist_ok=True, mode=0o711)
        except OSError as e:
            raise StartupError(f"cannot create run directory {run}: {e.strerror}") from None
        self._lock_fd = os.open(run / "nodemgr.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES):
                raise StartupError(
                    f"another nodemgr is already running with run directory {run}"
                ) from None
            raise
        os.ftruncate(self._lock_fd, 0)
        os.write(self._lock_fd, f"{os.getpid()}\n".encode())
        self.admin = self._bind(run / "admin.sock")
        kind = "simulated" if self.node.simulated else "NVML"
        log.info(
            "nodemgr %s serving %d %s GPUs; admin endpoint %s",
            __version__,
            len(self.node.gpus),
            kind,
            self.config.admin_endpoint,
        )

    def _bind(self, path: Path) -> zmq.Socket[bytes]:
        path.unlink(missing_ok=True)
        sock: zmq.Socket[bytes] = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        # libzmq drops oversized frames before they are buffered whole.
        sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
        # A reply to a client that has gone raises instead of vanishing, so a
        # grant nobody received can be taken back.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # The socket appears with the umask's mode; keep it private from the start.
        old = os.umask(0o177)
        try:
            sock.bind(f"ipc://{path}")
        finally:
            os.umask(old)
        self.poller.register(sock, zmq.POLLIN)
        return sock

    def _open_env(self, env: Env) -> None:
        if env.name in self.env_socks.values():
            return
        sock = self._bind(Path(env.endpoint.removeprefix("ipc://")))
        self.env_socks[sock] = env.name

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
        events = dict(self.poller.poll(int(timeout * 1000)))
        # Process exits first: serving a message may close a pidfd and open a
        # new one under the same number, which a stale event must not end.
        for sock in events:
            if isinstance(sock, int):
                self._process_exited(sock)
        for sock in events:
            if isinstance(sock, int):
                continue
            if sock is self.admin and self.admin is not None:
                self._serve(self.admin, None)
            else:
                self._serve(sock, self.env_socks[sock])
        now = time.monotonic()
        for task in self.node.expired(now):
            self._reclaim_hung(task)
        if now >= self._next_sweep:
            self._next_sweep = now + self.config.sweep_interval
            for env in self.node.envs.values():
                if env.ledger.reap():
                    log.debug("reaped dead processes' slots in %s", env.name)
            self.node.settle_draining()

    def _serve(self, sock: zmq.Socket[bytes], env: str | None) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) < 2:
                continue
            envelope = [f.bytes for f in frames[:-1]]
            out = self._dispatch(frames[-1], env)
            try:
                sock.send_multipart([*envelope, protocol.encode(out)], zmq.NOBLOCK)
            except zmq.ZMQError as e:
                log.warning("reply to a vanished client dropped: %s", e)
                if out["type"] == "grant":
                    # Its sender is gone, and the pid read for it may already
                    # name another process: the grant must not stand.
                    self._release(out["task_id"], "undelivered")

    def _dispatch(self, frame: zmq.Frame, env: str | None) -> dict[str, Any]:
        msg_id = 0
        try:
            msg = protocol.decode(frame.bytes)
            msg_id = msg["id"]
            if env is None:
                body = protocol.validate(msg, protocol.ADMIN_REQUESTS)
                return self._admin(msg["type"], msg_id, body)
            body = protocol.validate(msg, protocol.TASK_REQUESTS)
            return self._task(env, msg["type"], msg_id, body, frame)
        except ProtocolError as e:
            return protocol.error(e.code, e.message, msg_id)
        except Exception:
            log.exception("internal error serving a request")
            return protocol.error(Err.INTERNAL, "internal error in nodemgr; see its log", msg_id)

    # --- task endpoint -----------------------------------------------------------

    def _task(
        self, env: str, kind: str, msg_id: int, body: dict[str, Any], frame: zmq.Frame
    ) -> dict[str, Any]:
        node = self.node
        if kind == "request":
            task = node.grant(env, body["gpus"], body["memory"], peer_pid(frame), body["command"])
            self._watch(task)
            return protocol.reply("grant", msg_id, **self._grant_view(task))
        task = node.task(env, body["task_id"])
        if kind == "heartbeat":
            task.last_seen = time.monotonic()
            return protocol.reply("ack", msg_id, task_id=task.task_id)
        # done
        self._release(task.task_id, "done")
        return protocol.reply("ack", msg_id, task_id=task.task_id)

    def _grant_view(self, task: Task) -> dict[str, Any]:
        node = self.node
        env = node.envs[task.env]
        chosen = [node.gpus[i] for i in task.gpus]
        return {
            "task_id": task.task_id,
            "env": env.name,
            "gpus": [
                {"index": g.index, "uuid": g.uuid, "name": g.name, "memory": g.memory}
                for g in chosen
            ],
            "memory_limit": env.memory,
            "ledger": str(env.ledger.path),
            "heartbeat_interval": self.config.heartbeat_interval,
            "heartbeat_timeout": self.config.heartbeat_timeout,
            "simulated": node.simulated,
            "sim_gpus": sim_spec(node.gpus) if node.simulated else None,
        }

    def _watch(self, task: Task) -> None:
        if task.pid is None:
            return
        try:
            fd = os.pidfd_open(task.pid)
        except OSError as e:
            if e.errno == errno.ESRCH:
                self._release(task.task_id, "died")
            return
        self.pidfds[fd] = task.task_id
        self.task_pidfd[task.task_id] = fd
        self.poller.register(fd, zmq.POLLIN)

    def _unwatch(self, task_id: str) -> None:
        fd = self.task_pidfd.pop(task_id, None)
        if fd is not None:
            self.poller.unregister(fd)
            del self.pidfds[fd]
            os.close(fd)

    def _release(self, task_id: str, reason: str) -> None:
        self._unwatch(task_id)
        if self.node.release(task_id, reason) is not None:
            self._next_sweep = 0.0  # reap the task's processes' slots now

    def _process_exited(self, fd: int) -> None:
        task_id = self.pidfds.get(fd)
        if task_id is not None:
            self._release(task_id, "died")

    def _reclaim_hung(self, task: Task) -> None:
        """No heartbeat within the timeout: end the task's client so nothing keeps using
        memory that is given back (its child dies with it), then reclaim."""
        log.warning(
            "task %s sent no heartbeat for %.1fs", task.task_id, self.config.heartbeat_timeout
        )
        if task.pid is not None and task.task_id in self.task_pidfd:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self.task_pidfd[task.task_id], signal.SIGKILL)
        self._release(task.task_id, "timeout")

    # --- admin endpoint ----------------------------------------------------------

    def _admin(self, kind: str, msg_id: int, body: dict[str, Any]) -> dict[str, Any]:
        node = self.node
        if kind == "quota_set":
            env = node.set_quota(body["env"], body["gpus"], body["memory"])
            self._open_env(env)
            return protocol.reply("quota", msg_id, **node.quota_view(env))
        if kind == "quota_show":
            envs = [node.env(body["env"])] if body["env"] else list(node.envs.values())
            quotas = [node.quota_view(e) for e in sorted(envs, key=lambda e: e.name)]
            return protocol.reply("quotas", msg_id, quotas=quotas)
        if kind == "tasks":
            only = node.env(body["env"]).name if body["env"] else None
            tasks = sorted(node.tasks.values(), key=lambda t: t.started)
            views = [node.task_view(t) for t in tasks if only is None or t.env == only]
            return protocol.reply("tasks", msg_id, tasks=views)
        return protocol.reply("status", msg_id, **node.status_view())

    # --- shutdown ----------------------------------------------------------------

    def close(self) -> None:
        for fd in list(self.pidfds):
            os.close(fd)
        self.pidfds.clear()
        self.task_pidfd.clear()
        for sock in [*self.env_socks, *([self.admin] if self.admin else [])]:
            sock.close(linger=0)
        self.env_socks.clear()
        self.admin = None
        self.ctx.term()
        self.node.close()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
        log.info("nodemgr stopped")
