/*
 * What every file of the shim shares (private: never installed, never part
 * of the ABI). Everything declared in the shim's headers is hidden; the
 * exports are the cu* and nvml* wrappers and the gpushare_* API (shim.map).
 *
 * The files are layers, each calling only those below it, and each
 * header includes the one below, so that a file sees nothing above it:
 *
 *  dispatch.h   dispatch.c    tables generated from hooks.def, resolving the
 *                             real libraries, the dlsym hook,
 *                             cuGetProcAddress, the trace
 *  process.h    process.c     process state, ledger attachment, slot,
 *                             devices, the pause wait
 *  accounting.h accounting.c  charges, their records, contexts
 *  pools.h      pools.c       stream-ordered pools
 *  graph_mem.h  graph_mem.c   graph memory and stream capture
 *  pacer.h      pacer.c       compute shares: the pacer thread and the gate
 *                             launches read
 *  (wrappers)   cuda_hook.c   the wrappers, the launch path among them
 *               pool_hook.c   the wrappers of pools, stream-ordered
 *                             allocations, synchronisations, capture, graphs
 *               vmm_hook.c    the wrappers of virtual memory management
 *               iteration.c   the iteration API (gpushare_iteration and kin)
 *
 * Beside them, needing none: alloc_map.c (the sharded map of live
 * allocations, alloc_map.h) and ledger.c with ledger_access.c and
 * ledger_compute.c (the ledger, ledger_api.h).
 *
 * Load and fork: each file with state of its own sets it up in a
 * constructor of its own, and each that keeps state a fork child must not
 * inherit registers its own pthread_atfork handlers there, touching only
 * that state. libc is the registry: it runs the child handlers in the order
 * they were registered, and none depends on another's having run, so no
 * file names another's fork handling.
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

#pragma GCC visibility pop

#endif
