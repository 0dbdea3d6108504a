/*
 * What a process under the shim reads of its ledger, one accessor per field
 * or figure: the shim's files read no ledger field themselves, so each read
 * has one place, and its memory order is said there. Compiled beside
 * ledger.c into the shim and into nodemgr's cffi bindings (ledger_api.h
 * declares both).
 *
 * What nodemgr writes once (the header, the GPUs' UUIDs) it writes before it
 * publishes the magic, which the shim checked when it mapped the ledger
 * (gs_ledger_check): plain reads. A task entry's id is written before its
 * state marks it used (gs_ledger_task_add): read after an acquire load of
 * the state, it is the id of the task the state says is there.
 */
#include <errno.h>
#include <stddef.h>
#include <string.h>

#include "ledger.h"

uint64_t gs_ledger_ctx_charge(const struct gs_ledger *l, uint32_t gpu)
{
	/* A setting: nothing else is published through it. */
	return gpu < GS_MAX_GPUS ? __atomic_load_n(&l->gpu[gpu].ctx_charge, __ATOMIC_RELAXED) : 0;
}

int gs_ledger_gpu_index(const struct gs_ledger *l, const uint8_t *uuid)
{
	for (uint32_t i = 0; i < l->ngpus && i < GS_MAX_GPUS; i++)
		if (memcmp(l->gpu[i].uuid, uuid, 16) == 0)
			return (int)i;
	return -ENOENT;
}

int gs_ledger_slot_task(const struct gs_ledger *l, uint32_t slot)
{
	int32_t t;

	if (slot >= GS_MAX_SLOTS)
		return -1;
	t = __atomic_load_n(&l->slot[slot].task_index, __ATOMIC_ACQUIRE);
	return t >= 0 && t < GS_MAX_TASKS ? t : -1;
}

uint32_t *gs_ledger_pause_word(struct gs_ledger *l, int task)
{
	return task >= 0 && task < GS_MAX_TASKS ? &l->task[task].paused : NULL;
}

uint64_t *gs_ledger_launch_counter(struct gs_ledger *l, uint32_t slot)
{
	return slot < GS_MAX_SLOTS ? &l->slot[slot].launches : NULL;
}

int gs_ledger_pause_word_names(const uint32_t *word, const char *task_id)
{
	const struct gs_task *entry =
		(const struct gs_task *)((const char *)word - offsetof(struct gs_task, paused));

	return strncmp(entry->task_id, task_id, GS_TASK_ID_LEN) == 0;
}

int gs_ledger_own_turn(const struct gs_ledger *l, uint32_t slot, const char *task_id,
		       struct gs_turn *out)
{
	int t = gs_ledger_slot_task(l, slot);
	const struct gs_task *entry;

	if (t < 0)
		return -ENOENT;
	entry = &l->task[t];
	/* The state first, with acquire: the id read after it is the entry's own (above). */
	if (__atomic_load_n(&entry->state, __ATOMIC_ACQUIRE) != GS_SLOT_USED ||
	    strncmp(entry->task_id, task_id, GS_TASK_ID_LEN) != 0)
		return -ENOENT;
	/*
	 * Each an acquire load, pairing with nodemgr's stores; the four are no
	 * snapshot: nodemgr may change one between two reads, and the next
	 * boundary reads them afresh.
	 */
	out->flags = __atomic_load_n(&entry->flags, __ATOMIC_ACQUIRE);
	out->releases = __atomic_load_n(&l->slot[slot].releases, __ATOMIC_ACQUIRE);
	out->paused = __atomic_load_n(&entry->paused, __ATOMIC_ACQUIRE);
	out->turn_until = __atomic_load_n(&entry->turn_until, __ATOMIC_ACQUIRE);
	return 0;
}

void gs_ledger_slot_memory(const struct gs_ledger *l, uint32_t slot, struct gs_slot_memory *out)
{
	const struct gs_slot *s;

	memset(out, 0, sizeof(*out));
	if (slot >= GS_MAX_SLOTS)
		return;
	s = &l->slot[slot];
	/* Figures for a report, each read on its own: no other memory is published through them. */
	for (int i = 0; i < GS_MAX_GPUS; i++) {
		uint64_t used = __atomic_load_n(&s->used[i], __ATOMIC_RELAXED);
		uint64_t pers = __atomic_load_n(&s->persistent[i], __ATOMIC_RELAXED);

		out->used += used;
		out->persistent += pers;
		out->temporary += used > pers ? used - pers : 0;
		out->temporary_peak += __atomic_load_n(&s->temp_peak[i], __ATOMIC_RELAXED);
	}
	out->iterations = __atomic_load_n(&s->iterations, __ATOMIC_RELAXED);
	out->peak = __atomic_load_n(&s->peak, __ATOMIC_RELAXED);
	out->launches = __atomic_load_n(&s->launches, __ATOMIC_RELAXED);
}
