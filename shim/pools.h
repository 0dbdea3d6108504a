/*
 * pools.c: stream-ordered pools, charged for what they hold, and the
 * stream-ordered allocations that take from them. Above accounting.h.
 */
#ifndef GS_POOLS_H
#define GS_POOLS_H

#include "accounting.h"

#pragma GCC visibility push(hidden)

/* A pool of host or managed memory: allocations from it take no device memory. */
#define GS_POOL_HOST (-3)
#define GS_POOL_RELEASE_THRESHOLD 4 /* CU_MEMPOOL_ATTR_RELEASE_THRESHOLD */

/*
 * A device's graph memory pool (graph_mem.c) is an entry of the pool table
 * too, under a handle no driver pool has: so boundaries classify its charge
 * as they do a pool's, and the table asks the driver for its figures the
 * graph pool's way.
 */
#define GS_GRAPH_POOL(gpu) (UINT64_MAX - (uint64_t)(gpu))

struct gs_pool;

/* How a stream-ordered allocation is accounted. */
struct gs_pool_alloc {
	enum {
		GS_PASS, /* straight to the driver: inert, its own answer to bad arguments, host pool */
		GS_PLAIN,  /* a pool the shim cannot follow: charged as plain memory */
		GS_POOLED, /* charged to its pool */
		GS_NODE,   /* on a capturing stream: a graph's allocation node, charged at launch */
	} how;
	struct gs_charge c;
	struct gs_pool *p;
	uint64_t grew;
};

CUresult pool_alloc_begin(struct gs_pool_alloc *op, size_t bytes, CUmemoryPool pool,
			  CUstream stream);
CUresult pool_alloc_end(const struct gs_pool_alloc *op, CUresult rc, const CUdeviceptr *dptr);
struct gs_pool *pool_note(CUmemoryPool pool, int gpu);
int pool_gpu(const CUmemLocation *location, int type);
void set_current_pool(CUmemoryPool pool, int gpu);
void pool_trimmed(CUmemoryPool pool);
void pool_threshold_set(CUmemoryPool pool, uint64_t threshold);
void pool_destroyed(CUmemoryPool pool);
int pool_grow(struct gs_pool *p);
void pool_sync(struct gs_pool *p);
void pools_after_sync(void);
void pools_at_boundary(void);

#pragma GCC visibility pop

#endif
