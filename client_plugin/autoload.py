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

from gpushare import envvars

# Not typing.TYPE_CHECKING: importing typing alone would cost more than the rest.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from importlib.machinery import ModuleSpec
    from types import ModuleType
    from typing import Any

# Frameworks whose import puts in iteration hooks (gpushare.iterations).
HOOKED = ("torch", "keras")
DEFAULT_FRAMEWORKS = ("torch", "tensorflow", "jax", "jaxlib", "paddle", "mxnet", "cupy")


def frameworks(environ: Mapping[str, str] | None = None) -> frozenset[str]:
    """Top-level module names whose first import starts a task."""
    env = os.environ if environ is None else environ
    extra = (n.strip() for n in env.get(envvars.FRAMEWORKS, "").split(","))
    return frozenset(DEFAULT_FRAMEWORKS).union(n for n in extra if n)


class FrameworkFinder:
    """Finds nothing itself: it notices the first import of an installed framework and
    has the task started just before that module's code runs; after a hooked
    framework's code has run, it has its iteration hooks put in."""

    def __init__(
        self, names: frozenset[str], cwd: str | None, hooks: frozenset[str] = frozenset()
    ) -> None:
        self.names = names  # imports that start a task (empty: none)
        self.hooks = set(hooks)  # imports still to be hooked
        self.cwd = cwd  # where the interpreter started, for a restart
        self.pid = os.getpid()  # a forked child that imports first cannot be restarted
        self.fired = False
        self.searching = False
        self.lock = _thread.allocate_lock()

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: ModuleType | None = None,
    ) -> ModuleSpec | None:
        if self.searching or path is not None:
            return None
        if fullname not in self.hooks and (self.fired or fullname not in self.names):
            return None
        # Ask the finders behind this one: a framework that is not installed (an optional
        # import, importlib.util.find_spec) starts nothing.
        self.searching = True
        try:
            spec = None
            for finder in sys.meta_path:
                if finder is not self and hasattr(finder, "find_spec"):
                    spec = finder.find_spec(fullname, path, target)
                    if spec is not None:
                        break
        finally:
            self.searching = False
        if spec is None:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            self.before(fullname)
            return None
        # A stand-in with the Loader protocol; the real loader is put back at once.
        spec.loader = GrantingLoader(spec.loader, self, fullname)  # type: ignore[assignment]
        return spec

    def before(self, fullname: str) -> None:
        if fullname in self.names:
            self.fire(fullname)

    def after(self, fullname: str, module: ModuleType) -> None:
        if fullname not in self.hooks:
            return
        self.hooks.discard(fullname)
        from gpushare import iterations

        iterations.framework_loaded(fullname, module)

    def fire(self, fullname: str) -> None:
        with self.lock:
            if self.fired:
                return
            self.fired = True
        try:
            from client_plugin import autotask

            autotask.start(fullname, self.cwd, self.pid)
        except BaseException:
            self.fired = False  # refused or interrupted: the next import asks again
            raise


class GrantingLoader:
    """The framework's own loader, with the task started before its module's code runs."""

    def __init__(self, loader: Any, finder: FrameworkFinder, fullname: str) -> None:
        self._loader = loader
        self._finder = finder
        self._fullname = fullname

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        result: ModuleType | None = self._loader.create_module(spec)
        return result

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._finder.before(self._fullname)
        self._loader.exec_module(module)
        self._finder.after(self._fullname, module)


_installed = False


def install() -> None:
    """Called at interpreter start when GPUSHARE_AUTOLOAD is on, or in a process of a
    task (GPUSHARE_TASK_ID set), which needs only the iteration hooks."""
    global _installed
    if _installed:
        return  # the start-up hook ran twice (site-packages reached by two paths)
    _installed = True
    env = os.environ
    grant = envvars.switched_on(env.get(envvars.AUTOLOAD))
    hooks = frozenset(HOOKED) if envvars.hooks_wanted(env) else frozenset()
    if env.get(envvars.AUTOLOAD_HOLDER, "").partition(",")[0] == str(os.getpid()):
        # This process holds a task and was restarted with the shim (or exec'd another
        # program image): keep the task alive.
        from client_plugin import autotask

        autotask.resume()
        grant = False
    elif env.get(envvars.TASK_OWNER):
        grant = False  # a process of a task (or of a CPU-only run): it shares that grant
    if not grant and not (hooks and env.get(envvars.TASK_ID)):
        return
    try:
        cwd: str | None = os.getcwd()
    except OSError:
        cwd = None
    sys.meta_path.insert(0, FrameworkFinder(frameworks() if grant else frozenset(), cwd, hooks))
