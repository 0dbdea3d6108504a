"""GPU truth for compute shares and latency classes (docs/compute.md) on a real NVIDIA GPU.

Real PyTorch training loops (benchmarks/qos_bench.py's worker: an MLP trained for a given
number of seconds, each step's start and end written as a JSON line) under gpushare-run,
against a nodemgr on the node's GPUs (``gpus.source = "nvml"``), every job pinned to one
GPU. What a job got is judged from its step rate, which needs nothing but the job's own
clock; NVML's per-process utilisation is printed beside it (it cannot judge a share where
processes time-slice a GPU: docs/compute.md, "The pacer"). Marked
``gpu``: skipped where NVML finds no NVIDIA driver, and where no Python with torch and
gpushare installed is found (the iteration hooks come from gpushare's start-up hook).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.gpu.test_gpu import finish, torch_python  # noqa: F401 (a fixture)

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # last, as the benchmarks do: installed gpushare wins
from benchmarks import harness, qos_bench  # noqa: E402

pytestmark = pytest.mark.gpu

GiB = 1 << 30
QUOTA = 8 * GiB
# Steps of GPU work of milliseconds on an H200 (fp32 matrix products of 4096 x 4096 by
# a few thousand rows): the device, not the host, sets the pace.
TRAIN = {"width": 4096, "depth": 4, "batch": 2048, "think_ms": 0}
LS = {"width": 4096, "depth": 2, "batch": 2048, "think_ms": 10}
BE = {"width": 4096, "depth": 8, "batch": 256, "think_ms": 0}


class Node:
    """nodemgr on the node's GPUs, every job pinned to the one with the most free memory."""

    def __init__(self, daemon_factory: Any, run_task: Any, python: str, tmp: Path) -> None:
        if harness.installed_origin(python) is None:
            pytest.skip(f"{python} does not have gpushare installed (its hooks are needed)")
        gpu = harness.pick_gpu(harness.nvml_gpus(), need=2 * QUOTA)
        if gpu is None:
            pytest.skip(f"no GPU has {2 * QUOTA // GiB} GiB free")
        self.gpu = gpu
        self.daemon = daemon_factory(sections={"gpus": {"source": "nvml"}}, heartbeat_timeout=60.0)
        self.run_task = run_task
        self.python = python
        self.tmp = tmp

    def start(self, env: str, seconds: float, spec: dict[str, Any], *opts: str) -> Job:
        out = self.tmp / f"{env}-{time.monotonic_ns()}.jsonl"
        worker = json.dumps({**spec, "seconds": seconds, "out": str(out)})
        ep = self.daemon.env(env, gpus=1, memory=QUOTA)
        p = self.run_task(
            ep,
            self.python,
            str(ROOT / "benchmarks" / "qos_bench.py"),
            "--worker",
            worker,
            opts=list(opts),
            env=harness.pinned(self.gpu),
        )
        return Job(p, out)


class Job:
    def __init__(self, proc: Any, out: Path) -> None:
        self.proc = proc
        self.out = out

    def pid(self) -> int:
        deadline = time.monotonic() + 120
        while not (self.out.exists() and self.out.read_text().endswith("\n")):
            assert self.proc.poll() is None, f"the job ended: {self.proc.communicate(timeout=30)}"
            assert time.monotonic() < deadline, "the job did not start within 120 s"
            time.sleep(0.05)
        return int(json.loads(self.out.read_text().splitlines()[0])["pid"])

    def steps(self) -> list[dict[str, float]]:
        return [r for r in harness.read_jsonl(self.out) if "te" in r]

    def rate(self, since: float, until: float) -> float:
        """Steps a second that ended between the two times."""
        done = [s for s in self.steps() if since <= s["te"] <= until]
        return len(done) / (until - since)


def test_a_compute_share_holds_on_a_gpu(
    daemon_factory: Any,
    run_task: Any,
    torch_python: str,  # noqa: F811 (the fixture imported above)
    tmp_path: Path,
) -> None:
    """Two identical GPU-bound training loops, one ``--compute 30`` and one without a
    share: the other takes the rest (70%), so the capped loop's step rate is about 30/70
    of the other's. Without the pacer they would run at one rate."""
    node = Node(daemon_factory, run_task, torch_python, tmp_path)
    capped = node.start("capped", 10.0, TRAIN, "--compute", "30")
    other = node.start("other", 10.0, TRAIN)
    clock = qos_bench.NvmlClock(node.gpu.uuid)
    with qos_bench.Sampler(clock) as sampler:
        sampler.pids["capped"] = capped.pid()
        sampler.pids["other"] = other.pid()
        finish(capped.proc)
        finish(other.proc)
    since = max(j.steps()[0]["ts"] for j in (capped, other)) + 1.0
    until = min(j.steps()[-1]["te"] for j in (capped, other))
    assert until - since >= 3.0, "the two loops ran together for less than 3 s"
    ratio = capped.rate(since, until) / other.rate(since, until)
    nvml = {n: sampler.shares(n, since, until) for n in ("capped", "other")}
    print(f"rate ratio {ratio:.3f} (30/70 = 0.429); NVML windows {nvml}; {clock.describe()}")
    assert 0.25 <= ratio <= 0.65


def test_ls_keeps_its_speed_beside_be_on_a_gpu(
    daemon_factory: Any,
    run_task: Any,
    torch_python: str,  # noqa: F811 (the fixture imported above)
    tmp_path: Path,
) -> None:
    """A latency-sensitive loop (a step of GPU work, then 10 ms of thinking) alone, then
    beside a best-effort training loop: it keeps at least 85% of its step rate, and the BE
    loop still trains in the time LS leaves idle. Without classes each LS kernel would
    queue behind whatever the BE loop had queued, and the GPU would time-slice the two."""
    node = Node(daemon_factory, run_task, torch_python, tmp_path)
    node.daemon.env("ls", gpus=1, memory=QUOTA)
    node.daemon.admin("quota_set", env="ls", allow_ls=True)
    alone = node.start("ls", 6.0, LS, "--class", "ls")
    finish(alone.proc)
    be = node.start("be", 14.0, BE, "--class", "be")
    be.pid()
    time.sleep(2.0)
    beside = node.start("ls", 6.0, LS, "--class", "ls")
    finish(beside.proc)
    rate_alone = harness.steps_per_s(alone.steps(), 3)
    rate_beside = harness.steps_per_s(beside.steps(), 3)
    since, until = beside.steps()[3]["ts"], beside.steps()[-1]["te"]
    assert be.steps()[-1]["te"] >= until, "the BE loop ended before the LS one: not beside"
    be_rate = be.rate(since, until)
    finish(be.proc)
    print(f"LS {rate_alone:.2f} steps/s alone, {rate_beside:.2f} beside BE; BE {be_rate:.2f}")
    assert rate_beside >= 0.85 * rate_alone
    assert be_rate > 0, "the BE loop made no step while LS ran"
