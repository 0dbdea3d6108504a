/*
 * The accounting policy's core: what is charged for what, on which GPU, to
 * whom, and when it goes back. Allocations' charges live in the allocation
 * map (alloc_map.c) until freed; contexts are charged once per process and
 * GPU. Stream-ordered pools (pools.c) and the graph memory pool
 * (graph_mem.c) charge through this file for what they keep.
 */
#include "accounting.h"

#include <time.h>

/*
 * A charge still refused may be one nodemgr tops up (docs/prediction.md#admission):
 * a task granted its predicted memory rather than its environment's quota that
 * needs more is not failed at once. The process asks (gs_ledger_want) and polls
 * the limit for up to the ledger's wait: a new limit, and the charge is tried
 * again (asking again if still refused); nodemgr's answer without one (the
 * quota cannot hold it), or the wait's end, and the refusal stands. nodemgr
 * leaves an ask it cannot serve yet unanswered and holds the GPU's memory that
 * comes free for it. Polling, not a futex: the limit is a 64-bit word, and
 * nodemgr answers at its sweeps, tenths of a second apart.
 */
static int charge_after_topup(int slot, int gpu, uint64_t bytes, int refused)
{
	struct gs_ledger *l = gs_state.ledger;
	const struct timespec poll = { 0, 2 * 1000 * 1000 };
	uint64_t limit = gs_ledger_limit(l, (uint32_t)gpu);
	uint64_t waited_ns = 0, wait_ns, asked = 0;
	int rc = refused;

	wait_ns = (uint64_t)gs_ledger_topup_wait(l) * 1000000u;
	if (!gs_ledger_want(l, (uint32_t)gpu, bytes, limit, &asked))
		return rc;
	while (waited_ns < wait_ns) {
		uint64_t now_limit;
		int answered;

		nanosleep(&poll, NULL);
		waited_ns += (uint64_t)poll.tv_nsec;
		/* `wanted` before the limit: see gs_ledger_clear_ask. */
		answered = gs_ledger_wanted(l, (uint32_t)gpu) == 0;
		now_limit = gs_ledger_limit(l, (uint32_t)gpu);
		if (now_limit == limit && !answered)
			continue;
		/*
		 * A new limit, or an answer without one: the charge may fit now
		 * (what others held went back meanwhile), else ask again. An
		 * answer without a new limit may be another process's withdrawal
		 * of a merged ask; a real refusal leaves no top-up to ask for
		 * (the top-up limit at or below the limit), so the asking stops.
		 */
		limit = now_limit;
		rc = gs_ledger_charge(l, (uint32_t)slot, (uint32_t)gpu, bytes);
		if (rc == 0 || !gs_ledger_want(l, (uint32_t)gpu, bytes, limit, &asked))
			return rc;
	}
	/* Given up: withdrawn, so that nodemgr holds no memory back for it. */
	gs_ledger_clear_ask(l, (uint32_t)gpu, asked);
	return rc;
}

/*
 * Charge `bytes` on ledger GPU `gpu` to `slot`. A refused charge may be
 * refused for what processes of the environment that have ended still hold
 * (their slots are freed at nodemgr's next sweep; a task running processes
 * one after the other would be refused what the last one left): those are
 * freed here, and the charge is tried once more, even if this process freed
 * none (nodemgr may have, meanwhile); still refused, it may wait for a
 * top-up (charge_after_topup). Only when refused: the granted charge costs
 * what it did.
 */
static __attribute__((noinline, cold)) int charge_after_reap(int slot, int gpu, uint64_t bytes)
{
	int rc;

	reap_dead_slots(slot);
	rc = gs_ledger_charge(gs_state.ledger, (uint32_t)slot, (uint32_t)gpu, bytes);
	return rc == 0 ? 0 : charge_after_topup(slot, gpu, bytes, rc);
}

/* Charge `bytes` on `gpu` to `slot`, reaping once if refused: 0, or the ledger's error. */
int charge_slot(int slot, int gpu, uint64_t bytes)
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
	if (charge_slot(c->slot, gpu, bytes) != 0)
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

/* The process's contexts, as far as charging them goes. */
static struct {
	uint8_t state[GS_MAX_GPUS];	/* the context charge on that GPU: enum gs_ctx_state */
	uint64_t bytes[GS_MAX_GPUS];	/* what was charged for it */
	CUcontext primary[GS_MAX_DEVS]; /* each device's primary context, once retained */
	int primary_refs[GS_MAX_DEVS];	/* this process's retains of it; under teardown_mu */
} ctxs;

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
		st = __atomic_load_n(&ctxs.state[gpu], __ATOMIC_ACQUIRE);
		/* Paid, or this thread's own outer call is paying it (a callback re-entered). */
		if (st == GS_CTX_PAID || (paying & (1u << gpu)))
			return CUDA_SUCCESS;
		if (st == GS_CTX_UNPAID &&
		    __atomic_compare_exchange_n(&ctxs.state[gpu], &st, GS_CTX_PAYING, 0,
						__ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
			break;
		sched_yield(); /* another thread is paying: its outcome decides */
	}
	paying |= 1u << gpu;
	bytes = gs_ledger_ctx_charge(gs_state.ledger, (uint32_t)gpu);
	if (bytes != 0 && charge_gpu(gpu, bytes, &c) != CUDA_SUCCESS) {
		paying &= ~(1u << gpu);
		__atomic_store_n(&ctxs.state[gpu], GS_CTX_UNPAID, __ATOMIC_RELEASE);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	ctxs.bytes[gpu] = bytes;
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
		__atomic_store_n(&ctxs.state[gpu], GS_CTX_PAID, __ATOMIC_RELEASE);
		return;
	}
	/* A context's charge is not an allocation: it is left out of classification. */
	if (ctxs.bytes[gpu] != 0)
		gs_ledger_uncharge(gs_state.ledger,
				   (uint32_t)__atomic_load_n(&gs_state.slot, __ATOMIC_ACQUIRE),
				   (uint32_t)gpu, ctxs.bytes[gpu]);
	__atomic_store_n(&ctxs.state[gpu], GS_CTX_UNPAID, __ATOMIC_RELEASE);
}

/* --- records of allocations ---------------------------------------------------- */

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

int alloc_track(uint64_t key, uint32_t kind, const struct gs_charge *c)
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

/*
 * pools.c's: a callback, since pools charge through this file and this file
 * names nothing above it. Set at load, before any wrapper runs: a plain
 * read.
 */
static void (*pool_free)(const struct gs_alloc *a);

void records_pool_free(void (*to_pool)(const struct gs_alloc *a))
{
	pool_free = to_pool;
}

/* A record's memory was freed: back to the driver, or to the pool it came from. */
static void release_record(const struct gs_alloc *a)
{
	if (a->pool != 0)
		pool_free(a);
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

/* --- contexts: retains and teardown ---------------------------------------------- */

/* Serialises context teardown with the bookkeeping of primary retains. */
static pthread_mutex_t teardown_mu = PTHREAD_MUTEX_INITIALIZER;

/*
 * The primary context is remembered, and its retains counted, for its
 * teardown. Counted before the driver call (and uncounted if it fails): a
 * release racing with the retain must not take the context for its last one.
 */
void primary_retain_begin(CUdevice dev)
{
	pthread_mutex_lock(&teardown_mu);
	ctxs.primary_refs[dev]++;
	pthread_mutex_unlock(&teardown_mu);
}

/* After the driver's answer to the retain primary_retain_begin() counted. */
void primary_retain_end(CUdevice dev, CUresult rc, const CUcontext *ctx)
{
	pthread_mutex_lock(&teardown_mu);
	if (rc == CUDA_SUCCESS)
		ctxs.primary[dev] = *ctx;
	else
		ctxs.primary_refs[dev]--;
	pthread_mutex_unlock(&teardown_mu);
}

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
		ctx = ctxs.primary[dev];
		last = !release || ctxs.primary_refs[dev] <= 1;
	}
	memset(&t, 0, sizeof(t));
	if (last)
		take_context(ctx, &t);
	rc = destroy != NULL ? destroy(ctx) : on_dev(dev);
	if (last)
		settle_context(&t, ctx, rc);
	if (rc == CUDA_SUCCESS && release && ctxs.primary_refs[dev] > 0)
		ctxs.primary_refs[dev]--;
	pthread_mutex_unlock(&teardown_mu);
	return rc;
}

/*
 * The pacer (pacer.c): wait, from the calling thread and with the driver's
 * own entries (no wrapper's bookkeeping), for the work each primary context
 * this process holds has queued; the thread's current context is put back.
 * Under teardown_mu, so that no context goes away meanwhile (a teardown
 * waits for the synchronisation). Returns the number synchronised.
 */
int sync_primaries(void)
{
	gs_fn_cuCtxPushCurrent_v2 push = GS_REAL_FN(cuCtxPushCurrent_v2);
	gs_fn_cuCtxPopCurrent_v2 pop = GS_REAL_FN(cuCtxPopCurrent_v2);
	gs_fn_cuCtxSynchronize sync = GS_REAL_FN(cuCtxSynchronize);
	CUcontext ignored;
	int n = 0;

	if (push == NULL || pop == NULL || sync == NULL)
		return 0;
	pthread_mutex_lock(&teardown_mu);
	for (int dev = 0; dev < GS_MAX_DEVS; dev++) {
		if (ctxs.primary_refs[dev] <= 0 || ctxs.primary[dev] == NULL ||
		    push(ctxs.primary[dev]) != CUDA_SUCCESS)
			continue;
		n += sync() == CUDA_SUCCESS;
		pop(&ignored);
	}
	pthread_mutex_unlock(&teardown_mu);
	return n;
}

/*
 * In a fork child: the contexts are the parent's, so is what this thread
 * was paying, and so are the allocations the map records. Locks are re-made
 * because another thread may have held them.
 */
static void accounting_after_fork_child(void)
{
	paying = 0;
	memset(&ctxs, 0, sizeof(ctxs));
	pthread_mutex_init(&teardown_mu, NULL);
	gs_map_reset();
}

__attribute__((constructor)) static void accounting_load(void)
{
	gs_map_init();
	pthread_atfork(NULL, NULL, accounting_after_fork_child);
}
