/*
 * The node-wide registry of who uses which simulated GPU (sim_usage.c): the
 * simulated driver records, per process and device, that it holds a context
 * and how much device memory; the simulated NVML, in other processes, lists
 * them (nvmlDeviceGetComputeRunningProcesses) and sums them (memory used).
 * It also records how long each process kept the device busy: every kernel
 * launch counts a fixed simulated run time (sim_usage_busy), which NVML
 * reports as utilisation over the last second.
 *
 * The table is a file mapped shared by the processes of one simulated node:
 * with $GPUSHARE_SIM_STATE_DIR set (nodemgr names its own for its tasks),
 * DIR/gpushare-sim-usage-v2-NODE, shared by every user (made 0666, and
 * trusted when it is the user's own or the directory owner's); without,
 * /dev/shm/gpushare-sim-usage-v2-UID-NODE, this user's alone. NODE is
 * sim_node_id() in hex, so lists with other GPUs never meet. Entries of
 * processes that are gone are skipped and reused; a full table loses the
 * newest users, never a driver call.
 *
 * Compiled into both libraries with hidden visibility.
 */
#ifndef GPUSHARE_SIM_USAGE_H
#define GPUSHARE_SIM_USAGE_H

#include <stddef.h>

#define SIM_USAGE_DIR_ENV "GPUSHARE_SIM_STATE_DIR"
#define SIM_USAGE_SLOTS 1024

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

#endif
