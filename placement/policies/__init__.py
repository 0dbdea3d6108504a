"""The placement policies. Importing this package registers each of them
(:mod:`placement.registry`); this list is the one place that names their modules."""

from __future__ import annotations

from placement.policies import baselines, fgd, gpushare, seed000, seed003

__all__ = ["baselines", "fgd", "gpushare", "seed000", "seed003"]
