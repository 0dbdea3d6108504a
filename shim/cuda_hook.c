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
 *    trampoline in dlsym_x86_64.S, which leaves RTLD_NEXT alone and lets
 *    RTLD_DEFAULT find a hooked name only where the driver has it.
 * NVML's memory queries are answered the same two ways (export and dlsym),
 * so nvidia-smi inside a task shows the environment's share.
 *
 * Settings are read once: at load or, for a shim that loaded inert, when
 * gpushare_attach (gpushare.h) gives them. The allocation path takes no lock
 * across a driver call, does no I/O and never logs; the launch path touches
 * shared memory with one relaxed load (the task's pause word) and one relaxed
 * add.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <sched.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "cuda_abi.h"
#include "gpushare.h"
#include "ledger.h"

#define GS_EXPORT __attribute__((visibility("default")))
#define GS_HIDDEN __attribute__((visibility("hidden")))
/*
 * A sanitizer's runtime looks up its own interceptors with dlsym before it
 * is initialised, so the path dlsym takes through the shim must not be
 * instrumented.
 */
#define GS_UNINSTRUMENTED __attribute__((no_sanitize("thread", "address", "undefined")))
#define likely(x) __builtin_expect(!!(x), 1)
#define unlikely(x) __builtin_expect(!!(x), 0)

/* The newest CUDA version whose ABI variants hooks.def fully describes. */
#define GS_TABLE_CUDA_VERSION 13000

/*
 * Charging granularity (docs/architecture.md, "What is charged"): the
 * driver backs allocations of 2 MiB and more with 2 MiB pages, and packs
 * smaller ones at 512-byte alignment inside such pages.
 */
#define GS_PAGE (2ULL << 20)
#define GS_SMALL_ALIGN 512ULL

/* --- tables generated from hooks.def ----------------------------------- */

#define GS_HOOK(abi, base, ver, ptsz, params) typedef CUresult(*gs_fn_##abi) params;
#define GS_REAL(abi, params) typedef CUresult(*gs_fn_##abi) params;
#define GS_NVML_HOOK(abi, params) typedef nvmlReturn_t(*gs_fn_##abi) params;
#define GS_NVML_REAL(abi, params) typedef nvmlReturn_t(*gs_fn_##abi) params;
#include "hooks.def"

#define GS_HOOK(abi, base, ver, ptsz, params) GS_EXPORT CUresult abi params;
#define GS_REAL(abi, params)
#define GS_NVML_HOOK(abi, params) GS_EXPORT nvmlReturn_t abi params;
#include "hooks.def"

/* Real driver and NVML entry points; NULL where the library lacks one. */
static struct {
#define GS_HOOK(abi, base, ver, ptsz, params) gs_fn_##abi abi;
#define GS_REAL(abi, params) gs_fn_##abi abi;
#include "hooks.def"
} real;

static struct {
#define GS_HOOK(abi, base, ver, ptsz, params)
#define GS_REAL(abi, params)
#define GS_NVML_HOOK(abi, params) gs_fn_##abi abi;
#define GS_NVML_REAL(abi, params) gs_fn_##abi abi;
#include "hooks.def"
} nvml;

static const char *const real_names[] = {
#define GS_HOOK(abi, base, ver, ptsz, params) #abi,
#define GS_REAL(abi, params) #abi,
#include "hooks.def"
};

static const char *const nvml_names[] = {
#define GS_HOOK(abi, base, ver, ptsz, params)
#define GS_REAL(abi, params)
#define GS_NVML_HOOK(abi, params) #abi,
#define GS_NVML_REAL(abi, params) #abi,
#include "hooks.def"
};

_Static_assert(sizeof(real) / sizeof(void *) == sizeof(real_names) / sizeof(real_names[0]),
	       "real-pointer table and name list disagree");
_Static_assert(sizeof(nvml) / sizeof(void *) == sizeof(nvml_names) / sizeof(nvml_names[0]),
	       "NVML pointer table and name list disagree");

/* Every entry of the lookup table: hooks, known unhooked variants, NVML hooks. */
enum {
#define GS_HOOK(abi, base, ver, ptsz, params) GS_ID_##abi,
#define GS_REAL(abi, params)
#define GS_VARIANT(abi, base, ver, ptsz) GS_ID_##abi,
#define GS_NVML_HOOK(abi, params) GS_ID_##abi,
#include "hooks.def"
	GS_NENTRIES
};

enum gs_lib { GS_LIB_CUDA, GS_LIB_NVML };

struct gs_hook {
	const char *abi;
	const char *base; /* NULL for NVML */
	int version;
	int per_thread;
	enum gs_lib lib;
	void *wrapper; /* NULL: a variant the shim does not wrap */
	void **real;
};

static const struct gs_hook hooks[GS_NENTRIES] = {
#define GS_HOOK(abi, base, ver, ptsz, params) \
	[GS_ID_##abi] = { #abi, #base, ver, ptsz, GS_LIB_CUDA, (void *)abi, (void **)&real.abi },
#define GS_REAL(abi, params)
#define GS_VARIANT(abi, base, ver, ptsz) \
	[GS_ID_##abi] = { #abi, #base, ver, ptsz, GS_LIB_CUDA, NULL, NULL },
#define GS_NVML_HOOK(abi, params) \
	[GS_ID_##abi] = { #abi, NULL, 0, 0, GS_LIB_NVML, (void *)abi, (void **)&nvml.abi },
#include "hooks.def"
};

/* An acquire load of a real entry point: resolution publishes them with release. */
#define R(table, abi) __atomic_load_n(&(table).abi, __ATOMIC_ACQUIRE)

/* --- process state -------------------------------------------------------- */

enum gs_mode {
	GS_INERT = GPUSHARE_MODE_INERT,     /* no ledger: pass everything through */
	GS_ENFORCE = GPUSHARE_MODE_ENFORCE, /* ledger mapped: charge and enforce */
	GS_BROKEN = GPUSHARE_MODE_BROKEN,   /* ledger named at load, unusable: refuse allocations */
};

#define GS_MAX_DEVS 64
#define GS_DEV_UNKNOWN (-2)
#define GS_DEV_FOREIGN (-1)
/* ledger_gpu: the driver could not say which GPU the ordinal is (a bad one, no cuInit). */
#define GS_DEV_UNRESOLVED (-4)

/*
 * g.mode changes at most once after load, when gpushare_attach takes an
 * inert process to enforcing (a release store, after all else it sets). The
 * wrappers still read it plainly, so their paths stay as they were: each
 * reads it after an acquire load of a real entry point, and the real table
 * is filled only after the mark that attach tests under attach_mu, so a
 * successful attach happens before any wrapper reaches the driver. Other
 * readers use mode_acquire().
 */
static struct {
	enum gs_mode mode;
	struct gs_ledger *ledger;
	int fd;		  /* this process's descriptor; holds the slot lock */
	int slot;	  /* claimed slot, -1 until first use */
	char task_id[GS_TASK_ID_LEN];
	char *trace_path;
	int dev_map[GS_MAX_DEVS];
	uint8_t ctx_state[GS_MAX_GPUS];  /* the context charge on that GPU: enum gs_ctx_state */
	uint64_t ctx_bytes[GS_MAX_GPUS]; /* what was charged for it */
	CUcontext primary[GS_MAX_DEVS];  /* each device's primary context, once retained */
	int primary_refs[GS_MAX_DEVS];   /* this process's retains of it */
	unsigned int ctx_gen;		 /* bumped when a context goes away */
	/*
	 * Iteration boundaries this process reported (gpushare_iteration): an
	 * allocation made in an earlier epoch than the current one, or pinned
	 * by gpushare_mark_persistent, is in its slot's persistent share.
	 */
	uint64_t epoch;
	pthread_mutex_t claim_mu;
	pthread_mutex_t epoch_mu; /* orders boundaries and marks against each other */
	char ledger_path[PATH_MAX]; /* to map it afresh after fork */
} g = {
	.mode = GS_INERT,
	.fd = -1,
	.slot = -1,
	.claim_mu = PTHREAD_MUTEX_INITIALIZER,
	.epoch_mu = PTHREAD_MUTEX_INITIALIZER,
};

/* The mode, for readers that are not ordered after gpushare_attach otherwise. */
static inline enum gs_mode mode_acquire(void)
{
	return __atomic_load_n(&g.mode, __ATOMIC_ACQUIRE);
}

/*
 * What the launch path touches. Until the process has a slot both point at
 * private words, so the path needs no mode test: claiming a slot repoints
 * them into the ledger (the task's pause word, the slot's launch counter).
 */
static uint32_t never_paused;
static uint64_t unattached_launches;
static struct {
	uint32_t *pause;
	uint64_t *launches;
} hot = { &never_paused, &unattached_launches };

static struct {
	unsigned long calls[GS_NENTRIES];
	unsigned long via_dlsym[GS_NENTRIES];
	unsigned long via_gpa[GS_NENTRIES];
} trace;

#define TRACE(id, field)                                                     \
	do {                                                                 \
		if (unlikely(g.trace_path != NULL))                          \
			__atomic_fetch_add(&trace.field[id], 1, __ATOMIC_RELAXED); \
	} while (0)

GS_HIDDEN void *(*gs_real_dlsym)(void *, const char *);

/* --- resolving the real libraries ------------------------------------------ */

GS_UNINSTRUMENTED static void resolve_real_dlsym(void)
{
	void *p;

	if (__atomic_load_n(&gs_real_dlsym, __ATOMIC_ACQUIRE) != NULL)
		return;
	p = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
	if (p == NULL)
		p = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
	__atomic_store_n(&gs_real_dlsym, (void *(*)(void *, const char *))p, __ATOMIC_RELEASE);
}

static void fill_table(void *h, void **slots, const char *const *names, size_t n)
{
	for (size_t i = 0; i < n; i++)
		__atomic_store_n(&slots[i], gs_real_dlsym(h, names[i]), __ATOMIC_RELEASE);
}

static pthread_once_t real_once = PTHREAD_ONCE_INIT;

/*
 * Orders gpushare_attach against the first filling of the real table: the
 * table is filled only by a wrapper's first call, and from then on calls
 * reach the driver, so attaching is too late. Either attach finishes first
 * and every wrapper that reaches the driver sees it, or the mark is set
 * first and attach refuses.
 */
static pthread_mutex_t attach_mu = PTHREAD_MUTEX_INITIALIZER;
static int driver_reached; /* under attach_mu */

static void resolve_real_driver(void)
{
	void *h;

	resolve_real_dlsym();
	if (gs_real_dlsym == NULL)
		return;
	h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
	if (h == NULL)
		h = dlopen("libcuda.so.1", RTLD_NOW);
	if (h == NULL)
		return;
	pthread_mutex_lock(&attach_mu);
	driver_reached = 1;
	pthread_mutex_unlock(&attach_mu);
	/* The handle stays open: the pointers must outlive any dlclose. */
	fill_table(h, (void **)&real, real_names, sizeof(real_names) / sizeof(real_names[0]));
}

static inline void need_real(void)
{
	pthread_once(&real_once, resolve_real_driver);
}

/*
 * NVML is never loaded by the shim: its wrappers are only reached by a
 * program that loaded it, so the table is filled from the library already
 * there, retried until it is.
 */
static pthread_mutex_t nvml_mu = PTHREAD_MUTEX_INITIALIZER;
static int nvml_resolved;

static void need_nvml(void)
{
	void *h;

	if (__atomic_load_n(&nvml_resolved, __ATOMIC_ACQUIRE))
		return;
	resolve_real_dlsym();
	pthread_mutex_lock(&nvml_mu);
	if (!nvml_resolved && gs_real_dlsym != NULL) {
		h = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_NOLOAD);
		if (h != NULL) {
			fill_table(h, (void **)&nvml, nvml_names,
				   sizeof(nvml_names) / sizeof(nvml_names[0]));
			__atomic_store_n(&nvml_resolved, 1, __ATOMIC_RELEASE);
		}
	}
	pthread_mutex_unlock(&nvml_mu);
}

/*
 * The real entry point into `fn`, resolving the table on first use. A
 * missing one is reported, never called.
 */
#define GET_REAL(abi, fn)                                          \
	gs_fn_##abi fn = R(real, abi);                             \
	if (unlikely(fn == NULL)) {                                \
		need_real();                                       \
		fn = R(real, abi);                                 \
		if (fn == NULL)                                    \
			return CUDA_ERROR_NOT_FOUND;               \
	}

#define GET_NVML(abi, fn)                                          \
	gs_fn_##abi fn;                                            \
	need_nvml();                                               \
	fn = R(nvml, abi);                                         \
	if (fn == NULL)                                            \
		return NVML_ERROR_FUNCTION_NOT_FOUND;

static const struct gs_hook *hook_by_abi(const char *name)
{
	for (int i = 0; i < GS_NENTRIES; i++)
		if (hooks[i].wrapper != NULL && strcmp(hooks[i].abi, name) == 0)
			return &hooks[i];
	return NULL;
}

/*
 * The ABI variant a cuGetProcAddress request resolves to, as the driver
 * resolves it: among the variants of `base` of the requested stream
 * flavour, the newest the caller's version admits; a per-thread request
 * falls back to the legacy flavour when the name has no per-thread variant.
 * NULL when the table knows no variant the version admits.
 */
static const struct gs_hook *variant_for(const char *base, int version, cuuint64_t flags)
{
	int per_thread = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;

	for (;;) {
		const struct gs_hook *best = NULL;

		for (int i = 0; i < GS_NENTRIES; i++) {
			const struct gs_hook *h = &hooks[i];

			if (h->lib != GS_LIB_CUDA || strcmp(h->base, base) != 0)
				continue;
			if (h->per_thread != per_thread || h->version > version)
				continue;
			if (best == NULL || h->version > best->version)
				best = h;
		}
		if (best != NULL || !per_thread)
			return best;
		per_thread = 0;
	}
}

/* The part of the dlsym hook that sees every lookup in the process: uninstrumented. */
GS_UNINSTRUMENTED static int maybe_hooked(void *handle, const char *name)
{
	resolve_real_dlsym();
	if (handle == RTLD_NEXT || name == NULL)
		return 0;
	if (name[0] == 'c' && name[1] == 'u')
		return 1;
	return name[0] == 'n' && name[1] == 'v' && name[2] == 'm' && name[3] == 'l';
}

/* A lookup of a cu* or nvml* name on a library handle. */
static void *gs_dlsym_wrapper(void *handle, const char *name)
{
	const struct gs_hook *h;
	const char *soname;
	void *p, *lib, *own;

	h = hook_by_abi(name);
	if (h == NULL || gs_real_dlsym == NULL)
		return NULL;
	p = gs_real_dlsym(handle, name);
	if (p == NULL)
		return NULL;
	/* Only the program loads these libraries; never load one from here. */
	soname = h->lib == GS_LIB_CUDA ? "libcuda.so.1" : "libnvidia-ml.so.1";
	lib = dlopen(soname, RTLD_NOW | RTLD_NOLOAD);
	if (lib == NULL)
		return NULL;
	/*
	 * libcuda's own definition is looked up here, as the real table would
	 * hold it, rather than by filling the table: a lookup calls nothing, and
	 * must not make a later gpushare_attach too late.
	 */
	if (h->lib == GS_LIB_CUDA) {
		own = gs_real_dlsym(lib, name);
	} else {
		need_nvml();
		own = __atomic_load_n(h->real, __ATOMIC_ACQUIRE);
	}
	dlclose(lib); /* NOLOAD still took a reference */
	/* Wrap only what resolves to the library's own definition. */
	if (p != own)
		return NULL;
	TRACE(h - hooks, via_dlsym);
	return h->wrapper;
}

/* What gs_dlsym_hook returns for "answer NULL": never a function's address. */
#define GS_DLSYM_NONE ((void *)1)

/*
 * A global lookup (RTLD_DEFAULT) of a cu* or nvml* name. glibc would find
 * the shim's export of every hooked name, even one the installed driver
 * lacks (cuCtxCreate_v4 on a 535 driver), and calling that returns
 * CUDA_ERROR_NOT_FOUND: a program probing for an entry point would think it
 * there. Without the shim such a lookup finds nothing, so it answers NULL
 * when the library the name belongs to is loaded but lacks it, or is not
 * loaded and nothing after the shim in the global scope defines the name.
 * dlerror() then holds the message of a lookup past the shim that failed
 * here, naming the shim rather than the caller. Every other lookup
 * reaches glibc untouched.
 */
static void *gs_dlsym_global(const char *name)
{
	const struct gs_hook *h;
	void *lib, *theirs;

	h = hook_by_abi(name);
	if (h == NULL || gs_real_dlsym == NULL)
		return NULL;
	/* Someone before the shim in the global scope (the program) defines it. */
	if (gs_real_dlsym(RTLD_DEFAULT, name) != h->wrapper)
		return NULL;
	/* Only the program loads these libraries; never load one from here. */
	lib = dlopen(h->lib == GS_LIB_CUDA ? "libcuda.so.1" : "libnvidia-ml.so.1",
		     RTLD_NOW | RTLD_NOLOAD);
	if (lib != NULL) {
		theirs = gs_real_dlsym(lib, name);
		dlclose(lib); /* NOLOAD still took a reference */
		if (theirs != NULL)
			return NULL;
	}
	/*
	 * Also the last dl call, so that dlerror() reports its failure (dlclose
	 * cleared the error state).
	 */
	theirs = gs_real_dlsym(RTLD_NEXT, name);
	return lib != NULL || theirs == NULL ? GS_DLSYM_NONE : NULL;
}

/*
 * Called by the dlsym trampoline: a wrapper to hand out, GS_DLSYM_NONE to
 * answer NULL, or NULL to let glibc answer.
 */
GS_HIDDEN GS_UNINSTRUMENTED void *gs_dlsym_hook(void *handle, const char *name)
{
	if (!maybe_hooked(handle, name))
		return NULL;
	return handle == RTLD_DEFAULT ? gs_dlsym_global(name) : gs_dlsym_wrapper(handle, name);
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

/* Why a ledger could not be taken into use. */
enum gs_ledger_fault {
	GS_LEDGER_USABLE,
	GS_LEDGER_UNOPENED, /* errno says why */
	GS_LEDGER_SHORT,
	GS_LEDGER_FOREIGN, /* not mappable, or not a ledger of this version */
};

/* Open and map the ledger at `path` into *fd and *map, or say why not. */
static enum gs_ledger_fault open_ledger(const char *path, int *fd, struct gs_ledger **map)
{
	enum gs_ledger_fault fault;
	struct stat st;

	/* Kept for fork children, which map it afresh: a path that cannot be kept is unusable. */
	if (strlen(path) >= sizeof(g.ledger_path)) {
		errno = ENAMETOOLONG;
		return GS_LEDGER_UNOPENED;
	}
	*fd = open(path, O_RDWR | O_CLOEXEC);
	if (*fd < 0)
		return GS_LEDGER_UNOPENED;
	fault = GS_LEDGER_SHORT;
	if (fstat(*fd, &st) != 0 || (size_t)st.st_size < sizeof(struct gs_ledger))
		goto fail;
	fault = GS_LEDGER_FOREIGN;
	*map = map_ledger(*fd);
	if (*map == NULL)
		goto fail;
	return GS_LEDGER_USABLE;
fail:
	close(*fd);
	*fd = -1;
	return fault;
}

/* Publish an opened ledger and enforce it: the mode last, for readers that test it first. */
static void start_enforcing(const char *path, int fd, struct gs_ledger *map)
{
	strcpy(g.ledger_path, path); /* open_ledger checked that it fits */
	for (int i = 0; i < GS_MAX_DEVS; i++)
		g.dev_map[i] = GS_DEV_UNKNOWN;
	g.ledger = map;
	g.fd = fd;
	__atomic_store_n(&g.mode, GS_ENFORCE, __ATOMIC_RELEASE);
}

/* GPUSHARE_LEDGER at load: a ledger named but unusable breaks the process, aloud. */
static void attach_at_load(const char *path)
{
	struct gs_ledger *map = NULL;
	int fd = -1;

	switch (open_ledger(path, &fd, &map)) {
	case GS_LEDGER_USABLE:
		start_enforcing(path, fd, map);
		return;
	case GS_LEDGER_UNOPENED:
		say("cannot open ledger %s: %s; GPU allocations will fail (is nodemgr running?)",
		    path, strerror(errno));
		break;
	case GS_LEDGER_SHORT:
		say("ledger %s is too small; GPU allocations will fail", path);
		break;
	case GS_LEDGER_FOREIGN:
		say("cannot use ledger %s: not a version-%d gpushare ledger, or not mappable; GPU "
		    "allocations will fail (shim and nodemgr must come from the same release)",
		    path, GS_LEDGER_VERSION);
		break;
	}
	g.mode = GS_BROKEN;
}

/*
 * Too late is decided by driver_reached: once any wrapper has reached the
 * driver, allocations and contexts may exist that were never charged, and
 * primary retains that were never counted. Lookups (dlsym on libcuda's
 * handle) only hand out wrappers, which test the mode at each call, so they
 * do not count. Failure changes nothing, so the caller may still decide
 * what an unenforced process should do.
 */
GS_EXPORT int gpushare_attach(const char *ledger_path, const char *task_id)
{
	struct gs_ledger *map = NULL;
	int fd = -1, rc;

	if (ledger_path == NULL || ledger_path[0] == '\0' || task_id == NULL ||
	    task_id[0] == '\0' || strlen(task_id) >= sizeof(g.task_id))
		return GPUSHARE_E_INVAL;
	pthread_mutex_lock(&attach_mu);
	if (g.mode != GS_INERT) {
		rc = GPUSHARE_E_ATTACHED;
		goto fail;
	}
	if (driver_reached) {
		rc = GPUSHARE_E_TOO_LATE;
		goto fail;
	}
	if (open_ledger(ledger_path, &fd, &map) != GS_LEDGER_USABLE) {
		rc = GPUSHARE_E_LEDGER;
		goto fail;
	}
	strcpy(g.task_id, task_id); /* checked to fit above */
	start_enforcing(ledger_path, fd, map);
	pthread_mutex_unlock(&attach_mu);
	return GPUSHARE_OK;
fail:
	pthread_mutex_unlock(&attach_mu);
	return rc;
}

GS_EXPORT int gpushare_mode(void)
{
	return (int)mode_acquire();
}

/* The calling process's slot, claimed on first use; -1 if none is free. */
static int my_slot(void)
{
	int s = __atomic_load_n(&g.slot, __ATOMIC_ACQUIRE);

	if (likely(s >= 0))
		return s;
	pthread_mutex_lock(&g.claim_mu);
	s = g.slot;
	if (s < 0) {
		s = gs_ledger_claim(g.ledger, g.fd, (int32_t)getpid(), g.task_id);
		if (s >= 0) {
			int t = __atomic_load_n(&g.ledger->slot[s].task_index, __ATOMIC_ACQUIRE);

			if (t >= 0 && t < GS_MAX_TASKS)
				__atomic_store_n(&hot.pause, &g.ledger->task[t].paused,
						 __ATOMIC_RELEASE);
			__atomic_store_n(&hot.launches, &g.ledger->slot[s].launches,
					 __ATOMIC_RELEASE);
			__atomic_store_n(&g.slot, s, __ATOMIC_RELEASE);
		}
	}
	pthread_mutex_unlock(&g.claim_mu);
	return s < 0 ? -1 : s;
}

/*
 * Ledger GPU index of a device ordinal; GS_DEV_FOREIGN for a GPU of the
 * driver's that the ledger does not have, GS_DEV_UNRESOLVED when the driver
 * cannot say which GPU the ordinal is.
 */
static int ledger_gpu(CUdevice dev)
{
	gs_fn_cuDeviceGetUuid_v2 uuid_v2 = R(real, cuDeviceGetUuid_v2);
	gs_fn_cuDeviceGetUuid uuid_v1 = R(real, cuDeviceGetUuid);
	CUuuid uuid;
	int idx = GS_DEV_FOREIGN;
	CUresult rc;

	if (dev >= 0 && dev < GS_MAX_DEVS) {
		idx = __atomic_load_n(&g.dev_map[dev], __ATOMIC_RELAXED);
		if (idx != GS_DEV_UNKNOWN)
			return idx;
	}
	if (uuid_v2 != NULL)
		rc = uuid_v2(&uuid, dev);
	else if (uuid_v1 != NULL)
		rc = uuid_v1(&uuid, dev);
	else
		rc = CUDA_ERROR_NOT_FOUND;
	idx = rc == CUDA_SUCCESS ? GS_DEV_FOREIGN : GS_DEV_UNRESOLVED;
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

/*
 * Each thread remembers the ledger GPU of the context it last saw current,
 * so an allocation costs one driver call (cuCtxGetCurrent). A context that
 * goes away bumps g.ctx_gen, since a new one may take its address.
 */
static __thread __attribute__((tls_model("initial-exec"))) struct {
	CUcontext ctx;
	int gpu;
	unsigned int gen;
} tc;

/* The calling thread's current context and its ledger GPU, or the driver's error. */
static CUresult current_ctx(CUcontext *ctx, int *gpu)
{
	gs_fn_cuCtxGetCurrent get_ctx = R(real, cuCtxGetCurrent);
	gs_fn_cuCtxGetDevice get_dev = R(real, cuCtxGetDevice);
	unsigned int gen = __atomic_load_n(&g.ctx_gen, __ATOMIC_ACQUIRE);
	CUdevice dev;
	CUresult rc;

	if (get_ctx == NULL || get_dev == NULL)
		return CUDA_ERROR_NOT_FOUND;
	rc = get_ctx(ctx);
	if (rc != CUDA_SUCCESS)
		return rc;
	if (*ctx == NULL)
		return CUDA_ERROR_INVALID_CONTEXT; /* what the allocators answer without one */
	if (likely(tc.ctx == *ctx && tc.gen == gen)) {
		*gpu = tc.gpu;
		return CUDA_SUCCESS;
	}
	rc = get_dev(&dev);
	if (rc != CUDA_SUCCESS)
		return rc;
	*gpu = ledger_gpu(dev);
	tc.ctx = *ctx;
	tc.gpu = *gpu;
	tc.gen = gen;
	return CUDA_SUCCESS;
}

static CUresult current_gpu(int *gpu)
{
	CUcontext ctx;

	return current_ctx(&ctx, gpu);
}

/* CU_STREAM_LEGACY and CU_STREAM_PER_THREAD: the current context's default streams. */
#define GS_STREAM_LEGACY ((CUstream)0x1)
#define GS_STREAM_PER_THREAD ((CUstream)0x2)

/*
 * The context and ledger GPU of a stream: a stream-ordered allocation takes
 * its memory from the stream's device, which need not be the current one.
 */
static CUresult stream_ctx(CUstream stream, CUcontext *ctx, int *gpu)
{
	gs_fn_cuStreamGetCtx get = R(real, cuStreamGetCtx);
	gs_fn_cuCtxPushCurrent_v2 push = R(real, cuCtxPushCurrent_v2);
	gs_fn_cuCtxPopCurrent_v2 pop = R(real, cuCtxPopCurrent_v2);
	gs_fn_cuCtxGetDevice get_dev = R(real, cuCtxGetDevice);
	CUcontext cur, ignored;
	CUdevice dev;
	CUresult rc;

	if (stream == NULL || stream == GS_STREAM_LEGACY || stream == GS_STREAM_PER_THREAD ||
	    get == NULL)
		return current_ctx(ctx, gpu);
	rc = get(stream, ctx);
	if (rc != CUDA_SUCCESS)
		return rc;
	if (current_ctx(&cur, gpu) == CUDA_SUCCESS && cur == *ctx)
		return CUDA_SUCCESS;
	/* Another context's stream: ask the driver which device that context is on. */
	if (push == NULL || pop == NULL || get_dev == NULL)
		return CUDA_ERROR_NOT_FOUND;
	rc = push(*ctx);
	if (rc != CUDA_SUCCESS)
		return rc;
	rc = get_dev(&dev);
	pop(&ignored);
	if (rc == CUDA_SUCCESS)
		*gpu = ledger_gpu(dev);
	return rc;
}

/* --- charging --------------------------------------------------------------- */

/* What the driver really takes for `bytes`; UINT64_MAX when that overflows. */
static inline uint64_t footprint(uint64_t bytes)
{
	uint64_t align = bytes >= GS_PAGE ? GS_PAGE : GS_SMALL_ALIGN;

	if (bytes > UINT64_MAX - (align - 1))
		return UINT64_MAX;
	return (bytes + align - 1) & ~(align - 1);
}

static inline uint64_t mul_sat(uint64_t a, uint64_t b)
{
	uint64_t r;

	return __builtin_mul_overflow(a, b, &r) ? UINT64_MAX : r;
}

/* One charge: where it went, so it can be taken back exactly. */
struct gs_charge {
	int32_t slot;
	int32_t gpu;
	uint64_t bytes;
	CUcontext ctx;	/* the context the memory belongs to; NULL if none */
	uint64_t epoch; /* the process's epoch when it was charged */
	uint32_t pool;	/* taken from a stream-ordered pool (gs_alloc.pool): it holds the charge */
};

static inline uint64_t epoch_now(void)
{
	return __atomic_load_n(&g.epoch, __ATOMIC_ACQUIRE);
}

/*
 * Charge `bytes` on ledger GPU `gpu` to this process's slot. A GPU that is
 * not the node's, no free slot, or the limit: CUDA_ERROR_OUT_OF_MEMORY.
 *
 * The epoch is read before the charge. An allocation on one thread racing
 * a boundary on another may land on either side of it; the next boundary
 * sets the persistent share afresh, so such an error lasts one iteration.
 */
static CUresult charge_gpu(int gpu, uint64_t bytes, struct gs_charge *c)
{
	c->gpu = gpu;
	c->bytes = bytes;
	c->ctx = NULL;
	c->pool = 0;
	c->epoch = epoch_now();
	c->slot = my_slot();
	if (gpu < 0 || c->slot < 0)
		return CUDA_ERROR_OUT_OF_MEMORY;
	if (gs_ledger_charge(g.ledger, (uint32_t)c->slot, (uint32_t)gpu, bytes) != 0)
		return CUDA_ERROR_OUT_OF_MEMORY;
	return CUDA_SUCCESS;
}

static void wait_while_paused(uint32_t *word);

/* Launches and allocations of a paused or gated task wait here: one load when it runs. */
static inline __attribute__((always_inline)) void hold_while_paused(void)
{
	uint32_t *pause = __atomic_load_n(&hot.pause, __ATOMIC_ACQUIRE);

	if (unlikely(__atomic_load_n(pause, __ATOMIC_RELAXED) != 0))
		wait_while_paused(pause);
}

/*
 * A paused or gated task takes no new memory: an allocation waits, as a
 * launch does, before it is charged (docs/timeslicing.md). The slot is
 * claimed first, since claiming is what points hot.pause at the task's word.
 */
static inline __attribute__((always_inline)) void alloc_gate(void)
{
	my_slot();
	hold_while_paused();
}

/* charge_gpu for new memory: after the gate. */
static CUresult charge_new(int gpu, uint64_t bytes, struct gs_charge *c)
{
	alloc_gate();
	return charge_gpu(gpu, bytes, c);
}

/* The same on the device of the calling thread's current context, which owns the memory. */
static CUresult charge_current(uint64_t bytes, struct gs_charge *c)
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
static void give_back(int32_t slot, int32_t gpu, uint64_t bytes, uint64_t epoch, uint32_t pinned)
{
	gs_ledger_uncharge(g.ledger, (uint32_t)slot, (uint32_t)gpu, bytes);
	if (pinned || epoch < epoch_now())
		gs_ledger_unpersist(g.ledger, (uint32_t)slot, (uint32_t)gpu, bytes);
}

/* An allocation's charge, not recorded yet, goes back. */
static void uncharge(const struct gs_charge *c)
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
enum gs_ctx_state { GS_CTX_UNPAID, GS_CTX_PAYING, GS_CTX_PAID };

/* The GPUs whose context charge this thread is paying: it never waits for itself. */
static __thread __attribute__((tls_model("initial-exec"))) uint32_t paying;

static CUresult charge_context(CUdevice dev, int *charged)
{
	struct gs_charge c;
	uint64_t bytes;
	uint8_t st;
	int gpu;

	*charged = -1;
	if (g.mode != GS_ENFORCE)
		return CUDA_SUCCESS;
	gpu = ledger_gpu(dev);
	if (gpu < 0)
		return CUDA_SUCCESS;
	for (;;) {
		st = __atomic_load_n(&g.ctx_state[gpu], __ATOMIC_ACQUIRE);
		/* Paid, or this thread's own outer call is paying it (a callback re-entered). */
		if (st == GS_CTX_PAID || (paying & (1u << gpu)))
			return CUDA_SUCCESS;
		if (st == GS_CTX_UNPAID &&
		    __atomic_compare_exchange_n(&g.ctx_state[gpu], &st, GS_CTX_PAYING, 0,
						__ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
			break;
		sched_yield(); /* another thread is paying: its outcome decides */
	}
	paying |= 1u << gpu;
	bytes = __atomic_load_n(&g.ledger->gpu[gpu].ctx_charge, __ATOMIC_RELAXED);
	if (bytes != 0 && charge_gpu(gpu, bytes, &c) != CUDA_SUCCESS) {
		paying &= ~(1u << gpu);
		__atomic_store_n(&g.ctx_state[gpu], GS_CTX_UNPAID, __ATOMIC_RELEASE);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	g.ctx_bytes[gpu] = bytes;
	*charged = gpu;
	return CUDA_SUCCESS;
}

/*
 * After the driver call a charge_context() that paid was for: settle it.
 * A context that could not be made gives its charge back.
 */
static void context_settle(int gpu, CUresult rc)
{
	if (gpu < 0)
		return;
	paying &= ~(1u << gpu);
	if (rc == CUDA_SUCCESS) {
		__atomic_store_n(&g.ctx_state[gpu], GS_CTX_PAID, __ATOMIC_RELEASE);
		return;
	}
	/* A context's charge is not an allocation: it is left out of classification. */
	if (g.ctx_bytes[gpu] != 0)
		gs_ledger_uncharge(g.ledger,
				   (uint32_t)__atomic_load_n(&g.slot, __ATOMIC_ACQUIRE),
				   (uint32_t)gpu, g.ctx_bytes[gpu]);
	__atomic_store_n(&g.ctx_state[gpu], GS_CTX_UNPAID, __ATOMIC_RELEASE);
}

/* --- allocation map --------------------------------------------------------- */

/*
 * (handle, kind) -> charge for live allocations, so a free uncharges exactly
 * what its allocation charged. Device pointers, cuMemCreate handles, their
 * mappings, array handles and pools live in different namespaces, hence the
 * kind. Sharded so that threads rarely meet; a shard lock is held only
 * around the table operation, never across a driver call.
 */
enum gs_kind {
	GS_K_PTR = 1, /* device memory owned by a context */
	GS_K_HANDLE,  /* cuMemCreate: lives while referenced or mapped */
	GS_K_MAP,     /* a cuMemMap of a handle: no charge of its own */
	GS_K_ARRAY,
	GS_K_MIPMAP,
	GS_K_LIMIT, /* a context's heap and stacks beyond their defaults; keyed by the context */
};

/* A pool of host or managed memory: allocations from it take no device memory. */
#define GS_POOL_HOST (-3)

#define GS_SHARDS 64

struct gs_alloc {
	uint64_t key; /* 0 = empty; the driver never hands out 0 */
	uint32_t kind;
	int32_t gpu;
	uint64_t size;
	uint64_t owner; /* PTR, ARRAY, MIPMAP: the owning context; MAP: the handle mapped */
	uint32_t refs;	/* HANDLE: references (cuMemCreate's, each retain's) */
	uint32_t maps;	/* HANDLE: mappings */
	uint64_t epoch; /* charged ones: the process's epoch when charged */
	uint32_t pinned; /* charged ones: counted persistent by gpushare_mark_persistent */
	uint32_t pool;	 /* PTR from a stream-ordered pool: its pools[] index + 1, which holds the charge */
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

static inline uint64_t hkey(uint64_t key, uint32_t kind)
{
	return mix(key ^ ((uint64_t)kind << 60));
}

static inline struct gs_shard *shard_of(uint64_t key, uint32_t kind)
{
	return &shards[hkey(key, kind) & (GS_SHARDS - 1)];
}

static inline uint32_t home_of(const struct gs_shard *s, uint64_t key, uint32_t kind)
{
	return (uint32_t)(hkey(key, kind) >> 6) & (s->cap - 1);
}

/* Index of (key, kind) in the shard, or -1. Under the shard lock. */
static int64_t shard_find(const struct gs_shard *s, uint64_t key, uint32_t kind)
{
	uint32_t m, i;

	if (s->cap == 0)
		return -1;
	m = s->cap - 1;
	for (i = home_of(s, key, kind); s->tab[i].key != 0; i = (i + 1) & m)
		if (s->tab[i].key == key && s->tab[i].kind == kind)
			return i;
	return -1;
}

/* Backward-shift deletion keeps probe chains whole without tombstones. */
static void shard_del_at(struct gs_shard *s, uint32_t i)
{
	uint32_t m = s->cap - 1;

	for (uint32_t j = (i + 1) & m; s->tab[j].key != 0; j = (j + 1) & m) {
		uint32_t home = home_of(s, s->tab[j].key, s->tab[j].kind);

		if (((j - home) & m) >= ((j - i) & m)) {
			s->tab[i] = s->tab[j];
			i = j;
		}
	}
	s->tab[i].key = 0;
	s->n--;
}

/* Insert a; if a record for the same handle existed, return it in *old. */
static int shard_put(struct gs_shard *s, struct gs_alloc a, struct gs_alloc *old)
{
	uint32_t i = home_of(s, a.key, a.kind);
	int replaced = 0;

	while (s->tab[i].key != 0 && !(s->tab[i].key == a.key && s->tab[i].kind == a.kind))
		i = (i + 1) & (s->cap - 1);
	if (s->tab[i].key == 0) {
		s->n++;
	} else {
		*old = s->tab[i];
		replaced = 1;
	}
	s->tab[i] = a;
	return replaced;
}

static int carries_charge(uint32_t kind)
{
	return kind != GS_K_MAP;
}

static void release_record(const struct gs_alloc *a);

static int alloc_put(struct gs_alloc a)
{
	struct gs_shard *s = shard_of(a.key, a.kind);
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
			if (old[i].key != 0)
				shard_put(s, old[i], &stale);
		free(old);
	}
	replaced = shard_put(s, a, &stale);
out:
	pthread_mutex_unlock(&s->mu);
	/*
	 * The driver handed out a handle we still had on record: that memory
	 * went back without passing through us, so its charge goes now.
	 */
	if (replaced && carries_charge(stale.kind))
		release_record(&stale);
	return rc;
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

/* Remove the record of (key, kind) into *out; 0 if found, -ENOENT if not ours. */
static int alloc_untrack(uint64_t key, uint32_t kind, struct gs_alloc *out)
{
	struct gs_shard *s = shard_of(key, kind);
	int64_t i;

	pthread_mutex_lock(&s->mu);
	i = shard_find(s, key, kind);
	if (i >= 0) {
		*out = s->tab[i];
		shard_del_at(s, (uint32_t)i);
	}
	pthread_mutex_unlock(&s->mu);
	return i >= 0 ? 0 : -ENOENT;
}

/* A copy of the record of (key, kind); 0 if found, -ENOENT if not. */
static int alloc_peek(uint64_t key, uint32_t kind, struct gs_alloc *out)
{
	struct gs_shard *s = shard_of(key, kind);
	int64_t i;

	pthread_mutex_lock(&s->mu);
	i = shard_find(s, key, kind);
	if (i >= 0)
		*out = s->tab[i];
	pthread_mutex_unlock(&s->mu);
	return i >= 0 ? 0 : -ENOENT;
}

/*
 * Change a cuMemCreate handle's reference and mapping counts. When both
 * reach zero the driver frees the memory: the record is taken out into
 * *gone and 1 returned, for the caller to uncharge. 0 if it lives on,
 * 2 if there was no reference or mapping to drop (a double release: the
 * driver's to refuse, nothing changes), -ENOENT if the handle is not ours.
 */
static int handle_adjust(uint64_t handle, int drefs, int dmaps, struct gs_alloc *gone)
{
	struct gs_shard *s = shard_of(handle, GS_K_HANDLE);
	int64_t i;
	int rc = -ENOENT;

	pthread_mutex_lock(&s->mu);
	i = shard_find(s, handle, GS_K_HANDLE);
	if (i >= 0) {
		struct gs_alloc *a = &s->tab[i];
		int64_t refs = (int64_t)a->refs + drefs, maps = (int64_t)a->maps + dmaps;

		if (refs < 0 || maps < 0) {
			pthread_mutex_unlock(&s->mu);
			return 2;
		}
		a->refs = (uint32_t)refs;
		a->maps = (uint32_t)maps;
		rc = 0;
		if (a->refs == 0 && a->maps == 0) {
			*gone = *a;
			shard_del_at(s, (uint32_t)i);
			rc = 1;
		}
	}
	pthread_mutex_unlock(&s->mu);
	return rc;
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
};

static int owned_by(const struct gs_alloc *a, uint64_t owner)
{
	return a->key != 0 && a->owner == owner &&
	       (a->kind == GS_K_PTR || a->kind == GS_K_ARRAY || a->kind == GS_K_MIPMAP ||
		a->kind == GS_K_LIMIT);
}

static void take_context(CUcontext ctx, struct gs_taken *t)
{
	uint64_t owner = (uint64_t)(uintptr_t)ctx;

	memset(t, 0, sizeof(*t));
	/* Every thread's cached context -> GPU answer is stale from here on. */
	__atomic_add_fetch(&g.ctx_gen, 1, __ATOMIC_ACQ_REL);
	if (ctx == NULL)
		return;
	for (int k = 0; k < GS_SHARDS; k++) {
		struct gs_shard *s = &shards[k];

		pthread_mutex_lock(&s->mu);
		for (uint32_t i = 0; i < s->cap;) {
			if (!owned_by(&s->tab[i], owner)) {
				i++;
				continue;
			}
			if (t->n == t->cap) {
				size_t cap = t->cap ? t->cap * 2 : 64;
				struct gs_alloc *v = realloc(t->v, cap * sizeof(*v));

				if (v == NULL) {
					t->incomplete = 1;
					i++;
					continue;
				}
				t->v = v;
				t->cap = cap;
			}
			t->v[t->n++] = s->tab[i];
			shard_del_at(s, i); /* a later record may move here: look again */
		}
		pthread_mutex_unlock(&s->mu);
	}
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

/* After the driver's answer to the teardown take_context() prepared. */
static void settle_context(struct gs_taken *t, CUcontext ctx, CUresult rc)
{
	uint64_t gone[GS_MAX_GPUS] = { 0 }, kept[GS_MAX_GPUS] = { 0 };
	int slot = __atomic_load_n(&g.slot, __ATOMIC_ACQUIRE);
	uint64_t epoch = epoch_now();
	struct gs_alloc a;

	if (rc != CUDA_SUCCESS) {
		for (size_t i = 0; i < t->n; i++)
			alloc_put(t->v[i]);
		free(t->v);
		return;
	}
	/* A thread may have cached the context during the call; a new one may take its address. */
	__atomic_add_fetch(&g.ctx_gen, 1, __ATOMIC_ACQ_REL);
	for (size_t i = 0; i < t->n; i++)
		tally(&t->v[i], epoch, gone, kept);
	free(t->v);
	for (int k = 0; t->incomplete && k < GS_SHARDS; k++) {
		struct gs_shard *s = &shards[k];

		pthread_mutex_lock(&s->mu);
		for (uint32_t i = 0; i < s->cap;) {
			if (!owned_by(&s->tab[i], (uint64_t)(uintptr_t)ctx)) {
				i++;
				continue;
			}
			a = s->tab[i];
			tally(&a, epoch, gone, kept);
			shard_del_at(s, i);
		}
		pthread_mutex_unlock(&s->mu);
	}
	for (int i = 0; i < GS_MAX_GPUS && slot >= 0; i++) {
		if (gone[i] != 0)
			gs_ledger_uncharge(g.ledger, (uint32_t)slot, (uint32_t)i, gone[i]);
		if (kept[i] != 0)
			gs_ledger_unpersist(g.ledger, (uint32_t)slot, (uint32_t)i, kept[i]);
	}
}

/*
 * After a successful allocation: remember it, or, when that is impossible,
 * give the memory back (`undo`), since it could never be uncharged later.
 */
static CUresult remember(uint64_t key, uint32_t kind, const struct gs_charge *c,
			 void (*undo)(uint64_t))
{
	if (alloc_track(key, kind, c) == 0) {
		/* What a process allocates before its first boundary is set-up, not temporary. */
		if (c->epoch >= 1)
			gs_ledger_note_temp(g.ledger, (uint32_t)c->slot, (uint32_t)c->gpu);
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
static CUresult settle(CUresult rc, uint64_t key, uint32_t kind, const struct gs_charge *c,
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
static int forget(uint64_t key, uint32_t kind, struct gs_alloc *a)
{
	if (g.mode != GS_ENFORCE || key == 0)
		return 0;
	return alloc_untrack(key, kind, a) == 0;
}

/* A record's memory went back to the driver: so does its charge. */
static void uncharge_record(const struct gs_alloc *a)
{
	give_back(__atomic_load_n(&g.slot, __ATOMIC_ACQUIRE), a->gpu, a->size, a->epoch, a->pinned);
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
static CUresult freed(CUresult rc, const struct gs_alloc *a)
{
	/* Still allocated, so still charged; if it cannot be re-recorded it stays so. */
	if (rc != CUDA_SUCCESS)
		alloc_put(*a);
	else
		release_record(a);
	return rc;
}

static void undo_ptr(uint64_t key)
{
	gs_fn_cuMemFree_v2 fn = R(real, cuMemFree_v2);

	if (fn != NULL)
		fn((CUdeviceptr)key);
}

static void undo_handle(uint64_t key)
{
	gs_fn_cuMemRelease fn = R(real, cuMemRelease);

	if (fn != NULL)
		fn((CUmemGenericAllocationHandle)key);
}

static void undo_array(uint64_t key)
{
	gs_fn_cuArrayDestroy fn = R(real, cuArrayDestroy);

	if (fn != NULL)
		fn((CUarray)(uintptr_t)key);
}

static void undo_mipmap(uint64_t key)
{
	gs_fn_cuMipmappedArrayDestroy fn = R(real, cuMipmappedArrayDestroy);

	if (fn != NULL)
		fn((CUmipmappedArray)(uintptr_t)key);
}

/*
 * The common shape of an allocation that yields a device pointer: the mode
 * decides, invalid arguments get the driver's own answer uncharged, the
 * footprint is charged before the driver call and taken back if it fails.
 */
#define ALLOC_PTR(call, dptr, bytes, charge_expr)                                \
	do {                                                                     \
		struct gs_charge c_;                                             \
		CUresult rc_;                                                    \
		if (g.mode == GS_INERT)                                          \
			return call;                                             \
		if (g.mode == GS_BROKEN)                                         \
			return CUDA_ERROR_NOT_PERMITTED;                         \
		if ((dptr) == NULL || (bytes) == 0)                              \
			return call;                                             \
		rc_ = (charge_expr);                                             \
		if (rc_ != CUDA_SUCCESS)                                         \
			return rc_;                                              \
		rc_ = call;                                                      \
		return settle(rc_, *(dptr), GS_K_PTR, &c_, undo_ptr);            \
	} while (0)

/* --- wrappers: start-up and memory reports ------------------------------------ */

GS_EXPORT CUresult cuInit(unsigned int flags)
{
	CUresult rc;

	TRACE(GS_ID_cuInit, calls);
	GET_REAL(cuInit, fn);
	rc = fn(flags);
	/* Claim the slot now, so launches are counted and pausable from the first. */
	if (rc == CUDA_SUCCESS && g.mode == GS_ENFORCE)
		my_slot();
	return rc;
}

GS_EXPORT CUresult cuDeviceGetCount(int *count)
{
	TRACE(GS_ID_cuDeviceGetCount, calls);
	GET_REAL(cuDeviceGetCount, fn);
	return fn(count);
}

/*
 * The environment's share of ledger GPU `gpu` as a device report: total is
 * the limit, free what is left of the environment's pool; neither beyond
 * what the device itself reports.
 */
static void share(int gpu, uint64_t *total, uint64_t *free_bytes, uint64_t *used)
{
	uint64_t limit = gpu >= 0 ? gs_ledger_limit(g.ledger, (uint32_t)gpu) : 0;
	uint64_t u = gpu >= 0 ? gs_ledger_used(g.ledger, (uint32_t)gpu) : 0;
	uint64_t left = u < limit ? limit - u : 0;

	if (limit < *total)
		*total = limit;
	if (left < *free_bytes)
		*free_bytes = left;
	if (used != NULL)
		*used = u;
}

GS_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
	uint64_t total, ignored = UINT64_MAX;
	CUresult rc;
	int gpu;

	TRACE(GS_ID_cuDeviceTotalMem_v2, calls);
	GET_REAL(cuDeviceTotalMem_v2, fn);
	rc = fn(bytes, dev);
	if (rc != CUDA_SUCCESS || g.mode != GS_ENFORCE)
		return rc;
	gpu = ledger_gpu(dev);
	if (gpu >= 0) {
		total = *bytes;
		share(gpu, &total, &ignored, NULL);
		*bytes = (size_t)total;
	}
	return rc;
}

GS_EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes)
{
	uint64_t total, left;
	CUresult rc;
	int gpu;

	TRACE(GS_ID_cuMemGetInfo_v2, calls);
	GET_REAL(cuMemGetInfo_v2, fn);
	rc = fn(free_bytes, total_bytes);
	if (rc != CUDA_SUCCESS || g.mode != GS_ENFORCE)
		return rc;
	if (current_gpu(&gpu) != CUDA_SUCCESS)
		return rc;
	/* A device that is not the node's has no share: nothing of it is usable. */
	total = gpu >= 0 ? *total_bytes : 0;
	left = *free_bytes;
	share(gpu, &total, &left, NULL);
	*total_bytes = (size_t)total;
	*free_bytes = (size_t)left;
	return rc;
}

/* --- wrappers: contexts --------------------------------------------------------- */

/* Serialises context teardown with the bookkeeping of primary retains. */
static pthread_mutex_t teardown_mu = PTHREAD_MUTEX_INITIALIZER;

#define CONTEXT_CALL(dev, call)                                  \
	do {                                                     \
		CUresult rc_;                                    \
		int charged_;                                    \
		rc_ = charge_context((dev), &charged_);          \
		if (rc_ != CUDA_SUCCESS)                         \
			return rc_;                              \
		rc_ = call;                                      \
		context_settle(charged_, rc_);                   \
		return rc_;                                      \
	} while (0)

/* The primary context is remembered, and its retains counted, for its teardown. */
GS_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev)
{
	CUresult rc;
	int charged;

	TRACE(GS_ID_cuDevicePrimaryCtxRetain, calls);
	GET_REAL(cuDevicePrimaryCtxRetain, fn);
	if (ctx == NULL)
		return fn(ctx, dev);
	rc = charge_context(dev, &charged);
	if (rc != CUDA_SUCCESS)
		return rc;
	if (dev < 0 || dev >= GS_MAX_DEVS || g.mode != GS_ENFORCE) {
		rc = fn(ctx, dev);
		context_settle(charged, rc);
		return rc;
	}
	/*
	 * Counted before the driver call (and uncounted if it fails): a release
	 * racing with this retain must not take the context for its last one.
	 */
	pthread_mutex_lock(&teardown_mu);
	g.primary_refs[dev]++;
	pthread_mutex_unlock(&teardown_mu);
	rc = fn(ctx, dev);
	context_settle(charged, rc);
	pthread_mutex_lock(&teardown_mu);
	if (rc == CUDA_SUCCESS)
		g.primary[dev] = *ctx;
	else
		g.primary_refs[dev]--;
	pthread_mutex_unlock(&teardown_mu);
	return rc;
}

GS_EXPORT CUresult cuCtxCreate_v2(CUcontext *ctx, unsigned int flags, CUdevice dev)
{
	TRACE(GS_ID_cuCtxCreate_v2, calls);
	GET_REAL(cuCtxCreate_v2, fn);
	if (ctx == NULL)
		return fn(ctx, flags, dev);
	CONTEXT_CALL(dev, fn(ctx, flags, dev));
}

GS_EXPORT CUresult cuCtxCreate_v3(CUcontext *ctx, void *affinity, int naffinity,
				  unsigned int flags, CUdevice dev)
{
	TRACE(GS_ID_cuCtxCreate_v3, calls);
	GET_REAL(cuCtxCreate_v3, fn);
	if (ctx == NULL)
		return fn(ctx, affinity, naffinity, flags, dev);
	CONTEXT_CALL(dev, fn(ctx, affinity, naffinity, flags, dev));
}

GS_EXPORT CUresult cuCtxCreate_v4(CUcontext *ctx, void *params, unsigned int flags,
				  CUdevice dev)
{
	TRACE(GS_ID_cuCtxCreate_v4, calls);
	GET_REAL(cuCtxCreate_v4, fn);
	if (ctx == NULL)
		return fn(ctx, params, flags, dev);
	CONTEXT_CALL(dev, fn(ctx, params, flags, dev));
}

/*
 * Teardown: destroying a context, resetting a primary context, or releasing
 * its last retain frees the memory allocated in it, so its records and
 * charges go (what a context itself was charged stays until the process
 * ends). One teardown at a time, and retains' bookkeeping waits for it, so
 * the process's count of primary retains is never raced.
 */
static CUresult teardown(gs_fn_cuCtxDestroy_v2 destroy, CUcontext ctx,
			 gs_fn_cuDevicePrimaryCtxReset_v2 on_dev, CUdevice dev, int release)
{
	struct gs_taken t;
	CUresult rc;
	int last = 1;

	if (g.mode != GS_ENFORCE)
		return destroy != NULL ? destroy(ctx) : on_dev(dev);
	if (destroy == NULL && (dev < 0 || dev >= GS_MAX_DEVS))
		return on_dev(dev); /* the driver's answer to a bad ordinal */
	pthread_mutex_lock(&teardown_mu);
	if (destroy == NULL) {
		ctx = g.primary[dev];
		last = !release || g.primary_refs[dev] <= 1;
	}
	memset(&t, 0, sizeof(t));
	if (last)
		take_context(ctx, &t);
	rc = destroy != NULL ? destroy(ctx) : on_dev(dev);
	if (last)
		settle_context(&t, ctx, rc);
	if (rc == CUDA_SUCCESS && release && g.primary_refs[dev] > 0)
		g.primary_refs[dev]--;
	pthread_mutex_unlock(&teardown_mu);
	return rc;
}

#define TEARDOWN_WRAPPER(abi, type, arg, how)         \
	GS_EXPORT CUresult abi(type arg)                \
	{                                               \
		TRACE(GS_ID_##abi, calls);              \
		GET_REAL(abi, fn);                      \
		return how;                             \
	}

TEARDOWN_WRAPPER(cuCtxDestroy, CUcontext, ctx, teardown(fn, ctx, NULL, 0, 0))
TEARDOWN_WRAPPER(cuCtxDestroy_v2, CUcontext, ctx, teardown(fn, ctx, NULL, 0, 0))
TEARDOWN_WRAPPER(cuDevicePrimaryCtxRelease, CUdevice, dev, teardown(NULL, NULL, fn, dev, 1))
TEARDOWN_WRAPPER(cuDevicePrimaryCtxRelease_v2, CUdevice, dev, teardown(NULL, NULL, fn, dev, 1))
TEARDOWN_WRAPPER(cuDevicePrimaryCtxReset, CUdevice, dev, teardown(NULL, NULL, fn, dev, 0))
TEARDOWN_WRAPPER(cuDevicePrimaryCtxReset_v2, CUdevice, dev, teardown(NULL, NULL, fn, dev, 0))

/*
 * cuCtxSetLimit: the device malloc heap (CU_LIMIT_MALLOC_HEAP_SIZE) and the
 * per-thread stack (CU_LIMIT_STACK_SIZE, reserved for every thread the
 * device can hold at once: SMs x threads per SM) are device memory the
 * context takes when they are set. What a new value takes beyond the one it
 * replaces is charged first, refused beyond the limit with the driver's own
 * CUDA_ERROR_OUT_OF_MEMORY; what a smaller value gives back is uncharged,
 * and the context's end gives back the rest. The defaults are part of the
 * per-process context charge. One record per context holds the charge.
 */
static pthread_mutex_t limit_mu = PTHREAD_MUTEX_INITIALIZER;

static uint64_t limit_bytes(int limit, size_t value)
{
	gs_fn_cuDeviceGetAttribute attr = R(real, cuDeviceGetAttribute);
	gs_fn_cuCtxGetDevice get_dev = R(real, cuCtxGetDevice);
	int sms = 0, threads = 0;
	CUdevice dev;

	if (limit == CU_LIMIT_MALLOC_HEAP_SIZE)
		return value;
	if (attr == NULL || get_dev == NULL || get_dev(&dev) != CUDA_SUCCESS ||
	    attr(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev) != CUDA_SUCCESS ||
	    attr(&threads, CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR, dev) != CUDA_SUCCESS ||
	    sms <= 0 || threads <= 0)
		return 0;
	return mul_sat(value, (uint64_t)sms * (uint64_t)threads);
}

GS_EXPORT CUresult cuCtxSetLimit(int limit, size_t value)
{
	gs_fn_cuCtxGetLimit get = R(real, cuCtxGetLimit);
	uint64_t before, after, grow = 0, shrink = 0;
	struct gs_alloc rec;
	struct gs_charge c;
	CUcontext ctx;
	size_t old;
	CUresult rc;
	int gpu, had;

	TRACE(GS_ID_cuCtxSetLimit, calls);
	GET_REAL(cuCtxSetLimit, fn);
	if (g.mode != GS_ENFORCE ||
	    (limit != CU_LIMIT_STACK_SIZE && limit != CU_LIMIT_MALLOC_HEAP_SIZE))
		return fn(limit, value);
	if (get == NULL || current_ctx(&ctx, &gpu) != CUDA_SUCCESS || gpu < 0 ||
	    get(&old, limit) != CUDA_SUCCESS)
		return fn(limit, value);
	before = limit_bytes(limit, old);
	after = limit_bytes(limit, value);
	if (after > before)
		grow = footprint(after - before);
	pthread_mutex_lock(&limit_mu);
	if (grow != 0) {
		alloc_gate();
		if (charge_gpu(gpu, grow, &c) != CUDA_SUCCESS) {
			pthread_mutex_unlock(&limit_mu);
			return CUDA_ERROR_OUT_OF_MEMORY;
		}
	}
	rc = fn(limit, value);
	had = alloc_untrack((uint64_t)(uintptr_t)ctx, GS_K_LIMIT, &rec) == 0;
	if (!had)
		rec = (struct gs_alloc){ .key = (uint64_t)(uintptr_t)ctx,
					 .kind = GS_K_LIMIT,
					 .gpu = gpu,
					 .owner = (uint64_t)(uintptr_t)ctx,
					 .refs = 1,
					 .epoch = epoch_now() };
	if (rc != CUDA_SUCCESS) {
		if (grow != 0)
			uncharge(&c);
	} else if (grow != 0) {
		rec.size += grow;
	} else if (before > after) {
		shrink = footprint(before - after);
		shrink = shrink < rec.size ? shrink : rec.size;
		rec.size -= shrink;
	}
	if (shrink != 0)
		give_back(__atomic_load_n(&g.slot, __ATOMIC_ACQUIRE), rec.gpu, shrink, rec.epoch,
			  rec.pinned);
	/* Out of memory for the record: the charge goes, as for any allocation. */
	if (rec.size != 0 && alloc_put(rec) != 0)
		uncharge_record(&rec);
	pthread_mutex_unlock(&limit_mu);
	return rc;
}

/* --- wrappers: allocations -------------------------------------------------------- */

GS_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
	TRACE(GS_ID_cuMemAlloc_v2, calls);
	GET_REAL(cuMemAlloc_v2, fn);
	ALLOC_PTR(fn(dptr, bytesize), dptr, bytesize, charge_current(footprint(bytesize), &c_));
}

GS_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
	TRACE(GS_ID_cuMemAllocManaged, calls);
	GET_REAL(cuMemAllocManaged, fn);
	ALLOC_PTR(fn(dptr, bytesize, flags), dptr, bytesize,
		  charge_current(footprint(bytesize), &c_));
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
#define GS_POOL_RELEASE_THRESHOLD 4 /* CU_MEMPOOL_ATTR_RELEASE_THRESHOLD */
#define GS_POOL_RESERVED_CURRENT 5  /* CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT */

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
static struct gs_pool *pool_note(CUmemoryPool pool, int gpu)
{
	uint64_t handle = (uint64_t)(uintptr_t)pool;
	struct gs_pool *p;

	if (handle == 0 || g.mode != GS_ENFORCE)
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
		if (__atomic_load_n(&g.dev_map[d], __ATOMIC_RELAXED) == gpu)
			return d;
	return -1;
}

/* The pool cuMemAllocAsync takes from on ledger GPU `gpu`; NULL if unknown. */
static struct gs_pool *device_pool(int gpu)
{
	gs_fn_cuDeviceGetMemPool get = R(real, cuDeviceGetMemPool);
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
	int slot = __atomic_load_n(&g.slot, __ATOMIC_ACQUIRE);
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
	gs_ledger_uncharge(g.ledger, (uint32_t)slot, (uint32_t)p->gpu, d);
	if (unpersist != 0)
		gs_ledger_unpersist(g.ledger, (uint32_t)slot, (uint32_t)p->gpu, unpersist);
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
	gs_fn_cuMemPoolGetAttribute get = R(real, cuMemPoolGetAttribute);
	gs_fn_cuDeviceGetGraphMemAttribute get_graph = R(real, cuDeviceGetGraphMemAttribute);
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
static void pools_after_sync(void)
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
static void pools_at_boundary(void)
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
	if (gs_ledger_charge(g.ledger, (uint32_t)slot, (uint32_t)p->gpu, reserved - p->charged) != 0)
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
	gs_fn_cuMemPoolTrimTo trim = R(real, cuMemPoolTrimTo);
	gs_fn_cuDeviceGraphMemTrim trim_graph = R(real, cuDeviceGraphMemTrim);
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
	int slot = __atomic_load_n(&g.slot, __ATOMIC_ACQUIRE);
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
	int slot = __atomic_load_n(&g.slot, __ATOMIC_ACQUIRE);

	pthread_mutex_lock(&p->mu);
	__atomic_store_n(&p->in_use, p->in_use > a->size ? p->in_use - a->size : 0,
			 __ATOMIC_RELAXED);
	/* Pinned persistent by gpushare_mark_persistent: idle memory is not. */
	if (a->pinned && slot >= 0)
		gs_ledger_unpersist(g.ledger, (uint32_t)slot, (uint32_t)a->gpu, a->size);
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
		gs_ledger_note_temp(g.ledger, (uint32_t)c->slot, (uint32_t)c->gpu);
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
static uint32_t captures;  /* begun and not ended in this process */
static uint32_t graph_mem; /* 1 once this process made graph memory */

/* Whether a stream captures; only asked while captures is nonzero. */
static int stream_captures(CUstream stream)
{
	gs_fn_cuStreamIsCapturing is = R(real, cuStreamIsCapturing);
	int status = 0;

	return is != NULL && is(stream, &status) == CUDA_SUCCESS && status != 0;
}

/* A graph's allocation node: the driver's answer, uncharged. */
static CUresult graph_node_made(CUresult rc)
{
	if (rc == CUDA_SUCCESS)
		__atomic_store_n(&graph_mem, 1, __ATOMIC_RELEASE);
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

/* How a stream-ordered allocation is accounted. */
struct gs_pool_alloc {
	enum {
		GS_PASS,   /* straight to the driver: inert, its own answer to bad arguments, host pool */
		GS_PLAIN,  /* a pool the shim cannot follow: charged as plain memory */
		GS_POOLED, /* charged to its pool */
		GS_NODE,   /* on a capturing stream: a graph's allocation node, charged at launch */
	} how;
	struct gs_charge c;
	struct gs_pool *p;
	uint64_t grew;
};

/*
 * Before the driver call of a stream-ordered allocation from `pool` (NULL:
 * the stream's device's current pool): an error to answer, or op->how and
 * its charge. The mode decides as for every allocation (ALLOC_PTR). `cap`
 * is the stream as the driver names it to cuStreamIsCapturing.
 */
static CUresult pool_alloc_begin(struct gs_pool_alloc *op, const CUdeviceptr *dptr, size_t bytes,
				 CUmemoryPool pool, CUstream stream, CUstream cap)
{
	op->how = GS_PASS;
	if (g.mode == GS_INERT)
		return CUDA_SUCCESS;
	if (g.mode == GS_BROKEN)
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
static CUresult pool_alloc_end(const struct gs_pool_alloc *op, CUresult rc, const CUdeviceptr *dptr)
{
	if (op->how == GS_NODE)
		return graph_node_made(rc);
	if (op->how == GS_PLAIN)
		return settle(rc, *dptr, GS_K_PTR, &op->c, undo_ptr);
	return pool_settle(rc, *dptr, op->p, &op->c, op->grew);
}

/* The per-thread flavours' NULL stream is the per-thread default stream, which may capture. */
#define PTSZ_STREAM(stream) ((stream) == NULL ? GS_STREAM_PER_THREAD : (stream))

#define ASYNC_WRAPPER(abi, params, pool, cap, args)                             \
	GS_EXPORT CUresult abi params                                            \
	{                                                                        \
		struct gs_pool_alloc op;                                         \
		CUresult rc;                                                     \
		TRACE(GS_ID_##abi, calls);                                       \
		GET_REAL(abi, fn);                                               \
		rc = pool_alloc_begin(&op, dptr, bytesize, (pool), stream, cap); \
		if (rc != CUDA_SUCCESS)                                          \
			return rc;                                               \
		if (op.how == GS_PASS)                                           \
			return fn args;                                          \
		return pool_alloc_end(&op, fn args, dptr);                       \
	}

ASYNC_WRAPPER(cuMemAllocAsync, (CUdeviceptr *dptr, size_t bytesize, CUstream stream), NULL,
	      stream, (dptr, bytesize, stream))
ASYNC_WRAPPER(cuMemAllocAsync_ptsz, (CUdeviceptr *dptr, size_t bytesize, CUstream stream), NULL,
	      PTSZ_STREAM(stream), (dptr, bytesize, stream))
ASYNC_WRAPPER(cuMemAllocFromPoolAsync,
	      (CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream stream), pool,
	      stream, (dptr, bytesize, pool, stream))
ASYNC_WRAPPER(cuMemAllocFromPoolAsync_ptsz,
	      (CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream stream), pool,
	      PTSZ_STREAM(stream), (dptr, bytesize, pool, stream))

/* Device memory pools (pinned allocations at a device) are charged; host and managed ones not. */
static int pool_gpu(const CUmemLocation *location, int type)
{
	if (location->type != CU_MEM_LOCATION_TYPE_DEVICE || type != CU_MEM_ALLOCATION_TYPE_PINNED)
		return GS_POOL_HOST;
	return ledger_gpu(location->id);
}

GS_EXPORT CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props)
{
	CUresult rc;

	TRACE(GS_ID_cuMemPoolCreate, calls);
	GET_REAL(cuMemPoolCreate, fn);
	rc = fn(pool, props);
	if (rc == CUDA_SUCCESS && g.mode == GS_ENFORCE)
		pool_note(*pool, pool_gpu(&props->location, props->allocType));
	return rc;
}

/* A device's default or current pool is its pool of device memory. */
#define DEVICE_POOL_WRAPPER(abi)                                         \
	GS_EXPORT CUresult abi(CUmemoryPool *pool, CUdevice dev)         \
	{                                                                \
		CUresult rc;                                             \
		TRACE(GS_ID_##abi, calls);                               \
		GET_REAL(abi, fn);                                       \
		rc = fn(pool, dev);                                      \
		if (rc == CUDA_SUCCESS && g.mode == GS_ENFORCE)          \
			pool_note(*pool, ledger_gpu(dev));               \
		return rc;                                               \
	}

DEVICE_POOL_WRAPPER(cuDeviceGetDefaultMemPool)
DEVICE_POOL_WRAPPER(cuDeviceGetMemPool)

/* CUDA 13's way to the same pools: by location and allocation type. */
#define LOCATION_POOL_WRAPPER(abi)                                                    \
	GS_EXPORT CUresult abi(CUmemoryPool *pool, CUmemLocation *location, int type) \
	{                                                                             \
		CUresult rc;                                                          \
		TRACE(GS_ID_##abi, calls);                                            \
		GET_REAL(abi, fn);                                                    \
		rc = fn(pool, location, type);                                        \
		if (rc == CUDA_SUCCESS && g.mode == GS_ENFORCE)                       \
			pool_note(*pool, pool_gpu(location, type));                   \
		return rc;                                                            \
	}

LOCATION_POOL_WRAPPER(cuMemGetDefaultMemPool)
LOCATION_POOL_WRAPPER(cuMemGetMemPool)

/* A device's new current pool: what its cuMemAllocAsync takes from from now on. */
static void set_current_pool(CUmemoryPool pool, int gpu)
{
	struct gs_pool *p;

	if (gpu < 0 || gpu >= GS_MAX_GPUS)
		return;
	p = pool_note(pool, gpu);
	__atomic_store_n(&current_pool[gpu], p != NULL ? p->handle : 0, __ATOMIC_RELEASE);
}

GS_EXPORT CUresult cuDeviceSetMemPool(CUdevice dev, CUmemoryPool pool)
{
	CUresult rc;

	TRACE(GS_ID_cuDeviceSetMemPool, calls);
	GET_REAL(cuDeviceSetMemPool, fn);
	rc = fn(dev, pool);
	if (rc == CUDA_SUCCESS && g.mode == GS_ENFORCE)
		set_current_pool(pool, ledger_gpu(dev));
	return rc;
}

GS_EXPORT CUresult cuMemSetMemPool(CUmemLocation *location, int type, CUmemoryPool pool)
{
	CUresult rc;

	TRACE(GS_ID_cuMemSetMemPool, calls);
	GET_REAL(cuMemSetMemPool, fn);
	rc = fn(location, type, pool);
	if (rc == CUDA_SUCCESS && g.mode == GS_ENFORCE && pool_gpu(location, type) >= 0)
		set_current_pool(pool, ledger_gpu(location->id));
	return rc;
}

GS_EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t keep)
{
	struct gs_pool *p;
	CUresult rc;

	TRACE(GS_ID_cuMemPoolTrimTo, calls);
	GET_REAL(cuMemPoolTrimTo, fn);
	rc = fn(pool, keep);
	if (rc == CUDA_SUCCESS && g.mode == GS_ENFORCE &&
	    (p = pool_find((uint64_t)(uintptr_t)pool)) != NULL)
		pool_sync(p);
	return rc;
}

GS_EXPORT CUresult cuMemPoolSetAttribute(CUmemoryPool pool, int attr, void *value)
{
	struct gs_pool *p;
	CUresult rc;

	TRACE(GS_ID_cuMemPoolSetAttribute, calls);
	GET_REAL(cuMemPoolSetAttribute, fn);
	rc = fn(pool, attr, value);
	if (rc == CUDA_SUCCESS && g.mode == GS_ENFORCE && attr == GS_POOL_RELEASE_THRESHOLD &&
	    (p = pool_find((uint64_t)(uintptr_t)pool)) != NULL) {
		pthread_mutex_lock(&p->mu);
		__atomic_store_n(&p->threshold, *(const cuuint64_t *)value, __ATOMIC_RELAXED);
		pthread_mutex_unlock(&p->mu);
	}
	return rc;
}

/*
 * The driver gives a destroyed pool's idle memory back at once and the rest
 * as its allocations are freed (pool_give); a device whose current pool it
 * was takes from its default pool again.
 */
GS_EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool)
{
	uint64_t handle = (uint64_t)(uintptr_t)pool;
	struct gs_pool *p;
	CUresult rc;

	TRACE(GS_ID_cuMemPoolDestroy, calls);
	GET_REAL(cuMemPoolDestroy, fn);
	rc = fn(pool);
	if (rc != CUDA_SUCCESS || g.mode != GS_ENFORCE || (p = pool_find(handle)) == NULL)
		return rc;
	pthread_mutex_lock(&p->mu);
	p->dead = 1;
	pool_shrink(p, p->in_use);
	pthread_mutex_unlock(&p->mu);
	for (int i = 0; i < GS_MAX_GPUS; i++) {
		uint64_t expected = handle;

		__atomic_compare_exchange_n(&current_pool[i], &expected, 0, 0, __ATOMIC_ACQ_REL,
					    __ATOMIC_RELAXED);
	}
	return rc;
}

/* A synchronisation: where a pool above its release threshold gives memory back. */
#define SYNC_WRAPPER(abi, params, args)                                  \
	GS_EXPORT CUresult abi params                                    \
	{                                                                \
		CUresult rc;                                             \
		TRACE(GS_ID_##abi, calls);                               \
		GET_REAL(abi, fn);                                       \
		rc = fn args;                                            \
		if (rc == CUDA_SUCCESS && g.mode == GS_ENFORCE)          \
			pools_after_sync();                              \
		return rc;                                               \
	}

SYNC_WRAPPER(cuCtxSynchronize, (void), ())
SYNC_WRAPPER(cuCtxSynchronize_v2, (CUcontext ctx), (ctx))
SYNC_WRAPPER(cuStreamSynchronize, (CUstream stream), (stream))
SYNC_WRAPPER(cuStreamSynchronize_ptsz, (CUstream stream), (stream))
SYNC_WRAPPER(cuEventSynchronize, (CUevent event), (event))

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
static __attribute__((noinline, cold)) void graph_launched(CUstream stream)
{
	int slot = __atomic_load_n(&g.slot, __ATOMIC_ACQUIRE);
	struct gs_pool *p;
	CUcontext ctx;
	int gpu;

	if (g.mode != GS_ENFORCE || slot < 0 || stream_ctx(stream, &ctx, &gpu) != CUDA_SUCCESS ||
	    (p = graph_pool(gpu)) == NULL)
		return;
	/* What a process takes before its first boundary is set-up, not temporary. */
	if (pool_grow(p) && epoch_now() >= 1)
		gs_ledger_note_temp(g.ledger, (uint32_t)slot, (uint32_t)gpu);
}

/* Every graph pool's charge down to what it reserves now. */
static void graph_pools_sync(void)
{
	for (int gpu = 0; gpu < GS_MAX_GPUS; gpu++) {
		struct gs_pool *p = __atomic_load_n(&graph_pools[gpu], __ATOMIC_ACQUIRE);

		if (p != NULL)
			pool_sync(p);
	}
}

#define BEGIN_CAPTURE_WRAPPER(abi, params, args)                         \
	GS_EXPORT CUresult abi params                                    \
	{                                                                \
		CUresult rc;                                             \
		TRACE(GS_ID_##abi, calls);                               \
		GET_REAL(abi, fn);                                       \
		rc = fn args;                                            \
		if (rc == CUDA_SUCCESS)                                  \
			__atomic_add_fetch(&captures, 1, __ATOMIC_RELAXED); \
		return rc;                                               \
	}

BEGIN_CAPTURE_WRAPPER(cuStreamBeginCapture, (CUstream stream), (stream))
BEGIN_CAPTURE_WRAPPER(cuStreamBeginCapture_ptsz, (CUstream stream), (stream))
BEGIN_CAPTURE_WRAPPER(cuStreamBeginCapture_v2, (CUstream stream, int mode), (stream, mode))
BEGIN_CAPTURE_WRAPPER(cuStreamBeginCapture_v2_ptsz, (CUstream stream, int mode), (stream, mode))
BEGIN_CAPTURE_WRAPPER(cuStreamBeginCaptureToGraph,
		      (CUstream stream, void *graph, const void *deps, const void *edges,
		       size_t ndeps, int mode),
		      (stream, graph, deps, edges, ndeps, mode))
BEGIN_CAPTURE_WRAPPER(cuStreamBeginCaptureToGraph_ptsz,
		      (CUstream stream, void *graph, const void *deps, const void *edges,
		       size_t ndeps, int mode),
		      (stream, graph, deps, edges, ndeps, mode))

#define GS_CAPTURE_INVALIDATED 901 /* CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: ended all the same */

/* A capture ends with success, or invalidated; the count never goes below 0. */
static void capture_ended(CUresult rc)
{
	uint32_t n = __atomic_load_n(&captures, __ATOMIC_RELAXED);

	if (rc != CUDA_SUCCESS && rc != GS_CAPTURE_INVALIDATED)
		return;
	while (n != 0 && !__atomic_compare_exchange_n(&captures, &n, n - 1, 1, __ATOMIC_RELAXED,
						      __ATOMIC_RELAXED))
		;
}

#define END_CAPTURE_WRAPPER(abi)                                     \
	GS_EXPORT CUresult abi(CUstream stream, void **graph)        \
	{                                                            \
		CUresult rc;                                         \
		TRACE(GS_ID_##abi, calls);                           \
		GET_REAL(abi, fn);                                   \
		rc = fn(stream, graph);                              \
		capture_ended(rc);                                   \
		return rc;                                           \
	}

END_CAPTURE_WRAPPER(cuStreamEndCapture)
END_CAPTURE_WRAPPER(cuStreamEndCapture_ptsz)

GS_EXPORT CUresult cuGraphAddMemAllocNode(void **node, void *graph, const void *deps,
					  size_t ndeps, void *params)
{
	TRACE(GS_ID_cuGraphAddMemAllocNode, calls);
	GET_REAL(cuGraphAddMemAllocNode, fn);
	if (g.mode != GS_ENFORCE)
		return fn(node, graph, deps, ndeps, params);
	return graph_node_made(fn(node, graph, deps, ndeps, params));
}

/* An upload maps the graph's memory as its launch would. */
#define UPLOAD_WRAPPER(abi)                                                          \
	GS_EXPORT CUresult abi(CUgraphExec exec, CUstream stream)                    \
	{                                                                            \
		CUresult rc;                                                         \
		TRACE(GS_ID_##abi, calls);                                           \
		GET_REAL(abi, fn);                                                   \
		rc = fn(exec, stream);                                               \
		if (rc == CUDA_SUCCESS && __atomic_load_n(&graph_mem, __ATOMIC_ACQUIRE)) \
			graph_launched(stream);                                      \
		return rc;                                                           \
	}

UPLOAD_WRAPPER(cuGraphUpload)
UPLOAD_WRAPPER(cuGraphUpload_ptsz)

GS_EXPORT CUresult cuDeviceGraphMemTrim(CUdevice dev)
{
	struct gs_pool *p;
	CUresult rc;
	int gpu;

	TRACE(GS_ID_cuDeviceGraphMemTrim, calls);
	GET_REAL(cuDeviceGraphMemTrim, fn);
	rc = fn(dev);
	if (rc == CUDA_SUCCESS && g.mode == GS_ENFORCE && (gpu = ledger_gpu(dev)) >= 0 &&
	    gpu < GS_MAX_GPUS && (p = __atomic_load_n(&graph_pools[gpu], __ATOMIC_ACQUIRE)) != NULL)
		pool_sync(p);
	return rc;
}

/* The driver may give back the memory only that executable graph's launches used. */
GS_EXPORT CUresult cuGraphExecDestroy(CUgraphExec exec)
{
	CUresult rc;

	TRACE(GS_ID_cuGraphExecDestroy, calls);
	GET_REAL(cuGraphExecDestroy, fn);
	rc = fn(exec);
	if (rc == CUDA_SUCCESS && g.mode == GS_ENFORCE &&
	    __atomic_load_n(&graph_mem, __ATOMIC_ACQUIRE))
		graph_pools_sync();
	return rc;
}

/*
 * The pitch the driver picks is known only afterwards: charge for the width
 * rounded to the smallest alignment first, then settle on pitch x height.
 */
static CUresult settle_pitch(CUdeviceptr *dptr, size_t *pitch, size_t height, struct gs_charge *c)
{
	uint64_t actual = footprint(mul_sat(*pitch, height));
	struct gs_charge extra;

	if (actual > c->bytes) {
		if (charge_gpu(c->gpu, actual - c->bytes, &extra) != CUDA_SUCCESS) {
			undo_ptr(*dptr);
			uncharge(c);
			*dptr = 0;
			return CUDA_ERROR_OUT_OF_MEMORY;
		}
	} else if (actual < c->bytes) {
		extra = *c;
		extra.bytes = c->bytes - actual;
		uncharge(&extra);
	}
	c->bytes = actual;
	return remember(*dptr, GS_K_PTR, c, undo_ptr);
}

GS_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width,
				      size_t height, unsigned int elem)
{
	struct gs_charge c;
	uint64_t row, guess;
	CUresult rc;

	TRACE(GS_ID_cuMemAllocPitch_v2, calls);
	GET_REAL(cuMemAllocPitch_v2, fn);
	if (g.mode == GS_INERT)
		return fn(dptr, pitch, width, height, elem);
	if (g.mode == GS_BROKEN)
		return CUDA_ERROR_NOT_PERMITTED;
	if (dptr == NULL || pitch == NULL || width == 0 || height == 0)
		return fn(dptr, pitch, width, height, elem);
	row = width > UINT64_MAX - (GS_SMALL_ALIGN - 1) ?
		      UINT64_MAX :
		      (width + GS_SMALL_ALIGN - 1) & ~(GS_SMALL_ALIGN - 1);
	guess = footprint(mul_sat(row, height));
	rc = charge_current(guess, &c);
	if (rc != CUDA_SUCCESS)
		return rc;
	rc = fn(dptr, pitch, width, height, elem);
	if (rc != CUDA_SUCCESS) {
		uncharge(&c);
		return rc;
	}
	return settle_pitch(dptr, pitch, height, &c);
}

/*
 * Every free has the same shape: the record out before the driver frees
 * (forget), the driver's answer, then the charge settled (freed). A handle
 * the shim has no record of is the driver's business alone.
 */
#define FREE_WRAPPER(abi, params, key, kind, args)                        \
	GS_EXPORT CUresult abi params                                       \
	{                                                                   \
		struct gs_alloc a;                                          \
		TRACE(GS_ID_##abi, calls);                                  \
		GET_REAL(abi, fn);                                          \
		if (!forget((uint64_t)(uintptr_t)(key), (kind), &a))        \
			return fn args;                                     \
		return freed(fn args, &a);                                  \
	}

FREE_WRAPPER(cuMemFree_v2, (CUdeviceptr dptr), dptr, GS_K_PTR, (dptr))
/* Pool memory goes back to its pool, which stays charged for what it keeps. */
FREE_WRAPPER(cuMemFreeAsync, (CUdeviceptr dptr, CUstream stream), dptr, GS_K_PTR, (dptr, stream))
FREE_WRAPPER(cuMemFreeAsync_ptsz, (CUdeviceptr dptr, CUstream stream), dptr, GS_K_PTR,
	     (dptr, stream))

/*
 * Virtual memory management (PyTorch's expandable segments, NCCL): the
 * physical memory is cuMemCreate's, charged on the device it names until
 * cuMemRelease. Host locations take no device memory and are not charged.
 */
GS_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
			       const CUmemAllocationProp *prop, unsigned long long flags)
{
	struct gs_charge c;
	CUresult rc;
	int gpu;

	TRACE(GS_ID_cuMemCreate, calls);
	GET_REAL(cuMemCreate, fn);
	if (g.mode == GS_INERT)
		return fn(handle, size, prop, flags);
	if (handle == NULL || prop == NULL || size == 0 ||
	    prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
		return fn(handle, size, prop, flags);
	if (g.mode == GS_BROKEN)
		return CUDA_ERROR_NOT_PERMITTED;
	gpu = ledger_gpu(prop->location.id);
	/*
	 * A device the driver cannot name (a bad ordinal, before cuInit) is the
	 * driver's to answer: a made-up CUDA_ERROR_OUT_OF_MEMORY would read as a
	 * full GPU, which PyTorch's expandable segments take for one to retry.
	 */
	if (gpu == GS_DEV_UNRESOLVED)
		return fn(handle, size, prop, flags);
	rc = charge_new(gpu, footprint(size), &c);
	if (rc != CUDA_SUCCESS)
		return rc;
	rc = fn(handle, size, prop, flags);
	return settle(rc, *handle, GS_K_HANDLE, &c, undo_handle);
}


/*
 * The driver frees cuMemCreate memory when the last reference (cuMemCreate's
 * and each cuMemRetainAllocationHandle's) is released AND the last mapping
 * unmapped, in either order: releasing right after mapping is common. The
 * charge follows the memory, not the handle.
 */
GS_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
	struct gs_alloc gone;
	CUresult rc;
	int r;

	TRACE(GS_ID_cuMemRelease, calls);
	GET_REAL(cuMemRelease, fn);
	if (g.mode != GS_ENFORCE)
		return fn(handle);
	/* Before the driver call: once freed, the handle value may be handed out again. */
	r = handle_adjust(handle, -1, 0, &gone);
	if (r < 0 || r == 2)
		return fn(handle);
	rc = fn(handle);
	if (rc != CUDA_SUCCESS) {
		if (r == 1) {
			gone.refs = 1;
			alloc_put(gone);
		} else {
			handle_adjust(handle, 1, 0, &gone);
		}
		return rc;
	}
	if (r == 1)
		uncharge_record(&gone);
	return rc;
}

/* A mapping's handle: its charge is gone with the handle's last reference and mapping. */
static void drop_mapping(uint64_t handle)
{
	struct gs_alloc gone;

	if (handle_adjust(handle, 0, -1, &gone) == 1)
		uncharge_record(&gone);
}

GS_EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr)
{
	struct gs_alloc map, gone;
	int early = 0;
	CUresult rc;

	TRACE(GS_ID_cuMemRetainAllocationHandle, calls);
	GET_REAL(cuMemRetainAllocationHandle, fn);
	if (g.mode != GS_ENFORCE || handle == NULL)
		return fn(handle, addr);
	/*
	 * At a mapping's start the handle is known beforehand: the reference is
	 * counted before the driver call, so a release racing with it can never
	 * free the record of memory this retain keeps alive.
	 */
	if (alloc_peek((uint64_t)(uintptr_t)addr, GS_K_MAP, &map) == 0)
		early = handle_adjust(map.owner, 1, 0, &gone) == 0;
	rc = fn(handle, addr);
	if (early && (rc != CUDA_SUCCESS || *handle != map.owner)) {
		if (handle_adjust(map.owner, -1, 0, &gone) == 1)
			uncharge_record(&gone);
		early = 0;
	}
	if (rc == CUDA_SUCCESS && !early)
		handle_adjust(*handle, 1, 0, &gone);
	return rc;
}

GS_EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
			    CUmemGenericAllocationHandle handle, unsigned long long flags)
{
	struct gs_alloc stale, gone;
	CUresult rc;
	int ours;

	TRACE(GS_ID_cuMemMap, calls);
	GET_REAL(cuMemMap, fn);
	if (g.mode != GS_ENFORCE)
		return fn(ptr, size, offset, handle, flags);
	/* Counted before the call, so a racing last release cannot free the record. */
	ours = handle_adjust(handle, 0, 1, &gone) == 0;
	rc = fn(ptr, size, offset, handle, flags);
	if (rc != CUDA_SUCCESS) {
		if (ours)
			drop_mapping(handle);
		return rc;
	}
	/* A record still at this address is a mapping that went without us: settle it. */
	if (alloc_untrack(ptr, GS_K_MAP, &stale) == 0)
		drop_mapping(stale.owner);
	/*
	 * Every mapping is recorded, of handles not ours too, so an unmap can walk
	 * its range. One that cannot be recorded keeps its memory charged: never
	 * too little.
	 */
	alloc_put((struct gs_alloc){
		.key = ptr, .kind = GS_K_MAP, .gpu = GS_DEV_FOREIGN, .size = size, .owner = handle });
	return rc;
}

/*
 * The mappings [ptr, ptr + size) covers, in order, taken out of the table
 * into a buffer; the walk stops at an address with no record (a mapping
 * made before the shim was there).
 */
static struct gs_alloc *take_mappings(CUdeviceptr ptr, size_t size, size_t *n)
{
	struct gs_alloc *m = NULL, *grown;
	size_t cap = 0;

	*n = 0;
	for (CUdeviceptr cur = ptr; cur - ptr < size;) {
		if (*n == cap) {
			cap = cap ? cap * 2 : 4;
			grown = realloc(m, cap * sizeof(*m));
			if (grown == NULL)
				break; /* the rest stay recorded and charged: never too little */
			m = grown;
		}
		if (alloc_untrack(cur, GS_K_MAP, &m[*n]) != 0 || m[*n].size == 0)
			break;
		cur += m[(*n)++].size;
	}
	return m;
}

/* What an unmap did to one mapping's handle, to be undone or settled after the driver call. */
struct gs_unmapped {
	struct gs_alloc gone; /* the handle's record, if this was its last hold */
	int state;	      /* 0: not ours; 1: mapping count dropped; 2: record taken out */
};

GS_EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
	struct gs_unmapped *u;
	struct gs_alloc *m, ignored;
	CUresult rc;
	size_t n;

	TRACE(GS_ID_cuMemUnmap, calls);
	GET_REAL(cuMemUnmap, fn);
	if (g.mode != GS_ENFORCE)
		return fn(ptr, size);
	/*
	 * Out before the driver call: once unmapped, the range may be mapped
	 * again, and a freed handle handed out again, by other threads.
	 */
	m = take_mappings(ptr, size, &n);
	u = n ? calloc(n, sizeof(*u)) : NULL;
	if (n != 0 && u == NULL) {
		/* Nothing to keep the undo in: the mappings stay charged, never too little. */
		for (size_t i = 0; i < n; i++)
			alloc_put(m[i]);
		free(m);
		return fn(ptr, size);
	}
	for (size_t i = 0; i < n; i++) {
		int r = handle_adjust(m[i].owner, 0, -1, &u[i].gone);

		u[i].state = r == 1 ? 2 : r == 0 ? 1 : 0;
	}
	rc = fn(ptr, size);
	/* Undone last first: a handle mapped twice in the range had its record put back last. */
	for (size_t k = n; k-- > 0;) {
		size_t i = k;

		if (rc == CUDA_SUCCESS) {
			if (u[i].state == 2)
				uncharge_record(&u[i].gone);
			continue;
		}
		alloc_put(m[i]);
		if (u[i].state == 2) {
			u[i].gone.maps = 1;
			alloc_put(u[i].gone);
		} else if (u[i].state == 1) {
			handle_adjust(m[i].owner, 0, 1, &ignored);
		}
	}
	free(u);
	free(m);
	return rc;
}

/* --- wrappers: CUDA arrays ---------------------------------------------------------- */

/* Bytes per channel of an array format; the widest any format has for those not listed. */
static uint64_t format_bytes(int format)
{
	size_t n = gs_array_format_bytes(format);

	return n ? n : 16;
}

/* Layered and cubemap arrays keep their depth (layers, faces) at every mip level. */
#define GS_ARRAY3D_LAYERED 0x01
#define GS_ARRAY3D_CUBEMAP 0x04

static uint64_t array_bytes(size_t w, size_t h, size_t d, int format, unsigned int channels,
			    unsigned int flags, unsigned int levels)
{
	uint64_t elem = mul_sat(format_bytes(format), channels), total = 0;
	int keep_depth = (flags & (GS_ARRAY3D_LAYERED | GS_ARRAY3D_CUBEMAP)) != 0;

	h = h ? h : 1;
	d = d ? d : 1;
	for (unsigned int i = 0; i < (levels ? levels : 1); i++) {
		uint64_t level = mul_sat(mul_sat(mul_sat(w, h), d), elem);

		total = total + level < total ? UINT64_MAX : total + level;
		w = w > 1 ? w / 2 : 1;
		h = h > 1 ? h / 2 : 1;
		if (!keep_depth)
			d = d > 1 ? d / 2 : 1;
	}
	return footprint(total);
}

#define ALLOC_ARRAY(call, out, desc, bytes_expr, kind, undo)                         \
	do {                                                                         \
		struct gs_charge c_;                                                 \
		CUresult rc_;                                                        \
		if (g.mode == GS_INERT || (out) == NULL || (desc) == NULL)           \
			return call;                                                 \
		if (g.mode == GS_BROKEN)                                             \
			return CUDA_ERROR_NOT_PERMITTED;                             \
		rc_ = charge_current((bytes_expr), &c_);                             \
		if (rc_ != CUDA_SUCCESS)                                             \
			return rc_;                                                  \
		rc_ = call;                                                          \
		return settle(rc_, (uint64_t)(uintptr_t) * (out), (kind), &c_, (undo)); \
	} while (0)

GS_EXPORT CUresult cuArrayCreate_v2(CUarray *array, const CUDA_ARRAY_DESCRIPTOR *desc)
{
	TRACE(GS_ID_cuArrayCreate_v2, calls);
	GET_REAL(cuArrayCreate_v2, fn);
	ALLOC_ARRAY(fn(array, desc), array, desc,
		    array_bytes(desc->Width, desc->Height, 1, desc->Format, desc->NumChannels, 0,
				1),
		    GS_K_ARRAY, undo_array);
}

GS_EXPORT CUresult cuArray3DCreate_v2(CUarray *array, const CUDA_ARRAY3D_DESCRIPTOR *desc)
{
	TRACE(GS_ID_cuArray3DCreate_v2, calls);
	GET_REAL(cuArray3DCreate_v2, fn);
	ALLOC_ARRAY(fn(array, desc), array, desc,
		    array_bytes(desc->Width, desc->Height, desc->Depth, desc->Format,
				desc->NumChannels, desc->Flags, 1),
		    GS_K_ARRAY, undo_array);
}

GS_EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *array,
					  const CUDA_ARRAY3D_DESCRIPTOR *desc, unsigned int levels)
{
	TRACE(GS_ID_cuMipmappedArrayCreate, calls);
	GET_REAL(cuMipmappedArrayCreate, fn);
	ALLOC_ARRAY(fn(array, desc, levels), array, desc,
		    array_bytes(desc->Width, desc->Height, desc->Depth, desc->Format,
				desc->NumChannels, desc->Flags, levels),
		    GS_K_MIPMAP, undo_mipmap);
}

FREE_WRAPPER(cuArrayDestroy, (CUarray array), array, GS_K_ARRAY, (array))
FREE_WRAPPER(cuMipmappedArrayDestroy, (CUmipmappedArray array), array, GS_K_MIPMAP, (array))

/* --- wrappers: launches --------------------------------------------------------------- */

/*
 * Out of line: a paused or gated task's launches and allocations wait here
 * until nodemgr clears every bit of the word and wakes them. The wait is on
 * the value read, which may hold either bit or both, so a word that changed
 * in between is read again at once. The timeout re-reads the word now and
 * then, so a wake-up lost to a daemon restart costs a fraction of a second,
 * not a hang.
 */
static __attribute__((noinline, cold)) void wait_while_paused(uint32_t *word)
{
	const struct gs_task *entry = (const struct gs_task *)((const char *)word -
								offsetof(struct gs_task, paused));
	struct timespec ts = { 0, 250 * 1000 * 1000 };
	uint32_t seen;

	while ((seen = __atomic_load_n(word, __ATOMIC_ACQUIRE)) != 0) {
		/*
		 * A process that outlived its task may find the entry handed to a
		 * newer task: that task's pause is not this process's to obey.
		 */
		if (strncmp(entry->task_id, g.task_id, GS_TASK_ID_LEN) != 0) {
			__atomic_store_n(&hot.pause, &never_paused, __ATOMIC_RELEASE);
			return;
		}
		syscall(SYS_futex, word, FUTEX_WAIT, seen, &ts, NULL, 0);
	}
}

static inline __attribute__((always_inline)) void launch_gate(void)
{
	hold_while_paused();
	__atomic_fetch_add(__atomic_load_n(&hot.launches, __ATOMIC_ACQUIRE), 1, __ATOMIC_RELAXED);
}

/* Every launch entry: the gate, then the driver. */
#define LAUNCH_WRAPPER(abi, params, args)       \
	GS_EXPORT CUresult abi params           \
	{                                       \
		TRACE(GS_ID_##abi, calls);      \
		GET_REAL(abi, fn);              \
		launch_gate();                  \
		return fn args;                 \
	}

LAUNCH_WRAPPER(cuLaunchKernel, GS_LAUNCH_PARAMS,
	       (f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra))
LAUNCH_WRAPPER(cuLaunchKernel_ptsz, GS_LAUNCH_PARAMS,
	       (f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra))
LAUNCH_WRAPPER(cuLaunchKernelEx, GS_EX_PARAMS, (config, f, params, extra))
LAUNCH_WRAPPER(cuLaunchKernelEx_ptsz, GS_EX_PARAMS, (config, f, params, extra))
LAUNCH_WRAPPER(cuLaunchCooperativeKernel, GS_COOP_PARAMS,
	       (f, gx, gy, gz, bx, by, bz, shmem, stream, params))
LAUNCH_WRAPPER(cuLaunchCooperativeKernel_ptsz, GS_COOP_PARAMS,
	       (f, gx, gy, gz, bx, by, bz, shmem, stream, params))

/* A graph launch may map graph memory: one flag read unless the process ever made some. */
#define GRAPH_LAUNCH_WRAPPER(abi)                                                  \
	GS_EXPORT CUresult abi(CUgraphExec exec, CUstream stream)                  \
	{                                                                          \
		CUresult rc;                                                       \
		TRACE(GS_ID_##abi, calls);                                         \
		GET_REAL(abi, fn);                                                 \
		launch_gate();                                                     \
		rc = fn(exec, stream);                                             \
		if (unlikely(__atomic_load_n(&graph_mem, __ATOMIC_RELAXED) != 0) && \
		    rc == CUDA_SUCCESS)                                            \
			graph_launched(stream);                                    \
		return rc;                                                         \
	}

GRAPH_LAUNCH_WRAPPER(cuGraphLaunch)
GRAPH_LAUNCH_WRAPPER(cuGraphLaunch_ptsz)

/* --- wrappers: lookup ------------------------------------------------------------------- */

/*
 * After the real lookup succeeds, decide whether the caller gets a wrapper
 * instead of the driver's pointer:
 *  - the driver returned the very function one of the base name's hooked
 *    variants forwards to: that variant's wrapper, exact by construction;
 *  - otherwise, up to the CUDA version hooks.def describes, the variant the
 *    table resolves the request to, if the shim wraps it (a driver whose
 *    lookup hands out other addresses than its exports is still caught);
 *  - anything else keeps the driver's pointer: an unwrapped variant, a name
 *    the shim does not hook, or, past the table's version, a variant the
 *    table may not know.
 */
static void gpa_substitute(const char *symbol, void **pfn, int version, cuuint64_t flags)
{
	const struct gs_hook *h;

	if (symbol == NULL || pfn == NULL || *pfn == NULL)
		return;
	for (int i = 0; i < GS_NENTRIES; i++) {
		h = &hooks[i];
		if (h->lib != GS_LIB_CUDA || h->wrapper == NULL || strcmp(h->base, symbol) != 0)
			continue;
		if (*pfn == __atomic_load_n(h->real, __ATOMIC_ACQUIRE)) {
			TRACE(i, via_gpa);
			*pfn = h->wrapper;
			return;
		}
	}
	if (version > GS_TABLE_CUDA_VERSION)
		return;
	h = variant_for(symbol, version, flags);
	if (h == NULL || h->wrapper == NULL || __atomic_load_n(h->real, __ATOMIC_ACQUIRE) == NULL)
		return;
	TRACE(h - hooks, via_gpa);
	*pfn = h->wrapper;
}

GS_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cuda_version,
				    cuuint64_t flags)
{
	CUresult rc;

	TRACE(GS_ID_cuGetProcAddress, calls);
	GET_REAL(cuGetProcAddress, fn);
	rc = fn(symbol, pfn, cuda_version, flags);
	if (rc == CUDA_SUCCESS)
		gpa_substitute(symbol, pfn, cuda_version, flags);
	return rc;
}

GS_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cuda_version,
				       cuuint64_t flags, CUdriverProcAddressQueryResult *status)
{
	CUresult rc;

	TRACE(GS_ID_cuGetProcAddress_v2, calls);
	GET_REAL(cuGetProcAddress_v2, fn);
	rc = fn(symbol, pfn, cuda_version, flags, status);
	if (rc == CUDA_SUCCESS)
		gpa_substitute(symbol, pfn, cuda_version, flags);
	return rc;
}

/* --- wrappers: NVML -------------------------------------------------------------------- */

static int hexval(char c)
{
	if (c >= '0' && c <= '9')
		return c - '0';
	if (c >= 'a' && c <= 'f')
		return c - 'a' + 10;
	if (c >= 'A' && c <= 'F')
		return c - 'A' + 10;
	return -1;
}

/* Ledger GPU of an NVML device (by its "GPU-…" UUID), or GS_DEV_FOREIGN. */
static int nvml_gpu(nvmlDevice_t dev)
{
	gs_fn_nvmlDeviceGetUUID get = R(nvml, nvmlDeviceGetUUID);
	char text[GS_NVML_UUID_LEN];
	uint8_t bytes[16];
	int n = 0;

	if (get == NULL || get(dev, text, sizeof(text)) != NVML_SUCCESS)
		return GS_DEV_FOREIGN;
	text[sizeof(text) - 1] = '\0';
	if (strncmp(text, "GPU-", 4) != 0)
		return GS_DEV_FOREIGN; /* a MIG instance: not a GPU the node grants */
	for (const char *p = text + 4; *p != '\0' && n < 32; p++) {
		int v = hexval(*p);

		if (*p == '-')
			continue;
		if (v < 0)
			return GS_DEV_FOREIGN;
		bytes[n / 2] = (uint8_t)(n % 2 ? (bytes[n / 2] | v) : (v << 4));
		n++;
	}
	if (n != 32)
		return GS_DEV_FOREIGN;
	for (uint32_t i = 0; i < g.ledger->ngpus && i < GS_MAX_GPUS; i++)
		if (memcmp(g.ledger->gpu[i].uuid, bytes, 16) == 0)
			return (int)i;
	return GS_DEV_FOREIGN;
}

/* Rewrite an NVML memory report as the environment's share; untouched for other GPUs. */
static void nvml_share(nvmlDevice_t dev, unsigned long long *total, unsigned long long *free_b,
		       unsigned long long *used)
{
	uint64_t t = *total, f = *free_b, u = 0;
	int gpu = nvml_gpu(dev);

	if (gpu < 0)
		return;
	share(gpu, &t, &f, &u);
	*total = t;
	*free_b = f;
	*used = u < t ? u : t;
}

GS_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t dev, nvmlMemory_t *mem)
{
	nvmlReturn_t rc;

	TRACE(GS_ID_nvmlDeviceGetMemoryInfo, calls);
	GET_NVML(nvmlDeviceGetMemoryInfo, fn);
	rc = fn(dev, mem);
	if (rc == NVML_SUCCESS && mode_acquire() == GS_ENFORCE)
		nvml_share(dev, &mem->total, &mem->free, &mem->used);
	return rc;
}

GS_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t dev, nvmlMemory_v2_t *mem)
{
	nvmlReturn_t rc;

	TRACE(GS_ID_nvmlDeviceGetMemoryInfo_v2, calls);
	GET_NVML(nvmlDeviceGetMemoryInfo_v2, fn);
	rc = fn(dev, mem);
	if (rc == NVML_SUCCESS && mode_acquire() == GS_ENFORCE && nvml_gpu(dev) >= 0) {
		/* The driver's reservation is not the environment's to see. */
		mem->total -= mem->reserved < mem->total ? mem->reserved : mem->total;
		mem->reserved = 0;
		nvml_share(dev, &mem->total, &mem->free, &mem->used);
	}
	return rc;
}

/* --- iterations: persistent and temporary memory (docs/timeslicing.md) ---------- */

/* This process's task entry, if it still names the process's task; NULL if none. */
static const struct gs_task *own_task(int slot)
{
	int t = __atomic_load_n(&g.ledger->slot[slot].task_index, __ATOMIC_ACQUIRE);
	const struct gs_task *entry;

	if (t < 0 || t >= GS_MAX_TASKS)
		return NULL;
	entry = &g.ledger->task[t];
	/* As in wait_while_paused: an entry handed on to a newer task is not this one's. */
	if (__atomic_load_n(&entry->state, __ATOMIC_ACQUIRE) != GS_SLOT_USED ||
	    strncmp(entry->task_id, g.task_id, GS_TASK_ID_LEN) != 0)
		return NULL;
	return entry;
}

/*
 * A process without a slot yet has never called into the driver, so it
 * holds nothing to classify: its boundaries are not counted, and its epoch
 * starts with the first boundary after it claims one (cuInit claims it).
 */
GS_EXPORT int gpushare_iteration(void)
{
	const struct gs_task *entry;
	uint64_t epoch, turn;
	int slot, flags = 0;

	if (mode_acquire() != GS_ENFORCE)
		return 0;
	slot = __atomic_load_n(&g.slot, __ATOMIC_ACQUIRE);
	if (slot < 0)
		return 0;
	pthread_mutex_lock(&g.epoch_mu);
	epoch = g.epoch + 1;
	__atomic_store_n(&g.epoch, epoch, __ATOMIC_RELEASE);
	gs_ledger_boundary(g.ledger, (uint32_t)slot, epoch);
	pools_at_boundary();
	pthread_mutex_unlock(&g.epoch_mu);
	entry = own_task(slot);
	if (entry == NULL)
		return 0;
	/*
	 * On a time-sliced GPU a process that never released does so once, so that its
	 * shape can be learned: at its first boundary, or at its first one after its GPU
	 * became time-sliced.
	 */
	if ((__atomic_load_n(&entry->flags, __ATOMIC_ACQUIRE) & GS_TASK_TIMESLICED) &&
	    __atomic_load_n(&g.ledger->slot[slot].releases, __ATOMIC_ACQUIRE) == 0)
		flags |= GPUSHARE_RELEASE;
	/*
	 * A task waiting for its turn holds no temporary memory: a process that reaches
	 * a boundary while its task is gated (its turn ended while it finished its step)
	 * releases before its next launch waits.
	 */
	if (__atomic_load_n(&entry->paused, __ATOMIC_ACQUIRE) & GS_PAUSE_TURN)
		flags |= GPUSHARE_RELEASE;
	/*
	 * Each process yields at its own turn_until-th boundary; nodemgr hands the turn
	 * on once every iterating process of the task has (a barrier across them).
	 */
	turn = __atomic_load_n(&entry->turn_until, __ATOMIC_ACQUIRE);
	if (turn != 0 && epoch >= turn)
		flags |= GPUSHARE_RELEASE | GPUSHARE_YIELD;
	return flags;
}

GS_EXPORT void gpushare_released(void)
{
	int slot;

	if (mode_acquire() != GS_ENFORCE)
		return;
	slot = __atomic_load_n(&g.slot, __ATOMIC_ACQUIRE);
	if (slot >= 0)
		gs_ledger_settle(g.ledger, (uint32_t)slot);
}

/*
 * Pin the charged record (key, kind): a temporary one's bytes join the
 * persistent share, and its free takes them out again. Under epoch_mu, so
 * no boundary moves the epoch meanwhile. -ENOENT if there is no record.
 */
static int pin(uint64_t key, uint32_t kind)
{
	struct gs_shard *s = shard_of(key, kind);
	int slot = __atomic_load_n(&g.slot, __ATOMIC_ACQUIRE);
	int64_t i;

	pthread_mutex_lock(&s->mu);
	i = shard_find(s, key, kind);
	if (i >= 0) {
		struct gs_alloc *a = &s->tab[i];

		/* One made before the current epoch is persistent already. */
		if (!a->pinned && a->epoch == g.epoch && slot >= 0) {
			a->pinned = 1;
			gs_ledger_persist(g.ledger, (uint32_t)slot, (uint32_t)a->gpu, a->size);
		}
	}
	pthread_mutex_unlock(&s->mu);
	return i >= 0 ? 0 : -ENOENT;
}

/*
 * `dptr` is where an allocation that yields a device pointer starts (all
 * of them are recorded as GS_K_PTR), or where a cuMemCreate handle is
 * mapped: then the handle's memory is what is pinned.
 */
GS_EXPORT int gpushare_mark_persistent(unsigned long long dptr)
{
	struct gs_alloc map;
	int rc;

	if (mode_acquire() != GS_ENFORCE || dptr == 0)
		return GPUSHARE_E_INVAL;
	pthread_mutex_lock(&g.epoch_mu);
	rc = pin(dptr, GS_K_PTR);
	if (rc != 0 && alloc_peek(dptr, GS_K_MAP, &map) == 0)
		rc = pin(map.owner, GS_K_HANDLE);
	pthread_mutex_unlock(&g.epoch_mu);
	return rc == 0 ? GPUSHARE_OK : GPUSHARE_E_INVAL;
}

GS_EXPORT int gpushare_memory(struct gpushare_memory *out)
{
	const struct gs_slot *s;
	int slot;

	if (out == NULL || mode_acquire() != GS_ENFORCE)
		return GPUSHARE_E_INVAL;
	memset(out, 0, sizeof(*out));
	slot = __atomic_load_n(&g.slot, __ATOMIC_ACQUIRE);
	if (slot < 0)
		return GPUSHARE_OK;
	s = &g.ledger->slot[slot];
	for (int i = 0; i < GS_MAX_GPUS; i++) {
		uint64_t used = __atomic_load_n(&s->used[i], __ATOMIC_RELAXED);
		uint64_t pers = __atomic_load_n(&s->persistent[i], __ATOMIC_RELAXED);

		out->used += used;
		out->persistent += pers;
		out->temporary += used > pers ? used - pers : 0;
		out->temporary_peak += __atomic_load_n(&s->temp_peak[i], __ATOMIC_RELAXED);
	}
	out->iterations = __atomic_load_n(&s->iterations, __ATOMIC_RELAXED);
	return GPUSHARE_OK;
}

/* --- load, fork, exit ---------------------------------------------------------- */

/*
 * A fork waits for an attach in progress: a child must never inherit a
 * ledger descriptor that its g does not show, since a child holding the
 * parent's open file description would keep the parent's slot lock alive.
 */
static void before_fork(void)
{
	pthread_mutex_lock(&attach_mu);
}

static void after_fork_parent(void)
{
	pthread_mutex_unlock(&attach_mu);
}

static void after_fork_child(void)
{
	/*
	 * The inherited descriptor shares the parent's lock, and the parent's
	 * allocations and context charges are not the child's: start over with
	 * no slot, an empty map and no boundaries counted. Locks are re-made
	 * because another thread may have held them.
	 */
	pthread_mutex_unlock(&attach_mu); /* taken by this thread in before_fork */
	if (g.mode != GS_ENFORCE)
		return;
	hot.pause = &never_paused;
	hot.launches = &unattached_launches;
	memset(g.ctx_state, 0, sizeof(g.ctx_state));
	memset(g.primary, 0, sizeof(g.primary));
	memset(g.primary_refs, 0, sizeof(g.primary_refs));
	g.ctx_gen++;
	paying = 0;
	pthread_mutex_init(&nvml_mu, NULL);
	pthread_mutex_init(&teardown_mu, NULL);
	/* The parent's mapping was not inherited (MADV_DONTFORK); drop its descriptor too. */
	close(g.fd);
	g.slot = -1;
	g.fd = open(g.ledger_path, O_RDWR | O_CLOEXEC);
	g.ledger = g.fd >= 0 ? map_ledger(g.fd) : NULL;
	if (g.ledger == NULL) {
		if (g.fd >= 0)
			close(g.fd);
		g.fd = -1;
		__atomic_store_n(&g.mode, GS_BROKEN, __ATOMIC_RELEASE);
	}
	pthread_mutex_init(&g.claim_mu, NULL);
	pthread_mutex_init(&g.epoch_mu, NULL);
	g.epoch = 0;
	/* The pools are the parent's; what the child allocates from them is its own. */
	pthread_mutex_init(&pools_mu, NULL);
	for (uint32_t i = 0; i < pools_n; i++) {
		pthread_mutex_init(&pools[i].mu, NULL);
		pools[i].charged = pools[i].in_use = pools[i].persisted = 0;
	}
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
		attach_at_load(ledger);
	pthread_atfork(before_fork, after_fork_parent, after_fork_child);
}

__attribute__((destructor)) static void gs_unload(void)
{
	static const char *const modes[] = { "inert", "enforce", "broken" };
	char buf[8192];
	size_t n = 0;
	int fd;

	if (g.trace_path == NULL)
		return;
	/* One write per process, so lines from many processes never interleave. */
	n += (size_t)snprintf(buf + n, sizeof(buf) - n, "pid=%d mode=%s\n", (int)getpid(),
			      modes[mode_acquire()]);
	for (int i = 0; i < GS_NENTRIES && n < sizeof(buf); i++) {
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
