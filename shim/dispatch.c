/*
 * Dispatch: the tables generated from hooks.def, resolving the real driver
 * and NVML, the dlsym hook (the trampoline in dlsym_x86_64.S calls it),
 * cuGetProcAddress's substitution of wrappers, and the trace of which hooks
 * a process reached. The bottom layer: it names no other file's state
 * (shim.h).
 */
#include "dispatch.h"

struct gs_real_table gs_real;

struct gs_nvml_table gs_nvml;

static const char *const real_names[] = {
#define GS_HOOK(abi, base, ver, ptsz, params) #abi,
#define GS_REAL(abi, params) #abi,
#include "hooks.def"
};

static const char *const nvml_names[] = {
#define GS_HOOK(abi, base, ver, ptsz, params)
#define GS_REAL(abi, params)
#define GS_NVML_HOOK(abi, params) #abi,
#define GS_NVML_REAL(abi, params) #abi,
#include "hooks.def"
};

_Static_assert(sizeof(gs_real) / sizeof(void *) == sizeof(real_names) / sizeof(real_names[0]),
	       "real-pointer table and name list disagree");
_Static_assert(sizeof(gs_nvml) / sizeof(void *) == sizeof(nvml_names) / sizeof(nvml_names[0]),
	       "NVML pointer table and name list disagree");

const struct gs_hook gs_hooks[GS_NENTRIES] = {
#define GS_HOOK(abi, base, ver, ptsz, params) \
	[GS_ID_##abi] = { #abi, #base, ver, ptsz, GS_LIB_CUDA, (void *)abi, (void **)&gs_real.abi },
#define GS_REAL(abi, params)
#define GS_VARIANT(abi, base, ver, ptsz) \
	[GS_ID_##abi] = { #abi, #base, ver, ptsz, GS_LIB_CUDA, NULL, NULL },
#define GS_NVML_HOOK(abi, params) \
	[GS_ID_##abi] = { #abi, NULL, 0, 0, GS_LIB_NVML, (void *)abi, (void **)&gs_nvml.abi },
#include "hooks.def"
};

struct gs_trace_counts gs_trace;
int gs_tracing;
/* GPUSHARE_TRACE: the file the trace is appended to at exit; NULL: none. */
static char *trace_path;
static gs_trace_head_fn trace_head;

/* glibc's dlsym; the trampoline (dlsym_x86_64.S) calls it too. */
GS_HIDDEN void *(*gs_real_dlsym)(void *, const char *);

/* --- resolving the real libraries ------------------------------------------ */

GS_UNINSTRUMENTED void resolve_real_dlsym(void)
{
	void *p;

	if (__atomic_load_n(&gs_real_dlsym, __ATOMIC_ACQUIRE) != NULL)
		return;
	p = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
	if (p == NULL)
		p = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
	__atomic_store_n(&gs_real_dlsym, (void *(*)(void *, const char *))p, __ATOMIC_RELEASE);
}

static void fill_table(void *h, void **slots, const char *const *names, size_t n)
{
	for (size_t i = 0; i < n; i++)
		__atomic_store_n(&slots[i], gs_real_dlsym(h, names[i]), __ATOMIC_RELEASE);
}

static pthread_once_t real_once = PTHREAD_ONCE_INIT;

/*
 * Orders gpushare_attach against the first filling of the real table: the
 * table is filled only by a wrapper's first call, and from then on calls
 * reach the driver, so attaching is too late. Either attach finishes first
 * and every wrapper that reaches the driver sees it, or the mark is set
 * first and attach refuses.
 */
pthread_mutex_t gs_attach_mu = PTHREAD_MUTEX_INITIALIZER;
int gs_driver_reached; /* under gs_attach_mu */

static void resolve_real_driver(void)
{
	void *h;

	resolve_real_dlsym();
	if (gs_real_dlsym == NULL)
		return;
	h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
	if (h == NULL)
		h = dlopen("libcuda.so.1", RTLD_NOW);
	if (h == NULL)
		return;
	pthread_mutex_lock(&gs_attach_mu);
	gs_driver_reached = 1;
	pthread_mutex_unlock(&gs_attach_mu);
	/* The handle stays open: the pointers must outlive any dlclose. */
	fill_table(h, (void **)&gs_real, real_names, sizeof(real_names) / sizeof(real_names[0]));
}

void need_real(void)
{
	pthread_once(&real_once, resolve_real_driver);
}

/*
 * NVML is never loaded by the shim: its wrappers are only reached by a
 * program that loaded it, so the table is filled from the library already
 * there, retried until it is.
 */
static pthread_mutex_t nvml_mu = PTHREAD_MUTEX_INITIALIZER;
static int nvml_resolved;

void need_nvml(void)
{
	void *h;

	if (__atomic_load_n(&nvml_resolved, __ATOMIC_ACQUIRE))
		return;
	resolve_real_dlsym();
	pthread_mutex_lock(&nvml_mu);
	if (!nvml_resolved && gs_real_dlsym != NULL) {
		h = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_NOLOAD);
		if (h != NULL) {
			fill_table(h, (void **)&gs_nvml, nvml_names,
				   sizeof(nvml_names) / sizeof(nvml_names[0]));
			__atomic_store_n(&nvml_resolved, 1, __ATOMIC_RELEASE);
		}
	}
	pthread_mutex_unlock(&nvml_mu);
}

static const struct gs_hook *hook_by_abi(const char *name)
{
	for (int i = 0; i < GS_NENTRIES; i++)
		if (gs_hooks[i].wrapper != NULL && strcmp(gs_hooks[i].abi, name) == 0)
			return &gs_hooks[i];
	return NULL;
}

/*
 * The ABI variant a cuGetProcAddress request resolves to, as the driver
 * resolves it: among the variants of `base` of the requested stream
 * flavour, the newest the caller's version admits; a per-thread request
 * falls back to the legacy flavour when the name has no per-thread variant.
 * NULL when the table knows no variant the version admits.
 */
static const struct gs_hook *variant_for(const char *base, int version, cuuint64_t flags)
{
	int per_thread = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;

	for (;;) {
		const struct gs_hook *best = NULL;

		for (int i = 0; i < GS_NENTRIES; i++) {
			const struct gs_hook *h = &gs_hooks[i];

			if (h->lib != GS_LIB_CUDA || strcmp(h->base, base) != 0)
				continue;
			if (h->per_thread != per_thread || h->version > version)
				continue;
			if (best == NULL || h->version > best->version)
				best = h;
		}
		if (best != NULL || !per_thread)
			return best;
		per_thread = 0;
	}
}

/* The part of the dlsym hook that sees every lookup in the process: uninstrumented. */
GS_UNINSTRUMENTED static int maybe_hooked(void *handle, const char *name)
{
	resolve_real_dlsym();
	if (handle == RTLD_NEXT || name == NULL)
		return 0;
	if (name[0] == 'c' && name[1] == 'u')
		return 1;
	return name[0] == 'n' && name[1] == 'v' && name[2] == 'm' && name[3] == 'l';
}

/* A lookup of a cu* or nvml* name on a library handle. */
static void *gs_dlsym_wrapper(void *handle, const char *name)
{
	const struct gs_hook *h;
	const char *soname;
	void *p, *lib, *own;

	h = hook_by_abi(name);
	if (h == NULL || gs_real_dlsym == NULL)
		return NULL;
	p = gs_real_dlsym(handle, name);
	if (p == NULL)
		return NULL;
	/* Only the program loads these libraries; never load one from here. */
	soname = h->lib == GS_LIB_CUDA ? "libcuda.so.1" : "libnvidia-ml.so.1";
	lib = dlopen(soname, RTLD_NOW | RTLD_NOLOAD);
	if (lib == NULL)
		return NULL;
	/*
	 * libcuda's own definition is looked up here, as the real table would
	 * hold it, rather than by filling the table: a lookup calls nothing, and
	 * must not make a later gpushare_attach too late.
	 */
	if (h->lib == GS_LIB_CUDA) {
		own = gs_real_dlsym(lib, name);
	} else {
		need_nvml();
		own = __atomic_load_n(h->real, __ATOMIC_ACQUIRE);
	}
	dlclose(lib); /* NOLOAD still took a reference */
	/* Wrap only what resolves to the library's own definition. */
	if (p != own)
		return NULL;
	GS_TRACE(h - gs_hooks, via_dlsym);
	return h->wrapper;
}

/* What gs_dlsym_hook returns for "answer NULL": never a function's address. */
#define GS_DLSYM_NONE ((void *)1)

/*
 * A global lookup (RTLD_DEFAULT) of a cu* or nvml* name. glibc would find
 * the shim's export of every hooked name, even one the installed driver
 * lacks (cuCtxCreate_v4 on a 535 driver), and calling that returns
 * CUDA_ERROR_NOT_FOUND: a program probing for an entry point would think it
 * there. Without the shim such a lookup finds nothing, so it answers NULL
 * when the library the name belongs to is loaded but lacks it, or is not
 * loaded and nothing after the shim in the global scope defines the name.
 * dlerror() then holds the message of a lookup past the shim that failed
 * here, naming the shim rather than the caller. Every other lookup
 * reaches glibc untouched.
 */
static void *gs_dlsym_global(const char *name)
{
	const struct gs_hook *h;
	void *lib, *theirs;

	h = hook_by_abi(name);
	if (h == NULL || gs_real_dlsym == NULL)
		return NULL;
	/* Someone before the shim in the global scope (the program) defines it. */
	if (gs_real_dlsym(RTLD_DEFAULT, name) != h->wrapper)
		return NULL;
	/* Only the program loads these libraries; never load one from here. */
	lib = dlopen(h->lib == GS_LIB_CUDA ? "libcuda.so.1" : "libnvidia-ml.so.1",
		     RTLD_NOW | RTLD_NOLOAD);
	if (lib != NULL) {
		theirs = gs_real_dlsym(lib, name);
		dlclose(lib); /* NOLOAD still took a reference */
		if (theirs != NULL)
			return NULL;
	}
	/*
	 * Also the last dl call, so that dlerror() reports its failure (dlclose
	 * cleared the error state).
	 */
	theirs = gs_real_dlsym(RTLD_NEXT, name);
	return lib != NULL || theirs == NULL ? GS_DLSYM_NONE : NULL;
}

/*
 * Called by the dlsym trampoline: a wrapper to hand out, GS_DLSYM_NONE to
 * answer NULL, or NULL to let glibc answer.
 */
GS_HIDDEN GS_UNINSTRUMENTED void *gs_dlsym_hook(void *handle, const char *name)
{
	if (!maybe_hooked(handle, name))
		return NULL;
	return handle == RTLD_DEFAULT ? gs_dlsym_global(name) : gs_dlsym_wrapper(handle, name);
}

/* --- wrappers: lookup ------------------------------------------------------------------- */

/*
 * After the real lookup succeeds, decide whether the caller gets a wrapper
 * instead of the driver's pointer:
 *  - the driver returned the very function one of the base name's hooked
 *    variants forwards to: that variant's wrapper, exact by construction;
 *  - otherwise, up to the CUDA version hooks.def describes, the variant the
 *    table resolves the request to, if the shim wraps it (a driver whose
 *    lookup hands out other addresses than its exports is still caught);
 *  - anything else keeps the driver's pointer: an unwrapped variant, a name
 *    the shim does not hook, or, past the table's version, a variant the
 *    table may not know.
 */
static void gpa_substitute(const char *symbol, void **pfn, int version, cuuint64_t flags)
{
	const struct gs_hook *h;

	if (symbol == NULL || pfn == NULL || *pfn == NULL)
		return;
	for (int i = 0; i < GS_NENTRIES; i++) {
		h = &gs_hooks[i];
		if (h->lib != GS_LIB_CUDA || h->wrapper == NULL || strcmp(h->base, symbol) != 0)
			continue;
		if (*pfn == __atomic_load_n(h->real, __ATOMIC_ACQUIRE)) {
			GS_TRACE(i, via_gpa);
			*pfn = h->wrapper;
			return;
		}
	}
	if (version > GS_TABLE_CUDA_VERSION)
		return;
	h = variant_for(symbol, version, flags);
	if (h == NULL || h->wrapper == NULL || __atomic_load_n(h->real, __ATOMIC_ACQUIRE) == NULL)
		return;
	GS_TRACE(h - gs_hooks, via_gpa);
	*pfn = h->wrapper;
}

GS_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cuda_version,
				    cuuint64_t flags)
{
	gs_fn_cuGetProcAddress fn = TRACED_FN(cuGetProcAddress);
	CUresult rc = fn != NULL ? fn(symbol, pfn, cuda_version, flags) : CUDA_ERROR_NOT_FOUND;

	if (rc == CUDA_SUCCESS)
		gpa_substitute(symbol, pfn, cuda_version, flags);
	return rc;
}

GS_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cuda_version,
				       cuuint64_t flags, CUdriverProcAddressQueryResult *status)
{
	gs_fn_cuGetProcAddress_v2 fn = TRACED_FN(cuGetProcAddress_v2);
	CUresult rc =
		fn != NULL ? fn(symbol, pfn, cuda_version, flags, status) : CUDA_ERROR_NOT_FOUND;

	if (rc == CUDA_SUCCESS)
		gpa_substitute(symbol, pfn, cuda_version, flags);
	return rc;
}

void gs_trace_head(gs_trace_head_fn fn)
{
	trace_head = fn;
}

/* In a fork child: another thread may have held the lock. */
static void dispatch_after_fork_child(void)
{
	pthread_mutex_init(&nvml_mu, NULL);
}

__attribute__((constructor)) static void dispatch_load(void)
{
	const char *tr = getenv("GPUSHARE_TRACE");

	resolve_real_dlsym();
	if (tr != NULL && tr[0] != '\0')
		trace_path = strdup(tr);
	gs_tracing = trace_path != NULL;
	pthread_atfork(NULL, NULL, dispatch_after_fork_child);
}

__attribute__((destructor)) static void dispatch_unload(void)
{
	char buf[8192];
	size_t n = 0;
	int fd;

	if (trace_path == NULL)
		return;
	/*
	 * One write per process, so lines from many processes never interleave:
	 * the process's line (trace_head), then one per hook it reached.
	 */
	if (trace_head != NULL)
		n += (size_t)trace_head(buf, sizeof(buf));
	for (int i = 0; i < GS_NENTRIES && n < sizeof(buf); i++) {
		if (!gs_trace.calls[i] && !gs_trace.via_dlsym[i] && !gs_trace.via_gpa[i])
			continue;
		n += (size_t)snprintf(buf + n, sizeof(buf) - n,
				      "pid=%d hook=%s calls=%lu dlsym=%lu gpa=%lu\n", (int)getpid(),
				      gs_hooks[i].abi, gs_trace.calls[i], gs_trace.via_dlsym[i],
				      gs_trace.via_gpa[i]);
	}
	if (n > sizeof(buf))
		n = sizeof(buf);
	fd = open(trace_path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
	if (fd < 0)
		return;
	if (write(fd, buf, n) < 0) {
		/* Nothing useful to do at exit. */
	}
	close(fd);
}
