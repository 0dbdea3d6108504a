/*
 * The simulated driver's device heaps: each device's arena (a memfd as large
 * as the device, see sim_cuda.c), the allocator that takes from it and gives
 * back to it, cuMemAlloc and its kin, arrays, and what a forked child does
 * to the memory it shares with its parent.
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

struct CUarray_st {
	struct sim_obj obj;
};

struct CUmipmappedArray_st {
	struct sim_obj obj;
};

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

	/* A forked child's view is private (sim_memory_fork_child): the pages are the parent's. */
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
CUresult sim_heap_take(struct sim_device *d, size_t size, size_t align, enum sim_mem_kind kind,
		       uint64_t owner, size_t *at)
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

CUresult sim_heap_context_take(struct sim_device *d)
{
	size_t size, at;
	CUresult rc;

	if (d->ctx_held || d->spec->context == 0)
		return CUDA_SUCCESS;
	if (!sim_round(d->spec->context, &size))
		return CUDA_ERROR_OUT_OF_MEMORY;
	rc = sim_heap_take(d, size, SIM_ALIGN, SIM_MEM_CONTEXT, 0, &at);
	if (rc == CUDA_SUCCESS) {
		d->ctx_off = d->heap.live[at].off;
		d->ctx_len = size;
		d->ctx_held = true;
	}
	return rc;
}

void sim_heap_context_drop(struct sim_device *d)
{
	struct sim_extent *e;

	if (!d->ctx_held)
		return;
	e = sim_heap_find(&d->heap, d->ctx_off, SIM_MEM_CONTEXT);
	if (e)
		sim_heap_drop(&d->heap, e);
	d->ctx_held = false;
}

/* bytes rounded up to the heap's granule; false if that overflows. */
bool sim_round(size_t bytes, size_t *size)
{
	if (bytes > SIZE_MAX - (SIM_ALIGN - 1))
		return false;
	*size = (bytes + SIM_ALIGN - 1) & ~(size_t)(SIM_ALIGN - 1);
	return true;
}

CUresult sim_heap_alloc(struct sim_device *d, size_t bytes, enum sim_mem_kind kind, uint64_t owner,
			CUdeviceptr *out)
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
struct sim_extent *sim_heap_find(struct sim_heap *h, size_t off, enum sim_mem_kind kind)
{
	size_t at = sim_ext_search(h->live, h->nlive, off);

	if (at == h->nlive || h->live[at].off != off || h->live[at].kind != kind)
		return NULL;
	return &h->live[at];
}

/*
 * With h locked: freed device memory goes back to the system (it then costs
 * no RAM, and reads as zeros when handed out again) once SIM_PUNCH_BATCH
 * bytes have been freed since the last time: the free extents within the
 * span those bytes were freed in, at once. A hole punched at every free
 * costs a system call each: the shim's allocation benchmark measured the
 * simulator's free at 0.75 us instead of 26 ns; and punching every free
 * extent of a 16 GiB device each time made the kernel walk the page tables
 * of all of it. Freed memory is like a GPU's meanwhile: it keeps what was
 * there.
 */
#define SIM_PUNCH_BATCH ((size_t)64 << 20)

static void sim_heap_freed(struct sim_heap *h, size_t from, size_t to, size_t len)
{
	size_t i, lo, hi;

	if (h->unpunched == 0 || from < h->unpunched_lo)
		h->unpunched_lo = from;
	if (h->unpunched == 0 || to > h->unpunched_hi)
		h->unpunched_hi = to;
	h->unpunched += len;
	if (h->unpunched < SIM_PUNCH_BATCH)
		return;
	for (i = 0; i < h->nfree; i++) {
		lo = h->free_ext[i].off > h->unpunched_lo ? h->free_ext[i].off : h->unpunched_lo;
		hi = h->free_ext[i].off + h->free_ext[i].len;
		hi = hi < h->unpunched_hi ? hi : h->unpunched_hi;
		if (hi > lo)
			sim_heap_punch(h, lo, hi - lo);
	}
	h->unpunched = 0;
}

/* With h locked: gives live extent e back to the free extents. */
void sim_heap_drop(struct sim_heap *h, struct sim_extent *e)
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
	sim_heap_freed(h, off, off + len, len);
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
void sim_pool_release(struct sim_heap *h, struct CUmemPoolHandle_st *pool, uint64_t keep,
		      bool to_threshold)
{
	size_t i = 0;

	while (i < h->nlive) {
		struct sim_extent *e = &h->live[i];
		struct CUmemPoolHandle_st *p = e->pool;
		uint64_t limit = to_threshold && p ? p->threshold : keep;

		if (p && e->idle && (!pool || p == pool) && p->reserved - e->len >= limit) {
			p->reserved -= e->len;
			sim_heap_drop(h, e); /* the next extent moves to i */
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
CUresult sim_pool_alloc(struct sim_device *d, struct CUmemPoolHandle_st *pool, size_t bytes,
			CUdeviceptr *out)
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
		if (sim_heap_grow(h)) { /* may move the live extents */
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
	size_t i, kept = 0, pos = 0, freed = 0, lo = h->arena, hi = 0;

	pthread_mutex_lock(&h->lock);
	for (i = 0; i < h->nlive; i++) {
		struct sim_extent *e = &h->live[i];

		if (e->owner != id) {
			h->live[kept++] = *e;
			continue;
		}
		freed += e->len;
		lo = e->off < lo ? e->off : lo;
		hi = e->off + e->len > hi ? e->off + e->len : hi;
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
		sim_heap_freed(h, lo, hi, freed);
	}
	pthread_mutex_unlock(&h->lock);
}

/* The heap whose arena holds addr, with addr's offset in it; NULL if none. */
struct sim_heap *sim_heap_of(CUdeviceptr addr, size_t *off)
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

CUresult sim_impl_cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height,
				     unsigned int elem)
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
static CUresult sim_array_bytes(const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned int levels, size_t *out)
{
	bool layered = d->Flags & SIM_ARRAY3D_LAYERED;
	size_t elem = gs_array_format_bytes(d->Format) * d->NumChannels;
	size_t w = d->Width, h = d->Height ? d->Height : 1, depth = d->Depth ? d->Depth : 1;
	size_t largest = w > h ? w : h, total = 0;
	unsigned int l;

	if (d->Width == 0 || elem == 0 ||
	    (d->NumChannels != 1 && d->NumChannels != 2 && d->NumChannels != 4))
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
	struct sim_obj *o;
	size_t bytes;
	CUresult rc = sim_check_args(handle && desc);

	if (rc != CUDA_SUCCESS)
		return rc;
	rc = sim_array_bytes(desc, levels, &bytes);
	if (rc != CUDA_SUCCESS)
		return rc;
	o = sim_obj_new_current(sizeof(*o), kind, &rc);
	if (!o)
		return rc;
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
	struct sim_obj *o;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	pthread_mutex_lock(&sim_obj_lock);
	o = sim_obj_unlink_locked(handle, kind);
	if (o)
		sim_mem_free(o->addr, SIM_MEM_ARRAY);
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
					 const CUDA_ARRAY3D_DESCRIPTOR *desc, unsigned int levels)
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

/* With h locked: the live extent holding off, or NULL. */
struct sim_extent *sim_heap_holding(struct sim_heap *h, size_t off)
{
	size_t at = sim_ext_search(h->live, h->nlive, off + 1);
	struct sim_extent *e = at ? &h->live[at - 1] : NULL;

	return e && off - e->off < e->len ? e : NULL;
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
static void sim_memory_fork_child(void)
{
	pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
	struct sim_import *im;
	struct sim_ipc *m;
	struct sim_va *v;
	size_t k;
	int i;

	sim_va_lock = fresh;
	sim_host_lock = fresh;
	sim_ipc_lock = fresh;
	sim_import_lock = fresh;
	for (i = 0; i < sim_ndevs; i++)
		sim_devs[i].heap.lock = fresh;
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
		close(im->fd); /* its mappings are private now; no new ones */
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

/* With sim_obj_lock held, context id is going: what was allocated in it, on any device. */
static void sim_heap_ctx_gone(uint64_t id, struct sim_obj *dead)
{
	int i;

	(void)dead; /* arrays' storage is swept with the rest */
	for (i = 0; i < sim_ndevs; i++)
		sim_heap_sweep(&sim_devs[i].heap, id);
}

static const struct sim_hooks sim_heap_hooks = {
	.ctx_gone_locked = sim_heap_ctx_gone,
	.fork_child = sim_memory_fork_child,
	.sync = sim_pools_settle,
};

__attribute__((constructor)) static void sim_heap_load(void)
{
	sim_hooks_add(&sim_heap_hooks);
}
