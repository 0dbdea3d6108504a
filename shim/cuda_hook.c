/*
 * gpushare's preload library: sits between a framework and the CUDA driver,
 * charges every allocation to the environment's shared-memory ledger and
 * refuses what would exceed the grant.
 *
 * Three ways lead a program to the driver, and all three land here:
 *  - programs linked with -lcuda bind to the exported cu* definitions;
 *  - cuGetProcAddress (v1 and v2) hands out the shim's wrappers, itself
 *    included, so a runtime that re-fetches cuGetProcAddress stays caught;
 *  - dlsym on libcuda's handle (libcudart's way in) goes through the dlsym
 *    trampoline in dlsym_x86_64.S, which leaves RTLD_NEXT/RTLD_DEFAULT alone.
 *
 * Settings are read once, at load. The allocation path takes no lock across
 * a driver call, does no I/O and never logs.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cuda_abi.h"
#include "ledger.h"

#define GS_EXPORT __attribute__((visibility("default")))
#define GS_HIDDEN __attribute__((visibility("hidden")))
#define unlikely(x) __builtin_expect(!!(x), 0)

/* The newest CUDA version whose ABI variants hooks.def fully describes. */
#define GS_TABLE_CUDA_VERSION 13000

/* --- tables generated from hooks.def ----------------------------------- */

#define GS_HOOK(abi, base, ver, ptsz, params) typedef CUresult(*gs_fn_##abi) params;
#define GS_REAL(abi, params) typedef CUresult(*gs_fn_##abi) params;
#include "hooks.def"
#undef GS_HOOK
#undef GS_REAL

#define GS_HOOK(abi, base, ver, ptsz, params) GS_EXPORT CUresult abi params;
#define GS_REAL(abi, params)
#include "hooks.def"
#undef GS_HOOK
#undef GS_REAL

/* Real driver entry points; NULL when the driver lacks one. */
static struct {
#define GS_HOOK(abi, base, ver, ptsz, params) gs_fn_##abi abi;
#define GS_REAL(abi, params) gs_fn_##abi abi;
#include "hooks.def"
#undef GS_HOOK
#undef GS_REAL
} real;

enum {
#define GS_HOOK(abi, base, ver, ptsz, params) GS_ID_##abi,
#define GS_REAL(abi, params)
#include "hooks.def"
#undef GS_HOOK
#undef GS_REAL
	GS_NHOOKS
};

struct gs_hook {
	const char *abi;
	const char *base;
	int version;
	int per_thread;
	void *wrapper;
	void **real;
};

static const struct gs_hook hooks[GS_NHOOKS] = {
#define GS_HOOK(abi, base, ver, ptsz, params) \
	[GS_ID_##abi] = { #abi, #base, ver, ptsz, (void *)abi, (void **)&real.abi },
#define GS_REAL(abi, params)
#include "hooks.def"
#undef GS_HOOK
#undef GS_REAL
};

static const char *const real_names[] = {
#define GS_HOOK(abi, base, ver, ptsz, params) #abi,
#define GS_REAL(abi, params) #abi,
#include "hooks.def"
#undef GS_HOOK
#undef GS_REAL
};

_Static_assert(sizeof(real) / sizeof(void *) == sizeof(real_names) / sizeof(real_names[0]),
	       "real-pointer table and name list disagree");

/* --- process state -------------------------------------------------------- */

enum gs_mode {
	GS_INERT,   /* no GPUSHARE_LEDGER: pass everything through */
	GS_ENFORCE, /* ledger mapped: charge and enforce */
	GS_BROKEN,  /* ledger named but unusable: refuse allocations */
};

#define GS_MAX_DEVS 64
#define GS_DEV_UNKNOWN (-2)
#define GS_DEV_FOREIGN (-1)

static struct {
	enum gs_mode mode;
	struct gs_ledger *ledger;
	char *ledger_path;
	int fd;		  /* this process's descriptor; holds the slot lock */
	int slot;	  /* claimed slot, -1 until first use */
	char task_id[GS_TASK_ID_LEN];
	char *trace_path;
	int dev_map[GS_MAX_DEVS];
	pthread_mutex_t claim_mu;
} g = {
	.mode = GS_INERT,
	.fd = -1,
	.slot = -1,
	.claim_mu = PTHREAD_MUTEX_INITIALIZER,
};

static struct {
	unsigned long calls[GS_NHOOKS];
	unsigned long via_dlsym[GS_NHOOKS];
	unsigned long via_gpa[GS_NHOOKS];
} trace;

#define TRACE(id, field)                                                     \
	do {                                                                 \
		if (unlikely(g.trace_path != NULL))                          \
			__atomic_fetch_add(&trace.field[id], 1, __ATOMIC_RELAXED); \
	} while (0)

GS_HIDDEN void *(*gs_real_dlsym)(void *, const char *);

/* --- resolving the real driver -------------------------------------------- */

static void resolve_real_dlsym(void)
{
	void *p;

	if (__atomic_load_n(&gs_real_dlsym, __ATOMIC_ACQUIRE) != NULL)
		return;
	p = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
	if (p == NULL)
		p = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
	__atomic_store_n(&gs_real_dlsym, (void *(*)(void *, const char *))p, __ATOMIC_RELEASE);
}

static pthread_once_t real_once = PTHREAD_ONCE_INIT;

static void resolve_real_driver(void)
{
	void **slots = (void **)&real;
	void *h;

	resolve_real_dlsym();
	if (gs_real_dlsym == NULL)
		return;
	h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
	if (h == NULL)
		h = dlopen("libcuda.so.1", RTLD_NOW);
	if (h == NULL)
		return;
	/* The handle stays open: the pointers below must outlive any dlclose. */
	for (size_t i = 0; i < sizeof(real_names) / sizeof(real_names[0]); i++)
		__atomic_store_n(&slots[i], gs_real_dlsym(h, real_names[i]), __ATOMIC_RELEASE);
}

static inline void need_real(void)
{
	pthread_once(&real_once, resolve_real_driver);
}

/* A missing real entry point is reported, never called. */
#define REAL_OR_FAIL(abi)                               \
	do {                                            \
		need_real();                            \
		if (unlikely(real.abi == NULL))         \
			return CUDA_ERROR_NOT_FOUND;    \
	} while (0)

static const struct gs_hook *hook_by_abi(const char *name)
{
	for (int i = 0; i < GS_NHOOKS; i++)
		if (strcmp(hooks[i].abi, name) == 0)
			return &hooks[i];
	return NULL;
}

/*
 * The hook for a cuGetProcAddress request: among the variants of `base`
 * with the requested stream flavour, the newest one the caller's version
 * admits; per-thread requests fall back to the legacy variant as the
 * driver does when no per-thread variant exists.
 */
static const struct gs_hook *hook_by_base(const char *base, int version, cuuint64_t flags)
{
	int per_thread = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;

	for (;;) {
		const struct gs_hook *best = NULL;

		for (int i = 0; i < GS_NHOOKS; i++) {
			const struct gs_hook *h = &hooks[i];

			if (h->per_thread != per_thread || h->version > version)
				continue;
			if (strcmp(h->base, base) != 0)
				continue;
			if (best == NULL || h->version > best->version)
				best = h;
		}
		if (best != NULL || !per_thread)
			return best;
		per_thread = 0;
	}
}

/* Called by the dlsym trampoline: a wrapper to hand out, or NULL. */
GS_HIDDEN void *gs_dlsym_hook(void *handle, const char *name)
{
	const struct gs_hook *h;
	void *p, *h_cuda;

	resolve_real_dlsym();
	if (handle == RTLD_NEXT || handle == RTLD_DEFAULT || name == NULL)
		return NULL;
	if (name[0] != 'c' || name[1] != 'u')
		return NULL;
	h = hook_by_abi(name);
	if (h == NULL || gs_real_dlsym == NULL)
		return NULL;
	p = gs_real_dlsym(handle, name);
	if (p == NULL)
		return NULL;
	/* Only loading libcuda resolves the table; never load it from here. */
	h_cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
	if (h_cuda == NULL)
		return NULL;
	dlclose(h_cuda); /* NOLOAD still took a reference */
	need_real();
	/* Wrap only what resolves to libcuda's own definition. */
	if (p != __atomic_load_n(h->real, __ATOMIC_ACQUIRE))
		return NULL;
	TRACE(h - hooks, via_dlsym);
	return h->wrapper;
}

/* --- ledger attachment ------------------------------------------------------ */

/* One line on stderr, at load only: never on a hot path. */
__attribute__((format(printf, 1, 2))) static void say(const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	fprintf(stderr, "gpushare: ");
	vfprintf(stderr, fmt, ap);
	fputc('\n', stderr);
	va_end(ap);
}

/*
 * Map the ledger through `fd`, the descriptor the slot lock is later taken
 * on: the mapping keeps that open file description, and so the lock, alive
 * even if the program closes all its descriptors. MADV_DONTFORK keeps fork
 * children from inheriting it, or a child would pin a dead parent's slot.
 */
static struct gs_ledger *map_ledger(int fd)
{
	void *map = mmap(NULL, sizeof(struct gs_ledger), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);

	if (map == MAP_FAILED)
		return NULL;
	if (madvise(map, sizeof(struct gs_ledger), MADV_DONTFORK) != 0 ||
	    gs_ledger_check(map, sizeof(struct gs_ledger)) != 0) {
		munmap(map, sizeof(struct gs_ledger));
		return NULL;
	}
	return map;
}

static void attach_ledger(const char *path)
{
	struct stat st;
	void *map;
	int fd;

	g.mode = GS_BROKEN;
	g.ledger_path = strdup(path);
	fd = open(path, O_RDWR | O_CLOEXEC);
	if (fd < 0) {
		say("cannot open ledger %s: %s; GPU allocations will fail (is nodemgr running?)",
		    path, strerror(errno));
		return;
	}
	if (fstat(fd, &st) != 0 || (size_t)st.st_size < sizeof(struct gs_ledger)) {
		say("ledger %s is too small; GPU allocations will fail", path);
		close(fd);
		return;
	}
	map = map_ledger(fd);
	if (map == NULL) {
		say("cannot use ledger %s: not a version-1 gpushare ledger, or not mappable; GPU "
		    "allocations will fail (shim and nodemgr must come from the same release)",
		    path);
		close(fd);
		return;
	}
	for (int i = 0; i < GS_MAX_DEVS; i++)
		g.dev_map[i] = GS_DEV_UNKNOWN;
	g.ledger = map;
	g.fd = fd;
	g.mode = GS_ENFORCE;
}

/* The calling process's slot, claimed on first use; -1 if none is free. */
static int my_slot(void)
{
	int s = __atomic_load_n(&g.slot, __ATOMIC_ACQUIRE);

	if (s >= 0)
		return s;
	pthread_mutex_lock(&g.claim_mu);
	s = g.slot;
	if (s < 0) {
		s = gs_ledger_claim(g.ledger, g.fd, (int32_t)getpid(), g.task_id);
		if (s >= 0)
			__atomic_store_n(&g.slot, s, __ATOMIC_RELEASE);
	}
	pthread_mutex_unlock(&g.claim_mu);
	return s < 0 ? -1 : s;
}

/* Ledger GPU index of a device ordinal, or GS_DEV_FOREIGN. */
static int ledger_gpu(CUdevice dev)
{
	CUuuid uuid;
	int idx = GS_DEV_FOREIGN;
	CUresult rc;

	if (dev >= 0 && dev < GS_MAX_DEVS) {
		idx = __atomic_load_n(&g.dev_map[dev], __ATOMIC_RELAXED);
		if (idx != GS_DEV_UNKNOWN)
			return idx;
	}
	if (real.cuDeviceGetUuid_v2 != NULL)
		rc = real.cuDeviceGetUuid_v2(&uuid, dev);
	else if (real.cuDeviceGetUuid != NULL)
		rc = real.cuDeviceGetUuid(&uuid, dev);
	else
		rc = CUDA_ERROR_NOT_FOUND;
	idx = GS_DEV_FOREIGN;
	if (rc == CUDA_SUCCESS) {
		for (uint32_t i = 0; i < g.ledger->ngpus && i < GS_MAX_GPUS; i++) {
			if (memcmp(g.ledger->gpu[i].uuid, uuid.bytes, 16) == 0) {
				idx = (int)i;
				break;
			}
		}
	}
	if (rc == CUDA_SUCCESS && dev >= 0 && dev < GS_MAX_DEVS)
		__atomic_store_n(&g.dev_map[dev], idx, __ATOMIC_RELAXED);
	return idx;
}

/* Ledger GPU of the calling thread's current context, or the driver's error. */
static CUresult current_gpu(int *gpu)
{
	CUdevice dev;
	CUresult rc;

	if (real.cuCtxGetDevice == NULL)
		return CUDA_ERROR_NOT_FOUND;
	rc = real.cuCtxGetDevice(&dev);
	if (rc == CUDA_SUCCESS)
		*gpu = ledger_gpu(dev);
	return rc;
}

/* --- allocation map --------------------------------------------------------- */

/*
 * Pointer -> (size, GPU) for live allocations, so a free uncharges exactly
 * what its allocation charged. Sharded so that threads rarely meet; a shard
 * lock is held only around the table operation.
 */
#define GS_SHARDS 64

struct gs_alloc {
	CUdeviceptr ptr; /* 0 = empty; the driver never hands out 0 */
	uint64_t size;
	int32_t gpu;
};

static struct gs_shard {
	pthread_mutex_t mu;
	struct gs_alloc *tab;
	uint32_t cap, n;
} __attribute__((aligned(64))) shards[GS_SHARDS];

static inline uint64_t mix(uint64_t x)
{
	x ^= x >> 33;
	x *= 0xff51afd7ed558ccdULL;
	x ^= x >> 33;
	return x;
}

/* Insert a; if a record for the same address existed, return it in *old. */
static int shard_put(struct gs_shard *s, struct gs_alloc a, struct gs_alloc *old)
{
	uint32_t i = (uint32_t)(mix(a.ptr) >> 6) & (s->cap - 1);
	int replaced = 0;

	while (s->tab[i].ptr != 0 && s->tab[i].ptr != a.ptr)
		i = (i + 1) & (s->cap - 1);
	if (s->tab[i].ptr == 0) {
		s->n++;
	} else {
		*old = s->tab[i];
		replaced = 1;
	}
	s->tab[i] = a;
	return replaced;
}

static int alloc_track(CUdeviceptr ptr, uint64_t size, int gpu)
{
	struct gs_shard *s = &shards[mix(ptr) & (GS_SHARDS - 1)];
	struct gs_alloc stale;
	int rc = 0, replaced = 0;

	pthread_mutex_lock(&s->mu);
	if ((s->n + 1) * 4 > s->cap * 3) {
		uint32_t ncap = s->cap ? s->cap * 2 : 64;
		struct gs_alloc *old = s->tab, *tab = calloc(ncap, sizeof(*tab));
		uint32_t ocap = s->cap;

		if (tab == NULL) {
			rc = -ENOMEM;
			goto out;
		}
		s->tab = tab;
		s->cap = ncap;
		s->n = 0;
		for (uint32_t i = 0; i < ocap; i++)
			if (old[i].ptr != 0)
				shard_put(s, old[i], &stale);
		free(old);
	}
	replaced = shard_put(s, (struct gs_alloc){ ptr, size, gpu }, &stale);
out:
	pthread_mutex_unlock(&s->mu);
	/*
	 * The driver handed out an address we still had on record: that memory
	 * went back without cuMemFree (a context was destroyed or reset), so
	 * its charge goes now.
	 */
	if (replaced)
		gs_ledger_uncharge(g.ledger, (uint32_t)__atomic_load_n(&g.slot, __ATOMIC_ACQUIRE),
				   (uint32_t)stale.gpu, stale.size);
	return rc;
}

/* Remove ptr's record into *out; 0 if found, -ENOENT if not ours. */
static int alloc_untrack(CUdeviceptr ptr, struct gs_alloc *out)
{
	struct gs_shard *s = &shards[mix(ptr) & (GS_SHARDS - 1)];
	int rc = -ENOENT;

	pthread_mutex_lock(&s->mu);
	if (s->cap != 0) {
		uint32_t m = s->cap - 1, i = (uint32_t)(mix(ptr) >> 6) & m;

		while (s->tab[i].ptr != 0 && s->tab[i].ptr != ptr)
			i = (i + 1) & m;
		if (s->tab[i].ptr == ptr) {
			*out = s->tab[i];
			/* Backward-shift deletion keeps probe chains whole without tombstones. */
			for (uint32_t j = (i + 1) & m; s->tab[j].ptr != 0; j = (j + 1) & m) {
				uint32_t home = (uint32_t)(mix(s->tab[j].ptr) >> 6) & m;

				if (((j - home) & m) >= ((j - i) & m)) {
					s->tab[i] = s->tab[j];
					i = j;
				}
			}
			s->tab[i].ptr = 0;
			s->n--;
			rc = 0;
		}
	}
	pthread_mutex_unlock(&s->mu);
	return rc;
}

/* --- wrappers ---------------------------------------------------------------- */

GS_EXPORT CUresult cuInit(unsigned int flags)
{
	TRACE(GS_ID_cuInit, calls);
	REAL_OR_FAIL(cuInit);
	return real.cuInit(flags);
}

GS_EXPORT CUresult cuDeviceGetCount(int *count)
{
	TRACE(GS_ID_cuDeviceGetCount, calls);
	REAL_OR_FAIL(cuDeviceGetCount);
	return real.cuDeviceGetCount(count);
}

GS_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
	CUresult rc;
	int gpu;

	TRACE(GS_ID_cuDeviceTotalMem_v2, calls);
	REAL_OR_FAIL(cuDeviceTotalMem_v2);
	rc = real.cuDeviceTotalMem_v2(bytes, dev);
	if (rc != CUDA_SUCCESS || g.mode != GS_ENFORCE)
		return rc;
	gpu = ledger_gpu(dev);
	if (gpu >= 0) {
		uint64_t limit = gs_ledger_limit(g.ledger, (uint32_t)gpu);

		if (limit < *bytes)
			*bytes = (size_t)limit;
	}
	return rc;
}

GS_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
	CUresult rc;
	int gpu, slot;

	TRACE(GS_ID_cuMemAlloc_v2, calls);
	REAL_OR_FAIL(cuMemAlloc_v2);
	if (g.mode == GS_INERT)
		return real.cuMemAlloc_v2(dptr, bytesize);
	if (g.mode == GS_BROKEN)
		return CUDA_ERROR_NOT_PERMITTED;
	/* Invalid arguments get the driver's own answer; nothing is charged. */
	if (dptr == NULL || bytesize == 0)
		return real.cuMemAlloc_v2(dptr, bytesize);
	rc = current_gpu(&gpu);
	if (rc != CUDA_SUCCESS)
		return rc;
	slot = my_slot();
	if (gpu < 0 || slot < 0)
		return CUDA_ERROR_OUT_OF_MEMORY;
	if (gs_ledger_charge(g.ledger, (uint32_t)slot, (uint32_t)gpu, bytesize) != 0)
		return CUDA_ERROR_OUT_OF_MEMORY;
	rc = real.cuMemAlloc_v2(dptr, bytesize);
	if (rc != CUDA_SUCCESS) {
		gs_ledger_uncharge(g.ledger, (uint32_t)slot, (uint32_t)gpu, bytesize);
		return rc;
	}
	if (alloc_track(*dptr, bytesize, gpu) != 0) {
		/* Cannot remember it, so cannot uncharge it later: give it back. */
		if (real.cuMemFree_v2 != NULL)
			real.cuMemFree_v2(*dptr);
		gs_ledger_uncharge(g.ledger, (uint32_t)slot, (uint32_t)gpu, bytesize);
		*dptr = 0;
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	return CUDA_SUCCESS;
}

GS_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr)
{
	struct gs_alloc a;
	CUresult rc;

	TRACE(GS_ID_cuMemFree_v2, calls);
	REAL_OR_FAIL(cuMemFree_v2);
	if (g.mode != GS_ENFORCE || dptr == 0)
		return real.cuMemFree_v2(dptr);
	/*
	 * Forget the record before the driver frees: once freed, another thread
	 * may be handed the same address and must not find a stale record.
	 */
	if (alloc_untrack(dptr, &a) != 0)
		return real.cuMemFree_v2(dptr);
	rc = real.cuMemFree_v2(dptr);
	if (rc != CUDA_SUCCESS) {
		/* Still allocated, so still charged; if it cannot be re-recorded it stays so. */
		alloc_track(a.ptr, a.size, a.gpu);
		return rc;
	}
	gs_ledger_uncharge(g.ledger, (uint32_t)__atomic_load_n(&g.slot, __ATOMIC_ACQUIRE),
			   (uint32_t)a.gpu, a.size);
	return CUDA_SUCCESS;
}

GS_EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes)
{
	uint64_t limit, used, share;
	CUresult rc;
	int gpu;

	TRACE(GS_ID_cuMemGetInfo_v2, calls);
	REAL_OR_FAIL(cuMemGetInfo_v2);
	rc = real.cuMemGetInfo_v2(free_bytes, total_bytes);
	if (rc != CUDA_SUCCESS || g.mode != GS_ENFORCE)
		return rc;
	if (current_gpu(&gpu) != CUDA_SUCCESS)
		return rc;
	limit = gpu >= 0 ? gs_ledger_limit(g.ledger, (uint32_t)gpu) : 0;
	used = gpu >= 0 ? gs_ledger_used(g.ledger, (uint32_t)gpu) : 0;
	share = used < limit ? limit - used : 0;
	*total_bytes = (size_t)limit;
	if (share < *free_bytes)
		*free_bytes = (size_t)share;
	return rc;
}

static inline void count_launch(void)
{
	int s;

	if (g.mode != GS_ENFORCE)
		return;
	s = my_slot();
	if (s >= 0)
		__atomic_fetch_add(&g.ledger->slot[s].launches, 1, __ATOMIC_RELAXED);
}

GS_EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
				  unsigned int bx, unsigned int by, unsigned int bz,
				  unsigned int shmem, CUstream stream, void **params, void **extra)
{
	TRACE(GS_ID_cuLaunchKernel, calls);
	REAL_OR_FAIL(cuLaunchKernel);
	count_launch();
	return real.cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra);
}

GS_EXPORT CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy,
				       unsigned int gz, unsigned int bx, unsigned int by,
				       unsigned int bz, unsigned int shmem, CUstream stream,
				       void **params, void **extra)
{
	TRACE(GS_ID_cuLaunchKernel_ptsz, calls);
	REAL_OR_FAIL(cuLaunchKernel_ptsz);
	count_launch();
	return real.cuLaunchKernel_ptsz(f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra);
}

/*
 * After the real lookup succeeds, hand out the wrapper for the ABI variant
 * the request resolved to. Beyond the CUDA version hooks.def describes, a
 * newer variant may exist that the table does not know, so there the
 * wrapper is handed out only when the driver returned the very function the
 * wrapper forwards to.
 */
static void gpa_substitute(const char *symbol, void **pfn, int version, cuuint64_t flags)
{
	const struct gs_hook *h;
	void *r;

	if (symbol == NULL || pfn == NULL || *pfn == NULL)
		return;
	h = hook_by_base(symbol, version, flags);
	if (h == NULL)
		return;
	r = __atomic_load_n(h->real, __ATOMIC_ACQUIRE);
	if (r == NULL)
		return;
	if (*pfn != r && version > GS_TABLE_CUDA_VERSION)
		return;
	TRACE(h - hooks, via_gpa);
	*pfn = h->wrapper;
}

GS_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cuda_version,
				    cuuint64_t flags)
{
	CUresult rc;

	TRACE(GS_ID_cuGetProcAddress, calls);
	REAL_OR_FAIL(cuGetProcAddress);
	rc = real.cuGetProcAddress(symbol, pfn, cuda_version, flags);
	if (rc == CUDA_SUCCESS)
		gpa_substitute(symbol, pfn, cuda_version, flags);
	return rc;
}

GS_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cuda_version,
				       cuuint64_t flags, CUdriverProcAddressQueryResult *status)
{
	CUresult rc;

	TRACE(GS_ID_cuGetProcAddress_v2, calls);
	REAL_OR_FAIL(cuGetProcAddress_v2);
	rc = real.cuGetProcAddress_v2(symbol, pfn, cuda_version, flags, status);
	if (rc == CUDA_SUCCESS)
		gpa_substitute(symbol, pfn, cuda_version, flags);
	return rc;
}

/* --- load, fork, exit ---------------------------------------------------------- */

static void after_fork_child(void)
{
	/*
	 * The inherited descriptor shares the parent's lock, and the parent's
	 * allocations are not the child's: start over with no slot and an empty
	 * map. Locks are re-made because another thread may have held them.
	 */
	if (g.mode != GS_ENFORCE)
		return;
	/* The parent's mapping was not inherited (MADV_DONTFORK); drop its descriptor too. */
	close(g.fd);
	g.slot = -1;
	g.fd = open(g.ledger_path, O_RDWR | O_CLOEXEC);
	g.ledger = g.fd >= 0 ? map_ledger(g.fd) : NULL;
	if (g.ledger == NULL) {
		if (g.fd >= 0)
			close(g.fd);
		g.fd = -1;
		g.mode = GS_BROKEN;
	}
	pthread_mutex_init(&g.claim_mu, NULL);
	for (int i = 0; i < GS_SHARDS; i++) {
		pthread_mutex_init(&shards[i].mu, NULL);
		if (shards[i].tab != NULL)
			memset(shards[i].tab, 0, sizeof(struct gs_alloc) * shards[i].cap);
		shards[i].n = 0;
	}
}

__attribute__((constructor)) static void gs_load(void)
{
	const char *ledger = getenv("GPUSHARE_LEDGER");
	const char *task = getenv("GPUSHARE_TASK_ID");
	const char *tr = getenv("GPUSHARE_TRACE");

	resolve_real_dlsym();
	for (int i = 0; i < GS_SHARDS; i++)
		pthread_mutex_init(&shards[i].mu, NULL);
	if (task != NULL)
		strncpy(g.task_id, task, sizeof(g.task_id) - 1);
	if (tr != NULL && tr[0] != '\0')
		g.trace_path = strdup(tr);
	if (ledger != NULL && ledger[0] != '\0')
		attach_ledger(ledger);
	pthread_atfork(NULL, NULL, after_fork_child);
}

__attribute__((destructor)) static void gs_unload(void)
{
	static const char *const modes[] = { "inert", "enforce", "broken" };
	char buf[4096];
	size_t n = 0;
	int fd;

	if (g.trace_path == NULL)
		return;
	/* One write per process, so lines from many processes never interleave. */
	n += (size_t)snprintf(buf + n, sizeof(buf) - n, "pid=%d mode=%s\n", (int)getpid(),
			      modes[g.mode]);
	for (int i = 0; i < GS_NHOOKS && n < sizeof(buf); i++) {
		if (!trace.calls[i] && !trace.via_dlsym[i] && !trace.via_gpa[i])
			continue;
		n += (size_t)snprintf(buf + n, sizeof(buf) - n,
				      "pid=%d hook=%s calls=%lu dlsym=%lu gpa=%lu\n", (int)getpid(),
				      hooks[i].abi, trace.calls[i], trace.via_dlsym[i],
				      trace.via_gpa[i]);
	}
	if (n > sizeof(buf))
		n = sizeof(buf);
	fd = open(g.trace_path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
	if (fd < 0)
		return;
	if (write(fd, buf, n) < 0) {
		/* Nothing useful to do at exit. */
	}
	close(fd);
}
