"""The node's GPUs: what nodemgr knows of each, the simulated ones of the config, and which
GPUs a request names. Finding the GPUs NVML reports is nodemgr.host.backend's."""

from __future__ import annotations

import uuid as uuidlib
from collections.abc import Sequence
from dataclasses import dataclass

from gpushare.protocol import names_gpu
from nodemgr.config import Config


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
