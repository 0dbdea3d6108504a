/*
 * The process's state: attaching to the ledger (at load or by
 * gpushare_attach), its slot, which ledger GPU a device or context is, the
 * wait of a paused task, and what load and fork do to that state. Below
 * the accounting, above dispatch.c (process.h).
 */
#include "process.h"

struct gs_process gs_state = {
	.mode = GS_INERT,
	.fd = -1,
	.slot = -1,
	.claim_mu = PTHREAD_MUTEX_INITIALIZER,
	.epoch_mu = PTHREAD_MUTEX_INITIALIZER,
};

uint32_t gs_never_paused;
uint64_t gs_unattached_launches;
struct gs_hot_path gs_hot = { &gs_never_paused, &gs_unattached_launches };

/*
 * Launches and allocations that found the pause word set, and the time they
 * waited: counted in the wait itself (off the hot path), whether or not a
 * trace is written, so that a trace tells whether a slow run waited.
 */
static struct {
	unsigned long waits;
	unsigned long wait_ns;
} pause_stats;

/* --- ledger attachment ------------------------------------------------------ */

/* One line on stderr, at load only: never on a hot path. */
__attribute__((format(printf, 1, 2))) static void say(const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	fprintf(stderr, "gpushare: ");
	vfprintf(stderr, fmt, ap);
	fputc('\n', stderr);
	va_end(ap);
}

/*
 * Map the ledger through `fd`, the descriptor the slot lock is later taken
 * on: the mapping keeps that open file description, and so the lock, alive
 * even if the program closes all its descriptors. MADV_DONTFORK keeps fork
 * children from inheriting it, or a child would pin a dead parent's slot.
 */
static struct gs_ledger *map_ledger(int fd)
{
	void *map = mmap(NULL, sizeof(struct gs_ledger), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);

	if (map == MAP_FAILED)
		return NULL;
	if (madvise(map, sizeof(struct gs_ledger), MADV_DONTFORK) != 0 ||
	    gs_ledger_check(map, sizeof(struct gs_ledger)) != 0) {
		munmap(map, sizeof(struct gs_ledger));
		return NULL;
	}
	return map;
}

/* Why a ledger could not be taken into use. */
enum gs_ledger_fault {
	GS_LEDGER_USABLE,
	GS_LEDGER_UNOPENED, /* errno says why */
	GS_LEDGER_SHORT,
	GS_LEDGER_FOREIGN, /* not mappable, or not a ledger of this version */
};

/* Open and map the ledger at `path` into *fd and *map, or say why not. */
static enum gs_ledger_fault open_ledger(const char *path, int *fd, struct gs_ledger **map)
{
	enum gs_ledger_fault fault;
	struct stat st;

	/* Kept for fork children, which map it afresh: a path that cannot be kept is unusable. */
	if (strlen(path) >= sizeof(gs_state.ledger_path)) {
		errno = ENAMETOOLONG;
		return GS_LEDGER_UNOPENED;
	}
	*fd = open(path, O_RDWR | O_CLOEXEC);
	if (*fd < 0)
		return GS_LEDGER_UNOPENED;
	fault = GS_LEDGER_SHORT;
	if (fstat(*fd, &st) != 0 || (size_t)st.st_size < sizeof(struct gs_ledger))
		goto fail;
	fault = GS_LEDGER_FOREIGN;
	*map = map_ledger(*fd);
	if (*map == NULL)
		goto fail;
	return GS_LEDGER_USABLE;
fail:
	close(*fd);
	*fd = -1;
	return fault;
}

/* Publish an opened ledger and enforce it: the mode last, for readers that test it first. */
static void start_enforcing(const char *path, int fd, struct gs_ledger *map)
{
	strcpy(gs_state.ledger_path, path); /* open_ledger checked that it fits */
	for (int i = 0; i < GS_MAX_DEVS; i++)
		gs_state.dev_map[i] = GS_DEV_UNKNOWN;
	gs_state.ledger = map;
	gs_state.fd = fd;
	__atomic_store_n(&gs_state.mode, GS_ENFORCE, __ATOMIC_RELEASE);
}

/*
 * What to do about a ledger that could not be opened for reading and writing,
 * by the open's errno: the shim writes its slot there, so a read-only mount of
 * the environment's directory (a container's) is its own case.
 */
static const char *unopened_hint(int err)
{
	switch (err) {
	case EROFS:
		return "it is on a read-only mount: mount the directory read-write "
		       "(docs/containers.md)";
	case EACCES:
	case EPERM:
		return "this user may not write it: nodemgr's config sets the directory's and "
		       "ledger's owner, group and mode (env_defaults, env.NAME)";
	default:
		return "is nodemgr running, and the environment's directory there?";
	}
}

/* GPUSHARE_LEDGER at load: a ledger named but unusable breaks the process, aloud. */
static void attach_at_load(const char *path)
{
	struct gs_ledger *map = NULL;
	const char *slash = strrchr(path, '/');
	int fd = -1, err;

	switch (open_ledger(path, &fd, &map)) {
	case GS_LEDGER_USABLE:
		start_enforcing(path, fd, map);
		return;
	case GS_LEDGER_UNOPENED:
		err = errno;
		/* The directory is what a container mounts: name it, not only the file. */
		say("cannot open ledger %s for writing: %s; %s (directory %.*s); GPU "
		    "allocations will fail and no GPU memory is shown",
		    path, strerror(err), unopened_hint(err),
		    slash == NULL   ? 1
		    : slash == path ? 1
				    : (int)(slash - path),
		    slash == NULL ? "." : path);
		break;
	case GS_LEDGER_SHORT:
		say("ledger %s is too small; GPU allocations will fail", path);
		break;
	case GS_LEDGER_FOREIGN:
		say("cannot use ledger %s: not a version-%d gpushare ledger, or not mappable; GPU "
		    "allocations will fail (shim and nodemgr must come from the same release)",
		    path, GS_LEDGER_VERSION);
		break;
	}
	gs_state.mode = GS_BROKEN;
}

/*
 * Too late is decided by gs_driver_reached: once any wrapper has reached the
 * driver, allocations and contexts may exist that were never charged, and
 * primary retains that were never counted. Lookups (dlsym on libcuda's
 * handle) only hand out wrappers, which test the mode at each call, so they
 * do not count. Failure changes nothing, so the caller may still decide
 * what an unenforced process should do.
 */
GS_EXPORT int gpushare_attach(const char *ledger_path, const char *task_id)
{
	struct gs_ledger *map = NULL;
	int fd = -1, rc;

	if (ledger_path == NULL || ledger_path[0] == '\0' || task_id == NULL ||
	    task_id[0] == '\0' || strlen(task_id) >= sizeof(gs_state.task_id))
		return GPUSHARE_E_INVAL;
	pthread_mutex_lock(&gs_attach_mu);
	if (gs_state.mode != GS_INERT) {
		rc = GPUSHARE_E_ATTACHED;
		goto fail;
	}
	if (gs_driver_reached) {
		rc = GPUSHARE_E_TOO_LATE;
		goto fail;
	}
	if (open_ledger(ledger_path, &fd, &map) != GS_LEDGER_USABLE) {
		rc = GPUSHARE_E_LEDGER;
		goto fail;
	}
	strcpy(gs_state.task_id, task_id); /* checked to fit above */
	start_enforcing(ledger_path, fd, map);
	pthread_mutex_unlock(&gs_attach_mu);
	return GPUSHARE_OK;
fail:
	pthread_mutex_unlock(&gs_attach_mu);
	return rc;
}

GS_EXPORT int gpushare_mode(void)
{
	return (int)mode_acquire();
}

/* What a file above wants done once the process has claimed its slot (gs_on_claim). */
static gs_claimed_fn claimed;

void gs_on_claim(gs_claimed_fn fn)
{
	claimed = fn;
}

/* The calling process's slot, claimed on first use; -1 if none is free. */
int my_slot(void)
{
	int s = __atomic_load_n(&gs_state.slot, __ATOMIC_ACQUIRE);

	if (likely(s >= 0))
		return s;
	pthread_mutex_lock(&gs_state.claim_mu);
	s = gs_state.slot;
	if (s < 0) {
		s = gs_ledger_claim(gs_state.ledger, gs_state.fd, (int32_t)getpid(),
				    gs_state.task_id);
		if (s >= 0) {
			struct gs_ledger *l = gs_state.ledger;
			uint32_t *pause =
				gs_ledger_pause_word(l, gs_ledger_slot_task(l, (uint32_t)s));

			if (pause != NULL)
				__atomic_store_n(&gs_hot.pause, pause, __ATOMIC_RELEASE);
			__atomic_store_n(&gs_hot.launches, gs_ledger_launch_counter(l, (uint32_t)s),
					 __ATOMIC_RELEASE);
			__atomic_store_n(&gs_state.slot, s, __ATOMIC_RELEASE);
			if (claimed != NULL)
				claimed(s);
		}
	}
	pthread_mutex_unlock(&gs_state.claim_mu);
	return s < 0 ? -1 : s;
}

/*
 * A charge of this process (in `slot`) was refused: free the slots of the
 * environment's processes that have ended, whose charges would otherwise
 * stay until nodemgr's next sweep (gs_ledger_reap_others). One thread at a
 * time: slot locks belong to the open file description, so two threads of
 * this process would both be granted a dead slot's lock and clear it twice.
 * A failure to free one leaves its charges where they are, for nodemgr.
 */
void reap_dead_slots(int slot)
{
	pthread_mutex_lock(&gs_state.claim_mu);
	gs_ledger_reap_others(gs_state.ledger, gs_state.fd, (uint32_t)slot);
	pthread_mutex_unlock(&gs_state.claim_mu);
}

/*
 * Ledger GPU index of a device ordinal; GS_DEV_FOREIGN for a GPU of the
 * driver's that the ledger does not have, GS_DEV_UNRESOLVED when the driver
 * cannot say which GPU the ordinal is.
 */
int ledger_gpu(CUdevice dev)
{
	gs_fn_cuDeviceGetUuid_v2 uuid_v2 = GS_REAL_FN(cuDeviceGetUuid_v2);
	gs_fn_cuDeviceGetUuid uuid_v1 = GS_REAL_FN(cuDeviceGetUuid);
	CUuuid uuid;
	int idx = GS_DEV_FOREIGN;
	CUresult rc;

	if (dev >= 0 && dev < GS_MAX_DEVS) {
		idx = __atomic_load_n(&gs_state.dev_map[dev], __ATOMIC_RELAXED);
		if (idx != GS_DEV_UNKNOWN)
			return idx;
	}
	if (uuid_v2 != NULL)
		rc = uuid_v2(&uuid, dev);
	else if (uuid_v1 != NULL)
		rc = uuid_v1(&uuid, dev);
	else
		rc = CUDA_ERROR_NOT_FOUND;
	if (rc != CUDA_SUCCESS)
		idx = GS_DEV_UNRESOLVED;
	else if ((idx = gs_ledger_gpu_index(gs_state.ledger, (const uint8_t *)uuid.bytes)) < 0)
		idx = GS_DEV_FOREIGN;
	if (rc == CUDA_SUCCESS && dev >= 0 && dev < GS_MAX_DEVS)
		__atomic_store_n(&gs_state.dev_map[dev], idx, __ATOMIC_RELAXED);
	return idx;
}

/* The ledger GPU's device ordinal, as ledger_gpu() learnt it; -1 if never asked. */
CUdevice gpu_device(int gpu)
{
	for (int d = 0; d < GS_MAX_DEVS; d++)
		if (__atomic_load_n(&gs_state.dev_map[d], __ATOMIC_RELAXED) == gpu)
			return d;
	return -1;
}

/*
 * Each thread remembers the ledger GPU of the context it last saw current,
 * so an allocation costs one driver call (cuCtxGetCurrent). A context that
 * goes away bumps gs_state.ctx_gen, since a new one may take its address.
 */
static __thread __attribute__((tls_model("initial-exec"))) struct {
	CUcontext ctx;
	int gpu;
	unsigned int gen;
} tc;

/* The calling thread's current context and its ledger GPU, or the driver's error. */
CUresult current_ctx(CUcontext *ctx, int *gpu)
{
	gs_fn_cuCtxGetCurrent get_ctx = GS_REAL_FN(cuCtxGetCurrent);
	gs_fn_cuCtxGetDevice get_dev = GS_REAL_FN(cuCtxGetDevice);
	unsigned int gen = __atomic_load_n(&gs_state.ctx_gen, __ATOMIC_ACQUIRE);
	CUdevice dev;
	CUresult rc;

	if (get_ctx == NULL || get_dev == NULL)
		return CUDA_ERROR_NOT_FOUND;
	rc = get_ctx(ctx);
	if (rc != CUDA_SUCCESS)
		return rc;
	if (*ctx == NULL)
		return CUDA_ERROR_INVALID_CONTEXT; /* what the allocators answer without one */
	if (likely(tc.ctx == *ctx && tc.gen == gen)) {
		*gpu = tc.gpu;
		return CUDA_SUCCESS;
	}
	rc = get_dev(&dev);
	if (rc != CUDA_SUCCESS)
		return rc;
	*gpu = ledger_gpu(dev);
	tc.ctx = *ctx;
	tc.gpu = *gpu;
	tc.gen = gen;
	return CUDA_SUCCESS;
}

CUresult current_gpu(int *gpu)
{
	CUcontext ctx;

	return current_ctx(&ctx, gpu);
}

/*
 * The context and ledger GPU of a stream: a stream-ordered allocation takes
 * its memory from the stream's device, which need not be the current one.
 */
CUresult stream_ctx(CUstream stream, CUcontext *ctx, int *gpu)
{
	gs_fn_cuStreamGetCtx get = GS_REAL_FN(cuStreamGetCtx);
	gs_fn_cuCtxPushCurrent_v2 push = GS_REAL_FN(cuCtxPushCurrent_v2);
	gs_fn_cuCtxPopCurrent_v2 pop = GS_REAL_FN(cuCtxPopCurrent_v2);
	gs_fn_cuCtxGetDevice get_dev = GS_REAL_FN(cuCtxGetDevice);
	CUcontext cur, ignored;
	CUdevice dev;
	CUresult rc;

	if (stream == NULL || stream == GS_STREAM_LEGACY || stream == GS_STREAM_PER_THREAD ||
	    get == NULL)
		return current_ctx(ctx, gpu);
	rc = get(stream, ctx);
	if (rc != CUDA_SUCCESS)
		return rc;
	if (current_ctx(&cur, gpu) == CUDA_SUCCESS && cur == *ctx)
		return CUDA_SUCCESS;
	/* Another context's stream: ask the driver which device that context is on. */
	if (push == NULL || pop == NULL || get_dev == NULL)
		return CUDA_ERROR_NOT_FOUND;
	rc = push(*ctx);
	if (rc != CUDA_SUCCESS)
		return rc;
	rc = get_dev(&dev);
	pop(&ignored);
	if (rc == CUDA_SUCCESS)
		*gpu = ledger_gpu(dev);
	return rc;
}
/*
 * Out of line: a paused or gated task's launches and allocations wait here
 * until nodemgr clears every bit of the word that holds them
 * (GS_PAUSE_HOLDING: GS_PAUSE_COMPUTE holds nothing) and wakes them. The wait
 * is on the value read, which may hold several bits, so a word that changed
 * in between is read again at once. The timeout re-reads the word now and
 * then, so a wake-up lost to a daemon restart costs a fraction of a second,
 * not a hang.
 */
__attribute__((noinline, cold)) void wait_while_paused(uint32_t *word)
{
	struct timespec ts = { 0, 250 * 1000 * 1000 };
	struct timespec start, end;
	uint32_t seen;

	if ((__atomic_load_n(word, __ATOMIC_ACQUIRE) & GS_PAUSE_HOLDING) == 0)
		return; /* only GS_PAUSE_COMPUTE: no wait, and none counted */
	clock_gettime(CLOCK_MONOTONIC, &start);
	while (((seen = __atomic_load_n(word, __ATOMIC_ACQUIRE)) & GS_PAUSE_HOLDING) != 0) {
		/*
		 * A process that outlived its task may find the entry handed to a
		 * newer task: that task's pause is not this process's to obey.
		 */
		if (!gs_ledger_pause_word_names(word, gs_state.task_id)) {
			__atomic_store_n(&gs_hot.pause, &gs_never_paused, __ATOMIC_RELEASE);
			break;
		}
		syscall(SYS_futex, word, FUTEX_WAIT, seen, &ts, NULL, 0);
	}
	clock_gettime(CLOCK_MONOTONIC, &end);
	__atomic_fetch_add(&pause_stats.waits, 1, __ATOMIC_RELAXED);
	__atomic_fetch_add(&pause_stats.wait_ns,
			   (unsigned long)((end.tv_sec - start.tv_sec) * 1000000000L +
					   (end.tv_nsec - start.tv_nsec)),
			   __ATOMIC_RELAXED);
}

/* --- load, fork, exit ---------------------------------------------------------- */

/*
 * The trace's first line (dispatch.c writes the trace at exit). slot: its
 * ledger slot (-1: none); launches: its launch counter (the slot's, once it
 * has one); pause_waits: launches and allocations that waited for the
 * pause word, for pause_wait_us in all.
 */
static int trace_head(char *buf, size_t len)
{
	static const char *const modes[] = { "inert", "enforce", "broken" };
	uint64_t launches = __atomic_load_n(__atomic_load_n(&gs_hot.launches, __ATOMIC_ACQUIRE),
					    __ATOMIC_RELAXED);

	return snprintf(buf, len,
			"pid=%d mode=%s slot=%d launches=%llu pause_waits=%lu pause_wait_us=%lu\n",
			(int)getpid(), modes[mode_acquire()],
			__atomic_load_n(&gs_state.slot, __ATOMIC_ACQUIRE),
			(unsigned long long)launches,
			__atomic_load_n(&pause_stats.waits, __ATOMIC_RELAXED),
			__atomic_load_n(&pause_stats.wait_ns, __ATOMIC_RELAXED) / 1000);
}

/*
 * A fork waits for an attach in progress: a child must never inherit a
 * ledger descriptor that its gs_state does not show, since a child holding
 * the parent's open file description would keep the parent's slot lock
 * alive.
 */
static void before_fork(void)
{
	pthread_mutex_lock(&gs_attach_mu);
}

static void after_fork_parent(void)
{
	pthread_mutex_unlock(&gs_attach_mu);
}

/*
 * What the child starts over with of this file's state; the files above
 * reset their own (their allocations, contexts and pools are the parent's).
 */
static void after_fork_child(void)
{
	/*
	 * The inherited descriptor shares the parent's lock: start over with
	 * no slot and no boundaries counted. Locks are re-made because another
	 * thread may have held them.
	 */
	pthread_mutex_unlock(&gs_attach_mu); /* taken by this thread in before_fork */
	if (gs_state.mode != GS_ENFORCE)
		return;
	gs_hot.pause = &gs_never_paused;
	gs_hot.launches = &gs_unattached_launches;
	/* The parent's contexts are not the child's: no thread's cached answer holds. */
	gs_state.ctx_gen++;
	/* The parent's mapping was not inherited (MADV_DONTFORK); drop its descriptor too. */
	close(gs_state.fd);
	gs_state.slot = -1;
	gs_state.fd = open(gs_state.ledger_path, O_RDWR | O_CLOEXEC);
	gs_state.ledger = gs_state.fd >= 0 ? map_ledger(gs_state.fd) : NULL;
	if (gs_state.ledger == NULL) {
		if (gs_state.fd >= 0)
			close(gs_state.fd);
		gs_state.fd = -1;
		__atomic_store_n(&gs_state.mode, GS_BROKEN, __ATOMIC_RELEASE);
	}
	pthread_mutex_init(&gs_state.claim_mu, NULL);
	pthread_mutex_init(&gs_state.epoch_mu, NULL);
	gs_state.epoch = 0;
}

__attribute__((constructor)) static void process_load(void)
{
	const char *ledger = getenv("GPUSHARE_LEDGER");
	const char *task = getenv("GPUSHARE_TASK_ID");

	if (task != NULL)
		strncpy(gs_state.task_id, task, sizeof(gs_state.task_id) - 1);
	if (ledger != NULL && ledger[0] != '\0')
		attach_at_load(ledger);
	gs_trace_head(trace_head);
	pthread_atfork(before_fork, after_fork_parent, after_fork_child);
}
