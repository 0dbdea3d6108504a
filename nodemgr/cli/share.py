"""``nodemgr share``: change a running task's compute share."""

from __future__ import annotations

import click

from gpushare.messages import Share
from gpushare.params import ComputeCapType
from nodemgr.cli._common import admin_call, config_option, json_option, print_json, print_table


@click.command()
@click.argument("task_id")
@click.option(
    "--compute",
    type=ComputeCapType(1),
    required=True,
    help="The share of its GPUs' time the task may take, 1 to 100, or none.",
)
@config_option
@json_option
def share(task_id: str, compute: int, config_path: str | None, as_json: bool) -> None:
    """Give running task TASK_ID a compute share of its GPUs' time (docs/compute.md), or
    take it away (--compute none); it applies within a period.

    Prints the share in force (at most its environment's cap; shares that do not fit are
    scaled) and the windows of every task on its GPUs.

    \b
    nodemgr share 3f2a9c0d1b2e4f56 --compute 30
    """
    reply = admin_call(config_path, Share(task_id=task_id, compute=compute or None))
    if as_json:
        print_json(reply.wire())
        return
    asked = "none" if reply.compute is None else f"{reply.compute}%"
    got = f"{reply.share}%" if reply.share else "not gated"
    click.echo(f"task {reply.task_id} of {reply.env}: share {asked}, in force {got}")
    for note in reply.notes:
        click.echo(f"note: {note}")
    if reply.windows:
        print_table(
            ["TASK", "ENV", "GPU", "SHARE", "WINDOW"],
            [
                [
                    w["task_id"],
                    w["env"],
                    ",".join(map(str, w["gpus"])),
                    f"{w['share']}%",
                    f"{w['offset'] * 1e3:g}-{(w['offset'] + w['length']) * 1e3:g} ms "
                    f"of {w['period'] * 1e3:g}",
                ]
                for w in reply.windows
            ],
        )
