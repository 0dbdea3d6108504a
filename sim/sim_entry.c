/*
 * The simulated driver's entry points into itself: error names and strings,
 * cuGetExportTable (the tables are sim_tables.c's) and cuGetProcAddress.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "sim_driver.h"

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
	SIM_ERR(CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED, "peer access is already enabled"),
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

/* The runtime's private tables: sim_tables.c. */
CUresult sim_impl_cuGetExportTable(const void **table, const CUuuid *table_id)
{
	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (table == NULL || table_id == NULL)
		return CUDA_ERROR_INVALID_VALUE;
	return sim_export_table(table, table_id);
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
	const cuuint64_t valid =
		CU_GET_PROC_ADDRESS_LEGACY_STREAM | CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
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
