/*
 * The simulated driver's IPC memory handles: another process's device
 * memory opened here, sharing the very bytes, and what a forked child
 * makes of such a mapping.
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

pthread_mutex_t sim_ipc_lock = PTHREAD_MUTEX_INITIALIZER;
struct sim_ipc *sim_ipc_list;

/*
 * IPC: a handle names the exporting process, its device memfd and the
 * allocation's place in it. Another process opens the memfd through
 * /proc/PID/fd and maps the allocation's pages: both processes then share
 * the very bytes, as two processes share device memory on a GPU.
 */
struct sim_ipc_mem {
	uint32_t magic;
	uint32_t pid;
	int32_t fd;
	int32_t spec_index;
	uint64_t off;
	uint64_t size;
};

CUresult sim_impl_cuIpcGetMemHandle(CUipcMemHandle *handle, CUdeviceptr p)
{
	CUresult rc = sim_check_args(handle != NULL);
	struct sim_ipc_mem rec;
	struct sim_ptr info;
	struct sim_heap *h;
	size_t off;

	if (rc != CUDA_SUCCESS)
		return rc;
	h = sim_heap_of(p, &off);
	if (!h || !sim_ptr_find(p, &info) || info.base != p || !info.ipc)
		return CUDA_ERROR_INVALID_VALUE;
	if (h->fd < 0)
		return CUDA_ERROR_NOT_SUPPORTED; /* a forked child's private memory */
	memset(&rec, 0, sizeof(rec));
	rec.magic = SIM_IPC_MAGIC;
	rec.pid = (uint32_t)getpid();
	rec.fd = h->fd;
	rec.spec_index = sim_devs[info.dev].spec_index;
	rec.off = off;
	rec.size = info.size;
	memset(handle, 0, sizeof(*handle));
	memcpy(handle->reserved, &rec, sizeof(rec));
	return CUDA_SUCCESS;
}

static CUresult sim_ipc_open(CUdeviceptr *pdptr, const CUipcMemHandle *handle)
{
	const size_t page = 4096;
	struct sim_ipc_mem rec;
	struct sim_ipc *m;
	char path[64];
	uint64_t start;
	void *map;
	int fd, i, dev = -1;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	memcpy(&rec, handle->reserved, sizeof(rec));
	if (!pdptr || rec.magic != SIM_IPC_MAGIC || rec.size == 0)
		return CUDA_ERROR_INVALID_VALUE;
	/* A process cannot open its own handles. */
	if (rec.pid == (uint32_t)getpid())
		return CUDA_ERROR_INVALID_CONTEXT;
	if (!sim_depth)
		return CUDA_ERROR_INVALID_CONTEXT;
	for (i = 0; i < sim_ndevs; i++)
		if (sim_devs[i].spec_index == rec.spec_index)
			dev = i;
	if (dev < 0)
		return CUDA_ERROR_INVALID_DEVICE;
	pthread_mutex_lock(&sim_ipc_lock);
	for (m = sim_ipc_list; m; m = m->next) {
		/* Each device's memfd starts at 0: the device and the size tell them apart. */
		if (m->pid == (pid_t)rec.pid && m->spec_index == rec.spec_index &&
		    m->off == rec.off && m->size == rec.size) {
			m->refs++;
			*pdptr = m->ptr;
			pthread_mutex_unlock(&sim_ipc_lock);
			return CUDA_SUCCESS;
		}
	}
	pthread_mutex_unlock(&sim_ipc_lock);
	snprintf(path, sizeof(path), "/proc/%u/fd/%d", rec.pid, rec.fd);
	fd = open(path, O_RDWR | O_CLOEXEC);
	if (fd < 0)
		return CUDA_ERROR_INVALID_HANDLE;
	start = rec.off & ~(uint64_t)(page - 1);
	m = calloc(1, sizeof(*m));
	map = m ? mmap(NULL, rec.off - start + rec.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
		       (off_t)start)
		: MAP_FAILED;
	close(fd);
	if (map == MAP_FAILED) {
		free(m);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	m->map = (uintptr_t)map;
	m->maplen = rec.off - start + rec.size;
	m->ptr = m->map + (rec.off - start);
	m->size = rec.size;
	m->dev = dev;
	m->pid = (pid_t)rec.pid;
	m->fd = rec.fd;
	m->spec_index = rec.spec_index;
	m->off = rec.off;
	m->refs = 1;
	SIM_LIST_PUSH(&sim_ipc_lock, sim_ipc_list, m);
	*pdptr = m->ptr;
	return CUDA_SUCCESS;
}

/*
 * The handle is a 64-byte struct passed by value: the ABI puts it on the
 * stack, after the register arguments (sim_exports.c forwards those words
 * unchanged, so the prototype here is the real one).
 */
CUresult sim_impl_cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle,
					unsigned int flags)
{
	(void)flags;
	return sim_ipc_open(pdptr, &handle);
}

CUresult sim_impl_cuIpcOpenMemHandle(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int flags)
{
	(void)flags;
	return sim_ipc_open(pdptr, &handle);
}

CUresult sim_impl_cuIpcCloseMemHandle(CUdeviceptr p)
{
	struct sim_ipc **pp, *m = NULL;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	pthread_mutex_lock(&sim_ipc_lock);
	for (pp = &sim_ipc_list; *pp && (*pp)->ptr != p; pp = &(*pp)->next)
		;
	if (*pp && --(*pp)->refs == 0) {
		m = *pp;
		*pp = m->next;
	} else if (*pp) {
		pp = NULL; /* still open elsewhere in this process */
	}
	pthread_mutex_unlock(&sim_ipc_lock);
	if (!m)
		return pp ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
	munmap((void *)m->map, m->maplen);
	free(m);
	return CUDA_SUCCESS;
}

/*
 * In a forked child: an IPC-opened mapping becomes a private copy-on-write
 * view of the exporter's bytes, opened again through /proc; zeros if the
 * exporter is gone.
 */
void sim_ipc_privatise(const struct sim_ipc *m)
{
	char path[64];
	int fd;

	snprintf(path, sizeof(path), "/proc/%d/fd/%d", (int)m->pid, m->fd);
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd >= 0) {
		mmap((void *)m->map, m->maplen, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED, fd,
		     (off_t)(m->off - (m->ptr - m->map)));
		close(fd);
	} else {
		mmap((void *)m->map, m->maplen, PROT_READ | PROT_WRITE,
		     MAP_PRIVATE | MAP_FIXED | MAP_ANONYMOUS, -1, 0);
	}
}
