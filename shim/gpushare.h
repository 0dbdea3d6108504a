/*
 * gpushare's preload library (libgpushare.so): its public API.
 *
 * The library normally takes its settings from the environment when it is
 * loaded (GPUSHARE_LEDGER, GPUSHARE_TASK_ID). Loaded without a ledger it is
 * inert and passes every CUDA call through. gpushare_attach lets a process
 * whose shim was loaded inert switch it to enforcing later, for example once
 * a plugin has obtained a grant, without restarting the process.
 *
 * A program that may run without the shim should not link against it: it
 * looks the functions up with dlsym(RTLD_DEFAULT, "gpushare_attach") and
 * treats NULL as "no shim in this process".
 */
#ifndef GPUSHARE_H
#define GPUSHARE_H

#ifdef __cplusplus
extern "C" {
#endif

/* cffi-cdef begin: to the end mark, plain C for cffi's parser (gpushare/_shim_cdef.py). */

/* What gpushare_attach returns. */
enum gpushare_status {
	GPUSHARE_OK = 0,
	/* An argument is NULL or empty, or the task id is too long (23 bytes at most). */
	GPUSHARE_E_INVAL = -1,
	/* The shim already enforces a ledger, or was started with an unusable one (broken). */
	GPUSHARE_E_ATTACHED = -2,
	/*
	 * The process already called into the CUDA driver through the shim while it
	 * was inert: what it allocated then is unknown to the shim, so enforcing now
	 * would undercount. Looking entry points up (dlsym on libcuda's handle) is
	 * not a call and does not count.
	 */
	GPUSHARE_E_TOO_LATE = -3,
	/* The ledger cannot be opened or mapped, or is not of this shim's version. */
	GPUSHARE_E_LEDGER = -4,
};

/* What gpushare_mode returns. */
enum gpushare_mode {
	GPUSHARE_MODE_INERT = 0,   /* no ledger: every call passes through */
	GPUSHARE_MODE_ENFORCE = 1, /* allocations are charged to a ledger and limited */
	GPUSHARE_MODE_BROKEN = 2,  /* a ledger was named at load but unusable: allocations fail */
};

/*
 * Switch an inert shim to enforcing: charge this process's allocations to the
 * ledger at ledger_path, in a slot recorded as task_id's. Call it before the
 * process first calls into CUDA. Thread-safe; prints nothing.
 *
 * Returns GPUSHARE_OK, or a negative enum gpushare_status value; on any
 * failure the shim stays as it was (an inert shim stays inert). After a
 * successful attach the process behaves as one started with GPUSHARE_LEDGER
 * and GPUSHARE_TASK_ID set, fork children included; programs it executes
 * do not inherit it unless those variables are in their environment.
 */
int gpushare_attach(const char *ledger_path, const char *task_id);

/* The shim's mode now: an enum gpushare_mode value. */
int gpushare_mode(void);

/* What gpushare_iteration asks of its caller (docs/timeslicing.md). */
enum gpushare_iteration_flags {
	/*
	 * Release the framework's cached memory, then call gpushare_released: on a
	 * time-sliced GPU once to learn the task's shape (the process's first boundary
	 * while it has never released), when the task waits for its turn, and with
	 * GPUSHARE_YIELD.
	 */
	GPUSHARE_RELEASE = 1,
	/*
	 * The task's turn is over (this process's boundary count reached the turn's
	 * end): after the release, tell nodemgr (`yield`).
	 */
	GPUSHARE_YIELD = 2,
};

/*
 * An iteration boundary of this process: what it holds now becomes
 * persistent, what it allocates from now on is temporary until the next
 * boundary. Returns enum gpushare_iteration_flags bits (0: carry on). In a
 * shim that enforces no ledger, and in a process that has not called into
 * CUDA yet (it holds nothing to classify), it returns 0 and counts nothing.
 * Thread-safe; never waits for a pause or the GPU (only, briefly, for
 * another thread's boundary), prints nothing. Cheap enough for every step.
 */
int gpushare_iteration(void);

/*
 * The caller has released its cached memory as gpushare_iteration asked:
 * its persistent bytes now are recorded as its settled size. Nothing in a
 * shim that enforces no ledger.
 */
void gpushare_released(void);

/*
 * Count the allocation that starts at device pointer `dptr` (any allocation
 * that yields a device pointer, or the cuMemCreate memory mapped at `dptr`)
 * as persistent until it is freed. One made before the last boundary is
 * persistent already: GPUSHARE_OK, nothing changes. GPUSHARE_E_INVAL if the
 * shim knows no such allocation, or enforces no ledger.
 */
int gpushare_mark_persistent(unsigned long long dptr);

/*
 * This process's memory by region, summed over its GPUs (bytes), as its
 * ledger slot holds it. Before the process's first boundary nothing is
 * persistent unless marked so: all it holds reads as temporary there, while
 * temporary_peak counts from the first boundary on. Context charges are in
 * used (and persistent from the first boundary on).
 */
struct gpushare_memory {
	unsigned long long used;
	unsigned long long persistent;
	unsigned long long temporary;	   /* used - persistent, per GPU */
	unsigned long long temporary_peak; /* sum over GPUs of the most temporary bytes at once */
	unsigned long long iterations;	   /* boundaries this process reported */
};

/* Fill `out`; GPUSHARE_E_INVAL if `out` is NULL or the shim enforces no ledger. */
int gpushare_memory(struct gpushare_memory *out);

/*
 * This process's counters, as its ledger slot holds them. Fields are only ever added at
 * the end: a caller passes the size of the struct it was built with, and the shim fills
 * that much of it (a newer caller's fields the shim does not know read 0).
 */
struct gpushare_counters {
	unsigned long long peak;     /* the most bytes it held at once, all GPUs */
	unsigned long long launches; /* kernel launches (graph launches count one) */
};

/*
 * Fill the first `size` bytes of `out`; GPUSHARE_E_INVAL if `out` is NULL, `size` is
 * not a multiple of 8, or the shim enforces no ledger.
 */
int gpushare_counters(struct gpushare_counters *out, unsigned long size);

/* cffi-cdef end */

#ifdef __cplusplus
}
#endif

#endif
