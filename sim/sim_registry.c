/*
 * The registry of the simulated driver's host objects and of its
 * subsystems' hooks (sim_registry.h). It calls no other file of the driver.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "sim_registry.h"

pthread_mutex_t sim_obj_lock = PTHREAD_MUTEX_INITIALIZER;
struct sim_obj *sim_obj_list;

/*
 * What the create calls of objects share: a zeroed object of size bytes, a
 * struct that starts with its struct sim_obj, of kind on dev; NULL if out
 * of memory.
 */
void *sim_obj_new(size_t size, enum sim_obj_kind kind, int dev)
{
	struct sim_obj *o = calloc(1, size);

	if (o) {
		o->kind = kind;
		o->dev = dev;
	}
	return o;
}

void sim_obj_add(struct sim_obj *o)
{
	pthread_mutex_lock(&sim_obj_lock);
	o->next = sim_obj_list;
	sim_obj_list = o;
	pthread_mutex_unlock(&sim_obj_lock);
}

/*
 * With sim_obj_lock held: the link to the live object of this kind behind
 * handle, or NULL. Compared by address, so a made-up handle is never
 * dereferenced.
 */
struct sim_obj **sim_obj_find(const void *handle, enum sim_obj_kind kind)
{
	struct sim_obj **pp;

	if (!handle)
		return NULL;
	for (pp = &sim_obj_list; *pp && (*pp != handle || (*pp)->kind != kind); pp = &(*pp)->next)
		;
	return *pp ? pp : NULL;
}

/*
 * The live object of this kind behind handle, or NULL. With take it is
 * unlinked and the caller owns it; without, only the copy in *seen may be
 * read, since another thread may destroy the object as soon as the lock is
 * dropped.
 */
struct sim_obj *sim_obj_lookup(const void *handle, enum sim_obj_kind kind, bool take,
			       struct sim_obj *seen)
{
	struct sim_obj **pp, *o = NULL;

	pthread_mutex_lock(&sim_obj_lock);
	pp = sim_obj_find(handle, kind);
	if (pp) {
		o = *pp;
		*seen = *o;
		if (take)
			*pp = o->next;
	}
	pthread_mutex_unlock(&sim_obj_lock);
	return o;
}

/*
 * A copy of the first size bytes of the live object of this kind behind
 * handle (its whole struct), taken under sim_obj_lock; false if there is
 * no such object, and then *copy is left as it was.
 */
bool sim_obj_copy(const void *handle, enum sim_obj_kind kind, void *copy, size_t size)
{
	struct sim_obj **pp;

	pthread_mutex_lock(&sim_obj_lock);
	pp = sim_obj_find(handle, kind);
	if (pp)
		memcpy(copy, *pp, size);
	pthread_mutex_unlock(&sim_obj_lock);
	return pp != NULL;
}

/*
 * What the destroy calls of objects share: with sim_obj_lock held, the live
 * object of kind behind handle, taken off the list; NULL if none.
 */
struct sim_obj *sim_obj_unlink_locked(const void *handle, enum sim_obj_kind kind)
{
	struct sim_obj **pp = sim_obj_find(handle, kind), *o = pp ? *pp : NULL;

	if (o)
		*pp = o->next;
	return o;
}

/* --- hooks ---------------------------------------------------------------------------- */

/*
 * The subsystems that registered, a few. Registered from constructors, so
 * at load, before any thread can call the driver: read without a lock.
 */
#define SIM_MAX_HOOKS 8

static const struct sim_hooks *sim_hooks[SIM_MAX_HOOKS];
static unsigned int sim_nhooks;

void sim_hooks_add(const struct sim_hooks *hooks)
{
	/* More subsystems than the table holds is a mistake in the build: fail at once. */
	if (sim_nhooks == SIM_MAX_HOOKS)
		abort();
	sim_hooks[sim_nhooks++] = hooks;
}

void sim_teardown(uint64_t id)
{
	struct sim_obj **pp, *o, *dead = NULL;
	unsigned int i;

	pthread_mutex_lock(&sim_obj_lock);
	for (pp = &sim_obj_list; (o = *pp);) {
		if (o->owner == id) {
			*pp = o->next;
			o->next = dead;
			dead = o;
		} else {
			pp = &o->next;
		}
	}
	for (i = 0; i < sim_nhooks; i++)
		if (sim_hooks[i]->ctx_gone_locked)
			sim_hooks[i]->ctx_gone_locked(id, dead);
	pthread_mutex_unlock(&sim_obj_lock);
	for (i = 0; i < sim_nhooks; i++)
		if (sim_hooks[i]->ctx_gone)
			sim_hooks[i]->ctx_gone(id);
	while ((o = dead)) {
		dead = o->next;
		free(o);
	}
}

void sim_fork_child(void)
{
	pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
	unsigned int i;

	sim_obj_lock = fresh;
	for (i = 0; i < sim_nhooks; i++)
		if (sim_hooks[i]->fork_child)
			sim_hooks[i]->fork_child();
}

void sim_sync(void)
{
	unsigned int i;

	for (i = 0; i < sim_nhooks; i++)
		if (sim_hooks[i]->sync)
			sim_hooks[i]->sync();
}
