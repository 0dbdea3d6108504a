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
 * GS_GATE_CLOSED clear: launches go. Set: they wait in wait_to_launch
 * until the pacer opens it. Every change gives the word a new value (a
 * generation above the bit), so a waiter never misses a close and open in
 * between. Process-local, written by the pacer thread (its exit handler and
 * a fork child's handler too); read relaxed on the launch path, since
 * nothing else is published through it. 0 forever in a process whose task
 * has no schedule.
 */
#define GS_GATE_CLOSED 1u
extern uint32_t gs_compute_gate;

/*
 * While a burst is open: the value of the process's launch counter at
 * which it has made all its launches (the pacer sets it before it opens the
 * gate); launches from there wait as at a closed gate until the pacer opens
 * the next burst. UINT64_MAX, never reached, otherwise.
 */
extern uint64_t gs_burst_end;

/*
 * Out of line: a launch that found the pause word (`pause`) or the gate
 * set, or its burst's launches made (gs_burst_end), waits here until the
 * pause word is clear and the gate open with launches left.
 */
__attribute__((cold)) void wait_to_launch(uint32_t *pause);

#pragma GCC visibility pop

#endif
