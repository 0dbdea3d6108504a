/*
 * A process that holds GPU memory the shim does not account for, for the
 * bypass audit's tests (docs/operations.md, "Bypass audit"):
 *
 *   bypass dlmopen MIB GOFILE   loads libcuda.so.1 again in a link-map namespace of
 *                               its own (dlmopen), where no preloaded library
 *                               reaches, and allocates MIB there
 *   bypass hide MIB GOFILE      allocates MIB through the driver the shim hooks
 *                               (charged to its slot), then zeroes its own slot's
 *                               bytes in the ledger $GPUSHARE_LEDGER names
 *
 * Each prints "ready PID" once it holds the memory, then waits until GOFILE
 * exists, holding it.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "ledger_layout.h"

typedef int (*init_fn)(unsigned int);
typedef int (*device_get_fn)(int *, int);
typedef int (*retain_fn)(void **, int);
typedef int (*set_current_fn)(void *);
typedef int (*alloc_fn)(unsigned long long *, size_t);

static void *sym(void *lib, const char *name)
{
	void *p = dlsym(lib, name);

	if (!p) {
		fprintf(stderr, "bypass: no %s: %s\n", name, dlerror());
		exit(2);
	}
	return p;
}

/* Allocate mib MiB on device 0 through the driver lib. */
static void allocate(void *lib, size_t mib)
{
	unsigned long long ptr;
	void *ctx;
	int dev, rc;

	rc = ((init_fn)sym(lib, "cuInit"))(0);
	if (rc == 0)
		rc = ((device_get_fn)sym(lib, "cuDeviceGet"))(&dev, 0);
	if (rc == 0)
		rc = ((retain_fn)sym(lib, "cuDevicePrimaryCtxRetain"))(&ctx, dev);
	if (rc == 0)
		rc = ((set_current_fn)sym(lib, "cuCtxSetCurrent"))(ctx);
	if (rc == 0)
		rc = ((alloc_fn)sym(lib, "cuMemAlloc_v2"))(&ptr, mib << 20);
	if (rc != 0) {
		fprintf(stderr, "bypass: driver call failed: %d\n", rc);
		exit(2);
	}
}

/* Zero the bytes of this process's slot in the ledger at path. */
static void hide(const char *path)
{
	struct gs_ledger *l;
	uint32_t i, g;
	int fd = path ? open(path, O_RDWR | O_CLOEXEC) : -1;

	if (fd < 0) {
		fprintf(stderr, "bypass: cannot open the ledger %s\n", path ? path : "(unset)");
		exit(2);
	}
	l = mmap(NULL, sizeof(*l), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	close(fd);
	if (l == MAP_FAILED) {
		perror("bypass: mmap");
		exit(2);
	}
	for (i = 0; i < GS_MAX_SLOTS; i++) {
		if (l->slot[i].state != GS_SLOT_USED || l->slot[i].pid != (int32_t)getpid())
			continue;
		for (g = 0; g < GS_MAX_GPUS; g++)
			__atomic_store_n(&l->slot[i].used[g], 0, __ATOMIC_RELAXED);
	}
}

int main(int argc, char **argv)
{
	struct timespec tick = { 0, 10 * 1000 * 1000 };
	struct stat st;
	size_t mib;
	void *lib;

	if (argc != 4) {
		fprintf(stderr, "usage: bypass dlmopen|hide MIB GOFILE\n");
		return 2;
	}
	mib = strtoull(argv[2], NULL, 10);
	if (strcmp(argv[1], "dlmopen") == 0) {
		lib = dlmopen(LM_ID_NEWLM, "libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
	} else if (strcmp(argv[1], "hide") == 0) {
		lib = dlopen("libcuda.so.1", RTLD_NOW);
	} else {
		fprintf(stderr, "bypass: unknown mode %s\n", argv[1]);
		return 2;
	}
	if (!lib) {
		fprintf(stderr, "bypass: cannot load libcuda.so.1: %s\n", dlerror());
		return 2;
	}
	allocate(lib, mib);
	if (strcmp(argv[1], "hide") == 0)
		hide(getenv("GPUSHARE_LEDGER"));
	printf("ready %d\n", (int)getpid());
	fflush(stdout);
	while (stat(argv[3], &st) != 0)
		nanosleep(&tick, NULL);
	return 0;
}
