"""Step time and utilisation per GPU model (seed 000; docs/prediction.md#step-time): state
in, estimate out, no I/O.

A task sent with its dry run's features (``gpushare-run --shape predicted``) gets an
estimate of its seconds per iteration and of how busy it keeps its GPU, on the model of
the GPU it is granted:

1. **history**: the median of the last ``SAME_RUNS`` runs of the same command in the same
   environment on that GPU model, once there is one;
2. **fitted**: else the analytic estimate below times the median ratio of measured to
   analytic over the node's last ``FIT_RUNS`` runs on that model, once there is one;
3. **analytic**: else, from the features against the GPU's rates, which come from what
   NVML says of it (``GpuSpec``: compute capability, cores, clocks, memory bus, PCIe
   link; ``rates_of``). The device's time per step is each kernel launch's launch time,
   plus the longest of three bounds on the kernels' work (their waves of blocks over the
   GPU's SMs, their arithmetic at its peak rates, the bytes their operators read and
   write at its memory bandwidth: a roofline of the step's totals), plus the copies at
   the host link's and the device's bandwidth. The host's time is the dry run's seconds
   per step on the simulated driver, where kernels take no time: the host's work alone.
   The step takes the longer of the two; the device is busy the device's share of it.

nodemgr.node.node records each run (features, GPU model, measured step time and
utilisation) and feeds them back here.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from gpushare.messages import DRY_RUN_SMS

SAME_RUNS = 5  # runs of the same command a history estimate is the median of
FIT_RUNS = 20  # runs on a GPU model the fitted ratio is the median over


@dataclass(frozen=True)
class Features:
    """What a dry run measured per iteration (docs/prediction.md#the-report); the last four
    are None where it could not measure them (no operator profile without PyTorch)."""

    kernels: float  # kernel launches
    host_bytes: float  # bytes copied between host and device, both ways
    device_bytes: float  # bytes copied within the device
    host_s: float  # the host's seconds per iteration (the dry run's step time)
    waves: float | None = None  # waves of the launches' blocks over DRY_RUN_SMS SMs
    flops: float | None = None  # floating-point operations in 32 bits or wider
    half_flops: float | None = None  # those in 16 bits or narrower (tensor cores')
    op_bytes: float | None = None  # bytes the operators read and wrote in device memory


def decoded(values: Sequence[object]) -> Features:
    """Features from their figures in Features' order (gpushare.messages.FEATURE_FIELDS'):
    the first four numbers, the rest numbers or None, missing ones None. Raise ValueError
    or TypeError for anything else."""
    if not 4 <= len(values) <= 8:
        raise ValueError(f"{len(values)} features: 4 to 8 are")
    nums = [None if v is None else float(v) for v in values]  # type: ignore[arg-type]
    k, hb, db, hs, *rest = nums
    if k is None or hb is None or db is None or hs is None:
        raise ValueError("the first four features are numbers")
    return Features(k, hb, db, hs, *rest)


@dataclass(frozen=True)
class GpuSpec:
    """What NVML says of a GPU (nodemgr.host.backend.GpuBackend.describe); None where it
    did not answer."""

    cc: tuple[int, int] | None = None  # compute capability
    cores: int | None = None  # FP32 cores (nvmlDeviceGetNumGpuCores)
    sm_mhz: int | None = None  # the SMs' highest clock
    memory_mhz: int | None = None  # the memory's highest clock
    bus_bits: int | None = None  # the memory bus's width
    pcie_gen: int | None = None  # the PCIe link's highest generation
    pcie_lanes: int | None = None  # and width


@dataclass(frozen=True)
class GpuRates:
    """What the analytic estimate takes of a GPU."""

    launch_s: float  # device time a kernel launch takes besides its work
    wave_s: float  # device time of one wave of blocks
    host_bps: float  # bytes per second over the host link
    device_bps: float  # bytes per second of a copy within device memory
    sms: int = DRY_RUN_SMS
    flops_s: float = math.inf  # 32-bit operations per second (inf: not a bound)
    half_flops_s: float = math.inf  # 16-bit tensor core operations per second
    kernel_bps: float = math.inf  # bytes per second kernels read and write


# A launch's and a wave's time: the order of a small kernel's on one of this decade's
# data-centre GPUs (NVML has no figure for them), and the simulated timeline's defaults.
LAUNCH_S = 3e-6
WAVE_S = 5e-6

# The simulated driver's device timeline defaults (docs/simulator.md#the-device-timeline;
# a test holds them to sim/sim_timeline.c). It times a kernel by its launch and waves
# alone, never by its arithmetic or its memory traffic: those bounds are left out.
SIM_TIMELINE = GpuRates(launch_s=LAUNCH_S, wave_s=WAVE_S, host_bps=25e9, device_bps=1500e9)

# Per compute capability (major, minor): FP32 lanes per SM, and dense 16-bit tensor core
# operations per SM per clock (a multiply-add is two; 0: no tensor cores), from the
# vendor's architecture documents: Kepler, Maxwell, Pascal, Volta, Turing, Ampere (A100;
# GA10x), Ada, Hopper, Blackwell (data centre; consumer). The lanes are what NVML's core
# count is made of; sim/sim_nvml.c mirrors them (a test holds the two together).
ARCH: dict[tuple[int, int], tuple[int, int]] = {
    (3, 0): (192, 0),
    (5, 0): (128, 0),
    (6, 0): (64, 0),
    (6, 1): (128, 0),
    (7, 0): (64, 1024),
    (7, 5): (64, 1024),
    (8, 0): (64, 2048),
    (8, 6): (128, 1024),
    (8, 9): (128, 1024),
    (9, 0): (128, 4096),
    (10, 0): (128, 8192),
    (12, 0): (128, 1024),
}
# An architecture the table does not know: NVML's usual lanes, and no arithmetic bound
# rather than a guess.
UNKNOWN_ARCH = (128, 0)
# Bytes per second per lane of a PCIe generation after its encoding, and the share of it
# a large copy gets.
PCIE_LANE_BPS = {1: 0.25e9, 2: 0.5e9, 3: 0.985e9, 4: 1.969e9, 5: 3.938e9, 6: 7.563e9}
PCIE_EFFICIENCY = 0.8


def arch(cc: tuple[int, int]) -> tuple[int, int]:
    """ARCH's row for compute capability ``cc``: its own, else the nearest below it of the
    same major version, else UNKNOWN_ARCH."""
    same = [k for k in ARCH if k[0] == cc[0] and k <= cc]
    return ARCH[max(same)] if same else UNKNOWN_ARCH


def rates_of(spec: GpuSpec) -> GpuRates:
    """A GPU's rates from NVML's description: peak arithmetic from its cores, SMs and SM
    clock; memory bandwidth from its memory clock and bus (two transfers a clock); the
    host link from its PCIe link. What NVML did not say is the simulated timeline's,
    and arithmetic it does not give the means to work out is no bound."""
    d = SIM_TIMELINE
    lanes, tensor = arch(spec.cc) if spec.cc else (0, 0)
    sms = spec.cores // lanes if spec.cores and lanes else 0
    hz = spec.sm_mhz * 1e6 if spec.sm_mhz else 0.0
    device_bps = (
        spec.memory_mhz * 1e6 * 2 * spec.bus_bits / 8
        if spec.memory_mhz and spec.bus_bits
        else d.device_bps
    )
    lane = PCIE_LANE_BPS.get(spec.pcie_gen or 0)
    return GpuRates(
        launch_s=LAUNCH_S,
        wave_s=WAVE_S,
        host_bps=lane * spec.pcie_lanes * PCIE_EFFICIENCY
        if lane and spec.pcie_lanes
        else d.host_bps,
        device_bps=device_bps,
        sms=sms or d.sms,
        flops_s=2 * spec.cores * hz if spec.cores and hz else math.inf,
        half_flops_s=sms * tensor * hz if sms and tensor and hz else math.inf,
        kernel_bps=device_bps,
    )


@dataclass(frozen=True)
class Run:
    """A recorded run of a task sent with features."""

    env: str
    command: str | None
    model: str  # the GPU model's name (its first GPU's)
    features: Features
    step_s: float  # measured seconds per iteration
    utilization: float | None  # measured ratio of its GPU kept busy (None: not sampled)


@dataclass(frozen=True)
class Estimate:
    step_s: float
    utilization: float
    source: str  # "history", "fitted" or "analytic"


def analytic(f: Features, rates: GpuRates) -> Estimate:
    waves = f.kernels if f.waves is None else max(f.kernels, f.waves * DRY_RUN_SMS / rates.sms)
    work = max(
        waves * rates.wave_s,
        (f.flops or 0.0) / rates.flops_s + (f.half_flops or 0.0) / rates.half_flops_s,
        (f.op_bytes or 0.0) / rates.kernel_bps,
    )
    device = (
        f.kernels * rates.launch_s
        + work
        + f.host_bytes / rates.host_bps
        + f.device_bytes / rates.device_bps
    )
    step = max(device, f.host_s)
    return Estimate(step, min(1.0, device / step) if step > 0 else 0.0, "analytic")


def predict(
    f: Features, env: str, command: str | None, model: str, rates: GpuRates, runs: Sequence[Run]
) -> Estimate:
    """The estimate for a task of ``command`` in ``env`` on a GPU of ``model`` (runs:
    the node's recorded runs, oldest first)."""
    same = [r for r in runs if r.env == env and r.command == command and r.model == model]
    if same:
        last = same[-SAME_RUNS:]
        utils = [r.utilization for r in last if r.utilization is not None]
        return Estimate(
            statistics.median(r.step_s for r in last),
            statistics.median(utils) if utils else analytic(f, rates).utilization,
            "history",
        )
    base = analytic(f, rates)
    ratios = [
        r.step_s / a.step_s
        for r in [r for r in runs if r.model == model][-FIT_RUNS:]
        if (a := analytic(r.features, rates)).step_s > 0
    ]
    if ratios:
        return Estimate(base.step_s * statistics.median(ratios), base.utilization, "fitted")
    return base
