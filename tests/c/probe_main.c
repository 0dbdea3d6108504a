/* Prints what RTLD_NEXT / RTLD_DEFAULT / handle lookups resolve to. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <unistd.h>

const char *first_next(void);
const char *first_default(void);
const char *second_next(void);

typedef const char *(*probe_fn)(void);

int main(void)
{
	probe_fn main_next = (probe_fn)dlsym(RTLD_NEXT, "gs_probe");
	void *h = dlopen("libprobe_second.so", RTLD_NOW | RTLD_NOLOAD);
	probe_fn by_handle = h ? (probe_fn)dlsym(h, "gs_probe") : NULL;

	printf("first_next=%s\n", first_next());
	printf("first_default=%s\n", first_default());
	printf("second_next=%s\n", second_next());
	printf("main_next=%s\n", main_next ? main_next() : "none");
	printf("by_handle=%s\n", by_handle ? by_handle() : "none");
	printf("getpid_next=%d\n", dlsym(RTLD_NEXT, "getpid") == (void *)getpid);
	return 0;
}
