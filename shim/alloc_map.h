/*
 * The allocation map: (key, kind) -> the record of a live allocation, so a
 * free uncharges exactly what its allocation charged. Device pointers,
 * cuMemCreate handles, their mappings, array handles and a context's limits
 * live in different namespaces, hence the kind. Sharded so that threads
 * rarely meet; a shard lock is held only around the table operation (and
 * the callbacks below), never across a driver call.
 *
 * Needs no driver and no ledger: the charges a record stands for are the
 * caller's (accounting.c).
 */
#ifndef GS_ALLOC_MAP_H
#define GS_ALLOC_MAP_H

#include <stddef.h>
#include <stdint.h>

#pragma GCC visibility push(hidden)

enum gs_kind {
	GS_K_PTR = 1, /* device memory owned by a context */
	GS_K_HANDLE,  /* cuMemCreate: lives while referenced or mapped */
	GS_K_MAP,     /* a cuMemMap of a handle: no charge of its own */
	GS_K_ARRAY,
	GS_K_MIPMAP,
	GS_K_LIMIT, /* a context's heap and stacks beyond their defaults; keyed by the context */
};

struct gs_alloc {
	uint64_t key; /* 0 = empty; the driver never hands out 0 */
	uint32_t kind;
	int32_t gpu;
	uint64_t size;
	uint64_t owner;	 /* PTR, ARRAY, MIPMAP: the owning context; MAP: the handle mapped */
	uint32_t refs;	 /* HANDLE: references (cuMemCreate's, each retain's) */
	uint32_t maps;	 /* HANDLE: mappings */
	uint64_t epoch;	 /* charged ones: the process's epoch when charged */
	uint32_t pinned; /* charged ones: counted persistent by gpushare_mark_persistent */
	uint32_t
		pool; /* PTR from a stream-ordered pool: its pools[] index + 1, which holds the charge */
};

/* The shard locks made (at load), or made afresh with every record dropped (a fork child). */
void gs_map_init(void);
void gs_map_reset(void);

/*
 * Insert *a (a->key nonzero). 1 if a record for the same (key, kind) was
 * there: it is replaced and returned in *old. 0 if not; -ENOMEM if the
 * table could not grow (nothing changes).
 */
int gs_map_put(const struct gs_alloc *a, struct gs_alloc *old);

/* Remove the record of (key, kind) into *out; 0 if found, -ENOENT if not. */
int gs_map_take(uint64_t key, uint32_t kind, struct gs_alloc *out);

/* A copy of the record of (key, kind); 0 if found, -ENOENT if not. */
int gs_map_peek(uint64_t key, uint32_t kind, struct gs_alloc *out);

/*
 * Call fn on the record of (key, kind) in place, under its shard's lock
 * (fn must not change key or kind). 0 if found, -ENOENT if not.
 */
int gs_map_update(uint64_t key, uint32_t kind, void (*fn)(struct gs_alloc *, void *), void *arg);

/*
 * Change a GS_K_HANDLE record's reference and mapping counts. When both
 * reach zero the record is taken out into *gone and 1 returned. 0 if it
 * lives on, 2 if a count would go below zero (nothing changes), -ENOENT if
 * there is no record.
 */
int gs_map_handle_adjust(uint64_t handle, int drefs, int dmaps, struct gs_alloc *gone);

/*
 * Walk every record, one shard at a time under its lock: the ones fn
 * returns nonzero for are removed. Rare (context teardown): a walk of the
 * whole table.
 */
void gs_map_take_each(int (*fn)(const struct gs_alloc *, void *), void *arg);

/* How many records the map holds (a snapshot, for tests and reports). */
size_t gs_map_count(void);

#pragma GCC visibility pop

#endif
