/*
 * A simulated NVML, built as libnvidia-ml.so.1 beside the simulated driver,
 * for machines without NVIDIA hardware. It describes the same devices as
 * the simulated libcuda (sim_spec.c) and follows NVML's ABI: entry point
 * names, prototypes, return codes and reference-counted initialization.
 *
 * NVML sees every GPU on the node: like the real library it ignores
 * CUDA_VISIBLE_DEVICES. Memory is reported as the device's whole size, all
 * of it free: the simulated driver's allocations are per process, and a
 * real NVML's totals would not come from them either.
 *
 * Linked with -Bsymbolic so that calls inside the library stay inside it,
 * whatever a preloaded interposer exports.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "cuda_abi.h"
#include "sim_spec.h"

#define SIM_EXPORT __attribute__((visibility("default")))

/* The driver release that shipped with CUDA 13.0 (GS_SIM_DRIVER_VERSION). */
#define SIM_NVML_DRIVER_VERSION "580.65.06"
#define SIM_NVML_VERSION	"13." SIM_NVML_DRIVER_VERSION

/* A handle is the address of its slot: never a pointer into caller memory. */
struct nvmlDevice_st {
	int index;
};

static struct sim_spec nvml_specs[SIM_MAX_GPUS];
static struct nvmlDevice_st nvml_devs[SIM_MAX_GPUS];
static int nvml_ndevs;

/* The device list is read once per process, as the hardware would be. */
static pthread_once_t nvml_once = PTHREAD_ONCE_INIT;
static nvmlReturn_t nvml_load_result;

/* nvmlInit* calls not yet matched by nvmlShutdown; written under the lock. */
static pthread_mutex_t nvml_lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned int nvml_refs;

static void nvml_load(void)
{
	int i, n = sim_specs_load(nvml_specs);

	if (n < 0) {
		nvml_load_result = NVML_ERROR_UNKNOWN;
		return;
	}
	for (i = 0; i < n; i++)
		nvml_devs[i].index = i;
	nvml_ndevs = n;
	nvml_load_result = NVML_SUCCESS;
}

static bool nvml_live(void)
{
	return __atomic_load_n(&nvml_refs, __ATOMIC_ACQUIRE) > 0;
}

/* Every query's first checks: initialized, then a live handle. */
static nvmlReturn_t nvml_device(nvmlDevice_t dev, const struct sim_spec **spec)
{
	uintptr_t off = (uintptr_t)dev - (uintptr_t)nvml_devs;

	if (!nvml_live())
		return NVML_ERROR_UNINITIALIZED;
	if (!dev || (uintptr_t)dev < (uintptr_t)nvml_devs || off % sizeof(nvml_devs[0]) != 0 ||
	    off / sizeof(nvml_devs[0]) >= (uintptr_t)nvml_ndevs)
		return NVML_ERROR_INVALID_ARGUMENT;
	*spec = &nvml_specs[dev->index];
	return NVML_SUCCESS;
}

/* NVML's string convention: NUL-terminated, and a short buffer is an error. */
static nvmlReturn_t nvml_copy(char *buf, unsigned int length, const char *str)
{
	size_t n = strlen(str);

	if (!buf)
		return NVML_ERROR_INVALID_ARGUMENT;
	if (length <= n)
		return NVML_ERROR_INSUFFICIENT_SIZE;
	memcpy(buf, str, n + 1);
	return NVML_SUCCESS;
}

/* Initialization. */

/*
 * The flags (no GPUs required, no attach) change nothing here: the node
 * always has its devices and there is nothing to attach to.
 */
SIM_EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
	(void)flags;
	pthread_once(&nvml_once, nvml_load);
	if (nvml_load_result != NVML_SUCCESS)
		return nvml_load_result;
	pthread_mutex_lock(&nvml_lock);
	__atomic_store_n(&nvml_refs, nvml_refs + 1, __ATOMIC_RELEASE);
	pthread_mutex_unlock(&nvml_lock);
	return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlInit_v2(void)
{
	return nvmlInitWithFlags(0);
}

/* v1 differs only on nodes with a GPU the caller may not use; none here. */
SIM_EXPORT nvmlReturn_t nvmlInit(void)
{
	return nvmlInitWithFlags(0);
}

SIM_EXPORT nvmlReturn_t nvmlShutdown(void)
{
	nvmlReturn_t rc = NVML_SUCCESS;

	pthread_mutex_lock(&nvml_lock);
	if (nvml_refs == 0)
		rc = NVML_ERROR_UNINITIALIZED;
	else
		__atomic_store_n(&nvml_refs, nvml_refs - 1, __ATOMIC_RELEASE);
	pthread_mutex_unlock(&nvml_lock);
	return rc;
}

SIM_EXPORT const char *nvmlErrorString(nvmlReturn_t result)
{
	switch (result) {
	case NVML_SUCCESS:
		return "Success";
	case NVML_ERROR_UNINITIALIZED:
		return "Uninitialized";
	case NVML_ERROR_INVALID_ARGUMENT:
		return "Invalid Argument";
	case NVML_ERROR_NOT_SUPPORTED:
		return "Not Supported";
	case NVML_ERROR_NO_PERMISSION:
		return "Insufficient Permissions";
	case NVML_ERROR_ALREADY_INITIALIZED:
		return "Already Initialized";
	case NVML_ERROR_NOT_FOUND:
		return "Not Found";
	case NVML_ERROR_INSUFFICIENT_SIZE:
		return "Insufficient Size";
	case NVML_ERROR_DRIVER_NOT_LOADED:
		return "Driver Not Loaded";
	case NVML_ERROR_LIBRARY_NOT_FOUND:
		return "NVML Shared Library Not Found";
	case NVML_ERROR_FUNCTION_NOT_FOUND:
		return "Function Not Found";
	case NVML_ERROR_GPU_IS_LOST:
		return "GPU is lost";
	case NVML_ERROR_ARGUMENT_VERSION_MISMATCH:
		return "Argument version mismatch";
	default:
		return "Unknown Error";
	}
}

/* System queries. */

SIM_EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
	if (!nvml_live())
		return NVML_ERROR_UNINITIALIZED;
	return nvml_copy(version, length, SIM_NVML_DRIVER_VERSION);
}

SIM_EXPORT nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
	if (!nvml_live())
		return NVML_ERROR_UNINITIALIZED;
	return nvml_copy(version, length, SIM_NVML_VERSION);
}

/* Device enumeration. */

SIM_EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count)
{
	if (!nvml_live())
		return NVML_ERROR_UNINITIALIZED;
	if (!count)
		return NVML_ERROR_INVALID_ARGUMENT;
	*count = (unsigned int)nvml_ndevs;
	return NVML_SUCCESS;
}

/* As for nvmlInit: v1 would leave out devices the caller may not use. */
SIM_EXPORT nvmlReturn_t nvmlDeviceGetCount(unsigned int *count)
{
	return nvmlDeviceGetCount_v2(count);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
	if (!nvml_live())
		return NVML_ERROR_UNINITIALIZED;
	if (!device || index >= (unsigned int)nvml_ndevs)
		return NVML_ERROR_INVALID_ARGUMENT;
	*device = &nvml_devs[index];
	return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
	return nvmlDeviceGetHandleByIndex_v2(index, device);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
	int i;

	if (!nvml_live())
		return NVML_ERROR_UNINITIALIZED;
	if (!uuid || !device)
		return NVML_ERROR_INVALID_ARGUMENT;
	/* The whole UUID: unlike CUDA_VISIBLE_DEVICES, NVML takes no prefixes. */
	for (i = 0; i < nvml_ndevs; i++) {
		if (strcasecmp(nvml_specs[i].uuid, uuid) == 0) {
			*device = &nvml_devs[i];
			return NVML_SUCCESS;
		}
	}
	return NVML_ERROR_NOT_FOUND;
}

/* Device queries. */

SIM_EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
	const struct sim_spec *spec;
	nvmlReturn_t rc = nvml_device(device, &spec);

	return rc == NVML_SUCCESS ? nvml_copy(uuid, length, spec->uuid) : rc;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
	const struct sim_spec *spec;
	nvmlReturn_t rc = nvml_device(device, &spec);

	return rc == NVML_SUCCESS ? nvml_copy(name, length, spec->name) : rc;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
	const struct sim_spec *spec;
	nvmlReturn_t rc = nvml_device(device, &spec);

	if (rc == NVML_SUCCESS && !index)
		rc = NVML_ERROR_INVALID_ARGUMENT;
	if (rc == NVML_SUCCESS)
		*index = (unsigned int)device->index;
	return rc;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
	const struct sim_spec *spec;
	nvmlReturn_t rc = nvml_device(device, &spec);

	if (rc == NVML_SUCCESS && !memory)
		rc = NVML_ERROR_INVALID_ARGUMENT;
	if (rc != NVML_SUCCESS)
		return rc;
	memory->total = spec->bytes;
	memory->used = 0;
	memory->free = spec->bytes;
	return NVML_SUCCESS;
}

/* The caller states which layout it passed: only version 2 is known. */
SIM_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
	const struct sim_spec *spec;
	nvmlReturn_t rc = nvml_device(device, &spec);

	if (rc == NVML_SUCCESS && !memory)
		rc = NVML_ERROR_INVALID_ARGUMENT;
	if (rc == NVML_SUCCESS && memory->version != GS_NVML_MEMORY_V2)
		rc = NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
	if (rc != NVML_SUCCESS)
		return rc;
	memory->total = spec->bytes;
	memory->reserved = 0;
	memory->used = 0;
	memory->free = spec->bytes;
	return NVML_SUCCESS;
}
