"""gpushare's client side: ``gpushare-run``, the auto-loader and its framework hooks.

The iteration API lives in :mod:`gpushare` (``gpushare.iteration_boundary()``); its
names stay importable from here, as programs written against this package use them.
This package is imported at every interpreter start when the auto-loader is on, so it
imports nothing beyond gpushare's own import-free top.
"""

from __future__ import annotations

from gpushare import iteration, iteration_boundary, mark_persistent

__all__ = ["iteration", "iteration_boundary", "mark_persistent"]
