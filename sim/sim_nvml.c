/*
 * A simulated NVML, built as libnvidia-ml.so.1 beside the simulated driver,
 * for machines without NVIDIA hardware. It describes the same devices as
 * the simulated libcuda (sim_spec.c) and follows NVML's ABI: entry point
 * names, prototypes, return codes and reference-counted initialization.
 *
 * NVML sees every GPU on the node: like the real library it ignores
 * CUDA_VISIBLE_DEVICES. What the simulated driver's processes hold reaches
 * it through the node's usage registry (sim_usage.c): memory used is the sum
 * of their device memory, and they are the device's compute processes. Their
 * kernel launches' simulated run time over the last second is each one's
 * utilisation, and the device's is their sum, at most 100%. The simulated
 * GPUs have no NVLink and belong to no NVSwitch fabric.
 *
 * Linked with -Bsymbolic so that calls inside the library stay inside it,
 * whatever a preloaded interposer exports.
 */
#define _GNU_SOURCE
#include <limits.h>
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "cuda_abi.h"
#include "sim_attrs.h"
#include "sim_spec.h"
#include "sim_usage.h"

#define SIM_EXPORT __attribute__((visibility("default")))

/* The driver release that shipped with CUDA 13.0 (GS_SIM_DRIVER_VERSION). */
#define SIM_NVML_DRIVER_VERSION "580.65.06"
#define SIM_NVML_VERSION "13." SIM_NVML_DRIVER_VERSION

/*
 * NVML's structures beyond cuda_abi.h's slice, laid out as nvml.h lays
 * them out; the checks below hold them to the sizes the ABI fixes.
 */

/* nvmlPciInfo_t, as _v3 fills it. */
struct sim_nvml_pci {
	char busIdLegacy[16]; /* "%04X:%02X:%02X.0" */
	unsigned int domain;
	unsigned int bus;
	unsigned int device;
	unsigned int pciDeviceId; /* device id << 16 | vendor id */
	unsigned int pciSubSystemId;
	char busId[32]; /* "%08X:%02X:%02X.0" */
};

/* What v1 and _v2 fill: the short bus id, then four reserved words. */
struct sim_nvml_pci_legacy {
	char busId[16];
	unsigned int domain;
	unsigned int bus;
	unsigned int device;
	unsigned int pciDeviceId;
	unsigned int pciSubSystemId;
	unsigned int reserved[4];
};

/* nvmlProcessInfo_v1_t, for the unversioned nvmlDeviceGetComputeRunningProcesses. */
struct sim_nvml_proc_v1 {
	unsigned int pid;
	unsigned long long usedGpuMemory;
};

/* nvmlProcessInfo_v2_t, which _v3's nvmlProcessInfo_t repeats. */
struct sim_nvml_proc_v2 {
	unsigned int pid;
	unsigned long long usedGpuMemory;
	unsigned int gpuInstanceId;
	unsigned int computeInstanceId;
};

/* nvmlGpuFabricInfo_v2_t and _v3_t, the caller naming which in version. */
struct sim_nvml_fabric_v2 {
	unsigned int version;
	unsigned char clusterUuid[16];
	nvmlReturn_t status;
	unsigned int cliqueId;
	unsigned char state; /* nvmlGpuFabricState_t */
	unsigned int healthMask;
};

struct sim_nvml_fabric_v3 {
	unsigned int version;
	unsigned char clusterUuid[16];
	nvmlReturn_t status;
	unsigned int cliqueId;
	unsigned char state;
	unsigned int healthMask;
	unsigned char healthSummary;
};

/* nvmlUtilization_t. */
struct sim_nvml_utilization {
	unsigned int gpu;
	unsigned int memory;
};

/* nvmlProcessUtilizationSample_t. */
struct sim_nvml_proc_util {
	unsigned int pid;
	unsigned long long timeStamp; /* CPU timestamp, microseconds */
	unsigned int smUtil;
	unsigned int memUtil;
	unsigned int encUtil;
	unsigned int decUtil;
};

_Static_assert(sizeof(struct sim_nvml_utilization) == 8, "nvmlUtilization_t");
_Static_assert(sizeof(struct sim_nvml_proc_util) == 32, "nvmlProcessUtilizationSample_t");
_Static_assert(sizeof(struct sim_nvml_pci) == 68, "nvmlPciInfo_t");
_Static_assert(sizeof(struct sim_nvml_pci_legacy) == 52, "nvmlPciInfo_t, v1/v2");
_Static_assert(sizeof(struct sim_nvml_proc_v1) == 16, "nvmlProcessInfo_v1_t");
_Static_assert(sizeof(struct sim_nvml_proc_v2) == 24, "nvmlProcessInfo_v2_t");
_Static_assert(sizeof(struct sim_nvml_fabric_v2) == 36, "nvmlGpuFabricInfo_v2_t");
_Static_assert(sizeof(struct sim_nvml_fabric_v3) == 40, "nvmlGpuFabricInfo_v3_t");

/* NVML_STRUCT_VERSION(GpuFabricInfo, 2) and (..., 3). */
#define SIM_NVML_FABRIC_V2 ((unsigned int)(sizeof(struct sim_nvml_fabric_v2) | 2u << 24))
#define SIM_NVML_FABRIC_V3 ((unsigned int)(sizeof(struct sim_nvml_fabric_v3) | 3u << 24))
#define SIM_NVML_FABRIC_STATE_NOT_SUPPORTED 0

/* Outside MIG a process has no GPU or compute instance: NVML says "not available". */
#define SIM_NVML_NO_INSTANCE 0xffffffffu

/* NVML_NVLINK_MAX_LINKS of the NVML that ships with CUDA 13.0: links 0 to 17. */
#define SIM_NVML_NVLINK_MAX_LINKS 18

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
	sim_usage_ready();
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

/* nvml_device, then the caller's own argument check (args_ok). */
static nvmlReturn_t nvml_device_out(nvmlDevice_t dev, bool args_ok, const struct sim_spec **spec)
{
	nvmlReturn_t rc = nvml_device(dev, spec);

	if (rc == NVML_SUCCESS && !args_ok)
		rc = NVML_ERROR_INVALID_ARGUMENT;
	return rc;
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

/*
 * The exports, declared before they are defined: each definition below is
 * checked against its prototype.
 */
SIM_EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags);
SIM_EXPORT nvmlReturn_t nvmlInit_v2(void);
SIM_EXPORT nvmlReturn_t nvmlInit(void);
SIM_EXPORT nvmlReturn_t nvmlShutdown(void);
SIM_EXPORT const char *nvmlErrorString(nvmlReturn_t result);
SIM_EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length);
SIM_EXPORT nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length);
SIM_EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion);
SIM_EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion);
SIM_EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count);
SIM_EXPORT nvmlReturn_t nvmlDeviceGetCount(unsigned int *count);
SIM_EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device);
SIM_EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device);
SIM_EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device);
SIM_EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length);
SIM_EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length);
SIM_EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index);
SIM_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory);
SIM_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory);
SIM_EXPORT nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major,
							   int *minor);
SIM_EXPORT nvmlReturn_t nvmlDeviceGetNumGpuCores(nvmlDevice_t device, unsigned int *numCores);
SIM_EXPORT nvmlReturn_t nvmlDeviceGetMaxClockInfo(nvmlDevice_t device, int type,
						  unsigned int *clock);
SIM_EXPORT nvmlReturn_t nvmlDeviceGetMemoryBusWidth(nvmlDevice_t device, unsigned int *busWidth);
SIM_EXPORT nvmlReturn_t nvmlDeviceGetMaxPcieLinkGeneration(nvmlDevice_t device,
							   unsigned int *maxLinkGen);
SIM_EXPORT nvmlReturn_t nvmlDeviceGetMaxPcieLinkWidth(nvmlDevice_t device,
						      unsigned int *maxLinkWidth);
SIM_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device,
							     unsigned int *infoCount,
							     struct sim_nvml_proc_v1 *infos);
SIM_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device,
								unsigned int *infoCount,
								struct sim_nvml_proc_v2 *infos);
SIM_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device,
								unsigned int *infoCount,
								struct sim_nvml_proc_v2 *infos);
SIM_EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device,
						      struct sim_nvml_utilization *utilization);
SIM_EXPORT nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device,
							struct sim_nvml_proc_util *utilization,
							unsigned int *processSamplesCount,
							unsigned long long lastSeenTimeStamp);
SIM_EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, struct sim_nvml_pci *pci);
SIM_EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device,
						struct sim_nvml_pci_legacy *pci);
SIM_EXPORT nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t device, struct sim_nvml_pci_legacy *pci);
SIM_EXPORT nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId,
							 nvmlDevice_t *device);
SIM_EXPORT nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *pciBusId, nvmlDevice_t *device);
SIM_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link,
						 int *isActive);
SIM_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemoteDeviceType(nvmlDevice_t device, unsigned int link,
							    int *pNvLinkDeviceType);
SIM_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t device, unsigned int link,
							    struct sim_nvml_pci *pci);
SIM_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo(nvmlDevice_t device, unsigned int link,
							 struct sim_nvml_pci_legacy *pci);
SIM_EXPORT nvmlReturn_t nvmlDeviceGetGpuFabricInfoV(nvmlDevice_t device, void *gpuFabricInfo);
SIM_EXPORT nvmlReturn_t gpushareSimProcessBusyNs(nvmlDevice_t device, unsigned int pid,
						 unsigned long long *ns);
SIM_EXPORT nvmlReturn_t gpushareSimDeviceBusyNs(nvmlDevice_t device, unsigned long long *ns);

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

/*
 * The CUDA version the simulated driver's cuDriverGetVersion reports. v1
 * would read it from the installed libcuda, _v2 by calling it: both get
 * the same number here, without nvmlInit, as the reference allows.
 */
SIM_EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion)
{
	if (!cudaDriverVersion)
		return NVML_ERROR_INVALID_ARGUMENT;
	*cudaDriverVersion = GS_SIM_DRIVER_VERSION;
	return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion)
{
	return nvmlSystemGetCudaDriverVersion_v2(cudaDriverVersion);
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
	nvmlReturn_t rc = nvml_device_out(device, index != NULL, &spec);

	if (rc == NVML_SUCCESS)
		*index = (unsigned int)device->index;
	return rc;
}

/* What the device's processes hold now; never more than it has. */
static unsigned long long nvml_used(nvmlDevice_t device, const struct sim_spec *spec)
{
	unsigned long long total;

	sim_usage_list(device->index, NULL, 0, &total);
	return total < spec->bytes ? total : spec->bytes;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
	const struct sim_spec *spec;
	nvmlReturn_t rc = nvml_device_out(device, memory != NULL, &spec);

	if (rc != NVML_SUCCESS)
		return rc;
	memory->total = spec->bytes;
	memory->used = nvml_used(device, spec);
	memory->free = memory->total - memory->used;
	return NVML_SUCCESS;
}

/* The caller states which layout it passed: only version 2 is known. */
SIM_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
	const struct sim_spec *spec;
	nvmlReturn_t rc = nvml_device_out(device, memory != NULL, &spec);

	if (rc == NVML_SUCCESS && memory->version != GS_NVML_MEMORY_V2)
		rc = NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
	if (rc != NVML_SUCCESS)
		return rc;
	memory->total = spec->bytes;
	memory->reserved = 0;
	memory->used = nvml_used(device, spec);
	memory->free = memory->total - memory->used;
	return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major,
							   int *minor)
{
	const struct sim_spec *spec;
	nvmlReturn_t rc = nvml_device_out(device, major && minor, &spec);

	if (rc != NVML_SUCCESS)
		return rc;
	sim_device_attribute(spec, SIM_ATTR_CC_MAJOR, major);
	sim_device_attribute(spec, SIM_ATTR_CC_MINOR, minor);
	return NVML_SUCCESS;
}

/*
 * What a step time estimate takes of a GPU (nodemgr's GPU description,
 * docs/prediction.md#step-time), from the device's attributes, so that a
 * GPUSHARE_SIM_GPUS override ("cc=8.0,sms=108") describes the same device to
 * the driver and to NVML.
 */

/*
 * FP32 lanes per SM by compute capability, as the vendor's architecture
 * documents give them: NVML counts a GPU's cores so. Mirrored by
 * nodemgr/policy/steptime.py (ARCH), which divides the count back into SMs;
 * tests/sim/test_sim_nvml.py holds the two together.
 */
static unsigned int nvml_fp32_lanes(int major, int minor)
{
	if (major == 3)
		return 192;
	if ((major == 6 && minor == 0) || major == 7 || (major == 8 && minor == 0))
		return 64;
	return 128;
}

/*
 * An attribute NVML reports as a count or a clock: NOT_SUPPORTED for an
 * override that is not one (zero or negative).
 */
static nvmlReturn_t nvml_positive(const struct sim_spec *spec, int attrib, unsigned int *out)
{
	int value = 0;

	sim_device_attribute(spec, attrib, &value);
	if (value <= 0)
		return NVML_ERROR_NOT_SUPPORTED;
	*out = (unsigned int)value;
	return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetNumGpuCores(nvmlDevice_t device, unsigned int *numCores)
{
	const struct sim_spec *spec;
	nvmlReturn_t rc = nvml_device_out(device, numCores != NULL, &spec);
	unsigned long long cores;
	unsigned int sms = 0;
	int major = 0, minor = 0;

	if (rc == NVML_SUCCESS)
		rc = nvml_positive(spec, SIM_ATTR_MULTIPROCESSOR_COUNT, &sms);
	if (rc != NVML_SUCCESS)
		return rc;
	sim_device_attribute(spec, SIM_ATTR_CC_MAJOR, &major);
	sim_device_attribute(spec, SIM_ATTR_CC_MINOR, &minor);
	cores = (unsigned long long)sms * nvml_fp32_lanes(major, minor);
	*numCores = cores > UINT_MAX ? UINT_MAX : (unsigned int)cores;
	return NVML_SUCCESS;
}

/* nvmlClockType_t: graphics, SM, memory, video. */
enum {
	NVML_CLOCK_GRAPHICS,
	NVML_CLOCK_SM,
	NVML_CLOCK_MEM,
	NVML_CLOCK_VIDEO
};

/* The attributes' kHz in NVML's MHz; graphics and video clocks run with the SMs'. */
SIM_EXPORT nvmlReturn_t nvmlDeviceGetMaxClockInfo(nvmlDevice_t device, int type,
						  unsigned int *clock)
{
	const struct sim_spec *spec;
	nvmlReturn_t rc = nvml_device_out(device,
					  clock != NULL && type >= NVML_CLOCK_GRAPHICS &&
						  type <= NVML_CLOCK_VIDEO,
					  &spec);
	unsigned int khz = 0;

	if (rc == NVML_SUCCESS)
		rc = nvml_positive(spec,
				   type == NVML_CLOCK_MEM ? SIM_ATTR_MEMORY_CLOCK_RATE
							  : SIM_ATTR_CLOCK_RATE,
				   &khz);
	if (rc == NVML_SUCCESS)
		*clock = khz / 1000;
	return rc;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetMemoryBusWidth(nvmlDevice_t device, unsigned int *busWidth)
{
	const struct sim_spec *spec;
	nvmlReturn_t rc = nvml_device_out(device, busWidth != NULL, &spec);

	if (rc == NVML_SUCCESS)
		rc = nvml_positive(spec, SIM_ATTR_GLOBAL_MEMORY_BUS_WIDTH, busWidth);
	return rc;
}

/* The simulated GPUs sit on a PCIe 5.0 x16 link, as an H100 PCIe card or an SXM board's. */
#define NVML_SIM_PCIE_GEN 5
#define NVML_SIM_PCIE_WIDTH 16

SIM_EXPORT nvmlReturn_t nvmlDeviceGetMaxPcieLinkGeneration(nvmlDevice_t device,
							   unsigned int *maxLinkGen)
{
	const struct sim_spec *spec;
	nvmlReturn_t rc = nvml_device_out(device, maxLinkGen != NULL, &spec);

	if (rc == NVML_SUCCESS)
		*maxLinkGen = NVML_SIM_PCIE_GEN;
	return rc;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetMaxPcieLinkWidth(nvmlDevice_t device,
						      unsigned int *maxLinkWidth)
{
	const struct sim_spec *spec;
	nvmlReturn_t rc = nvml_device_out(device, maxLinkWidth != NULL, &spec);

	if (rc == NVML_SUCCESS)
		*maxLinkWidth = NVML_SIM_PCIE_WIDTH;
	return rc;
}

/* Processes. */

/*
 * Every version: the caller's *count is the room in infos; too little
 * gets the number needed and NVML_ERROR_INSUFFICIENT_SIZE, so that
 * *count = 0 asks how many there are (infos may then be NULL).
 */
static nvmlReturn_t nvml_processes(nvmlDevice_t device, unsigned int *count, void *infos, bool v1)
{
	struct sim_usage_proc procs[SIM_USAGE_SLOTS];
	const struct sim_spec *spec;
	unsigned long long total;
	unsigned int i, n;
	nvmlReturn_t rc = nvml_device_out(device, count != NULL, &spec);

	if (rc != NVML_SUCCESS)
		return rc;
	n = sim_usage_list(device->index, procs, SIM_USAGE_SLOTS, &total);
	if (*count < n) {
		*count = n;
		return NVML_ERROR_INSUFFICIENT_SIZE;
	}
	if (n > 0 && !infos)
		return NVML_ERROR_INVALID_ARGUMENT;
	for (i = 0; i < n; i++) {
		unsigned long long used = procs[i].bytes;

		if (used > spec->bytes)
			used = spec->bytes;
		if (v1) {
			struct sim_nvml_proc_v1 *p = (struct sim_nvml_proc_v1 *)infos + i;

			p->pid = procs[i].pid;
			p->usedGpuMemory = used;
		} else {
			struct sim_nvml_proc_v2 *p = (struct sim_nvml_proc_v2 *)infos + i;

			p->pid = procs[i].pid;
			p->usedGpuMemory = used;
			p->gpuInstanceId = SIM_NVML_NO_INSTANCE;
			p->computeInstanceId = SIM_NVML_NO_INSTANCE;
		}
	}
	*count = n;
	return NVML_SUCCESS;
}

/* The unversioned name is the oldest ABI: nvmlProcessInfo_v1_t entries. */
SIM_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device,
							     unsigned int *infoCount,
							     struct sim_nvml_proc_v1 *infos)
{
	return nvml_processes(device, infoCount, infos, true);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device,
								unsigned int *infoCount,
								struct sim_nvml_proc_v2 *infos)
{
	return nvml_processes(device, infoCount, infos, false);
}

/* _v3 takes the same entries: its nvmlProcessInfo_t repeats nvmlProcessInfo_v2_t. */
SIM_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device,
								unsigned int *infoCount,
								struct sim_nvml_proc_v2 *infos)
{
	return nvml_processes(device, infoCount, infos, false);
}

/* Utilisation. */

/*
 * The device's: the share of the last second its processes' kernels kept
 * it busy, their figures summed, at most 100. The simulation moves no
 * memory on a timeline: memory utilisation is 0.
 */
SIM_EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device,
						      struct sim_nvml_utilization *utilization)
{
	struct sim_usage_proc procs[SIM_USAGE_SLOTS];
	const struct sim_spec *spec;
	unsigned long long total;
	unsigned int i, n, sum = 0;
	nvmlReturn_t rc = nvml_device_out(device, utilization != NULL, &spec);

	if (rc != NVML_SUCCESS)
		return rc;
	n = sim_usage_list(device->index, procs, SIM_USAGE_SLOTS, &total);
	for (i = 0; i < n && i < SIM_USAGE_SLOTS; i++)
		sum += procs[i].util;
	utilization->gpu = sum < 100 ? sum : 100;
	utilization->memory = 0;
	return NVML_SUCCESS;
}

/*
 * One sample per process using the device, taken now: its share of the last
 * second (smUtil). None newer than lastSeenTimeStamp (microseconds, like
 * timeStamp) is NVML_ERROR_NOT_FOUND; too little room (*count, which may be
 * 0 with no buffer) gets the number needed and NVML_ERROR_INSUFFICIENT_SIZE.
 */
SIM_EXPORT nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device,
							struct sim_nvml_proc_util *utilization,
							unsigned int *processSamplesCount,
							unsigned long long lastSeenTimeStamp)
{
	struct sim_usage_proc procs[SIM_USAGE_SLOTS];
	const struct sim_spec *spec;
	unsigned long long total, stamp;
	struct timespec ts;
	unsigned int i, n;
	nvmlReturn_t rc = nvml_device_out(device, processSamplesCount != NULL, &spec);

	if (rc != NVML_SUCCESS)
		return rc;
	clock_gettime(CLOCK_REALTIME, &ts);
	stamp = (unsigned long long)ts.tv_sec * 1000000ull + (unsigned long long)ts.tv_nsec / 1000;
	n = sim_usage_list(device->index, procs, SIM_USAGE_SLOTS, &total);
	if (n > SIM_USAGE_SLOTS)
		n = SIM_USAGE_SLOTS;
	if (n == 0 || stamp <= lastSeenTimeStamp)
		return NVML_ERROR_NOT_FOUND;
	if (!utilization || *processSamplesCount < n) {
		*processSamplesCount = n;
		return NVML_ERROR_INSUFFICIENT_SIZE;
	}
	for (i = 0; i < n; i++) {
		utilization[i].pid = procs[i].pid;
		utilization[i].timeStamp = stamp;
		utilization[i].smUtil = procs[i].util;
		utilization[i].memUtil = 0;
		utilization[i].encUtil = 0;
		utilization[i].decUtil = 0;
	}
	*processSamplesCount = n;
	return NVML_SUCCESS;
}

/*
 * gpushare's own: the device time (ns) that the operations of process pid
 * occupied on the device's timeline (GPUSHARE_SIM_TIMELINE) and that has
 * elapsed by now; NVML_ERROR_NOT_FOUND if pid holds no context there.
 */
SIM_EXPORT nvmlReturn_t gpushareSimProcessBusyNs(nvmlDevice_t device, unsigned int pid,
						 unsigned long long *ns)
{
	const struct sim_spec *spec;
	nvmlReturn_t rc = nvml_device_out(device, ns != NULL, &spec);

	if (rc != NVML_SUCCESS)
		return rc;
	return sim_usage_process_busy(device->index, pid, ns) ? NVML_SUCCESS : NVML_ERROR_NOT_FOUND;
}

/* The same for all the device's work, of every process that used it. */
SIM_EXPORT nvmlReturn_t gpushareSimDeviceBusyNs(nvmlDevice_t device, unsigned long long *ns)
{
	const struct sim_spec *spec;
	nvmlReturn_t rc = nvml_device_out(device, ns != NULL, &spec);

	if (rc == NVML_SUCCESS)
		*ns = sim_usage_device_busy(device->index);
	return rc;
}

/* PCI. */

static unsigned int nvml_attr(const struct sim_spec *spec, int attrib)
{
	int v = 0;

	sim_device_attribute(spec, attrib, &v);
	return (unsigned int)v;
}

/* The device's address is the simulated driver's: bus = position + 1 (sim_attrs.c). */
static void nvml_pci(const struct sim_spec *spec, struct sim_nvml_pci *pci)
{
	memset(pci, 0, sizeof(*pci));
	pci->domain = nvml_attr(spec, SIM_ATTR_PCI_DOMAIN_ID);
	pci->bus = nvml_attr(spec, SIM_ATTR_PCI_BUS_ID);
	pci->device = nvml_attr(spec, SIM_ATTR_PCI_DEVICE_ID);
	pci->pciDeviceId = nvml_attr(spec, SIM_ATTR_GPU_PCI_DEVICE_ID);
	pci->pciSubSystemId = nvml_attr(spec, SIM_ATTR_GPU_PCI_SUBSYSTEM_ID);
	snprintf(pci->busIdLegacy, sizeof(pci->busIdLegacy), "%04X:%02X:%02X.0",
		 pci->domain & 0xffff, pci->bus, pci->device);
	snprintf(pci->busId, sizeof(pci->busId), "%08X:%02X:%02X.0", pci->domain, pci->bus,
		 pci->device);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, struct sim_nvml_pci *pci)
{
	const struct sim_spec *spec;
	nvmlReturn_t rc = nvml_device_out(device, pci != NULL, &spec);

	if (rc == NVML_SUCCESS)
		nvml_pci(spec, pci);
	return rc;
}

/* v1 and _v2 fill the legacy layout, with the short bus id, and answer alike here. */
SIM_EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device,
						struct sim_nvml_pci_legacy *pci)
{
	struct sim_nvml_pci full;
	const struct sim_spec *spec;
	nvmlReturn_t rc = nvml_device_out(device, pci != NULL, &spec);

	if (rc != NVML_SUCCESS)
		return rc;
	nvml_pci(spec, &full);
	memset(pci, 0, sizeof(*pci));
	memcpy(pci->busId, full.busIdLegacy, sizeof(pci->busId));
	pci->domain = full.domain;
	pci->bus = full.bus;
	pci->device = full.device;
	pci->pciDeviceId = full.pciDeviceId;
	pci->pciSubSystemId = full.pciSubSystemId;
	return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t device, struct sim_nvml_pci_legacy *pci)
{
	return nvmlDeviceGetPciInfo_v2(device, pci);
}

/* A hex field of 1 to maxdigits digits at *p, which moves past it. */
static bool nvml_hex(const char **p, unsigned int maxdigits, unsigned int *out)
{
	unsigned int v = 0, n = 0;
	int d;

	while ((d = sim_hexval(**p)) >= 0 && n < maxdigits) {
		v = v << 4 | (unsigned int)d;
		(*p)++;
		n++;
	}
	*out = v;
	return n > 0 && sim_hexval(**p) < 0;
}

/*
 * The forms NVML documents, all hexadecimal and of either case:
 * domain:bus:device.function, domain:bus:device and bus:device.function.
 */
static bool nvml_parse_bus_id(const char *s, unsigned int *domain, unsigned int *bus,
			      unsigned int *device, unsigned int *function)
{
	unsigned int a, b, c = 0;
	bool with_domain;

	*function = 0;
	if (!nvml_hex(&s, 8, &a) || *s++ != ':' || !nvml_hex(&s, 8, &b))
		return false;
	with_domain = *s == ':';
	if (with_domain && (s++, !nvml_hex(&s, 8, &c)))
		return false;
	if (*s == '.') {
		s++;
		if (!nvml_hex(&s, 1, function))
			return false;
	} else if (!with_domain) {
		return false;
	}
	*domain = with_domain ? a : 0;
	*bus = with_domain ? b : a;
	*device = with_domain ? c : b;
	return *s == '\0' && *bus <= 0xff && *device <= 0x1f && *function <= 7;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId, nvmlDevice_t *device)
{
	unsigned int domain, bus, dev, function;
	struct sim_nvml_pci pci;
	int i;

	if (!nvml_live())
		return NVML_ERROR_UNINITIALIZED;
	if (!pciBusId || !device || !nvml_parse_bus_id(pciBusId, &domain, &bus, &dev, &function))
		return NVML_ERROR_INVALID_ARGUMENT;
	for (i = 0; i < nvml_ndevs; i++) {
		nvml_pci(&nvml_specs[i], &pci);
		if (pci.domain == domain && pci.bus == bus && pci.device == dev && function == 0) {
			*device = &nvml_devs[i];
			return NVML_SUCCESS;
		}
	}
	return NVML_ERROR_NOT_FOUND;
}

/* v1 differed in an error code for devices the caller may not use; none here. */
SIM_EXPORT nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *pciBusId, nvmlDevice_t *device)
{
	return nvmlDeviceGetHandleByPciBusId_v2(pciBusId, device);
}

/* NVLink and fabric: a GPU with neither. */

/* A real link index of a device without NVLink: the feature is missing, not the link. */
static nvmlReturn_t nvml_nvlink(nvmlDevice_t device, unsigned int link, const void *out)
{
	const struct sim_spec *spec;
	nvmlReturn_t rc = nvml_device_out(device, link < SIM_NVML_NVLINK_MAX_LINKS && out, &spec);

	return rc != NVML_SUCCESS ? rc : NVML_ERROR_NOT_SUPPORTED;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link,
						 int *isActive)
{
	return nvml_nvlink(device, link, isActive);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemoteDeviceType(nvmlDevice_t device, unsigned int link,
							    int *pNvLinkDeviceType)
{
	return nvml_nvlink(device, link, pNvLinkDeviceType);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t device, unsigned int link,
							    struct sim_nvml_pci *pci)
{
	return nvml_nvlink(device, link, pci);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo(nvmlDevice_t device, unsigned int link,
							 struct sim_nvml_pci_legacy *pci)
{
	return nvml_nvlink(device, link, pci);
}

/*
 * Hopper answers the fabric query: a GPU outside any NVSwitch fabric says
 * so in state, with the call itself succeeding (PyTorch checks both).
 */
SIM_EXPORT nvmlReturn_t nvmlDeviceGetGpuFabricInfoV(nvmlDevice_t device, void *gpuFabricInfo)
{
	const struct sim_spec *spec;
	unsigned int version;
	nvmlReturn_t rc = nvml_device_out(device, gpuFabricInfo != NULL, &spec);

	if (rc != NVML_SUCCESS)
		return rc;
	/* Zeroes read "none" or "not supported" in every field after state. */
	memcpy(&version, gpuFabricInfo, sizeof(version));
	if (version == SIM_NVML_FABRIC_V2) {
		struct sim_nvml_fabric_v2 *info = gpuFabricInfo;

		memset(info, 0, sizeof(*info));
		info->version = version;
		info->status = NVML_ERROR_NOT_SUPPORTED;
		info->state = SIM_NVML_FABRIC_STATE_NOT_SUPPORTED;
	} else if (version == SIM_NVML_FABRIC_V3) {
		struct sim_nvml_fabric_v3 *info = gpuFabricInfo;

		memset(info, 0, sizeof(*info));
		info->version = version;
		info->status = NVML_ERROR_NOT_SUPPORTED;
		info->state = SIM_NVML_FABRIC_STATE_NOT_SUPPORTED;
	} else {
		rc = NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
	}
	return rc;
}
