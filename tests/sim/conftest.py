"""What the simulator's own tests share: tests/c/sim_probe.c, which drives the simulated
driver with no shim, the real driver's cuGetProcAddress rules to judge its answers by, and
programs run on the simulated driver alone."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpushare import libs
from tests.conftest import CSRC, cc

# cuGetProcAddress's status values (cuda.h's CUdriverProcAddressQueryResult) and flags.
PROC_FOUND = 0
PROC_SYMBOL_NOT_FOUND = 1
PROC_VERSION_NOT_SUFFICIENT = 2
PER_THREAD_DEFAULT_STREAM = 2  # CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM


@dataclass(frozen=True)
class Proc:
    """One ABI variant a cuGetProcAddress base name resolves to from `version` on."""

    base: str
    abi: str
    version: int
    per_thread: bool


def driver_answer(rows: Sequence[Proc], version: int, flags: int) -> tuple[int, str | None]:
    """The real driver's cuGetProcAddress_v2 for one base name with these rows: (status, ABI
    name or None). The newest variant introduced at or before version (any version above
    the driver's own included); with flags PER_THREAD_DEFAULT_STREAM, a name that has
    per-thread variants gets only those, so none below the first of them (not the legacy
    variant), and one without gets its legacy variant."""
    if not rows:
        return PROC_SYMBOL_NOT_FOUND, None
    per_thread = flags == PER_THREAD_DEFAULT_STREAM and any(r.per_thread for r in rows)
    usable = [r for r in rows if r.per_thread == per_thread and r.version <= version]
    if not usable:
        return PROC_VERSION_NOT_SUFFICIENT, None
    return PROC_FOUND, max(usable, key=lambda r: r.version).abi


def run_probe(probe: Path, mode: str, stdin: str = "") -> str:
    """tests/c/sim_probe.c in one of its modes, on the default simulated node, no shim."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "CUDA_VISIBLE_DEVICES")}
    env.pop("GPUSHARE_SIM_GPUS", None)
    return subprocess.run(
        [str(probe), mode],
        input=stdin,
        capture_output=True,
        text=True,
        check=True,
        env=env,
        timeout=120,
    ).stdout


def run_sim_json(
    args: Sequence[str], library_path: str, env_extra: dict[str, str] | None = None
) -> dict[str, Any]:
    """Runs a program that prints one JSON object, on the simulated driver (found on
    library_path) and nothing else of this process's: no preload, no GPUSHARE_ or CUDA_
    variables but those in env_extra. Returns the object."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUSHARE_", "CUDA_"))}
    env.pop("LD_PRELOAD", None)
    env.update(env_extra or {}, LD_LIBRARY_PATH=library_path)
    run = subprocess.run(list(args), capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    result: dict[str, Any] = json.loads(run.stdout)
    return result


@pytest.fixture(scope="session")
def sim_probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/c/sim_probe.c, linked straight against the simulated driver (no shim)."""
    sim = libs.sim_driver_dir()
    return cc(
        tmp_path_factory.mktemp("sim") / "sim_probe",
        str(CSRC / "sim_probe.c"),
        f"-L{sim}",
        "-l:libcuda.so.1",
        f"-Wl,-rpath,{sim}",
        "-ldl",
    )
