"""GPU truth: the shim against the real driver, PyTorch's allocators, NVML and nvidia-smi.

Every test here is marked ``gpu``: conftest skips them where NVML finds no NVIDIA
driver. nodemgr runs on the node's real GPUs (``gpus.source = "nvml"``) and the task
scripts run under gpushare-run with the shim preloaded. The scripts need PyTorch with
CUDA, in this Python or in ``$GPUSHARE_TORCH_PYTHON`` or ``python3`` on PATH (a
``make test`` venv usually lacks it); without one the torch tests are skipped.

A script reports its state by writing small files into a directory it is given and
waits for files the test writes there, so the test never blocks on a pipe.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import pytest

from tests.conftest import turns_changed

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # last, as the benchmarks do: installed gpushare wins
from benchmarks import harness  # noqa: E402 (the GPU choice and install check, shared)

pytestmark = pytest.mark.gpu

MiB = 1 << 20
GiB = 1 << 30
QUOTA = 8 * GiB  # the environment's per-GPU memory quota in every test
# gpus.context_memory in every test, set rather than left to the default: what the shim
# charges for each process's CUDA context, which NVML counts at its real size.
CONTEXT_CHARGE = 512 * MiB
STEP = 120.0  # seconds a script may take for one step (importing torch, starting CUDA)

# Run first in every script: argv is [-c, ALLOC_CONF, STATE_DIR, ...]. The allocator
# settings are fixed before torch is imported; PYTORCH_ALLOC_CONF, the newer name that
# takes precedence where it exists, is removed so that PYTORCH_CUDA_ALLOC_CONF decides.
PRELUDE = textwrap.dedent(
    """\
    import os, sys, time
    conf, state = sys.argv[1], sys.argv[2]
    os.environ.pop("PYTORCH_ALLOC_CONF", None)
    if conf:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = conf
    else:
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    import torch
    GiB = 1 << 30
    MiB = 1 << 20

    def say(name, text):
        tmp = os.path.join(state, name + ".tmp")
        with open(tmp, "w") as f:
            f.write(str(text))
        os.replace(tmp, os.path.join(state, name))

    def wait(name):
        while not os.path.exists(os.path.join(state, name)):
            time.sleep(0.02)

    def alloc(nbytes):
        return torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    """
)

OOM_SCRIPT = PRELUDE + textwrap.dedent(
    """\
    quota = int(sys.argv[3])
    x = alloc(quota // 2)
    print("under ok", flush=True)
    try:
        y = alloc(quota // 2 + GiB)
        print("over allocated", flush=True)
        del y
    except torch.cuda.OutOfMemoryError:
        print("over oom", flush=True)
    del x
    torch.cuda.empty_cache()
    y = alloc(quota // 2 + GiB)
    print("again ok", flush=True)
    """
)

MEMINFO_SCRIPT = PRELUDE + textwrap.dedent(
    """\
    x = alloc(GiB)
    free0, total0 = torch.cuda.mem_get_info()
    held0 = torch.cuda.memory_reserved()
    y = alloc(GiB)
    free1, total1 = torch.cuda.mem_get_info()
    held1 = torch.cuda.memory_reserved()
    print(free0, total0, held0, free1, total1, held1, flush=True)
    """
)

# Holds 2 GiB in 256 MiB tensors until told to go on, then asks for a whole quota more.
BACKEND_SCRIPT = PRELUDE + textwrap.dedent(
    """\
    quota = int(sys.argv[3])
    held = [alloc(256 * MiB) for _ in range(8)]
    torch.cuda.synchronize()
    say("held", torch.cuda.get_allocator_backend())
    wait("go")
    try:
        extra = alloc(quota)
        torch.cuda.synchronize()
        print("allocated", flush=True)
    except torch.cuda.OutOfMemoryError:
        print("oom", flush=True)
    """
)

# Starts CUDA and reports; then (told "go") holds 4 x 1 GiB and reports again.
PROCESS_SCRIPT = PRELUDE + textwrap.dedent(
    """\
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    say("ready", f"{os.getpid()} {torch.cuda.memory_reserved()}")
    wait("go")
    held = [alloc(GiB) for _ in range(4)]
    torch.cuda.synchronize()
    say("held", torch.cuda.memory_reserved())
    wait("stop")
    """
)

# Makes its CUDA context with an allocation (no kernel: no module loaded yet) and reports;
# then (told "go") runs its first kernel and reports again; ends when told "stop".
CONTEXT_SCRIPT = PRELUDE + textwrap.dedent(
    """\
    torch.cuda.init()
    x = torch.empty(1, device="cuda")
    say("ready", f"{os.getpid()} {torch.cuda.memory_reserved()}")
    wait("go")
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    say("kernel", torch.cuda.memory_reserved())
    wait("stop")
    """
)


# --- fixtures and helpers -----------------------------------------------------------------


@pytest.fixture(scope="module")
def torch_python() -> str:
    """A Python that imports torch with CUDA: this one, $GPUSHARE_TORCH_PYTHON or python3."""
    check = "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)"
    tried = []
    candidates = [os.environ.get("GPUSHARE_TORCH_PYTHON"), sys.executable, shutil.which("python3")]
    for py in dict.fromkeys(c for c in candidates if c):
        try:
            r = subprocess.run([py, "-c", check], capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            tried.append(f"{py}: {e}")
            continue
        if r.returncode == 0:
            return py
        last = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
        tried.append(f"{py}: {'CUDA not available' if r.returncode == 3 else last}")
    pytest.skip(f"no Python with torch and CUDA (set GPUSHARE_TORCH_PYTHON); tried {tried}")


@pytest.fixture
def nvml() -> Iterator[Any]:
    import pynvml

    pynvml.nvmlInit()
    yield pynvml
    pynvml.nvmlShutdown()


@pytest.fixture
def endpoint(daemon_factory: Any) -> tuple[Any, str]:
    """nodemgr on the node's real GPUs and an environment with a QUOTA per GPU."""
    daemon = daemon_factory(sections={"gpus": {"source": "nvml", "context_memory": CONTEXT_CHARGE}})
    return daemon, daemon.env("gputest", gpus=1, memory=QUOTA)


def _failed(p: subprocess.Popen[str], why: str) -> NoReturn:
    """Fail the test with ``why`` and whatever the task printed (killing it first)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)  # gpushare-run and its command: a session of theirs
    out, err = p.communicate(timeout=30)
    pytest.fail(f"{why} (exit {p.returncode})\nstdout:\n{out}\nstderr:\n{err}")


def await_state(p: subprocess.Popen[str], state: Path, name: str) -> str:
    """The text the task's script wrote as ``name``; fails if it dies or takes too long."""
    deadline = time.monotonic() + STEP
    path = state / name
    while not path.exists():
        if p.poll() is not None:
            _failed(p, f"the task ended before reporting {name!r}")
        if time.monotonic() > deadline:
            _failed(p, f"no {name!r} from the task within {STEP:.0f}s")
        time.sleep(0.05)
    return path.read_text()


def finish(p: subprocess.Popen[str]) -> list[str]:
    """Wait for the task to end successfully; return its stdout lines."""
    try:
        out, err = p.communicate(timeout=STEP)
    except subprocess.TimeoutExpired:
        _failed(p, f"the task did not end within {STEP:.0f}s")
    if p.returncode != 0:
        pytest.fail(f"the task failed (exit {p.returncode})\nstdout:\n{out}\nstderr:\n{err}")
    return [ln for ln in out.splitlines() if ln]


def start_script(
    run_task: Any,
    ep: str,
    py: str,
    script: str,
    state: Path,
    *args: str,
    conf: str = "",
    env: dict[str, str] | None = None,
) -> subprocess.Popen[str]:
    state.mkdir(exist_ok=True)
    p: subprocess.Popen[str] = run_task(ep, py, "-c", script, conf, str(state), *args, env=env)
    return p


def process_used(pynvml: Any, index: int, pid: int) -> int:
    """NVML's figure of the device memory process ``pid`` uses on GPU ``index``.

    NVML names processes by their pid in the host's pid namespace; when the tests run
    in a container of their own that pid is not ``pid``, and the GPU's only compute
    process is taken instead (the task's, as nothing else here starts CUDA).
    """
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    mine = [p for p in procs if p.pid == pid]
    if not mine and len(procs) == 1:
        print(f"NVML lists pid {procs[0].pid}, not {pid}: another pid namespace; taking it")
        mine = procs
    if not mine:
        listed = [(p.pid, p.usedGpuMemory) for p in procs]
        pytest.fail(f"pid {pid} is not among NVML's compute processes on GPU {index}: {listed}")
    used = mine[0].usedGpuMemory
    if used is None:
        pytest.skip("NVML does not report per-process memory on this node")
    return int(used)


def trace_calls(trace: Path) -> dict[str, int]:
    """Calls per hook from a GPUSHARE_TRACE file (``pid=P hook=NAME calls=N ...`` lines)."""
    calls: dict[str, int] = {}
    text = trace.read_text() if trace.exists() else ""
    for line in text.splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if "hook" in fields:
            calls[fields["hook"]] = calls.get(fields["hook"], 0) + int(fields.get("calls", 0))
    return calls


# --- tests ---------------------------------------------------------------------------------


def test_allocation_beyond_the_quota_raises_torch_oom(
    endpoint: tuple[Any, str], run_task: Any, torch_python: str, tmp_path: Path
) -> None:
    """Half the quota fits; another half and a GiB does not (OutOfMemoryError); once the
    first half is freed and the cache emptied, the same request fits."""
    _, ep = endpoint
    p = start_script(run_task, ep, torch_python, OOM_SCRIPT, tmp_path / "s", str(QUOTA))
    assert finish(p) == ["under ok", "over oom", "again ok"]


def test_mem_get_info_reports_the_share(
    endpoint: tuple[Any, str], run_task: Any, torch_python: str, tmp_path: Path
) -> None:
    """torch.cuda.mem_get_info(): total is the quota; free leaves out what the process holds
    and drops by exactly what it allocates."""
    _, ep = endpoint
    p = start_script(run_task, ep, torch_python, MEMINFO_SCRIPT, tmp_path / "s")
    [line] = finish(p)
    free0, total0, held0, free1, total1, held1 = map(int, line.split())
    print(
        f"mem_get_info: total {total0} free {free0} (holding {held0}) -> free {free1} "
        f"(holding {held1}); quota {QUOTA}"
    )
    assert total0 == total1 == QUOTA
    assert held0 >= GiB and held1 >= 2 * GiB
    assert 0 < free0 <= QUOTA - held0
    assert 0 < free1 <= QUOTA - held1
    assert abs((free0 - free1) - GiB) <= 16 * MiB


# The driver entry points each allocator backend must reach (GPUSHARE_TRACE hook names).
BACKENDS = {
    "caching": ("", "native", {"cuMemAlloc_v2"}),
    "expandable": ("expandable_segments:True", "native", {"cuMemCreate"}),
    "async": (
        "backend:cudaMallocAsync",
        "cudaMallocAsync",
        {
            "cuMemAllocAsync",
            "cuMemAllocAsync_ptsz",
            "cuMemAllocFromPoolAsync",
            "cuMemAllocFromPoolAsync_ptsz",
        },
    ),
}


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_every_allocator_backend_is_charged_and_limited(
    endpoint: tuple[Any, str], run_task: Any, torch_python: str, tmp_path: Path, backend: str
) -> None:
    """2 GiB of tensors show in nodemgr's tasks while held, through the backend's own driver
    calls, and asking for a whole quota more raises OutOfMemoryError."""
    daemon, ep = endpoint
    conf, expect_backend, hooks = BACKENDS[backend]
    state, trace = tmp_path / "s", tmp_path / "trace"
    p = start_script(
        run_task,
        ep,
        torch_python,
        BACKEND_SCRIPT,
        state,
        str(QUOTA),
        conf=conf,
        env={"GPUSHARE_TRACE": str(trace)},
    )
    assert await_state(p, state, "held") == expect_backend
    [task] = daemon.tasks()
    print(f"{backend}: nodemgr charges {task['memory_used']} bytes for 2 GiB of tensors")
    assert 2 * GiB <= task["memory_used"] <= QUOTA
    (state / "go").touch()
    assert finish(p) == ["oom"]
    calls = trace_calls(trace)
    assert sum(calls.get(h, 0) for h in hooks) > 0, f"none of {sorted(hooks)} in trace {calls}"


@dataclass(frozen=True)
class Readings:
    """One task process's memory, read twice: after CUDA start-up and one tensor (0), and
    holding 4 GiB more (1): torch's reserved bytes, nodemgr's charge for the task (the
    shim's figure) and NVML's per-process figure."""

    reserved0: int
    shim0: int
    nvml0: int
    reserved1: int
    shim1: int
    nvml1: int

    @property
    def context(self) -> int:
        """What NVML counts beyond torch's allocator after start-up: the process's context
        (with what the driver loaded into it), measured."""
        return self.nvml0 - self.reserved0


def check_against_nvml(r: Readings, charge: int) -> None:
    """The shim's total for a process against NVML's, the context allowed for.

    What this assumes:

    - NVML counts a process's context at its real size, measured as ``Readings.context``;
      the shim charges ``charge`` (gpus.context_memory) for it instead, once per process;
    - the shim charges every allocation the driver makes for torch's allocator (and any
      other it is asked for), as the driver makes it;
    - the context does not grow while the process only allocates: holding 4 GiB more
      loads no module and launches no kernel;
    - the driver's granularity and NVML's rounding stay within 2% of the 4 GiB.

    So the two totals differ by ``charge - context`` and by at most 2% of what the process
    allocated besides: the tolerance follows the measured context, whatever its size on
    this GPU, rather than a fixed guess of it."""
    grown_shim, grown_nvml = r.shim1 - r.shim0, r.nvml1 - r.nvml0
    assert grown_nvml > 3 * GiB, "NVML does not see the 4 GiB: is this the task's process?"
    assert abs(grown_shim - grown_nvml) <= 0.02 * grown_nvml, "the allocations' charge"
    expected = charge - r.context
    off = (r.shim1 - r.nvml1) - expected
    assert abs(off) <= 0.02 * grown_nvml, (
        f"the shim's total is off NVML's by {(r.shim1 - r.nvml1) / MiB:.1f} MiB where the "
        f"context charge ({charge / MiB:.1f} MiB) and the measured context "
        f"({r.context / MiB:.1f} MiB) explain {expected / MiB:.1f} MiB"
    )


def read_against_nvml(
    run_task: Any,
    daemon: Any,
    ep: str,
    python: str,
    state: Path,
    process_used: Callable[[int, int], int],
    env: dict[str, str] | None = None,
) -> Readings:
    """PROCESS_SCRIPT as a task: its readings at start-up and holding 4 GiB more, NVML's
    per-process figure from ``process_used(nodemgr's GPU index, pid)``."""
    p = start_script(run_task, ep, python, PROCESS_SCRIPT, state, env=env)
    pid, reserved0 = map(int, await_state(p, state, "ready").split())
    [task] = daemon.tasks()
    gpu = task["gpus"][0]
    shim0, nvml0 = task["memory_used"], process_used(gpu, pid)
    (state / "go").touch()
    reserved1 = int(await_state(p, state, "held"))
    [task] = daemon.tasks()
    shim1, nvml1 = task["memory_used"], process_used(gpu, pid)
    (state / "stop").touch()
    finish(p)
    r = Readings(reserved0, shim0, nvml0, reserved1, shim1, nvml1)
    print(
        f"after CUDA init: shim {shim0 / MiB:.1f} MiB, NVML {nvml0 / MiB:.1f} MiB "
        f"(torch reserved {reserved0 / MiB:.1f} MiB; context {r.context / MiB:.1f} MiB, "
        f"the figure for gpus.context_memory)\n"
        f"holding 4 GiB:   shim {shim1 / MiB:.1f} MiB, NVML {nvml1 / MiB:.1f} MiB "
        f"(torch reserved {reserved1 / MiB:.1f} MiB)"
    )
    return r


def test_shim_total_agrees_with_nvml(
    endpoint: tuple[Any, str], run_task: Any, torch_python: str, tmp_path: Path, nvml: Any
) -> None:
    """The task's memory_used (allocations and context charge) agrees with NVML's
    per-process figure once the measured context is allowed for (check_against_nvml says
    what it assumes), and the 4 GiB held are charged as NVML sees them."""
    daemon, ep = endpoint
    r = read_against_nvml(
        run_task,
        daemon,
        ep,
        torch_python,
        tmp_path / "s",
        lambda gpu, pid: process_used(nvml, gpu, pid),
    )
    check_against_nvml(r, CONTEXT_CHARGE)


def test_nvidia_smi_in_a_task_shows_the_share(
    endpoint: tuple[Any, str], run_task: Any, nvml: Any
) -> None:
    """nvidia-smi run under the shim reports the quota as the granted GPU's total memory."""
    if shutil.which("nvidia-smi") is None:
        pytest.skip("nvidia-smi is not on PATH")
    _, ep = endpoint
    query = "nvidia-smi --query-gpu=uuid,memory.total,memory.used --format=csv,noheader,nounits"
    p = run_task(ep, "sh", "-c", f'echo "$CUDA_VISIBLE_DEVICES"; exec {query}')
    granted, *rows = finish(p)
    table = {}
    for row in rows:
        fields = [f.strip() for f in row.split(",")]
        if len(fields) == 3 and fields[0].startswith("GPU-"):
            table[fields[0]] = (fields[1], fields[2])
    assert granted in table, f"granted GPU {granted} not in nvidia-smi's output {rows}"
    total, used = (int(v) if v.isdigit() else -1 for v in table[granted])
    real = nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByUUID(granted)).total
    print(
        f"nvidia-smi in the task: total {total} MiB, used {used} MiB; the GPU has "
        f"{real // MiB} MiB; the quota is {QUOTA // MiB} MiB"
    )
    assert abs(total - QUOTA // MiB) <= 1
    assert used <= total  # -1 where nvidia-smi has no figure


def test_context_memory_measured(
    endpoint: tuple[Any, str], run_task: Any, torch_python: str, tmp_path: Path, nvml: Any
) -> None:
    """What one process's CUDA context costs on this GPU, by NVML: the figure for
    gpus.context_memory. Printed for a person to read; it must at least be positive."""
    daemon, ep = endpoint
    state = tmp_path / "s"
    p = start_script(run_task, ep, torch_python, PROCESS_SCRIPT, state)
    pid, reserved = map(int, await_state(p, state, "ready").split())
    [task] = daemon.tasks()
    used = process_used(nvml, task["gpus"][0], pid)
    charged = task["memory_used"]
    (state / "go").touch()
    (state / "stop").touch()
    finish(p)
    print(
        f"after torch.cuda.init() and one tensor: NVML per-process {used} bytes "
        f"({used / MiB:.1f} MiB), torch reserved {reserved / MiB:.1f} MiB, so the context "
        f"is about {(used - reserved) / MiB:.1f} MiB; the shim charged {charged / MiB:.1f} MiB"
    )
    assert used > 0
    assert used > reserved


def test_auto_context_memory_is_a_torch_processs_context(
    daemon_factory: Any, torch_python: str, tmp_path: Path, nvml: Any
) -> None:
    """gpus.context_memory = "auto" (the default): the figure nodemgr measured with its probe
    at start is within 4 MiB of what NVML shows a PyTorch process hold beyond its allocations
    once torch.cuda.init() and a first allocation have made its context. Measured on an
    H200, driver 580, torch 2.11: 518 MiB both; the first kernel then loads its module
    (lazy loading) and the process holds 610 MiB besides its allocations."""
    daemon = daemon_factory(sections={"gpus": {"source": "nvml"}})
    gpus = daemon.admin("status")["gpus"]
    assert {g["context_source"] for g in gpus} == {"measured"}, daemon.logtext()
    measured = gpus[0]["context"]
    state = tmp_path / "s"
    state.mkdir()
    # Outside any task, without the shim: the driver's figure alone.
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env["CUDA_VISIBLE_DEVICES"] = gpus[0]["uuid"]
    p = subprocess.Popen(
        [torch_python, "-c", CONTEXT_SCRIPT, "", str(state)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    pid, reserved = map(int, await_state(p, state, "ready").split())
    context = process_used(nvml, 0, pid) - reserved
    (state / "go").touch()
    after_kernel = process_used(nvml, 0, pid) - int(await_state(p, state, "kernel"))
    (state / "stop").touch()
    finish(p)
    print(
        f"nodemgr measured {measured / MiB:.1f} MiB; a torch process's context "
        f"{context / MiB:.1f} MiB, {after_kernel / MiB:.1f} MiB after its first kernel"
    )
    assert abs(measured - context) <= 4 * MiB


# Two of these share a time-sliced GPU: each step's span (first launch to the end of its
# work) and the shape nodemgr learned are what the test looks at. The model and its Adam
# state stay from step to step; the activations of the large batch do not.
TRAIN_SCRIPT = PRELUDE + textwrap.dedent(
    """\
    import json
    steps = int(sys.argv[3])
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(2048, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 2048)
    ).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(32768, 2048, device="cuda")
    for i in range(steps):
        t0 = time.monotonic()
        x.mul_(1.0)  # the first launch: waits here while the other task has the turn
        t1 = time.monotonic()
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        torch.cuda.synchronize()
        tb = time.monotonic()
        opt.step()
        print(json.dumps({"i": i, "t0": t0, "t1": t1, "tb": tb}), flush=True)
    """
)


def test_timesliced_training_loops_take_turns(
    daemon_factory: Any, run_task: Any, torch_python: str, tmp_path: Path
) -> None:
    """Two PyTorch training loops on a time-sliced GPU: the optimizer hook marks each
    step, the loops take turns of two steps (never computing at once), nodemgr learns
    each one's shape (what it keeps: weights, gradients, Adam state; what a step adds)
    and both run to the end.

    Assumes: the torch Python has gpushare installed (the hooks come from its start-up
    hook), asked of that Python itself and not of the source tree; one GPU of the node
    has a quota's worth free. On a node of several GPUs nodemgr would give the two loops
    two GPUs, so that one (harness.pick_gpu: the most free memory) is time-sliced alone
    and both loops are pinned to it (CUDA_VISIBLE_DEVICES, its UUID)."""
    if harness.installed_origin(torch_python) is None:
        pytest.skip(f"{torch_python} does not have gpushare installed (its hooks are needed)")
    gpu = harness.pick_gpu(harness.nvml_gpus(), need=QUOTA)
    if gpu is None:
        pytest.skip(f"no GPU has {QUOTA // GiB} GiB free")
    daemon = daemon_factory(
        sections={
            "gpus": {"source": "nvml"},
            "timeslice": {"gpus": [gpu.uuid], "quantum": 2, "turn_timeout": 60.0},
        },
        heartbeat_timeout=60.0,
    )
    shape = ("--persistent", "1GiB", "--temporary", "4GiB")
    procs = []
    for name in ("a", "b"):
        ep = daemon.env(name, gpus=1, memory=QUOTA)
        state = tmp_path / name
        state.mkdir()
        procs.append(
            run_task(
                ep,
                torch_python,
                "-c",
                TRAIN_SCRIPT,
                "",
                str(state),
                "12",
                opts=shape,
                env=harness.pinned(gpu),
            )
        )
    learned: dict[str, Any] = {}
    granted: set[int] = set()
    while any(p.poll() is None for p in procs):
        for t in daemon.tasks():
            granted |= set(t["gpus"])
            for reg in t.get("regions") or []:
                if t["iterations"] >= 3 and reg["settled"]:
                    learned[t["env"]] = reg
        time.sleep(0.1)
    spans = []
    for name, p in zip(("a", "b"), procs, strict=True):
        rows = [json.loads(line) for line in finish(p)]
        assert len(rows) == 12
        spans += [(r["t1"], r["tb"], name) for r in rows]
    assert granted == {gpu.index}, f"the loops ran on nodemgr's GPUs {granted}, not {gpu}"
    assert turns_changed(spans) >= 3
    params = sum(2048 * 2048 + 2048 for _ in range(2)) * 4
    for name in ("a", "b"):
        reg = learned[name]
        # Weights, their gradients and two Adam moments: four times the parameters, at least.
        assert reg["settled"] >= 4 * params, reg
        assert reg["temporary_peak"] >= 32768 * 2048 * 4, reg
