"""``nodemgr status``: the node at a glance."""

from __future__ import annotations

import click

from nodemgr.cli._common import admin_call, config_option, json_option, print_json, print_table
from nodemgr.sizes import format_size, plural


@click.command()
@config_option
@json_option
def status(config_path: str | None, as_json: bool) -> None:
    """Show the node's GPUs, what is charged and used on each, and counts."""
    st = admin_call(config_path, "status")
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
        ["GPU", "NAME", "MEMORY", "CHARGED", "USED", "TASKS", "ENVS"],
        [
            [
                str(g["index"]) + (" drained" if g.get("drained") else ""),
                g["name"],
                format_size(g["memory"]),
                format_size(g["charged"]),
                format_size(g["used"]),
                str(g["tasks"]),
                ",".join(g["envs"]) or "-",
            ]
            for g in st["gpus"]
        ],
    )
