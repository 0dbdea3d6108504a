"""``nodemgr top``: a live view of GPUs, environments, tasks and the wait queue."""

from __future__ import annotations

import shutil
import sys
import time
from typing import Any

import click

from gpushare.client import Connection, NodeError, Unreachable
from gpushare.exitcodes import EXIT_UNREACHABLE
from gpushare.messages import Queue, QuotaShow, Status, Tasks
from gpushare.params import CountType, SecondsType
from gpushare.protocol import MAX_ADMIN_REPLY_BYTES, TIMESLICED
from gpushare.sizes import format_size, plural
from nodemgr.cli._common import (
    SILENT,
    check_access,
    config_option,
    fail,
    format_table,
    load_config,
    not_running,
    percent,
    preempted_lines,
    print_json,
    start_hint,
    task_row,
)


def snapshot(conn: Connection) -> dict[str, Any]:
    return {
        "status": conn.send(Status()).wire(),
        "quotas": conn.send(QuotaShow()).quotas,
        "tasks": conn.send(Tasks()).tasks,
        "queue": conn.send(Queue()).waiting,
    }


def timesliced_lines(gpus: list[dict[str, Any]]) -> list[str]:
    """Per time-sliced GPU: its regions, then its tasks in the order of the turn (holder
    first), each with its slice."""
    lines: list[str] = []
    for g in gpus:
        regions = g.get("regions")
        if g.get("mode") != TIMESLICED or regions is None:
            continue
        turn = g.get("turn")
        head = (
            f"GPU {g['index']} time-sliced: persistent {format_size(regions['persistent'])}"
            f", temporary {format_size(regions['temporary'])}"
            f" ({format_size(regions['temporary_used'])} in use)"
        )
        if turn is not None:
            head += f", quantum {turn['quantum']}, {turn['switches']} switches"
        lines += ["", head]
        slices = {x["task_id"]: x for x in regions["slices"]}
        order = turn["order"] if turn is not None else list(slices)
        rows = []
        for task_id in order:
            x = slices.get(task_id)
            if x is None:
                continue
            if turn is None:
                state = "alone"
            elif task_id == turn["holder"]:
                state = f"holder {turn['held_for']:.1f}s"
            else:
                state = "waiting"
            rows.append(
                [
                    task_id,
                    state,
                    format_size(x["persistent"]),
                    format_size(x["temporary"]),
                    format_size(x["guard"]),
                    x["shape"],
                ]
            )
        lines += format_table(["TASK", "TURN", "PERSISTENT", "TEMPORARY", "GUARD", "SHAPE"], rows)
    return lines


def _with_util(task: dict[str, Any]) -> list[str]:
    """A task's row, its utilisation of each of its GPUs beside its memory (``45%,10%``)."""
    row = task_row(task, "peak")
    util = task.get("utilization") or [None] * len(task["gpus"])
    row.insert(6, ",".join(percent(u) for u in util))
    # The device time its pacers measured, beside its share (docs/compute.md).
    row.insert(10, f"{task['device_seconds']:.1f}s" if task.get("device_seconds") else "-")
    return row


def render(snap: dict[str, Any], width: int = 120) -> str:
    """One frame of ``top``; lines cut at ``width`` columns (0: not cut)."""
    st, quotas, tasks, queue = snap["status"], snap["quotas"], snap["tasks"], snap["queue"]
    kind = "simulated" if st["simulated"] else "NVML"
    lines = [
        f"nodemgr {st['version']}  {time.strftime('%H:%M:%S')}  "
        f"{plural(len(st['gpus']), kind + ' GPU')}  {plural(st['envs'], 'env')}  "
        f"{plural(st['tasks'], 'task')}  {len(queue)} waiting",
        "",
    ]
    lines += format_table(
        ["GPU", "MEMORY", "CHARGED", "USED", "UTIL", "MEM UTIL", "TASKS", "ENVS"],
        [
            [
                str(g["index"])
                + (" LOST" if g.get("lost") else "")
                + (" DRAINED" if g.get("drained") else ""),
                format_size(g["memory"]),
                format_size(g["charged"]),
                format_size(g["used"]),
                percent(g.get("utilization")),
                percent(g.get("memory_utilization")),
                f"{g['tasks']}/{st.get('task_threshold', '-')}",
                ",".join(g["envs"]) or "-",
            ]
            for g in st["gpus"]
        ],
    )
    lines += timesliced_lines(st["gpus"])
    per_env: dict[str, list[dict[str, Any]]] = {}
    for t in tasks:
        per_env.setdefault(t["env"], []).append(t)
    lines.append("")
    lines += format_table(
        ["ENV", "QUOTA", "MEMORY/GPU", "TASKS", "USED"],
        [
            [
                q["env"],
                str(q["gpus"]),
                format_size(q["memory"]),
                str(len(per_env.get(q["env"], []))),
                format_size(sum(t["memory_used"] for t in per_env.get(q["env"], []))),
            ]
            for q in quotas
        ],
    )
    lines.append("")
    lines += format_table(
        [
            "TASK",
            "ENV",
            "CLASS",
            "PID",
            "GPU",
            "USED",
            "UTIL",
            "PEAK",
            "LAUNCHES",
            "SHARE",
            "DEVICE",
            "IDLE",
            "LAUNCHED",
            "STATE",
            "COMMAND",
        ],
        [_with_util(t) for t in tasks],
    )
    lines += preempted_lines(tasks)
    if queue:
        lines.append("")
        lines += format_table(
            ["POS", "ENV", "CLASS", "GPUS", "PID", "WAITED", "COMMAND"],
            [
                [
                    str(w["position"]),
                    w["env"],
                    w.get("task_class") or "-",
                    str(w["gpus"]),
                    str(w["pid"] or "-"),
                    f"{w['waited']:.0f}s",
                    (w["command"] or "")[:40],
                ]
                for w in queue
            ],
        )
    return "\n".join(line[:width] if width else line for line in lines)


class IterationsType(CountType):
    """``-n``: how many frames, as procps top's ``-n`` (it was once the interval here: a
    refusal says where that went)."""

    def convert(
        self, value: object, param: click.Parameter | None, ctx: click.Context | None
    ) -> int:
        try:
            return super().convert(value, param, ctx)
        except click.BadParameter as e:
            self.fail(
                f"{e.message} (-n is the number of frames, as in procps top; the seconds "
                "between them are -d/--delay)",
                param,
                ctx,
            )


@click.command()
@click.option(
    "-d",
    "--delay",
    "--interval",
    "delay",
    type=SecondsType(0.1, 3600.0),
    default=2.0,
    show_default=True,
    help="Seconds between frames, as procps top's -d (--interval is the same).",
)
@click.option(
    "-n",
    "--iterations",
    type=IterationsType(1),
    default=None,
    help="Stop after N frames, as procps top's -n (default: run until Ctrl-C).",
)
@config_option
@click.option("--json", "as_json", is_flag=True, help="Print one snapshot as JSON and exit.")
def top(delay: float, iterations: int | None, config_path: str | None, as_json: bool) -> None:
    """A live view of GPUs, environments, tasks and the wait queue."""
    cfg = load_config(config_path)
    count = 0
    away_since: str | None = None  # when nodemgr was last found not answering
    conn: Connection | None = None
    try:
        while True:
            if conn is None or away_since is not None:
                # Which socket lets this user in shows only while nodemgr serves: asked
                # again after it was away (a reader's is view.sock, once it is back).
                chosen = check_access(cfg, view=True)
                if conn is None or conn.endpoint != chosen:
                    if conn is not None:
                        conn.close()
                    conn = Connection(chosen, timeout=5.0, max_reply=MAX_ADMIN_REPLY_BYTES)
            endpoint = conn.endpoint
            why = not_running(endpoint)
            if why is not None:
                why = f"{why} ({start_hint(cfg)})"
            else:
                try:
                    snap = snapshot(conn)
                except Unreachable as e:
                    # Gone meanwhile (stopped, killed), or silent.
                    gone = not_running(endpoint)
                    why = f"{gone} ({start_hint(cfg)})" if gone else f"{e} ({SILENT})"
                except NodeError as e:
                    fail(e.message, 1)
            if as_json:
                if why is not None:
                    fail(why, EXIT_UNREACHABLE)
                print_json(snap)
                return
            if why is None:
                away_since = None
                frame = render(snap, _width())
            else:
                # Gone for now (stopped, restarting): said, and asked again each interval.
                away_since = away_since or time.strftime("%H:%M:%S")
                frame = away(why, away_since, _width())
            # Home and clear: redraw in place, as top does.
            click.echo("\x1b[H\x1b[2J" + frame, nl=True)
            count += 1
            if iterations and count >= iterations:
                return
            time.sleep(delay)
    except KeyboardInterrupt:
        return
    finally:
        if conn is not None:
            conn.close()


def _width() -> int:
    """A terminal's width to cut lines at; 0 (whole lines) into a pipe or a file."""
    return shutil.get_terminal_size((120, 40)).columns if sys.stdout.isatty() else 0


def away(why: str, since: str, width: int = 120) -> str:
    """``top``'s frame while nodemgr does not answer; lines cut at ``width`` (0: not cut)."""
    lines = [
        f"nodemgr  {time.strftime('%H:%M:%S')}  away since {since}: waiting for it to come back"
        " (Ctrl-C to quit)",
        "",
        why,
    ]
    return "\n".join(line[:width] if width else line for line in lines)
