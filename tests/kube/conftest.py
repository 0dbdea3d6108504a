"""What the Kubernetes tests share: the device plugin and the extender as processes."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.conftest import BIN, Daemon, _wait_for, die_with_test_run
from tests.fixtures.fake_kubelet import FakeKubelet


class PluginProcess:
    """``gpushare-cluster device-plugin`` in a child process."""

    def __init__(self, root: Path, daemon: Daemon, kubelet: FakeKubelet, *args: str) -> None:
        self.root, self.daemon, self.kubelet = root, daemon, kubelet
        self.args = args
        self.log_path = root / "plugin.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    str(BIN / "gpushare-cluster"),
                    "device-plugin",
                    "--kubelet-dir",
                    str(self.kubelet.plugins_dir),
                    "--pod-resources",
                    str(self.kubelet.pod_resources),
                    "--config",
                    str(self.daemon.config),
                    *self.args,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_test_run(),
            )

    def log(self) -> str:
        return self.log_path.read_text()

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(30)

    def stop(self) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        return self.proc.returncode


class ExtenderProcess:
    def __init__(self, *args: str) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="gs-x-"))
        self.log_path = self.root / "extender.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [str(BIN / "gpushare-cluster"), "extender", "--listen", "127.0.0.1:0", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_test_run(),
            )
        found: list[int] = []

        def serving() -> bool:
            m = re.search(r"serving on 127\.0\.0\.1:(\d+)", self.log())
            if m:
                found.append(int(m.group(1)))
            assert self.proc.poll() is None, self.log()
            return bool(m)

        _wait_for(serving, 60)
        self.url = f"http://127.0.0.1:{found[0]}"

    def log(self) -> str:
        return self.log_path.read_text()

    def post(self, verb: str, body: Any) -> tuple[int, Any]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.url}/{verb}", data=data, method="POST")
        request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        shutil.rmtree(self.root, ignore_errors=True)
        return self.proc.returncode


def in_container(mount: Any) -> list[str]:
    """The argv prefix that runs a command as a container runtime would with the Allocate
    answer's ``mount``: in a private mount namespace (unshare, as root) with the host's
    directory bound at the container's path, over an empty /run."""
    script = (
        f"mount -t tmpfs tmpfs /run && mkdir -p {mount.container_path}"
        f" && mount --bind {mount.host_path} {mount.container_path}"
        f' && exec "$0" "$@"'
    )
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]


def unshare_works() -> bool:
    """Whether this process may make a mount namespace (root, with unshare(1))."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    probe = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "true"],
        capture_output=True,
        timeout=30,
    )
    return probe.returncode == 0
