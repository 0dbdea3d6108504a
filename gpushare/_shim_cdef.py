"""The shim's public API (shim/gpushare.h) as cffi declarations, for ABI mode.

The declarations are the header's own: the lines between its ``cffi-cdef begin``
and ``cffi-cdef end`` marks, plain C that cffi's parser reads (it cannot read the
header's preprocessor lines). The wheel ships the header beside this module
(setup.py); run from a source checkout, the shim's copy is read.
"""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent


def _header() -> str:
    shipped = _HERE / "gpushare.h"
    source = _HERE.parent / "shim" / "gpushare.h"
    return (shipped if shipped.exists() else source).read_text()


def _marked(header: str) -> str:
    """The part of ``header`` between its cffi-cdef marks, the mark lines left out."""
    begin = header.index("/* cffi-cdef begin")
    end = header.index("/* cffi-cdef end */")
    return header[header.index("\n", begin) + 1 : end]


CDEF = _marked(_header())
