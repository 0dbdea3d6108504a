/*
 * The simulated driver's virtual memory management: cuMemCreate handles,
 * address reservations and the mappings in them, and shareable handles
 * (a handle's memory exported to, or imported from, another process).
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

pthread_mutex_t sim_va_lock = PTHREAD_MUTEX_INITIALIZER;
struct sim_va *sim_va_list;
pthread_mutex_t sim_import_lock = PTHREAD_MUTEX_INITIALIZER;
struct sim_import *sim_import_list;

/*
 * Virtual memory management. A handle is its allocation's address in the
 * device heap: opaque to callers, nonzero, and found again without a table.
 * Reserved ranges are PROT_NONE address space of their own, apart from the
 * heaps, so a reserved address is never a heap address (cuMemFree refuses
 * it); a mapping only records which handle's bytes back a reserved range.
 */

/* As for pools, only device locations exist in the simulation. */
static bool sim_valid_alloc_prop(const CUmemAllocationProp *prop)
{
	return prop->type == CU_MEM_ALLOCATION_TYPE_PINNED &&
	       prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE &&
	       sim_valid_dev(prop->location.id);
}

CUresult sim_impl_cuMemGetAllocationGranularity(size_t *granularity,
						const CUmemAllocationProp *prop, int option)
{
	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!granularity || !prop || !sim_valid_alloc_prop(prop))
		return CUDA_ERROR_INVALID_VALUE;
	if (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM &&
	    option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
		return CUDA_ERROR_INVALID_VALUE;
	*granularity = SIM_GRANULARITY;
	return CUDA_SUCCESS;
}

/* cuMemCreate memory belongs to no context: no context's teardown frees it. */
CUresult sim_impl_cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
			      const CUmemAllocationProp *prop, unsigned long long flags)
{
	CUdeviceptr addr;
	CUresult rc;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	/* flags is reserved and must be 0. */
	if (!handle || !prop || flags != 0 || !sim_valid_alloc_prop(prop))
		return CUDA_ERROR_INVALID_VALUE;
	if (size == 0 || size % SIM_GRANULARITY != 0)
		return CUDA_ERROR_INVALID_VALUE;
	rc = sim_heap_alloc(&sim_devs[prop->location.id], size, SIM_MEM_HANDLE, 0, &addr);
	if (rc == CUDA_SUCCESS)
		*handle = addr;
	return rc;
}

enum sim_handle_op {
	SIM_HANDLE_RELEASE,
	SIM_HANDLE_RETAIN,
	SIM_HANDLE_MAP,
	SIM_HANDLE_UNMAP
};

/*
 * The memory behind a handle goes back to its device only when every
 * reference (cuMemCreate's and each cuMemRetainAllocationHandle's) is
 * released and every mapping of it unmapped, in whatever order. A handle
 * with no reference left is no longer the caller's to release or map, though
 * its mappings keep the memory. Retain and unmap come only from a mapping,
 * which holds the allocation, so they always find it. MAP checks that
 * [offset, offset + size) lies inside the allocation.
 */

/* As sim_handle_op, for an imported handle; false if handle is not one. */
static bool sim_import_op(CUmemGenericAllocationHandle handle, enum sim_handle_op op, size_t offset,
			  size_t size, CUresult *rc)
{
	struct sim_import **pp, *m;

	pthread_mutex_lock(&sim_import_lock);
	for (pp = &sim_import_list; *pp && (uintptr_t)*pp != handle; pp = &(*pp)->next)
		;
	m = *pp;
	if (!m) {
		pthread_mutex_unlock(&sim_import_lock);
		return false;
	}
	*rc = CUDA_SUCCESS;
	/* The allocation's size is not known here, only where its device ends. */
	if (((op == SIM_HANDLE_RELEASE || op == SIM_HANDLE_MAP) && !m->refs) ||
	    (op == SIM_HANDLE_MAP && (offset > m->limit || size > m->limit - offset)))
		*rc = CUDA_ERROR_INVALID_VALUE;
	else if (op == SIM_HANDLE_RELEASE)
		m->refs--;
	else if (op == SIM_HANDLE_RETAIN)
		m->refs++;
	else if (op == SIM_HANDLE_MAP)
		m->maps++;
	else
		m->maps--;
	if (!m->refs && !m->maps)
		*pp = m->next;
	else
		m = NULL;
	pthread_mutex_unlock(&sim_import_lock);
	if (m) {
		if (m->fd >= 0)
			close(m->fd);
		free(m);
	}
	return true;
}

/* The file and offset whose bytes a handle's memory is, and its device. */
bool sim_handle_backing(CUmemGenericAllocationHandle handle, int *fd, uint64_t *off, int *dev)
{
	struct sim_import *m;
	struct sim_heap *h;
	size_t hoff;
	int i;

	h = sim_heap_of(handle, &hoff);
	if (h) {
		*fd = h->fd;
		*off = hoff;
		for (i = 0; i < sim_ndevs; i++)
			if (h == &sim_devs[i].heap)
				*dev = i;
		return true;
	}
	pthread_mutex_lock(&sim_import_lock);
	for (m = sim_import_list; m && (uintptr_t)m != handle; m = m->next)
		;
	if (m) {
		*fd = m->fd;
		*off = m->off;
		*dev = m->dev;
	}
	pthread_mutex_unlock(&sim_import_lock);
	return m != NULL;
}

static CUresult sim_handle_op(CUmemGenericAllocationHandle handle, enum sim_handle_op op,
			      size_t offset, size_t size)
{
	CUresult rc = CUDA_ERROR_INVALID_VALUE;
	struct sim_extent *e;
	struct sim_heap *h;
	size_t off;

	h = sim_heap_of(handle, &off);
	if (!h)
		return sim_import_op(handle, op, offset, size, &rc) ? rc : CUDA_ERROR_INVALID_VALUE;
	pthread_mutex_lock(&h->lock);
	e = sim_heap_find(h, off, SIM_MEM_HANDLE);
	if (!e || ((op == SIM_HANDLE_RELEASE || op == SIM_HANDLE_MAP) && !e->refs))
		goto out;
	switch (op) {
	case SIM_HANDLE_RELEASE:
		e->refs--;
		break;
	case SIM_HANDLE_RETAIN:
		e->refs++;
		break;
	case SIM_HANDLE_MAP:
		if (offset > e->len || size > e->len - offset)
			goto out;
		e->maps++;
		break;
	case SIM_HANDLE_UNMAP:
		e->maps--;
		break;
	}
	rc = CUDA_SUCCESS;
	if (!e->refs && !e->maps)
		sim_heap_drop(h, e);
out:
	pthread_mutex_unlock(&h->lock);
	return rc;
}

CUresult sim_impl_cuMemRelease(CUmemGenericAllocationHandle handle)
{
	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	return sim_handle_op(handle, SIM_HANDLE_RELEASE, 0, 0);
}

/* Address space of size bytes at a multiple of align: at hint if that is free. */
static uintptr_t sim_va_map(size_t size, size_t align, uintptr_t hint)
{
	const int flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
	uintptr_t p, start, end;
	size_t span;
	void *m;

	if (hint && hint % align == 0) {
		/* Without MAP_FIXED the kernel takes hint only if nothing is there. */
		m = mmap((void *)hint, size, PROT_NONE, flags, -1, 0);
		if (m == (void *)hint)
			return hint;
		if (m != MAP_FAILED)
			munmap(m, size);
	}
	if (size > SIZE_MAX - align)
		return 0;
	span = size + align;
	m = mmap(NULL, span, PROT_NONE, flags, -1, 0);
	if (m == MAP_FAILED)
		return 0;
	p = (uintptr_t)m;
	start = (p + align - 1) & ~(uintptr_t)(align - 1);
	end = start + size;
	if (start > p)
		munmap(m, start - p);
	if (p + span > end)
		munmap((void *)end, p + span - end);
	return start;
}

/*
 * Documented: size and addr multiples of the host page size, alignment a
 * power of two or 0 for the default, addr only a hint, flags unused and 0.
 * A reservation always starts on a granule, so that its start can be
 * mapped; only whole granules of it can be.
 */
CUresult sim_impl_cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment,
				      CUdeviceptr addr, unsigned long long flags)
{
	size_t page = (size_t)sysconf(_SC_PAGESIZE);
	struct sim_va *v;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!ptr || flags != 0 || size == 0 || size % page != 0 || addr % page != 0)
		return CUDA_ERROR_INVALID_VALUE;
	if (alignment & (alignment - 1))
		return CUDA_ERROR_INVALID_VALUE;
	if (alignment < SIM_GRANULARITY)
		alignment = SIM_GRANULARITY;
	v = calloc(1, sizeof(*v));
	if (!v)
		return CUDA_ERROR_OUT_OF_MEMORY;
	v->base = sim_va_map(size, alignment, (uintptr_t)addr);
	if (!v->base) {
		free(v);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	v->size = size;
	SIM_LIST_PUSH(&sim_va_lock, sim_va_list, v);
	*ptr = v->base;
	return CUDA_SUCCESS;
}

/*
 * Documented: ptr and size exactly as reserved. Freeing a range that still
 * has mappings is not described; it is refused here, since their memory
 * could then never be unmapped.
 */
CUresult sim_impl_cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
	struct sim_va **pp, *v = NULL;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	pthread_mutex_lock(&sim_va_lock);
	for (pp = &sim_va_list; *pp && (*pp)->base != ptr; pp = &(*pp)->next)
		;
	if (*pp && (*pp)->size == size && (*pp)->nmaps == 0) {
		v = *pp;
		*pp = v->next;
	}
	pthread_mutex_unlock(&sim_va_lock);
	if (!v)
		return CUDA_ERROR_INVALID_VALUE;
	munmap((void *)v->base, v->size);
	free(v->maps);
	free(v);
	return CUDA_SUCCESS;
}

/* With sim_va_lock held: the reservation holding [ptr, ptr + size), or NULL. */
struct sim_va *sim_va_find(CUdeviceptr ptr, size_t size)
{
	struct sim_va *v;

	for (v = sim_va_list; v; v = v->next)
		if (ptr >= v->base && ptr - v->base < v->size && size <= v->size - (ptr - v->base))
			return v;
	return NULL;
}

/* The first mapping of v at or after off. */
size_t sim_map_search(const struct sim_va *v, size_t off)
{
	size_t lo = 0, hi = v->nmaps;

	while (lo < hi) {
		size_t mid = lo + (hi - lo) / 2;

		if (v->maps[mid].off < off)
			lo = mid + 1;
		else
			hi = mid;
	}
	return lo;
}

/*
 * With sim_va_lock held: the mappings [*first, *last) of one reservation
 * that, each one whole and with no gap, cover exactly [ptr, ptr + size).
 */
static bool sim_va_whole(CUdeviceptr ptr, size_t size, struct sim_va **pv, size_t *first,
			 size_t *last)
{
	struct sim_va *v = size ? sim_va_find(ptr, size) : NULL;
	size_t off, end, at, i;

	if (!v)
		return false;
	off = (size_t)(ptr - v->base);
	end = off + size;
	at = sim_map_search(v, off);
	for (i = at; i < v->nmaps && off < end && v->maps[i].off == off; i++)
		off += v->maps[i].len;
	if (i == at || off != end)
		return false;
	*pv = v;
	*first = at;
	*last = i;
	return true;
}

/*
 * Documented: ptr, size and offset multiples of the granularity, the range
 * inside one reservation and not mapped already, offset + size within the
 * allocation, flags 0. The mapping holds the allocation until it is
 * unmapped, whatever becomes of the handle.
 */
CUresult sim_impl_cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
			   CUmemGenericAllocationHandle handle, unsigned long long flags)
{
	CUresult rc = CUDA_ERROR_INVALID_VALUE;
	struct sim_map *m;
	struct sim_va *v;
	size_t off, at;
	uint64_t hoff;
	int fd, dev;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (flags != 0 || size == 0 || ptr % SIM_GRANULARITY != 0 || size % SIM_GRANULARITY != 0 ||
	    offset % SIM_GRANULARITY != 0)
		return rc;
	pthread_mutex_lock(&sim_va_lock);
	v = sim_va_find(ptr, size);
	if (!v)
		goto out;
	off = (size_t)(ptr - v->base);
	at = sim_map_search(v, off);
	if ((at > 0 && v->maps[at - 1].off + v->maps[at - 1].len > off) ||
	    (at < v->nmaps && v->maps[at].off < off + size))
		goto out;
	if (v->nmaps == v->cap) {
		size_t cap = v->cap ? v->cap * 2 : 8;

		m = realloc(v->maps, cap * sizeof(*m));
		if (!m) {
			rc = CUDA_ERROR_OUT_OF_MEMORY;
			goto out;
		}
		v->maps = m;
		v->cap = cap;
	}
	rc = sim_handle_op(handle, SIM_HANDLE_MAP, offset, size);
	if (rc != CUDA_SUCCESS)
		goto out;
	/* The handle's own bytes, so that both addresses see the same memory. */
	sim_handle_backing(handle, &fd, &hoff, &dev);
	if (fd < 0) {
		/* A forked child's private memory cannot be mapped twice. */
		sim_handle_op(handle, SIM_HANDLE_UNMAP, 0, 0);
		rc = CUDA_ERROR_NOT_SUPPORTED;
		goto out;
	}
	if (mmap((void *)ptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd,
		 (off_t)(hoff + offset)) == MAP_FAILED) {
		sim_handle_op(handle, SIM_HANDLE_UNMAP, 0, 0);
		rc = CUDA_ERROR_OUT_OF_MEMORY;
		goto out;
	}
	m = &v->maps[at];
	memmove(m + 1, m, (v->nmaps - at) * sizeof(*m));
	m->off = off;
	m->len = size;
	m->handle = handle;
	m->hoff = offset;
	v->nmaps++;
out:
	pthread_mutex_unlock(&sim_va_lock);
	return rc;
}

/*
 * Documented: the range must be whole mappings, never part of one; it may
 * span several adjacent ones. Each unmapped may be the last hold on its
 * allocation's memory. Afterwards the range is a plain reservation again.
 */
CUresult sim_impl_cuMemUnmap(CUdeviceptr ptr, size_t size)
{
	size_t first, last, i;
	struct sim_va *v;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	pthread_mutex_lock(&sim_va_lock);
	if (!sim_va_whole(ptr, size, &v, &first, &last)) {
		pthread_mutex_unlock(&sim_va_lock);
		return CUDA_ERROR_INVALID_VALUE;
	}
	/* Back to reserved address space that holds nothing. */
	mmap((void *)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED,
	     -1, 0);
	for (i = first; i < last; i++)
		sim_handle_op(v->maps[i].handle, SIM_HANDLE_UNMAP, 0, 0);
	memmove(&v->maps[first], &v->maps[last], (v->nmaps - last) * sizeof(*v->maps));
	v->nmaps -= last - first;
	pthread_mutex_unlock(&sim_va_lock);
	return CUDA_SUCCESS;
}

/*
 * Nothing dereferences device memory, so access is checked and never
 * enforced. Documented: the range is fully mapped and holds whole
 * allocations' mappings. Only device locations exist in the simulation.
 */
CUresult sim_impl_cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc,
				 size_t count)
{
	size_t i, first, last;
	struct sim_va *v;
	bool whole;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!desc || count == 0)
		return CUDA_ERROR_INVALID_VALUE;
	for (i = 0; i < count; i++) {
		if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE)
			return CUDA_ERROR_INVALID_VALUE;
		if (!sim_valid_dev(desc[i].location.id))
			return CUDA_ERROR_INVALID_DEVICE;
		if (desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_NONE &&
		    desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READ &&
		    desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
			return CUDA_ERROR_INVALID_VALUE;
	}
	pthread_mutex_lock(&sim_va_lock);
	whole = sim_va_whole(ptr, size, &v, &first, &last);
	pthread_mutex_unlock(&sim_va_lock);
	return whole ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/*
 * Documented: addr may be any address inside a mapping; the handle is the
 * very value that was mapped there, and each retain takes a reference that
 * needs its own cuMemRelease.
 */
CUresult sim_impl_cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr)
{
	CUresult rc = CUDA_ERROR_INVALID_VALUE;
	const struct sim_map *m;
	struct sim_va *v;
	size_t off, at;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!handle)
		return rc;
	pthread_mutex_lock(&sim_va_lock);
	v = sim_va_find((uintptr_t)addr, 1);
	if (v) {
		off = (size_t)((uintptr_t)addr - v->base);
		at = sim_map_search(v, off + 1);
		m = at ? &v->maps[at - 1] : NULL;
		if (m && off - m->off < m->len) {
			rc = sim_handle_op(m->handle, SIM_HANDLE_RETAIN, 0, 0);
			if (rc == CUDA_SUCCESS)
				*handle = m->handle;
		}
	}
	pthread_mutex_unlock(&sim_va_lock);
	return rc;
}

/* Whether [p, p + n) lies in adjacent mappings of one reservation. */
bool sim_va_covers(uintptr_t p, size_t n)
{
	struct sim_va *v;
	size_t off, end, at;
	bool covered = false;

	pthread_mutex_lock(&sim_va_lock);
	v = sim_va_find(p, n);
	if (v) {
		off = p - v->base;
		end = off + n;
		at = sim_map_search(v, off + 1);
		if (at && off - v->maps[at - 1].off < v->maps[at - 1].len) {
			for (at--; at < v->nmaps && v->maps[at].off <= off && off < end; at++)
				off = v->maps[at].off + v->maps[at].len;
			covered = off >= end;
		}
	}
	pthread_mutex_unlock(&sim_va_lock);
	return covered;
}

/*
 * Shareable handles of cuMemCreate memory, POSIX file descriptors only: a
 * new open file description of the device memfd, positioned at the
 * allocation. Passed to another process (SCM_RIGHTS, pidfd_getfd) and
 * imported there, it maps the same pages.
 */
#define SIM_HANDLE_TYPE_POSIX_FD 1
#define SIM_HANDLE_TYPES_KNOWN 0xf /* POSIX fd, Win32, Win32 KMT, fabric */

CUresult sim_impl_cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle handle,
					       int type, unsigned long long flags)
{
	struct sim_extent *e;
	struct sim_heap *h;
	char path[64];
	size_t off;
	int fd;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!out || flags != 0 || type <= 0 || (type & ~SIM_HANDLE_TYPES_KNOWN))
		return CUDA_ERROR_INVALID_VALUE;
	if (type != SIM_HANDLE_TYPE_POSIX_FD)
		return CUDA_ERROR_NOT_SUPPORTED;
	h = sim_heap_of(handle, &off);
	if (!h)
		return CUDA_ERROR_INVALID_VALUE;
	pthread_mutex_lock(&h->lock);
	e = sim_heap_find(h, off, SIM_MEM_HANDLE);
	fd = e && e->refs ? h->fd : -2;
	pthread_mutex_unlock(&h->lock);
	if (fd == -2)
		return CUDA_ERROR_INVALID_VALUE;
	if (fd < 0)
		return CUDA_ERROR_NOT_SUPPORTED; /* a forked child's private memory */
	snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
	fd = open(path, O_RDWR | O_CLOEXEC);
	if (fd < 0)
		return CUDA_ERROR_OUT_OF_MEMORY;
	if (lseek(fd, (off_t)off, SEEK_SET) != (off_t)off) {
		close(fd);
		return CUDA_ERROR_INVALID_VALUE;
	}
	*(int *)out = fd;
	return CUDA_SUCCESS;
}

/* The device of the node whose memfd fd is, as a local ordinal; -1 if none. */
static int sim_memfd_device(int fd)
{
	char path[64], target[128];
	const char *name;
	ssize_t n;
	int i, spec_index;

	snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
	n = readlink(path, target, sizeof(target) - 1);
	if (n <= 0)
		return -1;
	target[n] = '\0';
	name = strstr(target, SIM_MEMFD_NAME);
	if (!name || sscanf(name + strlen(SIM_MEMFD_NAME), "%d", &spec_index) != 1)
		return -1;
	for (i = 0; i < sim_ndevs; i++)
		if (sim_devs[i].spec_index == spec_index)
			return i;
	return -1;
}

/* The caller keeps its descriptor: the import holds a duplicate of its own. */
CUresult sim_impl_cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle,
						 void *os_handle, int type)
{
	int fd = (int)(intptr_t)os_handle, dev;
	struct sim_import *m;
	off_t off;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!handle || type <= 0 || (type & ~SIM_HANDLE_TYPES_KNOWN))
		return CUDA_ERROR_INVALID_VALUE;
	if (type != SIM_HANDLE_TYPE_POSIX_FD)
		return CUDA_ERROR_NOT_SUPPORTED;
	dev = sim_memfd_device(fd);
	off = lseek(fd, 0, SEEK_CUR);
	if (dev < 0 || off < 0)
		return CUDA_ERROR_INVALID_VALUE;
	m = calloc(1, sizeof(*m));
	if (!m)
		return CUDA_ERROR_OUT_OF_MEMORY;
	m->fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
	if (m->fd < 0) {
		free(m);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	m->off = (uint64_t)off;
	m->dev = dev;
	m->limit = sim_devs[dev].spec->bytes > m->off ? sim_devs[dev].spec->bytes - m->off : 0;
	m->refs = 1;
	SIM_LIST_PUSH(&sim_import_lock, sim_import_list, m);
	*handle = (CUmemGenericAllocationHandle)(uintptr_t)m;
	return CUDA_SUCCESS;
}

/* What the memory behind a handle is: pinned device memory, shareable as a POSIX fd. */
CUresult sim_impl_cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop,
							 CUmemGenericAllocationHandle handle)
{
	uint64_t off;
	int fd, dev;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!prop || !sim_handle_backing(handle, &fd, &off, &dev))
		return CUDA_ERROR_INVALID_VALUE;
	memset(prop, 0, sizeof(*prop));
	prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
	prop->requestedHandleTypes = SIM_HANDLE_TYPE_POSIX_FD;
	prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	prop->location.id = dev;
	return CUDA_SUCCESS;
}
