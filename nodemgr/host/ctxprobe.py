"""What one process's CUDA context takes on each model of GPU: ``gpus.context_memory =
"auto"`` (docs/operations.md#context-memory).

Run as ``python -P -m nodemgr.host.ctxprobe LIBCUDA``, this module is the probe: with
CUDA_VISIBLE_DEVICES naming one GPU it retains that GPU's primary context through the
driver LIBCUDA (ctypes; no shim, no framework), prints ``ready`` and holds the context
until its stdin closes. nodemgr (``charges``) starts one probe per GPU model at start-up,
before it serves anything, reads meanwhile NVML's figure of the device memory that
process uses (through the node's nodemgr.host.backend, which also names the driver the
probe loads), and ends it. The probe imports nothing else, so that it starts fast.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import subprocess
    from pathlib import Path

    from nodemgr.config import Config
    from nodemgr.host.backend import GpuBackend, ProbeDriver
    from nodemgr.host.gpus import Gpu

# Seconds a probe has to make its context and NVML to show it, and then to end.
PROBE_TIMEOUT = 30.0
# The figure is rounded up to this: the driver maps device memory in 2 MiB pages.
PAGE = 2 << 20
# Where a charge comes from: the config's number, a probe, or CONTEXT_FALLBACK.
CONFIGURED, MEASURED, FALLBACK = "configured", "measured", "fallback"
READY = "ready"
# The driver entry points the probe calls, in order.
STEPS = ("cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain")


class ProbeError(Exception):
    """No figure from the probe; the message says why."""


def probe(library: str) -> int:
    """The probe's body: make the context, say so, hold it until stdin closes."""
    try:
        cuda = ctypes.CDLL(library)
    except OSError as e:
        print(f"cannot load the CUDA driver {library}: {e}", file=sys.stderr)
        return 1
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    args: dict[str, tuple[Any, ...]] = {
        "cuInit": (0,),
        "cuDeviceGet": (ctypes.byref(dev), 0),
        "cuDevicePrimaryCtxRetain": (ctypes.byref(ctx), dev),
    }
    for name in STEPS:
        rc = getattr(cuda, name)(*args[name])
        if rc != 0:
            text = ctypes.c_char_p()
            cuda.cuGetErrorName(rc, ctypes.byref(text))
            what = text.value.decode() if text.value else "unknown"
            print(f"{name} failed: CUDA error {rc} ({what})", file=sys.stderr)
            return 1
    print(READY, flush=True)
    sys.stdin.read()  # until nodemgr has read NVML's figure and closes it
    return 0


def page_up(nbytes: int) -> int:
    """``nbytes`` rounded up to whole PAGEs."""
    return -(-nbytes // PAGE) * PAGE


def probe_argv(library: str) -> list[str]:
    """The probe's command line: -P keeps the working directory off sys.path, so that no
    nodemgr/ there (or in "/", where it runs) stands in for nodemgr's own."""
    return [sys.executable, "-P", "-m", "nodemgr.host.ctxprobe", library]


def _probe_env(gpu: Gpu, sim_gpus: str | None, sim_state_dir: Path | None = None) -> dict[str, str]:
    """The probe's environment: nodemgr's, without the shim, a task's variables or the
    simulator's trace and timing knobs, seeing only ``gpu`` (and, on simulated GPUs, the
    node's simulated GPUs ``sim_gpus`` and their directory ``sim_state_dir``, where their
    process table lives)."""
    from gpushare.envvars import SIM_GPUS, SIM_STATE_DIR

    # None of gpushare's variables but, on simulated GPUs, the two that say which GPUs
    # and process table the simulated driver serves (GPUSHARE_SIM_TRACE would have the
    # probe append to a file nodemgr's environment names).
    keep = (SIM_GPUS, SIM_STATE_DIR) if sim_gpus is not None else ()
    env = {
        k: v
        for k, v in os.environ.items()
        if k != "LD_PRELOAD" and (not k.startswith("GPUSHARE_") or k in keep)
    }
    env["CUDA_VISIBLE_DEVICES"] = gpu.uuid
    if sim_gpus is not None:
        env[SIM_GPUS] = sim_gpus
    if sim_state_dir is not None:
        env[SIM_STATE_DIR] = str(sim_state_dir)
    return env


def measure(
    gpu: Gpu,
    driver: ProbeDriver,
    backend: GpuBackend,
    timeout: float = PROBE_TIMEOUT,
    command: list[str] | None = None,
) -> int:
    """Bytes ``backend`` sees a probe's context on ``driver`` take on ``gpu``, rounded up
    to PAGE; raise ProbeError, or BackendError where NVML cannot be asked. ``command``
    replaces the probe's (a test's)."""
    import subprocess
    import time

    argv = command or probe_argv(driver.library)
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=_probe_env(gpu, driver.sim_gpus, driver.sim_state_dir),
            cwd="/",  # not nodemgr's, nor on sys.path (probe_argv)
            start_new_session=True,  # a terminal's ^C is nodemgr's to handle
        )
    except OSError as e:
        raise ProbeError(f"cannot start the probe: {e}") from None
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    deadline = time.monotonic() + timeout
    try:
        said, ended = _read_line(proc.stdout.fileno(), deadline)
        if said != READY:
            if not ended:
                raise ProbeError(f"no context within {timeout:g}s")
            proc.wait(max(0.0, deadline - time.monotonic()))
            err = _read_written(proc.stderr.fileno()).strip().splitlines()
            raise ProbeError(err[-1] if err else f"the probe exited {proc.returncode}")
        while True:
            used = backend.process_memory(gpu.uuid, proc.pid)
            if used is not None:
                return page_up(used)
            if time.monotonic() > deadline:
                raise ProbeError(
                    f"NVML does not list the probe (pid {proc.pid}) within {timeout:g}s "
                    "(does nodemgr run in a pid namespace of its own?)"
                )
            time.sleep(0.02)  # the driver registers the process with NVML on its own time
    except subprocess.TimeoutExpired:
        raise ProbeError(f"the probe did not end within {timeout:g}s") from None
    finally:
        proc.stdin.close()
        _end(proc, max(1.0, deadline - time.monotonic()))
        proc.stdout.close()
        proc.stderr.close()


def _read_line(fd: int, deadline: float) -> tuple[str, bool]:
    """The first line read from ``fd`` (without its newline), and whether it ended (a
    newline or end of file) before ``deadline`` (time.monotonic()): a probe that writes
    half a line and hangs does not hang nodemgr."""
    import select
    import time

    got = b""
    while b"\n" not in got:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            return got.decode(errors="replace").strip(), False
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        got += chunk
    return got.partition(b"\n")[0].decode(errors="replace").strip(), True


def _read_written(fd: int) -> str:
    """What an ended probe wrote to ``fd``, read without waiting for the end of file: a
    process the probe started may hold the pipe open."""
    import select

    got = b""
    while select.select([fd], [], [], 0)[0]:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        got += chunk
    return got.decode(errors="replace")


# Seconds a probe killed at its time limit has to be reaped before nodemgr goes on without.
KILL_WAIT = 5.0


def _end(proc: subprocess.Popen[bytes], wait: float) -> None:
    """Reap ``proc`` within ``wait`` seconds of its stdin closing, else kill its process
    group (the probe's session: what it started too) and reap it; one that even SIGKILL
    does not end (stuck in the kernel) is logged and left, so start-up goes on."""
    import logging
    import signal
    import subprocess

    try:
        proc.wait(wait)
        return
    except subprocess.TimeoutExpired:
        pass
    # Not reaped yet, so its pid (the group's id) cannot name another process.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        proc.kill()
    try:
        proc.wait(KILL_WAIT)
    except subprocess.TimeoutExpired:
        logging.getLogger("nodemgr").warning(
            "the context probe (pid %d) did not end %gs after SIGKILL; going on without it",
            proc.pid,
            KILL_WAIT,
        )


def charges(config: Config, backend: GpuBackend) -> dict[int, tuple[int, str]]:
    """The context charge of each of ``backend``'s GPUs (by index) and where it comes from:
    the config's number, or with "auto" one measurement per GPU model (name and memory), on
    the GPU of that model with the most free memory, charged on all of them. Where the
    probe fails, a WARNING that names the fix, and on NVML GPUs CONTEXT_FALLBACK; on
    simulated ones what their driver is told a context takes
    (gpus.simulated_context_memory), a fact the probe only confirms."""
    import logging

    from gpushare.sizes import format_size
    from nodemgr.config import CONTEXT_FALLBACK, DEFAULT_CONFIG

    gpus = backend.gpus
    if config.context_memory is not None:
        return {g.index: (config.context_memory, CONFIGURED) for g in gpus}
    log = logging.getLogger("nodemgr")
    models: dict[tuple[str, int], list[Gpu]] = {}
    for g in gpus:
        models.setdefault((g.name, g.memory), []).append(g)
    fallback = config.sim_context if backend.simulated else CONTEXT_FALLBACK
    out: dict[int, tuple[int, str]] = {}
    for (name, _), same in models.items():
        indices = ", ".join(str(g.index) for g in same)
        try:
            gpu, figure = _measure_model(same, backend)
        except ProbeError as e:
            log.warning(
                'gpus.context_memory = "auto": cannot measure a CUDA context on %s (GPUs %s): '
                "%s; charging %s per process there instead. Set gpus.context_memory in %s to "
                "what one CUDA process holds there (nvidia-smi's figure for it) to charge that",
                name,
                indices,
                e,
                format_size(fallback),
                config.path or DEFAULT_CONFIG,
            )
            out.update({g.index: (fallback, FALLBACK) for g in same})
            continue
        log.info(
            "a CUDA context takes %s on %s (measured on GPU %d): charged per process on GPUs %s",
            format_size(figure),
            name,
            gpu.index,
            indices,
        )
        out.update({g.index: (figure, MEASURED) for g in same})
    return out


def _measure_model(same: list[Gpu], backend: GpuBackend) -> tuple[Gpu, int]:
    """(the GPU probed, its figure) for one model's GPUs ``same`` of ``backend``'s; raise
    ProbeError."""
    from nodemgr.host.backend import BackendError

    try:
        driver = backend.probe_driver()
    except BackendError as e:
        raise ProbeError(str(e)) from None
    try:
        backend.load()
    except BackendError as e:  # only the simulated NVML is loaded by nodemgr itself
        raise ProbeError(f"the simulated NVML: {e}") from None
    try:
        with backend.session():
            # The probe's context takes memory for a moment: where tasks leave the most.
            gpu = max(same, key=lambda g: backend.free_memory(g.uuid))
            return gpu, measure(gpu, driver, backend)
    except BackendError as e:
        raise ProbeError(f"NVML: {e}") from None


if __name__ == "__main__":
    sys.exit(probe(sys.argv[1]))
