"""Real PyTorch on the simulated driver's device timeline (docs/simulator.md, "The device
timeline"): a small training loop's step takes the modelled device time, which grows with
the wave time, and torch.cuda.synchronize() waits for it. No shim; the pinned torch venv
(test_torch_sim.py's torch_python).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from tests.real_torch.test_torch_sim import torch_env, torch_python  # noqa: F401 (a fixture)

HERE = Path(__file__).resolve().parent
WAVE_NS = 2_000_000


def run_loop(python: str, state: Path, wave_ns: int) -> dict[str, Any]:
    """The loop in a node directory of its own (the table NVML reads the busy time from)."""
    state.mkdir()
    env = torch_env(None)
    env.update(
        GPUSHARE_SIM_TIMELINE="1",
        GPUSHARE_SIM_STATE_DIR=str(state),
        GPUSHARE_SIM_LAUNCH_NS="0",
        GPUSHARE_SIM_WAVE_NS=str(wave_ns),
    )
    p = subprocess.run(
        [python, str(HERE / "torch_timeline_case.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    result: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    return result


def test_a_training_step_takes_the_modelled_time(torch_python: str, tmp_path: Path) -> None:  # noqa: F811
    fast = run_loop(torch_python, tmp_path / "fast", WAVE_NS)
    slow = run_loop(torch_python, tmp_path / "slow", 4 * WAVE_NS)
    # The same kernels, each four times as long (no launch time): exactly four times the
    # device time, however the host ran.
    assert fast["step_busy"] > 0
    assert abs(slow["step_busy"] - 4 * fast["step_busy"]) < 1e-6
    for r in (fast, slow):
        # Each step waits for its work at its synchronisation...
        assert r["step_wall"] >= r["step_busy"]
        # ...and that wait is most of a step: the host queues a step in less time.
        assert r["sync"] >= r["step_busy"] / 4
    # The step time grows with the wave time: the device time dominates it.
    assert slow["step_wall"] >= 4 * fast["step_busy"]
    assert slow["step_busy"] >= slow["step_wall"] / 2
