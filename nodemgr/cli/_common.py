"""What the admin commands share: finding the daemon, calling it, printing."""

from __future__ import annotations

import json
import socket
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import click

from nodemgr import config as configmod
from nodemgr.client import Connection, NodeError, Unreachable
from nodemgr.exitcodes import EXIT_ADMIN_REFUSED, EXIT_CONFIG, EXIT_UNREACHABLE
from nodemgr.idle import duration
from nodemgr.protocol import is_view
from nodemgr.sizes import format_size

F = TypeVar("F", bound=Callable[..., Any])


def config_option(f: F) -> F:
    return click.option(
        "--config",
        "config_path",
        type=click.Path(dir_okay=False),
        envvar=configmod.CONFIG_ENV,
        help="nodemgr's TOML config (default: $GPUSHARE_CONFIG, then /etc/gpushare/nodemgr.toml).",
    )(f)


def json_option(f: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")(f)


def fail(message: str, code: int) -> NoReturn:
    click.echo(f"nodemgr: {message}", err=True)
    sys.exit(code)


def load_config(path: str | None) -> configmod.Config:
    try:
        return configmod.load(path)
    except configmod.ConfigError as e:
        fail(str(e), EXIT_CONFIG)


def _refused(endpoint: str) -> bool:
    """Whether the socket at ``endpoint`` refuses this user (permission denied)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(endpoint.removeprefix("ipc://"))
        except PermissionError:
            return True
        except OSError:
            pass  # not there or not listening: the call says so
    return False


def check_access(cfg: configmod.Config, view: bool = False) -> str:
    """The endpoint to call: the admin socket, or for a ``view`` (protocol.is_view) the
    read-only one when only that lets this user in. Fail with the cause when they refuse
    this user: zmq connects in the background, so a refusal would otherwise read as
    nodemgr not answering."""
    if not _refused(cfg.admin_endpoint):
        return cfg.admin_endpoint
    if view and not _refused(cfg.reader_endpoint):
        return cfg.reader_endpoint
    path = cfg.run_dir / "admin.sock"
    readers = (
        f"; views need only {cfg.run_dir / 'view.sock'}, which [readers] owner/group/mode let in"
        if view
        else ""
    )
    fail(
        f"permission denied on {path}: run this as root, or as a user the config's "
        "[admin] owner/group/mode let in (and log in again after joining the group)"
        f"{readers}",
        EXIT_UNREACHABLE,
    )


def admin_call(config_path: str | None, kind: str, **fields: Any) -> dict[str, Any]:
    cfg = load_config(config_path)
    endpoint = check_access(cfg, is_view(kind, fields))
    try:
        with Connection(endpoint, timeout=5.0) as conn:
            return conn.call(kind, **fields)
    except Unreachable as e:
        fail(
            f"{e} (is nodemgr running with this config? start it with: nodemgr serve"
            f"{' --config ' + str(cfg.path) if cfg.path else ''})",
            EXIT_UNREACHABLE,
        )
    except NodeError as e:
        fail(e.message, EXIT_ADMIN_REFUSED)


def gpu_fields(gpu: str | None) -> dict[str, Any]:
    """The ``gpu`` field of an admin request from a GPU argument: an index, a UUID (or a
    prefix of one), or "all" or nothing for every GPU."""
    if gpu is None or gpu == "all":
        return {}
    return {"gpu": int(gpu) if gpu.isascii() and gpu.isdigit() else gpu}


def gpu_request(
    config_path: str | None, kind: str, gpu: str | None, **change: Any
) -> list[dict[str, Any]]:
    """The GPUs a per-GPU admin request answers with; GPU as ``gpu_fields`` reads it, and
    each setting in ``change`` sent unless it is None."""
    fields = gpu_fields(gpu)
    fields.update({k: v for k, v in change.items() if v is not None})
    gpus: list[dict[str, Any]] = admin_call(config_path, kind, **fields)["gpus"]
    return gpus


def print_gpus(
    gpus: list[dict[str, Any]],
    as_json: bool,
    headers: list[str],
    row: Callable[[dict[str, Any]], list[str]],
) -> None:
    """GPUs as an admin request answered them: as JSON, or a table of ``row(gpu)`` under
    ``headers``."""
    if as_json:
        print_json(gpus)
    else:
        print_table(headers, [row(g) for g in gpus])


def print_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, sort_keys=True))


def format_table(headers: list[str], rows: list[list[str]]) -> list[str]:
    """Left-aligned columns two spaces apart, one string per line."""
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]
    return [
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
        for line in [headers, *rows]
    ]


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    for line in format_table(headers, rows):
        click.echo(line)


def task_state(task: dict[str, Any]) -> str:
    """A task's STATE column: paused (an operator holds its launches), gated (waiting for a
    time-sliced GPU's turn) or running."""
    if task.get("paused"):
        return "paused"
    return "gated" if task.get("gated") else "running"


def launched(task: dict[str, Any], now: float | None = None) -> str:
    """How long ago a task's processes last launched a kernel, as nodemgr's sweeps saw it."""
    last = task.get("last_launch")
    if last is None:
        return "never"
    ago = max(0.0, (time.time() if now is None else now) - float(last))
    if ago < 60:
        return f"{ago:.0f}s ago"
    if ago < 3600:
        return f"{ago / 60:.0f}m ago"
    return f"{ago / 3600:.0f}h ago"


def idle_for(task: dict[str, Any]) -> str:
    """A task's IDLE column: how long it has launched no kernel (since its grant when it
    never did; paused or gated time does not count), "!" once past its idle timeout."""
    spent = task.get("idle")
    if spent is None:
        return "-"
    timeout = task.get("idle_timeout") or 0
    return duration(spent) + ("!" if timeout and spent >= timeout else "")


def percent(value: int | None) -> str:
    """A utilisation figure: ``45%``, or ``-`` when NVML gave none."""
    return "-" if value is None else f"{value}%"


def task_row(task: dict[str, Any], memory: str) -> list[str]:
    """A task's row in ``nodemgr tasks`` and ``nodemgr top``; the sixth column is the size
    in its field ``memory`` (the limit per GPU, or the peak)."""
    return [
        task["task_id"],
        task["env"],
        str(task["pid"] or "-"),
        ",".join(map(str, task["gpus"])),
        format_size(task["memory_used"]),
        format_size(task[memory]),
        str(task["launches"]),
        idle_for(task),
        launched(task),
        task_state(task),
        (task["command"] or "")[:40],
    ]
