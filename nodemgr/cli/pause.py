"""``nodemgr pause``: hold a task's kernel launches."""

from __future__ import annotations

import click

from nodemgr.cli._common import admin_call, config_option, json_option, print_json


@click.command()
@click.argument("task_id")
@config_option
@json_option
def pause(task_id: str, config_path: str | None, as_json: bool) -> None:
    """Pause task TASK_ID: its processes wait in their next kernel launch.

    The task keeps its GPUs, its memory and its heartbeats; kernels already
    launched run to completion. Undo with: nodemgr resume TASK_ID.
    """
    reply = admin_call(config_path, "pause", task_id=task_id)
    if as_json:
        print_json({"task_id": reply["task_id"], "env": reply["env"], "paused": reply["paused"]})
    else:
        click.echo(f"task {reply['task_id']} of {reply['env']}: paused")
