"""An environment's ledger is mapped read-write into its processes: its owner may write
anything there. nodemgr keeps serving whatever is written, believes no figure of it
beyond what that environment may hold, rewrites what is its own to write and reports
what NVML does not confirm (docs/containers.md, "Trust"; docs/operations.md, "Bypass
audit")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpushare.client import Connection, NodeError
from tests.conftest import die_with_test_run

GiB = 1 << 30
MiB = 1 << 20

# The environment's owner, as a process of a task of its own: it asks for one GPU, maps
# the ledger as the shim does, then runs one Python statement per line on stdin (names
# kept from one line to the next: `l` the ledger, `fd` its descriptor, `tid` the task id)
# and answers each with the JSON of the name `out`.
HOSTILE = r"""
import json, mmap, os, sys
from nodemgr._ledger import ffi, lib
from gpushare.client import Connection

conn = Connection(sys.argv[1], timeout=60)
grant = conn.call("request", timeout=60, gpus=1)
fd = os.open(grant["ledger"], os.O_RDWR)
mem = mmap.mmap(fd, os.fstat(fd).st_size)
names = {"l": ffi.cast("struct gs_ledger *", ffi.from_buffer(mem)), "lib": lib, "ffi": ffi,
         "fd": fd, "tid": grant["task_id"].encode(), "os": os, "out": None}
print(json.dumps(grant), flush=True)
for line in sys.stdin:
    names["out"] = None
    exec(line, names)
    print(json.dumps(names["out"]), flush=True)
"""


class Hostile:
    """A task of an environment whose process writes its ledger (HOSTILE)."""

    def __init__(self, endpoint: str) -> None:
        self.p = subprocess.Popen(
            [sys.executable, "-c", HOSTILE, endpoint],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd="/",  # the installed nodemgr (with its compiled ledger), not the source tree
            preexec_fn=die_with_test_run(),
        )
        assert self.p.stdout is not None
        line = self.p.stdout.readline()
        assert line, "the hostile task got no grant"
        self.grant: dict[str, Any] = json.loads(line)
        self.task_id = str(self.grant["task_id"])

    def do(self, statement: str) -> Any:
        assert self.p.stdin is not None and self.p.stdout is not None
        self.p.stdin.write(statement + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        assert line, f"the hostile process ended: {self.p.wait(10)}"
        return json.loads(line)

    def claim(self, pid: str = "os.getpid()") -> int:
        """Take a slot (its lock and taken bit) for the task, recording ``pid``."""
        slot = int(self.do(f"slot = out = lib.gs_ledger_claim(l, fd, {pid}, tid)"))
        assert slot >= 0
        return slot

    def end(self) -> None:
        assert self.p.stdin is not None
        self.p.stdin.close()
        assert self.p.wait(30) == 0


@pytest.fixture
def hostiles() -> Iterator[list[Hostile]]:
    made: list[Hostile] = []
    yield made
    for h in made:
        if h.p.poll() is None:
            h.p.kill()
        h.p.wait(timeout=30)
        for pipe in (h.p.stdin, h.p.stdout):
            if pipe is not None:
                pipe.close()


def swept(d: Any, h: Hostile, wait_for: Any) -> None:
    """Return once nodemgr has run two sweeps over ``h``'s ledger since this call: each
    dates a launch count that moved (the slot's `last_launch_ns`), the second starts after
    the first has ended."""
    for _ in range(2):
        h.do("l.slot[slot].last_launch_ns = 0; l.slot[slot].launches_seen = 0")
        h.do("l.slot[slot].launches += 1")
        wait_for(
            lambda: d.proc.poll() is not None or h.do("out = l.slot[slot].last_launch_ns") != 0,
            10,
        )
        assert d.proc.poll() is None, d.logtext()


def request(endpoint: str) -> dict[str, Any]:
    with Connection(endpoint, timeout=10) as c:
        return c.call("request", gpus=1)


def done(endpoint: str, task_id: str) -> None:
    with Connection(endpoint, timeout=10) as c:
        c.call("done", task_id=task_id)


# What each write did before: crash nodemgr, in the sweep, the audit or a reply.
WRITES = {
    "task peak": "l.task[l.slot[slot].task_index].peak = 1 << 63",
    "header ngpus": "l.ngpus = 17",
    "slot used": "l.slot[slot].used[0] = 2**64 - 1; l.slot[slot].held = 2**64 - 1",
    "launches": "l.slot[slot].launches = 1 << 63",
}


@pytest.mark.parametrize("write", sorted(WRITES))
def test_nodemgr_serves_on_whatever_an_environment_writes_in_its_ledger(
    daemon_factory: Any, hostiles: list[Hostile], wait_for: Any, write: str
) -> None:
    d = daemon_factory({"audit": {"interval": 0.1}}, heartbeat_timeout=600.0)
    evil = d.env("mallory", gpus=1, memory=4 * GiB)
    alice = d.env("alice", gpus=1, memory=4 * GiB)
    h = Hostile(evil)
    hostiles.append(h)
    h.claim()
    h.do(WRITES[write])
    swept(d, h, wait_for)
    audits = d.admin("status")["bypass"]["audits"]
    wait_for(
        lambda: d.proc.poll() is not None or d.admin("status")["bypass"]["audits"] > audits + 1,
        10,
    )
    # Every reply that shows the ledger's figures is answered, within sane bounds.
    tasks = {t["task_id"]: t for t in d.tasks()}
    mine = tasks[h.task_id]
    total = sum(g["memory"] for g in d.admin("status")["gpus"])
    assert 0 <= mine["memory_used"] <= total and 0 <= mine["peak"] <= total
    assert 0 <= mine["launches"] < 1 << 63
    assert all(0 <= g["used"] <= g["memory"] for g in d.admin("status")["gpus"])
    d.admin("history", limit=10)
    # Another environment is served as before.
    grant = request(alice)
    assert grant["gpus"][0]["index"] != h.grant["gpus"][0]["index"]
    done(alice, grant["task_id"])
    # The hostile task ends: its record is written, within bounds, and nodemgr goes on.
    h.end()
    wait_for(
        lambda: d.proc.poll() is not None or h.task_id not in {t["task_id"] for t in d.tasks()},
        10,
    )
    assert d.proc.poll() is None, d.logtext()
    [rec] = [r for r in d.admin("history", env="mallory", limit=10)["records"]]
    assert rec["task_id"] == h.task_id and 0 <= rec["peak"] <= total
    assert "Traceback" not in d.logtext()


def test_a_malformed_task_entry_is_freed_at_start_and_nodemgr_starts(
    daemon_factory: Any, hostiles: list[Hostile]
) -> None:
    d = daemon_factory(heartbeat_timeout=600.0)
    evil = d.env("mallory", gpus=1, memory=4 * GiB)
    alice = d.env("alice", gpus=1, memory=4 * GiB)
    h = Hostile(evil)
    hostiles.append(h)
    # Two free entries marked in use: an id with no end, and one with bytes after its end.
    a, b = h.do("out = [i for i in range(1024) if l.task[i].state == 0][:2]")
    h.do(f"ffi.memmove(l.task[{a}].task_id, bytes(range(200, 224)), 24); l.task[{a}].state = 1")
    h.do(f"ffi.memmove(l.task[{b}].task_id, b'ab\\0' + bytes(21 * [1]), 24); l.task[{b}].state = 1")
    d.kill()
    d.start()  # nodemgr starts, the environment's running task restored
    assert h.do(f"out = [l.task[{a}].state, l.task[{b}].state]") == [0, 0]
    assert "env mallory: freed 2 task entries of its ledger" in d.logtext()
    assert h.task_id in {t["task_id"] for t in d.tasks()}
    assert h.do("out = lib.gs_ledger_task_find(l, tid)") >= 0  # its own entry is kept
    for endpoint in (alice, evil):
        done(endpoint, request(endpoint)["task_id"])


@pytest.fixture
def registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A simulated node's usage registry of this test's own (nodemgr and its tasks inherit
    the variable): no other test's processes are on its GPUs."""
    path = tmp_path / "usage"
    path.mkdir()
    monkeypatch.setenv("GPUSHARE_SIM_STATE_DIR", str(path))
    return path


def findings(d: Any) -> list[dict[str, Any]]:
    return list(d.admin("status")["bypass"]["processes"])


def says_12_gib(d: Any, endpoint: str, hostiles: list[Hostile], wait_for: Any) -> Hostile:
    """A task of the environment at ``endpoint`` whose process takes a slot of its own (its
    lock held) and writes it to say 12 GiB on GPU 0; returned once nodemgr has swept it."""
    h = Hostile(endpoint)
    hostiles.append(h)
    h.claim()
    h.do("l.slot[slot].used[0] = 12 << 30; l.slot[slot].held = 12 << 30")
    swept(d, h, wait_for)
    return h


def test_a_fake_slot_costs_others_nothing_and_the_audit_reports_it(
    daemon_factory: Any, registry: Path, hostiles: list[Hostile], wait_for: Any
) -> None:
    d = daemon_factory(
        {"audit": {"interval": 0.1}, "gpus": {"simulated_count": 1}}, heartbeat_timeout=600.0
    )
    evil = d.env("mallory", gpus=1, memory=4 * GiB)
    alice = d.env("alice", gpus=1, memory=12 * GiB)
    h = says_12_gib(d, evil, hostiles, wait_for)
    # Its quota is 4 GiB there: alice's 12 GiB still fit.
    grant = request(alice)
    assert grant["gpus"][0]["index"] == 0
    wait_for(lambda: any(f["reason"] == "ledger beyond NVML" for f in findings(d)), 10)
    [f] = findings(d)
    assert (f["pid"], f["gpu"], f["seen"], f["accounted"], f["env"], f["task_id"]) == (
        h.p.pid,
        0,
        0,
        12 * GiB,
        "mallory",
        h.task_id,
    )
    st = d.admin("status")
    # Not a process holding memory around the shim: not counted as one, never killed.
    assert st["gpus"][0]["bypass"] == 0 and st["bypass"]["found"] == 1
    assert f"ledger: pid {h.p.pid} holds {12 * GiB} bytes on GPU 0, NVML sees 0" in d.logtext()
    done(alice, grant["task_id"])


def test_a_fake_slot_counts_only_the_quota_in_force_once_the_quota_was_lowered(
    daemon_factory: Any, hostiles: list[Hostile], wait_for: Any
) -> None:
    """The GPU was granted under a 12 GiB quota and given back empty; the quota is lowered
    to 4 GiB and the GPU granted again: a slot written to say 12 GiB keeps 4 GiB from the
    others, not the 12 GiB of the earlier limit."""
    d = daemon_factory({"gpus": {"simulated_count": 1}}, heartbeat_timeout=600.0)
    evil = d.env("mallory", gpus=1, memory=12 * GiB)
    done(evil, request(evil)["task_id"])
    d.env("mallory", gpus=1, memory=4 * GiB)
    alice = d.env("alice", gpus=1, memory=12 * GiB)
    says_12_gib(d, evil, hostiles, wait_for)
    grant = request(alice)
    assert grant["gpus"][0]["index"] == 0
    done(alice, grant["task_id"])


def test_a_limit_an_environment_raises_in_its_ledger_is_written_back_and_reported(
    daemon_factory: Any, hostiles: list[Hostile], wait_for: Any
) -> None:
    d = daemon_factory(heartbeat_timeout=600.0)
    evil = d.env("mallory", gpus=1, memory=4 * GiB)
    h = Hostile(evil)
    hostiles.append(h)
    gpu = h.grant["gpus"][0]["index"]
    h.do(f"l.gpu[{gpu}].limit = 16 << 30; l.gpu[{gpu}].ctx_charge = 1")
    back = f"out = [l.gpu[{gpu}].limit, l.gpu[{gpu}].ctx_charge]"
    wait_for(lambda: h.do(back) == [4 * GiB, 0], 10)
    audit = d.admin("status")["bypass"]
    assert audit["rewrites"] >= 1
    [rewrote] = audit["ledgers"]
    assert rewrote["env"] == "mallory"
    assert f"limit on GPU {gpu} {16 * GiB} (nodemgr's: {4 * GiB})" in rewrote["rewrote"]
    assert "context charge" in rewrote["rewrote"]
    assert "env mallory wrote in its ledger what only nodemgr writes" in d.logtext()


def test_a_process_without_the_shim_covered_by_a_fake_slot_is_found(
    daemon_factory: Any,
    registry: Path,
    hostiles: list[Hostile],
    run_task: Any,
    cbin: Any,
    tmp_path: Path,
    wait_for: Any,
) -> None:
    d = daemon_factory({"audit": {"interval": 0.1}}, heartbeat_timeout=600.0)
    evil = d.env("mallory", gpus=2, memory=4 * GiB)
    go = tmp_path / "go"
    plain = run_task(
        evil, "env", "-u", "LD_PRELOAD", str(cbin["client"]), "alloc", "128", "waitfile", str(go)
    )
    assert plain.stdout is not None
    for line in plain.stdout:
        if line.startswith("waiting"):
            break
    wait_for(lambda: [f["reason"] for f in findings(d)] == ["no slot"], 10)
    [f] = findings(d)
    # Another process of the environment writes a slot for it that says exactly what NVML
    # sees it hold: the figures agree, but the process maps no ledger.
    h = Hostile(evil)
    hostiles.append(h)
    h.claim(pid=str(f["pid"]))
    h.do(f"l.slot[slot].used[{f['gpu']}] = {128 * MiB}")
    # The claim and the figure are two writes: an audit between them finds the slot with
    # nothing accounted yet. Wait for one that saw both.
    wait_for(
        lambda: (
            [(g["reason"], g["accounted"]) for g in findings(d)]
            == [("slot not its own", 128 * MiB)]
        ),
        10,
    )
    [g] = findings(d)
    assert (g["pid"], g["gpu"], g["seen"], g["accounted"], g["env"]) == (
        f["pid"],
        f["gpu"],
        128 * MiB,
        128 * MiB,
        "mallory",
    )
    go.touch()
    assert plain.wait(30) == 0


# --- the loop itself: what still fails is logged and ends nothing --------------------------


def test_a_failure_in_one_environments_sweep_stops_no_other_and_not_the_loop(
    server: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    node = server.node
    for name in ("A", "B"):
        node.set_quota(name, 1, 1 << 30)
    sample = node.sample_env

    def failing(env: Any) -> None:
        if env.name == "A":
            raise RuntimeError("A's ledger cannot be read")
        sample(env)

    monkeypatch.setattr(node, "sample_env", failing)
    for _ in range(3):
        node.envs["B"].usage = None
        server._next_sweep = 0.0
        server.step()
        assert node.envs["B"].usage == {}  # B's sweep went on
    assert caplog.text.count("internal error sampling the ledger of env A") == 1
    assert "A's ledger cannot be read" in caplog.text


def test_a_reply_that_cannot_be_encoded_answers_that_request_with_an_internal_error(
    server: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from nodemgr.report import views

    status = views.status
    monkeypatch.setattr(views, "status", lambda *a: {**status(*a), "pid": 1 << 70})
    endpoint = f"ipc://{server.config.run_dir / 'admin.sock'}"
    answers: list[Any] = []

    def ask() -> None:
        with Connection(endpoint, timeout=10) as c:
            try:
                answers.append(c.call("status"))
            except NodeError as e:
                answers.append(e)

    for expect_error in (True, False):
        asking = threading.Thread(target=ask)
        asking.start()
        while asking.is_alive():
            server.step()
        asking.join()
        answer = answers.pop()
        if expect_error:
            assert isinstance(answer, NodeError) and answer.code == "internal", answer
            assert "internal error encoding a status reply" in caplog.text
            monkeypatch.setattr(views, "status", status)
        else:
            assert answer["pid"] == os.getpid()
