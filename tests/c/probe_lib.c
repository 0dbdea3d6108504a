/*
 * Two copies of this library (PROBE_NAME "first" and "second") let a test
 * check that dlsym(RTLD_NEXT, ...) and dlsym(RTLD_DEFAULT, ...) from inside
 * a library find what they would without the shim.
 */
#define _GNU_SOURCE
#include <dlfcn.h>

__attribute__((visibility("default"))) const char *gs_probe(void)
{
	return PROBE_NAME;
}

typedef const char *(*probe_fn)(void);

__attribute__((visibility("default"))) const char *PROBE_NEXT(void)
{
	probe_fn f = (probe_fn)dlsym(RTLD_NEXT, "gs_probe");

	return f ? f() : "none";
}

__attribute__((visibility("default"))) const char *PROBE_DEFAULT(void)
{
	probe_fn f = (probe_fn)dlsym(RTLD_DEFAULT, "gs_probe");

	return f ? f() : "none";
}
