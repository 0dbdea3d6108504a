/*
 * A driver-API client for gpushare's tests. Reaches the driver either the
 * way libcudart does (dlopen + dlsym(handle, "cuGetProcAddress_v2"), then
 * everything through cuGetProcAddress by base name and version) or, built
 * with -DLINKED, through symbols linked with -lcuda.
 *
 * Arguments are a script of steps; each prints one line:
 *   alloc MIB      cuMemAlloc: "alloc ok" | "alloc err CODE"
 *   allocb BYTES   the same, by the byte
 *   pitch W H      cuMemAllocPitch (4-byte elements): "pitch ok PITCH" | "pitch err CODE"
 *   managed MIB    cuMemAllocManaged
 *   async MIB      cuMemAllocAsync on the legacy stream (asyncpt: per-thread flavour)
 *   pool MIB       cuMemAllocFromPoolAsync from the device's default pool
 *   create MIB     cuMemCreate on the current device
 *   array W H      cuArrayCreate (float, one channel)
 *   array3d W H D  cuArray3DCreate (float, one channel)
 *   mipmap W H L   cuMipmappedArrayCreate (float, one channel, L levels)
 *                  each: "NAME ok" | "NAME err CODE"
 *   free           frees the oldest live allocation with the call that matches how it
 *                  was made: "free ok" | "free err CODE"
 *   fill MIB       allocate MIB chunks until one fails: "fill N"
 *   info           "info free=BYTES total=BYTES"
 *   totalmem       "totalmem BYTES" (cuDeviceTotalMem of the current device)
 *   dev N          make device N's primary context current: "dev ok" | "dev err CODE"
 *   launch N       N launches of each kind named: launch (cuLaunchKernel), launchpt (its
 *   launchex N     per-thread flavour), launchex (cuLaunchKernelEx), coop
 *   coop N         (cuLaunchCooperativeKernel), graph (cuGraphLaunch):
 *   graph N        "KIND ok" | "KIND err CODE"
 *   launchpt N
 *   sync, sync2, ssync, esync   cuCtxSynchronize (v1, v2), cuStreamSynchronize of the null
 *                  stream, cuEventSynchronize of an event recorded on it: "NAME ok"
 *   trim MIB       cuMemPoolTrimTo of the device's current pool: "trim ok"
 *   keep MIB|max   its release threshold: "keep ok"
 *   reserved       its CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT: "reserved BYTES"
 *   newpool        cuMemPoolCreate on the device; setpool, setlocpool: make it the
 *                  device's current pool (cuDeviceSetMemPool, cuMemSetMemPool);
 *                  pooldestroy: cuMemPoolDestroy of it (or of poolon's): "NAME ok"
 *   heap MIB       cuCtxSetLimit of the device malloc heap: "heap ok" | "heap err CODE"
 *   stack BYTES    cuCtxSetLimit of the per-thread stack: "stack ok" | "stack err CODE"
 *   gcapture MIB   on a stream of its own, a capture of cuMemAllocAsync of MIB and its
 *                  cuMemFreeAsync, instantiated (gkeep MIB: the allocation outlives the
 *                  graph, instantiated to auto-free it at the next launch)
 *   glaunch N      N cuGraphLaunch of it on that stream; gupload: cuGraphUpload of it
 *   gtrim          cuDeviceGraphMemTrim of the device; gdestroy: cuGraphExecDestroy of it
 *                  each: "NAME ok" | "NAME err CODE"
 *   greserved      the device's CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT: "greserved BYTES"
 *   edge           driver answers to bad arguments, one "edge NAME CODE" line each
 *   gpa NAME VER FLAGS   cuGetProcAddress: "gpa NAME VER FLAGS rc=RC status=S LIB:SYMBOL"
 *   threads T N MIB      T threads each make N random allocations/frees of up to MIB:
 *                  "threads ok=N failed=N maxheld=BYTES"
 *   vmm MIB        cuMemCreate, then reserve an address range, map and enable it
 *   vmmrelease     cuMemRelease of the vmm handle (mapped or not)
 *   vmmretain      cuMemRetainAllocationHandle at the vmm address: "vmmretain ok same"
 *   vmmunmap       cuMemUnmap of the vmm mapping and cuMemAddressFree
 *   vmmtwice MIB   as vmm, but the handle mapped twice, back to back, in a range of 3 x MIB
 *   unmapat OFF LEN  cuMemUnmap of LEN MiB at OFF MiB into the vmm range
 *   ctx N          cuCtxCreate on device N, made current
 *   ctxdestroy     cuCtxDestroy of the last ctx made; the primary context is current after
 *   primreset      cuDevicePrimaryCtxReset of the current device
 *   primrelease    cuDevicePrimaryCtxRelease of the current device
 *   stream N       a stream in device N's primary context
 *   asyncs MIB     cuMemAllocAsync on that stream (freed by free)
 *   poolon N MIB   cuMemPoolCreate on device N and cuMemAllocFromPoolAsync from it on
 *                  the legacy stream (freed by free)
 *   locpoolon N MIB  the same from device N's default pool, got through CUDA 13's
 *                  cuMemGetDefaultMemPool (a device location)
 *                  each: "NAME ok" | "NAME err CODE"
 *   waitfile PATH  "waiting", then blocks until PATH exists
 *   fork PATH      "forked"; the child lives on until PATH exists
 *   forkrest       the child runs the steps that follow; the parent waits for it, prints
 *                  "forkrest exit=CODE" and runs nothing more
 *   sleep SECONDS
 *   attach LEDGER TASK   gpushare_attach, found with dlsym(RTLD_DEFAULT):
 *                  "attach ok" | "attach err NAME" (GPUSHARE_E_NAME) | "attach none" (no shim)
 *   mode           gpushare_mode: "mode inert|enforce|broken" | "mode none"
 *   counters BYTES gpushare_counters into a buffer of 32 bytes set to 0xff, asked to fill
 *                  BYTES of it: "counters rc W0 W1 W2 W3" (its four 8-byte words, as
 *                  unsigned numbers) | "counters none"
 *   attachjoin     waits for the attach attachbg started, and prints as attach does
 *
 * The steps before the first one that is none of attach, mode and lookup run
 * before the client first calls into the driver (whose set-up calls come
 * first otherwise):
 *   lookup         dlopen libcuda.so.1 and dlsym cuGetProcAddress_v2 from its handle,
 *                  calling nothing: "lookup LIB" (the library the pointer lies in)
 *   attachbg LEDGER TASK   attach on a thread of its own, racing what follows; prints
 *                  nothing (see attachjoin)
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cuda_abi.h"
#include "gpushare.h"

typedef CUresult (*gpa_v2_t)(const char *, void **, int, cuuint64_t,
			     CUdriverProcAddressQueryResult *);
typedef CUresult (*launch_t)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
			     unsigned, CUstream, void **, void **);
typedef CUresult (*coop_t)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
			   unsigned, CUstream, void **);

static struct {
	CUresult (*init)(unsigned int);
	CUresult (*device_get)(CUdevice *, int);
	CUresult (*retain)(CUcontext *, CUdevice);
	CUresult (*set_current)(CUcontext);
	CUresult (*alloc)(CUdeviceptr *, size_t);
	CUresult (*free)(CUdeviceptr);
	CUresult (*info)(size_t *, size_t *);
	CUresult (*totalmem)(size_t *, CUdevice);
	CUresult (*pitch)(CUdeviceptr *, size_t *, size_t, size_t, unsigned int);
	CUresult (*managed)(CUdeviceptr *, size_t, unsigned int);
	CUresult (*async)(CUdeviceptr *, size_t, CUstream);
	CUresult (*async_pt)(CUdeviceptr *, size_t, CUstream);
	CUresult (*free_async)(CUdeviceptr, CUstream);
	CUresult (*default_pool)(CUmemoryPool *, CUdevice);
	CUresult (*pool_alloc)(CUdeviceptr *, size_t, CUmemoryPool, CUstream);
	CUresult (*create)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
			   unsigned long long);
	CUresult (*release)(CUmemGenericAllocationHandle);
	CUresult (*array)(CUarray *, const CUDA_ARRAY_DESCRIPTOR *);
	CUresult (*array3d)(CUarray *, const CUDA_ARRAY3D_DESCRIPTOR *);
	CUresult (*array_destroy)(CUarray);
	CUresult (*mipmap)(CUmipmappedArray *, const CUDA_ARRAY3D_DESCRIPTOR *, unsigned int);
	CUresult (*mipmap_destroy)(CUmipmappedArray);
	launch_t launch, launch_pt;
	CUresult (*launch_ex)(const CUlaunchConfig *, CUfunction, void **, void **);
	coop_t coop;
	CUresult (*graph)(CUgraphExec, CUstream);
	CUresult (*reserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
	CUresult (*addr_free)(CUdeviceptr, size_t);
	CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
			unsigned long long);
	CUresult (*unmap)(CUdeviceptr, size_t);
	CUresult (*set_access)(CUdeviceptr, size_t, const void *, size_t);
	CUresult (*retain_handle)(CUmemGenericAllocationHandle *, void *);
	CUresult (*ctx_create)(CUcontext *, unsigned int, CUdevice);
	CUresult (*ctx_destroy)(CUcontext);
	CUresult (*prim_reset)(CUdevice);
	CUresult (*prim_release)(CUdevice);
	CUresult (*stream_create)(CUstream *, unsigned int);
	CUresult (*push)(CUcontext);
	CUresult (*pop)(CUcontext *);
	CUresult (*pool_create)(CUmemoryPool *, const CUmemPoolProps *);
	CUresult (*location_pool)(CUmemoryPool *, CUmemLocation *, int);
	CUresult (*ctx_sync)(void);
	CUresult (*ctx_sync2)(CUcontext);
	CUresult (*stream_sync)(CUstream);
	CUresult (*event_create)(CUevent *, unsigned int);
	CUresult (*event_record)(CUevent, CUstream);
	CUresult (*event_sync)(CUevent);
	CUresult (*get_pool)(CUmemoryPool *, CUdevice);
	CUresult (*set_pool)(CUdevice, CUmemoryPool);
	CUresult (*set_loc_pool)(CUmemLocation *, int, CUmemoryPool);
	CUresult (*trim)(CUmemoryPool, size_t);
	CUresult (*pool_set)(CUmemoryPool, int, void *);
	CUresult (*pool_get)(CUmemoryPool, int, void *);
	CUresult (*pool_destroy)(CUmemoryPool);
	CUresult (*set_limit)(int, size_t);
	CUresult (*begin_capture)(CUstream, int);
	CUresult (*end_capture)(CUstream, void **);
	CUresult (*instantiate)(CUgraphExec *, void *, unsigned long long);
	CUresult (*upload)(CUgraphExec, CUstream);
	CUresult (*exec_destroy)(CUgraphExec);
	CUresult (*graph_trim)(CUdevice);
	CUresult (*graph_attr)(CUdevice, int, void *);
} cu;

static gpa_v2_t gpa;

/* Entry points newer than the basics may be missing from a driver: NULL then. */
static void *fetch_flags(const char *name, int version, cuuint64_t flags, int required)
{
	CUdriverProcAddressQueryResult st = -1;
	void *p = NULL;

	if (gpa(name, &p, version, flags, &st) != CUDA_SUCCESS || st != 0 || p == NULL) {
		if (!required)
			return NULL;
		fprintf(stderr, "cuGetProcAddress(%s, %d) failed\n", name, version);
		exit(3);
	}
	return p;
}

static void bind_optional(void)
{
	cu.pitch = fetch_flags("cuMemAllocPitch", 3020, 0, 0);
	cu.managed = fetch_flags("cuMemAllocManaged", 6000, 0, 0);
	cu.async = fetch_flags("cuMemAllocAsync", 11020, 0, 0);
	cu.async_pt = fetch_flags("cuMemAllocAsync", 11020, 2, 0);
	cu.free_async = fetch_flags("cuMemFreeAsync", 11020, 0, 0);
	cu.default_pool = fetch_flags("cuDeviceGetDefaultMemPool", 11020, 0, 0);
	cu.pool_alloc = fetch_flags("cuMemAllocFromPoolAsync", 11020, 0, 0);
	cu.create = fetch_flags("cuMemCreate", 10020, 0, 0);
	cu.release = fetch_flags("cuMemRelease", 10020, 0, 0);
	cu.array = fetch_flags("cuArrayCreate", 3020, 0, 0);
	cu.array3d = fetch_flags("cuArray3DCreate", 3020, 0, 0);
	cu.array_destroy = fetch_flags("cuArrayDestroy", 2000, 0, 0);
	cu.mipmap = fetch_flags("cuMipmappedArrayCreate", 5000, 0, 0);
	cu.mipmap_destroy = fetch_flags("cuMipmappedArrayDestroy", 5000, 0, 0);
	cu.launch_pt = fetch_flags("cuLaunchKernel", 7000, 2, 0);
	cu.launch_ex = fetch_flags("cuLaunchKernelEx", 11060, 0, 0);
	cu.coop = fetch_flags("cuLaunchCooperativeKernel", 9000, 0, 0);
	cu.graph = fetch_flags("cuGraphLaunch", 10000, 0, 0);
	cu.reserve = fetch_flags("cuMemAddressReserve", 10020, 0, 0);
	cu.addr_free = fetch_flags("cuMemAddressFree", 10020, 0, 0);
	cu.map = fetch_flags("cuMemMap", 10020, 0, 0);
	cu.unmap = fetch_flags("cuMemUnmap", 10020, 0, 0);
	cu.set_access = fetch_flags("cuMemSetAccess", 10020, 0, 0);
	cu.retain_handle = fetch_flags("cuMemRetainAllocationHandle", 11000, 0, 0);
	cu.ctx_create = fetch_flags("cuCtxCreate", 3020, 0, 0);
	cu.ctx_destroy = fetch_flags("cuCtxDestroy", 4000, 0, 0);
	cu.prim_reset = fetch_flags("cuDevicePrimaryCtxReset", 11000, 0, 0);
	cu.prim_release = fetch_flags("cuDevicePrimaryCtxRelease", 11000, 0, 0);
	cu.stream_create = fetch_flags("cuStreamCreate", 2000, 0, 0);
	cu.push = fetch_flags("cuCtxPushCurrent", 4000, 0, 0);
	cu.pop = fetch_flags("cuCtxPopCurrent", 4000, 0, 0);
	cu.pool_create = fetch_flags("cuMemPoolCreate", 11020, 0, 0);
	cu.location_pool = fetch_flags("cuMemGetDefaultMemPool", 13000, 0, 0);
	cu.ctx_sync = fetch_flags("cuCtxSynchronize", 2000, 0, 0);
	cu.ctx_sync2 = fetch_flags("cuCtxSynchronize", 13000, 0, 0);
	cu.stream_sync = fetch_flags("cuStreamSynchronize", 2000, 0, 0);
	cu.event_create = fetch_flags("cuEventCreate", 2000, 0, 0);
	cu.event_record = fetch_flags("cuEventRecord", 2000, 0, 0);
	cu.event_sync = fetch_flags("cuEventSynchronize", 2000, 0, 0);
	cu.get_pool = fetch_flags("cuDeviceGetMemPool", 11020, 0, 0);
	cu.set_pool = fetch_flags("cuDeviceSetMemPool", 11020, 0, 0);
	cu.set_loc_pool = fetch_flags("cuMemSetMemPool", 13000, 0, 0);
	cu.trim = fetch_flags("cuMemPoolTrimTo", 11020, 0, 0);
	cu.pool_set = fetch_flags("cuMemPoolSetAttribute", 11020, 0, 0);
	cu.pool_get = fetch_flags("cuMemPoolGetAttribute", 11020, 0, 0);
	cu.pool_destroy = fetch_flags("cuMemPoolDestroy", 11020, 0, 0);
	cu.set_limit = fetch_flags("cuCtxSetLimit", 3010, 0, 0);
	cu.begin_capture = fetch_flags("cuStreamBeginCapture", 10010, 0, 0);
	cu.end_capture = fetch_flags("cuStreamEndCapture", 10000, 0, 0);
	cu.instantiate = fetch_flags("cuGraphInstantiateWithFlags", 11040, 0, 0);
	cu.upload = fetch_flags("cuGraphUpload", 11010, 0, 0);
	cu.exec_destroy = fetch_flags("cuGraphExecDestroy", 10000, 0, 0);
	cu.graph_trim = fetch_flags("cuDeviceGraphMemTrim", 11040, 0, 0);
	cu.graph_attr = fetch_flags("cuDeviceGetGraphMemAttribute", 11040, 0, 0);
}

#ifdef LINKED
CUresult cuInit(unsigned int);
CUresult cuDeviceGet(CUdevice *, int);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemGetInfo_v2(size_t *, size_t *);
CUresult cuDeviceTotalMem_v2(size_t *, CUdevice);
CUresult cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
			unsigned, CUstream, void **, void **);
CUresult cuGetProcAddress_v2(const char *, void **, int, cuuint64_t,
			     CUdriverProcAddressQueryResult *);

static void bind_driver(void)
{
	cu.init = cuInit;
	cu.device_get = cuDeviceGet;
	cu.retain = cuDevicePrimaryCtxRetain;
	cu.set_current = cuCtxSetCurrent;
	cu.alloc = cuMemAlloc_v2;
	cu.free = cuMemFree_v2;
	cu.info = cuMemGetInfo_v2;
	cu.totalmem = cuDeviceTotalMem_v2;
	cu.launch = cuLaunchKernel;
	gpa = cuGetProcAddress_v2;
	bind_optional();
}
#else
static void *fetch(const char *name, int version)
{
	return fetch_flags(name, version, 0, 1);
}

static void bind_driver(void)
{
	void *h = dlopen("libcuda.so.1", RTLD_NOW);
	gpa_v2_t first;

	if (h == NULL) {
		fprintf(stderr, "dlopen libcuda.so.1: %s\n", dlerror());
		exit(3);
	}
	first = (gpa_v2_t)dlsym(h, "cuGetProcAddress_v2");
	if (first == NULL) {
		fprintf(stderr, "no cuGetProcAddress_v2\n");
		exit(3);
	}
	/* As libcudart does: fetch cuGetProcAddress itself and use that copy. */
	gpa = first;
	gpa = (gpa_v2_t)fetch("cuGetProcAddress", 12000);
	cu.init = fetch("cuInit", 2000);
	cu.device_get = fetch("cuDeviceGet", 2000);
	cu.retain = fetch("cuDevicePrimaryCtxRetain", 7000);
	cu.set_current = fetch("cuCtxSetCurrent", 4000);
	cu.alloc = fetch("cuMemAlloc", 3020);
	cu.free = fetch("cuMemFree", 3020);
	cu.info = fetch("cuMemGetInfo", 3020);
	cu.totalmem = fetch("cuDeviceTotalMem", 3020);
	cu.launch = fetch("cuLaunchKernel", 4000);
	bind_optional();
}
#endif

/* --- live allocations, freed oldest first ------------------------------------- */

enum kind {
	K_PTR,
	K_ASYNC,
	K_HANDLE,
	K_ARRAY,
	K_MIPMAP
};

struct live {
	enum kind kind;
	uint64_t handle;
};

#define MAX_LIVE 4096
static struct live live[MAX_LIVE];
static int head, tail;

static CUresult keep(CUresult rc, enum kind kind, uint64_t handle)
{
	if (rc == CUDA_SUCCESS) {
		if (tail - head == MAX_LIVE)
			return CUDA_ERROR_UNKNOWN;
		live[tail++ % MAX_LIVE] = (struct live){ kind, handle };
	}
	return rc;
}

#define NEED(fn)          \
	if ((fn) == NULL) \
	return CUDA_ERROR_NOT_FOUND

static CUresult free_one(struct live l)
{
	switch (l.kind) {
	case K_ASYNC:
		NEED(cu.free_async);
		return cu.free_async((CUdeviceptr)l.handle, NULL);
	case K_HANDLE:
		NEED(cu.release);
		return cu.release((CUmemGenericAllocationHandle)l.handle);
	case K_ARRAY:
		NEED(cu.array_destroy);
		return cu.array_destroy((CUarray)(uintptr_t)l.handle);
	case K_MIPMAP:
		NEED(cu.mipmap_destroy);
		return cu.mipmap_destroy((CUmipmappedArray)(uintptr_t)l.handle);
	default:
		return cu.free((CUdeviceptr)l.handle);
	}
}

static CUdevice cur_dev;
static CUstream strm;	  /* made by the "stream" step */
static CUmemoryPool made; /* the last pool "poolon" or "newpool" made */

/* How many arguments each allocation step takes; 0: not an allocation step. */
static int make_args(const char *op)
{
	static const struct {
		const char *op;
		int args;
	} steps[] = { { "alloc", 1 },  { "allocb", 1 },	  { "pitch", 2 },  { "managed", 1 },
		      { "async", 1 },  { "asyncpt", 1 },  { "pool", 1 },   { "create", 1 },
		      { "array", 2 },  { "array3d", 3 },  { "mipmap", 3 }, { "asyncs", 1 },
		      { "poolon", 2 }, { "locpoolon", 2 } };

	for (size_t k = 0; k < sizeof(steps) / sizeof(steps[0]); k++)
		if (strcmp(op, steps[k].op) == 0)
			return steps[k].args;
	return 0;
}

static CUresult make(const char *op, char **argv, int *i, size_t *extra)
{
	size_t mib = strtoull(argv[*i + 1], NULL, 10) << 20;
	CUdeviceptr p = 0;
	CUresult rc;

	if (strcmp(op, "alloc") == 0 || strcmp(op, "allocb") == 0) {
		size_t bytes = op[5] == 'b' ? strtoull(argv[*i + 1], NULL, 10) : mib;

		(*i)++;
		rc = cu.alloc(&p, bytes);
		return keep(rc, K_PTR, p);
	}
	if (strcmp(op, "pitch") == 0) {
		size_t w = strtoull(argv[*i + 1], NULL, 10), h = strtoull(argv[*i + 2], NULL, 10);

		*i += 2;
		NEED(cu.pitch);
		rc = cu.pitch(&p, extra, w, h, 4);
		return keep(rc, K_PTR, p);
	}
	if (strcmp(op, "managed") == 0) {
		(*i)++;
		NEED(cu.managed);
		rc = cu.managed(&p, mib, CU_MEM_ATTACH_GLOBAL);
		return keep(rc, K_PTR, p);
	}
	if (strcmp(op, "async") == 0 || strcmp(op, "asyncpt") == 0) {
		CUresult (*fn)(CUdeviceptr *, size_t, CUstream) = op[5] ? cu.async_pt : cu.async;

		(*i)++;
		NEED(fn);
		rc = fn(&p, mib, NULL);
		return keep(rc, K_ASYNC, p);
	}
	if (strcmp(op, "asyncs") == 0) {
		(*i)++;
		NEED(cu.async);
		rc = cu.async(&p, mib, strm);
		return keep(rc, K_ASYNC, p);
	}
	if (strcmp(op, "poolon") == 0) {
		CUmemPoolProps props;
		CUmemoryPool pool;

		*i += 2;
		NEED(cu.pool_create);
		NEED(cu.pool_alloc);
		memset(&props, 0, sizeof(props));
		props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
		props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
		props.location.id = atoi(argv[*i - 1]);
		rc = cu.pool_create(&pool, &props);
		if (rc != CUDA_SUCCESS)
			return rc;
		made = pool;
		rc = cu.pool_alloc(&p, strtoull(argv[*i], NULL, 10) << 20, pool, (CUstream)0x1);
		return keep(rc, K_ASYNC, p);
	}
	if (strcmp(op, "locpoolon") == 0) {
		CUmemLocation loc = { CU_MEM_LOCATION_TYPE_DEVICE, atoi(argv[*i + 1]) };
		CUmemoryPool pool;

		*i += 2;
		NEED(cu.location_pool);
		NEED(cu.pool_alloc);
		rc = cu.location_pool(&pool, &loc, CU_MEM_ALLOCATION_TYPE_PINNED);
		if (rc != CUDA_SUCCESS)
			return rc;
		rc = cu.pool_alloc(&p, strtoull(argv[*i], NULL, 10) << 20, pool, (CUstream)0x1);
		return keep(rc, K_ASYNC, p);
	}
	if (strcmp(op, "pool") == 0) {
		CUmemoryPool pool;

		(*i)++;
		NEED(cu.default_pool);
		NEED(cu.pool_alloc);
		rc = cu.default_pool(&pool, cur_dev);
		if (rc != CUDA_SUCCESS)
			return rc;
		rc = cu.pool_alloc(&p, mib, pool, NULL);
		return keep(rc, K_ASYNC, p);
	}
	if (strcmp(op, "create") == 0) {
		CUmemAllocationProp prop;
		CUmemGenericAllocationHandle hd = 0;

		(*i)++;
		NEED(cu.create);
		memset(&prop, 0, sizeof(prop));
		prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
		prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
		prop.location.id = cur_dev;
		rc = cu.create(&hd, mib, &prop, 0);
		return keep(rc, K_HANDLE, hd);
	}
	if (strcmp(op, "array") == 0) {
		CUDA_ARRAY_DESCRIPTOR d = { strtoull(argv[*i + 1], NULL, 10),
					    strtoull(argv[*i + 2], NULL, 10), CU_AD_FORMAT_FLOAT,
					    1 };
		CUarray a = NULL;

		*i += 2;
		NEED(cu.array);
		rc = cu.array(&a, &d);
		return keep(rc, K_ARRAY, (uint64_t)(uintptr_t)a);
	}
	if (strcmp(op, "array3d") == 0 || strcmp(op, "mipmap") == 0) {
		int mip = op[0] == 'm';
		CUDA_ARRAY3D_DESCRIPTOR d = { strtoull(argv[*i + 1], NULL, 10),
					      strtoull(argv[*i + 2], NULL, 10),
					      mip ? 0 : strtoull(argv[*i + 3], NULL, 10),
					      CU_AD_FORMAT_FLOAT,
					      1,
					      0 };
		unsigned int levels = (unsigned int)strtoul(argv[*i + 3], NULL, 10);

		*i += 3;
		if (mip) {
			CUmipmappedArray m = NULL;

			NEED(cu.mipmap);
			rc = cu.mipmap(&m, &d, levels);
			return keep(rc, K_MIPMAP, (uint64_t)(uintptr_t)m);
		} else {
			CUarray a = NULL;

			NEED(cu.array3d);
			rc = cu.array3d(&a, &d);
			return keep(rc, K_ARRAY, (uint64_t)(uintptr_t)a);
		}
	}
	return CUDA_ERROR_INVALID_VALUE;
}

/* --- pools and synchronisation ------------------------------------------------- */

#define CU_MEMPOOL_ATTR_RELEASE_THRESHOLD 4
#define CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT 5

/* Whether op is one of the n names in ops. */
static int in_list(const char *op, const char *const *ops, size_t n)
{
	for (size_t k = 0; k < n; k++)
		if (strcmp(op, ops[k]) == 0)
			return 1;
	return 0;
}

static int is_pool_step(const char *op)
{
	static const char *const ops[] = { "sync",    "sync2",	    "ssync",	  "esync",
					   "trim",    "keep",	    "reserved",	  "newpool",
					   "setpool", "setlocpool", "pooldestroy" };

	return in_list(op, ops, sizeof(ops) / sizeof(ops[0]));
}

/* Steps that take an argument: trim MIB, keep MIB|max. */
static int pool_step_args(const char *op)
{
	return strcmp(op, "trim") == 0 || strcmp(op, "keep") == 0;
}

/*
 * sync/sync2/ssync/esync: cuCtxSynchronize (v1, v2), cuStreamSynchronize,
 * cuEventSynchronize of an event recorded on the null stream. trim MIB,
 * keep MIB|max (release threshold), reserved: on the device's current pool.
 * newpool: a pool on the device; setpool/setlocpool: make it current (v1,
 * CUDA 13); pooldestroy: destroy it.
 */
static CUresult pool_step(const char *op, const char *arg)
{
	cuuint64_t bytes = strcmp(arg, "max") == 0 ? UINT64_MAX : strtoull(arg, NULL, 10) << 20;
	CUmemoryPool pool;
	CUresult rc;

	if (strcmp(op, "sync") == 0) {
		NEED(cu.ctx_sync);
		return cu.ctx_sync();
	}
	if (strcmp(op, "sync2") == 0) {
		NEED(cu.ctx_sync2);
		return cu.ctx_sync2(NULL);
	}
	if (strcmp(op, "ssync") == 0) {
		NEED(cu.stream_sync);
		return cu.stream_sync(NULL);
	}
	if (strcmp(op, "esync") == 0) {
		CUevent ev;

		NEED(cu.event_create);
		NEED(cu.event_record);
		NEED(cu.event_sync);
		if ((rc = cu.event_create(&ev, 0)) != CUDA_SUCCESS ||
		    (rc = cu.event_record(ev, NULL)) != CUDA_SUCCESS)
			return rc;
		return cu.event_sync(ev);
	}
	if (strcmp(op, "newpool") == 0) {
		CUmemPoolProps props;

		NEED(cu.pool_create);
		memset(&props, 0, sizeof(props));
		props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
		props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
		props.location.id = cur_dev;
		return cu.pool_create(&made, &props);
	}
	if (strcmp(op, "setpool") == 0) {
		NEED(cu.set_pool);
		return cu.set_pool(cur_dev, made);
	}
	if (strcmp(op, "setlocpool") == 0) {
		CUmemLocation loc = { CU_MEM_LOCATION_TYPE_DEVICE, cur_dev };

		NEED(cu.set_loc_pool);
		return cu.set_loc_pool(&loc, CU_MEM_ALLOCATION_TYPE_PINNED, made);
	}
	if (strcmp(op, "pooldestroy") == 0) {
		NEED(cu.pool_destroy);
		return cu.pool_destroy(made);
	}
	NEED(cu.get_pool);
	if ((rc = cu.get_pool(&pool, cur_dev)) != CUDA_SUCCESS)
		return rc;
	if (strcmp(op, "trim") == 0) {
		NEED(cu.trim);
		return cu.trim(pool, bytes);
	}
	if (strcmp(op, "keep") == 0) {
		NEED(cu.pool_set);
		return cu.pool_set(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &bytes);
	}
	NEED(cu.pool_get);
	rc = cu.pool_get(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &bytes);
	if (rc == CUDA_SUCCESS)
		printf("reserved %llu\n", (unsigned long long)bytes);
	return rc;
}

/* --- graph memory ---------------------------------------------------------------- */

#define CU_STREAM_CAPTURE_MODE_RELAXED 2
#define CU_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH 1
#define CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT 2

static CUstream gstream; /* the stream graph steps capture on and launch on */
static CUgraphExec gexec;

static int is_graph_step(const char *op)
{
	static const char *const ops[] = { "gcapture", "gkeep",	   "glaunch",  "gupload",
					   "gtrim",    "gdestroy", "greserved" };

	return in_list(op, ops, sizeof(ops) / sizeof(ops[0]));
}

static int graph_step_args(const char *op)
{
	return strcmp(op, "gcapture") == 0 || strcmp(op, "gkeep") == 0 ||
	       strcmp(op, "glaunch") == 0;
}

/* A capture of an allocation of MIB, freed in the graph unless keep. */
static CUresult graph_capture(size_t bytes, int keep)
{
	CUdeviceptr p = 0;
	void *graph = NULL;
	CUresult rc, end;

	NEED(cu.begin_capture);
	NEED(cu.end_capture);
	NEED(cu.instantiate);
	NEED(cu.async);
	NEED(cu.free_async);
	if (gstream == NULL) {
		NEED(cu.stream_create);
		if ((rc = cu.stream_create(&gstream, 0)) != CUDA_SUCCESS)
			return rc;
	}
	if ((rc = cu.begin_capture(gstream, CU_STREAM_CAPTURE_MODE_RELAXED)) != CUDA_SUCCESS)
		return rc;
	rc = cu.async(&p, bytes, gstream);
	if (rc == CUDA_SUCCESS && !keep)
		rc = cu.free_async(p, gstream);
	end = cu.end_capture(gstream, &graph);
	if (rc != CUDA_SUCCESS || (rc = end) != CUDA_SUCCESS)
		return rc;
	return cu.instantiate(&gexec, graph,
			      keep ? CU_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH : 0);
}

static CUresult graph_step(const char *op, const char *arg)
{
	cuuint64_t bytes = 0;
	CUresult rc = CUDA_SUCCESS;

	if (strcmp(op, "gcapture") == 0 || strcmp(op, "gkeep") == 0)
		return graph_capture(strtoull(arg, NULL, 10) << 20, op[1] == 'k');
	if (strcmp(op, "glaunch") == 0) {
		NEED(cu.graph);
		for (long k = strtol(arg, NULL, 10); k > 0 && rc == CUDA_SUCCESS; k--)
			rc = cu.graph(gexec, gstream);
		return rc;
	}
	if (strcmp(op, "gupload") == 0) {
		NEED(cu.upload);
		return cu.upload(gexec, gstream);
	}
	if (strcmp(op, "gtrim") == 0) {
		NEED(cu.graph_trim);
		return cu.graph_trim(cur_dev);
	}
	if (strcmp(op, "gdestroy") == 0) {
		NEED(cu.exec_destroy);
		return cu.exec_destroy(gexec);
	}
	NEED(cu.graph_attr);
	rc = cu.graph_attr(cur_dev, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, &bytes);
	if (rc == CUDA_SUCCESS)
		printf("greserved %llu\n", (unsigned long long)bytes);
	return rc;
}

/* --- launches ------------------------------------------------------------------ */

static int is_launch(const char *op)
{
	return strcmp(op, "launch") == 0 || strcmp(op, "launchpt") == 0 ||
	       strcmp(op, "launchex") == 0 || strcmp(op, "coop") == 0 || strcmp(op, "graph") == 0;
}

static CUresult launch_one(const char *kind)
{
	CUfunction f = (CUfunction)0x1;

	if (strcmp(kind, "launch") == 0)
		return cu.launch(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
	if (strcmp(kind, "launchpt") == 0) {
		NEED(cu.launch_pt);
		return cu.launch_pt(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
	}
	if (strcmp(kind, "launchex") == 0) {
		CUlaunchConfig c = { 1, 1, 1, 1, 1, 1, 0, NULL, NULL, 0 };

		NEED(cu.launch_ex);
		return cu.launch_ex(&c, f, NULL, NULL);
	}
	if (strcmp(kind, "coop") == 0) {
		NEED(cu.coop);
		return cu.coop(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL);
	}
	if (strcmp(kind, "graph") == 0) {
		NEED(cu.graph);
		return cu.graph((CUgraphExec)0x1, NULL);
	}
	return CUDA_ERROR_INVALID_VALUE;
}

/* --- bad arguments: whatever the driver answers, the shim must answer too ----- */

static void edge(void)
{
	CUdeviceptr p = 0, q = 0;
	size_t fr = 0;
	CUresult rc;

	printf("edge alloc_null %d\n", cu.alloc(NULL, 1 << 20));
	printf("edge alloc_zero %d\n", cu.alloc(&p, 0));
	printf("edge alloc_huge %d\n", cu.alloc(&p, SIZE_MAX));
	printf("edge alloc_near_huge %d\n", cu.alloc(&p, SIZE_MAX - (1 << 20)));
	printf("edge info_null %d\n", cu.info(NULL, NULL));
	printf("edge info_null_total %d\n", cu.info(&fr, NULL));
	printf("edge totalmem_null %d\n", cu.totalmem(NULL, cur_dev));
	printf("edge free_zero %d\n", cu.free(0));
	printf("edge free_unknown %d\n", cu.free((CUdeviceptr)0xdead0000));
	rc = cu.alloc(&q, 1 << 20);
	printf("edge alloc_ok %d\n", rc);
	printf("edge free_first %d\n", rc == CUDA_SUCCESS ? cu.free(q) : -1);
	printf("edge free_double %d\n", rc == CUDA_SUCCESS ? cu.free(q) : -1);
	if (cu.pitch != NULL) {
		size_t pitch = 0;

		printf("edge pitch_null %d\n", cu.pitch(&p, NULL, 64, 64, 4));
		printf("edge pitch_elem %d\n", cu.pitch(&p, &pitch, 64, 64, 3));
		printf("edge pitch_huge %d\n", cu.pitch(&p, &pitch, SIZE_MAX / 2, 4, 4));
	}
	if (cu.create != NULL) {
		CUmemGenericAllocationHandle h = 0;
		CUmemAllocationProp bad;

		printf("edge create_null_prop %d\n", cu.create(&h, 2 << 20, NULL, 0));
		/* A device the driver does not have: its own error, not a made-up one. */
		memset(&bad, 0, sizeof(bad));
		bad.type = CU_MEM_ALLOCATION_TYPE_PINNED;
		bad.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
		bad.location.id = 99;
		printf("edge create_bad_ordinal %d\n", cu.create(&h, 2 << 20, &bad, 0));
		bad.location.id = -1;
		printf("edge create_negative_ordinal %d\n", cu.create(&h, 2 << 20, &bad, 0));
		printf("edge release_unknown %d\n", cu.release(0xdeadULL));
	}
	if (cu.array != NULL) {
		CUDA_ARRAY_DESCRIPTOR d = { 0, 0, CU_AD_FORMAT_FLOAT, 1 };
		CUarray a = NULL;

		printf("edge array_null_desc %d\n", cu.array(&a, NULL));
		printf("edge array_zero %d\n", cu.array(&a, &d));
	}
	if (cu.async != NULL) {
		printf("edge async_null %d\n", cu.async(NULL, 1 << 20, NULL));
		printf("edge async_zero %d\n", cu.async(&p, 0, NULL));
		printf("edge free_async_unknown %d\n",
		       cu.free_async((CUdeviceptr)0xdead0000, NULL));
	}
}

/* --- many threads ---------------------------------------------------------------- */

struct churn {
	int n;
	size_t max_bytes;
	unsigned int seed;
	int ok, failed;
};

static uint64_t held, max_held;

static void *churn(void *arg)
{
	struct churn *c = arg;
	CUdeviceptr mine[16] = { 0 };
	size_t size[16] = { 0 };

	/* Threads share the process's context; each makes it current for itself. */
	CUcontext ctx;
	if (cu.retain(&ctx, cur_dev) != CUDA_SUCCESS || cu.set_current(ctx) != CUDA_SUCCESS)
		return NULL;
	for (int k = 0; k < c->n; k++) {
		int j = (int)(rand_r(&c->seed) % 16);

		if (mine[j] != 0) {
			__atomic_fetch_sub(&held, size[j], __ATOMIC_SEQ_CST);
			if (cu.free(mine[j]) != CUDA_SUCCESS)
				c->failed++;
			mine[j] = 0;
			continue;
		}
		size[j] = ((size_t)rand_r(&c->seed) % c->max_bytes + 1) & ~(size_t)((2 << 20) - 1);
		size[j] = size[j] ? size[j] : (2 << 20);
		if (cu.alloc(&mine[j], size[j]) == CUDA_SUCCESS) {
			uint64_t now = __atomic_add_fetch(&held, size[j], __ATOMIC_SEQ_CST);
			uint64_t m = __atomic_load_n(&max_held, __ATOMIC_SEQ_CST);

			while (now > m &&
			       !__atomic_compare_exchange_n(&max_held, &m, now, 0, __ATOMIC_SEQ_CST,
							    __ATOMIC_SEQ_CST))
				;
			c->ok++;
		} else {
			mine[j] = 0;
		}
	}
	for (int j = 0; j < 16; j++) {
		if (mine[j] != 0) {
			__atomic_fetch_sub(&held, size[j], __ATOMIC_SEQ_CST);
			if (cu.free(mine[j]) != CUDA_SUCCESS)
				c->failed++;
		}
	}
	return NULL;
}

static void threads(int nthreads, int n, size_t max_bytes)
{
	pthread_t tid[256];
	struct churn c[256];
	int ok = 0, failed = 0;

	if (nthreads > 256)
		nthreads = 256;
	for (int t = 0; t < nthreads; t++) {
		c[t] = (struct churn){ n, max_bytes, (unsigned int)t * 7919u + 1, 0, 0 };
		pthread_create(&tid[t], NULL, churn, &c[t]);
	}
	for (int t = 0; t < nthreads; t++) {
		pthread_join(tid[t], NULL);
		ok += c[t].ok;
		failed += c[t].failed;
	}
	printf("threads ok=%d failed=%d maxheld=%llu\n", ok, failed, (unsigned long long)max_held);
}

/* --- virtual memory, contexts, streams, pools --------------------------------------- */

static struct {
	CUmemGenericAllocationHandle handle;
	CUdeviceptr va;
	size_t size;
} vmm;
static CUcontext made_ctx;

static CUresult vmm_step(const char *op, const char *arg)
{
	if (strcmp(op, "vmm") == 0 || strcmp(op, "vmmtwice") == 0) {
		int twice = op[3] == 't';
		CUmemAllocationProp prop;
		struct {
			CUmemLocation location;
			int flags;
		} access = { { CU_MEM_LOCATION_TYPE_DEVICE, cur_dev }, 3 };
		CUresult rc;

		NEED(cu.create);
		NEED(cu.reserve);
		NEED(cu.map);
		NEED(cu.set_access);
		memset(&prop, 0, sizeof(prop));
		prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
		prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
		prop.location.id = cur_dev;
		vmm.size = strtoull(arg, NULL, 10) << 20;
		if ((rc = cu.create(&vmm.handle, vmm.size, &prop, 0)) != CUDA_SUCCESS)
			return rc;
		if ((rc = cu.reserve(&vmm.va, vmm.size * (twice ? 3 : 1), 0, 0, 0)) != CUDA_SUCCESS)
			return rc;
		if ((rc = cu.map(vmm.va, vmm.size, 0, vmm.handle, 0)) != CUDA_SUCCESS)
			return rc;
		if (twice &&
		    (rc = cu.map(vmm.va + vmm.size, vmm.size, 0, vmm.handle, 0)) != CUDA_SUCCESS)
			return rc;
		return cu.set_access(vmm.va, vmm.size * (twice ? 2 : 1), &access, 1);
	}
	if (strcmp(op, "vmmrelease") == 0) {
		NEED(cu.release);
		return cu.release(vmm.handle);
	}
	if (strcmp(op, "vmmretain") == 0) {
		CUmemGenericAllocationHandle h = 0;
		CUresult rc;

		NEED(cu.retain_handle);
		rc = cu.retain_handle(&h, (void *)(uintptr_t)vmm.va);
		if (rc == CUDA_SUCCESS && h != vmm.handle)
			return CUDA_ERROR_UNKNOWN;
		return rc;
	}
	if (strcmp(op, "vmmunmap") == 0) {
		CUresult rc;

		NEED(cu.unmap);
		NEED(cu.addr_free);
		if ((rc = cu.unmap(vmm.va, vmm.size)) != CUDA_SUCCESS)
			return rc;
		return cu.addr_free(vmm.va, vmm.size);
	}
	return CUDA_ERROR_INVALID_VALUE;
}

static CUresult ctx_step(const char *op, const char *arg)
{
	CUcontext ctx;
	CUdevice dev;
	CUresult rc;

	if (strcmp(op, "ctx") == 0) {
		NEED(cu.ctx_create);
		if ((rc = cu.device_get(&dev, atoi(arg))) != CUDA_SUCCESS)
			return rc;
		rc = cu.ctx_create(&made_ctx, 0, dev);
		if (rc == CUDA_SUCCESS)
			cur_dev = dev;
		return rc;
	}
	if (strcmp(op, "ctxdestroy") == 0) {
		NEED(cu.ctx_destroy);
		if ((rc = cu.ctx_destroy(made_ctx)) != CUDA_SUCCESS)
			return rc;
		if ((rc = cu.retain(&ctx, cur_dev)) != CUDA_SUCCESS)
			return rc;
		return cu.set_current(ctx);
	}
	if (strcmp(op, "primreset") == 0) {
		NEED(cu.prim_reset);
		return cu.prim_reset(cur_dev);
	}
	if (strcmp(op, "primrelease") == 0) {
		NEED(cu.prim_release);
		return cu.prim_release(cur_dev);
	}
	if (strcmp(op, "stream") == 0) {
		NEED(cu.stream_create);
		NEED(cu.push);
		NEED(cu.pop);
		if ((rc = cu.device_get(&dev, atoi(arg))) != CUDA_SUCCESS ||
		    (rc = cu.retain(&ctx, dev)) != CUDA_SUCCESS ||
		    (rc = cu.push(ctx)) != CUDA_SUCCESS)
			return rc;
		rc = cu.stream_create(&strm, 0);
		cu.pop(&ctx);
		return rc;
	}
	return CUDA_ERROR_INVALID_VALUE;
}

static int is_vmm(const char *op)
{
	return strcmp(op, "vmm") == 0 || strcmp(op, "vmmrelease") == 0 ||
	       strcmp(op, "vmmretain") == 0 || strcmp(op, "vmmunmap") == 0 ||
	       strcmp(op, "vmmtwice") == 0;
}

static int is_ctx(const char *op)
{
	return strcmp(op, "ctx") == 0 || strcmp(op, "ctxdestroy") == 0 ||
	       strcmp(op, "primreset") == 0 || strcmp(op, "primrelease") == 0 ||
	       strcmp(op, "stream") == 0;
}

static void gpa_step(const char *name, int version, cuuint64_t flags)
{
	CUdriverProcAddressQueryResult st = -1;
	void *p = NULL;
	Dl_info info;
	CUresult rc = gpa(name, &p, version, flags, &st);
	const char *lib = "-", *sym = "-";

	if (p != NULL && dladdr(p, &info) != 0) {
		lib = info.dli_fname ? strrchr(info.dli_fname, '/') : NULL;
		lib = lib ? lib + 1 : (info.dli_fname ? info.dli_fname : "?");
		sym = info.dli_sname ? info.dli_sname : "?";
	}
	printf("gpa %s %d %llu rc=%d status=%d %s:%s\n", name, version, (unsigned long long)flags,
	       rc, st, lib, sym);
}

/* The file name of the library `p` lies in, or "-". */
static const char *lib_of(const void *p)
{
	Dl_info info;
	const char *slash;

	if (p == NULL || dladdr(p, &info) == 0 || info.dli_fname == NULL)
		return "-";
	slash = strrchr(info.dli_fname, '/');
	return slash ? slash + 1 : info.dli_fname;
}

#define ATTACH_NONE 1 /* no gpushare_attach in the process */

/* As a program that may run without the shim: look the API up, never link to it. */
static int attach_call(const char *ledger, const char *task)
{
	__typeof__(gpushare_attach) *attach = dlsym(RTLD_DEFAULT, "gpushare_attach");

	return attach != NULL ? attach(ledger, task) : ATTACH_NONE;
}

static void attach_print(int rc)
{
	const char *name = "unknown";

	switch (rc) {
	case ATTACH_NONE:
		printf("attach none\n");
		return;
	case GPUSHARE_OK:
		printf("attach ok\n");
		return;
	case GPUSHARE_E_INVAL:
		name = "INVAL";
		break;
	case GPUSHARE_E_ATTACHED:
		name = "ATTACHED";
		break;
	case GPUSHARE_E_TOO_LATE:
		name = "TOO_LATE";
		break;
	case GPUSHARE_E_LEDGER:
		name = "LEDGER";
		break;
	}
	printf("attach err %s\n", name);
}

static void attach_step(const char *ledger, const char *task)
{
	attach_print(attach_call(ledger, task));
}

/* attachbg: an attach on a thread of its own, racing the client's start-up. */
static pthread_t attach_thread;
static int attach_bg_rc;

static void *attach_bg(void *arg)
{
	char **args = arg;

	attach_bg_rc = attach_call(args[0], args[1]);
	return NULL;
}

static void mode_step(void)
{
	static const char *const names[] = { "inert", "enforce", "broken" };
	__typeof__(gpushare_mode) *mode = dlsym(RTLD_DEFAULT, "gpushare_mode");
	int m;

	if (mode == NULL) {
		printf("mode none\n");
		return;
	}
	m = mode();
	printf("mode %s\n", m >= 0 && m < 3 ? names[m] : "unknown");
}

static void counters_step(const char *bytes)
{
	__typeof__(gpushare_counters) *fn = dlsym(RTLD_DEFAULT, "gpushare_counters");
	unsigned long long words[4];
	int rc;

	if (fn == NULL) {
		printf("counters none\n");
		return;
	}
	memset(words, 0xff, sizeof(words));
	rc = fn((struct gpushare_counters *)words, strtoul(bytes, NULL, 10));
	printf("counters %d %llu %llu %llu %llu\n", rc, words[0], words[1], words[2], words[3]);
}

/* Steps that may come before the first driver call; returns 0 for any other. */
static int early_step(int argc, char **argv, int *i)
{
	const char *op = argv[*i];

	if (strcmp(op, "attach") == 0 && *i + 2 < argc) {
		attach_step(argv[*i + 1], argv[*i + 2]);
		*i += 3;
	} else if (strcmp(op, "attachbg") == 0 && *i + 2 < argc) {
		if (pthread_create(&attach_thread, NULL, attach_bg, &argv[*i + 1]) != 0) {
			fprintf(stderr, "cannot start a thread\n");
			exit(3);
		}
		*i += 3;
	} else if (strcmp(op, "mode") == 0) {
		mode_step();
		*i += 1;
	} else if (strcmp(op, "lookup") == 0) {
		void *h = dlopen("libcuda.so.1", RTLD_NOW);

		printf("lookup %s\n", lib_of(h ? dlsym(h, "cuGetProcAddress_v2") : NULL));
		*i += 1;
	} else {
		return 0;
	}
	return 1;
}

int main(int argc, char **argv)
{
	CUcontext ctx;
	CUresult rc;
	int first = 1;

	setvbuf(stdout, NULL, _IOLBF, 0);
	while (first < argc && early_step(argc, argv, &first))
		;
	bind_driver();
	if ((rc = cu.init(0)) != CUDA_SUCCESS ||
	    (rc = cu.device_get(&cur_dev, 0)) != CUDA_SUCCESS ||
	    (rc = cu.retain(&ctx, cur_dev)) != CUDA_SUCCESS ||
	    (rc = cu.set_current(ctx)) != CUDA_SUCCESS) {
		printf("init err %d\n", rc);
		return 4;
	}
	for (int i = first; i < argc; i++) {
		const char *op = argv[i];
		const char *arg = i + 1 < argc ? argv[i + 1] : "0";
		size_t extra = 0;

		if (make_args(op) > 0 && i + make_args(op) < argc) {
			rc = make(op, argv, &i, &extra);
			const char *name = strcmp(op, "allocb") == 0 ? "alloc" : op;

			if (rc != CUDA_SUCCESS)
				printf("%s err %d\n", name, rc);
			else if (strcmp(op, "pitch") == 0)
				printf("pitch ok %zu\n", extra);
			else
				printf("%s ok\n", name);
		} else if (strcmp(op, "fill") == 0) {
			size_t bytes = strtoull(arg, NULL, 10) << 20;
			CUdeviceptr p;
			int n = 0;

			i++;
			while ((rc = cu.alloc(&p, bytes)) == CUDA_SUCCESS &&
			       keep(rc, K_PTR, p) == CUDA_SUCCESS)
				n++;
			printf("fill %d\n", n);
		} else if (strcmp(op, "free") == 0) {
			rc = head < tail ? free_one(live[head++ % MAX_LIVE])
					 : CUDA_ERROR_INVALID_VALUE;
			printf(rc == CUDA_SUCCESS ? "free ok\n" : "free err %d\n", rc);
		} else if (strcmp(op, "info") == 0) {
			size_t fr = 0, tot = 0;

			rc = cu.info(&fr, &tot);
			if (rc == CUDA_SUCCESS)
				printf("info free=%zu total=%zu\n", fr, tot);
			else
				printf("info err %d\n", rc);
		} else if (strcmp(op, "totalmem") == 0) {
			size_t tot = 0;

			rc = cu.totalmem(&tot, cur_dev);
			printf("totalmem %zu\n", rc == CUDA_SUCCESS ? tot : 0);
		} else if (strcmp(op, "dev") == 0) {
			i++;
			if ((rc = cu.device_get(&cur_dev, atoi(arg))) == CUDA_SUCCESS &&
			    (rc = cu.retain(&ctx, cur_dev)) == CUDA_SUCCESS)
				rc = cu.set_current(ctx);
			printf(rc == CUDA_SUCCESS ? "dev ok\n" : "dev err %d\n", rc);
		} else if (is_launch(op)) {
			long n = strtol(arg, NULL, 10);

			i++;
			rc = CUDA_SUCCESS;
			for (long k = 0; k < n && rc == CUDA_SUCCESS; k++)
				rc = launch_one(op);
			printf(rc == CUDA_SUCCESS ? "%s ok\n" : "%s err %d\n", op, rc);
		} else if (is_vmm(op) || is_ctx(op)) {
			int takes_arg = strcmp(op, "vmm") == 0 || strcmp(op, "ctx") == 0 ||
					strcmp(op, "stream") == 0 || strcmp(op, "vmmtwice") == 0;

			rc = is_vmm(op) ? vmm_step(op, arg) : ctx_step(op, arg);
			i += takes_arg;
			if (rc != CUDA_SUCCESS)
				printf("%s err %d\n", op, rc);
			else
				printf(strcmp(op, "vmmretain") == 0 ? "%s ok same\n" : "%s ok\n",
				       op);
		} else if (strcmp(op, "heap") == 0 || strcmp(op, "stack") == 0) {
			int heap = op[0] == 'h';

			i++;
			rc = cu.set_limit == NULL
				     ? CUDA_ERROR_NOT_FOUND
				     : cu.set_limit(heap ? CU_LIMIT_MALLOC_HEAP_SIZE
							 : CU_LIMIT_STACK_SIZE,
						    strtoull(arg, NULL, 10) << (heap ? 20 : 0));
			printf(rc == CUDA_SUCCESS ? "%s ok\n" : "%s err %d\n", op, rc);
		} else if (is_pool_step(op)) {
			rc = pool_step(op, arg);
			i += pool_step_args(op);
			if (rc != CUDA_SUCCESS)
				printf("%s err %d\n", op, rc);
			else if (strcmp(op, "reserved") != 0)
				printf("%s ok\n", op);
		} else if (is_graph_step(op)) {
			rc = graph_step(op, arg);
			i += graph_step_args(op);
			if (rc != CUDA_SUCCESS)
				printf("%s err %d\n", op, rc);
			else if (strcmp(op, "greserved") != 0)
				printf("%s ok\n", op);
		} else if (strcmp(op, "unmapat") == 0 && i + 2 < argc) {
			size_t off = strtoull(argv[i + 1], NULL, 10) << 20;
			size_t len = strtoull(argv[i + 2], NULL, 10) << 20;

			i += 2;
			rc = cu.unmap != NULL ? cu.unmap(vmm.va + off, len) : CUDA_ERROR_NOT_FOUND;
			printf(rc == CUDA_SUCCESS ? "unmapat ok\n" : "unmapat err %d\n", rc);
		} else if (strcmp(op, "edge") == 0) {
			edge();
		} else if (strcmp(op, "gpa") == 0 && i + 3 < argc) {
			gpa_step(argv[i + 1], atoi(argv[i + 2]), strtoull(argv[i + 3], NULL, 10));
			i += 3;
		} else if (strcmp(op, "threads") == 0 && i + 3 < argc) {
			threads(atoi(argv[i + 1]), atoi(argv[i + 2]),
				strtoull(argv[i + 3], NULL, 10) << 20);
			i += 3;
		} else if (strcmp(op, "waitfile") == 0) {
			i++;
			printf("waiting\n");
			while (access(arg, F_OK) != 0)
				usleep(2000);
		} else if (strcmp(op, "fork") == 0) {
			pid_t pid;

			i++;
			pid = fork();
			if (pid == 0) {
				while (access(arg, F_OK) != 0)
					usleep(2000);
				_exit(0);
			}
			printf(pid > 0 ? "forked\n" : "fork failed\n");
		} else if (strcmp(op, "forkrest") == 0) {
			pid_t pid = fork();
			int st = 0;

			if (pid == 0)
				continue;
			if (pid < 0 || waitpid(pid, &st, 0) != pid) {
				printf("forkrest failed\n");
				return 5;
			}
			printf("forkrest exit=%d\n",
			       WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st));
			return 0;
		} else if (strcmp(op, "attach") == 0 && i + 2 < argc) {
			attach_step(argv[i + 1], argv[i + 2]);
			i += 2;
		} else if (strcmp(op, "mode") == 0) {
			mode_step();
		} else if (strcmp(op, "counters") == 0 && i + 1 < argc) {
			counters_step(argv[++i]);
		} else if (strcmp(op, "attachjoin") == 0) {
			pthread_join(attach_thread, NULL);
			attach_print(attach_bg_rc);
		} else if (strcmp(op, "sleep") == 0) {
			i++;
			usleep((useconds_t)(strtod(arg, NULL) * 1e6));
		} else {
			fprintf(stderr, "unknown step %s\n", op);
			return 2;
		}
	}
	return 0;
}
