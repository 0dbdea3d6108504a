/*
 * Asks whatever libcuda.so.1 the loader finds, the way libcudart does (dlopen,
 * then dlsym on its handle), and prints each answer on one line, so that runs
 * with and without the shim can be compared line by line. Commands on stdin:
 *
 *   init                  cuInit(0)                  -> "init RC"
 *   mode                  gpushare_mode(), found with dlsym(RTLD_DEFAULT)
 *                                                    -> "mode N" ("mode none" without it)
 *   gpa NAME VER FLAGS    cuGetProcAddress_v2        -> "gpa NAME VER FLAGS RC STATUS FN"
 *   gpa1 NAME VER FLAGS   cuGetProcAddress (v1)      -> "gpa1 NAME VER FLAGS RC FN"
 *   sym NAME              dlsym(RTLD_DEFAULT, NAME)  -> "sym NAME FN ERR"
 *   hsym NAME             dlsym on libcuda's handle  -> "hsym NAME FN"
 *
 * NAME "-" is the empty name. FN is "-" for NULL, "untouched" when the call left
 * the pointer as it was, else "LIB:SYMBOL": the file name of the library that
 * holds the function and the dynamic symbol at exactly its address (dladdr),
 * "?" where none is. ERR is "err" when dlerror() reported a failure, else "ok".
 *
 * Usage: driver_probe [local|global|none]: libcuda.so.1 is opened RTLD_LOCAL
 * (the default, as libcudart does), RTLD_GLOBAL (as a program linked with
 * -lcuda has it) or not at all (then only mode, sym and hsym work).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

typedef int (*init_fn)(unsigned int);
typedef int (*gpa2_fn)(const char *, void **, int, unsigned long long, int *);
typedef int (*gpa1_fn)(const char *, void **, int, unsigned long long);
typedef int (*mode_fn)(void);

static char where[512];

static const char *describe(void *fn)
{
	Dl_info info;
	const char *file;

	if (fn == NULL)
		return "-";
	if (!dladdr(fn, &info) || info.dli_fname == NULL)
		return "?";
	file = strrchr(info.dli_fname, '/');
	file = file ? file + 1 : info.dli_fname;
	snprintf(where, sizeof(where), "%s:%s", file,
		 info.dli_sname && info.dli_saddr == fn ? info.dli_sname : "?");
	return where;
}

int main(int argc, char **argv)
{
	static char sentinel;
	const char *how = argc > 1 ? argv[1] : "local";
	void *h = NULL;
	char line[512], name[256];
	int version;
	unsigned long long flags;
	gpa2_fn gpa2 = NULL;
	gpa1_fn gpa1 = NULL;
	init_fn init = NULL;

	if (strcmp(how, "none") != 0) {
		h = dlopen("libcuda.so.1",
			   RTLD_NOW | (strcmp(how, "global") == 0 ? RTLD_GLOBAL : RTLD_LOCAL));
		if (h == NULL) {
			fprintf(stderr, "driver_probe: %s\n", dlerror());
			return 2;
		}
		gpa2 = (gpa2_fn)dlsym(h, "cuGetProcAddress_v2");
		gpa1 = (gpa1_fn)dlsym(h, "cuGetProcAddress");
		init = (init_fn)dlsym(h, "cuInit");
	}
	while (fgets(line, sizeof(line), stdin)) {
		const char *arg = name;

		if (strncmp(line, "sym ", 4) && strncmp(line, "hsym ", 5) &&
		    strcmp(line, "mode\n") && (gpa2 == NULL || gpa1 == NULL || init == NULL)) {
			fprintf(stderr,
				"driver_probe: the driver lacks cuInit or cuGetProcAddress\n");
			return 2;
		}
		if (strcmp(line, "init\n") == 0) {
			printf("init %d\n", init(0));
		} else if (strcmp(line, "mode\n") == 0) {
			mode_fn mode = (mode_fn)dlsym(RTLD_DEFAULT, "gpushare_mode");

			if (mode)
				printf("mode %d\n", mode());
			else
				printf("mode none\n");
		} else if (sscanf(line, "gpa1 %255s %d %llu", name, &version, &flags) == 3) {
			void *fn = &sentinel;
			int rc = gpa1(strcmp(name, "-") ? arg : "", &fn, version, flags);

			printf("gpa1 %s %d %llu %d %s\n", name, version, flags, rc,
			       fn == &sentinel ? "untouched" : describe(fn));
		} else if (sscanf(line, "gpa %255s %d %llu", name, &version, &flags) == 3) {
			void *fn = &sentinel;
			int status = -1;
			int rc = gpa2(strcmp(name, "-") ? arg : "", &fn, version, flags, &status);

			printf("gpa %s %d %llu %d %d %s\n", name, version, flags, rc, status,
			       fn == &sentinel ? "untouched" : describe(fn));
		} else if (sscanf(line, "sym %255s", name) == 1) {
			void *fn;
			const char *err;

			dlerror();
			fn = dlsym(RTLD_DEFAULT, name);
			err = dlerror();
			printf("sym %s %s %s\n", name, describe(fn), err ? "err" : "ok");
		} else if (sscanf(line, "hsym %255s", name) == 1) {
			printf("hsym %s %s\n", name, h ? describe(dlsym(h, name)) : "-");
		} else {
			fprintf(stderr, "driver_probe: bad line: %s", line);
			return 2;
		}
	}
	return 0;
}
