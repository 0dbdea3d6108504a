"""``nodemgr serve``: run the daemon in the foreground."""

from __future__ import annotations

import logging
import sys

import click

from gpushare.exitcodes import EXIT_CONFIG
from nodemgr.cli._common import config_option, fail, load_config
from nodemgr.config import FORGET_FLAG
from nodemgr.host.gpus import InventoryError


@click.command()
@config_option
@click.option("-v", "--verbose", is_flag=True, help="Log debug detail.")
@click.option(
    FORGET_FLAG,
    "forget_unknown",
    is_flag=True,
    help="Start although run_dir holds ledgers, used by no process, of environments the "
    "database does not know (it was emptied or replaced): their quotas are lost.",
)
def serve(config_path: str | None, verbose: bool, forget_unknown: bool) -> None:
    """Run nodemgr in the foreground until SIGTERM or Ctrl-C."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # Here, not at the top: the other commands need none of the daemon (nor its metrics
    # library), and every command loads this module.
    from nodemgr.loop.server import Server, StartupError

    cfg = load_config(config_path)
    try:
        server = Server(cfg, forget_unknown)
        server.start()
    except (StartupError, InventoryError) as e:
        fail(str(e), EXIT_CONFIG)
    code = server.serve_forever()
    if code:
        sys.exit(code)  # EXIT_SOFTWARE: the loop kept failing (said in the log)
