/*
 * Compute shares in the ledger (docs/compute.md): a task entry's schedule,
 * which nodemgr writes and each process's pacer (pacer.c) reads; what the
 * pacers measured, in their slots; the pacer's debt arithmetic; and the
 * node's board, where latency-sensitive tasks say when they last launched.
 * Compiled beside ledger.c into the shim and into nodemgr's cffi bindings.
 *
 * Memory order: a schedule is several words, published as a seqlock whose
 * single writer is nodemgr's loop: the writer makes the sequence word odd,
 * stores the fields, then stores the next even value; a reader loads the
 * word, the fields and the word again, and keeps what it read only when
 * both loads saw the same even value. Every access of it is seq_cst, with no
 * fence (which TSan cannot follow): a field store the reader saw comes after
 * the writer's odd store in the single total order, and so before the
 * reader's second load of the word, which then cannot see the value it saw
 * first. A write is a few stores, off every hot path. A slot's pacing
 * figures are a seqlock of the same kind, written by the process's pacer
 * thread alone (pacing_seq), except gated_ns, which launches add to on their
 * own: a reader sees each window whole. Board stamps are figures whose
 * readers need nothing else published with them: relaxed.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <stddef.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "ledger.h"

#define RELAXED_LOAD(p) __atomic_load_n((p), __ATOMIC_RELAXED)
#define LOAD(p) __atomic_load_n((p), __ATOMIC_SEQ_CST)
#define STORE(p, v) __atomic_store_n((p), (v), __ATOMIC_SEQ_CST)

void gs_ledger_set_flags(struct gs_ledger *l, uint32_t flags)
{
	__atomic_store_n(&l->flags, flags, __ATOMIC_SEQ_CST);
}

uint32_t gs_ledger_flags(const struct gs_ledger *l)
{
	/* A setting read once at a claim: nothing else is published through it. */
	return RELAXED_LOAD(&l->flags);
}

/* Write entry `t`'s schedule as a seqlock writer, then wake whoever sleeps on it. */
static void publish(struct gs_task *t, const struct gs_schedule *s)
{
	uint32_t seq = LOAD(&t->sched_seq);

	/* Even when nodemgr is the writer; a word someone made odd is made even first. */
	seq = (seq | 1u) + 1u;
	STORE(&t->sched_seq, seq - 1u);
	STORE(&t->compute_flags, s->flags);
	STORE(&t->share, s->share);
	STORE(&t->gpu_mask, s->gpu_mask);
	STORE(&t->period_ns, s->period_ns);
	STORE(&t->offset_ns, s->offset_ns);
	STORE(&t->length_ns, s->length_ns);
	STORE(&t->poll_ns, s->poll_ns);
	STORE(&t->ls_idle_ns, s->ls_idle_ns);
	STORE(&t->sched_seq, seq);
	/* Not FUTEX_PRIVATE: the pacers are threads of other processes sharing the file. */
	syscall(SYS_futex, &t->sched_seq, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

int gs_ledger_task_schedule(struct gs_ledger *l, const char *task_id, const struct gs_schedule *s)
{
	int i = gs_ledger_task_find(l, task_id);

	if (i < 0)
		return i;
	publish(&l->task[i], s);
	/*
	 * A process starts its pacer at its claim only when its task has a schedule: those
	 * that claimed before start theirs at their next launch, which this bit sends out of
	 * line. nodemgr clears it once every live process of the task runs one.
	 */
	if (s->flags != 0)
		gs_ledger_task_wake_pacers(l, task_id, 1);
	return 0;
}

void gs_ledger_entry_unschedule(struct gs_ledger *l, int task)
{
	static const struct gs_schedule none;

	if (task >= 0 && task < GS_MAX_TASKS)
		publish(&l->task[task], &none);
}

uint32_t gs_ledger_entry_schedule(const struct gs_ledger *l, int task, struct gs_schedule *out)
{
	const struct gs_task *t;
	uint32_t before, after;

	memset(out, 0, sizeof(*out));
	if (task < 0 || task >= GS_MAX_TASKS)
		return 0;
	t = &l->task[task];
	for (int tries = 0;; tries++) {
		before = LOAD(&t->sched_seq);
		out->flags = LOAD(&t->compute_flags);
		out->share = LOAD(&t->share);
		out->gpu_mask = LOAD(&t->gpu_mask);
		out->period_ns = LOAD(&t->period_ns);
		out->offset_ns = LOAD(&t->offset_ns);
		out->length_ns = LOAD(&t->length_ns);
		out->poll_ns = LOAD(&t->poll_ns);
		out->ls_idle_ns = LOAD(&t->ls_idle_ns);
		after = LOAD(&t->sched_seq);
		if (before == after && (before & 1u) == 0)
			return before;
		/*
		 * A write under way (nodemgr writes a few words), or a word an
		 * environment's process keeps odd: after a few tries, no schedule.
		 */
		if (tries == 1000) {
			memset(out, 0, sizeof(*out));
			return after;
		}
		sched_yield();
	}
}

uint32_t *gs_ledger_sched_word(struct gs_ledger *l, int task)
{
	return task >= 0 && task < GS_MAX_TASKS ? &l->task[task].sched_seq : NULL;
}

void gs_ledger_slot_paced(struct gs_ledger *l, uint32_t slot)
{
	/* Read by nodemgr to learn when every process of a task runs its pacer. */
	if (slot < GS_MAX_SLOTS)
		STORE(&l->slot[slot].pacer, 1u);
}

void gs_ledger_pacing_add(struct gs_ledger *l, uint32_t slot, const struct gs_pacing *d)
{
	struct gs_slot *s;
	uint64_t seq;

	if (slot >= GS_MAX_SLOTS)
		return;
	s = &l->slot[slot];
	seq = LOAD(&s->pacing_seq);
	__atomic_store_n(&s->pacing_seq, seq + 1, __ATOMIC_SEQ_CST);
	/* Added, not stored: launches add their waits to gated_ns meanwhile. */
	__atomic_fetch_add(&s->device_ns, d->device_ns, __ATOMIC_SEQ_CST);
	__atomic_fetch_add(&s->overrun_ns, d->overrun_ns, __ATOMIC_SEQ_CST);
	__atomic_fetch_add(&s->gated_ns, d->gated_ns, __ATOMIC_SEQ_CST);
	__atomic_fetch_add(&s->windows, d->windows, __ATOMIC_SEQ_CST);
	__atomic_fetch_add(&s->unmeasured, d->unmeasured, __ATOMIC_SEQ_CST);
	__atomic_store_n(&s->pacing_seq, seq + 2, __ATOMIC_SEQ_CST);
}

void gs_ledger_gated_add(struct gs_ledger *l, uint32_t slot, uint64_t ns)
{
	if (slot < GS_MAX_SLOTS)
		__atomic_fetch_add(&l->slot[slot].gated_ns, ns, __ATOMIC_RELAXED);
}

/* Slot `s`'s figures added to *out: a whole change of its pacer's, or none of it. */
static void pacing_read(const struct gs_slot *s, struct gs_pacing *out)
{
	struct gs_pacing got;
	uint64_t before, after;

	for (int tries = 0;; tries++) {
		before = LOAD(&s->pacing_seq);
		got.device_ns = LOAD(&s->device_ns);
		got.overrun_ns = LOAD(&s->overrun_ns);
		got.windows = LOAD(&s->windows);
		got.unmeasured = LOAD(&s->unmeasured);
		after = LOAD(&s->pacing_seq);
		/*
		 * A pacer stopped mid-change (the process killed) or one that
		 * keeps the word odd: after a few tries, what was read.
		 */
		if ((before == after && (before & 1u) == 0) || tries == 1000)
			break;
		sched_yield();
	}
	out->device_ns += got.device_ns;
	out->overrun_ns += got.overrun_ns;
	out->gated_ns += RELAXED_LOAD(&s->gated_ns);
	out->windows += got.windows;
	out->unmeasured += got.unmeasured;
}

int gs_ledger_task_pacing(const struct gs_ledger *l, const char *task_id, struct gs_pacing *out)
{
	int n = 0;

	memset(out, 0, sizeof(*out));
	for (uint32_t w = 0; w < GS_MAX_SLOTS / 64; w++) {
		uint64_t word = __atomic_load_n(&l->slot_taken[w], __ATOMIC_ACQUIRE);

		for (; word != 0; word &= word - 1) {
			const struct gs_slot *s =
				&l->slot[w * 64 + (uint32_t)__builtin_ctzll(word)];

			if (__atomic_load_n(&s->state, __ATOMIC_ACQUIRE) != GS_SLOT_USED ||
			    strncmp(s->task_id, task_id, GS_TASK_ID_LEN) != 0)
				continue;
			pacing_read(s, out);
			out->pacers += LOAD(&s->pacer) != 0;
			n++;
		}
	}
	out->processes = (uint32_t)n;
	return n;
}

/* --- the pacer's arithmetic --------------------------------------------------------- */

uint64_t gs_pace_open(uint64_t start, uint64_t length, uint64_t now, uint64_t *debt)
{
	uint64_t end = start + length, from = now > start ? now : start, late, paid, left;

	if (from >= end) {
		/* Seen after its end: the whole window went to work already under way. */
		*debt = *debt > length ? *debt - length : 0;
		return 0;
	}
	/* Lateness is time the process's own work held the device in this window. */
	late = from - start;
	paid = late < *debt ? late : *debt;
	*debt -= paid;
	left = end - from;
	if (*debt >= left) {
		*debt -= left;
		return 0;
	}
	end -= *debt;
	*debt = 0;
	return end;
}

uint64_t gs_pace_close(uint64_t closed, uint64_t done, uint64_t max_debt, uint64_t *debt)
{
	uint64_t over = done > closed ? done - closed : 0;

	*debt = *debt + over > max_debt ? max_debt : *debt + over;
	return over;
}

uint64_t gs_pace_window_start(uint64_t period, uint64_t offset, uint64_t length, uint64_t now)
{
	uint64_t start;

	if (period == 0)
		return now;
	offset %= period;
	if (now < offset)
		return offset;
	start = (now - offset) / period * period + offset;
	return now < start + length ? start : start + period;
}

/* --- the board ---------------------------------------------------------------------- */

int gs_board_init(struct gs_board *b, uint32_t ngpus)
{
	if (ngpus > GS_MAX_GPUS)
		return -E2BIG;
	b->version = GS_BOARD_VERSION;
	b->ngpus = ngpus;
	__atomic_store_n(&b->magic, (uint64_t)GS_BOARD_MAGIC, __ATOMIC_SEQ_CST);
	return 0;
}

int gs_board_check(const struct gs_board *b, size_t len)
{
	if (b == NULL || len < sizeof(*b) ||
	    __atomic_load_n(&b->magic, __ATOMIC_SEQ_CST) != GS_BOARD_MAGIC)
		return -EINVAL;
	return b->version == GS_BOARD_VERSION && b->ngpus <= GS_MAX_GPUS ? 0 : -EPROTO;
}

void gs_board_stamp(struct gs_board *b, uint32_t mask, uint64_t now)
{
	for (uint32_t g = 0; g < GS_MAX_GPUS; g++) {
		uint64_t *p = &b->gpu[g].ls_last_ns, seen;

		if (!(mask & (1u << g)))
			continue;
		/* The latest stamp wins whichever LS process writes last. */
		seen = RELAXED_LOAD(p);
		while (seen < now &&
		       !__atomic_compare_exchange_n(p, &seen, now, 1, __ATOMIC_RELAXED,
						    __ATOMIC_RELAXED))
			;
	}
}

int gs_board_ls_active(const struct gs_board *b, uint32_t mask, uint64_t now, uint64_t idle_ns)
{
	for (uint32_t g = 0; g < GS_MAX_GPUS; g++) {
		uint64_t last;

		if (!(mask & (1u << g)))
			continue;
		last = RELAXED_LOAD(&b->gpu[g].ls_last_ns);
		/* A stamp from the future (a hostile writer) reads as activity: BE only waits. */
		if (last != 0 && (last > now || now - last < idle_ns))
			return 1;
	}
	return 0;
}
