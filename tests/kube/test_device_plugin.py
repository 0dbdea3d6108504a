"""The device plugin against a fake kubelet (real gRPC on unix sockets) and a real
nodemgr on simulated GPUs: registration, ListAndWatch, GetPreferredAllocation, Allocate
making environments, a task run through what Allocate returned, reconciliation after a
pod is deleted, and restarts of either side and of kubelet (docs/kubernetes.md)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kube.proto import deviceplugin_pb2 as dp
from kube.resources import ENV_ANNOTATION, GPU_MEMORY, GPUS, SOCKETS
from tests.conftest import BIN, Daemon, _wait_for, die_with_test_run
from tests.fixtures.fake_apiserver import FakeApiServer, pod
from tests.fixtures.fake_kubelet import FakeKubelet
from tests.kube.conftest import PluginProcess, in_container, unshare_works

GIB = 1 << 30
FACTOR = 2  # kube.oversubscription in the daemon's config
HEARTBEAT_TIMEOUT = 2.0
GPU_SOCK, MEM_SOCK = SOCKETS[GPUS], SOCKETS[GPU_MEMORY]


@pytest.fixture
def cluster(daemon_factory: Any) -> Iterator[tuple[Daemon, FakeKubelet, PluginProcess]]:
    # The plugin reconciles every half heartbeat timeout: each second here.
    daemon: Daemon = daemon_factory(
        {"kube": {"oversubscription": FACTOR}, "gpus": {"simulated_count": 2}},
        heartbeat_timeout=HEARTBEAT_TIMEOUT,
    )
    root = Path(tempfile.mkdtemp(prefix="gs-k-", dir="/tmp"))
    kubelet = FakeKubelet(root / "dp", root / "pr" / "kubelet.sock")
    plugin = PluginProcess(root, daemon, kubelet)
    try:
        try:
            _wait_for(lambda: len(kubelet.registrations()) == 2, 30)
        except AssertionError:
            raise AssertionError(f"the plugin did not register: {plugin.log()}") from None
        yield daemon, kubelet, plugin
    finally:
        plugin.stop()
        kubelet.stop()
        shutil.rmtree(root, ignore_errors=True)


def _envs(daemon: Daemon) -> dict[str, dict[str, Any]]:
    return {q["env"]: q for q in daemon.admin("quota_show")["quotas"]}


def _allocate_both(kubelet: FakeKubelet, gpus: list[str], mem: list[str]) -> tuple[Any, Any]:
    return kubelet.allocate(GPU_SOCK, gpus), kubelet.allocate(MEM_SOCK, mem)


def test_registers_both_resources_and_lists_oversubscribed_devices(
    cluster: tuple[Daemon, FakeKubelet, PluginProcess],
) -> None:
    _, kubelet, _ = cluster
    assert sorted(kubelet.registrations()) == [
        ("v1beta1", MEM_SOCK, GPU_MEMORY),
        ("v1beta1", GPU_SOCK, GPUS),
    ]
    gpus = kubelet.list_devices(GPU_SOCK)
    # 2 simulated GPUs, each offered FACTOR times.
    assert sorted(i for i, _ in gpus) == ["gpu0-0", "gpu0-1", "gpu1-0", "gpu1-1"]
    assert {h for _, h in gpus} == {"Healthy"}
    mem = kubelet.list_devices(MEM_SOCK)
    assert len(mem) == 2 * 16 * FACTOR  # 16 GiB each, in GiB, FACTOR times over
    assert len({i for i, _ in mem}) == len(mem)


def test_a_drained_gpu_is_offered_unhealthy_until_undrained(
    cluster: tuple[Daemon, FakeKubelet, PluginProcess],
) -> None:
    daemon, kubelet, _ = cluster
    channel, stub = kubelet.plugin(GPU_SOCK)
    with channel:
        stream = stub.ListAndWatch(dp.Empty(), timeout=30)
        assert {d.health for d in next(stream).devices} == {"Healthy"}
        daemon.admin("drain", gpu=1, drained=True)
        # The next answer on the same stream: GPU 1's slots unhealthy, GPU 0's not.
        sent = {d.ID: d.health for d in next(stream).devices}
        assert sent == {
            "gpu0-0": "Healthy",
            "gpu0-1": "Healthy",
            "gpu1-0": "Unhealthy",
            "gpu1-1": "Unhealthy",
        }
        daemon.admin("drain", gpu=1, drained=False)
        assert {d.health for d in next(stream).devices} == {"Healthy"}
        stream.cancel()


def test_preferred_allocation_spreads_over_gpus(
    cluster: tuple[Daemon, FakeKubelet, PluginProcess],
) -> None:
    _, kubelet, _ = cluster
    got = kubelet.preferred(GPU_SOCK, ["gpu0-0", "gpu0-1", "gpu1-0", "gpu1-1"], 2)
    assert sorted(got) == ["gpu0-0", "gpu1-0"]


def test_allocate_makes_the_environment_with_the_pods_quota(
    cluster: tuple[Daemon, FakeKubelet, PluginProcess],
) -> None:
    daemon, kubelet, _ = cluster
    first = kubelet.allocate(GPU_SOCK, ["gpu0-0", "gpu1-0"])
    env = first.annotations[ENV_ANNOTATION]
    # Until its memory half comes, the environment holds nothing.
    assert (_envs(daemon)[env]["gpus"], _envs(daemon)[env]["memory"]) == (0, 0)
    second = kubelet.allocate(MEM_SOCK, [f"mem0-{k}" for k in range(12)])
    assert second.annotations[ENV_ANNOTATION] == env
    quota = _envs(daemon)[env]
    assert (quota["gpus"], quota["memory"]) == (2, 6 * GIB)  # 12 GiB over 2 GPUs
    for got in (first, second):
        assert [(m.container_path, m.host_path, m.read_only) for m in got.mounts] == [
            ("/run/gpushare", str(daemon.run_dir / "envs" / env), False)
        ]
        assert got.envs["GPUSHARE_ENDPOINT"] == "ipc:///run/gpushare/task.sock"
        assert got.envs["GPUSHARE_AUTOLOAD"] == "1"
    # Another container's halves make another environment.
    third, _ = _allocate_both(kubelet, ["gpu0-1"], ["mem1-0", "mem1-1"])
    other = third.annotations[ENV_ANNOTATION]
    assert other != env
    assert (_envs(daemon)[other]["gpus"], _envs(daemon)[other]["memory"]) == (1, 2 * GIB)


def test_allocate_that_nodemgr_refuses_fails_with_its_reason(
    cluster: tuple[Daemon, FakeKubelet, PluginProcess],
) -> None:
    _, kubelet, _ = cluster
    kubelet.allocate(GPU_SOCK, ["gpu0-0"])
    with pytest.raises(grpc.RpcError) as caught:
        # 20 GiB for one GPU of 16: no GPU could serve it.
        kubelet.allocate(MEM_SOCK, [f"mem0-{k}" for k in range(20)])
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "nodemgr" in (caught.value.details() or "")


@pytest.mark.skipif(not unshare_works(), reason="needs root and unshare(1) for a mount namespace")
def test_a_task_run_with_what_allocate_returned_gets_the_quota(
    cluster: tuple[Daemon, FakeKubelet, PluginProcess], cbin: dict[str, Path]
) -> None:
    """The container runtime's part, done by hand: a private mount namespace with the
    response's mount, and its variables; gpushare-run inside asks nodemgr for GPUs, and
    a CUDA program (the C driver-API client) is held to the memory quota."""
    daemon, kubelet, _ = cluster
    got, _ = _allocate_both(kubelet, ["gpu0-0", "gpu1-0"], [f"mem0-{k}" for k in range(8)])
    (mount,) = got.mounts
    env = {**os.environ, **dict(got.envs)}
    env.pop("GPUSHARE_AUTOLOAD")  # the child is no framework; gpushare-run asks
    container = in_container(mount)
    python_c = [sys.executable, "-c"]
    child = "import os, sys; print(os.environ['CUDA_VISIBLE_DEVICES']); sys.stdin.read()"
    run = subprocess.Popen(
        [*container, str(BIN / "gpushare-run"), "--gpus", "2", "--", *python_c, child],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=die_with_test_run(),
    )
    try:
        assert run.stdout is not None
        visible = run.stdout.readline().strip().split(",")
        assert len(set(visible)) == 2, visible  # two GPUs granted
        (task,) = daemon.tasks()
        assert task["env"] == got.annotations[ENV_ANNOTATION]
        assert task["memory_limit"] == 4 * GIB  # 8 GiB over 2 GPUs
    finally:
        run.communicate("", timeout=30)
    assert run.returncode == 0
    # Beyond the quota: three GPUs are refused.
    over = subprocess.run(
        [*container, str(BIN / "gpushare-run"), "--gpus", "3", "--no-wait", "--", "true"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert over.returncode == 77, over.stderr
    # The shim enforces the per-GPU memory quota on a CUDA program in the "container".
    steps = [str(cbin["client"]), "info", "alloc", "3072", "alloc", "2048", "alloc", "1024"]
    cuda = subprocess.run(
        [*container, str(BIN / "gpushare-run"), "--gpus", "1", "--", *steps],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cuda.returncode == 0, cuda.stderr
    assert cuda.stdout.split("\n")[:4] == [
        f"info free={4 * GIB} total={4 * GIB}",  # the quota, not the 16 GiB device
        "alloc ok",
        "alloc err 2",  # CUDA_ERROR_OUT_OF_MEMORY: past 4 GiB
        "alloc ok",
    ]


def test_a_deleted_pods_environment_goes_within_one_heartbeat_timeout(
    cluster: tuple[Daemon, FakeKubelet, PluginProcess],
) -> None:
    daemon, kubelet, _ = cluster
    a, _ = _allocate_both(kubelet, ["gpu0-0"], ["mem0-0", "mem0-1"])
    b, _ = _allocate_both(kubelet, ["gpu1-0"], ["mem1-0"])
    env_a, env_b = a.annotations[ENV_ANNOTATION], b.annotations[ENV_ANNOTATION]
    kubelet.set_pods(
        [
            ("team", "a", "dev", {GPUS: ["gpu0-0"], GPU_MEMORY: ["mem0-0", "mem0-1"]}),
            ("team", "b", "dev", {GPUS: ["gpu1-0"], GPU_MEMORY: ["mem1-0"]}),
        ]
    )
    # Rounds enough for both to be older than the grace a new allocation has.
    time.sleep(HEARTBEAT_TIMEOUT + 0.5)
    assert {env_a, env_b} <= set(_envs(daemon))
    kubelet.set_pods([("team", "b", "dev", {GPUS: ["gpu1-0"], GPU_MEMORY: ["mem1-0"]})])
    gone_in = _wait_for(lambda: env_a not in _envs(daemon), 10)
    assert gone_in <= HEARTBEAT_TIMEOUT
    assert env_b in _envs(daemon)


def test_restarts_lose_no_live_pods_environment(
    cluster: tuple[Daemon, FakeKubelet, PluginProcess],
) -> None:
    daemon, kubelet, plugin = cluster
    got, _ = _allocate_both(kubelet, ["gpu0-0", "gpu1-1"], [f"mem1-{k}" for k in range(6)])
    env = got.annotations[ENV_ANNOTATION]
    ids = {GPUS: ["gpu0-0", "gpu1-1"], GPU_MEMORY: [f"mem1-{k}" for k in range(6)]}
    kubelet.set_pods([("team", "a", "dev", ids)])
    # The plugin killed (no clean-up) and started again: it keeps the environment.
    plugin.kill()
    registered = len(kubelet.registrations())
    plugin.start()
    _wait_for(lambda: len(kubelet.registrations()) == registered + 2, 30)
    time.sleep(HEARTBEAT_TIMEOUT)  # two rounds: a wrong removal would show
    assert (_envs(daemon)[env]["gpus"], _envs(daemon)[env]["memory"]) == (2, 3 * GIB)
    # nodemgr killed and started again: the environment persists in its state.
    daemon.kill()
    daemon.start()
    time.sleep(HEARTBEAT_TIMEOUT)  # two rounds: a wrong removal would show
    assert (_envs(daemon)[env]["gpus"], _envs(daemon)[env]["memory"]) == (2, 3 * GIB)
    # The environment lost from nodemgr while the pod lives: the plugin makes it again.
    daemon.admin("quota_delete", env=env, force=True)
    _wait_for(lambda: env in _envs(daemon), 10)
    assert (_envs(daemon)[env]["gpus"], _envs(daemon)[env]["memory"]) == (2, 3 * GIB)
    # The book lost as well (the plugin's state file gone, its process killed).
    plugin.kill()
    (daemon.state_dir / "kube-allocations.json").unlink()
    plugin.start()
    book = daemon.state_dir / "kube-allocations.json"
    _wait_for(lambda: book.exists() and env in book.read_text(), 10)  # taken back in
    time.sleep(HEARTBEAT_TIMEOUT)  # two rounds: a wrong removal would show
    assert (_envs(daemon)[env]["gpus"], _envs(daemon)[env]["memory"]) == (2, 3 * GIB)


def test_registers_again_when_kubelet_restarts(
    cluster: tuple[Daemon, FakeKubelet, PluginProcess],
) -> None:
    _, kubelet, plugin = cluster
    # kubelet empties its directory when it starts.
    for name in (GPU_SOCK, MEM_SOCK):
        (kubelet.plugins_dir / name).unlink()
    _wait_for(lambda: len(kubelet.registrations()) == 4, 30)
    assert len(kubelet.list_devices(GPU_SOCK)) == 2 * FACTOR
    assert plugin.stop() == 0
    assert not (kubelet.plugins_dir / GPU_SOCK).exists()


def test_refused_registration_exits_69(daemon_factory: Any, tmp_path: Path) -> None:
    daemon: Daemon = daemon_factory()
    root = Path(tempfile.mkdtemp(prefix="gs-k-", dir="/tmp"))
    kubelet = FakeKubelet(root / "dp", root / "pr" / "kubelet.sock")
    kubelet.refuse = "resource name already taken"
    try:
        plugin = PluginProcess(root, daemon, kubelet)
        assert plugin.proc is not None
        assert plugin.proc.wait(30) == 69
        assert "resource name already taken" in plugin.log()
    finally:
        kubelet.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_unreachable_nodemgr_exits_69(daemon_factory: Any) -> None:
    daemon: Daemon = daemon_factory()
    daemon.stop()
    root = Path(tempfile.mkdtemp(prefix="gs-k-", dir="/tmp"))
    kubelet = FakeKubelet(root / "dp", root / "pr" / "kubelet.sock")
    try:
        plugin = PluginProcess(root, daemon, kubelet)
        assert plugin.proc is not None
        assert plugin.proc.wait(30) == 69
        assert "nodemgr" in plugin.log()
    finally:
        kubelet.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_a_bad_config_exits_78(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from kube.cli import cli

    bad = tmp_path / "nodemgr.toml"
    bad.write_text("[kube]\noversubscription = 0\n")
    got = CliRunner().invoke(cli, ["device-plugin", "--config", str(bad)])
    assert got.exit_code == 78
    assert "kube.oversubscription" in got.output


def test_a_kubelet_dir_it_cannot_listen_in_exits_78(daemon_factory: Any, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from kube.cli import cli

    daemon: Daemon = daemon_factory()
    missing = tmp_path / "no" / "such" / "dir"
    got = CliRunner().invoke(
        cli, ["device-plugin", "--config", str(daemon.config), "--kubelet-dir", str(missing)]
    )
    assert got.exit_code == 78, got.output
    assert "cannot listen" in got.output


def test_the_pods_class_annotation_sets_its_environments_class(daemon_factory: Any) -> None:
    """With an API server, the plugin reads each live pod's gpushare.io/class and sets
    its environment's class (latency-sensitive ones allowed such tasks)."""
    daemon: Daemon = daemon_factory(heartbeat_timeout=HEARTBEAT_TIMEOUT)
    root = Path(tempfile.mkdtemp(prefix="gs-k-", dir="/tmp"))
    kubelet = FakeKubelet(root / "dp", root / "pr" / "kubelet.sock")
    api = FakeApiServer()
    api.pods = [
        pod("ls", 1, 2, annotations={"gpushare.io/class": "ls"}, node_name="n"),
        pod("be", 1, 2, node_name="n"),
    ]
    plugin = PluginProcess(root, daemon, kubelet, "--api-server", api.url)
    try:
        _wait_for(lambda: len(kubelet.registrations()) == 2, 30)
        a, _ = _allocate_both(kubelet, ["gpu0-0"], ["mem0-0", "mem0-1"])
        b, _ = _allocate_both(kubelet, ["gpu1-0"], ["mem1-0", "mem1-1"])
        kubelet.set_pods(
            [
                ("team", "ls", "dev", {GPUS: ["gpu0-0"], GPU_MEMORY: ["mem0-0", "mem0-1"]}),
                ("team", "be", "dev", {GPUS: ["gpu1-0"], GPU_MEMORY: ["mem1-0", "mem1-1"]}),
            ]
        )
        env_ls, env_be = a.annotations[ENV_ANNOTATION], b.annotations[ENV_ANNOTATION]
        _wait_for(lambda: _envs(daemon)[env_ls]["class_default"] == "ls", 10)
        assert _envs(daemon)[env_ls]["allow_ls"] is True
        # Best-effort is nodemgr's default: the log says it was read, not left.
        _wait_for(lambda: "class be, from pod team/be/dev" in plugin.log(), 10)
        assert _envs(daemon)[env_be]["class_default"] == "be"
    finally:
        plugin.stop()
        kubelet.stop()
        api.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_devices_given_to_a_new_container_carry_on_their_environment(
    cluster: tuple[Daemon, FakeKubelet, PluginProcess],
) -> None:
    """Kubelet hands a device to a new container once the one that held it is gone (or to
    app containers after an init container of the same pod): the new container gets that
    environment, with its own quota, and no second one appears."""
    daemon, kubelet, _ = cluster
    old, _ = _allocate_both(kubelet, ["gpu0-0"], ["mem0-0", "mem0-1"])
    env = old.annotations[ENV_ANNOTATION]
    new, second = _allocate_both(kubelet, ["gpu0-0"], [f"mem1-{k}" for k in range(6)])
    assert new.annotations[ENV_ANNOTATION] == second.annotations[ENV_ANNOTATION] == env
    assert [e for e in _envs(daemon) if e.startswith("k8s-")] == [env]
    assert (_envs(daemon)[env]["gpus"], _envs(daemon)[env]["memory"]) == (1, 6 * GIB)


def test_an_allocate_nodemgr_refuses_leaves_no_half_behind(
    cluster: tuple[Daemon, FakeKubelet, PluginProcess],
) -> None:
    """A refused Allocate changes nothing: the next container's halves pair with each
    other, not with the refused one's."""
    daemon, kubelet, _ = cluster
    kubelet.allocate(GPU_SOCK, ["gpu0-0"])
    with pytest.raises(grpc.RpcError):
        kubelet.allocate(MEM_SOCK, [f"mem0-{k}" for k in range(20)])  # over a 16 GiB GPU
    a, b = _allocate_both(kubelet, ["gpu1-0"], ["mem1-0", "mem1-1"])
    assert a.annotations[ENV_ANNOTATION] == b.annotations[ENV_ANNOTATION]
    env = a.annotations[ENV_ANNOTATION]
    assert (_envs(daemon)[env]["gpus"], _envs(daemon)[env]["memory"]) == (1, 2 * GIB)


def test_registers_again_once_a_restarted_kubelet_takes_registrations(
    cluster: tuple[Daemon, FakeKubelet, PluginProcess],
) -> None:
    """A kubelet that restarts empties its directory and may refuse registrations for a
    while: the plugin serves again at once and registers as soon as kubelet takes it."""
    _, kubelet, plugin = cluster
    kubelet.refuse = "kubelet is starting"
    for name in (GPU_SOCK, MEM_SOCK):
        (kubelet.plugins_dir / name).unlink()
    _wait_for(lambda: (kubelet.plugins_dir / GPU_SOCK).exists(), 30)
    _wait_for(lambda: "kubelet is starting" in plugin.log(), 30)
    refused = len(kubelet.registrations())
    kubelet.refuse = ""
    _wait_for(
        lambda: {r for _, _, r in kubelet.registrations()[refused:]} == {GPUS, GPU_MEMORY}, 30
    )
    assert len(kubelet.list_devices(GPU_SOCK)) == 2 * FACTOR
