"""Real PyTorch in a Kubernetes container that gpushare's device plugin set up: the pinned
torch (test_torch_sim.py's venv) run by gpushare-run in a private mount namespace holding
the Allocate answer's mount and variables, as a container runtime would start it, against
a real nodemgr on simulated GPUs and the plugin against a fake kubelet
(docs/kubernetes.md, "How it is tested without a cluster").

The pod's gpushare.io/gpu-memory is the device torch sees, and going past it is torch's
own out-of-memory error, as in test_torch_gpushare.py with a quota set by hand."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kube.resources import ENV_ANNOTATION, GPU_MEMORY, GPUS, SOCKETS
from tests.conftest import BIN, Daemon, _wait_for, die_with_test_run
from tests.fixtures.fake_kubelet import FakeKubelet
from tests.kube.conftest import PluginProcess, in_container, unshare_works
from tests.real_torch.test_torch_gpushare import CASE, GIB, QUOTA, go_on, read_stage
from tests.real_torch.test_torch_sim import torch_python  # noqa: F401 (a fixture)


@pytest.fixture
def allocated(daemon_factory: Any) -> Iterator[tuple[Daemon, Any]]:
    """A node's nodemgr and plugin, and the Allocate answer for a container of one GPU
    and QUOTA of its memory."""
    daemon: Daemon = daemon_factory()
    root = Path(tempfile.mkdtemp(prefix="gs-kt-", dir="/tmp"))
    kubelet = FakeKubelet(root / "dp", root / "pr" / "kubelet.sock")
    plugin = PluginProcess(root, daemon, kubelet)
    try:
        _wait_for(lambda: len(kubelet.registrations()) == 2, 30)
        memory = [f"mem0-{k}" for k in range(QUOTA // GIB)]
        got = kubelet.allocate(SOCKETS[GPUS], ["gpu0-0"])
        kubelet.allocate(SOCKETS[GPU_MEMORY], memory)
        # The container lives as long as the test: kubelet lists it.
        kubelet.set_pods([("team", "nb", "dev", {GPUS: ["gpu0-0"], GPU_MEMORY: memory})])
        yield daemon, got
    finally:
        plugin.stop()
        kubelet.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.skipif(not unshare_works(), reason="needs root and unshare(1) for a mount namespace")
def test_the_pods_memory_is_torchs_device_in_its_container(
    allocated: tuple[Daemon, Any],
    torch_python: str,  # noqa: F811 (the fixture imported above)
) -> None:
    daemon, got = allocated
    (mount,) = got.mounts
    env = {**os.environ, **dict(got.envs)}
    env.pop("GPUSHARE_AUTOLOAD")  # gpushare-run asks; the auto-loader is tested elsewhere
    p = subprocess.Popen(
        [
            *in_container(mount),
            str(BIN / "gpushare-run"),
            "--gpus",
            "1",
            "--",
            torch_python,
            str(CASE),
        ],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=die_with_test_run(),
    )
    try:
        start = read_stage(p, "start")
        assert start["mem_get_info"] == [QUOTA, QUOTA]  # the pod's memory is the device
        (task,) = daemon.tasks()
        assert task["env"] == got.annotations[ENV_ANNOTATION]
        go_on(p)
        read_stage(p, "held")
        go_on(p)
        refused = read_stage(p, "refused")["refused"]
        assert refused is not None and refused["type"] == "torch.OutOfMemoryError", refused
        go_on(p)
        read_stage(p, "freed")
        go_on(p)
        assert read_stage(p, "emptied")["reserved"] == 0
        go_on(p)
        assert p.wait(120) == 0
    finally:
        if p.poll() is None:
            p.kill()
        p.communicate(timeout=30)
