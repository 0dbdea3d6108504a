"""``gpushare-cluster device-plugin``: the Kubernetes commands of the gpushare-cluster
console script (docs/kubernetes.md), added to the placement commands' group."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import NoReturn

import click

from gpushare.exitcodes import EXIT_CONFIG, EXIT_UNREACHABLE
from kube.resources import KUBELET_DIR, POD_RESOURCES_SOCKET
from placement.cli import cli
from placement.cli import main as placement_main

cli.help = (cli.help or "") + (
    "\nOn Kubernetes (pip install 'gpushare[kube]'; docs/kubernetes.md): device-plugin, one"
    " per node beside nodemgr.\n"
)

# What the device plugin's exit codes mean (its --help and docs/kubernetes.md).
DEVICE_PLUGIN_EXITS = f"""Exit codes: 0 stopped by SIGTERM or SIGINT; {EXIT_UNREACHABLE} nodemgr
unreachable at start, or kubelet refused to register the plugin; {EXIT_CONFIG} a bad nodemgr
config, grpcio missing (pip install 'gpushare[kube]'), or a kubelet directory the plugin
cannot listen in."""


@cli.command(
    "device-plugin",
    help="Serve gpushare's resources to this node's kubelet (gpushare.io/gpus,"
    " gpushare.io/gpu-memory), making an environment in nodemgr for each container.\n\n"
    + DEVICE_PLUGIN_EXITS,
)
@click.option(
    "--kubelet-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=KUBELET_DIR,
    show_default=True,
    envvar="GPUSHARE_KUBELET_DIR",
    help="The kubelet's device-plugin directory (its kubelet.sock; the plugin's sockets).",
)
@click.option(
    "--pod-resources",
    type=click.Path(dir_okay=False, path_type=Path),
    default=POD_RESOURCES_SOCKET,
    show_default=True,
    envvar="GPUSHARE_POD_RESOURCES",
    help="The kubelet's pod-resources socket, read to remove the environments of gone pods.",
)
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    envvar="GPUSHARE_CONFIG",
    help="nodemgr's config file (its run_dir, state_dir, heartbeat_timeout and"
    " kube.oversubscription).",
)
@click.option(
    "--interval",
    type=click.FloatRange(min=0.05, max=3600),
    default=None,
    help="Seconds between reconciliations [default: half nodemgr's heartbeat_timeout].",
)
def device_plugin(
    kubelet_dir: Path, pod_resources: Path, config_path: str | None, interval: float | None
) -> None:
    from nodemgr import config as configmod

    try:
        from kube.deviceplugin.plugin import ListenError, Plugin, PluginError
    except ImportError as e:
        _fail(f"{e.name or e} is missing: pip install 'gpushare[kube]'", EXIT_CONFIG)
    from gpushare.client import NodeError, Unreachable

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = configmod.load(config_path)
    except configmod.ConfigError as e:
        _fail(str(e), EXIT_CONFIG)
    plugin = Plugin(cfg, kubelet_dir, pod_resources, interval=interval)
    stopped = threading.Event()

    def stop(signum: int, frame: FrameType | None) -> None:
        stopped.set()
        plugin.stopping.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        plugin.start()
    except (Unreachable, NodeError) as e:
        plugin.stop()
        _fail(f"nodemgr at {cfg.admin_endpoint}: {e}", EXIT_UNREACHABLE)
    except PluginError as e:
        plugin.stop()
        _fail(str(e), EXIT_CONFIG if isinstance(e, ListenError) else EXIT_UNREACHABLE)
    try:
        plugin.loop()
    finally:
        plugin.stop()


def _fail(message: str, code: int) -> NoReturn:
    click.echo(f"gpushare-cluster: {message}", err=True)
    sys.exit(code)


def main() -> None:
    placement_main()


__all__ = ["cli", "main"]
