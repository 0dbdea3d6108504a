"""A request/reply connection to a nodemgr endpoint, for the CLI and gpushare-run."""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import zmq
from zmq.utils.monitor import recv_monitor_message

from gpushare import paths, protocol
from gpushare.errors import GpushareError
from gpushare.messages import INTERIM, Ask, HeldReply, QueuedReply, R, Status, read_reply

# Seconds a client waits for nodemgr's first answer to a request, however long the request
# may then wait (a `queued` or `held` answer comes at once): nodemgr gone while its socket
# stays is reported this soon (docs/protocol.md).
FIRST_ANSWER = 5.0

T = TypeVar("T")

# The signals whose Python handlers may raise (SIGINT's KeyboardInterrupt, and the handlers
# gpushare-run installs).
_HELD_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP})


def _pending_check() -> None:
    """A Python call: the interpreter raises a signal's exception on entering one."""


@contextmanager
def _signals_held() -> Iterator[None]:
    """Hold the signals that raise while sockets are made or closed, in the main thread.

    An exception inside pyzmq between libzmq making a socket and the context tracking it
    (or the connection keeping it) leaves a socket nothing closes, and terminating the
    context then waits for it for ever. A signal that comes meanwhile stays pending and
    raises when the block ends, with every socket owned. Other threads are left alone:
    Python raises signal exceptions only in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD_SIGNALS)
    try:
        # One that came while the mask was being set raises here, before any socket.
        _pending_check()
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


class NodeError(GpushareError):
    """nodemgr answered with an error reply."""

    def __init__(self, code: str, message: str, retryable: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retryable = retryable


class QuotaZero(NodeError):
    """The environment's GPU quota is 0: the task may run on the CPU instead."""


class QuotaExceeded(NodeError):
    """The request can never be granted as things stand: fail at once."""


class NoResources(NodeError):
    """Not enough free GPUs now: the same request may succeed later (or wait)."""


class ClassNotAllowed(NodeError):
    """A latency-sensitive request from an environment that may not make one."""


class Reclaimed(NodeError):
    """A heartbeat's answer: nodemgr took the task's GPUs back. ``reason``: why
    (protocol.RECLAIM_REASONS, or a newer one); the message says what to do."""

    reason = ""


_ERRORS: dict[str, type[NodeError]] = {
    protocol.Err.RECLAIMED: Reclaimed,
    protocol.Err.QUOTA_ZERO: QuotaZero,
    protocol.Err.QUOTA_EXCEEDED: QuotaExceeded,
    protocol.Err.NO_RESOURCES: NoResources,
    protocol.Err.CLASS_NOT_ALLOWED: ClassNotAllowed,
}


def error_for(code: str, message: str, retryable: bool = False) -> NodeError:
    """The NodeError subclass for an error reply's code."""
    return _ERRORS.get(code, NodeError)(code, message, retryable)


class Unreachable(GpushareError):
    """No answer from nodemgr at the endpoint within the timeout."""


def _readable(read: Callable[[], T]) -> T:
    """What ``read`` makes of a reply; a reply it cannot read is nodemgr's error."""
    try:
        return read()
    except protocol.ProtocolError as e:
        raise NodeError(e.code, f"unreadable reply from nodemgr: {e.message}") from None


class Connection:
    """One DEALER socket; :meth:`send` sends a request and waits for its reply.
    ``max_reply``: the largest reply it reads, its endpoint's (protocol.MAX_TASK_REPLY_BYTES,
    or MAX_ADMIN_REPLY_BYTES for the admin endpoint)."""

    def __init__(
        self,
        endpoint: str,
        timeout: float = 5.0,
        max_reply: int = protocol.MAX_TASK_REPLY_BYTES,
    ) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self.max_reply = max_reply
        self._ids = itertools.count(1)
        # The socket was there when this connection was made, or nodemgr has answered on
        # it: it is connected, and keeps working after the socket's name is gone (an
        # environment deleted, whose clients' next heartbeat hears why).
        socket = paths.socket_of(endpoint)
        self._connected = socket is not None and os.path.exists(socket)
        with _signals_held():
            self._ctx = zmq.Context()
            self._sock = self._ctx.socket(zmq.DEALER)
        try:
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.SNDHWM, 64)
            self._sock.connect(endpoint)
        except zmq.ZMQError as e:
            self.close()
            raise Unreachable(f"bad nodemgr endpoint {endpoint!r}: {e}") from None
        except BaseException:  # interrupted: nothing would close the socket
            self.close()
            raise

    def close(self) -> None:
        """Close the connection's sockets, the monitor of a request that was interrupted
        included, and end its context: it waits for no socket left open."""
        with _signals_held():
            self._ctx.destroy(linger=0)

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(
        self,
        request: Ask[R],
        timeout: float | None = None,
        on_queued: Callable[[QueuedReply | HeldReply], None] | None = None,
        on_tick: Callable[[], None] | None = None,
        tick: float = 1.0,
        first_answer: float | None = None,
        resend: Callable[[], Ask[R]] | None = None,
        on_lost: Callable[[bool], None] | None = None,
    ) -> R:
        """Send ``request`` and return its reply, of the class the request is answered
        with; raise NodeError (a subclass by code; an unreadable reply is one too) or
        Unreachable. ``queued`` updates to a waiting request, and the ``held`` answer to a
        `yield` that waits for the task's other processes, go to ``on_queued`` (the call
        keeps waiting for the final reply within ``timeout``);
        ``on_tick`` is called every ``tick`` seconds without a message (a progress display).
        With ``first_answer``, no answer at all within that many seconds is Unreachable
        however long ``timeout`` is: a nodemgr that is gone while its socket stays is
        found out then, not at the end of a long wait.

        With ``resend``, a request that nodemgr has answered survives a restart of nodemgr:
        when the connection breaks, ``on_lost(True)`` is called and the call keeps waiting;
        when it is made again (a new nodemgr bound the socket), the request ``resend``
        returns is sent in its place, ``on_lost(False)`` is called, and the first answer to
        it is awaited as above (docs/protocol.md, "Restarts")."""

        def interim(msg: dict[str, Any]) -> None:
            if on_queued is not None:
                on_queued(_readable(lambda: INTERIM[msg["type"]].from_wire(msg)))

        def again() -> dict[str, Any]:
            assert resend is not None
            return resend().wire()

        msg = self._exchange(
            request.TYPE,
            request.wire(),
            timeout,
            interim,
            on_tick,
            tick,
            first_answer,
            again if resend is not None else None,
            on_lost,
        )
        return _readable(lambda: read_reply(request, msg))

    def call(
        self,
        kind: str,
        timeout: float | None = None,
        on_queued: Callable[[dict[str, Any]], None] | None = None,
        **fields: Any,
    ) -> dict[str, Any]:
        """Send a request of type ``kind`` made of ``fields`` as they are, and return its
        reply's map, envelope and all: the raw wire, for tests and tools that send what the
        message classes would not (unknown types and fields, values out of range). Errors,
        ``timeout`` and ``on_queued`` as for :meth:`send`, with maps."""
        return self._exchange(kind, fields, timeout, on_queued)

    def _exchange(
        self,
        kind: str,
        fields: dict[str, Any],
        timeout: float | None = None,
        on_interim: Callable[[dict[str, Any]], None] | None = None,
        on_tick: Callable[[], None] | None = None,
        tick: float = 1.0,
        first_answer: float | None = None,
        resend: Callable[[], dict[str, Any]] | None = None,
        on_lost: Callable[[bool], None] | None = None,
    ) -> dict[str, Any]:
        """Send one request and wait for its final reply's map (send's contract)."""
        path = paths.socket_of(self.endpoint)
        if path is not None and not self._connected:
            try:
                os.stat(path)
            except PermissionError:
                raise Unreachable(
                    f"no permission to reach the nodemgr socket {path} (its directory's and "
                    "socket's owner, group and mode come from nodemgr's config: env_defaults, "
                    "env.NAME)"
                ) from None
            except OSError:
                raise Unreachable(f"no nodemgr socket at {path}") from None
        msg_id = next(self._ids)
        try:
            # Never block: with nodemgr gone, queued messages would pile up to
            # the high-water mark and then hang the caller for good.
            self._sock.send(protocol.encode(protocol.message(kind, msg_id, fields)), zmq.NOBLOCK)
        except zmq.Again:
            raise Unreachable(f"nodemgr is not accepting messages at {self.endpoint}") from None
        monitor = None
        if resend is not None:
            with _signals_held():
                monitor = self._sock.get_monitor_socket(
                    zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
                )
        try:
            reply = self._wait(
                kind,
                msg_id,
                timeout,
                on_interim,
                on_tick,
                tick,
                first_answer,
                resend,
                on_lost,
                monitor,
            )
        except NodeError:
            self._connected = True
            raise
        finally:
            if monitor is not None:
                with _signals_held():
                    self._sock.disable_monitor()
                    monitor.close(linger=0)
        self._connected = True
        return reply

    def _wait(
        self,
        kind: str,
        msg_id: int,
        timeout: float | None,
        on_interim: Callable[[dict[str, Any]], None] | None,
        on_tick: Callable[[], None] | None,
        tick: float,
        first_answer: float | None,
        resend: Callable[[], dict[str, Any]] | None,
        on_lost: Callable[[bool], None] | None,
        monitor: zmq.Socket[bytes] | None,
    ) -> dict[str, Any]:
        limit = self.timeout if timeout is None else timeout
        sent = time.monotonic()
        deadline = sent + limit
        unanswered = first_answer is not None and first_answer < limit
        lost = False
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        if monitor is not None:
            poller.register(monitor, zmq.POLLIN)
        while True:
            now = time.monotonic()
            left = deadline - now
            if unanswered:
                assert first_answer is not None
                if now - sent >= first_answer:
                    raise Unreachable(
                        f"nodemgr did not answer at {self.endpoint} within {first_answer:g}s"
                    )
                left = min(left, sent + first_answer - now)
            if left <= 0:
                break
            step = min(left, tick) if on_tick is not None else left
            ready = dict(poller.poll(max(1, int(step * 1000))))
            if monitor is not None and monitor in ready:
                event = recv_monitor_message(monitor)["event"]
                if event == zmq.EVENT_DISCONNECTED and not lost:
                    # nodemgr went away (a restart): whatever it knew of the request is gone.
                    lost, unanswered = True, False
                    if on_lost is not None:
                        on_lost(True)
                elif event == zmq.EVENT_CONNECTED and lost:
                    assert resend is not None
                    lost = False
                    try:
                        again = protocol.message(kind, msg_id, resend())
                        self._sock.send(protocol.encode(again), zmq.NOBLOCK)
                    except zmq.Again:
                        raise Unreachable(
                            f"nodemgr is not accepting messages at {self.endpoint}"
                        ) from None
                    sent, unanswered = time.monotonic(), first_answer is not None
                    if on_lost is not None:
                        on_lost(False)
                continue
            if self._sock not in ready:
                if on_tick is not None and left > step:
                    on_tick()
                continue
            try:
                msg = protocol.decode(self._sock.recv(), self.max_reply)
            except protocol.ProtocolError as e:
                raise NodeError(e.code, f"unreadable reply from nodemgr: {e.message}") from None
            if msg.get("id") != msg_id:
                continue  # a late reply to an earlier request that timed out
            unanswered = False
            if msg["type"] == "error":
                err = error_for(
                    str(msg.get("error")), str(msg.get("message")), bool(msg.get("retryable"))
                )
                if isinstance(err, Reclaimed):
                    err.reason = str(msg.get("reason") or "")
                raise err
            if msg["type"] in INTERIM:
                if on_interim is not None:
                    on_interim(msg)
                continue
            return msg
        raise Unreachable(f"nodemgr did not answer at {self.endpoint} within {limit:g}s")


def wait_until_serving(endpoint: str, alive: Callable[[], bool], timeout: float) -> bool:
    """Ask nodemgr's admin ``endpoint`` for its status until it answers (True), or until
    ``alive()`` says the daemon that was started is gone or ``timeout`` seconds pass (False):
    how a program that starts nodemgr waits for it to serve."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with Connection(
                endpoint, timeout=0.5, max_reply=protocol.MAX_ADMIN_REPLY_BYTES
            ) as conn:
                conn.send(Status())
            return True
        except Unreachable:
            if not alive() or time.monotonic() > deadline:
                return False
            time.sleep(0.05)
