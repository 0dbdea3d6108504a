"""The preloaded shim, from Python: switch it from inert to enforcing a grant, and
report iteration boundaries to it (docs/timeslicing.md).

In the recommended container setup ``libgpushare.so`` is preloaded into every
process with no ledger named, so it passes every CUDA call through. A plugin
that has obtained a grant from nodemgr calls :func:`attach` with the grant's
ledger and task id before the framework first calls into CUDA; from then on
the process is enforced as if gpushare-run had started it.

Only this process, and the children it forks, are attached: a program it
executes starts inert unless ``GPUSHARE_LEDGER`` and ``GPUSHARE_TASK_ID`` are
in that program's environment.

Time slicing: :func:`iteration` is called at the end of every training step
and answers what the caller must do (:data:`RELEASE`, :data:`YIELD` bits);
:func:`released`, :func:`mark_persistent` and :func:`memory` go with it. In a
process without the shim, or with an inert one, they do nothing.

The functions are looked up in the process's global symbol namespace, where a
preloaded shim defines them: asking never loads the shim. The declarations
are parsed on first use (cffi's parser costs some tens of milliseconds once).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from cffi import FFI

from gpushare._shim_cdef import CDEF
from gpushare.errors import GpushareError

Mode = Literal["inert", "enforce", "broken"]

_MODES: dict[int, Mode] = {0: "inert", 1: "enforce", 2: "broken"}


# What iteration() asks of its caller (gpushare.h, enum gpushare_iteration_flags).
RELEASE = 1  # release the framework's cached memory, then call released()
YIELD = 2  # the task's turn is over: after the release, send `yield` to nodemgr


class ShimError(GpushareError):
    """A call into the shim failed; the process is as it was before the call."""


class ShimNotLoaded(ShimError):
    """No gpushare shim in this process, so nothing can enforce a grant here."""


class ShimTooLate(ShimError):
    """The process called into the CUDA driver before the attach: too late to enforce."""


class ShimAlreadyAttached(ShimError):
    """The shim already enforces a ledger, or was started with an unusable one."""


class ShimLedgerError(ShimError):
    """The ledger cannot be opened or mapped, or is not of this shim's version."""


@functools.cache
def _namespace() -> tuple[Any, Any]:
    """The process's global symbols (dlopen(NULL)) declared with the shim's API; the
    FFI is kept with them, since the library object must not outlive it."""
    ffi = FFI()
    ffi.cdef(CDEF)
    return ffi, ffi.dlopen(None)


def _entry(name: str) -> Any | None:
    try:
        return getattr(_namespace()[1], name)
    except AttributeError:  # cffi's answer to a symbol dlsym cannot find
        return None


def loaded() -> bool:
    """Whether a gpushare shim is loaded (preloaded) in this process. Never loads it."""
    return _entry("gpushare_attach") is not None


_NOT_LOADED = (
    "gpushare's shim (libgpushare.so) is not loaded in this process, so no grant can be "
    "enforced here: start the process with the shim in LD_PRELOAD (the container image "
    "should set it for every process), or run the program under gpushare-run"
)


def mode() -> Mode:
    """The shim's mode: ``inert`` (passes every call through), ``enforce``, or ``broken``
    (started with a ledger it cannot use: its GPU allocations fail)."""
    fn = _entry("gpushare_mode")
    if fn is None:
        raise ShimNotLoaded(_NOT_LOADED)
    m = int(fn())
    if m not in _MODES:
        raise ShimError(f"the shim reports mode {m}, which this gpushare release does not know")
    return _MODES[m]


def _ledger_problem(path: str) -> str:
    """Why the file at ``path`` may be unusable as a ledger, in a few words."""
    try:
        os.stat(path)
    except OSError as e:
        return e.strerror or str(e)
    try:
        read_only = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    if read_only:
        return (
            f"on a read-only mount: mount {os.path.dirname(path) or '.'} read-write "
            "(docs/containers.md)"
        )
    if not os.access(path, os.R_OK | os.W_OK):
        return "not readable and writable by this process"
    return "not a gpushare ledger of this shim's version"


def attach(ledger: str | os.PathLike[str], task_id: str) -> None:
    """Make the shim enforce the grant whose ledger is at ``ledger``, charging this
    process's allocations to ``task_id``. Call it before the first CUDA call.

    Raises a :class:`ShimError`; the subclasses say which way it failed. On any
    failure the process stays as it was (an inert shim stays inert).
    """
    path = os.fspath(ledger)
    if "\0" in path or "\0" in task_id:
        raise ShimError("a ledger path or task id with a NUL character cannot be passed on")
    attach_fn = _entry("gpushare_attach")
    if attach_fn is None:
        raise ShimNotLoaded(_NOT_LOADED)
    lib = _namespace()[1]
    rc = int(attach_fn(os.fsencode(path), task_id.encode()))
    if rc == lib.GPUSHARE_OK:
        return
    if rc == lib.GPUSHARE_E_TOO_LATE:
        raise ShimTooLate(
            "this process called into the CUDA driver before the shim was attached, so "
            "memory it may hold is unknown to the shim: attach before the framework "
            "first uses CUDA, or run the program under gpushare-run"
        )
    if rc == lib.GPUSHARE_E_ATTACHED:
        if mode() == "broken":
            raise ShimAlreadyAttached(
                "the shim was started with GPUSHARE_LEDGER naming a ledger it cannot use "
                "(it said why on stderr) and refuses GPU allocations: start the process "
                "without that setting, or under gpushare-run"
            )
        raise ShimAlreadyAttached(
            "the shim in this process already enforces a grant (the process was started "
            "under gpushare-run, or attach was called before): keep that grant rather than "
            "attaching another"
        )
    if rc == lib.GPUSHARE_E_LEDGER:
        raise ShimLedgerError(
            f"ledger {path} cannot be used ({_ledger_problem(path)}): pass the ledger path "
            "of the grant nodemgr sent, from a nodemgr of the same gpushare release; the "
            "process stays unenforced"
        )
    if rc == lib.GPUSHARE_E_INVAL:
        raise ShimError(
            f"the shim refused ledger {path!r} with task id {task_id!r}: both must be "
            "non-empty, and the task id at most 23 bytes"
        )
    raise ShimError(f"the shim answered {rc}, which this gpushare release does not know")


def _zero() -> int:
    return 0


@functools.cache
def _iteration_fn() -> Callable[[], int]:
    """gpushare_iteration, looked up once: iteration() runs at every training step."""
    fn = _entry("gpushare_iteration")
    return _zero if fn is None else fn


def prepare() -> None:
    """Parse the declarations and look the iteration entry points up now (tens of
    milliseconds, once), so that a process's first boundary costs what later ones do."""
    _iteration_fn()
    _entry("gpushare_released")


def iteration() -> int:
    """Report an iteration boundary of this process: what it holds on its GPUs now counts
    as persistent, what it allocates from now on as temporary. Returns :data:`RELEASE` and
    :data:`YIELD` bits for the caller to act on; 0 without a shim, with an inert one, or
    before the process first used CUDA. Never waits."""
    return int(_iteration_fn()())


def released() -> None:
    """Tell the shim the framework's cached memory was released, as :func:`iteration`
    asked (:data:`RELEASE`). Nothing without a shim or with an inert one."""
    fn = _entry("gpushare_released")
    if fn is not None:
        fn()


def mark_persistent(dptr: int) -> None:
    """Count the allocation that starts at device pointer ``dptr`` as persistent until it
    is freed (for memory a process allocates after its first boundary but keeps).

    Raises :class:`ShimNotLoaded` without a shim, :class:`ShimError` when the shim
    enforces no grant or knows no allocation starting at ``dptr``.
    """
    fn = _entry("gpushare_mark_persistent")
    if fn is None:
        raise ShimNotLoaded(_NOT_LOADED)
    if not 0 <= dptr < 1 << 64:
        raise ShimError(f"{dptr} is not a device pointer (an unsigned 64-bit address)")
    if int(fn(dptr)) == _namespace()[1].GPUSHARE_OK:
        return
    m = mode()
    if m != "enforce":
        raise ShimError(
            f"the shim in this process is {m} and enforces no grant, so there is no "
            "persistent memory to mark: run the program under gpushare-run"
        )
    raise ShimError(
        f"the shim knows no allocation starting at device pointer {dptr:#x}: pass the "
        "address an allocation returned (its start, not an address inside it), before it "
        "is freed"
    )


@dataclass(frozen=True)
class Memory:
    """This process's GPU memory by region, summed over its GPUs (bytes)."""

    used: int
    persistent: int  # held at its last boundary, or marked persistent
    temporary: int  # used - persistent: allocated since the last boundary
    temporary_peak: int  # the most temporary bytes at once, from the first boundary on
    iterations: int  # boundaries this process reported


def memory() -> Memory | None:
    """This process's memory by region as the shim charges it; None without a shim or
    with one that enforces no grant."""
    fn = _entry("gpushare_memory")
    if fn is None:
        return None
    ffi, lib = _namespace()
    out = ffi.new("struct gpushare_memory *")
    if int(fn(out)) != lib.GPUSHARE_OK:
        return None
    return Memory(
        int(out.used),
        int(out.persistent),
        int(out.temporary),
        int(out.temporary_peak),
        int(out.iterations),
    )


@dataclass(frozen=True)
class Counters:
    """This process's counters, summed over its GPUs."""

    peak: int  # the most bytes it held at once
    launches: int  # kernel launches (a graph launch counts one)


def counters() -> Counters | None:
    """This process's peak and launches as the shim counts them; None without a shim (or
    one older than this call) or with one that enforces no grant."""
    fn = _entry("gpushare_counters")
    if fn is None:
        return None
    ffi, lib = _namespace()
    out = ffi.new("struct gpushare_counters *")
    if int(fn(out, ffi.sizeof("struct gpushare_counters"))) != lib.GPUSHARE_OK:
        return None
    return Counters(int(out.peak), int(out.launches))
