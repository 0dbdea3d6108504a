/*
 * Probes the simulated driver on its own (no shim) for test_sim_driver.py.
 * Prints observations, one "KEY VALUE" line each; the test holds the
 * expectations, so a wrong value shows up as a named key in its diff.
 *
 *   sim_probe mem       every allocation path, its way back and its errors,
 *                       the launch entry points and the old ABI variants
 *   sim_probe resolve   reads "gpa BASE VERSION FLAGS" and "sym NAME" lines
 *                       from stdin; prints for each
 *                       "gpa BASE VERSION FLAGS RC STATUS VARIANT" (VARIANT is
 *                       what dladdr names the returned pointer, "-" if none)
 *                       or "sym NAME VARIANT"
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
CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice dev);
CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props);
CUresult cuMemPoolDestroy(CUmemoryPool pool);
CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
				       int option);

#define MIB ((size_t)1 << 20)

static void out(const char *key, long long value)
{
	printf("%s %lld\n", key, value);
}

/* Free bytes on a device, read through its primary context. */
static long long free_on(CUdevice dev)
{
	CUcontext ctx;
	size_t free_bytes = 0, total;

	if (cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS ||
	    cuCtxPushCurrent_v2(ctx) != CUDA_SUCCESS ||
	    cuMemGetInfo_v2(&free_bytes, &total) != CUDA_SUCCESS ||
	    cuCtxPopCurrent_v2(NULL) != CUDA_SUCCESS) {
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

static void back(const char *key, CUdevice dev, long long before)
{
	char k[128];

	snprintf(k, sizeof(k), "%s.back", key);
	out(k, before - free_on(dev));
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
	CUstream stream = (CUstream)0x5;	/* made up: never looked through */
	CUmemoryPool pool0 = NULL, pool1 = NULL, mine = NULL;
	CUmemPoolProps props = { 0 };
	CUdeviceptr p = 0, q = 0;
	long long f0 = free_on(0), f1 = free_on(1);

	out("async.rc", cuMemAllocAsync(&p, 5 * MIB, stream));
	taken("async", 0, f0);
	out("async.free", cuMemFreeAsync(p, stream));
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
	out("gran.rc", cuMemGetAllocationGranularity(&gran, &prop,
						     CU_MEM_ALLOC_GRANULARITY_MINIMUM));
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
	d3.Flags = 1;	/* CUDA_ARRAY3D_LAYERED: a layered 1D array */
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

	out("noctx.pitch", cuMemAllocPitch_v2(&p, &pitch, 64, 64, 4));
	out("noctx.managed", cuMemAllocManaged(&p, MIB, CU_MEM_ATTACH_GLOBAL));
	out("noctx.async", cuMemAllocAsync(&p, MIB, NULL));
	out("noctx.array", cuArrayCreate_v2(&a, &d2));
	out("noctx.ex", cuLaunchKernelEx(&cfg, (CUfunction)0x10, NULL, NULL));
	out("noctx.graph", cuGraphLaunch((CUgraphExec)0x20, NULL));
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
	probe_vmm();
	probe_arrays();
	probe_launch();
	probe_v1();
	/* Everything above gave back what it took. */
	out("all.back", f0 - free_on(0));
	out("ctx_v3.destroy", cuCtxDestroy_v2(ctx));
	probe_no_context();
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
	char line[512], name[256];
	int version;
	unsigned long long flags;

	out("init", cuInit(0));
	while (fgets(line, sizeof(line), stdin)) {
		if (sscanf(line, "gpa %255s %d %llu", name, &version, &flags) == 3) {
			CUdriverProcAddressQueryResult status = -1;
			void *fn = NULL;
			CUresult rc = cuGetProcAddress_v2(name, &fn, version, flags, &status);

			printf("gpa %s %d %llu %d %d %s\n", name, version, flags, rc, status,
			       variant(fn));
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
