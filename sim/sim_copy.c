/*
 * The simulated driver's copies and memsets: they move real bytes between
 * the device heaps, mapped reservations and host memory.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <linux/falloc.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "sim_driver.h"
#include "sim_memory.h"
#include "sim_usage.h"

/*
 * Whether [p, p + n) lies in one allocation the driver knows, or in mapped
 * memory of one reservation (expandable segments map many handles side by
 * side, and copies run across them).
 */
bool sim_range_known(uintptr_t p, size_t n)
{
	struct sim_ptr info;

	if (!p || !sim_ptr_find(p, &info))
		return false;
	return n <= info.size - (p - info.base) || sim_va_covers(p, n);
}

/*
 * What this process's copies moved (gpushareSimCopyCounters, docs/simulator.md): bytes
 * host to device, device to host, device to device, and the copies to the host (each
 * one a read of a device result the program waits for or acts on). Counted when a copy
 * is submitted: a copy recorded into a graph counts once, at its capture. Relaxed
 * atomics: each is a count of its own, read for a report.
 */
enum {
	SIM_COPIED_H2D,
	SIM_COPIED_D2H,
	SIM_COPIED_D2D,
	SIM_COPIES_D2H,
	SIM_COPY_COUNTERS
};
static uint64_t sim_copied[SIM_COPY_COUNTERS];

/* Device memory: an allocation of a device, or a mapping in a reservation (cuMemMap). */
static bool sim_is_device(uintptr_t p)
{
	struct sim_ptr info;

	if (sim_ptr_find(p, &info))
		return info.type == CU_MEMORYTYPE_DEVICE;
	return sim_va_covers(p, 1);
}

static void sim_count_copy(bool dst_dev, bool src_dev, uint64_t n)
{
	if (src_dev && dst_dev)
		__atomic_fetch_add(&sim_copied[SIM_COPIED_D2D], n, __ATOMIC_RELAXED);
	else if (dst_dev)
		__atomic_fetch_add(&sim_copied[SIM_COPIED_H2D], n, __ATOMIC_RELAXED);
	else if (src_dev) {
		__atomic_fetch_add(&sim_copied[SIM_COPIED_D2H], n, __ATOMIC_RELAXED);
		__atomic_fetch_add(&sim_copied[SIM_COPIES_D2H], 1, __ATOMIC_RELAXED);
	}
}

/*
 * The simulator's own: this process's copy counters, in the order of the enum above,
 * the first `count` of them (at most SIM_COPY_COUNTERS; the rest of `out` is left as
 * it is). Not in cuda.h: found with dlsym on libcuda's handle.
 */
SIM_EXPORT CUresult gpushareSimCopyCounters(unsigned long long *out, unsigned int count);
SIM_EXPORT CUresult gpushareSimCopyCounters(unsigned long long *out, unsigned int count)
{
	return sim_counters_out(out, count, sim_copied, SIM_COPY_COUNTERS);
}

CUresult sim_counters_out(unsigned long long *out, unsigned int count, const uint64_t *counters,
			  unsigned int n)
{
	if (out == NULL)
		return CUDA_ERROR_INVALID_VALUE;
	for (unsigned int i = 0; i < count && i < n; i++)
		out[i] = __atomic_load_n(&counters[i], __ATOMIC_RELAXED);
	return CUDA_SUCCESS;
}

/* Copies. Device sides must lie in device (or page-locked) memory. */

/* SIM_SYNC as the stream: a synchronous copy or memset, on the legacy stream and waited for. */
#define SIM_SYNC ((CUstream)(uintptr_t)-1)

static CUresult sim_stream_op(CUstream stream, const struct sim_op *op)
{
	return stream == SIM_SYNC ? sim_stream_do_sync(op) : sim_stream_do(stream, op);
}

static CUresult sim_copy(uintptr_t dst, uintptr_t src, size_t n, bool dst_dev, bool src_dev,
			 CUstream stream)
{
	struct sim_op op = { .kind = SIM_OP_COPY, .dst = dst, .src = src, .width = n, .height = 1 };
	CUresult rc;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (n == 0)
		return CUDA_SUCCESS;
	if (!dst || !src || (dst_dev && !sim_range_known(dst, n)) ||
	    (src_dev && !sim_range_known(src, n)))
		return CUDA_ERROR_INVALID_VALUE;
	rc = sim_stream_op(stream, &op);
	if (rc != CUDA_SUCCESS)
		return rc;
	/* A unified copy (cuMemcpy, neither side said) is told by its addresses. */
	if (!dst_dev && !src_dev)
		sim_count_copy(sim_is_device(dst), sim_is_device(src), n);
	else
		sim_count_copy(dst_dev, src_dev, n);
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n)
{
	return sim_copy(dst, src, n, false, false, SIM_SYNC);
}

CUresult sim_impl_cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream stream)
{
	return sim_copy(dst, src, n, false, false, stream);
}

CUresult sim_impl_cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n)
{
	return sim_copy(dst, (uintptr_t)src, n, true, false, SIM_SYNC);
}

CUresult sim_impl_cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream stream)
{
	return sim_copy(dst, (uintptr_t)src, n, true, false, stream);
}

CUresult sim_impl_cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n)
{
	return sim_copy((uintptr_t)dst, src, n, false, true, SIM_SYNC);
}

CUresult sim_impl_cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream stream)
{
	return sim_copy((uintptr_t)dst, src, n, false, true, stream);
}

CUresult sim_impl_cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n)
{
	return sim_copy(dst, src, n, true, true, SIM_SYNC);
}

CUresult sim_impl_cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream stream)
{
	return sim_copy(dst, src, n, true, true, stream);
}

/* Every device shares one address space here, so a peer copy is a copy. */
CUresult sim_impl_cuMemcpyPeer(CUdeviceptr dst, CUcontext dctx, CUdeviceptr src, CUcontext sctx,
			       size_t n)
{
	(void)dctx, (void)sctx;
	return sim_copy(dst, src, n, true, true, SIM_SYNC);
}

CUresult sim_impl_cuMemcpyPeerAsync(CUdeviceptr dst, CUcontext dctx, CUdeviceptr src,
				    CUcontext sctx, size_t n, CUstream stream)
{
	(void)dctx, (void)sctx;
	return sim_copy(dst, src, n, true, true, stream);
}

/*
 * One side of one slice of a 2D/3D copy: its first byte, checked with the
 * rows it spans. Device memory must lie in one allocation (or adjacent
 * mappings) the driver handed out; unified addresses the driver knows are
 * checked the same way, others are pageable host memory, which no driver
 * can check. Arrays are not supported.
 */
static CUresult sim_copy_side(int type, const void *host, CUdeviceptr dev, size_t x, size_t y,
			      size_t z, size_t pitch, size_t height, size_t width, size_t rows,
			      uintptr_t *out)
{
	size_t off, extent;
	struct sim_ptr info;
	uintptr_t base;

	switch (type) {
	case CU_MEMORYTYPE_HOST:
		base = (uintptr_t)host;
		break;
	case CU_MEMORYTYPE_DEVICE:
	case CU_MEMORYTYPE_UNIFIED:
		base = dev;
		break;
	case CU_MEMORYTYPE_ARRAY:
		return CUDA_ERROR_NOT_SUPPORTED;
	default:
		return CUDA_ERROR_INVALID_VALUE;
	}
	if (!base || __builtin_mul_overflow(z, height, &off) ||
	    __builtin_add_overflow(off, y, &off) || __builtin_mul_overflow(off, pitch, &off) ||
	    __builtin_add_overflow(off, x, &off) || __builtin_add_overflow(base, off, out) ||
	    __builtin_mul_overflow(rows - 1, pitch, &extent) ||
	    __builtin_add_overflow(extent, width, &extent))
		return CUDA_ERROR_INVALID_VALUE;
	if (type == CU_MEMORYTYPE_HOST ||
	    (type == CU_MEMORYTYPE_UNIFIED && !sim_ptr_find(*out, &info)))
		return CUDA_SUCCESS;
	return sim_range_known(*out, extent) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

static CUresult sim_copy3d(const CUDA_MEMCPY3D *p, CUstream stream)
{
	struct sim_op op = { .kind = SIM_OP_COPY };
	uintptr_t dst, src, first_dst = 0, first_src = 0;
	size_t z, depth;
	CUresult rc;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!p)
		return CUDA_ERROR_INVALID_VALUE;
	if (p->WidthInBytes == 0 || p->Height == 0)
		return CUDA_SUCCESS;
	depth = p->Depth ? p->Depth : 1;
	if ((p->srcMemoryType != CU_MEMORYTYPE_ARRAY &&
	     p->srcPitch < p->WidthInBytes + p->srcXInBytes) ||
	    (p->dstMemoryType != CU_MEMORYTYPE_ARRAY &&
	     p->dstPitch < p->WidthInBytes + p->dstXInBytes))
		return CUDA_ERROR_INVALID_VALUE;
	for (z = 0; z < depth; z++) {
		rc = sim_copy_side(p->srcMemoryType, p->srcHost, p->srcDevice, p->srcXInBytes,
				   p->srcY, p->srcZ + z, p->srcPitch, p->srcHeight, p->WidthInBytes,
				   p->Height, &src);
		if (rc == CUDA_SUCCESS)
			rc = sim_copy_side(p->dstMemoryType, p->dstHost, p->dstDevice,
					   p->dstXInBytes, p->dstY, p->dstZ + z, p->dstPitch,
					   p->dstHeight, p->WidthInBytes, p->Height, &dst);
		if (rc != CUDA_SUCCESS)
			return rc;
		if (z == 0) {
			first_dst = dst;
			first_src = src;
		}
		op.dst = dst;
		op.src = src;
		op.width = p->WidthInBytes;
		op.height = p->Height;
		op.dpitch = p->dstPitch;
		op.spitch = p->srcPitch;
		rc = sim_stream_op(stream, &op);
		if (rc != CUDA_SUCCESS)
			return rc;
	}
	/* One copy, one read at most, whatever its depth: the sides of its first slice say. */
	sim_count_copy(sim_is_device(first_dst), sim_is_device(first_src),
		       (uint64_t)p->WidthInBytes * p->Height * depth);
	return CUDA_SUCCESS;
}

static CUresult sim_copy2d(const CUDA_MEMCPY2D *p, CUstream stream)
{
	CUDA_MEMCPY3D q;

	if (!p)
		return CUDA_ERROR_INVALID_VALUE;
	memset(&q, 0, sizeof(q));
	q.srcXInBytes = p->srcXInBytes;
	q.srcY = p->srcY;
	q.srcMemoryType = p->srcMemoryType;
	q.srcHost = p->srcHost;
	q.srcDevice = p->srcDevice;
	q.srcArray = p->srcArray;
	q.srcPitch = p->srcPitch;
	q.dstXInBytes = p->dstXInBytes;
	q.dstY = p->dstY;
	q.dstMemoryType = p->dstMemoryType;
	q.dstHost = p->dstHost;
	q.dstDevice = p->dstDevice;
	q.dstArray = p->dstArray;
	q.dstPitch = p->dstPitch;
	q.WidthInBytes = p->WidthInBytes;
	q.Height = p->Height;
	q.Depth = 1;
	return sim_copy3d(&q, stream);
}

CUresult sim_impl_cuMemcpy2D_v2(const CUDA_MEMCPY2D *p)
{
	return sim_copy2d(p, SIM_SYNC);
}

CUresult sim_impl_cuMemcpy2DUnaligned_v2(const CUDA_MEMCPY2D *p)
{
	return sim_copy2d(p, SIM_SYNC);
}

CUresult sim_impl_cuMemcpy2DAsync_v2(const CUDA_MEMCPY2D *p, CUstream stream)
{
	return sim_copy2d(p, stream);
}

CUresult sim_impl_cuMemcpy3D_v2(const CUDA_MEMCPY3D *p)
{
	return sim_copy3d(p, SIM_SYNC);
}

CUresult sim_impl_cuMemcpy3DAsync_v2(const CUDA_MEMCPY3D *p, CUstream stream)
{
	return sim_copy3d(p, stream);
}

/* Memsets: width elements of elem bytes in each of height rows pitch apart. */
static CUresult sim_memset(CUdeviceptr dst, size_t pitch, uint32_t value, unsigned int elem,
			   size_t width, size_t height, CUstream stream)
{
	struct sim_op op = { .kind = SIM_OP_SET,
			     .dst = dst,
			     .width = width,
			     .height = height,
			     .dpitch = pitch,
			     .value = value,
			     .elem = elem };
	size_t row, extent;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (width == 0 || height == 0)
		return CUDA_SUCCESS;
	if (__builtin_mul_overflow(width, elem, &row) ||
	    __builtin_mul_overflow(height - 1, pitch, &extent) ||
	    __builtin_add_overflow(extent, row, &extent))
		return CUDA_ERROR_INVALID_VALUE;
	if (dst % elem || pitch < row || !sim_range_known(dst, extent))
		return CUDA_ERROR_INVALID_VALUE;
	return sim_stream_op(stream, &op);
}

CUresult sim_impl_cuMemsetD8_v2(CUdeviceptr dst, unsigned char v, size_t n)
{
	return sim_memset(dst, n, v, 1, n, 1, SIM_SYNC);
}

CUresult sim_impl_cuMemsetD16_v2(CUdeviceptr dst, unsigned short v, size_t n)
{
	return sim_memset(dst, n * 2, v, 2, n, 1, SIM_SYNC);
}

CUresult sim_impl_cuMemsetD32_v2(CUdeviceptr dst, unsigned int v, size_t n)
{
	return sim_memset(dst, n * 4, v, 4, n, 1, SIM_SYNC);
}

CUresult sim_impl_cuMemsetD8Async(CUdeviceptr dst, unsigned char v, size_t n, CUstream s)
{
	return sim_memset(dst, n, v, 1, n, 1, s);
}

CUresult sim_impl_cuMemsetD16Async(CUdeviceptr dst, unsigned short v, size_t n, CUstream s)
{
	return sim_memset(dst, n * 2, v, 2, n, 1, s);
}

CUresult sim_impl_cuMemsetD32Async(CUdeviceptr dst, unsigned int v, size_t n, CUstream s)
{
	return sim_memset(dst, n * 4, v, 4, n, 1, s);
}

CUresult sim_impl_cuMemsetD2D8_v2(CUdeviceptr dst, size_t pitch, unsigned char v, size_t w,
				  size_t h)
{
	return sim_memset(dst, pitch, v, 1, w, h, SIM_SYNC);
}

CUresult sim_impl_cuMemsetD2D16_v2(CUdeviceptr dst, size_t pitch, unsigned short v, size_t w,
				   size_t h)
{
	return sim_memset(dst, pitch, v, 2, w, h, SIM_SYNC);
}

CUresult sim_impl_cuMemsetD2D32_v2(CUdeviceptr dst, size_t pitch, unsigned int v, size_t w,
				   size_t h)
{
	return sim_memset(dst, pitch, v, 4, w, h, SIM_SYNC);
}

CUresult sim_impl_cuMemsetD2D8Async(CUdeviceptr dst, size_t pitch, unsigned char v, size_t w,
				    size_t h, CUstream s)
{
	return sim_memset(dst, pitch, v, 1, w, h, s);
}

CUresult sim_impl_cuMemsetD2D16Async(CUdeviceptr dst, size_t pitch, unsigned short v, size_t w,
				     size_t h, CUstream s)
{
	return sim_memset(dst, pitch, v, 2, w, h, s);
}

CUresult sim_impl_cuMemsetD2D32Async(CUdeviceptr dst, size_t pitch, unsigned int v, size_t w,
				     size_t h, CUstream s)
{
	return sim_memset(dst, pitch, v, 4, w, h, s);
}

/* The per-thread default stream variants (SIM_SAME_AS). */
SIM_SAME_AS(cuMemcpy_ptds, cuMemcpy);
SIM_SAME_AS(cuMemcpyAsync_ptsz, cuMemcpyAsync);
SIM_SAME_AS(cuMemcpyHtoD_v2_ptds, cuMemcpyHtoD_v2);
SIM_SAME_AS(cuMemcpyHtoDAsync_v2_ptsz, cuMemcpyHtoDAsync_v2);
SIM_SAME_AS(cuMemcpyDtoH_v2_ptds, cuMemcpyDtoH_v2);
SIM_SAME_AS(cuMemcpyDtoHAsync_v2_ptsz, cuMemcpyDtoHAsync_v2);
SIM_SAME_AS(cuMemcpyDtoD_v2_ptds, cuMemcpyDtoD_v2);
SIM_SAME_AS(cuMemcpyDtoDAsync_v2_ptsz, cuMemcpyDtoDAsync_v2);
SIM_SAME_AS(cuMemcpyPeer_ptds, cuMemcpyPeer);
SIM_SAME_AS(cuMemcpyPeerAsync_ptsz, cuMemcpyPeerAsync);
SIM_SAME_AS(cuMemcpy2D_v2_ptds, cuMemcpy2D_v2);
SIM_SAME_AS(cuMemcpy2DUnaligned_v2_ptds, cuMemcpy2DUnaligned_v2);
SIM_SAME_AS(cuMemcpy2DAsync_v2_ptsz, cuMemcpy2DAsync_v2);
SIM_SAME_AS(cuMemcpy3D_v2_ptds, cuMemcpy3D_v2);
SIM_SAME_AS(cuMemcpy3DAsync_v2_ptsz, cuMemcpy3DAsync_v2);
SIM_SAME_AS(cuMemsetD8_v2_ptds, cuMemsetD8_v2);
SIM_SAME_AS(cuMemsetD16_v2_ptds, cuMemsetD16_v2);
SIM_SAME_AS(cuMemsetD32_v2_ptds, cuMemsetD32_v2);
SIM_SAME_AS(cuMemsetD2D8_v2_ptds, cuMemsetD2D8_v2);
SIM_SAME_AS(cuMemsetD2D16_v2_ptds, cuMemsetD2D16_v2);
SIM_SAME_AS(cuMemsetD2D32_v2_ptds, cuMemsetD2D32_v2);
SIM_SAME_AS(cuMemsetD8Async_ptsz, cuMemsetD8Async);
SIM_SAME_AS(cuMemsetD16Async_ptsz, cuMemsetD16Async);
SIM_SAME_AS(cuMemsetD32Async_ptsz, cuMemsetD32Async);
SIM_SAME_AS(cuMemsetD2D8Async_ptsz, cuMemsetD2D8Async);
SIM_SAME_AS(cuMemsetD2D16Async_ptsz, cuMemsetD2D16Async);
SIM_SAME_AS(cuMemsetD2D32Async_ptsz, cuMemsetD2D32Async);
