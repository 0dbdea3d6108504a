#!/usr/bin/env python3
"""A guided tour of gpushare on two simulated GPUs, which is also a smoke test.

    make demo                   (or: .venv/bin/python demo/demo.py)

It starts its own ``nodemgr serve`` on two simulated 5 GiB GPUs, with its run
and state directories in a fresh temporary directory, and creates two
environments: ``alice`` (2 GPUs, 4 GiB per GPU) and ``bob`` (1 GPU, 2 GiB).
Then, with ``gpushare-run`` and a small CUDA driver-API program:

1. alice's job takes both GPUs (4 GiB charged on each leaves 1 GiB, too little
   for bob's 2 GiB);
2. bob's task started with ``--no-wait`` is refused (exit 75); started with
   ``--wait`` it waits in nodemgr's queue;
3. alice's job ends and bob's task starts at once; it allocates up to its
   2 GiB and one allocation beyond it fails with CUDA_ERROR_OUT_OF_MEMORY;
4. a new task of alice's runs beside bob's, on the other GPU;
5. both end, and ``nodemgr history`` shows the three tasks;
6. GPU 1 is switched to time slicing (``nodemgr mode``), and two training jobs
   (``tests/fixtures/ts_job.py`` on the stand-in torch), each keeping 512 MiB and using
   3 GiB more per iteration, run there together although they do not fit side
   by side: they take turns, which ``nodemgr top`` shows.

``nodemgr tasks``, ``status``, ``top`` and ``history`` are shown at those
moments. The exit status is 0 when everything happened as described, 1 when
something did not (the demo says what, with the end of nodemgr's log), 130
on Ctrl-C. Whatever it started is stopped however it ends, and its temporary
directory removed.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpushare.client import Connection, wait_until_serving
from gpushare.protocol import MAX_ADMIN_REPLY_BYTES

SELF = Path(__file__).resolve()
BIN = Path(sys.executable).parent  # nodemgr and gpushare-run installed beside this Python
NODEMGR = BIN / "nodemgr"
GPUSHARE_RUN = BIN / "gpushare-run"
# The test doubles the demo runs: a scripted training job, and a stand-in torch on the
# simulated driver.
FIXTURES = SELF.parent.parent / "tests" / "fixtures"
TS_JOB = FIXTURES / "ts_job.py"
STANDIN = FIXTURES / "standin"

MiB = 1 << 20
GiB = 1 << 30
GPU_MEMORY = 5 * GiB
ALICE = {"gpus": 2, "memory": 4 * GiB}
BOB = {"gpus": 1, "memory": 2 * GiB}
CUDA_ERROR_OUT_OF_MEMORY = 2
EXIT_NO_RESOURCES = 75
START_TIMEOUT = 20.0  # seconds for a task to be granted and reach its first step
_PR_SET_PDEATHSIG = 1


class DemoFailed(Exception):
    """Something did not happen as the tour says it does."""


def _pdeathsig() -> None:
    """Die with the parent: nothing the demo starts outlives it, even a kill -9 of it."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _size(n: int) -> str:
    if n % GiB == 0:
        return f"{n // GiB}GiB"
    return f"{n / MiB:.0f}MiB"


# --- the CUDA program each task runs (this file with --client STEPS) --------------------


def client(steps: list[str]) -> int:
    """A few CUDA driver calls, one printed line each.

    Steps: ``info`` (cuMemGetInfo), ``alloc MIB`` (cuMemAlloc), ``hold PATH``
    (stay until PATH exists, at most a minute). It reaches libcuda.so.1 as any
    program does; under gpushare-run on simulated GPUs that is gpushare's
    simulated driver, with the shim in front of it.
    """
    parent = os.getppid()
    _pdeathsig()
    if os.getppid() != parent:
        return 1
    cu = ctypes.CDLL("libcuda.so.1")
    cu.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
    cu.cuMemGetInfo_v2.argtypes = [ctypes.POINTER(ctypes.c_size_t)] * 2
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    for name, rc in (
        ("cuInit", cu.cuInit(0)),
        ("cuDeviceGet", cu.cuDeviceGet(ctypes.byref(dev), 0)),
        ("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)),
        ("cuCtxSetCurrent", cu.cuCtxSetCurrent(ctx)),
    ):
        if rc != 0:
            print(f"{name} failed: CUDA error {rc}", flush=True)
            return 1
    held: list[ctypes.c_uint64] = []
    while steps:
        step = steps.pop(0)
        if step == "info":
            free, total = ctypes.c_size_t(), ctypes.c_size_t()
            rc = cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
            print(
                f"info free={free.value} total={total.value} "
                f"({_size(free.value)} of {_size(total.value)} free) rc={rc}",
                flush=True,
            )
        elif step == "alloc":
            mib = int(steps.pop(0))
            ptr = ctypes.c_uint64()
            rc = cu.cuMemAlloc_v2(ctypes.byref(ptr), mib * MiB)
            if rc == 0:
                held.append(ptr)
                print(f"alloc {mib}MiB ok", flush=True)
            else:
                name = " CUDA_ERROR_OUT_OF_MEMORY" if rc == CUDA_ERROR_OUT_OF_MEMORY else ""
                print(f"alloc {mib}MiB err {rc}{name}", flush=True)
        elif step == "hold":
            path = Path(steps.pop(0))
            print("holding until the demo lets go", flush=True)
            deadline = time.monotonic() + 60
            while not path.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        else:
            print(f"unknown step {step!r}", flush=True)
            return 2
    return 0


# --- the tour ---------------------------------------------------------------------------------

_print_lock = threading.Lock()


def say(text: str = "") -> None:
    with _print_lock:
        print(text, flush=True)


def section(title: str) -> None:
    say()
    say(f"== {title}")


class Task:
    """One ``gpushare-run`` process; its output is shown as it comes, prefixed with its name."""

    def __init__(self, name: str, proc: subprocess.Popen[str]) -> None:
        self.name = name
        self.proc = proc
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.rstrip("\n")
            say(f"   {self.name:>11} | {line}")
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_line(self, pattern: str, timeout: float = START_TIMEOUT) -> re.Match[str]:
        """The first output line matching ``pattern``; DemoFailed if none comes in time."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines:
                    m = rx.search(line)
                    if m:
                        return m
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    raise DemoFailed(
                        f"{self.name}: no line like {pattern!r} (exit status {self.proc.poll()})"
                    )
                self._cond.wait(min(left, 0.2))

    def output(self) -> list[str]:
        with self._cond:
            return list(self.lines)

    def finish(self, timeout: float = START_TIMEOUT) -> int:
        """Wait for gpushare-run to exit; its exit status."""
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise DemoFailed(f"{self.name}: still running after {timeout:.0f}s") from None
        self._reader.join(5)
        return rc

    def stop(self) -> None:
        """End gpushare-run and its command, however far they got."""
        if self.proc.poll() is None:
            # gpushare-run passes SIGTERM on to its command and reports the end.
            with contextlib.suppress(ProcessLookupError):
                self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(3)
        # Its own session: this reaches whatever is left in it.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        self._reader.join(2)


class Demo:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.run_dir = root / "run"
        self.config = root / "nodemgr.toml"
        self.log = root / "nodemgr.log"
        self.daemon: subprocess.Popen[bytes] | None = None
        self.tasks: list[Task] = []
        self.checks = 0
        # The demo sets everything gpushare-run needs on its command line; settings
        # from the caller's shell (a GPUSHARE_CPU_FALLBACK, say) must not change it.
        self.env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("GPUSHARE_") or k == "GPUSHARE_SHIM"
        }
        # The CUDA program goes by a short name, as it then shows in nodemgr's tables.
        bin_dir = root / "bin"
        bin_dir.mkdir()
        program = bin_dir / "cuda-client"
        exe, me = shlex.quote(sys.executable), shlex.quote(str(SELF))
        program.write_text(f'#!/bin/sh\nexec {exe} {me} --client "$@"\n')
        program.chmod(0o755)
        self.env["PATH"] = os.pathsep.join([str(bin_dir), self.env.get("PATH", "")])

    # helpers

    def check(self, ok: bool, what: str) -> None:
        if not ok:
            raise DemoFailed(what)
        self.checks += 1

    def spawn(self, argv: list[str], **popen: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` in a session of its own (a Ctrl-C at the terminal reaches only
        the demo, which then stops it), tied to the demo's life."""
        wrapped = [sys.executable, str(SELF), "--exec", str(os.getpid()), *argv]
        popen.setdefault("env", self.env)
        return subprocess.Popen(wrapped, start_new_session=True, **popen)

    def admin(self, kind: str, **fields: Any) -> dict[str, Any]:
        with Connection(
            f"ipc://{self.run_dir / 'admin.sock'}", timeout=5.0, max_reply=MAX_ADMIN_REPLY_BYTES
        ) as conn:
            return conn.call(kind, **fields)

    def nodemgr(self, *args: str) -> None:
        """Run a nodemgr command and show it with its output."""
        say(f"$ nodemgr {' '.join(args)}")
        argv = [str(NODEMGR), *args, "--config", str(self.config)]
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=20, env=self.env, check=False
        )
        for line in (done.stdout + done.stderr).rstrip("\n").splitlines():
            say(f"  {line}")
        if done.returncode != 0:
            raise DemoFailed(f"nodemgr {args[0]} exited {done.returncode}")

    def gpushare_run(self, name: str, options: list[str], steps: list[str]) -> Task:
        shown = " ".join([*options, "--", "cuda-client", *steps])
        say(f"$ gpushare-run {shown}".replace(str(self.root), "$TMP"))
        return self.start_task(name, [str(GPUSHARE_RUN), *options, "--", "cuda-client", *steps])

    def start_task(self, name: str, argv: list[str], **popen: Any) -> Task:
        """Spawn ``argv`` as the task ``name``, its output read as text, and keep it."""
        proc = self.spawn(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            **popen,
        )
        task = Task(name, proc)
        self.tasks.append(task)
        return task

    def endpoint(self, env: str) -> str:
        return f"ipc://{self.run_dir / 'envs' / env / 'task.sock'}"

    def wait_for(
        self, what: str, probe: Callable[[], bool], task: Task | None = None, timeout: float = 10.0
    ) -> None:
        """Poll ``probe`` until it holds; DemoFailed if ``task`` ends first or time runs out."""
        deadline = time.monotonic() + timeout
        while not probe():
            if task is not None and task.proc.poll() is not None:
                raise DemoFailed(f"{task.name} exited {task.proc.poll()} before {what}")
            if time.monotonic() > deadline:
                raise DemoFailed(f"{what} did not happen within {timeout:.0f}s")
            time.sleep(0.05)
        self.checks += 1

    # the daemon

    def start_nodemgr(self) -> None:
        self.config.write_text(
            "# Written by demo/demo.py: everything under its temporary directory.\n"
            "[node]\n"
            f'run_dir = "{self.run_dir}"\n'
            f'state_dir = "{self.root / "state"}"\n'
            "[gpus]\n"
            'source = "simulated"\n'
            "simulated_count = 2\n"
            f'simulated_memory = "{_size(GPU_MEMORY)}"\n'
        )
        say(f"TMP={self.root}")
        gpus = f"2 simulated {_size(GPU_MEMORY)} GPUs"
        say(f"$ nodemgr serve --config $TMP/{self.config.name}   ({gpus})")
        say("  (every nodemgr command below is given the same --config)")
        with open(self.log, "wb") as log:
            self.daemon = self.spawn(
                [str(NODEMGR), "serve", "--config", str(self.config)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        daemon = self.daemon
        admin = f"ipc://{self.run_dir / 'admin.sock'}"
        if not wait_until_serving(admin, lambda: daemon.poll() is None, 20):
            raise DemoFailed("nodemgr did not start")

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        for task in self.tasks:
            task.stop()
        if self.daemon is not None and self.daemon.poll() is None:
            self.daemon.terminate()
            try:
                self.daemon.wait(10)
            except subprocess.TimeoutExpired:
                self.daemon.kill()
                self.daemon.wait(5)

    # the story

    def run(self) -> None:
        section("Start nodemgr and create two environments")
        self.start_nodemgr()
        for env, q in (("alice", ALICE), ("bob", BOB)):
            self.nodemgr(
                "quota", "set", env, "--gpus", str(q["gpus"]), "--memory", _size(q["memory"])
            )
        self.nodemgr("status")

        section("1. alice's job takes both GPUs")
        release_a1 = self.root / "release-alice-job"
        a1 = self.gpushare_run(
            "alice-job",
            ["--endpoint", self.endpoint("alice"), "--gpus", "2"],
            ["info", "alloc", "3072", "info", "hold", str(release_a1)],
        )
        a1.wait_line("holding")
        infos = [m for line in a1.output() if (m := re.match(r"info free=(\d+) total=(\d+)", line))]
        self.check(
            len(infos) == 2 and all(int(m[2]) == ALICE["memory"] for m in infos),
            "alice's job should see her 4GiB per-GPU quota as the GPU's total memory",
        )
        self.check(
            int(infos[1][1]) == ALICE["memory"] - 3072 * MiB,
            "after 3GiB of allocations alice's job should see 1GiB free",
        )
        self.nodemgr("tasks")
        self.nodemgr("status")
        status = self.admin("status")
        self.check(
            all(g["envs"] == ["alice"] and g["charged"] == ALICE["memory"] for g in status["gpus"]),
            "both GPUs should be charged alice's 4GiB",
        )

        section("2. bob's task: refused at once with --no-wait, queued with --wait")
        b0 = self.gpushare_run(
            "bob-no-wait", ["--endpoint", self.endpoint("bob"), "--no-wait"], ["info"]
        )
        rc = b0.finish()
        self.check(
            rc == EXIT_NO_RESOURCES,
            f"gpushare-run --no-wait should exit {EXIT_NO_RESOURCES} (no GPUs free), not {rc}",
        )
        say(f"   (gpushare-run exited {rc}: no GPUs free now)")
        b1 = self.gpushare_run(
            "bob-task",
            ["--endpoint", self.endpoint("bob"), "--wait", "--wait-timeout", "60"],
            ["info", "alloc", "1536", "alloc", "1024", "info", "hold", str(self.root / "release")],
        )
        self.wait_for(
            "bob's request waiting in nodemgr's queue",
            lambda: [w["env"] for w in self.admin("queue")["waiting"]] == ["bob"],
            task=b1,
        )
        self.nodemgr("top", "--iterations", "1")

        section("3. alice's job ends: bob's task starts at once and meets its 2GiB quota")
        self.check(
            not any(line.startswith("info") for line in b1.output()),
            "bob's command should not start while alice's job holds both GPUs",
        )
        release_a1.touch()
        rc = a1.finish()
        self.check(rc == 0, f"alice's job should exit 0, not {rc}")
        b1.wait_line("holding")
        out = b1.output()
        self.check(
            any(re.match(rf"info free={BOB['memory']} total={BOB['memory']}\b", s) for s in out),
            "bob's task should see his 2GiB quota as the GPU's memory",
        )
        self.check("alloc 1536MiB ok" in out, "bob's first allocation (1.5GiB) should succeed")
        self.check(
            f"alloc 1024MiB err {CUDA_ERROR_OUT_OF_MEMORY} CUDA_ERROR_OUT_OF_MEMORY" in out,
            "bob's second allocation (1GiB more) should fail: beyond his 2GiB",
        )
        self.check(
            any(s.startswith(f"info free={512 * MiB} ") for s in out),
            "bob's task should see 512MiB of his quota left",
        )

        section("4. A new task of alice's runs beside bob's, on the other GPU")
        a2 = self.gpushare_run(
            "alice-task",
            ["--endpoint", self.endpoint("alice"), "--wait", "--wait-timeout", "60"],
            ["info", "alloc", "1024", "hold", str(self.root / "release")],
        )
        a2.wait_line("holding")
        self.check(
            any(re.match(rf"info free=\d+ total={ALICE['memory']}\b", s) for s in a2.output()),
            "alice's second task should see her 4GiB quota",
        )
        self.nodemgr("tasks")
        self.nodemgr("status")
        status = self.admin("status")
        self.check(
            sorted(env for g in status["gpus"] for env in g["envs"]) == ["alice", "bob"],
            "alice and bob should each hold one GPU",
        )

        section("5. Both tasks end; the records")
        (self.root / "release").touch()
        for task in (b1, a2):
            rc = task.finish()
            self.check(rc == 0, f"{task.name} should exit 0, not {rc}")
        self.wait_for("the GPUs' release", lambda: self.admin("status")["tasks"] == 0)
        self.nodemgr("history")
        records = self.admin("history")["records"]
        self.check(
            sorted((r["env"], r["reason"], r["exit_code"]) for r in records)
            == [("alice", "done", 0), ("alice", "done", 0), ("bob", "done", 0)],
            "history should hold alice's two tasks and bob's one, each done with exit 0",
        )
        self.timeslicing()

    def timeslicing(self) -> None:
        section("6. Time slicing: two training jobs that do not fit side by side take turns")
        self.nodemgr("mode", "1", "timesliced")
        self.nodemgr("quota", "set", "bob", "--gpus", "1", "--memory", "4GiB")
        say("   (each job keeps 512MiB and uses 3GiB more per iteration: 7GiB for both at")
        say(f"    once, on a {_size(GPU_MEMORY)} GPU; each states its shape, so both are admitted)")
        outs = {}
        jobs = []
        for env in ("alice", "bob"):
            outs[env] = self.root / f"{env}-train.jsonl"
            shape = ["--persistent", "512MiB", "--temporary", "3GiB"]
            job = ["--name", env, "--persistent", "512", "--temporary", "3072"]
            job += ["--iterations", "12", "--work-ms", "40"]
            say(
                f"$ CUDA_VISIBLE_DEVICES=1 gpushare-run --endpoint $TMP/.../{env} "
                f"{' '.join(shape)} -- python tests/fixtures/ts_job.py {' '.join(job)}"
            )
            env_vars = {**self.env, "CUDA_VISIBLE_DEVICES": "1", "PYTHONPATH": str(STANDIN)}
            argv = [str(GPUSHARE_RUN), "--endpoint", self.endpoint(env), *shape, "--"]
            argv += [sys.executable, str(TS_JOB), *job, "--out", str(outs[env])]
            jobs.append(self.start_task(f"{env}-train", argv, env=env_vars))
        self.wait_for(
            "one job waiting for its turn",
            lambda: any(t["gated"] for t in self.admin("tasks")["tasks"]),
            timeout=START_TIMEOUT,
        )
        self.nodemgr("top", "--iterations", "1")
        for task in jobs:
            rc = task.finish(timeout=60)
            self.check(rc == 0, f"{task.name} should exit 0, not {rc}")
        rows = []
        for env, out in outs.items():
            lines = [json.loads(x) for x in out.read_text().splitlines() if x.strip()]
            self.check(len(lines) == 12, f"{env}'s job should have run its 12 iterations")
            rows += [(x["t1"], x["tb"], env) for x in lines]
        rows.sort()
        for (_, end, who), (start, _, other) in itertools.pairwise(rows):
            self.check(who == other or start >= end, f"{other} ran while {who} had the turn")
        turns = 1 + sum(1 for a, b in itertools.pairwise(rows) if a[2] != b[2])
        say(f"   (both jobs ran their 12 iterations in {turns} turns, never at once)")


def _exec(argv: list[str]) -> int:
    """``--exec PARENT CMD...``: tie this process to the demo's life, then become CMD."""
    parent, *command = argv
    _pdeathsig()
    if os.getppid() != int(parent):
        return 1  # the demo died before we could tie ourselves to it
    os.execv(command[0], command)


def _terminate(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through every finally: children are stopped


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--client"]:
        return client(args[1:])
    if args[:1] == ["--exec"]:
        return _exec(args[1:])
    if args:
        print(__doc__, file=sys.stderr)
        return 2
    for path in (NODEMGR, GPUSHARE_RUN):
        if not path.exists():
            print(f"demo: {path} is missing; run `make install` and use .venv/bin/python")
            return 2
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGHUP, _terminate)
    # ipc:// paths must fit in a socket address (108 bytes): keep the directory short.
    root = Path(tempfile.mkdtemp(prefix="gsdemo-", dir="/tmp"))
    demo: Demo | None = None
    start = time.monotonic()
    try:
        demo = Demo(root)
        demo.run()
    except DemoFailed as e:
        say()
        say(f"demo: FAILED: {e}")
        if demo is not None:
            say("demo: the end of nodemgr's log:")
            say(demo.log_tail())
        return 1
    except KeyboardInterrupt:
        say()
        say("demo: interrupted")
        return 130
    finally:
        if demo is not None:
            demo.stop()
        shutil.rmtree(root, ignore_errors=True)
    say()
    say(f"demo: all {demo.checks} checks passed in {time.monotonic() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
