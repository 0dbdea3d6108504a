/*
 * The node-wide registry of who uses which simulated GPU (sim_usage.c): the
 * simulated driver records, per process and device, that it holds a context
 * and how much device memory; the simulated NVML, in other processes, lists
 * them (nvmlDeviceGetComputeRunningProcesses) and sums them (memory used).
 * It also records how long each process kept the device busy: every kernel
 * launch counts a fixed simulated run time (sim_usage_busy), or, with the
 * device timeline on (sim_timeline.c), each operation the span of the
 * device's time it occupies (sim_usage_schedule); NVML reports it as
 * utilisation over the last second, and as busy nanoseconds.
 *
 * The table is a file mapped shared by the processes of one simulated node:
 * with $GPUSHARE_SIM_STATE_DIR set (nodemgr names its own for its tasks),
 * DIR/gpushare-sim-usage-v3-NODE, shared by every user (made 0666, and
 * trusted when it is the user's own or the directory owner's); without,
 * /dev/shm/gpushare-sim-usage-v3-UID-NODE, this user's alone. NODE is
 * sim_node_id() in hex, so lists with other GPUs never meet. Entries of
 * processes that are gone are skipped and reused; a full table loses the
 * newest users, never a driver call.
 *
 * Compiled into both libraries with hidden visibility.
 */
#ifndef GPUSHARE_SIM_USAGE_H
#define GPUSHARE_SIM_USAGE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define SIM_USAGE_DIR_ENV "GPUSHARE_SIM_STATE_DIR"
#define SIM_USAGE_SLOTS 1024
/*
 * The most spans of device time a process may have pending on a device (not
 * all elapsed, and not back to back): a launch beyond waits, as a real
 * device's full launch queue makes it wait.
 */
#define SIM_USAGE_PENDING 128

/*
 * The driver's side. The calling process uses device spec_index (its
 * position in the spec list) and holds bytes of its memory now: called when
 * a context is first made on it and whenever the bytes change. The first
 * call for a device opens the table; later ones are one atomic store.
 */
void sim_usage_set(int spec_index, size_t bytes);

/* The calling process no longer uses spec_index (its last context went away). */
void sim_usage_clear(int spec_index);

/*
 * The calling process launched work that keeps spec_index busy for ns
 * nanoseconds, run after the work it launched before (its queue), from
 * now at the earliest. A queue more than SIM_USAGE_AHEAD_NS ahead of now is
 * full: the excess is not recorded (the device is busy all that time
 * anyway). Nothing is recorded without a context on the device.
 */
void sim_usage_busy(int spec_index, unsigned long long ns);

/* CLOCK_MONOTONIC in nanoseconds: the clock of every time here. */
uint64_t sim_usage_now(void);

/*
 * The device timeline. Whether the calling process may schedule on
 * spec_index now; if not, *until is when its oldest pending span ends.
 */
bool sim_usage_room(int spec_index, uint64_t *until);

/*
 * Schedules ns of spec_index's time, from after (and now) at the earliest:
 * it starts when the device is free of everything scheduled before, by any
 * process of the node, [*start, *end), and counts as the calling process's
 * busy time (with a context on the device).
 */
void sim_usage_schedule(int spec_index, uint64_t after, uint64_t ns, uint64_t *start,
			uint64_t *end);

/* The span utilisation is reported over, and the queue limit. */
#define SIM_USAGE_WINDOW_NS 1000000000ull
#define SIM_USAGE_AHEAD_NS 500000000ull

/*
 * NVML's start: in a state dir, map the node's table, making it if it is
 * not there, so that it is the directory owner's (nodemgr's) and open to the
 * processes of every user, who cannot make files there.
 */
void sim_usage_ready(void);

/* NVML's side: one live process using a device. */
struct sim_usage_proc {
	unsigned int pid;
	unsigned long long bytes;
	unsigned int util; /* percent of the last whole second its work kept the device busy */
};

/*
 * The live processes using spec_index: up to max of them into procs (which
 * may be NULL when max is 0) and the sum of all their bytes into *total.
 * Returns how many there are, which may be more than max.
 */
unsigned int sim_usage_list(int spec_index, struct sim_usage_proc *procs, unsigned int max,
			    unsigned long long *total);

/*
 * The device time the operations of live process pid on spec_index
 * occupied that has elapsed by now, in *ns; false if pid uses no context
 * there.
 */
bool sim_usage_process_busy(int spec_index, unsigned int pid, unsigned long long *ns);

/* The same for every operation scheduled on spec_index, of every process. */
unsigned long long sim_usage_device_busy(int spec_index);

#endif
