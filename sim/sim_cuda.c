/*
 * A simulated CUDA driver, built as libcuda.so.1, for machines without
 * NVIDIA hardware. The shim is loaded in front of it exactly as it would be
 * in front of the real driver, so everything here follows the driver ABI:
 * entry point names, error codes and the cuGetProcAddress rules.
 *
 * Device memory is host memory that reads and writes, so copies and memsets
 * are real: each device's memory is a memfd as large as the device, mapped
 * shared and MAP_NORESERVE, and allocations are addresses inside it. Pages
 * nobody touched cost nothing (a 16 GiB device costs no RAM until written),
 * and freed ones are given back. Being a file, the same bytes can be mapped
 * again elsewhere: at a cuMemMap address, or in another process that opened
 * a cuIpcGetMemHandle handle. Kernels do not run: what they would compute
 * stays as it was.
 *
 * Linked with -Bsymbolic so that the pointers cuGetProcAddress hands out are
 * this library's own functions, never those of a preloaded interposer.
 *
 * The driver is split by area, its files sharing sim_driver.h. This one
 * starts it and keeps the device list and contexts; sim_entry.c has errors,
 * cuGetExportTable and cuGetProcAddress. The device heaps and all that
 * takes from them are sim_heap.c (allocations, arrays), sim_pools.c
 * (stream-ordered pools, graph memory), sim_vmm.c (virtual memory
 * management, shareable handles), sim_host.c (host memory, pointer
 * queries), sim_ipc.c (IPC handles) and sim_copy.c (the copies and memsets
 * that move real bytes), sharing sim_memory.h. sim_streams.c has streams,
 * stream capture and graphs that replay their copies, and launches;
 * sim_events.c has events; sim_modules.c has modules and kernels (loaded,
 * never run) and occupancy. Beyond allocation, all that is what real
 * libcudart and PyTorch need.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "sim_driver.h"
#include "sim_usage.h"

enum {
	SIM_UNINIT,
	SIM_READY
};

static struct sim_spec sim_specs[SIM_MAX_GPUS];
static int sim_nspecs;
struct sim_device sim_devs[SIM_MAX_GPUS];
int sim_ndevs;

static pthread_once_t sim_once = PTHREAD_ONCE_INIT;
static CUresult sim_init_result;
static int sim_state; /* SIM_READY is stored with release */

/* Lock order: sim_driver.h. */
pthread_mutex_t sim_ctx_lock = PTHREAD_MUTEX_INITIALIZER;
struct CUctx_st *sim_ctx_list;
static uint64_t sim_ctx_serial = SIM_MAX_GPUS; /* the last id handed out; atomic */

pthread_mutex_t sim_obj_lock = PTHREAD_MUTEX_INITIALIZER;
struct sim_obj *sim_obj_list;

__thread struct sim_ctx_slot sim_stack[SIM_CTX_DEPTH];
__thread unsigned int sim_depth;

bool sim_initialized(void)
{
	return __atomic_load_n(&sim_state, __ATOMIC_ACQUIRE) == SIM_READY;
}

CUresult sim_live(void)
{
	return sim_initialized() ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED;
}

CUresult sim_check_args(bool args_ok)
{
	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	return args_ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

bool sim_valid_dev(CUdevice dev)
{
	return dev >= 0 && dev < sim_ndevs;
}

/* What most device queries check first: initialized, out-pointer, ordinal. */
CUresult sim_check(const void *out, CUdevice dev)
{
	CUresult rc = sim_check_args(out != NULL);

	if (rc != CUDA_SUCCESS)
		return rc;
	return sim_valid_dev(dev) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}

CUresult sim_check_dev(CUdevice dev)
{
	return sim_check(&dev, dev);
}

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

/* Device list: GPUSHARE_SIM_GPUS (sim_spec.c), then CUDA_VISIBLE_DEVICES. */

/* A CUDA_VISIBLE_DEVICES entry as a spec index, or -1 if it is unusable. */
static int sim_visible_entry(const char *e, size_t len)
{
	int i, match = -1;
	size_t k;

	if (len > 4 && strncmp(e, "GPU-", 4) == 0) {
		if (len > SIM_UUID_LEN)
			return -1;
		for (k = 4; k < len; k++)
			if (e[k] != '-' && sim_hexval(e[k]) < 0)
				return -1;
		for (i = 0; i < sim_nspecs; i++) {
			if (strncasecmp(sim_specs[i].uuid, e, len) != 0)
				continue;
			if (match >= 0)
				return -1; /* ambiguous prefix */
			match = i;
		}
		return match;
	}
	if (len == 0 || len > 9)
		return -1;
	for (match = 0, k = 0; k < len; k++) {
		if (e[k] < '0' || e[k] > '9')
			return -1;
		match = match * 10 + (e[k] - '0');
	}
	return match < sim_nspecs ? match : -1;
}

static void sim_add_device(int spec_index)
{
	struct sim_device *d = &sim_devs[sim_ndevs];

	d->spec = &sim_specs[spec_index];
	d->spec_index = spec_index;
	d->index = sim_ndevs;
	d->heap.arena = d->spec->bytes & ~(size_t)(SIM_ALIGN - 1);
	pthread_mutex_init(&d->heap.lock, NULL);
	d->heap.spec_index = spec_index;
	d->default_pool.obj.kind = SIM_OBJ_POOL;
	d->default_pool.obj.dev = sim_ndevs;
	d->mempool = &d->default_pool;
	d->primary.id = SIM_PRIMARY_ID(sim_ndevs);
	d->primary.dev = sim_ndevs++;
}

/* As the real driver does, the list is cut at its first unusable entry. */
static void sim_apply_visible(void)
{
	const char *env = getenv("CUDA_VISIBLE_DEVICES");
	const char *p, *end, *comma;
	int i, idx;

	if (!env) {
		for (i = 0; i < sim_nspecs; i++)
			sim_add_device(i);
		return;
	}
	for (p = env;; p = comma + 1) {
		comma = strchr(p, ',');
		end = comma ? comma : p + strlen(p);
		while (p < end && isspace((unsigned char)*p))
			p++;
		while (end > p && isspace((unsigned char)end[-1]))
			end--;
		idx = sim_visible_entry(p, (size_t)(end - p));
		if (idx < 0)
			return;
		for (i = 0; i < sim_ndevs; i++)
			if (sim_devs[i].spec_index == idx)
				return;
		sim_add_device(idx);
		if (!comma)
			return;
	}
}

static void sim_init_once(void)
{
	sim_nspecs = sim_specs_load(sim_specs);
	if (sim_nspecs < 0) {
		sim_nspecs = 0;
		sim_init_result = CUDA_ERROR_INVALID_VALUE;
		return;
	}
	sim_apply_visible();
	if (sim_ndevs == 0) {
		sim_init_result = CUDA_ERROR_NO_DEVICE;
		return;
	}
	pthread_atfork(NULL, NULL, sim_atfork_child);
	__atomic_store_n(&sim_state, SIM_READY, __ATOMIC_RELEASE);
}

/*
 * Nothing is torn down at exit: a framework's own exit-time code (static
 * destructors, worker threads still running) keeps freeing and querying,
 * and a driver that failed those calls would abort the process. The
 * library is linked with -z nodelete, so dlclose never unloads it either;
 * the system takes the memory back with the process.
 */

/* Host objects behind array, pool and stream handles. */

void sim_obj_add(struct sim_obj *o)
{
	pthread_mutex_lock(&sim_obj_lock);
	o->next = sim_obj_list;
	sim_obj_list = o;
	pthread_mutex_unlock(&sim_obj_lock);
}

/*
 * With sim_obj_lock held: the link to the live object of this kind behind
 * handle, or NULL. Compared by address, so a made-up handle is never
 * dereferenced.
 */
struct sim_obj **sim_obj_find(const void *handle, enum sim_obj_kind kind)
{
	struct sim_obj **pp;

	if (!handle)
		return NULL;
	for (pp = &sim_obj_list; *pp && (*pp != handle || (*pp)->kind != kind); pp = &(*pp)->next)
		;
	return *pp ? pp : NULL;
}

/*
 * The live object of this kind behind handle, or NULL. With take it is
 * unlinked and the caller owns it; without, only the copy in *seen may be
 * read, since another thread may destroy the object as soon as the lock is
 * dropped.
 */
struct sim_obj *sim_obj_lookup(const void *handle, enum sim_obj_kind kind, bool take,
			       struct sim_obj *seen)
{
	struct sim_obj **pp, *o = NULL;

	pthread_mutex_lock(&sim_obj_lock);
	pp = sim_obj_find(handle, kind);
	if (pp) {
		o = *pp;
		*seen = *o;
		if (take)
			*pp = o->next;
	}
	pthread_mutex_unlock(&sim_obj_lock);
	return o;
}

/*
 * A copy of the first size bytes of the live object of this kind behind
 * handle (its whole struct), taken under sim_obj_lock; false if there is
 * no such object, and then *copy is left as it was.
 */
bool sim_obj_copy(const void *handle, enum sim_obj_kind kind, void *copy, size_t size)
{
	struct sim_obj **pp;

	pthread_mutex_lock(&sim_obj_lock);
	pp = sim_obj_find(handle, kind);
	if (pp)
		memcpy(copy, *pp, size);
	pthread_mutex_unlock(&sim_obj_lock);
	return pp != NULL;
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
 * What a real GPU does when a context goes: everything allocated in it is
 * freed (on whichever device: a pool on another device may have served it)
 * and its arrays and streams are destroyed, so their handles are unknown
 * from then on. cuMemCreate allocations, pools and the stream-ordered
 * memory taken from pools belong to no context.
 * Arrays are made and destroyed under sim_obj_lock, so none is half made or
 * half destroyed here. A thread still using a destroyed context (undefined
 * in the driver) allocates under a dead id, and that memory stays taken.
 */
static void sim_ctx_teardown(uint64_t id)
{
	struct sim_obj **pp, *o, *dead = NULL;
	int i;

	pthread_mutex_lock(&sim_obj_lock);
	for (pp = &sim_obj_list; (o = *pp);) {
		if (o->owner == id) {
			*pp = o->next;
			o->next = dead;
			dead = o;
		} else {
			pp = &o->next;
		}
	}
	for (o = dead; o; o = o->next)
		if (o->kind == SIM_OBJ_STREAM)
			sim_graph_free(sim_stream_gone_locked((struct CUstream_st *)o));
	for (i = 0; i < sim_ndevs; i++)
		sim_heap_sweep(&sim_devs[i].heap, id);
	pthread_mutex_unlock(&sim_obj_lock);
	sim_cls_drop(id);
	while ((o = dead)) {
		dead = o->next;
		free(o);
	}
}

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
	sim_ctx_teardown(c->id);
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

CUresult sim_impl_cuCtxSynchronize(void)
{
	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	/* Nothing ever runs, so there is nothing to wait for; pools settle. */
	sim_pools_settle();
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
		sim_ctx_teardown(SIM_PRIMARY_ID(dev));
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
	sim_ctx_teardown(SIM_PRIMARY_ID(dev));
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

/* Initialization and device queries. */

CUresult sim_impl_cuInit(unsigned int flags)
{
	if (flags != 0)
		return CUDA_ERROR_INVALID_VALUE;
	pthread_once(&sim_once, sim_init_once);
	return sim_init_result;
}

CUresult sim_impl_cuDriverGetVersion(int *version)
{
	if (!version)
		return CUDA_ERROR_INVALID_VALUE;
	*version = GS_SIM_DRIVER_VERSION;
	return CUDA_SUCCESS;
}

/* The device queries that answer one value, each into an out of its own type. */
enum sim_dev_query {
	SIM_DEV_COUNT,	   /* int: how many devices there are (dev is 0) */
	SIM_DEV_ORDINAL,   /* CUdevice: dev itself, once checked */
	SIM_DEV_UUID,	   /* CUuuid */
	SIM_DEV_TOTAL_MEM, /* size_t: bytes */
};

/* sim_check, then the value asked for into *out. */
static CUresult sim_device_query(void *out, CUdevice dev, enum sim_dev_query what)
{
	CUresult rc = sim_check(out, dev);

	if (rc != CUDA_SUCCESS)
		return rc;
	switch (what) {
	case SIM_DEV_COUNT:
		*(int *)out = sim_ndevs;
		break;
	case SIM_DEV_ORDINAL:
		*(CUdevice *)out = dev;
		break;
	case SIM_DEV_UUID:
		memcpy(out, sim_devs[dev].spec->uuid_bytes, sizeof(CUuuid));
		break;
	case SIM_DEV_TOTAL_MEM:
		*(size_t *)out = sim_devs[dev].spec->bytes;
		break;
	}
	return CUDA_SUCCESS;
}

/* sim_check, then a text buffer of len bytes: len must leave room for something. */
static CUresult sim_check_text(char *text, int len, CUdevice dev)
{
	CUresult rc = sim_check(text, dev);

	if (rc == CUDA_SUCCESS && len <= 0)
		rc = CUDA_ERROR_INVALID_VALUE;
	return rc;
}

CUresult sim_impl_cuDeviceGetCount(int *count)
{
	return sim_device_query(count, 0, SIM_DEV_COUNT);
}

CUresult sim_impl_cuDeviceGet(CUdevice *dev, int ordinal)
{
	return sim_device_query(dev, ordinal, SIM_DEV_ORDINAL);
}

CUresult sim_impl_cuDeviceGetName(char *name, int len, CUdevice dev)
{
	CUresult rc = sim_check_text(name, len, dev);

	if (rc == CUDA_SUCCESS)
		snprintf(name, (size_t)len, "%s", sim_devs[dev].spec->name);
	return rc;
}

CUresult sim_impl_cuDeviceGetUuid(CUuuid *uuid, CUdevice dev)
{
	return sim_device_query(uuid, dev, SIM_DEV_UUID);
}

/* _v2 differs from v1 only for MIG instances, and the simulation has none. */
CUresult sim_impl_cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev)
{
	return sim_impl_cuDeviceGetUuid(uuid, dev);
}

CUresult sim_impl_cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
	return sim_device_query(bytes, dev, SIM_DEV_TOTAL_MEM);
}

/* An H100-like set by default, each overridable per device (sim_attrs.c). */
CUresult sim_impl_cuDeviceGetAttribute(int *pi, int attrib, CUdevice dev)
{
	CUresult rc = sim_check(pi, dev);

	if (rc != CUDA_SUCCESS)
		return rc;
	return sim_device_attribute(sim_devs[dev].spec, attrib, pi) == 0 ? CUDA_SUCCESS
									 : CUDA_ERROR_INVALID_VALUE;
}

CUresult sim_impl_cuDeviceGetPCIBusId(char *bus_id, int len, CUdevice dev)
{
	CUresult rc = sim_check_text(bus_id, len, dev);

	if (rc == CUDA_SUCCESS)
		snprintf(bus_id, (size_t)len, "0000:%02x:00.0",
			 (unsigned int)sim_devs[dev].spec_index + 1);
	return rc;
}

/*
 * The CUDA 2.0-era ABI variants, with 32-bit sizes and device pointers.
 * cuda.h has mapped these names to their _v2 successors since CUDA 3.2, so
 * only a binary built against an older header, or a cuGetProcAddress caller
 * asking for a version before 3020, reaches them. 32-bit sizes cannot
 * describe the simulated devices, so the simulation refuses every one with
 * CUDA_ERROR_NOT_SUPPORTED; they exist so that, as in the real driver, each
 * ABI variant is its own exported function and never an alias of its _v2.
 */
CUresult sim_impl_cuDeviceTotalMem(unsigned int *bytes, CUdevice dev)
{
	(void)bytes, (void)dev;
	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult sim_impl_cuMemGetInfo(unsigned int *free_bytes, unsigned int *total_bytes)
{
	(void)free_bytes, (void)total_bytes;
	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult sim_impl_cuMemAlloc(sim_devptr_v1 *dptr, unsigned int bytesize)
{
	(void)dptr, (void)bytesize;
	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult sim_impl_cuMemAllocPitch(sim_devptr_v1 *dptr, unsigned int *pitch, unsigned int width,
				  unsigned int height, unsigned int elem)
{
	(void)dptr, (void)pitch, (void)width, (void)height, (void)elem;
	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult sim_impl_cuMemFree(sim_devptr_v1 dptr)
{
	(void)dptr;
	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	return CUDA_ERROR_NOT_SUPPORTED;
}

/* The v1 descriptors differ only in 32-bit extents; never read here. */
CUresult sim_impl_cuArrayCreate(CUarray *array, const void *desc)
{
	(void)array, (void)desc;
	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult sim_impl_cuArray3DCreate(CUarray *array, const void *desc)
{
	(void)array, (void)desc;
	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult sim_impl_cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
	(void)pctx, (void)flags, (void)dev;
	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	return CUDA_ERROR_NOT_SUPPORTED;
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
		sim_pools_settle();
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

/* Every simulated device reaches every other: one address space, no links to model. */
CUresult sim_impl_cuDeviceCanAccessPeer(int *can, CUdevice dev, CUdevice peer)
{
	CUresult rc = sim_check(can, dev);

	if (rc == CUDA_SUCCESS && !sim_valid_dev(peer))
		rc = CUDA_ERROR_INVALID_DEVICE;
	if (rc == CUDA_SUCCESS)
		*can = dev != peer;
	return rc;
}

CUresult sim_impl_cuDeviceGetP2PAttribute(int *v, int attr, CUdevice src, CUdevice dst)
{
	CUresult rc = sim_check(v, src);

	if (rc == CUDA_SUCCESS && !sim_valid_dev(dst))
		rc = CUDA_ERROR_INVALID_DEVICE;
	if (rc == CUDA_SUCCESS && src == dst)
		rc = CUDA_ERROR_INVALID_DEVICE;
	if (rc != CUDA_SUCCESS)
		return rc;
	/* 1: performance rank (0); 2: access; 3: native atomics; 4: array access. */
	switch (attr) {
	case 1:
		*v = 0;
		break;
	case 2:
	case 3:
	case 4:
		*v = 1;
		break;
	default:
		return CUDA_ERROR_INVALID_VALUE;
	}
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

/* "[domain:]bus:device.function", the domain optional, in hex. */
CUresult sim_impl_cuDeviceGetByPCIBusId(CUdevice *dev, const char *bus_id)
{
	unsigned int domain = 0, bus, device, fn;
	int i;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!dev || !bus_id)
		return CUDA_ERROR_INVALID_VALUE;
	if (sscanf(bus_id, "%x:%x:%x.%x", &domain, &bus, &device, &fn) != 4) {
		domain = 0;
		if (sscanf(bus_id, "%x:%x.%x", &bus, &device, &fn) != 3)
			return CUDA_ERROR_INVALID_VALUE;
	}
	for (i = 0; i < sim_ndevs; i++) {
		if (domain == 0 && device == 0 && fn == 0 &&
		    bus == (unsigned int)sim_devs[i].spec_index + 1) {
			*dev = i;
			return CUDA_SUCCESS;
		}
	}
	return CUDA_ERROR_INVALID_DEVICE;
}

CUresult sim_impl_cuDeviceComputeCapability(int *major, int *minor, CUdevice dev)
{
	CUresult rc = sim_check(major, dev);

	if (rc == CUDA_SUCCESS && !minor)
		rc = CUDA_ERROR_INVALID_VALUE;
	if (rc == CUDA_SUCCESS)
		rc = sim_impl_cuDeviceGetAttribute(major,
						   CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
						   dev);
	if (rc == CUDA_SUCCESS)
		rc = sim_impl_cuDeviceGetAttribute(minor,
						   CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
						   dev);
	return rc;
}

CUresult sim_impl_cuDeviceGetTexture1DLinearMaxWidth(size_t *width, int format,
						     unsigned int channels, CUdevice dev)
{
	CUresult rc = sim_check(width, dev);

	(void)format, (void)channels;
	if (rc == CUDA_SUCCESS)
		*width = (size_t)1 << 27;
	return rc;
}

CUresult sim_impl_cuDeviceGetExecAffinitySupport(int *supported, int type, CUdevice dev)
{
	CUresult rc = sim_check(supported, dev);

	(void)type;
	if (rc == CUDA_SUCCESS)
		*supported = 0;
	return rc;
}

CUresult sim_impl_cuFlushGPUDirectRDMAWrites(int target, int scope)
{
	(void)target, (void)scope;
	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	return CUDA_SUCCESS;
}
