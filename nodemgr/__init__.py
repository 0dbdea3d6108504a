"""nodemgr: the per-node gpushare daemon and its admin CLI."""

__version__ = "0.1.0"
