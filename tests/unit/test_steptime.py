"""nodemgr.policy.steptime (docs/prediction.md#step-time): the step time estimate, case by
case, and its table's last row against the simulated driver's timeline defaults."""

from __future__ import annotations

import math
import re
from dataclasses import replace

import pytest

from gpushare.messages import DRY_RUN_SMS
from nodemgr.policy import steptime
from nodemgr.policy.steptime import Features, GpuRates, GpuSpec, Run
from tests.conftest import ROOT

RATES = GpuRates(launch_s=2e-6, wave_s=3e-6, host_bps=10e9, device_bps=1000e9)


def run(
    step: float,
    env: str = "a",
    command: str = "train",
    model: str = "X",
    util: float | None = None,
    kernels: float = 100,
) -> Run:
    return Run(env, command, model, Features(kernels, 0, 0, 0), step, util)


def test_analytic_takes_the_longer_of_device_and_host() -> None:
    # 100 launches x 5 us + 1 GB at 10 GB/s + 2 GB at 1000 GB/s = 0.5 ms + 100 ms + 2 ms.
    device = 100 * 5e-6 + 0.1 + 0.002
    f = Features(100, 1e9, 2e9, 0.05)
    e = steptime.analytic(f, RATES)
    assert e.step_s == pytest.approx(device) and e.utilization == pytest.approx(1.0)
    assert e.source == "analytic"
    # Host-bound: the device is busy its share of the host's time.
    e = steptime.analytic(Features(100, 0, 0, 0.01), RATES)
    assert e.step_s == 0.01 and e.utilization == pytest.approx(100 * 5e-6 / 0.01)
    assert steptime.analytic(Features(0, 0, 0, 0), RATES).utilization == 0.0


def test_without_runs_the_estimate_is_analytic() -> None:
    f = Features(1000, 0, 0, 0.001)
    assert steptime.predict(f, "a", "train", "X", RATES, []) == steptime.analytic(f, RATES)


def test_runs_of_the_same_command_give_the_median_of_the_last_five() -> None:
    f = Features(1000, 0, 0, 0.001)
    runs = [run(s, util=u) for s, u in ((9.0, 0.1), (1.0, 0.5), (2.0, 0.6), (3.0, 0.7))]
    runs += [run(4.0, util=0.8), run(5.0, util=None)]
    e = steptime.predict(f, "a", "train", "X", RATES, runs)
    # The first (9.0) is past the last five; utilisation over those sampled.
    assert (e.step_s, e.source) == (3.0, "history")
    assert e.utilization == pytest.approx(0.65)


def test_another_environment_command_or_model_is_not_the_same_run() -> None:
    f = Features(1000, 0, 0, 0.0)
    base = steptime.analytic(f, RATES).step_s
    for other in (run(1.0, env="b"), run(1.0, command="eval"), run(1.0, model="Y")):
        e = steptime.predict(f, "a", "train", "X", RATES, [other])
        # Other runs on model X teach a ratio; on Y, nothing.
        assert e.source == ("analytic" if other.model == "Y" else "fitted")
        if other.model == "X":
            ratio = 1.0 / steptime.analytic(other.features, RATES).step_s
            assert e.step_s == pytest.approx(base * ratio)


def test_fitted_is_the_median_ratio_over_the_models_last_runs() -> None:
    f = Features(1000, 0, 0, 0.0)
    a = steptime.analytic(Features(100, 0, 0, 0), RATES).step_s
    # Ratios 2, 3, 100 (an outlier), on other commands of model X: the median is 3.
    runs = [run(2 * a, command="p"), run(3 * a, command="q"), run(100 * a, command="r")]
    runs += [run(50 * a, command="s", model="Y")]
    e = steptime.predict(f, "a", "train", "X", RATES, runs)
    assert e.source == "fitted"
    assert e.step_s == pytest.approx(3 * steptime.analytic(f, RATES).step_s)
    # Only the last FIT_RUNS count.
    old = [run(1000 * a, command="old")] * steptime.FIT_RUNS
    e = steptime.predict(f, "a", "train", "X", RATES, old + runs * 7)
    assert e.step_s == pytest.approx(3 * steptime.analytic(f, RATES).step_s)


# What NVML says of an H100 SXM5 and an A100 SXM4 40 GB (the vendors' specifications).
H100 = GpuSpec(
    cc=(9, 0), cores=16896, sm_mhz=1980, memory_mhz=2619, bus_bits=5120, pcie_gen=5, pcie_lanes=16
)
A100 = GpuSpec(
    cc=(8, 0), cores=6912, sm_mhz=1410, memory_mhz=1215, bus_bits=5120, pcie_gen=4, pcie_lanes=16
)


def test_rates_come_from_what_nvml_says_of_the_gpu() -> None:
    h = steptime.rates_of(H100)
    assert h.sms == 132
    assert h.flops_s == pytest.approx(66.9e12, rel=0.01)  # the published FP32 peak
    assert h.half_flops_s == pytest.approx(1070e12, rel=0.01)  # dense BF16 at 1980 MHz
    assert h.device_bps == pytest.approx(3.35e12, rel=0.01)
    assert h.kernel_bps == h.device_bps
    assert h.host_bps == pytest.approx(3.938e9 * 16 * 0.8)
    a = steptime.rates_of(A100)
    assert a.sms == 108
    assert a.flops_s == pytest.approx(19.5e12, rel=0.01)
    assert a.half_flops_s == pytest.approx(312e12, rel=0.01)
    assert a.device_bps == pytest.approx(1.555e12, rel=0.01)
    assert a.host_bps == pytest.approx(h.host_bps / 2, rel=0.01)


def test_what_nvml_does_not_say_takes_the_defaults() -> None:
    r = steptime.rates_of(GpuSpec())
    d = steptime.SIM_TIMELINE
    assert (r.host_bps, r.device_bps, r.sms) == (d.host_bps, d.device_bps, DRY_RUN_SMS)
    assert r.flops_s == r.half_flops_s == math.inf  # no clock: arithmetic is no bound
    # Cores without a compute capability say nothing of the SMs.
    assert steptime.rates_of(GpuSpec(cores=6912, sm_mhz=1410)).sms == DRY_RUN_SMS
    # A GPU without tensor cores (Pascal): no 16-bit bound.
    assert steptime.rates_of(GpuSpec(cc=(6, 1), cores=3584, sm_mhz=1500)).half_flops_s == math.inf


@pytest.mark.parametrize(
    ("cc", "row"),
    [
        ((8, 0), steptime.ARCH[8, 0]),
        ((8, 7), steptime.ARCH[8, 6]),  # Orin: GA10x's
        ((5, 2), steptime.ARCH[5, 0]),
        ((12, 1), steptime.ARCH[12, 0]),
        ((11, 0), steptime.UNKNOWN_ARCH),  # a major version the table lacks: no guess
        ((13, 0), steptime.UNKNOWN_ARCH),
    ],
)
def test_a_capability_takes_its_row_or_the_nearest_below(
    cc: tuple[int, int], row: tuple[int, int]
) -> None:
    assert steptime.arch(cc) == row


def test_no_tensor_bound_without_the_sms() -> None:
    """Without NVML's core count, or with fewer cores than one SM's lanes, the SMs are
    unknown: the dry run's SM count for waves, and no 16-bit bound."""
    for spec in (GpuSpec(cc=(8, 0), sm_mhz=1410), GpuSpec(cc=(9, 0), cores=100, sm_mhz=1000)):
        r = steptime.rates_of(spec)
        assert r.sms == DRY_RUN_SMS and r.half_flops_s == math.inf
        f = Features(10, 0, 0, 0, waves=10, flops=1e9, half_flops=1e12)
        assert steptime.analytic(f, r).step_s > 0


def test_waves_are_scaled_to_the_gpus_sms() -> None:
    rates = replace(RATES, sms=66)  # half the dry run GPU's SMs: twice the waves
    f = Features(100, 0, 0, 0, waves=400)
    assert steptime.analytic(f, rates).step_s == pytest.approx(100 * 2e-6 + 800 * 3e-6)
    # Never fewer waves than launches: each launch is a wave at least.
    many = replace(RATES, sms=10_000)
    assert steptime.analytic(f, many).step_s == pytest.approx(100 * 2e-6 + 100 * 3e-6)


def test_the_kernels_work_is_the_longest_of_its_bounds() -> None:
    rates = replace(RATES, flops_s=1e12, half_flops_s=4e12, kernel_bps=1e11)
    launches = 10 * 2e-6
    waves_only = Features(10, 0, 0, 0, waves=10)
    assert steptime.analytic(waves_only, rates).step_s == pytest.approx(launches + 10 * 3e-6)
    compute = Features(10, 0, 0, 0, waves=10, flops=1e9, half_flops=4e9, op_bytes=1e6)
    assert steptime.analytic(compute, rates).step_s == pytest.approx(launches + 2e-3)
    memory = Features(10, 0, 0, 0, waves=10, flops=1e6, half_flops=0, op_bytes=1e9)
    assert steptime.analytic(memory, rates).step_s == pytest.approx(launches + 1e-2)


def test_features_decode_from_four_or_eight_figures() -> None:
    assert steptime.decoded([1, 2, 3, 4]) == Features(1, 2, 3, 4)
    assert steptime.decoded([1, 2, 3, 4, 5, None, 7, 8]) == Features(1, 2, 3, 4, 5, None, 7, 8)
    for bad in ([1, 2, 3], [1, 2, 3, None], [1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, "x"]):
        with pytest.raises((ValueError, TypeError)):
            steptime.decoded(bad)


def test_the_timeline_rates_are_the_simulators_defaults() -> None:
    source = (ROOT / "sim" / "sim_timeline.c").read_text()
    found = {
        m[1]: float(m[2])
        for m in re.finditer(r'\{ "GPUSHARE_SIM_(\w+)", ([0-9.]+),', source, re.ASCII)
    }
    assert (
        GpuRates(
            found["LAUNCH_NS"] / 1e9,
            found["WAVE_NS"] / 1e9,
            found["HOST_GBPS"] * 1e9,
            found["DEVICE_GBPS"] * 1e9,
        )
        == steptime.SIM_TIMELINE
    )


def test_the_dry_runs_sms_are_the_simulated_devices() -> None:
    source = (ROOT / "sim" / "sim_attrs.c").read_text()
    m = re.search(r'\[16\] = \{ "multiprocessor_count", (\d+) \}', source)
    assert m is not None
    assert int(m[1]) == DRY_RUN_SMS
