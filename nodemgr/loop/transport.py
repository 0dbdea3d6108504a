"""ZeroMQ's wire (ZMTP 3.0, NULL mechanism) on nodemgr's side of its sockets.

Clients connect libzmq DEALER (or REQ) sockets; nodemgr accepts and reads the connections
itself instead of through a libzmq ROUTER, for two reasons that matter on sockets every user
of an environment can reach:

- libzmq accepts in its own thread, with no cap, and aborts the whole process when
  ``accept`` meets the descriptor limit. Here every connection is accepted by the loop,
  counted (per environment, per client process, and against the descriptor limit) and
  refused with an answer beyond its cap.
- libzmq buffers a multipart message whole before the application sees a byte of it; only
  each frame's size can be bounded. Here a message is bounded in frames and in bytes as it
  arrives (protocol.MAX_FRAMES, protocol.MAX_MESSAGE_BYTES) and its sender's connection is
  dropped the moment it goes past either; replies that a client does not read are bounded
  too.

The msgpack maps inside the frames are protocol.py's; this module only moves frames.
"""

from __future__ import annotations

import socket
import struct

from gpushare.protocol import MAX_FRAMES, MAX_MESSAGE_BYTES

# Our greeting: signature (0xFF, 8 bytes of padding, 0x7F), version 3.0, mechanism NULL,
# as-server 0, filler. 3.0 rather than 3.1: nothing of 3.1 (PING, subscriptions as
# commands) is needed, and a 3.1 peer speaks 3.0 to us.
GREETING = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + bytes(32)
GREETING_SIZE = len(GREETING)

# Frame flags (ZMTP 3.0, section "Framing").
MORE = 0x01
LONG = 0x02
COMMAND = 0x04

# A command (READY, PING, ...) larger than this ends the connection: ours carry a socket type
# and at most a 255-byte identity, and libzmq's user metadata is not used by any client.
MAX_COMMAND_BYTES = 4096
# The peer socket types that talk to a ROUTER and that a client may use.
PEER_TYPES = frozenset({b"DEALER", b"REQ"})
# Bytes read from one connection per turn of the loop, so one busy sender cannot hold it.
READ_CHUNK = 64 * 1024


def _frame_header(flags: int, size: int) -> bytes:
    if size <= 255:
        return bytes((flags, size))
    return bytes((flags | LONG,)) + size.to_bytes(8, "big")


def _command(name: bytes, body: bytes = b"") -> bytes:
    data = bytes((len(name),)) + name + body
    return _frame_header(COMMAND, len(data)) + data


def _property(name: bytes, value: bytes) -> bytes:
    return bytes((len(name),)) + name + struct.pack(">I", len(value)) + value


READY = _command(b"READY", _property(b"Socket-Type", b"ROUTER"))


class ProtocolViolation(Exception):
    """What the peer sent is not ZMTP 3 from a DEALER or REQ socket, or breaks a limit."""


def _parse_ready(data: bytes) -> dict[bytes, bytes]:
    """The properties of a READY command's body (after its name)."""
    props: dict[bytes, bytes] = {}
    at = 0
    while at < len(data):
        n = data[at]
        name = data[at + 1 : at + 1 + n]
        at += 1 + n
        if at + 4 > len(data):
            raise ProtocolViolation("truncated READY property")
        (size,) = struct.unpack_from(">I", data, at)
        at += 4
        if at + size > len(data):
            raise ProtocolViolation("truncated READY property")
        props[name.lower()] = data[at : at + size]
        at += size
    return props


class Conn:
    """One accepted connection: its socket, who is on the other end, and the ZMTP state.

    ``receive`` returns the complete messages that have arrived, each a list of frames as
    the client sent them; ``send`` queues one. Both say False/raise nothing on a broken
    connection: ``closed`` becomes true and the loop drops it.
    """

    __slots__ = (
        "_count",
        "_frames",
        "_in",
        "_out",
        "_size",
        "_state",
        "close_when_sent",
        "closed",
        "deadline",
        "env",
        "fd",
        "out_limit",
        "pid",
        "readonly",
        "refusal",
        "sock",
        "uid",
        "watching_out",
    )

    def __init__(
        self,
        sock: socket.socket,
        env: str | None,
        pid: int | None,
        out_limit: int,
        deadline: float,
    ) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.env = env  # None: the admin endpoint
        self.readonly = False  # the read-only admin endpoint's: views only
        self.pid = pid
        self.uid: int | None = None  # the peer's (SO_PEERCRED), on view.sock
        self.out_limit = out_limit
        self.closed = False
        # Set when the connection is over a cap: its first request is answered with this
        # and the connection then closed.
        self.refusal: str | None = None
        self.close_when_sent = False
        # Until the handshake is done (or a refused connection is answered): the
        # monotonic time by which it must be, else the connection is dropped.
        self.deadline: float | None = deadline
        self.watching_out = False  # the loop's: whether it polls for writing
        self._in = bytearray()
        self._out = bytearray(GREETING + READY)
        self._state = 0  # 0: greeting, 1: READY, 2: traffic
        self._frames: list[bytes] = []
        self._size = 0
        self._count = 0
        self.flush()

    @property
    def wants_write(self) -> bool:
        return bool(self._out) and not self.closed

    @property
    def ready(self) -> bool:
        return self._state == 2

    def close(self) -> None:
        self.closed = True
        self._in.clear()
        self._out.clear()
        self._frames.clear()
        self.sock.close()

    def receive(self) -> list[list[bytes]]:
        """Read what has arrived (at most READ_CHUNK) and return the complete messages."""
        if self.closed:
            return []
        try:
            data = self.sock.recv(READ_CHUNK)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            self.closed = True
            return []
        if not data:
            self.closed = True
            return []
        self._in += data
        try:
            return self._parse()
        except ProtocolViolation:
            self.closed = True
            return []

    def _parse(self) -> list[list[bytes]]:
        buf = self._in
        at = 0
        out: list[list[bytes]] = []
        if self._state == 0:
            if len(buf) < GREETING_SIZE:
                # The signature is checked as soon as it is there: what is not ZMTP ends early.
                if len(buf) >= 10 and (buf[0] != 0xFF or not buf[9] & 1):
                    raise ProtocolViolation("not a ZMTP 3 greeting")
                return out
            if buf[0] != 0xFF or not buf[9] & 1 or buf[10] < 3:
                raise ProtocolViolation("not a ZMTP 3 greeting")
            if bytes(buf[12:32]).rstrip(b"\x00") != b"NULL":
                raise ProtocolViolation("only the NULL mechanism is spoken")
            at = GREETING_SIZE
            self._state = 1
        while True:
            if at + 2 > len(buf):
                break
            flags = buf[at]
            if flags & ~(MORE | LONG | COMMAND):
                raise ProtocolViolation("reserved frame flags set")
            if flags & LONG:
                if at + 9 > len(buf):
                    break
                size = int.from_bytes(buf[at + 1 : at + 9], "big")
                head = 9
            else:
                size = buf[at + 1]
                head = 2
            command = bool(flags & COMMAND)
            limit = MAX_COMMAND_BYTES if command else MAX_MESSAGE_BYTES - self._size
            if size > limit:
                # Before reading the frame: the whole point is never to hold it.
                raise ProtocolViolation("a frame beyond the message size limit")
            if not command and self._count + 1 > MAX_FRAMES:
                raise ProtocolViolation("a message of too many frames")
            if at + head + size > len(buf):
                break
            body = bytes(buf[at + head : at + head + size])
            at += head + size
            if command:
                self._command(body)
                continue
            if self._state != 2:
                raise ProtocolViolation("a message before READY")
            self._frames.append(body)
            self._size += size
            self._count += 1
            if not flags & MORE:
                out.append(self._frames)
                self._frames, self._size, self._count = [], 0, 0
        del buf[:at]
        return out

    def _command(self, body: bytes) -> None:
        if not body:
            raise ProtocolViolation("an empty command")
        name = body[1 : 1 + body[0]]
        if self._state == 1:
            if name != b"READY":
                raise ProtocolViolation("the first command is not READY")
            peer = _parse_ready(body[1 + body[0] :]).get(b"socket-type")
            if peer not in PEER_TYPES:
                raise ProtocolViolation(f"a {peer!r} socket cannot talk to a ROUTER")
            self._state = 2
            if self.refusal is None:
                self.deadline = None
            return
        if name == b"PING":
            # ZMTP 3.1 heartbeat, if a client turns them on: PONG echoes its context.
            ttl_context = body[1 + body[0] :]
            self.queue(_command(b"PONG", ttl_context[2:]))
        # Other commands (ERROR, SUBSCRIBE, ...) carry nothing for a ROUTER: ignored.

    def send(self, frames: list[bytes]) -> bool:
        """Queue one message and write what the socket takes now; False if it cannot go."""
        if self.closed:
            return False
        data = bytearray()
        last = len(frames) - 1
        for i, frame in enumerate(frames):
            data += _frame_header(MORE if i < last else 0, len(frame))
            data += frame
        return self.queue(bytes(data))

    def queue(self, data: bytes) -> bool:
        if len(self._out) + len(data) > self.out_limit:
            # A client that does not read its replies: it is dropped, not buffered for.
            self.closed = True
            return False
        self._out += data
        self.flush()
        return not self.closed

    def flush(self) -> None:
        while self._out and not self.closed:
            try:
                sent = self.sock.send(self._out)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # EPIPE, ECONNRESET: the client is gone
                self.closed = True
                return
            del self._out[:sent]
        if not self._out and self.close_when_sent:
            self.closed = True


def peer_cred(sock: socket.socket) -> tuple[int | None, int | None]:
    """The pid and uid of the process that connected ``sock``, from the kernel
    (SO_PEERCRED); None where it does not say."""
    try:
        cred = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None, None
    pid, uid, _ = struct.unpack("3i", cred)
    return (int(pid) if pid > 0 else None), (int(uid) if uid >= 0 else None)
