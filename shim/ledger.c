/*
 * Ledger operations shared by the shim (inside every framework process) and
 * nodemgr (through cffi). Nothing here allocates, logs or blocks: slot locks
 * are taken with F_OFD_SETLK, never F_OFD_SETLKW. The one wait is a claim's,
 * at most 2 ms, while free slots' locks are held for a moment (see
 * gs_ledger_claim); nodemgr never claims.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <stddef.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "ledger.h"

/*
 * Memory order: seq_cst unless said otherwise. The ledger is shared between
 * processes and read off the hot paths, so the strongest order costs little
 * and keeps every reader's view simple. What needs an order is said where it
 * is needed (the order of a charge's and an uncharge's steps, for a process
 * killed between them); counters kept only for reports (peaks) are relaxed,
 * each saying so.
 */
#define LOAD(p) __atomic_load_n((p), __ATOMIC_SEQ_CST)
#define STORE(p, v) __atomic_store_n((p), (v), __ATOMIC_SEQ_CST)
/* A figure read only for reports: no other memory is published through it. */
#define LOAD_REPORT(p) __atomic_load_n((p), __ATOMIC_RELAXED)

/*
 * The first slot at or after `from` whose taken bit is set, GS_MAX_SLOTS if
 * none: readers visit only those, so their cost follows the slots in use,
 * not the table. A slot holds nothing while its bit is clear.
 */
static uint32_t next_taken(const struct gs_ledger *l, uint32_t from)
{
	for (uint32_t w = from / 64; w < GS_MAX_SLOTS / 64; w++) {
		uint64_t word = LOAD(&l->slot_taken[w]);

		if (w == from / 64)
			word &= ~0ULL << (from % 64);
		if (word != 0)
			return w * 64 + (uint32_t)__builtin_ctzll(word);
	}
	return GS_MAX_SLOTS;
}

#define for_each_taken(l, i) \
	for (uint32_t i = next_taken(l, 0); i < GS_MAX_SLOTS; i = next_taken(l, i + 1))

/*
 * Whether a task entry's id and a slot's are the same: both are written
 * zero-padded to their full length, so a fixed-size compare (inlined: on
 * every charge and uncharge) says what strncmp would.
 */
static int same_task(const char *entry_id, const char *slot_id)
{
	return memcmp(entry_id, slot_id, GS_TASK_ID_LEN) == 0;
}

/* Whether slot `s` is claimed by a process of `task_id`. */
static int of_task(const struct gs_slot *s, const char *task_id)
{
	return LOAD(&s->state) == GS_SLOT_USED && strncmp(s->task_id, task_id, GS_TASK_ID_LEN) == 0;
}

int gs_ledger_check(const struct gs_ledger *l, size_t len)
{
	if (l == NULL || len < sizeof(*l))
		return -EINVAL;
	if (l->magic != GS_LEDGER_MAGIC)
		return -EINVAL;
	if (l->version != GS_LEDGER_VERSION || l->size != sizeof(*l))
		return -EPROTO;
	if (l->ngpus > GS_MAX_GPUS || l->nslots != GS_MAX_SLOTS)
		return -EPROTO;
	return 0;
}

int gs_ledger_init(struct gs_ledger *l, uint32_t ngpus)
{
	if (ngpus > GS_MAX_GPUS)
		return -E2BIG;
	l->version = GS_LEDGER_VERSION;
	l->size = sizeof(*l);
	l->ngpus = ngpus;
	l->nslots = GS_MAX_SLOTS;
	/* The magic goes last: a reader that sees it sees a whole header. */
	STORE(&l->magic, (uint64_t)GS_LEDGER_MAGIC);
	return 0;
}

void gs_ledger_set_limit(struct gs_ledger *l, uint32_t gpu, uint64_t bytes)
{
	if (gpu < GS_MAX_GPUS)
		STORE(&l->gpu[gpu].limit, bytes);
}

uint64_t gs_ledger_limit(const struct gs_ledger *l, uint32_t gpu)
{
	return gpu < GS_MAX_GPUS ? LOAD(&l->gpu[gpu].limit) : 0;
}

void gs_ledger_set_ctx_charge(struct gs_ledger *l, uint32_t gpu, uint64_t bytes)
{
	if (gpu < GS_MAX_GPUS)
		STORE(&l->gpu[gpu].ctx_charge, bytes);
}

void gs_ledger_set_topup_limit(struct gs_ledger *l, uint32_t gpu, uint64_t bytes)
{
	if (gpu < GS_MAX_GPUS)
		STORE(&l->gpu[gpu].topup_limit, bytes);
}

void gs_ledger_set_topup_wait(struct gs_ledger *l, uint32_t ms)
{
	STORE(&l->topup_wait_ms, ms);
}

uint64_t gs_ledger_wanted(const struct gs_ledger *l, uint32_t gpu)
{
	return gpu < GS_MAX_GPUS ? LOAD(&l->gpu[gpu].wanted) : 0;
}

void gs_ledger_clear_ask(struct gs_ledger *l, uint32_t gpu, uint64_t seen)
{
	/*
	 * nodemgr answers after any new limit (sequentially consistent, in this
	 * order): a waiter that sees `wanted` zeroed and then reads the limit
	 * sees the new one. Only the ask read is cleared: one raised since,
	 * another process's, stands.
	 */
	if (gpu < GS_MAX_GPUS)
		__atomic_compare_exchange_n(&l->gpu[gpu].wanted, &seen, 0, 0, __ATOMIC_SEQ_CST,
					    __ATOMIC_SEQ_CST);
}

int gs_ledger_want(struct gs_ledger *l, uint32_t gpu, uint64_t bytes, uint64_t limit,
		   uint64_t *asked)
{
	uint64_t topup_limit, need, seen;

	if (gpu >= GS_MAX_GPUS || LOAD(&l->topup_wait_ms) == 0)
		return 0;
	topup_limit = LOAD(&l->gpu[gpu].topup_limit);
	need = LOAD(&l->gpu[gpu].charged) + bytes;
	if (topup_limit <= limit || need < bytes || need > topup_limit)
		return 0;
	/* Of several processes' asks, the largest stands until nodemgr answers. */
	seen = LOAD(&l->gpu[gpu].wanted);
	while (seen < need && !__atomic_compare_exchange_n(&l->gpu[gpu].wanted, &seen, need, 0,
							   __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
		;
	*asked = need;
	return 1;
}

uint32_t gs_ledger_topup_wait(const struct gs_ledger *l)
{
	return LOAD(&l->topup_wait_ms);
}

int gs_ledger_task_find(const struct gs_ledger *l, const char *task_id)
{
	for (int i = 0; i < GS_MAX_TASKS; i++) {
		const struct gs_task *t = &l->task[i];

		if (LOAD(&t->state) == GS_SLOT_USED &&
		    strncmp(t->task_id, task_id, GS_TASK_ID_LEN) == 0)
			return i;
	}
	return -ENOENT;
}

/* Store 0 into each of `n` figures. */
static void zero_all(uint64_t *const *figures, size_t n)
{
	for (size_t i = 0; i < n; i++)
		STORE(figures[i], 0);
}

#define ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))

/* Only nodemgr writes task entries, from one thread: no entry is raced for. */
int gs_ledger_task_add(struct gs_ledger *l, const char *task_id)
{
	int i = gs_ledger_task_find(l, task_id);

	if (i >= 0)
		return i;
	for (i = 0; i < GS_MAX_TASKS; i++) {
		struct gs_task *t = &l->task[i];
		uint64_t *const figures[] = { &t->last_launch_ns, &t->iterations, &t->turn_until,
					      &t->used, &t->peak };

		if (LOAD(&t->state) != GS_SLOT_FREE)
			continue;
		memset(t->task_id, 0, sizeof(t->task_id));
		strncpy(t->task_id, task_id, sizeof(t->task_id) - 1);
		STORE(&t->paused, 0);
		STORE(&t->flags, 0);
		zero_all(figures, ARRAY_LEN(figures));
		gs_ledger_entry_unschedule(l, i);
		/* State last: a process that finds the entry finds it whole. */
		STORE(&t->state, (uint32_t)GS_SLOT_USED);
		return i;
	}
	return -ENOSPC;
}

static void wake_all(uint32_t *word)
{
	/* Not FUTEX_PRIVATE: the waiters are other processes sharing the file. */
	syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* Only nodemgr writes pause words, from one thread: a plain read-modify-write is enough. */
static int task_bit(struct gs_ledger *l, const char *task_id, uint32_t bit, uint32_t on)
{
	int i = gs_ledger_task_find(l, task_id);
	uint32_t word;

	if (i < 0)
		return i;
	word = LOAD(&l->task[i].paused);
	word = on ? (word | bit) : (word & ~bit);
	STORE(&l->task[i].paused, word);
	/* Nothing holds the task any longer (GS_PAUSE_COMPUTE holds nothing). */
	if ((word & GS_PAUSE_HOLDING) == 0)
		wake_all(&l->task[i].paused);
	return 0;
}

int gs_ledger_task_pause(struct gs_ledger *l, const char *task_id, uint32_t paused)
{
	return task_bit(l, task_id, GS_PAUSE_ADMIN, paused);
}

int gs_ledger_task_gate(struct gs_ledger *l, const char *task_id, uint32_t gated)
{
	return task_bit(l, task_id, GS_PAUSE_TURN, gated);
}

int gs_ledger_task_hold_class(struct gs_ledger *l, const char *task_id, uint32_t held)
{
	return task_bit(l, task_id, GS_PAUSE_CLASS, held);
}

int gs_ledger_task_wake_pacers(struct gs_ledger *l, const char *task_id, uint32_t on)
{
	return task_bit(l, task_id, GS_PAUSE_COMPUTE, on);
}

int gs_ledger_task_turn(struct gs_ledger *l, const char *task_id, uint64_t turn_until,
			uint32_t flags)
{
	int i = gs_ledger_task_find(l, task_id);

	if (i < 0)
		return i;
	STORE(&l->task[i].turn_until, turn_until);
	STORE(&l->task[i].flags, flags);
	return 0;
}

int gs_ledger_task_remove(struct gs_ledger *l, const char *task_id)
{
	int i = gs_ledger_task_find(l, task_id);

	if (i < 0)
		return i;
	/* A process still holding a launch must not wait for a task that is gone. */
	STORE(&l->task[i].paused, 0);
	wake_all(&l->task[i].paused);
	gs_ledger_entry_unschedule(l, i);
	STORE(&l->task[i].state, (uint32_t)GS_SLOT_FREE);
	return 0;
}

/* The task entry slot `s` charges, if it still names the slot's task; NULL if none. */
static struct gs_task *slot_task(struct gs_ledger *l, const struct gs_slot *s)
{
	int32_t t = LOAD(&s->task_index);
	struct gs_task *entry;

	if (t < 0 || t >= GS_MAX_TASKS)
		return NULL;
	entry = &l->task[t];
	if (LOAD(&entry->state) != GS_SLOT_USED || !same_task(entry->task_id, s->task_id))
		return NULL;
	return entry;
}

void gs_ledger_stamp_launches(struct gs_ledger *l, uint64_t now_ns)
{
	for_each_taken(l, i) {
		struct gs_slot *s = &l->slot[i];
		struct gs_task *t;
		uint64_t n;

		if (LOAD(&s->state) != GS_SLOT_USED)
			continue;
		n = LOAD(&s->launches);
		if (n == LOAD(&s->launches_seen))
			continue;
		STORE(&s->launches_seen, n);
		STORE(&s->last_launch_ns, now_ns);
		/* The entry the process found at claim, if it still names the process's task. */
		t = slot_task(l, s);
		if (t != NULL)
			STORE(&t->last_launch_ns, now_ns);
	}
}

uint64_t gs_ledger_used(const struct gs_ledger *l, uint32_t gpu)
{
	uint64_t total = 0;

	if (gpu >= GS_MAX_GPUS)
		return 0;
	for_each_taken(l, i) {
		uint64_t v = LOAD(&l->slot[i].used[gpu]);

		/* A corrupt slot must read as "full", never wrap to "empty". */
		if (total + v < total)
			return UINT64_MAX;
		total += v;
	}
	return total;
}

uint64_t gs_ledger_charged(const struct gs_ledger *l, uint32_t gpu)
{
	return gpu < GS_MAX_GPUS ? LOAD(&l->gpu[gpu].charged) : 0;
}

int gs_ledger_task_usage(const struct gs_ledger *l, const char *task_id, uint64_t *used,
			 uint64_t *launches, uint64_t *peak)
{
	int n = 0, t;

	memset(used, 0, sizeof(uint64_t) * GS_MAX_GPUS);
	*launches = 0;
	*peak = 0;
	for_each_taken(l, i) {
		const struct gs_slot *s = &l->slot[i];

		if (!of_task(s, task_id))
			continue;
		for (int g = 0; g < GS_MAX_GPUS; g++)
			used[g] += LOAD(&s->used[g]);
		*launches += LOAD(&s->launches);
		*peak += LOAD(&s->peak);
		n++;
	}
	/* The task's own count is exact; the sum of its processes' peaks is an upper bound. */
	t = gs_ledger_task_find(l, task_id);
	if (t >= 0 && LOAD(&l->task[t].peak) != 0)
		*peak = LOAD(&l->task[t].peak);
	return n;
}

int gs_ledger_task_regions(const struct gs_ledger *l, const char *task_id, struct gs_regions *out)
{
	int n = 0;

	memset(out, 0, sizeof(*out));
	for_each_taken(l, i) {
		const struct gs_slot *s = &l->slot[i];
		uint64_t it, rel;

		if (!of_task(s, task_id))
			continue;
		for (int g = 0; g < GS_MAX_GPUS; g++) {
			out->used[g] += LOAD(&s->used[g]);
			out->persistent[g] += LOAD(&s->persistent[g]);
			out->temp_peak[g] += LOAD(&s->temp_peak[g]);
			out->settled[g] += LOAD(&s->settled[g]);
		}
		it = LOAD(&s->iterations);
		rel = LOAD(&s->releases);
		if (it > out->iterations)
			out->iterations = it;
		/* A process that never reported a boundary is one that runs no iterations. */
		if (it > 0 && (out->releases == 0 || rel < out->releases))
			out->releases = rel;
		if (it > 0 && (out->min_iterations == 0 || it < out->min_iterations))
			out->min_iterations = it;
		n++;
	}
	out->processes = (uint32_t)n;
	return n;
}

int gs_ledger_task_barrier(const struct gs_ledger *l, const char *task_id, uint64_t since_ns,
			   uint64_t *min_iterations)
{
	int n = 0;

	*min_iterations = 0;
	for_each_taken(l, i) {
		const struct gs_slot *s = &l->slot[i];
		uint64_t it, at;

		if (!of_task(s, task_id))
			continue;
		at = LOAD(&s->boundary_ns);
		it = LOAD(&s->iterations);
		/* No boundary yet, or none lately: a process that does not step now. */
		if (it == 0 || at == 0 || at < since_ns)
			continue;
		if (*min_iterations == 0 || it < *min_iterations)
			*min_iterations = it;
		n++;
	}
	return n;
}

static void slot_info(const struct gs_slot *s, uint32_t i, struct gs_slot_info *o)
{
	uint64_t total = 0;

	for (int g = 0; g < GS_MAX_GPUS; g++) {
		uint64_t u = LOAD(&s->used[g]);

		total = total + u < total ? UINT64_MAX : total + u;
	}
	memcpy(o->task_id, s->task_id, sizeof(o->task_id));
	o->task_id[sizeof(o->task_id) - 1] = '\0';
	o->pid = LOAD(&s->pid);
	o->slot = i;
	o->used = total;
	o->peak = LOAD(&s->peak);
	o->launches = LOAD(&s->launches);
}

int gs_ledger_summary(const struct gs_ledger *l, struct gs_slot_info *out, uint32_t max)
{
	uint32_t n = 0;

	for_each_taken(l, i) {
		if (n == max)
			break;
		if (LOAD(&l->slot[i].state) != GS_SLOT_USED)
			continue;
		slot_info(&l->slot[i], i, &out[n++]);
	}
	return (int)n;
}

static int slot_lock(int fd, uint32_t i, short type)
{
	struct flock fl = {
		.l_type = type,
		.l_whence = SEEK_SET,
		.l_start = (off_t)offsetof(struct gs_ledger, slot) +
			   (off_t)i * (off_t)sizeof(struct gs_slot),
		.l_len = 1,
	};

	return fcntl(fd, F_OFD_SETLK, &fl) == 0 ? 0 : -errno;
}

static uint64_t sub_sat(uint64_t *p, uint64_t bytes);

/*
 * What a cleared slot held leaves its GPUs' and its task's counts. Each
 * figure is taken out of the slot (an exchange) before it is taken off the
 * counts, so a clearer killed in between leaves a count too high, never one
 * taken off twice when the next clearer comes.
 */
static void slot_clear(struct gs_ledger *l, struct gs_slot *s)
{
	struct gs_task *t = slot_task(l, s);
	uint64_t *const figures[] = { &s->held,		  &s->iterations, &s->releases,
				      &s->boundary_ns,	  &s->launches,	  &s->launches_seen,
				      &s->last_launch_ns, &s->peak,	  &s->device_ns,
				      &s->overrun_ns,	  &s->gated_ns,	  &s->windows,
				      &s->unmeasured };
	uint64_t held = 0;

	for (int g = 0; g < GS_MAX_GPUS; g++) {
		uint64_t v = __atomic_exchange_n(&s->used[g], 0, __ATOMIC_SEQ_CST);

		if (v != 0)
			sub_sat(&l->gpu[g].charged, v);
		held += v;
	}
	if (t != NULL && held != 0)
		sub_sat(&t->used, held);
	for (int g = 0; g < GS_MAX_GPUS; g++) {
		STORE(&s->persistent[g], 0);
		STORE(&s->temp_peak[g], 0);
		STORE(&s->settled[g], 0);
	}
	zero_all(figures, ARRAY_LEN(figures));
	STORE(&s->pacer, 0u);
	STORE(&s->task_index, -1);
}

/*
 * The taken bits are written only by whoever holds the slot's lock: a
 * claimer sets its slot's bit once it holds the lock, before it charges
 * anything; a reaper clears a dead process's bit once it has zeroed the slot,
 * before it lets the lock go. So a slot whose bit is clear holds nothing, a
 * live process's bit is set (but for the moment between its lock and its
 * bit), and a bit left set by a process that died is cleared by the reaper.
 */
static void mark_taken(struct gs_ledger *l, uint32_t i, int taken)
{
	uint64_t bit = 1ULL << (i % 64);

	if (taken)
		__atomic_fetch_or(&l->slot_taken[i / 64], bit, __ATOMIC_SEQ_CST);
	else
		__atomic_fetch_and(&l->slot_taken[i / 64], ~bit, __ATOMIC_SEQ_CST);
}

/*
 * With no slot taken, the slots hold nothing, and what the GPUs' counts
 * still hold was left by a process killed in the middle of a charge (or an
 * uncharge, or a clear): set them to zero. Only while this descriptor holds
 * a lock on every slot, so no process can hold or claim one, and so charge,
 * in the meantime (a claimer between its lock and its taken bit holds a
 * lock: the range lock is then refused).
 */
static void reconcile(struct gs_ledger *l, int fd)
{
	struct flock fl = {
		.l_type = F_WRLCK,
		.l_whence = SEEK_SET,
		.l_start = (off_t)offsetof(struct gs_ledger, slot),
		.l_len = (off_t)sizeof(l->slot),
	};
	int stale = 0;

	for (int g = 0; g < GS_MAX_GPUS; g++)
		stale |= LOAD(&l->gpu[g].charged) != 0;
	if (!stale || next_taken(l, 0) != GS_MAX_SLOTS || fcntl(fd, F_OFD_SETLK, &fl) != 0)
		return;
	for (int g = 0; g < GS_MAX_GPUS; g++)
		STORE(&l->gpu[g].charged, 0);
	fl.l_type = F_UNLCK;
	fcntl(fd, F_OFD_SETLK, &fl);
}

/*
 * Free slot `i` if its owner has died: its lock, which the kernel dropped
 * with the owner's last descriptor of the ledger, is free to this one.
 * Whoever takes the lock first clears the slot; a second reaper, or a
 * claimer, finds it held, or finds the slot clear. Describes a used slot
 * into `out` (may be NULL) before it is forgotten. Returns 1 if a process's
 * slot was freed, 0 if the slot held none, -EAGAIN while its owner lives,
 * or another negative errno value.
 */
static int reap_slot(struct gs_ledger *l, int fd, uint32_t i, struct gs_slot_info *out)
{
	struct gs_slot *s = &l->slot[i];
	int used, rc = slot_lock(fd, i, F_WRLCK);

	if (rc == -EACCES)
		rc = -EAGAIN;
	if (rc != 0)
		return rc;
	used = LOAD(&s->state) == GS_SLOT_USED;
	if (used && out != NULL)
		slot_info(s, i, out);
	slot_clear(l, s);
	STORE(&s->state, (uint32_t)GS_SLOT_FREE);
	mark_taken(l, i, 0);
	slot_lock(fd, i, F_UNLCK);
	/* A process killed between its lock and its first write held nothing to report. */
	return used;
}

int gs_ledger_reap(struct gs_ledger *l, int fd, struct gs_slot_info *out, uint32_t max)
{
	int n = 0;

	for_each_taken(l, i) {
		int rc = reap_slot(l, fd, i, out != NULL && (uint32_t)n < max ? &out[n] : NULL);

		if (rc == -EAGAIN)
			continue; /* its owner is alive */
		if (rc < 0)
			return rc;
		n += rc;
	}
	reconcile(l, fd);
	return n;
}

/*
 * Clock `id` in ns. CLOCK_REALTIME is the clock of a task's last_launch_ns
 * (nodemgr's time.time_ns()), CLOCK_MONOTONIC that of a slot's boundary_ns
 * (nodemgr's time.monotonic_ns()).
 */
static uint64_t clock_ns(clockid_t id)
{
	struct timespec ts;

	if (clock_gettime(id, &ts) != 0)
		return 0;
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

int gs_ledger_reap_others(struct gs_ledger *l, int fd, uint32_t own)
{
	int n = 0;

	for_each_taken(l, i) {
		struct gs_slot *s = &l->slot[i];
		struct gs_task *t;
		int rc;

		/* This descriptor's own lock: taking it again would succeed. */
		if (i == own)
			continue;
		/*
		 * A process that launched since nodemgr's last sweep and died
		 * dates its task's last launch, as nodemgr's sweep would have
		 * (gs_ledger_stamp_launches, before its reap). Read before
		 * reap_slot zeroes them; a live owner's slot is left as it is.
		 */
		t = LOAD(&s->launches) != LOAD(&s->launches_seen) ? slot_task(l, s) : NULL;
		rc = reap_slot(l, fd, i, NULL);
		if (rc == -EAGAIN)
			continue;
		if (rc < 0)
			return rc;
		if (rc > 0 && t != NULL)
			STORE(&t->last_launch_ns, clock_ns(CLOCK_REALTIME));
		n += rc;
	}
	return n;
}

/* Take slot `i`, whose lock this descriptor now holds, for `pid` of `task_id`. */
static void slot_take(struct gs_ledger *l, uint32_t i, int32_t pid, const char *task_id)
{
	struct gs_slot *s = &l->slot[i];

	mark_taken(l, i, 1);
	/* Whoever held this slot before is gone: its charges go with it. */
	slot_clear(l, s);
	s->pid = pid;
	memset(s->task_id, 0, sizeof(s->task_id));
	if (task_id != NULL) {
		strncpy(s->task_id, task_id, sizeof(s->task_id) - 1);
		STORE(&s->task_index, gs_ledger_task_find(l, task_id));
	}
	STORE(&s->state, (uint32_t)GS_SLOT_USED);
}

/*
 * Try the locks of slots whose taken bit is `taken`, from slot `first` on
 * (wrapping); take the first whose lock is free. Free slots (bit clear) are
 * found without a system call each: processes starting together look at a
 * few cache lines, not at every slot before theirs, and try the lock of a
 * slot no live process holds (the kernel's search of a file's locks grows
 * with every process holding one). Starting where the pid says spreads
 * processes starting at the same moment over different slots. Returns the
 * slot, -EAGAIN if every lock tried was held, -ENOSPC if none was tried.
 */
static int claim_pass(struct gs_ledger *l, int fd, int32_t pid, const char *task_id, uint32_t first,
		      int taken)
{
	int held = 0;

	for (uint32_t k = 0; k <= GS_MAX_SLOTS / 64; k++) {
		uint32_t w = (first / 64 + k) % (GS_MAX_SLOTS / 64);
		uint64_t word = LOAD(&l->slot_taken[w]);
		uint64_t want = taken ? word : ~word;

		/* The first word is visited twice: from `first` on, last up to it. */
		if (k == 0)
			want &= ~0ULL << (first % 64);
		else if (k == GS_MAX_SLOTS / 64)
			want &= ~(~0ULL << (first % 64));
		while (want != 0) {
			uint32_t i = w * 64 + (uint32_t)__builtin_ctzll(want);
			int rc = slot_lock(fd, i, F_WRLCK);

			want &= want - 1;
			if (rc == -EAGAIN || rc == -EACCES) {
				held = 1;
				continue;
			}
			if (rc != 0)
				return rc;
			slot_take(l, i, pid, task_id);
			return (int)i;
		}
	}
	return held ? -EAGAIN : -ENOSPC;
}

int gs_ledger_claim(struct gs_ledger *l, int fd, int32_t pid, const char *task_id)
{
	uint32_t first = ((uint32_t)pid * 2654435761u) % GS_MAX_SLOTS;

	/*
	 * Up to three tries, a millisecond apart, but only while free slots'
	 * locks are held: by claimers that found them at the same moment, or by
	 * nodemgr holding every slot for a moment (reconcile()). A table whose
	 * slots live processes hold fails at once.
	 */
	for (int pass = 0; pass < 3; pass++) {
		int on_free = claim_pass(l, fd, pid, task_id, first, 0), rc;

		if (on_free != -EAGAIN && on_free != -ENOSPC)
			return on_free;
		/* None free: a slot whose process died and is not reaped yet is taken over. */
		rc = claim_pass(l, fd, pid, task_id, first, 1);
		if (rc != -EAGAIN && rc != -ENOSPC)
			return rc;
		if (on_free != -EAGAIN)
			break;
		usleep(1000);
	}
	return -ENOSPC;
}

/* A granted charge of a task's process: the task's count, and its peak, grow. */
static void task_charged(struct gs_task *t, uint64_t bytes)
{
	uint64_t now, peak;

	if (t == NULL)
		return;
	now = __atomic_add_fetch(&t->used, bytes, __ATOMIC_SEQ_CST);
	/* Relaxed: the peak is a report, and its CAS alone keeps it monotonic. */
	peak = LOAD_REPORT(&t->peak);
	while (now > peak && !__atomic_compare_exchange_n(&t->peak, &peak, now, 0, __ATOMIC_RELAXED,
							  __ATOMIC_RELAXED))
		;
}

/* The slot now holds `held` bytes, all GPUs: its peak follows. */
static void note_peak(struct gs_slot *s, uint64_t held)
{
	/* Relaxed: the peak is a report, and its CAS alone keeps it monotonic. */
	uint64_t peak = LOAD_REPORT(&s->peak);

	while (held > peak && !__atomic_compare_exchange_n(&s->peak, &peak, held, 0,
							   __ATOMIC_RELAXED, __ATOMIC_RELAXED))
		;
}

int gs_ledger_charge(struct gs_ledger *l, uint32_t slot, uint32_t gpu, uint64_t bytes)
{
	struct gs_slot *s;
	uint64_t limit, before;

	if (gpu >= GS_MAX_GPUS || slot >= GS_MAX_SLOTS)
		return -EINVAL;
	limit = LOAD(&l->gpu[gpu].limit);
	if (bytes > limit)
		return -ENOSPC;
	/*
	 * One atomic add decides: of racing charges, each adds to the same
	 * counter and sees every add before its own, so the sum of the granted
	 * ones never passes the limit (both may be refused, never both granted
	 * past it). A refused charge takes its bytes back.
	 *
	 * The GPU's count is raised before the slot's, and an uncharge lowers
	 * the slot's first: a process killed between the two leaves the count
	 * too high, which a reap cannot see and which refuses too much (the safe
	 * side) until the environment next has no process (reconcile()). The
	 * other orders would let a reap take back bytes the count never had.
	 */
	before = __atomic_fetch_add(&l->gpu[gpu].charged, bytes, __ATOMIC_SEQ_CST);
	if (before + bytes < before || before + bytes > limit) {
		__atomic_fetch_sub(&l->gpu[gpu].charged, bytes, __ATOMIC_SEQ_CST);
		return -ENOSPC;
	}
	s = &l->slot[slot];
	__atomic_fetch_add(&s->used[gpu], bytes, __ATOMIC_SEQ_CST);
	note_peak(s, __atomic_add_fetch(&s->held, bytes, __ATOMIC_SEQ_CST));
	task_charged(slot_task(l, s), bytes);
	return 0;
}

/*
 * Saturate: taking back more than is there never turns a figure into a huge
 * number. Returns what was taken.
 */
static uint64_t sub_sat(uint64_t *p, uint64_t bytes)
{
	uint64_t cur = LOAD(p);

	while (!__atomic_compare_exchange_n(p, &cur, cur > bytes ? cur - bytes : 0, 0,
					    __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
		;
	return cur > bytes ? bytes : cur;
}

void gs_ledger_uncharge(struct gs_ledger *l, uint32_t slot, uint32_t gpu, uint64_t bytes)
{
	struct gs_task *t;
	uint64_t taken;

	if (gpu >= GS_MAX_GPUS || slot >= GS_MAX_SLOTS)
		return;
	/* The slot first, then the counts: see gs_ledger_charge. */
	taken = sub_sat(&l->slot[slot].used[gpu], bytes);
	if (taken == 0)
		return;
	/*
	 * Plain subtractions: what the slot held includes `taken`, and so does
	 * the count (a corrupt count that wraps refuses every charge).
	 */
	__atomic_fetch_sub(&l->slot[slot].held, taken, __ATOMIC_SEQ_CST);
	__atomic_fetch_sub(&l->gpu[gpu].charged, taken, __ATOMIC_SEQ_CST);
	t = slot_task(l, &l->slot[slot]);
	if (t != NULL)
		sub_sat(&t->used, taken);
}

/*
 * --- classification: each called by the slot's owner only -------------------------
 *
 * The owner is a process, and its threads free and allocate concurrently:
 * read-modify-writes of a slot's figures are compare-and-swap loops.
 */

uint64_t gs_ledger_boundary(struct gs_ledger *l, uint32_t slot, uint64_t iterations)
{
	struct gs_slot *s;
	struct gs_task *t;
	uint64_t seen;

	if (slot >= GS_MAX_SLOTS)
		return iterations;
	s = &l->slot[slot];
	for (int g = 0; g < GS_MAX_GPUS; g++)
		STORE(&s->persistent[g], LOAD(&s->used[g]));
	STORE(&s->boundary_ns, clock_ns(CLOCK_MONOTONIC));
	STORE(&s->iterations, iterations);
	t = slot_task(l, s);
	if (t == NULL)
		return iterations;
	seen = LOAD(&t->iterations);
	while (seen < iterations &&
	       !__atomic_compare_exchange_n(&t->iterations, &seen, iterations, 0, __ATOMIC_SEQ_CST,
					    __ATOMIC_SEQ_CST))
		;
	return seen > iterations ? seen : iterations;
}

void gs_ledger_persist(struct gs_ledger *l, uint32_t slot, uint32_t gpu, uint64_t bytes)
{
	uint64_t *p, cur;

	if (gpu >= GS_MAX_GPUS || slot >= GS_MAX_SLOTS)
		return;
	p = &l->slot[slot].persistent[gpu];
	cur = LOAD(p);
	while (!__atomic_compare_exchange_n(p, &cur, cur + bytes < cur ? UINT64_MAX : cur + bytes,
					    0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
		;
}

void gs_ledger_unpersist(struct gs_ledger *l, uint32_t slot, uint32_t gpu, uint64_t bytes)
{
	if (gpu < GS_MAX_GPUS && slot < GS_MAX_SLOTS)
		sub_sat(&l->slot[slot].persistent[gpu], bytes);
}

void gs_ledger_note_temp(struct gs_ledger *l, uint32_t slot, uint32_t gpu)
{
	struct gs_slot *s;
	uint64_t used, pers, temp, peak;

	if (gpu >= GS_MAX_GPUS || slot >= GS_MAX_SLOTS)
		return;
	s = &l->slot[slot];
	used = LOAD(&s->used[gpu]);
	pers = LOAD(&s->persistent[gpu]);
	temp = used > pers ? used - pers : 0;
	peak = LOAD(&s->temp_peak[gpu]);
	while (temp > peak && !__atomic_compare_exchange_n(&s->temp_peak[gpu], &peak, temp, 0,
							   __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
		;
}

void gs_ledger_settle(struct gs_ledger *l, uint32_t slot)
{
	struct gs_slot *s;

	if (slot >= GS_MAX_SLOTS)
		return;
	s = &l->slot[slot];
	for (int g = 0; g < GS_MAX_GPUS; g++)
		STORE(&s->settled[g], LOAD(&s->persistent[g]));
	__atomic_fetch_add(&s->releases, 1, __ATOMIC_SEQ_CST);
}
