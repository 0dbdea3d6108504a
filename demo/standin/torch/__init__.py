"""A stand-in for PyTorch on gpushare's simulated driver (demo, tests, benchmarks).

It has just enough of torch's surface for gpushare's hooks: ``torch.optim``
with optimizer step post-hooks, and ``torch.cuda`` with a caching allocator
over the CUDA driver API (``synchronize``, ``empty_cache``,
``is_initialized``). Memory is taken with ``cuMemAlloc_v2`` and kernels are
``cuLaunchKernel`` calls the simulated driver accepts, so the gpushare shim
sees what it would see under PyTorch: blocks cached across steps and given
back only by ``empty_cache``.
"""

from torch import cuda, optim

__all__ = ["cuda", "optim"]
__version__ = "0.0-standin"
