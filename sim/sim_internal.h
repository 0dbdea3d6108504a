/*
 * What the simulated driver's own files share: the generated export layer
 * (sim_exports.c), the trace (sim_trace.c), the private export tables
 * (sim_tables.c) and the driver proper (sim_cuda.c and the files beside it,
 * which share sim_driver.h among themselves). The tables hear of a context's
 * teardown and of a fork through the driver's registry (sim_registry.h). Nothing here is part of
 * libcuda.so.1's ABI: every symbol is hidden.
 */
#ifndef GPUSHARE_SIM_INTERNAL_H
#define GPUSHARE_SIM_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>

#include "cuda_abi.h"

#define SIM_EXPORT __attribute__((visibility("default")))

/* GPUSHARE_SIM_TRACE: a file every driver call is logged to (docs/simulator.md). */
#define SIM_TRACE_ENV "GPUSHARE_SIM_TRACE"

/*
 * Nonzero when tracing; set once by a constructor before any caller can
 * reach the driver, and never changed after, so a plain read suffices.
 */
extern int sim_trace_on;

/* One line to the trace: the caller's pid and thread id, then fmt. */
void sim_trace(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/*
 * An entry point's call: its arguments as machine words, described by kinds
 * (one letter each, as in cuda_api.gen.h), and what it returned.
 */
void sim_trace_call(const char *name, const char *kinds, const uintptr_t *args, CUresult rc);

/*
 * One row per cuGetProcAddress answer the real driver gives: the name asked
 * for, the ABI variant it stands for, the CUDA version that introduced the
 * variant and whether it is the per-thread default stream flavour. fn is the
 * exported function named abi, so dladdr() on a pointer handed out names it.
 */
struct sim_proc {
	const char *base;
	const char *abi;
	int first_version;
	bool per_thread;
	void *fn;
};

extern const struct sim_proc sim_procs[];
extern const unsigned int sim_nprocs;

/* The private tables cudart asks cuGetExportTable for (sim_tables.c). */
CUresult sim_export_table(const void **table, const CUuuid *id);

/* sim_ctx.c, for the tables. */

/* Device dev's primary-context handle, neither retained nor made current. */
CUresult sim_primary_handle(CUcontext *out, CUdevice dev);

/* The id of a live context, NULL meaning the calling thread's current one. */
bool sim_ctx_id(CUcontext ctx, uint64_t *id);

/* sim_exports.c declares every implementation its own way, as machine words. */
#ifndef SIM_EXPORT_LAYER
CUresult sim_impl_cuDriverGetVersion(int *version);
CUresult sim_impl_cuDeviceGetCount(int *count);
CUresult sim_impl_cuDeviceGetUuid(CUuuid *uuid, CUdevice dev);
CUresult sim_impl_cuDeviceGetAttribute(int *pi, int attrib, CUdevice dev);
#endif

#endif
