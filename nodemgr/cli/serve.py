"""``nodemgr serve``: run the daemon in the foreground."""

from __future__ import annotations

import logging

import click

from nodemgr.cli._common import config_option, fail, load_config
from nodemgr.exitcodes import EXIT_CONFIG
from nodemgr.gpus import InventoryError


@click.command()
@config_option
@click.option("-v", "--verbose", is_flag=True, help="Log debug detail.")
def serve(config_path: str | None, verbose: bool) -> None:
    """Run nodemgr in the foreground until SIGTERM or Ctrl-C."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # Here, not at the top: the other commands need none of the daemon (nor its metrics
    # library), and every command loads this module.
    from nodemgr.server import Server, StartupError

    cfg = load_config(config_path)
    try:
        server = Server(cfg)
        server.start()
    except (StartupError, InventoryError) as e:
        fail(str(e), EXIT_CONFIG)
    server.serve_forever()
