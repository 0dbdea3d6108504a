"""Every byte on gpushare's wire goes through this module (docs/protocol.md).

A message is one ZeroMQ frame holding a msgpack map: ``v`` (protocol
version), ``type``, ``id`` (chosen by the sender, echoed in the reply) and
the type's fields. This module holds the envelope, the limits and the error codes;
the messages themselves, each a class that validates its fields, are
gpushare.messages'. Every reply is a payload or ``{"type": "error", "error": CODE,
"message": TEXT}``. Unknown fields are tolerated, unknown types are answered with an
error.
"""

from __future__ import annotations

import re
import reprlib
from collections.abc import Mapping
from typing import Any

import msgpack

PROTOCOL_VERSION = 1
# A message: at most this many bytes in all its frames together, and this many frames.
# Beyond either, nodemgr drops the sender's connection without reading on (transport.py).
MAX_MESSAGE_BYTES = 64 * 1024
MAX_FRAMES = 8
# A reply may be larger: nodemgr drops a connection whose unread replies pass its endpoint's
# limit (connections.py), and a client reads one reply up to that size. A task endpoint's
# replies are a few KiB; the admin's `tasks` or `history` can be megabytes.
MAX_TASK_REPLY_BYTES = 1 << 20
MAX_ADMIN_REPLY_BYTES = 256 << 20

ENV_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
# A task id: what a ledger slot holds (shim/ledger_layout.h: GS_TASK_ID_LEN, less its NUL).
MAX_TASK_ID = 23
TASK_ID = re.compile(rf"^[A-Za-z0-9-]{{1,{MAX_TASK_ID}}}$")
MAX_GPUS_PER_REQUEST = 64
MAX_BYTES = (1 << 63) - 1
MAX_WAIT = 7 * 86400.0
MAX_HISTORY = 10000
MAX_GUARD = 1 << 40
# An environment's idle timeout (docs/nodemgr.md, "Idle tasks"): at most a week.
MAX_IDLE = 7 * 86400.0
# Why nodemgr reclaimed a task, as a `reclaimed` error's `reason` tells its client.
RECLAIM_REASONS = ("idle", "timeout", "admin", "deleted", "preempted")
# An operator's reason for `reclaim`, shown to the task's user: one line of printable text.
MAX_NOTE = 500
NOTE = re.compile(r"[^\x00-\x1f\x7f]+")
# What an idle policy does with an idle task (docs/nodemgr.md, "Idle tasks").
IDLE_ACTIONS = ("reclaim", "report")
# A GPU's mode (docs/timeslicing.md).
SHARED = "shared"
TIMESLICED = "timesliced"
MODES = (SHARED, TIMESLICED)
# A task's class (docs/scheduling.md, "Classes"): latency-sensitive or best-effort. The wire
# carries the short names; the long ones are what a user may also write (gpushare-run
# --class, GPUSHARE_CLASS, nodemgr quota set --class-default), normalised before the wire.
LS = "ls"
BE = "be"
CLASSES = (LS, BE)
CLASS_NAMES = {"ls": LS, "latency-sensitive": LS, "be": BE, "best-effort": BE}
CLASS_LONG = {LS: "latency-sensitive", BE: "best-effort"}


def task_class(value: str) -> str:
    """A class as a user wrote it (any case, short or long form) as the wire names it;
    ValueError naming the accepted forms."""
    found = CLASS_NAMES.get(value.strip().lower())
    if found is None:
        raise ValueError(
            f"{value!r} is not a task class: use ls (latency-sensitive) or be (best-effort)"
        )
    return found


# request.devices: a GPU index as nodemgr numbers them, or a GPU UUID or a prefix of one
# (at least "GPU-" and 4 more characters). Which GPU a name means is nodemgr.host.gpus.resolve's.
DEVICE_NAME = re.compile(r"[0-9]{1,9}|GPU-[0-9A-Fa-f-]{4,60}")


def names_gpu(name: str, index: int, uuid: str) -> bool:
    """Does a ``devices`` entry name this GPU: its index, or its UUID or the start of it,
    without regard to case? (nodemgr resolves requests with it, and the client checks a
    grant against its restriction with it.)"""
    if name.upper().startswith("GPU-"):
        return uuid.lower().startswith(name.lower())
    return name.isdigit() and int(name) == index


class Err:
    """Error codes a reply can carry."""

    BAD_REQUEST = "bad_request"
    UNSUPPORTED_VERSION = "unsupported_version"
    UNKNOWN_TYPE = "unknown_type"
    UNKNOWN_ENV = "unknown_env"
    UNKNOWN_TASK = "unknown_task"
    BUSY = "busy"
    NOT_PAUSABLE = "not_pausable"
    CLASS_NOT_ALLOWED = "class_not_allowed"
    QUOTA_ZERO = "quota_zero"
    QUOTA_EXCEEDED = "quota_exceeded"
    NO_RESOURCES = "no_resources"
    RECLAIMED = "reclaimed"
    FORBIDDEN = "forbidden"
    INTERNAL = "internal"

    RETRYABLE = frozenset({NO_RESOURCES})


class ProtocolError(Exception):
    """A message that cannot be served; becomes an error reply."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def message(kind: str, msg_id: int, fields: Mapping[str, Any]) -> dict[str, Any]:
    """The map a message of type ``kind`` travels as: the envelope, then its fields."""
    return {"v": PROTOCOL_VERSION, "type": kind, "id": msg_id, **fields}


def encode(msg: dict[str, Any]) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)  # type: ignore[no-any-return]


def envelope_ok(sizes: list[int]) -> bool:
    """Whether frames of these sizes, as the client sent them, are one request: at most an
    empty REQ delimiter, then one map. Anything else is dropped unread and unanswered: a
    reply echoes the envelope, and a request is one map."""
    return len(sizes) == 1 or (len(sizes) == 2 and sizes[0] == 0)


def decode(frame: bytes, limit: int = MAX_MESSAGE_BYTES) -> dict[str, Any]:
    """Unpack one frame of at most ``limit`` bytes (a request's, by default; a client
    reading replies passes its endpoint's reply limit) into a map with ``v``, ``type`` and
    ``id``; raise ProtocolError."""
    if len(frame) > limit:
        raise ProtocolError(Err.BAD_REQUEST, f"message larger than {limit} bytes")
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException):
        raise ProtocolError(Err.BAD_REQUEST, "not a msgpack message") from None
    if not isinstance(msg, dict):
        raise ProtocolError(Err.BAD_REQUEST, "a message must be a map")
    version = msg.get("v")
    if isinstance(version, bool) or not isinstance(version, int) or version != PROTOCOL_VERSION:
        # reprlib: a client's value, however deep or long, makes one short line
        # (repr of a ~1000-deep list raises RecursionError).
        raise ProtocolError(
            Err.UNSUPPORTED_VERSION,
            f"protocol version {reprlib.repr(version)} is not supported; this nodemgr speaks "
            f"{PROTOCOL_VERSION} (upgrade the client and nodemgr together)",
        )
    if not isinstance(msg.get("type"), str):
        raise ProtocolError(Err.BAD_REQUEST, "field 'type' must be a string")
    mid = msg.get("id", 0)
    if isinstance(mid, bool) or not isinstance(mid, int) or not 0 <= mid < 1 << 63:
        raise ProtocolError(Err.BAD_REQUEST, "field 'id' must be a non-negative integer")
    msg["id"] = mid
    return msg
