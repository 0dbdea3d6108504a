"""Where the installed package keeps its native libraries."""

from __future__ import annotations

import os
from pathlib import Path

from gpushare.envvars import SHIM as SHIM_ENV
from gpushare.envvars import SIM_DIR as SIM_DIR_ENV

LIB_DIR = Path(__file__).resolve().parent / "lib"


def shim_path() -> Path:
    """The preload library: $GPUSHARE_SHIM if set (e.g. a debug build), else the packaged one."""
    path = Path(os.environ.get(SHIM_ENV) or LIB_DIR / "libgpushare.so")
    if not path.is_file():
        raise FileNotFoundError(
            f"gpushare's preload library is missing at {path}; reinstall gpushare "
            "(pip install .) so the package build compiles it"
        )
    return path


def sim_driver_dir() -> Path:
    """The directory holding the simulated ``libcuda.so.1`` and ``libnvidia-ml.so.1``:
    $GPUSHARE_SIM_DIR if set (e.g. a sanitizer build), else the packaged one."""
    path = Path(os.environ.get(SIM_DIR_ENV) or LIB_DIR / "sim")
    if not (path / "libcuda.so.1").is_file():
        raise FileNotFoundError(
            f"the simulated driver is missing from {path}; reinstall gpushare (pip install .)"
        )
    return path
