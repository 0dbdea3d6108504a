/*
 * The simulated node's device list, shared by the simulated driver
 * (libcuda.so.1) and the simulated NVML (libnvidia-ml.so.1) so that both
 * libraries describe the same GPUs: GPUSHARE_SIM_GPUS = "ENTRY;ENTRY;..."
 * or, when it is unset or empty, the default node the daemon also generates.
 *
 * An entry is NAME|UUID|BYTES, or NAME|UUID|BYTES|OVERRIDES where OVERRIDES
 * is a comma-separated list of KEY=VALUE device attributes that differ from
 * the default (sim_attrs.c): KEY is an attribute's number (CUdevice_attribute)
 * or name, e.g. "cc=8.0,sms=108,l2_cache_size=41943040", or "context", the
 * bytes each process's context takes from the device (0 by default).
 *
 * Compiled into each library with hidden visibility: nothing here is part of
 * either library's ABI.
 */
#ifndef GPUSHARE_SIM_SPEC_H
#define GPUSHARE_SIM_SPEC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define SIM_MAX_GPUS 64
#define SIM_NAME_MAX 256 /* the driver's device name buffer */
#define SIM_UUID_LEN 40	 /* "GPU-" + 8-4-4-4-12 hex digits */
#define SIM_SPEC_ENV "GPUSHARE_SIM_GPUS"

/*
 * CU_DEVICE_ATTRIBUTE_MAX of CUDA 13.0, the version the simulated driver
 * reports: attribute ids run from 1 to SIM_ATTR_COUNT - 1.
 */
#define SIM_ATTR_COUNT 148

struct sim_spec {
	char name[SIM_NAME_MAX];
	char uuid[SIM_UUID_LEN + 1]; /* lowercased */
	unsigned char uuid_bytes[16];
	size_t bytes;
	int index;		   /* position in the list: PCI bus index + 1 */
	int attrs[SIM_ATTR_COUNT]; /* cuDeviceGetAttribute's answers, by id */
	size_t context;		   /* bytes a process's context takes ("context" key; 0) */
};

/*
 * Fills specs (room for SIM_MAX_GPUS) from the environment. Returns the
 * number of devices, always at least one, or -1 after telling stderr which
 * entry is bad.
 */
int sim_specs_load(struct sim_spec *specs);

/* A decimal byte count of len bytes at str into *out; false if it is not one. */
bool sim_parse_bytes(size_t *out, const char *str, size_t len);

/*
 * The node the last successful sim_specs_load described, as a hash of its
 * devices' names, UUIDs and sizes (not their attributes): processes given
 * the same GPUs share a node, whichever way the list was spelt. 0 before a
 * load.
 */
uint64_t sim_node_id(void);

/*
 * cuDeviceGetAttribute's answer for spec: 0 with *value set, or -1 for an
 * attribute id CUDA 13.0 does not define (0, negative or >= SIM_ATTR_COUNT).
 */
int sim_device_attribute(const struct sim_spec *spec, int attrib, int *value);

/* The value of one hex digit, or -1. */
int sim_hexval(char c);

#endif
