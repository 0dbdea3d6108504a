"""``gpushare-run --status``: the node as this environment may see it, asked of nodemgr on
the environment's own task endpoint (docs/protocol.md, ``view``): who holds each GPU, by
environment, and the wait queue, this environment's requests in full."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from gpushare.client import FIRST_ANSWER, Connection
from gpushare.messages import View
from gpushare.sizes import format_clock, format_size, plural


def fetch(endpoint: str) -> dict[str, Any]:
    """The ``view`` reply's fields; raises Unreachable or NodeError."""
    with Connection(endpoint, timeout=FIRST_ANSWER) as conn:
        return conn.send(View()).wire()


def _gpu_lines(gpu: Mapping[str, Any], me: str) -> list[str]:
    flags = [str(gpu["mode"])]
    if gpu.get("drained"):
        flags.append("drained: no new tasks")
    if gpu.get("lost"):
        flags.append("lost")
    lines = [
        f"GPU {gpu['index']}  {gpu['name']}  {format_size(int(gpu['memory']))}  "
        f"{', '.join(flags)}  promised {format_size(int(gpu['charged']))} of "
        f"{format_size(int(gpu['capacity']))}"
    ]
    holders = gpu.get("holders") or []
    if not holders:
        lines.append("  free")
    width = max((len(str(h["env"])) for h in holders), default=0)
    for h in holders:
        name = str(h["env"])
        tasks = plural(int(h["tasks"]), "task") if h["tasks"] else "no task, memory still held"
        mine = "  (this environment)" if name == me else ""
        lines.append(
            f"  {name:<{width}}  {tasks}, holds {format_size(int(h['used']))}, "
            f"promised {format_size(int(h['promised']))}{mine}"
        )
    return lines


def _queue_lines(view: Mapping[str, Any]) -> list[str]:
    waiting = int(view["waiting"])
    if not waiting:
        return ["queue: empty"]
    mine = view.get("mine") or []
    lines = [f"queue: {plural(waiting, 'request')} waiting, {len(mine)} of them this environment's"]
    for w in mine:
        memory = f", {format_size(int(w['memory']))} each" if w.get("memory") is not None else ""
        devices = ""
        if w.get("devices") is not None:
            devices = ", only GPU " + ",".join(str(d) for d in w["devices"])
        lines.append(
            f"  position {w['position']}: {plural(int(w['gpus']), 'GPU')}{memory}{devices}, "
            f"waited {format_clock(float(w['waited']))}, class {w.get('task_class') or '-'}"
        )
        if w.get("command"):
            lines.append(f"    command: {w['command']}")
        if w.get("reason"):
            lines.append(f"    waits for: {w['reason']}")
    others = int(view.get("others") or 0)
    if others:
        lines.append(f"  and {plural(others, 'request')} of other environments")
    return lines


def render(view: Mapping[str, Any]) -> str:
    """The view in a human form."""
    me = str(view["env"])
    lines = [f"environment {me}"]
    for gpu in view["gpus"]:
        lines += _gpu_lines(gpu, me)
    lines += _task_lines(view)
    lines += _queue_lines(view)
    return "\n".join(lines) + "\n"


def _task_lines(view: Mapping[str, Any]) -> list[str]:
    """This environment's classes and running tasks (docs/scheduling.md, "Classes")."""
    ls = "may" if view.get("allow_ls", True) else "may not"
    lines = [
        f"classes: default {view.get('class_default', 'be')}; this environment {ls} run "
        "latency-sensitive (ls) tasks"
    ]
    for t in view.get("running") or []:
        state = f"paused: {t['preempted']}" if t.get("preempted") else "running"
        gpus = ",".join(str(g) for g in t["gpus"])
        lines.append(f"  task {t['task_id']} ({t['task_class']}) on GPU {gpus}: {state}")
    return lines


def show(endpoint: str, as_json: bool, write: Callable[[str], None]) -> None:
    """Ask nodemgr and write the view; raises Unreachable or NodeError."""
    view = fetch(endpoint)
    write(json.dumps(view, indent=2, sort_keys=True) + "\n" if as_json else render(view))
