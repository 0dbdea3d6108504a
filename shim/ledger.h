/* The shared-memory ledger: layout and operations (see ledger_layout.h). */
#ifndef GPUSHARE_LEDGER_H
#define GPUSHARE_LEDGER_H

#include <stddef.h>
#include <stdint.h>

#include "ledger_layout.h"
#include "ledger_api.h"

_Static_assert(sizeof(struct gs_gpu_entry) == 64, "gpu entry is one cache line");
/* A new field may take a reserved word (zero in a ledger made before it) without a new version. */
_Static_assert(sizeof(struct gs_slot) == 768, "slot layout changed: bump GS_LEDGER_VERSION");
_Static_assert(sizeof(struct gs_task) == 192, "task entry is three cache lines");
_Static_assert(offsetof(struct gs_task, sched_seq) % 64 == 0, "the schedule has a line of its own");
_Static_assert(sizeof(struct gs_board) == 64 + 64 * GS_MAX_GPUS, "board entry is one cache line");
_Static_assert(GS_PAUSE_HOLDING == (uint32_t)~GS_PAUSE_COMPUTE, "every pause bit holds but one");
_Static_assert(GS_MAX_SLOTS % 512 == 0, "the taken bits fill whole cache lines");
_Static_assert(sizeof(struct gs_ledger) == 64 + GS_MAX_SLOTS / 8 + 64 * GS_MAX_GPUS +
						   192 * GS_MAX_TASKS + 768 * GS_MAX_SLOTS,
	       "ledger layout changed: bump GS_LEDGER_VERSION");

#endif
