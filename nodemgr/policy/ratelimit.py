"""Rate limits, as pure policies over a clock the caller reads: token buckets for requests
(an environment's `view`s, docs/protocol.md "Connections") and a throttle for log lines an
environment's user can provoke at will (docs/operations.md, "Storage faults")."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

# Seconds between two lines of the same kind about one environment, for the lines its
# user can provoke in a loop (a ledger or socket replaced: docs/operations.md).
ENV_LOG_INTERVAL = 60.0


@dataclass
class _Bucket:
    tokens: float
    at: float  # when ``tokens`` was last brought up to date (the caller's clock)


class TokenBuckets:
    """One token bucket per key: ``rate`` tokens a second, at most ``burst`` kept; a bucket
    starts full. ``take(key, now)`` spends a token if there is one."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate = rate
        self.burst = float(burst)
        self._buckets: dict[str, _Bucket] = {}

    def take(self, key: str, now: float) -> bool:
        b = self._buckets.get(key)
        if b is None:
            b = self._buckets[key] = _Bucket(self.burst, now)
        elif now > b.at:
            b.tokens = min(self.burst, b.tokens + (now - b.at) * self.rate)
            b.at = now
        if b.tokens < 1.0:
            return False
        b.tokens -= 1.0
        return True

    def forget(self, key: str) -> None:
        self._buckets.pop(key, None)


class LogThrottle:
    """At most one line per key per ``interval`` seconds. ``allow(key, now)`` returns None
    while the line is to be suppressed (and counts it), else how many were suppressed since
    the last line said."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._said: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def allow(self, key: str, now: float) -> int | None:
        last = self._said.get(key)
        if last is not None and now - last < self.interval:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return None
        self._said[key] = now
        return self._suppressed.pop(key, 0)


def suppressed_note(count: int) -> str:
    """What a throttled line adds about the lines suppressed since the last one."""
    if not count:
        return ""
    return f" ({count} more like it since the last such line, not logged)"


def log_throttled(
    logger: logging.Logger, throttle: LogThrottle, key: str, level: int, message: str
) -> None:
    """Log ``message`` unless ``throttle`` holds lines of ``key`` back now; a line said
    counts those held back since the last."""
    suppressed = throttle.allow(key, time.monotonic())
    if suppressed is not None:
        logger.log(level, "%s%s", message, suppressed_note(suppressed))
