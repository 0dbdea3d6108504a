/*
 * The simulated driver's device memory: each device's heap (a memfd as large
 * as the device, see sim_cuda.c) and all that takes from it or maps it.
 * Allocations and frees, stream-ordered pools, virtual memory management
 * (reservations, cuMemCreate handles, mappings), arrays, page-locked host
 * memory, pointer queries, IPC and shareable handles, the copies and
 * memsets that move real bytes, and what a forked child does to them.
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
#include "sim_usage.h"

#define SIM_GRANULARITY	((size_t)2 << 20)	/* cuMemCreate / cuMemMap granule */

struct CUarray_st {
	struct sim_obj obj;
};

struct CUmipmappedArray_st {
	struct sim_obj obj;
};

/* cuMemMap: the bytes [off, off + len) of a reservation are handle's. */
struct sim_map {
	size_t off;
	size_t len;
	CUmemGenericAllocationHandle handle;
	size_t hoff;		/* where in the handle's allocation the mapping starts */
};

/* cuMemAddressReserve: a range of address space and its mappings. */
struct sim_va {
	struct sim_va *next;	/* sim_va_list */
	uintptr_t base;
	size_t size;
	struct sim_map *maps;	/* sorted by off, never overlapping */
	size_t nmaps, cap;
};

static pthread_mutex_t sim_va_lock = PTHREAD_MUTEX_INITIALIZER;
static struct sim_va *sim_va_list;

/* Device memory allocator. */

/* The first index whose offset is >= off. */
static size_t sim_ext_search(const struct sim_extent *v, size_t n, size_t off)
{
	size_t lo = 0, hi = n;

	while (lo < hi) {
		size_t mid = lo + (hi - lo) / 2;

		if (v[mid].off < off)
			lo = mid + 1;
		else
			hi = mid;
	}
	return lo;
}

static void sim_ext_insert(struct sim_extent *v, size_t *n, size_t at, size_t off, size_t len,
			   unsigned int kind)
{
	memmove(&v[at + 1], &v[at], (*n - at) * sizeof(*v));
	memset(&v[at], 0, sizeof(*v));
	v[at].off = off;
	v[at].len = len;
	v[at].kind = kind;
	(*n)++;
}

static void sim_ext_remove(struct sim_extent *v, size_t *n, size_t at)
{
	memmove(&v[at], &v[at + 1], (*n - at - 1) * sizeof(*v));
	(*n)--;
}

/* Room for one more live allocation and the free extent it may leave. */
static bool sim_heap_grow(struct sim_heap *h)
{
	size_t cap = h->live_cap ? h->live_cap * 2 : 64;
	struct sim_extent *v;

	if (h->nlive < h->live_cap)
		return true;
	v = realloc(h->free_ext, (cap + 1) * sizeof(*v));
	if (!v)
		return false;
	h->free_ext = v;
	h->free_cap = cap + 1;
	v = realloc(h->live, cap * sizeof(*v));
	if (!v)
		return false;
	h->live = v;
	h->live_cap = cap;
	return true;
}

/* Made on first use so that devices a process never touches cost nothing. */
#define SIM_MEMFD_NAME "gpushare-sim-"

static bool sim_heap_reserve(struct sim_heap *h, size_t total, int spec_index)
{
	char name[32];
	void *p;
	int fd;

	if (h->base)
		return true;
	if (h->arena == 0 || !sim_heap_grow(h))
		return false;
	/* The name says which device of the node it is: imports read it (SIM_MEMFD_NAME). */
	snprintf(name, sizeof(name), SIM_MEMFD_NAME "%d", spec_index);
	fd = memfd_create(name, MFD_CLOEXEC);
	if (fd < 0)
		return false;
	if (ftruncate(fd, (off_t)total) != 0)
		goto fail;
	p = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
	if (p == MAP_FAILED)
		goto fail;
	h->fd = fd;
	h->free_ext[0].off = 0;
	h->free_ext[0].len = h->arena;
	h->free_ext[0].kind = 0;
	h->nfree = 1;
	__atomic_store_n(&h->base, (uintptr_t)p, __ATOMIC_RELEASE);
	return true;
fail:
	close(fd);
	return false;
}

/* The whole pages of [off, off + len) go back to the system. */
static void sim_heap_punch(struct sim_heap *h, size_t off, size_t len)
{
	const size_t page = 4096;
	size_t start = (off + page - 1) & ~(page - 1);
	size_t end = (off + len) & ~(page - 1);

	/* A forked child's view is private (sim_atfork_child): the pages are the parent's. */
	if (end > start && h->fd >= 0)
		fallocate(h->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)start,
			  (off_t)(end - start));
}

/*
 * With h locked: takes size bytes (already rounded to SIM_ALIGN) at a
 * multiple of align and records the allocation; *at is its index among the
 * live extents. owner is the id of the context the allocation belongs to, 0
 * for none. cuMemCreate memory is granule-aligned, so that cuMemMap can map
 * its pages of the memfd elsewhere.
 */
static CUresult sim_heap_take(struct sim_device *d, size_t size, size_t align,
			      enum sim_mem_kind kind, uint64_t owner, size_t *at)
{
	struct sim_heap *h = &d->heap;
	size_t i, off = 0;

	if (size > d->spec->bytes - h->used || !sim_heap_reserve(h, d->spec->bytes, d->spec_index))
		return CUDA_ERROR_OUT_OF_MEMORY;
	for (i = 0; i < h->nfree; i++) {
		const struct sim_extent *f = &h->free_ext[i];

		off = (f->off + align - 1) & ~(align - 1);
		if (off - f->off <= f->len && size <= f->len - (off - f->off))
			break;
	}
	/* Fragmentation can leave no hole big enough; the real driver fails too. */
	if (i == h->nfree || !sim_heap_grow(h))
		return CUDA_ERROR_OUT_OF_MEMORY;
	if (off > h->free_ext[i].off) {
		/* The hole's unaligned head stays free, as a hole of its own. */
		size_t head = off - h->free_ext[i].off;

		sim_ext_insert(h->free_ext, &h->nfree, i, h->free_ext[i].off, head, 0);
		i++;
		h->free_ext[i].off += head;
		h->free_ext[i].len -= head;
	}
	*at = sim_ext_search(h->live, h->nlive, off);
	sim_ext_insert(h->live, &h->nlive, *at, off, size, kind);
	h->live[*at].owner = owner;
	/* cuMemCreate hands its caller the first reference. */
	h->live[*at].refs = kind == SIM_MEM_HANDLE;
	if (h->free_ext[i].len == size) {
		sim_ext_remove(h->free_ext, &h->nfree, i);
	} else {
		h->free_ext[i].off += size;
		h->free_ext[i].len -= size;
	}
	h->used += size;
	sim_usage_set(h->spec_index, h->used);
	return CUDA_SUCCESS;
}

/* bytes rounded up to the heap's granule; false if that overflows. */
static bool sim_round(size_t bytes, size_t *size)
{
	if (bytes > SIZE_MAX - (SIM_ALIGN - 1))
		return false;
	*size = (bytes + SIM_ALIGN - 1) & ~(size_t)(SIM_ALIGN - 1);
	return true;
}

CUresult sim_heap_alloc(struct sim_device *d, size_t bytes, enum sim_mem_kind kind,
			uint64_t owner, CUdeviceptr *out)
{
	struct sim_heap *h = &d->heap;
	size_t size, at;
	CUresult rc;

	if (!sim_round(bytes, &size))
		return CUDA_ERROR_OUT_OF_MEMORY;
	pthread_mutex_lock(&h->lock);
	rc = sim_heap_take(d, size, kind == SIM_MEM_HANDLE ? SIM_GRANULARITY : SIM_ALIGN, kind,
			   owner, &at);
	if (rc == CUDA_SUCCESS)
		*out = (CUdeviceptr)(h->base + h->live[at].off);
	pthread_mutex_unlock(&h->lock);
	return rc;
}

/* With h locked: the live extent of this kind that starts at off, or NULL. */
static struct sim_extent *sim_heap_find(struct sim_heap *h, size_t off, enum sim_mem_kind kind)
{
	size_t at = sim_ext_search(h->live, h->nlive, off);

	if (at == h->nlive || h->live[at].off != off || h->live[at].kind != kind)
		return NULL;
	return &h->live[at];
}

/*
 * With h locked: freed device memory goes back to the system (it then costs
 * no RAM, and reads as zeros when handed out again) once SIM_PUNCH_BATCH
 * bytes have been freed since the last time, all free extents at once. A
 * hole punched at every free costs a system call each: the shim's
 * allocation benchmark measured the simulator's free at 0.75 us instead of
 * 26 ns. Freed memory is like a GPU's meanwhile: it keeps what was there.
 */
#define SIM_PUNCH_BATCH ((size_t)64 << 20)

static void sim_heap_freed(struct sim_heap *h, size_t len)
{
	size_t i;

	h->unpunched += len;
	if (h->unpunched < SIM_PUNCH_BATCH)
		return;
	for (i = 0; i < h->nfree; i++)
		sim_heap_punch(h, h->free_ext[i].off, h->free_ext[i].len);
	h->unpunched = 0;
}

/* With h locked: gives live extent e back to the free extents. */
static void sim_heap_drop(struct sim_heap *h, struct sim_extent *e)
{
	struct sim_extent *f;
	size_t at, off = e->off, len = e->len;
	bool join_prev, join_next;

	sim_ext_remove(h->live, &h->nlive, (size_t)(e - h->live));
	h->used -= len;
	sim_usage_set(h->spec_index, h->used);

	f = h->free_ext;
	at = sim_ext_search(f, h->nfree, off);
	join_prev = at > 0 && f[at - 1].off + f[at - 1].len == off;
	join_next = at < h->nfree && off + len == f[at].off;
	if (join_prev && join_next) {
		f[at - 1].len += len + f[at].len;
		sim_ext_remove(f, &h->nfree, at);
	} else if (join_prev) {
		f[at - 1].len += len;
	} else if (join_next) {
		f[at].off = off;
		f[at].len += len;
	} else {
		sim_ext_insert(f, &h->nfree, at, off, len, 0);
	}
	sim_heap_freed(h, len);
}

/*
 * Memory from a pool goes back to the pool, which keeps it reserved; a
 * second free of it is an error like any other.
 */
static CUresult sim_heap_free(struct sim_heap *h, size_t off, enum sim_mem_kind kind)
{
	CUresult rc = CUDA_ERROR_INVALID_VALUE;
	struct sim_extent *e;

	pthread_mutex_lock(&h->lock);
	e = sim_heap_find(h, off, kind);
	if (e && e->pool) {
		if (!e->idle) {
			e->idle = true;
			e->pool->used -= e->len;
			rc = CUDA_SUCCESS;
		}
	} else if (e) {
		sim_heap_drop(h, e);
		rc = CUDA_SUCCESS;
	}
	pthread_mutex_unlock(&h->lock);
	return rc;
}

/*
 * With h locked: gives idle chunks of pool (of every pool when NULL) back to
 * the device as long as the pool keeps at least keep reserved (its release
 * threshold, with to_threshold), as cuMemPoolTrimTo documents.
 */
static void sim_pool_release(struct sim_heap *h, struct CUmemPoolHandle_st *pool, uint64_t keep,
			     bool to_threshold)
{
	size_t i = 0;

	while (i < h->nlive) {
		struct sim_extent *e = &h->live[i];
		struct CUmemPoolHandle_st *p = e->pool;
		uint64_t limit = to_threshold && p ? p->threshold : keep;

		if (p && e->idle && (!pool || p == pool) && p->reserved - e->len >= limit) {
			p->reserved -= e->len;
			sim_heap_drop(h, e);	/* the next extent moves to i */
		} else {
			i++;
		}
	}
}

/* A synchronisation: every pool gives back what exceeds its release threshold. */
void sim_pools_settle(void)
{
	int i;

	for (i = 0; i < sim_ndevs; i++) {
		struct sim_heap *h = &sim_devs[i].heap;

		if (!__atomic_load_n(&h->base, __ATOMIC_ACQUIRE))
			continue;
		pthread_mutex_lock(&h->lock);
		sim_pool_release(h, NULL, 0, true);
		pthread_mutex_unlock(&h->lock);
	}
}

/*
 * From pool on device d: the smallest idle chunk of the pool that holds the
 * request (split when it is a granule or more too large), else new memory
 * from the device. When the device is full, the
 * pool's own idle chunks are given back first and the request tried again,
 * as the driver does before it reports CUDA_ERROR_OUT_OF_MEMORY.
 */
static CUresult sim_pool_alloc(struct sim_device *d, struct CUmemPoolHandle_st *pool,
			       size_t bytes, CUdeviceptr *out)
{
	struct sim_heap *h = &d->heap;
	struct sim_extent *best = NULL;
	size_t size, i, at;
	CUresult rc = CUDA_SUCCESS;

	if (!sim_round(bytes, &size))
		return CUDA_ERROR_OUT_OF_MEMORY;
	pthread_mutex_lock(&h->lock);
	for (i = 0; i < h->nlive; i++) {
		struct sim_extent *e = &h->live[i];

		if (e->pool == pool && e->idle && e->len >= size && (!best || e->len < best->len))
			best = e;
	}
	if (!best) {
		rc = sim_heap_take(d, size, SIM_ALIGN, SIM_MEM_PTR, 0, &at);
		if (rc == CUDA_ERROR_OUT_OF_MEMORY) {
			sim_pool_release(h, pool, 0, false);
			rc = sim_heap_take(d, size, SIM_ALIGN, SIM_MEM_PTR, 0, &at);
		}
		if (rc == CUDA_SUCCESS) {
			best = &h->live[at];
			best->pool = pool;
			pool->reserved += size;
			if (pool->reserved > pool->reserved_high)
				pool->reserved_high = pool->reserved;
		}
	}
	if (best && best->len - size >= SIM_GRANULARITY) {
		/* A much larger idle chunk is split: the rest stays idle in the pool. */
		at = (size_t)(best - h->live);
		if (sim_heap_grow(h)) {	/* may move the live extents */
			best = &h->live[at];
			sim_ext_insert(h->live, &h->nlive, at + 1, best->off + size,
				       best->len - size, SIM_MEM_PTR);
			h->live[at].len = size;
			h->live[at + 1].pool = pool;
			h->live[at + 1].idle = true;
		}
		best = &h->live[at];
	}
	if (best) {
		best->idle = false;
		pool->used += best->len;
		if (pool->used > pool->used_high)
			pool->used_high = pool->used;
		*out = (CUdeviceptr)(h->base + best->off);
	}
	pthread_mutex_unlock(&h->lock);
	return rc;
}

/*
 * Frees every allocation that belongs to context id, in one pass however
 * many there are: the survivors are compacted, and since live and free
 * extents tile the arena, the free extents are the gaps between survivors.
 */
void sim_heap_sweep(struct sim_heap *h, uint64_t id)
{
	size_t i, kept = 0, pos = 0, freed = 0;

	pthread_mutex_lock(&h->lock);
	for (i = 0; i < h->nlive; i++) {
		if (h->live[i].owner == id)
			freed += h->live[i].len;
		else
			h->live[kept++] = h->live[i];
	}
	if (kept < h->nlive) {
		h->nlive = kept;
		h->used -= freed;
		sim_usage_set(h->spec_index, h->used);
		h->nfree = 0;
		for (i = 0; i <= kept; i++) {
			size_t end = i < kept ? h->live[i].off : h->arena;

			if (end > pos)
				sim_ext_insert(h->free_ext, &h->nfree, h->nfree, pos, end - pos, 0);
			if (i < kept)
				pos = h->live[i].off + h->live[i].len;
		}
		sim_heap_freed(h, freed);
	}
	pthread_mutex_unlock(&h->lock);
}

/* The heap whose arena holds addr, with addr's offset in it; NULL if none. */
static struct sim_heap *sim_heap_of(CUdeviceptr addr, size_t *off)
{
	int i;

	for (i = 0; addr && i < sim_ndevs; i++) {
		struct sim_heap *h = &sim_devs[i].heap;
		uintptr_t base = __atomic_load_n(&h->base, __ATOMIC_ACQUIRE);

		if (base && addr >= base && addr - base < h->arena) {
			*off = (size_t)(addr - base);
			return h;
		}
	}
	return NULL;
}

/* Memory: every path takes from, and gives back to, the device heaps. */

/* Allocations made here belong to the current context. */
static CUresult sim_alloc_current(CUdeviceptr *dptr, size_t bytes, enum sim_mem_kind kind)
{
	const struct sim_ctx_slot *cur;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!dptr || bytes == 0)
		return CUDA_ERROR_INVALID_VALUE;
	cur = sim_current();
	if (!cur)
		return CUDA_ERROR_INVALID_CONTEXT;
	return sim_heap_alloc(&sim_devs[cur->dev], bytes, kind, cur->id, dptr);
}

/* Frees addr if a heap holds a live allocation of this kind starting there. */
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
	size_t off, len;	/* its extent of the device's arena */
	size_t refs;		/* ops of graphs and executable graphs, and 1 while live */
	bool live;		/* allocated by a launch, not freed since */
	bool mark;		/* scratch for sim_gmem_launch's dry run */
};

static pthread_mutex_t sim_gmem_lock = PTHREAD_MUTEX_INITIALIZER;
static struct {
	uint64_t used, used_high;	/* bytes of live graph allocations */
	uint64_t reserved, reserved_high;	/* bytes the pool holds */
} sim_gpool[SIM_MAX_GPUS];
/* Graph allocations in existence: frees look for one only when there are some. */
static size_t sim_gallocs;	/* atomic */

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
	ga->refs = 1;	/* the node's */
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
static bool sim_graph_free_addr(CUdeviceptr addr)
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

CUresult sim_mem_free(CUdeviceptr addr, enum sim_mem_kind kind)
{
	size_t off;
	struct sim_heap *h;

	if (kind == SIM_MEM_PTR && sim_graph_free_addr(addr))
		return CUDA_SUCCESS;
	h = sim_heap_of(addr, &off);
	return h ? sim_heap_free(h, off, kind) : CUDA_ERROR_INVALID_VALUE;
}

CUresult sim_impl_cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
	return sim_alloc_current(dptr, bytesize, SIM_MEM_PTR);
}

/* Freeing NULL does nothing: cudaFree(NULL), the idiom that creates a context, ends here. */
CUresult sim_impl_cuMemFree_v2(CUdeviceptr dptr)
{
	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	return dptr ? sim_mem_free(dptr, SIM_MEM_PTR) : CUDA_SUCCESS;
}

/* The row alignment cuMemAllocPitch reports; what current GPUs use. */
#define SIM_PITCH 512

CUresult sim_impl_cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width,
				       size_t height, unsigned int elem)
{
	size_t row;
	CUresult rc;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!dptr || !pitch || width == 0 || height == 0)
		return CUDA_ERROR_INVALID_VALUE;
	/* The documented element sizes: what one thread reads or writes at once. */
	if (elem != 4 && elem != 8 && elem != 16)
		return CUDA_ERROR_INVALID_VALUE;
	if (width > SIZE_MAX - (SIM_PITCH - 1))
		return CUDA_ERROR_OUT_OF_MEMORY;
	row = (width + SIM_PITCH - 1) & ~(size_t)(SIM_PITCH - 1);
	if (height > SIZE_MAX / row)
		return CUDA_ERROR_OUT_OF_MEMORY;
	rc = sim_alloc_current(dptr, row * height, SIM_MEM_PTR);
	if (rc == CUDA_SUCCESS)
		*pitch = row;
	return rc;
}

/* Managed memory lives on the device that allocated it: nothing migrates here. */
CUresult sim_impl_cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (flags != CU_MEM_ATTACH_GLOBAL && flags != CU_MEM_ATTACH_HOST)
		return CUDA_ERROR_INVALID_VALUE;
	return sim_alloc_current(dptr, bytesize, SIM_MEM_PTR);
}

CUresult sim_impl_cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes)
{
	struct sim_device *d;
	size_t used;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!free_bytes || !total_bytes)
		return CUDA_ERROR_INVALID_VALUE;
	if (!sim_depth)
		return CUDA_ERROR_INVALID_CONTEXT;
	d = &sim_devs[sim_current_dev()];
	pthread_mutex_lock(&d->heap.lock);
	used = d->heap.used;
	pthread_mutex_unlock(&d->heap.lock);
	*total_bytes = d->spec->bytes;
	*free_bytes = d->spec->bytes - used;
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
	p = calloc(1, sizeof(*p));
	if (!p)
		return CUDA_ERROR_OUT_OF_MEMORY;
	p->obj.kind = SIM_OBJ_POOL;
	p->obj.dev = props->location.id;
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
	struct sim_obj **pp, *o = NULL;
	int i;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	pthread_mutex_lock(&sim_obj_lock);
	pp = sim_obj_find(pool, SIM_OBJ_POOL);
	if (pp) {
		o = *pp;
		*pp = o->next;
		for (i = 0; i < sim_ndevs; i++)
			if (sim_devs[i].mempool == pool)
				sim_devs[i].mempool = &sim_devs[i].default_pool;
	}
	pthread_mutex_unlock(&sim_obj_lock);
	if (!o)
		return CUDA_ERROR_INVALID_VALUE;
	sim_pool_forget(&sim_devs[o->dev].heap, pool);
	free(o);
	return CUDA_SUCCESS;
}

/*
 * From the current pool of the stream's device (a pool is always local to
 * its device, so that is the device's heap). Stream-ordered memory belongs
 * to its pool, not to a context: cuCtxDestroy documents that it does not
 * free it, so it is recorded with no owning context.
 */
static CUresult sim_alloc_async(CUdeviceptr *dptr, size_t bytesize, CUstream stream)
{
	struct CUmemPoolHandle_st *pool;
	struct sim_ctx_slot slot;
	bool captured;
	CUresult rc;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!dptr || bytesize == 0)
		return CUDA_ERROR_INVALID_VALUE;
	rc = sim_stream_slot(stream, &slot);
	if (rc != CUDA_SUCCESS)
		return rc;
	rc = sim_capture_alloc(stream, slot.dev, bytesize, dptr, &captured);
	if (captured)
		return rc;
	/* Held throughout, so that the pool cannot be destroyed while it is used. */
	pthread_mutex_lock(&sim_obj_lock);
	pool = sim_devs[slot.dev].mempool;
	rc = sim_pool_alloc(&sim_devs[slot.dev], pool, bytesize, dptr);
	pthread_mutex_unlock(&sim_obj_lock);
	return rc;
}

CUresult sim_impl_cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream stream)
{
	return sim_alloc_async(dptr, bytesize, stream);
}

CUresult sim_impl_cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream stream)
{
	return sim_alloc_async(dptr, bytesize, stream);
}

/* From the pool's device, whatever the stream's device is. */
static CUresult sim_alloc_from_pool(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
				    CUstream stream)
{
	struct sim_ctx_slot slot;
	bool captured;
	CUresult rc;
	int dev;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!dptr || bytesize == 0)
		return CUDA_ERROR_INVALID_VALUE;
	if (sim_pool_device(pool) < 0)
		return CUDA_ERROR_INVALID_VALUE;
	rc = sim_stream_slot(stream, &slot);
	if (rc != CUDA_SUCCESS)
		return rc;
	/* Captured: a node of the graph, on the pool's device (its properties are the node's). */
	dev = sim_pool_device(pool);
	rc = dev < 0 ? CUDA_ERROR_INVALID_VALUE
		     : sim_capture_alloc(stream, dev, bytesize, dptr, &captured);
	if (dev < 0 || captured)
		return rc;
	/* Held throughout, so that the pool cannot be destroyed while it is used. */
	pthread_mutex_lock(&sim_obj_lock);
	dev = sim_pool_device_locked(pool);
	rc = dev < 0 ? CUDA_ERROR_INVALID_VALUE
		     : sim_pool_alloc(&sim_devs[dev], pool, bytesize, dptr);
	pthread_mutex_unlock(&sim_obj_lock);
	return rc;
}

CUresult sim_impl_cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize,
					    CUmemoryPool pool, CUstream stream)
{
	return sim_alloc_from_pool(dptr, bytesize, pool, stream);
}

CUresult sim_impl_cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize,
						 CUmemoryPool pool, CUstream stream)
{
	return sim_alloc_from_pool(dptr, bytesize, pool, stream);
}

static CUresult sim_free_async(CUdeviceptr dptr, CUstream stream)
{
	struct sim_ctx_slot slot;
	bool captured;
	CUresult rc;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	rc = sim_stream_slot(stream, &slot);
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

/*
 * Virtual memory management. A handle is its allocation's address in the
 * device heap: opaque to callers, nonzero, and found again without a table.
 * Reserved ranges are PROT_NONE address space of their own, apart from the
 * heaps, so a reserved address is never a heap address (cuMemFree refuses
 * it); a mapping only records which handle's bytes back a reserved range.
 */

/* As for pools, only device locations exist in the simulation. */
static bool sim_valid_alloc_prop(const CUmemAllocationProp *prop)
{
	return prop->type == CU_MEM_ALLOCATION_TYPE_PINNED &&
	       prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE &&
	       sim_valid_dev(prop->location.id);
}

CUresult sim_impl_cuMemGetAllocationGranularity(size_t *granularity,
						  const CUmemAllocationProp *prop, int option)
{
	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!granularity || !prop || !sim_valid_alloc_prop(prop))
		return CUDA_ERROR_INVALID_VALUE;
	if (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM &&
	    option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
		return CUDA_ERROR_INVALID_VALUE;
	*granularity = SIM_GRANULARITY;
	return CUDA_SUCCESS;
}

/* cuMemCreate memory belongs to no context: no context's teardown frees it. */
CUresult sim_impl_cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
				const CUmemAllocationProp *prop, unsigned long long flags)
{
	CUdeviceptr addr;
	CUresult rc;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	/* flags is reserved and must be 0. */
	if (!handle || !prop || flags != 0 || !sim_valid_alloc_prop(prop))
		return CUDA_ERROR_INVALID_VALUE;
	if (size == 0 || size % SIM_GRANULARITY != 0)
		return CUDA_ERROR_INVALID_VALUE;
	rc = sim_heap_alloc(&sim_devs[prop->location.id], size, SIM_MEM_HANDLE, 0, &addr);
	if (rc == CUDA_SUCCESS)
		*handle = addr;
	return rc;
}

enum sim_handle_op { SIM_HANDLE_RELEASE, SIM_HANDLE_RETAIN, SIM_HANDLE_MAP, SIM_HANDLE_UNMAP };

/*
 * The memory behind a handle goes back to its device only when every
 * reference (cuMemCreate's and each cuMemRetainAllocationHandle's) is
 * released and every mapping of it unmapped, in whatever order. A handle
 * with no reference left is no longer the caller's to release or map, though
 * its mappings keep the memory. Retain and unmap come only from a mapping,
 * which holds the allocation, so they always find it. MAP checks that
 * [offset, offset + size) lies inside the allocation.
 */
/*
 * Memory of another process, imported from a shareable handle (a file
 * descriptor of its device memfd, positioned at the allocation): its handle
 * is the address of this record, which is never a heap address.
 */
struct sim_import {
	struct sim_import *next;
	int fd;			/* our own description of the exporter's memfd */
	uint64_t off;		/* the allocation's place in it */
	uint64_t limit;		/* bytes from there to the end of the device's memory */
	int dev;
	size_t refs, maps;
};

static pthread_mutex_t sim_import_lock = PTHREAD_MUTEX_INITIALIZER;
static struct sim_import *sim_import_list;

/* As sim_handle_op, for an imported handle; false if handle is not one. */
static bool sim_import_op(CUmemGenericAllocationHandle handle, enum sim_handle_op op,
			  size_t offset, size_t size, CUresult *rc)
{
	struct sim_import **pp, *m;

	pthread_mutex_lock(&sim_import_lock);
	for (pp = &sim_import_list; *pp && (uintptr_t)*pp != handle; pp = &(*pp)->next)
		;
	m = *pp;
	if (!m) {
		pthread_mutex_unlock(&sim_import_lock);
		return false;
	}
	*rc = CUDA_SUCCESS;
	/* The allocation's size is not known here, only where its device ends. */
	if (((op == SIM_HANDLE_RELEASE || op == SIM_HANDLE_MAP) && !m->refs) ||
	    (op == SIM_HANDLE_MAP && (offset > m->limit || size > m->limit - offset)))
		*rc = CUDA_ERROR_INVALID_VALUE;
	else if (op == SIM_HANDLE_RELEASE)
		m->refs--;
	else if (op == SIM_HANDLE_RETAIN)
		m->refs++;
	else if (op == SIM_HANDLE_MAP)
		m->maps++;
	else
		m->maps--;
	if (!m->refs && !m->maps)
		*pp = m->next;
	else
		m = NULL;
	pthread_mutex_unlock(&sim_import_lock);
	if (m) {
		if (m->fd >= 0)
			close(m->fd);
		free(m);
	}
	return true;
}

/* The file and offset whose bytes a handle's memory is, and its device. */
static bool sim_handle_backing(CUmemGenericAllocationHandle handle, int *fd, uint64_t *off,
			       int *dev)
{
	struct sim_import *m;
	struct sim_heap *h;
	size_t hoff;
	int i;

	h = sim_heap_of(handle, &hoff);
	if (h) {
		*fd = h->fd;
		*off = hoff;
		for (i = 0; i < sim_ndevs; i++)
			if (h == &sim_devs[i].heap)
				*dev = i;
		return true;
	}
	pthread_mutex_lock(&sim_import_lock);
	for (m = sim_import_list; m && (uintptr_t)m != handle; m = m->next)
		;
	if (m) {
		*fd = m->fd;
		*off = m->off;
		*dev = m->dev;
	}
	pthread_mutex_unlock(&sim_import_lock);
	return m != NULL;
}

static CUresult sim_handle_op(CUmemGenericAllocationHandle handle, enum sim_handle_op op,
			      size_t offset, size_t size)
{
	CUresult rc = CUDA_ERROR_INVALID_VALUE;
	struct sim_extent *e;
	struct sim_heap *h;
	size_t off;

	h = sim_heap_of(handle, &off);
	if (!h)
		return sim_import_op(handle, op, offset, size, &rc) ? rc : CUDA_ERROR_INVALID_VALUE;
	pthread_mutex_lock(&h->lock);
	e = sim_heap_find(h, off, SIM_MEM_HANDLE);
	if (!e || ((op == SIM_HANDLE_RELEASE || op == SIM_HANDLE_MAP) && !e->refs))
		goto out;
	switch (op) {
	case SIM_HANDLE_RELEASE:
		e->refs--;
		break;
	case SIM_HANDLE_RETAIN:
		e->refs++;
		break;
	case SIM_HANDLE_MAP:
		if (offset > e->len || size > e->len - offset)
			goto out;
		e->maps++;
		break;
	case SIM_HANDLE_UNMAP:
		e->maps--;
		break;
	}
	rc = CUDA_SUCCESS;
	if (!e->refs && !e->maps)
		sim_heap_drop(h, e);
out:
	pthread_mutex_unlock(&h->lock);
	return rc;
}

CUresult sim_impl_cuMemRelease(CUmemGenericAllocationHandle handle)
{
	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	return sim_handle_op(handle, SIM_HANDLE_RELEASE, 0, 0);
}

/* Address space of size bytes at a multiple of align: at hint if that is free. */
static uintptr_t sim_va_map(size_t size, size_t align, uintptr_t hint)
{
	const int flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
	uintptr_t p, start, end;
	size_t span;
	void *m;

	if (hint && hint % align == 0) {
		/* Without MAP_FIXED the kernel takes hint only if nothing is there. */
		m = mmap((void *)hint, size, PROT_NONE, flags, -1, 0);
		if (m == (void *)hint)
			return hint;
		if (m != MAP_FAILED)
			munmap(m, size);
	}
	if (size > SIZE_MAX - align)
		return 0;
	span = size + align;
	m = mmap(NULL, span, PROT_NONE, flags, -1, 0);
	if (m == MAP_FAILED)
		return 0;
	p = (uintptr_t)m;
	start = (p + align - 1) & ~(uintptr_t)(align - 1);
	end = start + size;
	if (start > p)
		munmap(m, start - p);
	if (p + span > end)
		munmap((void *)end, p + span - end);
	return start;
}

/*
 * Documented: size and addr multiples of the host page size, alignment a
 * power of two or 0 for the default, addr only a hint, flags unused and 0.
 * A reservation always starts on a granule, so that its start can be
 * mapped; only whole granules of it can be.
 */
CUresult sim_impl_cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment,
					CUdeviceptr addr, unsigned long long flags)
{
	size_t page = (size_t)sysconf(_SC_PAGESIZE);
	struct sim_va *v;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!ptr || flags != 0 || size == 0 || size % page != 0 || addr % page != 0)
		return CUDA_ERROR_INVALID_VALUE;
	if (alignment & (alignment - 1))
		return CUDA_ERROR_INVALID_VALUE;
	if (alignment < SIM_GRANULARITY)
		alignment = SIM_GRANULARITY;
	v = calloc(1, sizeof(*v));
	if (!v)
		return CUDA_ERROR_OUT_OF_MEMORY;
	v->base = sim_va_map(size, alignment, (uintptr_t)addr);
	if (!v->base) {
		free(v);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	v->size = size;
	pthread_mutex_lock(&sim_va_lock);
	v->next = sim_va_list;
	sim_va_list = v;
	pthread_mutex_unlock(&sim_va_lock);
	*ptr = v->base;
	return CUDA_SUCCESS;
}

/*
 * Documented: ptr and size exactly as reserved. Freeing a range that still
 * has mappings is not described; it is refused here, since their memory
 * could then never be unmapped.
 */
CUresult sim_impl_cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
	struct sim_va **pp, *v = NULL;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	pthread_mutex_lock(&sim_va_lock);
	for (pp = &sim_va_list; *pp && (*pp)->base != ptr; pp = &(*pp)->next)
		;
	if (*pp && (*pp)->size == size && (*pp)->nmaps == 0) {
		v = *pp;
		*pp = v->next;
	}
	pthread_mutex_unlock(&sim_va_lock);
	if (!v)
		return CUDA_ERROR_INVALID_VALUE;
	munmap((void *)v->base, v->size);
	free(v->maps);
	free(v);
	return CUDA_SUCCESS;
}

/* With sim_va_lock held: the reservation holding [ptr, ptr + size), or NULL. */
static struct sim_va *sim_va_find(CUdeviceptr ptr, size_t size)
{
	struct sim_va *v;

	for (v = sim_va_list; v; v = v->next)
		if (ptr >= v->base && ptr - v->base < v->size &&
		    size <= v->size - (ptr - v->base))
			return v;
	return NULL;
}

/* The first mapping of v at or after off. */
static size_t sim_map_search(const struct sim_va *v, size_t off)
{
	size_t lo = 0, hi = v->nmaps;

	while (lo < hi) {
		size_t mid = lo + (hi - lo) / 2;

		if (v->maps[mid].off < off)
			lo = mid + 1;
		else
			hi = mid;
	}
	return lo;
}

/*
 * With sim_va_lock held: the mappings [*first, *last) of one reservation
 * that, each one whole and with no gap, cover exactly [ptr, ptr + size).
 */
static bool sim_va_whole(CUdeviceptr ptr, size_t size, struct sim_va **pv, size_t *first,
			 size_t *last)
{
	struct sim_va *v = size ? sim_va_find(ptr, size) : NULL;
	size_t off, end, at, i;

	if (!v)
		return false;
	off = (size_t)(ptr - v->base);
	end = off + size;
	at = sim_map_search(v, off);
	for (i = at; i < v->nmaps && off < end && v->maps[i].off == off; i++)
		off += v->maps[i].len;
	if (i == at || off != end)
		return false;
	*pv = v;
	*first = at;
	*last = i;
	return true;
}

/*
 * Documented: ptr, size and offset multiples of the granularity, the range
 * inside one reservation and not mapped already, offset + size within the
 * allocation, flags 0. The mapping holds the allocation until it is
 * unmapped, whatever becomes of the handle.
 */
CUresult sim_impl_cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
			     CUmemGenericAllocationHandle handle, unsigned long long flags)
{
	CUresult rc = CUDA_ERROR_INVALID_VALUE;
	struct sim_map *m;
	struct sim_va *v;
	size_t off, at;
	uint64_t hoff;
	int fd, dev;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (flags != 0 || size == 0 || ptr % SIM_GRANULARITY != 0 ||
	    size % SIM_GRANULARITY != 0 || offset % SIM_GRANULARITY != 0)
		return rc;
	pthread_mutex_lock(&sim_va_lock);
	v = sim_va_find(ptr, size);
	if (!v)
		goto out;
	off = (size_t)(ptr - v->base);
	at = sim_map_search(v, off);
	if ((at > 0 && v->maps[at - 1].off + v->maps[at - 1].len > off) ||
	    (at < v->nmaps && v->maps[at].off < off + size))
		goto out;
	if (v->nmaps == v->cap) {
		size_t cap = v->cap ? v->cap * 2 : 8;

		m = realloc(v->maps, cap * sizeof(*m));
		if (!m) {
			rc = CUDA_ERROR_OUT_OF_MEMORY;
			goto out;
		}
		v->maps = m;
		v->cap = cap;
	}
	rc = sim_handle_op(handle, SIM_HANDLE_MAP, offset, size);
	if (rc != CUDA_SUCCESS)
		goto out;
	/* The handle's own bytes, so that both addresses see the same memory. */
	sim_handle_backing(handle, &fd, &hoff, &dev);
	if (fd < 0) {
		/* A forked child's private memory cannot be mapped twice. */
		sim_handle_op(handle, SIM_HANDLE_UNMAP, 0, 0);
		rc = CUDA_ERROR_NOT_SUPPORTED;
		goto out;
	}
	if (mmap((void *)ptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd,
		 (off_t)(hoff + offset)) == MAP_FAILED) {
		sim_handle_op(handle, SIM_HANDLE_UNMAP, 0, 0);
		rc = CUDA_ERROR_OUT_OF_MEMORY;
		goto out;
	}
	m = &v->maps[at];
	memmove(m + 1, m, (v->nmaps - at) * sizeof(*m));
	m->off = off;
	m->len = size;
	m->handle = handle;
	m->hoff = offset;
	v->nmaps++;
out:
	pthread_mutex_unlock(&sim_va_lock);
	return rc;
}

/*
 * Documented: the range must be whole mappings, never part of one; it may
 * span several adjacent ones. Each unmapped may be the last hold on its
 * allocation's memory. Afterwards the range is a plain reservation again.
 */
CUresult sim_impl_cuMemUnmap(CUdeviceptr ptr, size_t size)
{
	size_t first, last, i;
	struct sim_va *v;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	pthread_mutex_lock(&sim_va_lock);
	if (!sim_va_whole(ptr, size, &v, &first, &last)) {
		pthread_mutex_unlock(&sim_va_lock);
		return CUDA_ERROR_INVALID_VALUE;
	}
	/* Back to reserved address space that holds nothing. */
	mmap((void *)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED,
	     -1, 0);
	for (i = first; i < last; i++)
		sim_handle_op(v->maps[i].handle, SIM_HANDLE_UNMAP, 0, 0);
	memmove(&v->maps[first], &v->maps[last], (v->nmaps - last) * sizeof(*v->maps));
	v->nmaps -= last - first;
	pthread_mutex_unlock(&sim_va_lock);
	return CUDA_SUCCESS;
}

/*
 * Nothing dereferences device memory, so access is checked and never
 * enforced. Documented: the range is fully mapped and holds whole
 * allocations' mappings. Only device locations exist in the simulation.
 */
CUresult sim_impl_cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc,
				   size_t count)
{
	size_t i, first, last;
	struct sim_va *v;
	bool whole;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!desc || count == 0)
		return CUDA_ERROR_INVALID_VALUE;
	for (i = 0; i < count; i++) {
		if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE)
			return CUDA_ERROR_INVALID_VALUE;
		if (!sim_valid_dev(desc[i].location.id))
			return CUDA_ERROR_INVALID_DEVICE;
		if (desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_NONE &&
		    desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READ &&
		    desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
			return CUDA_ERROR_INVALID_VALUE;
	}
	pthread_mutex_lock(&sim_va_lock);
	whole = sim_va_whole(ptr, size, &v, &first, &last);
	pthread_mutex_unlock(&sim_va_lock);
	return whole ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/*
 * Documented: addr may be any address inside a mapping; the handle is the
 * very value that was mapped there, and each retain takes a reference that
 * needs its own cuMemRelease.
 */
CUresult sim_impl_cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle,
						void *addr)
{
	CUresult rc = CUDA_ERROR_INVALID_VALUE;
	const struct sim_map *m;
	struct sim_va *v;
	size_t off, at;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!handle)
		return rc;
	pthread_mutex_lock(&sim_va_lock);
	v = sim_va_find((uintptr_t)addr, 1);
	if (v) {
		off = (size_t)((uintptr_t)addr - v->base);
		at = sim_map_search(v, off + 1);
		m = at ? &v->maps[at - 1] : NULL;
		if (m && off - m->off < m->len) {
			rc = sim_handle_op(m->handle, SIM_HANDLE_RETAIN, 0, 0);
			if (rc == CUDA_SUCCESS)
				*handle = m->handle;
		}
	}
	pthread_mutex_unlock(&sim_va_lock);
	return rc;
}

/*
 * Arrays: opaque layouts on a real GPU; here their storage is the plain
 * product of the extents and the element size, taken from the current
 * context's device. Descriptors follow the documented rules: (W,0,0) is 1D,
 * (W,H,0) 2D, (W,H,D) 3D, and (W,0,D) only as a layered 1D array.
 */
#define SIM_ARRAY3D_LAYERED 0x01

/*
 * Bytes of an array with levels mip levels (1 for a plain array), each
 * extent halving per level down to 1; the layer count of a layered array
 * does not halve. CUDA_ERROR_INVALID_VALUE for a bad descriptor, and
 * CUDA_ERROR_OUT_OF_MEMORY when the size overflows.
 */
static CUresult sim_array_bytes(const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned int levels,
				size_t *out)
{
	bool layered = d->Flags & SIM_ARRAY3D_LAYERED;
	size_t elem = gs_array_format_bytes(d->Format) * d->NumChannels;
	size_t w = d->Width, h = d->Height ? d->Height : 1, depth = d->Depth ? d->Depth : 1;
	size_t largest = w > h ? w : h, total = 0;
	unsigned int l;

	if (d->Width == 0 || elem == 0 || (d->NumChannels != 1 && d->NumChannels != 2 &&
					   d->NumChannels != 4))
		return CUDA_ERROR_INVALID_VALUE;
	if (d->Height == 0 && d->Depth != 0 && !layered)
		return CUDA_ERROR_INVALID_VALUE;
	if (!layered && depth > largest)
		largest = depth;
	/* A level below 1x1x1 does not exist: at most 1 + floor(log2(largest)). */
	if (levels == 0 || levels > (unsigned int)(64 - __builtin_clzll(largest)))
		return CUDA_ERROR_INVALID_VALUE;
	for (l = 0; l < levels; l++) {
		size_t lw = w >> l ? w >> l : 1;
		size_t lh = h >> l ? h >> l : 1;
		size_t ld = layered ? depth : (depth >> l ? depth >> l : 1);
		size_t bytes;

		if (__builtin_mul_overflow(lw, lh, &bytes) ||
		    __builtin_mul_overflow(bytes, ld, &bytes) ||
		    __builtin_mul_overflow(bytes, elem, &bytes) ||
		    __builtin_add_overflow(total, bytes, &total))
			return CUDA_ERROR_OUT_OF_MEMORY;
	}
	*out = total;
	return CUDA_SUCCESS;
}

/*
 * An array's storage and its handle are made, and destroyed, together under
 * sim_obj_lock, so a context's teardown never finds one without the other.
 */
static CUresult sim_array_new(void **handle, const CUDA_ARRAY3D_DESCRIPTOR *desc,
			      unsigned int levels, enum sim_obj_kind kind)
{
	const struct sim_ctx_slot *cur;
	struct sim_obj *o;
	size_t bytes;
	CUresult rc;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!handle || !desc)
		return CUDA_ERROR_INVALID_VALUE;
	rc = sim_array_bytes(desc, levels, &bytes);
	if (rc != CUDA_SUCCESS)
		return rc;
	cur = sim_current();
	if (!cur)
		return CUDA_ERROR_INVALID_CONTEXT;
	o = calloc(1, sizeof(*o));
	if (!o)
		return CUDA_ERROR_OUT_OF_MEMORY;
	o->kind = kind;
	o->dev = cur->dev;
	o->owner = cur->id;
	pthread_mutex_lock(&sim_obj_lock);
	rc = sim_heap_alloc(&sim_devs[o->dev], bytes, SIM_MEM_ARRAY, o->owner, &o->addr);
	if (rc == CUDA_SUCCESS) {
		o->next = sim_obj_list;
		sim_obj_list = o;
	}
	pthread_mutex_unlock(&sim_obj_lock);
	if (rc != CUDA_SUCCESS) {
		free(o);
		return rc;
	}
	*handle = o;
	return CUDA_SUCCESS;
}

static CUresult sim_array_destroy(const void *handle, enum sim_obj_kind kind)
{
	struct sim_obj **pp, *o = NULL;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	pthread_mutex_lock(&sim_obj_lock);
	pp = sim_obj_find(handle, kind);
	if (pp) {
		o = *pp;
		*pp = o->next;
		sim_mem_free(o->addr, SIM_MEM_ARRAY);
	}
	pthread_mutex_unlock(&sim_obj_lock);
	if (!o)
		return CUDA_ERROR_INVALID_HANDLE;
	free(o);
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuArrayCreate_v2(CUarray *array, const CUDA_ARRAY_DESCRIPTOR *desc)
{
	CUDA_ARRAY3D_DESCRIPTOR d3 = { 0 };
	void *handle = NULL;
	CUresult rc;

	if (desc) {
		d3.Width = desc->Width;
		d3.Height = desc->Height;
		d3.Format = desc->Format;
		d3.NumChannels = desc->NumChannels;
	}
	rc = sim_array_new(array ? &handle : NULL, desc ? &d3 : NULL, 1, SIM_OBJ_ARRAY);
	if (rc == CUDA_SUCCESS)
		*array = handle;
	return rc;
}

CUresult sim_impl_cuArray3DCreate_v2(CUarray *array, const CUDA_ARRAY3D_DESCRIPTOR *desc)
{
	void *handle = NULL;
	CUresult rc = sim_array_new(array ? &handle : NULL, desc, 1, SIM_OBJ_ARRAY);

	if (rc == CUDA_SUCCESS)
		*array = handle;
	return rc;
}

CUresult sim_impl_cuArrayDestroy(CUarray array)
{
	return sim_array_destroy(array, SIM_OBJ_ARRAY);
}

CUresult sim_impl_cuMipmappedArrayCreate(CUmipmappedArray *array,
					   const CUDA_ARRAY3D_DESCRIPTOR *desc,
					   unsigned int levels)
{
	void *handle = NULL;
	CUresult rc = sim_array_new(array ? &handle : NULL, desc, levels, SIM_OBJ_MIPMAP);

	if (rc == CUDA_SUCCESS)
		*array = handle;
	return rc;
}

CUresult sim_impl_cuMipmappedArrayDestroy(CUmipmappedArray array)
{
	return sim_array_destroy(array, SIM_OBJ_MIPMAP);
}

/* Host memory: page-locked allocations and registrations, by range. */
struct sim_host {
	struct sim_host *next;
	uintptr_t base;
	size_t size;
	unsigned int flags;
	bool registered;	/* cuMemHostRegister: the caller's memory, not ours */
};

static pthread_mutex_t sim_host_lock = PTHREAD_MUTEX_INITIALIZER;
static struct sim_host *sim_host_list;

/* Device memory of another process, opened through an IPC handle. */
struct sim_ipc {
	struct sim_ipc *next;
	uintptr_t map;		/* the pages mapped */
	size_t maplen;
	uintptr_t ptr;		/* what the caller got: the allocation's start */
	size_t size;
	int dev;
	pid_t pid;		/* the exporter and its allocation, for reopening */
	int fd;			/* the exporter's descriptor of its memfd */
	int spec_index;
	uint64_t off;
	unsigned int refs;
};

static pthread_mutex_t sim_ipc_lock = PTHREAD_MUTEX_INITIALIZER;
static struct sim_ipc *sim_ipc_list;

/* What a pointer is, as cuPointerGetAttribute describes it. */
struct sim_ptr {
	int type;		/* CU_MEMORYTYPE_DEVICE or _HOST */
	int dev;		/* its device; the current one for host memory */
	uintptr_t base;		/* the allocation holding it */
	size_t size;
	uint64_t owner;		/* the context it belongs to, or 0 */
	CUmemoryPool pool;
	bool ipc;		/* a whole cuMemAlloc allocation, fit for cuIpcGetMemHandle */
};

/* With h locked: the live extent holding off, or NULL. */
static struct sim_extent *sim_heap_holding(struct sim_heap *h, size_t off)
{
	size_t at = sim_ext_search(h->live, h->nlive, off + 1);
	struct sim_extent *e = at ? &h->live[at - 1] : NULL;

	return e && off - e->off < e->len ? e : NULL;
}

static bool sim_ptr_find(uintptr_t p, struct sim_ptr *out)
{
	struct sim_heap *h;
	struct sim_va *v;
	struct sim_host *hm;
	struct sim_ipc *m;
	size_t off;
	int i;

	memset(out, 0, sizeof(*out));
	h = sim_heap_of(p, &off);
	if (h) {
		struct sim_extent *e;

		pthread_mutex_lock(&h->lock);
		e = sim_heap_holding(h, off);
		if (e) {
			out->type = CU_MEMORYTYPE_DEVICE;
			out->base = h->base + e->off;
			out->size = e->len;
			out->owner = e->owner;
			out->pool = e->pool;
			out->ipc = e->kind == SIM_MEM_PTR && !e->pool;
		}
		pthread_mutex_unlock(&h->lock);
		for (i = 0; i < sim_ndevs; i++)
			if (h == &sim_devs[i].heap)
				out->dev = i;
		return out->type != 0;
	}
	pthread_mutex_lock(&sim_va_lock);
	v = sim_va_find(p, 1);
	if (v) {
		size_t at = sim_map_search(v, p - v->base + 1);
		const struct sim_map *mp = at ? &v->maps[at - 1] : NULL;

		if (mp && p - v->base - mp->off < mp->len) {
			uint64_t hoff;
			int fd;

			out->type = CU_MEMORYTYPE_DEVICE;
			out->base = v->base + mp->off;
			out->size = mp->len;
			sim_handle_backing(mp->handle, &fd, &hoff, &out->dev);
		}
	}
	pthread_mutex_unlock(&sim_va_lock);
	if (out->type)
		return true;
	pthread_mutex_lock(&sim_ipc_lock);
	for (m = sim_ipc_list; m; m = m->next) {
		if (p >= m->ptr && p - m->ptr < m->size) {
			out->type = CU_MEMORYTYPE_DEVICE;
			out->base = m->ptr;
			out->size = m->size;
			out->dev = m->dev;
			break;
		}
	}
	pthread_mutex_unlock(&sim_ipc_lock);
	if (out->type)
		return true;
	pthread_mutex_lock(&sim_host_lock);
	for (hm = sim_host_list; hm; hm = hm->next) {
		if (p >= hm->base && p - hm->base < hm->size) {
			out->type = CU_MEMORYTYPE_HOST;
			out->base = hm->base;
			out->size = hm->size;
			out->dev = sim_depth ? sim_current_dev() : 0;
			break;
		}
	}
	pthread_mutex_unlock(&sim_host_lock);
	return out->type != 0;
}

/* Whether [p, p + n) lies in adjacent mappings of one reservation. */
static bool sim_va_covers(uintptr_t p, size_t n)
{
	struct sim_va *v;
	size_t off, end, at;
	bool covered = false;

	pthread_mutex_lock(&sim_va_lock);
	v = sim_va_find(p, n);
	if (v) {
		off = p - v->base;
		end = off + n;
		at = sim_map_search(v, off + 1);
		if (at && off - v->maps[at - 1].off < v->maps[at - 1].len) {
			for (at--; at < v->nmaps && v->maps[at].off <= off && off < end; at++)
				off = v->maps[at].off + v->maps[at].len;
			covered = off >= end;
		}
	}
	pthread_mutex_unlock(&sim_va_lock);
	return covered;
}

/*
 * Whether [p, p + n) lies in one allocation the driver knows, or in mapped
 * memory of one reservation (expandable segments map many handles side by
 * side, and copies run across them).
 */
static bool sim_range_known(uintptr_t p, size_t n)
{
	struct sim_ptr info;

	if (!p || !sim_ptr_find(p, &info))
		return false;
	return n <= info.size - (p - info.base) || sim_va_covers(p, n);
}

/* Copies. Device sides must lie in device (or page-locked) memory. */

static CUresult sim_copy(uintptr_t dst, uintptr_t src, size_t n, bool dst_dev, bool src_dev,
			 CUstream stream)
{
	struct sim_op op = { .kind = SIM_OP_COPY, .dst = dst, .src = src, .width = n,
			     .height = 1 };

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (n == 0)
		return CUDA_SUCCESS;
	if (!dst || !src || (dst_dev && !sim_range_known(dst, n)) ||
	    (src_dev && !sim_range_known(src, n)))
		return CUDA_ERROR_INVALID_VALUE;
	return sim_stream_do(stream, &op);
}

CUresult sim_impl_cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n)
{
	return sim_copy(dst, src, n, false, false, NULL);
}

CUresult sim_impl_cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream stream)
{
	return sim_copy(dst, src, n, false, false, stream);
}

CUresult sim_impl_cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n)
{
	return sim_copy(dst, (uintptr_t)src, n, true, false, NULL);
}

CUresult sim_impl_cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n,
				       CUstream stream)
{
	return sim_copy(dst, (uintptr_t)src, n, true, false, stream);
}

CUresult sim_impl_cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n)
{
	return sim_copy((uintptr_t)dst, src, n, false, true, NULL);
}

CUresult sim_impl_cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream stream)
{
	return sim_copy((uintptr_t)dst, src, n, false, true, stream);
}

CUresult sim_impl_cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n)
{
	return sim_copy(dst, src, n, true, true, NULL);
}

CUresult sim_impl_cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n,
				       CUstream stream)
{
	return sim_copy(dst, src, n, true, true, stream);
}

/* Every device shares one address space here, so a peer copy is a copy. */
CUresult sim_impl_cuMemcpyPeer(CUdeviceptr dst, CUcontext dctx, CUdeviceptr src, CUcontext sctx,
			       size_t n)
{
	(void)dctx, (void)sctx;
	return sim_copy(dst, src, n, true, true, NULL);
}

CUresult sim_impl_cuMemcpyPeerAsync(CUdeviceptr dst, CUcontext dctx, CUdeviceptr src,
				    CUcontext sctx, size_t n, CUstream stream)
{
	(void)dctx, (void)sctx;
	return sim_copy(dst, src, n, true, true, stream);
}

/*
 * One side of one slice of a 2D/3D copy: its first byte, checked with the
 * rows it spans. Device memory must lie in one allocation (or adjacent
 * mappings) the driver handed out; unified addresses the driver knows are
 * checked the same way, others are pageable host memory, which no driver
 * can check. Arrays are not supported.
 */
static CUresult sim_copy_side(int type, const void *host, CUdeviceptr dev, size_t x, size_t y,
			      size_t z, size_t pitch, size_t height, size_t width, size_t rows,
			      uintptr_t *out)
{
	size_t off, extent;
	struct sim_ptr info;
	uintptr_t base;

	switch (type) {
	case CU_MEMORYTYPE_HOST:
		base = (uintptr_t)host;
		break;
	case CU_MEMORYTYPE_DEVICE:
	case CU_MEMORYTYPE_UNIFIED:
		base = dev;
		break;
	case CU_MEMORYTYPE_ARRAY:
		return CUDA_ERROR_NOT_SUPPORTED;
	default:
		return CUDA_ERROR_INVALID_VALUE;
	}
	if (!base || __builtin_mul_overflow(z, height, &off) || __builtin_add_overflow(off, y, &off) ||
	    __builtin_mul_overflow(off, pitch, &off) || __builtin_add_overflow(off, x, &off) ||
	    __builtin_add_overflow(base, off, out) ||
	    __builtin_mul_overflow(rows - 1, pitch, &extent) ||
	    __builtin_add_overflow(extent, width, &extent))
		return CUDA_ERROR_INVALID_VALUE;
	if (type == CU_MEMORYTYPE_HOST || (type == CU_MEMORYTYPE_UNIFIED && !sim_ptr_find(*out, &info)))
		return CUDA_SUCCESS;
	return sim_range_known(*out, extent) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

static CUresult sim_copy3d(const CUDA_MEMCPY3D *p, CUstream stream)
{
	struct sim_op op = { .kind = SIM_OP_COPY };
	uintptr_t dst, src;
	size_t z, depth;
	CUresult rc;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!p)
		return CUDA_ERROR_INVALID_VALUE;
	if (p->WidthInBytes == 0 || p->Height == 0)
		return CUDA_SUCCESS;
	depth = p->Depth ? p->Depth : 1;
	if ((p->srcMemoryType != CU_MEMORYTYPE_ARRAY && p->srcPitch < p->WidthInBytes + p->srcXInBytes) ||
	    (p->dstMemoryType != CU_MEMORYTYPE_ARRAY && p->dstPitch < p->WidthInBytes + p->dstXInBytes))
		return CUDA_ERROR_INVALID_VALUE;
	for (z = 0; z < depth; z++) {
		rc = sim_copy_side(p->srcMemoryType, p->srcHost, p->srcDevice, p->srcXInBytes,
				   p->srcY, p->srcZ + z, p->srcPitch, p->srcHeight, p->WidthInBytes,
				   p->Height, &src);
		if (rc == CUDA_SUCCESS)
			rc = sim_copy_side(p->dstMemoryType, p->dstHost, p->dstDevice,
					   p->dstXInBytes, p->dstY, p->dstZ + z, p->dstPitch,
					   p->dstHeight, p->WidthInBytes, p->Height, &dst);
		if (rc != CUDA_SUCCESS)
			return rc;
		op.dst = dst;
		op.src = src;
		op.width = p->WidthInBytes;
		op.height = p->Height;
		op.dpitch = p->dstPitch;
		op.spitch = p->srcPitch;
		rc = sim_stream_do(stream, &op);
		if (rc != CUDA_SUCCESS)
			return rc;
	}
	return CUDA_SUCCESS;
}

static CUresult sim_copy2d(const CUDA_MEMCPY2D *p, CUstream stream)
{
	CUDA_MEMCPY3D q;

	if (!p)
		return CUDA_ERROR_INVALID_VALUE;
	memset(&q, 0, sizeof(q));
	q.srcXInBytes = p->srcXInBytes;
	q.srcY = p->srcY;
	q.srcMemoryType = p->srcMemoryType;
	q.srcHost = p->srcHost;
	q.srcDevice = p->srcDevice;
	q.srcArray = p->srcArray;
	q.srcPitch = p->srcPitch;
	q.dstXInBytes = p->dstXInBytes;
	q.dstY = p->dstY;
	q.dstMemoryType = p->dstMemoryType;
	q.dstHost = p->dstHost;
	q.dstDevice = p->dstDevice;
	q.dstArray = p->dstArray;
	q.dstPitch = p->dstPitch;
	q.WidthInBytes = p->WidthInBytes;
	q.Height = p->Height;
	q.Depth = 1;
	return sim_copy3d(&q, stream);
}

CUresult sim_impl_cuMemcpy2D_v2(const CUDA_MEMCPY2D *p)
{
	return sim_copy2d(p, NULL);
}

CUresult sim_impl_cuMemcpy2DUnaligned_v2(const CUDA_MEMCPY2D *p)
{
	return sim_copy2d(p, NULL);
}

CUresult sim_impl_cuMemcpy2DAsync_v2(const CUDA_MEMCPY2D *p, CUstream stream)
{
	return sim_copy2d(p, stream);
}

CUresult sim_impl_cuMemcpy3D_v2(const CUDA_MEMCPY3D *p)
{
	return sim_copy3d(p, NULL);
}

CUresult sim_impl_cuMemcpy3DAsync_v2(const CUDA_MEMCPY3D *p, CUstream stream)
{
	return sim_copy3d(p, stream);
}

/* Memsets: width elements of elem bytes in each of height rows pitch apart. */
static CUresult sim_memset(CUdeviceptr dst, size_t pitch, uint32_t value, unsigned int elem,
			   size_t width, size_t height, CUstream stream)
{
	struct sim_op op = { .kind = SIM_OP_SET, .dst = dst, .width = width, .height = height,
			     .dpitch = pitch, .value = value, .elem = elem };
	size_t row, extent;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (width == 0 || height == 0)
		return CUDA_SUCCESS;
	if (__builtin_mul_overflow(width, elem, &row) ||
	    __builtin_mul_overflow(height - 1, pitch, &extent) ||
	    __builtin_add_overflow(extent, row, &extent))
		return CUDA_ERROR_INVALID_VALUE;
	if (dst % elem || pitch < row || !sim_range_known(dst, extent))
		return CUDA_ERROR_INVALID_VALUE;
	return sim_stream_do(stream, &op);
}

CUresult sim_impl_cuMemsetD8_v2(CUdeviceptr dst, unsigned char v, size_t n)
{
	return sim_memset(dst, n, v, 1, n, 1, NULL);
}

CUresult sim_impl_cuMemsetD16_v2(CUdeviceptr dst, unsigned short v, size_t n)
{
	return sim_memset(dst, n * 2, v, 2, n, 1, NULL);
}

CUresult sim_impl_cuMemsetD32_v2(CUdeviceptr dst, unsigned int v, size_t n)
{
	return sim_memset(dst, n * 4, v, 4, n, 1, NULL);
}

CUresult sim_impl_cuMemsetD8Async(CUdeviceptr dst, unsigned char v, size_t n, CUstream s)
{
	return sim_memset(dst, n, v, 1, n, 1, s);
}

CUresult sim_impl_cuMemsetD16Async(CUdeviceptr dst, unsigned short v, size_t n, CUstream s)
{
	return sim_memset(dst, n * 2, v, 2, n, 1, s);
}

CUresult sim_impl_cuMemsetD32Async(CUdeviceptr dst, unsigned int v, size_t n, CUstream s)
{
	return sim_memset(dst, n * 4, v, 4, n, 1, s);
}

CUresult sim_impl_cuMemsetD2D8_v2(CUdeviceptr dst, size_t pitch, unsigned char v, size_t w,
				  size_t h)
{
	return sim_memset(dst, pitch, v, 1, w, h, NULL);
}

CUresult sim_impl_cuMemsetD2D16_v2(CUdeviceptr dst, size_t pitch, unsigned short v, size_t w,
				   size_t h)
{
	return sim_memset(dst, pitch, v, 2, w, h, NULL);
}

CUresult sim_impl_cuMemsetD2D32_v2(CUdeviceptr dst, size_t pitch, unsigned int v, size_t w,
				   size_t h)
{
	return sim_memset(dst, pitch, v, 4, w, h, NULL);
}

CUresult sim_impl_cuMemsetD2D8Async(CUdeviceptr dst, size_t pitch, unsigned char v, size_t w,
				    size_t h, CUstream s)
{
	return sim_memset(dst, pitch, v, 1, w, h, s);
}

CUresult sim_impl_cuMemsetD2D16Async(CUdeviceptr dst, size_t pitch, unsigned short v,
				     size_t w, size_t h, CUstream s)
{
	return sim_memset(dst, pitch, v, 2, w, h, s);
}

CUresult sim_impl_cuMemsetD2D32Async(CUdeviceptr dst, size_t pitch, unsigned int v, size_t w,
				     size_t h, CUstream s)
{
	return sim_memset(dst, pitch, v, 4, w, h, s);
}

/* Host memory. */

static CUresult sim_host_add(uintptr_t base, size_t size, unsigned int flags, bool registered)
{
	struct sim_host *hm = calloc(1, sizeof(*hm));

	if (!hm)
		return CUDA_ERROR_OUT_OF_MEMORY;
	hm->base = base;
	hm->size = size;
	hm->flags = flags;
	hm->registered = registered;
	pthread_mutex_lock(&sim_host_lock);
	hm->next = sim_host_list;
	sim_host_list = hm;
	pthread_mutex_unlock(&sim_host_lock);
	return CUDA_SUCCESS;
}

/* The record that starts at base, unlinked; NULL if there is none of that kind. */
static struct sim_host *sim_host_take(uintptr_t base, bool registered)
{
	struct sim_host **pp, *hm;

	pthread_mutex_lock(&sim_host_lock);
	for (pp = &sim_host_list; *pp && ((*pp)->base != base || (*pp)->registered != registered);
	     pp = &(*pp)->next)
		;
	hm = *pp;
	if (hm)
		*pp = hm->next;
	pthread_mutex_unlock(&sim_host_lock);
	return hm;
}

CUresult sim_impl_cuMemHostAlloc(void **pp, size_t size, unsigned int flags)
{
	void *p;
	CUresult rc;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!pp || size == 0 || flags > 0x7)
		return CUDA_ERROR_INVALID_VALUE;
	if (!sim_depth)
		return CUDA_ERROR_INVALID_CONTEXT;
	p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (p == MAP_FAILED)
		return CUDA_ERROR_OUT_OF_MEMORY;
	rc = sim_host_add((uintptr_t)p, size, flags, false);
	if (rc != CUDA_SUCCESS) {
		munmap(p, size);
		return rc;
	}
	*pp = p;
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuMemAllocHost_v2(void **pp, size_t size)
{
	return sim_impl_cuMemHostAlloc(pp, size, 0);
}

CUresult sim_impl_cuMemFreeHost(void *p)
{
	struct sim_host *hm;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	hm = sim_host_take((uintptr_t)p, false);
	if (!hm)
		return CUDA_ERROR_INVALID_VALUE;
	munmap((void *)hm->base, hm->size);
	free(hm);
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuMemHostRegister_v2(void *p, size_t size, unsigned int flags)
{
	struct sim_ptr info;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!p || size == 0)
		return CUDA_ERROR_INVALID_VALUE;
	if (!sim_depth)
		return CUDA_ERROR_INVALID_CONTEXT;
	/* CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED */
	if (sim_ptr_find((uintptr_t)p, &info))
		return 712;
	return sim_host_add((uintptr_t)p, size, flags, true);
}

CUresult sim_impl_cuMemHostUnregister(void *p)
{
	struct sim_host *hm;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	hm = sim_host_take((uintptr_t)p, true);
	/* CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED */
	if (!hm)
		return 713;
	free(hm);
	return CUDA_SUCCESS;
}

/* Host and device share one address space: the device sees the same address. */
CUresult sim_impl_cuMemHostGetDevicePointer_v2(CUdeviceptr *pd, void *p, unsigned int flags)
{
	struct sim_ptr info;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!pd || flags != 0 || !sim_ptr_find((uintptr_t)p, &info) ||
	    info.type != CU_MEMORYTYPE_HOST)
		return CUDA_ERROR_INVALID_VALUE;
	*pd = (CUdeviceptr)(uintptr_t)p;
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuMemHostGetFlags(unsigned int *flags, void *p)
{
	struct sim_host *hm;
	CUresult rc = CUDA_ERROR_INVALID_VALUE;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!flags)
		return rc;
	pthread_mutex_lock(&sim_host_lock);
	for (hm = sim_host_list; hm; hm = hm->next) {
		if ((uintptr_t)p >= hm->base && (uintptr_t)p - hm->base < hm->size) {
			*flags = hm->flags;
			rc = CUDA_SUCCESS;
			break;
		}
	}
	pthread_mutex_unlock(&sim_host_lock);
	return rc;
}

/* Pointer queries. */

CUresult sim_impl_cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p)
{
	struct sim_ptr info;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!sim_ptr_find(p, &info) || info.type != CU_MEMORYTYPE_DEVICE)
		return CUDA_ERROR_NOT_FOUND;
	if (base)
		*base = info.base;
	if (size)
		*size = info.size;
	return CUDA_SUCCESS;
}

/* The context a device pointer belongs to: its owner, else its device's primary. */
static CUcontext sim_ptr_ctx(const struct sim_ptr *info)
{
	struct CUctx_st *c;

	if (info->owner > SIM_MAX_GPUS) {
		pthread_mutex_lock(&sim_ctx_lock);
		for (c = sim_ctx_list; c && c->id != info->owner; c = c->next)
			;
		pthread_mutex_unlock(&sim_ctx_lock);
		if (c)
			return c;
	}
	return &sim_devs[info->dev].primary;
}

/*
 * One attribute of a known pointer into data, at its documented width. The
 * "booleans" of the C API are ints: cudart hands 4 bytes for IS_MANAGED.
 */
static CUresult sim_ptr_attr(void *data, int attr, uintptr_t p, const struct sim_ptr *info)
{
	switch (attr) {
	case CU_POINTER_ATTRIBUTE_CONTEXT:
		*(CUcontext *)data = sim_ptr_ctx(info);
		break;
	case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
		*(unsigned int *)data = (unsigned int)info->type;
		break;
	case CU_POINTER_ATTRIBUTE_DEVICE_POINTER:
	case CU_POINTER_ATTRIBUTE_HOST_POINTER:
		*(uintptr_t *)data = p;
		break;
	case CU_POINTER_ATTRIBUTE_SYNC_MEMOPS:
	case CU_POINTER_ATTRIBUTE_IS_MANAGED:
	case CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE:
		*(int *)data = 0;
		break;
	case CU_POINTER_ATTRIBUTE_MAPPED:
		*(int *)data = 1;
		break;
	case CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE:
		*(int *)data = info->ipc;
		break;
	case CU_POINTER_ATTRIBUTE_BUFFER_ID:
	case CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID:
		*(unsigned long long *)data = info->base;
		break;
	case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
		*(int *)data = info->dev;
		break;
	case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
	case CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR:
		*(uintptr_t *)data = info->base;
		break;
	case CU_POINTER_ATTRIBUTE_RANGE_SIZE:
	case CU_POINTER_ATTRIBUTE_MAPPING_SIZE:
		*(size_t *)data = info->size;
		break;
	case CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES:
		*(unsigned long long *)data = 0;
		break;
	case CU_POINTER_ATTRIBUTE_ACCESS_FLAGS:
		*(int *)data = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
		break;
	case CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE:
		*(CUmemoryPool *)data = info->pool;
		break;
	default:
		return CUDA_ERROR_INVALID_VALUE;
	}
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuPointerGetAttribute(void *data, int attr, CUdeviceptr p)
{
	struct sim_ptr info;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!data || !sim_ptr_find(p, &info))
		return CUDA_ERROR_INVALID_VALUE;
	return sim_ptr_attr(data, attr, p, &info);
}

/*
 * Unlike the singular query, memory the driver does not know (pageable host
 * memory) is no error here: its type is 0 and the other answers zero.
 */
CUresult sim_impl_cuPointerGetAttributes(unsigned int n, int *attrs, void **data, CUdeviceptr p)
{
	struct sim_ptr info;
	unsigned int i;
	bool known;
	CUresult rc;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!attrs || !data)
		return CUDA_ERROR_INVALID_VALUE;
	known = sim_ptr_find(p, &info);
	for (i = 0; i < n; i++) {
		if (!data[i])
			continue;
		if (!known) {
			switch (attrs[i]) {
			case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
				*(int *)data[i] = -2;
				continue;
			case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
			case CU_POINTER_ATTRIBUTE_ACCESS_FLAGS:
				*(unsigned int *)data[i] = 0;
				continue;
			case CU_POINTER_ATTRIBUTE_SYNC_MEMOPS:
			case CU_POINTER_ATTRIBUTE_IS_MANAGED:
			case CU_POINTER_ATTRIBUTE_MAPPED:
			case CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE:
			case CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE:
				*(int *)data[i] = 0;
				continue;
			default:
				*(uintptr_t *)data[i] = 0;
				continue;
			}
		}
		rc = sim_ptr_attr(data[i], attrs[i], p, &info);
		if (rc != CUDA_SUCCESS)
			return rc;
	}
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuPointerSetAttribute(const void *value, int attr, CUdeviceptr p)
{
	struct sim_ptr info;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!value || attr != CU_POINTER_ATTRIBUTE_SYNC_MEMOPS || !sim_ptr_find(p, &info))
		return CUDA_ERROR_INVALID_VALUE;
	return CUDA_SUCCESS;
}

/* Managed memory never migrates here: advice and prefetches are checked, then done. */
static CUresult sim_managed_range(CUdeviceptr p, size_t n)
{
	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	return sim_range_known(p, n) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult sim_impl_cuMemAdvise(CUdeviceptr p, size_t n, int advice, CUdevice dev)
{
	(void)advice, (void)dev;
	return sim_managed_range(p, n);
}

CUresult sim_impl_cuMemAdvise_v2(CUdeviceptr p, size_t n, int advice, CUmemLocation loc)
{
	(void)advice, (void)loc;
	return sim_managed_range(p, n);
}

CUresult sim_impl_cuMemPrefetchAsync(CUdeviceptr p, size_t n, CUdevice dev, CUstream s)
{
	(void)dev, (void)s;
	return sim_managed_range(p, n);
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

CUresult sim_impl_cuMemPoolSetAttribute(CUmemoryPool pool, int attr, void *value)
{
	struct sim_heap *h;
	CUresult rc = CUDA_SUCCESS;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!value || !(h = sim_pool_lock(pool)))
		return CUDA_ERROR_INVALID_VALUE;
	switch (attr) {
	case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES:
	case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC:
	case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES:
		pool->reuse[attr - 1] = *(int *)value;
		break;
	case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD:
		pool->threshold = *(uint64_t *)value;
		break;
	/* The high-water marks can only be reset, to 0, which restarts them at current. */
	case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH:
		if (*(uint64_t *)value)
			rc = CUDA_ERROR_INVALID_VALUE;
		else
			pool->reserved_high = pool->reserved;
		break;
	case CU_MEMPOOL_ATTR_USED_MEM_HIGH:
		if (*(uint64_t *)value)
			rc = CUDA_ERROR_INVALID_VALUE;
		else
			pool->used_high = pool->used;
		break;
	default:
		rc = CUDA_ERROR_INVALID_VALUE;
		break;
	}
	sim_pool_unlock(h);
	return rc;
}

CUresult sim_impl_cuMemPoolGetAttribute(CUmemoryPool pool, int attr, void *value)
{
	struct sim_heap *h;
	CUresult rc = CUDA_SUCCESS;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!value || !(h = sim_pool_lock(pool)))
		return CUDA_ERROR_INVALID_VALUE;
	switch (attr) {
	case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES:
	case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC:
	case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES:
		*(int *)value = pool->reuse[attr - 1];
		break;
	case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD:
		*(uint64_t *)value = pool->threshold;
		break;
	case CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT:
		*(uint64_t *)value = pool->reserved;
		break;
	case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH:
		*(uint64_t *)value = pool->reserved_high;
		break;
	case CU_MEMPOOL_ATTR_USED_MEM_CURRENT:
		*(uint64_t *)value = pool->used;
		break;
	case CU_MEMPOOL_ATTR_USED_MEM_HIGH:
		*(uint64_t *)value = pool->used_high;
		break;
	default:
		rc = CUDA_ERROR_INVALID_VALUE;
		break;
	}
	sim_pool_unlock(h);
	return rc;
}

CUresult sim_impl_cuMemPoolTrimTo(CUmemoryPool pool, size_t keep)
{
	struct sim_heap *h;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	h = sim_pool_lock(pool);
	if (!h)
		return CUDA_ERROR_INVALID_VALUE;
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

/*
 * IPC: a handle names the exporting process, its device memfd and the
 * allocation's place in it. Another process opens the memfd through
 * /proc/PID/fd and maps the allocation's pages: both processes then share
 * the very bytes, as two processes share device memory on a GPU.
 */
struct sim_ipc_mem {
	uint32_t magic;
	uint32_t pid;
	int32_t fd;
	int32_t spec_index;
	uint64_t off;
	uint64_t size;
};

CUresult sim_impl_cuIpcGetMemHandle(CUipcMemHandle *handle, CUdeviceptr p)
{
	struct sim_ipc_mem rec;
	struct sim_ptr info;
	struct sim_heap *h;
	size_t off;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!handle)
		return CUDA_ERROR_INVALID_VALUE;
	h = sim_heap_of(p, &off);
	if (!h || !sim_ptr_find(p, &info) || info.base != p || !info.ipc)
		return CUDA_ERROR_INVALID_VALUE;
	if (h->fd < 0)
		return CUDA_ERROR_NOT_SUPPORTED;	/* a forked child's private memory */
	memset(&rec, 0, sizeof(rec));
	rec.magic = SIM_IPC_MAGIC;
	rec.pid = (uint32_t)getpid();
	rec.fd = h->fd;
	rec.spec_index = sim_devs[info.dev].spec_index;
	rec.off = off;
	rec.size = info.size;
	memset(handle, 0, sizeof(*handle));
	memcpy(handle->reserved, &rec, sizeof(rec));
	return CUDA_SUCCESS;
}

static CUresult sim_ipc_open(CUdeviceptr *pdptr, const CUipcMemHandle *handle)
{
	const size_t page = 4096;
	struct sim_ipc_mem rec;
	struct sim_ipc *m;
	char path[64];
	uint64_t start;
	void *map;
	int fd, i, dev = -1;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	memcpy(&rec, handle->reserved, sizeof(rec));
	if (!pdptr || rec.magic != SIM_IPC_MAGIC || rec.size == 0)
		return CUDA_ERROR_INVALID_VALUE;
	/* A process cannot open its own handles. */
	if (rec.pid == (uint32_t)getpid())
		return CUDA_ERROR_INVALID_CONTEXT;
	if (!sim_depth)
		return CUDA_ERROR_INVALID_CONTEXT;
	for (i = 0; i < sim_ndevs; i++)
		if (sim_devs[i].spec_index == rec.spec_index)
			dev = i;
	if (dev < 0)
		return CUDA_ERROR_INVALID_DEVICE;
	pthread_mutex_lock(&sim_ipc_lock);
	for (m = sim_ipc_list; m; m = m->next) {
		/* Each device's memfd starts at 0: the device and the size tell them apart. */
		if (m->pid == (pid_t)rec.pid && m->spec_index == rec.spec_index &&
		    m->off == rec.off && m->size == rec.size) {
			m->refs++;
			*pdptr = m->ptr;
			pthread_mutex_unlock(&sim_ipc_lock);
			return CUDA_SUCCESS;
		}
	}
	pthread_mutex_unlock(&sim_ipc_lock);
	snprintf(path, sizeof(path), "/proc/%u/fd/%d", rec.pid, rec.fd);
	fd = open(path, O_RDWR | O_CLOEXEC);
	if (fd < 0)
		return CUDA_ERROR_INVALID_HANDLE;
	start = rec.off & ~(uint64_t)(page - 1);
	m = calloc(1, sizeof(*m));
	map = m ? mmap(NULL, rec.off - start + rec.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
		       (off_t)start)
		: MAP_FAILED;
	close(fd);
	if (map == MAP_FAILED) {
		free(m);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	m->map = (uintptr_t)map;
	m->maplen = rec.off - start + rec.size;
	m->ptr = m->map + (rec.off - start);
	m->size = rec.size;
	m->dev = dev;
	m->pid = (pid_t)rec.pid;
	m->fd = rec.fd;
	m->spec_index = rec.spec_index;
	m->off = rec.off;
	m->refs = 1;
	pthread_mutex_lock(&sim_ipc_lock);
	m->next = sim_ipc_list;
	sim_ipc_list = m;
	pthread_mutex_unlock(&sim_ipc_lock);
	*pdptr = m->ptr;
	return CUDA_SUCCESS;
}

/*
 * The handle is a 64-byte struct passed by value: the ABI puts it on the
 * stack, after the register arguments (sim_exports.c forwards those words
 * unchanged, so the prototype here is the real one).
 */
CUresult sim_impl_cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle,
					unsigned int flags)
{
	(void)flags;
	return sim_ipc_open(pdptr, &handle);
}

CUresult sim_impl_cuIpcOpenMemHandle(CUdeviceptr *pdptr, CUipcMemHandle handle,
				     unsigned int flags)
{
	(void)flags;
	return sim_ipc_open(pdptr, &handle);
}

CUresult sim_impl_cuIpcCloseMemHandle(CUdeviceptr p)
{
	struct sim_ipc **pp, *m = NULL;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	pthread_mutex_lock(&sim_ipc_lock);
	for (pp = &sim_ipc_list; *pp && (*pp)->ptr != p; pp = &(*pp)->next)
		;
	if (*pp && --(*pp)->refs == 0) {
		m = *pp;
		*pp = m->next;
	} else if (*pp) {
		pp = NULL;	/* still open elsewhere in this process */
	}
	pthread_mutex_unlock(&sim_ipc_lock);
	if (!m)
		return pp ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
	munmap((void *)m->map, m->maplen);
	free(m);
	return CUDA_SUCCESS;
}

/* The per-thread default stream variants (SIM_SAME_AS). */
SIM_SAME_AS(cuMemcpy_ptds, cuMemcpy);
SIM_SAME_AS(cuMemcpyAsync_ptsz, cuMemcpyAsync);
SIM_SAME_AS(cuMemcpyHtoD_v2_ptds, cuMemcpyHtoD_v2);
SIM_SAME_AS(cuMemcpyHtoDAsync_v2_ptsz, cuMemcpyHtoDAsync_v2);
SIM_SAME_AS(cuMemcpyDtoH_v2_ptds, cuMemcpyDtoH_v2);
SIM_SAME_AS(cuMemcpyDtoHAsync_v2_ptsz, cuMemcpyDtoHAsync_v2);
SIM_SAME_AS(cuMemcpyDtoD_v2_ptds, cuMemcpyDtoD_v2);
SIM_SAME_AS(cuMemcpyDtoDAsync_v2_ptsz, cuMemcpyDtoDAsync_v2);
SIM_SAME_AS(cuMemcpyPeer_ptds, cuMemcpyPeer);
SIM_SAME_AS(cuMemcpyPeerAsync_ptsz, cuMemcpyPeerAsync);
SIM_SAME_AS(cuMemcpy2D_v2_ptds, cuMemcpy2D_v2);
SIM_SAME_AS(cuMemcpy2DUnaligned_v2_ptds, cuMemcpy2DUnaligned_v2);
SIM_SAME_AS(cuMemcpy2DAsync_v2_ptsz, cuMemcpy2DAsync_v2);
SIM_SAME_AS(cuMemcpy3D_v2_ptds, cuMemcpy3D_v2);
SIM_SAME_AS(cuMemcpy3DAsync_v2_ptsz, cuMemcpy3DAsync_v2);
SIM_SAME_AS(cuMemsetD8_v2_ptds, cuMemsetD8_v2);
SIM_SAME_AS(cuMemsetD16_v2_ptds, cuMemsetD16_v2);
SIM_SAME_AS(cuMemsetD32_v2_ptds, cuMemsetD32_v2);
SIM_SAME_AS(cuMemsetD2D8_v2_ptds, cuMemsetD2D8_v2);
SIM_SAME_AS(cuMemsetD2D16_v2_ptds, cuMemsetD2D16_v2);
SIM_SAME_AS(cuMemsetD2D32_v2_ptds, cuMemsetD2D32_v2);
SIM_SAME_AS(cuMemsetD8Async_ptsz, cuMemsetD8Async);
SIM_SAME_AS(cuMemsetD16Async_ptsz, cuMemsetD16Async);
SIM_SAME_AS(cuMemsetD32Async_ptsz, cuMemsetD32Async);
SIM_SAME_AS(cuMemsetD2D8Async_ptsz, cuMemsetD2D8Async);
SIM_SAME_AS(cuMemsetD2D16Async_ptsz, cuMemsetD2D16Async);
SIM_SAME_AS(cuMemsetD2D32Async_ptsz, cuMemsetD2D32Async);
SIM_SAME_AS(cuMemPrefetchAsync_ptsz, cuMemPrefetchAsync);

/*
 * Shareable handles of cuMemCreate memory, POSIX file descriptors only: a
 * new open file description of the device memfd, positioned at the
 * allocation. Passed to another process (SCM_RIGHTS, pidfd_getfd) and
 * imported there, it maps the same pages.
 */
#define SIM_HANDLE_TYPE_POSIX_FD 1
#define SIM_HANDLE_TYPES_KNOWN 0xf	/* POSIX fd, Win32, Win32 KMT, fabric */

CUresult sim_impl_cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle handle,
					       int type, unsigned long long flags)
{
	struct sim_extent *e;
	struct sim_heap *h;
	char path[64];
	size_t off;
	int fd;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!out || flags != 0 || type <= 0 || (type & ~SIM_HANDLE_TYPES_KNOWN))
		return CUDA_ERROR_INVALID_VALUE;
	if (type != SIM_HANDLE_TYPE_POSIX_FD)
		return CUDA_ERROR_NOT_SUPPORTED;
	h = sim_heap_of(handle, &off);
	if (!h)
		return CUDA_ERROR_INVALID_VALUE;
	pthread_mutex_lock(&h->lock);
	e = sim_heap_find(h, off, SIM_MEM_HANDLE);
	fd = e && e->refs ? h->fd : -2;
	pthread_mutex_unlock(&h->lock);
	if (fd == -2)
		return CUDA_ERROR_INVALID_VALUE;
	if (fd < 0)
		return CUDA_ERROR_NOT_SUPPORTED;	/* a forked child's private memory */
	snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
	fd = open(path, O_RDWR | O_CLOEXEC);
	if (fd < 0)
		return CUDA_ERROR_OUT_OF_MEMORY;
	if (lseek(fd, (off_t)off, SEEK_SET) != (off_t)off) {
		close(fd);
		return CUDA_ERROR_INVALID_VALUE;
	}
	*(int *)out = fd;
	return CUDA_SUCCESS;
}

/* The device of the node whose memfd fd is, as a local ordinal; -1 if none. */
static int sim_memfd_device(int fd)
{
	char path[64], target[128];
	const char *name;
	ssize_t n;
	int i, spec_index;

	snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
	n = readlink(path, target, sizeof(target) - 1);
	if (n <= 0)
		return -1;
	target[n] = '\0';
	name = strstr(target, SIM_MEMFD_NAME);
	if (!name || sscanf(name + strlen(SIM_MEMFD_NAME), "%d", &spec_index) != 1)
		return -1;
	for (i = 0; i < sim_ndevs; i++)
		if (sim_devs[i].spec_index == spec_index)
			return i;
	return -1;
}

/* The caller keeps its descriptor: the import holds a duplicate of its own. */
CUresult sim_impl_cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle,
						 void *os_handle, int type)
{
	int fd = (int)(intptr_t)os_handle, dev;
	struct sim_import *m;
	off_t off;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!handle || type <= 0 || (type & ~SIM_HANDLE_TYPES_KNOWN))
		return CUDA_ERROR_INVALID_VALUE;
	if (type != SIM_HANDLE_TYPE_POSIX_FD)
		return CUDA_ERROR_NOT_SUPPORTED;
	dev = sim_memfd_device(fd);
	off = lseek(fd, 0, SEEK_CUR);
	if (dev < 0 || off < 0)
		return CUDA_ERROR_INVALID_VALUE;
	m = calloc(1, sizeof(*m));
	if (!m)
		return CUDA_ERROR_OUT_OF_MEMORY;
	m->fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
	if (m->fd < 0) {
		free(m);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	m->off = (uint64_t)off;
	m->dev = dev;
	m->limit = sim_devs[dev].spec->bytes > m->off ? sim_devs[dev].spec->bytes - m->off : 0;
	m->refs = 1;
	pthread_mutex_lock(&sim_import_lock);
	m->next = sim_import_list;
	sim_import_list = m;
	pthread_mutex_unlock(&sim_import_lock);
	*handle = (CUmemGenericAllocationHandle)(uintptr_t)m;
	return CUDA_SUCCESS;
}

/* What the memory behind a handle is: pinned device memory, shareable as a POSIX fd. */
CUresult sim_impl_cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop,
							 CUmemGenericAllocationHandle handle)
{
	uint64_t off;
	int fd, dev;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!prop || !sim_handle_backing(handle, &fd, &off, &dev))
		return CUDA_ERROR_INVALID_VALUE;
	memset(prop, 0, sizeof(*prop));
	prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
	prop->requestedHandleTypes = SIM_HANDLE_TYPE_POSIX_FD;
	prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	prop->location.id = dev;
	return CUDA_SUCCESS;
}

/*
 * In a forked child: an IPC-opened mapping becomes a private copy-on-write
 * view of the exporter's bytes, opened again through /proc; zeros if the
 * exporter is gone.
 */
static void sim_ipc_privatise(const struct sim_ipc *m)
{
	char path[64];
	int fd;

	snprintf(path, sizeof(path), "/proc/%d/fd/%d", (int)m->pid, m->fd);
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd >= 0) {
		mmap((void *)m->map, m->maplen, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED, fd,
		     (off_t)(m->off - (m->ptr - m->map)));
		close(fd);
	} else {
		mmap((void *)m->map, m->maplen, PROT_READ | PROT_WRITE,
		     MAP_PRIVATE | MAP_FIXED | MAP_ANONYMOUS, -1, 0);
	}
}

/*
 * After fork() the child must not share its parent's device memory: it has
 * its own copy of the allocator's records, so its frees would punch, and
 * its allocations write, pages the parent still uses. The child's view of
 * each heap becomes a private copy-on-write mapping of the same bytes and
 * the memfd is let go (nothing can map or share the child's memory then:
 * IPC and shareable handles answer an error), as a forked process had its
 * own copy of device memory before heaps were shared files. Locks another
 * thread held at the fork are made anew: only this thread exists now.
 */
void sim_atfork_child(void)
{
	pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
	struct sim_import *im;
	struct sim_ipc *m;
	struct sim_va *v;
	size_t k;
	int i;

	sim_ctx_lock = fresh;
	sim_obj_lock = fresh;
	sim_va_lock = fresh;
	sim_host_lock = fresh;
	sim_ipc_lock = fresh;
	sim_import_lock = fresh;
	for (i = 0; i < sim_ndevs; i++)
		sim_devs[i].heap.lock = fresh;
	sim_cls_after_fork();
	/* Mappings of the same files elsewhere (cuMemMap, IPC) become private too. */
	for (v = sim_va_list; v; v = v->next) {
		for (k = 0; k < v->nmaps; k++) {
			uint64_t off;
			int fd, dev;

			if (sim_handle_backing(v->maps[k].handle, &fd, &off, &dev) && fd >= 0)
				mmap((void *)(v->base + v->maps[k].off), v->maps[k].len,
				     PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED, fd,
				     (off_t)(off + v->maps[k].hoff));
		}
	}
	for (m = sim_ipc_list; m; m = m->next)
		sim_ipc_privatise(m);
	for (im = sim_import_list; im; im = im->next) {
		close(im->fd);	/* its mappings are private now; no new ones */
		im->fd = -1;
	}
	for (i = 0; i < sim_ndevs; i++) {
		struct sim_heap *h = &sim_devs[i].heap;

		if (!h->base || h->fd < 0)
			continue;
		mmap((void *)h->base, sim_devs[i].spec->bytes, PROT_READ | PROT_WRITE,
		     MAP_PRIVATE | MAP_FIXED | MAP_NORESERVE, h->fd, 0);
		close(h->fd);
		h->fd = -1;
	}
}
