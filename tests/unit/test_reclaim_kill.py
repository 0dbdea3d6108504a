"""nodemgr.loop.reclaim.kill_commands: a silent wrapper's command is killed by process group,
and only when each of the wrapper's children leads a group of its own."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest

from nodemgr.host import procfs
from nodemgr.loop.reclaim import kill_commands


def _gone(pid: int) -> bool:
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        if procfs.state(pid) in (None, "Z"):
            return True
        time.sleep(0.01)
    return False


# Starts a client, returns it, the number it prints first, and a pidfd of it.
Spawn = Callable[..., tuple["subprocess.Popen[str]", int, int]]


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    procs: list[subprocess.Popen[str]] = []
    fds: list[int] = []

    def start(*argv: str) -> tuple[subprocess.Popen[str], int, int]:
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        procs.append(p)
        fds.append(os.pidfd_open(p.pid))
        assert p.stdout is not None
        return p, int(p.stdout.readline()), fds[-1]

    yield start
    for fd in fds:
        os.close(fd)
    for p in procs:
        p.kill()
        # Not communicate(): a child it left behind (a `sleep 30`) holds its stdout open.
        p.wait(30)
        assert p.stdout is not None
        p.stdout.close()


def test_children_leading_their_groups_are_killed_with_their_groups(spawn: Spawn) -> None:
    script = (
        "import subprocess\n"
        "c = subprocess.Popen(['sh', '-c', 'sleep 30 & echo $!; wait'], process_group=0,"
        " stdout=subprocess.PIPE, text=True)\n"
        "print(c.stdout.readline().strip(), flush=True)\n"
        "c.wait()\n"
    )
    client, grandchild, fd = spawn(sys.executable, "-c", script)
    assert kill_commands(client.pid, fd)
    # The whole group: the child's own child too. The client stays.
    assert _gone(grandchild)
    assert client.wait(5) == 0


def test_a_child_in_the_clients_group_is_not_killed(spawn: Spawn) -> None:
    client, child, fd = spawn("sh", "-c", "sleep 30 & echo $!; wait")
    assert not kill_commands(client.pid, fd)
    assert procfs.state(child) not in (None, "Z")


def test_a_client_without_children_or_ended_kills_nothing(spawn: Spawn) -> None:
    client, _, fd = spawn("sh", "-c", "echo 0; exec sleep 30")
    assert not kill_commands(client.pid, fd)
    client.kill()
    client.wait(30)
    assert not kill_commands(client.pid, fd)
