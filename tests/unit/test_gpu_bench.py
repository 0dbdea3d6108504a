"""The logic of the GPU benchmarks (benchmarks/gpu_timeslice_bench.py, benchmarks/gpu_bench.py)
proven without a GPU: how the time-slicing benchmark sizes its jobs and quota from the GPU's
memory."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # last, as the benchmarks do: installed gpushare wins
from benchmarks import gpu_timeslice_bench as ts  # noqa: E402
from benchmarks import harness  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20

# NVML's total of GPUs of several sizes: 16 GiB, 24 GB, 40 GB and 80 GB (A100), the H200.
GPU_TOTALS = [16 * GiB, 24_576 * MiB, 40_960 * MiB, 81_920 * MiB, 143_771 * MiB]


@pytest.mark.parametrize("total", GPU_TOTALS)
def test_one_job_fits_its_quota_and_two_quotas_do_not_fit_the_gpu(total: int) -> None:
    plan = ts.plan_job(total)
    assert plan.gpu_total == total
    assert plan.batch > 0 and plan.batch % ts.ROW_STEP == 0
    # alone: the job's modelled peak, with room to spare, within its quota within the GPU
    assert plan.peak <= plan.quota * ts.FILL
    assert plan.quota < total
    # shared: nodemgr must refuse a second job, its quota does not fit beside the first's
    assert 2 * plan.quota > total
    # time-sliced: both fit when each states its shape plus the margin
    assert ts.timesliced_charge(plan) <= total
    # a job worth sharing: its temporary memory is most of what it uses
    assert plan.temporary > plan.persistent


def test_the_h200_job_is_what_ran_there_and_fits_where_the_fixed_one_did_not() -> None:
    """The H200 (143,771 MiB): the fixed 60 GiB quota was too small for a job that took
    about 63 GiB with PyTorch 2.11; the plan gives the quota room beyond that."""
    measured = 15_760_000_000 + 51_500_000_000  # settled + temporary peak, 2^20 rows, 2 GiB
    plan = ts.plan_job(143_771 * MiB)
    assert plan.quota > 60 * GiB
    assert plan.quota >= measured * plan.batch / 2**20 * 1.1
    assert 2**20 * 0.9 <= plan.batch <= 2**20 * 1.1  # about the job measured


def test_the_model_is_not_below_what_was_measured() -> None:
    persistent, temporary = ts.job_shape(2**20, 2 * GiB)
    assert persistent >= 15_760_000_000
    assert temporary >= 51_500_000_000


def test_a_gpu_too_small_is_refused_with_its_size() -> None:
    with pytest.raises(harness.BenchError, match="a GPU of 1024 MiB is too small"):
        ts.plan_job(1 * GiB)
