"""gpushare's client side: ``gpushare-run``, the auto-loader, and the iteration API.

The functions below are for programs that no hook covers (docs/timeslicing.md):
call :func:`iteration_boundary` after each training step, or wrap the step in
``with iteration():``. Outside a task they do nothing. This package is imported
at every interpreter start when the auto-loader is on, so it imports nothing
itself: what the functions need is imported on their first use.
"""

from __future__ import annotations

TYPE_CHECKING = False  # not typing's: importing typing alone would cost more than the rest
if TYPE_CHECKING:
    from types import TracebackType


def iteration_boundary() -> int:
    """One training step has ended: the shim classifies memory, and on a time-sliced GPU
    the task releases its cached memory or yields its turn when asked. Returns the
    shim's flags (0: nothing to do, or not in a task)."""
    from client_plugin import iterations

    return iterations.iteration_boundary()


class iteration:  # used like a function: ``with iteration(): ...``
    """``with iteration(): step()``: a boundary when the block ends without error."""

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if kind is None:
            iteration_boundary()


def mark_persistent(dptr: int) -> None:
    """Count the allocation starting at device pointer ``dptr`` as persistent."""
    from client_plugin import iterations

    iterations.mark_persistent(dptr)
