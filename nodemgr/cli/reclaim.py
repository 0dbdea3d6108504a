"""``nodemgr reclaim``: end a task and take back its GPUs."""

from __future__ import annotations

import click

from gpushare.messages import Reclaim
from gpushare.protocol import MAX_NOTE, NOTE
from nodemgr.cli._common import admin_call, config_option, json_option, print_json


@click.command()
@click.argument("task_id")
@click.option(
    "--reason",
    metavar="TEXT",
    help=f"Why, in one line (at most {MAX_NOTE} characters): the task's user sees it.",
)
@config_option
@json_option
def reclaim(task_id: str, reason: str | None, config_path: str | None, as_json: bool) -> None:
    """End task TASK_ID now and give its GPUs back.

    Its GPUs go back at once. Its client (gpushare-run) hears why at its next
    heartbeat, with --reason's text, ends its command and exits 92; one still
    running after node.reclaim_grace is killed, so nothing keeps using memory
    that is granted again. The record's end reason is "admin".
    """
    if reason is not None and not (0 < len(reason) <= MAX_NOTE and NOTE.fullmatch(reason)):
        raise click.BadParameter(
            f"one line of 1 to {MAX_NOTE} printable characters", param_hint="'--reason'"
        )
    reply = admin_call(config_path, Reclaim(task_id=task_id, reason=reason))
    if as_json:
        print_json(reply.wire())
    else:
        click.echo(f"task {reply.task_id} of {reply.env}: reclaimed")
