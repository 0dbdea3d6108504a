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

#include "cuda_abi.h"

#define SIM_EXPORT __attribute__((visibility("default")))

#define SIM_MAX_GPUS	64
#define SIM_NAME_MAX	256	/* the driver's device name buffer */
#define SIM_UUID_LEN	40	/* "GPU-" + 8-4-4-4-12 hex digits */
#define SIM_ALIGN	512	/* allocation granule and alignment */
#define SIM_CTX_DEPTH	64	/* per-thread context stack */
#define SIM_SPEC_ENV	"GPUSHARE_SIM_GPUS"

/* The daemon generates the same default node: keep the two in step. */
#define SIM_DEFAULT_GPUS	4
#define SIM_DEFAULT_NAME	"gpushare Simulated GPU"
#define SIM_DEFAULT_BYTES	17179869184ULL
#define SIM_DEFAULT_UUID	"GPU-5349d000-0000-4000-8000-%012x"

struct sim_spec {
	char name[SIM_NAME_MAX];
	char uuid[SIM_UUID_LEN + 1];	/* lowercased */
	unsigned char uuid_bytes[16];
	size_t bytes;
};

struct sim_extent {
	size_t off;
	size_t len;
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

struct CUctx_st {
	struct CUctx_st *next;	/* sim_ctx_list; unused by primaries */
	int dev;
};

struct sim_device {
	const struct sim_spec *spec;
	int spec_index;
	struct sim_heap heap;
	struct CUctx_st primary;
	unsigned int primary_refs;	/* under sim_ctx_lock */
};

/*
 * A stack slot records the device with the handle so that the hot paths
 * never read a context object another thread may have destroyed.
 */
struct sim_ctx_slot {
	CUcontext ctx;
	int dev;
};

enum { SIM_UNINIT, SIM_READY, SIM_GONE };

static struct sim_spec sim_specs[SIM_MAX_GPUS];
static int sim_nspecs;
static struct sim_device sim_devs[SIM_MAX_GPUS];
static int sim_ndevs;

static pthread_once_t sim_once = PTHREAD_ONCE_INIT;
static CUresult sim_init_result;
static int sim_state;		/* SIM_READY is stored with release */

static pthread_mutex_t sim_ctx_lock = PTHREAD_MUTEX_INITIALIZER;
static struct CUctx_st *sim_ctx_list;

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

/* Device list: GPUSHARE_SIM_GPUS, then CUDA_VISIBLE_DEVICES. */

static int sim_hexval(char c)
{
	if (c >= '0' && c <= '9')
		return c - '0';
	c = (char)tolower((unsigned char)c);
	return c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

static bool sim_parse_uuid(struct sim_spec *s, const char *str, size_t len)
{
	size_t i, n = 0;

	if (len != SIM_UUID_LEN || strncmp(str, "GPU-", 4) != 0)
		return false;
	memcpy(s->uuid, "GPU-", 4);
	for (i = 4; i < len; i++) {
		bool dash = i == 12 || i == 17 || i == 22 || i == 27;
		int v = sim_hexval(str[i]);

		if (dash ? str[i] != '-' : v < 0)
			return false;
		s->uuid[i] = (char)tolower((unsigned char)str[i]);
		if (dash)
			continue;
		if (n % 2 == 0)
			s->uuid_bytes[n / 2] = (unsigned char)(v << 4);
		else
			s->uuid_bytes[n / 2] |= (unsigned char)v;
		n++;
	}
	s->uuid[len] = '\0';
	return true;
}

static bool sim_parse_bytes(size_t *out, const char *str, size_t len)
{
	uint64_t v = 0;
	size_t i;

	for (i = 0; i < len; i++) {
		unsigned int digit = (unsigned char)str[i] - '0';

		if (digit > 9 || v > (UINT64_MAX - digit) / 10)
			return false;
		v = v * 10 + digit;
	}
	if (len == 0 || v > SIZE_MAX)
		return false;
	*out = (size_t)v;
	return true;
}

/* NULL when the entry is good, else why it is not. */
static const char *sim_parse_entry(struct sim_spec *s, const char *e, size_t len)
{
	const char *end = e + len;
	const char *bar1 = memchr(e, '|', len);
	const char *bar2 = bar1 ? memchr(bar1 + 1, '|', (size_t)(end - bar1 - 1)) : NULL;
	int i;

	if (!bar2 || memchr(bar2 + 1, '|', (size_t)(end - bar2 - 1)))
		return "expected NAME|UUID|BYTES";
	if (bar1 == e || bar1 - e >= SIM_NAME_MAX)
		return "name empty or too long";
	memcpy(s->name, e, (size_t)(bar1 - e));
	s->name[bar1 - e] = '\0';
	if (!sim_parse_uuid(s, bar1 + 1, (size_t)(bar2 - bar1 - 1)))
		return "bad UUID";
	if (!sim_parse_bytes(&s->bytes, bar2 + 1, (size_t)(end - bar2 - 1)))
		return "bad byte count";
	/* CUDA_VISIBLE_DEVICES picks devices by UUID prefix: keep UUIDs unique. */
	for (i = 0; i < sim_nspecs; i++)
		if (strcmp(sim_specs[i].uuid, s->uuid) == 0)
			return "duplicate UUID";
	return NULL;
}

static CUresult sim_load_specs(void)
{
	const char *env = getenv(SIM_SPEC_ENV);
	const char *p, *semi;
	char uuid[SIM_UUID_LEN + 1];

	if (!env || !*env) {
		for (; sim_nspecs < SIM_DEFAULT_GPUS; sim_nspecs++) {
			struct sim_spec *s = &sim_specs[sim_nspecs];

			snprintf(s->name, sizeof(s->name), "%s", SIM_DEFAULT_NAME);
			snprintf(uuid, sizeof(uuid), SIM_DEFAULT_UUID, (unsigned int)sim_nspecs);
			sim_parse_uuid(s, uuid, strlen(uuid));
			s->bytes = (size_t)SIM_DEFAULT_BYTES;
		}
		return CUDA_SUCCESS;
	}
	for (p = env;; p = semi + 1) {
		size_t len;
		const char *why;

		semi = strchr(p, ';');
		len = semi ? (size_t)(semi - p) : strlen(p);
		why = sim_nspecs == SIM_MAX_GPUS ? "more than 64 entries" :
		      sim_parse_entry(&sim_specs[sim_nspecs], p, len);
		if (why) {
			fprintf(stderr, "gpushare sim: %s: bad entry \"%.*s\": %s\n",
				SIM_SPEC_ENV, (int)len, p, why);
			sim_nspecs = 0;
			return CUDA_ERROR_INVALID_VALUE;
		}
		sim_nspecs++;
		if (!semi)
			return CUDA_SUCCESS;
	}
}

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
	sim_init_result = sim_load_specs();
	if (sim_init_result != CUDA_SUCCESS)
		return;
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

static void sim_ext_insert(struct sim_extent *v, size_t *n, size_t at, size_t off, size_t len)
{
	memmove(&v[at + 1], &v[at], (*n - at) * sizeof(*v));
	v[at].off = off;
	v[at].len = len;
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
	h->nfree = 1;
	__atomic_store_n(&h->base, (uintptr_t)p, __ATOMIC_RELEASE);
	return true;
}

static CUresult sim_heap_alloc(struct sim_device *d, size_t bytes, CUdeviceptr *out)
{
	struct sim_heap *h = &d->heap;
	CUresult rc = CUDA_ERROR_OUT_OF_MEMORY;
	size_t size, i, off;

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
	sim_ext_insert(h->live, &h->nlive, sim_ext_search(h->live, h->nlive, off), off, size);
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

static CUresult sim_heap_free(struct sim_heap *h, size_t off)
{
	struct sim_extent *f;
	size_t at, len;
	bool join_prev, join_next;

	pthread_mutex_lock(&h->lock);
	at = sim_ext_search(h->live, h->nlive, off);
	if (at == h->nlive || h->live[at].off != off) {
		pthread_mutex_unlock(&h->lock);
		return CUDA_ERROR_INVALID_VALUE;
	}
	len = h->live[at].len;
	sim_ext_remove(h->live, &h->nlive, at);
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
		sim_ext_insert(f, &h->nfree, at, off, len);
	}
	pthread_mutex_unlock(&h->lock);
	return CUDA_SUCCESS;
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
}

/* Contexts. */

static int sim_current_dev(void)
{
	return sim_depth ? sim_stack[sim_depth - 1].dev : -1;
}

/* The device of a live context handle, or -1. */
static int sim_ctx_device(CUcontext ctx)
{
	struct CUctx_st *c;
	int i, dev = -1;

	for (i = 0; ctx && i < sim_ndevs; i++)
		if (ctx == &sim_devs[i].primary)
			return i;
	pthread_mutex_lock(&sim_ctx_lock);
	for (c = sim_ctx_list; ctx && c; c = c->next)
		if (c == ctx)
			dev = c->dev;
	pthread_mutex_unlock(&sim_ctx_lock);
	return dev;
}

static CUresult sim_push(CUcontext ctx, int dev)
{
	if (sim_depth == SIM_CTX_DEPTH)
		return CUDA_ERROR_OUT_OF_MEMORY;
	sim_stack[sim_depth].ctx = ctx;
	sim_stack[sim_depth].dev = dev;
	sim_depth++;
	return CUDA_SUCCESS;
}

static CUresult sim_ctx_create(CUcontext *pctx, CUdevice dev)
{
	CUresult rc = sim_check(pctx, dev);
	struct CUctx_st *c;

	if (rc != CUDA_SUCCESS)
		return rc;
	c = calloc(1, sizeof(*c));
	if (!c)
		return CUDA_ERROR_OUT_OF_MEMORY;
	c->dev = dev;
	rc = sim_push(c, dev);
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
	free(c);
	return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxSetCurrent(CUcontext ctx)
{
	int dev;

	SIM_REQUIRE_INIT();
	if (!ctx) {
		/* Documented as popping the stack, or nothing when it is empty. */
		if (sim_depth)
			sim_depth--;
		return CUDA_SUCCESS;
	}
	dev = sim_ctx_device(ctx);
	if (dev < 0)
		return CUDA_ERROR_INVALID_CONTEXT;
	if (!sim_depth)
		return sim_push(ctx, dev);
	sim_stack[sim_depth - 1].ctx = ctx;
	sim_stack[sim_depth - 1].dev = dev;
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
	int dev;

	SIM_REQUIRE_INIT();
	dev = sim_ctx_device(ctx);
	return dev < 0 ? CUDA_ERROR_INVALID_CONTEXT : sim_push(ctx, dev);
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

SIM_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
	CUresult rc = sim_check_dev(dev);

	if (rc != CUDA_SUCCESS)
		return rc;
	pthread_mutex_lock(&sim_ctx_lock);
	if (sim_devs[dev].primary_refs)
		sim_devs[dev].primary_refs--;
	else
		rc = CUDA_ERROR_INVALID_CONTEXT;
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

SIM_EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev)
{
	return sim_check_dev(dev);
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

SIM_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
	SIM_REQUIRE_INIT();
	if (!dptr || bytesize == 0)
		return CUDA_ERROR_INVALID_VALUE;
	if (!sim_depth)
		return CUDA_ERROR_INVALID_CONTEXT;
	return sim_heap_alloc(&sim_devs[sim_current_dev()], bytesize, dptr);
}

SIM_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr)
{
	int i;

	SIM_REQUIRE_INIT();
	for (i = 0; dptr && i < sim_ndevs; i++) {
		struct sim_heap *h = &sim_devs[i].heap;
		uintptr_t base = __atomic_load_n(&h->base, __ATOMIC_ACQUIRE);

		if (base && dptr >= base && dptr - base < h->arena)
			return sim_heap_free(h, (size_t)(dptr - base));
	}
	return CUDA_ERROR_INVALID_VALUE;
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
	SIM_PROC(cuDeviceTotalMem, cuDeviceTotalMem_v2, 3020, false),
	SIM_PROC(cuDeviceGetAttribute, cuDeviceGetAttribute, 2000, false),
	SIM_PROC(cuDeviceGetPCIBusId, cuDeviceGetPCIBusId, 2000, false),
	SIM_PROC(cuMemAlloc, cuMemAlloc_v2, 3020, false),
	SIM_PROC(cuMemFree, cuMemFree_v2, 3020, false),
	SIM_PROC(cuMemGetInfo, cuMemGetInfo_v2, 3020, false),
	SIM_PROC(cuCtxCreate, cuCtxCreate_v2, 3020, false),
	SIM_PROC(cuCtxCreate, cuCtxCreate_v4, 12050, false),
	SIM_PROC(cuCtxDestroy, cuCtxDestroy_v2, 4000, false),
	SIM_PROC(cuCtxPushCurrent, cuCtxPushCurrent_v2, 4000, false),
	SIM_PROC(cuCtxPopCurrent, cuCtxPopCurrent_v2, 4000, false),
	SIM_PROC(cuCtxSetCurrent, cuCtxSetCurrent, 2000, false),
	SIM_PROC(cuCtxGetCurrent, cuCtxGetCurrent, 2000, false),
	SIM_PROC(cuCtxGetDevice, cuCtxGetDevice, 2000, false),
	SIM_PROC(cuCtxSynchronize, cuCtxSynchronize, 2000, false),
	SIM_PROC(cuDevicePrimaryCtxRetain, cuDevicePrimaryCtxRetain, 2000, false),
	SIM_PROC(cuDevicePrimaryCtxRelease, cuDevicePrimaryCtxRelease_v2, 11000, false),
	SIM_PROC(cuDevicePrimaryCtxGetState, cuDevicePrimaryCtxGetState, 2000, false),
	SIM_PROC(cuDevicePrimaryCtxSetFlags, cuDevicePrimaryCtxSetFlags_v2, 11000, false),
	SIM_PROC(cuDevicePrimaryCtxReset, cuDevicePrimaryCtxReset_v2, 11000, false),
	SIM_PROC(cuLaunchKernel, cuLaunchKernel, 4000, false),
	SIM_PROC(cuLaunchKernel, cuLaunchKernel_ptsz, 7000, true),
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
