"""``nodemgr status``: the node at a glance."""

from __future__ import annotations

from typing import Any

import click

from gpushare.messages import Status
from gpushare.sizes import format_size, plural
from nodemgr.cli._common import (
    admin_call,
    config_option,
    json_option,
    percent,
    print_json,
    print_table,
)


@click.command()
@config_option
@json_option
def status(config_path: str | None, as_json: bool) -> None:
    """Show the node's GPUs, what is charged and used on each, and counts."""
    st = admin_call(config_path, Status()).wire()
    st.pop("v", None)
    st.pop("type", None)
    st.pop("id", None)
    if as_json:
        print_json(st)
        return
    kind = "simulated" if st["simulated"] else "NVML"
    click.echo(
        f"nodemgr {st['version']} (pid {st['pid']}), {plural(len(st['gpus']), kind + ' GPU')}, "
        f"{plural(st['envs'], 'environment')}, {plural(st['tasks'], 'task')}"
    )
    print_table(
        ["GPU", "NAME", "MEMORY", "CHARGED", "USED", "UTIL", "MEM UTIL", "TASKS", "ENVS"],
        [
            [
                str(g["index"]) + (" drained" if g.get("drained") else ""),
                g["name"],
                format_size(g["memory"]),
                format_size(g["charged"]),
                format_size(g["used"]),
                percent(g.get("utilization")),
                percent(g.get("memory_utilization")),
                str(g["tasks"]),
                ",".join(g["envs"]) or "-",
            ]
            for g in st["gpus"]
        ],
    )
    _contexts(st["gpus"])
    _bypass(st.get("bypass"))


def _contexts(gpus: list[dict[str, Any]]) -> None:
    """What a process is charged for its CUDA context, once per figure and source
    (docs/operations.md#context-memory)."""
    groups: dict[tuple[int, str], list[str]] = {}
    for g in gpus:
        if "context" in g:
            groups.setdefault((g["context"], g["context_source"]), []).append(str(g["index"]))
    for (nbytes, source), indices in groups.items():
        where = "GPU " if len(indices) == 1 else "GPUs "
        how = _CONTEXT_SOURCES.get(source, source)
        click.echo(
            f"context charge: {format_size(nbytes)} per process on {where}{','.join(indices)} "
            f"({how})"
        )


_CONTEXT_SOURCES = {
    "measured": "measured at start",
    "configured": "gpus.context_memory",
    "fallback": "the default: a context could not be measured, see nodemgr's log",
}


def _bypass(audit: dict[str, Any] | None) -> None:
    """The bypass audit's findings (docs/operations.md#bypass-audit), when it found any."""
    if not audit:
        return
    if audit.get("error"):
        click.echo(f"bypass audit: cannot list NVML's processes: {audit['error']}")
    for rewrite in audit.get("ledgers") or []:
        click.echo(
            f"ledgers rewritten: env {rewrite['env']} wrote what only nodemgr writes; "
            f"written back: {rewrite['rewrote']}"
        )
    procs = audit.get("processes") or []
    if not procs and not audit.get("found"):
        return
    n = len(procs)
    click.echo(
        f"bypass audit: {n} process{'' if n == 1 else 'es'} holding GPU memory no ledger "
        f"accounts for now; {audit['found']} found, {audit['killed']} killed since start"
    )
    if procs:
        print_table(
            ["PID", "GPU", "NVML SEES", "LEDGER", "WHY", "ENV", "TASK"],
            [
                [
                    str(p["pid"]),
                    str(p["gpu"]),
                    format_size(p["seen"]),
                    format_size(p["accounted"]),
                    p["reason"],
                    p["env"] or "-",
                    p["task_id"] or "-",
                ]
                for p in procs
            ],
        )
