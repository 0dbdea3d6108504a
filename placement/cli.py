"""``gpushare-cluster``: cluster placement from the command line (docs/placement.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from gpushare import __version__
from gpushare.exitcodes import EXIT_CONFIG, EXIT_DATA, EXIT_USAGE

HELP = f"""gpushare cluster placement: replay a trace against a placement policy.

Exit codes: 0 success; {EXIT_USAGE} bad usage; {EXIT_DATA} a trace file that cannot be read;
{EXIT_CONFIG} numpy missing (pip install 'gpushare[cluster]').
"""


def _fail(message: str, code: int) -> None:
    click.echo(f"gpushare-cluster: {message}", err=True)
    sys.exit(code)


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, help=HELP)
@click.version_option(__version__, prog_name="gpushare-cluster")
def cli() -> None:
    """The gpushare-cluster command; its help is HELP."""


def _policy_names() -> list[str]:
    try:
        from placement import policies  # noqa: F401  (registers them)
        from placement.registry import names
    except ImportError:  # numpy missing: said when the command runs
        return []
    return list(names())


@cli.command()
@click.option(
    "--nodes",
    "nodes_path",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="The node list: CSV with sn, cpu_milli, memory_mib, gpu, model.",
)
@click.option(
    "--pods",
    "pods_path",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="The pod list: CSV with name, cpu_milli, num_gpu, gpu_milli [, memory_mib, "
    "gpu_spec, qos, creation_time, deletion_time].",
)
@click.option(
    "--policy",
    required=True,
    type=click.Choice(_policy_names()),
    help="The placement policy.",
)
@click.option(
    "--tune",
    default=1.3,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True, max=10),
    help="Arrive until the GPU requests reach this multiple of the cluster's GPUs.",
)
@click.option("--seed", default=42, show_default=True, type=int, help="The run's random seed.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def simulate(
    nodes_path: Path, pods_path: Path, policy: str, tune: float, seed: int, as_json: bool
) -> None:
    """Replay the pod list on the nodes by the FGD paper's arrival protocol: pods arrive
    in a seeded random order, re-sampled until their GPU requests reach --tune times the
    cluster's, and are never deleted; a pod that fits nowhere fails. Prints the allocated
    and fragmented shares of the cluster's GPUs at each arrived share."""
    from placement.cluster import PlacementError
    from placement.replay import CHECKPOINTS, replay
    from placement.trace import read_nodes, read_pods

    try:
        result = replay(read_nodes(nodes_path), read_pods(pods_path), policy, seed, tune)
    except PlacementError as e:  # the trace's files, or a cluster they make that cannot be
        _fail(str(e), EXIT_DATA)
    if as_json:
        click.echo(json.dumps(result.wire(), indent=2))
        return
    click.echo(
        f"policy {policy}, seed {seed}, tune {tune:g}: {result.pods:,} pods arrived, "
        f"{result.placed:,} placed, {result.failed_pods:,} failed ({result.seconds:.1f} s)"
    )
    shown = [a for a in CHECKPOINTS if a in result.alloc_at]
    click.echo("arrived %      " + "".join(f"{a:>8}" for a in shown))
    click.echo("allocated %    " + "".join(f"{result.alloc_at[a]:>8.2f}" for a in shown))
    click.echo("fragmented %   " + "".join(f"{result.frag_at[a]:>8.2f}" for a in shown))


def main() -> None:
    try:
        import numpy  # noqa: F401
    except ImportError:
        _fail("numpy is missing: pip install 'gpushare[cluster]'", EXIT_CONFIG)
    cli()
