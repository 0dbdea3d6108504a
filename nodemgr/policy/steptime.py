"""Step time and utilisation per GPU model (seed 000; docs/prediction.md#step-time): state
in, estimate out, no I/O.

A task sent with its dry run's features (``gpushare-run --shape predicted``) gets an
estimate of its seconds per iteration and of how busy it keeps its GPU, on the model of
the GPU it is granted:

1. **history**: the median of the last ``SAME_RUNS`` runs of the same command in the same
   environment on that GPU model, once there is one;
2. **fitted**: else the analytic estimate below times the median ratio of measured to
   analytic over the node's last ``FIT_RUNS`` runs on that model, once there is one;
3. **analytic**: else, from the features against the model's rates: the device's time per
   step (each kernel launch its launch and one wave, the copies at the host link's and
   the device's bandwidth) against the host's (the dry run's seconds per step on the
   simulated driver, where kernels take no time: the host's work alone). The step takes
   the longer of the two; the device is busy the device's share of it.

nodemgr.node.node records each run (features, GPU model, measured step time and
utilisation) and feeds them back here.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

SAME_RUNS = 5  # runs of the same command a history estimate is the median of
FIT_RUNS = 20  # runs on a GPU model the fitted ratio is the median over


@dataclass(frozen=True)
class Features:
    """What a dry run measured per iteration (docs/prediction.md#the-report)."""

    kernels: float  # kernel launches
    host_bytes: float  # bytes copied between host and device, both ways
    device_bytes: float  # bytes copied within the device
    host_s: float  # the host's seconds per iteration (the dry run's step time)


@dataclass(frozen=True)
class GpuRates:
    """What the analytic estimate takes of a GPU model."""

    launch_s: float  # device time a kernel launch takes besides its waves
    wave_s: float  # device time of one wave of blocks
    host_bps: float  # bytes per second over the host link
    device_bps: float  # bytes per second within device memory


# Rates by GPU model, matched by a word of NVML's name (first match wins). Bandwidths are
# the vendors' published figures (HBM; PCIe 5.0 or 4.0 x16, about 80% of the link); a
# launch's and a wave's time are the order of a small kernel's on such a GPU. The last
# row, for any other name, has the simulated driver's timeline defaults
# (docs/simulator.md#the-device-timeline; a test holds them to sim/sim_timeline.c).
GPU_RATES: tuple[tuple[str, GpuRates], ...] = (
    ("H200", GpuRates(3e-6, 5e-6, 50e9, 4800e9)),
    ("H100", GpuRates(3e-6, 5e-6, 50e9, 3350e9)),
    ("A100", GpuRates(4e-6, 6e-6, 25e9, 2000e9)),
    ("L40", GpuRates(4e-6, 8e-6, 25e9, 864e9)),
    ("L4", GpuRates(4e-6, 10e-6, 25e9, 300e9)),
    ("", GpuRates(3e-6, 5e-6, 25e9, 1500e9)),
)


def rates_for(model: str) -> GpuRates:
    """The rates of the first row of GPU_RATES whose word is in ``model``."""
    for word, rates in GPU_RATES:
        if word in model:
            return rates
    raise AssertionError("GPU_RATES ends with a row for every name")


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
    device = (
        f.kernels * (rates.launch_s + rates.wave_s)
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
