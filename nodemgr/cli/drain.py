"""``nodemgr drain`` / ``undrain``: stop new grants on GPUs, and resume them."""

from __future__ import annotations

import click

from nodemgr.cli._common import (
    admin_call,
    config_option,
    gpu_fields,
    json_option,
    print_json,
    print_table,
)


def _drain(gpu: str | None, drained: bool | None, config_path: str | None, as_json: bool) -> None:
    fields = gpu_fields(gpu)
    if drained is not None:
        fields["drained"] = drained
    reply = admin_call(config_path, "drain", **fields)
    if as_json:
        print_json(reply["gpus"])
        return
    print_table(
        ["GPU", "UUID", "STATE", "TASKS"],
        [
            [str(g["index"]), g["uuid"], "drained" if g["drained"] else "open", str(g["tasks"])]
            for g in reply["gpus"]
        ],
    )


@click.command()
@click.argument("gpu", required=False)
@click.option("--show", is_flag=True, help="Only show which GPUs are drained.")
@config_option
@json_option
def drain(gpu: str | None, show: bool, config_path: str | None, as_json: bool) -> None:
    """Drain GPU (an index or UUID as `nodemgr status` shows them, or "all"): no new task
    is granted it, the tasks on it run on and waiting requests wait. Kept across restarts;
    `nodemgr undrain` ends it.

    \b
    nodemgr drain 2        # before maintenance of GPU 2
    nodemgr drain --show   # every GPU's state
    """
    if gpu is None and not show:
        raise click.UsageError('name the GPU to drain (an index, a UUID, or "all"), or --show')
    _drain(gpu, None if show else True, config_path, as_json)


@click.command()
@click.argument("gpu")
@config_option
@json_option
def undrain(gpu: str, config_path: str | None, as_json: bool) -> None:
    """Grant GPU (an index or UUID, or "all") to new tasks again; waiting requests are
    tried at once."""
    _drain(gpu, False, config_path, as_json)
