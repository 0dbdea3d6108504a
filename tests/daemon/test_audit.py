"""The bypass audit (docs/operations.md, "Bypass audit") through a real nodemgr: processes
that hold memory on the simulated GPUs around the shim are named in `status`, counted in
the metrics and, with audit.action = "kill", killed; a process the shim charges is not."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import BIN, CSRC, cc
from tests.daemon.conftest import free_port, scrape

MiB = 1 << 20
GPU0 = 'gpu="0",uuid="GPU-5349d000-0000-4000-8000-000000000000"'


@pytest.fixture
def bypass(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/c/bypass.c."""
    return cc(tmp_path_factory.mktemp("bypass") / "bypass", str(CSRC / "bypass.c"), "-ldl")


@pytest.fixture
def audited(
    daemon_factory: Any, tmp_path: Path
) -> Callable[[dict[str, Any]], tuple[Any, int, str, Path]]:
    """Start a node (its simulated GPUs its own: no other test's processes are on them)
    with these [audit] settings and metrics on a free port: the node, that
    port, the endpoint of an environment "alice" (one GPU, 4GiB) and a file whose creation
    lets this test's tasks end."""

    def start(audit: dict[str, Any]) -> tuple[Any, int, str, Path]:
        port = free_port()
        d = daemon_factory({"audit": audit, "metrics": {"port": port}})
        return d, port, d.env("alice", gpus=1, memory=4 << 30), tmp_path / "go"

    return start


def findings(d: Any) -> dict[int, dict[str, Any]]:
    return {int(p["pid"]): p for p in d.admin("status")["bypass"]["processes"]}


def ready_pid(p: subprocess.Popen[str], word: str) -> None:
    """Read the task's output up to the line starting with ``word``."""
    assert p.stdout is not None
    for line in p.stdout:
        if line.startswith(word):
            return
    code = p.wait(10)
    err = p.stderr.read() if p.stderr is not None else ""
    raise AssertionError(f"the task ended before {word!r} (exit {code}): {err}")


def test_each_kind_of_bypass_is_reported_and_a_charged_process_is_not(
    audited: Any, run_task: Any, wait_for: Any, cbin: Any, bypass: Path
) -> None:
    d, port, ep, go = audited({"interval": 0.2})
    # LD_PRELOAD unset: the shim never loads, and no slot names the process.
    plain = run_task(
        ep, "env", "-u", "LD_PRELOAD", str(cbin["client"]), "alloc", "128", "waitfile", str(go)
    )
    # libcuda loaded again by dlmopen, in a namespace the preloaded shim does not reach.
    hidden_ns = run_task(ep, str(bypass), "dlmopen", "512", str(go))
    # Charged through the shim, then its own slot zeroed in the ledger.
    rewrote = run_task(ep, str(bypass), "hide", "256", str(go))
    # Through the shim and charged: no finding.
    honest = run_task(ep, str(cbin["client"]), "alloc", "300", "waitfile", str(go))
    for p, word in (
        (plain, "waiting"),
        (hidden_ns, "ready"),
        (rewrote, "ready"),
        (honest, "waiting"),
    ):
        ready_pid(p, word)
    tasks = {t["pid"]: t["task_id"] for t in d.tasks()}
    wait_for(lambda: len(findings(d)) == 3, 10)
    found = findings(d)
    by_task = {p["task_id"]: p for p in found.values()}
    assert set(by_task) == {tasks[plain.pid], tasks[hidden_ns.pid], tasks[rewrote.pid]}
    assert tasks[honest.pid] not in by_task
    for p, nbytes, reason in (
        (plain, 128 * MiB, "no slot"),
        (hidden_ns, 512 * MiB, "no slot"),
        (rewrote, 256 * MiB, "beyond its slot"),
    ):
        f = by_task[tasks[p.pid]]
        assert (f["gpu"], f["seen"], f["accounted"], f["reason"], f["env"]) == (
            0,
            nbytes,
            0,
            reason,
            "alice",
        )
    st = d.admin("status")
    assert st["gpus"][0]["bypass"] == 3 and st["gpus"][1]["bypass"] == 0
    assert st["bypass"]["found"] == 3 and st["bypass"]["killed"] == 0
    # The metrics' snapshot is taken at most once a second.
    wait_for(lambda: scrape(port).get("gpushare_bypass_findings_total") == 3, 5, interval=0.2)
    assert scrape(port)[f"gpushare_bypass_processes{{{GPU0}}}"] == 3
    # Logged once each, however many audits find them.
    wait_for(lambda: d.admin("status")["bypass"]["audits"] >= st["bypass"]["audits"] + 3, 10)
    log = d.logtext()
    for pid in found:
        assert log.count(f"bypass: pid {pid} holds") == 1, log
    shown = subprocess.run(
        [str(BIN / "nodemgr"), "status", "--config", str(d.config)],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    assert "bypass audit: 3 processes" in shown, shown
    for pid, f in found.items():
        assert any(
            line.split()[:2] == [str(pid), "0"] and f["task_id"] in line
            for line in shown.splitlines()
        ), shown
    # Ended, they are no longer found; the count stays.
    go.touch()
    for p in (plain, hidden_ns, rewrote, honest):
        assert p.wait(30) == 0
    wait_for(lambda: findings(d) == {}, 10)
    assert d.admin("status")["bypass"]["found"] == 3


def test_the_kill_action_kills_a_bypassing_process_only(
    audited: Any, run_task: Any, wait_for: Any, cbin: Any, bypass: Path
) -> None:
    d, port, ep, go = audited({"interval": 0.2, "action": "kill"})
    honest = run_task(ep, str(cbin["client"]), "alloc", "300", "waitfile", str(go))
    ready_pid(honest, "waiting")
    cheat = run_task(ep, str(bypass), "dlmopen", "512", str(go))
    ready_pid(cheat, "ready")
    # The bypassing process is killed: its task's client sees its command die of SIGKILL.
    assert cheat.wait(30) != 0
    wait_for(lambda: d.admin("status")["bypass"]["killed"] == 1, 10)
    assert "killed pid" in d.logtext()
    wait_for(lambda: findings(d) == {}, 10)
    wait_for(lambda: scrape(port).get("gpushare_bypass_kills_total") == 1, 5, interval=0.2)
    assert honest.poll() is None
    go.touch()
    assert honest.wait(30) == 0


def test_the_user_of_a_task_whose_process_is_killed_is_told_why(
    audited: Any, run_task: Any, bypass: Path
) -> None:
    """A bypassing command killed under audit.action = "kill": its gpushare-run learns why
    at its next heartbeat and prints it before it exits as its command did."""
    _, _, ep, go = audited({"interval": 0.2, "action": "kill"})
    cheat = run_task(ep, str(bypass), "dlmopen", "512", str(go))
    ready_pid(cheat, "ready")
    assert cheat.wait(30) == 137
    assert cheat.stderr is not None
    err = cheat.stderr.read()
    assert "gpushare-run: nodemgr's bypass audit killed process" in err, err
    assert "of this task (audit.action = kill): it held 512MiB on GPU 0" in err, err
    assert "Run CUDA programs with gpushare's shim preloaded" in err
