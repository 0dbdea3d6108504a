/*
 * Processes charging one ledger file at once, as the shim's do, and killed
 * in the middle of it. Usage:
 *
 *   ledger_procs fit PATH PROCS ROUNDS
 *	PROCS processes, each claiming its own slot, charge 3 MiB and give it
 *	back ROUNDS times against a limit that fits one such charge. Each
 *	granted charge is counted in a shared counter while it is held.
 *	Prints "limit=L fits=1 max_held=M granted=G refused=R charged=C used=U"
 *	(C and U once all are done): max_held must never pass `fits`.
 *
 *   ledger_procs kill PATH PROCS ROUNDS
 *	ROUNDS times: PROCS processes charge and uncharge random sizes without
 *	end; after a moment half of them are killed (SIGKILL, wherever they
 *	are), the dead slots are reaped as nodemgr does, and the survivors are
 *	stopped between two calls. Prints per round
 *	"round=N charged=C used=U killed=K" where C must be at least U (a kill
 *	may leave the count too high, by at most one charge per killed process,
 *	never too low); then all are killed and reaped and a last line
 *	"idle charged=C used=U" must read 0 and 0.
 *
 *   ledger_procs reclaim PATH PROCS ROUNDS
 *	What a refused charge of the shim does (gs_ledger_reap_others). Each
 *	round, PROCS victims charge random sizes, filling the limit, and stop;
 *	half of them are killed (SIGKILL). A survivor alone charges what they
 *	held: refused, it reaps, and retried the charge is granted. Then the
 *	other half are killed, and PROCS racers charge what those held between
 *	them, each reaping and retrying once if refused, while a reaper frees
 *	dead slots as nodemgr does. Prints per round "round=N solo_rc=S
 *	solo_reaped=K stamped=1 killed=K2 reaped=R granted=G charged=C used=U": S is 1
 *	(refused, then granted after freeing the K dead slots, K being half of
 *	PROCS) and stamping the task's last launch (the victims launched, and no
 *	sweep saw it), every dead slot of the race is freed exactly once (R is K2) and
 *	the count is exact (C is U) once all are quiet; then "idle charged=C
 *	used=U" after all are killed and reaped.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ledger.h"

#define MIB (1ULL << 20)
#define CHUNK (3 * MIB)
#define FITS 1
#define MAX_PROCS 256

/* What the processes share besides the ledger: counters and the stop flag. */
struct shared {
	unsigned long held, max_held, granted, refused;
	unsigned long reaped; /* reclaim: dead slots freed by racers and the reaper */
	unsigned long done;   /* reclaim: racers done */
	int solo_rc;	      /* reclaim: the survivor's charge_reclaiming() */
	int claimed;	      /* children that hold their slot */
	int go;		      /* set once all have: they start together */
	int stop;
	int stopped;
};

static struct gs_ledger *map_ledger(const char *path, int *fd)
{
	void *m;

	*fd = open(path, O_RDWR | O_CLOEXEC);
	if (*fd < 0)
		return NULL;
	m = mmap(NULL, sizeof(struct gs_ledger), PROT_READ | PROT_WRITE, MAP_SHARED, *fd, 0);
	return m == MAP_FAILED ? NULL : m;
}

static void fail(const char *what)
{
	perror(what);
	exit(1);
}

/* A child: its own descriptor and slot, as a process under the shim has. */
static uint32_t child_slot(const char *path, struct shared *sh, struct gs_ledger **l)
{
	int fd, s;

	*l = map_ledger(path, &fd);
	if (*l == NULL)
		fail("child map");
	s = gs_ledger_claim(*l, fd, (int32_t)getpid(), "procs");
	if (s < 0) {
		fprintf(stderr, "claim: %d\n", s);
		exit(1);
	}
	__atomic_fetch_add(&sh->claimed, 1, __ATOMIC_RELEASE);
	while (!__atomic_load_n(&sh->go, __ATOMIC_ACQUIRE))
		sched_yield();
	return (uint32_t)s;
}

static void fit_child(const char *path, struct shared *sh, long rounds)
{
	struct gs_ledger *l;
	uint32_t slot = child_slot(path, sh, &l);

	for (long i = 0; i < rounds; i++) {
		unsigned long now, max;

		if (gs_ledger_charge(l, slot, 0, CHUNK) != 0) {
			__atomic_fetch_add(&sh->refused, 1, __ATOMIC_RELAXED);
			continue;
		}
		now = __atomic_add_fetch(&sh->held, 1, __ATOMIC_SEQ_CST);
		max = __atomic_load_n(&sh->max_held, __ATOMIC_RELAXED);
		while (now > max &&
		       !__atomic_compare_exchange_n(&sh->max_held, &max, now, 0, __ATOMIC_RELAXED,
						    __ATOMIC_RELAXED))
			;
		__atomic_fetch_add(&sh->granted, 1, __ATOMIC_RELAXED);
		/* Held a moment, so that others try while it is. */
		for (volatile int spin = 0; spin < 200; spin++)
			;
		/* Given up before it is given back: the count never lags the ledger. */
		__atomic_fetch_sub(&sh->held, 1, __ATOMIC_SEQ_CST);
		gs_ledger_uncharge(l, slot, 0, CHUNK);
	}
	_exit(0);
}

static void kill_child(const char *path, struct shared *sh, unsigned seed)
{
	struct gs_ledger *l;
	uint32_t slot = child_slot(path, sh, &l);
	uint64_t held[4] = { 0 };

	for (unsigned n = seed;; n = n * 1103515245u + 12345u) {
		uint64_t bytes = ((n >> 8) % 64 + 1) * MIB;
		int k = (int)((n >> 20) & 3);

		if (__atomic_load_n(&sh->stop, __ATOMIC_ACQUIRE)) {
			__atomic_fetch_add(&sh->stopped, 1, __ATOMIC_RELEASE);
			pause();
		}
		if (held[k] != 0) {
			gs_ledger_uncharge(l, slot, 0, held[k]);
			held[k] = 0;
		} else if (gs_ledger_charge(l, slot, 0, bytes) == 0) {
			held[k] = bytes;
		}
	}
}

static struct shared *shared_page(void)
{
	void *m = mmap(NULL, sizeof(struct shared), PROT_READ | PROT_WRITE,
		       MAP_SHARED | MAP_ANONYMOUS, -1, 0);

	if (m == MAP_FAILED)
		fail("mmap");
	return m;
}

static void nap_us(long us)
{
	struct timespec ts = { .tv_sec = us / 1000000, .tv_nsec = (us % 1000000) * 1000 };

	nanosleep(&ts, NULL);
}

/* Wait until all `procs` children hold their slot, then let them go. */
static void start_together(struct shared *sh, int procs)
{
	while (__atomic_load_n(&sh->claimed, __ATOMIC_ACQUIRE) < procs)
		nap_us(100);
	__atomic_store_n(&sh->go, 1, __ATOMIC_RELEASE);
}

static int run_fit(const char *path, struct gs_ledger *l, int procs, long rounds)
{
	struct shared *sh = shared_page();

	gs_ledger_set_limit(l, 0, FITS * CHUNK);
	for (int i = 0; i < procs; i++) {
		pid_t p = fork();

		if (p < 0)
			fail("fork");
		if (p == 0)
			fit_child(path, sh, rounds);
	}
	start_together(sh, procs);
	for (int i = 0; i < procs; i++) {
		int st;

		if (wait(&st) < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
			fprintf(stderr, "a child failed\n");
			return 1;
		}
	}
	printf("limit=%llu fits=%d max_held=%lu granted=%lu refused=%lu charged=%llu used=%llu\n",
	       (unsigned long long)(FITS * CHUNK), FITS, sh->max_held, sh->granted, sh->refused,
	       (unsigned long long)gs_ledger_charged(l, 0),
	       (unsigned long long)gs_ledger_used(l, 0));
	return 0;
}

static int run_kill(const char *path, struct gs_ledger *l, int fd, int procs, long rounds)
{
	struct shared *sh = shared_page();
	pid_t pid[MAX_PROCS];

	gs_ledger_set_limit(l, 0, 256 * MIB * (uint64_t)procs);
	for (long r = 0; r < rounds; r++) {
		int killed = 0;

		sh->stop = 0;
		sh->stopped = 0;
		sh->claimed = 0;
		sh->go = 0;
		for (int i = 0; i < procs; i++) {
			pid[i] = fork();
			if (pid[i] < 0)
				fail("fork");
			if (pid[i] == 0)
				kill_child(path, sh, (unsigned)(r * MAX_PROCS + i + 1));
		}
		start_together(sh, procs);
		nap_us(20000 + (r % 7) * 3000);
		for (int i = 0; i < procs; i += 2, killed++)
			kill(pid[i], SIGKILL);
		for (int i = 0; i < procs; i += 2)
			waitpid(pid[i], NULL, 0);
		if (gs_ledger_reap(l, fd, NULL, 0) != killed) {
			fprintf(stderr, "round %ld: reaped other than %d\n", r, killed);
			return 1;
		}
		/* The survivors stop between two calls: the ledger is quiet. */
		__atomic_store_n(&sh->stop, 1, __ATOMIC_RELEASE);
		while (__atomic_load_n(&sh->stopped, __ATOMIC_ACQUIRE) < procs - killed)
			nap_us(100);
		printf("round=%ld charged=%llu used=%llu killed=%d\n", r,
		       (unsigned long long)gs_ledger_charged(l, 0),
		       (unsigned long long)gs_ledger_used(l, 0), killed);
		for (int i = 1; i < procs; i += 2) {
			kill(pid[i], SIGKILL);
			waitpid(pid[i], NULL, 0);
		}
		gs_ledger_reap(l, fd, NULL, 0);
	}
	printf("idle charged=%llu used=%llu\n", (unsigned long long)gs_ledger_charged(l, 0),
	       (unsigned long long)gs_ledger_used(l, 0));
	return 0;
}

/* A victim: charges its size, says so, and stops. */
static void victim_child(const char *path, struct shared *sh, uint64_t bytes)
{
	struct gs_ledger *l;
	int fd, s;

	l = map_ledger(path, &fd);
	if (l == NULL)
		fail("victim map");
	s = gs_ledger_claim(l, fd, (int32_t)getpid(), "procs");
	if (s < 0 || gs_ledger_charge(l, (uint32_t)s, 0, bytes) != 0)
		_exit(1);
	/* A kernel launch, counted as the shim counts it: never seen by a sweep. */
	__atomic_fetch_add(&l->slot[s].launches, 1, __ATOMIC_SEQ_CST);
	__atomic_fetch_add(&sh->claimed, 1, __ATOMIC_RELEASE);
	for (;;)
		pause();
}

/*
 * A charge as the shim makes it: refused, the dead processes' slots are
 * freed (counted into *reaped) and it is tried once more. Returns 0 if
 * granted, 1 if granted only after the reap, -1 if refused.
 */
static int charge_reclaiming(struct gs_ledger *l, int fd, uint32_t slot, uint64_t bytes,
			     unsigned long *reaped)
{
	int n;

	if (gs_ledger_charge(l, slot, 0, bytes) == 0)
		return 0;
	n = gs_ledger_reap_others(l, fd, slot);
	if (n < 0)
		fail("reap_others");
	__atomic_fetch_add(reaped, (unsigned long)n, __ATOMIC_SEQ_CST);
	return gs_ledger_charge(l, slot, 0, bytes) == 0 ? 1 : -1;
}

/* A racer (or the solo survivor): claims, charges `bytes` reclaiming, reports, stops. */
static void racer_child(const char *path, struct shared *sh, uint64_t bytes, int solo)
{
	struct gs_ledger *l;
	int fd, s, rc;

	l = map_ledger(path, &fd);
	if (l == NULL)
		fail("racer map");
	s = gs_ledger_claim(l, fd, (int32_t)getpid(), "procs");
	if (s < 0)
		_exit(1);
	if (!solo) {
		__atomic_fetch_add(&sh->claimed, 1, __ATOMIC_RELEASE);
		while (!__atomic_load_n(&sh->go, __ATOMIC_ACQUIRE))
			sched_yield();
	}
	rc = charge_reclaiming(l, fd, (uint32_t)s, bytes, &sh->reaped);
	__atomic_fetch_add(rc >= 0 ? &sh->granted : &sh->refused, 1, __ATOMIC_SEQ_CST);
	/* The solo survivor must have been refused first: the dead still held the limit. */
	if (solo) {
		sh->solo_rc = rc;
		_exit(0);
	}
	__atomic_fetch_add(&sh->done, 1, __ATOMIC_RELEASE);
	for (;;)
		pause();
}

/* nodemgr's sweep, as fast as it goes, until stopped. */
static void reaper_child(const char *path, struct shared *sh)
{
	struct gs_ledger *l;
	int fd;

	l = map_ledger(path, &fd);
	if (l == NULL)
		fail("reaper map");
	__atomic_fetch_add(&sh->claimed, 1, __ATOMIC_RELEASE);
	/* A last pass once stopped: what no racer freed is freed by the sweep. */
	for (;;) {
		int stopping = __atomic_load_n(&sh->stop, __ATOMIC_ACQUIRE);
		int n = gs_ledger_reap(l, fd, NULL, 0);

		if (n < 0)
			fail("reap");
		__atomic_fetch_add(&sh->reaped, (unsigned long)n, __ATOMIC_SEQ_CST);
		if (stopping)
			_exit(0);
	}
}

static pid_t spawn(void)
{
	pid_t p;

	/* A child must not inherit, and print again, a line not yet written. */
	fflush(stdout);
	p = fork();

	if (p < 0)
		fail("fork");
	return p;
}

static void kill_all(pid_t *pid, int n)
{
	for (int i = 0; i < n; i++)
		kill(pid[i], SIGKILL);
	for (int i = 0; i < n; i++)
		waitpid(pid[i], NULL, 0);
}

static int run_reclaim(const char *path, struct gs_ledger *l, int fd, int procs, long rounds)
{
	struct shared *sh = shared_page();
	pid_t victim[MAX_PROCS], racer[MAX_PROCS + 1], solo, reaper;
	uint64_t size[MAX_PROCS], first = 0, second = 0;
	int half = procs / 2, task;

	for (long r = 0; r < rounds; r++) {
		int st;

		memset(sh, 0, sizeof(*sh));
		gs_ledger_set_limit(l, 0, UINT64_MAX);
		gs_ledger_task_remove(l, "procs");
		task = gs_ledger_task_add(l, "procs");
		if (task < 0)
			fail("task entry");
		for (int i = 0; i < procs; i++) {
			size[i] = ((uint64_t)(r * 7 + i * 13) % 64 + 1) * MIB;
			if (i < half)
				first += size[i];
			else
				second += size[i];
			victim[i] = spawn();
			if (victim[i] == 0)
				victim_child(path, sh, size[i]);
		}
		while (__atomic_load_n(&sh->claimed, __ATOMIC_ACQUIRE) < procs)
			nap_us(100);
		/* The victims fill the limit: nothing more fits until the dead are reaped. */
		gs_ledger_set_limit(l, 0, first + second);
		kill_all(victim, half);
		solo = spawn();
		if (solo == 0)
			racer_child(path, sh, first, 1);
		if (waitpid(solo, &st, 0) < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
			fprintf(stderr, "round %ld: the survivor failed\n", r);
			return 1;
		}
		printf("round=%ld solo_rc=%d solo_reaped=%lu stamped=%d ", r, sh->solo_rc,
		       sh->reaped, l->task[task].last_launch_ns != 0);
		/* The survivor has exited: its slot is dead too, and is reaped with the second half. */
		sh->reaped = 0;
		sh->granted = 0;
		sh->claimed = 0;
		kill_all(victim + half, procs - half);
		reaper = spawn();
		if (reaper == 0)
			reaper_child(path, sh);
		for (int i = 0; i < procs; i++) {
			racer[i] = spawn();
			if (racer[i] == 0)
				racer_child(path, sh, second / (uint64_t)procs, 0);
		}
		while (__atomic_load_n(&sh->claimed, __ATOMIC_ACQUIRE) < procs + 1)
			nap_us(100);
		__atomic_store_n(&sh->go, 1, __ATOMIC_RELEASE);
		while (__atomic_load_n(&sh->done, __ATOMIC_ACQUIRE) < (unsigned long)procs)
			nap_us(100);
		__atomic_store_n(&sh->stop, 1, __ATOMIC_RELEASE);
		waitpid(reaper, NULL, 0);
		printf("killed=%d reaped=%lu granted=%lu charged=%llu used=%llu\n",
		       procs - half + 1, sh->reaped, sh->granted,
		       (unsigned long long)gs_ledger_charged(l, 0),
		       (unsigned long long)gs_ledger_used(l, 0));
		kill_all(racer, procs);
		gs_ledger_reap(l, fd, NULL, 0);
		first = second = 0;
	}
	printf("idle charged=%llu used=%llu\n", (unsigned long long)gs_ledger_charged(l, 0),
	       (unsigned long long)gs_ledger_used(l, 0));
	return 0;
}

int main(int argc, char **argv)
{
	struct gs_ledger *l;
	int procs, fd;
	long rounds;

	if (argc != 5 || (strcmp(argv[1], "fit") != 0 && strcmp(argv[1], "kill") != 0 &&
			  strcmp(argv[1], "reclaim") != 0)) {
		fprintf(stderr, "usage: ledger_procs fit|kill|reclaim PATH PROCS ROUNDS\n");
		return 2;
	}
	procs = atoi(argv[3]);
	rounds = atol(argv[4]);
	if (procs < 2 || procs > MAX_PROCS || rounds < 1) {
		fprintf(stderr, "PROCS: 2 to %d; ROUNDS: at least 1\n", MAX_PROCS);
		return 2;
	}
	fd = open(argv[2], O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
	if (fd < 0 || ftruncate(fd, sizeof(struct gs_ledger)) != 0)
		fail(argv[2]);
	close(fd);
	l = map_ledger(argv[2], &fd);
	if (l == NULL || gs_ledger_init(l, 1) != 0)
		fail("ledger");
	if (strcmp(argv[1], "fit") == 0)
		return run_fit(argv[2], l, procs, rounds);
	if (strcmp(argv[1], "reclaim") == 0)
		return run_reclaim(argv[2], l, fd, procs, rounds);
	return run_kill(argv[2], l, fd, procs, rounds);
}
