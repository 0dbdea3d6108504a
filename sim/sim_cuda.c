/*
 * A simulated CUDA driver, built as libcuda.so.1, for machines without
 * NVIDIA hardware. The shim is loaded in front of it exactly as it would be
 * in front of the real driver, so everything here follows the driver ABI:
 * entry point names, error codes and the cuGetProcAddress rules.
 *
 * Device memory is address space, never RAM: each device owns a PROT_NONE,
 * MAP_NORESERVE reservation and allocations are addresses inside it. Nothing
 * dereferences a device pointer, so a 16 GiB device costs no memory.
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
#include <sys/mman.h>
#include <unistd.h>

#include "cuda_abi.h"
#include "sim_spec.h"

#define SIM_EXPORT __attribute__((visibility("default")))

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
enum sim_obj_kind { SIM_OBJ_ARRAY = 1, SIM_OBJ_MIPMAP, SIM_OBJ_POOL, SIM_OBJ_STREAM };

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

struct CUmemPoolHandle_st {
	struct sim_obj obj;
};

struct CUstream_st {
	struct sim_obj obj;
};

struct sim_device {
	const struct sim_spec *spec;
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

enum { SIM_UNINIT, SIM_READY, SIM_GONE };

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

static __thread struct sim_ctx_slot sim_stack[SIM_CTX_DEPTH];
static __thread unsigned int sim_depth;

static CUresult sim_live(void)
{
	switch (__atomic_load_n(&sim_state, __ATOMIC_ACQUIRE)) {
	case SIM_READY:
		return CUDA_SUCCESS;
	case SIM_GONE:
		return CUDA_ERROR_DEINITIALIZED;
	default:
		return CUDA_ERROR_NOT_INITIALIZED;
	}
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
	d->heap.arena = d->spec->bytes & ~(size_t)(SIM_ALIGN - 1);
	pthread_mutex_init(&d->heap.lock, NULL);
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
	if (sim_ndevs == 0)
		sim_init_result = CUDA_ERROR_NO_DEVICE;
	else
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

/* Reserved on first use so that devices a process never touches cost nothing. */
static bool sim_heap_reserve(struct sim_heap *h, size_t total)
{
	void *p;

	if (h->base)
		return true;
	if (h->arena == 0 || !sim_heap_grow(h))
		return false;
	p = mmap(NULL, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	if (p == MAP_FAILED)
		return false;
	h->free_ext[0].off = 0;
	h->free_ext[0].len = h->arena;
	h->free_ext[0].kind = 0;
	h->nfree = 1;
	__atomic_store_n(&h->base, (uintptr_t)p, __ATOMIC_RELEASE);
	return true;
}

/* owner: the id of the context the allocation belongs to; 0 for none. */
static CUresult sim_heap_alloc(struct sim_device *d, size_t bytes, enum sim_mem_kind kind,
			       uint64_t owner, CUdeviceptr *out)
{
	struct sim_heap *h = &d->heap;
	CUresult rc = CUDA_ERROR_OUT_OF_MEMORY;
	size_t size, i, off, at;

	if (bytes > SIZE_MAX - (SIM_ALIGN - 1))
		return CUDA_ERROR_OUT_OF_MEMORY;
	size = (bytes + SIM_ALIGN - 1) & ~(size_t)(SIM_ALIGN - 1);

	pthread_mutex_lock(&h->lock);
	if (size > d->spec->bytes - h->used || !sim_heap_reserve(h, d->spec->bytes))
		goto out;
	for (i = 0; i < h->nfree && h->free_ext[i].len < size; i++)
		;
	/* Fragmentation can leave no hole big enough; the real driver fails too. */
	if (i == h->nfree || !sim_heap_grow(h))
		goto out;
	off = h->free_ext[i].off;
	at = sim_ext_search(h->live, h->nlive, off);
	sim_ext_insert(h->live, &h->nlive, at, off, size, kind);
	h->live[at].owner = owner;
	/* cuMemCreate hands its caller the first reference. */
	h->live[at].refs = kind == SIM_MEM_HANDLE;
	if (h->free_ext[i].len == size) {
		sim_ext_remove(h->free_ext, &h->nfree, i);
	} else {
		h->free_ext[i].off += size;
		h->free_ext[i].len -= size;
	}
	h->used += size;
	*out = (CUdeviceptr)(h->base + off);
	rc = CUDA_SUCCESS;
out:
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

static CUresult sim_heap_free(struct sim_heap *h, size_t off, enum sim_mem_kind kind)
{
	struct sim_extent *e;

	pthread_mutex_lock(&h->lock);
	e = sim_heap_find(h, off, kind);
	if (e)
		sim_heap_drop(h, e);
	pthread_mutex_unlock(&h->lock);
	return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
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
		if (h->live[i].owner == id)
			freed += h->live[i].len;
		else
			h->live[kept++] = h->live[i];
	}
	if (kept < h->nlive) {
		h->nlive = kept;
		h->used -= freed;
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
 * On dlclose and at exit, give back what the heaps and contexts hold. Other
 * threads may still be calling in at exit: from here on they get
 * CUDA_ERROR_DEINITIALIZED like the real driver's, and one already past that
 * check finds empty heaps under the lock rather than freed memory.
 */
__attribute__((destructor)) static void sim_fini(void)
{
	struct CUctx_st *c;
	struct sim_obj *o;
	struct sim_va *v;
	int i;

	if (sim_live() != CUDA_SUCCESS)
		return;
	__atomic_store_n(&sim_state, SIM_GONE, __ATOMIC_RELEASE);
	for (i = 0; i < sim_ndevs; i++) {
		struct sim_heap *h = &sim_devs[i].heap;

		pthread_mutex_lock(&h->lock);
		if (h->base)
			munmap((void *)h->base, sim_devs[i].spec->bytes);
		free(h->free_ext);
		free(h->live);
		h->free_ext = h->live = NULL;
		h->nfree = h->free_cap = h->nlive = h->live_cap = 0;
		pthread_mutex_unlock(&h->lock);
	}
	pthread_mutex_lock(&sim_ctx_lock);
	while ((c = sim_ctx_list)) {
		sim_ctx_list = c->next;
		free(c);
	}
	pthread_mutex_unlock(&sim_ctx_lock);
	pthread_mutex_lock(&sim_obj_lock);
	while ((o = sim_obj_list)) {
		sim_obj_list = o->next;
		free(o);
	}
	pthread_mutex_unlock(&sim_obj_lock);
	pthread_mutex_lock(&sim_va_lock);
	while ((v = sim_va_list)) {
		sim_va_list = v->next;
		munmap((void *)v->base, v->size);
		free(v->maps);
		free(v);
	}
	pthread_mutex_unlock(&sim_va_lock);
}

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
	for (i = 0; i < sim_ndevs; i++)
		sim_heap_sweep(&sim_devs[i].heap, id);
	pthread_mutex_unlock(&sim_obj_lock);
	while ((o = dead)) {
		dead = o->next;
		free(o);
	}
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
	*pctx = c;
	return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
	(void)flags;
	return sim_ctx_create(pctx, dev);
}

/* Execution affinity (SM counts of a green context) means nothing here. */
SIM_EXPORT CUresult cuCtxCreate_v3(CUcontext *pctx, void *affinity, int naffinity,
				   unsigned int flags, CUdevice dev)
{
	(void)affinity;
	(void)naffinity;
	(void)flags;
	return sim_ctx_create(pctx, dev);
}

SIM_EXPORT CUresult cuCtxCreate_v4(CUcontext *pctx, void *params, unsigned int flags,
				   CUdevice dev)
{
	(void)params;
	(void)flags;
	return sim_ctx_create(pctx, dev);
}

SIM_EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx)
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

SIM_EXPORT CUresult cuCtxSetCurrent(CUcontext ctx)
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

SIM_EXPORT CUresult cuCtxGetCurrent(CUcontext *pctx)
{
	SIM_REQUIRE_INIT();
	if (!pctx)
		return CUDA_ERROR_INVALID_VALUE;
	*pctx = sim_depth ? sim_stack[sim_depth - 1].ctx : NULL;
	return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxGetDevice(CUdevice *dev)
{
	SIM_REQUIRE_INIT();
	if (!dev)
		return CUDA_ERROR_INVALID_VALUE;
	if (!sim_depth)
		return CUDA_ERROR_INVALID_CONTEXT;
	*dev = sim_current_dev();
	return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxPushCurrent_v2(CUcontext ctx)
{
	struct sim_ctx_slot slot;

	SIM_REQUIRE_INIT();
	return sim_ctx_slot_of(ctx, &slot) ? sim_push(&slot) : CUDA_ERROR_INVALID_CONTEXT;
}

SIM_EXPORT CUresult cuCtxPopCurrent_v2(CUcontext *pctx)
{
	SIM_REQUIRE_INIT();
	if (!sim_depth)
		return CUDA_ERROR_INVALID_CONTEXT;
	sim_depth--;
	if (pctx)
		*pctx = sim_stack[sim_depth].ctx;
	return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxSynchronize(void)
{
	SIM_REQUIRE_INIT();
	/* Nothing ever runs, so there is nothing to wait for. */
	return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
	CUresult rc = sim_check(pctx, dev);

	if (rc != CUDA_SUCCESS)
		return rc;
	pthread_mutex_lock(&sim_ctx_lock);
	sim_devs[dev].primary_refs++;
	pthread_mutex_unlock(&sim_ctx_lock);
	*pctx = &sim_devs[dev].primary;
	return CUDA_SUCCESS;
}

/*
 * The last release destroys the primary context, and with it what was
 * allocated in it. sim_ctx_lock is held throughout, so a retain on another
 * thread finds either the old context or a fresh one, never a half-torn one.
 */
SIM_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
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
	return rc;
}

SIM_EXPORT CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active)
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

SIM_EXPORT CUresult cuDevicePrimaryCtxSetFlags_v2(CUdevice dev, unsigned int flags)
{
	(void)flags;
	return sim_check_dev(dev);
}

/*
 * Documented as destroying all allocations and state of the primary
 * context; it does not release it, so the reference count stays as it is.
 */
SIM_EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev)
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
SIM_EXPORT CUresult cuCtxDestroy(CUcontext ctx)
{
	return cuCtxDestroy_v2(ctx);
}

SIM_EXPORT CUresult cuDevicePrimaryCtxRelease(CUdevice dev)
{
	return cuDevicePrimaryCtxRelease_v2(dev);
}

SIM_EXPORT CUresult cuDevicePrimaryCtxReset(CUdevice dev)
{
	return cuDevicePrimaryCtxReset_v2(dev);
}

/* Initialization, device queries, memory, launch. */

SIM_EXPORT CUresult cuInit(unsigned int flags)
{
	if (flags != 0)
		return CUDA_ERROR_INVALID_VALUE;
	pthread_once(&sim_once, sim_init_once);
	return sim_init_result;
}

SIM_EXPORT CUresult cuDriverGetVersion(int *version)
{
	if (!version)
		return CUDA_ERROR_INVALID_VALUE;
	*version = GS_SIM_DRIVER_VERSION;
	return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceGetCount(int *count)
{
	CUresult rc = sim_check(count, 0);

	if (rc == CUDA_SUCCESS)
		*count = sim_ndevs;
	return rc;
}

SIM_EXPORT CUresult cuDeviceGet(CUdevice *dev, int ordinal)
{
	CUresult rc = sim_check(dev, ordinal);

	if (rc == CUDA_SUCCESS)
		*dev = ordinal;
	return rc;
}

SIM_EXPORT CUresult cuDeviceGetName(char *name, int len, CUdevice dev)
{
	CUresult rc = sim_check(name, dev);

	if (rc == CUDA_SUCCESS && len <= 0)
		rc = CUDA_ERROR_INVALID_VALUE;
	if (rc == CUDA_SUCCESS)
		snprintf(name, (size_t)len, "%s", sim_devs[dev].spec->name);
	return rc;
}

SIM_EXPORT CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev)
{
	CUresult rc = sim_check(uuid, dev);

	if (rc == CUDA_SUCCESS)
		memcpy(uuid->bytes, sim_devs[dev].spec->uuid_bytes, sizeof(uuid->bytes));
	return rc;
}

/* _v2 differs from v1 only for MIG instances, and the simulation has none. */
SIM_EXPORT CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev)
{
	return cuDeviceGetUuid(uuid, dev);
}

SIM_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
	CUresult rc = sim_check(bytes, dev);

	if (rc == CUDA_SUCCESS)
		*bytes = sim_devs[dev].spec->bytes;
	return rc;
}

SIM_EXPORT CUresult cuDeviceGetAttribute(int *pi, int attrib, CUdevice dev)
{
	CUresult rc = sim_check(pi, dev);

	if (rc != CUDA_SUCCESS)
		return rc;
	switch (attrib) {
	case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR:
		*pi = 9;
		break;
	case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT:
		*pi = 132;
		break;
	case CU_DEVICE_ATTRIBUTE_WARP_SIZE:
		*pi = 32;
		break;
	case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK:
		*pi = 1024;
		break;
	case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING:
		*pi = 1;
		break;
	case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID:
		/* By spec position: a device keeps its bus id whatever is hidden. */
		*pi = sim_devs[dev].spec_index + 1;
		break;
	default:
		/* The compute capability minor, PCI domain and device id among them. */
		*pi = 0;
		break;
	}
	return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceGetPCIBusId(char *bus_id, int len, CUdevice dev)
{
	CUresult rc = sim_check(bus_id, dev);

	if (rc == CUDA_SUCCESS && len <= 0)
		rc = CUDA_ERROR_INVALID_VALUE;
	if (rc == CUDA_SUCCESS)
		snprintf(bus_id, (size_t)len, "0000:%02x:00.0",
			 (unsigned int)sim_devs[dev].spec_index + 1);
	return rc;
}

SIM_EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes)
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

SIM_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
	return sim_alloc_current(dptr, bytesize, SIM_MEM_PTR);
}

SIM_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr)
{
	SIM_REQUIRE_INIT();
	return sim_mem_free(dptr, SIM_MEM_PTR);
}

/* The row alignment cuMemAllocPitch reports; what current GPUs use. */
#define SIM_PITCH 512

SIM_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width,
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
SIM_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
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
SIM_EXPORT CUresult cuStreamCreate(CUstream *stream, unsigned int flags)
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
	sim_obj_add(&s->obj);
	*stream = s;
	return CUDA_SUCCESS;
}

/* A default stream is not the caller's to destroy. */
SIM_EXPORT CUresult cuStreamDestroy_v2(CUstream stream)
{
	struct sim_obj seen, *o;

	SIM_REQUIRE_INIT();
	o = sim_default_stream(stream) ? NULL
				       : sim_obj_lookup(stream, SIM_OBJ_STREAM, true, &seen);
	if (!o)
		return CUDA_ERROR_INVALID_HANDLE;
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

SIM_EXPORT CUresult cuStreamGetCtx(CUstream stream, CUcontext *pctx)
{
	return sim_stream_ctx(stream, pctx);
}

/* The per-thread default stream is the current context's too. */
SIM_EXPORT CUresult cuStreamGetCtx_ptsz(CUstream stream, CUcontext *pctx)
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

SIM_EXPORT CUresult cuStreamGetCtx_v2(CUstream stream, CUcontext *pctx, CUgreenCtx *pgreen)
{
	return sim_stream_ctx_v2(stream, pctx, pgreen);
}

SIM_EXPORT CUresult cuStreamGetCtx_v2_ptsz(CUstream stream, CUcontext *pctx,
					   CUgreenCtx *pgreen)
{
	return sim_stream_ctx_v2(stream, pctx, pgreen);
}

/* Nothing ever runs, so there is nothing to wait for; the handle is checked. */
static CUresult sim_stream_sync(CUstream stream)
{
	struct sim_ctx_slot slot;

	SIM_REQUIRE_INIT();
	return sim_stream_slot(stream, &slot);
}

SIM_EXPORT CUresult cuStreamSynchronize(CUstream stream)
{
	return sim_stream_sync(stream);
}

SIM_EXPORT CUresult cuStreamSynchronize_ptsz(CUstream stream)
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

SIM_EXPORT CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice dev)
{
	CUresult rc = sim_check(pool, dev);

	if (rc == CUDA_SUCCESS)
		*pool = &sim_devs[dev].default_pool;
	return rc;
}

/* The pool cuMemAllocAsync takes from on dev: its default pool until set. */
SIM_EXPORT CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev)
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
SIM_EXPORT CUresult cuDeviceSetMemPool(CUdevice dev, CUmemoryPool pool)
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
SIM_EXPORT CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props)
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
SIM_EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool)
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
	struct sim_ctx_slot slot;
	CUresult rc;

	SIM_REQUIRE_INIT();
	if (!dptr || bytesize == 0)
		return CUDA_ERROR_INVALID_VALUE;
	rc = sim_stream_slot(stream, &slot);
	if (rc != CUDA_SUCCESS)
		return rc;
	return sim_heap_alloc(&sim_devs[slot.dev], bytesize, SIM_MEM_PTR, 0, dptr);
}

SIM_EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream stream)
{
	return sim_alloc_async(dptr, bytesize, stream);
}

SIM_EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream stream)
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
	dev = sim_pool_device(pool);
	if (dev < 0)
		return CUDA_ERROR_INVALID_VALUE;
	rc = sim_stream_slot(stream, &slot);
	if (rc != CUDA_SUCCESS)
		return rc;
	return sim_heap_alloc(&sim_devs[dev], bytesize, SIM_MEM_PTR, 0, dptr);
}

SIM_EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize,
					    CUmemoryPool pool, CUstream stream)
{
	return sim_alloc_from_pool(dptr, bytesize, pool, stream);
}

SIM_EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize,
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

SIM_EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream stream)
{
	return sim_free_async(dptr, stream);
}

SIM_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream stream)
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

SIM_EXPORT CUresult cuMemGetAllocationGranularity(size_t *granularity,
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
SIM_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
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
static CUresult sim_handle_op(CUmemGenericAllocationHandle handle, enum sim_handle_op op,
			      size_t offset, size_t size)
{
	CUresult rc = CUDA_ERROR_INVALID_VALUE;
	struct sim_extent *e;
	struct sim_heap *h;
	size_t off;

	h = sim_heap_of(handle, &off);
	if (!h)
		return rc;
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

SIM_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
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
SIM_EXPORT CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment,
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
SIM_EXPORT CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size)
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
SIM_EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
			     CUmemGenericAllocationHandle handle, unsigned long long flags)
{
	CUresult rc = CUDA_ERROR_INVALID_VALUE;
	struct sim_map *m;
	struct sim_va *v;
	size_t off, at;

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
SIM_EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
	size_t first, last, i;
	struct sim_va *v;

	SIM_REQUIRE_INIT();
	pthread_mutex_lock(&sim_va_lock);
	if (!sim_va_whole(ptr, size, &v, &first, &last)) {
		pthread_mutex_unlock(&sim_va_lock);
		return CUDA_ERROR_INVALID_VALUE;
	}
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
SIM_EXPORT CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc,
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
SIM_EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle,
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

SIM_EXPORT CUresult cuArrayCreate_v2(CUarray *array, const CUDA_ARRAY_DESCRIPTOR *desc)
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

SIM_EXPORT CUresult cuArray3DCreate_v2(CUarray *array, const CUDA_ARRAY3D_DESCRIPTOR *desc)
{
	void *handle = NULL;
	CUresult rc = sim_array_new(array ? &handle : NULL, desc, 1, SIM_OBJ_ARRAY);

	if (rc == CUDA_SUCCESS)
		*array = handle;
	return rc;
}

SIM_EXPORT CUresult cuArrayDestroy(CUarray array)
{
	return sim_array_destroy(array, SIM_OBJ_ARRAY);
}

SIM_EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *array,
					   const CUDA_ARRAY3D_DESCRIPTOR *desc,
					   unsigned int levels)
{
	void *handle = NULL;
	CUresult rc = sim_array_new(array ? &handle : NULL, desc, levels, SIM_OBJ_MIPMAP);

	if (rc == CUDA_SUCCESS)
		*array = handle;
	return rc;
}

SIM_EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray array)
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

SIM_EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy,
				   unsigned int gz, unsigned int bx, unsigned int by,
				   unsigned int bz, unsigned int shmem, CUstream stream,
				   void **params, void **extra)
{
	(void)shmem, (void)stream, (void)params, (void)extra;
	return sim_launch(f, gx, gy, gz, bx, by, bz);
}

SIM_EXPORT CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy,
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

SIM_EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **params,
				     void **extra)
{
	(void)params, (void)extra;
	return sim_launch_ex(config, f);
}

SIM_EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f,
					  void **params, void **extra)
{
	(void)params, (void)extra;
	return sim_launch_ex(config, f);
}

SIM_EXPORT CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gx, unsigned int gy,
					      unsigned int gz, unsigned int bx, unsigned int by,
					      unsigned int bz, unsigned int shmem, CUstream stream,
					      void **params)
{
	(void)shmem, (void)stream, (void)params;
	return sim_launch(f, gx, gy, gz, bx, by, bz);
}

SIM_EXPORT CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gx,
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
static CUresult sim_graph_launch(CUgraphExec exec)
{
	SIM_REQUIRE_INIT();
	if (!sim_depth)
		return CUDA_ERROR_INVALID_CONTEXT;
	return exec ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

SIM_EXPORT CUresult cuGraphLaunch(CUgraphExec exec, CUstream stream)
{
	(void)stream;
	return sim_graph_launch(exec);
}

SIM_EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec exec, CUstream stream)
{
	(void)stream;
	return sim_graph_launch(exec);
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

SIM_EXPORT CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice dev)
{
	(void)bytes, (void)dev;
	SIM_REQUIRE_INIT();
	return CUDA_ERROR_NOT_SUPPORTED;
}

SIM_EXPORT CUresult cuMemGetInfo(unsigned int *free_bytes, unsigned int *total_bytes)
{
	(void)free_bytes, (void)total_bytes;
	SIM_REQUIRE_INIT();
	return CUDA_ERROR_NOT_SUPPORTED;
}

SIM_EXPORT CUresult cuMemAlloc(sim_devptr_v1 *dptr, unsigned int bytesize)
{
	(void)dptr, (void)bytesize;
	SIM_REQUIRE_INIT();
	return CUDA_ERROR_NOT_SUPPORTED;
}

SIM_EXPORT CUresult cuMemAllocPitch(sim_devptr_v1 *dptr, unsigned int *pitch,
				    unsigned int width, unsigned int height, unsigned int elem)
{
	(void)dptr, (void)pitch, (void)width, (void)height, (void)elem;
	SIM_REQUIRE_INIT();
	return CUDA_ERROR_NOT_SUPPORTED;
}

SIM_EXPORT CUresult cuMemFree(sim_devptr_v1 dptr)
{
	(void)dptr;
	SIM_REQUIRE_INIT();
	return CUDA_ERROR_NOT_SUPPORTED;
}

/* The v1 descriptors differ only in 32-bit extents; never read here. */
SIM_EXPORT CUresult cuArrayCreate(CUarray *array, const void *desc)
{
	(void)array, (void)desc;
	SIM_REQUIRE_INIT();
	return CUDA_ERROR_NOT_SUPPORTED;
}

SIM_EXPORT CUresult cuArray3DCreate(CUarray *array, const void *desc)
{
	(void)array, (void)desc;
	SIM_REQUIRE_INIT();
	return CUDA_ERROR_NOT_SUPPORTED;
}

SIM_EXPORT CUresult cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev)
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

SIM_EXPORT CUresult cuGetErrorString(CUresult error, const char **str)
{
	return sim_error_lookup(error, str, false);
}

SIM_EXPORT CUresult cuGetErrorName(CUresult error, const char **str)
{
	return sim_error_lookup(error, str, true);
}

/*
 * Export tables are the runtime's private channel to the driver; their
 * contents are undocumented and the simulation does not pretend to know
 * them. Without one, libcudart stops before it enumerates devices, so every
 * table id gets the same table: a size word followed by entries that do
 * nothing and report success. That carries libcudart's start-up through
 * cuDeviceGetCount and the per-device queries (what gpushare's tests
 * observe) until it gives up with an error of its own; no real work can run.
 */
#define SIM_EXPORT_ENTRIES 64

/* CU_MODULE_LAZY_LOADING: what the runtime asks before anything else. */
#define SIM_MODULE_LAZY_LOADING 2

SIM_EXPORT CUresult cuModuleGetLoadingMode(int *mode)
{
	SIM_REQUIRE_INIT();
	if (mode == NULL)
		return CUDA_ERROR_INVALID_VALUE;
	*mode = SIM_MODULE_LAZY_LOADING;
	return CUDA_SUCCESS;
}

static CUresult sim_export_entry(void)
{
	return CUDA_SUCCESS;
}

static void *sim_export_table[SIM_EXPORT_ENTRIES];

SIM_EXPORT CUresult cuGetExportTable(const void **table, const CUuuid *table_id)
{
	SIM_REQUIRE_INIT();
	if (table == NULL || table_id == NULL)
		return CUDA_ERROR_INVALID_VALUE;
	if (sim_export_table[0] == NULL) {
		for (int i = 1; i < SIM_EXPORT_ENTRIES; i++)
			sim_export_table[i] = (void *)sim_export_entry;
		__atomic_store_n(&sim_export_table[0], (void *)sizeof(sim_export_table),
				 __ATOMIC_RELEASE);
	}
	*table = sim_export_table;
	return CUDA_SUCCESS;
}

/*
 * Handed out for driver API names the simulation does not implement: the
 * CUDA runtime resolves hundreds of entry points at start-up and gives up
 * if one is missing, but calls only the few it needs.
 */
static CUresult sim_not_supported(void)
{
	return CUDA_ERROR_NOT_SUPPORTED;
}

SIM_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cuda_version,
					cuuint64_t flags,
					CUdriverProcAddressQueryResult *status);

SIM_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cuda_version,
				     cuuint64_t flags)
{
	return cuGetProcAddress_v2(symbol, pfn, cuda_version, flags, NULL);
}

struct sim_proc {
	const char *base;	/* the name callers ask for */
	const char *abi;	/* the exported variant it stands for */
	int first_version;	/* the CUDA version that introduced the variant */
	bool per_thread;	/* per-thread default stream flavour */
	void *fn;
};

#define SIM_PROC(base, abi, ver, pt) { #base, #abi, ver, pt, (void *)abi }
/*
 * One row per ABI variant, with the CUDA version that introduced it (those of
 * cuda.h's _vN / _ptsz mappings; hooks.def lists the same for the hooked
 * names). Every fn is the exported function named abi, so dladdr() on a
 * pointer handed out here names the variant it resolved to.
 */
static const struct sim_proc sim_procs[] = {
	SIM_PROC(cuGetProcAddress, cuGetProcAddress, 11030, false),
	SIM_PROC(cuGetProcAddress, cuGetProcAddress_v2, 12000, false),
	SIM_PROC(cuInit, cuInit, 2000, false),
	SIM_PROC(cuDriverGetVersion, cuDriverGetVersion, 2000, false),
	SIM_PROC(cuDeviceGet, cuDeviceGet, 2000, false),
	SIM_PROC(cuDeviceGetCount, cuDeviceGetCount, 2000, false),
	SIM_PROC(cuDeviceGetName, cuDeviceGetName, 2000, false),
	SIM_PROC(cuDeviceGetUuid, cuDeviceGetUuid, 9020, false),
	SIM_PROC(cuDeviceGetUuid, cuDeviceGetUuid_v2, 11040, false),
	SIM_PROC(cuDeviceTotalMem, cuDeviceTotalMem, 2000, false),
	SIM_PROC(cuDeviceTotalMem, cuDeviceTotalMem_v2, 3020, false),
	SIM_PROC(cuDeviceGetAttribute, cuDeviceGetAttribute, 2000, false),
	SIM_PROC(cuDeviceGetPCIBusId, cuDeviceGetPCIBusId, 2000, false),
	SIM_PROC(cuDeviceGetDefaultMemPool, cuDeviceGetDefaultMemPool, 11020, false),
	SIM_PROC(cuDeviceGetMemPool, cuDeviceGetMemPool, 11020, false),
	SIM_PROC(cuDeviceSetMemPool, cuDeviceSetMemPool, 11020, false),
	SIM_PROC(cuMemGetInfo, cuMemGetInfo, 2000, false),
	SIM_PROC(cuMemGetInfo, cuMemGetInfo_v2, 3020, false),
	SIM_PROC(cuMemAlloc, cuMemAlloc, 2000, false),
	SIM_PROC(cuMemAlloc, cuMemAlloc_v2, 3020, false),
	SIM_PROC(cuMemAllocPitch, cuMemAllocPitch, 2000, false),
	SIM_PROC(cuMemAllocPitch, cuMemAllocPitch_v2, 3020, false),
	SIM_PROC(cuMemAllocManaged, cuMemAllocManaged, 6000, false),
	SIM_PROC(cuMemFree, cuMemFree, 2000, false),
	SIM_PROC(cuMemFree, cuMemFree_v2, 3020, false),
	SIM_PROC(cuMemAllocAsync, cuMemAllocAsync, 11020, false),
	SIM_PROC(cuMemAllocAsync, cuMemAllocAsync_ptsz, 11020, true),
	SIM_PROC(cuMemAllocFromPoolAsync, cuMemAllocFromPoolAsync, 11020, false),
	SIM_PROC(cuMemAllocFromPoolAsync, cuMemAllocFromPoolAsync_ptsz, 11020, true),
	SIM_PROC(cuMemFreeAsync, cuMemFreeAsync, 11020, false),
	SIM_PROC(cuMemFreeAsync, cuMemFreeAsync_ptsz, 11020, true),
	SIM_PROC(cuMemPoolCreate, cuMemPoolCreate, 11020, false),
	SIM_PROC(cuMemPoolDestroy, cuMemPoolDestroy, 11020, false),
	SIM_PROC(cuMemGetAllocationGranularity, cuMemGetAllocationGranularity, 10020, false),
	SIM_PROC(cuMemCreate, cuMemCreate, 10020, false),
	SIM_PROC(cuMemRelease, cuMemRelease, 10020, false),
	SIM_PROC(cuMemAddressReserve, cuMemAddressReserve, 10020, false),
	SIM_PROC(cuMemAddressFree, cuMemAddressFree, 10020, false),
	SIM_PROC(cuMemMap, cuMemMap, 10020, false),
	SIM_PROC(cuMemUnmap, cuMemUnmap, 10020, false),
	SIM_PROC(cuMemSetAccess, cuMemSetAccess, 10020, false),
	SIM_PROC(cuMemRetainAllocationHandle, cuMemRetainAllocationHandle, 11000, false),
	SIM_PROC(cuStreamCreate, cuStreamCreate, 2000, false),
	SIM_PROC(cuStreamDestroy, cuStreamDestroy_v2, 4000, false),
	SIM_PROC(cuStreamGetCtx, cuStreamGetCtx, 9020, false),
	SIM_PROC(cuStreamGetCtx, cuStreamGetCtx_ptsz, 9020, true),
	SIM_PROC(cuStreamGetCtx, cuStreamGetCtx_v2, 12050, false),
	SIM_PROC(cuStreamGetCtx, cuStreamGetCtx_v2_ptsz, 12050, true),
	SIM_PROC(cuStreamSynchronize, cuStreamSynchronize, 2000, false),
	SIM_PROC(cuStreamSynchronize, cuStreamSynchronize_ptsz, 7000, true),
	SIM_PROC(cuArrayCreate, cuArrayCreate, 2000, false),
	SIM_PROC(cuArrayCreate, cuArrayCreate_v2, 3020, false),
	SIM_PROC(cuArray3DCreate, cuArray3DCreate, 2000, false),
	SIM_PROC(cuArray3DCreate, cuArray3DCreate_v2, 3020, false),
	SIM_PROC(cuArrayDestroy, cuArrayDestroy, 2000, false),
	SIM_PROC(cuMipmappedArrayCreate, cuMipmappedArrayCreate, 5000, false),
	SIM_PROC(cuMipmappedArrayDestroy, cuMipmappedArrayDestroy, 5000, false),
	SIM_PROC(cuCtxCreate, cuCtxCreate, 2000, false),
	SIM_PROC(cuCtxCreate, cuCtxCreate_v2, 3020, false),
	SIM_PROC(cuCtxCreate, cuCtxCreate_v3, 11040, false),
	SIM_PROC(cuCtxCreate, cuCtxCreate_v4, 12050, false),
	SIM_PROC(cuCtxDestroy, cuCtxDestroy, 2000, false),
	SIM_PROC(cuCtxDestroy, cuCtxDestroy_v2, 4000, false),
	SIM_PROC(cuCtxPushCurrent, cuCtxPushCurrent_v2, 4000, false),
	SIM_PROC(cuCtxPopCurrent, cuCtxPopCurrent_v2, 4000, false),
	SIM_PROC(cuCtxSetCurrent, cuCtxSetCurrent, 2000, false),
	SIM_PROC(cuCtxGetCurrent, cuCtxGetCurrent, 2000, false),
	SIM_PROC(cuCtxGetDevice, cuCtxGetDevice, 2000, false),
	SIM_PROC(cuCtxSynchronize, cuCtxSynchronize, 2000, false),
	SIM_PROC(cuDevicePrimaryCtxRetain, cuDevicePrimaryCtxRetain, 7000, false),
	SIM_PROC(cuDevicePrimaryCtxRelease, cuDevicePrimaryCtxRelease, 7000, false),
	SIM_PROC(cuDevicePrimaryCtxRelease, cuDevicePrimaryCtxRelease_v2, 11000, false),
	SIM_PROC(cuDevicePrimaryCtxGetState, cuDevicePrimaryCtxGetState, 2000, false),
	SIM_PROC(cuDevicePrimaryCtxSetFlags, cuDevicePrimaryCtxSetFlags_v2, 11000, false),
	SIM_PROC(cuDevicePrimaryCtxReset, cuDevicePrimaryCtxReset, 7000, false),
	SIM_PROC(cuDevicePrimaryCtxReset, cuDevicePrimaryCtxReset_v2, 11000, false),
	SIM_PROC(cuLaunchKernel, cuLaunchKernel, 4000, false),
	SIM_PROC(cuLaunchKernel, cuLaunchKernel_ptsz, 7000, true),
	SIM_PROC(cuLaunchKernelEx, cuLaunchKernelEx, 11060, false),
	SIM_PROC(cuLaunchKernelEx, cuLaunchKernelEx_ptsz, 11060, true),
	SIM_PROC(cuLaunchCooperativeKernel, cuLaunchCooperativeKernel, 9000, false),
	SIM_PROC(cuLaunchCooperativeKernel, cuLaunchCooperativeKernel_ptsz, 9000, true),
	SIM_PROC(cuGraphLaunch, cuGraphLaunch, 10000, false),
	SIM_PROC(cuGraphLaunch, cuGraphLaunch_ptsz, 10000, true),
	SIM_PROC(cuGetErrorString, cuGetErrorString, 2000, false),
	SIM_PROC(cuGetErrorName, cuGetErrorName, 2000, false),
	SIM_PROC(cuGetExportTable, cuGetExportTable, 2000, false),
	SIM_PROC(cuModuleGetLoadingMode, cuModuleGetLoadingMode, 11070, false),
};
#define SIM_NPROCS (sizeof(sim_procs) / sizeof(sim_procs[0]))

/* The newest variant of base of one stream flavour usable at version. */
static const struct sim_proc *sim_proc_pick(const char *base, int version, bool per_thread,
					    bool *known)
{
	const struct sim_proc *best = NULL;
	size_t i;

	for (i = 0; i < SIM_NPROCS; i++) {
		const struct sim_proc *p = &sim_procs[i];

		if (strcmp(p->base, base) != 0)
			continue;
		*known = true;
		if (p->per_thread != per_thread || p->first_version > version)
			continue;
		if (!best || p->first_version > best->first_version)
			best = p;
	}
	return best;
}

SIM_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cuda_version,
					cuuint64_t flags,
					CUdriverProcAddressQueryResult *status)
{
	bool per_thread = flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
	const cuuint64_t valid = CU_GET_PROC_ADDRESS_LEGACY_STREAM |
				 CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
	const struct sim_proc *p = NULL;
	CUdriverProcAddressQueryResult result = CU_GET_PROC_ADDRESS_SUCCESS;
	bool known = false;

	if (!symbol || !pfn || (flags & ~valid))
		return CUDA_ERROR_INVALID_VALUE;
	if (per_thread)
		p = sim_proc_pick(symbol, cuda_version, true, &known);
	if (!p)
		p = sim_proc_pick(symbol, cuda_version, false, &known);

	if (p)
		*pfn = p->fn;
	else if (known)
		result = CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
	else if (symbol[0] == 'c' && symbol[1] == 'u' && isupper((unsigned char)symbol[2]))
		*pfn = (void *)sim_not_supported;
	else
		result = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
	if (result != CU_GET_PROC_ADDRESS_SUCCESS)
		*pfn = NULL;
	if (status)
		*status = result;
	return result == CU_GET_PROC_ADDRESS_SUCCESS ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}
