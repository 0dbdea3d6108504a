/*
 * Charges racing at the limit, and what a reader of the ledger sees meanwhile.
 * Usage: ledger_race THREADS ROUNDS
 *
 * Two slots hold 3 MiB each of a GPU whose limit is 8 MiB; THREADS writers,
 * each its own slot, try to charge 3 MiB more again and again, racing each
 * other at the limit: every try is refused, as 9 MiB would be over it, and
 * some of them are being checked at any moment. A reader meanwhile sums what
 * nodemgr reports:
 * gs_ledger_used, and the used bytes and peaks of gs_ledger_summary. Prints
 * "limit=L max_used=U max_summary=S max_peak=P refused=R granted=G samples=N"
 * (N: the reader's looks): nothing a reader sees may exceed the limit, since a
 * refused charge never happened.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ledger.h"

#define MIB (1ULL << 20)
#define LIMIT (8 * MIB)
#define CHUNK (3 * MIB)

static struct gs_ledger *ledger;
static long rounds;
static int done, reading;
static unsigned long refused, granted, samples;

static void *writer(void *arg)
{
	uint32_t slot = (uint32_t)(uintptr_t)arg;
	unsigned long no = 0, yes = 0;

	while (!__atomic_load_n(&reading, __ATOMIC_ACQUIRE))
		; /* the reader is looking before anyone charges */
	for (long i = 0; i < rounds; i++) {
		if (gs_ledger_charge(ledger, slot, 0, CHUNK) != 0) {
			no++;
			continue;
		}
		yes++;
		gs_ledger_uncharge(ledger, slot, 0, CHUNK);
	}
	__atomic_fetch_add(&refused, no, __ATOMIC_RELAXED);
	__atomic_fetch_add(&granted, yes, __ATOMIC_RELAXED);
	return NULL;
}

static void *reader(void *arg)
{
	static struct gs_slot_info info[GS_MAX_SLOTS];
	uint64_t *max = arg;

	__atomic_store_n(&reading, 1, __ATOMIC_RELEASE);
	while (!__atomic_load_n(&done, __ATOMIC_ACQUIRE)) {
		uint64_t used = gs_ledger_used(ledger, 0), sum = 0, peak = 0;
		int n = gs_ledger_summary(ledger, info, GS_MAX_SLOTS);

		for (int i = 0; i < n; i++) {
			sum += info[i].used;
			peak = info[i].peak > peak ? info[i].peak : peak;
		}
		max[0] = used > max[0] ? used : max[0];
		max[1] = sum > max[1] ? sum : max[1];
		max[2] = peak > max[2] ? peak : max[2];
		samples++;
	}
	return NULL;
}

int main(int argc, char **argv)
{
	int threads = argc > 2 ? atoi(argv[1]) : 0;
	pthread_t w[64], r;
	uint64_t max[3] = { 0, 0, 0 };

	rounds = argc > 2 ? atol(argv[2]) : 0;
	if (threads < 1 || threads > 60 || rounds < 1) {
		fprintf(stderr, "usage: ledger_race THREADS(1-60) ROUNDS\n");
		return 2;
	}
	ledger = calloc(1, sizeof(*ledger));
	if (ledger == NULL || gs_ledger_init(ledger, 1) != 0)
		return 1;
	gs_ledger_set_limit(ledger, 0, LIMIT);
	for (int i = 0; i < threads + 2; i++) {
		ledger->slot[i].state = GS_SLOT_USED;
		ledger->slot[i].task_index = -1;
		snprintf(ledger->slot[i].task_id, sizeof(ledger->slot[i].task_id), "t%d", i);
		ledger->slot_taken[i / 64] |= 1ULL << (i % 64);
	}
	for (uint32_t i = 0; i < 2; i++)
		if (gs_ledger_charge(ledger, (uint32_t)threads + i, 0, CHUNK) != 0)
			return 1;
	pthread_create(&r, NULL, reader, max);
	for (int i = 0; i < threads; i++)
		pthread_create(&w[i], NULL, writer, (void *)(uintptr_t)i);
	for (int i = 0; i < threads; i++)
		pthread_join(w[i], NULL);
	__atomic_store_n(&done, 1, __ATOMIC_RELEASE);
	pthread_join(r, NULL);
	printf("limit=%llu max_used=%llu max_summary=%llu max_peak=%llu refused=%lu granted=%lu "
	       "samples=%lu\n",
	       LIMIT, (unsigned long long)max[0], (unsigned long long)max[1],
	       (unsigned long long)max[2], refused, granted, samples);
	return 0;
}
