/*
 * A libcuda.so.1 to put in front of the simulated one, for the integrity
 * check's test: it forwards cuGetProcAddress_v2 (the one symbol cudart
 * looks up in libcuda.so.1) to the simulated driver named by SIM_DRIVER, and
 * puts its own function in slot 1 of the INTEGRITY_CHECK table. That
 * function calls the driver's and, with FLIP_BIT=1, flips one bit of the
 * answer. The driver computes the check from what the table holds, so with
 * FLIP_BIT=0 cudart must accept it and with FLIP_BIT=1 refuse it (103).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef int (*gpa_fn)(const char *, void **, int, unsigned long long, int *);
typedef int (*check_fn)(uint32_t, uint64_t, uint64_t *);

static gpa_fn real_gpa;
static check_fn real_check;
static int flip;

static const unsigned char integrity_uuid[16] = {
	0xd4, 0x08, 0x20, 0x55, 0xbd, 0xe6, 0x70, 0x4b,
	0x8d, 0x34, 0xba, 0x12, 0x3c, 0x66, 0xe1, 0xf2,
};

static int flipped_check(uint32_t version, uint64_t seconds, uint64_t *out)
{
	int rc = real_check(version, seconds, out);

	if (rc == 0 && flip)
		out[1] ^= 1u << 7;
	return rc;
}

__attribute__((constructor)) static void setup(void)
{
	const char *path = getenv("SIM_DRIVER");
	int (*init)(unsigned int), (*get_table)(const void **, const void *);
	const void **table;
	uintptr_t page;
	void *h;

	flip = getenv("FLIP_BIT") && strcmp(getenv("FLIP_BIT"), "1") == 0;
	h = path ? dlopen(path, RTLD_NOW | RTLD_LOCAL) : NULL;
	if (!h) {
		fprintf(stderr, "integrity_flip: cannot load SIM_DRIVER\n");
		exit(2);
	}
	real_gpa = (gpa_fn)dlsym(h, "cuGetProcAddress_v2");
	init = (int (*)(unsigned int))dlsym(h, "cuInit");
	get_table = (int (*)(const void **, const void *))dlsym(h, "cuGetExportTable");
	if (!real_gpa || !init || !get_table || init(0) != 0 ||
	    get_table((const void **)&table, integrity_uuid) != 0) {
		fprintf(stderr, "integrity_flip: no INTEGRITY_CHECK table\n");
		exit(2);
	}
	page = (uintptr_t)&table[1] & ~(uintptr_t)(sysconf(_SC_PAGESIZE) - 1);
	if (mprotect((void *)page, (size_t)sysconf(_SC_PAGESIZE), PROT_READ | PROT_WRITE) != 0) {
		perror("integrity_flip: mprotect");
		exit(2);
	}
	real_check = (check_fn)table[1];
	table[1] = (const void *)flipped_check;
}

__attribute__((visibility("default"))) int cuGetProcAddress_v2(const char *symbol, void **pfn,
							       int version,
							       unsigned long long flags,
							       int *status)
{
	return real_gpa(symbol, pfn, version, flags, status);
}
