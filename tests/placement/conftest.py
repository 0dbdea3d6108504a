"""What the placement tests share: small clusters built by hand, and the public trace."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from placement.cluster import Node, Pod

ROOT = Path(__file__).resolve().parent.parent.parent
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # last, as the benchmarks do: installed gpushare wins
from benchmarks.cluster_bench import TRACES_ENV, traces_dir  # noqa: E402


def traces() -> Path:
    return traces_dir() / "alibaba-gpu-v2023"


@pytest.fixture
def trace() -> Path:
    """The Alibaba GPU v2023 trace's folder; the test is skipped, saying why, without it."""
    folder = traces()
    if not (folder / "openb_node_list_gpu_node.csv").is_file():
        pytest.skip(f"no Alibaba GPU v2023 trace at {folder} (set {TRACES_ENV})")
    return folder


def nodes(*shapes: tuple[int, int, int, str]) -> list[Node]:
    """Nodes n0, n1, ... of (cpu, memory, gpus, model)."""
    return [
        Node(f"n{i}", cpu, mem, gpus, model) for i, (cpu, mem, gpus, model) in enumerate(shapes)
    ]


def pod(
    name: str = "p",
    cpu: int = 1000,
    gpus: int = 1,
    milli: int = 1000,
    memory: int = 0,
    spec: Sequence[str] = (),
    qos: str = "LS",
) -> Pod:
    return Pod(name, cpu, memory, gpus, milli if gpus else 0, tuple(spec), qos)
