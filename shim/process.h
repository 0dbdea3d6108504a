/*
 * process.c: the process's state, attaching to the ledger (at load or by
 * gpushare_attach), its slot, which ledger GPU a device or context is, and
 * the wait of a paused task. Above dispatch.h.
 */
#ifndef GS_PROCESS_H
#define GS_PROCESS_H

#include "dispatch.h"

#pragma GCC visibility push(hidden)

enum gs_mode {
	GS_INERT = GPUSHARE_MODE_INERT,	    /* no ledger: pass everything through */
	GS_ENFORCE = GPUSHARE_MODE_ENFORCE, /* ledger mapped: charge and enforce */
	GS_BROKEN = GPUSHARE_MODE_BROKEN,   /* ledger named at load, unusable: refuse allocations */
};

#define GS_MAX_DEVS 64
#define GS_DEV_UNKNOWN (-2)
#define GS_DEV_FOREIGN (-1)
/* ledger_gpu: the driver could not say which GPU the ordinal is (a bad one, no cuInit). */
#define GS_DEV_UNRESOLVED (-4)

/*
 * gs_state.mode changes at most once after load, when gpushare_attach takes
 * an inert process to enforcing (a release store, after all else it sets).
 * The wrappers still read it plainly, so their paths stay as they were: each
 * reads it after an acquire load of a real entry point, and the real table
 * is filled only after the mark that attach tests under gs_attach_mu, so a
 * successful attach happens before any wrapper reaches the driver. Other
 * readers use mode_acquire().
 */
struct gs_process {
	enum gs_mode mode;
	struct gs_ledger *ledger;
	int fd;	  /* this process's descriptor; holds the slot lock */
	int slot; /* claimed slot, -1 until first use */
	char task_id[GS_TASK_ID_LEN];
	int dev_map[GS_MAX_DEVS];
	unsigned int ctx_gen; /* bumped when a context goes away */
	/*
	 * Iteration boundaries this process reported (gpushare_iteration): an
	 * allocation made in an earlier epoch than the current one, or pinned
	 * by gpushare_mark_persistent, is in its slot's persistent share.
	 */
	uint64_t epoch;
	pthread_mutex_t claim_mu;   /* claims and reaps through fd: its locks are every thread's */
	pthread_mutex_t epoch_mu;   /* orders boundaries and marks against each other */
	char ledger_path[PATH_MAX]; /* to map it afresh after fork */
};

extern struct gs_process gs_state;

/* The mode, for readers that are not ordered after gpushare_attach otherwise. */
static inline enum gs_mode mode_acquire(void)
{
	return __atomic_load_n(&gs_state.mode, __ATOMIC_ACQUIRE);
}

static inline uint64_t epoch_now(void)
{
	return __atomic_load_n(&gs_state.epoch, __ATOMIC_ACQUIRE);
}

/*
 * What the launch path touches. Until the process has a slot both point at
 * private words, so the path needs no mode test: claiming a slot repoints
 * them into the ledger (the task's pause word, the slot's launch counter).
 */
struct gs_hot_path {
	uint32_t *pause;
	uint64_t *launches;
};

extern uint32_t gs_never_paused;
extern uint64_t gs_unattached_launches;
extern struct gs_hot_path gs_hot;

int my_slot(void);
/*
 * Register what runs, under the claim's lock, once the process has claimed
 * its slot (the pacer's start, pacer.c): set in a constructor, before any
 * claim, so a plain pointer suffices. One registrant.
 */
typedef void (*gs_claimed_fn)(int slot);
void gs_on_claim(gs_claimed_fn fn);
void reap_dead_slots(int slot);
int ledger_gpu(CUdevice dev);
CUdevice gpu_device(int gpu);
CUresult current_ctx(CUcontext *ctx, int *gpu);
CUresult current_gpu(int *gpu);
CUresult stream_ctx(CUstream stream, CUcontext *ctx, int *gpu);
__attribute__((cold)) void wait_while_paused(uint32_t *word);

/* Launches and allocations of a paused or gated task wait here: one load when it runs. */
static inline __attribute__((always_inline)) void hold_while_paused(void)
{
	uint32_t *pause = __atomic_load_n(&gs_hot.pause, __ATOMIC_ACQUIRE);

	if (unlikely(__atomic_load_n(pause, __ATOMIC_RELAXED) != 0))
		wait_while_paused(pause);
}

/*
 * A paused or gated task takes no new memory: an allocation waits, as a
 * launch does, before it is charged (docs/timeslicing.md). The slot is
 * claimed first, since claiming is what points gs_hot.pause at the task's
 * word.
 */
static inline __attribute__((always_inline)) void alloc_gate(void)
{
	my_slot();
	hold_while_paused();
}

#pragma GCC visibility pop

#endif
