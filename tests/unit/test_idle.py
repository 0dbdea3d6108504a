"""The idle policy's words (nodemgr.policy.idle): the numbers a warned user reads add up."""

from __future__ import annotations

import math
import re

import pytest

from gpushare.sizes import format_duration as duration
from nodemgr.policy.idle import RECLAIM, Policy, warning

_CLOCK = re.compile(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?")


def seconds(text: str) -> int:
    """A duration as gpushare.sizes.format_duration writes it, back in seconds."""
    m = _CLOCK.fullmatch(text)
    assert m is not None and text, text
    h, mi, s = (int(g or 0) for g in m.groups())
    return h * 3600 + mi * 60 + s


def said(idle: float, policy: Policy) -> tuple[int, int, int]:
    """The idle time, the time left and the timeout a warning gives, in seconds."""
    m = re.search(
        r"no kernel for (\S+): its GPUs are reclaimed in (\S+) unless .* is (\S+)\)$",
        warning(idle, policy, "t1"),
    )
    assert m is not None
    spent, left, timeout = (seconds(g) for g in m.groups())
    return spent, left, timeout


@pytest.mark.parametrize("timeout", [3.0, 60.0, 600.0, 3599.0, 3600.0, 7200.0])
@pytest.mark.parametrize("into_warning", [0.0, 0.1, 0.5, 0.99, 1.0, 1.5, 2.999])
def test_a_warning_s_idle_time_and_time_left_add_up_to_the_timeout(
    timeout: float, into_warning: float
) -> None:
    """Warned ``warn_before`` (3 s) ahead, at any moment of the warning's span, the time
    left is rounded up (never "in 0s" while time is left, never beyond warn_before) and the
    idle time down, so under an hour the two make the timeout; from an hour on the idle
    time is said in whole minutes."""
    policy = Policy(timeout, 3.0, RECLAIM)
    idle = timeout - policy.warn_before + into_warning
    spent, left, said_timeout = said(idle, policy)
    assert said_timeout == timeout
    assert left == math.ceil(timeout - idle) and 0 < left <= policy.warn_before
    if idle < 3600:
        assert spent + left == timeout, warning(idle, policy, "t1")
    else:
        assert spent == idle // 60 * 60


def test_durations_read_back() -> None:
    written = ["0s", "59s", "1m", "12m07s", "2h05m"]
    assert [duration(x) for x in (0.4, 59.9, 60, 727, 7500)] == written
    assert [seconds(x) for x in written] == [0, 59, 60, 727, 7500]
