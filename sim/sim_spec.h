/*
 * The simulated node's device list, shared by the simulated driver
 * (libcuda.so.1) and the simulated NVML (libnvidia-ml.so.1) so that both
 * libraries describe the same GPUs: GPUSHARE_SIM_GPUS = "NAME|UUID|BYTES;..."
 * or, when it is unset or empty, the default node the daemon also generates.
 *
 * Compiled into each library with hidden visibility: nothing here is part of
 * either library's ABI.
 */
#ifndef GPUSHARE_SIM_SPEC_H
#define GPUSHARE_SIM_SPEC_H

#include <stdbool.h>
#include <stddef.h>

#define SIM_MAX_GPUS	64
#define SIM_NAME_MAX	256	/* the driver's device name buffer */
#define SIM_UUID_LEN	40	/* "GPU-" + 8-4-4-4-12 hex digits */
#define SIM_SPEC_ENV	"GPUSHARE_SIM_GPUS"

struct sim_spec {
	char name[SIM_NAME_MAX];
	char uuid[SIM_UUID_LEN + 1];	/* lowercased */
	unsigned char uuid_bytes[16];
	size_t bytes;
};

/*
 * Fills specs (room for SIM_MAX_GPUS) from the environment. Returns the
 * number of devices, always at least one, or -1 after telling stderr which
 * entry is bad.
 */
int sim_specs_load(struct sim_spec *specs);

/* The value of one hex digit, or -1. */
int sim_hexval(char c);

#endif
