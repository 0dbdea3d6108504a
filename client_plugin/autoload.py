"""Auto-load: a GPU grant for any Python process the moment it imports a framework.

With ``GPUSHARE_AUTOLOAD=1`` the package's start-up hook (``gpushare-autoload.pth``,
which ``site`` runs in every interpreter) calls :func:`install`. That must cost
next to nothing, since most Python processes never touch a GPU: it imports only
what the interpreter already has and puts one finder in front of the import
system. The grant itself (client_plugin.autotask) is imported when the first
framework import fires, before that framework's own code runs.
"""

from __future__ import annotations

import _thread
import os
import sys

# Not typing.TYPE_CHECKING: importing typing alone would cost more than the rest.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from importlib.machinery import ModuleSpec
    from types import ModuleType

FRAMEWORKS_ENV = "GPUSHARE_FRAMEWORKS"
OWNER_ENV = "GPUSHARE_TASK_OWNER"  # client_plugin.settings.TASK_OWNER
# Set only for the restart of the process that holds the task (client_plugin.autotask).
RESTART_ENV = "GPUSHARE_AUTOLOAD_RESTART"
DEFAULT_FRAMEWORKS = ("torch", "tensorflow", "jax", "jaxlib", "paddle", "mxnet", "cupy")


def frameworks(environ: Mapping[str, str] | None = None) -> frozenset[str]:
    """Top-level module names whose first import starts a task."""
    env = os.environ if environ is None else environ
    extra = (n.strip() for n in env.get(FRAMEWORKS_ENV, "").split(","))
    return frozenset(DEFAULT_FRAMEWORKS).union(n for n in extra if n)


class FrameworkFinder:
    """Never finds anything: it only notices the first import of a framework."""

    def __init__(self, names: frozenset[str], cwd: str | None) -> None:
        self.names = names
        self.cwd = cwd  # where the interpreter started, for a restart
        self.fired = False
        self.lock = _thread.allocate_lock()

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: ModuleType | None = None,
    ) -> ModuleSpec | None:
        if self.fired or path is not None or fullname not in self.names:
            return None
        with self.lock:
            if self.fired:
                return None
            self.fired = True
        from client_plugin import autotask

        autotask.start(fullname, self.cwd)
        return None


def install() -> None:
    """Called at interpreter start when GPUSHARE_AUTOLOAD is on."""
    if os.environ.get(RESTART_ENV, "").partition(",")[0] == str(os.getpid()):
        # This process holds a task and was restarted with the shim: carry on.
        from client_plugin import autotask

        autotask.resume()
        return
    if os.environ.get(OWNER_ENV):
        return  # a process of a task (or of a CPU-only run): it shares that grant
    if any(isinstance(f, FrameworkFinder) for f in sys.meta_path):
        return  # the start-up hook ran twice (site-packages reached by two paths)
    try:
        cwd: str | None = os.getcwd()
    except OSError:
        cwd = None
    sys.meta_path.insert(0, FrameworkFinder(frameworks(), cwd))
