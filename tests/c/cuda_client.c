/*
 * A driver-API client for gpushare's tests. Reaches the driver either the
 * way libcudart does (dlopen + dlsym(handle, "cuGetProcAddress_v2"), then
 * everything through cuGetProcAddress by base name and version) or, built
 * with -DLINKED, through symbols linked with -lcuda.
 *
 * Arguments are a script of steps; each prints one line:
 *   alloc MIB      "alloc ok" | "alloc err CODE"
 *   free           frees the oldest live allocation: "free ok" | "free err CODE"
 *   fill MIB       allocate MIB chunks until one fails: "fill N"
 *   info           "info free=BYTES total=BYTES"
 *   totalmem       "totalmem BYTES" (cuDeviceTotalMem of device 0)
 *   launch N       N kernel launches: "launch ok" | "launch err CODE"
 *   waitfile PATH  "waiting", then blocks until PATH exists
 *   fork PATH      "forked"; the child lives on until PATH exists
 *   sleep SECONDS
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cuda_abi.h"

typedef CUresult (*gpa_v2_t)(const char *, void **, int, cuuint64_t,
			     CUdriverProcAddressQueryResult *);

static struct {
	CUresult (*init)(unsigned int);
	CUresult (*device_get)(CUdevice *, int);
	CUresult (*retain)(CUcontext *, CUdevice);
	CUresult (*set_current)(CUcontext);
	CUresult (*alloc)(CUdeviceptr *, size_t);
	CUresult (*free)(CUdeviceptr);
	CUresult (*info)(size_t *, size_t *);
	CUresult (*totalmem)(size_t *, CUdevice);
	CUresult (*launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
			   unsigned, unsigned, CUstream, void **, void **);
} cu;

#ifdef LINKED
CUresult cuInit(unsigned int);
CUresult cuDeviceGet(CUdevice *, int);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemGetInfo_v2(size_t *, size_t *);
CUresult cuDeviceTotalMem_v2(size_t *, CUdevice);
CUresult cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
			unsigned, CUstream, void **, void **);

static void bind_driver(void)
{
	cu.init = cuInit;
	cu.device_get = cuDeviceGet;
	cu.retain = cuDevicePrimaryCtxRetain;
	cu.set_current = cuCtxSetCurrent;
	cu.alloc = cuMemAlloc_v2;
	cu.free = cuMemFree_v2;
	cu.info = cuMemGetInfo_v2;
	cu.totalmem = cuDeviceTotalMem_v2;
	cu.launch = cuLaunchKernel;
}
#else
static gpa_v2_t gpa;

static void *fetch(const char *name, int version)
{
	CUdriverProcAddressQueryResult st = -1;
	void *p = NULL;

	if (gpa(name, &p, version, 0, &st) != CUDA_SUCCESS || st != 0 || p == NULL) {
		fprintf(stderr, "cuGetProcAddress(%s, %d) failed\n", name, version);
		exit(3);
	}
	return p;
}

static void bind_driver(void)
{
	void *h = dlopen("libcuda.so.1", RTLD_NOW);
	gpa_v2_t first;

	if (h == NULL) {
		fprintf(stderr, "dlopen libcuda.so.1: %s\n", dlerror());
		exit(3);
	}
	first = (gpa_v2_t)dlsym(h, "cuGetProcAddress_v2");
	if (first == NULL) {
		fprintf(stderr, "no cuGetProcAddress_v2\n");
		exit(3);
	}
	/* As libcudart does: fetch cuGetProcAddress itself and use that copy. */
	gpa = first;
	gpa = (gpa_v2_t)fetch("cuGetProcAddress", 12000);
	cu.init = fetch("cuInit", 2000);
	cu.device_get = fetch("cuDeviceGet", 2000);
	cu.retain = fetch("cuDevicePrimaryCtxRetain", 7000);
	cu.set_current = fetch("cuCtxSetCurrent", 4000);
	cu.alloc = fetch("cuMemAlloc", 3020);
	cu.free = fetch("cuMemFree", 3020);
	cu.info = fetch("cuMemGetInfo", 3020);
	cu.totalmem = fetch("cuDeviceTotalMem", 3020);
	cu.launch = fetch("cuLaunchKernel", 4000);
}
#endif

#define MAX_LIVE 4096

int main(int argc, char **argv)
{
	static CUdeviceptr live[MAX_LIVE];
	int head = 0, tail = 0;
	CUcontext ctx;
	CUdevice dev;
	CUresult rc;

	setvbuf(stdout, NULL, _IOLBF, 0);
	bind_driver();
	if ((rc = cu.init(0)) != CUDA_SUCCESS || (rc = cu.device_get(&dev, 0)) != CUDA_SUCCESS ||
	    (rc = cu.retain(&ctx, dev)) != CUDA_SUCCESS || (rc = cu.set_current(ctx)) != CUDA_SUCCESS) {
		printf("init err %d\n", rc);
		return 4;
	}
	for (int i = 1; i < argc; i++) {
		const char *op = argv[i];
		const char *arg = i + 1 < argc ? argv[i + 1] : "0";

		if (strcmp(op, "alloc") == 0 || strcmp(op, "fill") == 0) {
			size_t bytes = strtoull(arg, NULL, 10) << 20;
			int n = 0;

			i++;
			do {
				CUdeviceptr p = 0;

				rc = tail - head < MAX_LIVE ? cu.alloc(&p, bytes) : CUDA_ERROR_UNKNOWN;
				if (rc == CUDA_SUCCESS) {
					live[tail++ % MAX_LIVE] = p;
					n++;
				}
			} while (op[0] == 'f' && rc == CUDA_SUCCESS);
			if (op[0] == 'f')
				printf("fill %d\n", n);
			else if (rc == CUDA_SUCCESS)
				printf("alloc ok\n");
			else
				printf("alloc err %d\n", rc);
		} else if (strcmp(op, "free") == 0) {
			rc = head < tail ? cu.free(live[head++ % MAX_LIVE]) : CUDA_ERROR_INVALID_VALUE;
			printf(rc == CUDA_SUCCESS ? "free ok\n" : "free err %d\n", rc);
		} else if (strcmp(op, "info") == 0) {
			size_t fr = 0, tot = 0;

			rc = cu.info(&fr, &tot);
			if (rc == CUDA_SUCCESS)
				printf("info free=%zu total=%zu\n", fr, tot);
			else
				printf("info err %d\n", rc);
		} else if (strcmp(op, "totalmem") == 0) {
			size_t tot = 0;

			rc = cu.totalmem(&tot, dev);
			printf("totalmem %zu\n", rc == CUDA_SUCCESS ? tot : 0);
		} else if (strcmp(op, "launch") == 0) {
			long n = strtol(arg, NULL, 10);

			i++;
			rc = CUDA_SUCCESS;
			for (long k = 0; k < n && rc == CUDA_SUCCESS; k++)
				rc = cu.launch((CUfunction)0x1, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
			printf(rc == CUDA_SUCCESS ? "launch ok\n" : "launch err %d\n", rc);
		} else if (strcmp(op, "waitfile") == 0) {
			i++;
			printf("waiting\n");
			while (access(arg, F_OK) != 0)
				usleep(2000);
		} else if (strcmp(op, "fork") == 0) {
			pid_t pid;

			i++;
			pid = fork();
			if (pid == 0) {
				while (access(arg, F_OK) != 0)
					usleep(2000);
				_exit(0);
			}
			printf(pid > 0 ? "forked\n" : "fork failed\n");
		} else if (strcmp(op, "sleep") == 0) {
			i++;
			usleep((useconds_t)(strtod(arg, NULL) * 1e6));
		} else {
			fprintf(stderr, "unknown step %s\n", op);
			return 2;
		}
	}
	return 0;
}
