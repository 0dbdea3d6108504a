"""``gpushare-run --predict``: a dry run of a command on a private simulated node, whose
figures predict what the command will need of a GPU (docs/prediction.md).

The command runs as it would under a grant, with the shim preloaded and the iteration hooks
in its framework, but on gpushare's simulated driver and against a nodemgr of the dry run's
own: a daemon started for it in a temporary directory, on simulated GPUs. The real PyTorch
allocator, cuBLAS and cuDNN run there and make every allocation a real run would make;
kernels compute nothing. Its processes (``GPUSHARE_DRY_RUN``, gpushare.iterations) run the
iterations asked for as on a shared GPU, then release the framework's cache as a
time-sliced GPU's first release does and run one iteration more, so that the shim learns
the task's persistent and temporary memory (docs/timeslicing.md), and wait at its end.
Then the task's figures are read from the private nodemgr, the command is stopped, and
the node is removed.

The node's GPUs, its grant, its quota and its records are the dry run's alone: the node's
own nodemgr is not asked, and the user's environment holds nothing while it runs.
"""

from __future__ import annotations

import contextlib
import functools
import io
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from client_plugin.grant import Heartbeat, Progress, acquire, task_environment
from client_plugin.settings import Settings
from client_plugin.supervise import Supervisor, Terminal, die_with, exit_code, say, spawn
from gpushare import envvars, paths, sizes
from gpushare.client import FIRST_ANSWER, Connection, NodeError, Unreachable, wait_until_serving
from gpushare.errors import GpushareError
from gpushare.exitcodes import (
    EXIT_CANCELLED,
    EXIT_INTERNAL,
    EXIT_NOT_EXECUTABLE,
    EXIT_NOT_FOUND,
    EXIT_NOT_PREDICTED,
)
from gpushare.messages import (
    DRY_RUN_SMS,
    FEATURE_FIELDS,
    AdminRequest,
    Estimate,
    History,
    Message,
    QuotaSet,
    Tasks,
)
from gpushare.protocol import MAX_ADMIN_REPLY_BYTES

# How often the task's figures are read while it runs, seconds: the command is stopped
# within about this long of the boundary that completes the iterations asked for.
LOOK_INTERVAL = 0.05
# The dry run's GPU: an H100-like device (the simulated driver's attributes: compute
# capability 9.0, 132 SMs) with an 80 GiB memory, so that no configuration of a real GPU
# runs out of memory in the dry run before it shows what it needs.
SIM_GPU_NAME = "gpushare dry run (H100-like)"
SIM_GPU_MEMORY = 80 << 30
# After the first process of a task has run its iterations, how long the dry run waits for
# the others before it reads what there is, seconds.
STRAGGLER_WAIT = 10.0
# How long the private nodemgr may take to serve, seconds.
START_TIMEOUT = 30.0
ENV_NAME = "predict"
# The operators the text names, those with the most arithmetic first.
TOP_OPERATORS = 3
# How long the environment's nodemgr has to give its step time estimate.
ESTIMATE_TIMEOUT = FIRST_ANSWER


R = TypeVar("R", bound=Message)


class PredictError(GpushareError):
    """The dry run could not be made (its node did not start, or refused the task)."""


def _task_socket(root: Path) -> Path:
    """The private node's deepest socket, its environment's."""
    return paths.env_dir(root / "run", ENV_NAME) / paths.TASK_SOCKET


def _node_root() -> Path:
    """A new private directory for the node: in $TMPDIR where its sockets' paths fit in a
    unix socket address, else in /tmp."""
    root = Path(tempfile.mkdtemp(prefix="gpushare-predict-"))
    if len(os.fsencode(_task_socket(root))) <= paths.MAX_SOCKET_PATH:
        return root
    root.rmdir()
    return Path(tempfile.mkdtemp(prefix="gpushare-predict-", dir="/tmp"))


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(str(value))  # a TOML basic string: JSON's escapes are TOML's


class PrivateNode:
    """A nodemgr of the dry run's own on ``gpus`` simulated GPUs, in a temporary directory,
    with one environment whose quota is the whole of them; stopped and removed on exit."""

    def __init__(self, gpus: int) -> None:
        self.gpus = gpus
        self.root = _node_root()
        self.proc: subprocess.Popen[bytes] | None = None
        self.endpoint = ""
        self.admin_endpoint = f"ipc://{self.root / 'run' / 'admin.sock'}"

    def __enter__(self) -> PrivateNode:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _config(self) -> str:
        tables: dict[str, dict[str, Any]] = {
            "node": {"run_dir": str(self.root / "run"), "state_dir": str(self.root / "state")},
            "gpus": {
                "source": "simulated",
                "simulated_count": self.gpus,
                "simulated_memory": str(SIM_GPU_MEMORY),
                "simulated_name": SIM_GPU_NAME,
                # Nothing to measure: the simulated context takes no memory.
                "context_memory": "0",
                "utilization_interval": 0.0,
            },
            # Time-sliced, so that nodemgr shows the task's shape as the shim learns it
            # (the dry run's processes make the release a time-sliced GPU asks for
            # themselves, after their iterations as on a shared GPU); alone, it is never
            # gated.
            "timeslice": {"gpus": list(range(self.gpus))},
            "audit": {"interval": 0.0},
        }
        lines = []
        for name, table in tables.items():
            lines.append(f"[{name}]")
            lines += [f"{k} = {_toml(v)}" for k, v in table.items()]
        return "\n".join(lines) + "\n"

    def _start(self) -> None:
        config = self.root / "nodemgr.toml"
        config.write_text(self._config())
        # The daemon is the dry run's: none of the caller's gpushare settings, shim or
        # simulated node reaches it.
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("GPUSHARE_") and k not in ("LD_PRELOAD", "CUDA_VISIBLE_DEVICES")
        }
        with open(self.root / "nodemgr.log", "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "nodemgr", "serve", "--config", str(config)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                # `python -m` puts its directory first on sys.path: the node's own, so that
                # no nodemgr/ in the caller's directory shadows the installed one.
                cwd=self.root,
                # Out of the caller's process group (a Ctrl-C is the command's to take),
                # and stopped (cleanly) with the caller.
                start_new_session=True,
                preexec_fn=functools.partial(die_with, os.getpid(), signal.SIGTERM),
            )
        proc = self.proc
        if not wait_until_serving(self.admin_endpoint, lambda: proc.poll() is None, START_TIMEOUT):
            raise PredictError(f"the dry run's nodemgr did not start: {self.log_tail()}")
        reply = self._admin(QuotaSet(env=ENV_NAME, gpus=self.gpus, memory=SIM_GPU_MEMORY))
        self.endpoint = str(reply.endpoint)

    def _admin(self, request: AdminRequest[R]) -> R:
        with Connection(self.admin_endpoint, timeout=10.0, max_reply=MAX_ADMIN_REPLY_BYTES) as c:
            return c.send(request)

    def task(self, task_id: str) -> dict[str, Any] | None:
        """The task's view (nodemgr's `tasks`), or None once it has ended."""
        for t in self._admin(Tasks(env=ENV_NAME)).tasks:
            if t.get("task_id") == task_id:
                return dict(t)
        return None

    def ended(self, task_id: str) -> dict[str, Any] | None:
        """The task's record once it has ended (nodemgr's `history`)."""
        for r in self._admin(History(env=ENV_NAME)).records:
            if r.get("task_id") == task_id:
                return dict(r)
        return None

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = (self.root / "nodemgr.log").read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:]) or "(its log is empty)"

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        shutil.rmtree(self.root, ignore_errors=True)


@dataclass
class Look:
    """What one reading of the task's view said, and whether, by the report read just
    before it, every process that reported had run its iteration after the release."""

    iterations: int
    peak: int
    regions: list[dict[str, Any]]
    complete: bool


@dataclass
class Watch:
    """Reads the task's figures while it runs; says when the iterations asked for are in:
    when every process of the task that reported a boundary has reported the one after
    its release (and waits there), and no other process holds GPU memory, or
    STRAGGLER_WAIT after the first did, whatever the others do (a parent that stopped
    stepping to wait for its children, a process that never steps)."""

    node: PrivateNode
    task_id: str
    wanted: int
    report: Path
    last: Look | None = None
    failed: str | None = None
    first_done: float | None = None

    def __call__(self) -> bool:
        processes = _by_pid(_read_report(self.report)).values()
        done = [bs[-1].iterations > self.wanted for bs in processes]
        try:
            view = self.node.task(self.task_id)
        except (Unreachable, NodeError) as e:
            self.failed = str(e)
            return True  # no figures can come: stop the command
        if view is None:
            return False
        now = time.monotonic()
        # Every process that holds a slot (has called into CUDA) counts, those that have
        # reported no boundary yet too: ranks start together and step together.
        live = int(view.get("processes") or 0)
        self.last = Look(
            iterations=int(view.get("iterations") or 0),
            peak=int(view.get("peak") or 0),
            regions=[dict(r) for r in view.get("regions") or ()],
            complete=bool(done) and all(done) and len(done) >= live,
        )
        if any(done) and self.first_done is None:
            self.first_done = now
        if self.last.complete:
            return True
        return self.first_done is not None and now - self.first_done >= STRAGGLER_WAIT


@dataclass(frozen=True)
class GpuShape:
    gpu: int  # the task's n-th GPU
    persistent: int | None
    temporary: int | None


@dataclass(frozen=True)
class Prediction:
    command: str
    wanted: int
    iterations: int
    # None: stopped by the dry run once its iterations were in; else the command's exit code.
    exit_code: int | None
    peak: int
    gpus: list[GpuShape] = field(default_factory=list)
    kernels_per_step: float | None = None
    copies_per_step: dict[str, float] | None = None
    seconds: float = 0.0
    host_step: float | None = None  # the host's seconds per iteration in the dry run
    waves_per_step: float | None = None  # waves of blocks over the dry run GPU's SMs
    devices: int = 1  # the GPUs it ran on (--gpus)
    # One iteration's operator profile (_operator_profile); None without one.
    profile: dict[str, Any] | None = None
    # The node's nodemgr's estimate per GPU model (its `estimate` reply's `gpus`), or why
    # there is none; both None: no endpoint to ask.
    estimates: list[dict[str, Any]] | None = None
    no_estimate: str | None = None

    @property
    def features(self) -> dict[str, float | None] | None:
        """What nodemgr's step time estimate takes (docs/prediction.md#step-time), by the
        fields of gpushare.messages.FEATURE_FIELDS: kernel launches, bytes over the host
        link and within the device, host seconds, waves, arithmetic and the operators'
        bytes, per iteration and per GPU (the task's, split evenly over its GPUs: each
        does its share at once); None where the dry run did not measure the first four."""
        c = self.copies_per_step
        if self.kernels_per_step is None or c is None or self.host_step is None:
            return None
        p = self.profile

        def share(v: float | None) -> float | None:
            return None if v is None else v / self.devices

        values = (
            share(self.kernels_per_step),
            share(c["host_to_device_bytes"] + c["device_to_host_bytes"]),
            share(c["device_to_device_bytes"]),
            self.host_step,
            share(self.waves_per_step),
            share(p["flops"] if p else None),
            share(p["half_flops"] if p else None),
            share(p["bytes"] if p else None),
        )
        return dict(zip(FEATURE_FIELDS, values, strict=True))

    @property
    def reached(self) -> bool:
        """Whether it ran the iterations asked for as on a shared GPU (its peak)."""
        return self.iterations >= self.wanted

    @property
    def made(self) -> bool:
        """Whether the figures predict anything: the command reached its iterations, or
        ended of itself with success."""
        return self.reached or self.exit_code == 0

    def as_json(self) -> dict[str, Any]:
        first = self.gpus[0] if self.gpus else GpuShape(0, None, None)
        p = self.profile
        return {
            "command": self.command,
            "predicted": self.made,
            "iterations": self.iterations,
            "iterations_wanted": self.wanted,
            "exit_code": self.exit_code,
            "peak": self.peak,
            "persistent": first.persistent,
            "temporary": first.temporary,
            "gpus": [
                {"gpu": g.gpu, "persistent": g.persistent, "temporary": g.temporary}
                for g in self.gpus
            ],
            "kernels_per_step": self.kernels_per_step,
            "copies_per_step": self.copies_per_step,
            "host_seconds_per_step": self.host_step,
            "waves_per_step": self.waves_per_step,
            "flops_per_step": p["flops"] if p else None,
            "half_flops_per_step": p["half_flops"] if p else None,
            "op_bytes_per_step": p["bytes"] if p else None,
            "batch": p["batch"] if p else None,
            "operators": {
                name: {"calls": v[0], "flops": v[1], "bytes": v[2], "largest_input": v[3]}
                for name, v in p["ops"].items()
            }
            if p
            else None,
            "step_time": self.estimates,
            "seconds": round(self.seconds, 3),
            "gpu_model": {"name": SIM_GPU_NAME, "memory": SIM_GPU_MEMORY},
        }

    def text(self) -> str:
        lines = [f"dry run of `{self.command}` on {SIM_GPU_NAME}: {self._how()}"]
        lines.append(
            f"  peak: {sizes.format_size(self.peak)} (all its GPUs at once, on a shared GPU)"
        )
        for g in self.gpus:
            if g.persistent is None or g.temporary is None:
                lines.append(
                    f"  GPU {g.gpu}: shape unknown (it takes {self.wanted + 1} iterations: "
                    f"the command reported {self.iterations})"
                )
            else:
                lines.append(
                    f"  GPU {g.gpu}: persistent {sizes.format_size(g.persistent)}, "
                    f"temporary {sizes.format_size(g.temporary)} per iteration"
                )
        if self.kernels_per_step is not None:
            waves = self.waves_per_step
            lines.append(
                f"  kernel launches per iteration: {self.kernels_per_step:g}"
                + (f" ({waves:g} waves of blocks over {DRY_RUN_SMS} SMs)" if waves else "")
            )
        if self.host_step is not None:
            lines.append(
                f"  host time per iteration: {self.host_step * 1000:.1f} ms (on the simulated "
                "driver: the host's work alone)"
            )
        p = self.profile
        if p is not None:
            lines.append(
                f"  arithmetic per iteration: {(p['flops'] + p['half_flops']) / 1e9:.3g} "
                f"GFLOP ({p['half_flops'] / 1e9:.3g} in 16 bits); operators read and write "
                f"{sizes.format_size(round(p['bytes']))} of device memory"
                + (f"; batch {p['batch']}" if p["batch"] is not None else "")
            )
            top = sorted((kv for kv in p["ops"].items() if kv[1][1]), key=lambda kv: -kv[1][1])
            if top:
                lines.append(
                    "  most arithmetic: "
                    + ", ".join(
                        f"{name} {v[1] / 1e9:.3g} GFLOP in {v[0]} calls"
                        for name, v in top[:TOP_OPERATORS]
                    )
                )
        for e in self.estimates or []:
            lines.append(
                f"  on {e['model']}: {e['step'] * 1000:.1f} ms per iteration, "
                f"GPU busy {100 * e['utilization']:.0f}% ({e['source']} estimate)"
            )
        if self.no_estimate is not None:
            lines.append(f"  no step time estimate: {self.no_estimate}")
        c = self.copies_per_step
        if c is not None:
            moved = ", ".join(
                f"{sizes.format_size(round(c[f'{k}_bytes']))} {k.replace('_', ' ')}"
                for k in COPY_KINDS
            )
            lines.append(f"  copies per iteration: {moved}")
            if c["reads"]:
                lines.append(
                    f"  it reads {c['reads']:g} result{'' if c['reads'] == 1 else 's'} back "
                    "from the GPU per iteration; the simulated driver computes no values, so "
                    "what the job does with what it reads may not be what it does on a GPU "
                    "(docs/prediction.md)"
                )
        return "\n".join(lines) + "\n"

    def _how(self) -> str:
        took = f"in {self.seconds:.1f}s"
        if self.exit_code is None:
            return f"stopped after {self.wanted} iterations and one more after a release {took}"
        how = f"ended with exit code {self.exit_code} after {self.iterations} iterations {took}"
        if not self.made:
            how += (
                f"; no prediction (it failed before its {self.wanted} iterations were in, "
                "on the simulated driver: see its output)"
            )
        return how


def _shapes(look: Look | None) -> list[GpuShape]:
    """Each GPU's learned shape: what the task's processes kept after their release, and
    the most they held beyond that within an iteration; known where, at that reading,
    every process had run its iteration after the release."""
    if look is None:
        return []
    known = look.complete
    return [
        GpuShape(
            gpu=n,
            persistent=int(r.get("settled") or 0) if known else None,
            temporary=int(r.get("temporary_peak") or 0) if known else None,
        )
        for n, r in enumerate(look.regions)
    ]


@dataclass(frozen=True)
class Boundary:
    """One process's figures at one of its boundaries, before the boundary acted (the
    GPUSHARE_DRY_RUN_REPORT line gpushare.iterations writes)."""

    pid: int
    iterations: int
    peak: int
    launches: int
    # The simulated driver's copy counters (COPY_KINDS, then copies to the host); None
    # where they could not be read.
    copies: tuple[int, int, int, int] | None = None
    t: float | None = None  # when it reported it (CLOCK_MONOTONIC seconds)
    # The simulated driver's kernel counters: launches, blocks, waves; None where unread.
    kernels: tuple[int, int, int] | None = None
    # The operator profile of the iteration that ended here (gpushare.opprofile), if any.
    ops: dict[str, Any] | None = None


# What a dry run's copies moved, by direction, as gpushareSimCopyCounters gives them.
COPY_KINDS = ("host_to_device", "device_to_host", "device_to_device")


def _read_report(path: Path) -> list[Boundary]:
    """The report's lines; one that is not whole or not of this form is left out."""
    out = []
    try:
        text = path.read_text()
    except OSError:
        return []
    for line in text.splitlines():
        try:
            d = json.loads(line)
            c = d.get("copies")
            copies = None
            if isinstance(c, list) and len(c) == 4:
                h2d, d2h, d2d, reads = (int(v) for v in c)
                copies = (h2d, d2h, d2d, reads)
            t = d.get("t")
            k = d.get("kernels")
            kernels = None
            if isinstance(k, list) and len(k) == 3:
                launched, blocks, waves = (int(v) for v in k)
                kernels = (launched, blocks, waves)
            ops = d.get("ops")
            out.append(
                Boundary(
                    int(d["pid"]),
                    int(d["iterations"]),
                    int(d["peak"]),
                    int(d["launches"]),
                    copies,
                    float(t) if isinstance(t, int | float) else None,
                    kernels,
                    _profile(ops) if isinstance(ops, dict) else None,
                )
            )
        except (ValueError, KeyError, TypeError):
            continue
    return out


def _by_pid(boundaries: list[Boundary]) -> dict[int, list[Boundary]]:
    """The report's lines by process, each process's in the order of its boundaries."""
    out: dict[int, list[Boundary]] = {}
    for b in boundaries:
        out.setdefault(b.pid, []).append(b)
    for bs in out.values():
        bs.sort(key=lambda b: b.iterations)
    return out


def _shared_peak(boundaries: list[Boundary], wanted: int, final: int) -> int:
    """The most the task holds at once on a shared GPU: what each process had held at most
    by boundary ``wanted``, before its release (summed), when every process that reported
    got there; else, nothing having been released, the task's peak."""
    at_release = [[b for b in bs if b.iterations == wanted] for bs in _by_pid(boundaries).values()]
    if not at_release or not all(at_release):
        return final
    return sum(bs[-1].peak for bs in at_release)


def _spans(boundaries: list[Boundary], wanted: int) -> list[tuple[Boundary, Boundary]]:
    """Each process's first and last boundary up to its ``wanted``th (the iteration after
    the release runs under the operator profile, which may change what it launches), or
    to its last where it reported fewer than two by then; where it reported two or more."""
    out = []
    for bs in _by_pid(boundaries).values():
        before = [b for b in bs if b.iterations <= wanted]
        span = before if len(before) >= 2 else bs
        if span[-1].iterations > span[0].iterations:
            out.append((span[0], span[-1]))
    return out


def _per_step(
    boundaries: list[Boundary], wanted: int, count: Callable[[Boundary], int | None]
) -> float | None:
    """A counter's growth between a process's first boundary and its last (_spans), per
    iteration, summed over its processes; None before any has two with the counter read."""
    rates = []
    for first, last in _spans(boundaries, wanted):
        start, end = count(first), count(last)
        if start is not None and end is not None:
            rates.append((end - start) / (last.iterations - first.iterations))
    return sum(rates) if rates else None


def _kernels_per_step(boundaries: list[Boundary], wanted: int) -> float | None:
    """Kernel launches per iteration (the shim's counter)."""
    return _per_step(boundaries, wanted, lambda b: b.launches)


def _waves_per_step(boundaries: list[Boundary], wanted: int) -> float | None:
    """Waves of blocks over the dry run's GPU's SMs per iteration (the simulated driver's
    counter)."""
    return _per_step(boundaries, wanted, lambda b: None if b.kernels is None else b.kernels[2])


def _profile(d: dict[str, Any]) -> dict[str, Any] | None:
    """A report line's operator profile (gpushare.opprofile.Profile.as_json), checked; None
    where it is not of that form."""
    try:
        ops = {
            str(name): [int(v[0]), float(v[1]), float(v[2]), int(v[3])]
            for name, v in d["ops"].items()
        }
        batch = d.get("batch")
        return {
            "flops": float(d["flops"]),
            "half_flops": float(d["half_flops"]),
            "bytes": float(d["bytes"]),
            "batch": None if batch is None else int(batch),
            "ops": ops,
        }
    except (KeyError, TypeError, ValueError, IndexError, AttributeError):
        return None


def _operator_profile(boundaries: list[Boundary]) -> dict[str, Any] | None:
    """The task's operator profile of one iteration: each process's (the first its report
    has), summed, each operator's largest input the largest of any; the batch the first
    process's. None where no process counted one (no PyTorch)."""
    profiles = [
        next(b.ops for b in bs if b.ops)
        for bs in _by_pid(boundaries).values()
        if any(b.ops for b in bs)
    ]
    if not profiles:
        return None
    out: dict[str, Any] = {"flops": 0.0, "half_flops": 0.0, "bytes": 0.0, "batch": None, "ops": {}}
    for p in profiles:
        for key in ("flops", "half_flops", "bytes"):
            out[key] += p[key]
        if out["batch"] is None:
            out["batch"] = p["batch"]
        for name, (calls, flops, moved, largest) in p["ops"].items():
            have = out["ops"].setdefault(name, [0, 0.0, 0.0, 0])
            have[0] += calls
            have[1] += flops
            have[2] += moved
            have[3] = max(have[3], largest)
    return out


def _copies_per_step(boundaries: list[Boundary], wanted: int) -> dict[str, float] | None:
    """The bytes each kind of copy moved per iteration, and the copies to the host (reads
    of device results) per iteration, summed over the processes as for launches; None
    before any has two boundaries with the counters read."""
    spans = [(f, t) for f, t in _spans(boundaries, wanted) if f.copies is not None and t.copies]
    if not spans:
        return None
    out = dict.fromkeys([*(f"{k}_bytes" for k in COPY_KINDS), "reads"], 0.0)
    for first, last in spans:
        assert first.copies is not None and last.copies is not None
        n = last.iterations - first.iterations
        for i, key in enumerate(out):
            out[key] += (last.copies[i] - first.copies[i]) / n
    return out


def _host_step(boundaries: list[Boundary], wanted: int) -> float | None:
    """The host's seconds per iteration: each process's shortest iteration from its first
    boundary to its ``wanted``th (before the release, which takes time of its own; the
    first iterations are the longest, warming up: the shortest is the nearest to a long
    run's), the slowest process's (they step together). None before any has two such
    boundaries."""
    rates = []
    for bs in _by_pid(boundaries).values():
        span = [b for b in bs if b.iterations <= wanted and b.t is not None]
        steps = [
            (later.t - earlier.t) / (later.iterations - earlier.iterations)
            for earlier, later in itertools.pairwise(span)
            if earlier.t is not None
            and later.t is not None
            and later.iterations > earlier.iterations
        ]
        if steps:
            rates.append(min(steps))
    return max(rates) if rates else None


def _estimated(result: Prediction, cmd: list[str], endpoint: str | None) -> Prediction:
    """The prediction with the step time the environment's nodemgr (``endpoint``, the
    caller's GPUSHARE_ENDPOINT) estimates from it on each of the node's GPU models
    (docs/prediction.md#step-time); as it was without an endpoint."""
    f = result.features
    if endpoint is None:
        return result
    if f is None:
        return replace(result, no_estimate="the dry run measured too few iterations")
    request = Estimate(command=" ".join(cmd), **f)  # type: ignore[arg-type]
    try:
        with Connection(endpoint, timeout=ESTIMATE_TIMEOUT) as conn:
            gpus = conn.send(request).gpus
    except (Unreachable, NodeError) as e:
        return replace(result, no_estimate=f"nodemgr at {endpoint} did not give one: {e}")
    return replace(result, estimates=[dict(g) for g in gpus])


def _command_environment(base: Mapping[str, str]) -> dict[str, str]:
    """The caller's environment without what would tie the command to the caller's node
    or change what the dry run measures: every GPUSHARE_* setting (the iteration hooks
    switched off, a simulated node's, an endpoint) but the builds to use, and a
    CUDA_VISIBLE_DEVICES naming real GPUs. The grant adds the dry run's own."""
    keep = (envvars.SHIM, envvars.SIM_DIR)
    return {
        k: v
        for k, v in base.items()
        if not (k.startswith("GPUSHARE_") and k not in keep) and k != "CUDA_VISIBLE_DEVICES"
    }


def _end_group(pgid: int, grace: float) -> None:
    """Whatever of the command's process group is left (a process that outlived the
    command, one waiting at its last boundary): SIGTERM, then SIGKILL after ``grace``."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def dry_run(
    cmd: list[str],
    gpus: int,
    iterations: int,
    grace: float,
    stdout: int | None = None,
    base: Mapping[str, str] | None = None,
) -> Prediction | int:
    """Run CMD on a private simulated node for ``iterations`` iterations and one more, or
    to its end; its prediction, or the exit code of a dry run that could not start.
    ``stdout``: a descriptor for the command's standard output (None: gpushare-run's)."""
    started = time.monotonic()
    command = " ".join(cmd)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    environ = _command_environment(os.environ if base is None else base)
    with PrivateNode(gpus) as node:
        s = Settings(endpoint=node.endpoint, gpus=gpus, wait=False, grace=grace)
        quiet = Progress("gpushare-run", gpus, stream=io.StringIO())
        grant = acquire(s, command, quiet, wrapper=True)
        env = task_environment(grant, environ, os.getpid())
        report = node.root / "boundaries.jsonl"
        report.touch(mode=0o600)
        env[envvars.DRY_RUN] = str(iterations)
        env[envvars.DRY_RUN_REPORT] = str(report)
        term = Terminal()
        # spawn() blocks the signals the supervisor takes: unblocked again once it is done.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
        child = None
        try:
            try:
                child = spawn(cmd, env, term, stdout)
            except OSError as e:
                code = EXIT_NOT_FOUND if isinstance(e, FileNotFoundError) else EXIT_NOT_EXECUTABLE
                say(f"cannot run {cmd[0]}: {e.strerror}")
                return code
            hb = Heartbeat(node.endpoint, grant.task_id, grant.heartbeat_interval, say)
            watch = Watch(node, grant.task_id, iterations, report)
            supervisor = Supervisor(child, term, grace, hb, watch, LOOK_INTERVAL)
            returncode = supervisor.run()
            hb.done(exit_code(returncode), -returncode if returncode < 0 else None)
        finally:
            if child is not None:
                _end_group(child.pid, grace)
            term.close()
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if watch.failed is not None:
            raise PredictError(f"lost the dry run's nodemgr: {watch.failed}")
        last = watch.last
        record = None
        with contextlib.suppress(Unreachable, NodeError):
            record = node.ended(grant.task_id)
        final = max(last.peak if last else 0, int(record.get("peak") or 0) if record else 0)
        boundaries = _read_report(report)
        done = max([last.iterations if last else 0, *(b.iterations for b in boundaries)])
        return Prediction(
            command=command,
            wanted=iterations,
            iterations=done,
            exit_code=None if supervisor.ended else exit_code(returncode),
            peak=_shared_peak(boundaries, iterations, final),
            gpus=_shapes(last),
            kernels_per_step=_kernels_per_step(boundaries, iterations),
            copies_per_step=_copies_per_step(boundaries, iterations),
            seconds=time.monotonic() - started,
            host_step=_host_step(boundaries, iterations),
            waves_per_step=_waves_per_step(boundaries, iterations),
            devices=gpus,
            profile=_operator_profile(boundaries),
        )


def run(cmd: list[str], gpus: int, iterations: int, grace: float, as_json: bool) -> int:
    """``gpushare-run --predict``: print the prediction; returns the exit code."""
    try:
        # With --json gpushare-run's standard output is the prediction alone: the
        # command's goes to standard error.
        result = dry_run(cmd, gpus, iterations, grace, sys.stderr.fileno() if as_json else None)
    except (PredictError, Unreachable, NodeError) as e:
        say(f"the dry run failed: {e}")
        return EXIT_INTERNAL
    except KeyboardInterrupt:  # before the command ran (its node starting): nothing to show
        say("interrupted")
        return EXIT_CANCELLED
    if isinstance(result, int):
        return result
    result = _estimated(result, cmd, os.environ.get(envvars.ENDPOINT) or None)
    out = json.dumps(result.as_json()) + "\n" if as_json else result.text()
    with contextlib.suppress(OSError):
        sys.stdout.write(out)
        sys.stdout.flush()
    return 0 if result.made else EXIT_NOT_PREDICTED
