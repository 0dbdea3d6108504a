"""nodemgr.reclaim.kill_commands: a silent wrapper's command is killed by process group,
and only when each of the wrapper's children leads a group of its own."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodemgr.reclaim import kill_commands


def _state(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2]


def _gone(pid: int) -> bool:
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        if _state(pid) in (None, "Z"):
            return True
        time.sleep(0.01)
    return False


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        p.kill()
        p.communicate()


def _client(started: list[subprocess.Popen[str]], *argv: str) -> tuple[subprocess.Popen[str], int]:
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    started.append(p)
    assert p.stdout is not None
    return p, int(p.stdout.readline())


def test_children_leading_their_groups_are_killed_with_their_groups(
    started: list[subprocess.Popen[str]],
) -> None:
    script = (
        "import subprocess\n"
        "c = subprocess.Popen(['sh', '-c', 'sleep 30 & echo $!; wait'], process_group=0,"
        " stdout=subprocess.PIPE, text=True)\n"
        "print(c.stdout.readline().strip(), flush=True)\n"
        "c.wait()\n"
    )
    client, grandchild = _client(started, sys.executable, "-c", script)
    fd = os.pidfd_open(client.pid)
    try:
        assert kill_commands(client.pid, fd)
    finally:
        os.close(fd)
    # The whole group: the child's own child too. The client stays.
    assert _gone(grandchild)
    assert client.wait(5) == 0


def test_a_child_in_the_clients_group_is_not_killed(
    started: list[subprocess.Popen[str]],
) -> None:
    client, child = _client(started, "sh", "-c", "sleep 30 & echo $!; wait")
    fd = os.pidfd_open(client.pid)
    try:
        assert not kill_commands(client.pid, fd)
    finally:
        os.close(fd)
    assert _state(child) not in (None, "Z")


def test_a_client_without_children_or_ended_kills_nothing(
    started: list[subprocess.Popen[str]],
) -> None:
    client, _ = _client(started, "sh", "-c", "echo 0; exec sleep 30")
    fd = os.pidfd_open(client.pid)
    try:
        assert not kill_commands(client.pid, fd)
        client.kill()
        client.wait()
        assert not kill_commands(client.pid, fd)
    finally:
        os.close(fd)
