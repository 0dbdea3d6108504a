"""One environment cannot touch another's tasks or quota, nor any quota; sockets carry
the owner, group and mode the config gives them."""

from __future__ import annotations

import os
import pwd
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpushare.client import Connection, NodeError

GiB = 1 << 30


def call(endpoint: str, kind: str, **fields: Any) -> dict[str, Any]:
    with Connection(endpoint) as c:
        return c.call(kind, **fields)


def error_code(endpoint: str, kind: str, **fields: Any) -> str:
    with pytest.raises(NodeError) as e:
        call(endpoint, kind, **fields)
    return e.value.code


def test_an_environment_cannot_reach_another_environments_tasks_or_quota(daemon: Any) -> None:
    a = daemon.env("A", gpus=1, memory=GiB)
    b = daemon.env("B", gpus=2, memory=2 * GiB)
    with Connection(b) as bc:
        b_task = bc.call("request", gpus=1)["task_id"]
        # Its own quota is all A can read; it never names an environment.
        assert call(a, "quota", env="B") == {
            **call(a, "quota"),
            "env": "A",
            "gpus": 1,
            "memory": GiB,
        }
        # B's task is unknown on A's endpoint: no heartbeat, no done.
        assert error_code(a, "heartbeat", task_id=b_task) == "unknown_task"
        assert error_code(a, "done", task_id=b_task) == "unknown_task"
        # Admin requests do not exist on a task endpoint: no quota changes, no
        # listing, no reclaim or pause, no history.
        requests: list[tuple[str, dict[str, Any]]] = [
            ("quota_set", {"env": "A", "gpus": 4, "memory": GiB}),
            ("quota_delete", {"env": "B", "force": True}),
            ("quota_show", {"env": "B"}),
            ("tasks", {}),
            ("reclaim", {"task_id": b_task}),
            ("pause", {"task_id": b_task}),
            ("resume", {"task_id": b_task}),
            ("history", {}),
            ("status", {}),
        ]
        for kind, fields in requests:
            assert error_code(a, kind, **fields) == "unknown_type", kind
        # B's task is untouched and still B's.
        tasks = daemon.tasks()
        assert [(t["task_id"], t["env"]) for t in tasks] == [(b_task, "B")]
        assert bc.call("heartbeat", task_id=b_task)["type"] == "ack"
        assert daemon.admin("quota_show", env="A")["quotas"][0]["gpus"] == 1
        bc.call("done", task_id=b_task)


def test_sockets_and_ledgers_get_the_configured_owner_group_and_mode(
    daemon_factory: Any,
) -> None:
    gid = os.getgroups()[-1] if os.getgroups() else os.getegid()
    d = daemon_factory(
        {
            "admin": {"mode": "0660", "group": gid},
            "env_defaults": {"mode": "0600"},
            "env": {"shared": {"mode": "0666"}},
        }
    )
    d.env("private")
    d.env("shared")
    admin = os.stat(d.run_dir / "admin.sock")
    assert stat.S_IMODE(admin.st_mode) == 0o660
    assert admin.st_gid == gid
    for env, mode, dir_mode in [("private", 0o600, 0o700), ("shared", 0o666, 0o711)]:
        sock = os.stat(d.run_dir / "envs" / env / "task.sock")
        ledger = os.stat(d.run_dir / "envs" / env / "ledger")
        assert stat.S_IMODE(sock.st_mode) == mode, env
        assert stat.S_IMODE(ledger.st_mode) == mode, env
        assert stat.S_IMODE(os.stat(d.run_dir / "envs" / env).st_mode) == dir_mode, env


CONNECT_AS = """
import os, socket, sys
os.setgid(int(sys.argv[1])); os.setgroups([]); os.setuid(int(sys.argv[2]))
for path in sys.argv[3:]:
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
        print("ok")
    except OSError as e:
        print(e.__class__.__name__)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_another_user_reaches_only_the_sockets_the_config_opens_to_it(
    daemon_factory: Any,
) -> None:
    nobody = pwd.getpwnam("nobody")
    d = daemon_factory({"env": {"theirs": {"owner": "nobody", "mode": "0600"}}})
    d.env("theirs")
    d.env("mine")
    os.chmod(d.root, 0o755)
    os.chmod(d.run_dir, 0o711)
    paths = [
        str(d.run_dir / "admin.sock"),
        str(d.run_dir / "envs" / "mine" / "task.sock"),
        str(d.run_dir / "envs" / "theirs" / "task.sock"),
    ]
    out = subprocess.run(
        [sys.executable, "-c", CONNECT_AS, str(nobody.pw_gid), str(nobody.pw_uid), *paths],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["PermissionError", "PermissionError", "ok"]


def test_an_environment_directory_made_before_nodemgr_keeps_its_identity(
    daemon: Any, tmp_path: Path
) -> None:
    """A container runtime may create the directory it bind-mounts before nodemgr does;
    nodemgr must empty it, not replace it, or the container would see a deleted directory."""
    env_dir = daemon.run_dir / "envs" / "alice"
    env_dir.mkdir()
    (env_dir / "stray").write_text("x")
    (env_dir / "sub").mkdir()
    (env_dir / "link").symlink_to(tmp_path)
    before = os.stat(env_dir).st_ino
    ep = daemon.env("alice")
    assert os.stat(env_dir).st_ino == before
    assert sorted(p.name for p in env_dir.iterdir()) == ["board", "ledger", "task.sock"]
    assert ep == f"ipc://{env_dir / 'task.sock'}"
    assert tmp_path.exists()  # a link is removed, never followed


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_no_permission_is_not_reported_as_no_nodemgr(daemon: Any) -> None:
    nobody = pwd.getpwnam("nobody")
    ep = daemon.env("mine")
    os.chmod(daemon.root, 0o755)
    os.chmod(daemon.run_dir, 0o711)
    code = (
        "import os, sys\n"
        "from gpushare.client import Connection, Unreachable\n"
        "os.setgid(int(sys.argv[1])); os.setuid(int(sys.argv[2]))\n"
        "try:\n"
        "    Connection(sys.argv[3]).call('quota')\n"
        "except Unreachable as e:\n"
        "    print(e)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(nobody.pw_gid), str(nobody.pw_uid), ep],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr
    assert "no permission to reach the nodemgr socket" in r.stdout
