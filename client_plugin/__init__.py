"""gpushare's client side: ``gpushare-run``, the auto-loader, and the iteration API.

The functions below are for programs that no hook covers (docs/timeslicing.md):
call :func:`iteration_boundary` after each training step, or wrap the step in
``with iteration():``. Outside a task they do nothing. They import what they
need on first use, since this package is imported at every interpreter start
when the auto-loader is on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


def iteration_boundary() -> int:
    """One training step has ended: the shim classifies memory, and on a time-sliced GPU
    the task releases its cached memory or yields its turn when asked. Returns the
    shim's flags (0: nothing to do, or not in a task)."""
    from client_plugin import iterations

    return iterations.iteration_boundary()


@contextlib.contextmanager
def iteration() -> Iterator[None]:
    """``with iteration(): step()``: a boundary when the block ends without error."""
    yield
    iteration_boundary()


def mark_persistent(dptr: int) -> None:
    """Count the allocation starting at device pointer ``dptr`` as persistent."""
    from client_plugin import iterations

    iterations.mark_persistent(dptr)
