/*
 * What the simulated driver's memory files share: sim_heap.c (the device
 * heaps, cuMemAlloc and its kin, arrays, the forked child), sim_pools.c
 * (stream-ordered pools and graph memory), sim_vmm.c (virtual memory
 * management and shareable handles), sim_copy.c (copies and memsets),
 * sim_host.c (page-locked host memory and pointer queries) and sim_ipc.c
 * (IPC memory handles). Private to them; what the rest of the driver reaches
 * is in sim_driver.h.
 */
#ifndef GPUSHARE_SIM_MEMORY_H
#define GPUSHARE_SIM_MEMORY_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "sim_driver.h"

#pragma GCC visibility push(hidden)

/* A device memfd's name: this prefix and the device's place in the node. */
#define SIM_MEMFD_NAME "gpushare-sim-"
#define SIM_GRANULARITY ((size_t)2 << 20) /* cuMemCreate / cuMemMap granule */

/* cuMemMap: the bytes [off, off + len) of a reservation are handle's. */
struct sim_map {
	size_t off;
	size_t len;
	CUmemGenericAllocationHandle handle;
	size_t hoff; /* where in the handle's allocation the mapping starts */
};

/* cuMemAddressReserve: a range of address space and its mappings. */
struct sim_va {
	struct sim_va *next; /* sim_va_list */
	uintptr_t base;
	size_t size;
	struct sim_map *maps; /* sorted by off, never overlapping */
	size_t nmaps, cap;
};

/*
 * Memory of another process, imported from a shareable handle (a file
 * descriptor of its device memfd, positioned at the allocation): its handle
 * is the address of this record, which is never a heap address.
 */
struct sim_import {
	struct sim_import *next;
	int fd;		/* our own description of the exporter's memfd */
	uint64_t off;	/* the allocation's place in it */
	uint64_t limit; /* bytes from there to the end of the device's memory */
	int dev;
	size_t refs, maps;
};

/* Host memory: page-locked allocations and registrations, by range. */
struct sim_host {
	struct sim_host *next;
	uintptr_t base;
	size_t size;
	unsigned int flags;
	bool registered; /* cuMemHostRegister: the caller's memory, not ours */
};

/* Device memory of another process, opened through an IPC handle. */
struct sim_ipc {
	struct sim_ipc *next;
	uintptr_t map; /* the pages mapped */
	size_t maplen;
	uintptr_t ptr; /* what the caller got: the allocation's start */
	size_t size;
	int dev;
	pid_t pid; /* the exporter and its allocation, for reopening */
	int fd;	   /* the exporter's descriptor of its memfd */
	int spec_index;
	uint64_t off;
	unsigned int refs;
};

/* What a pointer is, as cuPointerGetAttribute describes it. */
struct sim_ptr {
	int type;	/* CU_MEMORYTYPE_DEVICE or _HOST */
	int dev;	/* its device; the current one for host memory */
	uintptr_t base; /* the allocation holding it */
	size_t size;
	uint64_t owner; /* the context it belongs to, or 0 */
	CUmemoryPool pool;
	bool ipc; /* a whole cuMemAlloc allocation, fit for cuIpcGetMemHandle */
};

/* Under these locks: the lists of reservations, imports, host memory and IPC mappings. */
extern pthread_mutex_t sim_va_lock;
extern struct sim_va *sim_va_list;
extern pthread_mutex_t sim_import_lock;
extern struct sim_import *sim_import_list;
extern pthread_mutex_t sim_host_lock;
extern struct sim_host *sim_host_list;
extern pthread_mutex_t sim_ipc_lock;
extern struct sim_ipc *sim_ipc_list;

/* sim_heap.c: the allocator, for the other ways memory is taken and given back. */
bool sim_round(size_t bytes, size_t *size);
CUresult sim_heap_take(struct sim_device *d, size_t size, size_t align, enum sim_mem_kind kind,
		       uint64_t owner, size_t *at);
struct sim_extent *sim_heap_find(struct sim_heap *h, size_t off, enum sim_mem_kind kind);
void sim_heap_drop(struct sim_heap *h, struct sim_extent *e);
void sim_pool_release(struct sim_heap *h, struct CUmemPoolHandle_st *pool, uint64_t keep,
		      bool to_threshold);
CUresult sim_pool_alloc(struct sim_device *d, struct CUmemPoolHandle_st *pool, size_t bytes,
			CUdeviceptr *out);
struct sim_heap *sim_heap_of(CUdeviceptr addr, size_t *off);
struct sim_extent *sim_heap_holding(struct sim_heap *h, size_t off);

/* sim_pools.c: graph memory. */
bool sim_graph_free_addr(CUdeviceptr addr);

/* sim_vmm.c: reservations and the handles mapped into them. */
bool sim_handle_backing(CUmemGenericAllocationHandle handle, int *fd, uint64_t *off, int *dev);
struct sim_va *sim_va_find(CUdeviceptr ptr, size_t size);
size_t sim_map_search(const struct sim_va *v, size_t off);
bool sim_va_covers(uintptr_t p, size_t n);

/* sim_copy.c: whether the driver knows all of a range. */
bool sim_range_known(uintptr_t p, size_t n);

/* sim_host.c: what a pointer is. */
bool sim_ptr_find(uintptr_t p, struct sim_ptr *out);

/* sim_ipc.c: in a forked child. */
void sim_ipc_privatise(const struct sim_ipc *m);

#pragma GCC visibility pop

#endif
