"""``nodemgr``: the daemon (``serve``) and the operator's commands, one module each."""

from __future__ import annotations

import click

from gpushare import __version__
from gpushare.exitcodes import EXIT_ADMIN_REFUSED, EXIT_CONFIG, EXIT_UNREACHABLE, EXIT_USAGE
from nodemgr.cli.drain import drain, undrain
from nodemgr.cli.history import history
from nodemgr.cli.idle import idle
from nodemgr.cli.mode import mode
from nodemgr.cli.pause import pause
from nodemgr.cli.queue import queue
from nodemgr.cli.quota import quota
from nodemgr.cli.reclaim import reclaim
from nodemgr.cli.resume import resume
from nodemgr.cli.serve import serve
from nodemgr.cli.share import share
from nodemgr.cli.status import status
from nodemgr.cli.tasks import tasks
from nodemgr.cli.top import top

HELP = f"""gpushare node manager: grants GPUs to tasks within per-environment quotas.

Exit codes: 0 success; {EXIT_ADMIN_REFUSED} nodemgr refused the request; {EXIT_USAGE} bad usage;
{EXIT_UNREACHABLE} nodemgr unreachable; {EXIT_CONFIG} bad configuration.

Shell completion (bash; zsh and fish alike):
eval "$(_NODEMGR_COMPLETE=bash_source nodemgr)"
"""


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, help=HELP)
@click.version_option(__version__, prog_name="nodemgr")
def cli() -> None:
    """The nodemgr command; its help is HELP."""


cli.add_command(serve)
cli.add_command(quota)
cli.add_command(tasks)
cli.add_command(queue)
cli.add_command(status)
cli.add_command(history)
cli.add_command(reclaim)
cli.add_command(pause)
cli.add_command(resume)
cli.add_command(share)
cli.add_command(top)
cli.add_command(mode)
cli.add_command(drain)
cli.add_command(undrain)
cli.add_command(idle)


def main() -> None:
    cli()
