"""What the tests of gpushare-run's own commands share: a small node to fill, and
gpushare-run run to its end."""

from __future__ import annotations

import os
import subprocess
from typing import Any

import pytest

from tests.conftest import BIN


@pytest.fixture
def node(daemon_factory: Any) -> Any:
    # Two GPUs, one task each: easy to fill.
    return daemon_factory(
        {"scheduler": {"task_threshold": 1}, "gpus": {"simulated_count": 2}},
        heartbeat_timeout=600.0,
    )


def gpushare_run(*args: str, env: dict[str, str] | None = None, **kw: Any) -> Any:
    """gpushare-run with args, in this environment plus ``env``: its exit code and what it
    printed."""
    return subprocess.run(
        [str(BIN / "gpushare-run"), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
        **kw,
    )
