/*
 * Probes the simulated driver on its own (no shim) for test_sim_driver.py.
 * Prints observations, one "KEY VALUE" line each; the test holds the
 * expectations, so a wrong value shows up as a named key in its diff.
 *
 *   sim_probe mem       every allocation path, its way back and its errors,
 *                       streams, address reservations and mappings, what a
 *                       context's end frees, the launch entry points and the
 *                       old ABI variants
 *   sim_probe resolve   reads "gpa BASE VERSION FLAGS", "gpa1 BASE VERSION FLAGS"
 *                       and "sym NAME" lines from stdin; prints for each
 *                       "gpa BASE VERSION FLAGS RC STATUS VARIANT" (cuGetProcAddress_v2;
 *                       VARIANT is what dladdr names the returned pointer, "-" if
 *                       none), "gpa1 BASE VERSION FLAGS RC VARIANT" (cuGetProcAddress;
 *                       VARIANT "untouched" if *pfn kept its old value) or
 *                       "sym NAME VARIANT". A BASE of "-" asks for the empty name.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_abi.h"

/* The hooked entry points' prototypes, from the one list of them. */
#define GS_HOOK(abi, base, ver, ptsz, params) CUresult abi params;
#define GS_REAL(abi, params) CUresult abi params;
#include "hooks.def"

/* The CUDA 2.0-era variants hooks.def lists without prototypes. */
CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice dev);
CUresult cuMemGetInfo(unsigned int *free_bytes, unsigned int *total_bytes);
CUresult cuMemAlloc(unsigned int *dptr, unsigned int bytesize);
CUresult cuMemAllocPitch(unsigned int *dptr, unsigned int *pitch, unsigned int width,
			 unsigned int height, unsigned int elem);
CUresult cuMemFree(unsigned int dptr);
CUresult cuArrayCreate(CUarray *array, const void *desc);
CUresult cuArray3DCreate(CUarray *array, const void *desc);
CUresult cuCtxCreate(CUcontext *ctx, unsigned int flags, CUdevice dev);

/* Entry points the shim does not hook. */
CUresult cuCtxPushCurrent_v2(CUcontext ctx);
CUresult cuCtxPopCurrent_v2(CUcontext *ctx);
CUresult cuCtxDestroy_v2(CUcontext ctx);
CUresult cuCtxGetCurrent(CUcontext *ctx);
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev);
CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev);
CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active);
CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice dev);
CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev);
CUresult cuDeviceSetMemPool(CUdevice dev, CUmemoryPool pool);
CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props);
CUresult cuMemPoolDestroy(CUmemoryPool pool);
CUresult cuCtxSynchronize(void);
CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
				       int option);
CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
			     unsigned long long flags);
CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size);
CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
		  unsigned long long flags);
CUresult cuMemUnmap(CUdeviceptr ptr, size_t size);
CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count);
CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr);
CUresult cuStreamCreate(CUstream *stream, unsigned int flags);
CUresult cuStreamDestroy_v2(CUstream stream);
CUresult cuStreamGetCtx(CUstream stream, CUcontext *ctx);
CUresult cuStreamGetCtx_ptsz(CUstream stream, CUcontext *ctx);
CUresult cuStreamGetCtx_v2(CUstream stream, CUcontext *ctx, CUgreenCtx *green);
CUresult cuStreamSynchronize(CUstream stream);
CUresult cuStreamSynchronize_ptsz(CUstream stream);

#define MIB ((size_t)1 << 20)

static void out(const char *key, long long value)
{
	printf("%s %lld\n", key, value);
}

/*
 * Free bytes on a device, read through its primary context. The reference
 * taken is given back, so reading leaves the primary context as it was
 * (which, without other references, is destroyed again).
 */
static long long free_on(CUdevice dev)
{
	CUcontext ctx;
	size_t free_bytes = 0, total;

	if (cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS ||
	    cuCtxPushCurrent_v2(ctx) != CUDA_SUCCESS ||
	    cuMemGetInfo_v2(&free_bytes, &total) != CUDA_SUCCESS ||
	    cuCtxPopCurrent_v2(NULL) != CUDA_SUCCESS ||
	    cuDevicePrimaryCtxRelease_v2(dev) != CUDA_SUCCESS) {
		fprintf(stderr, "sim_probe: cannot read free memory of device %d\n", dev);
		exit(2);
	}
	return (long long)free_bytes;
}

/* "KEY.taken" and "KEY.back": what an allocation took and what its release left. */
static void taken(const char *key, CUdevice dev, long long before)
{
	char k[128];

	snprintf(k, sizeof(k), "%s.taken", key);
	out(k, before - free_on(dev));
}

/*
 * A synchronisation first: stream-ordered frees go back to their pool, which
 * gives them back to the device only then (as the driver's pools do, with
 * the default release threshold of 0).
 */
static void back(const char *key, CUdevice dev, long long before)
{
	char k[128];

	cuCtxSynchronize();

	snprintf(k, sizeof(k), "%s.back", key);
	out(k, before - free_on(dev));
}

/* "KEY": cuStreamGetCtx on stream; "KEY.same": whether it answered want. */
static void stream_ctx(const char *key, CUstream stream, CUcontext want)
{
	CUcontext c = NULL;
	char k[128];

	out(key, cuStreamGetCtx(stream, &c));
	snprintf(k, sizeof(k), "%s.same", key);
	out(k, c == want);
}

static void probe_linear(void)
{
	CUdeviceptr p = 0;
	size_t pitch = 0;
	long long f0 = free_on(0);

	out("pitch.rc", cuMemAllocPitch_v2(&p, &pitch, 1000, 100, 4));
	out("pitch.pitch", (long long)pitch);
	taken("pitch", 0, f0);
	out("pitch.free", cuMemFree_v2(p));
	back("pitch", 0, f0);
	out("pitch.elem3", cuMemAllocPitch_v2(&p, &pitch, 1000, 100, 3));
	out("pitch.elem32", cuMemAllocPitch_v2(&p, &pitch, 1000, 100, 32));
	out("pitch.width0", cuMemAllocPitch_v2(&p, &pitch, 0, 100, 4));
	out("pitch.nullpitch", cuMemAllocPitch_v2(&p, NULL, 1000, 100, 4));
	out("pitch.huge", cuMemAllocPitch_v2(&p, &pitch, (size_t)1 << 40, 1 << 20, 16));

	out("managed.rc", cuMemAllocManaged(&p, 3 * MIB, CU_MEM_ATTACH_GLOBAL));
	taken("managed", 0, f0);
	out("managed.free", cuMemFree_v2(p));
	back("managed", 0, f0);
	out("managed_host.rc", cuMemAllocManaged(&p, MIB, CU_MEM_ATTACH_HOST));
	out("managed_host.free", cuMemFree_v2(p));
	out("managed.flags0", cuMemAllocManaged(&p, MIB, 0));
	out("managed.flags3", cuMemAllocManaged(&p, MIB, 3));
	out("managed.size0", cuMemAllocManaged(&p, 0, CU_MEM_ATTACH_GLOBAL));
}

static void probe_async(void)
{
	CUstream stream = NULL;
	CUmemoryPool pool0 = NULL, pool1 = NULL, mine = NULL;
	CUmemPoolProps props = { 0 };
	CUdeviceptr p = 0, q = 0;
	long long f0 = free_on(0), f1 = free_on(1);

	out("async.stream", cuStreamCreate(&stream, 0));
	out("async.rc", cuMemAllocAsync(&p, 5 * MIB, stream));
	taken("async", 0, f0);
	out("async.free", cuMemFreeAsync(p, stream));
	taken("async.pooled", 0, f0);
	back("async", 0, f0);
	out("async_ptsz.rc", cuMemAllocAsync_ptsz(&p, 6 * MIB, NULL));
	taken("async_ptsz", 0, f0);
	out("async_ptsz.free", cuMemFreeAsync_ptsz(p, NULL));
	back("async_ptsz", 0, f0);
	out("async.size0", cuMemAllocAsync(&p, 0, stream));
	out("async.double_free", cuMemFreeAsync(p, stream));

	out("defpool.rc", cuDeviceGetDefaultMemPool(&pool0, 0));
	out("defpool1.rc", cuDeviceGetDefaultMemPool(&pool1, 1));
	out("defpool.baddev", cuDeviceGetDefaultMemPool(&pool0, 99));
	out("defpool.distinct", pool0 && pool1 && pool0 != pool1);
	/* The current context is on device 0; the pool decides the device. */
	out("frompool1.rc", cuMemAllocFromPoolAsync(&p, 7 * MIB, pool1, stream));
	taken("frompool1", 1, f1);
	taken("frompool1.dev0", 0, f0);
	out("frompool1.free", cuMemFreeAsync(p, stream));
	back("frompool1", 1, f1);
	out("frompool0_ptsz.rc", cuMemAllocFromPoolAsync_ptsz(&p, 2 * MIB, pool0, NULL));
	taken("frompool0_ptsz", 0, f0);
	out("frompool0_ptsz.free", cuMemFree_v2(p));
	back("frompool0_ptsz", 0, f0);
	out("frompool.madeup", cuMemAllocFromPoolAsync(&p, MIB, (CUmemoryPool)0x1000, stream));
	out("frompool.null", cuMemAllocFromPoolAsync(&p, MIB, NULL, stream));

	props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
	props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	props.location.id = 1;
	out("pool.create", cuMemPoolCreate(&mine, &props));
	out("pool.alloc", cuMemAllocFromPoolAsync(&q, 9 * MIB, mine, stream));
	taken("pool", 1, f1);
	/* Documented: what a destroyed pool handed out stays valid until freed. */
	out("pool.destroy", cuMemPoolDestroy(mine));
	taken("pool.after_destroy", 1, f1);
	out("pool.free", cuMemFreeAsync(q, stream));
	back("pool", 1, f1);
	out("pool.destroy_again", cuMemPoolDestroy(mine));
	out("pool.destroy_default", cuMemPoolDestroy(pool0));
	props.location.type = CU_MEM_LOCATION_TYPE_HOST;
	out("pool.host", cuMemPoolCreate(&mine, &props));
	props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	props.location.id = 99;
	out("pool.baddev", cuMemPoolCreate(&mine, &props));
	out("async.stream_destroy", cuStreamDestroy_v2(stream));
}

/*
 * Streams belong to the context current when they were made: a stream of
 * another device's context sends cuMemAllocAsync there, whatever is
 * current. ctx is the current context (device 0).
 */
static void probe_streams(CUcontext ctx)
{
	CUstream s = NULL, s1 = NULL, nb = NULL;
	CUcontext c = NULL, primary1 = NULL;
	CUgreenCtx g = (CUgreenCtx)0x1;
	CUmemoryPool pool0 = NULL, pool1 = NULL, cur = NULL, mine = NULL;
	CUmemPoolProps props = { 0 };
	CUdeviceptr p = 0;
	long long f0 = free_on(0), f1 = free_on(1);

	out("stream.create", cuStreamCreate(&s, 0));
	out("stream.create_nonblocking", cuStreamCreate(&nb, CU_STREAM_NON_BLOCKING));
	out("stream.destroy_nonblocking", cuStreamDestroy_v2(nb));
	out("stream.create_badflags", cuStreamCreate(&nb, 4));
	out("stream.create_null", cuStreamCreate(NULL, 0));
	stream_ctx("stream.getctx", s, ctx);
	out("stream.getctx_ptsz", cuStreamGetCtx_ptsz(s, &c));
	out("stream.getctx_ptsz.same", c == ctx);
	c = NULL;
	out("stream.getctx_v2", cuStreamGetCtx_v2(s, &c, &g));
	out("stream.getctx_v2.same", c == ctx && g == NULL);
	out("stream.getctx_v2.nullgreen", cuStreamGetCtx_v2(s, &c, NULL));
	out("stream.getctx_nullout", cuStreamGetCtx(s, NULL));
	stream_ctx("stream.getctx_default", NULL, ctx);
	stream_ctx("stream.getctx_legacy", CU_STREAM_LEGACY, ctx);
	stream_ctx("stream.getctx_per_thread", CU_STREAM_PER_THREAD, ctx);
	out("stream.getctx_madeup", cuStreamGetCtx((CUstream)0x5000, &c));
	out("stream.sync", cuStreamSynchronize(s));
	out("stream.sync_default", cuStreamSynchronize(NULL));
	out("stream.sync_ptsz", cuStreamSynchronize_ptsz(NULL));

	/* A stream of device 1's primary context, made there and used from here. */
	cuDevicePrimaryCtxRetain(&primary1, 1);
	cuCtxPushCurrent_v2(primary1);
	out("stream1.create", cuStreamCreate(&s1, 0));
	cuCtxPopCurrent_v2(NULL);
	out("stream1.getctx", cuStreamGetCtx(s1, &c));
	out("stream1.getctx.same", c == primary1);
	out("stream1.async", cuMemAllocAsync(&p, 3 * MIB, s1));
	taken("stream1.async", 1, f1);
	taken("stream1.async.dev0", 0, f0);
	out("stream1.free", cuMemFreeAsync(p, s1));
	back("stream1.async", 1, f1);
	out("stream1.async_ptsz", cuMemAllocAsync_ptsz(&p, 2 * MIB, s1));
	taken("stream1.async_ptsz", 1, f1);
	out("stream1.free_ptsz", cuMemFreeAsync_ptsz(p, s1));
	cuCtxSynchronize(); /* the pool gives the freed memory back */
	/* The pool decides the device, whatever the stream's is. */
	cuDeviceGetDefaultMemPool(&pool0, 0);
	out("stream1.frompool0", cuMemAllocFromPoolAsync(&p, 4 * MIB, pool0, s1));
	taken("stream1.frompool0", 0, f0);
	taken("stream1.frompool0.dev1", 1, f1);
	out("stream1.frompool0.free", cuMemFreeAsync(p, s1));
	cuCtxSynchronize(); /* the pool gives the freed memory back */
	out("stream1.destroy", cuStreamDestroy_v2(s1));
	cuDevicePrimaryCtxRelease_v2(1);

	out("stream.destroy", cuStreamDestroy_v2(s));
	out("stream.destroy_again", cuStreamDestroy_v2(s));
	out("stream.destroy_null", cuStreamDestroy_v2(NULL));
	out("stream.destroyed.getctx", cuStreamGetCtx(s, &c));
	out("stream.destroyed.sync", cuStreamSynchronize(s));
	out("stream.destroyed.async", cuMemAllocAsync(&p, MIB, s));
	out("stream.destroyed.frompool", cuMemAllocFromPoolAsync(&p, MIB, pool0, s));

	/* A device's current pool: its default one until set, and again after. */
	cuDeviceGetDefaultMemPool(&pool1, 1);
	out("mempool.get", cuDeviceGetMemPool(&cur, 0));
	out("mempool.get.default", cur == pool0);
	props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
	props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	props.location.id = 0;
	cuMemPoolCreate(&mine, &props);
	out("mempool.set", cuDeviceSetMemPool(0, mine));
	cuDeviceGetMemPool(&cur, 0);
	out("mempool.set.current", cur == mine);
	out("mempool.async", cuMemAllocAsync(&p, MIB, NULL));
	taken("mempool.async", 0, f0);
	out("mempool.async.free", cuMemFreeAsync(p, NULL));
	cuCtxSynchronize(); /* the pool gives the freed memory back */
	out("mempool.set_other_device", cuDeviceSetMemPool(1, mine));
	out("mempool.set_other_default", cuDeviceSetMemPool(0, pool1));
	out("mempool.set_null", cuDeviceSetMemPool(0, NULL));
	out("mempool.set_baddev", cuDeviceSetMemPool(99, mine));
	out("mempool.get_baddev", cuDeviceGetMemPool(&cur, 99));
	out("mempool.get_null", cuDeviceGetMemPool(NULL, 0));
	cuMemPoolDestroy(mine);
	cuDeviceGetMemPool(&cur, 0);
	out("mempool.after_destroy.default", cur == pool0);
	out("mempool.set_destroyed", cuDeviceSetMemPool(0, mine));
	out("mempool.set_default", cuDeviceSetMemPool(0, pool0));
}

static void probe_vmm(void)
{
	CUmemAllocationProp prop = { 0 };
	CUmemGenericAllocationHandle h = 0;
	size_t gran = 0;
	long long f1 = free_on(1);

	prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
	prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	prop.location.id = 1;
	out("gran.rc",
	    cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
	out("gran.min", (long long)gran);
	gran = 0;
	cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
	out("gran.recommended", (long long)gran);
	out("gran.badoption", cuMemGetAllocationGranularity(&gran, &prop, 7));

	out("create.rc", cuMemCreate(&h, 4 * gran, &prop, 0));
	out("create.nonzero", h != 0);
	taken("create", 1, f1);
	out("create.memfree", cuMemFree_v2((CUdeviceptr)h));
	out("create.release", cuMemRelease(h));
	back("create", 1, f1);
	out("create.release_again", cuMemRelease(h));
	out("create.release_madeup", cuMemRelease(0x1234));
	out("create.unaligned", cuMemCreate(&h, gran + 512, &prop, 0));
	out("create.size0", cuMemCreate(&h, 0, &prop, 0));
	out("create.flags", cuMemCreate(&h, gran, &prop, 1));
	out("create.oom", cuMemCreate(&h, (size_t)1 << 60, &prop, 0));
	prop.location.id = 99;
	out("create.baddev", cuMemCreate(&h, gran, &prop, 0));
	out("gran.baddev", cuMemGetAllocationGranularity(&gran, &prop, 0));
	prop.location.id = 1;
	prop.type = 0;
	out("create.badtype", cuMemCreate(&h, gran, &prop, 0));
	prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
	prop.location.type = CU_MEM_LOCATION_TYPE_HOST;
	out("create.host", cuMemCreate(&h, gran, &prop, 0));
}

/*
 * Reservations, mappings and references: a cuMemCreate allocation's memory
 * goes back only when its last reference is released and its last mapping
 * unmapped, in either order.
 */
/* cuMemRetainAllocationHandle takes its address as a pointer. */
static void *as_addr(CUdeviceptr p)
{
	return (void *)(uintptr_t)p;
}

static void probe_map(void)
{
	const size_t gran = 2 * MIB;
	CUmemAllocationProp prop = { 0 };
	CUmemAccessDesc acc = { { CU_MEM_LOCATION_TYPE_DEVICE, 1 },
				CU_MEM_ACCESS_FLAGS_PROT_READWRITE };
	CUmemGenericAllocationHandle h = 0, h2 = 0, a = 0, b = 0;
	CUdeviceptr va = 0, va2 = 0;
	long long f1 = free_on(1);

	prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
	prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	prop.location.id = 1;

	/* Documented: sizes and hints in host pages, alignments powers of two. */
	out("reserve.rc", cuMemAddressReserve(&va, 8 * gran, 0, 0, 0));
	out("reserve.granule_aligned", va && va % gran == 0);
	taken("reserve", 1, f1);
	out("reserve.page", cuMemAddressReserve(&va2, 4096, 0, 0, 0));
	out("reserve.page.free", cuMemAddressFree(va2, 4096));
	out("reserve.align64m", cuMemAddressReserve(&va2, gran, 64 * MIB, 0, 0));
	out("reserve.align64m.aligned", va2 % (64 * MIB) == 0);
	out("reserve.align64m.free", cuMemAddressFree(va2, gran));
	out("reserve.odd_size", cuMemAddressReserve(&va2, 1000, 0, 0, 0));
	out("reserve.align3g", cuMemAddressReserve(&va2, gran, 3 * gran, 0, 0));
	out("reserve.odd_hint", cuMemAddressReserve(&va2, gran, 0, 12345, 0));
	out("reserve.size0", cuMemAddressReserve(&va2, 0, 0, 0, 0));
	out("reserve.flags", cuMemAddressReserve(&va2, gran, 0, 0, 1));
	out("reserve.null", cuMemAddressReserve(NULL, gran, 0, 0, 0));

	out("map.create", cuMemCreate(&h, 4 * gran, &prop, 0));
	/* Two mappings of one allocation, its halves side by side. */
	out("map.first", cuMemMap(va, 2 * gran, 0, h, 0));
	out("map.second", cuMemMap(va + 2 * gran, 2 * gran, 2 * gran, h, 0));
	taken("map", 1, f1);
	out("map.overlap", cuMemMap(va + 2 * gran, 2 * gran, 0, h, 0));
	out("map.unaligned_offset", cuMemMap(va + 4 * gran, gran, 512, h, 0));
	out("map.unaligned_size", cuMemMap(va + 4 * gran, gran + 512, 0, h, 0));
	out("map.past_allocation", cuMemMap(va + 4 * gran, 2 * gran, 3 * gran, h, 0));
	out("map.past_reservation", cuMemMap(va + 6 * gran, 4 * gran, 0, h, 0));
	out("map.unreserved", cuMemMap(gran, gran, 0, h, 0));
	out("map.flags", cuMemMap(va + 4 * gran, gran, 0, h, 1));
	out("map.size0", cuMemMap(va + 4 * gran, 0, 0, h, 0));
	out("map.madeup_handle", cuMemMap(va + 4 * gran, gran, 0, 0x1234, 0));

	out("access.rc", cuMemSetAccess(va, 4 * gran, &acc, 1));
	out("access.one", cuMemSetAccess(va + 2 * gran, 2 * gran, &acc, 1));
	out("access.part", cuMemSetAccess(va, gran, &acc, 1));
	out("access.unmapped", cuMemSetAccess(va, 6 * gran, &acc, 1));
	out("access.count0", cuMemSetAccess(va, 4 * gran, &acc, 0));
	out("access.null", cuMemSetAccess(va, 4 * gran, NULL, 1));
	acc.flags = 2;
	out("access.badflags", cuMemSetAccess(va, 4 * gran, &acc, 1));
	acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READ;
	out("access.read", cuMemSetAccess(va, 4 * gran, &acc, 1));
	acc.location.id = 99;
	out("access.baddev", cuMemSetAccess(va, 4 * gran, &acc, 1));
	acc.location.id = 1;
	acc.location.type = CU_MEM_LOCATION_TYPE_HOST;
	out("access.host", cuMemSetAccess(va, 4 * gran, &acc, 1));

	/* Released while mapped: legal, and the memory stays in use. */
	out("map.release", cuMemRelease(h));
	taken("map.released", 1, f1);
	out("map.release_again", cuMemRelease(h));
	out("map.map_released", cuMemMap(va + 4 * gran, 2 * gran, 0, h, 0));
	out("retain.rc", cuMemRetainAllocationHandle(&h2, as_addr(va + 3 * gran)));
	out("retain.same", h2 == h);
	out("retain.unmapped", cuMemRetainAllocationHandle(&h2, as_addr(va + 5 * gran)));
	out("retain.unreserved", cuMemRetainAllocationHandle(&h2, as_addr(gran)));
	out("retain.null", cuMemRetainAllocationHandle(NULL, as_addr(va)));
	out("unmap.part", cuMemUnmap(va, gran));
	out("unmap.past", cuMemUnmap(va, 6 * gran));
	out("unmap.first", cuMemUnmap(va, 2 * gran));
	taken("unmap.first", 1, f1);
	out("unmap.first_again", cuMemUnmap(va, 2 * gran));
	out("retain.after_unmap", cuMemRetainAllocationHandle(&h2, as_addr(va)));
	out("addrfree.mapped", cuMemAddressFree(va, 8 * gran));
	out("unmap.second", cuMemUnmap(va + 2 * gran, 2 * gran));
	/* Unmapped everywhere, but the retained reference holds it. */
	taken("unmap.second", 1, f1);
	out("retain.release", cuMemRelease(h2));
	back("map", 1, f1);
	out("retain.release_again", cuMemRelease(h2));

	/* One unmap over two adjacent mappings of two allocations, released at once. */
	cuMemCreate(&a, gran, &prop, 0);
	cuMemCreate(&b, 2 * gran, &prop, 0);
	out("pair.map_a", cuMemMap(va + 2 * gran, gran, 0, a, 0));
	out("pair.map_b", cuMemMap(va + 3 * gran, 2 * gran, 0, b, 0));
	out("pair.release_a", cuMemRelease(a));
	out("pair.release_b", cuMemRelease(b));
	taken("pair", 1, f1);
	acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	out("pair.access", cuMemSetAccess(va + 2 * gran, 3 * gran, &acc, 1));
	out("pair.unmap_past", cuMemUnmap(va + 2 * gran, 4 * gran));
	out("pair.unmap", cuMemUnmap(va + 2 * gran, 3 * gran));
	back("pair", 1, f1);

	out("addrfree.wrong_size", cuMemAddressFree(va, 4 * gran));
	out("addrfree.inside", cuMemAddressFree(va + gran, 7 * gran));
	out("addrfree.rc", cuMemAddressFree(va, 8 * gran));
	out("addrfree.again", cuMemAddressFree(va, 8 * gran));
	cuMemCreate(&a, gran, &prop, 0);
	out("map.freed_range", cuMemMap(va, gran, 0, a, 0));
	cuMemRelease(a);
	back("vmm", 1, f1);
}

static void probe_arrays(void)
{
	CUDA_ARRAY_DESCRIPTOR d2 = { 1000, 10, CU_AD_FORMAT_FLOAT, 4 };
	CUDA_ARRAY3D_DESCRIPTOR d3 = { 64, 32, 8, CU_AD_FORMAT_HALF, 2, 0 };
	CUDA_ARRAY3D_DESCRIPTOR mip = { 64, 32, 0, CU_AD_FORMAT_UNSIGNED_INT8, 1, 0 };
	CUarray a = NULL;
	CUmipmappedArray m = NULL;
	long long f0 = free_on(0);

	out("array2d.rc", cuArrayCreate_v2(&a, &d2));
	taken("array2d", 0, f0);
	out("array2d.destroy", cuArrayDestroy(a));
	back("array2d", 0, f0);
	out("array2d.destroy_again", cuArrayDestroy(a));
	out("array.destroy_null", cuArrayDestroy(NULL));
	out("array.destroy_madeup", cuArrayDestroy((CUarray)0x1000));
	d2.Height = 0;
	out("array1d.rc", cuArrayCreate_v2(&a, &d2));
	taken("array1d", 0, f0);
	out("array1d.destroy", cuArrayDestroy(a));
	d2.Width = 0;
	out("array.width0", cuArrayCreate_v2(&a, &d2));
	d2.Width = 16;
	d2.NumChannels = 3;
	out("array.channels3", cuArrayCreate_v2(&a, &d2));
	d2.NumChannels = 1;
	d2.Format = 0x55;
	out("array.badformat", cuArrayCreate_v2(&a, &d2));
	out("array.nulldesc", cuArrayCreate_v2(&a, NULL));

	out("array3d.rc", cuArray3DCreate_v2(&a, &d3));
	taken("array3d", 0, f0);
	/* Each handle kind has its own destroy. */
	out("array3d.mipmap_destroy", cuMipmappedArrayDestroy((CUmipmappedArray)a));
	out("array3d.destroy", cuArrayDestroy(a));
	back("array3d", 0, f0);
	d3.Height = 0;
	out("array3d.w0d", cuArray3DCreate_v2(&a, &d3));
	d3.Flags = 1; /* CUDA_ARRAY3D_LAYERED: a layered 1D array */
	out("layered1d.rc", cuArray3DCreate_v2(&a, &d3));
	taken("layered1d", 0, f0);
	out("layered1d.destroy", cuArrayDestroy(a));

	out("mipmap.rc", cuMipmappedArrayCreate(&m, &mip, 4));
	taken("mipmap", 0, f0);
	out("mipmap.array_destroy", cuArrayDestroy((CUarray)m));
	out("mipmap.destroy", cuMipmappedArrayDestroy(m));
	back("mipmap", 0, f0);
	out("mipmap.destroy_again", cuMipmappedArrayDestroy(m));
	out("mipmap_full.rc", cuMipmappedArrayCreate(&m, &mip, 7));
	taken("mipmap_full", 0, f0);
	out("mipmap_full.destroy", cuMipmappedArrayDestroy(m));
	out("mipmap.levels0", cuMipmappedArrayCreate(&m, &mip, 0));
	out("mipmap.levels8", cuMipmappedArrayCreate(&m, &mip, 8));
}

static void probe_launch(void)
{
	CUlaunchConfig cfg = { 2, 1, 1, 32, 1, 1, 0, NULL, NULL, 0 };
	CUfunction f = (CUfunction)0x10;
	CUgraphExec g = (CUgraphExec)0x20;

	out("ex.rc", cuLaunchKernelEx(&cfg, f, NULL, NULL));
	out("ex_ptsz.rc", cuLaunchKernelEx_ptsz(&cfg, f, NULL, NULL));
	out("ex.nullconfig", cuLaunchKernelEx(NULL, f, NULL, NULL));
	out("ex_ptsz.nullconfig", cuLaunchKernelEx_ptsz(NULL, f, NULL, NULL));
	out("ex.nullfunc", cuLaunchKernelEx(&cfg, NULL, NULL, NULL));
	cfg.numAttrs = 1;
	out("ex.nullattrs", cuLaunchKernelEx(&cfg, f, NULL, NULL));
	cfg.numAttrs = 0;
	cfg.gridDimY = 0;
	out("ex.grid0", cuLaunchKernelEx(&cfg, f, NULL, NULL));

	out("coop.rc", cuLaunchCooperativeKernel(f, 1, 1, 1, 64, 1, 1, 0, NULL, NULL));
	out("coop_ptsz.rc", cuLaunchCooperativeKernel_ptsz(f, 1, 1, 1, 64, 1, 1, 0, NULL, NULL));
	out("coop.nullfunc", cuLaunchCooperativeKernel(NULL, 1, 1, 1, 64, 1, 1, 0, NULL, NULL));
	out("coop_ptsz.nullfunc",
	    cuLaunchCooperativeKernel_ptsz(NULL, 1, 1, 1, 64, 1, 1, 0, NULL, NULL));
	out("coop.block0", cuLaunchCooperativeKernel(f, 1, 1, 1, 0, 1, 1, 0, NULL, NULL));

	out("graph.rc", cuGraphLaunch(g, NULL));
	out("graph_ptsz.rc", cuGraphLaunch_ptsz(g, NULL));
	out("graph.null", cuGraphLaunch(NULL, NULL));
	out("graph_ptsz.null", cuGraphLaunch_ptsz(NULL, NULL));
}

/* The 32-bit ABI is refused, each variant by its own function. */
static void probe_v1(void)
{
	unsigned int u = 0, v = 0;
	CUarray a = NULL;
	CUcontext c = NULL;

	out("v1.cuDeviceTotalMem", cuDeviceTotalMem(&u, 0));
	out("v1.cuMemGetInfo", cuMemGetInfo(&u, &v));
	out("v1.cuMemAlloc", cuMemAlloc(&u, 1024));
	out("v1.cuMemAllocPitch", cuMemAllocPitch(&u, &v, 64, 64, 4));
	out("v1.cuMemFree", cuMemFree(u));
	out("v1.cuArrayCreate", cuArrayCreate(&a, &u));
	out("v1.cuArray3DCreate", cuArray3DCreate(&a, &u));
	out("v1.cuCtxCreate", cuCtxCreate(&c, 0, 0));
}

/* With no current context, each path that needs one says so. */
static void probe_no_context(void)
{
	CUDA_ARRAY_DESCRIPTOR d2 = { 16, 16, CU_AD_FORMAT_FLOAT, 1 };
	CUlaunchConfig cfg = { 1, 1, 1, 1, 1, 1, 0, NULL, NULL, 0 };
	CUdeviceptr p;
	size_t pitch;
	CUarray a;
	CUstream s;
	CUcontext c;

	out("noctx.pitch", cuMemAllocPitch_v2(&p, &pitch, 64, 64, 4));
	out("noctx.managed", cuMemAllocManaged(&p, MIB, CU_MEM_ATTACH_GLOBAL));
	out("noctx.async", cuMemAllocAsync(&p, MIB, NULL));
	out("noctx.array", cuArrayCreate_v2(&a, &d2));
	out("noctx.ex", cuLaunchKernelEx(&cfg, (CUfunction)0x10, NULL, NULL));
	out("noctx.graph", cuGraphLaunch((CUgraphExec)0x20, NULL));
	out("noctx.stream_create", cuStreamCreate(&s, 0));
	out("noctx.stream_getctx", cuStreamGetCtx(NULL, &c));
	out("noctx.stream_sync", cuStreamSynchronize(CU_STREAM_LEGACY));
	out("noctx.free_async", cuMemFreeAsync(0xdead0000, NULL));
}

/*
 * What a context's end frees: everything allocated while it was current, on
 * whichever device, and its arrays and streams; never another context's
 * memory, nor cuMemCreate's. Device 2 and 3's primary contexts are unused
 * until here.
 */
static void probe_teardown(void)
{
	CUDA_ARRAY_DESCRIPTOR d2 = { 256, 256, CU_AD_FORMAT_FLOAT, 1 };
	CUDA_ARRAY3D_DESCRIPTOR mip = { 64, 64, 0, CU_AD_FORMAT_UNSIGNED_INT8, 1, 0 };
	CUmemAllocationProp prop = { 0 };
	CUmemGenericAllocationHandle h = 0;
	CUcontext a = NULL, b = NULL, c = NULL;
	CUmemoryPool pool3 = NULL;
	CUdeviceptr p = 0, pitched = 0, managed = 0, async = 0, other = 0, q = 0;
	CUmipmappedArray m = NULL;
	CUstream s = NULL;
	CUarray arr = NULL;
	size_t pitch = 0;
	long long f2 = free_on(2), f3 = free_on(3);

	prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
	prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	prop.location.id = 2;
	cuDeviceGetDefaultMemPool(&pool3, 3);

	out("teardown.create", cuCtxCreate_v2(&a, 0, 2));
	out("teardown.alloc", cuMemAlloc_v2(&p, 4 * MIB));
	out("teardown.pitch", cuMemAllocPitch_v2(&pitched, &pitch, 1024, 1024, 4));
	out("teardown.managed", cuMemAllocManaged(&managed, MIB, CU_MEM_ATTACH_GLOBAL));
	out("teardown.stream", cuStreamCreate(&s, 0));
	out("teardown.async", cuMemAllocAsync(&async, 2 * MIB, s));
	out("teardown.array", cuArrayCreate_v2(&arr, &d2));
	out("teardown.mipmap", cuMipmappedArrayCreate(&m, &mip, 3));
	/* Device 3's pool serves it; like all pool memory it outlives the context. */
	out("teardown.frompool3", cuMemAllocFromPoolAsync(&q, 3 * MIB, pool3, NULL));
	out("teardown.memcreate", cuMemCreate(&h, 2 * MIB, &prop, 0));
	/* A second context on the same device, whose memory must survive a's end. */
	out("teardown.create_b", cuCtxCreate_v2(&b, 0, 2));
	out("teardown.alloc_b", cuMemAlloc_v2(&other, 5 * MIB));
	cuCtxPopCurrent_v2(NULL);
	taken("teardown", 2, f2);
	taken("teardown.dev3", 3, f3);

	out("teardown.destroy", cuCtxDestroy_v2(a));
	out("teardown.current_after", cuCtxGetCurrent(&c) == CUDA_SUCCESS && c == NULL);
	/* Left: b's 5 MiB, the cuMemCreate allocation and the pools' memory. */
	taken("teardown.destroyed", 2, f2);
	taken("teardown.dev3_kept", 3, f3);
	const struct {
		const char *key;
		CUdeviceptr ptr;
	} frees[] = {
		{ "teardown.free_freed", p },
		{ "teardown.free_freed_pitch", pitched },
		{ "teardown.free_freed_managed", managed },
		{ "teardown.free_pool3", q },
		{ "teardown.free_async", async },
	};
	for (size_t i = 0; i < sizeof(frees) / sizeof(frees[0]); i++)
		out(frees[i].key, cuMemFree_v2(frees[i].ptr));
	back("teardown.dev3", 3, f3);
	out("teardown.array_destroy", cuArrayDestroy(arr));
	out("teardown.mipmap_destroy", cuMipmappedArrayDestroy(m));
	out("teardown.stream_getctx", cuStreamGetCtx(s, &c));
	out("teardown.stream_destroy", cuStreamDestroy_v2(s));
	out("teardown.destroy_again", cuCtxDestroy_v2(a));
	out("teardown.release", cuMemRelease(h));
	out("teardown.destroy_b", cuCtxDestroy_v2(b));
	back("teardown", 2, f2);
	out("teardown.free_freed_b", cuMemFree_v2(other));
}

/*
 * The primary context: reset frees what was allocated in it and keeps it
 * retained; the release that brings its count to 0 destroys it, and with it
 * what was allocated in it.
 */
static void probe_primary(void)
{
	CUDA_ARRAY_DESCRIPTOR d2 = { 128, 128, CU_AD_FORMAT_FLOAT, 1 };
	CUcontext pc = NULL, again = NULL;
	CUdeviceptr p = 0, q = 0;
	CUarray arr = NULL;
	unsigned int flags = 0;
	int active = -1;
	long long f2 = free_on(2);

	out("primary.retain", cuDevicePrimaryCtxRetain(&pc, 2));
	cuCtxPushCurrent_v2(pc);
	out("primary.alloc", cuMemAlloc_v2(&p, 6 * MIB));
	out("primary.array", cuArrayCreate_v2(&arr, &d2));
	cuCtxPopCurrent_v2(NULL);
	taken("primary", 2, f2);
	out("reset.rc", cuDevicePrimaryCtxReset_v2(2));
	back("reset", 2, f2);
	out("reset.free_freed", cuMemFree_v2(p));
	out("reset.array_destroy", cuArrayDestroy(arr));
	cuDevicePrimaryCtxGetState(2, &flags, &active);
	out("reset.still_active", active);
	out("reset.baddev", cuDevicePrimaryCtxReset_v2(99));

	/* The same handle serves on after a reset. */
	cuCtxPushCurrent_v2(pc);
	out("release.alloc", cuMemAlloc_v2(&q, 7 * MIB));
	cuCtxPopCurrent_v2(NULL);
	out("release.retain_again", cuDevicePrimaryCtxRetain(&again, 2));
	out("release.same_handle", again == pc);
	out("release.one", cuDevicePrimaryCtxRelease_v2(2));
	taken("release.one", 2, f2);
	out("release.last", cuDevicePrimaryCtxRelease_v2(2));
	back("release.last", 2, f2);
	cuDevicePrimaryCtxGetState(2, &flags, &active);
	out("release.inactive", active);
	out("release.free_freed", cuMemFree_v2(q));
	out("release.again", cuDevicePrimaryCtxRelease_v2(2));
}

static int probe_mem(void)
{
	CUcontext ctx = NULL;
	long long f0;

	out("init", cuInit(0));
	out("ctx_v3.rc", cuCtxCreate_v3(&ctx, NULL, 0, 0, 0));
	f0 = free_on(0);
	probe_linear();
	probe_async();
	probe_streams(ctx);
	probe_vmm();
	probe_map();
	probe_arrays();
	probe_launch();
	probe_v1();
	/* Everything above gave back what it took. */
	out("all.back", f0 - free_on(0));
	out("ctx_v3.destroy", cuCtxDestroy_v2(ctx));
	probe_no_context();
	probe_teardown();
	probe_primary();
	return 0;
}

static const char *variant(void *fn)
{
	Dl_info info;

	if (!fn)
		return "-";
	if (!dladdr(fn, &info) || !info.dli_sname || info.dli_saddr != fn)
		return "?";
	return info.dli_sname;
}

static int probe_resolve(void)
{
	static char sentinel;
	char line[512], name[256];
	int version;
	unsigned long long flags;

	out("init", cuInit(0));
	while (fgets(line, sizeof(line), stdin)) {
		if (sscanf(line, "gpa1 %255s %d %llu", name, &version, &flags) == 3) {
			void *fn = (void *)&sentinel;
			CUresult rc = cuGetProcAddress(strcmp(name, "-") ? name : "", &fn, version,
						       flags);

			printf("gpa1 %s %d %llu %d %s\n", name, version, flags, rc,
			       fn == (void *)&sentinel ? "untouched" : variant(fn));
		} else if (sscanf(line, "gpa %255s %d %llu", name, &version, &flags) == 3) {
			CUdriverProcAddressQueryResult status = -1;
			void *fn = (void *)&sentinel;
			CUresult rc = cuGetProcAddress_v2(strcmp(name, "-") ? name : "", &fn,
							  version, flags, &status);

			printf("gpa %s %d %llu %d %d %s\n", name, version, flags, rc, status,
			       fn == (void *)&sentinel ? "untouched" : variant(fn));
		} else if (sscanf(line, "sym %255s", name) == 1) {
			printf("sym %s %s\n", name, variant(dlsym(RTLD_DEFAULT, name)));
		} else {
			fprintf(stderr, "sim_probe: bad line: %s", line);
			return 2;
		}
	}
	return 0;
}

int main(int argc, char **argv)
{
	if (argc == 2 && strcmp(argv[1], "mem") == 0)
		return probe_mem();
	if (argc == 2 && strcmp(argv[1], "resolve") == 0)
		return probe_resolve();
	fprintf(stderr, "usage: sim_probe mem|resolve\n");
	return 2;
}
