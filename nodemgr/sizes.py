"""Byte sizes as operators write them: ``8GiB``, ``512MiB``, ``1.5G``, ``1048576``."""

from __future__ import annotations

import re

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
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?|\.\d+)\s*([a-zA-Z]*)\s*$")
MAX_SIZE = (1 << 63) - 1


def parse_size(text: str | int) -> int:
    """Return the number of bytes ``text`` names; raise ValueError with the accepted forms.

    Decimal units (``G``, ``GB``) are powers of 1000 and binary units (``GiB``)
    powers of 1024, as on disk labels and in ``nvidia-smi``.
    """
    if isinstance(text, bool):
        raise ValueError(f"not a size: {text!r}")
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE.match(text)
        unit = m.group(2).lower() if m else ""
        if not m or unit not in _UNITS:
            raise ValueError(
                f"not a size: {text!r} (use bytes or a number with a unit: 512MiB, 8GiB, 1.5G, 1TB)"
            )
        number = float(m.group(1)) if "." in m.group(1) else int(m.group(1))
        value = int(number * _UNITS[unit])
    if value < 0 or value > MAX_SIZE:
        raise ValueError(f"size out of range: {text!r}")
    return value


def format_size(n: int) -> str:
    """Render bytes in the largest binary unit that keeps the number readable."""
    for unit, factor in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= factor:
            value = n / factor
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.2f}{unit}"
    return f"{n}B"
