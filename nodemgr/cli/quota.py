"""``nodemgr quota``: set and show environments' quotas."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import click

from gpushare.messages import QuotaDelete, QuotaSet, QuotaShow
from gpushare.params import ClassType, ComputeCapType, CountType, EnvNameType, SizeType
from gpushare.protocol import MAX_GPUS_PER_REQUEST
from gpushare.sizes import format_duration as duration
from gpushare.sizes import format_size, plural
from nodemgr.cli._common import admin_call, config_option, json_option, print_json, print_table


@click.group()
def quota() -> None:
    """Per-environment GPU-count and per-GPU memory quotas."""


@quota.command("set")
@click.argument("env", type=EnvNameType())
@click.option(
    "--gpus",
    type=CountType(0, MAX_GPUS_PER_REQUEST),
    default=None,
    help="GPU-count quota [default: ENV's, unchanged; a new ENV needs it].",
)
@click.option(
    "--memory",
    type=SizeType(warn_unitless=True),
    default=None,
    help="Memory per GPU: 512MiB, 8GiB, 1.5G, ... (a bare number is bytes) "
    "[default: ENV's, unchanged; a new ENV needs it].",
)
@click.option(
    "--compute",
    type=ComputeCapType(),
    default=None,
    metavar="PERCENT|none",
    help="Cap each task's compute share at PERCENT of its GPUs' time (a task asking for "
    "none gets the cap); 0 or none clears it (docs/compute.md) [default: unchanged].",
)
@click.option(
    "--force",
    is_flag=True,
    help="Set it even though no GPU of this node could serve it (more GPUs than the node "
    "has or than can each give the memory, more memory than its largest GPU, 0 bytes or "
    "less than a CUDA context).",
)
@click.option(
    "--class-default",
    type=ClassType(),
    default=None,
    help="The class of ENV's tasks that name none: ls (latency-sensitive) or be "
    "(best-effort) [default: ENV's, unchanged; new: the node's [classes] default].",
)
@click.option(
    "--allow-ls/--no-allow-ls",
    default=None,
    help="Whether ENV may run latency-sensitive tasks [default: ENV's, unchanged; new: "
    "the node's [classes] allow_ls_default].",
)
@config_option
@json_option
def set_(
    env: str,
    gpus: int | None,
    memory: int | None,
    compute: int | None,
    force: bool,
    class_default: str | None,
    allow_ls: bool | None,
    config_path: str | None,
    as_json: bool,
) -> None:
    """Create environment ENV or change its quota; an option left out keeps ENV's.

    \b
    nodemgr quota set alice --gpus 2 --memory 8GiB
    nodemgr quota set alice --memory 12GiB    # alice keeps her 2 GPUs
    nodemgr quota set bob --class-default be --no-allow-ls
    """
    if all(v is None for v in (gpus, memory, class_default, allow_ls, compute)):
        raise click.UsageError("give --gpus, --memory, --class-default, --allow-ls or --compute")
    reply = admin_call(
        config_path,
        QuotaSet(
            env=env,
            gpus=gpus,
            memory=memory,
            force=force,
            class_default=class_default,
            allow_ls=allow_ls,
            compute=compute,
        ),
    )
    if as_json:
        print_json(reply.wire())
        return
    click.echo(
        f"{env}: {plural(reply.gpus, 'GPU')} x {format_size(reply.memory)}"
        + (f", compute at most {reply.compute}%" if reply.compute else "")
        + f"; class {classes(reply.wire())}; task endpoint {reply.endpoint}"
    )
    for o in reply.over:
        click.echo(
            f"warning: {env} holds {format_size(o['used'])} on GPU {o['gpu']}, more than its "
            "new quota: it keeps that memory until it frees it (charged for all of it), and "
            "allocates nothing more there until it is below the quota",
            err=True,
        )


@quota.command("show")
@click.argument("env", type=EnvNameType(), required=False)
@click.option(
    "--endpoint",
    "endpoint_only",
    is_flag=True,
    help="Print only ENV's task endpoint (for GPUSHARE_ENDPOINT).",
)
@config_option
@json_option
def show(env: str | None, endpoint_only: bool, config_path: str | None, as_json: bool) -> None:
    """Show ENV's quota, or every environment's.

    \b
    export GPUSHARE_ENDPOINT=$(nodemgr quota show alice --endpoint)
    """
    if endpoint_only and env is None:
        raise click.UsageError("--endpoint needs ENV: nodemgr quota show ENV --endpoint")
    quotas = admin_call(config_path, QuotaShow(env=env)).quotas
    if endpoint_only:
        click.echo(quotas[0]["endpoint"])
        return
    if as_json:
        print_json(quotas[0] if env else quotas)
        return
    print_table(
        ["ENV", "GPUS", "MEMORY/GPU", "COMPUTE", "IDLE", "CLASS", "ENDPOINT"],
        [
            [
                q["env"],
                str(q["gpus"]),
                format_size(q["memory"]),
                f"{q['compute']}%" if q.get("compute") else "-",
                idle_policy(q),
                classes(q),
                q["endpoint"],
            ]
            for q in quotas
        ],
    )


def classes(q: Mapping[str, Any]) -> str:
    """An environment's CLASS column: its default class, and ``+ls`` when it may run
    latency-sensitive tasks (``-ls`` when not)."""
    return f"{q.get('class_default', 'be')} {'+ls' if q.get('allow_ls', True) else '-ls'}"


def idle_policy(q: Mapping[str, Any]) -> str:
    """An environment's IDLE column: its idle timeout and action, "-" when off; "*" marks
    its own policy (nodemgr idle), as opposed to the node's."""
    own = "*" if q.get("idle_own") else ""
    if not q.get("idle_timeout"):
        return "-" + own
    return f"{duration(q['idle_timeout'])} {q['idle_action']}{own}"


@quota.command("delete")
@click.argument("env", type=EnvNameType())
@click.option("--force", is_flag=True, help="End ENV's running tasks first (reason: admin).")
@config_option
@json_option
def delete(env: str, force: bool, config_path: str | None, as_json: bool) -> None:
    """Delete environment ENV: its quota, endpoint and ledger. Its records stay in history.

    Refused while ENV has running tasks or memory in use, unless --force.
    """
    reply = admin_call(config_path, QuotaDelete(env=env, force=force))
    if as_json:
        print_json(reply.wire())
    else:
        click.echo(f"{env}: deleted; {plural(reply.tasks_ended, 'running task')} ended")
