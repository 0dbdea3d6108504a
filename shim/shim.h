/*
 * Internals the shim's files share (private: never installed, never part of
 * the ABI). Everything declared here is hidden; the exports are the cu* and
 * nvml* wrappers and the gpushare_* API (shim.map).
 *
 *  dispatch.c   tables generated from hooks.def, resolving the real
 *               libraries, the dlsym hook, cuGetProcAddress, the trace
 *  process.c    process state, ledger attachment, slot, devices, the pause
 *               wait, load and fork
 *  accounting.c charging policy: charges and their records, contexts, pools,
 *               graph memory
 *  alloc_map.c  the sharded map of live allocations (alloc_map.h)
 *  cuda_hook.c  the wrappers, the launch path among them
 *  vmm_hook.c   the wrappers of virtual memory management (cuMemCreate, cuMemMap)
 *  iteration.c  the iteration API (gpushare_iteration and its kin)
 */
#ifndef GS_SHIM_H
#define GS_SHIM_H

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
#include "alloc_map.h"

#pragma GCC visibility push(hidden)

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
struct gs_real_table {
#define GS_HOOK(abi, base, ver, ptsz, params) gs_fn_##abi abi;
#define GS_REAL(abi, params) gs_fn_##abi abi;
#include "hooks.def"
};

struct gs_nvml_table {
#define GS_HOOK(abi, base, ver, ptsz, params)
#define GS_REAL(abi, params)
#define GS_NVML_HOOK(abi, params) gs_fn_##abi abi;
#define GS_NVML_REAL(abi, params) gs_fn_##abi abi;
#include "hooks.def"
};

extern struct gs_real_table gs_real;
extern struct gs_nvml_table gs_nvml;

/* Every entry of the lookup table: hooks, known unhooked variants, NVML hooks. */
enum {
#define GS_HOOK(abi, base, ver, ptsz, params) GS_ID_##abi,
#define GS_REAL(abi, params)
#define GS_VARIANT(abi, base, ver, ptsz) GS_ID_##abi,
#define GS_NVML_HOOK(abi, params) GS_ID_##abi,
#include "hooks.def"
	GS_NENTRIES
};

enum gs_lib {
	GS_LIB_CUDA,
	GS_LIB_NVML
};

struct gs_hook {
	const char *abi;
	const char *base; /* NULL for NVML */
	int version;
	int per_thread;
	enum gs_lib lib;
	void *wrapper; /* NULL: a variant the shim does not wrap */
	void **real;
};

extern const struct gs_hook gs_hooks[GS_NENTRIES];

/*
 * An acquire load of a real entry point of the driver or of NVML: resolution
 * publishes them with release. NULL where the library lacks it.
 */
#define GS_REAL_FN(abi) __atomic_load_n(&gs_real.abi, __ATOMIC_ACQUIRE)
#define GS_NVML_FN(abi) __atomic_load_n(&gs_nvml.abi, __ATOMIC_ACQUIRE)

/* --- process state -------------------------------------------------------- */

enum gs_mode {
	GS_INERT = GPUSHARE_MODE_INERT,	    /* no ledger: pass everything through */
	GS_ENFORCE = GPUSHARE_MODE_ENFORCE, /* ledger mapped: charge and enforce */
	GS_BROKEN = GPUSHARE_MODE_BROKEN,   /* ledger named at load, unusable: refuse allocations */
};

#define GS_MAX_DEVS 64
#define GS_DEV_UNKNOWN (-2)
#define GS_DEV_FOREIGN (-1)
/* ledger_gpu: the driver could not say which GPU the ordinal is (a bad one, no cuInit). */
#define GS_DEV_UNRESOLVED (-4)

/*
 * gs_state.mode changes at most once after load, when gpushare_attach takes an
 * inert process to enforcing (a release store, after all else it sets). The
 * wrappers still read it plainly, so their paths stay as they were: each
 * reads it after an acquire load of a real entry point, and the real table
 * is filled only after the mark that attach tests under gs_attach_mu, so a
 * successful attach happens before any wrapper reaches the driver. Other
 * readers use mode_acquire().
 */
struct gs_process {
	enum gs_mode mode;
	struct gs_ledger *ledger;
	int fd;	  /* this process's descriptor; holds the slot lock */
	int slot; /* claimed slot, -1 until first use */
	char task_id[GS_TASK_ID_LEN];
	char *trace_path;
	int dev_map[GS_MAX_DEVS];
	uint8_t ctx_state[GS_MAX_GPUS];	 /* the context charge on that GPU: enum gs_ctx_state */
	uint64_t ctx_bytes[GS_MAX_GPUS]; /* what was charged for it */
	CUcontext primary[GS_MAX_DEVS];	 /* each device's primary context, once retained */
	int primary_refs[GS_MAX_DEVS];	 /* this process's retains of it */
	unsigned int ctx_gen;		 /* bumped when a context goes away */
	/*
	 * Iteration boundaries this process reported (gpushare_iteration): an
	 * allocation made in an earlier epoch than the current one, or pinned
	 * by gpushare_mark_persistent, is in its slot's persistent share.
	 */
	uint64_t epoch;
	pthread_mutex_t claim_mu;   /* claims and reaps through fd: its locks are every thread's */
	pthread_mutex_t epoch_mu;   /* orders boundaries and marks against each other */
	char ledger_path[PATH_MAX]; /* to map it afresh after fork */
};

extern struct gs_process gs_state;

/* The mode, for readers that are not ordered after gpushare_attach otherwise. */
static inline enum gs_mode mode_acquire(void)
{
	return __atomic_load_n(&gs_state.mode, __ATOMIC_ACQUIRE);
}

/*
 * What the launch path touches. Until the process has a slot both point at
 * private words, so the path needs no mode test: claiming a slot repoints
 * them into the ledger (the task's pause word, the slot's launch counter).
 */
struct gs_hot_path {
	uint32_t *pause;
	uint64_t *launches;
};

extern uint32_t gs_never_paused;
extern uint64_t gs_unattached_launches;
extern struct gs_hot_path gs_hot;

struct gs_trace_counts {
	unsigned long calls[GS_NENTRIES];
	unsigned long via_dlsym[GS_NENTRIES];
	unsigned long via_gpa[GS_NENTRIES];
	/*
	 * Launches and allocations that found the pause word set, and the time
	 * they waited: counted in the wait itself (off the hot path), whether or
	 * not a trace is written, so that a trace tells whether a slow run waited.
	 */
	unsigned long pause_waits;
	unsigned long pause_wait_ns;
};

extern struct gs_trace_counts gs_trace;

#define GS_TRACE(id, field)                                                           \
	do {                                                                          \
		if (unlikely(gs_state.trace_path != NULL))                            \
			__atomic_fetch_add(&gs_trace.field[id], 1, __ATOMIC_RELAXED); \
	} while (0)

extern void *(*gs_real_dlsym)(void *, const char *);

/* CU_STREAM_LEGACY and CU_STREAM_PER_THREAD: the current context's default streams. */
#define GS_STREAM_LEGACY ((CUstream)0x1)
#define GS_STREAM_PER_THREAD ((CUstream)0x2)

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
	return __atomic_load_n(&gs_state.epoch, __ATOMIC_ACQUIRE);
}

/* A pool of host or managed memory: allocations from it take no device memory. */
#define GS_POOL_HOST (-3)
#define GS_POOL_RELEASE_THRESHOLD 4 /* CU_MEMPOOL_ATTR_RELEASE_THRESHOLD */

/* dispatch.c */
extern pthread_mutex_t gs_attach_mu;
extern int gs_driver_reached;
void resolve_real_dlsym(void);
/* Called by the dlsym trampoline (dlsym_x86_64.S). */
GS_UNINSTRUMENTED void *gs_dlsym_hook(void *handle, const char *name);
void need_real(void);
void need_nvml(void);
void gs_dispatch_after_fork(void);

/*
 * A wrapper's opening: the call counted in the trace, then the real entry
 * point, the table resolved on first use. NULL where the library lacks it,
 * which the wrapper answers with its not-found code (CUDA_ERROR_NOT_FOUND,
 * NVML_ERROR_FUNCTION_NOT_FOUND) and never calls.
 */
static inline __attribute__((always_inline)) void *traced_entry(int id, void **slot)
{
	void *fn;

	GS_TRACE(id, calls);
	fn = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
	if (unlikely(fn == NULL)) {
		need_real();
		fn = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
	}
	return fn;
}

static inline void *traced_nvml_entry(int id, void **slot)
{
	GS_TRACE(id, calls);
	need_nvml();
	return __atomic_load_n(slot, __ATOMIC_ACQUIRE);
}

/* gs_fn_abi fn = TRACED_FN(abi): the opening of abi's wrapper. */
#define TRACED_FN(abi) ((gs_fn_##abi)traced_entry(GS_ID_##abi, (void **)&gs_real.abi))
#define TRACED_NVML_FN(abi) ((gs_fn_##abi)traced_nvml_entry(GS_ID_##abi, (void **)&gs_nvml.abi))

/* process.c */
int my_slot(void);
void reap_dead_slots(int slot);
int ledger_gpu(CUdevice dev);
CUresult current_ctx(CUcontext *ctx, int *gpu);
CUresult current_gpu(int *gpu);
CUresult stream_ctx(CUstream stream, CUcontext *ctx, int *gpu);
__attribute__((cold)) void wait_while_paused(uint32_t *word);

/* accounting.c: charges */
CUresult charge_gpu(int gpu, uint64_t bytes, struct gs_charge *c);
CUresult charge_new(int gpu, uint64_t bytes, struct gs_charge *c);
CUresult charge_current(uint64_t bytes, struct gs_charge *c);
void give_back(int32_t slot, int32_t gpu, uint64_t bytes, uint64_t epoch, uint32_t pinned);
void uncharge(const struct gs_charge *c);
CUresult charge_context(CUdevice dev, int *charged);
void context_settle(int gpu, CUresult rc);
void gs_accounting_after_fork(void);

/* accounting.c: records of allocations */
int alloc_put(struct gs_alloc a);
CUresult remember(uint64_t key, uint32_t kind, const struct gs_charge *c, void (*undo)(uint64_t));
CUresult settle(CUresult rc, uint64_t key, uint32_t kind, const struct gs_charge *c,
		void (*undo)(uint64_t));
int forget(uint64_t key, uint32_t kind, struct gs_alloc *a);
void uncharge_record(const struct gs_alloc *a);
CUresult freed(CUresult rc, const struct gs_alloc *a);
void undo_ptr(uint64_t key);
void undo_handle(uint64_t key);
void undo_array(uint64_t key);
void undo_mipmap(uint64_t key);

/* accounting.c: contexts */
extern pthread_mutex_t teardown_mu;
CUresult teardown(gs_fn_cuCtxDestroy_v2 destroy, CUcontext ctx,
		  gs_fn_cuDevicePrimaryCtxReset_v2 on_dev, CUdevice dev, int release);

/* accounting.c: stream-ordered pools and graph memory */
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

CUresult pool_alloc_begin(struct gs_pool_alloc *op, const CUdeviceptr *dptr, size_t bytes,
			  CUmemoryPool pool, CUstream stream, CUstream cap);
CUresult pool_alloc_end(const struct gs_pool_alloc *op, CUresult rc, const CUdeviceptr *dptr);
struct gs_pool *pool_note(CUmemoryPool pool, int gpu);
int pool_gpu(const CUmemLocation *location, int type);
void set_current_pool(CUmemoryPool pool, int gpu);
void pool_trimmed(CUmemoryPool pool);
void pool_threshold_set(CUmemoryPool pool, uint64_t threshold);
void pool_destroyed(CUmemoryPool pool);
void pools_after_sync(void);
void pools_at_boundary(void);
extern uint32_t gs_graph_mem;
CUresult graph_node_made(CUresult rc);
__attribute__((cold)) void graph_launched(CUstream stream);
void graph_pool_trimmed(int gpu);
void graph_pools_sync(void);
void capture_begun(void);
void capture_ended(CUresult rc);
/* Launches and allocations of a paused or gated task wait here: one load when it runs. */
static inline __attribute__((always_inline)) void hold_while_paused(void)
{
	uint32_t *pause = __atomic_load_n(&gs_hot.pause, __ATOMIC_ACQUIRE);

	if (unlikely(__atomic_load_n(pause, __ATOMIC_RELAXED) != 0))
		wait_while_paused(pause);
}

/*
 * A paused or gated task takes no new memory: an allocation waits, as a
 * launch does, before it is charged (docs/timeslicing.md). The slot is
 * claimed first, since claiming is what points gs_hot.pause at the task's word.
 */
static inline __attribute__((always_inline)) void alloc_gate(void)
{
	my_slot();
	hold_while_paused();
}

#pragma GCC visibility pop

#endif
