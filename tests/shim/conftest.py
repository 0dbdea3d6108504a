"""What the shim's tests share: a program run three ways over one driver (without the shim,
with it preloaded inert, and under a real grant), and tests/c/driver_probe.c."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import CSRC, cc, shim_preload


@dataclass(frozen=True)
class Result:
    """How a child process ended: exit status, stdout, stderr."""

    rc: int
    out: str
    err: str


def driver_env(lib: Path, **extra: str) -> dict[str, str]:
    """This process's environment without gpushare's or CUDA's settings and without a
    preload, finding the driver in lib."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUSHARE_", "CUDA_"))}
    env.pop("LD_PRELOAD", None)
    return {**env, "LD_LIBRARY_PATH": str(lib), **extra}


def run_ways(
    daemon: Any, run_task: Any, lib: Path, argv: Sequence[str], stdin: str = ""
) -> dict[str, Result]:
    """argv run three ways, each finding the driver (libcuda.so.1, libnvidia-ml.so.1) in
    lib and reading stdin: without the shim ("plain"), with it preloaded "inert" (no
    ledger), and "enforcing" under a real grant of an environment "alice" from daemon."""
    feed = Path(daemon.root) / "stdin"
    feed.write_text(stdin)
    out = {}
    for way, extra in (("plain", {}), ("inert", {"LD_PRELOAD": shim_preload()})):
        with feed.open() as f:
            run = subprocess.run(
                list(argv),
                stdin=f,
                capture_output=True,
                text=True,
                env=driver_env(lib, **extra),
                timeout=120,
            )
        out[way] = Result(run.returncode, run.stdout, run.stderr)
    ep = daemon.env("alice", gpus=1, memory=1 << 30)
    with feed.open() as f:
        # gpushare-run puts the simulated driver first on a simulated node: this is the
        # real one's run.
        p = run_task(ep, "env", f"LD_LIBRARY_PATH={lib}", *argv, stdin=f)
        stdout, stderr = p.communicate(timeout=120)
    out["enforcing"] = Result(p.returncode, stdout, stderr)
    return out


@pytest.fixture(scope="session")
def driver_probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/c/driver_probe.c: dlopens whatever libcuda.so.1 the loader finds."""
    return cc(
        tmp_path_factory.mktemp("probe") / "driver_probe", str(CSRC / "driver_probe.c"), "-ldl"
    )
