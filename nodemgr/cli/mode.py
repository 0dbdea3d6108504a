"""``nodemgr mode``: show or change whether GPUs are shared or time-sliced."""

from __future__ import annotations

import click

from gpushare.messages import Mode
from gpushare.params import GpuType
from gpushare.protocol import MODES, SHARED
from gpushare.sizes import format_size
from nodemgr.cli._common import admin_call, config_option, json_option, one_gpu, print_gpus


@click.command()
@click.argument("gpu", type=GpuType(), required=False)
@click.argument("mode", required=False, type=click.Choice(MODES))
@config_option
@json_option
def mode(gpu: int | str | None, mode: str | None, config_path: str | None, as_json: bool) -> None:
    """Show every GPU's mode, or GPU's; with MODE, set it.

    GPU is an index or a UUID as `nodemgr status` shows them, or "all". MODE is
    "shared" (tasks run concurrently, each environment charged its quota) or
    "timesliced" (tasks take turns; docs/timeslicing.md). A mode set here is
    kept across restarts and wins over the config's timeslice.gpus.
    """
    gpus = admin_call(config_path, Mode(gpu=one_gpu(gpu), mode=mode)).gpus
    print_gpus(
        gpus,
        as_json,
        ["GPU", "UUID", "MODE", "SOURCE"],
        lambda g: [str(g["index"]), g["uuid"], g["mode"], g["source"]],
    )
    if as_json:
        return
    for g in gpus:
        if g.get("charged", 0) > g.get("capacity", g.get("charged", 0)):
            if g["mode"] == SHARED:
                hint = "time-slice it again, or end some tasks with nodemgr reclaim"
            else:
                hint = (
                    "its tasks' measured shapes exceed their estimates; "
                    "end some with nodemgr reclaim"
                )
            click.echo(
                f"warning: GPU {g['index']} is charged {format_size(g['charged'])}, more than "
                f"its {format_size(g['capacity'])}: its tasks may run out of GPU memory "
                f"({hint})",
                err=True,
            )
