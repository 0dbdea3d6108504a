"""What the client's tests share: gpushare-run run to its end, and how many threads a client
process has."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
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


def threads_of(pid: int) -> int:
    """How many threads process ``pid`` has (0 once it is gone): a client's ZeroMQ context
    starts its I/O threads just before the client sends its first request and waits."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return int(re.search(r"^Threads:\s+(\d+)", status, re.M)[1])  # type: ignore[index]
