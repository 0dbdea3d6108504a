"""The GPUs as nodemgr asks them (docs/architecture.md, "Packages"): one GpuBackend,
NVML on the machine's driver or the simulated GPUs of the config through the simulated
NVML the package ships, chosen once at start (``choose``) and handed to what asks the GPUs:
the bypass audit, utilisation sampling, the health check and the context probe. The only
module of nodemgr that imports pynvml; each query raises BackendError where NVML cannot
be asked.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nodemgr.config import Config
from nodemgr.host.gpus import Gpu, InventoryError, sim_spec, simulated

log = logging.getLogger("nodemgr")


class BackendError(Exception):
    """NVML cannot be asked (or the simulated one loaded); the message says why."""


@dataclass(frozen=True)
class GpuProcess:
    """One compute process NVML lists on one GPU."""

    gpu: int  # nodemgr's GPU index
    pid: int  # in the driver's (the host's) pid namespace
    bytes: int  # NVML's usedGpuMemory; 0 where NVML does not give it (no permission)


@dataclass(frozen=True)
class GpuSample:
    """One GPU's figures, percent; None where NVML gives none."""

    gpu: int | None
    memory: int | None
    processes: dict[int, int]  # NVML's pid -> its busy share of the GPU


@dataclass(frozen=True)
class ProbeDriver:
    """The CUDA driver a context probe (nodemgr.host.ctxprobe) loads and, on simulated GPUs,
    what their driver is told: the node's GPUs (gpus.sim_spec) and the directory of their
    process table."""

    library: str
    sim_gpus: str | None = None
    sim_state_dir: Path | None = None


def nvml_text(value: bytes | str) -> str:
    """A string NVML returned: bytes from older pynvml, str from newer."""
    return value.decode() if isinstance(value, bytes) else str(value)


class GpuBackend(ABC):
    """The node's GPUs (``gpus``, in nodemgr's index order) and what NVML says of them.

    Each query initialises NVML for its own duration; ``session`` holds it initialised
    across several (NVML counts its initialisations, so those inside are cheap)."""

    simulated: bool
    kind: str  # how the log names the GPUs

    def __init__(self, gpus: list[Gpu]) -> None:
        self.gpus = gpus

    @abstractmethod
    def load(self) -> None:
        """Make NVML answer for these GPUs (the simulated one: load it); raise BackendError."""

    @abstractmethod
    def probe_driver(self) -> ProbeDriver:
        """The driver a context probe loads; raise BackendError where it is not there."""

    @abstractmethod
    def lost(self) -> set[int]:
        """Indices of the GPUs now lost or gone; empty when NVML cannot be asked."""

    @contextlib.contextmanager
    def _nvml(self) -> Iterator[Any]:
        """pynvml, NVML initialised for the block; an NVMLError raised in it is raised as
        BackendError."""
        self.load()
        import pynvml

        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            raise BackendError(str(e)) from None
        try:
            yield pynvml
        except pynvml.NVMLError as e:
            raise BackendError(str(e)) from None
        finally:
            pynvml.nvmlShutdown()

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """NVML initialised for the block, for a caller asking several times in a row."""
        with self._nvml():
            yield

    def processes(self) -> list[GpuProcess]:
        """The compute processes NVML lists on each GPU (the bypass audit)."""
        with self._nvml() as pynvml:
            out = []
            for g in self.gpus:
                h = pynvml.nvmlDeviceGetHandleByUUID(g.uuid)
                procs: list[Any] = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
                for p in procs:
                    used = p.usedGpuMemory
                    # NVML reports "not available" (None in pynvml) without the permission.
                    nbytes = int(used) if used is not None else 0
                    out.append(GpuProcess(g.index, int(p.pid), nbytes))
            return out

    def utilization(self) -> list[GpuSample]:
        """Every GPU's figures; a figure a GPU does not support is None (or no processes)."""
        with self._nvml() as pynvml:
            out = []
            for g in self.gpus:
                h = pynvml.nvmlDeviceGetHandleByUUID(g.uuid)
                gpu: int | None = None
                memory: int | None = None
                try:
                    rates = pynvml.nvmlDeviceGetUtilizationRates(h)
                    gpu, memory = int(rates.gpu), int(rates.memory)
                except pynvml.NVMLError:
                    pass
                procs: dict[int, int] = {}
                try:
                    found: list[Any] = pynvml.nvmlDeviceGetProcessUtilization(h, 0)
                except pynvml.NVMLError:  # NOT_FOUND: no samples; NOT_SUPPORTED
                    found = []
                newest: dict[int, int] = {}
                for p in found:
                    # Several samples of one process: the newest.
                    if int(p.timeStamp) >= newest.get(int(p.pid), -1):
                        newest[int(p.pid)] = int(p.timeStamp)
                        procs[int(p.pid)] = min(100, int(p.smUtil))
                out.append(GpuSample(gpu, memory, procs))
            return out

    def describe(self) -> dict[int, dict[str, Any]]:
        """What NVML says of each GPU that a step time estimate takes (nodemgr.policy.
        steptime.GpuSpec's fields, by GPU index): compute capability, cores, highest SM
        and memory clocks, memory bus width, PCIe link; a figure NVML does not give (not
        supported, no permission) is left out."""
        with self._nvml() as pynvml:
            queries: dict[str, Callable[[Any], Any]] = {
                "cc": lambda h: tuple(int(v) for v in pynvml.nvmlDeviceGetCudaComputeCapability(h)),
                "cores": pynvml.nvmlDeviceGetNumGpuCores,
                "sm_mhz": lambda h: pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM),
                "memory_mhz": lambda h: pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_MEM),
                "bus_bits": pynvml.nvmlDeviceGetMemoryBusWidth,
                "pcie_gen": pynvml.nvmlDeviceGetMaxPcieLinkGeneration,
                "pcie_lanes": pynvml.nvmlDeviceGetMaxPcieLinkWidth,
            }
            out: dict[int, dict[str, Any]] = {}
            for g in self.gpus:
                h = pynvml.nvmlDeviceGetHandleByUUID(g.uuid)
                found: dict[str, Any] = {}
                for key, query in queries.items():
                    try:
                        value = query(h)
                    except (pynvml.NVMLError, AttributeError):  # unsupported; older pynvml
                        continue
                    found[key] = value if key == "cc" else int(value)
                out[g.index] = found
            return out

    def free_memory(self, uuid: str) -> int:
        """Bytes NVML sees free on GPU ``uuid``."""
        with self._nvml() as pynvml:
            return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByUUID(uuid)).free)

    def process_memory(self, uuid: str, pid: int) -> int | None:
        """NVML's figure of what process ``pid`` uses on GPU ``uuid``; None while unlisted."""
        with self._nvml() as pynvml:
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if p.pid == pid and p.usedGpuMemory is not None:
                    return int(p.usedGpuMemory)
            return None


class NvmlBackend(GpuBackend):
    """The machine's GPUs, through NVML on its driver."""

    simulated = False
    kind = "NVML"

    @staticmethod
    def inventory() -> list[Gpu]:
        """The GPUs NVML reports, in NVML index order; raise InventoryError without a
        driver."""
        try:
            import pynvml
        except ImportError as e:  # pragma: no cover - a declared dependency
            raise InventoryError(f"nvidia-ml-py is not installed: {e}") from None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            raise InventoryError(f"NVML is not available: {e}") from None
        try:
            out = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                name = pynvml.nvmlDeviceGetName(h)
                uuid = pynvml.nvmlDeviceGetUUID(h)
                mem = pynvml.nvmlDeviceGetMemoryInfo(h).total
                out.append(Gpu(i, nvml_text(uuid), nvml_text(name), int(mem)))
            return out
        finally:
            pynvml.nvmlShutdown()

    def load(self) -> None:
        """pynvml loads the driver's NVML by name at its first initialisation."""

    def probe_driver(self) -> ProbeDriver:
        return ProbeDriver("libcuda.so.1")

    def lost(self) -> set[int]:
        """A GPU that has fallen off the bus (NVML_ERROR_GPU_IS_LOST) or whose UUID NVML no
        longer finds is lost. Other errors say nothing about the GPU and are only logged."""
        try:
            import pynvml
        except ImportError:  # pragma: no cover - a declared dependency
            return set()
        gone = {pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVML_ERROR_NOT_FOUND}
        lost = set()
        try:
            with self._nvml():
                for g in self.gpus:
                    try:
                        h = pynvml.nvmlDeviceGetHandleByUUID(g.uuid)
                        pynvml.nvmlDeviceGetMemoryInfo(h)
                    except pynvml.NVMLError as e:
                        if getattr(e, "value", None) in gone:
                            lost.add(g.index)
                        else:
                            log.warning("GPU health check of GPU %d: %s", g.index, e)
        except BackendError as e:
            log.warning("GPU health check: NVML is not available: %s", e)
        return lost


class SimulatedBackend(GpuBackend):
    """The config's simulated GPUs (docs/simulator.md), through the simulated NVML the
    package ships, whose process table is in ``gpus.simulated_state_dir``: the table the
    tasks' simulated driver records their processes in."""

    simulated = True
    kind = "simulated"

    def __init__(self, config: Config) -> None:
        super().__init__(simulated(config))
        self.state_dir = config.sim_state_dir

    def load(self) -> None:
        import pynvml

        try:
            load_simulated(sim_spec(self.gpus), self.state_dir)
        except (OSError, pynvml.NVMLError) as e:  # a missing or broken library
            raise BackendError(str(e)) from None

    def probe_driver(self) -> ProbeDriver:
        from gpushare import libs

        try:
            library = str(libs.sim_driver_dir() / "libcuda.so.1")
        except FileNotFoundError as e:
            raise BackendError(str(e)) from None
        # The whole node's list: the simulated NVML's process table is the node's.
        return ProbeDriver(library, sim_spec(self.gpus), self.state_dir)

    def lost(self) -> set[int]:
        """Simulated GPUs do not fall off the bus."""
        return set()


_sim_loaded = False


def load_simulated(spec: str, state_dir: Path) -> None:
    """Make pynvml reach the simulated NVML of the simulated GPUs ``spec`` (nodemgr.host.gpus.
    sim_spec) whose process table is in ``state_dir``: the packaged library, loaded by path
    before pynvml loads it by name, told what the tasks' simulated driver is told
    (GPUSHARE_SIM_GPUS and GPUSHARE_SIM_STATE_DIR, which it reads at its first
    initialisation in the process, when it maps the table, making it if it is not there;
    the variables are put back after it). Once a process: the library stays loaded."""
    global _sim_loaded
    if _sim_loaded:
        return
    import pynvml

    from gpushare import libs
    from gpushare.envvars import SIM_GPUS, SIM_STATE_DIR

    ctypes.CDLL(str(libs.sim_driver_dir() / "libnvidia-ml.so.1"), mode=ctypes.RTLD_GLOBAL)
    told = {SIM_GPUS: spec, SIM_STATE_DIR: str(state_dir)}
    saved = {name: os.environ.get(name) for name in told}
    os.environ.update(told)
    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value
    _sim_loaded = True


def choose(config: Config) -> GpuBackend:
    """The node's backend by ``gpus.source``: NVML where it finds GPUs (``auto``) or must
    (``nvml``, else InventoryError), the config's simulated GPUs otherwise."""
    if config.gpu_source == "simulated":
        return SimulatedBackend(config)
    try:
        found = NvmlBackend.inventory()
    except InventoryError:
        if config.gpu_source == "nvml":
            raise
        return SimulatedBackend(config)
    if not found and config.gpu_source == "auto":
        return SimulatedBackend(config)
    return NvmlBackend(found)
