/*
 * Layout of an environment's shared-memory ledger, and of the node's board.
 *
 * This file is read by the C compiler (through ledger.h) and by cffi's cdef
 * parser (nodemgr's bindings), so it must stay plain C: no includes, no
 * guards, no attributes, integer #defines only.
 *
 * nodemgr creates one ledger file per environment and alone writes the
 * header and the per-GPU limits. Each process running under the shim claims
 * one slot (by taking an open-file-description lock on the slot's first
 * byte, which the kernel drops when the process dies) and charges its own
 * bytes there, and to the GPU's `charged` counter, which a charge checks
 * against the limit in one atomic add, whatever the number of slots. Every
 * update is ordered so that a process killed between two of its steps can
 * only leave `charged` too high, never too low: reaping its slot takes back
 * what the slot holds, and what a kill left over (at most the one charge in
 * flight) is taken back when the environment next has no process.
 */

#define GS_LEDGER_MAGIC 0x3152444c53555047
#define GS_LEDGER_VERSION 6
#define GS_MAX_GPUS 16
#define GS_MAX_SLOTS 1024
#define GS_MAX_TASKS 1024
#define GS_TASK_ID_LEN 24

#define GS_SLOT_FREE 0
#define GS_SLOT_USED 1

/*
 * Bits of a task entry's pause word: launches and allocations wait while any is set,
 * but GS_PAUSE_COMPUTE, which holds nothing: it sends the task's next launches out of
 * line, where a process whose task got a compute schedule starts its pacer.
 */
#define GS_PAUSE_ADMIN 1	    /* an operator paused the task */
#define GS_PAUSE_TURN 2		    /* a time-sliced GPU of the task is another task's turn */
#define GS_PAUSE_CLASS 4	    /* a best-effort task paused for a latency-sensitive one */
#define GS_PAUSE_COMPUTE 8	    /* some process of the task may have no pacer yet (pacer.c) */
#define GS_PAUSE_HOLDING 0xfffffff7 /* the bits that hold: all but GS_PAUSE_COMPUTE */

/* Bits of a task entry's flags, written by nodemgr. */
#define GS_TASK_TIMESLICED 1 /* the task runs on a time-sliced GPU: learn its shape */

/* Bits of the ledger header's flags, written by nodemgr. */
#define GS_LEDGER_COMPUTE 1 /* compute control is on: each process starts a pacer (pacer.c) */

/*
 * Bits of a task entry's compute_flags (docs/compute.md), written by nodemgr:
 * none set, the task's launches are never gated.
 */
#define GS_COMPUTE_WINDOW 1	/* launch only in [offset, offset + length) of each period */
#define GS_COMPUTE_LS_PUBLISH 2 /* latency-sensitive: stamp the board when launches move */
#define GS_COMPUTE_YIELD_LS 4	/* best-effort: outside a window, launch only while LS is idle */

#define GS_BOARD_MAGIC 0x3144524f42535047
#define GS_BOARD_VERSION 1

struct gs_gpu_entry {
	uint64_t limit;
	uint8_t uuid[16];
	uint32_t node_index;
	uint32_t reserved0;
	uint64_t ctx_charge; /* bytes a process is charged for its context on this GPU */
	/*
	 * Bytes the slots hold on this GPU, plus charges being checked and at
	 * most what killed processes left in flight: what a charge must fit
	 * beside. Written by every process of the environment; on the line of
	 * the limit, which each charge reads anyway.
	 */
	uint64_t charged;
	/*
	 * Top-up (docs/prediction.md#admission): a task granted less than its
	 * environment's quota may be granted more while it runs. nodemgr may
	 * raise `limit` up to `topup_limit` (0, or not above the limit: never); a
	 * process whose charge the limit refuses raises `wanted` to the count it
	 * needed and waits a while for the limit to move; nodemgr zeroes `wanted`
	 * once it has answered, after raising the limit if it did. Older ledgers
	 * had zeros here: no top-up.
	 */
	uint64_t topup_limit;
	uint64_t wanted;
};

/*
 * One running task of the environment. nodemgr fills an entry before the
 * grant leaves and frees it when the task ends; a process finds its task's
 * entry once, when it claims its slot.
 */
struct gs_task {
	char task_id[GS_TASK_ID_LEN];
	uint32_t state;	 /* GS_SLOT_FREE or GS_SLOT_USED */
	uint32_t paused; /* GS_PAUSE_* bits; nonzero: launches and allocations wait (futex word) */
	uint64_t last_launch_ns; /* CLOCK_REALTIME of the last sweep that saw launches move */
	uint64_t iterations; /* the most iteration boundaries any process of the task reported */
	/*
	 * nodemgr: the boundary count at which the task's turn ends (it then
	 * releases its temporary memory and yields); 0: the task is not gated.
	 */
	uint64_t turn_until;
	uint32_t flags; /* GS_TASK_* bits */
	uint32_t reserved0;
	/*
	 * Written by the task's processes at each granted charge and each
	 * uncharge, so on a cache line of its own: the first holds the pause
	 * word every launch reads.
	 */
	uint64_t used; /* bytes its processes hold now, all GPUs */
	uint64_t peak; /* the most they held at once: the task's exact peak */
	uint64_t reserved[6];
	/*
	 * The compute schedule (docs/compute.md), written by nodemgr and read by
	 * each process's pacer thread, never by the launch path: a line of its
	 * own. A seqlock: nodemgr makes sched_seq odd, writes the rest, makes it
	 * even again and wakes the pacers waiting on it (a futex word).
	 */
	uint32_t sched_seq;
	uint32_t compute_flags; /* GS_COMPUTE_* bits; 0: never gated */
	uint32_t share;		/* percent of the GPU's time, for reports; 0: none */
	uint32_t gpu_mask;	/* bit i: the task holds node GPU i (its board entries) */
	uint64_t period_ns;	/* windows recur every period, aligned to CLOCK_MONOTONIC */
	uint64_t offset_ns;	/* the window's start within its period */
	uint64_t length_ns;	/* its length */
	uint64_t poll_ns;	/* how often the pacer looks at the board and launch counter */
	uint64_t ls_idle_ns;	/* LS idle this long: best-effort may launch */
	uint64_t reserved2;
};

/*
 * A process's charges. Per GPU, `used` splits into persistent bytes (what was
 * still allocated at the process's last iteration boundary, or marked so)
 * and temporary bytes (used - persistent: allocated since). Only the owning
 * process writes its slot, except a reaper clearing a dead one (nodemgr, or
 * a process of the environment whose charge was refused).
 */
struct gs_slot {
	uint64_t used[GS_MAX_GPUS];
	uint64_t persistent[GS_MAX_GPUS];
	uint64_t temp_peak
		[GS_MAX_GPUS]; /* most temporary bytes at once, from the first boundary on */
	uint64_t settled[GS_MAX_GPUS]; /* persistent bytes right after the last release */
	uint64_t launches;
	uint64_t last_launch_ns;
	int32_t pid;
	uint32_t state;
	char task_id[GS_TASK_ID_LEN];
	uint64_t peak;		/* most bytes this slot held at once, over all GPUs */
	uint64_t launches_seen; /* nodemgr: launches at its last sweep */
	int32_t task_index;	/* the process's task entry, -1 if none (set at claim) */
	uint32_t pacer;		/* 1 once the process runs its pacer thread (pacer.c) */
	uint64_t iterations;	/* iteration boundaries this process reported */
	uint64_t releases; /* times it released its temporary memory (settled is valid when > 0) */
	uint64_t boundary_ns; /* CLOCK_MONOTONIC of the last boundary; 0: none yet */
	uint64_t held;	      /* bytes this slot holds now, all GPUs: what its peak follows */
	/*
	 * What the process's pacer measured, cumulative, for reports
	 * (docs/compute.md): written by the pacer thread only, each change
	 * between two increments of pacing_seq (odd while it writes), so a
	 * reader sees whole windows; gated_ns alone is added by launches too.
	 */
	uint64_t device_ns;  /* device time of its windows: open time plus overrun */
	uint64_t overrun_ns; /* how long the work of its windows ran past their end */
	uint64_t gated_ns;   /* how long its launches waited for the gate */
	uint64_t windows;    /* windows it opened */
	uint64_t unmeasured; /* of which not measured (a stream capture was under way) */
	uint64_t pacing_seq;
	uint64_t reserved1[GS_MAX_GPUS - 7];
	uint64_t reserved[4];
};

struct gs_ledger {
	uint64_t magic;
	uint32_t version;
	uint32_t size;
	uint32_t ngpus;
	uint32_t nslots;
	uint32_t flags;		/* GS_LEDGER_* bits */
	uint32_t topup_wait_ms; /* how long a refused charge waits for a top-up; 0: never */
	uint64_t reserved[4];
	/*
	 * Bit i set: slot i is taken. Written only by whoever holds the slot's
	 * lock: a claimer sets it once it holds the lock, before it charges
	 * anything; a reaper clears it once it has zeroed a dead process's slot.
	 * Claimers try the locks of slots whose bit is clear only, and readers
	 * visit only the slots whose bit is set.
	 */
	uint64_t slot_taken[GS_MAX_SLOTS / 64];
	struct gs_gpu_entry gpu[GS_MAX_GPUS];
	struct gs_task task[GS_MAX_TASKS];
	struct gs_slot slot[GS_MAX_SLOTS];
};

/*
 * The node's board (docs/compute.md#latency-classes): one file nodemgr
 * creates in its run directory, mapped by the processes of latency-sensitive
 * and best-effort tasks. Every task may write it (mode 0666): a writer can at
 * worst hold best-effort tasks back, never take memory or time from others.
 */
struct gs_board_entry {
	uint64_t ls_last_ns; /* CLOCK_MONOTONIC of the last LS launch seen on this GPU */
	uint64_t reserved[7];
};

struct gs_board {
	uint64_t magic;
	uint32_t version;
	uint32_t ngpus;
	uint64_t reserved[6];
	struct gs_board_entry gpu[GS_MAX_GPUS]; /* by node GPU index */
};
