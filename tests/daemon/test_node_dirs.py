"""Where a node's nodemgr is found, and one nodemgr per GPU (docs/nodemgr.md,
"Configuration"): a config file names the node's run directory for every user alike, the
shipped configs set it, and a second nodemgr on GPUs another one serves does not start."""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpushare import paths
from gpushare.exitcodes import EXIT_CONFIG
from nodemgr import config
from nodemgr.host.gpus import simulated_uuid
from tests.conftest import BIN
from tests.daemon.conftest import CLI_AS

ROOT = Path(__file__).resolve().parents[2]


def serve_beside(tmp_path: Path, sim_dir: Path) -> subprocess.CompletedProcess[str]:
    """`nodemgr serve` of a second nodemgr, with run and state directories of its own, on
    the simulated GPUs of ``sim_dir``, run until it ends (refused) or 60 s pass."""
    second = tmp_path / "second.toml"
    second.write_text(
        f'[node]\nrun_dir = "{tmp_path}/run2"\nstate_dir = "{tmp_path}/state2"\n'
        f'[gpus]\nsource = "simulated"\nsimulated_state_dir = "{sim_dir}"\n'
    )
    return subprocess.run(
        [str(BIN / "nodemgr"), "serve", "--config", str(second)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_second_nodemgr_on_the_same_gpus_exits_78_naming_the_holder(
    daemon_factory: Any, tmp_path: Path
) -> None:
    """Two nodemgrs with their own run and state directories on one simulated node (one
    gpus.simulated_state_dir): the second is refused while the first runs, and starts once
    the first is killed (the kernel frees its locks)."""
    node = {"gpus": {"simulated_state_dir": str(tmp_path / "node")}}
    first = daemon_factory(node)
    refused = serve_beside(tmp_path, tmp_path / "node")
    assert refused.returncode == EXIT_CONFIG, refused.stderr
    lock = tmp_path / "node" / f"gpushare-{simulated_uuid(0)}.lock"
    assert (
        f"GPU 0 ({simulated_uuid(0)}) is already served by nodemgr pid {first.proc.pid}, "
        f"run directory {first.run_dir} (lock {lock}): stop that nodemgr first, or give "
        "this one a gpus.simulated_state_dir of its own"
    ) in refused.stderr
    assert not (tmp_path / "run2" / "admin.sock").exists()
    assert first.admin("status")["tasks"] == 0  # the first serves on
    first.kill()
    again = daemon_factory(node)  # waits until it serves
    assert again.admin("status")["simulated"]


def cli_as(user: pwd.struct_passwd | None, *args: str, node_run_dir: str = "") -> Any:
    """``nodemgr ARGS`` as ``user`` (None: root), with neither $GPUSHARE_CONFIG nor
    $XDG_RUNTIME_DIR; ``node_run_dir`` stands for /run/gpushare."""
    env = {k: v for k, v in os.environ.items() if k not in (config.CONFIG_ENV, "XDG_RUNTIME_DIR")}
    ids = ["0", "0"] if user is None else [str(user.pw_gid), str(user.pw_uid)]
    return subprocess.run(
        [sys.executable, "-c", CLI_AS, *ids, node_run_dir, *args],
        capture_output=True,
        text=True,
        env=env,
        cwd="/",
        timeout=60,
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
@pytest.mark.skipif(
    (paths.NODE_RUN_DIR / "admin.sock").exists(), reason="a nodemgr serves this node"
)
def test_a_config_file_names_the_same_run_dir_for_every_user(
    open_dir: Callable[[int], Path],
) -> None:
    """A config that leaves run_dir unset means /run/gpushare to root and to any other
    user alike: an operator who is not root finds the node's nodemgr, not one of their own."""
    shared = open_dir(0o755)
    cfg = shared / "node.toml"
    cfg.write_text('[gpus]\nsource = "simulated"\n')
    cfg.chmod(0o644)
    nobody = pwd.getpwnam("nobody")
    for user in (None, nobody):
        out = cli_as(user, "status", "--config", str(cfg))
        assert out.returncode == 69, out.stderr
        assert "/run/gpushare/admin.sock" in out.stderr, out.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
@pytest.mark.skipif(config.DEFAULT_CONFIG.exists(), reason="this node has a config file")
def test_a_user_without_a_config_is_told_where_the_nodes_nodemgr_is(daemon: Any) -> None:
    """Without a config file another user's commands look in their own run directory: the
    error names the node's nodemgr's socket and how to reach it."""
    os.chmod(daemon.root, 0o755)
    os.chmod(daemon.run_dir, 0o711)
    out = cli_as(pwd.getpwnam("nobody"), "status", node_run_dir=str(daemon.run_dir))
    assert out.returncode == 69, out.stderr
    assert (
        f"a nodemgr serves at {daemon.run_dir}/admin.sock: name its config with --config "
        f"or ${config.CONFIG_ENV}"
    ) in out.stderr


@pytest.mark.parametrize("name", ["nodemgr.toml", "sim.toml"])
def test_the_shipped_configs_set_the_run_dir(name: str) -> None:
    """Each names its run directory, absolute from any working directory."""
    path = ROOT / "configs" / name
    assert "run_dir" in tomllib.loads(path.read_text())["node"]
    here = os.getcwd()
    try:
        os.chdir("/")
        from_root = config.load(Path("/") / path.relative_to("/")).run_dir
        os.chdir(path.parent)
        from_configs = config.load(name).run_dir
    finally:
        os.chdir(here)
    assert from_root.is_absolute() and from_root == from_configs
    if name == "sim.toml":
        assert from_root == ROOT / "build" / "run"


# Holds GPU 0's lock in a directory as another user until stdin closes, as a nodemgr of
# theirs on the node's real GPUs would (nodemgr.host.gpulock, whose NVML lock directory is open
# to all).
HOLD_AS = """
import os, sys
from pathlib import Path
from nodemgr.host import gpulock
from nodemgr.host.gpus import Gpu
os.setgid(int(sys.argv[1])); os.setgroups([]); os.setuid(int(sys.argv[2]))
gpu = Gpu(0, sys.argv[4], "GPU", 1 << 30)
try:
    fds = gpulock.hold([gpu], Path(sys.argv[3]), Path("/run/theirs"), "stop it")
except gpulock.GpuHeld as e:
    print(e, flush=True)
    sys.exit(3)
print("held", flush=True)
sys.stdin.read()
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_a_gpu_lock_in_a_directory_open_to_all_holds_across_users(
    open_dir: Callable[[int], Path],
) -> None:
    """Root and another user take turns at one GPU's lock: the lock file root made (0644,
    root's) still locks for the other user, who may only read it, and each refusal names
    the holder's pid, with a run directory only where the holder wrote it."""
    from nodemgr.host import gpulock
    from nodemgr.host.gpus import Gpu

    shared = open_dir(0o755)
    os.chmod(shared, 0o1777)
    nobody = pwd.getpwnam("nobody")
    uuid = simulated_uuid(7)
    gpu = Gpu(0, uuid, "GPU", 1 << 30)
    lock = gpulock.lock_path(shared, gpu)
    ids = [str(nobody.pw_gid), str(nobody.pw_uid)]

    def hold_as_nobody() -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-c", HOLD_AS, *ids, str(shared), uuid],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    fds = gpulock.hold([gpu], shared, Path("/run/mine"), "stop it")
    try:
        refused = hold_as_nobody()
        out, _ = refused.communicate(timeout=30)
        assert refused.returncode == 3, out
        assert out.strip() == (
            f"GPU 0 ({uuid}) is already served by nodemgr pid {os.getpid()}, run directory "
            f"/run/mine (lock {lock}): stop it"
        )
    finally:
        for fd in fds:
            os.close(fd)
    assert (lock.stat().st_uid, lock.stat().st_mode & 0o777) == (0, 0o644)
    theirs = hold_as_nobody()
    assert theirs.stdout is not None
    try:
        assert theirs.stdout.readline() == "held\n"
        with pytest.raises(gpulock.GpuHeld) as held:
            gpulock.hold([gpu], shared, Path("/run/mine"), "stop it")
        # They could not write root's file: what it says is root's, and not told as theirs.
        assert str(held.value) == (
            f"GPU 0 ({uuid}) is already served by nodemgr pid {theirs.pid} (lock {lock}): stop it"
        )
    finally:
        theirs.communicate(timeout=30)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_another_users_lock_file_does_not_keep_root_from_starting(
    daemon_factory: Any, open_dir: Callable[[int], Path], tmp_path: Path
) -> None:
    """A lock file another user made at a GPU's lock name in a directory open to all, and
    holds, is not a nodemgr's to root: root's nodemgr replaces it, says so, and serves; a
    second root nodemgr is then refused, naming the first."""
    shared = open_dir(0o755)
    from nodemgr.host import gpulock
    from nodemgr.host.gpus import Gpu

    os.chmod(shared, 0o1777)
    nobody = pwd.getpwnam("nobody")
    lock = gpulock.lock_path(shared, Gpu(0, simulated_uuid(0), "GPU", 1 << 30))
    planted = subprocess.Popen(
        [
            sys.executable,
            "-c",
            HOLD_AS,
            str(nobody.pw_gid),
            str(nobody.pw_uid),
            str(shared),
            simulated_uuid(0),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert planted.stdout is not None
    try:
        assert planted.stdout.readline() == "held\n"
        assert lock.stat().st_uid == nobody.pw_uid
        first = daemon_factory({"gpus": {"simulated_state_dir": str(shared)}})
        assert first.admin("status")["simulated"]
        assert (lock.stat().st_uid, lock.stat().st_mode & 0o777) == (0, 0o644)
        assert (
            f"replaced the GPU lock file {lock}: it was nobody (uid {nobody.pw_uid})'s, "
            "not root's, so no nodemgr of root's"
        ) in first.logtext()
        refused = serve_beside(tmp_path, shared)
        assert refused.returncode == EXIT_CONFIG, refused.stderr
        assert f"already served by nodemgr pid {first.proc.pid}" in refused.stderr
    finally:
        planted.communicate(timeout=30)


def _run_dir_of_length(root: Path, size: int) -> Path:
    """A run directory under ``root`` whose path is ``size`` bytes long."""
    path = root / ("r" * (size - len(str(root)) - 1))
    assert len(str(path)) == size
    return path


def test_a_new_environment_whose_socket_no_client_could_reach_is_refused() -> None:
    """An environment's socket path may have 107 bytes (an AF_UNIX address's 108, less its
    NUL): one of exactly 107 is created and served, one a byte longer is refused, naming
    the path and the limit, and nothing of it is made."""
    from gpushare.exitcodes import EXIT_ADMIN_REFUSED
    from tests.conftest import Daemon, Holder, invoke

    root = Path(tempfile.mkdtemp(prefix="gs-", dir="/tmp"))
    daemon = None
    try:
        # Its run directory is root/run: 60 bytes.
        daemon = Daemon(_run_dir_of_length(root, 60 - len("/run")))
        assert len(str(daemon.run_dir)) == 60
        fits = "a" * (paths.MAX_SOCKET_PATH - 60 - len("/envs//task.sock"))
        endpoint = daemon.env(fits)
        assert len(endpoint.removeprefix("ipc://")) == paths.MAX_SOCKET_PATH
        holder = Holder(endpoint)  # a client reaches it
        holder.close()
        over = fits + "b"
        path = daemon.run_dir / "envs" / over / "task.sock"
        out = invoke(daemon, "quota", "set", over, "--gpus", "1", "--memory", "1GiB")
        assert out.exit_code == EXIT_ADMIN_REFUSED, out.output
        assert (
            f"environment {over}'s socket {path} would be 108 bytes long, over the 107 a "
            "Unix socket's path may have: give it a shorter name, or the node a shorter "
            "node.run_dir"
        ) in out.output
        assert not path.parent.exists()
        assert [q["env"] for q in daemon.admin("quota_show", env=None)["quotas"]] == [fits]
    finally:
        if daemon is not None:
            daemon.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_nodemgr_refuses_to_start_on_an_admin_socket_no_client_could_reach(
    tmp_path: Path,
) -> None:
    """A run directory whose admin.sock path would be 108 bytes stops the start (exit 78)
    naming the path and the limit, rather than serve a socket no client can connect to."""
    root = Path(tempfile.mkdtemp(prefix="gs-", dir="/tmp"))
    try:
        run_dir = _run_dir_of_length(root, paths.MAX_SOCKET_PATH - len("/admin.sock") + 1)
        cfg = tmp_path / "node.toml"
        cfg.write_text(
            f'[node]\nrun_dir = "{run_dir}"\nstate_dir = "{tmp_path}/state"\n'
            f'[gpus]\nsource = "simulated"\nsimulated_state_dir = "{tmp_path}/sim"\n'
        )
        refused = subprocess.run(
            [str(BIN / "nodemgr"), "serve", "--config", str(cfg)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert refused.returncode == EXIT_CONFIG, refused.stderr
        assert (
            f"the admin socket {run_dir}/admin.sock would be 108 bytes long, over the 107 a "
            "Unix socket's path may have: give the node a shorter node.run_dir"
        ) in refused.stderr
        assert not (run_dir / "admin.sock").exists()
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
@pytest.mark.parametrize("planted", ["link", "directory"])
def test_root_replaces_a_link_or_directory_another_user_put_at_a_lock(
    open_dir: Callable[[int], Path], planted: str
) -> None:
    """Another user's link at a lock's name is replaced, its target untouched; their
    directory is moved aside: either way root's nodemgr takes the GPU."""
    shared = open_dir(0o755)
    from nodemgr.host import gpulock
    from nodemgr.host.gpus import Gpu

    os.chmod(shared, 0o1777)
    nobody = pwd.getpwnam("nobody")
    gpu = Gpu(0, simulated_uuid(5), "GPU", 1 << 30)
    lock = gpulock.lock_path(shared, gpu)
    target = shared / "target"
    target.write_text("root's\n")
    if planted == "link":
        lock.symlink_to(target)
    else:
        lock.mkdir()
        (lock / "inside").write_text("theirs\n")
    os.lchown(lock, nobody.pw_uid, nobody.pw_gid)
    fds = gpulock.hold([gpu], shared, Path("/run/mine"), "stop it")
    try:
        st = lock.lstat()
        assert (stat.S_ISREG(st.st_mode), st.st_uid) == (True, 0)
        assert lock.read_text().startswith(f"{os.getpid()} /run/mine")
        assert target.read_text() == "root's\n"
        if planted == "directory":
            (aside,) = shared.glob(f".{lock.name}.moved-*")
            assert (aside / "inside").read_text() == "theirs\n"
    finally:
        for fd in fds:
            os.close(fd)
