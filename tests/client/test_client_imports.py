"""The client's modules: it imports only nodemgr's wire code (the auto-loader runs inside a
user's `import torch`, and gpushare-run starts in front of every command, so neither loads
the daemon's config and its TOML parser, state, GPU inventory, server or admin CLI), and
what it raises has one root (docs/client.md#auto-load-python)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CLIENT_MODULES = [
    "client_plugin.autoload",
    "client_plugin.autotask",
    "gpushare.iterations",
    "client_plugin.grant",
    "client_plugin.run",
    "client_plugin.predict",
    "client_plugin.supervise",
]
DAEMON_SIDE = [
    "nodemgr.config",
    "nodemgr.node.node",
    "nodemgr.host.gpus",
    "nodemgr.loop.server",
    "nodemgr.cli",
]


@pytest.mark.parametrize("module", CLIENT_MODULES)
def test_client_imports_no_daemon_module(module: str, tmp_path: Path) -> None:
    code = f"import json, sys, {module}; print(json.dumps(sorted(sys.modules)))"
    # Unmeasured: coverage.py, started in every process of a measured run (`make pytest`),
    # loads modules of its own, tomllib among them.
    env = {k: v for k, v in os.environ.items() if k != "COVERAGE_PROCESS_CONFIG"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    loaded = json.loads(out)
    assert module in loaded
    bad = [
        m
        for m in loaded
        if m == "tomllib"
        or m.startswith("tomllib.")
        or any(m == d or m.startswith(d + ".") for d in DAEMON_SIDE)
    ]
    assert bad == [], f"importing {module} loads {bad}"


def test_one_exception_root() -> None:
    from client_plugin import autotask, settings
    from gpushare import client, shim
    from gpushare.errors import GpushareError

    assert issubclass(GpushareError, RuntimeError)  # not taken for a missing framework
    assert autotask.GpushareError is GpushareError
    for cls in (
        client.NodeError,
        client.QuotaZero,
        client.QuotaExceeded,
        client.NoResources,
        client.Unreachable,
        settings.SettingsError,
        shim.ShimError,
        shim.ShimNotLoaded,
        shim.ShimTooLate,
        shim.ShimAlreadyAttached,
        shim.ShimLedgerError,
    ):
        assert issubclass(cls, GpushareError), cls
    assert issubclass(settings.SettingsError, ValueError)
