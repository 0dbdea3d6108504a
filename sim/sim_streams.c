/*
 * The simulated driver's streams, stream capture and kernel and graph
 * launches (events are sim_events.c's, graphs sim_graphs.c's). An
 * operation on a stream is done by the time its call returns, unless the
 * stream is capturing, when it is recorded into a graph to be done at each
 * launch of it. With the device timeline on (sim_timeline.c) it also
 * occupies its device for a modelled time, which synchronisations wait for.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "sim_attrs.h"
#include "sim_driver.h"
#include "sim_usage.h"

/*
 * Streams. A stream is a handle bound to the context that was current when
 * it was made: it decides the device (and the owning context) of what is
 * allocated on it, and, with the timeline, the order of the work on it.
 * NULL, CU_STREAM_LEGACY and CU_STREAM_PER_THREAD name a default stream of
 * the calling thread's current context.
 */

static uint64_t sim_stream_serial; /* the last stream id handed out; atomic */

static void sim_capture_end_locked(uint64_t id);

static bool sim_default_stream(CUstream stream)
{
	return !stream || stream == CU_STREAM_LEGACY || stream == CU_STREAM_PER_THREAD;
}

/* The context behind a stream, as a stack slot. */
CUresult sim_stream_slot(CUstream stream, struct sim_ctx_slot *slot)
{
	const struct sim_ctx_slot *cur;
	struct sim_obj seen;

	if (sim_default_stream(stream)) {
		cur = sim_current();
		if (!cur)
			return CUDA_ERROR_INVALID_CONTEXT;
		*slot = *cur;
		return CUDA_SUCCESS;
	}
	if (!sim_obj_lookup(stream, SIM_OBJ_STREAM, false, &seen))
		return CUDA_ERROR_INVALID_HANDLE;
	slot->ctx = seen.ctx;
	slot->dev = seen.dev;
	slot->id = seen.owner;
	return CUDA_SUCCESS;
}

/* sim_stream_slot for an entry point: CUDA_ERROR_NOT_INITIALIZED before cuInit. */
CUresult sim_stream_slot_live(CUstream stream, struct sim_ctx_slot *slot)
{
	return sim_initialized() ? sim_stream_slot(stream, slot) : CUDA_ERROR_NOT_INITIALIZED;
}

/*
 * The flags are the documented ones. A stream made while its context is
 * being destroyed on another thread (undefined in the driver) outlives it as
 * an orphan handle.
 */
CUresult sim_impl_cuStreamCreate(CUstream *stream, unsigned int flags)
{
	struct CUstream_st *s;
	CUresult rc;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!stream || (flags & ~(unsigned int)CU_STREAM_NON_BLOCKING))
		return CUDA_ERROR_INVALID_VALUE;
	s = sim_obj_new_current(sizeof(*s), SIM_OBJ_STREAM, &rc);
	if (!s)
		return rc;
	s->flags = flags;
	s->id = __atomic_add_fetch(&sim_stream_serial, 1, __ATOMIC_RELAXED);
	sim_obj_add(&s->obj);
	*stream = s;
	return CUDA_SUCCESS;
}

/*
 * With sim_obj_lock held: a stream that goes ends its capture if it began
 * one; the graph it captured into is returned for the caller to free.
 */
static struct CUgraph_st *sim_stream_gone_locked(struct CUstream_st *s)
{
	struct CUgraph_st *g = NULL;

	if (s->capture_status != CU_STREAM_CAPTURE_STATUS_NONE && s->capture_origin) {
		g = s->capture;
		sim_capture_end_locked(s->capture_id);
	}
	return g;
}

/* A default stream is not the caller's to destroy. */
CUresult sim_impl_cuStreamDestroy_v2(CUstream stream)
{
	struct CUgraph_st *g = NULL;
	struct sim_obj *o;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (sim_default_stream(stream))
		return CUDA_ERROR_INVALID_HANDLE;
	pthread_mutex_lock(&sim_obj_lock);
	o = sim_obj_unlink_locked(stream, SIM_OBJ_STREAM);
	if (o)
		g = sim_stream_gone_locked((struct CUstream_st *)o);
	pthread_mutex_unlock(&sim_obj_lock);
	if (!o)
		return CUDA_ERROR_INVALID_HANDLE;
	sim_graph_free(g);
	free(o);
	return CUDA_SUCCESS;
}

static CUresult sim_stream_ctx(CUstream stream, CUcontext *pctx)
{
	struct sim_ctx_slot slot;
	CUresult rc = sim_check_args(pctx != NULL);

	if (rc == CUDA_SUCCESS)
		rc = sim_stream_slot(stream, &slot);
	if (rc == CUDA_SUCCESS)
		*pctx = slot.ctx;
	return rc;
}

CUresult sim_impl_cuStreamGetCtx(CUstream stream, CUcontext *pctx)
{
	return sim_stream_ctx(stream, pctx);
}

/* The per-thread default stream is the current context's too. */
CUresult sim_impl_cuStreamGetCtx_ptsz(CUstream stream, CUcontext *pctx)
{
	return sim_stream_ctx(stream, pctx);
}

/* CUDA 12.5: a stream of a green context would report it; there are none here. */
static CUresult sim_stream_ctx_v2(CUstream stream, CUcontext *pctx, CUgreenCtx *pgreen)
{
	CUresult rc;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!pgreen)
		return CUDA_ERROR_INVALID_VALUE;
	rc = sim_stream_ctx(stream, pctx);
	if (rc == CUDA_SUCCESS)
		*pgreen = NULL;
	return rc;
}

CUresult sim_impl_cuStreamGetCtx_v2(CUstream stream, CUcontext *pctx, CUgreenCtx *pgreen)
{
	return sim_stream_ctx_v2(stream, pctx, pgreen);
}

CUresult sim_impl_cuStreamGetCtx_v2_ptsz(CUstream stream, CUcontext *pctx, CUgreenCtx *pgreen)
{
	return sim_stream_ctx_v2(stream, pctx, pgreen);
}

/* Without the timeline nothing is outstanding: only the handle is checked. */
static CUresult sim_stream_sync(CUstream stream)
{
	struct sim_ctx_slot slot;
	CUresult rc;

	rc = sim_stream_slot_live(stream, &slot);
	if (rc != CUDA_SUCCESS)
		return rc;
	if (sim_tl_on())
		sim_tl_sleep_until(sim_tl_stream_end(stream, &slot));
	sim_sync();
	return rc;
}

CUresult sim_impl_cuStreamSynchronize(CUstream stream)
{
	return sim_stream_sync(stream);
}

CUresult sim_impl_cuStreamSynchronize_ptsz(CUstream stream)
{
	return sim_stream_sync(stream);
}

/*
 * What one kernel launch keeps its device busy for, as NVML's utilisation
 * counts it (sim_usage_busy): GPUSHARE_SIM_KERNEL_US microseconds, read once.
 */
#define SIM_KERNEL_ENV "GPUSHARE_SIM_KERNEL_US"
#define SIM_KERNEL_DEFAULT_US 100ull

static pthread_once_t sim_kernel_once = PTHREAD_ONCE_INIT;
static unsigned long long sim_kernel_ns;

static void sim_kernel_load(void)
{
	const char *v = getenv(SIM_KERNEL_ENV);
	unsigned long long us = SIM_KERNEL_DEFAULT_US;
	char *end;

	if (v && *v) {
		us = strtoull(v, &end, 10);
		if (*end || us > SIM_USAGE_AHEAD_NS / 1000)
			us = SIM_KERNEL_DEFAULT_US;
	}
	sim_kernel_ns = us * 1000;
}

/*
 * What this process's kernel launches asked of its devices (gpushareSimKernelCounters,
 * docs/simulator.md): launches, blocks, and waves of blocks over the launching device's
 * SMs (a launch of b blocks on s SMs is ceil(b / s) waves: what the device timeline
 * times). Counted at submission, as the copy counters are: a launch recorded into a
 * graph counts once, at its capture. Relaxed atomics: each is a count of its own, read
 * for a report.
 */
enum {
	SIM_KERNELS_LAUNCHED,
	SIM_KERNELS_BLOCKS,
	SIM_KERNELS_WAVES,
	SIM_KERNEL_COUNTERS
};
static uint64_t sim_kernel_counts[SIM_KERNEL_COUNTERS];

static void sim_count_launch(uint64_t blocks)
{
	int sms = 0;

	sim_device_attribute(sim_devs[sim_current_dev()].spec,
			     CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, &sms);
	if (sms < 1)
		sms = 1;
	__atomic_fetch_add(&sim_kernel_counts[SIM_KERNELS_LAUNCHED], 1, __ATOMIC_RELAXED);
	__atomic_fetch_add(&sim_kernel_counts[SIM_KERNELS_BLOCKS], blocks, __ATOMIC_RELAXED);
	__atomic_fetch_add(&sim_kernel_counts[SIM_KERNELS_WAVES],
			   (blocks + (uint64_t)sms - 1) / (uint64_t)sms, __ATOMIC_RELAXED);
}

/*
 * Whether a grid is within the current device's limits (its max_grid_dim
 * attributes), as the driver checks: a grid's blocks then fit in 64 bits.
 */
static bool sim_grid_fits(unsigned int gx, unsigned int gy, unsigned int gz)
{
	const struct sim_spec *spec = sim_devs[sim_current_dev()].spec;
	int x = 0, y = 0, z = 0;

	sim_device_attribute(spec, SIM_ATTR_MAX_GRID_DIM_X, &x);
	sim_device_attribute(spec, SIM_ATTR_MAX_GRID_DIM_Y, &y);
	sim_device_attribute(spec, SIM_ATTR_MAX_GRID_DIM_Z, &z);
	return gx <= (unsigned int)x && gy <= (unsigned int)y && gz <= (unsigned int)z;
}

/*
 * The simulator's own: this process's kernel counters, in the order of the enum above,
 * the first `count` of them (at most SIM_KERNEL_COUNTERS; the rest of `out` is left as
 * it is). Not in cuda.h: found with dlsym on libcuda's handle.
 */
SIM_EXPORT CUresult gpushareSimKernelCounters(unsigned long long *out, unsigned int count);
SIM_EXPORT CUresult gpushareSimKernelCounters(unsigned long long *out, unsigned int count)
{
	return sim_counters_out(out, count, sim_kernel_counts, SIM_KERNEL_COUNTERS);
}

/*
 * A kernel launch is recorded into the capture of a capturing stream (a
 * kernel node, timed at each launch of the graph). Otherwise, with the
 * timeline, it is timed on its stream; without, it counts
 * GPUSHARE_SIM_KERNEL_US towards NVML's utilisation, and the stream is not
 * looked at (made-up handles pass, as before streams were timed).
 */
static CUresult sim_launch(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
			   unsigned int bx, unsigned int by, unsigned int bz, CUstream stream)
{
	struct sim_op op = { .kind = SIM_OP_KERNEL, .height = 1 };
	struct CUstream_st *s;
	CUresult rc = CUDA_SUCCESS;
	bool recorded = false;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!sim_depth)
		return CUDA_ERROR_INVALID_CONTEXT;
	/* Tests pass made-up handles: check it, never look through it. */
	if (!f)
		return CUDA_ERROR_INVALID_HANDLE;
	if (!gx || !gy || !gz || !bx || !by || !bz || !sim_grid_fits(gx, gy, gz))
		return CUDA_ERROR_INVALID_VALUE;
	op.width = (size_t)gx * gy * gz;
	if (sim_tl_on()) {
		rc = sim_stream_do(stream, &op);
		goto out;
	}
	pthread_mutex_lock(&sim_obj_lock);
	s = sim_stream_locked(stream);
	if (s && s->capture_status == CU_STREAM_CAPTURE_STATUS_ACTIVE) {
		if (!sim_graph_add(s->capture, &op))
			rc = CUDA_ERROR_OUT_OF_MEMORY;
		recorded = true;
	}
	pthread_mutex_unlock(&sim_obj_lock);
	if (!recorded) {
		pthread_once(&sim_kernel_once, sim_kernel_load);
		sim_usage_busy(sim_devs[sim_current_dev()].spec_index, sim_kernel_ns);
	}
out:
	if (rc == CUDA_SUCCESS)
		sim_count_launch(op.width);
	return rc;
}

CUresult sim_impl_cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
				 unsigned int bx, unsigned int by, unsigned int bz,
				 unsigned int shmem, CUstream stream, void **params, void **extra)
{
	(void)shmem, (void)params, (void)extra;
	return sim_launch(f, gx, gy, gz, bx, by, bz, stream);
}

CUresult sim_impl_cuLaunchKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy,
				      unsigned int gz, unsigned int bx, unsigned int by,
				      unsigned int bz, unsigned int shmem, CUstream stream,
				      void **params, void **extra)
{
	(void)shmem, (void)params, (void)extra;
	return sim_launch(f, gx, gy, gz, bx, by, bz, stream);
}

static CUresult sim_launch_ex(const CUlaunchConfig *config, CUfunction f)
{
	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!config || (config->numAttrs && !config->attrs))
		return CUDA_ERROR_INVALID_VALUE;
	return sim_launch(f, config->gridDimX, config->gridDimY, config->gridDimZ,
			  config->blockDimX, config->blockDimY, config->blockDimZ, config->hStream);
}

CUresult sim_impl_cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **params,
				   void **extra)
{
	(void)params, (void)extra;
	return sim_launch_ex(config, f);
}

CUresult sim_impl_cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **params,
					void **extra)
{
	(void)params, (void)extra;
	return sim_launch_ex(config, f);
}

CUresult sim_impl_cuLaunchCooperativeKernel(CUfunction f, unsigned int gx, unsigned int gy,
					    unsigned int gz, unsigned int bx, unsigned int by,
					    unsigned int bz, unsigned int shmem, CUstream stream,
					    void **params)
{
	(void)shmem, (void)params;
	return sim_launch(f, gx, gy, gz, bx, by, bz, stream);
}

CUresult sim_impl_cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy,
						 unsigned int gz, unsigned int bx, unsigned int by,
						 unsigned int bz, unsigned int shmem,
						 CUstream stream, void **params)
{
	(void)shmem, (void)params;
	return sim_launch(f, gx, gy, gz, bx, by, bz, stream);
}

/*
 * cuGraphLaunch documents no CUDA_ERROR_INVALID_HANDLE: a missing
 * executable graph is CUDA_ERROR_INVALID_VALUE. As with functions, a
 * non-NULL handle is taken on trust and never looked through.
 */
static CUresult sim_graph_run(CUgraphExec exec, CUstream stream);

static CUresult sim_graph_launch(CUgraphExec exec, CUstream stream)
{
	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!sim_depth)
		return CUDA_ERROR_INVALID_CONTEXT;
	return exec ? sim_graph_run(exec, stream) : CUDA_ERROR_INVALID_VALUE;
}

CUresult sim_impl_cuGraphLaunch(CUgraphExec exec, CUstream stream)
{
	return sim_graph_launch(exec, stream);
}

CUresult sim_impl_cuGraphLaunch_ptsz(CUgraphExec exec, CUstream stream)
{
	return sim_graph_launch(exec, stream);
}

/*
 * With sim_obj_lock held: the stream object behind a non-default handle, or
 * NULL (default streams are never captured).
 */
struct CUstream_st *sim_stream_locked(CUstream stream)
{
	struct sim_obj **pp;

	if (sim_default_stream(stream))
		return NULL;
	pp = sim_obj_find(stream, SIM_OBJ_STREAM);
	return pp ? (struct CUstream_st *)*pp : NULL;
}

/*
 * Does op on stream now (timed, with the timeline), or records it there
 * while the stream is capturing. *end, when asked for: when it completes
 * on the timeline (0 if recorded, or without the timeline).
 */
static CUresult sim_stream_put(CUstream stream, const struct sim_op *op, uint64_t *end)
{
	struct sim_ctx_slot slot;
	struct CUstream_st *s;
	CUresult rc;
	bool recorded = false;
	uint64_t t = 0;

	rc = sim_stream_slot_live(stream, &slot);
	if (rc != CUDA_SUCCESS)
		return rc;
	pthread_mutex_lock(&sim_obj_lock);
	s = sim_stream_locked(stream);
	if (s && s->capture_status == CU_STREAM_CAPTURE_STATUS_ACTIVE) {
		if (!sim_graph_add(s->capture, op))
			rc = CUDA_ERROR_OUT_OF_MEMORY;
		recorded = true;
	}
	pthread_mutex_unlock(&sim_obj_lock);
	if (!recorded && sim_tl_on())
		t = sim_tl_run(stream, &slot, op);
	else if (!recorded)
		sim_op_run(op);
	if (end)
		*end = t;
	return rc;
}

CUresult sim_stream_do(CUstream stream, const struct sim_op *op)
{
	return sim_stream_put(stream, op, NULL);
}

CUresult sim_stream_do_sync(const struct sim_op *op)
{
	uint64_t end;
	CUresult rc = sim_stream_put(NULL, op, &end);

	if (rc == CUDA_SUCCESS && end)
		sim_tl_sleep_until(end);
	return rc;
}

/*
 * cuMemAllocAsync on a capturing stream: an allocation node of the graph,
 * with its address on dev, and nothing taken from a pool (*captured). A
 * stream that is not capturing: nothing done.
 */
CUresult sim_capture_alloc(CUstream stream, int dev, size_t bytes, CUdeviceptr *out, bool *captured)
{
	struct sim_op op = { .kind = SIM_OP_GALLOC };
	struct CUstream_st *s;
	CUresult rc = CUDA_SUCCESS;

	*captured = false;
	pthread_mutex_lock(&sim_obj_lock);
	s = sim_stream_locked(stream);
	if (s && s->capture_status == CU_STREAM_CAPTURE_STATUS_ACTIVE) {
		*captured = true;
		op.ga = sim_galloc_new(dev, bytes, out);
		if (!op.ga) {
			rc = CUDA_ERROR_OUT_OF_MEMORY;
		} else {
			if (!sim_graph_add(s->capture, &op))
				rc = CUDA_ERROR_OUT_OF_MEMORY;
			sim_galloc_unref(op.ga); /* the graph's op holds it now */
		}
	}
	pthread_mutex_unlock(&sim_obj_lock);
	return rc;
}

/* cuMemFreeAsync of a graph allocation on a capturing stream: a free node (*captured). */
CUresult sim_capture_free(CUstream stream, CUdeviceptr addr, bool *captured)
{
	struct sim_op op = { .kind = SIM_OP_GFREE };
	struct CUstream_st *s;
	CUresult rc = CUDA_SUCCESS;

	*captured = false;
	if (sim_default_stream(stream) || !(op.ga = sim_galloc_at(addr)))
		return rc;
	pthread_mutex_lock(&sim_obj_lock);
	s = sim_stream_locked(stream);
	if (s && s->capture_status == CU_STREAM_CAPTURE_STATUS_ACTIVE) {
		*captured = true;
		if (!sim_graph_add(s->capture, &op))
			rc = CUDA_ERROR_OUT_OF_MEMORY;
	}
	pthread_mutex_unlock(&sim_obj_lock);
	sim_galloc_unref(op.ga);
	return rc;
}

/* Streams: priorities, flags, queries, callbacks, capture. */

CUresult sim_impl_cuStreamCreateWithPriority(CUstream *stream, unsigned int flags, int priority)
{
	CUresult rc = sim_impl_cuStreamCreate(stream, flags);

	if (rc == CUDA_SUCCESS) {
		/* The documented range is [-5, 0]; others are clamped to it. */
		struct CUstream_st *s = *stream;

		s->priority = priority < -5 ? -5 : priority > 0 ? 0 : priority;
	}
	return rc;
}

/* A copy of the stream's state, for the queries; default streams read as zeros. */
static CUresult sim_stream_state(CUstream stream, struct CUstream_st *out)
{
	struct sim_ctx_slot slot;
	struct CUstream_st *s;
	CUresult rc;

	rc = sim_stream_slot_live(stream, &slot);
	if (rc != CUDA_SUCCESS)
		return rc;
	memset(out, 0, sizeof(*out));
	out->obj.dev = slot.dev;
	pthread_mutex_lock(&sim_obj_lock);
	s = sim_stream_locked(stream);
	if (s)
		*out = *s;
	pthread_mutex_unlock(&sim_obj_lock);
	return CUDA_SUCCESS;
}

/* The fields of a stream's state that the queries read. */
enum sim_stream_field {
	SIM_STREAM_PRIORITY,
	SIM_STREAM_FLAGS,
	SIM_STREAM_ID,
	SIM_STREAM_DEVICE,
	SIM_STREAM_CAPTURE_STATUS,
};

/* A query: one field of the stream's state into *out, which has that field's type. */
static CUresult sim_stream_get(CUstream stream, enum sim_stream_field field, void *out)
{
	struct CUstream_st s;
	CUresult rc = out ? sim_stream_state(stream, &s) : CUDA_ERROR_INVALID_VALUE;

	if (rc != CUDA_SUCCESS)
		return rc;
	switch (field) {
	case SIM_STREAM_PRIORITY:
		*(int *)out = s.priority;
		break;
	case SIM_STREAM_FLAGS:
		*(unsigned int *)out = s.flags;
		break;
	case SIM_STREAM_ID:
		*(unsigned long long *)out = s.id;
		break;
	case SIM_STREAM_DEVICE:
		*(CUdevice *)out = s.obj.dev;
		break;
	case SIM_STREAM_CAPTURE_STATUS:
		*(int *)out = s.capture_status;
		break;
	}
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuStreamGetPriority(CUstream stream, int *priority)
{
	return sim_stream_get(stream, SIM_STREAM_PRIORITY, priority);
}

CUresult sim_impl_cuStreamGetFlags(CUstream stream, unsigned int *flags)
{
	return sim_stream_get(stream, SIM_STREAM_FLAGS, flags);
}

CUresult sim_impl_cuStreamGetId(CUstream stream, unsigned long long *id)
{
	return sim_stream_get(stream, SIM_STREAM_ID, id);
}

CUresult sim_impl_cuStreamGetDevice(CUstream stream, CUdevice *dev)
{
	return sim_stream_get(stream, SIM_STREAM_DEVICE, dev);
}

/* Without the timeline, everything on a stream is done by the time its call returns. */
CUresult sim_impl_cuStreamQuery(CUstream stream)
{
	struct sim_ctx_slot slot;
	CUresult rc = sim_stream_slot_live(stream, &slot);

	if (rc == CUDA_SUCCESS && sim_tl_on() && sim_usage_now() < sim_tl_stream_end(stream, &slot))
		rc = CUDA_ERROR_NOT_READY;
	return rc;
}

CUresult sim_impl_cuLaunchHostFunc(CUstream stream, CUhostFn fn, void *data)
{
	struct sim_op op = { .kind = SIM_OP_HOST, .fn = fn, .data = data };

	if (!fn)
		return CUDA_ERROR_INVALID_VALUE;
	return sim_stream_do(stream, &op);
}

CUresult sim_impl_cuStreamAddCallback(CUstream stream, CUstreamCallback cb, void *data,
				      unsigned int flags)
{
	struct sim_ctx_slot slot;
	CUresult rc;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!cb || flags != 0)
		return CUDA_ERROR_INVALID_VALUE;
	rc = sim_stream_slot(stream, &slot);
	if (rc != CUDA_SUCCESS)
		return rc;
	if (sim_tl_on()) {
		uint64_t t;

		/* Called when the stream reaches it, as a host function is. */
		pthread_mutex_lock(&sim_obj_lock);
		t = sim_tl_mark_locked(stream, sim_stream_locked(stream), slot.id);
		pthread_mutex_unlock(&sim_obj_lock);
		sim_tl_sleep_until(t);
	}
	cb(stream, CUDA_SUCCESS, data);
	return rc;
}

CUresult sim_impl_cuCtxGetStreamPriorityRange(int *least, int *greatest)
{
	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (least)
		*least = 0;
	if (greatest)
		*greatest = -5;
	return CUDA_SUCCESS;
}

/*
 * Stream capture: between begin and end, the stream's copies, memsets,
 * kernels and host functions are recorded into a graph instead of being
 * done; each launch of the instantiated graph does them. Default streams
 * cannot be captured.
 */
static __thread int sim_capture_mode; /* cuThreadExchangeStreamCaptureMode */
static uint64_t sim_capture_serial;   /* atomic */

/*
 * With sim_obj_lock held: capture id is over. Every stream in it (the one
 * that began it, and those that joined) stops capturing, and events
 * recorded in it no longer pull streams into it.
 */
static void sim_capture_end_locked(uint64_t id)
{
	struct sim_obj *o;

	for (o = sim_obj_list; o; o = o->next) {
		if (o->kind == SIM_OBJ_STREAM && ((struct CUstream_st *)o)->capture_id == id) {
			struct CUstream_st *s = (struct CUstream_st *)o;

			s->capture = NULL;
			s->capture_id = 0;
			s->capture_status = CU_STREAM_CAPTURE_STATUS_NONE;
			s->capture_origin = false;
		} else if (o->kind == SIM_OBJ_EVENT) {
			sim_event_capture_over((struct CUevent_st *)o, id);
		}
	}
}

static CUresult sim_begin_capture(CUstream stream, int mode)
{
	struct CUgraph_st *g;
	struct CUstream_st *s;
	CUresult rc = CUDA_SUCCESS;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (mode < CU_STREAM_CAPTURE_MODE_GLOBAL || mode > CU_STREAM_CAPTURE_MODE_RELAXED)
		return CUDA_ERROR_INVALID_VALUE;
	if (sim_default_stream(stream))
		return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
	g = sim_graph_new();
	if (!g)
		return CUDA_ERROR_OUT_OF_MEMORY;
	pthread_mutex_lock(&sim_obj_lock);
	s = sim_stream_locked(stream);
	if (!s) {
		rc = CUDA_ERROR_INVALID_HANDLE;
	} else if (s->capture_status != CU_STREAM_CAPTURE_STATUS_NONE) {
		rc = CUDA_ERROR_ILLEGAL_STATE;
	} else {
		s->capture_status = CU_STREAM_CAPTURE_STATUS_ACTIVE;
		s->capture_mode = mode;
		s->capture_id = __atomic_add_fetch(&sim_capture_serial, 1, __ATOMIC_RELAXED);
		s->capture = g;
		s->capture_origin = true;
		g = NULL;
	}
	pthread_mutex_unlock(&sim_obj_lock);
	free(g);
	return rc;
}

CUresult sim_impl_cuStreamBeginCapture(CUstream stream)
{
	return sim_begin_capture(stream, CU_STREAM_CAPTURE_MODE_GLOBAL);
}

CUresult sim_impl_cuStreamBeginCapture_v2(CUstream stream, int mode)
{
	return sim_begin_capture(stream, mode);
}

CUresult sim_impl_cuStreamEndCapture(CUstream stream, CUgraph *pg)
{
	struct CUgraph_st *g = NULL;
	struct CUstream_st *s;
	CUresult rc = sim_check_args(pg != NULL);

	if (rc != CUDA_SUCCESS)
		return rc;
	pthread_mutex_lock(&sim_obj_lock);
	s = sim_stream_locked(stream);
	if (!s || s->capture_status == CU_STREAM_CAPTURE_STATUS_NONE) {
		rc = s || sim_default_stream(stream) ? CUDA_ERROR_ILLEGAL_STATE
						     : CUDA_ERROR_INVALID_HANDLE;
	} else if (!s->capture_origin) {
		rc = CUDA_ERROR_STREAM_CAPTURE_UNMATCHED;
	} else {
		if (s->capture_status == CU_STREAM_CAPTURE_STATUS_INVALIDATED)
			rc = CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
		g = s->capture;
		sim_capture_end_locked(s->capture_id);
	}
	pthread_mutex_unlock(&sim_obj_lock);
	if (g && rc != CUDA_SUCCESS) {
		sim_graph_free(g);
		g = NULL;
	}
	if (g)
		sim_obj_add(&g->obj);
	*pg = g;
	return rc;
}

CUresult sim_impl_cuStreamIsCapturing(CUstream stream, int *status)
{
	return sim_stream_get(stream, SIM_STREAM_CAPTURE_STATUS, status);
}

/* Any output may be NULL. Captured work has no dependencies to report. */
static CUresult sim_capture_info(CUstream stream, int *status, uint64_t *id, CUgraph *graph,
				 const void **deps, const void **edges, size_t *ndeps)
{
	struct CUstream_st s;
	CUresult rc = sim_stream_state(stream, &s);

	if (rc != CUDA_SUCCESS)
		return rc;
	if (!status)
		return CUDA_ERROR_INVALID_VALUE;
	*status = s.capture_status;
	if (s.capture_status != CU_STREAM_CAPTURE_STATUS_NONE) {
		if (id)
			*id = s.capture_id;
		if (graph)
			*graph = s.capture;
		if (deps)
			*deps = NULL;
		if (edges)
			*edges = NULL;
		if (ndeps)
			*ndeps = 0;
	}
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuStreamGetCaptureInfo(CUstream stream, int *status, uint64_t *id)
{
	return sim_capture_info(stream, status, id, NULL, NULL, NULL, NULL);
}

CUresult sim_impl_cuStreamGetCaptureInfo_v2(CUstream stream, int *status, uint64_t *id,
					    CUgraph *graph, const void **deps, size_t *ndeps)
{
	return sim_capture_info(stream, status, id, graph, deps, NULL, ndeps);
}

CUresult sim_impl_cuStreamGetCaptureInfo_v3(CUstream stream, int *status, uint64_t *id,
					    CUgraph *graph, const void **deps, const void **edges,
					    size_t *ndeps)
{
	return sim_capture_info(stream, status, id, graph, deps, edges, ndeps);
}

CUresult sim_impl_cuThreadExchangeStreamCaptureMode(int *mode)
{
	int old;

	if (!mode || *mode < CU_STREAM_CAPTURE_MODE_GLOBAL ||
	    *mode > CU_STREAM_CAPTURE_MODE_RELAXED)
		return CUDA_ERROR_INVALID_VALUE;
	old = sim_capture_mode;
	sim_capture_mode = *mode;
	*mode = old;
	return CUDA_SUCCESS;
}

/*
 * A launch does the graph's recorded operations in order, each timed on the
 * stream with the timeline, or records them into the capture of a capturing
 * stream (a graph launched in a capture).
 * The ops are copied out first so that none runs under the lock (a host
 * function may call back into the driver). A handle the driver never made
 * is taken on trust, as before graphs were simulated: there is nothing to
 * do for it.
 */
static CUresult sim_graph_run(CUgraphExec exec, CUstream stream)
{
	struct sim_op *ops = NULL;
	struct sim_ctx_slot slot;
	struct CUstream_st *s;
	struct sim_obj **pp;
	size_t n = 0, i;
	bool autofree = false, timed = sim_tl_on();
	CUresult rc = CUDA_SUCCESS;

	if (timed) {
		rc = sim_stream_slot(stream, &slot);
		if (rc != CUDA_SUCCESS)
			return rc;
	}
	pthread_mutex_lock(&sim_obj_lock);
	pp = sim_obj_find(exec, SIM_OBJ_EXEC);
	s = sim_stream_locked(stream);
	if (pp && s && s->capture_status == CU_STREAM_CAPTURE_STATUS_ACTIVE) {
		const struct CUgraphExec_st *e = (const struct CUgraphExec_st *)*pp;

		for (i = 0; i < e->nops && rc == CUDA_SUCCESS; i++)
			if (!sim_graph_add(s->capture, &e->ops[i]))
				rc = CUDA_ERROR_OUT_OF_MEMORY;
		pp = NULL;
	}
	if (pp) {
		const struct CUgraphExec_st *e = (const struct CUgraphExec_st *)*pp;
		bool failed;

		ops = sim_ops_copy(e->ops, e->nops, &failed);
		n = ops ? e->nops : 0;
		autofree = e->autofree;
		if (failed)
			rc = CUDA_ERROR_OUT_OF_MEMORY;
	}
	pthread_mutex_unlock(&sim_obj_lock);
	if (n)
		sim_gmem_launch(ops, n, autofree, false);
	for (i = 0; i < n; i++) {
		if (timed)
			sim_tl_run(stream, &slot, &ops[i]);
		else
			sim_op_run(&ops[i]);
	}
	sim_ops_free(ops, n);
	return rc;
}

/* The per-thread default stream variants (SIM_SAME_AS). */
SIM_SAME_AS(cuStreamGetPriority_ptsz, cuStreamGetPriority);
SIM_SAME_AS(cuStreamGetFlags_ptsz, cuStreamGetFlags);
SIM_SAME_AS(cuStreamGetId_ptsz, cuStreamGetId);
SIM_SAME_AS(cuStreamGetDevice_ptsz, cuStreamGetDevice);
SIM_SAME_AS(cuStreamQuery_ptsz, cuStreamQuery);
SIM_SAME_AS(cuStreamAddCallback_ptsz, cuStreamAddCallback);
SIM_SAME_AS(cuLaunchHostFunc_ptsz, cuLaunchHostFunc);
SIM_SAME_AS(cuStreamBeginCapture_ptsz, cuStreamBeginCapture);
SIM_SAME_AS(cuStreamBeginCapture_v2_ptsz, cuStreamBeginCapture_v2);
SIM_SAME_AS(cuStreamEndCapture_ptsz, cuStreamEndCapture);
SIM_SAME_AS(cuStreamIsCapturing_ptsz, cuStreamIsCapturing);
SIM_SAME_AS(cuStreamGetCaptureInfo_ptsz, cuStreamGetCaptureInfo);
SIM_SAME_AS(cuStreamGetCaptureInfo_v2_ptsz, cuStreamGetCaptureInfo_v2);
SIM_SAME_AS(cuStreamGetCaptureInfo_v3_ptsz, cuStreamGetCaptureInfo_v3);

/* With sim_obj_lock held, a context is going: its streams' captures end with them. */
static void sim_streams_ctx_gone(uint64_t id, struct sim_obj *dead)
{
	struct sim_obj *o;

	(void)id;
	for (o = dead; o; o = o->next)
		if (o->kind == SIM_OBJ_STREAM)
			sim_graph_free(sim_stream_gone_locked((struct CUstream_st *)o));
}

static const struct sim_hooks sim_streams_hooks = { .ctx_gone_locked = sim_streams_ctx_gone };

__attribute__((constructor)) static void sim_streams_load(void)
{
	sim_hooks_add(&sim_streams_hooks);
}
