/*
 * accounting.c: the charging policy's core: what is charged for what, on
 * which GPU, to whom, the records of allocations that carry the charges
 * until freed, and contexts, charged once per process and GPU. Above
 * process.h.
 */
#ifndef GS_ACCOUNTING_H
#define GS_ACCOUNTING_H

#include "process.h"

#pragma GCC visibility push(hidden)

/* One charge: where it went, so it can be taken back exactly. */
struct gs_charge {
	int32_t slot;
	int32_t gpu;
	uint64_t bytes;
	CUcontext ctx;	/* the context the memory belongs to; NULL if none */
	uint64_t epoch; /* the process's epoch when it was charged */
	uint32_t pool;	/* taken from a stream-ordered pool (gs_alloc.pool): it holds the charge */
};

/* Charges. */
int charge_slot(int slot, int gpu, uint64_t bytes);
CUresult charge_gpu(int gpu, uint64_t bytes, struct gs_charge *c);
CUresult charge_new(int gpu, uint64_t bytes, struct gs_charge *c);
CUresult charge_current(uint64_t bytes, struct gs_charge *c);
void give_back(int32_t slot, int32_t gpu, uint64_t bytes, uint64_t epoch, uint32_t pinned);
void uncharge(const struct gs_charge *c);

/* Records of allocations (alloc_map.h). */
int alloc_put(struct gs_alloc a);
int alloc_track(uint64_t key, uint32_t kind, const struct gs_charge *c);
CUresult remember(uint64_t key, uint32_t kind, const struct gs_charge *c, void (*undo)(uint64_t));
CUresult settle(CUresult rc, uint64_t key, uint32_t kind, const struct gs_charge *c,
		void (*undo)(uint64_t));
int forget(uint64_t key, uint32_t kind, struct gs_alloc *a);
void uncharge_record(const struct gs_alloc *a);
CUresult freed(CUresult rc, const struct gs_alloc *a);
void undo_ptr(uint64_t key);
void undo_handle(uint64_t key);
void undo_array(uint64_t key);
void undo_mipmap(uint64_t key);

/*
 * Where a freed record of stream-ordered pool memory (gs_alloc.pool set)
 * goes: to its pool, which keeps the charge. pools.c, above this file,
 * registers it at load; a record of a pool can only exist after that.
 */
void records_pool_free(void (*to_pool)(const struct gs_alloc *a));

/* Contexts. */
CUresult charge_context(CUdevice dev, int *charged);
void context_settle(int gpu, CUresult rc);
void primary_retain_begin(CUdevice dev);
int sync_primaries(void);
void primary_retain_end(CUdevice dev, CUresult rc, const CUcontext *ctx);
CUresult teardown(gs_fn_cuCtxDestroy_v2 destroy, CUcontext ctx,
		  gs_fn_cuDevicePrimaryCtxReset_v2 on_dev, CUdevice dev, int release);

#pragma GCC visibility pop

#endif
