"""``nodemgr drain`` / ``undrain``: stop new grants on GPUs, and resume them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import click

from gpushare.messages import Drain
from gpushare.params import GpuType
from nodemgr.cli._common import admin_call, config_option, json_option, one_gpu, print_gpus


def _state_row(g: Mapping[str, Any]) -> list[str]:
    return [str(g["index"]), g["uuid"], "drained" if g["drained"] else "open", str(g["tasks"])]


def _drain(
    gpu: int | str | None, drained: bool | None, config_path: str | None, as_json: bool
) -> None:
    print_gpus(
        admin_call(config_path, Drain(gpu=one_gpu(gpu), drained=drained)).gpus,
        as_json,
        ["GPU", "UUID", "STATE", "TASKS"],
        _state_row,
    )


@click.command()
@click.argument("gpu", type=GpuType(), required=False)
@click.option("--show", is_flag=True, help="Only show which GPUs are drained.")
@config_option
@json_option
def drain(gpu: int | str | None, show: bool, config_path: str | None, as_json: bool) -> None:
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
@click.argument("gpu", type=GpuType())
@config_option
@json_option
def undrain(gpu: int | str, config_path: str | None, as_json: bool) -> None:
    """Grant GPU (an index or UUID, or "all") to new tasks again; waiting requests are
    tried at once."""
    _drain(gpu, False, config_path, as_json)
