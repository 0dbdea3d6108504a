"""Where a node's sockets and ledgers are, by the rules nodemgr and its clients share.

Under a node's run directory: ``admin.sock`` and ``view.sock`` (the admin endpoints), and
for each environment ``envs/ENV/`` holding ``task.sock`` (its task endpoint) and
``ledger`` (what the shim charges). A client in a container sees the environment's
directory mounted elsewhere, so it finds the ledger beside the socket it was given.
"""

from __future__ import annotations

import os
from pathlib import Path

# The run directory of a node whose config file names none (docs/configuration.md).
NODE_RUN_DIR = Path("/run/gpushare")
ADMIN_SOCKET = "admin.sock"
VIEW_SOCKET = "view.sock"
ENVS_DIR = "envs"
# Where a container sees its environment's directory (docs/containers.md): the mount's
# target, as the dev-container feature and the Kubernetes device plugin set it.
CONTAINER_DIR = Path("/run/gpushare")
TASK_SOCKET = "task.sock"
LEDGER = "ledger"
# The node's board (docs/compute.md#latency-classes): in the run directory, and linked into
# each environment's directory beside its ledger.
BOARD = "board"
# What nodemgr puts in an environment's directory, and so may replace there.
ENV_DIR_NAMES = (TASK_SOCKET, LEDGER, BOARD)
IPC = "ipc://"
# sockaddr_un's sun_path holds 108 bytes, the last a NUL (libzmq refuses a longer ipc
# path; a bind in another directory, renamed into place, would not, leaving a socket no
# client reaches).
MAX_SOCKET_PATH = 107


def default_run_dir(file: Path | None = None) -> Path:
    """Where sockets and ledgers live when the config names no ``run_dir``.

    With a config file (``file``), /run/gpushare whoever asks: the file names a node, whose
    daemon and every client of it must agree on the place, however they run. With none,
    /run/gpushare for root and a per-user runtime directory otherwise, so that a daemon and
    its commands of one user work without privileges.
    """
    if file is not None or os.geteuid() == 0:
        return NODE_RUN_DIR
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.access(xdg, os.W_OK):
        return Path(xdg) / "gpushare"
    return Path(f"/tmp/gpushare-{os.geteuid()}")


def env_dir(run_dir: Path, env: str) -> Path:
    """Environment ``env``'s directory: its socket and its ledger."""
    return run_dir / ENVS_DIR / env


def endpoint(path: Path) -> str:
    """The ZeroMQ endpoint of the socket at ``path``."""
    return f"{IPC}{path}"


def socket_of(endpoint_: str) -> str | None:
    """The socket's path of an ``ipc://`` endpoint; None for another transport."""
    return endpoint_.removeprefix(IPC) if endpoint_.startswith(IPC) else None


def ledger_beside(endpoint_: str) -> str:
    """The ledger's path beside the task socket ``endpoint_`` (an ``ipc://`` endpoint)."""
    return os.path.join(os.path.dirname(endpoint_.removeprefix(IPC)), LEDGER)


def board_beside(ledger: str) -> str:
    """The board's path beside an environment's ledger (as this process sees it)."""
    return os.path.join(os.path.dirname(ledger), BOARD)


def socket_path_problem(path: Path, what: str, fix: str) -> str | None:
    """Why no client could connect to a socket at ``path`` (``what`` names it, ``fix`` says
    how to shorten it); None when one can."""
    size = len(os.fsencode(path))
    if size <= MAX_SOCKET_PATH:
        return None
    return (
        f"{what} {path} would be {size} bytes long, over the {MAX_SOCKET_PATH} a Unix "
        f"socket's path may have: {fix}"
    )
