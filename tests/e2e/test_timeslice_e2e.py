"""Time slicing end to end: scripted training jobs (tests/fixtures/ts_job.py on the stand-in torch)
under gpushare-run, the real shim on the simulated driver, a real nodemgr whose GPU 0 is
time-sliced, and the plugin's PyTorch hook, Keras callback and API at the boundaries."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from tests.conftest import _wait_for, turns_changed

REPO = Path(__file__).resolve().parents[2]
JOB = REPO / "tests" / "fixtures" / "ts_job.py"
STANDIN = REPO / "tests" / "fixtures" / "standin"
GiB = 1 << 30
MiB = 1 << 20


def sliced(daemon_factory: Any, quantum: int = 2, **node: Any) -> Any:
    return daemon_factory(
        {
            "gpus": {"simulated_count": 1, "simulated_memory": "16GiB", "context_memory": "0"},
            "scheduler": {"memory_reserve": "0"},
            "timeslice": {"gpus": "all", "quantum": quantum, "turn_timeout": 30.0},
        },
        heartbeat_timeout=30.0,
        **node,
    )


def job_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {"PYTHONPATH": str(STANDIN)}
    env.update(extra or {})
    return env


def job(
    run_task: Any,
    endpoint: str,
    out: Path,
    *args: str,
    opts: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> subprocess.Popen[str]:
    proc = run_task(
        endpoint,
        sys.executable,
        str(JOB),
        "--out",
        str(out),
        *args,
        opts=opts,
        env=job_env(env),
    )
    assert isinstance(proc, subprocess.Popen)
    return proc


def rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def done(p: subprocess.Popen[str], timeout: float = 120) -> None:
    _out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, err


def task_of(daemon: Any, env: str) -> dict[str, Any] | None:
    tasks = daemon.admin("tasks", env=env)["tasks"]
    return dict(tasks[0]) if tasks else None


SHAPE = ("--persistent", "1GiB", "--temporary", "8GiB")


def test_two_jobs_that_do_not_fit_together_take_turns(
    daemon_factory: Any, run_task: Any, tmp_path: Path
) -> None:
    """Each job keeps 1 GiB and uses 8 GiB per iteration: together 18 GiB on a 16 GiB GPU.
    Time-sliced, both run to the end; their iterations never overlap, they alternate, and
    the GPU never holds more than one job's temporary memory."""
    d = sliced(daemon_factory, quantum=2)
    outs = {n: tmp_path / f"{n}.jsonl" for n in ("a", "b")}
    go = tmp_path / "go"
    args: tuple[str, ...] = ("--persistent", "1024", "--temporary", "8192", "--iterations", "10")
    args += ("--work-ms", "20", "--start-file", str(go))
    procs = {
        n: job(run_task, d.env(n, 1, 10 * GiB), outs[n], "--name", n, *args, opts=SHAPE)
        for n in ("a", "b")
    }
    # Both granted before either starts, however slowly this machine starts them.
    _wait_for(lambda: len(d.tasks()) == 2, 60)
    go.touch()
    peak = 0
    while any(p.poll() is None for p in procs.values()):
        peak = max(peak, d.gpu_used(0))
        time.sleep(0.01)
    for p in procs.values():
        done(p)
    r = {n: rows(outs[n]) for n in outs}
    assert all(len(r[n]) == 10 for n in r)
    # The time each held the GPU in an iteration: from its first launch to its boundary.
    spans = [(x["t1"], x["tb"], x["job"]) for n in r for x in r[n]]
    assert turns_changed(spans) >= 3, sorted(spans)
    # Both persistent slices plus one temporary region, never two.
    assert peak <= 2 * GiB + 8 * GiB + 64 * MiB, peak
    assert d.admin("status")["gpus"][0]["turn"] is None  # nothing left to gate


# Two ranks of one task, as torchrun starts them: both on the task's GPU, both reporting
# boundaries; the launcher fails if either does.
RANKS = """
import subprocess, sys
job, out, go = sys.argv[1], sys.argv[2], sys.argv[3]
args = ["--persistent", "256", "--temporary", "2048", "--iterations", "8", "--work-ms", "20",
        "--start-file", go, "--out", out]
procs = [subprocess.Popen([sys.executable, job, "--name", f"a{r}", *args]) for r in (0, 1)]
sys.exit(max(p.wait() for p in procs))
"""


def test_a_task_of_two_processes_hands_the_turn_on_only_when_both_reach_its_end(
    daemon_factory: Any, run_task: Any, tmp_path: Path
) -> None:
    """Task a runs two ranks, task b one process, on one time-sliced GPU. a's turn ends
    when both its ranks have reached it (each releasing its temporary memory), never with
    one rank stopped in the middle of a step: once both ranks have reported a boundary, no
    step of b overlaps a step of either rank, and the turn changes hands."""
    d = sliced(daemon_factory, quantum=2)
    go = tmp_path / "go"
    out_a, out_b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a = run_task(
        d.env("a", 1, 8 * GiB),
        sys.executable,
        "-c",
        RANKS,
        str(JOB),
        str(out_a),
        str(go),
        opts=("--persistent", "1GiB", "--temporary", "5GiB"),
        env=job_env(),
    )
    b = job(
        run_task,
        d.env("b", 1, 8 * GiB),
        out_b,
        "--name",
        "b",
        "--persistent",
        "512",
        "--temporary",
        "4096",
        "--iterations",
        "8",
        "--work-ms",
        "20",
        "--start-file",
        str(go),
        opts=("--persistent", "1GiB", "--temporary", "5GiB"),
    )
    ready = [tmp_path / f"go.{n}.ready" for n in ("a0", "a1", "b")]
    _wait_for(lambda: len(d.tasks()) == 2 and all(r.exists() for r in ready), 60)
    go.touch()
    done(a)
    done(b)
    ra, rb = rows(out_a), rows(out_b)
    assert len(ra) == 16 and len(rb) == 8
    # The barrier waits for the processes that have reported a boundary: from the moment
    # both ranks have, no step of b overlaps a step of either.
    both = max(x["te"] for x in ra if x["i"] == 0)
    for x in (x for x in ra if x["t1"] >= both):
        for y in (y for y in rb if y["t1"] >= both):
            assert x["tb"] <= y["t1"] or y["tb"] <= x["t1"], (x, y)
    spans = sorted([(x["t1"], "a") for x in ra] + [(y["t1"], "b") for y in rb])
    changes = sum(1 for p, q in itertools.pairwise(spans) if p[1] != q[1])
    assert changes >= 3, spans


def test_hooks_in_a_task_process_without_the_autoloader(
    daemon_factory: Any, run_task: Any, tmp_path: Path
) -> None:
    """gpushare-run's command imports torch: the optimizer hook reports its boundaries,
    with GPUSHARE_AUTOLOAD unset. GPUSHARE_ITERATION_HOOKS=0 leaves it out."""
    d = sliced(daemon_factory)
    ep = d.env("a", 1, 4 * GiB)
    for hooks, expect in (("1", 6), ("0", 0)):
        out = tmp_path / f"h{hooks}.jsonl"
        p = job(
            run_task,
            ep,
            out,
            "--iterations",
            "6",
            "--work-ms",
            "100",
            "--temporary",
            "64",
            env={"GPUSHARE_ITERATION_HOOKS": hooks, "GPUSHARE_AUTOLOAD": "0"},
        )
        seen = 0
        while p.poll() is None:
            t = task_of(d, "a")
            if t is not None:
                seen = max(seen, int(t["iterations"]))
            time.sleep(0.02)
        done(p)
        # The last boundaries may land after the last look; the first ones cannot.
        assert (seen >= expect - 2) if expect else seen == 0, seen


def test_api_boundaries_and_first_release(
    daemon_factory: Any, run_task: Any, tmp_path: Path
) -> None:
    """A program with no framework hook calls client_plugin.iteration_boundary(). On a
    time-sliced GPU its first boundary releases the cache, so nodemgr learns its shape:
    settled = what it keeps, temporary peak = one iteration's blocks."""
    d = sliced(daemon_factory)
    ep = d.env("a", 1, 4 * GiB)
    out = tmp_path / "api.jsonl"
    p = job(
        run_task,
        ep,
        out,
        "--boundary",
        "api",
        "--persistent",
        "256",
        "--temporary",
        "1024",
        "--iterations",
        "40",
        "--work-ms",
        "50",
    )
    regions: dict[str, Any] = {}

    def learned() -> bool:
        nonlocal regions
        t = task_of(d, "a")
        if t is None or not t.get("regions"):
            return False
        regions = t["regions"][0]
        return int(t["iterations"]) >= 3 and regions["settled"] > 0

    _wait_for(learned, 30)
    os.killpg(p.pid, signal.SIGTERM)
    p.communicate(timeout=30)
    assert 256 * MiB <= regions["settled"] < 256 * MiB + 16 * MiB, regions
    assert 1024 * MiB <= regions["temporary_peak"] < 1024 * MiB + 16 * MiB, regions
    first = rows(out)[0]
    assert int(first["flags"]) & 1  # the first boundary asked for a release


def test_killed_holder_hands_the_turn_on_at_once(
    daemon_factory: Any, run_task: Any, tmp_path: Path
) -> None:
    """The holder is killed in the middle of a long iteration: the waiting job runs on
    at once, long before nodemgr's 30 s turn timeout or heartbeat timeout."""
    d = sliced(daemon_factory, quantum=1)
    outs = {n: tmp_path / f"{n}.jsonl" for n in ("a", "b")}

    def start(name: str, iterations: str, work_ms: str) -> subprocess.Popen[str]:
        args = ("--name", name, "--iterations", iterations, "--work-ms", work_ms)
        return job(
            run_task, d.env(name, 1, 10 * GiB), outs[name], *args, "--temporary", "2048", opts=SHAPE
        )

    a = start("a", "1000", "2000")
    _wait_for(lambda: task_of(d, "a") is not None, 30)
    b = start("b", "3", "1")
    # b waits for its turn while a works through its first 2 s iteration.
    _wait_for(lambda: (task_of(d, "b") or {}).get("gated") is True, 30)
    killed = time.monotonic()
    job_pid = int(
        subprocess.run(
            ["pgrep", "-f", "-P", str(a.pid), "ts_job.py"],
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        ).stdout.split()[0]
    )
    os.kill(job_pid, signal.SIGKILL)
    done(b, timeout=60)
    first = rows(outs["b"])[0]
    assert first["t1"] - killed < 5.0  # well below the 30 s turn timeout
    a.communicate(timeout=30)


def test_estimate_options(daemon_factory: Any, run_task: Any) -> None:
    """--temporary alone is a usage error; an estimate above the quota is refused."""
    d = sliced(daemon_factory)
    ep = d.env("a", 1, 4 * GiB)
    p = run_task(ep, "true", opts=("--temporary", "1GiB"))
    _, err = p.communicate(timeout=30)
    assert p.returncode == 2 and "--persistent" in err
    p = run_task(ep, "true", opts=("--persistent", "3GiB", "--temporary", "2GiB"))
    _, err = p.communicate(timeout=30)
    assert p.returncode == 77, err


KERAS = """
class Callback:
    pass

class CallbackList:  # like Keras 3's: no iteration over it, only its .callbacks
    def __init__(self, callbacks=None):
        self.callbacks = list(callbacks or [])
    def append(self, c):
        self.callbacks.append(c)

class callbacks:
    Callback = Callback
    CallbackList = CallbackList

class Model:
    def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None):
        if isinstance(callbacks, CallbackList):
            callbacks = callbacks.callbacks
        for batch in range(3):
            for c in callbacks or []:
                c.on_train_batch_end(batch)
        return [type(c).__name__ for c in callbacks or []]
"""


def test_keras_fit_gets_the_callback(daemon_factory: Any, run_task: Any, tmp_path: Path) -> None:
    """Every Model.fit reports a boundary per batch, the user's callbacks kept, given by
    keyword, by position or as a CallbackList; so does a ``with client_plugin.iteration()``
    block that ends without an exception."""
    site = tmp_path / "site"
    (site / "keras").mkdir(parents=True)
    (site / "keras" / "__init__.py").write_text(KERAS)
    d = sliced(daemon_factory)
    ep = d.env("a", 1, 4 * GiB)
    program = textwrap.dedent(
        """
        import ctypes, keras
        cu = ctypes.CDLL("libcuda.so.1")
        dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
        cu.cuInit(0); cu.cuDeviceGet(ctypes.byref(dev), 0)
        cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev); cu.cuCtxSetCurrent(ctx)
        assert cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(1 << 20)) == 0
        class Mine(keras.Callback):
            def on_train_batch_end(self, batch, logs=None):
                pass
        m = keras.Model()
        print(m.fit(callbacks=[Mine()]))
        print(m.fit(None, None, 32, 1, 0, [Mine()]))
        print(m.fit(callbacks=keras.callbacks.CallbackList([Mine()])))
        import client_plugin
        with client_plugin.iteration():
            pass
        try:
            with client_plugin.iteration():  # a step that fails ends no iteration
                raise ValueError
        except ValueError:
            pass
        from gpushare import shim
        print("iterations", shim.memory().iterations)
        """
    )
    p = run_task(ep, sys.executable, "-c", program, env={"PYTHONPATH": str(site)})
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    lines = out.splitlines()
    assert lines[0] == "['Mine', 'GpushareIterations']"
    assert lines[1] == "['Mine', 'GpushareIterations']"
    assert lines[2] == "['Mine', 'GpushareIterations']"
    assert lines[3] == "iterations 10"


def test_a_yield_nodemgr_does_not_answer_stalls_one_step_only(
    daemon_factory: Any, run_task: Any, tmp_path: Path
) -> None:
    """nodemgr dies (its socket stays) while a job's turn ends at every boundary: the first
    yield waits a few seconds for an answer that does not come, says so once, and the next
    steps send none (for 30 s), so the job goes on at its own pace."""
    from nodemgr.host.ledger import TASK_TIMESLICED, Ledger

    d = sliced(daemon_factory)
    ep = d.env("a", 1, 4 * GiB)
    out = tmp_path / "a.jsonl"
    p = job(run_task, ep, out, "--iterations", "60", "--work-ms", "50", "--temporary", "64")
    _wait_for(lambda: task_of(d, "a") is not None, 30)
    task_id = str(task_of(d, "a")["task_id"])  # type: ignore[index]
    d.kill()  # its sockets stay behind, with nobody reading them
    ledger = Ledger.reopen(d.run_dir / "envs" / "a" / "ledger", [_sim_uuid(0)])
    assert ledger is not None
    try:
        ledger.task_turn(task_id, 1, TASK_TIMESLICED)  # every boundary from now on yields
    finally:
        ledger.close()
    _, err = p.communicate(timeout=120)
    r = rows(out)
    assert len(r) == 60
    stalls = [x for x in r if x["te"] - x["tb"] > 3.0]
    assert len(stalls) == 1, [round(x["te"] - x["tb"], 2) for x in r]
    assert err.count("could not hand the GPU's turn back to nodemgr") == 1, err


def _sim_uuid(index: int) -> bytes:
    import uuid

    from nodemgr.host.gpus import simulated_uuid

    return uuid.UUID(simulated_uuid(index).removeprefix("GPU-")).bytes
