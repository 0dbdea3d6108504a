/*
 * The simulated driver's device timeline (GPUSHARE_SIM_TIMELINE): kernels
 * still compute nothing and copies still move their bytes when they are
 * submitted, but each operation occupies its device for a modelled time, in
 * order on its stream, one at a time on the device whichever process
 * submitted it (sim_usage.c keeps each device's timeline in the node's
 * table). Synchronisations sleep until the modelled completion, and queries
 * answer CUDA_ERROR_NOT_READY before it.
 *
 * What a process knows of its own streams is kept here, under sim_obj_lock:
 * each stream's ready time (the end of its last operation) is in its object;
 * the legacy default stream's, and the latest end of the blocking streams'
 * and of all streams' work, per context, in sim_tl_ctxs; the per-thread
 * default stream's per thread.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "sim_driver.h"
#include "sim_memory.h"
#include "sim_usage.h"

/* The model's parameters: the variables, their defaults, and what each may be. */
struct sim_tl_param {
	const char *env;
	double value;
	double min; /* the smallest value accepted; 0 for those that must be above 0 */
	bool positive;
};

enum {
	SIM_TL_LAUNCH,
	SIM_TL_WAVE,
	SIM_TL_HOST,
	SIM_TL_DEVICE,
	SIM_TL_SCALE,
	SIM_TL_NPARAMS
};

static struct sim_tl_param sim_tl_params[SIM_TL_NPARAMS] = {
	[SIM_TL_LAUNCH] = { "GPUSHARE_SIM_LAUNCH_NS", 3000.0, 0.0, false },
	[SIM_TL_WAVE] = { "GPUSHARE_SIM_WAVE_NS", 5000.0, 0.0, false },
	[SIM_TL_HOST] = { "GPUSHARE_SIM_HOST_GBPS", 25.0, 0.0, true },
	[SIM_TL_DEVICE] = { "GPUSHARE_SIM_DEVICE_GBPS", 1500.0, 0.0, true },
	[SIM_TL_SCALE] = { "GPUSHARE_SIM_TIME_SCALE", 1.0, 0.0, true },
};

#define SIM_TL_ENV "GPUSHARE_SIM_TIMELINE"

static pthread_once_t sim_tl_once = PTHREAD_ONCE_INIT;
static bool sim_tl_enabled;

/*
 * Off unless set to something other than a false word, as the client's
 * switches read (gpushare/envvars.py): unset, empty, 0, false, no, off.
 */
static bool sim_tl_switch(const char *v)
{
	static const char *const off[] = { "0", "false", "no", "off" };
	size_t len, i;

	if (!v)
		return false;
	while (isspace((unsigned char)*v))
		v++;
	len = strlen(v);
	while (len && isspace((unsigned char)v[len - 1]))
		len--;
	if (!len)
		return false;
	for (i = 0; i < sizeof(off) / sizeof(off[0]); i++)
		if (strlen(off[i]) == len && strncasecmp(v, off[i], len) == 0)
			return false;
	return true;
}

static void sim_tl_load(void)
{
	struct sim_tl_param *p;
	const char *v;
	char *end;
	double x;

	sim_tl_enabled = sim_tl_switch(getenv(SIM_TL_ENV));
	for (p = sim_tl_params; p < sim_tl_params + SIM_TL_NPARAMS; p++) {
		v = getenv(p->env);
		if (!v || !*v)
			continue;
		errno = 0;
		x = strtod(v, &end);
		if (*end || errno || !__builtin_isfinite(x) || x < p->min ||
		    (p->positive && x <= 0)) {
			/* Said once, at start: a typo must not pass for the default silently. */
			fprintf(stderr,
				"gpushare simulated driver: %s=%s is not a number %s 0; using %g\n",
				p->env, v, p->positive ? "above" : "of at least", p->value);
			continue;
		}
		p->value = x;
	}
}

bool sim_tl_on(void)
{
	pthread_once(&sim_tl_once, sim_tl_load);
	return sim_tl_enabled;
}

void sim_tl_sleep_until(uint64_t t)
{
	struct timespec ts = { .tv_sec = (time_t)(t / 1000000000ull),
			       .tv_nsec = (long)(t % 1000000000ull) };

	while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
		;
}

static bool sim_tl_device_mem(uintptr_t p)
{
	struct sim_ptr info;

	return sim_ptr_find(p, &info) && info.type == CU_MEMORYTYPE_DEVICE;
}

/*
 * How long op occupies device dev, in ns: a kernel its launch time and a
 * wave time for each wave of blocks over the device's SMs; a copy or a
 * memset its bytes over the bandwidth, the device's when both sides are in
 * device memory, the host link's otherwise. Host functions and graph memory
 * nodes take none. Called with no lock held (pointer lookups take the heap
 * locks).
 */
uint64_t sim_tl_duration(const struct sim_op *op, int dev)
{
	double ns = 0, bytes;
	int sms = 0;

	switch (op->kind) {
	case SIM_OP_KERNEL:
		sim_device_attribute(sim_devs[dev].spec, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
				     &sms);
		if (sms < 1)
			sms = 1;
		ns = sim_tl_params[SIM_TL_LAUNCH].value +
		     (double)((op->width + (size_t)sms - 1) / (size_t)sms) *
			     sim_tl_params[SIM_TL_WAVE].value;
		break;
	case SIM_OP_COPY:
		bytes = (double)op->width * (double)op->height;
		ns = bytes / (sim_tl_device_mem(op->dst) && sim_tl_device_mem(op->src)
				      ? sim_tl_params[SIM_TL_DEVICE].value
				      : sim_tl_params[SIM_TL_HOST].value);
		break;
	case SIM_OP_SET:
		bytes = (double)op->width * op->elem * (double)op->height;
		ns = bytes / (sim_tl_device_mem(op->dst) ? sim_tl_params[SIM_TL_DEVICE].value
							 : sim_tl_params[SIM_TL_HOST].value);
		break;
	default:
		return 0;
	}
	ns *= sim_tl_params[SIM_TL_SCALE].value;
	/* Far beyond any test, and within what a time plus it can hold. */
	return ns >= 9e18 ? UINT64_MAX / 2 : (uint64_t)(ns + 0.5);
}

/*
 * A context's default-stream ordering. A context that does not fit shares
 * the spill entry with the others that did not: their streams are ordered
 * more than they need be, never less.
 */
struct sim_tl_ctx {
	uint64_t id;
	uint64_t legacy;   /* the end of the legacy stream's last operation */
	uint64_t blocking; /* the latest end on its blocking streams (the legacy one included) */
	uint64_t all;	   /* the latest end on any of its streams */
};

#define SIM_TL_CTXS 256
static struct sim_tl_ctx sim_tl_ctxs[SIM_TL_CTXS], sim_tl_spill;

static struct sim_tl_ctx *sim_tl_ctx_locked(uint64_t id)
{
	struct sim_tl_ctx *free = NULL;
	size_t i;

	for (i = 0; i < SIM_TL_CTXS; i++) {
		if (sim_tl_ctxs[i].id == id)
			return &sim_tl_ctxs[i];
		if (!free && !sim_tl_ctxs[i].id)
			free = &sim_tl_ctxs[i];
	}
	if (!free)
		return &sim_tl_spill;
	memset(free, 0, sizeof(*free));
	free->id = id;
	return free;
}

/* The calling thread's per-thread default streams, one per context it used. */
#define SIM_TL_PTDS 8
static __thread struct {
	uint64_t ctx, ready;
} sim_tl_ptds[SIM_TL_PTDS];

static uint64_t *sim_tl_ptds_ready(uint64_t ctx)
{
	static __thread unsigned int next;
	unsigned int i;

	for (i = 0; i < SIM_TL_PTDS; i++)
		if (sim_tl_ptds[i].ctx == ctx)
			return &sim_tl_ptds[i].ready;
	/* A context beyond the eighth takes the oldest entry: the context's own order remains. */
	i = next++ % SIM_TL_PTDS;
	sim_tl_ptds[i].ctx = ctx;
	sim_tl_ptds[i].ready = 0;
	return &sim_tl_ptds[i].ready;
}

static uint64_t sim_max(uint64_t a, uint64_t b)
{
	return a > b ? a : b;
}

/*
 * With sim_obj_lock held: when work submitted now on stream (s: its object,
 * NULL for a default stream) of context ctx may start, by the stream's
 * order alone. The legacy stream waits for every blocking stream of its
 * context; a blocking stream for the legacy stream.
 */
uint64_t sim_tl_after_locked(CUstream stream, const struct CUstream_st *s, uint64_t ctx)
{
	struct sim_tl_ctx *c = sim_tl_ctx_locked(ctx);

	if (s)
		return s->flags & CU_STREAM_NON_BLOCKING ? s->ready : sim_max(s->ready, c->legacy);
	if (stream == CU_STREAM_PER_THREAD)
		return sim_max(*sim_tl_ptds_ready(ctx), c->legacy);
	return sim_max(c->legacy, c->blocking);
}

/* With sim_obj_lock held: work on stream (as above) ends at end. */
void sim_tl_done_locked(CUstream stream, struct CUstream_st *s, uint64_t ctx, uint64_t end)
{
	struct sim_tl_ctx *c = sim_tl_ctx_locked(ctx);
	bool blocking = true;

	if (s) {
		s->ready = sim_max(s->ready, end);
		blocking = !(s->flags & CU_STREAM_NON_BLOCKING);
	} else if (stream == CU_STREAM_PER_THREAD) {
		uint64_t *ready = sim_tl_ptds_ready(ctx);

		*ready = sim_max(*ready, end);
	} else {
		c->legacy = sim_max(c->legacy, end);
	}
	if (blocking)
		c->blocking = sim_max(c->blocking, end);
	c->all = sim_max(c->all, end);
}

/*
 * With sim_obj_lock held: the time stream reaches a mark put on it now (an
 * event's record, a host function): now at the earliest. Later work on it
 * follows.
 */
uint64_t sim_tl_mark_locked(CUstream stream, struct CUstream_st *s, uint64_t ctx)
{
	uint64_t t = sim_max(sim_tl_after_locked(stream, s, ctx), sim_usage_now());

	sim_tl_done_locked(stream, s, ctx, t);
	return t;
}

/*
 * When all work submitted so far on stream completes: its own; for the
 * legacy stream, that of the blocking streams before it too.
 */
uint64_t sim_tl_stream_end(CUstream stream, const struct sim_ctx_slot *slot)
{
	struct CUstream_st *s;
	uint64_t t;

	pthread_mutex_lock(&sim_obj_lock);
	s = sim_stream_locked(stream);
	if (s)
		t = s->ready;
	else if (stream == CU_STREAM_PER_THREAD)
		t = *sim_tl_ptds_ready(slot->id);
	else
		t = sim_tl_after_locked(stream, NULL, slot->id);
	pthread_mutex_unlock(&sim_obj_lock);
	return t;
}

/* When all work submitted so far in context ctx completes. */
uint64_t sim_tl_ctx_end(uint64_t ctx)
{
	uint64_t t;

	pthread_mutex_lock(&sim_obj_lock);
	t = sim_tl_ctx_locked(ctx)->all;
	pthread_mutex_unlock(&sim_obj_lock);
	return t;
}

/*
 * Puts op, not captured, on stream's timeline and does it: it starts when
 * the stream's order and the device allow, and the device is busy until it
 * ends. A host function runs when the stream reaches it (the calling thread
 * sleeps until then). Returns when op completes on the timeline.
 */
uint64_t sim_tl_run(CUstream stream, const struct sim_ctx_slot *slot, const struct sim_op *op)
{
	int spec_index = sim_devs[slot->dev].spec_index;
	uint64_t ns = sim_tl_duration(op, slot->dev), until, start, end;
	struct CUstream_st *s;

	/* A process whose launch queue is full waits for its oldest work, holding no lock. */
	while (ns && !sim_usage_room(spec_index, &until))
		sim_tl_sleep_until(until);
	pthread_mutex_lock(&sim_obj_lock);
	s = sim_stream_locked(stream);
	if (op->kind == SIM_OP_HOST || !ns) {
		end = sim_tl_mark_locked(stream, s, slot->id);
	} else {
		sim_usage_schedule(spec_index, sim_tl_after_locked(stream, s, slot->id), ns, &start,
				   &end);
		sim_tl_done_locked(stream, s, slot->id, end);
	}
	pthread_mutex_unlock(&sim_obj_lock);
	if (op->kind == SIM_OP_HOST)
		sim_tl_sleep_until(end);
	sim_op_run(op);
	return end;
}

/* With sim_obj_lock held, a context is going: its ordering goes with it. */
static void sim_tl_ctx_gone(uint64_t id, struct sim_obj *dead)
{
	size_t i;

	(void)dead;
	for (i = 0; i < SIM_TL_CTXS; i++)
		if (sim_tl_ctxs[i].id == id)
			memset(&sim_tl_ctxs[i], 0, sizeof(sim_tl_ctxs[i]));
}

static const struct sim_hooks sim_tl_hooks = { .ctx_gone_locked = sim_tl_ctx_gone };

__attribute__((constructor)) static void sim_tl_hooks_load(void)
{
	sim_hooks_add(&sim_tl_hooks);
}
