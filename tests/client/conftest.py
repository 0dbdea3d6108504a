"""What the tests of gpushare-run's own commands share: a small node to fill, and
gpushare-run run to its end."""

from __future__ import annotations

import os
import subprocess
from typing import Any

from tests.conftest import BIN


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
