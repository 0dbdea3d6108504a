/* The simulated device list: see sim_spec.h. */
#include "sim_spec.h"

#include <ctype.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sim_attrs.h"

/* The daemon generates the same default node: keep the two in step. */
#define SIM_DEFAULT_GPUS 4
#define SIM_DEFAULT_NAME "gpushare Simulated GPU"
#define SIM_DEFAULT_BYTES 17179869184ULL
#define SIM_DEFAULT_UUID "GPU-5349d000-0000-4000-8000-%012x"

int sim_hexval(char c)
{
	if (c >= '0' && c <= '9')
		return c - '0';
	c = (char)tolower((unsigned char)c);
	return c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

static bool sim_parse_uuid(struct sim_spec *s, const char *str, size_t len)
{
	size_t i, n = 0;

	if (len != SIM_UUID_LEN || strncmp(str, "GPU-", 4) != 0)
		return false;
	memcpy(s->uuid, "GPU-", 4);
	for (i = 4; i < len; i++) {
		bool dash = i == 12 || i == 17 || i == 22 || i == 27;
		int v = sim_hexval(str[i]);

		if (dash ? str[i] != '-' : v < 0)
			return false;
		s->uuid[i] = (char)tolower((unsigned char)str[i]);
		if (dash)
			continue;
		if (n % 2 == 0)
			s->uuid_bytes[n / 2] = (unsigned char)(v << 4);
		else
			s->uuid_bytes[n / 2] |= (unsigned char)v;
		n++;
	}
	s->uuid[len] = '\0';
	return true;
}

bool sim_parse_bytes(size_t *out, const char *str, size_t len)
{
	uint64_t v = 0;
	size_t i;

	for (i = 0; i < len; i++) {
		unsigned int digit = (unsigned char)str[i] - '0';

		if (digit > 9 || v > (UINT64_MAX - digit) / 10)
			return false;
		v = v * 10 + digit;
	}
	if (len == 0 || v > SIZE_MAX)
		return false;
	*out = (size_t)v;
	return true;
}

/* Whether entry n is good; if not, why it is not goes into why. */
static bool sim_parse_entry(struct sim_spec *specs, int n, const char *e, size_t len, char *why,
			    size_t whylen)
{
	struct sim_spec *s = &specs[n];
	const char *end = e + len;
	const char *bar1 = memchr(e, '|', len);
	const char *bar2 = bar1 ? memchr(bar1 + 1, '|', (size_t)(end - bar1 - 1)) : NULL;
	const char *bar3 = bar2 ? memchr(bar2 + 1, '|', (size_t)(end - bar2 - 1)) : NULL;
	const char *why_not = NULL;
	int i;

	s->index = n;
	sim_attrs_default(s);
	if (!bar2 || (bar3 && memchr(bar3 + 1, '|', (size_t)(end - bar3 - 1))))
		why_not = "expected NAME|UUID|BYTES or NAME|UUID|BYTES|KEY=VALUE,...";
	else if (bar1 == e || bar1 - e >= SIM_NAME_MAX)
		why_not = "name empty or too long";
	if (why_not)
		goto fail;
	memcpy(s->name, e, (size_t)(bar1 - e));
	s->name[bar1 - e] = '\0';
	if (!sim_parse_uuid(s, bar1 + 1, (size_t)(bar2 - bar1 - 1)))
		why_not = "bad UUID";
	else if (!sim_parse_bytes(&s->bytes, bar2 + 1, (size_t)((bar3 ? bar3 : end) - bar2 - 1)))
		why_not = "bad byte count";
	if (why_not)
		goto fail;
	/* Devices are picked by UUID prefix (CUDA_VISIBLE_DEVICES): keep them unique. */
	for (i = 0; i < n; i++) {
		if (strcmp(specs[i].uuid, s->uuid) == 0) {
			why_not = "duplicate UUID";
			goto fail;
		}
	}
	return !bar3 || sim_attrs_override(s, bar3 + 1, (size_t)(end - bar3 - 1), why, whylen);
fail:
	snprintf(why, whylen, "%s", why_not);
	return false;
}

/* FNV-1a over one field and its terminating NUL, so fields cannot run together. */
static uint64_t sim_hash(uint64_t h, const void *data, size_t len)
{
	const unsigned char *p = data;
	size_t i;

	for (i = 0; i <= len; i++) {
		h ^= i < len ? p[i] : 0;
		h *= 0x100000001b3ULL;
	}
	return h;
}

static uint64_t sim_node;

/* What makes two lists the same node: names, UUIDs and sizes, in order. */
static void sim_set_node(const struct sim_spec *specs, int n)
{
	uint64_t h = 0xcbf29ce484222325ULL;
	char bytes[24];
	int i;

	for (i = 0; i < n; i++) {
		h = sim_hash(h, specs[i].name, strlen(specs[i].name));
		h = sim_hash(h, specs[i].uuid, strlen(specs[i].uuid));
		snprintf(bytes, sizeof(bytes), "%zu", specs[i].bytes);
		h = sim_hash(h, bytes, strlen(bytes));
	}
	/* 0 means "no node yet" to sim_node_id's callers. */
	__atomic_store_n(&sim_node, h ? h : 1, __ATOMIC_RELEASE);
}

uint64_t sim_node_id(void)
{
	return __atomic_load_n(&sim_node, __ATOMIC_ACQUIRE);
}

int sim_specs_load(struct sim_spec *specs)
{
	const char *env = getenv(SIM_SPEC_ENV);
	const char *p, *semi;
	char uuid[SIM_UUID_LEN + 1];
	char why[256];
	int n;

	if (!env || !*env) {
		for (n = 0; n < SIM_DEFAULT_GPUS; n++) {
			struct sim_spec *s = &specs[n];

			snprintf(s->name, sizeof(s->name), "%s", SIM_DEFAULT_NAME);
			snprintf(uuid, sizeof(uuid), SIM_DEFAULT_UUID, (unsigned int)n);
			sim_parse_uuid(s, uuid, strlen(uuid));
			s->bytes = (size_t)SIM_DEFAULT_BYTES;
			s->index = n;
			sim_attrs_default(s);
		}
		sim_set_node(specs, n);
		return n;
	}
	for (n = 0, p = env;; p = semi + 1) {
		size_t len;
		bool good;

		semi = strchr(p, ';');
		len = semi ? (size_t)(semi - p) : strlen(p);
		if (n == SIM_MAX_GPUS) {
			snprintf(why, sizeof(why), "more than %d entries", SIM_MAX_GPUS);
			good = false;
		} else {
			good = sim_parse_entry(specs, n, p, len, why, sizeof(why));
		}
		if (!good) {
			fprintf(stderr, "gpushare sim: %s: bad entry \"%.*s\": %s\n", SIM_SPEC_ENV,
				(int)len, p, why);
			return -1;
		}
		n++;
		if (!semi) {
			sim_set_node(specs, n);
			return n;
		}
	}
}
