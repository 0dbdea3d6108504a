/*
 * pacer.c: compute shares (docs/compute.md). A thread per process keeps
 * the process-local gate word that every launch reads beside the pause
 * word: open in the task's windows (and, for a best-effort task, while the
 * latency-sensitive side is idle), closed otherwise. Above graph_mem.h.
 */
#ifndef GS_PACER_H
#define GS_PACER_H

#include "graph_mem.h"

#pragma GCC visibility push(hidden)

/*
 * 0: launches go. Nonzero: they wait in wait_to_launch until the pacer
 * opens it. Process-local, written by the pacer thread only (and a fork
 * child's handler); read relaxed on the launch path, since nothing else is
 * published through it. 0 forever in a process whose task has no schedule.
 */
extern uint32_t gs_compute_gate;

/*
 * Out of line: a launch that found the pause word (`pause`) or the gate
 * set waits here until both are clear.
 */
__attribute__((cold)) void wait_to_launch(uint32_t *pause);

#pragma GCC visibility pop

#endif
