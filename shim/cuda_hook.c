/*
 * gpushare's preload library: sits between a framework and the CUDA driver,
 * charges every allocation to the environment's shared-memory ledger and
 * refuses what would exceed the grant.
 *
 * Three ways lead a program to the driver, and all three land here:
 *  - programs linked with -lcuda bind to the exported cu* definitions;
 *  - cuGetProcAddress (v1 and v2) hands out the shim's wrappers, itself
 *    included, so a runtime that re-fetches cuGetProcAddress stays caught;
 *  - dlsym on libcuda's handle (libcudart's way in) goes through the dlsym
 *    trampoline in dlsym_x86_64.S, which leaves RTLD_NEXT alone and lets
 *    RTLD_DEFAULT find a hooked name only where the driver has it.
 * NVML's memory queries are answered the same two ways (export and dlsym),
 * so nvidia-smi inside a task shows the environment's share.
 *
 * Settings are read once: at load or, for a shim that loaded inert, when
 * gpushare_attach (gpushare.h) gives them. The allocation path takes no lock
 * across a driver call, does no I/O and never logs; the launch path touches
 * shared memory with one relaxed load (the task's pause word) and one relaxed
 * add, and reads one process-local word in the same test as the pause word
 * (the compute gate, kept by the pacer thread: pacer.c).
 *
 * This file holds the wrappers but those of stream-ordered memory, pools,
 * synchronisations, capture and graph memory (pool_hook.c) and those of
 * virtual memory management (vmm_hook.c); shim.h says where the rest
 * lives. The launch wrappers and everything their fast path touches inline
 * stay in this one translation unit.
 */
#include "pacer.h"

/* --- wrappers: start-up and memory reports ------------------------------------ */

GS_EXPORT CUresult cuInit(unsigned int flags)
{
	gs_fn_cuInit fn = TRACED_FN(cuInit);
	CUresult rc = fn != NULL ? fn(flags) : CUDA_ERROR_NOT_FOUND;

	/* Claim the slot now, so launches are counted and pausable from the first. */
	if (rc == CUDA_SUCCESS && gs_state.mode == GS_ENFORCE)
		my_slot();
	return rc;
}

GS_EXPORT CUresult cuDeviceGetCount(int *count)
{
	gs_fn_cuDeviceGetCount fn = TRACED_FN(cuDeviceGetCount);

	return fn != NULL ? fn(count) : CUDA_ERROR_NOT_FOUND;
}

/*
 * The environment's share of ledger GPU `gpu` as a device report: total is
 * the limit, free what is left of the environment's pool; neither beyond
 * what the device itself reports.
 */
static void share(int gpu, uint64_t *total, uint64_t *free_bytes, uint64_t *used)
{
	uint64_t limit = gpu >= 0 ? gs_ledger_limit(gs_state.ledger, (uint32_t)gpu) : 0;
	uint64_t u = gpu >= 0 ? gs_ledger_charged(gs_state.ledger, (uint32_t)gpu) : 0;
	uint64_t left = u < limit ? limit - u : 0;

	if (limit < *total)
		*total = limit;
	if (left < *free_bytes)
		*free_bytes = left;
	if (used != NULL)
		*used = u;
}

GS_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
	uint64_t total, ignored = UINT64_MAX;
	int gpu;

	gs_fn_cuDeviceTotalMem_v2 fn = TRACED_FN(cuDeviceTotalMem_v2);
	CUresult rc = fn != NULL ? fn(bytes, dev) : CUDA_ERROR_NOT_FOUND;

	/* A broken shim allocates nothing: it shows nothing, never the whole device. */
	if (rc == CUDA_SUCCESS && gs_state.mode == GS_BROKEN)
		*bytes = 0;
	if (rc != CUDA_SUCCESS || gs_state.mode != GS_ENFORCE)
		return rc;
	gpu = ledger_gpu(dev);
	if (gpu >= 0) {
		total = *bytes;
		share(gpu, &total, &ignored, NULL);
		*bytes = (size_t)total;
	}
	return rc;
}

GS_EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes)
{
	uint64_t total, left;
	int gpu;

	gs_fn_cuMemGetInfo_v2 fn = TRACED_FN(cuMemGetInfo_v2);
	CUresult rc = fn != NULL ? fn(free_bytes, total_bytes) : CUDA_ERROR_NOT_FOUND;

	if (rc == CUDA_SUCCESS && gs_state.mode == GS_BROKEN)
		*free_bytes = *total_bytes = 0; /* as cuDeviceTotalMem_v2 */
	if (rc != CUDA_SUCCESS || gs_state.mode != GS_ENFORCE)
		return rc;
	if (current_gpu(&gpu) != CUDA_SUCCESS)
		return rc;
	/* A device that is not the node's has no share: nothing of it is usable. */
	total = gpu >= 0 ? *total_bytes : 0;
	left = *free_bytes;
	share(gpu, &total, &left, NULL);
	*total_bytes = (size_t)total;
	*free_bytes = (size_t)left;
	return rc;
}

/* The primary context is remembered, and its retains counted, for its teardown. */
GS_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev)
{
	CUresult rc;
	int charged;

	gs_fn_cuDevicePrimaryCtxRetain fn = TRACED_FN(cuDevicePrimaryCtxRetain);
	if (unlikely(fn == NULL))
		return CUDA_ERROR_NOT_FOUND;
	if (ctx == NULL)
		return fn(ctx, dev);
	rc = charge_context(dev, &charged);
	if (rc != CUDA_SUCCESS)
		return rc;
	if (dev < 0 || dev >= GS_MAX_DEVS || gs_state.mode != GS_ENFORCE) {
		rc = fn(ctx, dev);
		context_settle(charged, rc);
		return rc;
	}
	primary_retain_begin(dev);
	rc = fn(ctx, dev);
	context_settle(charged, rc);
	primary_retain_end(dev, rc, ctx);
	return rc;
}

/*
 * cuCtxCreate_v2, _v3 and _v4: the real entry of the one called (the others
 * NULL; all NULL where the driver lacks it) and its arguments but the context.
 */
struct ctx_create {
	gs_fn_cuCtxCreate_v2 v2;
	gs_fn_cuCtxCreate_v3 v3;
	gs_fn_cuCtxCreate_v4 v4;
	void *affinity; /* _v3 */
	int naffinity;	/* _v3 */
	void *params;	/* _v4 */
	unsigned int flags;
	CUdevice dev;
};

static CUresult ctx_create_call(const struct ctx_create *a, CUcontext *ctx)
{
	if (a->v2 != NULL)
		return a->v2(ctx, a->flags, a->dev);
	if (a->v3 != NULL)
		return a->v3(ctx, a->affinity, a->naffinity, a->flags, a->dev);
	return a->v4(ctx, a->params, a->flags, a->dev);
}

/* A new context: its device's context charge first, settled on the driver's answer. */
static CUresult ctx_create(CUcontext *ctx, const struct ctx_create *a)
{
	CUresult rc;
	int charged;

	if (unlikely(a->v2 == NULL && a->v3 == NULL && a->v4 == NULL))
		return CUDA_ERROR_NOT_FOUND;
	if (ctx == NULL)
		return ctx_create_call(a, ctx);
	rc = charge_context(a->dev, &charged);
	if (rc != CUDA_SUCCESS)
		return rc;
	rc = ctx_create_call(a, ctx);
	context_settle(charged, rc);
	return rc;
}

GS_EXPORT CUresult cuCtxCreate_v2(CUcontext *ctx, unsigned int flags, CUdevice dev)
{
	struct ctx_create a = { .v2 = TRACED_FN(cuCtxCreate_v2), .flags = flags, .dev = dev };

	return ctx_create(ctx, &a);
}

GS_EXPORT CUresult cuCtxCreate_v3(CUcontext *ctx, void *affinity, int naffinity, unsigned int flags,
				  CUdevice dev)
{
	struct ctx_create a = { .v3 = TRACED_FN(cuCtxCreate_v3),
				.affinity = affinity,
				.naffinity = naffinity,
				.flags = flags,
				.dev = dev };

	return ctx_create(ctx, &a);
}

GS_EXPORT CUresult cuCtxCreate_v4(CUcontext *ctx, void *params, unsigned int flags, CUdevice dev)
{
	struct ctx_create a = {
		.v4 = TRACED_FN(cuCtxCreate_v4), .params = params, .flags = flags, .dev = dev
	};

	return ctx_create(ctx, &a);
}

#define TEARDOWN_WRAPPER(abi, type, arg, how)                   \
	GS_EXPORT CUresult abi(type arg)                        \
	{                                                       \
		gs_fn_##abi fn = TRACED_FN(abi);                \
		return fn != NULL ? how : CUDA_ERROR_NOT_FOUND; \
	}

TEARDOWN_WRAPPER(cuCtxDestroy, CUcontext, ctx, teardown(fn, ctx, NULL, 0, 0))
TEARDOWN_WRAPPER(cuCtxDestroy_v2, CUcontext, ctx, teardown(fn, ctx, NULL, 0, 0))
TEARDOWN_WRAPPER(cuDevicePrimaryCtxRelease, CUdevice, dev, teardown(NULL, NULL, fn, dev, 1))
TEARDOWN_WRAPPER(cuDevicePrimaryCtxRelease_v2, CUdevice, dev, teardown(NULL, NULL, fn, dev, 1))
TEARDOWN_WRAPPER(cuDevicePrimaryCtxReset, CUdevice, dev, teardown(NULL, NULL, fn, dev, 0))
TEARDOWN_WRAPPER(cuDevicePrimaryCtxReset_v2, CUdevice, dev, teardown(NULL, NULL, fn, dev, 0))

/*
 * cuCtxSetLimit: the device malloc heap (CU_LIMIT_MALLOC_HEAP_SIZE) and the
 * per-thread stack (CU_LIMIT_STACK_SIZE, reserved for every thread the
 * device can hold at once: SMs x threads per SM) are device memory the
 * context takes when they are set. What a new value takes beyond the one it
 * replaces is charged first, refused beyond the limit with the driver's own
 * CUDA_ERROR_OUT_OF_MEMORY; what a smaller value gives back is uncharged,
 * and the context's end gives back the rest. The defaults are part of the
 * per-process context charge. One record per context holds the charge.
 */
static pthread_mutex_t limit_mu = PTHREAD_MUTEX_INITIALIZER;

static uint64_t limit_bytes(int limit, size_t value)
{
	gs_fn_cuDeviceGetAttribute attr = GS_REAL_FN(cuDeviceGetAttribute);
	gs_fn_cuCtxGetDevice get_dev = GS_REAL_FN(cuCtxGetDevice);
	int sms = 0, threads = 0;
	CUdevice dev;

	if (limit == CU_LIMIT_MALLOC_HEAP_SIZE)
		return value;
	if (attr == NULL || get_dev == NULL || get_dev(&dev) != CUDA_SUCCESS ||
	    attr(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev) != CUDA_SUCCESS ||
	    attr(&threads, CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR, dev) !=
		    CUDA_SUCCESS ||
	    sms <= 0 || threads <= 0)
		return 0;
	return mul_sat(value, (uint64_t)sms * (uint64_t)threads);
}

GS_EXPORT CUresult cuCtxSetLimit(int limit, size_t value)
{
	gs_fn_cuCtxGetLimit get = GS_REAL_FN(cuCtxGetLimit);
	uint64_t before, after, grow = 0, shrink = 0;
	struct gs_alloc rec;
	struct gs_charge c;
	CUcontext ctx;
	size_t old;
	CUresult rc;
	int gpu, had;

	gs_fn_cuCtxSetLimit fn = TRACED_FN(cuCtxSetLimit);
	if (unlikely(fn == NULL))
		return CUDA_ERROR_NOT_FOUND;
	if (gs_state.mode != GS_ENFORCE ||
	    (limit != CU_LIMIT_STACK_SIZE && limit != CU_LIMIT_MALLOC_HEAP_SIZE))
		return fn(limit, value);
	if (get == NULL || current_ctx(&ctx, &gpu) != CUDA_SUCCESS || gpu < 0 ||
	    get(&old, limit) != CUDA_SUCCESS)
		return fn(limit, value);
	before = limit_bytes(limit, old);
	after = limit_bytes(limit, value);
	if (after > before)
		grow = footprint(after - before);
	pthread_mutex_lock(&limit_mu);
	if (grow != 0) {
		alloc_gate();
		if (charge_gpu(gpu, grow, &c) != CUDA_SUCCESS) {
			pthread_mutex_unlock(&limit_mu);
			return CUDA_ERROR_OUT_OF_MEMORY;
		}
	}
	rc = fn(limit, value);
	had = gs_map_take((uint64_t)(uintptr_t)ctx, GS_K_LIMIT, &rec) == 0;
	if (!had)
		rec = (struct gs_alloc){ .key = (uint64_t)(uintptr_t)ctx,
					 .kind = GS_K_LIMIT,
					 .gpu = gpu,
					 .owner = (uint64_t)(uintptr_t)ctx,
					 .refs = 1,
					 .epoch = epoch_now() };
	if (rc != CUDA_SUCCESS) {
		if (grow != 0)
			uncharge(&c);
	} else if (grow != 0) {
		rec.size += grow;
	} else if (before > after) {
		shrink = footprint(before - after);
		shrink = shrink < rec.size ? shrink : rec.size;
		rec.size -= shrink;
	}
	if (shrink != 0)
		give_back(__atomic_load_n(&gs_state.slot, __ATOMIC_ACQUIRE), rec.gpu, shrink,
			  rec.epoch, rec.pinned);
	/* Out of memory for the record: the charge goes, as for any allocation. */
	if (rec.size != 0 && alloc_put(rec) != 0)
		uncharge_record(&rec);
	pthread_mutex_unlock(&limit_mu);
	return rc;
}

/* --- wrappers: allocations -------------------------------------------------------- */

/*
 * cuMemAlloc_v2 or cuMemAllocManaged: the real entry of the one called (the
 * other NULL; both NULL where the driver lacks it), and its flags.
 */
struct ptr_alloc {
	gs_fn_cuMemAlloc_v2 plain;
	gs_fn_cuMemAllocManaged managed;
	unsigned int flags; /* cuMemAllocManaged */
};

static inline CUresult ptr_alloc_call(const struct ptr_alloc *a, CUdeviceptr *dptr, size_t bytesize)
{
	if (a->plain != NULL)
		return a->plain(dptr, bytesize);
	return a->managed(dptr, bytesize, a->flags);
}

/*
 * A device-pointer allocation: the mode decides, then the driver answers bad
 * arguments itself; the footprint is charged before the driver call and
 * recorded (or given back) on its answer.
 */
static inline __attribute__((always_inline)) CUresult ptr_alloc(const struct ptr_alloc *a,
								CUdeviceptr *dptr, size_t bytesize)
{
	struct gs_charge c;
	CUresult rc;

	if (unlikely(a->plain == NULL && a->managed == NULL))
		return CUDA_ERROR_NOT_FOUND;
	if (gs_state.mode == GS_INERT)
		return ptr_alloc_call(a, dptr, bytesize);
	if (gs_state.mode == GS_BROKEN)
		return CUDA_ERROR_NOT_PERMITTED;
	if (dptr == NULL || bytesize == 0)
		return ptr_alloc_call(a, dptr, bytesize);
	rc = charge_current(footprint(bytesize), &c);
	if (rc != CUDA_SUCCESS)
		return rc;
	rc = ptr_alloc_call(a, dptr, bytesize);
	return settle(rc, *dptr, GS_K_PTR, &c, undo_ptr);
}

GS_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
	struct ptr_alloc a = { .plain = TRACED_FN(cuMemAlloc_v2) };

	return ptr_alloc(&a, dptr, bytesize);
}

GS_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
	struct ptr_alloc a = { .managed = TRACED_FN(cuMemAllocManaged), .flags = flags };

	return ptr_alloc(&a, dptr, bytesize);
}

/*
 * The pitch the driver picks is known only afterwards: charge for the width
 * rounded to the smallest alignment first, then settle on pitch x height.
 */
static CUresult settle_pitch(CUdeviceptr *dptr, size_t *pitch, size_t height, struct gs_charge *c)
{
	uint64_t actual = footprint(mul_sat(*pitch, height));
	struct gs_charge extra;

	if (actual > c->bytes) {
		if (charge_gpu(c->gpu, actual - c->bytes, &extra) != CUDA_SUCCESS) {
			undo_ptr(*dptr);
			uncharge(c);
			*dptr = 0;
			return CUDA_ERROR_OUT_OF_MEMORY;
		}
	} else if (actual < c->bytes) {
		extra = *c;
		extra.bytes = c->bytes - actual;
		uncharge(&extra);
	}
	c->bytes = actual;
	return remember(*dptr, GS_K_PTR, c, undo_ptr);
}

GS_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height,
				      unsigned int elem)
{
	struct gs_charge c;
	uint64_t row, guess;
	CUresult rc;

	gs_fn_cuMemAllocPitch_v2 fn = TRACED_FN(cuMemAllocPitch_v2);
	if (unlikely(fn == NULL))
		return CUDA_ERROR_NOT_FOUND;
	if (gs_state.mode == GS_INERT)
		return fn(dptr, pitch, width, height, elem);
	if (gs_state.mode == GS_BROKEN)
		return CUDA_ERROR_NOT_PERMITTED;
	if (dptr == NULL || pitch == NULL || width == 0 || height == 0)
		return fn(dptr, pitch, width, height, elem);
	row = width > UINT64_MAX - (GS_SMALL_ALIGN - 1)
		      ? UINT64_MAX
		      : (width + GS_SMALL_ALIGN - 1) & ~(GS_SMALL_ALIGN - 1);
	guess = footprint(mul_sat(row, height));
	rc = charge_current(guess, &c);
	if (rc != CUDA_SUCCESS)
		return rc;
	rc = fn(dptr, pitch, width, height, elem);
	if (rc != CUDA_SUCCESS) {
		uncharge(&c);
		return rc;
	}
	return settle_pitch(dptr, pitch, height, &c);
}

/*
 * Every free has the same shape: the record out before the driver frees
 * (forget), the driver's answer, then the charge settled (freed). A handle
 * the shim has no record of is the driver's business alone.
 */
#define FREE_WRAPPER(abi, params, key, kind, args)                   \
	GS_EXPORT CUresult abi params                                \
	{                                                            \
		struct gs_alloc a;                                   \
		gs_fn_##abi fn = TRACED_FN(abi);                     \
		if (unlikely(fn == NULL))                            \
			return CUDA_ERROR_NOT_FOUND;                 \
		if (!forget((uint64_t)(uintptr_t)(key), (kind), &a)) \
			return fn args;                              \
		return freed(fn args, &a);                           \
	}

FREE_WRAPPER(cuMemFree_v2, (CUdeviceptr dptr), dptr, GS_K_PTR, (dptr))
/* Pool memory goes back to its pool, which stays charged for what it keeps. */
FREE_WRAPPER(cuMemFreeAsync, (CUdeviceptr dptr, CUstream stream), dptr, GS_K_PTR, (dptr, stream))
FREE_WRAPPER(cuMemFreeAsync_ptsz, (CUdeviceptr dptr, CUstream stream), dptr, GS_K_PTR,
	     (dptr, stream))

/* --- wrappers: CUDA arrays ---------------------------------------------------------- */

/* Bytes per channel of an array format; the widest any format has for those not listed. */
static uint64_t format_bytes(int format)
{
	size_t n = gs_array_format_bytes(format);

	return n ? n : 16;
}

/* Layered and cubemap arrays keep their depth (layers, faces) at every mip level. */
#define GS_ARRAY3D_LAYERED 0x01
#define GS_ARRAY3D_CUBEMAP 0x04

static uint64_t array_bytes(size_t w, size_t h, size_t d, int format, unsigned int channels,
			    unsigned int flags, unsigned int levels)
{
	uint64_t elem = mul_sat(format_bytes(format), channels), total = 0;
	int keep_depth = (flags & (GS_ARRAY3D_LAYERED | GS_ARRAY3D_CUBEMAP)) != 0;

	h = h ? h : 1;
	d = d ? d : 1;
	for (unsigned int i = 0; i < (levels ? levels : 1); i++) {
		uint64_t level = mul_sat(mul_sat(mul_sat(w, h), d), elem);

		total = total + level < total ? UINT64_MAX : total + level;
		w = w > 1 ? w / 2 : 1;
		h = h > 1 ? h / 2 : 1;
		if (!keep_depth)
			d = d > 1 ? d / 2 : 1;
	}
	return footprint(total);
}

/*
 * cuArrayCreate_v2, cuArray3DCreate_v2 and cuMipmappedArrayCreate: the real
 * entry of the one called (the others NULL; all NULL where the driver lacks
 * it) and its arguments.
 */
struct array_create {
	gs_fn_cuArrayCreate_v2 flat;
	gs_fn_cuArray3DCreate_v2 deep;
	gs_fn_cuMipmappedArrayCreate mipmapped;
	CUarray *array;			       /* flat, deep */
	CUmipmappedArray *mipmap;	       /* mipmapped */
	const CUDA_ARRAY_DESCRIPTOR *desc;     /* flat */
	const CUDA_ARRAY3D_DESCRIPTOR *desc3d; /* deep, mipmapped */
	unsigned int levels;		       /* 1 but for mipmapped */
};

static CUresult array_create_call(const struct array_create *a)
{
	if (a->flat != NULL)
		return a->flat(a->array, a->desc);
	if (a->deep != NULL)
		return a->deep(a->array, a->desc3d);
	return a->mipmapped(a->mipmap, a->desc3d, a->levels);
}

/* The footprint of the array a describes. */
static uint64_t array_create_bytes(const struct array_create *a)
{
	const CUDA_ARRAY3D_DESCRIPTOR *d = a->desc3d;

	if (a->flat != NULL)
		return array_bytes(a->desc->Width, a->desc->Height, 1, a->desc->Format,
				   a->desc->NumChannels, 0, 1);
	return array_bytes(d->Width, d->Height, d->Depth, d->Format, d->NumChannels, d->Flags,
			   a->levels);
}

/*
 * An array's creation: the driver answers bad arguments itself, then the mode
 * decides; the footprint is charged before the driver call and recorded (or
 * given back) on its answer.
 */
static CUresult array_create(const struct array_create *a)
{
	struct gs_charge c;
	CUresult rc;

	if (unlikely(a->flat == NULL && a->deep == NULL && a->mipmapped == NULL))
		return CUDA_ERROR_NOT_FOUND;
	if (gs_state.mode == GS_INERT || (a->array == NULL && a->mipmap == NULL) ||
	    (a->desc == NULL && a->desc3d == NULL))
		return array_create_call(a);
	if (gs_state.mode == GS_BROKEN)
		return CUDA_ERROR_NOT_PERMITTED;
	rc = charge_current(array_create_bytes(a), &c);
	if (rc != CUDA_SUCCESS)
		return rc;
	rc = array_create_call(a);
	if (a->mipmapped != NULL)
		return settle(rc, (uint64_t)(uintptr_t)*a->mipmap, GS_K_MIPMAP, &c, undo_mipmap);
	return settle(rc, (uint64_t)(uintptr_t)*a->array, GS_K_ARRAY, &c, undo_array);
}

GS_EXPORT CUresult cuArrayCreate_v2(CUarray *array, const CUDA_ARRAY_DESCRIPTOR *desc)
{
	struct array_create a = {
		.flat = TRACED_FN(cuArrayCreate_v2), .array = array, .desc = desc, .levels = 1
	};

	return array_create(&a);
}

GS_EXPORT CUresult cuArray3DCreate_v2(CUarray *array, const CUDA_ARRAY3D_DESCRIPTOR *desc)
{
	struct array_create a = {
		.deep = TRACED_FN(cuArray3DCreate_v2), .array = array, .desc3d = desc, .levels = 1
	};

	return array_create(&a);
}

GS_EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *array,
					  const CUDA_ARRAY3D_DESCRIPTOR *desc, unsigned int levels)
{
	struct array_create a = { .mipmapped = TRACED_FN(cuMipmappedArrayCreate),
				  .mipmap = array,
				  .desc3d = desc,
				  .levels = levels };

	return array_create(&a);
}

FREE_WRAPPER(cuArrayDestroy, (CUarray array), array, GS_K_ARRAY, (array))
FREE_WRAPPER(cuMipmappedArrayDestroy, (CUmipmappedArray array), array, GS_K_MIPMAP, (array))

/* --- wrappers: launches --------------------------------------------------------------- */

static inline __attribute__((always_inline)) void launch_gate(void)
{
	uint32_t *pause = __atomic_load_n(&gs_hot.pause, __ATOMIC_ACQUIRE);
	uint64_t *launches = __atomic_load_n(&gs_hot.launches, __ATOMIC_ACQUIRE);

	/*
	 * The pause word and the compute gate in one test, both 0 unless a task is held or
	 * paced; then a burst's launch budget, never reached unless a burst is open.
	 */
	if (unlikely((__atomic_load_n(pause, __ATOMIC_RELAXED) |
		      (__atomic_load_n(&gs_compute_gate, __ATOMIC_RELAXED) & GS_GATE_CLOSED)) !=
			     0 ||
		     __atomic_load_n(launches, __ATOMIC_RELAXED) >=
			     __atomic_load_n(&gs_burst_end, __ATOMIC_RELAXED))) {
		wait_to_launch(pause);
		launches = __atomic_load_n(&gs_hot.launches, __ATOMIC_ACQUIRE);
	}
	__atomic_fetch_add(launches, 1, __ATOMIC_RELAXED);
}

/* Every launch entry: the gate, then the driver. */
#define LAUNCH_WRAPPER(abi, params, args)            \
	GS_EXPORT CUresult abi params                \
	{                                            \
		gs_fn_##abi fn = TRACED_FN(abi);     \
		if (unlikely(fn == NULL))            \
			return CUDA_ERROR_NOT_FOUND; \
		launch_gate();                       \
		return fn args;                      \
	}

LAUNCH_WRAPPER(cuLaunchKernel, GS_LAUNCH_PARAMS,
	       (f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra))
LAUNCH_WRAPPER(cuLaunchKernel_ptsz, GS_LAUNCH_PARAMS,
	       (f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra))
LAUNCH_WRAPPER(cuLaunchKernelEx, GS_EX_PARAMS, (config, f, params, extra))
LAUNCH_WRAPPER(cuLaunchKernelEx_ptsz, GS_EX_PARAMS, (config, f, params, extra))
LAUNCH_WRAPPER(cuLaunchCooperativeKernel, GS_COOP_PARAMS,
	       (f, gx, gy, gz, bx, by, bz, shmem, stream, params))
LAUNCH_WRAPPER(cuLaunchCooperativeKernel_ptsz, GS_COOP_PARAMS,
	       (f, gx, gy, gz, bx, by, bz, shmem, stream, params))

/* A graph launch may map graph memory: one flag read unless the process ever made some. */
#define GRAPH_LAUNCH_WRAPPER(abi)                                                      \
	GS_EXPORT CUresult abi(CUgraphExec exec, CUstream stream)                      \
	{                                                                              \
		CUresult rc;                                                           \
		gs_fn_##abi fn = TRACED_FN(abi);                                       \
		if (unlikely(fn == NULL))                                              \
			return CUDA_ERROR_NOT_FOUND;                                   \
		launch_gate();                                                         \
		rc = fn(exec, stream);                                                 \
		if (unlikely(__atomic_load_n(&gs_graph_mem, __ATOMIC_RELAXED) != 0) && \
		    rc == CUDA_SUCCESS)                                                \
			graph_launched(stream);                                        \
		return rc;                                                             \
	}

GRAPH_LAUNCH_WRAPPER(cuGraphLaunch)
GRAPH_LAUNCH_WRAPPER(cuGraphLaunch_ptsz)

/* --- wrappers: NVML -------------------------------------------------------------------- */

static int hexval(char c)
{
	if (c >= '0' && c <= '9')
		return c - '0';
	if (c >= 'a' && c <= 'f')
		return c - 'a' + 10;
	if (c >= 'A' && c <= 'F')
		return c - 'A' + 10;
	return -1;
}

/* Ledger GPU of an NVML device (by its "GPU-…" UUID), or GS_DEV_FOREIGN. */
static int nvml_gpu(nvmlDevice_t dev)
{
	gs_fn_nvmlDeviceGetUUID get = GS_NVML_FN(nvmlDeviceGetUUID);
	char text[GS_NVML_UUID_LEN];
	uint8_t bytes[16];
	int n = 0, gpu;

	if (get == NULL || get(dev, text, sizeof(text)) != NVML_SUCCESS)
		return GS_DEV_FOREIGN;
	text[sizeof(text) - 1] = '\0';
	if (strncmp(text, "GPU-", 4) != 0)
		return GS_DEV_FOREIGN; /* a MIG instance: not a GPU the node grants */
	for (const char *p = text + 4; *p != '\0' && n < 32; p++) {
		int v = hexval(*p);

		if (*p == '-')
			continue;
		if (v < 0)
			return GS_DEV_FOREIGN;
		bytes[n / 2] = (uint8_t)(n % 2 ? (bytes[n / 2] | v) : (v << 4));
		n++;
	}
	if (n != 32)
		return GS_DEV_FOREIGN;
	gpu = gs_ledger_gpu_index(gs_state.ledger, bytes);
	return gpu >= 0 ? gpu : GS_DEV_FOREIGN;
}

/* Rewrite an NVML memory report as the environment's share; untouched for other GPUs. */
static void nvml_share(nvmlDevice_t dev, unsigned long long *total, unsigned long long *free_b,
		       unsigned long long *used)
{
	uint64_t t = *total, f = *free_b, u = 0;
	int gpu = nvml_gpu(dev);

	if (gpu < 0)
		return;
	share(gpu, &t, &f, &u);
	*total = t;
	*free_b = f;
	*used = u < t ? u : t;
}

GS_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t dev, nvmlMemory_t *mem)
{
	gs_fn_nvmlDeviceGetMemoryInfo fn = TRACED_NVML_FN(nvmlDeviceGetMemoryInfo);
	nvmlReturn_t rc = fn != NULL ? fn(dev, mem) : NVML_ERROR_FUNCTION_NOT_FOUND;
	enum gs_mode mode = mode_acquire();

	if (rc == NVML_SUCCESS && mode == GS_BROKEN)
		mem->total = mem->free = mem->used = 0; /* as cuDeviceTotalMem_v2 */
	if (rc == NVML_SUCCESS && mode == GS_ENFORCE)
		nvml_share(dev, &mem->total, &mem->free, &mem->used);
	return rc;
}

GS_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t dev, nvmlMemory_v2_t *mem)
{
	gs_fn_nvmlDeviceGetMemoryInfo_v2 fn = TRACED_NVML_FN(nvmlDeviceGetMemoryInfo_v2);
	nvmlReturn_t rc = fn != NULL ? fn(dev, mem) : NVML_ERROR_FUNCTION_NOT_FOUND;
	enum gs_mode mode = mode_acquire();

	if (rc == NVML_SUCCESS && mode == GS_BROKEN)
		mem->total = mem->reserved = mem->free = mem->used = 0; /* as cuDeviceTotalMem_v2 */
	if (rc == NVML_SUCCESS && mode == GS_ENFORCE && nvml_gpu(dev) >= 0) {
		/* The driver's reservation is not the environment's to see. */
		mem->total -= mem->reserved < mem->total ? mem->reserved : mem->total;
		mem->reserved = 0;
		nvml_share(dev, &mem->total, &mem->free, &mem->used);
	}
	return rc;
}
