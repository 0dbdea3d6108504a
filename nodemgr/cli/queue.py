"""``nodemgr queue``: the requests waiting for GPUs, in the order they are served."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import click

from gpushare.messages import Queue
from gpushare.params import EnvNameType
from gpushare.sizes import format_clock, format_size
from nodemgr.cli._common import admin_call, config_option, json_option, print_json, print_table


def _row(w: Mapping[str, Any]) -> list[str]:
    devices = w.get("devices")
    memory = w.get("memory")
    return [
        str(w["position"]),
        w["env"],
        w.get("task_class") or "-",
        str(w["gpus"]),
        "any" if devices is None else ",".join(map(str, devices)),
        "-" if memory is None else format_size(memory),
        str(w["pid"] or "-"),
        format_clock(w["waited"]),
        format_clock(w["timeout_in"]),
        (w["command"] or "")[:40] or "-",
        w.get("reason") or "-",
    ]


@click.command()
@click.option("--env", type=EnvNameType(), default=None, help="Only this environment's requests.")
@config_option
@json_option
def queue(env: str | None, config_path: str | None, as_json: bool) -> None:
    """List the requests waiting for GPUs, next first: each one's place in the whole
    queue, environment, GPU count, the GPUs it may have (its CUDA_VISIBLE_DEVICES; "any"),
    memory hint, client pid, time waited and left, and why it is not granted yet."""
    waiting = admin_call(config_path, Queue(env=env)).waiting
    if as_json:
        print_json(waiting)
        return
    print_table(
        ["POS", "ENV", "CLASS", "GPUS", "GPU", "MEMORY", "PID", "WAITED", "LEFT", "COMMAND", "WHY"],
        [_row(w) for w in waiting],
    )
