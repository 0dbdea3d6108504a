"""``gpushare-cluster``: cluster placement from the command line (docs/placement.md)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn, Protocol, TypeVar

import click

from gpushare import __version__
from gpushare.exitcodes import EXIT_CONFIG, EXIT_DATA, EXIT_USAGE

HELP = f"""gpushare cluster placement: replay a trace against a placement policy.

Exit codes: 0 success; {EXIT_USAGE} bad usage; {EXIT_DATA} a trace file that cannot be read;
{EXIT_CONFIG} numpy missing (pip install 'gpushare[cluster]').
"""


def _fail(message: str, code: int) -> NoReturn:
    click.echo(f"gpushare-cluster: {message}", err=True)
    sys.exit(code)


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, help=HELP)
@click.version_option(__version__, prog_name="gpushare-cluster")
def cli() -> None:
    """The gpushare-cluster command; its help is HELP."""


class _Wired(Protocol):
    def wire(self) -> dict[str, object]: ...


W = TypeVar("W", bound=_Wired)


def _run(replay: Callable[[], W], as_json: bool) -> W | None:
    """The replay's result; with ``as_json`` printed as JSON, and None returned. A trace
    that cannot be read, or a cluster it makes that cannot be, ends the command."""
    from placement.cluster import PlacementError

    try:
        result = replay()
    except PlacementError as e:
        _fail(str(e), EXIT_DATA)
    if as_json:
        click.echo(json.dumps(result.wire(), indent=2))
        return None
    return result


def _policy_names() -> list[str]:
    try:
        from placement import policies  # noqa: F401  (registers them)
        from placement.registry import names
    except ImportError:  # numpy missing: said when the command runs
        return []
    return list(names())


def _trace_options(f: Callable[..., None]) -> Callable[..., None]:
    """--nodes, --pods and --policy, which every command takes."""
    for option in reversed(_TRACE_OPTIONS):
        f = option(f)
    return f


_TRACE_OPTIONS = [
    click.option(
        "--nodes",
        "nodes_path",
        required=True,
        type=click.Path(dir_okay=False, path_type=Path),
        help="The node list: CSV with sn, cpu_milli, memory_mib, gpu, model.",
    ),
    click.option(
        "--pods",
        "pods_path",
        required=True,
        type=click.Path(dir_okay=False, path_type=Path),
        help="The pod list: CSV with name, cpu_milli, num_gpu, gpu_milli [, memory_mib, "
        "gpu_spec, qos, creation_time, deletion_time].",
    ),
    click.option(
        "--policy",
        required=True,
        type=click.Choice(_policy_names()),
        help="The placement policy.",
    ),
]


_CLASSES = click.option(
    "--classes/--no-classes",
    default=True,
    show_default=True,
    help="Heed the pods' QoS classes (latency-sensitive ones may displace best-effort "
    "ones); --no-classes makes every pod latency-sensitive.",
)


@cli.command()
@_trace_options
@click.option(
    "--tune",
    default=1.3,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True, max=10),
    help="Arrive until the GPU requests reach this multiple of the cluster's GPUs.",
)
@click.option("--seed", default=42, show_default=True, type=int, help="The run's random seed.")
@_CLASSES
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def simulate(
    nodes_path: Path,
    pods_path: Path,
    policy: str,
    tune: float,
    seed: int,
    classes: bool,
    as_json: bool,
) -> None:
    """Replay the pod list on the nodes by the FGD paper's arrival protocol: pods arrive
    in a seeded random order, re-sampled until their GPU requests reach --tune times the
    cluster's, and are never deleted; a pod that fits nowhere fails. Prints the allocated
    and fragmented shares of the cluster's GPUs at each arrived share."""
    from placement.replay import CHECKPOINTS, replay
    from placement.trace import read_nodes, read_pods

    result = _run(
        lambda: replay(read_nodes(nodes_path), read_pods(pods_path), policy, seed, tune, classes),
        as_json,
    )
    if result is None:
        return
    click.echo(
        f"policy {policy}, seed {seed}, tune {tune:g}: {result.pods:,} pods arrived, "
        f"{result.placed:,} placed, {result.failed_pods:,} failed ({result.seconds:.1f} s)"
    )
    shown = [a for a in CHECKPOINTS if a in result.alloc_at]
    click.echo("arrived %      " + "".join(f"{a:>8}" for a in shown))
    click.echo("allocated %    " + "".join(f"{result.alloc_at[a]:>8.2f}" for a in shown))
    click.echo("fragmented %   " + "".join(f"{result.frag_at[a]:>8.2f}" for a in shown))
    if classes:
        click.echo(
            "by class: "
            + "; ".join(
                f"{c} {result.failed_by_class[c]:,} failed, holding "
                f"{result.alloc_by_class[c]:.2f}% of the GPUs"
                for c in result.failed_by_class
            )
        )
    if result.evicted or result.migrations:
        click.echo(
            f"displaced {result.evicted:,} best-effort pods ({result.evicted_unplaced:,} found "
            f"no other place); migrated {result.migrations:,} pods"
        )


@cli.command("replay")
@_trace_options
@click.option(
    "--speedup",
    default=1.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Divide the pods' creation times by this: arrivals closer together.",
)
@click.option(
    "--tune",
    default=0.0,
    show_default=True,
    type=click.FloatRange(min=0, max=10),
    help="Add copies of pods until the GPU requests reach this multiple of the cluster's "
    "GPUs (0: the trace's pods alone).",
)
@click.option("--seed", default=42, show_default=True, type=int, help="The run's random seed.")
@_CLASSES
@click.option(
    "--adapt/--no-adapt",
    default=False,
    show_default=True,
    help="Batch-size adaptation: a pod of whole GPUs that starts while nobody else waits "
    "runs on twice its GPUs, at twice its batch, where a node has them.",
)
@click.option(
    "--migrate/--no-migrate",
    default=True,
    show_default=True,
    help="Let the policy migrate pods by checkpoint to make room (gpushare, seed003); "
    "--no-migrate: displacement only.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
def replay_command(
    nodes_path: Path,
    pods_path: Path,
    policy: str,
    speedup: float,
    tune: float,
    seed: int,
    classes: bool,
    adapt: bool,
    migrate: bool,
    as_json: bool,
) -> None:
    """Replay the pod list in time: pods arrive at their creation times (divided by
    --speedup), wait in queues (the highest priority first, then latency-sensitive)
    while nothing has room, run for their lifetimes and leave. Prints job completion
    times and waits by class, the makespan, the GPU-hours, and the runs adapted."""
    from placement.timeline import replay_in_time
    from placement.trace import read_nodes, read_pods

    result = _run(
        lambda: replay_in_time(
            read_nodes(nodes_path),
            read_pods(pods_path),
            policy,
            seed,
            speedup,
            tune,
            adapt=adapt,
            migrate=migrate,
            classes=classes,
        ),
        as_json,
    )
    if result is None:
        return
    click.echo(
        f"policy {policy}, seed {seed}, speedup {speedup:g}, tune {tune:g}: {result.pods:,} "
        f"pods, {result.completed:,} completed, {result.refused:,} refused (fit nowhere), "
        f"{result.unfinished:,} unfinished ({result.seconds:.1f} s)"
    )
    click.echo("class   pods   JCT mean    JCT p99   wait mean   wait p99   wait max")
    for c in result.jct:
        j, w = result.jct[c], result.wait[c]
        click.echo(
            f"{c:<5} {j.count:>6} {j.mean:>10.1f} {j.p99:>10.1f} {w.mean:>11.1f} "
            f"{w.p99:>10.1f} {w.max:>10.1f}"
        )
    click.echo(
        f"makespan {result.makespan:,.0f} s, {result.gpu_hours:,.1f} GPU-hours; displaced "
        f"{result.evicted:,} pods, migrated {result.migrations:,}"
    )
    if adapt:
        click.echo(
            f"adapted {result.adapted:,} runs to twice their GPUs and batch "
            f"({result.adapted_gpu_hours:,.1f} GPU-hours), narrowed back {result.narrowed:,}"
        )


def main() -> None:
    try:
        import numpy  # noqa: F401
    except ImportError:
        _fail("numpy is missing: pip install 'gpushare[cluster]'", EXIT_CONFIG)
    cli()
