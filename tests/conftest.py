"""What every tier shares: the suite's time limits, its signals and the clean-up of what it
starts, and the fixtures that start a real daemon, real gpushare-run and real C clients.
What one tier alone uses is in that tier's conftest.py."""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import itertools
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpushare import libs
from gpushare.client import Connection, NodeError, Unreachable, wait_until_serving
from gpushare.protocol import MAX_ADMIN_REPLY_BYTES
from nodemgr.host import procfs

ROOT = Path(__file__).resolve().parent.parent

# Hypothesis's caches go to a temporary directory, not the repository (its example
# database is off: property tests set database=None).
os.environ.setdefault(
    "HYPOTHESIS_STORAGE_DIRECTORY",
    str(Path(tempfile.gettempdir()) / f"gpushare-hypothesis-{os.getuid()}"),
)
CSRC = Path(__file__).resolve().parent / "c"
BIN = Path(sys.executable).parent

# A suite started in the background by a shell without job control (`cmd &` in a script)
# inherits SIGINT ignored, and so would every process it starts, since exec keeps an
# ignored signal ignored: the tests that Ctrl-C gpushare-run, a command or `nodemgr top`
# need it delivered as a terminal delivers it. Handled here, it is the default in children.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# `make debug-test` runs the C paths under sanitizers: GPUSHARE_SHIM names the sanitizer
# build of the shim and this names its runtime ("address" or "thread").
SANITIZER = os.environ.get("GPUSHARE_TEST_SANITIZE", "")


def _sanitizer_runtime() -> list[str]:
    """What a process preloading the shim must preload after it: ASan's runtime must be
    loaded before libc, or it cannot see the heap; TSan's comes with the instrumented
    test programs themselves."""
    if SANITIZER != "address":
        return []
    path = subprocess.run(
        ["cc", "-print-file-name=libasan.so"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.strip()
    return [path]


SANITIZER_PRELOAD = _sanitizer_runtime()


def shim_preload() -> str:
    """LD_PRELOAD for a test process that runs with the shim (and, in a sanitizer run,
    that sanitizer's runtime)."""
    return " ".join([str(libs.shim_path()), *SANITIZER_PRELOAD])


HOOKS_DEF = ROOT / "shim" / "hooks.def"


@dataclass(frozen=True)
class HookEntry:
    """One line of shim/hooks.def."""

    kind: str  # GS_HOOK, GS_VARIANT, GS_REAL, GS_NVML_HOOK or GS_NVML_REAL
    abi: str
    base: str | None = None  # CUDA hooks and variants: the name cuGetProcAddress is asked for
    version: int = 0  # the CUDA version that introduced this ABI variant
    per_thread: bool = False


def hook_table() -> list[HookEntry]:
    """The shim's hook table, read from the file the C code is generated from."""
    entries = []
    text = re.sub(r"/\*.*?\*/", "", HOOKS_DEF.read_text(), flags=re.S)
    for m in re.finditer(r"^(GS_[A-Z_]+)\(\s*(\w+)\s*,([^\n]*)", text, flags=re.M):
        kind, abi, rest = m.group(1), m.group(2), m.group(3)
        if kind in ("GS_HOOK", "GS_VARIANT"):
            base, ver, ptsz = (f.strip() for f in rest.split(",")[:3])
            entries.append(HookEntry(kind, abi, base, int(ver), ptsz.rstrip(")") == "1"))
        elif kind in ("GS_REAL", "GS_NVML_HOOK", "GS_NVML_REAL"):
            entries.append(HookEntry(kind, abi))
    if not entries:
        pytest.fail(f"no entries parsed from {HOOKS_DEF}")
    return entries


def _have_nvidia() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _have_nvidia():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU and driver")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# --- time limits ----------------------------------------------------------------------------
# Every test has a time limit (pytest-timeout: `timeout` in pyproject.toml, or a test's
# `timeout` mark). At the limit SIGALRM fails the test, with every thread's stack, and the
# run goes on. A test stuck where no signal handler can run (C code that holds the GIL or
# retries its call when interrupted) is ended later by faulthandler's watchdog, a thread of
# C: it prints every thread's stack and exits the process (under xdist its worker, a
# crash that ends the run: --max-worker-restart=0 in pyproject.toml).
WATCHDOG_GRACE = 60.0  # the most the watchdog waits past the limit (at most the limit again)
_watchdog_fd = -1  # the terminal's stderr, kept from before pytest captured it


def pytest_configure(config: pytest.Config) -> None:
    global _watchdog_fd
    if _watchdog_fd < 0 and sys.__stderr__ is not None:
        _watchdog_fd = os.dup(sys.__stderr__.fileno())


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> None:
    """Arm the watchdog; pytest-timeout's own hook then sets its SIGALRM timer."""
    limit = float(settings.timeout)
    later = limit + min(limit, WATCHDOG_GRACE)
    faulthandler.dump_traceback_later(later, exit=True, file=_watchdog_fd)


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_cancel_timer(item: pytest.Item) -> None:
    faulthandler.cancel_dump_traceback_later()


def cc(out: Path, *args: str) -> Path:
    subprocess.run(
        [
            "cc",
            "-std=gnu11",
            "-O1",
            "-g",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-pthread",
            *(["-fsanitize=thread"] if SANITIZER == "thread" else []),
            f"-I{ROOT / 'shim'}",
            "-o",
            str(out),
            *args,
        ],
        check=True,
        timeout=120,
    )
    return out


@pytest.fixture(scope="session")
def cbin(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The C test programs, compiled once per session."""
    d = tmp_path_factory.mktemp("cbin")
    sim = libs.sim_driver_dir()
    src = str(CSRC / "cuda_client.c")
    out = {
        "client": cc(d / "client_gpa", src, "-ldl"),
        "client_linked": cc(
            d / "client_linked", "-DLINKED", src, f"-L{sim}", "-l:libcuda.so.1", "-ldl"
        ),
    }
    for name in ("first", "second"):
        cc(
            d / f"libprobe_{name}.so",
            "-shared",
            "-fPIC",
            f'-DPROBE_NAME="{name}"',
            f"-DPROBE_NEXT={name}_next",
            f"-DPROBE_DEFAULT={name}_default",
            str(CSRC / "probe_lib.c"),
            "-ldl",
        )
    out["probe"] = cc(
        d / "probe",
        str(CSRC / "probe_main.c"),
        f"-L{d}",
        "-lprobe_first",
        "-lprobe_second",
        f"-Wl,-rpath,{d}",
        "-ldl",
    )
    return out


def _toml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(v)


_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


def die_with_test_run() -> Callable[[], None]:
    """A ``preexec_fn`` for a process that must never outlive the test run, even when
    pytest is killed: the kernel sends it SIGKILL when this process dies."""
    parent = os.getpid()

    def arm() -> None:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before the line above
            os._exit(1)

    return arm


class Keeper(threading.Thread):
    """Heartbeats every task the test process itself holds on a daemon (a test that sends
    ``request`` on a Connection of its own). nodemgr reclaims a silent task by killing its
    client, and at a test daemon's 1 s timeout a slow moment would kill the test run."""

    def __init__(self, daemon: Daemon, interval: float) -> None:
        super().__init__(daemon=True, name="grant-keeper")
        self.node = daemon
        self.interval = interval
        self.stopped = threading.Event()
        self.start()

    def run(self) -> None:
        conns: dict[str, Connection] = {}
        try:
            while not self.stopped.wait(self.interval):
                try:
                    tasks = self.node.admin("tasks", timeout=max(self.interval, 0.5))["tasks"]
                except (Unreachable, NodeError):
                    continue  # stopped or restarting
                for t in tasks:
                    if t["pid"] != os.getpid():
                        continue
                    env = str(t["env"])
                    try:
                        if env not in conns:
                            sock = self.node.run_dir / "envs" / env / "task.sock"
                            conns[env] = Connection(f"ipc://{sock}", timeout=0.5)
                        conns[env].call("heartbeat", task_id=t["task_id"])
                    except (Unreachable, NodeError):
                        if env in conns:
                            conns.pop(env).close()
        finally:
            for conn in conns.values():
                conn.close()

    def stop(self) -> None:
        self.stopped.set()
        self.join(10)


class Daemon:
    """A nodemgr process serving from its own run directory; it dies with the test run, and
    grants the test process holds on it are kept alive (Keeper)."""

    def __init__(
        self,
        root: Path,
        sections: dict[str, dict[str, Any]] | None = None,
        nofile: int | tuple[int, int] | None = None,
        **node: Any,
    ) -> None:
        self.root = root
        # Its descriptor limit (soft and hard, or both), if not the test run's.
        self.nofile = (nofile, nofile) if isinstance(nofile, int) else nofile
        root.mkdir(parents=True, exist_ok=True)
        self.run_dir = root / "run"
        self.state_dir = root / "state"
        self.config = root / "nodemgr.toml"
        settings = {"heartbeat_interval": 0.2, "heartbeat_timeout": 1.0, **node}
        tables: dict[str, dict[str, Any]] = {
            "node": {"run_dir": str(self.run_dir), "state_dir": str(self.state_dir), **settings},
            "gpus": {"source": "simulated", "simulated_count": 4, "simulated_memory": "16GiB"},
        }
        for name, table in (sections or {}).items():
            tables[name] = {**tables.get(name, {}), **table}
        lines = []
        for name, table in tables.items():
            lines.append(f"[{name}]")
            lines += [f"{k} = {_toml(v)}" for k, v in table.items() if not isinstance(v, dict)]
            for k, sub in table.items():
                if isinstance(sub, dict):
                    lines.append(f'[{name}."{k}"]')
                    lines += [f"{kk} = {_toml(vv)}" for kk, vv in sub.items()]
        self.config.write_text("\n".join(lines) + "\n")
        self.log = open(root / "nodemgr.log", "a")  # noqa: SIM115
        self.start()
        self.keeper = Keeper(self, float(settings["heartbeat_interval"]))

    def start(self) -> None:
        arm = die_with_test_run()
        nofile = self.nofile

        def prepare() -> None:
            arm()
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, nofile)

        self.proc = subprocess.Popen(
            [str(BIN / "nodemgr"), "serve", "--config", str(self.config)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            preexec_fn=prepare,
        )
        admin = f"ipc://{self.run_dir / 'admin.sock'}"
        if not wait_until_serving(admin, lambda: self.proc.poll() is None, 15):
            raise RuntimeError(f"nodemgr did not start: {self.logtext()}")

    def logtext(self) -> str:
        self.log.flush()
        return (self.root / "nodemgr.log").read_text()

    def admin(self, kind: str, timeout: float = 5.0, **fields: Any) -> dict[str, Any]:
        with Connection(
            f"ipc://{self.run_dir / 'admin.sock'}",
            timeout=timeout,
            max_reply=MAX_ADMIN_REPLY_BYTES,
        ) as conn:
            return conn.call(kind, **fields)

    def env(self, name: str, gpus: int = 1, memory: int = 1 << 30, force: bool = False) -> str:
        """Create an environment; return its task endpoint. ``force``: even with a quota no
        GPU of the node could serve."""
        reply = self.admin("quota_set", env=name, gpus=gpus, memory=memory, force=force)
        return str(reply["endpoint"])

    def tasks(self) -> list[dict[str, Any]]:
        return list(self.admin("tasks")["tasks"])

    def gpu_used(self, index: int) -> int:
        return int(self.admin("status")["gpus"][index]["used"])

    def kill(self) -> None:
        """SIGKILL, as a crash would: no clean-up runs."""
        self.proc.kill()
        self.proc.wait(30)

    def stop(self) -> None:
        self.keeper.stop()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        if not self.log.closed:
            self.log.close()


@pytest.fixture
def daemon_factory() -> Iterator[Any]:
    made: list[Daemon] = []
    # ipc paths must fit in sun_path (108 bytes): keep run directories short.
    root = Path(tempfile.mkdtemp(prefix="gs-", dir="/tmp"))

    def make(
        sections: dict[str, dict[str, Any]] | None = None,
        nofile: int | tuple[int, int] | None = None,
        **node: Any,
    ) -> Daemon:
        d = Daemon(root / str(len(made)) if made else root, sections, nofile, **node)
        made.append(d)
        return d

    yield make
    for d in made:
        d.stop()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def daemon(daemon_factory: Any) -> Daemon:
    d: Daemon = daemon_factory()
    return d


@pytest.fixture
def node(daemon_factory: Any) -> Daemon:
    """Two GPUs taking one task each across environments: easy to fill, one GPU or both."""
    d: Daemon = daemon_factory(
        {"scheduler": {"task_threshold": 1}, "gpus": {"simulated_count": 2}},
        heartbeat_timeout=600.0,
    )
    return d


def invoke(daemon: Daemon, *args: str) -> Any:
    """``nodemgr ARGS --config`` the daemon's config, through click's CliRunner."""
    from click.testing import CliRunner

    from nodemgr.cli import cli

    return CliRunner().invoke(cli, [*args, "--config", str(daemon.config)])


@pytest.fixture
def open_dir() -> Iterator[Callable[[int], Path]]:
    """``open_dir(mode)``: a new directory of this process's user, outside the test's
    tmp_path (which other users cannot reach), with ``mode`` (0o755: others may read it,
    0o711: pass through it); removed afterwards."""
    made: list[Path] = []

    def make(mode: int) -> Path:
        path = Path(tempfile.mkdtemp(prefix="gs-open-"))
        made.append(path)
        os.chmod(path, mode)
        return path

    yield make
    for path in made:
        shutil.rmtree(path, ignore_errors=True)


def _gpushare_run(
    endpoint: str,
    *cmd: str,
    gpus: int = 1,
    env: dict[str, str] | None = None,
    opts: Sequence[str] = (),
    **popen: Any,
) -> subprocess.Popen[str]:
    extra = dict(env or {})
    if SANITIZER_PRELOAD:
        # gpushare-run puts the shim first and keeps what LD_PRELOAD already held.
        extra["LD_PRELOAD"] = " ".join([*SANITIZER_PRELOAD, extra.get("LD_PRELOAD", "")])
    return subprocess.Popen(
        [
            str(BIN / "gpushare-run"),
            "--endpoint",
            endpoint,
            "--gpus",
            str(gpus),
            *opts,
            "--",
            *cmd,
        ],
        env={**os.environ, **extra},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # so teardown can end the whole tree
        **popen,
    )


def _wait_for(predicate: Any, timeout: float, interval: float = 0.01) -> float:
    """Poll until predicate() is true; return the seconds it took, fail after timeout."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)
    return time.monotonic() - start


def kill_session(sid: int) -> None:
    """SIGKILL every process of session ``sid``, whatever its process group."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        if procfs.stat_ints(int(entry), 3) == (sid,):  # its session
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry), signal.SIGKILL)


@pytest.fixture
def run_task() -> Iterator[Any]:
    """Start ``gpushare-run --endpoint E --gpus N -- CMD...`` as a real child process.

    Whatever a test leaves running is killed and its pipes closed afterwards: the whole
    session, since CMD runs in a process group of its own, and its children (a DataLoader's
    workers, a spawned child) may outlive it holding the pipes.
    """
    started: list[subprocess.Popen[str]] = []

    def start(*args: Any, **kwargs: Any) -> subprocess.Popen[str]:
        p = _gpushare_run(*args, **kwargs)
        started.append(p)
        return p

    yield start
    for p in started:
        kill_session(p.pid)
        p.communicate(timeout=30)


class Holder:
    """Tasks of one GPU each (``count`` of them, 1 by default) held until close() by a child
    process (tests/fixtures/grant_holder.py) that heartbeats: nodemgr's reclaim of a silent
    task can never hit the test process."""

    def __init__(self, endpoint: str, count: int = 1) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__).parent / "fixtures" / "grant_holder.py"),
                endpoint,
                str(count),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=die_with_test_run(),
        )
        assert self.proc.stdout is not None
        self.task_ids: list[str] = []
        for _ in range(count):
            grant = json.loads(self.proc.stdout.readline() or "{}")
            if "task_id" not in grant:
                self.proc.communicate(timeout=15)
                raise AssertionError(f"the holder got no grant: {grant}")
            self.task_ids.append(str(grant["task_id"]))
        self.task_id = self.task_ids[0]
        self.pid = self.proc.pid

    def close(self) -> None:
        """Say done and wait for it; the task is gone from nodemgr on return."""
        self.proc.communicate(timeout=15)
        assert self.proc.returncode == 0, f"the holder failed: {self.proc.returncode}"


@pytest.fixture
def wait_for() -> Any:
    return _wait_for


def let_finish(p: subprocess.Popen[str], go: Path, daemon: Daemon) -> None:
    """Create the file a cuda_client ``waitfile`` step waits for: the task exits 0 and
    nodemgr forgets it within 5 s."""
    go.touch()
    assert p.wait(30) == 0
    _wait_for(lambda: daemon.tasks() == [], 5)


# --- time slicing --------------------------------------------------------------------------


def turns_changed(spans: list[tuple[float, float, str]]) -> int:
    """How often the GPU changed hands among jobs' steps, each span (start, end, job) the
    time a job computed in one step; fails if two jobs' steps overlap."""
    spans = sorted(spans)
    for (_, end, who), (start, _, other) in itertools.pairwise(spans):
        if who != other:
            assert start >= end, f"{other} ran while {who} still held the GPU"
    return sum(1 for x, y in itertools.pairwise(spans) if x[2] != y[2])


# --- protocol ------------------------------------------------------------------------------


def accepts(
    check: Callable[[Any], object],
    value: Any,
    refusal: type[Exception] | tuple[type[Exception], ...] = ValueError,
) -> bool:
    """Whether a protocol field's validator takes ``value``; it refuses by raising
    ``refusal``."""
    try:
        check(value)
    except refusal:
        return False
    return True
