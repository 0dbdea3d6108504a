"""nodemgr: the per-node gpushare daemon and its admin CLI (docs/architecture.md)."""

from gpushare import __version__

__all__ = ["__version__"]
