"""nodemgr under systemd's Type=notify (nodemgr/loop/sdnotify.py, configs/nodemgr.service):
READY=1 comes once the admin socket serves, STOPPING=1 when nodemgr stops, and no process
nodemgr starts inherits NOTIFY_SOCKET."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from gpushare.client import Connection, wait_until_serving
from nodemgr.loop.sdnotify import Notifier
from tests.conftest import BIN, die_with_test_run


def _serve(root: Path, notify: str) -> subprocess.Popen[bytes]:
    config = root / "nodemgr.toml"
    config.write_text(
        f'[node]\nrun_dir = "{root}/run"\nstate_dir = "{root}/state"\n'
        '[gpus]\nsource = "simulated"\nsimulated_count = 1\n'
    )
    return subprocess.Popen(
        [str(BIN / "nodemgr"), "serve", "--config", str(config)],
        env={**os.environ, "NOTIFY_SOCKET": notify},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=die_with_test_run(),
    )


@pytest.mark.parametrize("abstract", [False, True])
def test_ready_once_serving_and_stopping_at_the_end(tmp_path: Path, abstract: bool) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if abstract:
        name = f"gpushare-test-notify-{os.getpid()}-{tmp_path.name}"
        listener.bind("\0" + name)
        notify = "@" + name
    else:
        notify = str(tmp_path / "notify.sock")
        listener.bind(notify)
    listener.settimeout(60)
    proc = _serve(tmp_path, notify)
    try:
        ready = listener.recv(4096).decode().split("\n")
        assert ready[0] == "READY=1"
        assert ready[1] == "STATUS=serving 1 simulated GPUs"
        # Ready means served: the admin endpoint answers at once.
        with Connection(f"ipc://{tmp_path}/run/admin.sock", timeout=5.0) as c:
            assert len(c.call("status")["gpus"]) == 1
        proc.send_signal(signal.SIGTERM)
        assert listener.recv(4096) == b"STOPPING=1"
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait(timeout=30)
        listener.close()


def test_an_unusable_notify_socket_does_not_stop_nodemgr(tmp_path: Path) -> None:
    proc = _serve(tmp_path, str(tmp_path / "nobody-listens.sock"))
    try:
        admin = f"ipc://{tmp_path}/run/admin.sock"
        assert wait_until_serving(admin, lambda: proc.poll() is None, 60)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def test_the_address_is_read_once_and_not_passed_on() -> None:
    """What nodemgr starts (the context probe) inherits its environment without the
    address, so only nodemgr speaks for the unit; a relative name is refused."""
    environ = {"NOTIFY_SOCKET": "@somewhere", "PATH": "/bin"}
    notifier = Notifier(environ)
    assert environ == {"PATH": "/bin"}
    assert notifier.notify("READY=1") is False  # nobody listens at @somewhere
    assert Notifier({"NOTIFY_SOCKET": "relative"}).notify("READY=1") is False
    assert Notifier({}).notify("READY=1") is False
