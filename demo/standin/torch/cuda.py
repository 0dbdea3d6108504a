"""torch.cuda of the stand-in: a caching allocator over the driver API."""

from __future__ import annotations

import ctypes

_cu: ctypes.CDLL | None = None
_cache: dict[int, list[int]] = {}  # size -> free device pointers, kept for reuse
_sizes: dict[int, int] = {}  # live device pointer -> size


class OutOfMemoryError(RuntimeError):
    pass


def _check(what: str, rc: int) -> None:
    if rc == 2:  # CUDA_ERROR_OUT_OF_MEMORY
        raise OutOfMemoryError(f"{what}: out of memory")
    if rc:
        raise RuntimeError(f"{what}: CUDA error {rc}")


def _driver() -> ctypes.CDLL:
    global _cu
    if _cu is None:
        cu = ctypes.CDLL("libcuda.so.1")
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        _check("cuInit", cu.cuInit(0))
        _check("cuDeviceGet", cu.cuDeviceGet(ctypes.byref(dev), 0))
        _check("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
        _check("cuCtxSetCurrent", cu.cuCtxSetCurrent(ctx))
        _cu = cu
    return _cu


def is_initialized() -> bool:
    return _cu is not None


def alloc(nbytes: int) -> int:
    """A block of ``nbytes``: a cached one of that size, else a new one from the driver."""
    cu = _driver()
    free = _cache.get(nbytes)
    if free:
        ptr = free.pop()
    else:
        p = ctypes.c_uint64()
        _check("cuMemAlloc", cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(nbytes)))
        ptr = p.value
    _sizes[ptr] = nbytes
    return ptr


def free(ptr: int) -> None:
    """Back to the cache, not to the driver (as PyTorch's allocator does)."""
    _cache.setdefault(_sizes.pop(ptr), []).append(ptr)


def launch() -> None:
    """One kernel launch (a handle the simulated driver accepts)."""
    _check(
        "cuLaunchKernel",
        _driver().cuLaunchKernel(ctypes.c_void_p(1), 1, 1, 1, 1, 1, 1, 0, None, None, None),
    )


def current_device() -> int:
    return 0  # the stand-in uses device 0 only


def device_count() -> int:
    return 1


def memory_reserved(device: int | None = None) -> int:
    """What the allocator holds from the driver: live blocks and cached ones."""
    del device  # one device
    return sum(_sizes.values()) + sum(size * len(ptrs) for size, ptrs in _cache.items())


def synchronize(device: int | None = None) -> None:
    del device  # one device
    _check("cuCtxSynchronize", _driver().cuCtxSynchronize())


def empty_cache() -> None:
    """Give every cached block back to the driver."""
    if _cu is None:
        return
    for ptrs in _cache.values():
        for ptr in ptrs:
            _check("cuMemFree", _cu.cuMemFree_v2(ctypes.c_uint64(ptr)))
    _cache.clear()
