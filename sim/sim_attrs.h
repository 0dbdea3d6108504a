/*
 * The simulated devices' attributes (sim_attrs.c): their defaults and the
 * per-device overrides of GPUSHARE_SIM_GPUS. Used by sim_spec.c while it
 * reads the list; the drivers ask sim_device_attribute (sim_spec.h).
 */
#ifndef GPUSHARE_SIM_ATTRS_H
#define GPUSHARE_SIM_ATTRS_H

#include <stdbool.h>
#include <stddef.h>

#include "sim_spec.h"

/* The attribute ids the simulation itself looks at (CUdevice_attribute). */
enum {
	SIM_ATTR_MAX_GRID_DIM_X = 5,
	SIM_ATTR_MAX_GRID_DIM_Y = 6,
	SIM_ATTR_MAX_GRID_DIM_Z = 7,
	SIM_ATTR_CLOCK_RATE = 13, /* kHz */
	SIM_ATTR_MULTIPROCESSOR_COUNT = 16,
	SIM_ATTR_PCI_BUS_ID = 33,
	SIM_ATTR_PCI_DEVICE_ID = 34,
	SIM_ATTR_MEMORY_CLOCK_RATE = 36,       /* kHz */
	SIM_ATTR_GLOBAL_MEMORY_BUS_WIDTH = 37, /* bits */
	SIM_ATTR_PCI_DOMAIN_ID = 50,
	SIM_ATTR_CC_MAJOR = 75,
	SIM_ATTR_CC_MINOR = 76,
	SIM_ATTR_MULTI_GPU_BOARD_GROUP_ID = 85,
	SIM_ATTR_GPU_PCI_DEVICE_ID = 139, /* device id << 16 | vendor id */
	SIM_ATTR_GPU_PCI_SUBSYSTEM_ID = 140,
};

/* Fills spec->attrs with the defaults of a device at position spec->index. */
void sim_attrs_default(struct sim_spec *spec);

/*
 * Applies the len bytes at list ("KEY=VALUE,KEY=VALUE") to spec->attrs.
 * false, with the reason in why (room for whylen bytes), on the first bad
 * item; an empty list changes nothing.
 */
bool sim_attrs_override(struct sim_spec *spec, const char *list, size_t len, char *why,
			size_t whylen);

#endif
