"""gpushare-run --predict with real PyTorch: the dry run of a training job (the model zoo of
benchmarks/predict_zoo.py) against the same job run under gpushare-run on a real nodemgr's
simulated GPU, whose peak nodemgr's history records. make bench-predict holds the whole zoo
to its targets; here two jobs whose memory the dry run's release changes or whose steps
run in mixed precision."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import BIN, ROOT, SANITIZER_PRELOAD
from tests.real_torch.test_torch_sim import torch_env, torch_python  # noqa: F401 (a fixture)

ZOO = ROOT / "benchmarks" / "predict_zoo.py"
GIB = 1 << 30
MIB = 1 << 20
STEPS = 6


def zoo(python: str, name: str, batch: int, optimizer: str) -> list[str]:
    return [python, str(ZOO), name, str(batch), optimizer, str(STEPS)]


def gpushare_run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "gpushare-run"), *args],
        env=env or environment(),
        capture_output=True,
        text=True,
        timeout=300,
        cwd="/",
    )


def environment() -> dict[str, str]:
    env = torch_env(None)
    for drop in ("LD_LIBRARY_PATH", "GPUSHARE_SIM_GPUS"):  # gpushare-run sets what it needs
        env.pop(drop, None)
    if SANITIZER_PRELOAD:
        env["LD_PRELOAD"] = " ".join(SANITIZER_PRELOAD)
    return env


@pytest.mark.parametrize(
    ("name", "batch", "optimizer"), [("resnet-m", 32, "adam"), ("dec-s-bf16", 8, "sgd")]
)
def test_the_dry_run_predicts_the_peak_of_the_real_run(
    daemon_factory: Any,
    torch_python: str,  # noqa: F811
    name: str,
    batch: int,
    optimizer: str,
) -> None:
    cmd = zoo(torch_python, name, batch, optimizer)
    dry = gpushare_run("--predict", "--json", "--", *cmd)
    assert dry.returncode == 0, dry.stderr[-4000:]
    got = json.loads(dry.stdout)
    # It stopped at its 4th boundary (3 iterations, one more after the release), inside
    # the 4th step's optimizer step.
    assert got["iterations"] == 4 and got["exit_code"] is None
    steps = [ln.split()[1] for ln in dry.stderr.splitlines() if ln.startswith("step ")]
    assert steps == ["0", "1", "2"]
    assert got["persistent"] > 0 and got["temporary"] > 0
    assert got["kernels_per_step"] > 10

    d = daemon_factory(
        {
            "gpus": {
                "simulated_count": 1,
                "simulated_memory": "80GiB",
                "context_memory": "0",
            },
            "scheduler": {"memory_reserve": "0"},
        },
        heartbeat_timeout=30.0,
    )
    endpoint = d.env("zoo", 1, 80 * GIB)
    real = gpushare_run("--endpoint", endpoint, "--", *cmd)
    assert real.returncode == 0, real.stderr[-4000:]
    assert sum(ln.startswith("step ") for ln in real.stdout.splitlines()) == STEPS
    [record] = [r for r in d.admin("history", env="zoo")["records"]]
    # The real run on a shared GPU holds what the dry run saw before its release: its
    # cache grown over its steps, never emptied. (The allocator's own choices may differ
    # by a block between two processes.)
    assert abs(got["peak"] - record["peak"]) <= 0.01 * record["peak"], (got, record)


def test_a_job_the_dry_run_cannot_finish_is_reported(tmp_path: Path, torch_python: str) -> None:  # noqa: F811
    """A job that fails before its iterations are in: no prediction, exit 97, and what it
    did before is still shown, with the result it read back from the GPU."""
    script = tmp_path / "fails.py"
    script.write_text(
        "import os, sys, torch\n"
        "m = torch.nn.Linear(256, 256).cuda()\n"
        "o = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "for step in range(2):\n"
        "    loss = m(torch.randn(32, 256, device='cuda')).square().mean()\n"
        "    loss.backward(); o.step()\n"
        "    print('loss', loss.item())\n"
        "print('stopping: a check of the data failed', file=sys.stderr, flush=True)\n"
        # Not sys.exit: see benchmarks/predict_zoo.py's end() (PyTorch's autograd thread
        # and interpreter finalization).
        "os._exit(1)\n"
    )
    r = gpushare_run("--predict", "--json", "--", torch_python, str(script))
    assert r.returncode == 97, r.stderr[-4000:]
    got = json.loads(r.stdout)
    assert got["predicted"] is False and got["exit_code"] == 1 and got["iterations"] == 2
    assert got["peak"] > 0 and got["persistent"] is None
    assert got["copies_per_step"]["reads"] == 1  # loss.item()
    assert "a check of the data failed" in r.stderr


def test_a_job_sent_with_its_prediction_runs_within_its_grant(
    daemon_factory: Any,
    torch_python: str,  # noqa: F811
) -> None:
    """--shape predicted (docs/prediction.md#admission): the dry run first, then the real
    run granted its predicted peak and the margin instead of the quota, never topped up:
    the prediction held."""
    d = daemon_factory(
        {
            "gpus": {"simulated_count": 1, "simulated_memory": "16GiB", "context_memory": "0"},
            "scheduler": {"memory_reserve": "0"},
        },
        heartbeat_timeout=30.0,
    )
    endpoint = d.env("zoo", 1, 16 * GIB)
    cmd = zoo(torch_python, "resnet-m", 32, "adam")
    real = gpushare_run("--endpoint", endpoint, "--shape", "predicted", "--", *cmd)
    assert real.returncode == 0, real.stderr[-4000:]
    assert "predicted peak" in real.stderr
    # The dry run's output is not the run's: its steps are printed once.
    assert sum(ln.startswith("step ") for ln in real.stdout.splitlines()) == STEPS
    [record] = d.admin("history", env="zoo")["records"]
    predicted = record["predicted"]
    assert predicted is not None and predicted > 0
    assert record["memory"] == math.ceil(predicted * 1.1 / MIB) * MIB < 16 * GIB
    assert record["topups"] == 0
    assert abs(predicted - record["peak"]) <= 0.01 * record["peak"], record


def test_the_operator_profile_counts_one_iterations_arithmetic(
    tmp_path: Path,
    torch_python: str,  # noqa: F811
) -> None:
    """docs/prediction.md#the-operator-profile: the iteration after the release, forward
    and backward, counted by operator: a two-layer MLP's matrix products are 2·m·n·k
    each, the first layer's input needing no gradient; a bfloat16 one's are 16-bit, and
    float32 ones PyTorch lets run as TF32 count twice among them. A job that compiles
    (torch.compile, in full-graph mode) gets no profile, and its dry run runs as
    without one."""
    script = tmp_path / "mlp.py"
    script.write_text(
        "import sys, torch\n"
        "dtype = getattr(torch, sys.argv[1])\n"
        "torch.set_float32_matmul_precision(sys.argv[2])\n"
        "m = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(),\n"
        "                        torch.nn.Linear(1024, 256)).cuda().to(dtype)\n"
        "o = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "for step in range(6):\n"
        "    x = torch.randn(64, 512, dtype=dtype).cuda()\n"
        "    if sys.argv[3] == 'compiled':\n"
        "        x = torch.compile(lambda a: a * 2, backend='eager', fullgraph=True)(x)\n"
        "    m(x).float().square().mean().backward()\n"
        "    o.step(); o.zero_grad()\n"
    )
    # Forward: 64x512 by 512x1024 and 64x1024 by 1024x256; backward: both weights'
    # gradients and the second layer's input's.
    flops = 2 * 64 * (512 * 1024 * 2 + 1024 * 256 * 3)
    cases = [
        ("float32", "highest", flops, 0),
        ("float32", "high", 0, 2 * flops),
        ("bfloat16", "highest", 0, flops),
    ]
    for dtype, precision, full, half in cases:
        r = gpushare_run(
            "--predict", "--json", "--", torch_python, str(script), dtype, precision, "eager"
        )
        assert r.returncode == 0, r.stderr[-4000:]
        got = json.loads(r.stdout)
        assert (got["flops_per_step"], got["half_flops_per_step"]) == (full, half), dtype
        assert got["batch"] == 64  # the input copied to the GPU
        ops = got["operators"]
        assert ops["addmm"]["calls"] == 2 and ops["addmm"]["largest_input"] == 1024 * 512
        assert ops["mm"]["calls"] == 3
        assert sum(o["flops"] for o in ops.values()) == flops
        # The first layer's forward reads its input, weight and bias and writes its output.
        size = 2 if dtype == "bfloat16" else 4
        assert got["op_bytes_per_step"] > (64 * 512 + 512 * 1024 + 1024 + 64 * 1024) * size
        assert got["waves_per_step"] >= got["kernels_per_step"] > 10
    r = gpushare_run(
        "--predict", "--json", "--", torch_python, str(script), "float32", "highest", "compiled"
    )
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads(r.stdout)
    assert got["predicted"] is True and got["persistent"] > 0
    assert got["operators"] is None and got["flops_per_step"] is None
    assert got["waves_per_step"] >= got["kernels_per_step"] > 10
