/*
 * The iteration API (gpushare.h, docs/timeslicing.md): boundaries that
 * classify a process's memory as persistent or temporary, pins, releases
 * and the memory report.
 */
#include "pools.h"

/* --- iterations: persistent and temporary memory (docs/timeslicing.md) ---------- */

/*
 * A process without a slot yet has never called into the driver, so it
 * holds nothing to classify: its boundaries are not counted, and its epoch
 * starts with the first boundary after it claims one (cuInit claims it).
 */
GS_EXPORT int gpushare_iteration(void)
{
	struct gs_turn turn;
	uint64_t epoch;
	int slot, flags = 0;

	if (mode_acquire() != GS_ENFORCE)
		return 0;
	slot = __atomic_load_n(&gs_state.slot, __ATOMIC_ACQUIRE);
	if (slot < 0)
		return 0;
	pthread_mutex_lock(&gs_state.epoch_mu);
	epoch = gs_state.epoch + 1;
	__atomic_store_n(&gs_state.epoch, epoch, __ATOMIC_RELEASE);
	gs_ledger_boundary(gs_state.ledger, (uint32_t)slot, epoch);
	pools_at_boundary();
	pthread_mutex_unlock(&gs_state.epoch_mu);
	/* As in wait_while_paused: an entry handed on to a newer task is not this one's. */
	if (gs_ledger_own_turn(gs_state.ledger, (uint32_t)slot, gs_state.task_id, &turn) != 0)
		return 0;
	/*
	 * On a time-sliced GPU a process that never released does so once, so that its
	 * shape can be learned: at its first boundary, or at its first one after its GPU
	 * became time-sliced.
	 */
	if ((turn.flags & GS_TASK_TIMESLICED) && turn.releases == 0)
		flags |= GPUSHARE_RELEASE;
	/*
	 * A task waiting for its turn holds no temporary memory: a process that reaches
	 * a boundary while its task is gated (its turn ended while it finished its step)
	 * releases before its next launch waits.
	 */
	if (turn.paused & GS_PAUSE_TURN)
		flags |= GPUSHARE_RELEASE;
	/*
	 * Each process yields at its own turn_until-th boundary; nodemgr hands the turn
	 * on once every iterating process of the task has (a barrier across them).
	 */
	if (turn.turn_until != 0 && epoch >= turn.turn_until)
		flags |= GPUSHARE_RELEASE | GPUSHARE_YIELD;
	return flags;
}

GS_EXPORT void gpushare_released(void)
{
	int slot;

	if (mode_acquire() != GS_ENFORCE)
		return;
	slot = __atomic_load_n(&gs_state.slot, __ATOMIC_ACQUIRE);
	if (slot >= 0)
		gs_ledger_settle(gs_state.ledger, (uint32_t)slot);
}

/*
 * Pin the charged record (key, kind): a temporary one's bytes join the
 * persistent share, and its free takes them out again. Under epoch_mu, so
 * no boundary moves the epoch meanwhile. -ENOENT if there is no record.
 */
static void pin_record(struct gs_alloc *a, void *arg)
{
	int slot = *(const int *)arg;

	/* One made before the current epoch is persistent already. */
	if (!a->pinned && a->epoch == gs_state.epoch && slot >= 0) {
		a->pinned = 1;
		gs_ledger_persist(gs_state.ledger, (uint32_t)slot, (uint32_t)a->gpu, a->size);
	}
}

static int pin(uint64_t key, uint32_t kind)
{
	int slot = __atomic_load_n(&gs_state.slot, __ATOMIC_ACQUIRE);

	return gs_map_update(key, kind, pin_record, &slot);
}

/*
 * `dptr` is where an allocation that yields a device pointer starts (all
 * of them are recorded as GS_K_PTR), or where a cuMemCreate handle is
 * mapped: then the handle's memory is what is pinned.
 */
GS_EXPORT int gpushare_mark_persistent(unsigned long long dptr)
{
	struct gs_alloc map;
	int rc;

	if (mode_acquire() != GS_ENFORCE || dptr == 0)
		return GPUSHARE_E_INVAL;
	pthread_mutex_lock(&gs_state.epoch_mu);
	rc = pin(dptr, GS_K_PTR);
	if (rc != 0 && gs_map_peek(dptr, GS_K_MAP, &map) == 0)
		rc = pin(map.owner, GS_K_HANDLE);
	pthread_mutex_unlock(&gs_state.epoch_mu);
	return rc == 0 ? GPUSHARE_OK : GPUSHARE_E_INVAL;
}

GS_EXPORT int gpushare_memory(struct gpushare_memory *out)
{
	struct gs_slot_memory mem;
	int slot;

	if (out == NULL || mode_acquire() != GS_ENFORCE)
		return GPUSHARE_E_INVAL;
	memset(out, 0, sizeof(*out));
	slot = __atomic_load_n(&gs_state.slot, __ATOMIC_ACQUIRE);
	if (slot < 0)
		return GPUSHARE_OK;
	gs_ledger_slot_memory(gs_state.ledger, (uint32_t)slot, &mem);
	out->used = mem.used;
	out->persistent = mem.persistent;
	out->temporary = mem.temporary;
	out->temporary_peak = mem.temporary_peak;
	out->iterations = mem.iterations;
	return GPUSHARE_OK;
}

GS_EXPORT int gpushare_counters(struct gpushare_counters *out, unsigned long size)
{
	struct gpushare_counters all = { 0 };
	struct gs_slot_memory mem;
	int slot;

	if (out == NULL || size % sizeof(unsigned long long) != 0 || mode_acquire() != GS_ENFORCE)
		return GPUSHARE_E_INVAL;
	slot = __atomic_load_n(&gs_state.slot, __ATOMIC_ACQUIRE);
	if (slot >= 0) {
		gs_ledger_slot_memory(gs_state.ledger, (uint32_t)slot, &mem);
		all.peak = mem.peak;
		all.launches = mem.launches;
	}
	/* What the caller's struct holds beyond ours: fields of a newer header, unknown here. */
	if (size > sizeof(all)) {
		memset((char *)out + sizeof(all), 0, size - sizeof(all));
		size = sizeof(all);
	}
	memcpy(out, &all, size);
	return GPUSHARE_OK;
}
