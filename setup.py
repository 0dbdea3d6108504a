"""Package build: the cffi ledger bindings, the shim, and the simulated driver and NVML.

The preload library cannot be a Python extension (it must not need
libpython), so build_ext compiles it beside the cffi module and ships it in
gpushare/lib, where gpushare-run finds it.
"""

import importlib.util
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

sys.path.insert(0, str(Path(__file__).resolve().parent / "shim"))
import build as shim_build

# sim/build.py is loaded by path: both build scripts are called build.py.
_spec = importlib.util.spec_from_file_location(
    "sim_build", Path(__file__).parent / "sim" / "build.py"
)
assert _spec and _spec.loader
sim_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sim_build)


class BuildExt(build_ext):
    def run(self) -> None:
        super().run()
        root = Path(".") if self.inplace else Path(self.build_lib)
        shim_build.build_native(root / "gpushare" / "lib")
        sim_build.build_sim(root / "gpushare" / "lib")


# The auto-loader's start-up hook: site runs `import` lines of .pth files in
# site-packages at every interpreter start. The line does nothing unless
# GPUSHARE_AUTOLOAD is on, so it must sit at the root of site-packages.
AUTOLOAD_PTH = "gpushare-autoload.pth"
SHIM_HEADER = "shim/gpushare.h"


class BuildPy(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(AUTOLOAD_PTH, str(Path(self.build_lib) / AUTOLOAD_PTH))
        # The shim's public header: gpushare._shim_cdef reads its cffi declarations.
        self.copy_file(SHIM_HEADER, str(Path(self.build_lib) / "gpushare" / "gpushare.h"))


setup(
    cffi_modules=["shim/build.py:ffibuilder"],
    cmdclass={"build_ext": BuildExt, "build_py": BuildPy},
)
