/*
 * The pacer (docs/compute.md): one thread per process whose task has a
 * compute schedule, in a ledger where nodemgr turned compute control on:
 * started when the process claims its slot if its task has one then, else
 * at its first launch after nodemgr gave it one (GS_PAUSE_COMPUTE in the
 * task's pause word sends that launch out of line). It keeps
 * gs_compute_gate, the word every launch reads beside the pause word.
 * Nothing on the launch path asks anyone anything: the task entry
 * carries the schedule nodemgr computed, and windows are aligned to
 * CLOCK_MONOTONIC, which every process of the node shares.
 *
 * While the task has no schedule (it was taken away) the thread sleeps on
 * the entry's sequence word (a futex nodemgr wakes after each change) and
 * the gate stays open.
 * With a window it loops: gate closed until the window starts, open until
 * its end less the debt, closed again; then it synchronises the process's
 * primary contexts with the driver's own entries, so the completion of the
 * work the window launched is known: what ran past the window's end
 * (overrun) is debt that shortens the next windows (gs_pace_open,
 * gs_pace_close), so device time per period converges to the window's
 * length. Inside the window the gate opens in bursts, each closed until its
 * work has run, so that what runs past the end is a burst's work. No
 * synchronisation while a stream captures (quiet_begin): that window is
 * counted unmeasured.
 *
 * Latency classes: a latency-sensitive task's pacer stamps the board entry
 * of each of its GPUs whenever its slot's launch counter moved since its
 * last look; a best-effort task's pacer, outside its own window, opens the
 * gate only while every board entry of its GPUs is older than the idle
 * time, and closes it (and synchronises) as soon as one is not. Both look
 * every poll interval.
 *
 * Memory order: the gate is process-local. The pacer stores it; launches
 * load it relaxed (nothing is published through it) and, to wait, announce
 * themselves in gate_waiters and read it again, both seq_cst, while the
 * pacer's opening stores the burst's end, then the gate's new value, then
 * reads gate_waiters, all seq_cst: of the two, one sees the other, so a
 * wake is never lost (and the futex wait itself fails at once if the word
 * changed, as every store changes it). A launch that sees the new value
 * sees the new end. The pacer's state is
 * written before the thread is created, and after that by the thread
 * alone; `stopping` is written under stop_mu, which the pacer holds while
 * it closes the gate or calls the driver, so that after the exit handler
 * the gate stays open and the driver is left alone.
 */
#include <signal.h>
#include <sys/prctl.h>

#include "pacer.h"

#define GS_SECOND 1000000000ULL
#define GS_POLL_DEFAULT 500000ULL /* when an entry says none */
/* Debt is capped: one long stall must not starve the task for long. */
#define GS_MAX_DEBT_PERIODS 10

uint32_t gs_compute_gate;
uint64_t gs_burst_end = UINT64_MAX;
static uint32_t gate_waiters; /* launches in wait_to_launch's futex wait */
/* The pacer runs: set under start_mu (release), read by launches without it (acquire). */
static int pacer_up;

static pthread_mutex_t stop_mu = PTHREAD_MUTEX_INITIALIZER;
/* Orders starting the pacer: at a claim, or at a launch that finds GS_PAUSE_COMPUTE. */
static pthread_mutex_t start_mu = PTHREAD_MUTEX_INITIALIZER;

static struct {
	struct gs_ledger *ledger;
	int task, slot;
	uint32_t *sched;    /* the task entry's sequence word */
	uint32_t *pause;    /* its pause word: gs_ledger_pause_word_names */
	uint64_t *launches; /* the slot's launch counter */
	int running;	    /* a pacer thread runs for this process */
	int stopping;	    /* under stop_mu: the process exits */
	int at_exit;	    /* the exit handler is registered */
	uint32_t wake_bit;  /* the futex bitset bit this process's pacer sleeps with, beside 1 */
	char board_path[PATH_MAX];
	struct gs_board *board; /* the pacer thread's: mapped at first need */
	int board_tried, board_writable;
} pacer;

/* How long a burst keeps the gate open, and how many launches it may make. */
struct burst {
	uint64_t ns;
	uint64_t launches;
};

/* The window and gate as the pacer thread last set them: its alone. */
struct pace {
	uint32_t seq;	     /* the schedule's sequence it last acted on */
	uint64_t last_start; /* the start of the last window it handled */
	uint64_t close_at;   /* while a window is open, when it closes; else 0 */
	int open;	     /* the gate is open */
	int in_window;	     /* it was opened for a window (its overrun is debt) */
	uint64_t opened_at;
	uint64_t launches_at_open;
	uint64_t launches_seen; /* at the last look for the board */
	uint64_t spill_ns;	/* overrun a window may have without debt: a burst's aim */
	uint64_t debt;
	uint64_t max_debt;
	struct burst be_burst;	   /* best-effort beside LS, outside its window */
	struct burst window_burst; /* inside the task's own window */
	/* Of the window under way: launched in a burst of it; a burst unmeasured (no more). */
	int window_launched, window_unmeasured;
};

static uint64_t now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * GS_SECOND + (uint64_t)ts.tv_nsec;
}

static uint64_t launches_now(void)
{
	return __atomic_load_n(pacer.launches, __ATOMIC_RELAXED);
}

/* The open burst has made all its launches (gs_burst_end). */
static int burst_spent(void)
{
	return launches_now() >= __atomic_load_n(&gs_burst_end, __ATOMIC_SEQ_CST);
}

/*
 * The gate's next value: every change makes a new one (closed odd, open even), so a launch
 * waiting on the value it saw is woken by any change, a close and open in between
 * included. A CAS: the exit handler opens it too.
 */
static void gate_set(uint32_t closed)
{
	uint32_t cur = __atomic_load_n(&gs_compute_gate, __ATOMIC_SEQ_CST), next;

	do
		next = ((cur | GS_GATE_CLOSED) + 1u) | closed;
	while (!__atomic_compare_exchange_n(&gs_compute_gate, &cur, next, 0, __ATOMIC_SEQ_CST,
					    __ATOMIC_SEQ_CST));
}

/* Open until the process's launch counter reaches `end` (UINT64_MAX: for good). */
static void gate_open_until(uint64_t end)
{
	/* Stored before the gate: a launch that sees the gate open sees this end. */
	__atomic_store_n(&gs_burst_end, end, __ATOMIC_SEQ_CST);
	gate_set(0);
	if (__atomic_load_n(&gate_waiters, __ATOMIC_SEQ_CST) != 0)
		syscall(SYS_futex, &gs_compute_gate, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

static void gate_open(void)
{
	gate_open_until(UINT64_MAX);
}

/* Returns 0 when the process exits: then the gate stays open. */
static int gate_close(void)
{
	int closed;

	pthread_mutex_lock(&stop_mu);
	closed = !pacer.stopping;
	if (closed)
		gate_set(GS_GATE_CLOSED);
	pthread_mutex_unlock(&stop_mu);
	return closed;
}

/*
 * Wait for the work the process has queued: when it completed
 * (CLOCK_MONOTONIC), or 0 when it could not be measured (a capture under
 * way, the process exiting).
 */
static uint64_t work_done(void)
{
	uint64_t done = 0;

	if (!quiet_begin())
		return 0;
	pthread_mutex_lock(&stop_mu);
	if (!pacer.stopping && sync_primaries() > 0)
		done = now_ns();
	pthread_mutex_unlock(&stop_mu);
	quiet_end();
	return done;
}

/*
 * The gate closes at `now`: what the open time gave the process, measured, into its slot.
 * Returns when the work the open time launched completed (0: none launched, or unmeasured).
 */
static uint64_t close_and_measure(struct pace *p, uint64_t now)
{
	struct gs_pacing d = { 0 };
	uint64_t done = 0;

	if (!gate_close())
		return 0;
	p->open = 0;
	/* A window counts once the process launched in it; one with a burst unmeasured, so. */
	d.windows = p->in_window && p->window_launched;
	d.unmeasured = p->in_window && p->window_unmeasured;
	if (launches_now() != p->launches_at_open) {
		done = work_done();
		d.windows = p->in_window;
		d.device_ns = now - p->opened_at;
		if (done == 0) {
			d.unmeasured = (uint64_t)p->in_window;
		} else {
			d.overrun_ns = done > now ? done - now : 0;
			if (p->in_window)
				gs_pace_close(now + p->spill_ns, done, p->max_debt, &p->debt);
		}
		d.device_ns += d.overrun_ns;
	}
	p->in_window = 0;
	gs_ledger_pacing_add(pacer.ledger, (uint32_t)pacer.slot, &d);
	return done;
}

/*
 * A best-effort task beside a latency-sensitive one launches in bursts while LS is idle:
 * the gate opens for be_burst.ns, then closes until what the burst launched has run. The
 * device runs work in the order it was queued, so an LS kernel launched during a burst
 * waits at most for that burst's work (a real GPU's time slices between contexts are of
 * the same order), never for all a training step queues at once. The burst adapts so its
 * work takes about half of ls_idle on the device: shorter when it ran longer, longer when
 * it ran much shorter, within [GS_BURST_MIN_NS, poll]. It is bounded in launches too
 * (halved and doubled alike, from 1): a pacer woken late (a busy CPU) would otherwise let
 * a burst launch for as long as it slept.
 */
#define GS_BURST_MIN_NS 20000ULL
#define GS_BURST_FIRST_LAUNCHES 8
#define GS_BURST_MAX_LAUNCHES 65536

static void burst_ended(struct burst *b, uint64_t aim, uint64_t most, uint64_t opened,
			uint64_t done)
{
	uint64_t took = done > opened ? done - opened : 0;

	if (done == 0 || aim == 0)
		return;
	if (took > aim) {
		b->ns = b->ns / 2 > GS_BURST_MIN_NS ? b->ns / 2 : GS_BURST_MIN_NS;
		b->launches = b->launches > 1 ? b->launches / 2 : 1;
	} else if (took < aim / 2) {
		b->ns = b->ns * 2 < most ? b->ns * 2 : most;
		if (b->launches < GS_BURST_MAX_LAUNCHES)
			b->launches *= 2;
	}
}

/*
 * Inside its window a task launches in bursts as well: the gate closes once a burst has
 * launched, opens again once that work has run. What the task has queued when its window
 * ends runs in the next task's window, ahead of that task's kernels (the device runs work
 * in the order it was queued): a burst's work, not a whole training step's, so neither
 * task loses more than that per window. The burst adapts as a best-effort one does, so
 * that its work takes about GS_WINDOW_BURSTS_PER_PERIOD-th of the period (a quarter of
 * the window, if less); each costs the device the moment between its work's end and the
 * next burst's first kernel. An overrun up to that aim is not debt: every window ends with
 * about that much, which runs at the start of the next task's window, so each task gets
 * back what the one before took; charged as debt too, it would be lost twice.
 */
#define GS_WINDOW_BURSTS_PER_PERIOD 25

static uint64_t window_burst_aim(const struct gs_schedule *s)
{
	uint64_t aim = s->period_ns / GS_WINDOW_BURSTS_PER_PERIOD;

	return s->length_ns / 4 < aim ? s->length_ns / 4 : aim;
}

/*
 * Open the gate for a window or a burst (`b`: bounded in its launches) or, `b` NULL, for
 * good. Already open, it stays open as it is, but for a bound left from a burst: open for
 * good (a best-effort task whose LS neighbour ended) lifts it, or the launch that reached
 * it would wait for a burst's end that no pacer looks for.
 */
static void open_for(struct pace *p, uint64_t now, int window, const struct burst *b)
{
	if (p->open && b == NULL && __atomic_load_n(&gs_burst_end, __ATOMIC_SEQ_CST) != UINT64_MAX)
		gate_open();
	if (!p->open) {
		/*
		 * Read before the gate opens: a launch made at once counts in this burst,
		 * and the burst's end and its count start from the same value.
		 */
		p->launches_at_open = launches_now();
		gate_open_until(b != NULL ? p->launches_at_open + b->launches : UINT64_MAX);
		p->open = 1;
		p->opened_at = now;
	}
	p->in_window = window;
}

/* The board, mapped on first need; NULL where the process was given none or cannot map it. */
static struct gs_board *board(void)
{
	struct stat st;
	void *map;
	int fd, prot = PROT_READ | PROT_WRITE;

	if (pacer.board_tried)
		return pacer.board;
	pacer.board_tried = 1;
	if (pacer.board_path[0] == '\0')
		return NULL;
	fd = open(pacer.board_path, O_RDWR | O_CLOEXEC);
	if (fd < 0) {
		prot = PROT_READ; /* enough to yield to LS; not to publish */
		fd = open(pacer.board_path, O_RDONLY | O_CLOEXEC);
	}
	if (fd < 0)
		return NULL;
	if (fstat(fd, &st) == 0 && (size_t)st.st_size >= sizeof(struct gs_board)) {
		map = mmap(NULL, sizeof(struct gs_board), prot, MAP_SHARED, fd, 0);
		if (map != MAP_FAILED &&
		    (madvise(map, sizeof(struct gs_board), MADV_DONTFORK) != 0 ||
		     gs_board_check(map, sizeof(struct gs_board)) != 0)) {
			munmap(map, sizeof(struct gs_board));
			map = MAP_FAILED;
		}
		if (map != MAP_FAILED) {
			pacer.board = map;
			pacer.board_writable = (prot & PROT_WRITE) != 0;
		}
	}
	close(fd);
	return pacer.board;
}

static uint64_t earliest(uint64_t a, uint64_t b)
{
	return a < b ? a : b;
}

/*
 * Whether the open burst `b` is over at `now` (its time up, or its launches made) with
 * something launched, so that it ends; one that launched nothing starts its time again.
 */
static int burst_due(struct pace *p, const struct burst *b, uint64_t now)
{
	if (!p->open || (now < p->opened_at + b->ns && !burst_spent()))
		return 0;
	if (launches_now() != p->launches_at_open)
		return 1;
	p->opened_at = now; /* nothing launched: no burst to end yet */
	return 0;
}

/*
 * A burst inside the window ends now: the gate closes until its work has run. The
 * window goes on, and the gate opens again, unless its end passed meanwhile (the time
 * past it is debt, as at a window's end).
 */
static void window_burst_ended(struct pace *p, const struct gs_schedule *s)
{
	struct gs_pacing d = { 0 };
	uint64_t opened = p->opened_at, done;

	if (!gate_close())
		return;
	p->open = 0;
	p->window_launched = 1;
	done = work_done();
	if (done == 0) {
		/* Unmeasured (a capture): no more bursts in this window. */
		p->window_unmeasured = 1;
		open_for(p, now_ns(), 1, NULL);
		return;
	}
	burst_ended(&p->window_burst, window_burst_aim(s), s->length_ns, opened, done);
	if (done >= p->close_at) {
		d.windows = 1;
		d.unmeasured = (uint64_t)p->window_unmeasured;
		d.overrun_ns = done - p->close_at;
		gs_pace_close(p->close_at + p->spill_ns, done, p->max_debt, &p->debt);
		d.device_ns = p->close_at - opened + d.overrun_ns;
		p->in_window = 0;
	} else {
		d.device_ns = done - opened;
		open_for(p, now_ns(), 1, &p->window_burst);
	}
	gs_ledger_pacing_add(pacer.ledger, (uint32_t)pacer.slot, &d);
}

/*
 * One look at schedule `s` (sequence `seq`) at `now`: set the gate, measure
 * what a closing window gave, stamp the board. Returns when to look again
 * (CLOCK_MONOTONIC) unless the schedule changes first.
 */
static uint64_t step(struct pace *p, const struct gs_schedule *s, uint32_t seq, uint64_t now)
{
	int window = (s->flags & GS_COMPUTE_WINDOW) && s->period_ns != 0;
	uint64_t poll = s->poll_ns != 0 ? s->poll_ns : GS_POLL_DEFAULT;
	uint64_t wake = now + GS_SECOND, start;
	struct gs_board *b = NULL;
	int want;

	if (s->flags & (GS_COMPUTE_LS_PUBLISH | GS_COMPUTE_YIELD_LS))
		b = board();
	/* A window that ended, or was opened under another schedule, closes and is measured. */
	if (p->open && p->in_window && (seq != p->seq || now >= p->close_at))
		close_and_measure(p, now < p->close_at ? now : p->close_at);
	if (p->be_burst.ns == 0)
		p->be_burst = (struct burst){ poll, GS_BURST_FIRST_LAUNCHES };
	if (p->window_burst.ns == 0)
		p->window_burst = (struct burst){ poll, GS_BURST_FIRST_LAUNCHES };
	if (seq != p->seq) {
		p->seq = seq;
		p->last_start = 0;
		p->max_debt = GS_MAX_DEBT_PERIODS * s->period_ns;
		p->spill_ns = window ? window_burst_aim(s) : 0;
		if (p->debt > p->max_debt)
			p->debt = p->max_debt;
	}
	if (window) {
		start = gs_pace_window_start(s->period_ns, s->offset_ns, s->length_ns, now);
		if (!p->in_window && start <= now && start != p->last_start) {
			p->last_start = start;
			p->close_at = gs_pace_open(start, s->length_ns, now, &p->debt);
			p->window_launched = 0;
			p->window_unmeasured = 0;
			if (p->close_at > now)
				open_for(p, now, 1, &p->window_burst);
		}
		if (p->in_window && !p->window_unmeasured && burst_due(p, &p->window_burst, now)) {
			window_burst_ended(p, s);
			now = now_ns();
		}
		if (p->in_window && !p->window_unmeasured)
			wake = earliest(p->close_at, p->opened_at + p->window_burst.ns);
		else if (p->in_window)
			wake = p->close_at;
		else
			wake = start > now ? start : start + s->period_ns;
	}
	if (!p->in_window) {
		int bursts = (s->flags & GS_COMPUTE_YIELD_LS) && b != NULL;

		want = !window;
		if (bursts) {
			want = !gs_board_ls_active(b, s->gpu_mask, now, s->ls_idle_ns);
			wake = earliest(wake, now + poll);
		}
		if (want && bursts && burst_due(p, &p->be_burst, now)) {
			uint64_t opened = p->opened_at;

			burst_ended(&p->be_burst, s->ls_idle_ns / 2, poll, opened,
				    close_and_measure(p, now));
			now = now_ns();
			want = !gs_board_ls_active(b, s->gpu_mask, now, s->ls_idle_ns);
		}
		if (want)
			open_for(p, now, 0, bursts ? &p->be_burst : NULL);
		else if (p->open)
			close_and_measure(p, now);
		if (want && bursts)
			wake = earliest(wake, p->opened_at + p->be_burst.ns);
	}
	if ((s->flags & GS_COMPUTE_LS_PUBLISH) && b != NULL && pacer.board_writable) {
		uint64_t n = launches_now();

		if (n != p->launches_seen)
			gs_board_stamp(b, s->gpu_mask, now);
		p->launches_seen = n;
		wake = earliest(wake, now + poll);
	}
	return wake;
}

/* Sleep until `when` (CLOCK_MONOTONIC), or until nodemgr changes the schedule from `seq`. */
static void sleep_until(uint32_t seq, uint64_t when)
{
	struct timespec ts = { (time_t)(when / GS_SECOND), (long)(when % GS_SECOND) };

	/* FUTEX_WAIT_BITSET: an absolute CLOCK_MONOTONIC deadline. Shared: nodemgr wakes it. */
	/*
	 * nodemgr wakes every bit; a launch of this process that spent a burst wakes
	 * wake_bit only (and the pacer of a process whose bit is the same: it looks again).
	 */
	syscall(SYS_futex, pacer.sched, FUTEX_WAIT_BITSET, seq, &ts, NULL, 1u | pacer.wake_bit);
}

static void *pace(void *arg)
{
	/* The gate is closed when the pacer starts (pacer_start): its first look opens it. */
	struct pace p = { .seq = UINT32_MAX };
	struct gs_schedule s;

	(void)arg;
	/* Windows of a few milliseconds want wake-ups to the microsecond, not the default 50. */
	prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
	for (;;) {
		uint32_t seq = gs_ledger_entry_schedule(pacer.ledger, pacer.task, &s);
		uint64_t now = now_ns();

		if (__atomic_load_n(&pacer.stopping, __ATOMIC_ACQUIRE))
			break;
		/* A process that outlived its task obeys no newer task's schedule. */
		if (!gs_ledger_pause_word_names(pacer.pause, gs_state.task_id))
			memset(&s, 0, sizeof(s));
		sleep_until(seq, step(&p, &s, seq, now));
	}
	gate_open();
	return NULL;
}

/* At exit: the gate opens for good and the pacer leaves the driver alone. */
static void pacer_stop(void)
{
	pthread_mutex_lock(&stop_mu);
	__atomic_store_n(&pacer.stopping, 1, __ATOMIC_RELEASE);
	pthread_mutex_unlock(&stop_mu);
	gate_open();
	if (pacer.sched != NULL)
		syscall(SYS_futex, pacer.sched, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/*
 * Start the process's pacer for `slot` once (under start_mu): it runs from
 * then on, for the life of the process.
 */
static void pacer_start(int slot)
{
	struct gs_ledger *l = gs_state.ledger;
	int task = gs_ledger_slot_task(l, (uint32_t)slot);
	const char *path = getenv("GPUSHARE_BOARD");
	sigset_t all, old;
	pthread_attr_t attr;
	pthread_t thread;

	if (pacer.running || task < 0 || !(gs_ledger_flags(l) & GS_LEDGER_COMPUTE))
		return;
	/* Read now, not at load: an auto-loaded task sets it with its grant. */
	if (path != NULL && strlen(path) < sizeof(pacer.board_path))
		strcpy(pacer.board_path, path);
	else
		pacer.board_path[0] = '\0';
	pacer.ledger = l;
	pacer.task = task;
	pacer.slot = slot;
	pacer.sched = gs_ledger_sched_word(l, task);
	pacer.wake_bit = 1u << (1 + (uint32_t)getpid() % 31);
	pacer.pause = gs_ledger_pause_word(l, task);
	pacer.launches = gs_ledger_launch_counter(l, (uint32_t)slot);
	/* Registered after the driver was loaded, so it runs before the driver's own teardown. */
	if (!pacer.at_exit)
		pacer.at_exit = atexit(pacer_stop) == 0;
	/* Signals are the program's: the pacer thread takes none. */
	sigfillset(&all);
	pthread_sigmask(SIG_SETMASK, &all, &old);
	pthread_attr_init(&attr);
	pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
	/*
	 * Closed until the pacer's first look: a process that launches at once (a program
	 * queues work far faster than the device runs it) would otherwise queue all it can
	 * before its first window or burst is kept.
	 */
	gate_set(GS_GATE_CLOSED);
	pacer.running = pthread_create(&thread, &attr, pace, NULL) == 0;
	pthread_attr_destroy(&attr);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	if (pacer.running) {
		gs_ledger_slot_paced(l, (uint32_t)slot);
		__atomic_store_n(&pacer_up, 1, __ATOMIC_RELEASE);
	} else {
		gate_open();
	}
}

/*
 * The process claimed `slot` (gs_on_claim; under the claim's lock): its pacer
 * starts now if its task has a schedule. Otherwise the process stays
 * single-threaded, as it was (an idle thread of any kind makes libc's paths
 * dearer), until its task gets one: nodemgr then sets GS_PAUSE_COMPUTE in the
 * pause word, and the next launch starts the pacer (wait_to_launch).
 */
static void pacer_claimed(int slot)
{
	struct gs_schedule s;

	gs_ledger_entry_schedule(gs_state.ledger,
				 gs_ledger_slot_task(gs_state.ledger, (uint32_t)slot), &s);
	if (s.flags == 0)
		return;
	pthread_mutex_lock(&start_mu);
	pacer_start(slot);
	pthread_mutex_unlock(&start_mu);
}

/* A launch found GS_PAUSE_COMPUTE: its process's pacer starts, if it has not yet. */
static void pacer_wanted(void)
{
	int slot = __atomic_load_n(&gs_state.slot, __ATOMIC_ACQUIRE);

	if (slot < 0)
		return;
	pthread_mutex_lock(&start_mu);
	pacer_start(slot);
	pthread_mutex_unlock(&start_mu);
}

__attribute__((noinline, cold)) void wait_to_launch(uint32_t *pause)
{
	struct timespec ts = { 0, 250 * 1000 * 1000 };
	uint64_t start = 0;
	uint32_t g;

	for (;;) {
		uint32_t word = __atomic_load_n(pause, __ATOMIC_RELAXED);

		if ((word & GS_PAUSE_COMPUTE) && !__atomic_load_n(&pacer_up, __ATOMIC_ACQUIRE))
			pacer_wanted();
		if (word & GS_PAUSE_HOLDING) {
			wait_while_paused(pause);
			/* It may have let go of an entry that names another task now. */
			pause = __atomic_load_n(&gs_hot.pause, __ATOMIC_ACQUIRE);
			continue;
		}
		g = __atomic_load_n(&gs_compute_gate, __ATOMIC_SEQ_CST);
		/* Read after the gate: the end of the burst that opened it, or a later one. */
		if (!(g & GS_GATE_CLOSED) &&
		    __atomic_load_n(__atomic_load_n(&gs_hot.launches, __ATOMIC_ACQUIRE),
				    __ATOMIC_SEQ_CST) <
			    __atomic_load_n(&gs_burst_end, __ATOMIC_SEQ_CST))
			break;
		if (start == 0)
			start = now_ns();
		/* Open, and the burst spent: its pacer ends it now, not at its timer. */
		if (!(g & GS_GATE_CLOSED) && pacer.sched != NULL)
			syscall(SYS_futex, pacer.sched, FUTEX_WAKE_BITSET, INT_MAX, NULL, NULL,
				pacer.wake_bit);
		__atomic_add_fetch(&gate_waiters, 1, __ATOMIC_SEQ_CST);
		/* The timeout: a pacer gone (the process exiting) re-read now and then. */
		if (__atomic_load_n(&gs_compute_gate, __ATOMIC_SEQ_CST) == g)
			syscall(SYS_futex, &gs_compute_gate, FUTEX_WAIT_PRIVATE, g, &ts, NULL, 0);
		__atomic_sub_fetch(&gate_waiters, 1, __ATOMIC_SEQ_CST);
	}
	if (start != 0) {
		int slot = __atomic_load_n(&gs_state.slot, __ATOMIC_ACQUIRE);

		if (slot >= 0)
			gs_ledger_gated_add(gs_state.ledger, (uint32_t)slot, now_ns() - start);
	}
}

/* In a fork child: no pacer runs; the child starts its own when it claims a slot. */
static void pacer_after_fork_child(void)
{
	pacer.running = 0;
	pacer_up = 0;
	pacer.stopping = 0;
	pacer.sched = NULL;
	pacer.board = NULL; /* not inherited (MADV_DONTFORK) */
	pacer.board_tried = 0;
	gs_compute_gate = 0;
	gs_burst_end = UINT64_MAX;
	gate_waiters = 0;
	pthread_mutex_init(&stop_mu, NULL);
	pthread_mutex_init(&start_mu, NULL);
}

__attribute__((constructor)) static void pacer_load(void)
{
	gs_on_claim(pacer_claimed);
	pthread_atfork(NULL, NULL, pacer_after_fork_child);
}
