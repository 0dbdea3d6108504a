/*
 * The shim's allocation map on its own (shim/alloc_map.c), no driver and no
 * ledger: insert, look up, replace, remove, growth across every shard, the
 * handle counts, in-place updates, walks, reset, and threads at once.
 * Prints "ok records=N" and exits 0, or names the first check that failed
 * and exits 1.
 *
 * Usage: alloc_map_test [threads] [keys-per-thread]
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "alloc_map.h"

#define CHECK(cond)                                                                        \
	do {                                                                               \
		if (!(cond)) {                                                             \
			fprintf(stderr, "%s:%d: failed: %s\n", __FILE__, __LINE__, #cond); \
			exit(1);                                                           \
		}                                                                          \
	} while (0)

static struct gs_alloc rec(uint64_t key, uint32_t kind, uint64_t size, uint64_t owner)
{
	return (struct gs_alloc){ .key = key,
				  .kind = kind,
				  .gpu = (int32_t)(key % 7),
				  .size = size,
				  .owner = owner,
				  .refs = 1 };
}

/* Keys as the driver hands them out: aligned addresses, close together. */
static uint64_t addr(uint64_t i)
{
	return 0x7f0000000000ULL + i * 512;
}

static void basics(void)
{
	struct gs_alloc a = rec(addr(1), GS_K_PTR, 4096, 11), out, old;

	CHECK(gs_map_count() == 0);
	CHECK(gs_map_peek(addr(1), GS_K_PTR, &out) == -ENOENT);
	CHECK(gs_map_take(addr(1), GS_K_PTR, &out) == -ENOENT);
	CHECK(gs_map_put(&a, &old) == 0);
	CHECK(gs_map_peek(addr(1), GS_K_PTR, &out) == 0 && out.size == 4096 && out.owner == 11);
	/* The same key in another namespace is another record. */
	CHECK(gs_map_peek(addr(1), GS_K_ARRAY, &out) == -ENOENT);
	a.kind = GS_K_ARRAY;
	a.size = 8192;
	CHECK(gs_map_put(&a, &old) == 0);
	CHECK(gs_map_count() == 2);
	/* The same (key, kind) again replaces, and hands back what was there. */
	a.size = 16384;
	CHECK(gs_map_put(&a, &old) == 1 && old.size == 8192 && old.kind == GS_K_ARRAY);
	CHECK(gs_map_count() == 2);
	CHECK(gs_map_take(addr(1), GS_K_PTR, &out) == 0 && out.size == 4096);
	CHECK(gs_map_take(addr(1), GS_K_PTR, &out) == -ENOENT);
	CHECK(gs_map_take(addr(1), GS_K_ARRAY, &out) == 0 && out.size == 16384);
	CHECK(gs_map_count() == 0);
}

/* Enough records that every shard grows several times; then every other one removed. */
static void growth(uint64_t n)
{
	struct gs_alloc a, out, old;

	for (uint64_t i = 1; i <= n; i++) {
		a = rec(addr(i), i % 3 ? GS_K_PTR : GS_K_MIPMAP, i, i % 5);
		CHECK(gs_map_put(&a, &old) == 0);
	}
	CHECK(gs_map_count() == n);
	for (uint64_t i = 1; i <= n; i++) {
		CHECK(gs_map_peek(addr(i), i % 3 ? GS_K_PTR : GS_K_MIPMAP, &out) == 0);
		CHECK(out.key == addr(i) && out.size == i && out.owner == i % 5);
	}
	/* Removal shifts later records back: every survivor must still be found. */
	for (uint64_t i = 1; i <= n; i += 2)
		CHECK(gs_map_take(addr(i), i % 3 ? GS_K_PTR : GS_K_MIPMAP, &out) == 0 &&
		      out.size == i);
	CHECK(gs_map_count() == n / 2);
	for (uint64_t i = 1; i <= n; i++) {
		int rc = gs_map_peek(addr(i), i % 3 ? GS_K_PTR : GS_K_MIPMAP, &out);

		CHECK(i % 2 ? rc == -ENOENT : rc == 0 && out.size == i);
	}
	for (uint64_t i = 2; i <= n; i += 2)
		CHECK(gs_map_take(addr(i), i % 3 ? GS_K_PTR : GS_K_MIPMAP, &out) == 0);
	CHECK(gs_map_count() == 0);
}

static void handles(void)
{
	struct gs_alloc h = rec(0x1000, GS_K_HANDLE, 2 << 20, 0), gone, old;

	CHECK(gs_map_handle_adjust(0x1000, -1, 0, &gone) == -ENOENT);
	CHECK(gs_map_put(&h, &old) == 0);
	CHECK(gs_map_handle_adjust(0x1000, 0, 1, &gone) == 0);	/* mapped: refs 1, maps 1 */
	CHECK(gs_map_handle_adjust(0x1000, 0, -2, &gone) == 2); /* below zero: nothing changes */
	CHECK(gs_map_handle_adjust(0x1000, -1, 0, &gone) == 0); /* released, still mapped */
	CHECK(gs_map_handle_adjust(0x1000, -1, 0, &gone) == 2); /* a double release */
	CHECK(gs_map_handle_adjust(0x1000, 0, -1, &gone) == 1); /* unmapped: gone */
	CHECK(gone.key == 0x1000 && gone.size == 2 << 20 && gone.refs == 0 && gone.maps == 0);
	CHECK(gs_map_handle_adjust(0x1000, 1, 0, &gone) == -ENOENT);
	CHECK(gs_map_count() == 0);
}

static void grow_size(struct gs_alloc *a, void *arg)
{
	a->size += *(const uint64_t *)arg;
	a->pinned = 1;
}

static int owned_by_arg(const struct gs_alloc *a, void *arg)
{
	return a->owner == *(const uint64_t *)arg;
}

static void updates_and_walks(void)
{
	struct gs_alloc a, out, old;
	uint64_t more = 100, owner = 3;
	size_t left = 0;

	CHECK(gs_map_update(addr(5), GS_K_PTR, grow_size, &more) == -ENOENT);
	for (uint64_t i = 1; i <= 1000; i++) {
		a = rec(addr(i), GS_K_PTR, 1, i % 4);
		CHECK(gs_map_put(&a, &old) == 0);
		left += i % 4 != owner;
	}
	CHECK(gs_map_update(addr(5), GS_K_PTR, grow_size, &more) == 0);
	CHECK(gs_map_peek(addr(5), GS_K_PTR, &out) == 0 && out.size == 101 && out.pinned == 1);
	gs_map_take_each(owned_by_arg, &owner);
	CHECK(gs_map_count() == left);
	for (uint64_t i = 1; i <= 1000; i++)
		CHECK((gs_map_peek(addr(i), GS_K_PTR, &out) == 0) == (i % 4 != owner));
	gs_map_reset();
	CHECK(gs_map_count() == 0);
	CHECK(gs_map_peek(addr(2), GS_K_PTR, &out) == -ENOENT);
}

struct worker {
	pthread_t t;
	uint64_t id, n;
};

/* Each thread its own keys, in every shard at once: put, find, replace, take. */
static void *work(void *arg)
{
	const struct worker *w = arg;
	uint64_t base = (w->id + 1) << 32;
	struct gs_alloc a, out, old;

	for (uint64_t i = 1; i <= w->n; i++) {
		a = rec(base + i * 512, GS_K_PTR, i, w->id);
		CHECK(gs_map_put(&a, &old) == 0);
	}
	for (uint64_t i = 1; i <= w->n; i++) {
		CHECK(gs_map_peek(base + i * 512, GS_K_PTR, &out) == 0);
		CHECK(out.size == i && out.owner == w->id);
		a = rec(base + i * 512, GS_K_PTR, i + 1, w->id);
		CHECK(gs_map_put(&a, &old) == 1 && old.size == i);
	}
	for (uint64_t i = 1; i <= w->n; i += 2)
		CHECK(gs_map_take(base + i * 512, GS_K_PTR, &out) == 0 && out.size == i + 1);
	return NULL;
}

static void threads(int nthreads, uint64_t n)
{
	struct worker *w = calloc((size_t)nthreads, sizeof(*w));
	struct gs_alloc out;

	CHECK(w != NULL);
	for (int i = 0; i < nthreads; i++) {
		w[i].id = (uint64_t)i;
		w[i].n = n;
		CHECK(pthread_create(&w[i].t, NULL, work, &w[i]) == 0);
	}
	for (int i = 0; i < nthreads; i++)
		CHECK(pthread_join(w[i].t, NULL) == 0);
	CHECK(gs_map_count() == (size_t)nthreads * (n / 2));
	for (int t = 0; t < nthreads; t++)
		for (uint64_t i = 1; i <= n; i++)
			CHECK((gs_map_peek(((uint64_t)t + 1) << 32 | (i * 512), GS_K_PTR, &out) ==
			       0) == (i % 2 == 0));
	free(w);
}

int main(int argc, char **argv)
{
	int nthreads = argc > 1 ? atoi(argv[1]) : 8;
	uint64_t n = argc > 2 ? strtoull(argv[2], NULL, 10) : 20000;
	size_t records;

	gs_map_init();
	basics();
	growth(n);
	handles();
	updates_and_walks();
	threads(nthreads, n);
	records = gs_map_count();
	gs_map_reset();
	printf("ok records=%zu\n", records);
	return 0;
}
