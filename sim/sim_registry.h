/*
 * The simulated driver's registry: the host objects behind its handles, on
 * one list under one lock, and the hooks through which its subsystems hear
 * of what happens to all of them at once (a context's teardown, a fork
 * child, a synchronisation). The bottom of the driver: sim_registry.c calls
 * no other file of it, and the subsystems register themselves, so it names
 * none of them.
 */
#ifndef GPUSHARE_SIM_REGISTRY_H
#define GPUSHARE_SIM_REGISTRY_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cuda_abi.h"

#pragma GCC visibility push(hidden)

/*
 * Arrays, mipmapped arrays, memory pools, streams and the rest are host
 * objects on one list, so that a handle is looked up before it is used: a
 * made-up or destroyed handle gets an error, never a crash.
 */
enum sim_obj_kind {
	SIM_OBJ_ARRAY = 1,
	SIM_OBJ_MIPMAP,
	SIM_OBJ_POOL,
	SIM_OBJ_STREAM,
	SIM_OBJ_EVENT,
	SIM_OBJ_LIBRARY,
	SIM_OBJ_FUNC,
	SIM_OBJ_GRAPH,
	SIM_OBJ_EXEC,
	SIM_OBJ_GLOBAL,
};

/* The head of every object: a struct that starts with it is on the list. */
struct sim_obj {
	struct sim_obj *next; /* sim_obj_list; unused by default pools */
	enum sim_obj_kind kind;
	int dev;
	CUdeviceptr addr; /* arrays: their storage in the device heap */
	uint64_t owner;	  /* arrays, streams: their context's id; pools: 0 */
	CUcontext ctx;	  /* arrays, streams: their context */
};

/* Lock order: sim_driver.h. */
extern pthread_mutex_t sim_obj_lock;
extern struct sim_obj *sim_obj_list; /* under sim_obj_lock */

void *sim_obj_new(size_t size, enum sim_obj_kind kind, int dev);
void sim_obj_add(struct sim_obj *o);
struct sim_obj **sim_obj_find(const void *handle, enum sim_obj_kind kind);
struct sim_obj *sim_obj_lookup(const void *handle, enum sim_obj_kind kind, bool take,
			       struct sim_obj *seen);
bool sim_obj_copy(const void *handle, enum sim_obj_kind kind, void *copy, size_t size);
struct sim_obj *sim_obj_unlink_locked(const void *handle, enum sim_obj_kind kind);

/*
 * What a subsystem is told; any member may be NULL. Each subsystem
 * registers its hooks from a constructor of its own (sim_hooks_add); they
 * run in the order they were registered, and none may depend on another's
 * having run.
 */
struct sim_hooks {
	/*
	 * With sim_obj_lock held, context id is going: `dead` lists (through
	 * next) the objects it owned, already off the list, freed once every
	 * hook has run.
	 */
	void (*ctx_gone_locked)(uint64_t id, struct sim_obj *dead);
	/* Then, with sim_obj_lock dropped: what goes with the context beside its objects. */
	void (*ctx_gone)(uint64_t id);
	/* In a forked child, only the forking thread left: its locks anew, its memory its own. */
	void (*fork_child)(void);
	/* A synchronisation (of a context, a stream or an event). */
	void (*sync)(void);
};

void sim_hooks_add(const struct sim_hooks *hooks);

/* Context id's teardown: its objects unlinked, the hooks told, the objects freed. */
void sim_teardown(uint64_t id);
/* For pthread_atfork, registered by cuInit: sim_obj_lock anew, then each fork_child hook. */
void sim_fork_child(void);
/* Each sync hook. */
void sim_sync(void);

#pragma GCC visibility pop

#endif
