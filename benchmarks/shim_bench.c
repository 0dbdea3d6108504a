/*
 * The timed side of benchmarks/shim_bench.py: a driver client that reaches
 * libcuda.so.1 the way libcudart does, run with and without the shim
 * preloaded. shim_bench.py compiles it (cc -O2 -I shim) at run time.
 *
 *   shim_bench launch N REPS   REPS lines "ns_per_call" for N cuLaunchKernel calls each
 *   shim_bench alloc N REPS    the same for N cuMemAlloc_v2(2 MiB) + cuMemFree_v2 pairs
 *   shim_bench init READY GO HOLD
 *                              set up, write one byte to fd READY, wait until fd GO
 *                              is readable, then time cuInit(0); print one line
 *                              "init_ns end_ns" (end: CLOCK_MONOTONIC, absolute),
 *                              write another byte to READY and stay alive (holding
 *                              whatever cuInit took) until fd HOLD reads end-of-file
 *   shim_bench burst N         fork and exec N processes at once, each of which starts
 *                              as a CUDA program does (driver, cuInit, primary context,
 *                              a first 2 MiB allocation and its free) and then stays
 *                              alive; print one line "wall_ns": from the first fork to
 *                              the last process started. All exit once all have started.
 *
 * Each timed loop is preceded by one untimed warm-up round of the same
 * length. Errors go to stderr with exit status 1. Environment:
 *   SHIM_BENCH_PARENT  the benchmark's pid: die with it (and exit at once if
 *                      it is already gone)
 *   SHIM_BENCH_CPU     a CPU to pin this process to
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cuda_abi.h"

typedef CUresult (*gpa_v2_fn)(const char *symbol, void **pfn, int cuda_version, cuuint64_t flags,
			      CUdriverProcAddressQueryResult *status);
typedef CUresult (*init_fn)(unsigned int flags);
typedef CUresult (*device_get_fn)(CUdevice *dev, int ordinal);
typedef CUresult (*retain_fn)(CUcontext *ctx, CUdevice dev);
typedef CUresult (*set_current_fn)(CUcontext ctx);
typedef CUresult (*alloc_fn)(CUdeviceptr *dptr, size_t bytesize);
typedef CUresult (*free_fn)(CUdeviceptr dptr);
typedef CUresult (*launch_fn)(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
			      unsigned int bx, unsigned int by, unsigned int bz, unsigned int shmem,
			      CUstream stream, void **params, void **extra);

static struct {
	gpa_v2_fn gpa;
	init_fn init;
	device_get_fn device_get;
	retain_fn retain;
	set_current_fn set_current;
	alloc_fn alloc;
	free_fn free;
	launch_fn launch;
} cu;

#define ALLOC_BYTES ((size_t)2 << 20)

static void die(const char *what, long rc)
{
	fprintf(stderr, "shim_bench: %s failed (%ld)\n", what, rc);
	exit(1);
}

static void check(const char *what, CUresult rc)
{
	if (rc != CUDA_SUCCESS)
		die(what, rc);
}

static long long now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void fetch(const char *name, int version, void **out)
{
	CUdriverProcAddressQueryResult status = -1;
	CUresult rc = cu.gpa(name, out, version, CU_GET_PROC_ADDRESS_DEFAULT, &status);

	if (rc != CUDA_SUCCESS || status != CU_GET_PROC_ADDRESS_SUCCESS || *out == NULL) {
		fprintf(stderr, "shim_bench: cuGetProcAddress(%s, %d): rc %d status %d\n", name,
			version, rc, status);
		exit(1);
	}
}

/*
 * libcudart's way in: dlopen, dlsym of cuGetProcAddress_v2, then
 * cuGetProcAddress fetched through itself and everything else through that
 * copy, by base name and version.
 */
static void resolve(void)
{
	void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
	gpa_v2_fn first = h != NULL ? (gpa_v2_fn)dlsym(h, "cuGetProcAddress_v2") : NULL;

	if (first == NULL) {
		/* dlerror() names what failed: the library, or the symbol in it. */
		fprintf(stderr, "shim_bench: cuGetProcAddress_v2 of libcuda.so.1: %s\n", dlerror());
		exit(1);
	}
	cu.gpa = first;
	fetch("cuGetProcAddress", 12000, (void **)&cu.gpa);
	fetch("cuInit", 2000, (void **)&cu.init);
	fetch("cuDeviceGet", 2000, (void **)&cu.device_get);
	fetch("cuDevicePrimaryCtxRetain", 7000, (void **)&cu.retain);
	fetch("cuCtxSetCurrent", 4000, (void **)&cu.set_current);
	fetch("cuMemAlloc", 3020, (void **)&cu.alloc);
	fetch("cuMemFree", 3020, (void **)&cu.free);
	fetch("cuLaunchKernel", 4000, (void **)&cu.launch);
}

static void open_context(void)
{
	CUcontext ctx;
	CUdevice dev;

	check("cuInit", cu.init(0));
	check("cuDeviceGet", cu.device_get(&dev, 0));
	check("cuDevicePrimaryCtxRetain", cu.retain(&ctx, dev));
	check("cuCtxSetCurrent", cu.set_current(ctx));
}

static void launches(long n)
{
	/* Made up and never dereferenced, as the simulated driver allows. */
	CUfunction f = (CUfunction)(uintptr_t)0x5eed;

	for (long i = 0; i < n; i++)
		if (__builtin_expect(cu.launch(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL) != 0, 0))
			die("cuLaunchKernel", i);
}

static void alloc_frees(long n)
{
	CUdeviceptr p;
	CUresult rc;

	for (long i = 0; i < n; i++) {
		rc = cu.alloc(&p, ALLOC_BYTES);
		if (__builtin_expect(rc != CUDA_SUCCESS, 0))
			die("cuMemAlloc_v2", rc);
		rc = cu.free(p);
		if (__builtin_expect(rc != CUDA_SUCCESS, 0))
			die("cuMemFree_v2", rc);
	}
}

static int timed(void (*loop)(long), long n, long reps)
{
	loop(n); /* warm-up: slot claimed, tables sized, caches and branch predictors hot */
	for (long r = 0; r < reps; r++) {
		long long t0 = now_ns();

		loop(n);
		printf("%.3f\n", (double)(now_ns() - t0) / (double)n);
	}
	return fflush(stdout) == 0 ? 0 : 1;
}

static int init_once(int ready, int go, int hold)
{
	struct pollfd pfd = { .fd = go, .events = POLLIN };
	char byte = 1;
	long long t0, t1;
	CUresult rc;
	int n;

	if (write(ready, &byte, 1) != 1)
		die("write(ready)", errno);
	do
		n = poll(&pfd, 1, -1);
	while (n < 0 && errno == EINTR);
	if (n != 1)
		die("poll(go)", errno);
	t0 = now_ns();
	rc = cu.init(0);
	t1 = now_ns();
	check("cuInit", rc);
	/* One write, so lines from many processes sharing a file never interleave. */
	dprintf(STDOUT_FILENO, "%lld %lld\n", t1 - t0, t1);
	if (write(ready, &byte, 1) != 1)
		die("write(ready)", errno);
	/* Like the processes of a real burst, keep running while the others start. */
	for (;;) {
		ssize_t r = read(hold, &byte, 1);

		if (r == 0)
			return 0;
		if (r < 0 && errno != EINTR)
			die("read(hold)", errno);
	}
}

/* A process of a burst: start, say so on READY, stay alive until HOLD reads end-of-file. */
static int start_once(int ready, int hold)
{
	char byte = 1;
	ssize_t r;

	open_context();
	alloc_frees(1);
	if (write(ready, &byte, 1) != 1)
		die("write(ready)", errno);
	/* Said: a process that dies before saying so then reads as end-of-file there. */
	close(ready);
	do
		r = read(hold, &byte, 1);
	while (r < 0 && errno == EINTR);
	return r == 0 ? 0 : 1;
}

static int burst(const char *self, long n)
{
	int ready[2], hold[2], failed = 0;
	char fd_ready[16], fd_hold[16], me[16];
	long long t0;
	long got = 0;

	/* Close-on-exec: a process must not hold the other ends, or HOLD never reads EOF. */
	if (pipe2(ready, O_CLOEXEC) != 0 || pipe2(hold, O_CLOEXEC) != 0)
		die("pipe", errno);
	snprintf(fd_ready, sizeof(fd_ready), "%d", ready[1]);
	snprintf(fd_hold, sizeof(fd_hold), "%d", hold[0]);
	/* Its processes' parent is this one: they die with it (see settle()). */
	snprintf(me, sizeof(me), "%d", (int)getpid());
	setenv("SHIM_BENCH_PARENT", me, 1);
	t0 = now_ns();
	for (long i = 0; i < n; i++) {
		pid_t p = fork();

		if (p < 0)
			die("fork", errno);
		if (p == 0) {
			fcntl(ready[1], F_SETFD, 0);
			fcntl(hold[0], F_SETFD, 0);
			execl(self, self, "start", fd_ready, fd_hold, (char *)NULL);
			_exit(127);
		}
	}
	close(ready[1]);
	close(hold[0]);
	while (got < n) {
		char buf[256];
		ssize_t r = read(ready[0], buf, sizeof(buf));

		if (r == 0)
			break; /* all of them gone: some died before starting */
		if (r < 0 && errno != EINTR)
			die("read(ready)", errno);
		got += r > 0 ? r : 0;
	}
	printf("%lld\n", now_ns() - t0);
	close(hold[1]);
	for (long i = 0; i < n; i++) {
		int st;

		if (wait(&st) < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0)
			failed++;
	}
	if (got < n || failed)
		fprintf(stderr, "shim_bench: %ld of %ld started, %d failed\n", got, n, failed);
	return got < n || failed ? 1 : fflush(stdout) != 0;
}

/* Set up by the benchmark's environment: never outlive it; optionally stay on one CPU. */
static void settle(void)
{
	const char *parent = getenv("SHIM_BENCH_PARENT");
	const char *cpu = getenv("SHIM_BENCH_CPU");

	if (parent != NULL) {
		prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
		if (getppid() != (pid_t)strtol(parent, NULL, 10))
			exit(1);
	}
	if (cpu != NULL && cpu[0] != '\0') {
		cpu_set_t set;

		CPU_ZERO(&set);
		CPU_SET((int)strtol(cpu, NULL, 10), &set);
		if (sched_setaffinity(0, sizeof(set), &set) != 0)
			die("sched_setaffinity", errno);
	}
}

int main(int argc, char **argv)
{
	long a, b;

	if (argc == 3 && strcmp(argv[1], "burst") == 0) {
		settle();
		a = strtol(argv[2], NULL, 10);
		return a > 0 ? burst("/proc/self/exe", a) : 2;
	}
	if (argc < 4 || argc != (strcmp(argv[1], "init") == 0 ? 5 : 4)) {
		fprintf(stderr,
			"usage: %s launch|alloc N REPS | init READY_FD GO_FD HOLD_FD | "
			"burst N | start READY_FD HOLD_FD\n",
			argv[0]);
		return 2;
	}
	a = strtol(argv[2], NULL, 10);
	b = strtol(argv[3], NULL, 10);
	settle();
	resolve();
	if (strcmp(argv[1], "start") == 0)
		return start_once((int)a, (int)b);
	if (argc == 5)
		return init_once((int)a, (int)b, (int)strtol(argv[4], NULL, 10));
	if (a <= 0 || b <= 0)
		return 2;
	open_context();
	if (strcmp(argv[1], "launch") == 0)
		return timed(launches, a, b);
	if (strcmp(argv[1], "alloc") == 0)
		return timed(alloc_frees, a, b);
	fprintf(stderr, "shim_bench: unknown mode %s\n", argv[1]);
	return 2;
}
