"""Time slicing with real PyTorch: two real training loops (torch_timeslice_case.py,
real ``torch.optim`` optimizers, the boundaries from gpushare's global optimizer step hook)
under real gpushare-run on one time-sliced simulated GPU of a real nodemgr, in each of
torch's allocator modes (native, expandable segments, cudaMallocAsync).

They take turns of a quantum of steps and their steps never overlap (their times are
``time.monotonic()``, one clock for every process); each release empties torch's cache, and
the shape nodemgr learns is what torch's allocator held: persistent, what was left after a
release (parameters, gradients, optimizer state, the batch, cuBLAS' workspaces, which torch
keeps in its allocator, and the memory cuBLAS' handles allocate themselves); temporary,
the most a step grew the allocator's reserve. A step captured in a CUDA graph ends an
iteration at each replay, not at its capture.
"""

from __future__ import annotations

import itertools
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import _wait_for, turns_changed
from tests.real_torch.test_torch_sim import MODES, torch_env, torch_python  # noqa: F401 (a fixture)

HERE = Path(__file__).resolve().parent
CASE = HERE / "torch_timeslice_case.py"
GIB = 1 << 30
MIB = 1 << 20
QUANTUM = 3
STEPS = 5 * QUANTUM  # five turns each; the last step of each yields
OPTIMIZERS = {"a": "SGD", "b": "Adam"}
WARMUP = 3  # torch_timeslice_case.py's eager steps before it captures one


def rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def spans(r: dict[str, list[dict[str, Any]]]) -> list[tuple[float, float, str]]:
    """The time each loop used the GPU in each step: from its first launch to the end of
    its release when the step ended its turn (the yield that follows waits for the other
    task), else to the end of ``optimizer.step()``."""
    return [(x["t1"], x.get("release_end", x["te"]), n) for n in r for x in r[n]]


def runs(order: list[str]) -> list[tuple[str, int]]:
    """The turns in a sequence of steps: (job, steps in a row)."""
    return [(job, len(list(group))) for job, group in itertools.groupby(order)]


@dataclass
class Run:
    """Two loops run to their end: their step rows, and nodemgr's view after their last steps."""

    rows: dict[str, list[dict[str, Any]]]
    captured: dict[str, int]  # graph style: boundaries counted when the capture ended
    tasks: dict[str, dict[str, Any]]  # by environment
    turn: dict[str, Any]  # status' view of the GPU's turn


def run_loops(
    daemon_factory: Any, run_task: Any, python: str, tmp_path: Path, mode: str, style: str
) -> Run:
    d = daemon_factory(
        {
            "gpus": {"simulated_count": 1, "simulated_memory": "16GiB"},
            "scheduler": {"memory_reserve": "0"},
            "timeslice": {"gpus": "all", "quantum": QUANTUM, "turn_timeout": 30.0},
        },
        heartbeat_timeout=30.0,
    )
    go = tmp_path / "go"
    outs = {n: tmp_path / f"{n}.jsonl" for n in OPTIMIZERS}
    env = {"PYTORCH_CUDA_ALLOC_CONF": MODES[mode] or ""}
    procs = {
        n: run_task(
            d.env(n, 1, 2 * GIB),
            python,
            str(CASE),
            n,
            opt,
            str(STEPS),
            str(outs[n]),
            str(go),
            style,
            env=env,
            stdin=subprocess.PIPE,
        )
        for n, opt in OPTIMIZERS.items()
    }
    # Both on the GPU (so gated from their first step) before either touches it.
    ready = [Path(f"{go}.{n}.ready") for n in OPTIMIZERS]
    _wait_for(lambda: len(d.tasks()) == 2 and all(r.exists() for r in ready), 120)
    go.touch()
    for p in procs.values():
        assert p.stdout is not None
        line = p.stdout.readline()
        if line.strip() != "done":
            assert p.stderr is not None
            p.kill()
            raise AssertionError(f"a loop did not finish: {line!r} {p.stderr.read()[-4000:]}")
    tasks = {t["env"]: t for t in d.tasks()}
    turn = d.admin("status")["gpus"][0]["turn"]
    for p in procs.values():
        assert p.stdin is not None
        p.stdin.write("\n")
        p.stdin.flush()
    for p in procs.values():
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
    lines = {n: rows(outs[n]) for n in outs}
    captured = {n: x["captured"] for n in lines for x in lines[n] if "captured" in x}
    steps = {n: [x for x in lines[n] if "captured" not in x] for n in lines}
    return Run(steps, captured, tasks, turn)


def check_turns(run: Run) -> None:
    """Both loops finished; their steps never overlapped; they took turns of exactly a
    quantum of steps, alternating, and nodemgr handed the turn on after each (the last one
    back to the task that finished first); each released at its first boundary (to learn its
    shape) and at the end of each turn, and in no other step."""
    r = run.rows
    assert all([x["i"] for x in r[n]] == list(range(STEPS)) for n in r)
    order = sorted(spans(r))
    assert turns_changed(order) == 2 * STEPS // QUANTUM - 1, order  # fails on any overlap
    assert runs([job for _, _, job in order]) == [
        (job, QUANTUM) for _ in range(STEPS // QUANTUM) for job in (order[0][2], order[-1][2])
    ]
    assert run.turn["switches"] == 2 * STEPS // QUANTUM
    for n, steps in r.items():
        released = [x["i"] for x in steps if "release_end" in x]
        assert released == [0, *range(QUANTUM - 1, STEPS, QUANTUM)], (n, released)


@pytest.mark.parametrize("mode", ["native", "expandable", "async"])
def test_two_real_training_loops_take_turns(
    daemon_factory: Any,
    run_task: Any,
    torch_python: str,  # noqa: F811 (the fixture imported above)
    tmp_path: Path,
    mode: str,
) -> None:
    """Two real training loops (SGD with momentum, Adam) on one time-sliced GPU take turns
    (check_turns); each release empties torch's cache and leaves only what the process
    keeps, which the shim then counts as persistent; in other steps the cache is kept; and
    the shape nodemgr learned is what torch's allocator (and the libraries under it) held:
    persistent = what the device held after the last release, temporary = the most one step
    grew the allocator's reserve."""
    run = run_loops(daemon_factory, run_task, torch_python, tmp_path, mode, "eager")
    check_turns(run)
    for n, steps in run.rows.items():
        for x in steps:
            # What torch's allocator reserves, plus what cuBLAS allocated itself at set-up
            # (its handles), is what the task holds, step after step.
            assert x["held"] - x["reserved"] == steps[0]["held"] - steps[0]["reserved"], x
            assert x["shim"]["used"] == x["held"], x
            if "release_end" in x:
                assert x["emptied"] == x["reserved"] < x["peak"], x  # the cache emptied
            else:
                assert x["reserved"] == x["peak"], x  # nothing given back
            # A boundary makes all the process holds persistent.
            assert x["shim"]["persistent"] == x["held"], x
        [region] = run.tasks[n]["regions"]
        last = next(x for x in reversed(steps) if "release_end" in x)
        assert region["settled"] == last["held"], (n, region, last)
        # Temporary: the most a step (after the first, set-up) grew torch's reserve.
        growth = max(x["peak"] - before["reserved"] for before, x in itertools.pairwise(steps))
        assert region["temporary_peak"] == growth, (n, region)
        assert growth >= 64 * MIB  # a step's activations and gradients, at least


def test_steps_captured_in_a_cuda_graph_take_turns(
    daemon_factory: Any,
    run_task: Any,
    torch_python: str,  # noqa: F811 (the fixture imported above)
    tmp_path: Path,
) -> None:
    """Loops that capture a whole training step in a CUDA graph after a few eager steps, as
    PyTorch's documentation shows, and replay it: the optimizer step captured is no boundary
    (nothing ran; a release there would synchronise inside the capture), each replay of it
    is one, so the replays take turns like eager steps."""
    run = run_loops(daemon_factory, run_task, torch_python, tmp_path, "native", "graph")
    assert run.captured == dict.fromkeys(OPTIMIZERS, WARMUP)
    check_turns(run)


RELEASE = """
import sys
import torch
from gpushare import iterations

held = [torch.ones(1 << 20, device=f"cuda:{d}") for d in map(int, sys.argv[1].split(","))]
torch.cuda.set_device(0)
held.clear()  # cached by torch, reserved still
torch.cuda.mem_get_info()  # marks the trace: the release starts
iterations._torch_release(torch)
torch.cuda.mem_get_info()  # and ends
print(torch.cuda.memory_reserved(0), torch.cuda.memory_reserved(1))
"""


@pytest.mark.parametrize(("devices", "synced"), [("0", 1), ("1", 2), ("0,1", 2)])
def test_a_release_waits_for_every_gpu_the_process_holds_memory_on(
    torch_python: str,  # noqa: F811 (the fixture imported above)
    tmp_path: Path,
    devices: str,
    synced: int,
) -> None:
    """A turn ends once the task's work is done on each GPU it holds memory on, so the
    release synchronises each of them (and the current one), then empties the cache; a GPU
    the process never used gets no synchronisation, which would make a context there."""
    trace = tmp_path / "trace"
    env = torch_env(None) | {"GPUSHARE_SIM_TRACE": str(trace)}
    p = subprocess.run(
        [torch_python, "-c", RELEASE, devices],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    assert p.stdout.split() == ["0", "0"]  # the cache emptied on both
    calls = [line.split()[2] for line in trace.read_text().splitlines()]
    marks = [i for i, c in enumerate(calls) if c.startswith("cuMemGetInfo")]
    during = calls[marks[-2] : marks[-1]]
    assert sum(c.startswith("cuCtxSynchronize") for c in during) == synced, during
    assert not any(c.startswith("cuDevicePrimaryCtxRetain") for c in during), during
