"""The client's settings: one ``GPUSHARE_*`` environment variable each (their names in
gpushare.envvars).

``gpushare-run`` options override them; the auto-loader reads only these. A bad
value is an error that names the variable, never a silent default.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from gpushare import paths, sizes
from gpushare.envvars import (
    CLASS,
    COMPUTE,
    CPU_FALLBACK,
    DEADLINE,
    ENDPOINT,
    FALSE_WORDS,
    GPUS,
    GRACE,
    GUARD,
    MEMORY,
    PERSISTENT,
    PREDICT_ITERATIONS,
    PROGRESS_INTERVAL,
    REQUEUE,
    SHAPE,
    STEP_TARGET,
    STEPS,
    TEMPORARY,
    TRUE_WORDS,
    WAIT,
    WAIT_TIMEOUT,
    ZERO_QUOTA,
)
from gpushare.errors import GpushareError
from gpushare.protocol import MAX_GPUS_PER_REQUEST, MAX_WAIT, task_class
from gpushare.sizes import parse_size

DEFAULT_GRACE = 10.0
DEFAULT_PROGRESS_INTERVAL = 30.0
# gpushare-run --predict: the iteration boundaries its dry run waits for (docs/prediction.md).
DEFAULT_PREDICT_ITERATIONS = 3
MAX_PREDICT_ITERATIONS = 1000


class SettingsError(GpushareError, ValueError):
    """A setting has a value the client cannot use; the message names it. Also a
    ValueError, as it was before gpushare's errors had one root."""


@dataclass(frozen=True)
class Settings:
    endpoint: str | None = None
    gpus: int = 1
    memory: int | None = None  # bytes per GPU the task expects (a hint)
    wait: bool = True  # wait in nodemgr's queue when no GPUs are free
    wait_timeout: float | None = None  # seconds; None: no limit
    cpu_fallback: bool = False  # run without a GPU on zero quota / nothing free
    grace: float = DEFAULT_GRACE  # seconds from a passed-on signal to SIGKILL
    zero_quota: str = "warn"  # auto-loader on a zero quota: "warn" or "error"
    devices: tuple[str, ...] | None = None  # the user's CUDA_VISIBLE_DEVICES, a restriction
    persistent: int | None = None  # estimated persistent bytes per GPU (time-sliced GPUs)
    temporary: int | None = None  # estimated temporary peak per GPU, with persistent
    guard: int | None = None  # bytes after its persistent slice; None: the node's default
    compute: int | None = None  # percent of its GPUs' time (docs/compute.md); None: no share
    # Waiting with stderr not a terminal: seconds between progress lines, at most.
    progress_interval: float = DEFAULT_PROGRESS_INTERVAL
    task_class: str | None = None  # "ls" or "be"; None: the environment's default
    requeue: bool = True  # gpushare-run: run CMD again when requeued for an LS task
    # A latency-sensitive task's target (docs/compute.md, "Elastic share"): seconds per
    # iteration, or seconds for a run of `steps` iterations.
    step_target: float | None = None
    deadline: float | None = None
    steps: int | None = None
    predict_iterations: int = DEFAULT_PREDICT_ITERATIONS  # gpushare-run --predict
    # gpushare-run --shape (docs/prediction.md#admission): "quota", or "predicted" (a dry
    # run first, and the request carries its peak); and that peak, once known.
    shape: str = "quota"
    predicted: int | None = None
    # Its dry run's features per iteration (docs/prediction.md#step-time), by the request's
    # field names (gpushare.messages.FEATURE_FIELDS).
    features: dict[str, float | None] | None = None

    def but(self, **changes: Any) -> Settings:
        """A copy with the given fields changed (None values leave a field as it is)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


def parse_bool(name: str, value: str) -> bool:
    v = value.strip().lower()
    if v in TRUE_WORDS:
        return True
    if v in FALSE_WORDS or v == "":
        return False
    raise SettingsError(f"{name}={value!r}: use 1 or 0 (also true/false, yes/no, on/off)")


def parse_seconds(name: str, value: str) -> float:
    """A finite number of seconds (never inf: an unset variable is the one "no limit")."""
    try:
        return sizes.parse_seconds(value.strip(), 0.0, MAX_WAIT)
    except ValueError as e:
        raise SettingsError(f"{name}={value!r}: {e}") from None


def parse_endpoint(name: str, value: str) -> str:
    """An environment's task endpoint: nodemgr serves ``ipc://`` sockets only."""
    if not paths.socket_of(value):
        raise SettingsError(
            f"{name}={value!r}: expected ipc://PATH, the environment's task socket "
            "(nodemgr quota show ENV prints it)"
        )
    return value


def parse_gpus(name: str, value: str) -> int:
    try:
        n = int(value.strip())
    except ValueError:
        raise SettingsError(f"{name}={value!r}: expected a whole number of GPUs") from None
    if not 1 <= n <= MAX_GPUS_PER_REQUEST:
        raise SettingsError(f"{name}={value!r}: expected 1 to {MAX_GPUS_PER_REQUEST} GPUs")
    return n


def parse_memory(name: str, value: str) -> int:
    try:
        return parse_size(value)
    except ValueError as e:
        raise SettingsError(f"{name}={value!r}: {e}") from None


def parse_devices(value: str) -> tuple[str, ...]:
    """CUDA_VISIBLE_DEVICES as the driver reads it: indices or UUIDs up to the first entry
    that is neither (so the usual ``-1`` means no GPU)."""
    devices: list[str] = []
    for entry in value.split(","):
        d = entry.strip()
        if not (d.isdigit() or d.upper().startswith(("GPU-", "MIG-"))):
            break
        devices.append(d)
    return tuple(devices)


def parse_class(name: str, value: str) -> str:
    try:
        return task_class(value)
    except ValueError as e:
        raise SettingsError(f"{name}={value!r}: {e}") from None


def parse_compute(name: str, value: str) -> int:
    try:
        n = int(value.strip())
    except ValueError:
        raise SettingsError(f"{name}={value!r}: expected a whole percentage, 1 to 100") from None
    if not 1 <= n <= 100:
        raise SettingsError(f"{name}={value!r}: expected a percentage from 1 to 100")
    return n


def parse_step_target(name: str, value: str) -> float:
    """Milliseconds per iteration, as --step-target takes them: seconds."""
    try:
        ms = float(value.strip())
    except ValueError:
        raise SettingsError(f"{name}={value!r}: expected milliseconds per iteration") from None
    if not 1.0 <= ms <= 3_600_000.0:
        raise SettingsError(f"{name}={value!r}: expected 1 to 3600000 milliseconds")
    return ms / 1000.0


def parse_steps(name: str, value: str) -> int:
    try:
        n = int(value.strip())
    except ValueError:
        raise SettingsError(f"{name}={value!r}: expected a number of iterations") from None
    if n < 1:
        raise SettingsError(f"{name}={value!r}: expected at least 1 iteration")
    return n


def parse_predict_iterations(name: str, value: str) -> int:
    try:
        n = int(value.strip())
    except ValueError:
        raise SettingsError(f"{name}={value!r}: expected a number of iterations") from None
    if not 1 <= n <= MAX_PREDICT_ITERATIONS:
        raise SettingsError(f"{name}={value!r}: expected 1 to {MAX_PREDICT_ITERATIONS}")
    return n


SHAPES = ("quota", "predicted")


def parse_shape(name: str, value: str) -> str:
    v = value.strip().lower()
    if v not in SHAPES:
        raise SettingsError(f"{name}={value!r}: use {' or '.join(SHAPES)}")
    return v


def check_target(s: Settings) -> None:
    """SettingsError unless a deadline comes with its run's steps, and steps with one."""
    if (s.deadline is None) != (s.steps is None):
        raise SettingsError(
            "--deadline and --steps go together: the time a run of N steps may take"
        )


def parse_zero_quota(name: str, value: str) -> str:
    v = value.strip().lower()
    if v not in ("warn", "error"):
        raise SettingsError(f"{name}={value!r}: use warn or error")
    return v


# The variables from_environment reads, in the order it checks them (the first bad one is
# the error): (name, the Settings field it sets, its parser). An empty variable is unset.
_VARIABLES: tuple[tuple[str, str, Callable[[str, str], Any]], ...] = (
    (ENDPOINT, "endpoint", parse_endpoint),
    (GPUS, "gpus", parse_gpus),
    (MEMORY, "memory", parse_memory),
    (WAIT, "wait", parse_bool),
    (WAIT_TIMEOUT, "wait_timeout", parse_seconds),
    (CPU_FALLBACK, "cpu_fallback", parse_bool),
    (GRACE, "grace", parse_seconds),
    (PROGRESS_INTERVAL, "progress_interval", parse_seconds),
    (ZERO_QUOTA, "zero_quota", parse_zero_quota),
    (PERSISTENT, "persistent", parse_memory),
    (TEMPORARY, "temporary", parse_memory),
    (GUARD, "guard", parse_memory),
    (CLASS, "task_class", parse_class),
    (REQUEUE, "requeue", parse_bool),
    (COMPUTE, "compute", parse_compute),
    (STEP_TARGET, "step_target", parse_step_target),
    (DEADLINE, "deadline", parse_seconds),
    (STEPS, "steps", parse_steps),
    (PREDICT_ITERATIONS, "predict_iterations", parse_predict_iterations),
    (SHAPE, "shape", parse_shape),
)


def from_environment(environ: Mapping[str, str] | None = None) -> Settings:
    """Settings from ``GPUSHARE_*`` variables (and the user's CUDA_VISIBLE_DEVICES)."""
    env = os.environ if environ is None else environ
    s = Settings()
    for name, key, parse in _VARIABLES:
        if env.get(name):
            s = replace(s, **{key: parse(name, env[name])})
    check_shape(s)
    if "CUDA_VISIBLE_DEVICES" in env:
        s = replace(s, devices=parse_devices(env["CUDA_VISIBLE_DEVICES"]))
    return s


def check_shape(s: Settings) -> None:
    """An estimate of temporary memory means nothing without the persistent one."""
    if s.temporary is not None and s.persistent is None:
        raise SettingsError(
            f"{TEMPORARY} (--temporary) is an estimate of a task's shape together with "
            f"{PERSISTENT} (--persistent): set both, or neither"
        )


def wait_seconds(s: Settings) -> float:
    """What one request may wait in nodemgr's queue (the node cuts it to its own limit)."""
    if not s.wait:
        return 0.0
    return MAX_WAIT if s.wait_timeout is None else min(s.wait_timeout, MAX_WAIT)
