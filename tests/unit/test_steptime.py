"""nodemgr.policy.steptime (docs/prediction.md#step-time): the step time estimate, case by
case, and its table's last row against the simulated driver's timeline defaults."""

from __future__ import annotations

import re

import pytest

from nodemgr.policy import steptime
from nodemgr.policy.steptime import Features, GpuRates, Run
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


@pytest.mark.parametrize(
    ("name", "word"),
    [
        ("NVIDIA H200", "H200"),
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA L40S", "L40"),
        ("NVIDIA L4", "L4"),
        ("gpushare Simulated GPU", ""),
    ],
)
def test_rates_are_matched_by_model_name(name: str, word: str) -> None:
    assert steptime.rates_for(name) == dict(steptime.GPU_RATES)[word]


def test_the_last_row_is_the_simulators_timeline_defaults() -> None:
    source = (ROOT / "sim" / "sim_timeline.c").read_text()
    found = {
        m[1]: float(m[2])
        for m in re.finditer(r'\{ "GPUSHARE_SIM_(\w+)", ([0-9.]+),', source, re.ASCII)
    }
    last = dict(steptime.GPU_RATES)[""]
    assert last == GpuRates(
        found["LAUNCH_NS"] / 1e9,
        found["WAVE_NS"] / 1e9,
        found["HOST_GBPS"] * 1e9,
        found["DEVICE_GBPS"] * 1e9,
    )
