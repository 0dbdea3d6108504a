"""nodemgr takes back what dead, finished or silent tasks hold."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from nodemgr.host import procfs

GiB = 1 << 30


@pytest.fixture
def ep(daemon: Any) -> str:
    """The endpoint of environment alice: one GPU, a 1 GiB pool."""
    return str(daemon.env("alice", gpus=1, memory=GiB))


def start_holder(run_task: Any, ep: str, cbin: dict[str, Path], go: Path) -> Any:
    """A task that fills its 1 GiB pool and then waits."""
    p = run_task(ep, str(cbin["client"]), "fill", "64", "waitfile", str(go))
    assert p.stdout.readline() == "fill 16\n"
    assert p.stdout.readline() == "waiting\n"
    return p


def assert_pool_usable(run_task: Any, ep: str, cbin: dict[str, Path]) -> None:
    p = run_task(ep, str(cbin["client"]), "alloc", "1024")
    out, err = p.communicate(timeout=30)
    assert (p.returncode, out) == (0, "alloc ok\n"), err


def test_done_releases_at_once(
    daemon: Any, run_task: Any, cbin: dict[str, Path], tmp_path: Path, ep: str
) -> None:
    go = tmp_path / "go"
    p = start_holder(run_task, ep, cbin, go)
    go.touch()
    assert p.wait(30) == 0
    assert daemon.tasks() == []
    assert daemon.gpu_used(0) == 0
    assert daemon.admin("status")["gpus"][0]["envs"] == []


def test_kill9_of_gpushare_run_frees_bytes_and_gpu(
    daemon: Any, run_task: Any, cbin: dict[str, Path], tmp_path: Path, wait_for: Any, ep: str
) -> None:
    p = start_holder(run_task, ep, cbin, tmp_path / "never")
    [task] = daemon.tasks()
    assert task["memory_used"] == GiB
    os.kill(p.pid, signal.SIGKILL)
    # How soon is the benchmarks' (reclaim_kill); here, that it happens at all.
    wait_for(
        lambda: (
            daemon.tasks() == []
            and daemon.gpu_used(0) == 0
            and daemon.admin("status")["gpus"][0]["envs"] == []
        ),
        timeout=10.0,
    )
    # The client process died with gpushare-run (no orphan keeps the memory).
    assert p.wait(5) == -signal.SIGKILL
    assert_pool_usable(run_task, ep, cbin)


def test_kill9_of_the_cuda_process_frees_its_memory(
    daemon: Any, run_task: Any, cbin: dict[str, Path], tmp_path: Path, wait_for: Any, ep: str
) -> None:
    pidfile = tmp_path / "pid"
    script = f"echo $$ > {pidfile}; exec {cbin['client']} fill 64 waitfile {tmp_path / 'never'}"
    p = run_task(ep, "sh", "-c", script)
    assert p.stdout.readline() == "fill 16\n"
    assert p.stdout.readline() == "waiting\n"
    os.kill(int(pidfile.read_text()), signal.SIGKILL)
    wait_for(lambda: daemon.tasks() == [] and daemon.gpu_used(0) == 0, timeout=10.0)
    assert p.wait(5) == 128 + signal.SIGKILL  # gpushare-run passes the status on
    assert_pool_usable(run_task, ep, cbin)


def test_task_whose_heartbeats_stop_is_reclaimed_after_the_timeout(
    daemon_factory: Any, run_task: Any, cbin: dict[str, Path], tmp_path: Path, wait_for: Any
) -> None:
    daemon = daemon_factory(heartbeat_interval=0.2, heartbeat_timeout=1.5)
    ep = daemon.env("alice", gpus=1, memory=GiB)
    p = start_holder(run_task, ep, cbin, tmp_path / "never")
    os.kill(p.pid, signal.SIGSTOP)  # gpushare-run, the process that heartbeats
    stopped = time.monotonic()
    time.sleep(1.0)  # a window to observe: nothing is reclaimed before the timeout
    assert len(daemon.tasks()) == 1, "reclaimed before the timeout"
    # How soon after the timeout is the benchmarks' (reclaim_hang).
    wait_for(lambda: daemon.tasks() == [] and daemon.gpu_used(0) == 0, timeout=10.0)
    # The timeout runs from the last heartbeat, up to one interval before the stop.
    assert time.monotonic() - stopped >= 1.5 - 0.2
    # nodemgr ended the process holding GPU memory (CMD's process group); gpushare-run,
    # which holds none, hears why once it runs again.
    os.kill(p.pid, signal.SIGCONT)
    assert p.wait(5) == 91
    assert_pool_usable(run_task, ep, cbin)


def test_a_silent_gpushare_run_loses_its_command_and_says_why_when_it_runs_again(
    daemon_factory: Any, run_task: Any, wait_for: Any
) -> None:
    """gpushare-run stopped alone (CMD runs on: a starved client): at the heartbeat timeout
    nodemgr kills CMD's process group, not gpushare-run, which, continued, prints why and
    exits 91."""
    daemon = daemon_factory(heartbeat_interval=0.2, heartbeat_timeout=1.0, reclaim_grace=60.0)
    ep = daemon.env("alice", gpus=1, memory=GiB)
    p = run_task(ep, "sh", "-c", "echo $$; while :; do sleep 0.05; done")
    cmd = int(p.stdout.readline())
    os.kill(p.pid, signal.SIGSTOP)
    wait_for(lambda: daemon.tasks() == [] and daemon.gpu_used(0) == 0, timeout=10.0)
    # CMD is killed at once (a zombie until gpushare-run, stopped, reaps it) ...
    wait_for(lambda: procfs.state(cmd) in (None, "Z"), timeout=2.0)
    # ... and gpushare-run is still there, stopped.
    assert procfs.state(p.pid) == "T"
    [ended] = daemon.admin("history")["records"]
    assert ended["reason"] == "timeout"
    os.kill(p.pid, signal.SIGCONT)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 91, err
    assert err.splitlines()[-1] == (
        "gpushare-run: GPUs reclaimed: nodemgr heard no heartbeat from this task for 1s (was "
        "gpushare-run stopped, or the process too busy to heartbeat?); run the command again"
    )


def test_a_restored_gpushare_run_is_still_a_wrapper(
    daemon_factory: Any, run_task: Any, wait_for: Any
) -> None:
    """After a nodemgr restart the task is restored from the database, wrapper included: at
    the heartbeat timeout its command is killed, not gpushare-run, which says why."""
    daemon = daemon_factory(heartbeat_interval=0.2, heartbeat_timeout=1.0, reclaim_grace=60.0)
    ep = daemon.env("alice", gpus=1, memory=GiB)
    p = run_task(ep, "sh", "-c", "echo $$; while :; do sleep 0.05; done")
    cmd = int(p.stdout.readline())
    daemon.kill()
    daemon.start()
    wait_for(lambda: [t["attached"] for t in daemon.tasks()] == [True], timeout=10.0)
    os.kill(p.pid, signal.SIGSTOP)
    wait_for(lambda: daemon.tasks() == [], timeout=10.0)
    wait_for(lambda: procfs.state(cmd) in (None, "Z"), timeout=2.0)
    assert procfs.state(p.pid) == "T"
    os.kill(p.pid, signal.SIGCONT)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 91, err


def test_a_gpushare_run_granted_from_the_queue_also_keeps_running(
    daemon_factory: Any, run_task: Any, cbin: dict[str, Path], tmp_path: Path, wait_for: Any
) -> None:
    # One GPU, one task on it: alice's gpushare-run waits for bob's task to end.
    daemon = daemon_factory(
        {"scheduler": {"task_threshold": 1}, "gpus": {"simulated_count": 1}},
        heartbeat_interval=0.2,
        heartbeat_timeout=1.0,
        reclaim_grace=60.0,
    )
    ep = daemon.env("alice", gpus=1, memory=GiB)
    go = tmp_path / "go"
    first = start_holder(run_task, daemon.env("bob", gpus=1, memory=GiB), cbin, go)
    p = run_task(ep, "sh", "-c", "echo $$; while :; do sleep 0.05; done")
    wait_for(lambda: len(daemon.admin("queue")["waiting"]) == 1, timeout=10.0)
    go.touch()
    assert first.wait(30) == 0
    cmd = int(p.stdout.readline())
    os.kill(p.pid, signal.SIGSTOP)
    wait_for(lambda: procfs.state(cmd) in (None, "Z"), timeout=10.0)
    assert procfs.state(p.pid) == "T"
    os.kill(p.pid, signal.SIGCONT)
    assert p.wait(30) == 91


def test_a_running_task_keeps_its_grant(
    daemon: Any, run_task: Any, cbin: dict[str, Path], tmp_path: Path, ep: str
) -> None:
    """Heartbeats keep a task alive well past the timeout."""
    go = tmp_path / "go"
    p = start_holder(run_task, ep, cbin, go)
    time.sleep(2.5)  # timeout is 1.0 s, heartbeats every 0.2 s
    [task] = daemon.tasks()
    assert task["memory_used"] == GiB
    go.touch()
    assert p.wait(30) == 0


def test_a_fork_child_does_not_pin_its_dead_parents_memory(
    daemon: Any, run_task: Any, cbin: dict[str, Path], tmp_path: Path, wait_for: Any
) -> None:
    """A worker forked by a task outlives it; the task's bytes still come back."""
    ep = daemon.env("alice", gpus=1, memory=4 * GiB)
    release = tmp_path / "release"
    p = run_task(ep, str(cbin["client"]), "alloc", "3072", "fork", str(release))
    assert p.stdout.readline() == "alloc ok\n"
    assert p.stdout.readline() == "forked\n"
    assert p.wait(30) == 0
    wait_for(lambda: daemon.gpu_used(0) == 0, timeout=1.0)
    q = run_task(ep, str(cbin["client"]), "info", "alloc", "4096")
    out, err = q.communicate(timeout=30)
    assert out == f"info free={4 * GiB} total={4 * GiB}\nalloc ok\n", err
    release.touch()


def test_memory_held_by_a_leftover_process_stays_charged_until_returned(
    daemon: Any, run_task: Any, cbin: dict[str, Path], tmp_path: Path, wait_for: Any, ep: str
) -> None:
    """The command exits while a background child of it still holds GPU memory:
    the GPU is no longer the environment's, but what it holds stays charged."""
    ready, release = tmp_path / "ready", tmp_path / "release"
    p = run_task(
        ep,
        "sh",
        "-c",
        f"{cbin['client']} alloc 512 waitfile {release} & "
        f"while [ ! -e {ready} ]; do sleep 0.01; done",
    )
    assert p.stdout.readline() == "alloc ok\n"
    assert p.stdout.readline() == "waiting\n"
    ready.touch()
    wait_for(lambda: daemon.tasks() == [], timeout=5)
    gpu = daemon.admin("status")["gpus"][0]
    assert (gpu["envs"], gpu["charged"], gpu["used"]) == ([], 512 << 20, 512 << 20)
    release.touch()
    wait_for(lambda: daemon.admin("status")["gpus"][0]["charged"] == 0, timeout=2)
    assert daemon.gpu_used(0) == 0
