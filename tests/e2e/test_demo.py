"""`make demo` is also a smoke test of the whole product: run it as users would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

DEMO = Path(__file__).resolve().parents[2] / "demo" / "demo.py"


def test_the_demo_runs_every_step() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSHARE_")}
    r = subprocess.run(
        [sys.executable, str(DEMO)], capture_output=True, text=True, timeout=120, env=env
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr
    assert "checks passed" in r.stdout + r.stderr, last
    assert "waiting for 1 GPU: position 1 of 1" in r.stdout + r.stderr
    assert "CUDA_ERROR_OUT_OF_MEMORY" in r.stdout
