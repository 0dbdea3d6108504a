/*
 * Stream-ordered pools: the pools the shim follows, what each is charged for
 * what it holds, and the stream-ordered allocations that take from them.
 * Below graph_mem.c, whose graph pools are entries of the same table; above
 * accounting.c, through which every pool charges.
 */
#include "pools.h"

/*
 * A pool keeps what is freed into it (above its release threshold only
 * until a synchronisation, and until trimmed or destroyed), and that memory
 * is the environment's for as long as the pool holds it, as a caching
 * allocator's cache is: PyTorch's cudaMallocAsync backend keeps everything
 * it frees. So a pool's memory is charged to the pool. An allocation takes
 * from what the pool has charged already and the charge grows only by what
 * is new; a free hands its bytes to the pool. The charge follows what the
 * driver says the pool reserves (CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT):
 * up when an allocation made it grow, down where the pool may give memory
 * back (cuMemPoolTrimTo, a synchronisation when it holds more than its
 * release threshold, cuMemPoolDestroy, a failed allocation).
 *
 * Pools are few (one per device and allocation type, and a program's own),
 * so they live in a small table searched linearly. An entry is filled and
 * then published by raising pools_n; its handle never changes after that.
 * A pool that does not fit is charged per allocation, as plain memory.
 * Lock order: epoch_mu -> pools_mu -> a pool's mu.
 */
#define GS_MAX_POOLS 64
#define GS_POOL_RESERVED_CURRENT 5 /* CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT */

struct gs_pool {
	uint64_t handle; /* the driver's CUmemoryPool */
	int32_t gpu;	 /* ledger GPU, GS_DEV_FOREIGN or GS_POOL_HOST */
	uint32_t dead;	 /* destroyed: frees of its last allocations give their bytes back */
	pthread_mutex_t mu;
	/* Written under mu with atomic stores, so that a hint may read them without it. */
	uint64_t charged;   /* bytes charged for the pool: in use and idle */
	uint64_t in_use;    /* footprints of its live allocations */
	uint64_t persisted; /* of charged, what the last boundary made persistent */
	uint64_t threshold; /* its release threshold as last set (the driver's default: 0) */
};

static struct gs_pool pools[GS_MAX_POOLS];
static uint32_t pools_n;
static pthread_mutex_t pools_mu = PTHREAD_MUTEX_INITIALIZER;
/* Each ledger GPU's current pool, which cuMemAllocAsync takes from; 0 until asked. */
static uint64_t current_pool[GS_MAX_GPUS];

static struct gs_pool *pool_find(uint64_t handle)
{
	uint32_t n = __atomic_load_n(&pools_n, __ATOMIC_ACQUIRE);

	for (uint32_t i = 0; i < n; i++)
		if (pools[i].handle == handle)
			return &pools[i];
	return NULL;
}

/* Where a pool lives, noted when it is made or fetched. NULL when the table is full. */
struct gs_pool *pool_note(CUmemoryPool pool, int gpu)
{
	uint64_t handle = (uint64_t)(uintptr_t)pool;
	struct gs_pool *p;

	if (handle == 0 || gs_state.mode != GS_ENFORCE)
		return NULL;
	pthread_mutex_lock(&pools_mu);
	p = pool_find(handle);
	if (p == NULL && pools_n < GS_MAX_POOLS) {
		p = &pools[pools_n];
		pthread_mutex_init(&p->mu, NULL);
		p->handle = handle;
		p->gpu = gpu;
		__atomic_store_n(&pools_n, pools_n + 1, __ATOMIC_RELEASE);
	} else if (p != NULL) {
		pthread_mutex_lock(&p->mu);
		/* A new pool at a destroyed one's address: nothing of the old one is left. */
		if (p->dead && p->in_use == 0) {
			p->dead = 0;
			p->gpu = gpu;
			__atomic_store_n(&p->threshold, 0, __ATOMIC_RELAXED);
		}
		pthread_mutex_unlock(&p->mu);
	}
	pthread_mutex_unlock(&pools_mu);
	return p;
}

static inline uint32_t pool_index(const struct gs_pool *p)
{
	return (uint32_t)(p - pools) + 1;
}

/* The pool cuMemAllocAsync takes from on ledger GPU `gpu`; NULL if unknown. */
static struct gs_pool *device_pool(int gpu)
{
	gs_fn_cuDeviceGetMemPool get = GS_REAL_FN(cuDeviceGetMemPool);
	CUmemoryPool pool;
	struct gs_pool *p;
	uint64_t handle;
	CUdevice dev;

	if (gpu < 0 || gpu >= GS_MAX_GPUS)
		return NULL;
	handle = __atomic_load_n(&current_pool[gpu], __ATOMIC_ACQUIRE);
	if (handle != 0)
		return pool_find(handle);
	dev = gpu_device(gpu);
	if (dev < 0 || get == NULL || get(&pool, dev) != CUDA_SUCCESS)
		return NULL;
	p = pool_note(pool, gpu);
	if (p != NULL)
		__atomic_store_n(&current_pool[gpu], p->handle, __ATOMIC_RELEASE);
	return p;
}

/* With p->mu held: the pool's charge down to `target` bytes, if it is above. */
static void pool_shrink(struct gs_pool *p, uint64_t target)
{
	int slot = __atomic_load_n(&gs_state.slot, __ATOMIC_ACQUIRE);
	uint64_t d, unpersist;

	if (target >= p->charged || slot < 0 || p->gpu < 0)
		return;
	d = p->charged - target;
	/*
	 * What goes is idle memory; the last boundary counted it persistent if
	 * the pool held it then. Which bytes those were is not known: an error
	 * lasts until the next boundary sets the persistent share afresh.
	 */
	unpersist = d < p->persisted ? d : p->persisted;
	__atomic_store_n(&p->charged, target, __ATOMIC_RELAXED);
	__atomic_store_n(&p->persisted, p->persisted - unpersist, __ATOMIC_RELAXED);
	gs_ledger_uncharge(gs_state.ledger, (uint32_t)slot, (uint32_t)p->gpu, d);
	if (unpersist != 0)
		gs_ledger_unpersist(gs_state.ledger, (uint32_t)slot, (uint32_t)p->gpu, unpersist);
}

/* A device's graph memory pool (GS_GRAPH_POOL): the driver reports it by device. */
#define GS_GRAPH_RESERVED_CURRENT 2 /* CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT */

static inline int is_graph_pool(const struct gs_pool *p)
{
	return p->handle > UINT64_MAX - GS_MAX_GPUS;
}

/* What the driver says the pool reserves; 0 with *known 0 when it cannot say. */
static uint64_t pool_reserved(const struct gs_pool *p, int *known)
{
	gs_fn_cuMemPoolGetAttribute get = GS_REAL_FN(cuMemPoolGetAttribute);
	gs_fn_cuDeviceGetGraphMemAttribute get_graph = GS_REAL_FN(cuDeviceGetGraphMemAttribute);
	cuuint64_t bytes = 0;
	CUdevice dev;

	if (is_graph_pool(p)) {
		dev = gpu_device(p->gpu);
		*known = dev >= 0 && get_graph != NULL &&
			 get_graph(dev, GS_GRAPH_RESERVED_CURRENT, &bytes) == CUDA_SUCCESS;
		return bytes;
	}
	*known = get != NULL && get((CUmemoryPool)(uintptr_t)p->handle, GS_POOL_RESERVED_CURRENT,
				    &bytes) == CUDA_SUCCESS;
	return bytes;
}

/* The pool may have given memory back: its charge down to what it reserves. */
void pool_sync(struct gs_pool *p)
{
	int known;
	uint64_t reserved = pool_reserved(p, &known);

	if (!known)
		return;
	pthread_mutex_lock(&p->mu);
	pool_shrink(p, reserved > p->in_use ? reserved : p->in_use);
	pthread_mutex_unlock(&p->mu);
}

/*
 * After a synchronisation: a device pool that holds more than its
 * threshold and more than its allocations use may have given the rest back.
 * PyTorch's pools keep everything (an unbounded threshold): no driver call.
 */
void pools_after_sync(void)
{
	uint32_t n = __atomic_load_n(&pools_n, __ATOMIC_ACQUIRE);

	for (uint32_t i = 0; i < n; i++) {
		struct gs_pool *p = &pools[i];
		uint64_t charged = __atomic_load_n(&p->charged, __ATOMIC_RELAXED);

		/* The graph memory pool keeps what it holds across synchronisations. */
		if (is_graph_pool(p))
			continue;
		if (charged > __atomic_load_n(&p->in_use, __ATOMIC_RELAXED) &&
		    charged > __atomic_load_n(&p->threshold, __ATOMIC_RELAXED))
			pool_sync(p);
	}
}

/* At a boundary (under epoch_mu): what every pool holds is now persistent, as all else. */
void pools_at_boundary(void)
{
	uint32_t n = __atomic_load_n(&pools_n, __ATOMIC_ACQUIRE);

	for (uint32_t i = 0; i < n; i++) {
		pthread_mutex_lock(&pools[i].mu);
		__atomic_store_n(&pools[i].persisted, pools[i].charged, __ATOMIC_RELAXED);
		pthread_mutex_unlock(&pools[i].mu);
	}
}

/*
 * Take `bytes` (a footprint) from pool p for a new allocation, after the
 * gate: what the pool has charged and does not use first, a new charge for
 * the rest, refused beyond the limit. *grew is the new charge.
 */
static CUresult pool_take(struct gs_pool *p, uint64_t bytes, struct gs_charge *c, uint64_t *grew)
{
	uint64_t want, need;
	CUresult rc = CUDA_SUCCESS;

	pthread_mutex_lock(&p->mu);
	want = p->in_use > UINT64_MAX - bytes ? UINT64_MAX : p->in_use + bytes;
	need = want > p->charged ? want - p->charged : 0;
	if (need != 0) {
		rc = charge_gpu(p->gpu, need, c);
	} else {
		c->gpu = p->gpu;
		c->ctx = NULL;
		c->epoch = epoch_now();
		c->slot = my_slot();
		if (c->slot < 0)
			rc = CUDA_ERROR_OUT_OF_MEMORY;
	}
	if (rc == CUDA_SUCCESS) {
		__atomic_store_n(&p->charged, p->charged + need, __ATOMIC_RELAXED);
		__atomic_store_n(&p->in_use, want, __ATOMIC_RELAXED);
	}
	pthread_mutex_unlock(&p->mu);
	c->bytes = bytes;
	c->pool = pool_index(p);
	*grew = need;
	return rc;
}

/*
 * With p->mu held: charge what the pool reserves beyond its charge, if the
 * limit has room. 1 if it fits (*more: whether anything was charged).
 */
static int pool_charge_to(struct gs_pool *p, uint64_t reserved, int slot, int *more)
{
	if (reserved <= p->charged)
		return 1;
	if (charge_slot(slot, p->gpu, reserved - p->charged) != 0)
		return 0;
	__atomic_store_n(&p->charged, reserved, __ATOMIC_RELAXED);
	*more = 1;
	return 1;
}

/*
 * Give back the pool's idle memory, keeping at least `keep` bytes: a graph
 * pool has no such bound (cuDeviceGraphMemTrim). 1 if the driver did.
 */
static int pool_trim(const struct gs_pool *p, uint64_t keep)
{
	gs_fn_cuMemPoolTrimTo trim = GS_REAL_FN(cuMemPoolTrimTo);
	gs_fn_cuDeviceGraphMemTrim trim_graph = GS_REAL_FN(cuDeviceGraphMemTrim);
	CUdevice dev;

	if (is_graph_pool(p)) {
		dev = gpu_device(p->gpu);
		return dev >= 0 && trim_graph != NULL && trim_graph(dev) == CUDA_SUCCESS;
	}
	return trim != NULL && trim((CUmemoryPool)(uintptr_t)p->handle, keep) == CUDA_SUCCESS;
}

/*
 * After an allocation (or a graph launch), the pool may have grown by more
 * than the footprints: the driver reserves in its own chunks, and kept
 * chunks too small or too scattered for a request stay beside a new one
 * (even when what the pool keeps adds up to the request). The rest is
 * charged too while the limit has room for it; where it has not, the pool
 * gives back its idle chunks, as the driver does when the device is full,
 * its charge follows it down, and what it still reserves beyond is charged
 * if it fits. Only what cannot be given back and does not fit goes
 * uncharged. Returns 1 if the charge grew.
 */
int pool_grow(struct gs_pool *p)
{
	int slot = __atomic_load_n(&gs_state.slot, __ATOMIC_ACQUIRE);
	uint64_t reserved, keep;
	int known, fits, more = 0;

	reserved = pool_reserved(p, &known);
	if (!known || slot < 0)
		return 0;
	pthread_mutex_lock(&p->mu);
	fits = pool_charge_to(p, reserved, slot, &more);
	keep = p->charged;
	pthread_mutex_unlock(&p->mu);
	if (fits || !pool_trim(p, keep))
		return more;
	reserved = pool_reserved(p, &known);
	if (!known)
		return more;
	pthread_mutex_lock(&p->mu);
	pool_shrink(p, reserved > p->in_use ? reserved : p->in_use);
	pool_charge_to(p, reserved, slot, &more);
	pthread_mutex_unlock(&p->mu);
	return more;
}

/* A record of pool memory was freed: its bytes stay charged, to the pool. */
static void pool_give(const struct gs_alloc *a)
{
	struct gs_pool *p = &pools[a->pool - 1];
	int slot = __atomic_load_n(&gs_state.slot, __ATOMIC_ACQUIRE);

	pthread_mutex_lock(&p->mu);
	__atomic_store_n(&p->in_use, p->in_use > a->size ? p->in_use - a->size : 0,
			 __ATOMIC_RELAXED);
	/* Pinned persistent by gpushare_mark_persistent: idle memory is not. */
	if (a->pinned && slot >= 0)
		gs_ledger_unpersist(gs_state.ledger, (uint32_t)slot, (uint32_t)a->gpu, a->size);
	/* A destroyed pool's memory goes back to the driver as its allocations are freed. */
	if (p->dead)
		pool_shrink(p, p->in_use);
	pthread_mutex_unlock(&p->mu);
}

/* After the driver's answer to an allocation pool_take() charged as *c. */
static CUresult pool_settle(CUresult rc, CUdeviceptr key, struct gs_pool *p,
			    const struct gs_charge *c, uint64_t grew)
{
	struct gs_alloc a = { .pool = c->pool, .size = c->bytes, .gpu = c->gpu };

	if (rc != CUDA_SUCCESS) {
		pool_give(&a);
		pool_sync(p);
		return rc;
	}
	/* One query of the pool per allocation: the price of charging what it really holds. */
	if (pool_grow(p))
		grew = 1;
	if (alloc_track(key, GS_K_PTR, c) != 0) {
		undo_ptr(key);
		pool_give(&a);
		pool_sync(p);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	/* What a process allocates before its first boundary is set-up, not temporary. */
	if (grew != 0 && c->epoch >= 1)
		gs_ledger_note_temp(gs_state.ledger, (uint32_t)c->slot, (uint32_t)c->gpu);
	return CUDA_SUCCESS;
}

/* The pool cuMemAllocAsync takes from: the current pool of the stream's device. */
static struct gs_pool *stream_pool(CUstream stream)
{
	CUcontext ctx;
	int gpu;

	if (stream_ctx(stream, &ctx, &gpu) != CUDA_SUCCESS)
		return NULL;
	return device_pool(gpu);
}

/*
 * A pool named by the program lives where it was made or fetched; one the
 * shim never saw is taken to be on the stream's device.
 */
static struct gs_pool *named_pool(CUmemoryPool pool, CUstream stream)
{
	struct gs_pool *p = pool_find((uint64_t)(uintptr_t)pool);
	CUcontext ctx;
	int gpu;

	if (p != NULL || stream_ctx(stream, &ctx, &gpu) != CUDA_SUCCESS)
		return p;
	return pool_note(pool, gpu);
}

/*
 * The same as charge_current on a stream's device. Stream-ordered memory
 * belongs to its pool, not to a context (cuCtxDestroy does not free it): it
 * is recorded with none.
 */
static CUresult charge_stream(CUstream stream, uint64_t bytes, struct gs_charge *c)
{
	CUcontext ctx = NULL;
	int gpu;
	CUresult rc = stream_ctx(stream, &ctx, &gpu);

	if (rc == CUDA_SUCCESS)
		rc = charge_new(gpu, bytes, c);
	return rc;
}

/*
 * Before the driver call of a stream-ordered allocation of `bytes` (nonzero)
 * from `pool` (NULL: the stream's device's current pool), in an enforcing
 * process, on a stream that does not capture (pool_hook.c decides those):
 * an error to answer, or op->how and its charge.
 */
CUresult pool_alloc_begin(struct gs_pool_alloc *op, size_t bytes, CUmemoryPool pool,
			  CUstream stream)
{
	op->how = GS_PASS;
	op->p = pool != NULL ? named_pool(pool, stream) : stream_pool(stream);
	if (op->p != NULL && op->p->gpu == GS_POOL_HOST)
		return CUDA_SUCCESS;
	if (op->p == NULL) {
		op->how = GS_PLAIN;
		return charge_stream(stream, footprint(bytes), &op->c);
	}
	op->how = GS_POOLED;
	alloc_gate();
	return pool_take(op->p, footprint(bytes), &op->c, &op->grew);
}

/* After the driver's answer to an allocation pool_alloc_begin() charged. */
CUresult pool_alloc_end(const struct gs_pool_alloc *op, CUresult rc, const CUdeviceptr *dptr)
{
	if (op->how == GS_PLAIN)
		return settle(rc, *dptr, GS_K_PTR, &op->c, undo_ptr);
	return pool_settle(rc, *dptr, op->p, &op->c, op->grew);
}

/* Device memory pools (pinned allocations at a device) are charged; host and managed ones not. */
int pool_gpu(const CUmemLocation *location, int type)
{
	if (location->type != CU_MEM_LOCATION_TYPE_DEVICE || type != CU_MEM_ALLOCATION_TYPE_PINNED)
		return GS_POOL_HOST;
	return ledger_gpu(location->id);
}

/* A device's new current pool: what its cuMemAllocAsync takes from from now on. */
void set_current_pool(CUmemoryPool pool, int gpu)
{
	struct gs_pool *p;

	if (gpu < 0 || gpu >= GS_MAX_GPUS)
		return;
	p = pool_note(pool, gpu);
	__atomic_store_n(&current_pool[gpu], p != NULL ? p->handle : 0, __ATOMIC_RELEASE);
}

/* cuMemPoolTrimTo trimmed the pool: its charge follows. */
void pool_trimmed(CUmemoryPool pool)
{
	struct gs_pool *p = pool_find((uint64_t)(uintptr_t)pool);

	if (p != NULL)
		pool_sync(p);
}

/* The pool's release threshold (CU_MEMPOOL_ATTR_RELEASE_THRESHOLD) was set. */
void pool_threshold_set(CUmemoryPool pool, uint64_t threshold)
{
	struct gs_pool *p = pool_find((uint64_t)(uintptr_t)pool);

	if (p == NULL)
		return;
	pthread_mutex_lock(&p->mu);
	__atomic_store_n(&p->threshold, threshold, __ATOMIC_RELAXED);
	pthread_mutex_unlock(&p->mu);
}

/*
 * The driver gives a destroyed pool's idle memory back at once and the rest
 * as its allocations are freed (pool_give); a device whose current pool it
 * was takes from its default pool again.
 */
void pool_destroyed(CUmemoryPool pool)
{
	uint64_t handle = (uint64_t)(uintptr_t)pool;
	struct gs_pool *p = pool_find(handle);

	if (p == NULL)
		return;
	pthread_mutex_lock(&p->mu);
	p->dead = 1;
	pool_shrink(p, p->in_use);
	pthread_mutex_unlock(&p->mu);
	for (int i = 0; i < GS_MAX_GPUS; i++) {
		uint64_t expected = handle;

		__atomic_compare_exchange_n(&current_pool[i], &expected, 0, 0, __ATOMIC_ACQ_REL,
					    __ATOMIC_RELAXED);
	}
}

/*
 * In a fork child: the pools are the parent's; what the child allocates
 * from them is its own. Locks are re-made because another thread may have
 * held them.
 */
static void pools_after_fork_child(void)
{
	pthread_mutex_init(&pools_mu, NULL);
	for (uint32_t i = 0; i < pools_n; i++) {
		pthread_mutex_init(&pools[i].mu, NULL);
		pools[i].charged = pools[i].in_use = pools[i].persisted = 0;
	}
}

__attribute__((constructor)) static void pools_load(void)
{
	records_pool_free(pool_give);
	pthread_atfork(NULL, NULL, pools_after_fork_child);
}
