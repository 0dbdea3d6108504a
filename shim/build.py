"""How the shim and the ledger bindings are built; used by setup.py and the Makefile.

- ``libgpushare.so``: the preload shim. Plain C with no libpython, since it is
  loaded into every program a task runs.
- the simulated driver and NVML are built by ``sim/build.py`` with the same
  flags (``link`` below).
- ``nodemgr._ledger``: cffi bindings to the ledger (``ledger.c``,
  ``ledger_access.c``'s reads and ``ledger_compute.c``'s schedules and board),
  declared from the same headers the shim is compiled with.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent

WARN = ["-Wall", "-Wextra", "-Werror"]
# -Wmissing-prototypes: a function is static, or declared in the header its callers share.
COMMON = ["-std=gnu11", "-fPIC", "-fvisibility=hidden", *WARN, "-Wmissing-prototypes"]
RELEASE = ["-O2", "-g"]
SANITIZERS = {"address": "address,undefined", "thread": "thread"}


# The shim's translation units; shim.h lists what each holds.
SHIM_SOURCES = (
    "cuda_hook.c",
    "pool_hook.c",
    "vmm_hook.c",
    "dispatch.c",
    "process.c",
    "accounting.c",
    "pools.c",
    "graph_mem.c",
    "alloc_map.c",
    "iteration.c",
    "ledger.c",
    "ledger_access.c",
    "ledger_compute.c",
    "pacer.c",
    "dlsym_x86_64.S",
)


def _debug_flags(sanitizer: str) -> list[str]:
    return ["-O1", "-g", "-fno-omit-frame-pointer", f"-fsanitize={SANITIZERS[sanitizer]}"]


def _cc() -> list[str]:
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return shlex.split(cc)[:1]


def link(
    out: Path, sources: list[Path], flags: list[str], ldflags: list[str], debug: str | None
) -> None:
    """Compile and link one shared library; debug names a sanitizer build."""
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        *_cc(),
        *COMMON,
        *(_debug_flags(debug) if debug else RELEASE),
        *flags,
        "-shared",
        "-o",
        str(out),
        *[str(s) for s in sources],
        *ldflags,
        *([] if debug else ["-Wl,-z,defs"]),
    ]
    print(" ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True)


def build_native(out_dir: Path, debug: str | None = None, coverage: bool = False) -> list[Path]:
    """Compile the shim into ``out_dir``; return the file.

    ``debug`` names a sanitizer build ("address": ASan+UBSan, "thread": TSan).
    ``coverage`` adds gcc's ``--coverage``: beside the library, a ``.gcno`` per C source
    (``libgpushare.so-SOURCE.gcno``), and a ``.gcda`` that each process using the library
    adds its counts to when it exits (tests/c_coverage.py reads them).
    """
    shim = out_dir / "libgpushare.so"
    # An earlier build's counts, or the notes of a source since removed, would otherwise be
    # read as this build's.
    for old in out_dir.glob(f"{shim.name}-*.gc*"):
        old.unlink()
    link(
        shim,
        [HERE / s for s in SHIM_SOURCES],
        ["--coverage"] if coverage else [],
        [f"-Wl,--version-script={HERE / 'shim.map'}", "-ldl", "-lpthread"],
        debug,
    )
    return [shim]


def _cdef() -> str:
    return (HERE / "ledger_layout.h").read_text() + (HERE / "ledger_api.h").read_text()


ffibuilder = FFI()
ffibuilder.cdef(_cdef())
ffibuilder.set_source(
    "nodemgr._ledger",
    '#include "ledger.h"',
    sources=[
        os.path.relpath(HERE / s) for s in ("ledger.c", "ledger_access.c", "ledger_compute.c")
    ],
    include_dirs=[os.path.relpath(HERE)],
    extra_compile_args=["-std=gnu11", *WARN, "-Wno-unused-parameter"],
)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, required=True, help="directory for the libraries")
    ap.add_argument(
        "--debug",
        nargs="?",
        const="address",
        choices=sorted(SANITIZERS),
        help="sanitizer build: address (ASan+UBSan, the default) or thread (TSan)",
    )
    ap.add_argument(
        "--coverage",
        action="store_true",
        help="gcc's line and branch counting (gcov) in the shim",
    )
    args = ap.parse_args()
    for path in build_native(args.out, args.debug, args.coverage):
        print(path)
