/*
 * (key, kind) -> record of a live allocation. See alloc_map.h.
 */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "alloc_map.h"

#define GS_SHARDS 64

static struct gs_shard {
	pthread_mutex_t mu;
	struct gs_alloc *tab;
	uint32_t cap, n;
} __attribute__((aligned(64))) shards[GS_SHARDS];

static inline uint64_t mix(uint64_t x)
{
	x ^= x >> 33;
	x *= 0xff51afd7ed558ccdULL;
	x ^= x >> 33;
	return x;
}

static inline uint64_t hkey(uint64_t key, uint32_t kind)
{
	return mix(key ^ ((uint64_t)kind << 60));
}

static inline struct gs_shard *shard_of(uint64_t key, uint32_t kind)
{
	return &shards[hkey(key, kind) & (GS_SHARDS - 1)];
}

static inline uint32_t home_of(const struct gs_shard *s, uint64_t key, uint32_t kind)
{
	return (uint32_t)(hkey(key, kind) >> 6) & (s->cap - 1);
}

/* Index of (key, kind) in the shard, or -1. Under the shard lock. */
static int64_t shard_find(const struct gs_shard *s, uint64_t key, uint32_t kind)
{
	uint32_t m, i;

	if (s->cap == 0)
		return -1;
	m = s->cap - 1;
	for (i = home_of(s, key, kind); s->tab[i].key != 0; i = (i + 1) & m)
		if (s->tab[i].key == key && s->tab[i].kind == kind)
			return i;
	return -1;
}

/* Backward-shift deletion keeps probe chains whole without tombstones. */
static void shard_del_at(struct gs_shard *s, uint32_t i)
{
	uint32_t m = s->cap - 1;

	for (uint32_t j = (i + 1) & m; s->tab[j].key != 0; j = (j + 1) & m) {
		uint32_t home = home_of(s, s->tab[j].key, s->tab[j].kind);

		if (((j - home) & m) >= ((j - i) & m)) {
			s->tab[i] = s->tab[j];
			i = j;
		}
	}
	s->tab[i].key = 0;
	s->n--;
}

/* Insert a; if a record for the same handle existed, return it in *old. */
static int shard_put(struct gs_shard *s, struct gs_alloc a, struct gs_alloc *old)
{
	uint32_t i = home_of(s, a.key, a.kind);
	int replaced = 0;

	while (s->tab[i].key != 0 && !(s->tab[i].key == a.key && s->tab[i].kind == a.kind))
		i = (i + 1) & (s->cap - 1);
	if (s->tab[i].key == 0) {
		s->n++;
	} else {
		*old = s->tab[i];
		replaced = 1;
	}
	s->tab[i] = a;
	return replaced;
}

void gs_map_init(void)
{
	for (int i = 0; i < GS_SHARDS; i++)
		pthread_mutex_init(&shards[i].mu, NULL);
}

void gs_map_reset(void)
{
	for (int i = 0; i < GS_SHARDS; i++) {
		pthread_mutex_init(&shards[i].mu, NULL);
		if (shards[i].tab != NULL)
			memset(shards[i].tab, 0, sizeof(struct gs_alloc) * shards[i].cap);
		shards[i].n = 0;
	}
}

int gs_map_put(const struct gs_alloc *a, struct gs_alloc *old)
{
	struct gs_shard *s = shard_of(a->key, a->kind);
	struct gs_alloc stale;
	int rc;

	pthread_mutex_lock(&s->mu);
	if ((s->n + 1) * 4 > s->cap * 3) {
		uint32_t ncap = s->cap ? s->cap * 2 : 64;
		struct gs_alloc *was = s->tab, *tab = calloc(ncap, sizeof(*tab));
		uint32_t ocap = s->cap;

		if (tab == NULL) {
			pthread_mutex_unlock(&s->mu);
			return -ENOMEM;
		}
		s->tab = tab;
		s->cap = ncap;
		s->n = 0;
		for (uint32_t i = 0; i < ocap; i++)
			if (was[i].key != 0)
				shard_put(s, was[i], &stale);
		free(was);
	}
	rc = shard_put(s, *a, old);
	pthread_mutex_unlock(&s->mu);
	return rc;
}

int gs_map_take(uint64_t key, uint32_t kind, struct gs_alloc *out)
{
	struct gs_shard *s = shard_of(key, kind);
	int64_t i;

	pthread_mutex_lock(&s->mu);
	i = shard_find(s, key, kind);
	if (i >= 0) {
		*out = s->tab[i];
		shard_del_at(s, (uint32_t)i);
	}
	pthread_mutex_unlock(&s->mu);
	return i >= 0 ? 0 : -ENOENT;
}

int gs_map_peek(uint64_t key, uint32_t kind, struct gs_alloc *out)
{
	struct gs_shard *s = shard_of(key, kind);
	int64_t i;

	pthread_mutex_lock(&s->mu);
	i = shard_find(s, key, kind);
	if (i >= 0)
		*out = s->tab[i];
	pthread_mutex_unlock(&s->mu);
	return i >= 0 ? 0 : -ENOENT;
}

int gs_map_handle_adjust(uint64_t handle, int drefs, int dmaps, struct gs_alloc *gone)
{
	struct gs_shard *s = shard_of(handle, GS_K_HANDLE);
	int64_t i;
	int rc = -ENOENT;

	pthread_mutex_lock(&s->mu);
	i = shard_find(s, handle, GS_K_HANDLE);
	if (i >= 0) {
		struct gs_alloc *a = &s->tab[i];
		int64_t refs = (int64_t)a->refs + drefs, maps = (int64_t)a->maps + dmaps;

		if (refs < 0 || maps < 0) {
			pthread_mutex_unlock(&s->mu);
			return 2;
		}
		a->refs = (uint32_t)refs;
		a->maps = (uint32_t)maps;
		rc = 0;
		if (a->refs == 0 && a->maps == 0) {
			*gone = *a;
			shard_del_at(s, (uint32_t)i);
			rc = 1;
		}
	}
	pthread_mutex_unlock(&s->mu);
	return rc;
}

int gs_map_update(uint64_t key, uint32_t kind, void (*fn)(struct gs_alloc *, void *), void *arg)
{
	struct gs_shard *s = shard_of(key, kind);
	int64_t i;

	pthread_mutex_lock(&s->mu);
	i = shard_find(s, key, kind);
	if (i >= 0)
		fn(&s->tab[i], arg);
	pthread_mutex_unlock(&s->mu);
	return i >= 0 ? 0 : -ENOENT;
}

void gs_map_take_each(int (*fn)(const struct gs_alloc *, void *), void *arg)
{
	for (int k = 0; k < GS_SHARDS; k++) {
		struct gs_shard *s = &shards[k];

		pthread_mutex_lock(&s->mu);
		for (uint32_t i = 0; i < s->cap;) {
			if (s->tab[i].key == 0 || !fn(&s->tab[i], arg)) {
				i++;
				continue;
			}
			shard_del_at(s, i); /* a later record may move here: look again */
		}
		pthread_mutex_unlock(&s->mu);
	}
}

size_t gs_map_count(void)
{
	size_t n = 0;

	for (int k = 0; k < GS_SHARDS; k++) {
		pthread_mutex_lock(&shards[k].mu);
		n += shards[k].n;
		pthread_mutex_unlock(&shards[k].mu);
	}
	return n;
}
