/*
 * Graph memory and stream capture: each device's graph memory pool, an
 * entry of pools.c's table (GS_GRAPH_POOL), and the count of captures under
 * way, which tells a stream-ordered allocation whether to ask the driver if
 * it is a graph's node. Above pools.c.
 */
#include "graph_mem.h"

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

/*
 * Whether a stream captures, so that a stream-ordered allocation on it is a
 * graph's node: asked of the driver only while captures is nonzero.
 */
int stream_captures(CUstream stream)
{
	gs_fn_cuStreamIsCapturing is = GS_REAL_FN(cuStreamIsCapturing);
	int status = 0;

	if (__atomic_load_n(&captures, __ATOMIC_RELAXED) == 0)
		return 0;
	return is != NULL && is(stream, &status) == CUDA_SUCCESS && status != 0;
}

/* A graph's allocation node: the driver's answer, uncharged. */
CUresult graph_node_made(CUresult rc)
{
	if (rc == CUDA_SUCCESS)
		__atomic_store_n(&gs_graph_mem, 1, __ATOMIC_RELEASE);
	return rc;
}

/* --- graph pools ---------------------------------------------------------------------- */

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

/*
 * A synchronisation while a stream captures would invalidate the capture
 * (or be refused), so the pacer (pacer.c) synchronises only while none is
 * under way, and no capture begins meanwhile: capture_mu orders the two.
 */
static pthread_mutex_t capture_mu = PTHREAD_MUTEX_INITIALIZER;

/* A capture is about to begin: it waits for a synchronisation of the pacer's. */
void capture_starting(void)
{
	pthread_mutex_lock(&capture_mu);
}

/* The driver's answer to it: counted when it began. */
void capture_begun(CUresult rc)
{
	if (rc == CUDA_SUCCESS)
		__atomic_add_fetch(&captures, 1, __ATOMIC_RELAXED);
	pthread_mutex_unlock(&capture_mu);
}

/* The pacer: 1 (and no capture may begin until quiet_end) when none is under way, else 0. */
int quiet_begin(void)
{
	pthread_mutex_lock(&capture_mu);
	if (__atomic_load_n(&captures, __ATOMIC_RELAXED) == 0)
		return 1;
	pthread_mutex_unlock(&capture_mu);
	return 0;
}

void quiet_end(void)
{
	pthread_mutex_unlock(&capture_mu);
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

/* In a fork child: the pacer that may have held capture_mu is the parent's. */
static void graph_mem_after_fork_child(void)
{
	pthread_mutex_init(&capture_mu, NULL);
}

__attribute__((constructor)) static void graph_mem_load(void)
{
	pthread_atfork(NULL, NULL, graph_mem_after_fork_child);
}
