"""What the admin commands share: finding the daemon, calling it, printing."""

from __future__ import annotations

import json
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click

from gpushare import paths
from gpushare.client import Connection, NodeError, Unreachable
from gpushare.exitcodes import EXIT_ADMIN_REFUSED, EXIT_CONFIG, EXIT_UNREACHABLE
from gpushare.messages import AdminRequest, R
from gpushare.params import ALL_GPUS
from gpushare.protocol import MAX_ADMIN_REPLY_BYTES
from gpushare.sizes import format_duration as duration
from gpushare.sizes import format_size
from nodemgr import config as configmod

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


def _connect(path: Path) -> type[OSError] | None:
    """What connecting to the socket at ``path`` answers at once: PermissionError (it
    refuses this user), FileNotFoundError (no socket: a nodemgr stopped cleanly removes
    it), ConnectionRefusedError (nothing listens: a killed nodemgr leaves it); None when
    something listens (a full backlog answers EAGAIN at once: it listens)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(2.0)
        try:
            probe.connect(str(path))
        except (PermissionError, FileNotFoundError, ConnectionRefusedError) as e:
            return type(e)
        except OSError:
            pass
    return None


def check_access(cfg: configmod.Config, view: bool = False) -> str:
    """The endpoint to call: the admin socket, or for a ``view`` (protocol.is_view) the
    read-only one when only that lets this user in. Fail with the cause when they refuse
    this user: zmq connects in the background, so a refusal would otherwise read as
    nodemgr not answering."""
    path = cfg.run_dir / paths.ADMIN_SOCKET
    if _connect(path) is not PermissionError:
        return cfg.admin_endpoint
    if view and _connect(cfg.run_dir / paths.VIEW_SOCKET) is not PermissionError:
        return cfg.reader_endpoint
    readers = (
        f"; views need only {cfg.run_dir / paths.VIEW_SOCKET}, which [readers] owner/group/mode "
        "let in"
        if view
        else ""
    )
    fail(
        f"permission denied on {path}: run this as root, or as a user the config's "
        "[admin] owner/group/mode let in (and log in again after joining the group)"
        f"{readers}",
        EXIT_UNREACHABLE,
    )


def not_running(endpoint: str) -> str | None:
    """Why nodemgr is not running at ``endpoint`` (check_access's), as connecting to it
    tells at once: no socket there, or one nothing listens on. None when something listens:
    only waiting for its answer tells a nodemgr that is stopped or stuck."""
    path = Path(endpoint.removeprefix(paths.IPC))
    got = _connect(path)
    if got is FileNotFoundError:
        return f"nodemgr is not running: no socket at {path}"
    if got is ConnectionRefusedError:
        return (
            f"nodemgr is not running: nothing listens at {path} (left by a nodemgr that was killed)"
        )
    return None


def start_hint(cfg: configmod.Config) -> str:
    """What to do when nodemgr is not running at ``cfg``'s admin socket. Without a config
    file a user's commands look in a directory of their own: a nodemgr serving the node's
    (a config file's, or root's) is named, with how to reach it."""
    node = paths.NODE_RUN_DIR / paths.ADMIN_SOCKET
    if cfg.path is None and cfg.run_dir != paths.NODE_RUN_DIR and node.exists():
        return (
            f"a nodemgr serves at {node}: name its config with --config or ${configmod.CONFIG_ENV}"
        )
    config = f" --config {cfg.path}" if cfg.path else ""
    return (
        f"start it with: nodemgr serve{config}, or give this command the config nodemgr runs with"
    )


# An answer that does not come although something listens at the admin socket.
SILENT = "its process is alive but does not answer: stopped (SIGSTOP) or stuck? see its log"


def admin_call(config_path: str | None, request: AdminRequest[R]) -> R:
    """Send ``request`` to the nodemgr of the config at ``config_path``, and return its reply;
    fail with the exit code of what went wrong."""
    cfg = load_config(config_path)
    endpoint = check_access(cfg, request.is_view())
    why = not_running(endpoint)
    if why is not None:
        fail(f"{why} ({start_hint(cfg)})", EXIT_UNREACHABLE)
    try:
        with Connection(endpoint, timeout=5.0, max_reply=MAX_ADMIN_REPLY_BYTES) as conn:
            return conn.send(request)
    except Unreachable as e:
        why = not_running(endpoint)  # gone meanwhile (stopped, killed), or silent
        fail(f"{why} ({start_hint(cfg)})" if why else f"{e} ({SILENT})", EXIT_UNREACHABLE)
    except NodeError as e:
        fail(e.message, EXIT_ADMIN_REFUSED)


def one_gpu(gpu: int | str | None) -> int | str | None:
    """A per-GPU admin request's ``gpu``, from a GPU argument as params.GpuType reads it (an
    index, a UUID or a prefix of one): None, every GPU, for "all" or none given."""
    return None if gpu is None or gpu == ALL_GPUS else gpu


def print_gpus(
    gpus: Sequence[Mapping[str, Any]],
    as_json: bool,
    headers: list[str],
    row: Callable[[Mapping[str, Any]], list[str]],
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


def preempted_lines(tasks: Sequence[Mapping[str, Any]]) -> list[str]:
    """Under a table of tasks: why each best-effort task held for a latency-sensitive one
    is (docs/scheduling.md, "Classes"), and each latency-sensitive task held for using more
    than its share (docs/compute.md, "Elastic share")."""
    lines = [f"{t['task_id']}: {t['preempted']}" for t in tasks if t.get("preempted")]
    return lines + [f"{t['task_id']}: held: {t['held']}" for t in tasks if t.get("held")]


def task_state(task: Mapping[str, Any]) -> str:
    """A task's STATE column: paused (an operator holds its launches), gated (waiting for a
    time-sliced GPU's turn) or running."""
    if task.get("paused"):
        return "paused"
    if task.get("preempted"):
        return "preempted"
    if task.get("held"):
        return "held"
    return "gated" if task.get("gated") else "running"


def launched(task: Mapping[str, Any], now: float | None = None) -> str:
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


def idle_for(task: Mapping[str, Any]) -> str:
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


def share(task: Mapping[str, Any]) -> str:
    """A task's SHARE column (docs/compute.md): the share of its GPUs' time in force, "-"
    when it is not gated; with a "<" when that is less than it asked for (a cap, or shares
    scaled to fit)."""
    got = task.get("share") or 0
    if not got:
        return "-"
    asked = task.get("compute")
    return f"{got}%" + ("<" if asked is not None and got < asked else "")


def task_row(task: Mapping[str, Any], memory: str) -> list[str]:
    """A task's row in ``nodemgr tasks`` and ``nodemgr top``; the seventh column is the
    size in its field ``memory`` (the limit per GPU, or the peak)."""
    return [
        task["task_id"],
        task["env"],
        task.get("task_class", "-"),
        str(task["pid"] or "-"),
        ",".join(map(str, task["gpus"])),
        format_size(task["memory_used"]),
        format_size(task[memory]),
        str(task["launches"]),
        share(task),
        idle_for(task),
        launched(task),
        task_state(task),
        (task["command"] or "")[:40],
    ]
