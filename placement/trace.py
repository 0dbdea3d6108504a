"""Reading a cluster and its tasks from CSV: the Alibaba GPU v2023 trace's columns
(docs/placement.md, "Trace files"). The one module that reads files."""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TypeVar

from placement.cluster import LS, Node, PlacementError, Pod, parse_spec

NODE_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
POD_COLUMNS = ("name", "cpu_milli", "num_gpu", "gpu_milli")
# Read when present: memory (0 without), accepted GPU models (any), class (LS), the
# times of a time-based replay (created at 0, never deleted), and seed 003's priority (0)
# and constraints (none; groups separated by "|", as GPU models are).
POD_OPTIONAL = (
    "memory_mib",
    "gpu_spec",
    "qos",
    "creation_time",
    "deletion_time",
    "priority",
    "group",
    "together",
    "apart",
    "near",
)

T = TypeVar("T")


class TraceError(PlacementError):
    """A trace file that cannot be read: the message names the file, line and column."""


def _rows(path: Path, required: tuple[str, ...]) -> Iterator[tuple[int, Mapping[str, str]]]:
    try:
        f = path.open(newline="", encoding="utf-8")
    except OSError as e:
        raise TraceError(f"cannot read {path}: {e.strerror or e}") from None
    with f:
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        missing = [c for c in required if c not in header]
        if missing:
            raise TraceError(
                f"{path}: no column {', '.join(missing)} (the header has: {', '.join(header)})"
            )
        for row in reader:
            yield reader.line_num, row


def _field(
    path: Path, line: int, row: Mapping[str, str], column: str, parse: Callable[[str], T]
) -> T:
    text = (row.get(column) or "").strip()
    try:
        return parse(text)
    except ValueError:
        raise TraceError(f"{path}:{line}: {column} {text!r} is not valid") from None


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise ValueError(text)
    return value


def _records(
    path: Path, required: tuple[str, ...], what: str, build: Callable[[int, Mapping[str, str]], T]
) -> list[T]:
    """One record per row, as ``build(line, row)`` makes it; a record that cannot be is
    the file's error at that line."""
    out = []
    for line, row in _rows(path, required):
        try:
            out.append(build(line, row))
        except TraceError:
            raise
        except PlacementError as e:
            raise TraceError(f"{path}:{line}: {e}") from None
    if not out:
        raise TraceError(f"{path}: no {what}")
    return out


def read_nodes(path: Path) -> list[Node]:
    """The nodes of a node list (columns sn, cpu_milli, memory_mib, gpu, model)."""

    def node(line: int, row: Mapping[str, str]) -> Node:
        return Node(
            name=_field(path, line, row, "sn", str),
            cpu=_field(path, line, row, "cpu_milli", _count),
            memory=_field(path, line, row, "memory_mib", _count),
            gpus=_field(path, line, row, "gpu", _count),
            model=_field(path, line, row, "model", str),
        )

    return _records(path, NODE_COLUMNS, "nodes", node)


def read_pods(path: Path) -> list[Pod]:
    """The tasks of a pod list, in file order."""

    def pod(line: int, row: Mapping[str, str]) -> Pod:
        deleted = (row.get("deletion_time") or "").strip()
        return Pod(
            name=_field(path, line, row, "name", str),
            cpu=_field(path, line, row, "cpu_milli", _count),
            memory=_field(path, line, row, "memory_mib", lambda t: _count(t or "0")),
            num_gpu=_field(path, line, row, "num_gpu", _count),
            gpu_milli=_field(path, line, row, "gpu_milli", _count),
            spec=parse_spec(row.get("gpu_spec") or ""),
            qos=(row.get("qos") or "").strip() or LS,
            created=_field(path, line, row, "creation_time", lambda t: _seconds(t or "0")),
            deleted=_field(path, line, row, "deletion_time", _seconds) if deleted else None,
            priority=_field(path, line, row, "priority", lambda t: int(t or "0")),
            group=(row.get("group") or "").strip(),
            together=parse_spec(row.get("together") or ""),
            apart=parse_spec(row.get("apart") or ""),
            near=parse_spec(row.get("near") or ""),
        )

    return _records(path, POD_COLUMNS, "pods", pod)
