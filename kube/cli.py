"""``gpushare-cluster device-plugin`` and ``extender``: the Kubernetes commands of the
gpushare-cluster console script (docs/kubernetes.md), added to the placement commands'
group."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import click

from gpushare.exitcodes import EXIT_CONFIG, EXIT_UNREACHABLE
from kube.resources import KUBELET_DIR, POD_RESOURCES_SOCKET

if TYPE_CHECKING:
    from kube.apiserver import ApiServer
from placement.cli import _fail, cli
from placement.cli import main as placement_main

cli.help = (cli.help or "") + (
    "\nOn Kubernetes (pip install 'gpushare[kube]'; docs/kubernetes.md): device-plugin, one"
    " per node beside nodemgr; extender, kube-scheduler's.\n"
)

_API_OPTIONS = [
    click.option(
        "--api-server",
        default=None,
        envvar="GPUSHARE_API_SERVER",
        help="The API server's URL [default: the cluster's own, from the pod's service"
        " account]; 'none': no API server.",
    ),
    click.option(
        "--token-file",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help="A file holding a bearer token for --api-server (read again every minute).",
    ),
    click.option(
        "--ca-file",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help="The CA certificate that signs --api-server's.",
    ),
]


def _api_options(f: Callable[..., None]) -> Callable[..., None]:
    for option in reversed(_API_OPTIONS):
        f = option(f)
    return f


def _api(
    api_server: str | None, token_file: Path | None, ca_file: Path | None, required: bool
) -> ApiServer | None:
    """The API server the options name; the cluster's own when none is named (None
    outside a cluster unless ``required``, which then ends the command)."""
    from kube.apiserver import ApiError, ApiServer

    if api_server == "none":
        return None
    try:
        if api_server is None:
            if not required and not os.environ.get("KUBERNETES_SERVICE_HOST"):
                return None
            return ApiServer.in_cluster()
        return ApiServer(api_server, ca=ca_file, token_file=token_file)
    except (ApiError, OSError) as e:
        _fail(str(e), EXIT_CONFIG)


def _log_to_stderr() -> None:
    """The daemons' log lines: time, logger, level, message."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")


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
@_api_options
@click.option(
    "--host-dev",
    type=click.Path(file_okay=False, path_type=Path),
    default="/dev",
    show_default=True,
    help="The host's /dev as this process sees it (in a pod: a hostPath mount), where the"
    " NVIDIA device nodes given to containers are looked for.",
)
@click.option(
    "--interval",
    type=click.FloatRange(min=0.05, max=3600),
    default=None,
    help="Seconds between reconciliations [default: half nodemgr's heartbeat_timeout].",
)
def device_plugin(
    kubelet_dir: Path,
    pod_resources: Path,
    config_path: str | None,
    api_server: str | None,
    token_file: Path | None,
    ca_file: Path | None,
    host_dev: Path,
    interval: float | None,
) -> None:
    from nodemgr import config as configmod

    try:
        from kube.deviceplugin.plugin import ListenError, Plugin, PluginError
    except ImportError as e:
        _fail(f"{e.name or e} is missing: pip install 'gpushare[kube]'", EXIT_CONFIG)
    from gpushare.client import NodeError, Unreachable

    _log_to_stderr()
    try:
        cfg = configmod.load(config_path)
    except configmod.ConfigError as e:
        _fail(str(e), EXIT_CONFIG)
    api = _api(api_server, token_file, ca_file, required=False)
    if api is None:
        logging.getLogger("gpushare.device-plugin").info(
            "no API server: the pods' gpushare.io/class is not read (environments are"
            " best-effort by nodemgr's default)"
        )
    plugin = Plugin(cfg, kubelet_dir, pod_resources, interval=interval, api=api, host_dev=host_dev)

    def stop(signum: int, frame: FrameType | None) -> None:
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


EXTENDER_EXITS = f"""Exit codes: 0 stopped by SIGTERM or SIGINT; {EXIT_UNREACHABLE} the listen
address cannot be bound; {EXIT_CONFIG} bad options (an unknown policy, no API server to
reach), or numpy missing (pip install 'gpushare[kube]')."""


def _listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise click.BadParameter(f"{text!r} is not HOST:PORT (or :PORT for every address)")
    return host.strip("[]"), int(port)


@cli.command(
    "extender",
    help="Serve kube-scheduler's extender protocol (filter, prioritize, bind) with a"
    " placement policy over the cluster the API server shows.\n\n" + EXTENDER_EXITS,
)
@click.option(
    "--listen",
    default=":8888",
    show_default=True,
    envvar="GPUSHARE_EXTENDER_LISTEN",
    help="HOST:PORT to serve on (:PORT: every address).",
)
@click.option(
    "--policy",
    default="gpushare",
    show_default=True,
    envvar="GPUSHARE_EXTENDER_POLICY",
    help="The placement policy (gpushare-cluster simulate --help lists them).",
)
@_api_options
@click.option(
    "--oversubscription",
    type=click.IntRange(1, 64),
    default=4,
    show_default=True,
    envvar="GPUSHARE_OVERSUBSCRIPTION",
    help="Nodes' kube.oversubscription, where no node label gpushare.io/oversubscription gives it.",
)
@click.option(
    "--refresh",
    type=click.FloatRange(min=0.1, max=3600),
    default=5.0,
    show_default=True,
    help="Seconds between reads of the nodes and pods from the API server.",
)
def extender(
    listen: str,
    policy: str,
    api_server: str | None,
    token_file: Path | None,
    ca_file: Path | None,
    oversubscription: int,
    refresh: float,
) -> None:
    host, port = _listen(listen)
    try:
        from kube.extender.server import Extender, serve
        from placement.registry import names
    except ImportError as e:
        _fail(f"{e.name or e} is missing: pip install 'gpushare[kube]'", EXIT_CONFIG)
    if policy not in names():
        _fail(f"no placement policy {policy!r} (known: {', '.join(names())})", EXIT_CONFIG)
    _log_to_stderr()
    api = _api(api_server, token_file, ca_file, required=True)
    ext = Extender(api, policy, oversubscription, refresh)
    try:
        server = serve(ext, host, port)
    except OSError as e:
        _fail(f"cannot listen on {listen}: {e}", EXIT_UNREACHABLE)
    refresher = threading.Thread(target=ext.loop, name="refresh", daemon=True)
    refresher.start()

    def stop(signum: int, frame: FrameType | None) -> None:
        ext.stopping.set()
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    logging.getLogger("gpushare.extender").info(
        "serving on %s:%d with policy %s", host or "*", server.server_address[1], policy
    )
    server.serve_forever()
    server.server_close()


def main() -> None:
    placement_main()


__all__ = ["cli", "main"]
