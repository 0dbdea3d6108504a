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
	int claimed; /* children that hold their slot */
	int go;	     /* set once all have: they start together */
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

int main(int argc, char **argv)
{
	struct gs_ledger *l;
	int procs, fd;
	long rounds;

	if (argc != 5 || (strcmp(argv[1], "fit") != 0 && strcmp(argv[1], "kill") != 0)) {
		fprintf(stderr, "usage: ledger_procs fit|kill PATH PROCS ROUNDS\n");
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
	return run_kill(argv[2], l, fd, procs, rounds);
}
