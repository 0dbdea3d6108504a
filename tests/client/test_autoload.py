"""The auto-loader: a stand-in package named like a framework, real interpreters,
the installed start-up hook, a real nodemgr and the simulated driver."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from gpushare import libs
from gpushare.client import FIRST_ANSWER
from tests.client.conftest import threads_of
from tests.conftest import Holder, _wait_for

GiB = 1 << 30
MiB = 1 << 20

# The stand-in's body reports what it finds when it starts to run, then offers the
# driver through ctypes, as a framework would use it.
STANDIN = '''
import ctypes, os, sys
print("body", repr(os.environ.get("CUDA_VISIBLE_DEVICES")), os.environ.get("GPUSHARE_TASK_ID"),
      flush=True)

def alloc(mib, ordinal=0):
    """cuMemAlloc of MIB MiB on device ORDINAL: the CUDA result code."""
    cu = ctypes.CDLL("libcuda.so.1")
    dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
    for rc in (lambda: cu.cuInit(0),
               lambda: cu.cuDeviceGet(ctypes.byref(dev), ordinal),
               lambda: cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev),
               lambda: cu.cuCtxSetCurrent(ctx)):
        r = rc()
        if r:
            return r
    return cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(mib << 20))
'''


@pytest.fixture
def standin(tmp_path: Path) -> Path:
    """A directory holding packages `torch` (the stand-in) and `notaframework`."""
    root = tmp_path / "site"
    (root / "torch").mkdir(parents=True)
    (root / "torch" / "__init__.py").write_text(STANDIN)
    (root / "notaframework").mkdir()
    (root / "notaframework" / "__init__.py").write_text(STANDIN)
    return root


def python(
    code_or_args: str | list[str],
    standin: Path,
    endpoint: str | None,
    env: dict[str, str] | None = None,
    autoload: str | None = "1",
    **kw: Any,
) -> subprocess.Popen[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("GPUSHARE_", "CUDA_"))}
    base.pop("LD_PRELOAD", None)
    base["PYTHONPATH"] = str(standin)
    if autoload is not None:
        base["GPUSHARE_AUTOLOAD"] = autoload
    if endpoint is not None:
        base["GPUSHARE_ENDPOINT"] = endpoint
    base.update(env or {})
    args = ["-c", code_or_args] if isinstance(code_or_args, str) else code_or_args
    return subprocess.Popen(
        [sys.executable, *args],
        env=base,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # so a failed test's workers can be ended with it
        **kw,
    )


def finish(p: subprocess.Popen[str], timeout: float = 60) -> tuple[str, str]:
    try:
        return p.communicate(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        if p.poll() is None:
            p.communicate(timeout=30)


def finish_ok(p: subprocess.Popen[str], timeout: float = 60) -> tuple[str, str]:
    """finish(p), which must have exited 0."""
    out, err = finish(p, timeout)
    assert p.returncode == 0, err
    return out, err


def records(daemon: Any, env: str) -> list[dict[str, Any]]:
    return list(daemon.admin("history", env=env)["records"])


def only_record(daemon: Any, env: str) -> dict[str, Any]:
    """The one history record of env: there must be exactly one."""
    [rec] = records(daemon, env)
    return rec


def test_a_dead_nodemgr_fails_the_import_soon(daemon: Any, standin: Path) -> None:
    ep = daemon.env("alice")
    daemon.kill()  # its socket file stays: a connect succeeds, nothing answers
    start = time.monotonic()
    p = python("import torch", standin, ep)
    _, err = finish(p, timeout=FIRST_ANSWER + 20)
    took = time.monotonic() - start
    assert p.returncode == 1, err
    assert "GpushareError: gpushare: cannot reach nodemgr" in err
    assert f"nodemgr did not answer at {ep} within {FIRST_ANSWER:g}s" in err
    assert FIRST_ANSWER <= took < FIRST_ANSWER + 10


def test_ctrl_c_in_the_wait_is_one_line(daemon: Any, standin: Path) -> None:
    ep = daemon.env("alice")
    daemon.kill()
    code = "import sys\ntry:\n    import torch\nfinally:\n    print('cleaned up')\n"
    p = python(code, standin, ep)
    _wait_for(lambda: threads_of(p.pid) > 1, 10)  # in the wait for nodemgr's first answer
    os.kill(p.pid, signal.SIGINT)
    out, err = finish(p)
    assert p.returncode == 130, err
    assert out == "cleaned up\n"
    assert err == (
        f"gpushare: cancelled before nodemgr answered at {ep} (is it running?); "
        "torch was not imported\n"
    )


def test_off_nothing_happens(daemon: Any, standin: Path) -> None:
    ep = daemon.env("alice")
    for autoload in (None, "0", ""):
        p = python("import torch", standin, ep, autoload=autoload)
        out, err = finish_ok(p)
        assert out == "body None None\n"
        assert err == ""
    assert records(daemon, "alice") == []


def test_the_hook_fires_before_the_frameworks_body(daemon: Any, standin: Path) -> None:
    ep = daemon.env("alice", gpus=1, memory=GiB)
    p = python("import json; import torch; print('after', torch.alloc(64))", standin, ep)
    out, _ = finish_ok(p)
    body, after = out.splitlines()[-2:]
    _, visible, task_id = body.split()
    assert visible.startswith("'GPU-") and len(task_id) == 16
    assert after == "after 0"  # the simulated driver, through the shim
    [rec] = records(daemon, "alice")
    assert rec["task_id"] == task_id
    assert rec["reason"] == "done"  # said at exit
    assert daemon.tasks() == []


def test_other_imports_and_processes_without_a_framework_ask_nothing(
    daemon: Any, standin: Path
) -> None:
    ep = daemon.env("alice")
    p = python("import json, email, notaframework", standin, ep)
    out, _ = finish_ok(p)
    assert out == "body None None\n"
    assert records(daemon, "alice") == []


def test_more_framework_names_from_the_environment(daemon: Any, standin: Path) -> None:
    ep = daemon.env("alice")
    p = python(
        "import notaframework", standin, ep, env={"GPUSHARE_FRAMEWORKS": " other, notaframework"}
    )
    out, _ = finish_ok(p)
    assert len(out.split()[2]) == 16
    assert len(records(daemon, "alice")) == 1


def test_the_quota_is_enforced_in_the_process(daemon: Any, standin: Path) -> None:
    ep = daemon.env("alice", gpus=1, memory=GiB)
    p = python("import torch; print(torch.alloc(768), torch.alloc(512))", standin, ep)
    out, _ = finish_ok(p)
    assert out.splitlines()[-1] == "0 2"  # CUDA_ERROR_OUT_OF_MEMORY beyond 1 GiB


def test_restart_keeps_argv_stdin_cwd_and_exit_code(
    daemon: Any, standin: Path, tmp_path: Path
) -> None:
    """Started without the shim, the process is restarted with it at the import."""
    ep = daemon.env("alice", gpus=1, memory=GiB)
    script = tmp_path / "main.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, sys
            os.chdir("/")
            import torch
            print("argv", sys.argv[1:])
            print("cwd", os.getcwd())
            print("stdin", sys.stdin.read().strip())
            print("preloaded", "libgpushare.so" in os.environ.get("LD_PRELOAD", ""))
            print("pid", os.getpid())
            sys.exit(7)
            """
        )
    )
    workdir = tmp_path / "work"
    workdir.mkdir()
    p = python(
        ["-u", str(script), "a b", "--flag", ""],
        standin,
        ep,
        cwd=workdir,
        stdin=subprocess.PIPE,
    )
    out, err = p.communicate("line from stdin\n", timeout=60)
    assert p.returncode == 7, err
    lines = out.splitlines()
    assert "argv ['a b', '--flag', '']" in lines
    assert "cwd /" in lines  # the script's own chdir, made again after the restart
    assert "stdin line from stdin" in lines
    assert "preloaded True" in lines
    assert f"pid {p.pid}" in lines  # the same process: the grant stays with it
    assert only_record(daemon, "alice")["reason"] == "done"


def test_restart_starts_from_the_original_directory(
    daemon: Any, standin: Path, tmp_path: Path
) -> None:
    ep = daemon.env("alice")
    (tmp_path / "work").mkdir()
    code = (
        "import os, sys; print('start', os.getcwd(), flush=True); "
        "os.chdir(sys.argv[1]) if len(sys.argv) > 1 and os.getcwd() != sys.argv[1] else None; "
        "import torch; print('end', os.getcwd())"
    )
    p = python(["-c", code, "/"], standin, ep, cwd=tmp_path / "work")
    out, _ = finish_ok(p)
    starts = [line for line in out.splitlines() if line.startswith("start")]
    assert starts == [f"start {tmp_path / 'work'}"] * 2
    assert out.splitlines()[-1] == "end /"


def test_zero_quota_warns_and_hides_gpus(daemon: Any, standin: Path) -> None:
    ep = daemon.env("zero", gpus=0)
    p = python(
        "import torch, subprocess, sys; subprocess.run([sys.executable, '-c', 'import torch'])",
        standin,
        ep,
    )
    out, err = finish_ok(p)
    # The child inherits "no GPU" and asks nothing either: one warning in all.
    assert out == "body '' None\n" * 2
    assert err.count("\n") == 1 and "GPU quota is 0" in err


def test_zero_quota_can_be_an_error(daemon: Any, standin: Path) -> None:
    ep = daemon.env("zero", gpus=0)
    p = python("import torch", standin, ep, env={"GPUSHARE_ZERO_QUOTA": "error"})
    out, err = finish(p)
    assert p.returncode == 1
    assert out == ""  # the framework's body never ran
    assert "GpushareError" in err and "GPUSHARE_ZERO_QUOTA=error" in err
    assert err.count("GPU quota is 0") == 1  # said once, with nodemgr's advice


def test_waits_for_a_gpu_with_progress_on_stderr(
    daemon_factory: Any, standin: Path, wait_for: Any
) -> None:
    node = daemon_factory(
        {"scheduler": {"task_threshold": 1}, "gpus": {"simulated_count": 1}},
        heartbeat_timeout=600.0,
    )
    holder = Holder(node.env("a"))
    p = python("import torch", standin, node.env("b"))
    wait_for(lambda: len(node.admin("queue")["waiting"]) == 1, 20)
    holder.close()
    out, err = finish_ok(p)
    assert "gpushare: waiting for 1 GPU: position 1 of 1" in err
    assert "granted after waiting" in err
    assert len(out.split()[2]) == 16


def test_no_gpu_within_the_wait_is_an_error_or_a_cpu_fallback(
    daemon_factory: Any, standin: Path
) -> None:
    node = daemon_factory({"gpus": {"simulated_count": 1}, "scheduler": {"task_threshold": 1}})
    holder = Holder(node.env("a"))
    ep = node.env("b")
    p = python("import torch", standin, ep, env={"GPUSHARE_WAIT": "0"})
    _, err = finish(p)
    assert p.returncode == 1
    assert "no GPU for torch" in err and "GPUSHARE_CPU_FALLBACK=1" in err
    p = python(
        "import torch",
        standin,
        ep,
        env={"GPUSHARE_WAIT_TIMEOUT": "0.5", "GPUSHARE_CPU_FALLBACK": "1"},
    )
    out, err = finish_ok(p)
    assert out == "body '' None\n"
    assert "runs without a GPU" in err
    holder.close()


def test_worker_processes_share_the_parents_grant(
    daemon: Any, standin: Path, wait_for: Any, tmp_path: Path
) -> None:
    """A spawned interpreter and a forked worker import the framework too: one task, one
    record, both processes charged to it."""
    ep = daemon.env("alice", gpus=1, memory=GiB)
    go = tmp_path / "go"
    worker = tmp_path / "worker.py"
    worker.write_text(
        "import os, time, torch\n"
        "print('spawned', torch.alloc(32), flush=True)\n"
        f"while not os.path.exists({str(go)!r}):\n"
        "    time.sleep(0.02)\n"
    )
    code = textwrap.dedent(
        f"""
        import os, subprocess, sys, time
        import torch
        print("parent", torch.alloc(64), flush=True)
        child = subprocess.Popen([sys.executable, {str(worker)!r}])
        pid = os.fork()
        if pid == 0:
            import torch as t2
            print("forked", t2.alloc(16), flush=True)
            while not os.path.exists({str(go)!r}):
                time.sleep(0.02)
            os._exit(0)
        child.wait()
        os.waitpid(pid, 0)
        """
    )
    p = python(code, standin, ep)
    wait_for(lambda: daemon.tasks() and daemon.tasks()[0]["memory_used"] >= 112 * MiB, 30)
    [task] = daemon.tasks()
    assert task["processes"] == 3
    go.touch()
    out, _ = finish_ok(p)
    assert "parent 0" in out and "spawned 0" in out and "forked 0" in out
    bodies = [line for line in out.splitlines() if line.startswith("body")]
    assert len({b.split()[2] for b in bodies}) == 1  # one task id seen everywhere
    assert only_record(daemon, "alice")["reason"] == "done"


def test_a_process_inside_gpushare_run_asks_nothing(
    daemon: Any, standin: Path, run_task: Any
) -> None:
    ep = daemon.env("alice")
    p = run_task(
        ep,
        sys.executable,
        "-c",
        "import torch",
        env={"PYTHONPATH": str(standin), "GPUSHARE_AUTOLOAD": "1", "GPUSHARE_ENDPOINT": ep},
    )
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    [rec] = records(daemon, "alice")
    assert out.split()[2] == rec["task_id"]


def test_a_preloaded_shim_is_attached_without_a_restart(daemon: Any, standin: Path) -> None:
    ep = daemon.env("alice", gpus=1, memory=GiB)
    p = python(
        "print('once', flush=True); import torch; print(torch.alloc(768), torch.alloc(512))",
        standin,
        ep,
        env={"LD_PRELOAD": str(libs.shim_path())},
    )
    out, _ = finish_ok(p)
    assert out.count("once") == 1  # no restart
    assert out.splitlines()[-1] == "0 2"


def test_cuda_used_before_the_import_fails_it_clearly_where_no_restart_can_help(
    daemon: Any, standin: Path
) -> None:
    """A preloaded shim that saw the driver used before the framework import cannot enforce
    a grant in place, and a script read from stdin cannot be restarted with it: the import
    says so, gives the grant back, and leaves the environment as it was, so that no child
    process inherits the GPUs or the task id of a grant that is gone."""
    ep = daemon.env("alice", gpus=1, memory=GiB)
    code = textwrap.dedent(
        f"""
        import ctypes, os
        print("cuInit", ctypes.CDLL({str(libs.sim_driver_dir() / "libcuda.so.1")!r}).cuInit(0))
        try:
            import torch
        except RuntimeError as e:
            print(type(e).__name__, e)
        print(sorted(k for k in os.environ if k.startswith(("GPUSHARE_", "CUDA_"))))
        """
    )
    p = python(["-"], standin, ep, env={"LD_PRELOAD": str(libs.shim_path())}, stdin=subprocess.PIPE)
    out, err = p.communicate(code, timeout=60)
    assert p.returncode == 0, err
    cuinit, refused, left = out.splitlines()
    assert cuinit == "cuInit 0"
    assert refused.startswith("GpushareError gpushare: ")
    assert "before" in refused and "CUDA" in refused and "not loaded" not in refused, refused
    assert left == "['GPUSHARE_AUTOLOAD', 'GPUSHARE_ENDPOINT']"
    assert only_record(daemon, "alice")["reason"] == "done"  # given back at once
    assert daemon.tasks() == []


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_process_is_reclaimed(
    daemon: Any, standin: Path, wait_for: Any, signum: int
) -> None:
    """No done at exit: nodemgr sees the process end and takes the task back."""
    ep = daemon.env("alice")
    p = python("import torch, time; print('up', flush=True); time.sleep(60)", standin, ep)
    assert p.stdout is not None
    p.stdout.readline()
    assert p.stdout.readline() == "up\n"
    p.send_signal(signum)
    finish(p)
    wait_for(lambda: daemon.tasks() == [], 5)
    assert [r["reason"] for r in records(daemon, "alice")] == ["exited"]


LAUNCHER = """
import os, subprocess, sys
# A small stand-in for torchrun: --nproc-per-node N SCRIPT starts N ranks with the
# variables torchrun sets, and fails if any rank fails.
n, script = int(sys.argv[2]), sys.argv[3]
ranks = [subprocess.Popen([sys.executable, script],
                          env={**os.environ, "LOCAL_RANK": str(r), "RANK": str(r),
                               "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n)})
         for r in range(n)]
sys.exit(max(p.wait() for p in ranks))
"""

RANK = """
import os, time, torch
rank = int(os.environ["LOCAL_RANK"])
print("rank", rank, torch.alloc(64 * (rank + 1), rank), flush=True)
while not os.path.exists(os.environ["GO"]):
    time.sleep(0.02)
"""


def test_torchrun_ranks_share_a_two_gpu_grant(
    daemon: Any, standin: Path, run_task: Any, wait_for: Any, tmp_path: Path
) -> None:
    """gpushare-run --gpus 2 -- torchrun --nproc-per-node 2 train.py: one request, each
    rank on its own granted GPU, both charged to the one task."""
    ep = daemon.env("alice", gpus=2, memory=GiB)
    (tmp_path / "torchrun.py").write_text(LAUNCHER)
    (tmp_path / "train.py").write_text(RANK)
    go = tmp_path / "go"
    p = run_task(
        ep,
        sys.executable,
        str(tmp_path / "torchrun.py"),
        "--nproc-per-node",
        "2",
        str(tmp_path / "train.py"),
        gpus=2,
        env={
            "PYTHONPATH": str(standin),
            "GPUSHARE_AUTOLOAD": "1",
            "GPUSHARE_ENDPOINT": ep,
            "GO": str(go),
        },
    )
    wait_for(lambda: daemon.tasks() and daemon.tasks()[0]["memory_used"] >= 192 * MiB, 30)
    [task] = daemon.tasks()
    assert task["processes"] == 2
    used = {g: daemon.gpu_used(g) for g in task["gpus"]}
    assert sorted(used.values()) == [64 * MiB, 128 * MiB], used
    go.touch()
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert sorted(line for line in out.splitlines() if line.startswith("rank")) == [
        "rank 0 0",
        "rank 1 0",
    ]
    [rec] = records(daemon, "alice")
    assert rec["reason"] == "done" and len(rec["gpus"]) == 2


def test_only_an_installed_framework_counts(standin: Path) -> None:
    """An optional import that fails, or a library asking whether torch is installed,
    requests nothing: here nodemgr is unreachable, so any request would fail loudly."""
    code = textwrap.dedent(
        """
        import importlib.util
        try:
            import cupy
        except ImportError:
            print('no cupy')
        print('torch installed', importlib.util.find_spec('torch') is not None)
        """
    )
    p = python(code, standin, "ipc:///nonexistent/task.sock")
    out, err = finish_ok(p)
    assert out == "no cupy\ntorch installed True\n"
    assert err == ""


def test_a_refused_import_asks_again_next_time(standin: Path) -> None:
    code = textwrap.dedent(
        """
        for _ in range(2):
            try:
                import torch
            except RuntimeError as e:
                print(type(e).__name__)
        """
    )
    p = python(code, standin, "ipc:///nonexistent/task.sock")
    out, _ = finish_ok(p)
    assert out == "GpushareError\nGpushareError\n"  # never a framework without a grant


def test_cuda_visible_devices_minus_one_means_no_gpu(daemon: Any, standin: Path) -> None:
    ep = daemon.env("alice")
    p = python("import torch", standin, ep, env={"CUDA_VISIBLE_DEVICES": "-1"})
    out, _ = finish_ok(p)
    assert out == "body '-1' None\n"
    assert records(daemon, "alice") == []


def test_a_program_the_holder_execs_keeps_the_task(daemon_factory: Any, standin: Path) -> None:
    """Heartbeats go on in the new program image (this daemon reclaims after 2 s of silence;
    the new image runs 3 s), and it says done at its exit. 2 s, not the test daemons' 1 s:
    between the last heartbeat of the old image and the first of the new one a whole
    interpreter starts, which on a loaded machine can take most of a second."""
    daemon = daemon_factory(heartbeat_timeout=2.0)
    ep = daemon.env("alice")
    code = (
        "import os, sys, torch\n"
        "os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(3.0)'])\n"
    )
    for preload in ({}, {"LD_PRELOAD": str(libs.shim_path())}):
        p = python(code, standin, ep, env=preload)
        finish_ok(p)
    assert [r["reason"] for r in records(daemon, "alice")] == ["done", "done"]


# A task held by an auto-loaded process, silent for SILENT seconds after its grant (a
# restart: the new interpreter starting), then heartbeating every 60 s from a Task; it ends
# (saying done) at SILENT + 2.5 s. The daemon reclaims after 3 s of silence.
SILENT_HOLDER = """
import sys, time
from client_plugin import autotask, settings
from client_plugin.grant import Progress, acquire
s = settings.from_environment()
grant = acquire(s, "silent holder", Progress("test", s.gpus, interval=60.0))
time.sleep(1.0)
autotask._task = autotask.Task(s.endpoint, grant.task_id, 60.0, beat_first=sys.argv[1] == "1")
time.sleep(2.5)
"""


@pytest.mark.parametrize("beat_first", [True, False])
def test_a_restarted_holder_beats_at_once(
    daemon_factory: Any, standin: Path, beat_first: bool
) -> None:
    """The restarted interpreter (autotask.resume) beats as soon as it holds the task, not
    one interval later: the timeout ran through the restart. Without that, a task silent
    past the timeout is killed at once (reason timeout), as a hung one."""
    daemon = daemon_factory(heartbeat_timeout=3.0)
    ep = daemon.env("alice")
    p = python(["-c", SILENT_HOLDER, "1" if beat_first else "0"], standin, ep, autoload=None)
    _, err = finish(p)
    rec = only_record(daemon, "alice")
    if beat_first:
        assert p.returncode == 0, err
        assert rec["reason"] == "done"
    else:
        assert p.returncode == -signal.SIGKILL, err
        assert rec["reason"] == "timeout"
