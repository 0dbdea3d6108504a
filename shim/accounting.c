/*
 * The accounting policy: what is charged for what, on which GPU, to whom,
 * and when it goes back. Allocations' charges live in the allocation map
 * (alloc_map.c) until freed; contexts are charged once per process and GPU;
 * stream-ordered pools and the graph memory pool hold the charge of what
 * they keep.
 */
#include "shim.h"

/*
 * Charge `bytes` on ledger GPU `gpu` to `slot`. A refused charge may be
 * refused for what processes of the environment that have ended still hold
 * (their slots are freed at nodemgr's next sweep; a task running processes
 * one after the other would be refused what the last one left): those are
 * freed here, and the charge is tried once more, even if this process freed
 * none (nodemgr may have, meanwhile). Only when refused: the granted charge
 * costs what it did.
 */
static __attribute__((noinline, cold)) int charge_after_reap(int slot, int gpu, uint64_t bytes)
{
	reap_dead_slots(slot);
	return gs_ledger_charge(gs_state.ledger, (uint32_t)slot, (uint32_t)gpu, bytes);
}

static inline int ledger_charge(int slot, int gpu, uint64_t bytes)
{
	int rc = gs_ledger_charge(gs_state.ledger, (uint32_t)slot, (uint32_t)gpu, bytes);

	return likely(rc == 0) ? 0 : charge_after_reap(slot, gpu, bytes);
}

/*
 * Charge `bytes` on ledger GPU `gpu` to this process's slot. A GPU that is
 * not the node's, no free slot, or the limit: CUDA_ERROR_OUT_OF_MEMORY.
 *
 * The epoch is read before the charge. An allocation on one thread racing
 * a boundary on another may land on either side of it; the next boundary
 * sets the persistent share afresh, so such an error lasts one iteration.
 */
CUresult charge_gpu(int gpu, uint64_t bytes, struct gs_charge *c)
{
	c->gpu = gpu;
	c->bytes = bytes;
	c->ctx = NULL;
	c->pool = 0;
	c->epoch = epoch_now();
	c->slot = my_slot();
	if (gpu < 0 || c->slot < 0)
		return CUDA_ERROR_OUT_OF_MEMORY;
	if (ledger_charge(c->slot, gpu, bytes) != 0)
		return CUDA_ERROR_OUT_OF_MEMORY;
	return CUDA_SUCCESS;
}

/* charge_gpu for new memory: after the gate. */
CUresult charge_new(int gpu, uint64_t bytes, struct gs_charge *c)
{
	alloc_gate();
	return charge_gpu(gpu, bytes, c);
}

/* The same on the device of the calling thread's current context, which owns the memory. */
CUresult charge_current(uint64_t bytes, struct gs_charge *c)
{
	CUcontext ctx = NULL;
	int gpu;
	CUresult rc = current_ctx(&ctx, &gpu);

	if (rc == CUDA_SUCCESS)
		rc = charge_new(gpu, bytes, c);
	c->ctx = ctx;
	return rc;
}

/*
 * The same on a stream's device. Stream-ordered memory belongs to its pool,
 * not to a context (cuCtxDestroy does not free it): it is recorded with none.
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
 * Memory charged at `epoch` goes back: its bytes leave the slot, and its
 * persistent share too when it was made before the current epoch (the last
 * boundary counted it) or pinned. Used first, so that a temporary peak
 * noted meanwhile never sees the bytes as temporary.
 */
void give_back(int32_t slot, int32_t gpu, uint64_t bytes, uint64_t epoch, uint32_t pinned)
{
	gs_ledger_uncharge(gs_state.ledger, (uint32_t)slot, (uint32_t)gpu, bytes);
	if (pinned || epoch < epoch_now())
		gs_ledger_unpersist(gs_state.ledger, (uint32_t)slot, (uint32_t)gpu, bytes);
}

/* An allocation's charge, not recorded yet, goes back. */
void uncharge(const struct gs_charge *c)
{
	give_back(c->slot, c->gpu, c->bytes, c->epoch, 0);
}

/*
 * A process pays for its context on a GPU once, when it first creates or
 * retains one there (the figure nodemgr publishes per GPU). Charged before
 * the driver call, so a context that would not fit is refused like an
 * allocation; the charge stays until the process ends. While one thread
 * pays, the others wait for the outcome: none may make a context that
 * nobody paid for.
 */
enum gs_ctx_state {
	GS_CTX_UNPAID,
	GS_CTX_PAYING,
	GS_CTX_PAID
};

/* The GPUs whose context charge this thread is paying: it never waits for itself. */
static __thread __attribute__((tls_model("initial-exec"))) uint32_t paying;
_Static_assert(GS_MAX_GPUS <= 32, "paying is a 32-bit mask of ledger GPUs");

CUresult charge_context(CUdevice dev, int *charged)
{
	struct gs_charge c;
	uint64_t bytes;
	uint8_t st;
	int gpu;

	*charged = -1;
	if (gs_state.mode != GS_ENFORCE)
		return CUDA_SUCCESS;
	gpu = ledger_gpu(dev);
	if (gpu < 0)
		return CUDA_SUCCESS;
	for (;;) {
		st = __atomic_load_n(&gs_state.ctx_state[gpu], __ATOMIC_ACQUIRE);
		/* Paid, or this thread's own outer call is paying it (a callback re-entered). */
		if (st == GS_CTX_PAID || (paying & (1u << gpu)))
			return CUDA_SUCCESS;
		if (st == GS_CTX_UNPAID &&
		    __atomic_compare_exchange_n(&gs_state.ctx_state[gpu], &st, GS_CTX_PAYING, 0,
						__ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
			break;
		sched_yield(); /* another thread is paying: its outcome decides */
	}
	paying |= 1u << gpu;
	bytes = gs_ledger_ctx_charge(gs_state.ledger, (uint32_t)gpu);
	if (bytes != 0 && charge_gpu(gpu, bytes, &c) != CUDA_SUCCESS) {
		paying &= ~(1u << gpu);
		__atomic_store_n(&gs_state.ctx_state[gpu], GS_CTX_UNPAID, __ATOMIC_RELEASE);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	gs_state.ctx_bytes[gpu] = bytes;
	*charged = gpu;
	return CUDA_SUCCESS;
}

/*
 * After the driver call a charge_context() that paid was for: settle it.
 * A context that could not be made gives its charge back.
 */
void context_settle(int gpu, CUresult rc)
{
	if (gpu < 0)
		return;
	paying &= ~(1u << gpu);
	if (rc == CUDA_SUCCESS) {
		__atomic_store_n(&gs_state.ctx_state[gpu], GS_CTX_PAID, __ATOMIC_RELEASE);
		return;
	}
	/* A context's charge is not an allocation: it is left out of classification. */
	if (gs_state.ctx_bytes[gpu] != 0)
		gs_ledger_uncharge(gs_state.ledger,
				   (uint32_t)__atomic_load_n(&gs_state.slot, __ATOMIC_ACQUIRE),
				   (uint32_t)gpu, gs_state.ctx_bytes[gpu]);
	__atomic_store_n(&gs_state.ctx_state[gpu], GS_CTX_UNPAID, __ATOMIC_RELEASE);
}
static int carries_charge(uint32_t kind)
{
	return kind != GS_K_MAP;
}

static void release_record(const struct gs_alloc *a);

/*
 * Record a; a record the map still held for the same handle means the
 * driver handed it out again after that memory went back without passing
 * through us, so that record's charge goes now. -ENOMEM if it could not
 * be recorded.
 */
int alloc_put(struct gs_alloc a)
{
	struct gs_alloc stale;
	int rc = gs_map_put(&a, &stale);

	if (rc == 1 && carries_charge(stale.kind))
		release_record(&stale);
	return rc < 0 ? rc : 0;
}

static int alloc_track(uint64_t key, uint32_t kind, const struct gs_charge *c)
{
	return alloc_put((struct gs_alloc){ .key = key,
					    .kind = kind,
					    .gpu = c->gpu,
					    .size = c->bytes,
					    .owner = (uint64_t)(uintptr_t)c->ctx,
					    .refs = 1,
					    .epoch = c->epoch,
					    .pool = c->pool });
}

/*
 * Context teardown takes a context's records out BEFORE the driver call:
 * once the driver has freed the memory, another thread may be handed the
 * same addresses, or a new context at the same address, and allocate. The
 * records go back if the driver refuses. Rare, so a walk of the table.
 */
struct gs_taken {
	struct gs_alloc *v;
	size_t n, cap;
	int incomplete; /* out of memory: some records stayed in the table */
	uint64_t owner; /* the context, as records name their owner */
};

static int owned_by(const struct gs_alloc *a, uint64_t owner)
{
	return a->key != 0 && a->owner == owner &&
	       (a->kind == GS_K_PTR || a->kind == GS_K_ARRAY || a->kind == GS_K_MIPMAP ||
		a->kind == GS_K_LIMIT);
}

/* Collect a record of the context into t; 0 (leave it in the table) when out of memory. */
static int take_owned(const struct gs_alloc *a, void *arg)
{
	struct gs_taken *t = arg;

	if (!owned_by(a, t->owner))
		return 0;
	if (t->n == t->cap) {
		size_t cap = t->cap ? t->cap * 2 : 64;
		struct gs_alloc *v = realloc(t->v, cap * sizeof(*v));

		if (v == NULL) {
			t->incomplete = 1;
			return 0;
		}
		t->v = v;
		t->cap = cap;
	}
	t->v[t->n++] = *a;
	return 1;
}

static void take_context(CUcontext ctx, struct gs_taken *t)
{
	memset(t, 0, sizeof(*t));
	t->owner = (uint64_t)(uintptr_t)ctx;
	/* Every thread's cached context -> GPU answer is stale from here on. */
	__atomic_add_fetch(&gs_state.ctx_gen, 1, __ATOMIC_ACQ_REL);
	if (ctx == NULL)
		return;
	gs_map_take_each(take_owned, t);
}

/* Add a torn-down record's bytes to its GPU's, and to its persistent share's (give_back). */
static void tally(const struct gs_alloc *a, uint64_t epoch, uint64_t *gone, uint64_t *kept)
{
	if (a->gpu < 0 || a->gpu >= GS_MAX_GPUS)
		return;
	gone[a->gpu] += a->size;
	if (a->pinned || a->epoch < epoch)
		kept[a->gpu] += a->size;
}

/* What the records take_context() left in the table add up to. */
struct gs_tally {
	uint64_t owner;
	uint64_t epoch;
	uint64_t *gone, *kept;
};

static int tally_owned(const struct gs_alloc *a, void *arg)
{
	struct gs_tally *l = arg;

	if (!owned_by(a, l->owner))
		return 0;
	tally(a, l->epoch, l->gone, l->kept);
	return 1;
}

/* After the driver's answer to the teardown take_context() prepared. */
static void settle_context(struct gs_taken *t, CUcontext ctx, CUresult rc)
{
	uint64_t gone[GS_MAX_GPUS] = { 0 }, kept[GS_MAX_GPUS] = { 0 };
	int slot = __atomic_load_n(&gs_state.slot, __ATOMIC_ACQUIRE);
	uint64_t epoch = epoch_now();

	if (rc != CUDA_SUCCESS) {
		for (size_t i = 0; i < t->n; i++)
			alloc_put(t->v[i]);
		free(t->v);
		return;
	}
	/* A thread may have cached the context during the call; a new one may take its address. */
	__atomic_add_fetch(&gs_state.ctx_gen, 1, __ATOMIC_ACQ_REL);
	for (size_t i = 0; i < t->n; i++)
		tally(&t->v[i], epoch, gone, kept);
	free(t->v);
	if (t->incomplete) {
		struct gs_tally left = { (uint64_t)(uintptr_t)ctx, epoch, gone, kept };

		gs_map_take_each(tally_owned, &left);
	}
	for (int i = 0; i < GS_MAX_GPUS && slot >= 0; i++) {
		if (gone[i] != 0)
			gs_ledger_uncharge(gs_state.ledger, (uint32_t)slot, (uint32_t)i, gone[i]);
		if (kept[i] != 0)
			gs_ledger_unpersist(gs_state.ledger, (uint32_t)slot, (uint32_t)i, kept[i]);
	}
}

/*
 * After a successful allocation: remember it, or, when that is impossible,
 * give the memory back (`undo`), since it could never be uncharged later.
 */
CUresult remember(uint64_t key, uint32_t kind, const struct gs_charge *c, void (*undo)(uint64_t))
{
	if (alloc_track(key, kind, c) == 0) {
		/* What a process allocates before its first boundary is set-up, not temporary. */
		if (c->epoch >= 1)
			gs_ledger_note_temp(gs_state.ledger, (uint32_t)c->slot, (uint32_t)c->gpu);
		return CUDA_SUCCESS;
	}
	undo(key);
	uncharge(c);
	return CUDA_ERROR_OUT_OF_MEMORY;
}

/*
 * After the driver's answer to an allocation charged as *c: on failure the
 * charge goes back, on success the allocation is remembered. `key` is read
 * from the caller's out-parameter, which means nothing after a failure.
 */
CUresult settle(CUresult rc, uint64_t key, uint32_t kind, const struct gs_charge *c,
		void (*undo)(uint64_t))
{
	if (rc != CUDA_SUCCESS) {
		uncharge(c);
		return rc;
	}
	return remember(key, kind, c, undo);
}

/*
 * Take a record out before the driver frees, so that a thread handed the
 * same handle after the free never finds a stale one. Returns 1 if it was
 * ours.
 */
int forget(uint64_t key, uint32_t kind, struct gs_alloc *a)
{
	if (gs_state.mode != GS_ENFORCE || key == 0)
		return 0;
	return gs_map_take(key, kind, a) == 0;
}

/* A record's memory went back to the driver: so does its charge. */
void uncharge_record(const struct gs_alloc *a)
{
	give_back(__atomic_load_n(&gs_state.slot, __ATOMIC_ACQUIRE), a->gpu, a->size, a->epoch,
		  a->pinned);
}

static void pool_give(const struct gs_alloc *a);

/* A record's memory was freed: back to the driver, or to the pool it came from. */
static void release_record(const struct gs_alloc *a)
{
	if (a->pool != 0)
		pool_give(a);
	else
		uncharge_record(a);
}

/* After the driver's answer to a free of a record forget() took out. */
CUresult freed(CUresult rc, const struct gs_alloc *a)
{
	/* Still allocated, so still charged; if it cannot be re-recorded it stays so. */
	if (rc != CUDA_SUCCESS)
		alloc_put(*a);
	else
		release_record(a);
	return rc;
}

void undo_ptr(uint64_t key)
{
	gs_fn_cuMemFree_v2 fn = GS_REAL_FN(cuMemFree_v2);

	if (fn != NULL)
		fn((CUdeviceptr)key);
}

void undo_handle(uint64_t key)
{
	gs_fn_cuMemRelease fn = GS_REAL_FN(cuMemRelease);

	if (fn != NULL)
		fn((CUmemGenericAllocationHandle)key);
}

void undo_array(uint64_t key)
{
	gs_fn_cuArrayDestroy fn = GS_REAL_FN(cuArrayDestroy);

	if (fn != NULL)
		fn((CUarray)(uintptr_t)key);
}

void undo_mipmap(uint64_t key)
{
	gs_fn_cuMipmappedArrayDestroy fn = GS_REAL_FN(cuMipmappedArrayDestroy);

	if (fn != NULL)
		fn((CUmipmappedArray)(uintptr_t)key);
}

/* --- wrappers: contexts --------------------------------------------------------- */

/* Serialises context teardown with the bookkeeping of primary retains. */
pthread_mutex_t teardown_mu = PTHREAD_MUTEX_INITIALIZER;

/*
 * Teardown: destroying a context, resetting a primary context, or releasing
 * its last retain frees the memory allocated in it, so its records and
 * charges go (what a context itself was charged stays until the process
 * ends). One teardown at a time, and retains' bookkeeping waits for it, so
 * the process's count of primary retains is never raced.
 */
CUresult teardown(gs_fn_cuCtxDestroy_v2 destroy, CUcontext ctx,
		  gs_fn_cuDevicePrimaryCtxReset_v2 on_dev, CUdevice dev, int release)
{
	struct gs_taken t;
	CUresult rc;
	int last = 1;

	if (gs_state.mode != GS_ENFORCE)
		return destroy != NULL ? destroy(ctx) : on_dev(dev);
	if (destroy == NULL && (dev < 0 || dev >= GS_MAX_DEVS))
		return on_dev(dev); /* the driver's answer to a bad ordinal */
	pthread_mutex_lock(&teardown_mu);
	if (destroy == NULL) {
		ctx = gs_state.primary[dev];
		last = !release || gs_state.primary_refs[dev] <= 1;
	}
	memset(&t, 0, sizeof(t));
	if (last)
		take_context(ctx, &t);
	rc = destroy != NULL ? destroy(ctx) : on_dev(dev);
	if (last)
		settle_context(&t, ctx, rc);
	if (rc == CUDA_SUCCESS && release && gs_state.primary_refs[dev] > 0)
		gs_state.primary_refs[dev]--;
	pthread_mutex_unlock(&teardown_mu);
	return rc;
}

/* --- stream-ordered pools ------------------------------------------------------ */

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

/* The ledger GPU's device ordinal, as ledger_gpu() learnt it; -1 if never asked. */
static CUdevice gpu_device(int gpu)
{
	for (int d = 0; d < GS_MAX_DEVS; d++)
		if (__atomic_load_n(&gs_state.dev_map[d], __ATOMIC_RELAXED) == gpu)
			return d;
	return -1;
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

/*
 * A device's graph memory pool (see "graph memory" below) is an entry of the
 * table too, under a handle no driver pool has: so boundaries classify its
 * charge as they do a pool's.
 */
#define GS_GRAPH_POOL(gpu) (UINT64_MAX - (uint64_t)(gpu))
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
static void pool_sync(struct gs_pool *p)
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
	if (ledger_charge(slot, p->gpu, reserved - p->charged) != 0)
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
static int pool_grow(struct gs_pool *p)
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

/*
 * Graph memory. A stream-ordered allocation on a capturing stream takes no
 * memory from its pool: it becomes an allocation node of the graph, whose
 * memory the device's graph memory pool maps when an executable graph
 * holding the node is uploaded or launched, and keeps (for later launches)
 * after the graph frees it, until cuDeviceGraphMemTrim. So a captured
 * allocation is not charged; the device's graph pool is, following what
 * the driver says it reserves (CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT):
 * up after a launch or an upload, down after a trim or an executable
 * graph's destruction. The memory is taken by the time the shim learns of
 * it (the driver says nothing of a graph's needs beforehand): where the
 * limit has no room for it, the pool is trimmed and what it still holds
 * charged if that fits; what does not stays uncharged until a later
 * launch finds room or a trim gives it back.
 *
 * A process that never made graph memory pays one relaxed load per graph
 * launch. Captures in progress are counted (cuStreamBeginCapture* and
 * cuStreamEndCapture*), so a stream-ordered allocation asks the driver
 * whether its stream captures only while some capture is under way. A
 * capture its stream's destruction ended keeps the count up: the price is
 * that question on each later stream-ordered allocation.
 */
static uint32_t captures; /* begun and not ended in this process */
uint32_t gs_graph_mem;	  /* 1 once this process made graph memory */

/* Whether a stream captures; only asked while captures is nonzero. */
static int stream_captures(CUstream stream)
{
	gs_fn_cuStreamIsCapturing is = GS_REAL_FN(cuStreamIsCapturing);
	int status = 0;

	return is != NULL && is(stream, &status) == CUDA_SUCCESS && status != 0;
}

/* A graph's allocation node: the driver's answer, uncharged. */
CUresult graph_node_made(CUresult rc)
{
	if (rc == CUDA_SUCCESS)
		__atomic_store_n(&gs_graph_mem, 1, __ATOMIC_RELEASE);
	return rc;
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
 * Before the driver call of a stream-ordered allocation from `pool` (NULL:
 * the stream's device's current pool): an error to answer, or op->how and
 * its charge. The mode decides as for every allocation (cuMemAlloc_v2). `cap`
 * is the stream as the driver names it to cuStreamIsCapturing.
 */
CUresult pool_alloc_begin(struct gs_pool_alloc *op, const CUdeviceptr *dptr, size_t bytes,
			  CUmemoryPool pool, CUstream stream, CUstream cap)
{
	op->how = GS_PASS;
	if (gs_state.mode == GS_INERT)
		return CUDA_SUCCESS;
	if (gs_state.mode == GS_BROKEN)
		return CUDA_ERROR_NOT_PERMITTED;
	if (dptr == NULL || bytes == 0)
		return CUDA_SUCCESS;
	if (__atomic_load_n(&captures, __ATOMIC_RELAXED) != 0 && stream_captures(cap)) {
		op->how = GS_NODE;
		return CUDA_SUCCESS;
	}
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
	if (op->how == GS_NODE)
		return graph_node_made(rc);
	if (op->how == GS_PLAIN)
		return settle(rc, *dptr, GS_K_PTR, &op->c, undo_ptr);
	return pool_settle(rc, *dptr, op->p, &op->c, op->grew);
}

/* The per-thread flavours' NULL stream is the per-thread default stream, which may capture. */
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

/* --- graph memory (see "Graph memory" above) ----------------------------------------- */

static struct gs_pool *graph_pools[GS_MAX_GPUS];

/* Ledger GPU gpu's graph memory pool entry; NULL when the table is full. */
static struct gs_pool *graph_pool(int gpu)
{
	struct gs_pool *p;

	if (gpu < 0 || gpu >= GS_MAX_GPUS)
		return NULL;
	p = __atomic_load_n(&graph_pools[gpu], __ATOMIC_ACQUIRE);
	if (p == NULL) {
		p = pool_note((CUmemoryPool)(uintptr_t)GS_GRAPH_POOL(gpu), gpu);
		__atomic_store_n(&graph_pools[gpu], p, __ATOMIC_RELEASE);
	}
	return p;
}

/*
 * After a launch or an upload on a stream: the charge of its device's graph
 * pool up to what the pool reserves, if the limit has room; if not, after
 * a trim, up to what the pool still reserves, if that fits.
 */
__attribute__((noinline, cold)) void graph_launched(CUstream stream)
{
	int slot = __atomic_load_n(&gs_state.slot, __ATOMIC_ACQUIRE);
	struct gs_pool *p;
	CUcontext ctx;
	int gpu;

	if (gs_state.mode != GS_ENFORCE || slot < 0 ||
	    stream_ctx(stream, &ctx, &gpu) != CUDA_SUCCESS || (p = graph_pool(gpu)) == NULL)
		return;
	/* What a process takes before its first boundary is set-up, not temporary. */
	if (pool_grow(p) && epoch_now() >= 1)
		gs_ledger_note_temp(gs_state.ledger, (uint32_t)slot, (uint32_t)gpu);
}

/* cuDeviceGraphMemTrim on ledger GPU gpu: its graph pool's charge follows. */
void graph_pool_trimmed(int gpu)
{
	struct gs_pool *p;

	if (gpu >= 0 && gpu < GS_MAX_GPUS &&
	    (p = __atomic_load_n(&graph_pools[gpu], __ATOMIC_ACQUIRE)) != NULL)
		pool_sync(p);
}

/* Every graph pool's charge down to what it reserves now. */
void graph_pools_sync(void)
{
	for (int gpu = 0; gpu < GS_MAX_GPUS; gpu++) {
		struct gs_pool *p = __atomic_load_n(&graph_pools[gpu], __ATOMIC_ACQUIRE);

		if (p != NULL)
			pool_sync(p);
	}
}

#define GS_CAPTURE_INVALIDATED 901 /* CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: ended all the same */

/* A capture began. */
void capture_begun(void)
{
	__atomic_add_fetch(&captures, 1, __ATOMIC_RELAXED);
}

/* A capture ends with success, or invalidated; the count never goes below 0. */
void capture_ended(CUresult rc)
{
	uint32_t n = __atomic_load_n(&captures, __ATOMIC_RELAXED);

	if (rc != CUDA_SUCCESS && rc != GS_CAPTURE_INVALIDATED)
		return;
	while (n != 0 && !__atomic_compare_exchange_n(&captures, &n, n - 1, 1, __ATOMIC_RELAXED,
						      __ATOMIC_RELAXED))
		;
}

/*
 * In a fork child: the contexts and pools are the parent's, so is what this
 * thread was paying; what the child allocates from the pools is its own.
 * Locks are re-made because another thread may have held them.
 */
void gs_accounting_after_fork(void)
{
	paying = 0;
	pthread_mutex_init(&teardown_mu, NULL);
	pthread_mutex_init(&pools_mu, NULL);
	for (uint32_t i = 0; i < pools_n; i++) {
		pthread_mutex_init(&pools[i].mu, NULL);
		pools[i].charged = pools[i].in_use = pools[i].persisted = 0;
	}
}
