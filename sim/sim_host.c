/*
 * The simulated driver's page-locked host memory (allocations and
 * registrations), pointer queries (what an address is, and whose) and
 * managed-memory advice.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <linux/falloc.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "sim_driver.h"
#include "sim_memory.h"
#include "sim_usage.h"

pthread_mutex_t sim_host_lock = PTHREAD_MUTEX_INITIALIZER;
struct sim_host *sim_host_list;

/* With sim_host_lock held: the host record that holds p, or NULL. */
static const struct sim_host *sim_host_holding_locked(uintptr_t p)
{
	const struct sim_host *hm;

	for (hm = sim_host_list; hm; hm = hm->next)
		if (p >= hm->base && p - hm->base < hm->size)
			return hm;
	return NULL;
}

bool sim_ptr_find(uintptr_t p, struct sim_ptr *out)
{
	struct sim_heap *h;
	struct sim_va *v;
	const struct sim_host *hm;
	struct sim_ipc *m;
	size_t off;
	int i;

	memset(out, 0, sizeof(*out));
	h = sim_heap_of(p, &off);
	if (h) {
		struct sim_extent *e;

		pthread_mutex_lock(&h->lock);
		e = sim_heap_holding(h, off);
		if (e) {
			out->type = CU_MEMORYTYPE_DEVICE;
			out->base = h->base + e->off;
			out->size = e->len;
			out->owner = e->owner;
			out->pool = e->pool;
			out->ipc = e->kind == SIM_MEM_PTR && !e->pool;
		}
		pthread_mutex_unlock(&h->lock);
		for (i = 0; i < sim_ndevs; i++)
			if (h == &sim_devs[i].heap)
				out->dev = i;
		return out->type != 0;
	}
	pthread_mutex_lock(&sim_va_lock);
	v = sim_va_find(p, 1);
	if (v) {
		size_t at = sim_map_search(v, p - v->base + 1);
		const struct sim_map *mp = at ? &v->maps[at - 1] : NULL;

		if (mp && p - v->base - mp->off < mp->len) {
			uint64_t hoff;
			int fd;

			out->type = CU_MEMORYTYPE_DEVICE;
			out->base = v->base + mp->off;
			out->size = mp->len;
			sim_handle_backing(mp->handle, &fd, &hoff, &out->dev);
		}
	}
	pthread_mutex_unlock(&sim_va_lock);
	if (out->type)
		return true;
	pthread_mutex_lock(&sim_ipc_lock);
	for (m = sim_ipc_list; m; m = m->next) {
		if (p >= m->ptr && p - m->ptr < m->size) {
			out->type = CU_MEMORYTYPE_DEVICE;
			out->base = m->ptr;
			out->size = m->size;
			out->dev = m->dev;
			break;
		}
	}
	pthread_mutex_unlock(&sim_ipc_lock);
	if (out->type)
		return true;
	pthread_mutex_lock(&sim_host_lock);
	hm = sim_host_holding_locked(p);
	if (hm) {
		out->type = CU_MEMORYTYPE_HOST;
		out->base = hm->base;
		out->size = hm->size;
		out->dev = sim_depth ? sim_current_dev() : 0;
	}
	pthread_mutex_unlock(&sim_host_lock);
	return out->type != 0;
}

/* Host memory. */

static CUresult sim_host_add(uintptr_t base, size_t size, unsigned int flags, bool registered)
{
	struct sim_host *hm = calloc(1, sizeof(*hm));

	if (!hm)
		return CUDA_ERROR_OUT_OF_MEMORY;
	hm->base = base;
	hm->size = size;
	hm->flags = flags;
	hm->registered = registered;
	SIM_LIST_PUSH(&sim_host_lock, sim_host_list, hm);
	return CUDA_SUCCESS;
}

/* The record that starts at base, unlinked; NULL if there is none of that kind. */
static struct sim_host *sim_host_take(uintptr_t base, bool registered)
{
	struct sim_host **pp, *hm;

	pthread_mutex_lock(&sim_host_lock);
	for (pp = &sim_host_list; *pp && ((*pp)->base != base || (*pp)->registered != registered);
	     pp = &(*pp)->next)
		;
	hm = *pp;
	if (hm)
		*pp = hm->next;
	pthread_mutex_unlock(&sim_host_lock);
	return hm;
}

CUresult sim_impl_cuMemHostAlloc(void **pp, size_t size, unsigned int flags)
{
	void *p;
	CUresult rc;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!pp || size == 0 || flags > 0x7)
		return CUDA_ERROR_INVALID_VALUE;
	if (!sim_depth)
		return CUDA_ERROR_INVALID_CONTEXT;
	p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (p == MAP_FAILED)
		return CUDA_ERROR_OUT_OF_MEMORY;
	rc = sim_host_add((uintptr_t)p, size, flags, false);
	if (rc != CUDA_SUCCESS) {
		munmap(p, size);
		return rc;
	}
	*pp = p;
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuMemAllocHost_v2(void **pp, size_t size)
{
	return sim_impl_cuMemHostAlloc(pp, size, 0);
}

/*
 * cuMemFreeHost and cuMemHostUnregister: the record that starts at p, of
 * the call's kind, goes (an allocation's pages with it); missing if none.
 */
static CUresult sim_host_remove(void *p, bool registered, CUresult missing)
{
	struct sim_host *hm;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	hm = sim_host_take((uintptr_t)p, registered);
	if (!hm)
		return missing;
	if (!registered)
		munmap((void *)hm->base, hm->size);
	free(hm);
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuMemFreeHost(void *p)
{
	return sim_host_remove(p, false, CUDA_ERROR_INVALID_VALUE);
}

CUresult sim_impl_cuMemHostRegister_v2(void *p, size_t size, unsigned int flags)
{
	struct sim_ptr info;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!p || size == 0)
		return CUDA_ERROR_INVALID_VALUE;
	if (!sim_depth)
		return CUDA_ERROR_INVALID_CONTEXT;
	/* CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED */
	if (sim_ptr_find((uintptr_t)p, &info))
		return 712;
	return sim_host_add((uintptr_t)p, size, flags, true);
}

CUresult sim_impl_cuMemHostUnregister(void *p)
{
	/* CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED */
	return sim_host_remove(p, true, 713);
}

/* Host and device share one address space: the device sees the same address. */
CUresult sim_impl_cuMemHostGetDevicePointer_v2(CUdeviceptr *pd, void *p, unsigned int flags)
{
	struct sim_ptr info;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!pd || flags != 0 || !sim_ptr_find((uintptr_t)p, &info) ||
	    info.type != CU_MEMORYTYPE_HOST)
		return CUDA_ERROR_INVALID_VALUE;
	*pd = (CUdeviceptr)(uintptr_t)p;
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuMemHostGetFlags(unsigned int *flags, void *p)
{
	const struct sim_host *hm;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!flags)
		return CUDA_ERROR_INVALID_VALUE;
	pthread_mutex_lock(&sim_host_lock);
	hm = sim_host_holding_locked((uintptr_t)p);
	if (hm)
		*flags = hm->flags;
	pthread_mutex_unlock(&sim_host_lock);
	return hm ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* Pointer queries. */

CUresult sim_impl_cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p)
{
	struct sim_ptr info;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!sim_ptr_find(p, &info) || info.type != CU_MEMORYTYPE_DEVICE)
		return CUDA_ERROR_NOT_FOUND;
	if (base)
		*base = info.base;
	if (size)
		*size = info.size;
	return CUDA_SUCCESS;
}

/* The context a device pointer belongs to: its owner, else its device's primary. */
static CUcontext sim_ptr_ctx(const struct sim_ptr *info)
{
	struct CUctx_st *c;

	if (info->owner > SIM_MAX_GPUS) {
		pthread_mutex_lock(&sim_ctx_lock);
		for (c = sim_ctx_list; c && c->id != info->owner; c = c->next)
			;
		pthread_mutex_unlock(&sim_ctx_lock);
		if (c)
			return c;
	}
	return &sim_devs[info->dev].primary;
}

/*
 * One attribute of a known pointer into data, at its documented width. The
 * "booleans" of the C API are ints: cudart hands 4 bytes for IS_MANAGED.
 */
static CUresult sim_ptr_attr(void *data, int attr, uintptr_t p, const struct sim_ptr *info)
{
	switch (attr) {
	case CU_POINTER_ATTRIBUTE_CONTEXT:
		*(CUcontext *)data = sim_ptr_ctx(info);
		break;
	case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
		*(unsigned int *)data = (unsigned int)info->type;
		break;
	case CU_POINTER_ATTRIBUTE_DEVICE_POINTER:
	case CU_POINTER_ATTRIBUTE_HOST_POINTER:
		*(uintptr_t *)data = p;
		break;
	case CU_POINTER_ATTRIBUTE_SYNC_MEMOPS:
	case CU_POINTER_ATTRIBUTE_IS_MANAGED:
	case CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE:
		*(int *)data = 0;
		break;
	case CU_POINTER_ATTRIBUTE_MAPPED:
		*(int *)data = 1;
		break;
	case CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE:
		*(int *)data = info->ipc;
		break;
	case CU_POINTER_ATTRIBUTE_BUFFER_ID:
	case CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID:
		*(unsigned long long *)data = info->base;
		break;
	case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
		*(int *)data = info->dev;
		break;
	case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
	case CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR:
		*(uintptr_t *)data = info->base;
		break;
	case CU_POINTER_ATTRIBUTE_RANGE_SIZE:
	case CU_POINTER_ATTRIBUTE_MAPPING_SIZE:
		*(size_t *)data = info->size;
		break;
	case CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES:
		*(unsigned long long *)data = 0;
		break;
	case CU_POINTER_ATTRIBUTE_ACCESS_FLAGS:
		*(int *)data = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
		break;
	case CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE:
		*(CUmemoryPool *)data = info->pool;
		break;
	default:
		return CUDA_ERROR_INVALID_VALUE;
	}
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuPointerGetAttribute(void *data, int attr, CUdeviceptr p)
{
	struct sim_ptr info;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!data || !sim_ptr_find(p, &info))
		return CUDA_ERROR_INVALID_VALUE;
	return sim_ptr_attr(data, attr, p, &info);
}

/*
 * Unlike the singular query, memory the driver does not know (pageable host
 * memory) is no error here: its type is 0 and the other answers zero.
 */
CUresult sim_impl_cuPointerGetAttributes(unsigned int n, int *attrs, void **data, CUdeviceptr p)
{
	struct sim_ptr info;
	unsigned int i;
	bool known;
	CUresult rc = sim_check_args(attrs && data);

	if (rc != CUDA_SUCCESS)
		return rc;
	known = sim_ptr_find(p, &info);
	for (i = 0; i < n; i++) {
		if (!data[i])
			continue;
		if (!known) {
			switch (attrs[i]) {
			case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
				*(int *)data[i] = -2;
				continue;
			case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
			case CU_POINTER_ATTRIBUTE_ACCESS_FLAGS:
				*(unsigned int *)data[i] = 0;
				continue;
			case CU_POINTER_ATTRIBUTE_SYNC_MEMOPS:
			case CU_POINTER_ATTRIBUTE_IS_MANAGED:
			case CU_POINTER_ATTRIBUTE_MAPPED:
			case CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE:
			case CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE:
				*(int *)data[i] = 0;
				continue;
			default:
				*(uintptr_t *)data[i] = 0;
				continue;
			}
		}
		rc = sim_ptr_attr(data[i], attrs[i], p, &info);
		if (rc != CUDA_SUCCESS)
			return rc;
	}
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuPointerSetAttribute(const void *value, int attr, CUdeviceptr p)
{
	struct sim_ptr info;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!value || attr != CU_POINTER_ATTRIBUTE_SYNC_MEMOPS || !sim_ptr_find(p, &info))
		return CUDA_ERROR_INVALID_VALUE;
	return CUDA_SUCCESS;
}

/* Managed memory never migrates here: advice and prefetches are checked, then done. */
static CUresult sim_managed_range(CUdeviceptr p, size_t n)
{
	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	return sim_range_known(p, n) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult sim_impl_cuMemAdvise(CUdeviceptr p, size_t n, int advice, CUdevice dev)
{
	(void)advice, (void)dev;
	return sim_managed_range(p, n);
}

CUresult sim_impl_cuMemAdvise_v2(CUdeviceptr p, size_t n, int advice, CUmemLocation loc)
{
	(void)advice, (void)loc;
	return sim_managed_range(p, n);
}

CUresult sim_impl_cuMemPrefetchAsync(CUdeviceptr p, size_t n, CUdevice dev, CUstream s)
{
	(void)dev, (void)s;
	return sim_managed_range(p, n);
}

SIM_SAME_AS(cuMemPrefetchAsync_ptsz, cuMemPrefetchAsync);
