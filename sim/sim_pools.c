/*
 * The simulated driver's stream-ordered memory: memory pools (the device's
 * default pool and those made with cuMemPoolCreate), cuMemAllocAsync and
 * cuMemFreeAsync, pool attributes, and graph memory (the allocation and
 * free nodes of graphs).
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
 * Graph memory, as the driver models it. An allocation node (a
 * cuMemAllocAsync captured into a graph) gets a fixed address when it is
 * made, but no memory from any pool: the device's graph memory pool
 * provides it when a launch (or an upload) of an executable graph that
 * holds the node needs it. The pool keeps what it reserved after a graph
 * frees it, for later launches to reuse, until cuDeviceGraphMemTrim gives
 * back what no live graph allocation uses. The simulation has one address
 * space per device, its arena: a node's address range is taken from the
 * arena when the node is made (so it counts as used device memory from
 * then, see docs/simulator.md), while the graph pool's figures count what a
 * real driver maps. Reuse between allocations whose lifetimes do not
 * overlap is by bytes: the pool reserves the peak of what is live at once.
 *
 * Under sim_gmem_lock (after sim_obj_lock, before a heap lock): every
 * sim_galloc's fields and the pools' figures.
 */
struct sim_galloc {
	int dev;
	size_t off, len; /* its extent of the device's arena */
	size_t refs;	 /* ops of graphs and executable graphs, and 1 while live */
	bool live;	 /* allocated by a launch, not freed since */
	bool mark;	 /* scratch for sim_gmem_launch's dry run */
};

static pthread_mutex_t sim_gmem_lock = PTHREAD_MUTEX_INITIALIZER;
static struct {
	uint64_t used, used_high;	  /* bytes of live graph allocations */
	uint64_t reserved, reserved_high; /* bytes the pool holds */
} sim_gpool[SIM_MAX_GPUS];
/* Graph allocations in existence: frees look for one only when there are some. */
static size_t sim_gallocs; /* atomic */

struct sim_galloc *sim_galloc_new(int dev, size_t bytes, CUdeviceptr *out)
{
	struct sim_device *d = &sim_devs[dev];
	struct sim_galloc *ga;
	size_t size, at;
	CUresult rc;

	if (!sim_round(bytes, &size) || !(ga = calloc(1, sizeof(*ga))))
		return NULL;
	pthread_mutex_lock(&d->heap.lock);
	rc = sim_heap_take(d, size, SIM_ALIGN, SIM_MEM_PTR, 0, &at);
	if (rc == CUDA_SUCCESS) {
		d->heap.live[at].graph = ga;
		ga->off = d->heap.live[at].off;
		*out = (CUdeviceptr)(d->heap.base + ga->off);
	}
	pthread_mutex_unlock(&d->heap.lock);
	if (rc != CUDA_SUCCESS) {
		free(ga);
		return NULL;
	}
	ga->dev = dev;
	ga->len = size;
	ga->refs = 1; /* the node's */
	__atomic_add_fetch(&sim_gallocs, 1, __ATOMIC_RELAXED);
	return ga;
}

void sim_galloc_ref(struct sim_galloc *ga)
{
	pthread_mutex_lock(&sim_gmem_lock);
	ga->refs++;
	pthread_mutex_unlock(&sim_gmem_lock);
}

/* With sim_gmem_lock held: the last reference gone, its address range goes back. */
static void sim_galloc_unref_locked(struct sim_galloc *ga)
{
	struct sim_heap *h = &sim_devs[ga->dev].heap;
	struct sim_extent *e;

	if (--ga->refs)
		return;
	pthread_mutex_lock(&h->lock);
	e = sim_heap_find(h, ga->off, SIM_MEM_PTR);
	if (e && e->graph == ga)
		sim_heap_drop(h, e);
	pthread_mutex_unlock(&h->lock);
	__atomic_sub_fetch(&sim_gallocs, 1, __ATOMIC_RELAXED);
	free(ga);
}

void sim_galloc_unref(struct sim_galloc *ga)
{
	pthread_mutex_lock(&sim_gmem_lock);
	sim_galloc_unref_locked(ga);
	pthread_mutex_unlock(&sim_gmem_lock);
}

/* The graph allocation at addr, with a reference for the caller; NULL if none. */
struct sim_galloc *sim_galloc_at(CUdeviceptr addr)
{
	struct sim_galloc *ga = NULL;
	struct sim_extent *e;
	struct sim_heap *h;
	size_t off;

	if (!__atomic_load_n(&sim_gallocs, __ATOMIC_RELAXED) || !(h = sim_heap_of(addr, &off)))
		return NULL;
	pthread_mutex_lock(&sim_gmem_lock);
	pthread_mutex_lock(&h->lock);
	e = sim_heap_find(h, off, SIM_MEM_PTR);
	if (e && e->graph) {
		ga = e->graph;
		ga->refs++;
	}
	pthread_mutex_unlock(&h->lock);
	pthread_mutex_unlock(&sim_gmem_lock);
	return ga;
}

/* With sim_gmem_lock held: a launch reaches ga's allocation node. */
static void sim_galloc_alloc_locked(struct sim_galloc *ga)
{
	typeof(sim_gpool[0]) *p = &sim_gpool[ga->dev];

	/* Live still (no free and no auto-free since the last launch): nothing new is taken. */
	if (ga->live)
		return;
	ga->live = true;
	ga->refs++;
	p->used += ga->len;
	if (p->used > p->used_high)
		p->used_high = p->used;
	if (p->used > p->reserved)
		p->reserved = p->used;
	if (p->reserved > p->reserved_high)
		p->reserved_high = p->reserved;
}

/* With sim_gmem_lock held: ga's lifetime ends; its bytes stay reserved by the pool. */
static void sim_galloc_free_locked(struct sim_galloc *ga)
{
	if (!ga->live)
		return;
	ga->live = false;
	sim_gpool[ga->dev].used -= ga->len;
	sim_galloc_unref_locked(ga);
}

void sim_galloc_run(const struct sim_op *op)
{
	pthread_mutex_lock(&sim_gmem_lock);
	if (op->kind == SIM_OP_GALLOC)
		sim_galloc_alloc_locked(op->ga);
	else
		sim_galloc_free_locked(op->ga);
	pthread_mutex_unlock(&sim_gmem_lock);
}

/*
 * Before a launch (or for an upload) of an executable graph's ops: with
 * autofree (CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH) what its
 * allocation nodes left live is freed first; then the pool reserves the
 * peak of what the ops will hold at once, as a dry run of them finds.
 */
void sim_gmem_launch(const struct sim_op *ops, size_t n, bool autofree, bool upload)
{
	uint64_t cur[SIM_MAX_GPUS], peak[SIM_MAX_GPUS];
	size_t i;
	int d;

	pthread_mutex_lock(&sim_gmem_lock);
	for (i = 0; i < n; i++)
		if (autofree && !upload && ops[i].kind == SIM_OP_GALLOC)
			sim_galloc_free_locked(ops[i].ga);
	for (d = 0; d < sim_ndevs; d++)
		cur[d] = sim_gpool[d].used;
	for (i = 0; i < n; i++)
		if (ops[i].ga)
			ops[i].ga->mark = ops[i].ga->live;
	/* An upload sees what the launch after it will auto-free as free already. */
	for (i = 0; i < n; i++) {
		struct sim_galloc *ga = ops[i].ga;

		if (autofree && upload && ops[i].kind == SIM_OP_GALLOC && ga->mark) {
			ga->mark = false;
			cur[ga->dev] -= ga->len;
		}
	}
	for (d = 0; d < sim_ndevs; d++)
		peak[d] = cur[d];
	for (i = 0; i < n; i++) {
		struct sim_galloc *ga = ops[i].ga;

		if (ops[i].kind == SIM_OP_GALLOC && !ga->mark) {
			ga->mark = true;
			cur[ga->dev] += ga->len;
			if (cur[ga->dev] > peak[ga->dev])
				peak[ga->dev] = cur[ga->dev];
		} else if (ops[i].kind == SIM_OP_GFREE && ga->mark) {
			ga->mark = false;
			cur[ga->dev] -= ga->len;
		}
	}
	for (d = 0; d < sim_ndevs; d++) {
		if (peak[d] > sim_gpool[d].reserved)
			sim_gpool[d].reserved = peak[d];
		if (sim_gpool[d].reserved > sim_gpool[d].reserved_high)
			sim_gpool[d].reserved_high = sim_gpool[d].reserved;
	}
	pthread_mutex_unlock(&sim_gmem_lock);
}

/*
 * A graph allocation freed outside its graphs (cuMemFree, cuMemFreeAsync):
 * its lifetime ends. One that is not live (never launched, or freed
 * already) is left as it is.
 */
bool sim_graph_free_addr(CUdeviceptr addr)
{
	struct sim_galloc *ga = sim_galloc_at(addr);

	if (!ga)
		return false;
	pthread_mutex_lock(&sim_gmem_lock);
	sim_galloc_free_locked(ga);
	sim_galloc_unref_locked(ga);
	pthread_mutex_unlock(&sim_gmem_lock);
	return true;
}

CUresult sim_impl_cuDeviceGraphMemTrim(CUdevice dev)
{
	CUresult rc = sim_check_dev(dev);

	if (rc != CUDA_SUCCESS)
		return rc;
	pthread_mutex_lock(&sim_gmem_lock);
	sim_gpool[dev].reserved = sim_gpool[dev].used;
	pthread_mutex_unlock(&sim_gmem_lock);
	return CUDA_SUCCESS;
}

/* CUgraphMem_attribute: USED_MEM_CURRENT, USED_MEM_HIGH, RESERVED_MEM_CURRENT, _HIGH. */
CUresult sim_impl_cuDeviceGetGraphMemAttribute(CUdevice dev, int attr, void *value)
{
	CUresult rc = sim_check(value, dev);
	uint64_t v[4];

	if (rc != CUDA_SUCCESS)
		return rc;
	if (attr < 0 || attr > 3)
		return CUDA_ERROR_INVALID_VALUE;
	pthread_mutex_lock(&sim_gmem_lock);
	v[0] = sim_gpool[dev].used;
	v[1] = sim_gpool[dev].used_high;
	v[2] = sim_gpool[dev].reserved;
	v[3] = sim_gpool[dev].reserved_high;
	pthread_mutex_unlock(&sim_gmem_lock);
	*(uint64_t *)value = v[attr];
	return CUDA_SUCCESS;
}

/* Only the high-water marks can be set, and only to 0, which restarts them at current. */
CUresult sim_impl_cuDeviceSetGraphMemAttribute(CUdevice dev, int attr, void *value)
{
	CUresult rc = sim_check(value, dev);

	if (rc != CUDA_SUCCESS)
		return rc;
	if ((attr != 1 && attr != 3) || *(uint64_t *)value != 0)
		return CUDA_ERROR_INVALID_VALUE;
	pthread_mutex_lock(&sim_gmem_lock);
	if (attr == 1)
		sim_gpool[dev].used_high = sim_gpool[dev].used;
	else
		sim_gpool[dev].reserved_high = sim_gpool[dev].reserved;
	pthread_mutex_unlock(&sim_gmem_lock);
	return CUDA_SUCCESS;
}

/*
 * Stream-ordered allocation, done at once: the stream has always reached
 * the allocation or free by the time the call returns. What is allocated
 * belongs to the stream's context.
 */

static bool sim_valid_pool_props(const CUmemPoolProps *props)
{
	return props->allocType == CU_MEM_ALLOCATION_TYPE_PINNED &&
	       props->location.type == CU_MEM_LOCATION_TYPE_DEVICE &&
	       sim_valid_dev(props->location.id);
}

/* With sim_obj_lock held: the device of a live pool handle, or -1. */
static int sim_pool_device_locked(CUmemoryPool pool)
{
	struct sim_obj **pp;
	int i;

	for (i = 0; pool && i < sim_ndevs; i++)
		if (pool == &sim_devs[i].default_pool)
			return i;
	pp = sim_obj_find(pool, SIM_OBJ_POOL);
	return pp ? (*pp)->dev : -1;
}

static int sim_pool_device(CUmemoryPool pool)
{
	int dev;

	pthread_mutex_lock(&sim_obj_lock);
	dev = sim_pool_device_locked(pool);
	pthread_mutex_unlock(&sim_obj_lock);
	return dev;
}

CUresult sim_impl_cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice dev)
{
	CUresult rc = sim_check(pool, dev);

	if (rc == CUDA_SUCCESS)
		*pool = &sim_devs[dev].default_pool;
	return rc;
}

/* The pool cuMemAllocAsync takes from on dev: its default pool until set. */
CUresult sim_impl_cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev)
{
	CUresult rc = sim_check(pool, dev);

	if (rc != CUDA_SUCCESS)
		return rc;
	pthread_mutex_lock(&sim_obj_lock);
	*pool = sim_devs[dev].mempool;
	pthread_mutex_unlock(&sim_obj_lock);
	return CUDA_SUCCESS;
}

/* Documented: the pool must be local to the device. */
CUresult sim_impl_cuDeviceSetMemPool(CUdevice dev, CUmemoryPool pool)
{
	CUresult rc = sim_check_dev(dev);

	if (rc != CUDA_SUCCESS)
		return rc;
	pthread_mutex_lock(&sim_obj_lock);
	if (sim_pool_device_locked(pool) == dev)
		sim_devs[dev].mempool = pool;
	else
		rc = CUDA_ERROR_INVALID_VALUE;
	pthread_mutex_unlock(&sim_obj_lock);
	return rc;
}

/*
 * CUDA 13's pool calls name a location and an allocation type. The
 * simulation has device memory only: pinned memory of a device location is
 * that device's pools; other locations and types are not simulated.
 */
static CUresult sim_location_device(const CUmemLocation *loc, int type, CUdevice *dev)
{
	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!loc)
		return CUDA_ERROR_INVALID_VALUE;
	if (loc->type != CU_MEM_LOCATION_TYPE_DEVICE || type != CU_MEM_ALLOCATION_TYPE_PINNED)
		return CUDA_ERROR_NOT_SUPPORTED;
	if (!sim_valid_dev(loc->id))
		return CUDA_ERROR_INVALID_DEVICE;
	*dev = loc->id;
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuMemGetDefaultMemPool(CUmemoryPool *pool, const CUmemLocation *loc, int type)
{
	CUdevice dev;
	CUresult rc = pool ? sim_location_device(loc, type, &dev) : CUDA_ERROR_INVALID_VALUE;

	return rc == CUDA_SUCCESS ? sim_impl_cuDeviceGetDefaultMemPool(pool, dev) : rc;
}

CUresult sim_impl_cuMemGetMemPool(CUmemoryPool *pool, const CUmemLocation *loc, int type)
{
	CUdevice dev;
	CUresult rc = pool ? sim_location_device(loc, type, &dev) : CUDA_ERROR_INVALID_VALUE;

	return rc == CUDA_SUCCESS ? sim_impl_cuDeviceGetMemPool(pool, dev) : rc;
}

CUresult sim_impl_cuMemSetMemPool(const CUmemLocation *loc, int type, CUmemoryPool pool)
{
	CUdevice dev;
	CUresult rc = sim_location_device(loc, type, &dev);

	return rc == CUDA_SUCCESS ? sim_impl_cuDeviceSetMemPool(dev, pool) : rc;
}

/*
 * A pool is tied to a device and keeps what is freed into it reserved (see
 * struct CUmemPoolHandle_st); maxSize is not enforced. The simulation has
 * device memory only, so host locations are refused as invalid.
 */
CUresult sim_impl_cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props)
{
	struct CUmemPoolHandle_st *p;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!pool || !props || !sim_valid_pool_props(props))
		return CUDA_ERROR_INVALID_VALUE;
	p = sim_obj_new(sizeof(*p), SIM_OBJ_POOL, props->location.id);
	if (!p)
		return CUDA_ERROR_OUT_OF_MEMORY;
	sim_obj_add(&p->obj);
	*pool = p;
	return CUDA_SUCCESS;
}

/*
 * A destroyed pool's idle memory goes back to the device; what is still
 * allocated from it stays valid, as plain memory freed on its own.
 */
static void sim_pool_forget(struct sim_heap *h, CUmemoryPool pool)
{
	size_t i;

	if (!__atomic_load_n(&h->base, __ATOMIC_ACQUIRE))
		return;
	pthread_mutex_lock(&h->lock);
	sim_pool_release(h, pool, 0, false);
	for (i = 0; i < h->nlive; i++)
		if (h->live[i].pool == pool)
			h->live[i].pool = NULL;
	pthread_mutex_unlock(&h->lock);
}

/*
 * As documented, memory still allocated from a destroyed pool stays valid
 * until it is freed, and a device whose current pool it was goes back to its
 * default pool. A device's default pool is not the caller's to destroy.
 */
CUresult sim_impl_cuMemPoolDestroy(CUmemoryPool pool)
{
	struct sim_obj *o;
	int i;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	pthread_mutex_lock(&sim_obj_lock);
	o = sim_obj_unlink_locked(pool, SIM_OBJ_POOL);
	for (i = 0; o && i < sim_ndevs; i++)
		if (sim_devs[i].mempool == pool)
			sim_devs[i].mempool = &sim_devs[i].default_pool;
	pthread_mutex_unlock(&sim_obj_lock);
	if (!o)
		return CUDA_ERROR_INVALID_VALUE;
	sim_pool_forget(&sim_devs[o->dev].heap, pool);
	free(o);
	return CUDA_SUCCESS;
}

/*
 * From the current pool of the stream's device (by_stream: cuMemAllocAsync;
 * a pool is always local to its device, so that is the device's heap), or
 * from the pool named (cuMemAllocFromPoolAsync: on the pool's device,
 * whatever the stream's device is). Stream-ordered memory belongs to its
 * pool, not to a context: cuCtxDestroy documents that it does not free it,
 * so it is recorded with no owning context.
 */
static CUresult sim_alloc_async(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
				bool by_stream, CUstream stream)
{
	struct sim_ctx_slot slot;
	bool captured;
	CUresult rc;
	int dev;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!dptr || bytesize == 0)
		return CUDA_ERROR_INVALID_VALUE;
	if (!by_stream && sim_pool_device(pool) < 0)
		return CUDA_ERROR_INVALID_VALUE;
	rc = sim_stream_slot(stream, &slot);
	if (rc != CUDA_SUCCESS)
		return rc;
	/* Captured: a node of the graph, on the pool's device (its properties are the node's). */
	dev = by_stream ? slot.dev : sim_pool_device(pool);
	rc = dev < 0 ? CUDA_ERROR_INVALID_VALUE
		     : sim_capture_alloc(stream, dev, bytesize, dptr, &captured);
	if (dev < 0 || captured)
		return rc;
	/* Held throughout, so that the pool cannot be destroyed while it is used. */
	pthread_mutex_lock(&sim_obj_lock);
	if (by_stream)
		pool = sim_devs[dev].mempool;
	else
		dev = sim_pool_device_locked(pool);
	rc = dev < 0 ? CUDA_ERROR_INVALID_VALUE
		     : sim_pool_alloc(&sim_devs[dev], pool, bytesize, dptr);
	pthread_mutex_unlock(&sim_obj_lock);
	return rc;
}

CUresult sim_impl_cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream stream)
{
	return sim_alloc_async(dptr, bytesize, NULL, true, stream);
}

CUresult sim_impl_cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream stream)
{
	return sim_alloc_async(dptr, bytesize, NULL, true, stream);
}

CUresult sim_impl_cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
					  CUstream stream)
{
	return sim_alloc_async(dptr, bytesize, pool, false, stream);
}

CUresult sim_impl_cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize,
					       CUmemoryPool pool, CUstream stream)
{
	return sim_alloc_async(dptr, bytesize, pool, false, stream);
}

static CUresult sim_free_async(CUdeviceptr dptr, CUstream stream)
{
	struct sim_ctx_slot slot;
	bool captured;
	CUresult rc;

	rc = sim_stream_slot_live(stream, &slot);
	if (rc != CUDA_SUCCESS)
		return rc;
	/* A graph allocation freed in a capture: a free node of the graph. */
	rc = sim_capture_free(stream, dptr, &captured);
	return captured ? rc : sim_mem_free(dptr, SIM_MEM_PTR);
}

CUresult sim_impl_cuMemFreeAsync(CUdeviceptr dptr, CUstream stream)
{
	return sim_free_async(dptr, stream);
}

CUresult sim_impl_cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream stream)
{
	return sim_free_async(dptr, stream);
}

/* Pools: attributes, trimming, access. */

/*
 * The heap of a live pool's device, locked, with sim_obj_lock held so that
 * the pool cannot be destroyed meanwhile; NULL, nothing locked, if there is
 * none. sim_pool_unlock undoes it.
 */
static struct sim_heap *sim_pool_lock(CUmemoryPool pool)
{
	int dev;

	pthread_mutex_lock(&sim_obj_lock);
	dev = sim_pool_device_locked(pool);
	if (dev < 0) {
		pthread_mutex_unlock(&sim_obj_lock);
		return NULL;
	}
	pthread_mutex_lock(&sim_devs[dev].heap.lock);
	return &sim_devs[dev].heap;
}

static void sim_pool_unlock(struct sim_heap *h)
{
	pthread_mutex_unlock(&h->lock);
	pthread_mutex_unlock(&sim_obj_lock);
}

/*
 * The opening of the calls on a pool: initialized, then the caller's own
 * argument check (args_ok), then the pool, locked as sim_pool_lock does.
 */
static CUresult sim_pool_enter(CUmemoryPool pool, bool args_ok, struct sim_heap **h)
{
	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!args_ok || !(*h = sim_pool_lock(pool)))
		return CUDA_ERROR_INVALID_VALUE;
	return CUDA_SUCCESS;
}

/*
 * The figure attr names (the release threshold or a memory counter) and,
 * for a high-water mark, the current figure it restarts at (else NULL);
 * NULL for a reuse switch or an attribute that is none of the pool's.
 */
static uint64_t *sim_pool_figure(CUmemoryPool pool, int attr, const uint64_t **current)
{
	*current = NULL;
	switch (attr) {
	case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD:
		return &pool->threshold;
	case CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT:
		return &pool->reserved;
	case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH:
		*current = &pool->reserved;
		return &pool->reserved_high;
	case CU_MEMPOOL_ATTR_USED_MEM_CURRENT:
		return &pool->used;
	case CU_MEMPOOL_ATTR_USED_MEM_HIGH:
		*current = &pool->used;
		return &pool->used_high;
	default:
		return NULL;
	}
}

/* With the pool locked: one attribute set from, or read into, *value. */
static CUresult sim_pool_attr_locked(CUmemoryPool pool, int attr, void *value, bool set)
{
	const uint64_t *current;
	uint64_t *figure = sim_pool_figure(pool, attr, &current);

	if (attr >= CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES &&
	    attr <= CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES) {
		if (set)
			pool->reuse[attr - 1] = *(int *)value;
		else
			*(int *)value = pool->reuse[attr - 1];
		return CUDA_SUCCESS;
	}
	if (!figure)
		return CUDA_ERROR_INVALID_VALUE;
	if (!set) {
		*(uint64_t *)value = *figure;
		return CUDA_SUCCESS;
	}
	if (attr == CU_MEMPOOL_ATTR_RELEASE_THRESHOLD) {
		*figure = *(uint64_t *)value;
		return CUDA_SUCCESS;
	}
	/* The high-water marks can only be reset, to 0, which restarts them at current. */
	if (!current || *(uint64_t *)value != 0)
		return CUDA_ERROR_INVALID_VALUE;
	*figure = *current;
	return CUDA_SUCCESS;
}

static CUresult sim_pool_attr(CUmemoryPool pool, int attr, void *value, bool set)
{
	struct sim_heap *h = NULL;
	CUresult rc = sim_pool_enter(pool, value != NULL, &h);

	if (rc != CUDA_SUCCESS)
		return rc;
	rc = sim_pool_attr_locked(pool, attr, value, set);
	sim_pool_unlock(h);
	return rc;
}

CUresult sim_impl_cuMemPoolSetAttribute(CUmemoryPool pool, int attr, void *value)
{
	return sim_pool_attr(pool, attr, value, true);
}

CUresult sim_impl_cuMemPoolGetAttribute(CUmemoryPool pool, int attr, void *value)
{
	return sim_pool_attr(pool, attr, value, false);
}

CUresult sim_impl_cuMemPoolTrimTo(CUmemoryPool pool, size_t keep)
{
	struct sim_heap *h = NULL;
	CUresult rc = sim_pool_enter(pool, true, &h);

	if (rc != CUDA_SUCCESS)
		return rc;
	sim_pool_release(h, pool, keep, false);
	sim_pool_unlock(h);
	return CUDA_SUCCESS;
}

/* Every device reaches every pool here; access is checked, never enforced. */
CUresult sim_impl_cuMemPoolSetAccess(CUmemoryPool pool, const CUmemAccessDesc *desc, size_t n)
{
	size_t i;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!desc || sim_pool_device(pool) < 0)
		return CUDA_ERROR_INVALID_VALUE;
	for (i = 0; i < n; i++)
		if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
		    !sim_valid_dev(desc[i].location.id))
			return CUDA_ERROR_INVALID_VALUE;
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuMemPoolGetAccess(int *flags, CUmemoryPool pool, const CUmemLocation *loc)
{
	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!flags || !loc || sim_pool_device(pool) < 0 ||
	    loc->type != CU_MEM_LOCATION_TYPE_DEVICE || !sim_valid_dev(loc->id))
		return CUDA_ERROR_INVALID_VALUE;
	*flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
	return CUDA_SUCCESS;
}
