"""Byte sizes and durations as operators write them: ``8GiB``, ``512MiB``, ``1.5G``,
``1048576``; ``2.5`` seconds. The one parser of each, for the config, the CLIs and the
environment variables alike."""

from __future__ import annotations

import math
import re
from decimal import Decimal

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1 << 40,
}
# ASCII only: Python's \d and int() also take other scripts' digits (full-width ones).
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?|\.\d+)\s*([a-zA-Z]*)\s*$", re.ASCII)
_SECONDS = re.compile(r"^\s*(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?\s*$", re.ASCII)
MAX_SIZE = (1 << 63) - 1
MiB = 1 << 20
SIZE_FORMS = "bytes or a number with a unit: 512MiB, 8GiB, 1.5G, 1TB"


def _shown(value: object) -> str:
    """``value`` as an error message quotes it: whole unless very long."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:30]}...({len(text)} characters)"


def parse_size(text: str | int) -> int:
    """Return the number of bytes ``text`` names; raise ValueError with the accepted forms.

    Decimal units (``G``, ``GB``) are powers of 1000 and binary units (``GiB``)
    powers of 1024, as on disk labels and in ``nvidia-smi``.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = _SIZE.match(text) if isinstance(text, str) else None
        unit = m.group(2).lower() if m else ""
        if not m or unit not in _UNITS:
            raise ValueError(f"not a size: {_shown(text)} (use {SIZE_FORMS})")
        # Decimal, not float: a long number stays a number (float makes it inf) and
        # 1.5G is exactly 1,500,000,000.
        value = int(Decimal(m.group(1)) * _UNITS[unit])
    if value < 0 or value > MAX_SIZE:
        raise ValueError(f"size out of range: {_shown(text)} (0 to {MAX_SIZE} bytes)")
    return value


def unitless(text: str) -> bool:
    """Whether a size as written has no unit (``12``: bytes), as opposed to ``12GiB``."""
    m = _SIZE.match(text)
    return m is not None and m.group(2) == ""


def parse_seconds(value: object, low: float, high: float) -> float:
    """A duration in seconds from ``low`` to ``high``: a number, or a string of one written
    with ASCII digits (``2``, ``0.5``, ``1e-3``); never NaN or infinite. Raise ValueError
    saying the accepted range."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    text = isinstance(value, str) and _SECONDS.match(value) is not None
    seconds = float(value) if number or text else math.nan  # type: ignore[arg-type]
    if not (math.isfinite(seconds) and low <= seconds <= high):
        raise ValueError(f"{_shown(value)} is not a number of seconds from {low:g} to {high:g}")
    return seconds


def format_size(n: int) -> str:
    """Render bytes in the largest binary unit that keeps the number readable."""
    for unit, factor in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= factor:
            value = n / factor
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.2f}{unit}"
    return f"{n}B"


def plural(count: int, noun: str) -> str:
    """``1 GPU``, ``2 GPUs``: a count with its noun."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def format_clock(seconds: float) -> str:
    """``42s``, ``3m07s``, ``2h05m``: a duration as a waiting user reads it (whole seconds,
    rounded down)."""
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def format_duration(seconds: float) -> str:
    """A short duration: 45s, 12m (a timeout is often whole minutes), 12m07s, 2h05m."""
    text = format_clock(max(0.0, seconds))
    return text.removesuffix("00s") if text.endswith("m00s") else text
