"""What the daemon's tests share: nodemgr's loop in the test process, the CLI run as another
user, a request that waits in a thread of its own, and the metrics endpoint's samples."""

from __future__ import annotations

import contextlib
import shutil
import socket
import tempfile
import threading
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpushare.client import Connection
from nodemgr.host.gpus import simulated_uuid
from nodemgr.host.ledger import Ledger


@contextlib.contextmanager
def in_process_server(root: Path) -> Iterator[Any]:
    """nodemgr's loop in this process, on 4 simulated GPUs, for a test to step by hand (a
    nodemgr.loop.server.Server), with its run and state directories under ``root`` (a
    state directory already there is used as it is). Imported here, not at the top: helper
    processes import this module with the source tree first on their path, where the ledger
    bindings are not built. It neither audits, samples utilisation nor measures a context
    (its charge is 0): those would load the simulated NVML into the test process, for the
    tests after it too."""
    from nodemgr import config as nodemgr_config
    from nodemgr.loop.server import Server

    (root / "c.toml").write_text(
        f'[node]\nrun_dir = "{root}/run"\nstate_dir = "{root}/state"\n'
        '[gpus]\nsource = "simulated"\nutilization_interval = 0\ncontext_memory = "0"\n'
        "[audit]\ninterval = 0\n"
    )
    srv = Server(nodemgr_config.load(root / "c.toml"))
    srv.start()
    try:
        yield srv
    finally:
        srv.close()


@pytest.fixture
def server() -> Iterator[Any]:
    """in_process_server in a directory of its own."""
    root = Path(tempfile.mkdtemp(prefix="gs-", dir="/tmp"))
    with in_process_server(root) as srv:
        yield srv
    shutil.rmtree(root, ignore_errors=True)


# `python -c CLI_AS GID UID NODE_RUN_DIR ARGS...`: the nodemgr CLI as another user (NODE_RUN_DIR,
# if not empty, stands for /run/gpushare). Python itself is not theirs to read here: it is
# started as root, loads nodemgr, and then becomes the user.
CLI_AS = """
import os, sys
from gpushare import paths
from nodemgr.cli import cli
if sys.argv[3]:
    paths.NODE_RUN_DIR = type(paths.NODE_RUN_DIR)(sys.argv[3])
os.setgid(int(sys.argv[1])); os.setgroups([]); os.setuid(int(sys.argv[2]))
cli(sys.argv[4:])
"""


class Waiting(threading.Thread):
    """A request that may wait, made from a thread so the test can go on; ``fields`` are
    the request's (``gpus`` defaults to 1)."""

    def __init__(self, endpoint: str, wait: float, **fields: Any) -> None:
        super().__init__(daemon=True)
        self.wait = wait
        self.fields = {"gpus": 1, **fields}
        self.updates: list[int] = []  # the positions of its `queued` answers
        self.reasons: list[str] = []  # and their reasons ("" where none)
        self.result: dict[str, Any] | None = None
        self.error: Exception | None = None
        self.conn = Connection(endpoint)
        self.start()

    def run(self) -> None:
        try:
            self.result = self.conn.call(
                "request",
                timeout=self.wait + 10,
                on_queued=self._queued,
                wait=self.wait,
                **self.fields,
            )
        except Exception as e:
            self.error = e

    def _queued(self, msg: dict[str, Any]) -> None:
        self.reasons.append(str(msg.get("reason") or ""))
        self.updates.append(int(msg["position"]))

    def finish(self) -> dict[str, Any]:
        self.join(15)
        assert not self.is_alive()
        self.conn.close()
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


def free_port() -> int:
    """A TCP port free on the loopback now, for a metrics endpoint."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> dict[str, float]:
    """Every sample nodemgr's metrics endpoint on ``port`` serves, by name and labels."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


@contextlib.contextmanager
def ledger_of(daemon: Any, env: str, gpus: int = 4) -> Iterator[Ledger]:
    """The environment's ledger file, mapped as its processes map it (also while nodemgr is
    down); ``gpus``: the daemon's simulated GPU count (the test daemons' default is 4)."""
    uuids = [uuid.UUID(simulated_uuid(i).removeprefix("GPU-")).bytes for i in range(gpus)]
    ledger = Ledger.reopen(daemon.run_dir / "envs" / env / "ledger", uuids)
    assert ledger is not None, "no valid ledger"
    try:
        yield ledger
    finally:
        ledger.close()
