"""An environment's directory belongs to its user, who may plant anything there; nodemgr,
as root, follows no link and trusts no entry it finds there, and an entry it cannot clear
refuses that environment alone."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import pwd
import stat
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpushare.client import Connection, NodeError
from nodemgr.host.envdirs import MAX_CLEARED

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")

NOBODY = pwd.getpwnam("nobody")
USER = {"owner": NOBODY.pw_uid, "group": NOBODY.pw_gid, "mode": "0600"}

# Run as the environment's user: keep replacing an entry of its directory by a link, as a
# user racing nodemgr's start would; with "spoil", also keep its ledger unadoptable (its
# user may write it), so that every start makes a new one.
RACER = """
import os, sys
os.setgid(int(sys.argv[1])); os.setgroups([]); os.setuid(int(sys.argv[2]))
env_dir, name, target, stop, spoil = sys.argv[3:8]
tmp = os.path.join(env_dir, "swap")
while not os.path.exists(stop):
    try:
        if spoil == "1":
            with open(os.path.join(env_dir, "ledger"), "r+b") as f:
                f.write(bytes(8))
        os.symlink(target, tmp)
        os.rename(tmp, os.path.join(env_dir, name))
    except OSError:
        pass
"""


@contextlib.contextmanager
def _racing(d: Any, env: str, name: str, target: Path, spoil: bool) -> Iterator[None]:
    stop = d.root / f"stop-{env}"  # where the racer can see it
    ids = [str(NOBODY.pw_gid), str(NOBODY.pw_uid)]
    args = [str(d.run_dir / "envs" / env), name, str(target), str(stop), "1" if spoil else "0"]
    racer = subprocess.Popen([sys.executable, "-c", RACER, *ids, *args])
    try:
        yield
    finally:
        stop.touch()
        try:
            racer.wait(10)
        except subprocess.TimeoutExpired:
            racer.kill()
            racer.wait(30)
    assert racer.returncode == 0


def _restart(d: Any) -> None:
    d.kill()
    d.start()


def _victim(path: Path) -> tuple[bytes, int, int, int]:
    st = os.lstat(path)
    return path.read_bytes(), st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)


def _quota(endpoint: str) -> dict[str, Any]:
    with Connection(endpoint, timeout=5) as c:
        return c.call("quota")


def _open_to_others(d: Any) -> None:
    os.chmod(d.root, 0o755)
    os.chmod(d.run_dir, 0o711)


def test_a_new_ledger_never_follows_a_link_the_user_left(
    daemon_factory: Any, tmp_path: Path
) -> None:
    d = daemon_factory({"env": {"m1": USER, "m2": USER}})
    victim = tmp_path / "victim"  # root's file, which a link must not give away
    ghost = tmp_path / "ghost"  # a missing file, which a link must not create
    victim.write_bytes(b"root's own file\n")
    os.chmod(victim, 0o640)
    before = _victim(victim)
    for env in ("m1", "m2"):
        d.env(env)
    _open_to_others(d)
    # The temporary name nodemgr 0.1 used for a new ledger.
    with (
        _racing(d, "m1", "ledger.new", victim, spoil=True),
        _racing(d, "m2", "ledger.new", ghost, spoil=True),
    ):
        for round in range(10):
            _restart(d)
            assert _victim(victim) == before, round
            assert not ghost.exists() and not ghost.is_symlink(), round
    d.kill()
    for env in ("m1", "m2"):
        # A link where the ledger was: removed, not followed.
        env_dir = d.run_dir / "envs" / env
        (env_dir / "ledger").unlink()
        (env_dir / "ledger").symlink_to(victim)
    d.start()
    assert _victim(victim) == before
    for env in ("m1", "m2"):
        ledger = os.lstat(d.run_dir / "envs" / env / "ledger")
        assert stat.S_ISREG(ledger.st_mode) and ledger.st_uid == NOBODY.pw_uid
        assert _quota(d.env(env))["env"] == env


def test_a_hard_link_is_not_adopted_as_a_ledger(daemon_factory: Any) -> None:
    """A user who can hard-link a file of root's (another environment's ledger, say) into
    its directory does not get it: a ledger with a second name is not nodemgr's."""
    d = daemon_factory({"env": {"mallory": USER}})
    d.env("mallory")
    d.env("alice")  # nodemgr's user owns it: the default
    alice = d.run_dir / "envs" / "alice" / "ledger"
    mallory = d.run_dir / "envs" / "mallory" / "ledger"
    before = _victim(alice)
    d.kill()
    mallory.unlink()
    os.link(alice, mallory)
    d.start()
    assert _victim(alice)[1:] == before[1:]
    assert os.stat(alice).st_nlink == 1  # the link was removed, not followed
    assert os.stat(mallory).st_uid == NOBODY.pw_uid
    assert _quota(d.env("mallory"))["env"] == "mallory"


def test_swapping_the_socket_for_a_link_during_restarts_gives_nothing_away(
    daemon_factory: Any, tmp_path: Path
) -> None:
    d = daemon_factory({"env": {"m": USER}})
    ep = d.env("m")
    _open_to_others(d)
    victim = tmp_path / "victim"
    victim.write_bytes(b"root's own file\n")
    before = _victim(victim)
    with _racing(d, "m", "task.sock", victim, spoil=False):
        for round in range(8):
            _restart(d)
            assert _victim(victim) == before, round
    _restart(d)
    assert _quota(ep)["env"] == "m"
    assert _victim(victim) == before


def _stopped_with_a_socket_removed(daemon_factory: Any) -> tuple[Any, str, str, Path]:
    """A node with environments a and b, stopped, a's task socket file removed: the node,
    a's and b's endpoints and a's directory."""
    d = daemon_factory({"env": {"a": USER}})
    ep = d.env("a")
    other = d.env("b")
    env_dir = d.run_dir / "envs" / "a"
    d.kill()
    (env_dir / "task.sock").unlink()
    return d, ep, other, env_dir


def test_a_directory_at_the_socket_is_moved_aside(daemon_factory: Any) -> None:
    d, ep, other, env_dir = _stopped_with_a_socket_removed(daemon_factory)
    (env_dir / "task.sock" / "sub").mkdir(parents=True)
    (env_dir / "task.sock" / "sub" / "f").write_text("kept")
    d.start()
    assert _quota(ep)["env"] == "a"
    assert _quota(other)["env"] == "b"
    [aside] = [p for p in env_dir.iterdir() if p.name.startswith("task.sock.")]
    assert (aside / "sub" / "f").read_text() == "kept"
    assert f"{env_dir / 'task.sock'} was a directory: moved it aside to {aside}" in d.logtext()


FS_IOC_GETFLAGS = 0x80086601
FS_IOC_SETFLAGS = 0x40086602
FS_IMMUTABLE_FL = 0x10


def _set_immutable(path: Path, on: bool) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        buf = fcntl.ioctl(fd, FS_IOC_GETFLAGS, struct.pack("l", 0))
        flags = struct.unpack("l", buf)[0]
        flags = flags | FS_IMMUTABLE_FL if on else flags & ~FS_IMMUTABLE_FL
        fcntl.ioctl(fd, FS_IOC_SETFLAGS, struct.pack("l", flags))
    finally:
        os.close(fd)


@contextlib.contextmanager
def _immutable(path: Path) -> Iterator[None]:
    try:
        _set_immutable(path, True)
    except OSError as e:
        if e.errno in (errno.ENOTTY, errno.EOPNOTSUPP, errno.EPERM, errno.EINVAL):
            pytest.skip(f"cannot make {path} immutable here: {e.strerror}")
        raise
    try:
        yield
    finally:
        _set_immutable(path, False)


def test_an_entry_nodemgr_cannot_clear_refuses_only_its_environment(
    daemon_factory: Any,
) -> None:
    d, ep, other, env_dir = _stopped_with_a_socket_removed(daemon_factory)
    (env_dir / "task.sock").mkdir()
    (env_dir / "task.sock" / "f").write_text("x")
    with _immutable(env_dir / "task.sock"):
        d.start()
        # The node serves every other environment.
        assert _quota(other)["env"] == "b"
        assert d.admin("quota_show", env="b")["quotas"][0]["env"] == "b"
        why = f"environment a refused: cannot create its socket {env_dir / 'task.sock'}"
        assert why in d.logtext()
        with pytest.raises(NodeError) as e:
            d.env("a")
        assert why in e.value.message
        assert d.proc.poll() is None
    # Once the entry can go, a quota set serves it again.
    assert d.env("a") == ep
    assert _quota(ep)["env"] == "a"


def test_files_planted_by_the_thousand_are_cleared_only_so_far(daemon_factory: Any) -> None:
    """A user who plants any number of files in its directory (some in subdirectories) and
    spoils its ledger does not hold up nodemgr's start: at most MAX_CLEARED of them are
    removed, the rest are left (said in the log), and the environment is served with a new
    ledger."""
    d = daemon_factory()
    ep = d.env("a")
    env_dir = d.run_dir / "envs" / "a"
    d.kill()
    (env_dir / "ledger").write_bytes(b"not a ledger")
    (env_dir / "deep" / "er").mkdir(parents=True)
    for i in range(MAX_CLEARED + 50):
        (env_dir / "deep" / "er" / f"f{i}").touch()
    fd = os.open(env_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i in range(MAX_CLEARED + 50):
            os.close(os.open(f"planted{i}", os.O_CREAT | os.O_WRONLY, 0o600, dir_fd=fd))
    finally:
        os.close(fd)
    d.start()
    assert _quota(ep)["env"] == "a"
    left = [p for p in os.listdir(env_dir) if p.startswith("planted")]
    left += os.listdir(env_dir / "deep" / "er") if (env_dir / "deep").exists() else []
    # MAX_CLEARED entries are removed (the two directories among them if they went).
    assert (
        2 * (MAX_CLEARED + 50) - MAX_CLEARED
        <= len(left)
        <= 2 * (MAX_CLEARED + 50) - (MAX_CLEARED - 2)
    )
    assert f"{env_dir}: removed {MAX_CLEARED} entries its user made there" in d.logtext()
    assert os.stat(env_dir / "ledger").st_size > len(b"not a ledger")
