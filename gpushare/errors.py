"""The one exception root of gpushare's client (docs/client.md#auto-load-python).

Everything the client raises for a reason of gpushare's is a :class:`GpushareError`:
nodemgr's refusals and its silence (:mod:`gpushare.client`), unusable settings
(:mod:`client_plugin.settings`), a failed attach of the shim (:mod:`gpushare.shim`),
and the auto-loader's refusal of a framework import. This module imports nothing: the
auto-loader and nodemgr's client connection import it.
"""

from __future__ import annotations


class GpushareError(RuntimeError):
    """gpushare's client cannot do what was asked; the message says why and, where it can,
    what to do. A RuntimeError, so code that reads an ImportError as "framework not
    installed" does not run on without gpushare when the auto-loader refuses an import."""
