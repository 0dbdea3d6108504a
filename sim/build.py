"""How the simulated driver and NVML are built; used by setup.py and the Makefile.

- ``sim/libcuda.so.1``: the simulated CUDA driver for machines without NVIDIA GPUs.
- ``sim/libnvidia-ml.so.1``: the simulated NVML beside it, describing the same
  devices (both read them through ``sim_spec.c``, their attributes through
  ``sim_attrs.c``) and the processes using them (``sim_usage.c``: the driver
  records them in a node-wide table, NVML lists them).

Both go into ``<out>/sim``; the driver ABI header they share with the shim is
``shim/cuda_abi.h``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "shim"))
import build as shim_build  # noqa: E402  (the compiler flags live there)

# Each library: its sources (beside this file) and its version script.
# The driver stays loaded once loaded (-z nodelete): see sim_cuda.c on exit.
LIBRARIES = {
    "libcuda.so.1": (
        [
            "sim_registry.c",
            "sim_cuda.c",
            "sim_ctx.c",
            "sim_entry.c",
            "sim_heap.c",
            "sim_pools.c",
            "sim_vmm.c",
            "sim_host.c",
            "sim_ipc.c",
            "sim_copy.c",
            "sim_streams.c",
            "sim_graphs.c",
            "sim_events.c",
            "sim_timeline.c",
            "sim_modules.c",
            "sim_exports.c",
            "sim_tables.c",
            "sim_trace.c",
            "sim_spec.c",
            "sim_attrs.c",
            "sim_usage.c",
        ],
        "sim_cuda.map",
    ),
    "libnvidia-ml.so.1": (
        ["sim_nvml.c", "sim_spec.c", "sim_attrs.c", "sim_usage.c"],
        "sim_nvml.map",
    ),
}


def build_sim(out_dir: Path, debug: str | None = None) -> list[Path]:
    """Compile the simulated driver and NVML into ``out_dir/sim``; return the files.

    ``debug`` names a sanitizer build, as for the shim (shim/build.py).
    """
    built = []
    for name, (sources, script) in LIBRARIES.items():
        lib = out_dir / "sim" / name
        shim_build.link(
            lib,
            [HERE / s for s in sources],
            [f"-I{shim_build.HERE}"],
            [
                "-Wl,-Bsymbolic",
                "-Wl,-z,nodelete",
                f"-Wl,--version-script={HERE / script}",
                f"-Wl,-soname,{name}",
                "-lpthread",
            ],
            debug,
        )
        built.append(lib)
    return built


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, required=True, help="directory for the libraries")
    ap.add_argument("--debug", nargs="?", const="address", choices=sorted(shim_build.SANITIZERS))
    args = ap.parse_args()
    for path in build_sim(args.out, args.debug):
        print(path)
