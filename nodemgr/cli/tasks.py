"""``nodemgr tasks``: running tasks and what they use."""

from __future__ import annotations

import click

from gpushare.messages import Tasks
from gpushare.params import EnvNameType
from nodemgr.cli._common import (
    admin_call,
    config_option,
    json_option,
    preempted_lines,
    print_json,
    print_table,
    task_row,
)


@click.command()
@click.option("--env", type=EnvNameType(), default=None, help="Only this environment's tasks.")
@config_option
@json_option
def tasks(env: str | None, config_path: str | None, as_json: bool) -> None:
    """List running tasks: their GPUs, memory, kernel launches, compute share and whether
    they are paused."""
    items = admin_call(config_path, Tasks(env=env)).tasks
    if as_json:
        print_json(items)
        return
    print_table(
        [
            "TASK",
            "ENV",
            "CLASS",
            "PID",
            "GPU",
            "USED",
            "LIMIT/GPU",
            "LAUNCHES",
            "SHARE",
            "IDLE",
            "LAUNCHED",
            "STATE",
            "COMMAND",
        ],
        [task_row(t, "memory_limit") for t in items],
    )
    for line in preempted_lines(items):
        click.echo(line)
