"""gpushare's messages as types (docs/protocol.md): one frozen dataclass per request and
per reply of both endpoints.

Each field carries its own validator (``Annotated[type, check]``), so a class is the
schema of its message: nodemgr turns a request's map into its class (:func:`parse`), a
client turns a reply's map into the class its request is answered with
(:func:`read_reply`), and either writes a message as its map (:func:`encode`). A field
with a default may be left out of a map; one whose default is None may also be nil, and
with ``OMIT_NIL`` it is left out of the map when it is None. The envelope (``v``,
``type``, ``id``) and the error codes are gpushare.protocol's.
"""

from __future__ import annotations

import dataclasses
import re
import reprlib
from collections.abc import Callable, Mapping, Sequence
from typing import (
    Annotated,
    Any,
    ClassVar,
    Generic,
    NamedTuple,
    TypeVar,
    cast,
    get_args,
    get_origin,
    get_type_hints,
)

from gpushare import protocol
from gpushare.protocol import (
    CLASSES,
    DEVICE_NAME,
    ENV_NAME,
    IDLE_ACTIONS,
    MAX_BYTES,
    MAX_GPUS_PER_REQUEST,
    MAX_GUARD,
    MAX_HISTORY,
    MAX_IDLE,
    MAX_NOTE,
    MAX_TASK_ID,
    MAX_WAIT,
    MODES,
    NOTE,
    TASK_ID,
    Err,
    ProtocolError,
)

Check = Callable[[Any], Any]

# --- field validators: value -> cleaned value, or raise ValueError ------------------------


def _int(lo: int, hi: int) -> Check:
    def check(v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ValueError(f"must be an integer {lo}..{hi}")
        return v

    return check


def _number(lo: float, hi: float) -> Check:
    def check(v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, int | float) or not lo <= v <= hi:
            raise ValueError(f"must be a number {lo:g}..{hi:g}")
        return float(v)

    return check


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError("must be true or false")
    return v


def _str(pattern: re.Pattern[str] | None = None, max_len: int = 4096) -> Check:
    def check(v: Any) -> str:
        if not isinstance(v, str) or len(v) > max_len:
            raise ValueError(f"must be a string of at most {max_len} characters")
        # fullmatch: with match, the pattern's "$" also accepts a trailing newline.
        if pattern is not None and not pattern.fullmatch(v):
            raise ValueError(f"must match {pattern.pattern}")
        return v

    return check


def _devices(v: Any) -> list[str]:
    if not isinstance(v, list) or not 1 <= len(v) <= MAX_GPUS_PER_REQUEST:
        raise ValueError(f"must be a list of 1..{MAX_GPUS_PER_REQUEST} GPU names, or nil")
    for i, name in enumerate(v):
        if not isinstance(name, str) or not DEVICE_NAME.fullmatch(name):
            raise ValueError(
                f"entry {i} ({reprlib.repr(name)}) must be a GPU index as `nodemgr status` "
                "numbers them, or a GPU UUID (GPU-...) or a prefix of one of at least 8 "
                "characters; fix or unset CUDA_VISIBLE_DEVICES"
            )
    return list(v)


def _gpu(v: Any) -> int | str:
    """admin ``mode.gpu``, ``drain.gpu``: a node index, or a GPU UUID or a prefix of one."""
    if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < MAX_GPUS_PER_REQUEST:
        return v
    if isinstance(v, str) and DEVICE_NAME.fullmatch(v):
        return v
    raise ValueError("must be a GPU index or a GPU UUID (GPU-...), or nil: all")


def _one_of(*choices: str) -> Check:
    def check(v: Any) -> str:
        if v not in choices:
            raise ValueError("must be one of " + ", ".join(repr(c) for c in choices))
        return str(v)

    return check


def _optional(check: Check) -> Check:
    def opt(v: Any) -> Any:
        return None if v is None else check(v)

    return opt


ENV = _str(ENV_NAME, 64)
TASK = _str(TASK_ID, MAX_TASK_ID)
BYTES = _int(0, MAX_BYTES)


# Replies are nodemgr's: a client checks only the shapes it reads.
def _is(kind: type, name: str) -> Check:
    def check(v: Any) -> Any:
        # bool is an int to Python, never to msgpack.
        if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
            raise ValueError(f"must be {name}")
        return v

    return check


def _real(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ValueError("must be a number")
    return float(v)


def _list_of(item: Check, name: str) -> Check:
    def check(v: Any) -> list[Any]:
        if not isinstance(v, list):
            raise ValueError(f"must be a list of {name}")
        try:
            return [item(x) for x in v]
        except ValueError:
            raise ValueError(f"must be a list of {name}") from None

    return check


INT = _is(int, "an integer")
STR = _is(str, "a string")
BOOL = _bool
REAL = _real
MAP = _is(dict, "a map")
MAPS = _list_of(MAP, "maps")
INTS = _list_of(INT, "integers")
STRS = _list_of(STR, "strings")


class _OmitNil:
    """Marks a field that is left out of its message's map when it is None (``ack``'s
    ``warning``; ``request``'s ``waited``, sent only by a client that sends a request
    again)."""

    def __repr__(self) -> str:
        return "OMIT_NIL"


OMIT_NIL = _OmitNil()


class Field(NamedTuple):
    """A message field as the wire sees it."""

    name: str
    required: bool
    check: Check  # takes nil too where the field may be nil
    omit: bool  # left out of the map when None


_FIELDS: dict[type[Message], tuple[Field, ...]] = {}


def fields_of(cls: type[Message]) -> tuple[Field, ...]:
    """The wire fields of a message class, in order, from its annotations (read once)."""
    known = _FIELDS.get(cls)
    if known is not None:
        return known
    hints = get_type_hints(cls, include_extras=True)
    out = []
    for f in dataclasses.fields(cls):
        extras = getattr(hints[f.name], "__metadata__", ())
        checks = [x for x in extras if callable(x)]
        if len(checks) != 1:
            raise TypeError(f"{cls.__name__}.{f.name}: give it one validator (Annotated)")
        check = checks[0]
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if f.default is None:
            check = _optional(check)
        out.append(Field(f.name, required, check, OMIT_NIL in extras))
    _FIELDS[cls] = tuple(out)
    return _FIELDS[cls]


# name -> (required, validator)
Schema = dict[str, tuple[bool, Check]]


def schema(cls: type[Message]) -> Schema:
    """A message class's fields as name -> (required, validator): what the docs and the
    fuzzers check and generate messages from."""
    return {f.name: (f.required, f.check) for f in fields_of(cls)}


M = TypeVar("M", bound="Message")
R = TypeVar("R", bound="Message")


class Message:
    """A message of type ``TYPE``; subclasses are frozen, keyword-only dataclasses."""

    TYPE: ClassVar[str]
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    @classmethod
    def from_wire(cls: type[M], msg: Mapping[str, Any]) -> M:
        """The message in a decoded map (protocol.decode), each field checked; fields it
        does not define are ignored. Raise ProtocolError (bad_request)."""
        kind = cls.TYPE
        values: dict[str, Any] = {}
        for f in fields_of(cls):
            if f.name not in msg:
                if f.required:
                    raise ProtocolError(Err.BAD_REQUEST, f"{kind}: field {f.name!r} is required")
                continue
            try:
                values[f.name] = f.check(msg[f.name])
            except ValueError as e:
                raise ProtocolError(Err.BAD_REQUEST, f"{kind}: field {f.name!r} {e}") from None
        return cls(**values)

    def wire(self) -> dict[str, Any]:
        """The message's fields as its map carries them (without the envelope)."""
        out: dict[str, Any] = {}
        for f in fields_of(type(self)):
            value = getattr(self, f.name)
            if value is None and f.omit:
                continue
            out[f.name] = value
        return out


class Ask(Message, Generic[R]):
    """A request, answered with a ``REPLY`` (the class it is declared with: ``Ask[R]``)."""

    REPLY: ClassVar[type[Message]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for base in cls.__dict__.get("__orig_bases__", ()):
            origin = get_origin(base)
            if isinstance(origin, type) and issubclass(origin, Ask):
                (reply,) = get_args(base)
                if isinstance(reply, type):
                    cls.REPLY = reply


class TaskRequest(Ask[R]):
    """A request of the task endpoint (an environment's socket)."""


class AdminRequest(Ask[R]):
    """A request of the admin endpoint."""

    def is_view(self) -> bool:
        """Whether it only reads: all the read-only admin socket serves (docs/protocol.md,
        "Transport")."""
        return False


# --- replies -------------------------------------------------------------------------------

MapList = Annotated[Sequence[Mapping[str, Any]], MAPS]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ErrorReply(Message):
    """Any request's refusal: a code of protocol.Err, and one line for a person."""

    TYPE: ClassVar[str] = "error"
    error: Annotated[str, STR]
    message: Annotated[str, STR]
    retryable: Annotated[bool, BOOL] = False
    # `reclaimed`: why (protocol.RECLAIM_REASONS).
    reason: Annotated[str | None, STR, OMIT_NIL] = None

    @classmethod
    def of(cls, code: str, message: str, reason: str | None = None) -> ErrorReply:
        return cls(error=code, message=message, retryable=code in Err.RETRYABLE, reason=reason)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GrantReply(Message):
    TYPE: ClassVar[str] = "grant"
    task_id: Annotated[str, STR]
    env: Annotated[str, STR]
    gpus: MapList
    memory_limit: Annotated[int, INT]
    ledger: Annotated[str, STR]
    heartbeat_interval: Annotated[float, REAL]
    heartbeat_timeout: Annotated[float, REAL]
    simulated: Annotated[bool, BOOL] = False
    sim_gpus: Annotated[str | None, STR] = None
    # Left out by a nodemgr older than these fields.
    sim_state_dir: Annotated[str | None, STR] = None
    timesliced: Annotated[Sequence[int], INTS] = ()
    # The simulated device timeline's parameters by name, when it is on (nil: off).
    sim_timeline: Annotated[Mapping[str, Any] | None, MAP] = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class QueuedReply(Message):
    """Where a waiting `request` is in the queue (before its `grant` or error)."""

    TYPE: ClassVar[str] = "queued"
    position: Annotated[int, INT]
    waiting: Annotated[int, INT]
    reason: Annotated[str, STR] = ""  # a nodemgr older than it sends it in the first only


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeldReply(Message):
    """A `yield` waits for the task's other processes (before its `turn`)."""

    TYPE: ClassVar[str] = "held"
    task_id: Annotated[str, STR]


@dataclasses.dataclass(frozen=True, kw_only=True)
class AckReply(Message):
    TYPE: ClassVar[str] = "ack"
    task_id: Annotated[str, STR]
    warning: Annotated[str | None, STR, OMIT_NIL] = None
    notices: Annotated[Sequence[str] | None, STRS, OMIT_NIL] = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class TurnReply(Message):
    TYPE: ClassVar[str] = "turn"
    task_id: Annotated[str, STR]
    passed: Annotated[bool, BOOL]


@dataclasses.dataclass(frozen=True, kw_only=True)
class EstimateReply(Message):
    """The task endpoint's `estimate`: per GPU model of the node, a task's estimated step
    time (docs/prediction.md#step-time)."""

    TYPE: ClassVar[str] = "estimate"
    gpus: MapList


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuotaReply(Message):
    """The task endpoint's `quota`: its own environment's."""

    TYPE: ClassVar[str] = "quota"
    env: Annotated[str, STR]
    gpus: Annotated[int, INT]
    memory: Annotated[int, INT]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ViewReply(Message):
    TYPE: ClassVar[str] = "view"
    env: Annotated[str, STR]
    gpus: MapList
    waiting: Annotated[int, INT]
    mine: MapList = ()
    others: Annotated[int, INT] = 0
    # Left out by a nodemgr older than classes (docs/scheduling.md, "Classes").
    class_default: Annotated[str, STR] = "be"
    allow_ls: Annotated[bool, BOOL] = True
    running: MapList = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuotaSetReply(Message):
    """The admin `quota_set`'s `quota`: the environment's quota, as in `quotas`."""

    TYPE: ClassVar[str] = "quota"
    env: Annotated[str, STR]
    gpus: Annotated[int, INT]
    memory: Annotated[int, INT]
    endpoint: Annotated[str, STR]
    idle_timeout: Annotated[float, REAL]
    idle_action: Annotated[str, STR]
    idle_own: Annotated[bool, BOOL]
    over: MapList = ()
    # Left out by a nodemgr older than classes (docs/scheduling.md, "Classes").
    class_default: Annotated[str, STR] = "be"
    allow_ls: Annotated[bool, BOOL] = True
    compute: Annotated[int | None, INT] = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuotasReply(Message):
    TYPE: ClassVar[str] = "quotas"
    quotas: MapList


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeletedReply(Message):
    TYPE: ClassVar[str] = "deleted"
    env: Annotated[str, STR]
    tasks_ended: Annotated[int, INT]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TasksReply(Message):
    TYPE: ClassVar[str] = "tasks"
    tasks: MapList


@dataclasses.dataclass(frozen=True, kw_only=True)
class QueueReply(Message):
    TYPE: ClassVar[str] = "queue"
    waiting: MapList


@dataclasses.dataclass(frozen=True, kw_only=True)
class StatusReply(Message):
    TYPE: ClassVar[str] = "status"
    version: Annotated[str, STR]
    simulated: Annotated[bool, BOOL]
    uptime: Annotated[float, REAL]
    pid: Annotated[int, INT]
    envs: Annotated[int, INT]
    tasks: Annotated[int, INT]
    waiting: Annotated[int, INT]
    task_threshold: Annotated[int, INT]
    gpus: MapList
    bypass: Annotated[Mapping[str, Any], MAP]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModesReply(Message):
    TYPE: ClassVar[str] = "modes"
    gpus: MapList


@dataclasses.dataclass(frozen=True, kw_only=True)
class DrainsReply(Message):
    TYPE: ClassVar[str] = "drains"
    gpus: MapList


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReclaimedReply(Message):
    TYPE: ClassVar[str] = "reclaimed"
    task_id: Annotated[str, STR]
    env: Annotated[str, STR]


@dataclasses.dataclass(frozen=True, kw_only=True)
class PausedReply(Message):
    TYPE: ClassVar[str] = "paused"
    task_id: Annotated[str, STR]
    env: Annotated[str, STR]
    paused: Annotated[bool, BOOL]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SharedReply(Message):
    """The admin `share`'s reply: the task's share as asked and as in force, and the
    windows of every task on its GPUs (docs/compute.md)."""

    TYPE: ClassVar[str] = "shared"
    task_id: Annotated[str, STR]
    env: Annotated[str, STR]
    share: Annotated[int, INT]
    compute: Annotated[int | None, INT] = None
    windows: MapList
    notes: Annotated[Sequence[str], STRS] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class HistoryReply(Message):
    TYPE: ClassVar[str] = "history"
    records: MapList


# What a request may be answered with before its reply: `queued` (a waiting `request`),
# `held` (a `yield` waiting for the task's other processes).
INTERIM: dict[str, type[QueuedReply] | type[HeldReply]] = {
    QueuedReply.TYPE: QueuedReply,
    HeldReply.TYPE: HeldReply,
}

# --- task endpoint ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Request(TaskRequest[GrantReply]):
    """GPUs for a task; answered `grant`, or `queued` while it waits."""

    TYPE: ClassVar[str] = "request"
    gpus: Annotated[int, _int(1, MAX_GPUS_PER_REQUEST)]
    memory: Annotated[int | None, BYTES] = None
    command: Annotated[str | None, _str(max_len=4096)] = None
    wait: Annotated[float | None, _number(0.0, MAX_WAIT)] = None
    devices: Annotated[list[str] | None, _devices] = None
    persistent: Annotated[int | None, BYTES] = None
    temporary: Annotated[int | None, BYTES] = None
    guard: Annotated[int | None, _int(0, MAX_GUARD)] = None
    # Percent of its GPUs' time (docs/compute.md); nil: none.
    compute: Annotated[int | None, _int(1, 100), OMIT_NIL] = None
    wrapper: Annotated[bool | None, _bool, OMIT_NIL] = None
    waited: Annotated[float | None, _number(0.0, MAX_WAIT), OMIT_NIL] = None
    # "ls" or "be" (docs/scheduling.md, "Classes"); nil: the environment's default.
    task_class: Annotated[str | None, _one_of(*CLASSES), OMIT_NIL] = None
    # A latency-sensitive task's target (docs/compute.md, "Elastic share"): seconds per
    # iteration, or a deadline (seconds from its grant) for a run of `steps` iterations.
    step_target: Annotated[float | None, _number(0.001, 3600.0), OMIT_NIL] = None
    deadline: Annotated[float | None, _number(1.0, MAX_WAIT), OMIT_NIL] = None
    steps: Annotated[int | None, _int(1, (1 << 53) - 1), OMIT_NIL] = None
    # Its predicted peak per GPU, bytes (gpushare-run --shape predicted; docs/prediction.md):
    # on a shared GPU it is granted that plus prediction.margin, not the whole quota.
    predicted: Annotated[int | None, BYTES, OMIT_NIL] = None
    # Its dry run's features per iteration (docs/prediction.md#step-time), for nodemgr's
    # step time and utilisation estimate: the first four all or none; the others only
    # with them, each where the dry run measured it.
    kernels_per_step: Annotated[float | None, _number(0.0, 1e12), OMIT_NIL] = None
    host_bytes_per_step: Annotated[float | None, _number(0.0, 1e18), OMIT_NIL] = None
    device_bytes_per_step: Annotated[float | None, _number(0.0, 1e18), OMIT_NIL] = None
    host_step: Annotated[float | None, _number(0.0, 3600.0), OMIT_NIL] = None
    waves_per_step: Annotated[float | None, _number(0.0, 1e15), OMIT_NIL] = None
    flops_per_step: Annotated[float | None, _number(0.0, 1e21), OMIT_NIL] = None
    half_flops_per_step: Annotated[float | None, _number(0.0, 1e21), OMIT_NIL] = None
    op_bytes_per_step: Annotated[float | None, _number(0.0, 1e21), OMIT_NIL] = None

    @property
    def estimate(self) -> tuple[int, int] | None:
        """Its shape on time-sliced GPUs (persistent, temporary); ``temporary`` counts only
        with ``persistent``."""
        if self.persistent is None:
            return None
        return (self.persistent, self.temporary or 0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Yield(TaskRequest[TurnReply]):
    TYPE: ClassVar[str] = "yield"
    task_id: Annotated[str, TASK]
    iterations: Annotated[int | None, _int(0, (1 << 63) - 1)] = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Heartbeat(TaskRequest[AckReply]):
    TYPE: ClassVar[str] = "heartbeat"
    task_id: Annotated[str, TASK]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Done(TaskRequest[AckReply]):
    TYPE: ClassVar[str] = "done"
    task_id: Annotated[str, TASK]
    exit_code: Annotated[int | None, _int(-(1 << 31), (1 << 31) - 1)] = None
    signal: Annotated[int | None, _int(1, 128)] = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Quota(TaskRequest[QuotaReply]):
    TYPE: ClassVar[str] = "quota"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Estimate(TaskRequest[EstimateReply]):
    """A dry run's features: what a task of ``command`` would take per iteration on each
    GPU model of the node (docs/prediction.md#step-time). Grants nothing."""

    TYPE: ClassVar[str] = "estimate"
    command: Annotated[str | None, _str(max_len=4096)] = None
    kernels_per_step: Annotated[float, _number(0.0, 1e12)]
    host_bytes_per_step: Annotated[float, _number(0.0, 1e18)]
    device_bytes_per_step: Annotated[float, _number(0.0, 1e18)]
    host_step: Annotated[float, _number(0.0, 3600.0)]
    waves_per_step: Annotated[float | None, _number(0.0, 1e15), OMIT_NIL] = None
    flops_per_step: Annotated[float | None, _number(0.0, 1e21), OMIT_NIL] = None
    half_flops_per_step: Annotated[float | None, _number(0.0, 1e21), OMIT_NIL] = None
    op_bytes_per_step: Annotated[float | None, _number(0.0, 1e21), OMIT_NIL] = None


# A dry run's features per iteration, as `request` and `estimate` carry them
# (docs/prediction.md#step-time), in nodemgr.policy.steptime.Features' order: kernel
# launches, bytes over the host link, bytes within the device, the host's seconds (these
# four always together), then waves of blocks, 32-bit and 16-bit floating-point
# operations and the operators' bytes (each where the dry run measured it).
FEATURE_FIELDS = (
    "kernels_per_step",
    "host_bytes_per_step",
    "device_bytes_per_step",
    "host_step",
    "waves_per_step",
    "flops_per_step",
    "half_flops_per_step",
    "op_bytes_per_step",
)
REQUIRED_FEATURES = FEATURE_FIELDS[:4]
# The SMs of the dry run's GPU, over which `waves_per_step` counts waves: the simulated
# driver's default device's (sim/sim_attrs.c; a test holds the two together).
DRY_RUN_SMS = 132

Features = tuple[float | None, ...]


def features_of(m: Request | Estimate) -> Features | None:
    """The features a message carries, in FEATURE_FIELDS' order (None for one it does not
    carry); None unless it carries the first four."""
    values = tuple(getattr(m, name) for name in FEATURE_FIELDS)
    if any(v is None for v in values[: len(REQUIRED_FEATURES)]):
        return None
    return tuple(None if v is None else float(v) for v in values)


@dataclasses.dataclass(frozen=True, kw_only=True)
class View(TaskRequest[ViewReply]):
    TYPE: ClassVar[str] = "view"


# --- admin endpoint --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuotaSet(AdminRequest[QuotaSetReply]):
    TYPE: ClassVar[str] = "quota_set"
    env: Annotated[str, ENV]
    gpus: Annotated[int | None, _int(0, MAX_GPUS_PER_REQUEST)] = None
    memory: Annotated[int | None, BYTES] = None
    force: Annotated[bool | None, _bool] = None
    # The environment's task classes (docs/scheduling.md, "Classes"); nil: unchanged.
    class_default: Annotated[str | None, _one_of(*CLASSES), OMIT_NIL] = None
    allow_ls: Annotated[bool | None, _bool, OMIT_NIL] = None
    # The cap on each task's compute share, percent; 0 clears it; nil: unchanged.
    compute: Annotated[int | None, _int(0, 100), OMIT_NIL] = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuotaShow(AdminRequest[QuotasReply]):
    TYPE: ClassVar[str] = "quota_show"
    env: Annotated[str | None, ENV] = None

    def is_view(self) -> bool:
        return True


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuotaDelete(AdminRequest[DeletedReply]):
    TYPE: ClassVar[str] = "quota_delete"
    env: Annotated[str, ENV]
    force: Annotated[bool | None, _bool] = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tasks(AdminRequest[TasksReply]):
    TYPE: ClassVar[str] = "tasks"
    env: Annotated[str | None, ENV] = None

    def is_view(self) -> bool:
        return True


@dataclasses.dataclass(frozen=True, kw_only=True)
class Queue(AdminRequest[QueueReply]):
    TYPE: ClassVar[str] = "queue"
    env: Annotated[str | None, ENV] = None

    def is_view(self) -> bool:
        return True


@dataclasses.dataclass(frozen=True, kw_only=True)
class Status(AdminRequest[StatusReply]):
    TYPE: ClassVar[str] = "status"

    def is_view(self) -> bool:
        return True


@dataclasses.dataclass(frozen=True, kw_only=True)
class Mode(AdminRequest[ModesReply]):
    TYPE: ClassVar[str] = "mode"
    gpu: Annotated[int | str | None, _gpu, OMIT_NIL] = None
    mode: Annotated[str | None, _one_of(*MODES), OMIT_NIL] = None

    def is_view(self) -> bool:
        return self.mode is None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Drain(AdminRequest[DrainsReply]):
    TYPE: ClassVar[str] = "drain"
    gpu: Annotated[int | str | None, _gpu, OMIT_NIL] = None
    drained: Annotated[bool | None, _bool, OMIT_NIL] = None

    def is_view(self) -> bool:
        return self.drained is None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Reclaim(AdminRequest[ReclaimedReply]):
    TYPE: ClassVar[str] = "reclaim"
    task_id: Annotated[str, TASK]
    reason: Annotated[str | None, _str(NOTE, MAX_NOTE)] = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class IdleSet(AdminRequest[QuotasReply]):
    TYPE: ClassVar[str] = "idle_set"
    env: Annotated[str, ENV]
    idle_timeout: Annotated[float | None, _number(0.0, MAX_IDLE)] = None
    idle_action: Annotated[str | None, _one_of(*IDLE_ACTIONS)] = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Pause(AdminRequest[PausedReply]):
    TYPE: ClassVar[str] = "pause"
    task_id: Annotated[str, TASK]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Resume(AdminRequest[PausedReply]):
    TYPE: ClassVar[str] = "resume"
    task_id: Annotated[str, TASK]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Share(AdminRequest[SharedReply]):
    """Change a running task's compute share (docs/compute.md); nil clears it."""

    TYPE: ClassVar[str] = "share"
    task_id: Annotated[str, TASK]
    compute: Annotated[int | None, _int(1, 100)] = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class History(AdminRequest[HistoryReply]):
    TYPE: ClassVar[str] = "history"
    env: Annotated[str | None, ENV] = None
    since: Annotated[float | None, _number(0.0, 1e11)] = None
    limit: Annotated[int | None, _int(1, MAX_HISTORY)] = None

    def is_view(self) -> bool:
        return True


# What each endpoint serves, by type.
_TASK: tuple[type[TaskRequest[Any]], ...] = (
    Request,
    Yield,
    Heartbeat,
    Done,
    Quota,
    View,
    Estimate,
)
TASK_REQUESTS = {cls.TYPE: cls for cls in _TASK}
_ADMIN: tuple[type[AdminRequest[Any]], ...] = (
    QuotaSet,
    QuotaShow,
    QuotaDelete,
    Tasks,
    Queue,
    Status,
    Mode,
    Drain,
    Reclaim,
    IdleSet,
    Pause,
    Resume,
    Share,
    History,
)
ADMIN_REQUESTS = {cls.TYPE: cls for cls in _ADMIN}


def parse(msg: Mapping[str, Any], table: Mapping[str, type[M]]) -> M:
    """The request in a decoded map (protocol.decode) of a type ``table`` serves; raise
    ProtocolError (unknown_type, bad_request)."""
    kind = msg["type"]
    cls = table.get(kind)
    if cls is None:
        raise ProtocolError(
            Err.UNKNOWN_TYPE,
            f"unknown message type {reprlib.repr(kind)}; this endpoint accepts: "
            + ", ".join(sorted(table)),
        )
    return cls.from_wire(msg)


def read_reply(request: Ask[R], msg: Mapping[str, Any]) -> R:
    """The reply to ``request`` in a decoded map that is neither an error nor INTERIM;
    raise ProtocolError (bad_request) when it is not what the request is answered with."""
    cls = request.REPLY
    if msg["type"] != cls.TYPE:
        raise ProtocolError(
            Err.BAD_REQUEST,
            f"{request.TYPE} answered with {reprlib.repr(msg['type'])}, not {cls.TYPE!r}",
        )
    return cast(R, cls.from_wire(msg))


def to_map(message: Message, msg_id: int) -> dict[str, Any]:
    """``message`` as the map that carries it, envelope and all."""
    return protocol.message(message.TYPE, msg_id, message.wire())


def encode(message: Message, msg_id: int) -> bytes:
    return protocol.encode(to_map(message, msg_id))
