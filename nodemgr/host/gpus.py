"""The node's GPUs: from NVML when a driver is present, or simulated from the config."""

from __future__ import annotations

import logging
import uuid as uuidlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from gpushare.protocol import names_gpu
from nodemgr.config import Config

log = logging.getLogger("nodemgr")


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str  # "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"
    name: str
    memory: int  # bytes
    # Simulated GPUs: bytes the simulated driver takes for each process's context there.
    sim_context: int = 0

    @property
    def uuid_bytes(self) -> bytes:
        return uuidlib.UUID(self.uuid.removeprefix("GPU-")).bytes


class InventoryError(Exception):
    pass


def simulated_uuid(index: int) -> str:
    """The UUID the simulated driver gives device ``index`` (sim/sim_spec.c)."""
    return f"GPU-5349d000-0000-4000-8000-{index:012x}"


def simulated(config: Config) -> list[Gpu]:
    return [
        Gpu(i, simulated_uuid(i), config.sim_name, config.sim_memory, config.sim_context)
        for i in range(config.sim_count)
    ]


def sim_spec(gpus: list[Gpu]) -> str:
    """GPUSHARE_SIM_GPUS for the simulated driver: ``NAME|UUID|BYTES`` joined by ``;``,
    with ``|context=BYTES`` where its contexts take memory (docs/simulator.md)."""
    return ";".join(
        f"{g.name}|{g.uuid}|{g.memory}" + (f"|context={g.sim_context}" if g.sim_context else "")
        for g in gpus
    )


def resolve(
    names: Sequence[str],
    gpus: Sequence[Gpu],
    what: str = "CUDA_VISIBLE_DEVICES (request.devices)",
    fix: str | None = "fix or unset CUDA_VISIBLE_DEVICES",
) -> frozenset[int]:
    """The indices of the GPUs a request's ``devices`` name (docs/protocol.md).

    A name is a GPU index, or a GPU UUID or a prefix of one, compared without
    regard to case; gpushare.protocol has checked its form. Raise ValueError,
    naming the entry, for a name that matches no GPU or several, or a GPU
    named twice. ``what`` names the list in the message; ``fix``, if any, ends
    the message for a name that matches no GPU.
    """
    named: dict[int, str] = {}
    for name in names:
        matches = [g.index for g in gpus if names_gpu(name, g.index, g.uuid)]
        if not matches:
            have = {0: "no GPUs", 1: "GPU 0"}.get(len(gpus), f"GPUs 0-{len(gpus) - 1}")
            msg = (
                f"{what} entry {name!r} names no GPU of this node (it has {have}; "
                "`nodemgr status` lists their indices and UUIDs)"
            )
            raise ValueError(f"{msg}: {fix}" if fix else msg)
        if len(matches) > 1:
            raise ValueError(
                f"{what} entry {name!r} is the start of the "
                f"UUIDs of GPUs {', '.join(map(str, matches))}: give more of the UUID "
                "(`nodemgr status` lists them)"
            )
        index = matches[0]
        if index in named:
            first = named[index]
            twice = f"{name!r} twice" if first == name else f"{first!r} and {name!r}"
            raise ValueError(f"{what} names GPU {index} {twice}: name each GPU once")
        named[index] = name
    return frozenset(named)


def nvml_handles(pynvml: Any) -> Iterator[tuple[int, Any]]:
    """Each GPU's NVML index and device handle (NVML initialized)."""
    for i in range(pynvml.nvmlDeviceGetCount()):
        yield i, pynvml.nvmlDeviceGetHandleByIndex(i)


def nvml_text(value: bytes | str) -> str:
    """A string NVML returned: bytes from older pynvml, str from newer."""
    return value.decode() if isinstance(value, bytes) else str(value)


def nvml() -> list[Gpu]:
    """The GPUs NVML reports, in NVML index order; raise InventoryError without a driver."""
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
        for i, h in nvml_handles(pynvml):
            name = pynvml.nvmlDeviceGetName(h)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h).total
            out.append(Gpu(i, nvml_text(uuid), nvml_text(name), int(mem)))
        return out
    finally:
        pynvml.nvmlShutdown()


def lost_gpus(gpus: list[Gpu]) -> set[int]:
    """Indices of the GPUs NVML now reports lost or gone; empty when NVML cannot be asked.

    A GPU that has fallen off the bus (NVML_ERROR_GPU_IS_LOST) or whose UUID
    NVML no longer finds is lost. Other errors say nothing about the GPU and
    are only logged.
    """
    try:
        import pynvml
    except ImportError:  # pragma: no cover - a declared dependency
        return set()
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        log.warning("GPU health check: NVML is not available: %s", e)
        return set()
    gone = {pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVML_ERROR_NOT_FOUND}
    lost = set()
    try:
        for g in gpus:
            try:
                h = pynvml.nvmlDeviceGetHandleByUUID(g.uuid)
                pynvml.nvmlDeviceGetMemoryInfo(h)
            except pynvml.NVMLError as e:
                if getattr(e, "value", None) in gone:
                    lost.add(g.index)
                else:
                    log.warning("GPU health check of GPU %d: %s", g.index, e)
    finally:
        pynvml.nvmlShutdown()
    return lost


def discover(config: Config) -> tuple[list[Gpu], bool]:
    """Return (gpus, simulated) according to ``gpus.source``."""
    if config.gpu_source == "simulated":
        return simulated(config), True
    try:
        found = nvml()
    except InventoryError:
        if config.gpu_source == "nvml":
            raise
        return simulated(config), True
    if not found and config.gpu_source == "auto":
        return simulated(config), True
    return found, False
