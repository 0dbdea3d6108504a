/*
 * Operations on a mapped ledger, shared by the shim and nodemgr's cffi
 * bindings. Plain C for cffi's cdef parser, like ledger_layout.h.
 *
 * Return codes: 0 on success, a negative errno value on failure.
 */

/* Validate a mapping of `len` bytes as a ledger this code understands. */
int gs_ledger_check(const struct gs_ledger *l, size_t len);

/* nodemgr: fill a fresh (zeroed) mapping's header for `ngpus` GPUs. */
int gs_ledger_init(struct gs_ledger *l, uint32_t ngpus);

/* nodemgr: publish a new per-GPU limit (bytes); read at each allocation. */
void gs_ledger_set_limit(struct gs_ledger *l, uint32_t gpu, uint64_t bytes);
uint64_t gs_ledger_limit(const struct gs_ledger *l, uint32_t gpu);

/* nodemgr: what a process is charged for its context on `gpu` (bytes). */
void gs_ledger_set_ctx_charge(struct gs_ledger *l, uint32_t gpu, uint64_t bytes);

/*
 * Top-up (ledger_layout.h, gs_gpu_entry.topup_limit). nodemgr: how far it may
 * raise `gpu`'s limit (0: never); how long a refused charge waits for it
 * (ms, all GPUs; 0: never); the count a refused charge asked for (0: none
 * since the last answer). gs_ledger_clear_ask clears the ask read as
 * `seen` (a larger one made since stands): nodemgr's answer, given after any
 * new limit, and a waiting process's withdrawal when it stops waiting.
 */
void gs_ledger_set_topup_limit(struct gs_ledger *l, uint32_t gpu, uint64_t bytes);
void gs_ledger_set_topup_wait(struct gs_ledger *l, uint32_t ms);
uint64_t gs_ledger_wanted(const struct gs_ledger *l, uint32_t gpu);
void gs_ledger_clear_ask(struct gs_ledger *l, uint32_t gpu, uint64_t seen);

/*
 * A process whose charge of `bytes` on `gpu` the limit `limit` refused: ask
 * for a top-up (raise `wanted` to what the charge needed, also put in
 * *asked). Returns 1 when nodemgr may answer it (the top-up limit is above
 * the limit and holds the charge, and waiting is on), 0 when waiting is
 * useless.
 */
int gs_ledger_want(struct gs_ledger *l, uint32_t gpu, uint64_t bytes, uint64_t limit,
		   uint64_t *asked);
uint32_t gs_ledger_topup_wait(const struct gs_ledger *l);

/*
 * nodemgr: give `task_id` a task entry (before its grant is sent); returns
 * the entry index, or -ENOSPC when all GS_MAX_TASKS are in use. Adding a
 * task that has an entry returns that entry.
 */
int gs_ledger_task_add(struct gs_ledger *l, const char *task_id);

/* nodemgr: free the task's entry (waking any launch it held). -ENOENT if none. */
int gs_ledger_task_remove(struct gs_ledger *l, const char *task_id);

/*
 * nodemgr: set (nonzero) or clear (0) the GS_PAUSE_ADMIN bit of the task's
 * pause word; when the word becomes 0 every process waiting in a launch or
 * an allocation is woken. -ENOENT if no entry.
 */
int gs_ledger_task_pause(struct gs_ledger *l, const char *task_id, uint32_t paused);

/* nodemgr: the same for the GS_PAUSE_TURN bit (time slicing). */
int gs_ledger_task_gate(struct gs_ledger *l, const char *task_id, uint32_t gated);
/* Sets or clears the task's GS_PAUSE_CLASS bit (held for a latency-sensitive task). */
int gs_ledger_task_hold_class(struct gs_ledger *l, const char *task_id, uint32_t held);

/* nodemgr: the same for the GS_PAUSE_COMPUTE bit (compute shares: start the pacers). */
int gs_ledger_task_wake_pacers(struct gs_ledger *l, const char *task_id, uint32_t on);

/*
 * nodemgr: publish the task's turn (the boundary count at which it ends;
 * 0: not gated) and its GS_TASK_* flags. -ENOENT if no entry.
 */
int gs_ledger_task_turn(struct gs_ledger *l, const char *task_id, uint64_t turn_until,
			uint32_t flags);

/* The task's entry index, or -ENOENT. */
int gs_ledger_task_find(const struct gs_ledger *l, const char *task_id);

/*
 * nodemgr, once per sweep: for each slot whose launch count moved since the
 * last call, record `now_ns` as the last launch time of the slot's task.
 */
void gs_ledger_stamp_launches(struct gs_ledger *l, uint64_t now_ns);

/* Bytes charged on `gpu` by all slots (saturating); a charge still being checked is not. */
uint64_t gs_ledger_used(const struct gs_ledger *l, uint32_t gpu);

/*
 * The GPU's `charged` count: what a charge must fit beside (the slots'
 * bytes, charges being checked, and what a process killed in the middle of
 * a charge left until the environment next has no process). One load.
 */
uint64_t gs_ledger_charged(const struct gs_ledger *l, uint32_t gpu);

/*
 * Sum of the slots that carry `task_id`: bytes per GPU into used[GS_MAX_GPUS],
 * kernel launches into *launches, and the sum of each slot's peak (its most
 * bytes at once) into *peak. Returns the number of such slots.
 */
int gs_ledger_task_usage(const struct gs_ledger *l, const char *task_id, uint64_t *used,
			 uint64_t *launches, uint64_t *peak);

/* A task's memory by region, summed over its live processes (gs_ledger_task_regions). */
struct gs_regions {
	uint64_t used[GS_MAX_GPUS];	  /* bytes now, per ledger GPU */
	uint64_t persistent[GS_MAX_GPUS]; /* of which persistent */
	uint64_t temp_peak[GS_MAX_GPUS];  /* sum of each process's temporary peak */
	uint64_t
		settled[GS_MAX_GPUS]; /* persistent bytes right after each process's last release */
	uint64_t iterations;	      /* the most boundaries one process reported */
	uint64_t releases; /* the fewest releases one process made (0: none settled yet) */
	uint64_t
		min_iterations; /* the fewest boundaries one process that reported any reported (0: none did) */
	uint32_t processes;
	uint32_t reserved;
};

/* Fill `out` for `task_id`; returns the number of its processes. */
int gs_ledger_task_regions(const struct gs_ledger *l, const char *task_id, struct gs_regions *out);

/*
 * The turn's barrier (docs/timeslicing.md, "Tasks of several processes"):
 * the fewest boundaries among the slots of `task_id` whose last boundary
 * was at or after `since_ns` (CLOCK_MONOTONIC) into *min_iterations (0 when
 * none). Returns the number of slots counted.
 */
int gs_ledger_task_barrier(const struct gs_ledger *l, const char *task_id, uint64_t since_ns,
			   uint64_t *min_iterations);

/* One used slot, as gs_ledger_summary reports it. */
struct gs_slot_info {
	char task_id[24];
	int32_t pid;
	uint32_t slot;
	uint64_t used; /* bytes now, all GPUs */
	uint64_t peak; /* most bytes at once, all GPUs */
	uint64_t launches;
};

/*
 * nodemgr: describe up to `max` used slots into `out`, in slot order, in one
 * pass. Returns how many were written.
 */
int gs_ledger_summary(const struct gs_ledger *l, struct gs_slot_info *out, uint32_t max);

/*
 * nodemgr: free every used slot whose owner has died (its lock is free),
 * using `fd`, an open descriptor of the ledger file. The first `max` slots
 * freed are described into `out` (may be NULL) as they were. When no slot is
 * left in use, the GPUs' `charged` counts are set to zero
 * (see gs_ledger_charge). Returns the number of slots reaped, or a negative
 * errno value.
 */
int gs_ledger_reap(struct gs_ledger *l, int fd, struct gs_slot_info *out, uint32_t max);

/*
 * A process whose charge was refused: free the slots of the environment's
 * dead processes as gs_ledger_reap does, through `fd`, the descriptor its
 * own slot `own` is locked on (skipped: its lock is this descriptor's). A
 * process dies with its slot's lock, whatever pid namespace it and nodemgr
 * see each other in, so no pid is compared. The bytes a freed slot held
 * leave the GPUs' `charged` counts, exactly once whoever reaps first; a
 * freed slot that had launched since nodemgr last looked stamps its task's
 * last launch. Never reconciles (the caller's slot is taken). Returns the
 * number of slots freed, or a negative errno value.
 */
int gs_ledger_reap_others(struct gs_ledger *l, int fd, uint32_t own);

/*
 * A process: claim a free slot for itself through `fd` (an O_RDWR
 * descriptor of its own, kept open for the life of the claim), recording
 * its task's entry in the slot; a slot of a dead process when none is free.
 * Returns the slot index or a negative errno value (-ENOSPC: every slot is
 * held by a live process).
 */
int gs_ledger_claim(struct gs_ledger *l, int fd, int32_t pid, const char *task_id);

/*
 * A process: charge `bytes` on `gpu` to slot `slot` if the environment stays
 * within the GPU's limit. Returns 0, or -ENOSPC when over the limit (then
 * nothing stays charged). One atomic add to the GPU's `charged` count
 * decides, whatever the number of slots: racing processes can both fail but
 * never both pass beyond the limit; what is reported (gs_ledger_used, usage,
 * summaries, peaks) never counts a charge being checked.
 */
int gs_ledger_charge(struct gs_ledger *l, uint32_t slot, uint32_t gpu, uint64_t bytes);
void gs_ledger_uncharge(struct gs_ledger *l, uint32_t slot, uint32_t gpu, uint64_t bytes);

/*
 * A process, classifying its own slot's bytes as persistent or temporary
 * (docs/timeslicing.md#classification-in-the-shim). Each is called by
 * the slot's owner only.
 *
 * gs_ledger_boundary: an iteration boundary, the process's `iterations`th:
 * everything its slot holds now becomes persistent, and the slot records
 * the time (CLOCK_MONOTONIC) in boundary_ns; the task entry's count is
 * raised to `iterations` if lower. Returns the task entry's count, or
 * `iterations` when the slot has no task entry.
 */
uint64_t gs_ledger_boundary(struct gs_ledger *l, uint32_t slot, uint64_t iterations);

/* Move `bytes` on `gpu` into (persist) or out of (unpersist, saturating) the persistent share. */
void gs_ledger_persist(struct gs_ledger *l, uint32_t slot, uint32_t gpu, uint64_t bytes);
void gs_ledger_unpersist(struct gs_ledger *l, uint32_t slot, uint32_t gpu, uint64_t bytes);

/* Raise the slot's temporary peak on `gpu` to what it holds now beyond its persistent share. */
void gs_ledger_note_temp(struct gs_ledger *l, uint32_t slot, uint32_t gpu);

/* The process has released its temporary memory: record its persistent bytes as settled. */
void gs_ledger_settle(struct gs_ledger *l, uint32_t slot);

/*
 * --- what a process reads of its ledger (ledger_access.c) ---------------------------
 *
 * The shim reads ledger fields only through these, so that each read has
 * one place and its memory order is said there.
 */

/* The context charge of `gpu` (gs_ledger_set_ctx_charge); 0 for a GPU past the table. */
uint64_t gs_ledger_ctx_charge(const struct gs_ledger *l, uint32_t gpu);

/* The index of the ledger GPU whose UUID is the 16 bytes at `uuid`, or -ENOENT. */
int gs_ledger_gpu_index(const struct gs_ledger *l, const uint8_t *uuid);

/* The task entry slot `slot` recorded at its claim, or -1 if none. */
int gs_ledger_slot_task(const struct gs_ledger *l, uint32_t slot);

/*
 * The words a process's launch path keeps a pointer to: task entry `task`'s
 * pause word and slot `slot`'s launch counter. NULL for an index past the table.
 */
uint32_t *gs_ledger_pause_word(struct gs_ledger *l, int task);
uint64_t *gs_ledger_launch_counter(struct gs_ledger *l, uint32_t slot);

/*
 * Whether the task entry whose pause word `word` is (gs_ledger_pause_word)
 * still names `task_id`: nodemgr may have handed the entry to a newer task.
 */
int gs_ledger_pause_word_names(const uint32_t *word, const char *task_id);

/* What a process's iteration boundary reads of its task's turn (gs_ledger_own_turn). */
struct gs_turn {
	uint32_t flags;	     /* the task entry's GS_TASK_* bits */
	uint32_t paused;     /* its GS_PAUSE_* bits */
	uint64_t turn_until; /* gs_ledger_task_turn */
	uint64_t releases;   /* the slot's releases (gs_ledger_settle) */
};

/*
 * Slot `slot`'s task entry, if it is in use and still names `task_id`: its
 * turn into *out and 0; -ENOENT if the slot has no such entry.
 */
int gs_ledger_own_turn(const struct gs_ledger *l, uint32_t slot, const char *task_id,
		       struct gs_turn *out);

/* Slot `slot`'s bytes, summed over its GPUs, and its boundaries. */
struct gs_slot_memory {
	uint64_t used;
	uint64_t persistent;
	uint64_t temporary;	 /* what each GPU holds beyond its persistent share */
	uint64_t temporary_peak; /* the sum of the GPUs' temporary peaks */
	uint64_t iterations;
	uint64_t peak;	   /* the slot's most bytes at once, all GPUs */
	uint64_t launches; /* its kernel launches */
};

void gs_ledger_slot_memory(const struct gs_ledger *l, uint32_t slot, struct gs_slot_memory *out);

/*
 * --- compute shares (ledger_compute.c, docs/compute.md) -----------------------------
 */

/* nodemgr: the header's GS_LEDGER_* flags (GS_LEDGER_COMPUTE: processes start a pacer). */
void gs_ledger_set_flags(struct gs_ledger *l, uint32_t flags);
uint32_t gs_ledger_flags(const struct gs_ledger *l);

/* A task's compute schedule, as nodemgr writes it and a pacer reads it. */
struct gs_schedule {
	uint32_t flags;	   /* GS_COMPUTE_* bits; 0: never gated */
	uint32_t share;	   /* percent, for reports */
	uint32_t gpu_mask; /* node GPUs the task holds: its board entries */
	uint32_t reserved;
	uint64_t period_ns;
	uint64_t offset_ns;
	uint64_t length_ns;
	uint64_t poll_ns;
	uint64_t ls_idle_ns;
};

/*
 * nodemgr: publish the task's schedule and wake its pacers (one writer:
 * nodemgr's loop); a schedule with flags also sets GS_PAUSE_COMPUTE, so that
 * processes without a pacer start one. -ENOENT if the task has no entry.
 */
int gs_ledger_task_schedule(struct gs_ledger *l, const char *task_id, const struct gs_schedule *s);

/* nodemgr: clear entry `task`'s schedule (no gating) and wake its pacers. */
void gs_ledger_entry_unschedule(struct gs_ledger *l, int task);

/* The schedule task entry `task` holds now into *out; its sequence word's value. */
uint32_t gs_ledger_entry_schedule(const struct gs_ledger *l, int task, struct gs_schedule *out);

/* The futex word a pacer of entry `task` sleeps on; NULL for an index past the table. */
uint32_t *gs_ledger_sched_word(struct gs_ledger *l, int task);

/* What pacers measured (struct gs_slot's device_ns and kin). */
struct gs_pacing {
	uint64_t device_ns;
	uint64_t overrun_ns;
	uint64_t gated_ns;
	uint64_t windows;
	uint64_t unmeasured;
	uint32_t processes; /* gs_ledger_task_pacing: the task's live slots */
	uint32_t pacers;    /* of which run a pacer */
};

/* A pacer, once it runs: mark slot `slot` as paced (gs_ledger_task_pacing counts it). */
void gs_ledger_slot_paced(struct gs_ledger *l, uint32_t slot);

/* A pacer (its thread alone): add `delta` to slot `slot`'s counters, as one change. */
void gs_ledger_pacing_add(struct gs_ledger *l, uint32_t slot, const struct gs_pacing *delta);

/* A launch that waited for the gate: add `ns` to slot `slot`'s gated_ns. */
void gs_ledger_gated_add(struct gs_ledger *l, uint32_t slot, uint64_t ns);

/* The sum of the counters of the live slots of `task_id` into *out; returns their number. */
int gs_ledger_task_pacing(const struct gs_ledger *l, const char *task_id, struct gs_pacing *out);

/*
 * The pacer's arithmetic (pure, unit-tested): overrun becomes debt that
 * shortens later windows, so that device time per period converges to the
 * window's length.
 *
 * gs_pace_open: the window [start, start + length) begins, seen at `now`
 * (late when now > start: time its own work already took). Returns when to
 * close the gate, or 0 when the debt takes the whole window (then it is
 * skipped); *debt is what is left to pay.
 *
 * gs_pace_close: the gate closed at `closed` and the work launched before
 * it completed at `done`. Returns the overrun, which is added to *debt (at
 * most `max_debt`).
 */
uint64_t gs_pace_open(uint64_t start, uint64_t length, uint64_t now, uint64_t *debt);
uint64_t gs_pace_close(uint64_t closed, uint64_t done, uint64_t max_debt, uint64_t *debt);

/*
 * The next window of a schedule at `now` (CLOCK_MONOTONIC): its start
 * (k * period + offset, the latest not after now whose window has not
 * ended, else the next).
 */
uint64_t gs_pace_window_start(uint64_t period, uint64_t offset, uint64_t length, uint64_t now);

/* nodemgr: fill a fresh (zeroed) board for `ngpus` GPUs; the magic last. */
int gs_board_init(struct gs_board *b, uint32_t ngpus);
int gs_board_check(const struct gs_board *b, size_t len);

/* An LS task's pacer: its GPUs (`mask`) saw launches at `now`. */
void gs_board_stamp(struct gs_board *b, uint32_t mask, uint64_t now);

/* Whether any of the GPUs in `mask` saw an LS launch less than `idle_ns` before `now`. */
int gs_board_ls_active(const struct gs_board *b, uint32_t mask, uint64_t now, uint64_t idle_ns);
