/*
 * A simulated CUDA driver, built as libcuda.so.1, for machines without
 * NVIDIA hardware. The shim is loaded in front of it exactly as it would be
 * in front of the real driver, so everything here follows the driver ABI:
 * entry point names, error codes and the cuGetProcAddress rules.
 *
 * Device memory is host memory that reads and writes, so copies and memsets
 * are real: each device's memory is a memfd as large as the device, mapped
 * shared and MAP_NORESERVE, and allocations are addresses inside it. Pages
 * nobody touched cost nothing (a 16 GiB device costs no RAM until written),
 * and freed ones are given back. Being a file, the same bytes can be mapped
 * again elsewhere: at a cuMemMap address, or in another process that opened
 * a cuIpcGetMemHandle handle. Kernels do not run: what they would compute
 * stays as it was.
 *
 * Linked with -Bsymbolic so that the pointers cuGetProcAddress hands out are
 * this library's own functions, never those of a preloaded interposer.
 *
 * The driver is split by area, its files sharing sim_driver.h. This one
 * starts it and keeps the device list and the device queries; sim_ctx.c
 * has contexts; sim_registry.c the host objects behind handles and the
 * hooks through which the areas hear of a context's teardown, a fork and a
 * synchronisation; sim_entry.c has errors, cuGetExportTable and
 * cuGetProcAddress. The device heaps and all that
 * takes from them are sim_heap.c (allocations, arrays), sim_pools.c
 * (stream-ordered pools, graph memory), sim_vmm.c (virtual memory
 * management, shareable handles), sim_host.c (host memory, pointer
 * queries), sim_ipc.c (IPC handles) and sim_copy.c (the copies and memsets
 * that move real bytes), sharing sim_memory.h. sim_streams.c has streams,
 * stream capture and launches; sim_graphs.c graphs that replay their
 * copies; sim_events.c has events; sim_modules.c has modules and kernels (loaded,
 * never run) and occupancy. Beyond allocation, all that is what real
 * libcudart and PyTorch need.
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

#include "sim_driver.h"
#include "sim_usage.h"

enum {
	SIM_UNINIT,
	SIM_READY
};

static struct sim_spec sim_specs[SIM_MAX_GPUS];
static int sim_nspecs;
struct sim_device sim_devs[SIM_MAX_GPUS];
int sim_ndevs;

static pthread_once_t sim_once = PTHREAD_ONCE_INIT;
static CUresult sim_init_result;
static int sim_state; /* SIM_READY is stored with release */

bool sim_initialized(void)
{
	return __atomic_load_n(&sim_state, __ATOMIC_ACQUIRE) == SIM_READY;
}

CUresult sim_live(void)
{
	return sim_initialized() ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED;
}

CUresult sim_check_args(bool args_ok)
{
	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	return args_ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

bool sim_valid_dev(CUdevice dev)
{
	return dev >= 0 && dev < sim_ndevs;
}

/* What most device queries check first: initialized, out-pointer, ordinal. */
CUresult sim_check(const void *out, CUdevice dev)
{
	CUresult rc = sim_check_args(out != NULL);

	if (rc != CUDA_SUCCESS)
		return rc;
	return sim_valid_dev(dev) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}

CUresult sim_check_dev(CUdevice dev)
{
	return sim_check(&dev, dev);
}

/* Device list: GPUSHARE_SIM_GPUS (sim_spec.c), then CUDA_VISIBLE_DEVICES. */

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
				return -1; /* ambiguous prefix */
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
	d->index = sim_ndevs;
	d->heap.arena = d->spec->bytes & ~(size_t)(SIM_ALIGN - 1);
	pthread_mutex_init(&d->heap.lock, NULL);
	d->heap.spec_index = spec_index;
	d->default_pool.obj.kind = SIM_OBJ_POOL;
	d->default_pool.obj.dev = sim_ndevs;
	d->mempool = &d->default_pool;
	d->primary.id = SIM_PRIMARY_ID(sim_ndevs);
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
	sim_nspecs = sim_specs_load(sim_specs);
	if (sim_nspecs < 0) {
		sim_nspecs = 0;
		sim_init_result = CUDA_ERROR_INVALID_VALUE;
		return;
	}
	sim_apply_visible();
	if (sim_ndevs == 0) {
		sim_init_result = CUDA_ERROR_NO_DEVICE;
		return;
	}
	pthread_atfork(NULL, NULL, sim_fork_child);
	__atomic_store_n(&sim_state, SIM_READY, __ATOMIC_RELEASE);
}

/*
 * Nothing is torn down at exit: a framework's own exit-time code (static
 * destructors, worker threads still running) keeps freeing and querying,
 * and a driver that failed those calls would abort the process. The
 * library is linked with -z nodelete, so dlclose never unloads it either;
 * the system takes the memory back with the process.
 */

/*
 * A destroy call's opening: CUDA_ERROR_NOT_INITIALIZED before cuInit, else
 * the object of kind behind handle taken off the list into *out, for the
 * caller to free; missing (the call's own error) if there is none.
 */
CUresult sim_obj_take(const void *handle, enum sim_obj_kind kind, CUresult missing,
		      struct sim_obj **out)
{
	struct sim_obj seen;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	*out = sim_obj_lookup(handle, kind, true, &seen);
	return *out ? CUDA_SUCCESS : missing;
}

/* Initialization and device queries. */

CUresult sim_impl_cuInit(unsigned int flags)
{
	if (flags != 0)
		return CUDA_ERROR_INVALID_VALUE;
	pthread_once(&sim_once, sim_init_once);
	return sim_init_result;
}

CUresult sim_impl_cuDriverGetVersion(int *version)
{
	if (!version)
		return CUDA_ERROR_INVALID_VALUE;
	*version = GS_SIM_DRIVER_VERSION;
	return CUDA_SUCCESS;
}

/* The device queries that answer one value, each into an out of its own type. */
enum sim_dev_query {
	SIM_DEV_COUNT,	   /* int: how many devices there are (dev is 0) */
	SIM_DEV_ORDINAL,   /* CUdevice: dev itself, once checked */
	SIM_DEV_UUID,	   /* CUuuid */
	SIM_DEV_TOTAL_MEM, /* size_t: bytes */
};

/* sim_check, then the value asked for into *out. */
static CUresult sim_device_query(void *out, CUdevice dev, enum sim_dev_query what)
{
	CUresult rc = sim_check(out, dev);

	if (rc != CUDA_SUCCESS)
		return rc;
	switch (what) {
	case SIM_DEV_COUNT:
		*(int *)out = sim_ndevs;
		break;
	case SIM_DEV_ORDINAL:
		*(CUdevice *)out = dev;
		break;
	case SIM_DEV_UUID:
		memcpy(out, sim_devs[dev].spec->uuid_bytes, sizeof(CUuuid));
		break;
	case SIM_DEV_TOTAL_MEM:
		*(size_t *)out = sim_devs[dev].spec->bytes;
		break;
	}
	return CUDA_SUCCESS;
}

/* sim_check, then a text buffer of len bytes: len must leave room for something. */
static CUresult sim_check_text(char *text, int len, CUdevice dev)
{
	CUresult rc = sim_check(text, dev);

	if (rc == CUDA_SUCCESS && len <= 0)
		rc = CUDA_ERROR_INVALID_VALUE;
	return rc;
}

CUresult sim_impl_cuDeviceGetCount(int *count)
{
	return sim_device_query(count, 0, SIM_DEV_COUNT);
}

CUresult sim_impl_cuDeviceGet(CUdevice *dev, int ordinal)
{
	return sim_device_query(dev, ordinal, SIM_DEV_ORDINAL);
}

CUresult sim_impl_cuDeviceGetName(char *name, int len, CUdevice dev)
{
	CUresult rc = sim_check_text(name, len, dev);

	if (rc == CUDA_SUCCESS)
		snprintf(name, (size_t)len, "%s", sim_devs[dev].spec->name);
	return rc;
}

CUresult sim_impl_cuDeviceGetUuid(CUuuid *uuid, CUdevice dev)
{
	return sim_device_query(uuid, dev, SIM_DEV_UUID);
}

/* _v2 differs from v1 only for MIG instances, and the simulation has none. */
CUresult sim_impl_cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev)
{
	return sim_impl_cuDeviceGetUuid(uuid, dev);
}

CUresult sim_impl_cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
	return sim_device_query(bytes, dev, SIM_DEV_TOTAL_MEM);
}

/* An H100-like set by default, each overridable per device (sim_attrs.c). */
CUresult sim_impl_cuDeviceGetAttribute(int *pi, int attrib, CUdevice dev)
{
	CUresult rc = sim_check(pi, dev);

	if (rc != CUDA_SUCCESS)
		return rc;
	return sim_device_attribute(sim_devs[dev].spec, attrib, pi) == 0 ? CUDA_SUCCESS
									 : CUDA_ERROR_INVALID_VALUE;
}

CUresult sim_impl_cuDeviceGetPCIBusId(char *bus_id, int len, CUdevice dev)
{
	CUresult rc = sim_check_text(bus_id, len, dev);

	if (rc == CUDA_SUCCESS)
		snprintf(bus_id, (size_t)len, "0000:%02x:00.0",
			 (unsigned int)sim_devs[dev].spec_index + 1);
	return rc;
}

/*
 * The CUDA 2.0-era ABI variants, with 32-bit sizes and device pointers.
 * cuda.h has mapped these names to their _v2 successors since CUDA 3.2, so
 * only a binary built against an older header, or a cuGetProcAddress caller
 * asking for a version before 3020, reaches them. 32-bit sizes cannot
 * describe the simulated devices, so the simulation refuses every one with
 * CUDA_ERROR_NOT_SUPPORTED; they exist so that, as in the real driver, each
 * ABI variant is its own exported function and never an alias of its _v2.
 */
CUresult sim_impl_cuDeviceTotalMem(unsigned int *bytes, CUdevice dev)
{
	(void)bytes, (void)dev;
	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult sim_impl_cuMemGetInfo(unsigned int *free_bytes, unsigned int *total_bytes)
{
	(void)free_bytes, (void)total_bytes;
	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult sim_impl_cuMemAlloc(sim_devptr_v1 *dptr, unsigned int bytesize)
{
	(void)dptr, (void)bytesize;
	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult sim_impl_cuMemAllocPitch(sim_devptr_v1 *dptr, unsigned int *pitch, unsigned int width,
				  unsigned int height, unsigned int elem)
{
	(void)dptr, (void)pitch, (void)width, (void)height, (void)elem;
	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult sim_impl_cuMemFree(sim_devptr_v1 dptr)
{
	(void)dptr;
	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	return CUDA_ERROR_NOT_SUPPORTED;
}

/* The v1 descriptors differ only in 32-bit extents; never read here. */
CUresult sim_impl_cuArrayCreate(CUarray *array, const void *desc)
{
	(void)array, (void)desc;
	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult sim_impl_cuArray3DCreate(CUarray *array, const void *desc)
{
	(void)array, (void)desc;
	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult sim_impl_cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
	(void)pctx, (void)flags, (void)dev;
	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	return CUDA_ERROR_NOT_SUPPORTED;
}
/* Every simulated device reaches every other: one address space, no links to model. */
CUresult sim_impl_cuDeviceCanAccessPeer(int *can, CUdevice dev, CUdevice peer)
{
	CUresult rc = sim_check(can, dev);

	if (rc == CUDA_SUCCESS && !sim_valid_dev(peer))
		rc = CUDA_ERROR_INVALID_DEVICE;
	if (rc == CUDA_SUCCESS)
		*can = dev != peer;
	return rc;
}

CUresult sim_impl_cuDeviceGetP2PAttribute(int *v, int attr, CUdevice src, CUdevice dst)
{
	CUresult rc = sim_check(v, src);

	if (rc == CUDA_SUCCESS && !sim_valid_dev(dst))
		rc = CUDA_ERROR_INVALID_DEVICE;
	if (rc == CUDA_SUCCESS && src == dst)
		rc = CUDA_ERROR_INVALID_DEVICE;
	if (rc != CUDA_SUCCESS)
		return rc;
	/* 1: performance rank (0); 2: access; 3: native atomics; 4: array access. */
	switch (attr) {
	case 1:
		*v = 0;
		break;
	case 2:
	case 3:
	case 4:
		*v = 1;
		break;
	default:
		return CUDA_ERROR_INVALID_VALUE;
	}
	return CUDA_SUCCESS;
}

/* "[domain:]bus:device.function", the domain optional, in hex. */
CUresult sim_impl_cuDeviceGetByPCIBusId(CUdevice *dev, const char *bus_id)
{
	unsigned int domain = 0, bus, device, fn;
	int i;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!dev || !bus_id)
		return CUDA_ERROR_INVALID_VALUE;
	if (sscanf(bus_id, "%x:%x:%x.%x", &domain, &bus, &device, &fn) != 4) {
		domain = 0;
		if (sscanf(bus_id, "%x:%x.%x", &bus, &device, &fn) != 3)
			return CUDA_ERROR_INVALID_VALUE;
	}
	for (i = 0; i < sim_ndevs; i++) {
		if (domain == 0 && device == 0 && fn == 0 &&
		    bus == (unsigned int)sim_devs[i].spec_index + 1) {
			*dev = i;
			return CUDA_SUCCESS;
		}
	}
	return CUDA_ERROR_INVALID_DEVICE;
}

CUresult sim_impl_cuDeviceComputeCapability(int *major, int *minor, CUdevice dev)
{
	CUresult rc = sim_check(major, dev);

	if (rc == CUDA_SUCCESS && !minor)
		rc = CUDA_ERROR_INVALID_VALUE;
	if (rc == CUDA_SUCCESS)
		rc = sim_impl_cuDeviceGetAttribute(major,
						   CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
						   dev);
	if (rc == CUDA_SUCCESS)
		rc = sim_impl_cuDeviceGetAttribute(minor,
						   CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
						   dev);
	return rc;
}

CUresult sim_impl_cuDeviceGetTexture1DLinearMaxWidth(size_t *width, int format,
						     unsigned int channels, CUdevice dev)
{
	CUresult rc = sim_check(width, dev);

	(void)format, (void)channels;
	if (rc == CUDA_SUCCESS)
		*width = (size_t)1 << 27;
	return rc;
}

CUresult sim_impl_cuDeviceGetExecAffinitySupport(int *supported, int type, CUdevice dev)
{
	CUresult rc = sim_check(supported, dev);

	(void)type;
	if (rc == CUDA_SUCCESS)
		*supported = 0;
	return rc;
}

CUresult sim_impl_cuFlushGPUDirectRDMAWrites(int target, int scope)
{
	(void)target, (void)scope;
	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	return CUDA_SUCCESS;
}
