/*
 * The simulated driver's contexts: each thread's context stack, contexts
 * made and destroyed, primary contexts retained, released and reset, and
 * what a context is asked (its device, id, limits, flags, peers). A
 * context's teardown frees what was allocated in it and destroys its
 * objects (sim_teardown: every area registered what it does then).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "sim_driver.h"
#include "sim_usage.h"

/* Lock order: sim_driver.h. */
pthread_mutex_t sim_ctx_lock = PTHREAD_MUTEX_INITIALIZER;
struct CUctx_st *sim_ctx_list;
static uint64_t sim_ctx_serial = SIM_MAX_GPUS; /* the last id handed out; atomic */

__thread struct sim_ctx_slot sim_stack[SIM_CTX_DEPTH];
__thread unsigned int sim_depth;

/*
 * sim_check(out, dev); when it passes, sim_ctx_lock is held for the caller
 * to release. A call with no out pointer passes &dev, as sim_check_dev does.
 */
static CUresult sim_primary_lock(const void *out, CUdevice dev)
{
	CUresult rc = sim_check(out, dev);

	if (rc == CUDA_SUCCESS)
		pthread_mutex_lock(&sim_ctx_lock);
	return rc;
}

/* Contexts. */

/* The calling thread's current context, or NULL. */
const struct sim_ctx_slot *sim_current(void)
{
	return sim_depth ? &sim_stack[sim_depth - 1] : NULL;
}

int sim_current_dev(void)
{
	return sim_depth ? sim_stack[sim_depth - 1].dev : -1;
}

/* A live context handle as a stack slot; false if there is none such. */
static bool sim_ctx_slot_of(CUcontext ctx, struct sim_ctx_slot *slot)
{
	struct CUctx_st *c;
	int i;

	slot->ctx = ctx;
	for (i = 0; ctx && i < sim_ndevs; i++) {
		if (ctx == &sim_devs[i].primary) {
			slot->dev = i;
			slot->id = SIM_PRIMARY_ID(i);
			return true;
		}
	}
	pthread_mutex_lock(&sim_ctx_lock);
	for (c = sim_ctx_list; ctx && c && c != ctx; c = c->next)
		;
	if (ctx && c) {
		slot->dev = c->dev;
		slot->id = c->id;
	}
	pthread_mutex_unlock(&sim_ctx_lock);
	return ctx && c;
}

static CUresult sim_push(const struct sim_ctx_slot *slot)
{
	if (sim_depth == SIM_CTX_DEPTH)
		return CUDA_ERROR_OUT_OF_MEMORY;
	sim_stack[sim_depth++] = *slot;
	return CUDA_SUCCESS;
}

/*
 * What a real GPU does when a context goes (sim_teardown): everything
 * allocated in it is freed (on whichever device: a pool on another device
 * may have served it) and its arrays and streams are destroyed, so their
 * handles are unknown from then on. cuMemCreate allocations, pools and the
 * stream-ordered memory taken from pools belong to no context. The registry
 * takes the context's objects off its list, and each area does its part
 * through the hooks it registered (sim_heap.c frees the memory, sim_streams.c
 * ends the captures of its streams, sim_tables.c drops the runtime's state).
 * Arrays are made and destroyed under sim_obj_lock, so none is half made or
 * half destroyed here. A thread still using a destroyed context (undefined
 * in the driver) allocates under a dead id, and that memory stays taken.
 */

/*
 * NVML lists the processes that hold a context on a device, with the memory
 * they use there (sim_usage.c): a context made or retained puts the process
 * on the list, and it leaves it when its last primary reference goes and it
 * holds no memory there but its context's. The first one takes the
 * device's context size (sim_heap_context_take): a device too full for it
 * fails the context, as the real driver does.
 */
static CUresult sim_usage_open(struct sim_device *d)
{
	CUresult rc;

	pthread_mutex_lock(&d->heap.lock);
	rc = sim_heap_context_take(d);
	if (rc == CUDA_SUCCESS)
		sim_usage_set(d->spec_index, d->heap.used);
	pthread_mutex_unlock(&d->heap.lock);
	return rc;
}

static void sim_usage_close(struct sim_device *d)
{
	bool idle;

	pthread_mutex_lock(&sim_ctx_lock);
	idle = d->primary_refs == 0;
	pthread_mutex_unlock(&sim_ctx_lock);
	pthread_mutex_lock(&d->heap.lock);
	if (idle && d->heap.used == (d->ctx_held ? d->ctx_len : 0)) {
		sim_heap_context_drop(d);
		sim_usage_clear(d->spec_index);
	}
	pthread_mutex_unlock(&d->heap.lock);
}

static CUresult sim_ctx_create(CUcontext *pctx, CUdevice dev)
{
	CUresult rc = sim_check(pctx, dev);
	struct sim_ctx_slot slot;
	struct CUctx_st *c;

	if (rc != CUDA_SUCCESS)
		return rc;
	c = calloc(1, sizeof(*c));
	if (!c)
		return CUDA_ERROR_OUT_OF_MEMORY;
	c->dev = dev;
	c->id = __atomic_add_fetch(&sim_ctx_serial, 1, __ATOMIC_RELAXED);
	slot.ctx = c;
	slot.dev = dev;
	slot.id = c->id;
	rc = sim_push(&slot);
	if (rc != CUDA_SUCCESS) {
		free(c);
		return rc;
	}
	pthread_mutex_lock(&sim_ctx_lock);
	c->next = sim_ctx_list;
	sim_ctx_list = c;
	pthread_mutex_unlock(&sim_ctx_lock);
	rc = sim_usage_open(&sim_devs[dev]);
	if (rc != CUDA_SUCCESS) {
		sim_impl_cuCtxDestroy_v2(c);
		return rc;
	}
	*pctx = c;
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
	(void)flags;
	return sim_ctx_create(pctx, dev);
}

/* Execution affinity (SM counts of a green context) means nothing here. */
CUresult sim_impl_cuCtxCreate_v3(CUcontext *pctx, void *affinity, int naffinity, unsigned int flags,
				 CUdevice dev)
{
	(void)affinity;
	(void)naffinity;
	(void)flags;
	return sim_ctx_create(pctx, dev);
}

CUresult sim_impl_cuCtxCreate_v4(CUcontext *pctx, void *params, unsigned int flags, CUdevice dev)
{
	(void)params;
	(void)flags;
	return sim_ctx_create(pctx, dev);
}

CUresult sim_impl_cuCtxDestroy_v2(CUcontext ctx)
{
	struct CUctx_st **pp, *c;
	unsigned int i, kept = 0;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!ctx)
		return CUDA_ERROR_INVALID_VALUE;
	pthread_mutex_lock(&sim_ctx_lock);
	for (pp = &sim_ctx_list; *pp && *pp != ctx; pp = &(*pp)->next)
		;
	c = *pp;
	if (c)
		*pp = c->next;
	pthread_mutex_unlock(&sim_ctx_lock);
	/* Primary contexts are not on the list: they are released, not destroyed. */
	if (!c)
		return CUDA_ERROR_INVALID_CONTEXT;
	/* Only the caller's stack can be fixed up; other threads keep a stale handle. */
	for (i = 0; i < sim_depth; i++)
		if (sim_stack[i].ctx != ctx)
			sim_stack[kept++] = sim_stack[i];
	sim_depth = kept;
	sim_teardown(c->id);
	free(c);
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuCtxSetCurrent(CUcontext ctx)
{
	struct sim_ctx_slot slot;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!ctx) {
		/* Documented as popping the stack, or nothing when it is empty. */
		if (sim_depth)
			sim_depth--;
		return CUDA_SUCCESS;
	}
	if (!sim_ctx_slot_of(ctx, &slot))
		return CUDA_ERROR_INVALID_CONTEXT;
	if (!sim_depth)
		return sim_push(&slot);
	sim_stack[sim_depth - 1] = slot;
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuCtxGetCurrent(CUcontext *pctx)
{
	CUresult rc = sim_check_args(pctx != NULL);

	if (rc == CUDA_SUCCESS)
		*pctx = sim_depth ? sim_stack[sim_depth - 1].ctx : NULL;
	return rc;
}

/* sim_check_args, then a current context: CUDA_ERROR_INVALID_CONTEXT without one. */
static CUresult sim_current_query(const void *out)
{
	CUresult rc = sim_check_args(out != NULL);

	if (rc == CUDA_SUCCESS && !sim_depth)
		rc = CUDA_ERROR_INVALID_CONTEXT;
	return rc;
}

CUresult sim_impl_cuCtxGetDevice(CUdevice *dev)
{
	CUresult rc = sim_current_query(dev);

	if (rc == CUDA_SUCCESS)
		*dev = sim_current_dev();
	return rc;
}

CUresult sim_impl_cuCtxPushCurrent_v2(CUcontext ctx)
{
	struct sim_ctx_slot slot;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	return sim_ctx_slot_of(ctx, &slot) ? sim_push(&slot) : CUDA_ERROR_INVALID_CONTEXT;
}

CUresult sim_impl_cuCtxPopCurrent_v2(CUcontext *pctx)
{
	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!sim_depth)
		return CUDA_ERROR_INVALID_CONTEXT;
	sim_depth--;
	if (pctx)
		*pctx = sim_stack[sim_depth].ctx;
	return CUDA_SUCCESS;
}

/*
 * Waits for the work of every stream of the context on the device timeline
 * (without it, nothing is outstanding); pools settle.
 */
static void sim_ctx_sync(uint64_t id)
{
	if (sim_tl_on())
		sim_tl_sleep_until(sim_tl_ctx_end(id));
	sim_sync();
}

CUresult sim_impl_cuCtxSynchronize(void)
{
	const struct sim_ctx_slot *cur;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	cur = sim_current();
	if (cur)
		sim_ctx_sync(cur->id);
	else
		sim_sync();
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
	CUresult rc = sim_primary_lock(pctx, dev);

	if (rc != CUDA_SUCCESS)
		return rc;
	sim_devs[dev].primary_refs++;
	pthread_mutex_unlock(&sim_ctx_lock);
	rc = sim_usage_open(&sim_devs[dev]);
	if (rc != CUDA_SUCCESS) {
		sim_impl_cuDevicePrimaryCtxRelease_v2(dev);
		return rc;
	}
	*pctx = &sim_devs[dev].primary;
	return CUDA_SUCCESS;
}

/*
 * The last release destroys the primary context, and with it what was
 * allocated in it. sim_ctx_lock is held throughout, so a retain on another
 * thread finds either the old context or a fresh one, never a half-torn one.
 */
CUresult sim_impl_cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
	CUresult rc = sim_primary_lock(&dev, dev);

	if (rc != CUDA_SUCCESS)
		return rc;
	if (!sim_devs[dev].primary_refs)
		rc = CUDA_ERROR_INVALID_CONTEXT;
	else if (--sim_devs[dev].primary_refs == 0)
		sim_teardown(SIM_PRIMARY_ID(dev));
	pthread_mutex_unlock(&sim_ctx_lock);
	if (rc == CUDA_SUCCESS)
		sim_usage_close(&sim_devs[dev]);
	return rc;
}

CUresult sim_impl_cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active)
{
	CUresult rc = sim_check(active, dev);

	if (rc == CUDA_SUCCESS && !flags)
		rc = CUDA_ERROR_INVALID_VALUE;
	if (rc != CUDA_SUCCESS)
		return rc;
	pthread_mutex_lock(&sim_ctx_lock);
	*active = sim_devs[dev].primary_refs > 0;
	pthread_mutex_unlock(&sim_ctx_lock);
	*flags = 0;
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuDevicePrimaryCtxSetFlags_v2(CUdevice dev, unsigned int flags)
{
	(void)flags;
	return sim_check_dev(dev);
}

/*
 * Documented as destroying all allocations and state of the primary
 * context; it does not release it, so the reference count stays as it is.
 */
CUresult sim_impl_cuDevicePrimaryCtxReset_v2(CUdevice dev)
{
	CUresult rc = sim_primary_lock(&dev, dev);

	if (rc != CUDA_SUCCESS)
		return rc;
	sim_teardown(SIM_PRIMARY_ID(dev));
	pthread_mutex_unlock(&sim_ctx_lock);
	return CUDA_SUCCESS;
}

/*
 * The pre-_v2 entry points of context teardown. Their prototypes are the
 * _v2 ones; the driver keeps them for runtimes built against older headers.
 */
CUresult sim_impl_cuCtxDestroy(CUcontext ctx)
{
	return sim_impl_cuCtxDestroy_v2(ctx);
}

CUresult sim_impl_cuDevicePrimaryCtxRelease(CUdevice dev)
{
	return sim_impl_cuDevicePrimaryCtxRelease_v2(dev);
}

CUresult sim_impl_cuDevicePrimaryCtxReset(CUdevice dev)
{
	return sim_impl_cuDevicePrimaryCtxReset_v2(dev);
}

CUresult sim_primary_handle(CUcontext *out, CUdevice dev)
{
	CUresult rc = sim_check(out, dev);

	if (rc == CUDA_SUCCESS)
		*out = &sim_devs[dev].primary;
	return rc;
}

bool sim_ctx_id(CUcontext ctx, uint64_t *id)
{
	const struct sim_ctx_slot *cur;
	struct sim_ctx_slot slot;

	if (!ctx) {
		cur = sim_current();
		if (!cur)
			return false;
		*id = cur->id;
		return true;
	}
	if (!sim_ctx_slot_of(ctx, &slot))
		return false;
	*id = slot.id;
	return true;
}

/* Contexts and devices: the rest of what the runtime queries. */

static size_t sim_limits[CU_LIMIT_COUNT] = {
	1024,	 /* stack size */
	1048576, /* printf FIFO */
	8388608, /* malloc heap */
	2,	 /* device runtime sync depth */
	2048,	 /* device runtime pending launches */
	32,	 /* max L2 fetch granularity */
	0,	 /* persisting L2 cache size */
	0,	 /* shared memory size */
	0,	 /* CIG enabled */
	0,	 /* CIG shared memory fallback */
};
static unsigned int sim_ctx_flags;

CUresult sim_impl_cuCtxGetLimit(size_t *v, int limit)
{
	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!v || limit < 0 || limit >= CU_LIMIT_COUNT)
		return CUDA_ERROR_INVALID_VALUE;
	*v = __atomic_load_n(&sim_limits[limit], __ATOMIC_RELAXED);
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuCtxSetLimit(int limit, size_t v)
{
	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (limit < 0 || limit >= CU_LIMIT_COUNT)
		return CUDA_ERROR_INVALID_VALUE;
	if (!sim_depth)
		return CUDA_ERROR_INVALID_CONTEXT;
	__atomic_store_n(&sim_limits[limit], v, __ATOMIC_RELAXED);
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuCtxGetFlags(unsigned int *flags)
{
	CUresult rc = sim_current_query(flags);

	if (rc == CUDA_SUCCESS)
		*flags = __atomic_load_n(&sim_ctx_flags, __ATOMIC_RELAXED);
	return rc;
}

CUresult sim_impl_cuCtxSetFlags(unsigned int flags)
{
	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!sim_depth)
		return CUDA_ERROR_INVALID_CONTEXT;
	__atomic_store_n(&sim_ctx_flags, flags, __ATOMIC_RELAXED);
	return CUDA_SUCCESS;
}

/* A context handle (NULL: the current one) as a stack slot. */
static CUresult sim_ctx_or_current(CUcontext ctx, struct sim_ctx_slot *slot)
{
	const struct sim_ctx_slot *cur;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (ctx)
		return sim_ctx_slot_of(ctx, slot) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
	cur = sim_current();
	if (!cur)
		return CUDA_ERROR_INVALID_CONTEXT;
	*slot = *cur;
	return CUDA_SUCCESS;
}

/* What a context (NULL: the current one) is asked, each into an out of its own type. */
enum sim_ctx_query {
	SIM_CTX_API_VERSION, /* unsigned int */
	SIM_CTX_ID,	     /* unsigned long long */
	SIM_CTX_DEVICE,	     /* CUdevice */
};

/* A NULL out is refused before the context is looked at. */
static CUresult sim_ctx_query(CUcontext ctx, void *out, enum sim_ctx_query what)
{
	struct sim_ctx_slot slot;
	CUresult rc = out ? sim_ctx_or_current(ctx, &slot) : CUDA_ERROR_INVALID_VALUE;

	if (rc != CUDA_SUCCESS)
		return rc;
	switch (what) {
	case SIM_CTX_API_VERSION:
		*(unsigned int *)out = 3020;
		break;
	case SIM_CTX_ID:
		*(unsigned long long *)out = slot.id;
		break;
	case SIM_CTX_DEVICE:
		*(CUdevice *)out = slot.dev;
		break;
	}
	return CUDA_SUCCESS;
}

/* The version of the context API the context was made with: 3020, the _v2 one. */
CUresult sim_impl_cuCtxGetApiVersion(CUcontext ctx, unsigned int *version)
{
	return sim_ctx_query(ctx, version, SIM_CTX_API_VERSION);
}

CUresult sim_impl_cuCtxGetId(CUcontext ctx, unsigned long long *id)
{
	return sim_ctx_query(ctx, id, SIM_CTX_ID);
}

CUresult sim_impl_cuCtxGetDevice_v2(CUdevice *dev, CUcontext ctx)
{
	return sim_ctx_query(ctx, dev, SIM_CTX_DEVICE);
}

CUresult sim_impl_cuCtxSynchronize_v2(CUcontext ctx)
{
	struct sim_ctx_slot slot;
	CUresult rc = sim_ctx_or_current(ctx, &slot);

	if (rc == CUDA_SUCCESS)
		sim_ctx_sync(slot.id);
	return rc;
}

CUresult sim_impl_cuCtxGetCacheConfig(int *config)
{
	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!config)
		return CUDA_ERROR_INVALID_VALUE;
	*config = 0; /* CU_FUNC_CACHE_PREFER_NONE */
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuCtxSetCacheConfig(int config)
{
	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	return config >= 0 && config <= 3 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult sim_impl_cuCtxResetPersistingL2Cache(void)
{
	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuCtxEnablePeerAccess(CUcontext peer, unsigned int flags)
{
	struct sim_ctx_slot slot;
	CUresult rc;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (flags != 0)
		return CUDA_ERROR_INVALID_VALUE;
	if (!sim_depth)
		return CUDA_ERROR_INVALID_CONTEXT;
	rc = sim_ctx_slot_of(peer, &slot) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
	if (rc == CUDA_SUCCESS && slot.dev == sim_current_dev())
		rc = CUDA_ERROR_INVALID_DEVICE;
	return rc;
}

CUresult sim_impl_cuCtxDisablePeerAccess(CUcontext peer)
{
	struct sim_ctx_slot slot;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	return sim_ctx_slot_of(peer, &slot) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

/*
 * sim_obj_new for the calling thread's current context (an array's or a
 * stream's): on its device, with its id as owner and the context itself;
 * NULL with *rc set (CUDA_ERROR_INVALID_CONTEXT without one) if none is made.
 */
void *sim_obj_new_current(size_t size, enum sim_obj_kind kind, CUresult *rc)
{
	const struct sim_ctx_slot *cur = sim_current();
	struct sim_obj *o = cur ? sim_obj_new(size, kind, cur->dev) : NULL;

	if (o) {
		o->owner = cur->id;
		o->ctx = cur->ctx;
	}
	*rc = !cur ? CUDA_ERROR_INVALID_CONTEXT : !o ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_SUCCESS;
	return o;
}

/* In a forked child: sim_ctx_lock, which another thread may have held, anew. */
static void sim_ctx_fork_child(void)
{
	pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;

	sim_ctx_lock = fresh;
}

static const struct sim_hooks sim_ctx_hooks = { .fork_child = sim_ctx_fork_child };

__attribute__((constructor)) static void sim_ctx_load(void)
{
	sim_hooks_add(&sim_ctx_hooks);
}
