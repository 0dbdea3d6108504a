"""Run busy-launching processes under the shim on one simulated GPU, with whatever
schedules a test sets in their ledger, and read when each launched (tests/c/compute_child.c).

Fixture-free, so that timeline-based tests (the simulated driver's modelled device time)
can use it too: ``build`` the program once, ``start`` one child per task, ``collect``
each, then look at the bins (``busy_fraction``, ``in_window``).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gpushare import libs
from nodemgr.host import gpus
from tests.conftest import CSRC, cc, shim_preload

GiB = 1 << 30
NODE = [gpus.Gpu(i, gpus.simulated_uuid(i), "Compute Sim", 16 * GiB) for i in range(2)]
# Settings of the test's own environment that would change what the children do.
AT_LOAD = ("GPUSHARE_", "CUDA_", "LD_PRELOAD")


@dataclass
class Bins:
    """A child's launches per bin: absolute CLOCK_MONOTONIC bin start (ns) -> launches."""

    bin_ns: int
    counts: dict[int, int]
    total: int

    def busy_fraction(self, start_ns: int, end_ns: int) -> float:
        """The fraction of the bins in [start_ns, end_ns) in which the child launched."""
        first = -(-start_ns // self.bin_ns) * self.bin_ns
        n = max(1, (end_ns - first) // self.bin_ns)
        busy = sum(1 for t in self.counts if first <= t < first + n * self.bin_ns)
        return busy / n

    def span(self) -> tuple[int, int]:
        """The first and the end of the last bin with launches."""
        return min(self.counts), max(self.counts) + self.bin_ns

    def overlap(self, other: Bins) -> float:
        """The fraction of this child's bins with launches in which ``other`` launched too."""
        return len(set(self.counts) & set(other.counts)) / max(1, len(self.counts))

    def in_window(self, period_ns: int, offset_ns: int, length_ns: int, slack_ns: int) -> float:
        """The fraction of the launches whose bin lies in [offset - slack, offset + length +
        slack) of a period (CLOCK_MONOTONIC multiples of it)."""
        inside = 0
        for t, n in self.counts.items():
            lo = (t - offset_ns + slack_ns) % period_ns
            hi = (t + self.bin_ns - offset_ns - slack_ns) % period_ns
            if lo < length_ns + 2 * slack_ns or hi < length_ns:
                inside += n
        return inside / max(1, self.total)


def build(out_dir: Path) -> Path:
    sim = libs.sim_driver_dir()
    return cc(
        out_dir / "compute_child",
        str(CSRC / "compute_child.c"),
        f"-L{sim}",
        "-l:libcuda.so.1",
    )


def environment(ledger: Path | None, task_id: str | None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(AT_LOAD)}
    env["LD_LIBRARY_PATH"] = str(libs.sim_driver_dir())
    env["GPUSHARE_SIM_GPUS"] = gpus.sim_spec(NODE)
    env["LD_PRELOAD"] = shim_preload()
    if ledger is not None and task_id is not None:
        env["GPUSHARE_LEDGER"] = str(ledger)
        env["GPUSHARE_TASK_ID"] = task_id
    return {**env, **extra}


def start(
    program: Path,
    ledger: Path | None,
    task_id: str | None,
    seconds: float,
    bin_us: int = 1000,
    gap_us: int = 100,
    capture: bool = False,
    **extra: str,
) -> subprocess.Popen[str]:
    """One child launching for ``seconds`` (whole seconds), ``gap_us`` apart, as a process
    of ``task_id`` (``capture``: into a stream capture that lasts the whole run); returns
    once it is ready to launch."""
    p = subprocess.Popen(
        [str(program), str(int(seconds)), str(bin_us), str(gap_us)]
        + (["capture"] if capture else []),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=environment(ledger, task_id, **extra),
    )
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line == "ready\n", (line, p.stderr.read() if p.stderr else "")
    return p


def collect(p: subprocess.Popen[str], bin_us: int = 1000, timeout: float = 60) -> Bins:
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, err
    return parse(out, bin_us)


def parse(out: str, bin_us: int = 1000) -> Bins:
    """A child's output as its bins."""
    counts: dict[int, int] = {}
    total = 0
    for line in out.splitlines():
        a, b = line.split()
        if a == "done":
            total = int(b)
        else:
            counts[int(a)] = int(b)
    return Bins(bin_us * 1000, counts, total)


def run_all(
    program: Path, ledger: Path, task_ids: Sequence[str], seconds: float, bin_us: int = 1000
) -> list[Bins]:
    """One child per task id, all at once; their bins."""
    children = [start(program, ledger, t, seconds, bin_us) for t in task_ids]
    return [collect(p, bin_us, timeout=seconds + 60) for p in children]
