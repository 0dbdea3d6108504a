"""``nodemgr idle``: an environment's own idle policy (docs/nodemgr.md, "Idle tasks")."""

from __future__ import annotations

import click

from gpushare.messages import IdleSet
from gpushare.params import EnvNameType, SecondsType
from gpushare.protocol import IDLE_ACTIONS as ACTIONS
from gpushare.protocol import MAX_IDLE
from gpushare.sizes import format_duration as duration
from nodemgr.cli._common import admin_call, config_option, json_option, print_json


@click.command()
@click.argument("env", type=EnvNameType())
@click.option(
    "--timeout",
    type=SecondsType(0, MAX_IDLE),
    default=None,
    metavar="SECONDS",
    help="Seconds without a kernel launch before a task of ENV is idle; 0: never "
    "[default: the node's idle.timeout].",
)
@click.option(
    "--action",
    type=click.Choice(ACTIONS),
    default=None,
    help="reclaim an idle task's GPUs, or only report it [default: the node's idle.action].",
)
@config_option
@json_option
def idle(
    env: str, timeout: float | None, action: str | None, config_path: str | None, as_json: bool
) -> None:
    """Set environment ENV's idle policy; an option left out is the node's ([idle] in its
    config), so `nodemgr idle ENV` alone goes back to the node's policy. Kept across
    restarts; shown by `nodemgr quota show`."""
    [q] = admin_call(config_path, IdleSet(env=env, idle_timeout=timeout, idle_action=action)).quotas
    if as_json:
        print_json(q)
        return
    whose = "its own" if q["idle_own"] else "the node's"
    if q["idle_timeout"]:
        click.echo(f"{env}: idle after {duration(q['idle_timeout'])}: {q['idle_action']} ({whose})")
    else:
        click.echo(f"{env}: no idle timeout ({whose})")
