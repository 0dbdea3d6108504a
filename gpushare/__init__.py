"""gpushare: the contract between nodemgr and its clients, and the public Python API.

What both sides must agree on lives in this package and nowhere else: the wire protocol
and its typed messages (:mod:`gpushare.protocol`, :mod:`gpushare.messages`), the client
connection (:mod:`gpushare.client`), one exception root (:mod:`gpushare.errors`), sizes
and units, exit codes, environment variable names, run-directory, socket and ledger path
rules (:mod:`gpushare.paths`), the packaged native libraries (:mod:`gpushare.libs`) and
the shim's Python face (:mod:`gpushare.shim`). ``nodemgr`` and ``client_plugin`` import
it; it imports neither (import-linter holds this in ``make lint``).

The functions below are for programs that no hook covers (docs/timeslicing.md): call
:func:`iteration_boundary` after each training step, or wrap the step in
``with iteration():``. Outside a task they do nothing. The auto-loader imports this
package at interpreter start, so it imports nothing itself: what the functions need is
imported on their first use.
"""

from __future__ import annotations

__version__ = "0.1.0"

TYPE_CHECKING = False  # not typing's: importing typing alone would cost more than the rest
if TYPE_CHECKING:
    from types import TracebackType


def iteration_boundary() -> int:
    """One training step has ended: the shim classifies memory, and on a time-sliced GPU
    the task releases its cached memory or yields its turn when asked. Returns the
    shim's flags (0: nothing to do, or not in a task)."""
    from gpushare import iterations

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
    from gpushare import iterations

    iterations.mark_persistent(dptr)
