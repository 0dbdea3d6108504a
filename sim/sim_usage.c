/*
 * The node-wide usage registry: see sim_usage.h.
 *
 * A slot's key says who holds it and in what state:
 *
 *	0			free
 *	pid << 8		being filled in (or emptied) by pid
 *	pid << 8 | (dev + 1)	live: pid uses device dev; start and bytes are set
 *
 * Every change of owner is a compare-and-swap of the key, so two processes
 * can never take the same slot, and a reclaimer that misjudged an owner
 * finds the key changed and backs off. A writer fills start and bytes
 * while the key says "being filled in" and publishes the live key last,
 * so a reader that sees a live key sees its start too. Nothing but the key
 * needs to be clean in a free slot: the next owner writes the rest before
 * publishing.
 *
 * Busy time is kept per slot in a ring of SIM_USAGE_BUCKETS buckets of
 * SIM_USAGE_BUCKET_NS each, a bucket holding the number of the period it
 * counts (CLOCK_MONOTONIC / SIM_USAGE_BUCKET_NS, + 1; 0: none) and the busy
 * nanoseconds recorded in it. Only the owner writes them, one thread at a
 * time (under sim_usage_lock); a reader takes the buckets of the whole
 * periods of the last second, so a ring longer than that second, the
 * current period and the queue limit never hands it a stale or future
 * bucket for one of those.
 *
 * With the device timeline (sim_timeline.c) a slot also keeps the spans of
 * device time its owner's operations occupy that may not have elapsed yet
 * (pending, oldest first, at most SIM_USAGE_PENDING) and the total of those
 * it retired once they had (done): a span goes into the buckets when it is
 * retired, so a reader counts a span from the pending list or from the
 * buckets, never both. The owner writes all of them between two increments
 * of seq (odd while it writes); a reader reads them between two equal even
 * values of seq, trying again otherwise. The head of the table keeps each
 * device's timeline: the time it is busy until (free_at), moved on by a
 * compare-and-swap, and the device time ever scheduled on it.
 *
 * A process counts as gone when /proc has no running process of that pid
 * with the start time recorded (pid reuse cannot resurrect a slot; neither
 * can a zombie, whose contexts the real driver would have torn down at
 * exit). Without /proc, kill(pid, 0) answers instead.
 */
#define _GNU_SOURCE
#include "sim_usage.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "sim_spec.h"

#define SIM_USAGE_DEFAULT_DIR "/dev/shm"
/*
 * The layout's version is in the names: a later layout never reads this
 * one's files. The node (sim_node_id) too: lists with other GPUs never meet.
 */
#define SIM_USAGE_NAME "gpushare-sim-usage-v3-%016" PRIx64
#define SIM_USAGE_USER_NAME "gpushare-sim-usage-v3-%u-%016" PRIx64

#define SIM_USAGE_BUCKET_NS 100000000ull
#define SIM_USAGE_BUCKETS 20
_Static_assert(SIM_USAGE_BUCKETS *SIM_USAGE_BUCKET_NS >
		       SIM_USAGE_WINDOW_NS + SIM_USAGE_AHEAD_NS + 2 * SIM_USAGE_BUCKET_NS,
	       "the ring covers the window, the queue and the two partial buckets");

struct sim_usage_slot {
	uint64_t key;
	uint64_t start; /* the owner's start time + 1 (clock ticks); 0: unknown */
	uint64_t bytes;
	uint64_t busy_until; /* CLOCK_MONOTONIC ns at which the owner's queued work ends */
	uint64_t period[SIM_USAGE_BUCKETS]; /* the period a bucket counts, + 1; 0: none */
	uint64_t busy[SIM_USAGE_BUCKETS];   /* busy ns recorded in it */
	uint64_t seq;		  /* odd while the owner writes what follows or the buckets */
	uint64_t done;		  /* ns of the spans retired from pending */
	uint64_t first, npending; /* the oldest pending span, and how many there are */
	uint64_t pending[SIM_USAGE_PENDING][2]; /* [start, end) in CLOCK_MONOTONIC ns */
};

struct sim_usage_head {
	uint64_t free_at[SIM_MAX_GPUS];	  /* CLOCK_MONOTONIC ns the device is busy until */
	uint64_t scheduled[SIM_MAX_GPUS]; /* ns of device time ever scheduled on it */
};

struct sim_usage_table {
	struct sim_usage_head head;
	struct sim_usage_slot slots[SIM_USAGE_SLOTS];
};

#define SIM_USAGE_SIZE sizeof(struct sim_usage_table)

static inline uint64_t sim_key_busy(uint32_t pid)
{
	return (uint64_t)pid << 8;
}

static inline uint64_t sim_key_live(uint32_t pid, int dev)
{
	return (uint64_t)pid << 8 | (uint64_t)(dev + 1);
}

/* Everything below is written under sim_usage_lock; the table pointer once, for good. */
static pthread_mutex_t sim_usage_lock = PTHREAD_MUTEX_INITIALIZER;
static struct sim_usage_table *sim_usage_table;
static bool sim_usage_unusable; /* creating the table failed: never retried */
static int sim_procfs = -1;	/* /proc usable: 1, not: 0, not yet known: -1 */

/* This process's own slots, as a writer; reset in a forked child. */
static uint32_t sim_self_pid;
static uint64_t sim_self_start;
static pthread_once_t sim_atfork_once = PTHREAD_ONCE_INIT;
static struct sim_usage_slot *sim_mine[SIM_MAX_GPUS];
static bool sim_gave_up[SIM_MAX_GPUS]; /* no slot to be had: until sim_usage_clear */

/*
 * What /proc says of pid: 1 with *start (its start time + 1) when it runs,
 * 0 when there is no such process or it is a zombie, -1 when /proc cannot
 * tell.
 */
static int sim_proc_start(uint32_t pid, uint64_t *start)
{
	char path[64], buf[1024];
	const char *p;
	char *end;
	ssize_t n;
	int fd, field, rc = -1;

	snprintf(path, sizeof(path), "/proc/%u/stat", pid);
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return errno == ENOENT || errno == ESRCH ? 0 : -1;
	n = read(fd, buf, sizeof(buf) - 1);
	if (n <= 0)
		goto out;
	buf[n] = '\0';
	/* The command name may hold anything, spaces and parentheses too: skip past its end. */
	p = strrchr(buf, ')');
	if (!p || p[1] != ' ')
		goto out;
	p += 2;
	if (*p == 'Z' || *p == 'X' || *p == 'x') {
		rc = 0;
		goto out;
	}
	/* The state is field 3; the start time field 22. */
	for (field = 3; field < 22; field++) {
		p = strchr(p, ' ');
		if (!p)
			goto out;
		p++;
	}
	errno = 0;
	*start = strtoull(p, &end, 10) + 1;
	if (end != p && errno == 0)
		rc = 1;
out:
	close(fd);
	return rc;
}

/* Whether pid, started at start (0: unknown), still runs. */
static bool sim_usage_alive(uint32_t pid, uint64_t start)
{
	uint64_t now;

	if (sim_procfs) {
		switch (sim_proc_start(pid, &now)) {
		case 0:
			return false;
		case 1:
			return start == 0 || now == start;
		default:
			break;
		}
	}
	return kill((pid_t)pid, 0) == 0 || errno != ESRCH;
}

/*
 * The file of this node's table: in $GPUSHARE_SIM_STATE_DIR (*dir set to it)
 * every user's, the processes of a nodemgr's tasks meeting there; else this
 * user's own in /dev/shm (*dir NULL).
 */
static bool sim_usage_path(char *path, size_t len, const char **dir)
{
	uint64_t node = sim_node_id();
	int n;

	*dir = getenv(SIM_USAGE_DIR_ENV);
	if (*dir && !**dir)
		*dir = NULL;
	if (!node)
		return false;
	if (*dir)
		n = snprintf(path, len, "%s/" SIM_USAGE_NAME, *dir, node);
	else
		n = snprintf(path, len, SIM_USAGE_DEFAULT_DIR "/" SIM_USAGE_USER_NAME,
			     (unsigned int)getuid(), node);
	return n > 0 && (size_t)n < len;
}

/*
 * Whether a table file st may be used: one of this user's own, or in a state
 * dir one of the dir's owner (nodemgr makes it there for all its users); a
 * file another user put in a directory open to all is never trusted.
 */
static bool sim_usage_trusted(const struct stat *st, const char *dir)
{
	struct stat ds;

	if (!S_ISREG(st->st_mode))
		return false;
	if (st->st_uid == getuid())
		return true;
	return dir && stat(dir, &ds) == 0 && st->st_uid == ds.st_uid;
}

/*
 * Opens the table file, making it first if create. One made in a state dir
 * is 0666, whatever the umask, so that every user's processes record in it
 * (NVML lists every user's processes).
 */
static int sim_usage_open_file(const char *path, const char *dir, bool create)
{
	int flags = O_RDWR | O_CLOEXEC | O_NOFOLLOW, fd;

	if (create && dir) {
		fd = open(path, flags | O_CREAT | O_EXCL, 0600);
		if (fd >= 0) {
			if (fchmod(fd, 0666) == 0)
				return fd;
			close(fd);
			return -1;
		}
		if (errno != EEXIST)
			return -1;
	}
	return open(path, flags | (create ? O_CREAT : 0), 0600);
}

/*
 * Maps the table, making it first if create; under sim_usage_lock. A reader
 * listing processes does not create it: no file means nobody has used the
 * node yet (NVML's start makes it in a state dir: sim_usage_ready).
 */
static struct sim_usage_table *sim_usage_map(bool create)
{
	char path[PATH_MAX];
	const char *dir;
	struct stat st;
	void *map = NULL;
	uint64_t probe;
	int fd;

	if (sim_usage_table)
		return sim_usage_table;
	if (!sim_usage_path(path, sizeof(path), &dir))
		return NULL;
	fd = sim_usage_open_file(path, dir, create);
	if (fd < 0)
		return NULL;
	if (fstat(fd, &st) != 0 || !sim_usage_trusted(&st, dir))
		goto out;
	if ((size_t)st.st_size < SIM_USAGE_SIZE) {
		/*
		 * Mapping past the end would fault on access. Creators
		 * racing here all grow it to the same size, and nobody
		 * ever shrinks it.
		 */
		if (!create || ftruncate(fd, (off_t)SIM_USAGE_SIZE) != 0)
			goto out;
	}
	map = mmap(NULL, SIM_USAGE_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (map == MAP_FAILED) {
		map = NULL;
		goto out;
	}
	if (sim_procfs < 0)
		sim_procfs = sim_proc_start((uint32_t)getpid(), &probe) > 0;
	__atomic_store_n(&sim_usage_table, (struct sim_usage_table *)map, __ATOMIC_RELEASE);
out:
	close(fd);
	return map;
}

/*
 * A forked child is another process: the parent's slots stay the parent's,
 * and the child takes its own when it first uses a device.
 */
static void sim_usage_prepare(void)
{
	pthread_mutex_lock(&sim_usage_lock);
}

static void sim_usage_parent(void)
{
	pthread_mutex_unlock(&sim_usage_lock);
}

static void sim_usage_child(void)
{
	int i;

	sim_self_pid = 0;
	for (i = 0; i < SIM_MAX_GPUS; i++) {
		sim_mine[i] = NULL;
		sim_gave_up[i] = false;
	}
	pthread_mutex_unlock(&sim_usage_lock);
}

static void sim_usage_atfork(void)
{
	pthread_atfork(sim_usage_prepare, sim_usage_parent, sim_usage_child);
}

/* A slot for this process on dev: a free one, else one of a process that is gone. */
static struct sim_usage_slot *sim_usage_claim(struct sim_usage_slot *table, int dev)
{
	uint64_t busy = sim_key_busy(sim_self_pid);
	struct sim_usage_slot *s = NULL;
	uint64_t key;
	int i;

	for (i = 0; i < SIM_USAGE_SLOTS && !s; i++) {
		key = 0;
		if (__atomic_compare_exchange_n(&table[i].key, &key, busy, false, __ATOMIC_ACQ_REL,
						__ATOMIC_RELAXED))
			s = &table[i];
	}
	for (i = 0; i < SIM_USAGE_SLOTS && !s; i++) {
		uint64_t start;

		key = __atomic_load_n(&table[i].key, __ATOMIC_ACQUIRE);
		/* A half-made slot's start is not its owner's yet: judge it by pid alone. */
		start = key & 0xff ? __atomic_load_n(&table[i].start, __ATOMIC_RELAXED) : 0;
		if (!key || (uint32_t)(key >> 8) == sim_self_pid ||
		    sim_usage_alive((uint32_t)(key >> 8), start))
			continue;
		if (__atomic_compare_exchange_n(&table[i].key, &key, busy, false, __ATOMIC_ACQ_REL,
						__ATOMIC_RELAXED))
			s = &table[i];
	}
	if (!s)
		return NULL;
	__atomic_store_n(&s->start, sim_procfs ? sim_self_start : 0, __ATOMIC_RELAXED);
	__atomic_store_n(&s->bytes, 0, __ATOMIC_RELAXED);
	__atomic_store_n(&s->busy_until, 0, __ATOMIC_RELAXED);
	for (i = 0; i < SIM_USAGE_BUCKETS; i++)
		__atomic_store_n(&s->period[i], 0, __ATOMIC_RELAXED);
	/* A seq left odd by an owner that died writing is even again. */
	__atomic_store_n(&s->seq, 0, __ATOMIC_RELAXED);
	__atomic_store_n(&s->done, 0, __ATOMIC_RELAXED);
	__atomic_store_n(&s->first, 0, __ATOMIC_RELAXED);
	__atomic_store_n(&s->npending, 0, __ATOMIC_RELAXED);
	__atomic_store_n(&s->key, sim_key_live(sim_self_pid, dev), __ATOMIC_RELEASE);
	return s;
}

void sim_usage_set(int spec_index, size_t bytes)
{
	struct sim_usage_table *table;
	struct sim_usage_slot *s;

	if (spec_index < 0 || spec_index >= SIM_MAX_GPUS)
		return;
	s = __atomic_load_n(&sim_mine[spec_index], __ATOMIC_ACQUIRE);
	if (s) {
		__atomic_store_n(&s->bytes, (uint64_t)bytes, __ATOMIC_RELAXED);
		return;
	}
	if (__atomic_load_n(&sim_gave_up[spec_index], __ATOMIC_RELAXED))
		return;

	pthread_once(&sim_atfork_once, sim_usage_atfork);
	pthread_mutex_lock(&sim_usage_lock);
	s = sim_mine[spec_index];
	if (s || sim_gave_up[spec_index])
		goto out;
	table = sim_usage_unusable ? NULL : sim_usage_map(true);
	sim_usage_unusable = !table;
	if (table && !sim_self_pid) {
		sim_self_pid = (uint32_t)getpid();
		if (sim_procfs && sim_proc_start(sim_self_pid, &sim_self_start) <= 0)
			sim_self_start = 0;
	}
	s = table ? sim_usage_claim(table->slots, spec_index) : NULL;
	if (s)
		__atomic_store_n(&sim_mine[spec_index], s, __ATOMIC_RELEASE);
	else
		__atomic_store_n(&sim_gave_up[spec_index], true, __ATOMIC_RELAXED);
out:
	if (s)
		__atomic_store_n(&s->bytes, (uint64_t)bytes, __ATOMIC_RELAXED);
	pthread_mutex_unlock(&sim_usage_lock);
}

void sim_usage_ready(void)
{
	const char *dir = getenv(SIM_USAGE_DIR_ENV);

	if (!dir || !*dir)
		return;
	pthread_once(&sim_atfork_once, sim_usage_atfork);
	pthread_mutex_lock(&sim_usage_lock);
	sim_usage_map(true);
	pthread_mutex_unlock(&sim_usage_lock);
}

void sim_usage_clear(int spec_index)
{
	struct sim_usage_slot *s;
	uint64_t key;

	if (spec_index < 0 || spec_index >= SIM_MAX_GPUS)
		return;
	pthread_mutex_lock(&sim_usage_lock);
	s = sim_mine[spec_index];
	__atomic_store_n(&sim_mine[spec_index], NULL, __ATOMIC_RELEASE);
	__atomic_store_n(&sim_gave_up[spec_index], false, __ATOMIC_RELAXED);
	if (s) {
		key = sim_key_live(sim_self_pid, spec_index);
		__atomic_compare_exchange_n(&s->key, &key, 0, false, __ATOMIC_ACQ_REL,
					    __ATOMIC_RELAXED);
	}
	pthread_mutex_unlock(&sim_usage_lock);
}

uint64_t sim_usage_now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* The owner's writes to its slot, between two increments of seq. */
static void sim_write_begin(struct sim_usage_slot *s)
{
	__atomic_store_n(&s->seq, __atomic_load_n(&s->seq, __ATOMIC_RELAXED) + 1, __ATOMIC_RELEASE);
}

static void sim_write_end(struct sim_usage_slot *s)
{
	__atomic_store_n(&s->seq, __atomic_load_n(&s->seq, __ATOMIC_RELAXED) + 1, __ATOMIC_RELEASE);
}

/*
 * The owner records [t0, t1) of busy time in the buckets. A bucket that
 * counts a later period than one of the span's is left alone: that period is
 * older than the ring, and no reader asks for it.
 */
static void sim_buckets_add(struct sim_usage_slot *s, uint64_t t0, uint64_t t1)
{
	uint64_t t, cut, period, label;
	unsigned int i;

	for (t = t0; t < t1; t = cut) {
		period = t / SIM_USAGE_BUCKET_NS;
		cut = (period + 1) * SIM_USAGE_BUCKET_NS;
		if (cut > t1)
			cut = t1;
		i = (unsigned int)(period % SIM_USAGE_BUCKETS);
		label = __atomic_load_n(&s->period[i], __ATOMIC_RELAXED);
		if (label > period + 1)
			continue;
		if (label != period + 1) {
			/* Emptied before it is relabelled: a reader never adds old time to it. */
			__atomic_store_n(&s->busy[i], 0, __ATOMIC_RELEASE);
			__atomic_store_n(&s->period[i], period + 1, __ATOMIC_RELEASE);
		}
		__atomic_store_n(&s->busy[i],
				 __atomic_load_n(&s->busy[i], __ATOMIC_RELAXED) + (cut - t),
				 __ATOMIC_RELEASE);
	}
}

void sim_usage_busy(int spec_index, unsigned long long ns)
{
	struct sim_usage_slot *s;
	uint64_t now, start, end, limit;

	if (spec_index < 0 || spec_index >= SIM_MAX_GPUS || ns == 0)
		return;
	if (!__atomic_load_n(&sim_mine[spec_index], __ATOMIC_ACQUIRE))
		return;
	now = sim_usage_now();
	pthread_mutex_lock(&sim_usage_lock);
	s = sim_mine[spec_index];
	if (!s)
		goto out;
	start = __atomic_load_n(&s->busy_until, __ATOMIC_RELAXED);
	if (start < now)
		start = now;
	limit = now + SIM_USAGE_AHEAD_NS;
	end = start + ns < start || start + ns > limit ? limit : start + ns;
	sim_write_begin(s);
	sim_buckets_add(s, start, end);
	sim_write_end(s);
	if (end > start)
		__atomic_store_n(&s->busy_until, end, __ATOMIC_RELAXED);
out:
	pthread_mutex_unlock(&sim_usage_lock);
}

/*
 * The owner, writing: the pending spans that have ended by now go to the
 * buckets and the done total; with force, the oldest goes even if it has
 * not (a list that another thread filled since the caller found room).
 */
static void sim_pending_retire(struct sim_usage_slot *s, uint64_t now, bool force)
{
	uint64_t first = __atomic_load_n(&s->first, __ATOMIC_RELAXED),
		 n = __atomic_load_n(&s->npending, __ATOMIC_RELAXED), t0, t1;

	while (n) {
		t0 = __atomic_load_n(&s->pending[first][0], __ATOMIC_RELAXED);
		t1 = __atomic_load_n(&s->pending[first][1], __ATOMIC_RELAXED);
		if (t1 > now && !force)
			break;
		force = false;
		sim_buckets_add(s, t0, t1);
		__atomic_store_n(&s->done, __atomic_load_n(&s->done, __ATOMIC_RELAXED) + (t1 - t0),
				 __ATOMIC_RELAXED);
		first = (first + 1) % SIM_USAGE_PENDING;
		n--;
	}
	__atomic_store_n(&s->first, first, __ATOMIC_RELAXED);
	__atomic_store_n(&s->npending, n, __ATOMIC_RELAXED);
}

bool sim_usage_room(int spec_index, uint64_t *until)
{
	struct sim_usage_slot *s;
	bool room = true;

	if (spec_index < 0 || spec_index >= SIM_MAX_GPUS)
		return true;
	pthread_mutex_lock(&sim_usage_lock);
	s = sim_mine[spec_index];
	if (s) {
		sim_write_begin(s);
		sim_pending_retire(s, sim_usage_now(), false);
		sim_write_end(s);
		if (s->npending == SIM_USAGE_PENDING) {
			room = false;
			*until = s->pending[s->first][1];
		}
	}
	pthread_mutex_unlock(&sim_usage_lock);
	return room;
}

/* Each device's timeline when there is no table: this process's alone. */
static uint64_t sim_local_free_at[SIM_MAX_GPUS];

void sim_usage_schedule(int spec_index, uint64_t after, uint64_t ns, uint64_t *start, uint64_t *end)
{
	struct sim_usage_table *table = __atomic_load_n(&sim_usage_table, __ATOMIC_ACQUIRE);
	uint64_t now = sim_usage_now(), *free_at, old, last;
	struct sim_usage_slot *s;

	if (spec_index < 0 || spec_index >= SIM_MAX_GPUS) {
		*start = *end = after > now ? after : now;
		return;
	}
	if (after < now)
		after = now;
	free_at = table ? &table->head.free_at[spec_index] : &sim_local_free_at[spec_index];
	/*
	 * Under the lock, so that this process's spans are taken in the order
	 * they are listed; other processes' are ordered by the swap alone.
	 */
	pthread_mutex_lock(&sim_usage_lock);
	old = __atomic_load_n(free_at, __ATOMIC_ACQUIRE);
	do {
		*start = old > after ? old : after;
		*end = *start + ns;
	} while (!__atomic_compare_exchange_n(free_at, &old, *end, false, __ATOMIC_ACQ_REL,
					      __ATOMIC_ACQUIRE));
	if (table)
		__atomic_add_fetch(&table->head.scheduled[spec_index], ns, __ATOMIC_RELAXED);
	s = sim_mine[spec_index];
	if (s && ns) {
		uint64_t n, first;

		sim_write_begin(s);
		sim_pending_retire(s, now, s->npending == SIM_USAGE_PENDING);
		n = s->npending;
		first = s->first;
		last = (first + n + SIM_USAGE_PENDING - 1) % SIM_USAGE_PENDING;
		if (n && s->pending[last][1] == *start) {
			/* Back to back with the last: one span. */
			__atomic_store_n(&s->pending[last][1], *end, __ATOMIC_RELAXED);
		} else {
			last = (first + n) % SIM_USAGE_PENDING;
			__atomic_store_n(&s->pending[last][0], *start, __ATOMIC_RELAXED);
			__atomic_store_n(&s->pending[last][1], *end, __ATOMIC_RELAXED);
			__atomic_store_n(&s->npending, n + 1, __ATOMIC_RELAXED);
		}
		sim_write_end(s);
	}
	pthread_mutex_unlock(&sim_usage_lock);
}

/* What a reader takes of a slot at now: see sim_slot_read. */
struct sim_slot_view {
	uint64_t elapsed; /* busy ns elapsed by now */
	uint64_t ahead;	  /* busy ns still to come after now */
	uint64_t window;  /* busy ns within [from, to) */
};

static uint64_t sim_overlap(uint64_t a0, uint64_t a1, uint64_t b0, uint64_t b1)
{
	uint64_t lo = a0 > b0 ? a0 : b0, hi = a1 < b1 ? a1 : b1;

	return hi > lo ? hi - lo : 0;
}

/*
 * Slot s's busy time at now, and within the whole periods [from, to) of the
 * buckets: from its buckets, done total and pending spans, read between two
 * equal even values of seq. A writer that stays in the middle of a write
 * (stopped, or dead) is read as it is after a few tries: a figure off by one
 * span is better than a reader that never returns.
 */
static void sim_slot_read(struct sim_usage_slot *s, uint64_t now, uint64_t from, uint64_t to,
			  struct sim_slot_view *v)
{
	uint64_t seq, first, n, k, t0, t1, period;
	unsigned int i, tries;

	for (tries = 0; tries < 100; tries++) {
		seq = __atomic_load_n(&s->seq, __ATOMIC_ACQUIRE);
		if (seq & 1) {
			sched_yield();
			continue;
		}
		v->elapsed = __atomic_load_n(&s->done, __ATOMIC_ACQUIRE);
		v->ahead = v->window = 0;
		for (i = 0; i < SIM_USAGE_BUCKETS; i++) {
			period = __atomic_load_n(&s->period[i], __ATOMIC_ACQUIRE);
			if (period == 0 || period - 1 < from || period - 1 >= to)
				continue;
			v->window += __atomic_load_n(&s->busy[i], __ATOMIC_ACQUIRE);
		}
		first = __atomic_load_n(&s->first, __ATOMIC_ACQUIRE) % SIM_USAGE_PENDING;
		n = __atomic_load_n(&s->npending, __ATOMIC_ACQUIRE);
		for (k = 0; k < n && k < SIM_USAGE_PENDING; k++) {
			t0 = __atomic_load_n(&s->pending[(first + k) % SIM_USAGE_PENDING][0],
					     __ATOMIC_ACQUIRE);
			t1 = __atomic_load_n(&s->pending[(first + k) % SIM_USAGE_PENDING][1],
					     __ATOMIC_ACQUIRE);
			if (t1 < t0)
				continue;
			v->elapsed += sim_overlap(t0, t1, 0, now);
			v->ahead += sim_overlap(t0, t1, now, UINT64_MAX);
			v->window += sim_overlap(t0, t1, from * SIM_USAGE_BUCKET_NS,
						 to * SIM_USAGE_BUCKET_NS);
		}
		if (__atomic_load_n(&s->seq, __ATOMIC_RELAXED) == seq)
			return;
	}
}

/*
 * The share (percent) of the last second slot s's owner kept its device
 * busy, at now: the last SIM_USAGE_WINDOW_NS of whole buckets before the
 * current one, so a figure holds for a bucket's length (NVML's sample
 * period) and readers within it agree.
 */
static unsigned int sim_usage_util(struct sim_usage_slot *s, uint64_t now)
{
	uint64_t current = now / SIM_USAGE_BUCKET_NS,
		 window = SIM_USAGE_WINDOW_NS / SIM_USAGE_BUCKET_NS;
	uint64_t from = current > window ? current - window : 0, span;
	struct sim_slot_view v;

	if (current == 0)
		return 0;
	span = (current - from) * SIM_USAGE_BUCKET_NS;
	sim_slot_read(s, now, from, current, &v);
	return v.window >= span ? 100 : (unsigned int)(v.window * 100 / span);
}

/* NVML's table: mapped if a driver has made it; NULL if none has. */
static struct sim_usage_table *sim_usage_reader(void)
{
	struct sim_usage_table *table = __atomic_load_n(&sim_usage_table, __ATOMIC_ACQUIRE);

	if (!table) {
		pthread_once(&sim_atfork_once, sim_usage_atfork);
		pthread_mutex_lock(&sim_usage_lock);
		table = sim_usage_map(false);
		pthread_mutex_unlock(&sim_usage_lock);
	}
	return table;
}

unsigned int sim_usage_list(int spec_index, struct sim_usage_proc *procs, unsigned int max,
			    unsigned long long *total)
{
	struct sim_usage_table *table;
	unsigned int n = 0;
	uint64_t now = sim_usage_now();
	int i;

	*total = 0;
	if (spec_index < 0 || spec_index >= SIM_MAX_GPUS)
		return 0;
	table = sim_usage_reader();
	if (!table)
		return 0;
	for (i = 0; i < SIM_USAGE_SLOTS; i++) {
		struct sim_usage_slot *s = &table->slots[i];
		uint64_t key = __atomic_load_n(&s->key, __ATOMIC_ACQUIRE);
		uint64_t start, bytes;
		uint32_t pid = (uint32_t)(key >> 8);

		if ((key & 0xff) != (uint64_t)spec_index + 1)
			continue;
		/*
		 * Acquire loads, so the key is read again after them (a fence would do,
		 * but TSan does not model fences): emptied or taken over while being
		 * read, these values may be another's.
		 */
		start = __atomic_load_n(&s->start, __ATOMIC_ACQUIRE);
		bytes = __atomic_load_n(&s->bytes, __ATOMIC_ACQUIRE);
		if (__atomic_load_n(&s->key, __ATOMIC_RELAXED) != key)
			continue;
		if (!sim_usage_alive(pid, start)) {
			__atomic_compare_exchange_n(&s->key, &key, 0, false, __ATOMIC_ACQ_REL,
						    __ATOMIC_RELAXED);
			continue;
		}
		if (n < max) {
			procs[n].pid = pid;
			procs[n].bytes = bytes;
			procs[n].util = sim_usage_util(s, now);
		}
		n++;
		*total = *total > ULLONG_MAX - bytes ? ULLONG_MAX : *total + bytes;
	}
	return n;
}

bool sim_usage_process_busy(int spec_index, unsigned int pid, unsigned long long *ns)
{
	struct sim_usage_table *table;
	struct sim_slot_view v;
	int i;

	if (spec_index < 0 || spec_index >= SIM_MAX_GPUS)
		return false;
	table = sim_usage_reader();
	for (i = 0; table && i < SIM_USAGE_SLOTS; i++) {
		struct sim_usage_slot *s = &table->slots[i];

		if (__atomic_load_n(&s->key, __ATOMIC_ACQUIRE) != sim_key_live(pid, spec_index))
			continue;
		sim_slot_read(s, sim_usage_now(), 0, 0, &v);
		*ns = v.elapsed;
		return true;
	}
	return false;
}

unsigned long long sim_usage_device_busy(int spec_index)
{
	struct sim_usage_table *table;
	struct sim_slot_view v;
	uint64_t now = sim_usage_now(), busy, ahead = 0;
	int i;

	if (spec_index < 0 || spec_index >= SIM_MAX_GPUS)
		return 0;
	table = sim_usage_reader();
	if (!table)
		return 0;
	busy = __atomic_load_n(&table->head.scheduled[spec_index], __ATOMIC_ACQUIRE);
	for (i = 0; i < SIM_USAGE_SLOTS; i++) {
		struct sim_usage_slot *s = &table->slots[i];

		if ((__atomic_load_n(&s->key, __ATOMIC_ACQUIRE) & 0xff) != (uint64_t)spec_index + 1)
			continue;
		sim_slot_read(s, now, 0, 0, &v);
		ahead += v.ahead;
	}
	return busy > ahead ? busy - ahead : 0;
}
