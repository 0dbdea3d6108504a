"""The shim enforces the grant inside real client processes started by gpushare-run."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from gpushare.client import NoResources
from tests.conftest import CSRC, ROOT, cc, let_finish

# The ledger's operations as C programs link them: ledger.c, and the schedules it clears
# when a task entry is taken or freed (ledger_compute.c).
LEDGER_C = (str(ROOT / "shim/ledger.c"), str(ROOT / "shim/ledger_compute.c"))

MiB = 1 << 20
GiB = 1 << 30


def lines(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if ln]


@pytest.mark.parametrize("client", ["client", "client_linked"])
def test_allocation_within_quota_and_oom_beyond(
    daemon: Any, run_task: Any, cbin: dict[str, Path], client: str
) -> None:
    """Both ways into the driver (cudart-style cuGetProcAddress, and -lcuda) are enforced."""
    ep = daemon.env("alice", gpus=1, memory=GiB)
    p = run_task(
        ep,
        str(cbin[client]),
        "info",
        "totalmem",
        "alloc",
        "512",
        "alloc",
        "256",
        "alloc",
        "512",
        "free",
        "alloc",
        "512",
        "info",
    )
    out, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    assert lines(out) == [
        f"info free={GiB} total={GiB}",
        f"totalmem {GiB}",
        "alloc ok",
        "alloc ok",
        "alloc err 2",  # CUDA_ERROR_OUT_OF_MEMORY, nothing charged
        "free ok",  # frees the first 512 MiB
        "alloc ok",  # usable again
        f"info free={256 * MiB} total={GiB}",
    ]
    assert daemon.tasks() == []


def test_quota_larger_than_device_reports_device_memory(
    daemon: Any, run_task: Any, cbin: dict[str, Path]
) -> None:
    """cuMemGetInfo never reports more free memory than the device really has."""
    ep = daemon.env("big", gpus=1, memory=15 * GiB)
    p = run_task(ep, str(cbin["client"]), "alloc", "15360", "alloc", "1", "info")
    out, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    assert lines(out) == ["alloc ok", "alloc err 2", f"info free=0 total={15 * GiB}"]


def test_memory_used_visible_while_task_runs(
    daemon: Any, run_task: Any, cbin: dict[str, Path], tmp_path: Path
) -> None:
    ep = daemon.env("alice", gpus=1, memory=GiB)
    go = tmp_path / "go"
    p = run_task(ep, str(cbin["client"]), "alloc", "300", "launch", "7", "waitfile", str(go))
    assert p.stdout.readline() == "alloc ok\n"
    assert p.stdout.readline() == "launch ok\n"
    assert p.stdout.readline() == "waiting\n"
    [task] = daemon.tasks()
    assert task["env"] == "alice"
    assert task["pid"] == p.pid
    assert task["memory_used"] == 300 * MiB
    assert task["launches"] == 7
    assert daemon.gpu_used(task["gpus"][0]) == 300 * MiB
    let_finish(p, go, daemon)


def test_processes_of_one_environment_never_exceed_the_pool(
    daemon: Any, run_task: Any, cbin: dict[str, Path], tmp_path: Path
) -> None:
    """Two tasks x three processes race to fill one shared 1 GiB pool, five rounds."""
    ep = daemon.env("team", gpus=1, memory=GiB)
    client = str(cbin["client"])
    for round_ in range(5):
        go, stop = tmp_path / f"go{round_}", tmp_path / f"stop{round_}"
        script = f"for i in 1 2 3; do {client} waitfile {go} fill 8 waitfile {stop} & done; wait"
        tasks = [run_task(ep, "sh", "-c", script) for _ in range(2)]
        for t in tasks:
            for _ in range(3):
                assert t.stdout.readline() == "waiting\n"
        go.touch()
        filled = 0
        for t in tasks:
            # Three processes share the task's stdout: their lines interleave.
            got = sorted(t.stdout.readline().split() for _ in range(6))
            assert [w[0] for w in got] == ["fill"] * 3 + ["waiting"] * 3
            filled += sum(int(w[1]) for w in got[:3])
        running = daemon.tasks()
        assert len(running) == 2
        assert {tuple(t["gpus"]) for t in running} == {(0,)}, "both tasks share the env's GPU"
        used = sum(t["memory_used"] for t in running)
        assert used == filled * 8 * MiB
        assert used <= GiB
        # Racing processes may each back off near the limit, never overshoot it.
        assert used >= GiB - 6 * 8 * MiB
        stop.touch()
        for t in tasks:
            assert t.wait(30) == 0


@pytest.mark.parametrize("writers", [1, 4])
def test_a_refused_charge_is_never_reported(tmp_path: Path, writers: int) -> None:
    """Charges racing at the limit, on the ledger code the shim and nodemgr share: a reader
    (what nodemgr reports in status, tasks, metrics and peaks) never sees more than the
    limit, however many charges are being checked and refused meanwhile (tests/c/
    ledger_race.c: two slots hold 6 of 8 MiB, the writers' 3 MiB more never fits)."""
    race = cc(tmp_path / "ledger_race", str(CSRC / "ledger_race.c"), *LEDGER_C)
    argv = [str(race), str(writers), "300000"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    seen = dict(kv.split("=") for kv in out.stdout.split())
    assert int(seen["refused"]) == writers * 300000 and int(seen["samples"]) > 0, seen
    assert int(seen["max_used"]) == int(seen["max_summary"]) == 6 * MiB, seen  # the holders
    assert int(seen["max_peak"]) == 3 * MiB, seen


def _ledger_procs(tmp_path: Path, *argv: str) -> list[dict[str, str]]:
    """Run tests/c/ledger_procs.c; one dict per line it prints."""
    prog = cc(tmp_path / "ledger_procs", str(CSRC / "ledger_procs.c"), *LEDGER_C)
    out = subprocess.run(
        [str(prog), argv[0], str(tmp_path / "ledger"), *argv[1:]],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    return [dict(kv.split("=") for kv in line.split() if "=" in kv) for line in lines]


def test_charges_of_racing_processes_never_pass_the_limit(tmp_path: Path) -> None:
    """16 processes, each with its own slot and descriptor as under the shim, charge 3 MiB
    against a limit that fits one such charge: never are two granted at once, and once all
    are done the GPU's count and the slots are back at zero."""
    (seen,) = _ledger_procs(tmp_path, "fit", "16", "20000")
    assert int(seen["max_held"]) == int(seen["fits"]) == 1, seen
    assert int(seen["granted"]) > 0 and int(seen["refused"]) > 0, seen
    assert int(seen["granted"]) + int(seen["refused"]) == 16 * 20000, seen
    assert seen["charged"] == seen["used"] == "0", seen


def test_a_process_killed_while_charging_leaves_the_count_high_never_low(tmp_path: Path) -> None:
    """Processes killed (SIGKILL) wherever they are in their charges and uncharges: once
    their slots are reaped, the GPU's count is never below what the live slots hold (which
    would let the environment past its limit), and above it by at most one charge (64 MiB at
    most here) per killed process; with no process left, reaping sets it back to zero."""
    *rounds, idle = _ledger_procs(tmp_path, "kill", "16", "10")
    assert len(rounds) == 10
    for r in rounds:
        charged, used, killed = int(r["charged"]), int(r["used"]), int(r["killed"])
        assert killed == 8 and used <= charged <= used + killed * 64 * MiB, r
    assert idle == {"charged": "0", "used": "0"}


def test_a_refused_charge_first_frees_what_dead_processes_held(tmp_path: Path) -> None:
    """What the shim does when a charge is refused, on the ledger code it shares with
    nodemgr (tests/c/ledger_procs.c reclaim): a survivor is refused what SIGKILLed processes
    of the environment still hold, frees their slots (and only theirs: the others live) and
    is granted on its retry; racers doing the same while a reaper sweeps as nodemgr does free
    each dead slot exactly once, and the GPU's count is then exactly what the slots hold.
    Dead processes that launched since the last sweep date their task's last launch."""
    *rounds, idle = _ledger_procs(tmp_path, "reclaim", "16", "10")
    assert len(rounds) == 10
    for r in rounds:
        assert r["solo_rc"] == "1" and r["solo_reaped"] == "8", r  # refused, then granted
        assert r["stamped"] == "1", r  # the dead launched: their task's last launch is dated
        assert r["reaped"] == r["killed"] == "9", r  # the second half and the survivor
        assert int(r["granted"]) >= 1 and r["charged"] == r["used"], r
    assert idle == {"charged": "0", "used": "0"}


def test_processes_run_one_after_another_get_what_the_ended_ones_held(
    daemon_factory: Any, run_task: Any, cbin: dict[str, Path]
) -> None:
    """A task whose processes run one after the other, each taking most of the quota (and a
    context's charge) and exiting without freeing it: each is granted what the ended ones
    held, without waiting for nodemgr's sweep (60 s here, so none comes between them)."""
    d = daemon_factory(
        {"gpus": {"simulated_count": 1, "context_memory": "256MiB"}}, sweep_interval=60.0
    )
    ep = d.env("a", memory=4 * GiB)
    p = run_task(ep, "sh", "-c", f"for i in $(seq 20); do {cbin['client']} alloc 3072; done")
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert lines(out) == ["alloc ok"] * 20


def _one_gpu(daemon_factory: Any) -> Any:
    """A node of one 16 GiB GPU, all of it promisable."""
    return daemon_factory(
        {
            "gpus": {"simulated_count": 1, "simulated_memory": "16GiB"},
            "scheduler": {"memory_reserve": "0"},
        }
    )


def test_a_lowered_quota_charges_the_gpu_what_the_environment_still_holds(
    daemon_factory: Any, run_task: Any, cbin: dict[str, Path], tmp_path: Path
) -> None:
    """Lowered below what a running environment holds, a quota stops its new allocations
    there, the reply (and the CLI) says so, and the GPU stays charged what it holds: no other
    environment is let in on the difference."""
    d = _one_gpu(daemon_factory)
    go = tmp_path / "go"
    a = run_task(
        d.env("a", memory=12 * GiB),
        str(cbin["client"]),
        "alloc",
        "10240",
        "waitfile",
        str(go),
        "alloc",
        "64",
    )
    assert a.stdout.readline() == "alloc ok\n"
    assert a.stdout.readline() == "waiting\n"
    reply = d.admin("quota_set", env="a", gpus=1, memory=4 * GiB)
    assert reply["over"] == [{"gpu": 0, "used": 10 * GiB}]
    assert d.admin("status")["gpus"][0]["used"] == 10 * GiB
    b = run_task(d.env("b", memory=8 * GiB), "true", opts=["--no-wait"])
    _, err = b.communicate(timeout=30)
    assert b.returncode == 75, err  # 10 GiB held + 8 GiB would be more than the GPU's 16
    go.touch()
    out, _ = a.communicate(timeout=30)
    assert out.splitlines() == ["alloc err 2"]  # nothing more beyond the lowered quota


def test_a_raise_that_would_overcommit_a_gpu_is_refused_and_changes_nothing(
    daemon_factory: Any, run_task: Any, cbin: dict[str, Path], tmp_path: Path
) -> None:
    d = _one_gpu(daemon_factory)
    go = tmp_path / "go"
    hold = ["sh", "-c", f"echo up; while [ ! -e {go} ]; do sleep 0.05; done"]
    b = run_task(d.env("b", memory=8 * GiB), *hold)
    assert b.stdout.readline() == "up\n"
    a_ep = d.env("a", memory=8 * GiB)
    a = run_task(a_ep, str(cbin["client"]), "waitfile", str(go), "alloc", "9216", "info")
    assert a.stdout.readline() == "waiting\n"
    promised = "cannot have 12GiB per GPU while it runs: GPU 0 would be promised 20GiB of its 16GiB"
    with pytest.raises(NoResources, match=promised):
        d.admin("quota_set", env="a", gpus=1, memory=12 * GiB)
    assert d.admin("quota_show", env="a")["quotas"][0]["memory"] == 8 * GiB
    go.touch()
    out, _ = a.communicate(timeout=30)
    assert out.splitlines()[0] == "alloc err 2"  # the limit is still 8 GiB
    b.communicate(timeout=30)


def test_a_tasks_peak_is_what_its_processes_held_at_once(
    daemon: Any, run_task: Any, cbin: dict[str, Path], tmp_path: Path
) -> None:
    """Two processes of a task each hold 512 MiB, one after the other while both live: the
    task's peak (tasks, history) is 512 MiB, what it held at once, not the sum of each
    process's own peak."""
    ep = daemon.env("alice", gpus=1, memory=GiB)
    client, f0, f1 = str(cbin["client"]), tmp_path / "f0", tmp_path / "f1"
    first = f"{client} alloc 512 free waitfile {f1}"
    second = f"{client} waitfile {f0} alloc 512 free waitfile {f1}"
    t = run_task(ep, "sh", "-c", f"{first} & {second} & wait")
    assert t.stdout is not None
    seen: list[str] = []

    def until(line: str, count: int) -> None:
        while seen.count(line) < count:
            assert t.stdout is not None
            seen.append(t.stdout.readline().strip())

    until("free ok", 1)  # the first process held and freed its 512 MiB
    f0.touch()
    until("free ok", 2)
    [task] = daemon.tasks()
    assert task["processes"] == 2
    assert task["peak"] == 512 * MiB
    f1.touch()
    assert t.wait(30) == 0
    [record] = daemon.admin("history", env="alice", since=None, limit=None)["records"]
    assert record["peak"] == 512 * MiB
