/*
 * The simulated driver's events: recording, queries, elapsed time, a
 * stream's wait on one (which joins a capture) and IPC event handles.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "sim_driver.h"
#include "sim_usage.h"

/*
 * Events. Without the device timeline an event is complete as soon as it
 * is recorded, and its time is that of its recording; with it, its time is
 * when its stream reaches it (sim_tl_mark_locked), and it is complete from
 * then on. cuEventElapsedTime is the difference of two events' times.
 */
struct CUevent_st {
	struct sim_obj obj;
	unsigned int flags;
	bool recorded;
	uint64_t when; /* CLOCK_MONOTONIC ns */
	/* Recorded in a capture: a stream that waits on it joins that capture. */
	struct CUgraph_st *capture;
	uint64_t capture_id;
	int capture_mode;
};

/*
 * With sim_obj_lock held: capture id is over. If e was recorded in it, it no
 * longer pulls streams into it.
 */
void sim_event_capture_over(struct CUevent_st *e, uint64_t id)
{
	if (e->capture_id == id) {
		e->capture = NULL;
		e->capture_id = 0;
	}
}

CUresult sim_impl_cuEventCreate(CUevent *pe, unsigned int flags)
{
	struct CUevent_st *e;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!pe || (flags & ~0x7u))
		return CUDA_ERROR_INVALID_VALUE;
	/* Interprocess events must not time, as the documentation requires. */
	if ((flags & CU_EVENT_INTERPROCESS) && !(flags & CU_EVENT_DISABLE_TIMING))
		return CUDA_ERROR_INVALID_VALUE;
	if (!sim_depth)
		return CUDA_ERROR_INVALID_CONTEXT;
	e = sim_obj_new(sizeof(*e), SIM_OBJ_EVENT, sim_current_dev());
	if (!e)
		return CUDA_ERROR_OUT_OF_MEMORY;
	e->flags = flags;
	sim_obj_add(&e->obj);
	*pe = e;
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuEventDestroy_v2(CUevent e)
{
	struct sim_obj *o;
	CUresult rc = sim_obj_take(e, SIM_OBJ_EVENT, CUDA_ERROR_INVALID_HANDLE, &o);

	if (rc == CUDA_SUCCESS)
		free(o);
	return rc;
}

/*
 * What a record or a wait works on: the event (NULL if ev is none) and the
 * stream's object (NULL for a default stream). On success sim_obj_lock is
 * held, for the caller to release.
 */
static CUresult sim_event_stream_lock(CUevent ev, CUstream stream, struct sim_ctx_slot *slot,
				      struct CUevent_st **pe, struct CUstream_st **ps)
{
	struct sim_obj **pp;
	CUresult rc = sim_stream_slot_live(stream, slot);

	if (rc != CUDA_SUCCESS)
		return rc;
	pthread_mutex_lock(&sim_obj_lock);
	pp = sim_obj_find(ev, SIM_OBJ_EVENT);
	*pe = pp ? (struct CUevent_st *)*pp : NULL;
	*ps = sim_stream_locked(stream);
	return CUDA_SUCCESS;
}

static CUresult sim_event_record(CUevent ev, CUstream stream)
{
	struct sim_ctx_slot slot;
	struct CUstream_st *s;
	struct CUevent_st *e;
	CUresult rc = sim_event_stream_lock(ev, stream, &slot, &e, &s);

	if (rc != CUDA_SUCCESS)
		return rc;
	if (!e) {
		rc = CUDA_ERROR_INVALID_HANDLE;
	} else if (!s || s->capture_status != CU_STREAM_CAPTURE_STATUS_ACTIVE) {
		e->recorded = true;
		e->capture = NULL;
		e->capture_id = 0;
		e->when = sim_tl_on() ? sim_tl_mark_locked(stream, s, slot.id) : sim_usage_now();
	} else {
		e->capture = s->capture;
		e->capture_id = s->capture_id;
		e->capture_mode = s->capture_mode;
	}
	pthread_mutex_unlock(&sim_obj_lock);
	return rc;
}

CUresult sim_impl_cuEventRecord(CUevent e, CUstream s)
{
	return sim_event_record(e, s);
}

CUresult sim_impl_cuEventRecordWithFlags(CUevent e, CUstream s, unsigned int flags)
{
	(void)flags;
	return sim_event_record(e, s);
}

/* The event's handle checked, and *when its work completes (0: never recorded). */
static CUresult sim_event_check(CUevent ev, uint64_t *when)
{
	struct sim_obj **pp;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	pthread_mutex_lock(&sim_obj_lock);
	pp = sim_obj_find(ev, SIM_OBJ_EVENT);
	if (pp) {
		const struct CUevent_st *e = (const struct CUevent_st *)*pp;

		*when = e->recorded ? e->when : 0;
	}
	pthread_mutex_unlock(&sim_obj_lock);
	return pp ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult sim_impl_cuEventQuery(CUevent e)
{
	uint64_t when;
	CUresult rc = sim_event_check(e, &when);

	if (rc == CUDA_SUCCESS && sim_tl_on() && sim_usage_now() < when)
		rc = CUDA_ERROR_NOT_READY;
	return rc;
}

CUresult sim_impl_cuEventSynchronize(CUevent e)
{
	uint64_t when;
	CUresult rc = sim_event_check(e, &when);

	if (rc != CUDA_SUCCESS)
		return rc;
	if (sim_tl_on())
		sim_tl_sleep_until(when);
	sim_sync();
	return rc;
}

CUresult sim_impl_cuEventElapsedTime(float *ms, CUevent start, CUevent end)
{
	struct CUevent_st a = { .recorded = false }, b = { .recorded = false };
	struct sim_obj **pa, **pb;
	CUresult rc = sim_check_args(ms != NULL);

	if (rc != CUDA_SUCCESS)
		return rc;
	pthread_mutex_lock(&sim_obj_lock);
	pa = sim_obj_find(start, SIM_OBJ_EVENT);
	pb = sim_obj_find(end, SIM_OBJ_EVENT);
	if (pa && pb) {
		a = *(struct CUevent_st *)*pa;
		b = *(struct CUevent_st *)*pb;
	}
	pthread_mutex_unlock(&sim_obj_lock);
	if (!pa || !pb)
		return CUDA_ERROR_INVALID_HANDLE;
	/* Documented: an event that times nothing, or was never recorded. */
	if ((a.flags | b.flags) & CU_EVENT_DISABLE_TIMING || !a.recorded || !b.recorded)
		return CUDA_ERROR_INVALID_HANDLE;
	/* As the driver documents: an event whose work has not completed yet. */
	if (sim_tl_on() && sim_usage_now() < (a.when > b.when ? a.when : b.when))
		return CUDA_ERROR_NOT_READY;
	*ms = (float)(((double)b.when - (double)a.when) / 1e6);
	return rc;
}

CUresult sim_impl_cuEventElapsedTime_v2(float *ms, CUevent start, CUevent end)
{
	return sim_impl_cuEventElapsedTime(ms, start, end);
}

/*
 * Without the timeline, waits are already over: nothing is outstanding
 * anywhere; with it, the stream's later work starts after the event's time.
 * A stream that waits on an event recorded in a capture joins that capture
 * (the fork of work onto another stream during a capture), as the driver
 * documents.
 */
CUresult sim_impl_cuStreamWaitEvent(CUstream stream, CUevent ev, unsigned int flags)
{
	struct sim_ctx_slot slot;
	struct CUstream_st *s;
	struct CUevent_st *e;
	CUresult rc;

	(void)flags;
	rc = sim_event_stream_lock(ev, stream, &slot, &e, &s);
	if (rc != CUDA_SUCCESS)
		return rc;
	if (!e) {
		rc = CUDA_ERROR_INVALID_HANDLE;
	} else if (e->capture_id) {
		if (!s)
			rc = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
		else if (s->capture_status == CU_STREAM_CAPTURE_STATUS_NONE) {
			s->capture_status = CU_STREAM_CAPTURE_STATUS_ACTIVE;
			s->capture = e->capture;
			s->capture_id = e->capture_id;
			s->capture_mode = e->capture_mode;
			s->capture_origin = false;
		}
	} else if (e->recorded && sim_tl_on() &&
		   (!s || s->capture_status != CU_STREAM_CAPTURE_STATUS_ACTIVE)) {
		sim_tl_done_locked(stream, s, slot.id, e->when);
	}
	pthread_mutex_unlock(&sim_obj_lock);
	return rc;
}

/* An event IPC handle names the event's process; the opener gets an event of its own. */
struct sim_ipc_event {
	uint32_t magic;
	uint32_t pid;
};

CUresult sim_impl_cuIpcGetEventHandle(CUipcEventHandle *h, CUevent ev)
{
	struct sim_ipc_event rec = { SIM_IPC_MAGIC, (uint32_t)getpid() };
	struct CUevent_st e;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!h)
		return CUDA_ERROR_INVALID_VALUE;
	if (!sim_obj_copy(ev, SIM_OBJ_EVENT, &e, sizeof(e)))
		return CUDA_ERROR_INVALID_HANDLE;
	if (!(e.flags & CU_EVENT_INTERPROCESS))
		return CUDA_ERROR_INVALID_VALUE;
	memset(h, 0, sizeof(*h));
	memcpy(h->reserved, &rec, sizeof(rec));
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuIpcOpenEventHandle(CUevent *pe, CUipcEventHandle h)
{
	struct sim_ipc_event rec;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	memcpy(&rec, h.reserved, sizeof(rec));
	if (!pe || rec.magic != SIM_IPC_MAGIC)
		return CUDA_ERROR_INVALID_VALUE;
	return sim_impl_cuEventCreate(pe, CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING);
}

/* The per-thread default stream variants (SIM_SAME_AS). */
SIM_SAME_AS(cuStreamWaitEvent_ptsz, cuStreamWaitEvent);
SIM_SAME_AS(cuEventRecord_ptsz, cuEventRecord);
SIM_SAME_AS(cuEventRecordWithFlags_ptsz, cuEventRecordWithFlags);
