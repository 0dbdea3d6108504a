/*
 * What the simulated driver's own files share: sim_cuda.c (start-up,
 * devices), sim_ctx.c (contexts), sim_entry.c (errors, export tables,
 * cuGetProcAddress), the memory files (the device heaps and all that takes
 * from them; they share sim_memory.h besides), sim_streams.c (streams,
 * capture, launches), sim_graphs.c (graphs), sim_events.c (events),
 * sim_timeline.c (the device timeline) and sim_modules.c (modules,
 * kernels, occupancy), all above the registry of
 * host objects and hooks (sim_registry.h). Private to the driver and, like
 * everything in it, hidden; what the export layer, the tables and the
 * trace share with it is sim_internal.h.
 */
#ifndef GPUSHARE_SIM_DRIVER_H
#define GPUSHARE_SIM_DRIVER_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "sim_abi.h"
#include "sim_impl.h"
#include "sim_internal.h"
#include "sim_registry.h"
#include "sim_spec.h"

/*
 * Declared hidden, as -fvisibility=hidden makes their definitions, so that
 * the files reach each other's functions and globals directly.
 */
#pragma GCC visibility push(hidden)

#define SIM_ALIGN 512	 /* allocation granule and alignment */
#define SIM_CTX_DEPTH 64 /* per-thread context stack */

struct sim_extent {
	size_t off;
	size_t len;
	unsigned int kind;		 /* live extents: enum sim_mem_kind; free ones: 0 */
	uint64_t owner;			 /* live: the id of the context it belongs to, or 0 */
	size_t refs;			 /* SIM_MEM_HANDLE: unreleased handle references */
	size_t maps;			 /* SIM_MEM_HANDLE: mappings of it (cuMemMap) */
	struct CUmemPoolHandle_st *pool; /* stream-ordered: the pool it is from */
	bool idle;			 /* in a pool: freed to it, kept reserved for reuse */
	struct sim_galloc *graph;	 /* a graph allocation's address range (sim_pools.c) */
};

/*
 * What made a live allocation. Each way back frees only its own kind, as the
 * driver does: cuMemFree of a cuMemCreate handle's memory or of an array's
 * storage is an error, never a silent release. Pointers and arrays belong to
 * the context that was current when they were made and go with it; a
 * cuMemCreate allocation belongs to no context and lives until its last
 * reference and its last mapping are gone.
 */
enum sim_mem_kind {
	SIM_MEM_PTR = 1, /* cuMemAlloc & co.: back with cuMemFree(Async) */
	SIM_MEM_HANDLE,	 /* cuMemCreate: back with cuMemRelease */
	SIM_MEM_ARRAY,	 /* arrays and mipmapped arrays: back with their destroy */
	SIM_MEM_CONTEXT, /* the process's context: back when its last one goes */
};

/*
 * Both arrays are sorted by offset. Free extents are kept coalesced, so
 * there are never more of them than live allocations + 1; growing free_cap
 * along with live_cap keeps that room and is why a free can never fail.
 */
struct sim_heap {
	pthread_mutex_t lock;
	uintptr_t base; /* 0 until first allocation; read atomically */
	int fd;		/* the memfd behind base, once base is set */
	int spec_index; /* its device's place in the node (sim_usage.c) */
	size_t arena;	/* device bytes rounded down to SIM_ALIGN */
	size_t used;
	size_t unpunched;		   /* bytes freed since free memory last went back */
	size_t unpunched_lo, unpunched_hi; /* the span they were freed in */
	struct sim_extent *free_ext;
	size_t nfree, free_cap;
	struct sim_extent *live;
	size_t nlive, live_cap;
};

/*
 * A context's id is what its allocations and objects record as their owner.
 * Ids are never reused, so that an allocation made through a stale handle
 * can never be taken for a later context's. A primary context keeps one id
 * (its device's ordinal + 1) through every reset: it is the same handle.
 */
struct CUctx_st {
	struct CUctx_st *next; /* sim_ctx_list; unused by primaries */
	int dev;
	uint64_t id;
};

#define SIM_PRIMARY_ID(dev) ((uint64_t)(dev) + 1)

/*
 * A stream-ordered pool, as the driver models one: memory freed into it
 * stays reserved by the pool (still taken from the device) for reuse, until
 * the pool is trimmed (cuMemPoolTrimTo) or a synchronisation releases what
 * exceeds its release threshold (0 by default, so a synchronisation gives
 * everything idle back). Its chunks are heap extents that name it; the
 * counters are kept under its device's heap lock.
 */
struct CUmemPoolHandle_st {
	struct sim_obj obj;
	uint64_t threshold; /* CU_MEMPOOL_ATTR_RELEASE_THRESHOLD */
	uint64_t reserved, reserved_high;
	uint64_t used, used_high;
	int reuse[3]; /* the three CU_MEMPOOL_ATTR_REUSE_* switches */
};

struct sim_device {
	const struct sim_spec *spec;
	int index; /* its ordinal */
	int spec_index;
	struct sim_heap heap;
	struct CUctx_st primary;
	unsigned int primary_refs; /* under sim_ctx_lock */
	/* Under heap.lock: the context memory taken (sim_heap_context_take), if any. */
	bool ctx_held;
	size_t ctx_off, ctx_len;
	struct CUmemPoolHandle_st default_pool;
	CUmemoryPool mempool; /* the current pool; under sim_obj_lock */
};

/*
 * A stack slot records the device and id with the handle so that the hot
 * paths never read a context object another thread may have destroyed.
 */
struct sim_ctx_slot {
	CUcontext ctx;
	int dev;
	uint64_t id;
};

/* sim_cuda.c: start-up and the devices. */

extern struct sim_device sim_devs[SIM_MAX_GPUS];
extern int sim_ndevs;

/*
 * Lock order: sim_ctx_lock before sim_obj_lock before a heap lock, and
 * sim_va_lock (sim_vmm.c) before a heap lock; never two heap locks at
 * once.
 */

/* CUDA_ERROR_NOT_INITIALIZED until cuInit has succeeded. */
CUresult sim_live(void);

/* Whether cuInit has succeeded; until then most entry points answer CUDA_ERROR_NOT_INITIALIZED. */
bool sim_initialized(void);

bool sim_valid_dev(CUdevice dev);
CUresult sim_check(const void *out, CUdevice dev);
CUresult sim_check_dev(CUdevice dev);

/*
 * What an entry point checks first, in the driver's order:
 * CUDA_ERROR_NOT_INITIALIZED before cuInit, then CUDA_ERROR_INVALID_VALUE
 * unless args_ok (e.g. out != NULL); CUDA_SUCCESS otherwise.
 */
CUresult sim_check_args(bool args_ok);

/*
 * A destroy call's opening: CUDA_ERROR_NOT_INITIALIZED before cuInit, else
 * the object of kind behind handle taken off the list into *out, for the
 * caller to free; missing (the call's own error) if there is none.
 */
CUresult sim_obj_take(const void *handle, enum sim_obj_kind kind, CUresult missing,
		      struct sim_obj **out);

/* sim_ctx.c: contexts. */

extern pthread_mutex_t sim_ctx_lock;
extern struct CUctx_st *sim_ctx_list; /* under sim_ctx_lock; primaries are not on it */

/* The calling thread's context stack: the top one is current. */
extern __thread struct sim_ctx_slot sim_stack[SIM_CTX_DEPTH];
extern __thread unsigned int sim_depth;

const struct sim_ctx_slot *sim_current(void);
int sim_current_dev(void);

/*
 * sim_obj_new for the calling thread's current context (an array's or a
 * stream's): on its device, with its id as owner and the context itself;
 * NULL with *rc set (CUDA_ERROR_INVALID_CONTEXT without one) if none is made.
 */
void *sim_obj_new_current(size_t size, enum sim_obj_kind kind, CUresult *rc);

/* sim_heap.c and sim_pools.c: the device heaps. */

CUresult sim_heap_alloc(struct sim_device *d, size_t bytes, enum sim_mem_kind kind, uint64_t owner,
			CUdeviceptr *out);
CUresult sim_mem_free(CUdeviceptr addr, enum sim_mem_kind kind);
/*
 * With d's heap locked: the process's contexts on d take the device's
 * context size (the spec's "context") from its memory, once, as the real
 * driver's do; sim_heap_context_drop gives it back.
 */
CUresult sim_heap_context_take(struct sim_device *d);
void sim_heap_context_drop(struct sim_device *d);

/* sim_streams.c: what is done on a stream. */

/*
 * One operation of a stream: done at once, or recorded into the graph the
 * stream is capturing, to be done at each launch of it.
 */
enum sim_op_kind {
	SIM_OP_COPY = 1,
	SIM_OP_SET,
	SIM_OP_HOST,
	SIM_OP_KERNEL,
	SIM_OP_GALLOC, /* a graph's memory allocation node */
	SIM_OP_GFREE,  /* a graph's memory free node */
};

struct sim_op {
	enum sim_op_kind kind;
	uintptr_t dst, src;
	size_t width; /* bytes per row (copies), elements per row (sets), blocks (kernels) */
	size_t height;
	size_t dpitch, spitch;
	uint32_t value;
	unsigned int elem; /* memset element size: 1, 2 or 4 */
	CUhostFn fn;
	void *data;
	struct sim_galloc *ga; /* SIM_OP_GALLOC, SIM_OP_GFREE: holds a reference to it */
};

/*
 * sim_pools.c: graph memory. A graph allocation is an address range of
 * its device's arena, made when the allocation node is, and kept while a
 * graph, an executable graph or a launch (until its free) refers to it.
 */
struct sim_galloc *sim_galloc_new(int dev, size_t bytes, CUdeviceptr *out);
struct sim_galloc *sim_galloc_at(CUdeviceptr addr);
void sim_galloc_ref(struct sim_galloc *ga);
void sim_galloc_unref(struct sim_galloc *ga);
void sim_galloc_run(const struct sim_op *op);
void sim_gmem_launch(const struct sim_op *ops, size_t n, bool autofree, bool upload);

/*
 * A stream: a handle bound to the context that was current when it was
 * made (sim_streams.c). Its capture state is also read and joined by
 * events (sim_events.c).
 */
struct CUstream_st {
	struct sim_obj obj;
	unsigned int flags;
	int priority;
	uint64_t id;
	uint64_t ready; /* the device timeline: when its last operation ends; under sim_obj_lock */
	/* Stream capture, under sim_obj_lock. */
	int capture_status; /* CU_STREAM_CAPTURE_STATUS_* */
	int capture_mode;
	uint64_t capture_id;
	struct CUgraph_st *capture; /* the graph being captured into */
	bool capture_origin;	    /* began the capture (others joined it through an event) */
};

/*
 * With sim_obj_lock held: the stream object behind a non-default handle, or
 * NULL (default streams are never captured).
 */
struct CUstream_st *sim_stream_locked(CUstream stream);
/* sim_events.c: with sim_obj_lock held, capture id is over for event e. */
void sim_event_capture_over(struct CUevent_st *e, uint64_t id);

CUresult sim_capture_alloc(CUstream stream, int dev, size_t bytes, CUdeviceptr *out,
			   bool *captured);
CUresult sim_capture_free(CUstream stream, CUdeviceptr addr, bool *captured);
CUresult sim_stream_slot(CUstream stream, struct sim_ctx_slot *slot);
/* The same, CUDA_ERROR_NOT_INITIALIZED before cuInit: an entry point's first check. */
CUresult sim_stream_slot_live(CUstream stream, struct sim_ctx_slot *slot);
CUresult sim_stream_do(CUstream stream, const struct sim_op *op);
/* A synchronous copy or memset: on the legacy stream, and with the timeline on, waited for. */
CUresult sim_stream_do_sync(const struct sim_op *op);

/*
 * sim_timeline.c: the device timeline (GPUSHARE_SIM_TIMELINE). Times are
 * CLOCK_MONOTONIC ns. The _locked ones need sim_obj_lock; s is the
 * stream's object, NULL for a default stream.
 */
bool sim_tl_on(void);
void sim_tl_sleep_until(uint64_t t);
uint64_t sim_tl_duration(const struct sim_op *op, int dev);
uint64_t sim_tl_after_locked(CUstream stream, const struct CUstream_st *s, uint64_t ctx);
void sim_tl_done_locked(CUstream stream, struct CUstream_st *s, uint64_t ctx, uint64_t end);
uint64_t sim_tl_mark_locked(CUstream stream, struct CUstream_st *s, uint64_t ctx);
uint64_t sim_tl_stream_end(CUstream stream, const struct sim_ctx_slot *slot);
uint64_t sim_tl_ctx_end(uint64_t ctx);
uint64_t sim_tl_run(CUstream stream, const struct sim_ctx_slot *slot, const struct sim_op *op);

/* sim_graphs.c: a graph, and an instantiation of it: the operations recorded (struct sim_op). */
struct CUgraph_st {
	struct sim_obj obj;
	struct sim_op *ops;
	size_t nops, cap;
};

struct CUgraphExec_st {
	struct sim_obj obj;
	struct sim_op *ops;
	size_t nops;
	bool autofree; /* CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH */
};

struct CUgraph_st *sim_graph_new(void);
void sim_graph_free(struct CUgraph_st *g);
bool sim_graph_add(struct CUgraph_st *g, const struct sim_op *op);
void sim_op_run(const struct sim_op *op);
struct sim_op *sim_ops_copy(const struct sim_op *ops, size_t n, bool *failed);
void sim_ops_free(struct sim_op *ops, size_t n);

/* The first word of the IPC handles the driver makes, of memory and of events. */
#define SIM_IPC_MAGIC 0x50495347u /* "GSIP" */

/*
 * The per-thread default stream variants do exactly what their
 * legacy-stream twins do: a NULL stream is the legacy stream in both (the
 * per-thread default stream is CU_STREAM_PER_THREAD). An alias must be
 * defined in the file that defines its twin.
 */
#define SIM_SAME_AS(variant, twin)                            \
	extern __typeof__(sim_impl_##twin) sim_impl_##variant \
		__attribute__((alias("sim_impl_" #twin)))

/*
 * The simulator's counter functions' answer (gpushareSimCopyCounters,
 * gpushareSimKernelCounters): the first count of a process's n counters
 * into out (the rest of out left as it is), each read relaxed: a count of
 * its own, read for a report. CUDA_ERROR_INVALID_VALUE if out is NULL.
 */
CUresult sim_counters_out(unsigned long long *out, unsigned int count, const uint64_t *counters,
			  unsigned int n);

/* Puts node at the head of a list of records linked through their next, under lock. */
#define SIM_LIST_PUSH(lock, head, node)     \
	do {                                \
		pthread_mutex_lock(lock);   \
		(node)->next = (head);      \
		(head) = (node);            \
		pthread_mutex_unlock(lock); \
	} while (0)

#pragma GCC visibility pop

#endif
