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
#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/mman.h>
#include <unistd.h>

#include "sim_abi.h"
#include "sim_internal.h"
#include "sim_spec.h"
#include "sim_usage.h"

#define SIM_ALIGN	512	/* allocation granule and alignment */
#define SIM_CTX_DEPTH	64	/* per-thread context stack */
#define SIM_GRANULARITY	((size_t)2 << 20)	/* cuMemCreate / cuMemMap granule */

struct sim_extent {
	size_t off;
	size_t len;
	unsigned int kind;	/* live extents: enum sim_mem_kind; free ones: 0 */
	uint64_t owner;		/* live: the id of the context it belongs to, or 0 */
	size_t refs;		/* SIM_MEM_HANDLE: unreleased handle references */
	size_t maps;		/* SIM_MEM_HANDLE: mappings of it (cuMemMap) */
	struct CUmemPoolHandle_st *pool;	/* stream-ordered: the pool it is from */
	bool idle;		/* in a pool: freed to it, kept reserved for reuse */
};

/*
 * What made a live allocation. Each way back frees only its own kind, as the
 * driver does: cuMemFree of a cuMemCreate handle's memory or of an array's
 * storage is an error, never a silent release. Pointers and arrays belong to
 * the context that was current when they were made and go with it; a
 * cuMemCreate allocation belongs to no context and lives until its last
 * reference and its last mapping are gone.
 */
enum sim_mem_kind {
	SIM_MEM_PTR = 1,	/* cuMemAlloc & co.: back with cuMemFree(Async) */
	SIM_MEM_HANDLE,		/* cuMemCreate: back with cuMemRelease */
	SIM_MEM_ARRAY,		/* arrays and mipmapped arrays: back with their destroy */
};

/*
 * Both arrays are sorted by offset. Free extents are kept coalesced, so
 * there are never more of them than live allocations + 1; growing free_cap
 * along with live_cap keeps that room and is why a free can never fail.
 */
struct sim_heap {
	pthread_mutex_t lock;
	uintptr_t base;		/* 0 until first allocation; read atomically */
	int fd;			/* the memfd behind base, once base is set */
	int spec_index;		/* its device's place in the node (sim_usage.c) */
	size_t arena;		/* device bytes rounded down to SIM_ALIGN */
	size_t used;
	struct sim_extent *free_ext;
	size_t nfree, free_cap;
	struct sim_extent *live;
	size_t nlive, live_cap;
};

/*
 * A context's id is what its allocations and objects record as their owner.
 * Ids are never reused, so that an allocation made through a stale handle
 * can never be taken for a later context's. A primary context keeps one id
 * (its device's ordinal + 1) through every reset: it is the same handle.
 */
struct CUctx_st {
	struct CUctx_st *next;	/* sim_ctx_list; unused by primaries */
	int dev;
	uint64_t id;
};

#define SIM_PRIMARY_ID(dev) ((uint64_t)(dev) + 1)

/*
 * Arrays, mipmapped arrays, memory pools and streams are host objects on one
 * list, so that a handle is looked up before it is used: a made-up or
 * destroyed handle gets an error, never a crash.
 */
enum sim_obj_kind {
	SIM_OBJ_ARRAY = 1,
	SIM_OBJ_MIPMAP,
	SIM_OBJ_POOL,
	SIM_OBJ_STREAM,
	SIM_OBJ_EVENT,
	SIM_OBJ_LIBRARY,
	SIM_OBJ_FUNC,
	SIM_OBJ_GRAPH,
	SIM_OBJ_EXEC,
	SIM_OBJ_GLOBAL,
};

struct sim_obj {
	struct sim_obj *next;	/* sim_obj_list; unused by default pools */
	enum sim_obj_kind kind;
	int dev;
	CUdeviceptr addr;	/* arrays: their storage in the device heap */
	uint64_t owner;		/* arrays, streams: their context's id; pools: 0 */
	CUcontext ctx;		/* streams: their context */
};

struct CUarray_st {
	struct sim_obj obj;
};

struct CUmipmappedArray_st {
	struct sim_obj obj;
};

/*
 * A stream-ordered pool, as the driver models one: memory freed into it
 * stays reserved by the pool (still taken from the device) for reuse, until
 * the pool is trimmed (cuMemPoolTrimTo) or a synchronisation releases what
 * exceeds its release threshold (0 by default, so a synchronisation gives
 * everything idle back). Its chunks are heap extents that name it; the
 * counters are kept under its device's heap lock.
 */
struct CUmemPoolHandle_st {
	struct sim_obj obj;
	uint64_t threshold;	/* CU_MEMPOOL_ATTR_RELEASE_THRESHOLD */
	uint64_t reserved, reserved_high;
	uint64_t used, used_high;
	int reuse[3];		/* the three CU_MEMPOOL_ATTR_REUSE_* switches */
};

struct CUstream_st {
	struct sim_obj obj;
	unsigned int flags;
	int priority;
	uint64_t id;
	/* Stream capture, under sim_obj_lock. */
	int capture_status;	/* CU_STREAM_CAPTURE_STATUS_* */
	int capture_mode;
	uint64_t capture_id;
	struct CUgraph_st *capture;	/* the graph being captured into */
	bool capture_origin;	/* began the capture (others joined it through an event) */
};

struct sim_device {
	const struct sim_spec *spec;
	int index;			/* its ordinal */
	int spec_index;
	struct sim_heap heap;
	struct CUctx_st primary;
	unsigned int primary_refs;	/* under sim_ctx_lock */
	struct CUmemPoolHandle_st default_pool;
	CUmemoryPool mempool;		/* the current pool; under sim_obj_lock */
};

/*
 * A stack slot records the device and id with the handle so that the hot
 * paths never read a context object another thread may have destroyed.
 */
struct sim_ctx_slot {
	CUcontext ctx;
	int dev;
	uint64_t id;
};

enum { SIM_UNINIT, SIM_READY };

static struct sim_spec sim_specs[SIM_MAX_GPUS];
static int sim_nspecs;
static struct sim_device sim_devs[SIM_MAX_GPUS];
static int sim_ndevs;

static pthread_once_t sim_once = PTHREAD_ONCE_INIT;
static CUresult sim_init_result;
static int sim_state;		/* SIM_READY is stored with release */

/*
 * Lock order: sim_ctx_lock before sim_obj_lock before a heap lock, and
 * sim_va_lock before a heap lock; never two heap locks at once.
 */
static pthread_mutex_t sim_ctx_lock = PTHREAD_MUTEX_INITIALIZER;
static struct CUctx_st *sim_ctx_list;
static uint64_t sim_ctx_serial = SIM_MAX_GPUS;	/* the last id handed out; atomic */

static pthread_mutex_t sim_obj_lock = PTHREAD_MUTEX_INITIALIZER;
static struct sim_obj *sim_obj_list;

/* cuMemMap: the bytes [off, off + len) of a reservation are handle's. */
struct sim_map {
	size_t off;
	size_t len;
	CUmemGenericAllocationHandle handle;
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

static uint64_t sim_stream_serial;	/* the last stream id handed out; atomic */

static __thread struct sim_ctx_slot sim_stack[SIM_CTX_DEPTH];
static __thread unsigned int sim_depth;

static CUresult sim_live(void)
{
	return __atomic_load_n(&sim_state, __ATOMIC_ACQUIRE) == SIM_READY
		       ? CUDA_SUCCESS
		       : CUDA_ERROR_NOT_INITIALIZED;
}

#define SIM_REQUIRE_INIT()						\
	do {								\
		CUresult live_rc_ = sim_live();				\
		if (live_rc_ != CUDA_SUCCESS)				\
			return live_rc_;				\
	} while (0)

static bool sim_valid_dev(CUdevice dev)
{
	return dev >= 0 && dev < sim_ndevs;
}

/* What most device queries check first: initialized, out-pointer, ordinal. */
static CUresult sim_check(const void *out, CUdevice dev)
{
	CUresult rc = sim_live();

	if (rc != CUDA_SUCCESS)
		return rc;
	if (!out)
		return CUDA_ERROR_INVALID_VALUE;
	return sim_valid_dev(dev) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}

static CUresult sim_check_dev(CUdevice dev)
{
	return sim_check(&dev, dev);
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
				return -1;	/* ambiguous prefix */
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

static void sim_atfork_child(void);

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

/*
 * The whole pages of [off, off + len) go back to the system: freed device
 * memory costs no RAM, and reads as zeros when it is handed out again.
 */
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

static CUresult sim_heap_alloc(struct sim_device *d, size_t bytes, enum sim_mem_kind kind,
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

/* With h locked: gives live extent e back to the free extents. */
static void sim_heap_drop(struct sim_heap *h, struct sim_extent *e)
{
	struct sim_extent *f;
	size_t at, off = e->off, len = e->len;
	bool join_prev, join_next;

	sim_ext_remove(h->live, &h->nlive, (size_t)(e - h->live));
	h->used -= len;
	sim_heap_punch(h, off, len);
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
static void sim_pools_settle(void)
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
static void sim_heap_sweep(struct sim_heap *h, uint64_t id)
{
	size_t i, kept = 0, pos = 0, freed = 0;

	pthread_mutex_lock(&h->lock);
	for (i = 0; i < h->nlive; i++) {
		if (h->live[i].owner == id) {
			freed += h->live[i].len;
			sim_heap_punch(h, h->live[i].off, h->live[i].len);
		} else
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

/*
 * Nothing is torn down at exit: a framework's own exit-time code (static
 * destructors, worker threads still running) keeps freeing and querying,
 * and a driver that failed those calls would abort the process. The
 * library is linked with -z nodelete, so dlclose never unloads it either;
 * the system takes the memory back with the process.
 */

/* Host objects behind array, pool and stream handles. */

static void sim_obj_add(struct sim_obj *o)
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
static struct sim_obj **sim_obj_find(const void *handle, enum sim_obj_kind kind)
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
static struct sim_obj *sim_obj_lookup(const void *handle, enum sim_obj_kind kind, bool take,
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

/* Contexts. */

/* The calling thread's current context, or NULL. */
static const struct sim_ctx_slot *sim_current(void)
{
	return sim_depth ? &sim_stack[sim_depth - 1] : NULL;
}

static int sim_current_dev(void)
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
static void sim_graph_free(struct CUgraph_st *g);
static void sim_capture_end_locked(uint64_t id);
static struct CUgraph_st *sim_stream_gone_locked(struct CUstream_st *s);

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
 * holds no memory there.
 */
static void sim_usage_open(struct sim_device *d)
{
	pthread_mutex_lock(&d->heap.lock);
	sim_usage_set(d->spec_index, d->heap.used);
	pthread_mutex_unlock(&d->heap.lock);
}

static void sim_usage_close(struct sim_device *d)
{
	bool idle;

	pthread_mutex_lock(&sim_ctx_lock);
	idle = d->primary_refs == 0;
	pthread_mutex_unlock(&sim_ctx_lock);
	pthread_mutex_lock(&d->heap.lock);
	if (idle && d->heap.used == 0)
		sim_usage_clear(d->spec_index);
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
	sim_usage_open(&sim_devs[dev]);
	*pctx = c;
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
	(void)flags;
	return sim_ctx_create(pctx, dev);
}

/* Execution affinity (SM counts of a green context) means nothing here. */
CUresult sim_impl_cuCtxCreate_v3(CUcontext *pctx, void *affinity, int naffinity,
				   unsigned int flags, CUdevice dev)
{
	(void)affinity;
	(void)naffinity;
	(void)flags;
	return sim_ctx_create(pctx, dev);
}

CUresult sim_impl_cuCtxCreate_v4(CUcontext *pctx, void *params, unsigned int flags,
				   CUdevice dev)
{
	(void)params;
	(void)flags;
	return sim_ctx_create(pctx, dev);
}

CUresult sim_impl_cuCtxDestroy_v2(CUcontext ctx)
{
	struct CUctx_st **pp, *c;
	unsigned int i, kept = 0;

	SIM_REQUIRE_INIT();
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

	SIM_REQUIRE_INIT();
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
	SIM_REQUIRE_INIT();
	if (!pctx)
		return CUDA_ERROR_INVALID_VALUE;
	*pctx = sim_depth ? sim_stack[sim_depth - 1].ctx : NULL;
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuCtxGetDevice(CUdevice *dev)
{
	SIM_REQUIRE_INIT();
	if (!dev)
		return CUDA_ERROR_INVALID_VALUE;
	if (!sim_depth)
		return CUDA_ERROR_INVALID_CONTEXT;
	*dev = sim_current_dev();
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuCtxPushCurrent_v2(CUcontext ctx)
{
	struct sim_ctx_slot slot;

	SIM_REQUIRE_INIT();
	return sim_ctx_slot_of(ctx, &slot) ? sim_push(&slot) : CUDA_ERROR_INVALID_CONTEXT;
}

CUresult sim_impl_cuCtxPopCurrent_v2(CUcontext *pctx)
{
	SIM_REQUIRE_INIT();
	if (!sim_depth)
		return CUDA_ERROR_INVALID_CONTEXT;
	sim_depth--;
	if (pctx)
		*pctx = sim_stack[sim_depth].ctx;
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuCtxSynchronize(void)
{
	SIM_REQUIRE_INIT();
	/* Nothing ever runs, so there is nothing to wait for; pools settle. */
	sim_pools_settle();
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
	CUresult rc = sim_check(pctx, dev);

	if (rc != CUDA_SUCCESS)
		return rc;
	pthread_mutex_lock(&sim_ctx_lock);
	sim_devs[dev].primary_refs++;
	pthread_mutex_unlock(&sim_ctx_lock);
	sim_usage_open(&sim_devs[dev]);
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
	CUresult rc = sim_check_dev(dev);

	if (rc != CUDA_SUCCESS)
		return rc;
	pthread_mutex_lock(&sim_ctx_lock);
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
	CUresult rc = sim_check_dev(dev);

	if (rc != CUDA_SUCCESS)
		return rc;
	pthread_mutex_lock(&sim_ctx_lock);
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

/* Initialization, device queries, memory, launch. */

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

CUresult sim_impl_cuDeviceGetCount(int *count)
{
	CUresult rc = sim_check(count, 0);

	if (rc == CUDA_SUCCESS)
		*count = sim_ndevs;
	return rc;
}

CUresult sim_impl_cuDeviceGet(CUdevice *dev, int ordinal)
{
	CUresult rc = sim_check(dev, ordinal);

	if (rc == CUDA_SUCCESS)
		*dev = ordinal;
	return rc;
}

CUresult sim_impl_cuDeviceGetName(char *name, int len, CUdevice dev)
{
	CUresult rc = sim_check(name, dev);

	if (rc == CUDA_SUCCESS && len <= 0)
		rc = CUDA_ERROR_INVALID_VALUE;
	if (rc == CUDA_SUCCESS)
		snprintf(name, (size_t)len, "%s", sim_devs[dev].spec->name);
	return rc;
}

CUresult sim_impl_cuDeviceGetUuid(CUuuid *uuid, CUdevice dev)
{
	CUresult rc = sim_check(uuid, dev);

	if (rc == CUDA_SUCCESS)
		memcpy(uuid->bytes, sim_devs[dev].spec->uuid_bytes, sizeof(uuid->bytes));
	return rc;
}

/* _v2 differs from v1 only for MIG instances, and the simulation has none. */
CUresult sim_impl_cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev)
{
	return sim_impl_cuDeviceGetUuid(uuid, dev);
}

CUresult sim_impl_cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
	CUresult rc = sim_check(bytes, dev);

	if (rc == CUDA_SUCCESS)
		*bytes = sim_devs[dev].spec->bytes;
	return rc;
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
	CUresult rc = sim_check(bus_id, dev);

	if (rc == CUDA_SUCCESS && len <= 0)
		rc = CUDA_ERROR_INVALID_VALUE;
	if (rc == CUDA_SUCCESS)
		snprintf(bus_id, (size_t)len, "0000:%02x:00.0",
			 (unsigned int)sim_devs[dev].spec_index + 1);
	return rc;
}

CUresult sim_impl_cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes)
{
	struct sim_device *d;
	size_t used;

	SIM_REQUIRE_INIT();
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

/* Memory: every path takes from, and gives back to, the device heaps. */

/* Allocations made here belong to the current context. */
static CUresult sim_alloc_current(CUdeviceptr *dptr, size_t bytes, enum sim_mem_kind kind)
{
	const struct sim_ctx_slot *cur;

	SIM_REQUIRE_INIT();
	if (!dptr || bytes == 0)
		return CUDA_ERROR_INVALID_VALUE;
	cur = sim_current();
	if (!cur)
		return CUDA_ERROR_INVALID_CONTEXT;
	return sim_heap_alloc(&sim_devs[cur->dev], bytes, kind, cur->id, dptr);
}

/* Frees addr if a heap holds a live allocation of this kind starting there. */
static CUresult sim_mem_free(CUdeviceptr addr, enum sim_mem_kind kind)
{
	size_t off;
	struct sim_heap *h = sim_heap_of(addr, &off);

	return h ? sim_heap_free(h, off, kind) : CUDA_ERROR_INVALID_VALUE;
}

CUresult sim_impl_cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
	return sim_alloc_current(dptr, bytesize, SIM_MEM_PTR);
}

/* Freeing NULL does nothing: cudaFree(NULL), the idiom that creates a context, ends here. */
CUresult sim_impl_cuMemFree_v2(CUdeviceptr dptr)
{
	SIM_REQUIRE_INIT();
	return dptr ? sim_mem_free(dptr, SIM_MEM_PTR) : CUDA_SUCCESS;
}

/* The row alignment cuMemAllocPitch reports; what current GPUs use. */
#define SIM_PITCH 512

CUresult sim_impl_cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width,
				       size_t height, unsigned int elem)
{
	size_t row;
	CUresult rc;

	SIM_REQUIRE_INIT();
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
	SIM_REQUIRE_INIT();
	if (flags != CU_MEM_ATTACH_GLOBAL && flags != CU_MEM_ATTACH_HOST)
		return CUDA_ERROR_INVALID_VALUE;
	return sim_alloc_current(dptr, bytesize, SIM_MEM_PTR);
}

/*
 * Streams. Nothing runs asynchronously in the simulation, so a stream is a
 * handle bound to the context that was current when it was made: what it
 * decides is the device (and the owning context) of what is allocated on
 * it. NULL, CU_STREAM_LEGACY and CU_STREAM_PER_THREAD name a default stream
 * of the calling thread's current context.
 */

static bool sim_default_stream(CUstream stream)
{
	return !stream || stream == CU_STREAM_LEGACY || stream == CU_STREAM_PER_THREAD;
}

/* The context behind a stream, as a stack slot. */
static CUresult sim_stream_slot(CUstream stream, struct sim_ctx_slot *slot)
{
	const struct sim_ctx_slot *cur;
	struct sim_obj seen;

	if (sim_default_stream(stream)) {
		cur = sim_current();
		if (!cur)
			return CUDA_ERROR_INVALID_CONTEXT;
		*slot = *cur;
		return CUDA_SUCCESS;
	}
	if (!sim_obj_lookup(stream, SIM_OBJ_STREAM, false, &seen))
		return CUDA_ERROR_INVALID_HANDLE;
	slot->ctx = seen.ctx;
	slot->dev = seen.dev;
	slot->id = seen.owner;
	return CUDA_SUCCESS;
}

/*
 * Priorities, capture and callbacks are not simulated; the flags are the
 * documented ones. A stream made while its context is being destroyed on
 * another thread (undefined in the driver) outlives it as an orphan handle.
 */
CUresult sim_impl_cuStreamCreate(CUstream *stream, unsigned int flags)
{
	const struct sim_ctx_slot *cur;
	struct CUstream_st *s;

	SIM_REQUIRE_INIT();
	if (!stream || (flags & ~(unsigned int)CU_STREAM_NON_BLOCKING))
		return CUDA_ERROR_INVALID_VALUE;
	cur = sim_current();
	if (!cur)
		return CUDA_ERROR_INVALID_CONTEXT;
	s = calloc(1, sizeof(*s));
	if (!s)
		return CUDA_ERROR_OUT_OF_MEMORY;
	s->obj.kind = SIM_OBJ_STREAM;
	s->obj.dev = cur->dev;
	s->obj.owner = cur->id;
	s->obj.ctx = cur->ctx;
	s->flags = flags;
	s->id = __atomic_add_fetch(&sim_stream_serial, 1, __ATOMIC_RELAXED);
	sim_obj_add(&s->obj);
	*stream = s;
	return CUDA_SUCCESS;
}

/* A default stream is not the caller's to destroy. */
/*
 * With sim_obj_lock held: a stream that goes ends its capture if it began
 * one; the graph it captured into is returned for the caller to free.
 */
static struct CUgraph_st *sim_stream_gone_locked(struct CUstream_st *s)
{
	struct CUgraph_st *g = NULL;

	if (s->capture_status != CU_STREAM_CAPTURE_STATUS_NONE && s->capture_origin) {
		g = s->capture;
		sim_capture_end_locked(s->capture_id);
	}
	return g;
}

CUresult sim_impl_cuStreamDestroy_v2(CUstream stream)
{
	struct CUgraph_st *g = NULL;
	struct sim_obj **pp, *o = NULL;

	SIM_REQUIRE_INIT();
	if (sim_default_stream(stream))
		return CUDA_ERROR_INVALID_HANDLE;
	pthread_mutex_lock(&sim_obj_lock);
	pp = sim_obj_find(stream, SIM_OBJ_STREAM);
	if (pp) {
		o = *pp;
		*pp = o->next;
		g = sim_stream_gone_locked((struct CUstream_st *)o);
	}
	pthread_mutex_unlock(&sim_obj_lock);
	if (!o)
		return CUDA_ERROR_INVALID_HANDLE;
	sim_graph_free(g);
	free(o);
	return CUDA_SUCCESS;
}

static CUresult sim_stream_ctx(CUstream stream, CUcontext *pctx)
{
	struct sim_ctx_slot slot;
	CUresult rc;

	SIM_REQUIRE_INIT();
	if (!pctx)
		return CUDA_ERROR_INVALID_VALUE;
	rc = sim_stream_slot(stream, &slot);
	if (rc == CUDA_SUCCESS)
		*pctx = slot.ctx;
	return rc;
}

CUresult sim_impl_cuStreamGetCtx(CUstream stream, CUcontext *pctx)
{
	return sim_stream_ctx(stream, pctx);
}

/* The per-thread default stream is the current context's too. */
CUresult sim_impl_cuStreamGetCtx_ptsz(CUstream stream, CUcontext *pctx)
{
	return sim_stream_ctx(stream, pctx);
}

/* CUDA 12.5: a stream of a green context would report it; there are none here. */
static CUresult sim_stream_ctx_v2(CUstream stream, CUcontext *pctx, CUgreenCtx *pgreen)
{
	CUresult rc;

	SIM_REQUIRE_INIT();
	if (!pgreen)
		return CUDA_ERROR_INVALID_VALUE;
	rc = sim_stream_ctx(stream, pctx);
	if (rc == CUDA_SUCCESS)
		*pgreen = NULL;
	return rc;
}

CUresult sim_impl_cuStreamGetCtx_v2(CUstream stream, CUcontext *pctx, CUgreenCtx *pgreen)
{
	return sim_stream_ctx_v2(stream, pctx, pgreen);
}

CUresult sim_impl_cuStreamGetCtx_v2_ptsz(CUstream stream, CUcontext *pctx,
					   CUgreenCtx *pgreen)
{
	return sim_stream_ctx_v2(stream, pctx, pgreen);
}

/* Nothing ever runs, so there is nothing to wait for; the handle is checked. */
static CUresult sim_stream_sync(CUstream stream)
{
	struct sim_ctx_slot slot;
	CUresult rc;

	SIM_REQUIRE_INIT();
	rc = sim_stream_slot(stream, &slot);
	if (rc == CUDA_SUCCESS)
		sim_pools_settle();
	return rc;
}

CUresult sim_impl_cuStreamSynchronize(CUstream stream)
{
	return sim_stream_sync(stream);
}

CUresult sim_impl_cuStreamSynchronize_ptsz(CUstream stream)
{
	return sim_stream_sync(stream);
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
 * Pools are handles tied to a device; their attributes (release threshold,
 * reuse policy, maxSize) change nothing, since every allocation goes to the
 * device heap at once and every free comes back at once. The simulation has
 * device memory only, so host locations are refused as invalid.
 */
CUresult sim_impl_cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props)
{
	struct CUmemPoolHandle_st *p;

	SIM_REQUIRE_INIT();
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
 * As documented, memory still allocated from a destroyed pool stays valid
 * until it is freed, and a device whose current pool it was goes back to its
 * default pool. A device's default pool is not the caller's to destroy.
 */
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

CUresult sim_impl_cuMemPoolDestroy(CUmemoryPool pool)
{
	struct sim_obj **pp, *o = NULL;
	int i;

	SIM_REQUIRE_INIT();
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
	CUresult rc;

	SIM_REQUIRE_INIT();
	if (!dptr || bytesize == 0)
		return CUDA_ERROR_INVALID_VALUE;
	rc = sim_stream_slot(stream, &slot);
	if (rc != CUDA_SUCCESS)
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
	CUresult rc;
	int dev;

	SIM_REQUIRE_INIT();
	if (!dptr || bytesize == 0)
		return CUDA_ERROR_INVALID_VALUE;
	if (sim_pool_device(pool) < 0)
		return CUDA_ERROR_INVALID_VALUE;
	rc = sim_stream_slot(stream, &slot);
	if (rc != CUDA_SUCCESS)
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
	CUresult rc;

	SIM_REQUIRE_INIT();
	rc = sim_stream_slot(stream, &slot);
	return rc == CUDA_SUCCESS ? sim_mem_free(dptr, SIM_MEM_PTR) : rc;
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
	SIM_REQUIRE_INIT();
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

	SIM_REQUIRE_INIT();
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
	SIM_REQUIRE_INIT();
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

	SIM_REQUIRE_INIT();
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

	SIM_REQUIRE_INIT();
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

	SIM_REQUIRE_INIT();
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

	SIM_REQUIRE_INIT();
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

	SIM_REQUIRE_INIT();
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

	SIM_REQUIRE_INIT();
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

	SIM_REQUIRE_INIT();
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

	SIM_REQUIRE_INIT();
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

static CUresult sim_launch(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
			   unsigned int bx, unsigned int by, unsigned int bz)
{
	SIM_REQUIRE_INIT();
	if (!sim_depth)
		return CUDA_ERROR_INVALID_CONTEXT;
	/* Tests pass made-up handles: check it, never look through it. */
	if (!f)
		return CUDA_ERROR_INVALID_HANDLE;
	if (!gx || !gy || !gz || !bx || !by || !bz)
		return CUDA_ERROR_INVALID_VALUE;
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy,
				   unsigned int gz, unsigned int bx, unsigned int by,
				   unsigned int bz, unsigned int shmem, CUstream stream,
				   void **params, void **extra)
{
	(void)shmem, (void)stream, (void)params, (void)extra;
	return sim_launch(f, gx, gy, gz, bx, by, bz);
}

CUresult sim_impl_cuLaunchKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy,
					unsigned int gz, unsigned int bx, unsigned int by,
					unsigned int bz, unsigned int shmem, CUstream stream,
					void **params, void **extra)
{
	(void)shmem, (void)stream, (void)params, (void)extra;
	return sim_launch(f, gx, gy, gz, bx, by, bz);
}

static CUresult sim_launch_ex(const CUlaunchConfig *config, CUfunction f)
{
	SIM_REQUIRE_INIT();
	if (!config || (config->numAttrs && !config->attrs))
		return CUDA_ERROR_INVALID_VALUE;
	return sim_launch(f, config->gridDimX, config->gridDimY, config->gridDimZ,
			  config->blockDimX, config->blockDimY, config->blockDimZ);
}

CUresult sim_impl_cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **params,
				     void **extra)
{
	(void)params, (void)extra;
	return sim_launch_ex(config, f);
}

CUresult sim_impl_cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f,
					  void **params, void **extra)
{
	(void)params, (void)extra;
	return sim_launch_ex(config, f);
}

CUresult sim_impl_cuLaunchCooperativeKernel(CUfunction f, unsigned int gx, unsigned int gy,
					      unsigned int gz, unsigned int bx, unsigned int by,
					      unsigned int bz, unsigned int shmem, CUstream stream,
					      void **params)
{
	(void)shmem, (void)stream, (void)params;
	return sim_launch(f, gx, gy, gz, bx, by, bz);
}

CUresult sim_impl_cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gx,
						   unsigned int gy, unsigned int gz,
						   unsigned int bx, unsigned int by,
						   unsigned int bz, unsigned int shmem,
						   CUstream stream, void **params)
{
	(void)shmem, (void)stream, (void)params;
	return sim_launch(f, gx, gy, gz, bx, by, bz);
}

/*
 * cuGraphLaunch documents no CUDA_ERROR_INVALID_HANDLE: a missing
 * executable graph is CUDA_ERROR_INVALID_VALUE. As with functions, a
 * non-NULL handle is taken on trust and never looked through.
 */
static CUresult sim_graph_run(CUgraphExec exec, CUstream stream);

static CUresult sim_graph_launch(CUgraphExec exec, CUstream stream)
{
	SIM_REQUIRE_INIT();
	if (!sim_depth)
		return CUDA_ERROR_INVALID_CONTEXT;
	return exec ? sim_graph_run(exec, stream) : CUDA_ERROR_INVALID_VALUE;
}

CUresult sim_impl_cuGraphLaunch(CUgraphExec exec, CUstream stream)
{
	return sim_graph_launch(exec, stream);
}

CUresult sim_impl_cuGraphLaunch_ptsz(CUgraphExec exec, CUstream stream)
{
	return sim_graph_launch(exec, stream);
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
typedef unsigned int sim_devptr_v1;

CUresult sim_impl_cuDeviceTotalMem(unsigned int *bytes, CUdevice dev)
{
	(void)bytes, (void)dev;
	SIM_REQUIRE_INIT();
	return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult sim_impl_cuMemGetInfo(unsigned int *free_bytes, unsigned int *total_bytes)
{
	(void)free_bytes, (void)total_bytes;
	SIM_REQUIRE_INIT();
	return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult sim_impl_cuMemAlloc(sim_devptr_v1 *dptr, unsigned int bytesize)
{
	(void)dptr, (void)bytesize;
	SIM_REQUIRE_INIT();
	return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult sim_impl_cuMemAllocPitch(sim_devptr_v1 *dptr, unsigned int *pitch,
				    unsigned int width, unsigned int height, unsigned int elem)
{
	(void)dptr, (void)pitch, (void)width, (void)height, (void)elem;
	SIM_REQUIRE_INIT();
	return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult sim_impl_cuMemFree(sim_devptr_v1 dptr)
{
	(void)dptr;
	SIM_REQUIRE_INIT();
	return CUDA_ERROR_NOT_SUPPORTED;
}

/* The v1 descriptors differ only in 32-bit extents; never read here. */
CUresult sim_impl_cuArrayCreate(CUarray *array, const void *desc)
{
	(void)array, (void)desc;
	SIM_REQUIRE_INIT();
	return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult sim_impl_cuArray3DCreate(CUarray *array, const void *desc)
{
	(void)array, (void)desc;
	SIM_REQUIRE_INIT();
	return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult sim_impl_cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
	(void)pctx, (void)flags, (void)dev;
	SIM_REQUIRE_INIT();
	return CUDA_ERROR_NOT_SUPPORTED;
}

/* Errors, export tables, cuGetProcAddress. */

#define SIM_ERR(code, text) { code, #code, text }
static const struct {
	CUresult code;
	const char *name;
	const char *text;
} sim_errors[] = {
	SIM_ERR(CUDA_SUCCESS, "no error"),
	SIM_ERR(CUDA_ERROR_INVALID_VALUE, "invalid argument"),
	SIM_ERR(CUDA_ERROR_OUT_OF_MEMORY, "out of memory"),
	SIM_ERR(CUDA_ERROR_NOT_INITIALIZED, "initialization error"),
	SIM_ERR(CUDA_ERROR_DEINITIALIZED, "driver shutting down"),
	SIM_ERR(CUDA_ERROR_NO_DEVICE, "no CUDA-capable device is detected"),
	SIM_ERR(CUDA_ERROR_INVALID_DEVICE, "invalid device ordinal"),
	SIM_ERR(CUDA_ERROR_INVALID_CONTEXT, "invalid device context"),
	SIM_ERR(CUDA_ERROR_INVALID_HANDLE, "invalid resource handle"),
	SIM_ERR(CUDA_ERROR_NOT_FOUND, "named symbol not found"),
	SIM_ERR(CUDA_ERROR_NOT_PERMITTED, "operation not permitted"),
	SIM_ERR(CUDA_ERROR_NOT_SUPPORTED, "operation not supported"),
	SIM_ERR(CUDA_ERROR_INVALID_IMAGE, "device kernel image is invalid"),
	SIM_ERR(CUDA_ERROR_ALREADY_MAPPED, "resource already mapped"),
	SIM_ERR(CUDA_ERROR_ILLEGAL_STATE, "the operation cannot be performed in the present state"),
	SIM_ERR(CUDA_ERROR_NOT_READY, "device not ready"),
	SIM_ERR(CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED,
		"peer access is already enabled"),
	SIM_ERR(CUDA_ERROR_PEER_ACCESS_NOT_ENABLED, "peer access has not been enabled"),
	SIM_ERR(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
		"operation not permitted when stream is capturing"),
	SIM_ERR(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
		"operation failed due to a previous error during capture"),
	SIM_ERR(CUDA_ERROR_STREAM_CAPTURE_UNMATCHED, "capture was not initiated in this stream"),
	SIM_ERR(CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD,
		"attempt to terminate a thread-local capture sequence from another thread"),
	SIM_ERR(CUDA_ERROR_UNKNOWN, "unknown error"),
};

static CUresult sim_error_lookup(CUresult error, const char **out, bool name)
{
	size_t i;

	if (!out)
		return CUDA_ERROR_INVALID_VALUE;
	for (i = 0; i < sizeof(sim_errors) / sizeof(sim_errors[0]); i++) {
		if (sim_errors[i].code == error) {
			*out = name ? sim_errors[i].name : sim_errors[i].text;
			return CUDA_SUCCESS;
		}
	}
	*out = NULL;
	return CUDA_ERROR_INVALID_VALUE;
}

CUresult sim_impl_cuGetErrorString(CUresult error, const char **str)
{
	return sim_error_lookup(error, str, false);
}

CUresult sim_impl_cuGetErrorName(CUresult error, const char **str)
{
	return sim_error_lookup(error, str, true);
}

/* CU_MODULE_LAZY_LOADING: what the runtime asks before anything else. */
#define SIM_MODULE_LAZY_LOADING 2

CUresult sim_impl_cuModuleGetLoadingMode(int *mode)
{
	SIM_REQUIRE_INIT();
	if (mode == NULL)
		return CUDA_ERROR_INVALID_VALUE;
	*mode = SIM_MODULE_LAZY_LOADING;
	return CUDA_SUCCESS;
}

/* The runtime's private tables: sim_tables.c. */
CUresult sim_impl_cuGetExportTable(const void **table, const CUuuid *table_id)
{
	SIM_REQUIRE_INIT();
	if (table == NULL || table_id == NULL)
		return CUDA_ERROR_INVALID_VALUE;
	return sim_export_table(table, table_id);
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

/*
 * cuGetProcAddress answers as the real driver does, measured without a GPU:
 * the newest ABI variant of the name introduced at or before the version
 * asked for (versions above the driver's own are accepted); the per-thread
 * default stream variant when flags ask for it and the name has one, and
 * then NULL with VERSION_NOT_SUFFICIENT below that variant's version rather
 * than the legacy one. v2 answers a miss with rc 0, a status and NULL; v1
 * with CUDA_ERROR_NOT_FOUND and *pfn untouched. The rows come from CUDA's
 * own cudaTypedefs.h (cuda_api.gen.h), sorted once by name for lookup.
 */
static const struct sim_proc **sim_proc_index;
static pthread_once_t sim_proc_once = PTHREAD_ONCE_INIT;

static int sim_proc_cmp(const void *a, const void *b)
{
	const struct sim_proc *pa = *(const struct sim_proc *const *)a;
	const struct sim_proc *pb = *(const struct sim_proc *const *)b;

	return strcmp(pa->base, pb->base);
}

static void sim_proc_sort(void)
{
	const struct sim_proc **v = malloc(sim_nprocs * sizeof(*v));
	unsigned int i;

	if (!v)
		return;
	for (i = 0; i < sim_nprocs; i++)
		v[i] = &sim_procs[i];
	qsort(v, sim_nprocs, sizeof(*v), sim_proc_cmp);
	sim_proc_index = v;
}

/* The first index row for base, or sim_nprocs if there is none. */
static unsigned int sim_proc_first(const char *base)
{
	unsigned int lo = 0, hi = sim_nprocs;

	while (lo < hi) {
		unsigned int mid = lo + (hi - lo) / 2;

		if (strcmp(sim_proc_index[mid]->base, base) < 0)
			lo = mid + 1;
		else
			hi = mid;
	}
	return lo < sim_nprocs && strcmp(sim_proc_index[lo]->base, base) == 0 ? lo : sim_nprocs;
}

static CUdriverProcAddressQueryResult sim_proc_lookup(const char *symbol, int version,
						      bool per_thread, void **fn)
{
	const struct sim_proc *best = NULL;
	bool has_per_thread = false;
	unsigned int i;

	pthread_once(&sim_proc_once, sim_proc_sort);
	i = sim_proc_index ? sim_proc_first(symbol) : sim_nprocs;
	if (i == sim_nprocs)
		return CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
	for (; i < sim_nprocs && strcmp(sim_proc_index[i]->base, symbol) == 0; i++)
		has_per_thread |= sim_proc_index[i]->per_thread;
	for (i = sim_proc_first(symbol); i < sim_nprocs && !strcmp(sim_proc_index[i]->base, symbol);
	     i++) {
		const struct sim_proc *p = sim_proc_index[i];

		if (p->per_thread != (per_thread && has_per_thread) || p->first_version > version)
			continue;
		if (!best || p->first_version > best->first_version)
			best = p;
	}
	if (!best)
		return CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
	*fn = best->fn;
	return CU_GET_PROC_ADDRESS_SUCCESS;
}

static CUresult sim_get_proc(const char *symbol, void **pfn, int cuda_version, cuuint64_t flags,
			     CUdriverProcAddressQueryResult *status, bool v1)
{
	const cuuint64_t valid = CU_GET_PROC_ADDRESS_LEGACY_STREAM |
				 CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
	CUdriverProcAddressQueryResult result;
	void *fn = NULL;

	if (!symbol || !pfn || (flags & ~valid))
		return CUDA_ERROR_INVALID_VALUE;
	result = sim_proc_lookup(symbol, cuda_version,
				 flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, &fn);
	if (v1) {
		if (result != CU_GET_PROC_ADDRESS_SUCCESS)
			return CUDA_ERROR_NOT_FOUND;
		*pfn = fn;
		return CUDA_SUCCESS;
	}
	*pfn = fn;
	if (status)
		*status = result;
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuGetProcAddress(const char *symbol, void **pfn, int cuda_version,
				   cuuint64_t flags)
{
	return sim_get_proc(symbol, pfn, cuda_version, flags, NULL, true);
}

CUresult sim_impl_cuGetProcAddress_v2(const char *symbol, void **pfn, int cuda_version,
				      cuuint64_t flags, CUdriverProcAddressQueryResult *status)
{
	return sim_get_proc(symbol, pfn, cuda_version, flags, status, false);
}

/*
 * What real libcudart and PyTorch need beyond allocation: copies and
 * memsets that move real bytes, host memory, pointer queries, events,
 * stream capture and graphs that replay their copies, modules and kernels
 * (loaded, never run), occupancy, pools' attributes, IPC between processes.
 */

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

/*
 * One operation of a stream: done at once, or recorded into the graph the
 * stream is capturing, to be done at each launch of it.
 */
enum sim_op_kind { SIM_OP_COPY = 1, SIM_OP_SET, SIM_OP_HOST, SIM_OP_KERNEL };

struct sim_op {
	enum sim_op_kind kind;
	uintptr_t dst, src;
	size_t width;		/* bytes per row (copies) or elements per row (sets) */
	size_t height;
	size_t dpitch, spitch;
	uint32_t value;
	unsigned int elem;	/* memset element size: 1, 2 or 4 */
	CUhostFn fn;
	void *data;
};

struct CUgraph_st {
	struct sim_obj obj;
	struct sim_op *ops;
	size_t nops, cap;
};

struct CUgraphExec_st {
	struct sim_obj obj;
	struct sim_op *ops;
	size_t nops;
};

static void sim_op_run(const struct sim_op *op)
{
	size_t r, i;

	switch (op->kind) {
	case SIM_OP_COPY:
		for (r = 0; r < op->height; r++)
			memmove((void *)(op->dst + r * op->dpitch),
				(const void *)(op->src + r * op->spitch), op->width);
		break;
	case SIM_OP_SET:
		for (r = 0; r < op->height; r++) {
			uintptr_t row = op->dst + r * op->dpitch;

			if (op->elem == 1) {
				memset((void *)row, (int)(op->value & 0xff), op->width);
				continue;
			}
			for (i = 0; i < op->width; i++) {
				if (op->elem == 2)
					((uint16_t *)row)[i] = (uint16_t)op->value;
				else
					((uint32_t *)row)[i] = op->value;
			}
		}
		break;
	case SIM_OP_HOST:
		op->fn(op->data);
		break;
	case SIM_OP_KERNEL:
		/* Kernels do not execute: what they would compute stays as it was. */
		break;
	}
}

static bool sim_graph_add(struct CUgraph_st *g, const struct sim_op *op)
{
	if (g->nops == g->cap) {
		size_t cap = g->cap ? g->cap * 2 : 16;
		struct sim_op *v = realloc(g->ops, cap * sizeof(*v));

		if (!v)
			return false;
		g->ops = v;
		g->cap = cap;
	}
	g->ops[g->nops++] = *op;
	return true;
}

/*
 * With sim_obj_lock held: the stream object behind a non-default handle, or
 * NULL (default streams are never captured).
 */
static struct CUstream_st *sim_stream_locked(CUstream stream)
{
	struct sim_obj **pp;

	if (sim_default_stream(stream))
		return NULL;
	pp = sim_obj_find(stream, SIM_OBJ_STREAM);
	return pp ? (struct CUstream_st *)*pp : NULL;
}

/* Does op on stream now, or records it there while the stream is capturing. */
static CUresult sim_stream_do(CUstream stream, const struct sim_op *op)
{
	struct sim_ctx_slot slot;
	struct CUstream_st *s;
	CUresult rc;
	bool recorded = false;

	SIM_REQUIRE_INIT();
	rc = sim_stream_slot(stream, &slot);
	if (rc != CUDA_SUCCESS)
		return rc;
	pthread_mutex_lock(&sim_obj_lock);
	s = sim_stream_locked(stream);
	if (s && s->capture_status == CU_STREAM_CAPTURE_STATUS_ACTIVE) {
		if (!sim_graph_add(s->capture, op))
			rc = CUDA_ERROR_OUT_OF_MEMORY;
		recorded = true;
	}
	pthread_mutex_unlock(&sim_obj_lock);
	if (!recorded)
		sim_op_run(op);
	return rc;
}

/* Copies. Device sides must lie in device (or page-locked) memory. */

static CUresult sim_copy(uintptr_t dst, uintptr_t src, size_t n, bool dst_dev, bool src_dev,
			 CUstream stream)
{
	struct sim_op op = { .kind = SIM_OP_COPY, .dst = dst, .src = src, .width = n,
			     .height = 1 };

	SIM_REQUIRE_INIT();
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

	SIM_REQUIRE_INIT();
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

	SIM_REQUIRE_INIT();
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

	SIM_REQUIRE_INIT();
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

	SIM_REQUIRE_INIT();
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

	SIM_REQUIRE_INIT();
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

	SIM_REQUIRE_INIT();
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

	SIM_REQUIRE_INIT();
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

	SIM_REQUIRE_INIT();
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

	SIM_REQUIRE_INIT();
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

	SIM_REQUIRE_INIT();
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

	SIM_REQUIRE_INIT();
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

	SIM_REQUIRE_INIT();
	if (!value || attr != CU_POINTER_ATTRIBUTE_SYNC_MEMOPS || !sim_ptr_find(p, &info))
		return CUDA_ERROR_INVALID_VALUE;
	return CUDA_SUCCESS;
}

/* Managed memory never migrates here: advice and prefetches are checked, then done. */
static CUresult sim_managed_range(CUdeviceptr p, size_t n)
{
	SIM_REQUIRE_INIT();
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

/*
 * Events. Nothing runs asynchronously, so an event is complete as soon as
 * it is recorded; it keeps the time of its recording for cuEventElapsedTime.
 */
struct CUevent_st {
	struct sim_obj obj;
	unsigned int flags;
	bool recorded;
	struct timespec when;
	/* Recorded in a capture: a stream that waits on it joins that capture. */
	struct CUgraph_st *capture;
	uint64_t capture_id;
	int capture_mode;
};

CUresult sim_impl_cuEventCreate(CUevent *pe, unsigned int flags)
{
	struct CUevent_st *e;

	SIM_REQUIRE_INIT();
	if (!pe || (flags & ~0x7u))
		return CUDA_ERROR_INVALID_VALUE;
	/* Interprocess events must not time, as the documentation requires. */
	if ((flags & CU_EVENT_INTERPROCESS) && !(flags & CU_EVENT_DISABLE_TIMING))
		return CUDA_ERROR_INVALID_VALUE;
	if (!sim_depth)
		return CUDA_ERROR_INVALID_CONTEXT;
	e = calloc(1, sizeof(*e));
	if (!e)
		return CUDA_ERROR_OUT_OF_MEMORY;
	e->obj.kind = SIM_OBJ_EVENT;
	e->obj.dev = sim_current_dev();
	e->flags = flags;
	sim_obj_add(&e->obj);
	*pe = e;
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuEventDestroy_v2(CUevent e)
{
	struct sim_obj seen, *o;

	SIM_REQUIRE_INIT();
	o = sim_obj_lookup(e, SIM_OBJ_EVENT, true, &seen);
	if (!o)
		return CUDA_ERROR_INVALID_HANDLE;
	free(o);
	return CUDA_SUCCESS;
}

static CUresult sim_event_record(CUevent ev, CUstream stream)
{
	struct sim_ctx_slot slot;
	struct sim_obj **pp;
	struct CUstream_st *s;
	CUresult rc;

	SIM_REQUIRE_INIT();
	rc = sim_stream_slot(stream, &slot);
	if (rc != CUDA_SUCCESS)
		return rc;
	pthread_mutex_lock(&sim_obj_lock);
	pp = sim_obj_find(ev, SIM_OBJ_EVENT);
	s = sim_stream_locked(stream);
	if (!pp) {
		rc = CUDA_ERROR_INVALID_HANDLE;
	} else if (!s || s->capture_status != CU_STREAM_CAPTURE_STATUS_ACTIVE) {
		struct CUevent_st *e = (struct CUevent_st *)*pp;

		e->recorded = true;
		e->capture = NULL;
		e->capture_id = 0;
		clock_gettime(CLOCK_MONOTONIC, &e->when);
	} else {
		struct CUevent_st *e = (struct CUevent_st *)*pp;

		e->capture = s->capture;
		e->capture_id = s->capture_id;
		e->capture_mode = s->capture_mode;
	}
	pthread_mutex_unlock(&sim_obj_lock);
	return rc;
}

CUresult sim_impl_cuEventRecord(CUevent e, CUstream s)
{
	return sim_event_record(e, s);
}

CUresult sim_impl_cuEventRecordWithFlags(CUevent e, CUstream s, unsigned int flags)
{
	(void)flags;
	return sim_event_record(e, s);
}

static CUresult sim_event_check(CUevent e)
{
	struct sim_obj seen;

	SIM_REQUIRE_INIT();
	return sim_obj_lookup(e, SIM_OBJ_EVENT, false, &seen) ? CUDA_SUCCESS
							      : CUDA_ERROR_INVALID_HANDLE;
}

CUresult sim_impl_cuEventQuery(CUevent e)
{
	return sim_event_check(e);
}

CUresult sim_impl_cuEventSynchronize(CUevent e)
{
	CUresult rc = sim_event_check(e);

	if (rc == CUDA_SUCCESS)
		sim_pools_settle();
	return rc;
}

CUresult sim_impl_cuEventElapsedTime(float *ms, CUevent start, CUevent end)
{
	struct CUevent_st a = { .recorded = false }, b = { .recorded = false };
	struct sim_obj **pa, **pb;
	CUresult rc = CUDA_SUCCESS;

	SIM_REQUIRE_INIT();
	if (!ms)
		return CUDA_ERROR_INVALID_VALUE;
	pthread_mutex_lock(&sim_obj_lock);
	pa = sim_obj_find(start, SIM_OBJ_EVENT);
	pb = sim_obj_find(end, SIM_OBJ_EVENT);
	if (pa && pb) {
		a = *(struct CUevent_st *)*pa;
		b = *(struct CUevent_st *)*pb;
	}
	pthread_mutex_unlock(&sim_obj_lock);
	if (!pa || !pb)
		return CUDA_ERROR_INVALID_HANDLE;
	/* Documented: an event that times nothing, or was never recorded. */
	if ((a.flags | b.flags) & CU_EVENT_DISABLE_TIMING || !a.recorded || !b.recorded)
		return CUDA_ERROR_INVALID_HANDLE;
	*ms = (float)((double)(b.when.tv_sec - a.when.tv_sec) * 1e3 +
		      (double)(b.when.tv_nsec - a.when.tv_nsec) / 1e6);
	return rc;
}

CUresult sim_impl_cuEventElapsedTime_v2(float *ms, CUevent start, CUevent end)
{
	return sim_impl_cuEventElapsedTime(ms, start, end);
}

/* Waits are already over: nothing is outstanding anywhere. */
/*
 * Waits are already over: nothing is outstanding anywhere. A stream that
 * waits on an event recorded in a capture joins that capture (the fork of
 * work onto another stream during a capture), as the driver documents.
 */
CUresult sim_impl_cuStreamWaitEvent(CUstream stream, CUevent ev, unsigned int flags)
{
	struct sim_ctx_slot slot;
	struct CUstream_st *s;
	struct sim_obj **pp;
	CUresult rc;

	(void)flags;
	SIM_REQUIRE_INIT();
	rc = sim_stream_slot(stream, &slot);
	if (rc != CUDA_SUCCESS)
		return rc;
	pthread_mutex_lock(&sim_obj_lock);
	pp = sim_obj_find(ev, SIM_OBJ_EVENT);
	s = sim_stream_locked(stream);
	if (!pp) {
		rc = CUDA_ERROR_INVALID_HANDLE;
	} else if (((struct CUevent_st *)*pp)->capture_id) {
		const struct CUevent_st *e = (const struct CUevent_st *)*pp;

		if (!s)
			rc = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
		else if (s->capture_status == CU_STREAM_CAPTURE_STATUS_NONE) {
			s->capture_status = CU_STREAM_CAPTURE_STATUS_ACTIVE;
			s->capture = e->capture;
			s->capture_id = e->capture_id;
			s->capture_mode = e->capture_mode;
			s->capture_origin = false;
		}
	}
	pthread_mutex_unlock(&sim_obj_lock);
	return rc;
}

/* An event IPC handle names the event's process; the opener gets an event of its own. */
#define SIM_IPC_MAGIC 0x50495347u	/* "GSIP" */

struct sim_ipc_event {
	uint32_t magic;
	uint32_t pid;
};

CUresult sim_impl_cuIpcGetEventHandle(CUipcEventHandle *h, CUevent ev)
{
	struct sim_ipc_event rec = { SIM_IPC_MAGIC, (uint32_t)getpid() };
	struct sim_obj **pp;
	unsigned int flags = 0;

	SIM_REQUIRE_INIT();
	if (!h)
		return CUDA_ERROR_INVALID_VALUE;
	pthread_mutex_lock(&sim_obj_lock);
	pp = sim_obj_find(ev, SIM_OBJ_EVENT);
	if (pp)
		flags = ((struct CUevent_st *)*pp)->flags;
	pthread_mutex_unlock(&sim_obj_lock);
	if (!pp)
		return CUDA_ERROR_INVALID_HANDLE;
	if (!(flags & CU_EVENT_INTERPROCESS))
		return CUDA_ERROR_INVALID_VALUE;
	memset(h, 0, sizeof(*h));
	memcpy(h->reserved, &rec, sizeof(rec));
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuIpcOpenEventHandle(CUevent *pe, CUipcEventHandle h)
{
	struct sim_ipc_event rec;

	SIM_REQUIRE_INIT();
	memcpy(&rec, h.reserved, sizeof(rec));
	if (!pe || rec.magic != SIM_IPC_MAGIC)
		return CUDA_ERROR_INVALID_VALUE;
	return sim_impl_cuEventCreate(pe, CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING);
}

/* Streams: priorities, flags, queries, callbacks, capture. */

CUresult sim_impl_cuStreamCreateWithPriority(CUstream *stream, unsigned int flags, int priority)
{
	CUresult rc = sim_impl_cuStreamCreate(stream, flags);

	if (rc == CUDA_SUCCESS) {
		/* The documented range is [-5, 0]; others are clamped to it. */
		struct CUstream_st *s = *stream;

		s->priority = priority < -5 ? -5 : priority > 0 ? 0 : priority;
	}
	return rc;
}

/* A copy of the stream's state, for the queries; default streams read as zeros. */
static CUresult sim_stream_state(CUstream stream, struct CUstream_st *out)
{
	struct sim_ctx_slot slot;
	struct CUstream_st *s;
	CUresult rc;

	SIM_REQUIRE_INIT();
	rc = sim_stream_slot(stream, &slot);
	if (rc != CUDA_SUCCESS)
		return rc;
	memset(out, 0, sizeof(*out));
	out->obj.dev = slot.dev;
	pthread_mutex_lock(&sim_obj_lock);
	s = sim_stream_locked(stream);
	if (s)
		*out = *s;
	pthread_mutex_unlock(&sim_obj_lock);
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuStreamGetPriority(CUstream stream, int *priority)
{
	struct CUstream_st s;
	CUresult rc = priority ? sim_stream_state(stream, &s) : CUDA_ERROR_INVALID_VALUE;

	if (rc == CUDA_SUCCESS)
		*priority = s.priority;
	return rc;
}

CUresult sim_impl_cuStreamGetFlags(CUstream stream, unsigned int *flags)
{
	struct CUstream_st s;
	CUresult rc = flags ? sim_stream_state(stream, &s) : CUDA_ERROR_INVALID_VALUE;

	if (rc == CUDA_SUCCESS)
		*flags = s.flags;
	return rc;
}

CUresult sim_impl_cuStreamGetId(CUstream stream, unsigned long long *id)
{
	struct CUstream_st s;
	CUresult rc = id ? sim_stream_state(stream, &s) : CUDA_ERROR_INVALID_VALUE;

	if (rc == CUDA_SUCCESS)
		*id = s.id;
	return rc;
}

CUresult sim_impl_cuStreamGetDevice(CUstream stream, CUdevice *dev)
{
	struct CUstream_st s;
	CUresult rc = dev ? sim_stream_state(stream, &s) : CUDA_ERROR_INVALID_VALUE;

	if (rc == CUDA_SUCCESS)
		*dev = s.obj.dev;
	return rc;
}

/* Everything on a stream is done by the time its call returns. */
CUresult sim_impl_cuStreamQuery(CUstream stream)
{
	struct sim_ctx_slot slot;

	SIM_REQUIRE_INIT();
	return sim_stream_slot(stream, &slot);
}

CUresult sim_impl_cuLaunchHostFunc(CUstream stream, CUhostFn fn, void *data)
{
	struct sim_op op = { .kind = SIM_OP_HOST, .fn = fn, .data = data };

	if (!fn)
		return CUDA_ERROR_INVALID_VALUE;
	return sim_stream_do(stream, &op);
}

CUresult sim_impl_cuStreamAddCallback(CUstream stream, CUstreamCallback cb, void *data,
				      unsigned int flags)
{
	struct sim_ctx_slot slot;
	CUresult rc;

	SIM_REQUIRE_INIT();
	if (!cb || flags != 0)
		return CUDA_ERROR_INVALID_VALUE;
	rc = sim_stream_slot(stream, &slot);
	if (rc == CUDA_SUCCESS)
		cb(stream, CUDA_SUCCESS, data);
	return rc;
}

CUresult sim_impl_cuCtxGetStreamPriorityRange(int *least, int *greatest)
{
	SIM_REQUIRE_INIT();
	if (least)
		*least = 0;
	if (greatest)
		*greatest = -5;
	return CUDA_SUCCESS;
}

/*
 * Stream capture: between begin and end, the stream's copies, memsets,
 * kernels and host functions are recorded into a graph instead of being
 * done; each launch of the instantiated graph does them. Default streams
 * cannot be captured.
 */
static __thread int sim_capture_mode;	/* cuThreadExchangeStreamCaptureMode */
static uint64_t sim_capture_serial;	/* atomic */

static struct CUgraph_st *sim_graph_new(void)
{
	struct CUgraph_st *g = calloc(1, sizeof(*g));

	if (g)
		g->obj.kind = SIM_OBJ_GRAPH;
	return g;
}

/*
 * With sim_obj_lock held: capture id is over. Every stream in it (the one
 * that began it, and those that joined) stops capturing, and events
 * recorded in it no longer pull streams into it.
 */
static void sim_capture_end_locked(uint64_t id)
{
	struct sim_obj *o;

	for (o = sim_obj_list; o; o = o->next) {
		if (o->kind == SIM_OBJ_STREAM && ((struct CUstream_st *)o)->capture_id == id) {
			struct CUstream_st *s = (struct CUstream_st *)o;

			s->capture = NULL;
			s->capture_id = 0;
			s->capture_status = CU_STREAM_CAPTURE_STATUS_NONE;
			s->capture_origin = false;
		} else if (o->kind == SIM_OBJ_EVENT && ((struct CUevent_st *)o)->capture_id == id) {
			((struct CUevent_st *)o)->capture = NULL;
			((struct CUevent_st *)o)->capture_id = 0;
		}
	}
}

static CUresult sim_begin_capture(CUstream stream, int mode)
{
	struct CUgraph_st *g;
	struct CUstream_st *s;
	CUresult rc = CUDA_SUCCESS;

	SIM_REQUIRE_INIT();
	if (mode < CU_STREAM_CAPTURE_MODE_GLOBAL || mode > CU_STREAM_CAPTURE_MODE_RELAXED)
		return CUDA_ERROR_INVALID_VALUE;
	if (sim_default_stream(stream))
		return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
	g = sim_graph_new();
	if (!g)
		return CUDA_ERROR_OUT_OF_MEMORY;
	pthread_mutex_lock(&sim_obj_lock);
	s = sim_stream_locked(stream);
	if (!s) {
		rc = CUDA_ERROR_INVALID_HANDLE;
	} else if (s->capture_status != CU_STREAM_CAPTURE_STATUS_NONE) {
		rc = CUDA_ERROR_ILLEGAL_STATE;
	} else {
		s->capture_status = CU_STREAM_CAPTURE_STATUS_ACTIVE;
		s->capture_mode = mode;
		s->capture_id = __atomic_add_fetch(&sim_capture_serial, 1, __ATOMIC_RELAXED);
		s->capture = g;
		s->capture_origin = true;
		g = NULL;
	}
	pthread_mutex_unlock(&sim_obj_lock);
	free(g);
	return rc;
}

CUresult sim_impl_cuStreamBeginCapture(CUstream stream)
{
	return sim_begin_capture(stream, CU_STREAM_CAPTURE_MODE_GLOBAL);
}

CUresult sim_impl_cuStreamBeginCapture_v2(CUstream stream, int mode)
{
	return sim_begin_capture(stream, mode);
}

CUresult sim_impl_cuStreamEndCapture(CUstream stream, CUgraph *pg)
{
	struct CUgraph_st *g = NULL;
	struct CUstream_st *s;
	CUresult rc = CUDA_SUCCESS;

	SIM_REQUIRE_INIT();
	if (!pg)
		return CUDA_ERROR_INVALID_VALUE;
	pthread_mutex_lock(&sim_obj_lock);
	s = sim_stream_locked(stream);
	if (!s || s->capture_status == CU_STREAM_CAPTURE_STATUS_NONE) {
		rc = s || sim_default_stream(stream) ? CUDA_ERROR_ILLEGAL_STATE
						       : CUDA_ERROR_INVALID_HANDLE;
	} else if (!s->capture_origin) {
		rc = CUDA_ERROR_STREAM_CAPTURE_UNMATCHED;
	} else {
		if (s->capture_status == CU_STREAM_CAPTURE_STATUS_INVALIDATED)
			rc = CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
		g = s->capture;
		sim_capture_end_locked(s->capture_id);
	}
	pthread_mutex_unlock(&sim_obj_lock);
	if (g && rc != CUDA_SUCCESS) {
		sim_graph_free(g);
		g = NULL;
	}
	if (g)
		sim_obj_add(&g->obj);
	*pg = g;
	return rc;
}

CUresult sim_impl_cuStreamIsCapturing(CUstream stream, int *status)
{
	struct CUstream_st s;
	CUresult rc = status ? sim_stream_state(stream, &s) : CUDA_ERROR_INVALID_VALUE;

	if (rc == CUDA_SUCCESS)
		*status = s.capture_status;
	return rc;
}

/* Any output may be NULL. Captured work has no dependencies to report. */
static CUresult sim_capture_info(CUstream stream, int *status, uint64_t *id, CUgraph *graph,
				 const void **deps, const void **edges, size_t *ndeps)
{
	struct CUstream_st s;
	CUresult rc = sim_stream_state(stream, &s);

	if (rc != CUDA_SUCCESS)
		return rc;
	if (!status)
		return CUDA_ERROR_INVALID_VALUE;
	*status = s.capture_status;
	if (s.capture_status != CU_STREAM_CAPTURE_STATUS_NONE) {
		if (id)
			*id = s.capture_id;
		if (graph)
			*graph = s.capture;
		if (deps)
			*deps = NULL;
		if (edges)
			*edges = NULL;
		if (ndeps)
			*ndeps = 0;
	}
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuStreamGetCaptureInfo(CUstream stream, int *status, uint64_t *id)
{
	return sim_capture_info(stream, status, id, NULL, NULL, NULL, NULL);
}

CUresult sim_impl_cuStreamGetCaptureInfo_v2(CUstream stream, int *status, uint64_t *id,
					    CUgraph *graph, const void **deps, size_t *ndeps)
{
	return sim_capture_info(stream, status, id, graph, deps, NULL, ndeps);
}

CUresult sim_impl_cuStreamGetCaptureInfo_v3(CUstream stream, int *status, uint64_t *id,
					    CUgraph *graph, const void **deps, const void **edges,
					    size_t *ndeps)
{
	return sim_capture_info(stream, status, id, graph, deps, edges, ndeps);
}

CUresult sim_impl_cuThreadExchangeStreamCaptureMode(int *mode)
{
	int old;

	if (!mode || *mode < CU_STREAM_CAPTURE_MODE_GLOBAL || *mode > CU_STREAM_CAPTURE_MODE_RELAXED)
		return CUDA_ERROR_INVALID_VALUE;
	old = sim_capture_mode;
	sim_capture_mode = *mode;
	*mode = old;
	return CUDA_SUCCESS;
}

/* Graphs. */

CUresult sim_impl_cuGraphCreate(CUgraph *pg, unsigned int flags)
{
	struct CUgraph_st *g;

	SIM_REQUIRE_INIT();
	if (!pg || flags != 0)
		return CUDA_ERROR_INVALID_VALUE;
	g = sim_graph_new();
	if (!g)
		return CUDA_ERROR_OUT_OF_MEMORY;
	sim_obj_add(&g->obj);
	*pg = g;
	return CUDA_SUCCESS;
}

static void sim_graph_free(struct CUgraph_st *g)
{
	if (g)
		free(g->ops);
	free(g);
}

CUresult sim_impl_cuGraphDestroy(CUgraph g)
{
	struct sim_obj seen, *o;

	SIM_REQUIRE_INIT();
	o = sim_obj_lookup(g, SIM_OBJ_GRAPH, true, &seen);
	if (!o)
		return CUDA_ERROR_INVALID_VALUE;
	sim_graph_free((struct CUgraph_st *)o);
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuGraphGetNodes(CUgraph g, void **nodes, size_t *n)
{
	struct sim_obj **pp;
	size_t count = 0, i;

	SIM_REQUIRE_INIT();
	if (!n)
		return CUDA_ERROR_INVALID_VALUE;
	pthread_mutex_lock(&sim_obj_lock);
	pp = sim_obj_find(g, SIM_OBJ_GRAPH);
	if (pp)
		count = ((struct CUgraph_st *)*pp)->nops;
	pthread_mutex_unlock(&sim_obj_lock);
	if (!pp)
		return CUDA_ERROR_INVALID_VALUE;
	/* Node handles are the graph's address and the node's position: opaque, distinct. */
	for (i = 0; nodes && i < *n; i++)
		nodes[i] = i < count ? (char *)g + i + 1 : NULL;
	*n = count;
	return CUDA_SUCCESS;
}

static CUresult sim_instantiate(CUgraphExec *pe, CUgraph g)
{
	struct CUgraphExec_st *e;
	struct sim_obj **pp;
	CUresult rc = CUDA_SUCCESS;

	SIM_REQUIRE_INIT();
	if (!pe)
		return CUDA_ERROR_INVALID_VALUE;
	e = calloc(1, sizeof(*e));
	if (!e)
		return CUDA_ERROR_OUT_OF_MEMORY;
	e->obj.kind = SIM_OBJ_EXEC;
	pthread_mutex_lock(&sim_obj_lock);
	pp = sim_obj_find(g, SIM_OBJ_GRAPH);
	if (!pp) {
		rc = CUDA_ERROR_INVALID_VALUE;
	} else {
		const struct CUgraph_st *src = (const struct CUgraph_st *)*pp;

		e->nops = src->nops;
		e->ops = src->nops ? malloc(src->nops * sizeof(*e->ops)) : NULL;
		if (src->nops && !e->ops)
			rc = CUDA_ERROR_OUT_OF_MEMORY;
		else if (src->nops)
			memcpy(e->ops, src->ops, src->nops * sizeof(*e->ops));
	}
	pthread_mutex_unlock(&sim_obj_lock);
	if (rc != CUDA_SUCCESS) {
		free(e->ops);
		free(e);
		return rc;
	}
	sim_obj_add(&e->obj);
	*pe = e;
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuGraphInstantiateWithFlags(CUgraphExec *pe, CUgraph g,
					      unsigned long long flags)
{
	(void)flags;
	return sim_instantiate(pe, g);
}

CUresult sim_impl_cuGraphInstantiate(CUgraphExec *pe, CUgraph g, void *err_node, char *log,
				     size_t log_size)
{
	(void)err_node;
	if (log && log_size)
		log[0] = '\0';
	return sim_instantiate(pe, g);
}

CUresult sim_impl_cuGraphInstantiate_v2(CUgraphExec *pe, CUgraph g, void *err_node, char *log,
					size_t log_size)
{
	return sim_impl_cuGraphInstantiate(pe, g, err_node, log, log_size);
}

/* CUDA_GRAPH_INSTANTIATE_PARAMS: flags, upload stream, error node, result. */
struct sim_instantiate_params {
	uint64_t flags;
	CUstream upload;
	void *err_node;
	int result;
};

CUresult sim_impl_cuGraphInstantiateWithParams(CUgraphExec *pe, CUgraph g,
					       struct sim_instantiate_params *params)
{
	CUresult rc = sim_instantiate(pe, g);

	if (params)
		params->result = rc == CUDA_SUCCESS ? 0 : 1;
	return rc;
}

CUresult sim_impl_cuGraphExecDestroy(CUgraphExec e)
{
	struct sim_obj seen, *o;

	SIM_REQUIRE_INIT();
	o = sim_obj_lookup(e, SIM_OBJ_EXEC, true, &seen);
	if (!o)
		return CUDA_ERROR_INVALID_VALUE;
	free(((struct CUgraphExec_st *)o)->ops);
	free(o);
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuGraphUpload(CUgraphExec e, CUstream stream)
{
	struct sim_obj seen;

	(void)stream;
	SIM_REQUIRE_INIT();
	return sim_obj_lookup(e, SIM_OBJ_EXEC, false, &seen) ? CUDA_SUCCESS
							     : CUDA_ERROR_INVALID_VALUE;
}

/*
 * A launch does the graph's recorded operations in order, or records them
 * into the capture of a capturing stream (a graph launched in a capture).
 * The ops are copied out first so that none runs under the lock (a host
 * function may call back into the driver). A handle the driver never made
 * is taken on trust, as before graphs were simulated: there is nothing to
 * do for it.
 */
static CUresult sim_graph_run(CUgraphExec exec, CUstream stream)
{
	struct sim_op *ops = NULL;
	struct CUstream_st *s;
	struct sim_obj **pp;
	size_t n = 0, i;
	CUresult rc = CUDA_SUCCESS;

	pthread_mutex_lock(&sim_obj_lock);
	pp = sim_obj_find(exec, SIM_OBJ_EXEC);
	s = sim_stream_locked(stream);
	if (pp && s && s->capture_status == CU_STREAM_CAPTURE_STATUS_ACTIVE) {
		const struct CUgraphExec_st *e = (const struct CUgraphExec_st *)*pp;

		for (i = 0; i < e->nops && rc == CUDA_SUCCESS; i++)
			if (!sim_graph_add(s->capture, &e->ops[i]))
				rc = CUDA_ERROR_OUT_OF_MEMORY;
		pp = NULL;
	}
	if (pp) {
		const struct CUgraphExec_st *e = (const struct CUgraphExec_st *)*pp;

		ops = e->nops ? malloc(e->nops * sizeof(*ops)) : NULL;
		if (ops) {
			memcpy(ops, e->ops, e->nops * sizeof(*ops));
			n = e->nops;
		}
	}
	pthread_mutex_unlock(&sim_obj_lock);
	for (i = 0; i < n; i++)
		sim_op_run(&ops[i]);
	free(ops);
	return rc;
}

/* Graph memory (cudaMallocAsync inside captures) is plain pool memory here. */
CUresult sim_impl_cuDeviceGraphMemTrim(CUdevice dev)
{
	return sim_check_dev(dev);
}

CUresult sim_impl_cuDeviceGetGraphMemAttribute(CUdevice dev, int attr, void *value)
{
	CUresult rc = sim_check(value, dev);

	(void)attr;
	if (rc == CUDA_SUCCESS)
		*(uint64_t *)value = 0;
	return rc;
}

CUresult sim_impl_cuDeviceSetGraphMemAttribute(CUdevice dev, int attr, void *value)
{
	(void)attr;
	return sim_check(value, dev);
}

/*
 * Modules, libraries, kernels and functions. Code is loaded and never run:
 * a library or module is a handle, and each kernel name asked of it gets a
 * function object (a CUkernel and its CUfunction are the same object) with
 * H100-like attributes. Each device global asked for gets SIM_GLOBAL_BYTES
 * of device memory: the real sizes live in the image, which is not parsed,
 * and untouched pages cost nothing.
 */
#define SIM_GLOBAL_BYTES ((size_t)1 << 20)

struct CUlib_st {
	struct sim_obj obj;
};

struct CUfunc_st {
	struct sim_obj obj;
	struct CUlib_st *lib;
	int max_dynamic_smem;
	int carveout;
	char name[];		/* mangled names run to hundreds of bytes */
};

static CUresult sim_library_new(CUlibrary *out, const void *code)
{
	struct CUlib_st *l;

	SIM_REQUIRE_INIT();
	if (!out || !code)
		return CUDA_ERROR_INVALID_VALUE;
	l = calloc(1, sizeof(*l));
	if (!l)
		return CUDA_ERROR_OUT_OF_MEMORY;
	l->obj.kind = SIM_OBJ_LIBRARY;
	sim_obj_add(&l->obj);
	*out = l;
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuLibraryLoadData(CUlibrary *lib, const void *code, void *jit_opts,
				    void *jit_vals, unsigned int njit, void *lib_opts,
				    void *lib_vals, unsigned int nlib)
{
	(void)jit_opts, (void)jit_vals, (void)njit, (void)lib_opts, (void)lib_vals, (void)nlib;
	return sim_library_new(lib, code);
}

CUresult sim_impl_cuLibraryLoadFromFile(CUlibrary *lib, const char *path, void *jit_opts,
					void *jit_vals, unsigned int njit, void *lib_opts,
					void *lib_vals, unsigned int nlib)
{
	(void)jit_opts, (void)jit_vals, (void)njit, (void)lib_opts, (void)lib_vals, (void)nlib;
	if (path && access(path, R_OK) != 0)
		return CUDA_ERROR_NOT_FOUND;
	return sim_library_new(lib, path);
}

CUresult sim_impl_cuModuleLoadData(CUmodule *mod, const void *image)
{
	return sim_library_new((CUlibrary *)mod, image);
}

CUresult sim_impl_cuModuleLoadDataEx(CUmodule *mod, const void *image, unsigned int n,
				     void *opts, void *vals)
{
	(void)n, (void)opts, (void)vals;
	return sim_library_new((CUlibrary *)mod, image);
}

CUresult sim_impl_cuModuleLoadFatBinary(CUmodule *mod, const void *fatbin)
{
	return sim_library_new((CUlibrary *)mod, fatbin);
}

CUresult sim_impl_cuModuleLoad(CUmodule *mod, const char *path)
{
	if (path && access(path, R_OK) != 0)
		return CUDA_ERROR_NOT_FOUND;
	return sim_library_new((CUlibrary *)mod, path);
}

/* The library and the functions made from it go together. */
static CUresult sim_library_unload(void *lib)
{
	struct sim_obj **pp, *o, *dead = NULL;
	bool found = false;

	SIM_REQUIRE_INIT();
	pthread_mutex_lock(&sim_obj_lock);
	for (pp = &sim_obj_list; (o = *pp);) {
		bool mine = (o == lib && o->kind == SIM_OBJ_LIBRARY) ||
			    ((o->kind == SIM_OBJ_FUNC || o->kind == SIM_OBJ_GLOBAL) &&
			     ((struct CUfunc_st *)o)->lib == lib);

		found |= o == lib && o->kind == SIM_OBJ_LIBRARY;
		if (mine) {
			*pp = o->next;
			o->next = dead;
			dead = o;
		} else {
			pp = &o->next;
		}
	}
	pthread_mutex_unlock(&sim_obj_lock);
	while ((o = dead)) {
		dead = o->next;
		if (o->kind == SIM_OBJ_GLOBAL)
			sim_mem_free(o->addr, SIM_MEM_PTR);
		free(o);
	}
	return found ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult sim_impl_cuLibraryUnload(CUlibrary lib)
{
	return sim_library_unload(lib);
}

CUresult sim_impl_cuModuleUnload(CUmodule mod)
{
	return sim_library_unload(mod);
}

CUresult sim_impl_cuLibraryGetModule(CUmodule *mod, CUlibrary lib)
{
	struct sim_obj seen;

	SIM_REQUIRE_INIT();
	if (!mod)
		return CUDA_ERROR_INVALID_VALUE;
	if (!sim_obj_lookup(lib, SIM_OBJ_LIBRARY, false, &seen))
		return CUDA_ERROR_INVALID_HANDLE;
	*mod = (CUmodule)lib;
	return CUDA_SUCCESS;
}

/*
 * With sim_obj_lock held: the function (or global) named name in lib, made
 * on first request.
 */
static CUresult sim_symbol_locked(struct CUfunc_st **out, void *lib, const char *name,
				  enum sim_obj_kind kind)
{
	struct sim_obj *o;
	struct CUfunc_st *f;

	if (!sim_obj_find(lib, SIM_OBJ_LIBRARY))
		return CUDA_ERROR_INVALID_HANDLE;
	for (o = sim_obj_list; o; o = o->next) {
		f = (struct CUfunc_st *)o;
		if (o->kind == kind && f->lib == lib && strcmp(f->name, name) == 0) {
			*out = f;
			return CUDA_SUCCESS;
		}
	}
	f = calloc(1, sizeof(*f) + strlen(name) + 1);
	if (!f)
		return CUDA_ERROR_OUT_OF_MEMORY;
	f->obj.kind = kind;
	f->lib = lib;
	f->max_dynamic_smem = 49152;
	f->carveout = -1;
	strcpy(f->name, name);
	f->obj.next = sim_obj_list;
	sim_obj_list = &f->obj;
	*out = f;
	return CUDA_SUCCESS;
}

static CUresult sim_symbol(struct CUfunc_st **out, void *lib, const char *name,
			   enum sim_obj_kind kind)
{
	CUresult rc;

	SIM_REQUIRE_INIT();
	if (!out || !name)
		return CUDA_ERROR_INVALID_VALUE;
	pthread_mutex_lock(&sim_obj_lock);
	rc = sim_symbol_locked(out, lib, name, kind);
	pthread_mutex_unlock(&sim_obj_lock);
	return rc;
}

static CUresult sim_function(struct CUfunc_st **out, void *lib, const char *name)
{
	return sim_symbol(out, lib, name, SIM_OBJ_FUNC);
}

CUresult sim_impl_cuLibraryGetKernel(CUkernel *k, CUlibrary lib, const char *name)
{
	return sim_function((struct CUfunc_st **)k, lib, name);
}

CUresult sim_impl_cuModuleGetFunction(CUfunction *f, CUmodule mod, const char *name)
{
	return sim_function(f, mod, name);
}

CUresult sim_impl_cuKernelGetFunction(CUfunction *f, CUkernel k)
{
	struct sim_obj seen;

	SIM_REQUIRE_INIT();
	if (!f)
		return CUDA_ERROR_INVALID_VALUE;
	if (!sim_obj_lookup(k, SIM_OBJ_FUNC, false, &seen))
		return CUDA_ERROR_INVALID_HANDLE;
	*f = (CUfunction)k;
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuKernelGetLibrary(CUlibrary *lib, CUkernel k)
{
	struct sim_obj **pp;

	SIM_REQUIRE_INIT();
	if (!lib)
		return CUDA_ERROR_INVALID_VALUE;
	pthread_mutex_lock(&sim_obj_lock);
	pp = sim_obj_find(k, SIM_OBJ_FUNC);
	if (pp)
		*lib = ((struct CUfunc_st *)*pp)->lib;
	pthread_mutex_unlock(&sim_obj_lock);
	return pp ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult sim_impl_cuFuncGetModule(CUmodule *mod, CUfunction f)
{
	return sim_impl_cuKernelGetLibrary((CUlibrary *)mod, (CUkernel)f);
}

/* The name stays valid while the function lives, as documented. */
static CUresult sim_func_name(const char **name, const void *f)
{
	struct sim_obj **pp;

	SIM_REQUIRE_INIT();
	if (!name)
		return CUDA_ERROR_INVALID_VALUE;
	pthread_mutex_lock(&sim_obj_lock);
	pp = sim_obj_find(f, SIM_OBJ_FUNC);
	if (pp)
		*name = ((struct CUfunc_st *)*pp)->name;
	pthread_mutex_unlock(&sim_obj_lock);
	return pp ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult sim_impl_cuFuncGetName(const char **name, CUfunction f)
{
	return sim_func_name(name, f);
}

CUresult sim_impl_cuKernelGetName(const char **name, CUkernel k)
{
	return sim_func_name(name, k);
}

/*
 * A global's memory is taken from the current device when it is first asked
 * for, and belongs to the library: it goes when the library is unloaded.
 */
CUresult sim_impl_cuLibraryGetGlobal(CUdeviceptr *dptr, size_t *bytes, CUlibrary lib,
				     const char *name)
{
	struct CUfunc_st *g;
	CUdeviceptr addr = 0;
	CUresult rc;

	if (!sim_depth)
		return sim_live() == CUDA_SUCCESS ? CUDA_ERROR_INVALID_CONTEXT : sim_live();
	if (!name)
		return CUDA_ERROR_INVALID_VALUE;
	/* Held throughout (sim_obj_lock before a heap lock), so no unload frees g meanwhile. */
	pthread_mutex_lock(&sim_obj_lock);
	rc = sim_symbol_locked(&g, lib, name, SIM_OBJ_GLOBAL);
	if (rc == CUDA_SUCCESS && !g->obj.addr)
		rc = sim_heap_alloc(&sim_devs[sim_current_dev()], SIM_GLOBAL_BYTES, SIM_MEM_PTR, 0,
				    &g->obj.addr);
	if (rc == CUDA_SUCCESS)
		addr = g->obj.addr;
	pthread_mutex_unlock(&sim_obj_lock);
	if (rc != CUDA_SUCCESS)
		return rc;
	if (dptr)
		*dptr = addr;
	if (bytes)
		*bytes = SIM_GLOBAL_BYTES;
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuModuleGetGlobal_v2(CUdeviceptr *dptr, size_t *bytes, CUmodule mod,
				       const char *name)
{
	return sim_impl_cuLibraryGetGlobal(dptr, bytes, (CUlibrary)mod, name);
}

static CUresult sim_func_attr(int *v, int attr, const void *fn)
{
	struct CUfunc_st f;
	struct sim_obj **pp;

	SIM_REQUIRE_INIT();
	if (!v)
		return CUDA_ERROR_INVALID_VALUE;
	pthread_mutex_lock(&sim_obj_lock);
	pp = sim_obj_find(fn, SIM_OBJ_FUNC);
	if (pp)
		f = *(struct CUfunc_st *)*pp;
	pthread_mutex_unlock(&sim_obj_lock);
	if (!pp)
		return CUDA_ERROR_INVALID_HANDLE;
	switch (attr) {
	case CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK:
		*v = 1024;
		break;
	case CU_FUNC_ATTRIBUTE_NUM_REGS:
		*v = 32;
		break;
	case CU_FUNC_ATTRIBUTE_PTX_VERSION:
	case CU_FUNC_ATTRIBUTE_BINARY_VERSION:
		*v = 90;
		break;
	case CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES:
		*v = f.max_dynamic_smem;
		break;
	case CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT:
		*v = f.carveout;
		break;
	default:
		if (attr < 0 || attr >= CU_FUNC_ATTRIBUTE_MAX)
			return CUDA_ERROR_INVALID_VALUE;
		*v = 0;	/* static/const/local memory, cluster shape: none */
		break;
	}
	return CUDA_SUCCESS;
}

static CUresult sim_func_set(const void *fn, int attr, int v)
{
	struct sim_obj **pp;
	CUresult rc = CUDA_SUCCESS;

	SIM_REQUIRE_INIT();
	pthread_mutex_lock(&sim_obj_lock);
	pp = sim_obj_find(fn, SIM_OBJ_FUNC);
	if (!pp) {
		rc = CUDA_ERROR_INVALID_HANDLE;
	} else if (attr == CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES) {
		/* The opt-in limit: shared memory per block, less the static part. */
		if (v < 0 || v > 232448)
			rc = CUDA_ERROR_INVALID_VALUE;
		else
			((struct CUfunc_st *)*pp)->max_dynamic_smem = v;
	} else if (attr == CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT) {
		((struct CUfunc_st *)*pp)->carveout = v;
	} else if (attr < 0 || attr >= CU_FUNC_ATTRIBUTE_MAX) {
		rc = CUDA_ERROR_INVALID_VALUE;
	}
	pthread_mutex_unlock(&sim_obj_lock);
	return rc;
}

CUresult sim_impl_cuFuncGetAttribute(int *v, int attr, CUfunction f)
{
	return sim_func_attr(v, attr, f);
}

CUresult sim_impl_cuFuncSetAttribute(CUfunction f, int attr, int v)
{
	return sim_func_set(f, attr, v);
}

CUresult sim_impl_cuKernelGetAttribute(int *v, int attr, CUkernel k, CUdevice dev)
{
	CUresult rc = sim_check_dev(dev);

	return rc == CUDA_SUCCESS ? sim_func_attr(v, attr, k) : rc;
}

CUresult sim_impl_cuKernelSetAttribute(int attr, int v, CUkernel k, CUdevice dev)
{
	CUresult rc = sim_check_dev(dev);

	return rc == CUDA_SUCCESS ? sim_func_set(k, attr, v) : rc;
}

static CUresult sim_func_known(const void *f)
{
	struct sim_obj seen;

	SIM_REQUIRE_INIT();
	return sim_obj_lookup(f, SIM_OBJ_FUNC, false, &seen) ? CUDA_SUCCESS
							     : CUDA_ERROR_INVALID_HANDLE;
}

CUresult sim_impl_cuFuncSetCacheConfig(CUfunction f, int config)
{
	(void)config;
	return sim_func_known(f);
}

CUresult sim_impl_cuKernelSetCacheConfig(CUkernel k, int config, CUdevice dev)
{
	CUresult rc = sim_check_dev(dev);

	(void)config;
	return rc == CUDA_SUCCESS ? sim_func_known(k) : rc;
}

CUresult sim_impl_cuFuncIsLoaded(int *state, CUfunction f)
{
	CUresult rc = state ? sim_func_known(f) : CUDA_ERROR_INVALID_VALUE;

	if (rc == CUDA_SUCCESS)
		*state = 1;	/* CU_FUNCTION_LOADING_STATE_LOADED */
	return rc;
}

CUresult sim_impl_cuFuncLoad(CUfunction f)
{
	return sim_func_known(f);
}

/*
 * Occupancy, from an H100's limits: 2048 threads, 32 blocks and 228 KiB of
 * shared memory per multiprocessor.
 */
#define SIM_SM_THREADS	2048
#define SIM_SM_BLOCKS	32
#define SIM_SM_SMEM	233472

static int sim_blocks_per_sm(int block, size_t smem)
{
	int n;

	if (block <= 0)
		return 0;
	n = SIM_SM_THREADS / block;
	if (n > SIM_SM_BLOCKS)
		n = SIM_SM_BLOCKS;
	if (smem && (size_t)n > SIM_SM_SMEM / smem)
		n = (int)(SIM_SM_SMEM / smem);
	return n;
}

CUresult sim_impl_cuOccupancyMaxActiveBlocksPerMultiprocessor(int *n, CUfunction f, int block,
							      size_t smem)
{
	SIM_REQUIRE_INIT();
	if (!n || !f || block <= 0 || block > 1024)
		return CUDA_ERROR_INVALID_VALUE;
	*n = sim_blocks_per_sm(block, smem);
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int *n, CUfunction f,
								       int block, size_t smem,
								       unsigned int flags)
{
	(void)flags;
	return sim_impl_cuOccupancyMaxActiveBlocksPerMultiprocessor(n, f, block, smem);
}

typedef size_t (*sim_smem_fn)(int block);

CUresult sim_impl_cuOccupancyMaxPotentialBlockSize(int *grid, int *block, CUfunction f,
						   sim_smem_fn smem_fn, size_t smem, int limit)
{
	int b = limit > 0 && limit < 1024 ? limit : 1024;
	size_t shared;

	SIM_REQUIRE_INIT();
	if (!grid || !block || !f)
		return CUDA_ERROR_INVALID_VALUE;
	shared = smem_fn ? smem_fn(b) : smem;
	*block = b;
	*grid = sim_blocks_per_sm(b, shared) * 132;
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuOccupancyMaxPotentialBlockSizeWithFlags(int *grid, int *block, CUfunction f,
							    sim_smem_fn smem_fn, size_t smem,
							    int limit, unsigned int flags)
{
	(void)flags;
	return sim_impl_cuOccupancyMaxPotentialBlockSize(grid, block, f, smem_fn, smem, limit);
}

CUresult sim_impl_cuOccupancyAvailableDynamicSMemPerBlock(size_t *bytes, CUfunction f,
							  int nblocks, int block)
{
	SIM_REQUIRE_INIT();
	if (!bytes || !f || nblocks <= 0 || block <= 0)
		return CUDA_ERROR_INVALID_VALUE;
	*bytes = SIM_SM_SMEM / (size_t)nblocks;
	if (*bytes > 232448)
		*bytes = 232448;
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuOccupancyMaxActiveClusters(int *n, CUfunction f, const void *config)
{
	SIM_REQUIRE_INIT();
	if (!n || !f || !config)
		return CUDA_ERROR_INVALID_VALUE;
	*n = 132;
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuOccupancyMaxPotentialClusterSize(int *n, CUfunction f, const void *config)
{
	SIM_REQUIRE_INIT();
	if (!n || !f || !config)
		return CUDA_ERROR_INVALID_VALUE;
	*n = 8;	/* the portable cluster size limit */
	return CUDA_SUCCESS;
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

	SIM_REQUIRE_INIT();
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

	SIM_REQUIRE_INIT();
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

	SIM_REQUIRE_INIT();
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

	SIM_REQUIRE_INIT();
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
	SIM_REQUIRE_INIT();
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

	SIM_REQUIRE_INIT();
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

	SIM_REQUIRE_INIT();
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

	SIM_REQUIRE_INIT();
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

/* Contexts and devices: the rest of what the runtime queries. */

static size_t sim_limits[CU_LIMIT_COUNT] = {
	1024,		/* stack size */
	1048576,	/* printf FIFO */
	8388608,	/* malloc heap */
	2,		/* device runtime sync depth */
	2048,		/* device runtime pending launches */
	32,		/* max L2 fetch granularity */
	0,		/* persisting L2 cache size */
	0,		/* shared memory size */
	0,		/* CIG enabled */
	0,		/* CIG shared memory fallback */
};
static unsigned int sim_ctx_flags;

CUresult sim_impl_cuCtxGetLimit(size_t *v, int limit)
{
	SIM_REQUIRE_INIT();
	if (!v || limit < 0 || limit >= CU_LIMIT_COUNT)
		return CUDA_ERROR_INVALID_VALUE;
	*v = __atomic_load_n(&sim_limits[limit], __ATOMIC_RELAXED);
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuCtxSetLimit(int limit, size_t v)
{
	SIM_REQUIRE_INIT();
	if (limit < 0 || limit >= CU_LIMIT_COUNT)
		return CUDA_ERROR_INVALID_VALUE;
	if (!sim_depth)
		return CUDA_ERROR_INVALID_CONTEXT;
	__atomic_store_n(&sim_limits[limit], v, __ATOMIC_RELAXED);
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuCtxGetFlags(unsigned int *flags)
{
	SIM_REQUIRE_INIT();
	if (!flags)
		return CUDA_ERROR_INVALID_VALUE;
	if (!sim_depth)
		return CUDA_ERROR_INVALID_CONTEXT;
	*flags = __atomic_load_n(&sim_ctx_flags, __ATOMIC_RELAXED);
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuCtxSetFlags(unsigned int flags)
{
	SIM_REQUIRE_INIT();
	if (!sim_depth)
		return CUDA_ERROR_INVALID_CONTEXT;
	__atomic_store_n(&sim_ctx_flags, flags, __ATOMIC_RELAXED);
	return CUDA_SUCCESS;
}

/* A context handle (NULL: the current one) as a stack slot. */
static CUresult sim_ctx_or_current(CUcontext ctx, struct sim_ctx_slot *slot)
{
	const struct sim_ctx_slot *cur;

	SIM_REQUIRE_INIT();
	if (ctx)
		return sim_ctx_slot_of(ctx, slot) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
	cur = sim_current();
	if (!cur)
		return CUDA_ERROR_INVALID_CONTEXT;
	*slot = *cur;
	return CUDA_SUCCESS;
}

/* The version of the context API the context was made with: 3020, the _v2 one. */
CUresult sim_impl_cuCtxGetApiVersion(CUcontext ctx, unsigned int *version)
{
	struct sim_ctx_slot slot;
	CUresult rc = version ? sim_ctx_or_current(ctx, &slot) : CUDA_ERROR_INVALID_VALUE;

	if (rc == CUDA_SUCCESS)
		*version = 3020;
	return rc;
}

CUresult sim_impl_cuCtxGetId(CUcontext ctx, unsigned long long *id)
{
	struct sim_ctx_slot slot;
	CUresult rc = id ? sim_ctx_or_current(ctx, &slot) : CUDA_ERROR_INVALID_VALUE;

	if (rc == CUDA_SUCCESS)
		*id = slot.id;
	return rc;
}

CUresult sim_impl_cuCtxGetDevice_v2(CUdevice *dev, CUcontext ctx)
{
	struct sim_ctx_slot slot;
	CUresult rc = dev ? sim_ctx_or_current(ctx, &slot) : CUDA_ERROR_INVALID_VALUE;

	if (rc == CUDA_SUCCESS)
		*dev = slot.dev;
	return rc;
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
	SIM_REQUIRE_INIT();
	if (!config)
		return CUDA_ERROR_INVALID_VALUE;
	*config = 0;	/* CU_FUNC_CACHE_PREFER_NONE */
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuCtxSetCacheConfig(int config)
{
	SIM_REQUIRE_INIT();
	return config >= 0 && config <= 3 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult sim_impl_cuCtxResetPersistingL2Cache(void)
{
	SIM_REQUIRE_INIT();
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

	SIM_REQUIRE_INIT();
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

	SIM_REQUIRE_INIT();
	return sim_ctx_slot_of(peer, &slot) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

/* "[domain:]bus:device.function", the domain optional, in hex. */
CUresult sim_impl_cuDeviceGetByPCIBusId(CUdevice *dev, const char *bus_id)
{
	unsigned int domain = 0, bus, device, fn;
	int i;

	SIM_REQUIRE_INIT();
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
		rc = sim_impl_cuDeviceGetAttribute(major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
						   dev);
	if (rc == CUDA_SUCCESS)
		rc = sim_impl_cuDeviceGetAttribute(minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
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
	SIM_REQUIRE_INIT();
	return CUDA_SUCCESS;
}

/*
 * The per-thread default stream variants: nothing is asynchronous, so they
 * do exactly what their legacy-stream twins do.
 */
#define SIM_SAME_AS(variant, twin)						\
	extern __typeof__(sim_impl_##twin) sim_impl_##variant			\
		__attribute__((alias("sim_impl_" #twin)))

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
SIM_SAME_AS(cuStreamGetPriority_ptsz, cuStreamGetPriority);
SIM_SAME_AS(cuStreamGetFlags_ptsz, cuStreamGetFlags);
SIM_SAME_AS(cuStreamGetId_ptsz, cuStreamGetId);
SIM_SAME_AS(cuStreamGetDevice_ptsz, cuStreamGetDevice);
SIM_SAME_AS(cuStreamQuery_ptsz, cuStreamQuery);
SIM_SAME_AS(cuStreamWaitEvent_ptsz, cuStreamWaitEvent);
SIM_SAME_AS(cuStreamAddCallback_ptsz, cuStreamAddCallback);
SIM_SAME_AS(cuLaunchHostFunc_ptsz, cuLaunchHostFunc);
SIM_SAME_AS(cuEventRecord_ptsz, cuEventRecord);
SIM_SAME_AS(cuEventRecordWithFlags_ptsz, cuEventRecordWithFlags);
SIM_SAME_AS(cuStreamBeginCapture_ptsz, cuStreamBeginCapture);
SIM_SAME_AS(cuStreamBeginCapture_v2_ptsz, cuStreamBeginCapture_v2);
SIM_SAME_AS(cuStreamEndCapture_ptsz, cuStreamEndCapture);
SIM_SAME_AS(cuStreamIsCapturing_ptsz, cuStreamIsCapturing);
SIM_SAME_AS(cuStreamGetCaptureInfo_ptsz, cuStreamGetCaptureInfo);
SIM_SAME_AS(cuStreamGetCaptureInfo_v2_ptsz, cuStreamGetCaptureInfo_v2);
SIM_SAME_AS(cuStreamGetCaptureInfo_v3_ptsz, cuStreamGetCaptureInfo_v3);
SIM_SAME_AS(cuGraphUpload_ptsz, cuGraphUpload);
SIM_SAME_AS(cuGraphInstantiateWithParams_ptsz, cuGraphInstantiateWithParams);
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

	SIM_REQUIRE_INIT();
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

	SIM_REQUIRE_INIT();
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

	SIM_REQUIRE_INIT();
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
 * After fork() the child must not share its parent's device memory: it has
 * its own copy of the allocator's records, so its frees would punch, and
 * its allocations write, pages the parent still uses. The child's view of
 * each heap becomes a private copy-on-write mapping of the same bytes and
 * the memfd is let go (nothing can map or share the child's memory then:
 * IPC and shareable handles answer an error), as a forked process had its
 * own copy of device memory before heaps were shared files. Locks another
 * thread held at the fork are made anew: only this thread exists now.
 */
static void sim_atfork_child(void)
{
	pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
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
				     PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED, fd, (off_t)off);
		}
	}
	for (m = sim_ipc_list; m; m = m->next)
		mmap((void *)m->map, m->maplen, PROT_READ | PROT_WRITE,
		     MAP_PRIVATE | MAP_FIXED | MAP_ANONYMOUS, -1, 0);
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
