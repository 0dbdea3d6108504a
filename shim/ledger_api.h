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
 * nodemgr: give `task_id` a task entry (before its grant is sent); returns
 * the entry index, or -ENOSPC when all GS_MAX_TASKS are in use. Adding a
 * task that has an entry returns that entry.
 */
int gs_ledger_task_add(struct gs_ledger *l, const char *task_id);

/* nodemgr: free the task's entry (waking any launch it held). -ENOENT if none. */
int gs_ledger_task_remove(struct gs_ledger *l, const char *task_id);

/*
 * nodemgr: pause (nonzero) or resume (0) the task's kernel launches; on
 * resume every process waiting in a launch is woken. -ENOENT if no entry.
 */
int gs_ledger_task_pause(struct gs_ledger *l, const char *task_id, uint32_t paused);

/* The task's entry index, or -ENOENT. */
int gs_ledger_task_find(const struct gs_ledger *l, const char *task_id);

/*
 * nodemgr, once per sweep: for each slot whose launch count moved since the
 * last call, record `now_ns` as the last launch time of the slot's task.
 */
void gs_ledger_stamp_launches(struct gs_ledger *l, uint64_t now_ns);

/* Bytes charged on `gpu` by all slots (saturating). */
uint64_t gs_ledger_used(const struct gs_ledger *l, uint32_t gpu);

/*
 * Sum of the slots that carry `task_id`: bytes per GPU into used[GS_MAX_GPUS],
 * kernel launches into *launches, and the sum of each slot's peak (its most
 * bytes at once) into *peak. Returns the number of such slots.
 */
int gs_ledger_task_usage(const struct gs_ledger *l, const char *task_id,
			 uint64_t *used, uint64_t *launches, uint64_t *peak);

/* One used slot, as gs_ledger_summary reports it. */
struct gs_slot_info {
	char task_id[24];
	int32_t pid;
	uint32_t slot;
	uint64_t used;     /* bytes now, all GPUs */
	uint64_t peak;     /* most bytes at once, all GPUs */
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
 * freed are described into `out` (may be NULL) as they were. Returns the
 * number of slots reaped, or a negative errno value.
 */
int gs_ledger_reap(struct gs_ledger *l, int fd, struct gs_slot_info *out, uint32_t max);

/*
 * A process: claim a free slot for itself through `fd` (an O_RDWR
 * descriptor of its own, kept open for the life of the claim), recording
 * its task's entry in the slot. Returns the slot index or a negative errno
 * value.
 */
int gs_ledger_claim(struct gs_ledger *l, int fd, int32_t pid, const char *task_id);

/*
 * A process: charge `bytes` on `gpu` to slot `slot` if the environment stays
 * within the GPU's limit. Returns 0, or -ENOSPC when over the limit (then
 * nothing stays charged). Never check-then-add: the slot is charged first
 * and the total read after, so racing processes can both fail but never
 * both pass beyond the limit.
 */
int gs_ledger_charge(struct gs_ledger *l, uint32_t slot, uint32_t gpu, uint64_t bytes);
void gs_ledger_uncharge(struct gs_ledger *l, uint32_t slot, uint32_t gpu, uint64_t bytes);
