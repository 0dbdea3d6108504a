"""``nodemgr resume``: let a paused task's kernel launches go on."""

from __future__ import annotations

import click

from gpushare.messages import Resume
from nodemgr.cli._common import admin_call, config_option, json_option, print_json


@click.command()
@click.argument("task_id")
@config_option
@json_option
def resume(task_id: str, config_path: str | None, as_json: bool) -> None:
    """Resume task TASK_ID: processes waiting in a kernel launch or allocation go on at
    once.

    Resuming a task that is not paused changes nothing.
    """
    reply = admin_call(config_path, Resume(task_id=task_id))
    if as_json:
        print_json(reply.wire())
    else:
        click.echo(f"task {reply.task_id} of {reply.env}: resumed")
        if reply.paused:
            click.echo(
                f"task {reply.task_id} stays paused for a latency-sensitive task: it goes on "
                "when that ends (nodemgr tasks says which)",
                err=True,
            )
