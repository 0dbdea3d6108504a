"""``nodemgr pause``: hold a task's kernel launches."""

from __future__ import annotations

import click

from gpushare.messages import Pause
from nodemgr.cli._common import admin_call, config_option, json_option, print_json


@click.command()
@click.argument("task_id")
@config_option
@json_option
def pause(task_id: str, config_path: str | None, as_json: bool) -> None:
    """Pause task TASK_ID: each of its processes waits in its next kernel launch or
    allocation (frees are not held) until: nodemgr resume TASK_ID.

    The task keeps its GPUs, its memory and its heartbeats; kernels already
    launched run to completion. Refused for a task that is not running, or one
    that got no ledger task entry (docs/operations.md, "Pausing tasks").
    """
    reply = admin_call(config_path, Pause(task_id=task_id))
    if as_json:
        print_json(reply.wire())
    else:
        click.echo(f"task {reply.task_id} of {reply.env}: paused")
