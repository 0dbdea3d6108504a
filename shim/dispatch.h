/*
 * dispatch.c: the tables generated from hooks.def, the real driver's and
 * NVML's entry points, the dlsym hook, and the trace of which hooks a
 * process reached. The bottom layer of the shim: it names no other file's
 * state (shim.h).
 */
#ifndef GS_DISPATCH_H
#define GS_DISPATCH_H

#include "shim.h"

#pragma GCC visibility push(hidden)

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

/*
 * Orders gpushare_attach (process.c) against the first filling of the real
 * table: see dispatch.c.
 */
extern pthread_mutex_t gs_attach_mu;
extern int gs_driver_reached; /* under gs_attach_mu */

void resolve_real_dlsym(void);
extern void *(*gs_real_dlsym)(void *, const char *);
/* Called by the dlsym trampoline (dlsym_x86_64.S). */
GS_UNINSTRUMENTED void *gs_dlsym_hook(void *handle, const char *name);
void need_real(void);
void need_nvml(void);

/* --- the trace (GPUSHARE_TRACE) ----------------------------------------------- */

struct gs_trace_counts {
	unsigned long calls[GS_NENTRIES];
	unsigned long via_dlsym[GS_NENTRIES];
	unsigned long via_gpa[GS_NENTRIES];
};

extern struct gs_trace_counts gs_trace;

/*
 * Nonzero when GPUSHARE_TRACE names a file: set once at load, before any
 * wrapper can run, and never changed after, so a plain read suffices. The
 * path itself is dispatch.c's alone.
 */
extern int gs_tracing;

#define GS_TRACE(id, field)                                                           \
	do {                                                                          \
		if (unlikely(gs_tracing))                                             \
			__atomic_fetch_add(&gs_trace.field[id], 1, __ATOMIC_RELAXED); \
	} while (0)

/*
 * The trace's first line, which says what the process is (its mode, slot,
 * launches, waits): written into buf (len bytes) by a file above this one,
 * which registers it at load; snprintf's return. The trace is written at
 * exit, one write per process, so lines from many processes never
 * interleave.
 */
typedef int (*gs_trace_head_fn)(char *buf, size_t len);
void gs_trace_head(gs_trace_head_fn fn);

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

#pragma GCC visibility pop

#endif
