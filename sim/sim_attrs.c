/*
 * The simulated devices' attributes: what cuDeviceGetAttribute answers for
 * each CUdevice_attribute id of CUDA 13.0, and the per-device overrides of
 * GPUSHARE_SIM_GPUS (sim_spec.h).
 *
 * The defaults describe an H100 SXM5 (80 GB) as its driver reports it, so
 * that cudart, cuBLAS and PyTorch take their ordinary Hopper paths: they size
 * launches, shared memory and tiles from these numbers, and a zero where the
 * hardware has a limit makes them fail or divide by zero. Features the
 * simulated driver does not implement, or that need hardware beside the GPU
 * (NVSwitch fabric, GPUDirect RDMA, dma_buf, host NUMA memory), are reported
 * absent even where an H100 node may have them, so that no caller is led
 * into calls that cannot work here.
 */
#include "sim_attrs.h"

#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

struct sim_attr {
	const char *name; /* the override key, besides the id */
	int value;
};

/* Indexed by attribute id; id 0 is not an attribute. */
static const struct sim_attr sim_attr_table[SIM_ATTR_COUNT] = {
	[1] = { "max_threads_per_block", 1024 },
	[2] = { "max_block_dim_x", 1024 },
	[3] = { "max_block_dim_y", 1024 },
	[4] = { "max_block_dim_z", 64 },
	[5] = { "max_grid_dim_x", INT_MAX },
	[6] = { "max_grid_dim_y", 65535 },
	[7] = { "max_grid_dim_z", 65535 },
	[8] = { "max_shared_memory_per_block", 49152 },
	[9] = { "total_constant_memory", 65536 },
	[10] = { "warp_size", 32 },
	[11] = { "max_pitch", INT_MAX },
	[12] = { "max_registers_per_block", 65536 },
	[13] = { "clock_rate", 1980000 }, /* kHz */
	[14] = { "texture_alignment", 512 },
	[15] = { "gpu_overlap", 1 },
	[16] = { "multiprocessor_count", 132 },
	[17] = { "kernel_exec_timeout", 0 },
	[18] = { "integrated", 0 },
	[19] = { "can_map_host_memory", 1 },
	[20] = { "compute_mode", 0 }, /* default: shared */
	[21] = { "max_texture1d_width", 131072 },
	[22] = { "max_texture2d_width", 131072 },
	[23] = { "max_texture2d_height", 65536 },
	[24] = { "max_texture3d_width", 16384 },
	[25] = { "max_texture3d_height", 16384 },
	[26] = { "max_texture3d_depth", 16384 },
	[27] = { "max_texture2d_layered_width", 32768 },
	[28] = { "max_texture2d_layered_height", 32768 },
	[29] = { "max_texture2d_layered_layers", 2048 },
	[30] = { "surface_alignment", 512 },
	[31] = { "concurrent_kernels", 1 },
	[32] = { "ecc_enabled", 1 },
	[33] = { "pci_bus_id", 0 }, /* position + 1 */
	[34] = { "pci_device_id", 0 },
	[35] = { "tcc_driver", 0 },
	[36] = { "memory_clock_rate", 2619000 },    /* kHz */
	[37] = { "global_memory_bus_width", 5120 }, /* bits */
	[38] = { "l2_cache_size", 50331648 },
	[39] = { "max_threads_per_multiprocessor", 2048 },
	[40] = { "async_engine_count", 3 },
	[41] = { "unified_addressing", 1 },
	[42] = { "max_texture1d_layered_width", 32768 },
	[43] = { "max_texture1d_layered_layers", 2048 },
	[44] = { "can_tex2d_gather", 1 },
	[45] = { "max_texture2d_gather_width", 32768 },
	[46] = { "max_texture2d_gather_height", 32768 },
	[47] = { "max_texture3d_width_alt", 8192 },
	[48] = { "max_texture3d_height_alt", 8192 },
	[49] = { "max_texture3d_depth_alt", 32768 },
	[50] = { "pci_domain_id", 0 },
	[51] = { "texture_pitch_alignment", 32 },
	[52] = { "max_texturecubemap_width", 32768 },
	[53] = { "max_texturecubemap_layered_width", 32768 },
	[54] = { "max_texturecubemap_layered_layers", 2046 },
	[55] = { "max_surface1d_width", 32768 },
	[56] = { "max_surface2d_width", 131072 },
	[57] = { "max_surface2d_height", 65536 },
	[58] = { "max_surface3d_width", 16384 },
	[59] = { "max_surface3d_height", 16384 },
	[60] = { "max_surface3d_depth", 16384 },
	[61] = { "max_surface1d_layered_width", 32768 },
	[62] = { "max_surface1d_layered_layers", 2048 },
	[63] = { "max_surface2d_layered_width", 32768 },
	[64] = { "max_surface2d_layered_height", 32768 },
	[65] = { "max_surface2d_layered_layers", 2048 },
	[66] = { "max_surfacecubemap_width", 32768 },
	[67] = { "max_surfacecubemap_layered_width", 32768 },
	[68] = { "max_surfacecubemap_layered_layers", 2046 },
	[69] = { "max_texture1d_linear_width", 268435456 },
	[70] = { "max_texture2d_linear_width", 131072 },
	[71] = { "max_texture2d_linear_height", 65000 },
	[72] = { "max_texture2d_linear_pitch", 2097120 },
	[73] = { "max_texture2d_mipmapped_width", 32768 },
	[74] = { "max_texture2d_mipmapped_height", 32768 },
	[75] = { "compute_capability_major", 9 },
	[76] = { "compute_capability_minor", 0 },
	[77] = { "max_texture1d_mipmapped_width", 32768 },
	[78] = { "stream_priorities_supported", 1 },
	[79] = { "global_l1_cache_supported", 1 },
	[80] = { "local_l1_cache_supported", 1 },
	[81] = { "max_shared_memory_per_multiprocessor", 233472 },
	[82] = { "max_registers_per_multiprocessor", 65536 },
	[83] = { "managed_memory", 1 },
	[84] = { "multi_gpu_board", 0 },
	[85] = { "multi_gpu_board_group_id", 0 }, /* position */
	[86] = { "host_native_atomic_supported", 0 },
	[87] = { "single_to_double_precision_perf_ratio", 2 },
	/* A discrete GPU without HMM: pageable memory must be registered first. */
	[88] = { "pageable_memory_access", 0 },
	[89] = { "concurrent_managed_access", 1 },
	[90] = { "compute_preemption_supported", 1 },
	[91] = { "can_use_host_pointer_for_registered_mem", 1 },
	[92] = { "can_use_stream_mem_ops_v1", 1 },
	[93] = { "can_use_64_bit_stream_mem_ops_v1", 1 },
	[94] = { "can_use_stream_wait_value_nor_v1", 1 },
	[95] = { "cooperative_launch", 1 },
	[96] = { "cooperative_multi_device_launch", 1 },
	/* 227 KiB: what kernels may opt in to beyond the 48 KiB default. */
	[97] = { "max_shared_memory_per_block_optin", 232448 },
	[98] = { "can_flush_remote_writes", 0 },
	[99] = { "host_register_supported", 1 },
	[100] = { "pageable_memory_access_uses_host_page_tables", 0 },
	[101] = { "direct_managed_mem_access_from_host", 0 },
	/* cuMemCreate and cuMemMap are simulated: PyTorch's expandable segments use them. */
	[102] = { "virtual_memory_management_supported", 1 },
	[103] = { "handle_type_posix_fd_supported", 1 },
	[104] = { "handle_type_win32_supported", 0 },
	[105] = { "handle_type_win32_kmt_supported", 0 },
	[106] = { "max_blocks_per_multiprocessor", 32 },
	[107] = { "generic_compression_supported", 1 },
	[108] = { "max_persisting_l2_cache_size", 37748736 }, /* 3/4 of L2 */
	[109] = { "max_access_policy_window_size", 134213632 },
	[110] = { "gpu_direct_rdma_with_cuda_vmm_supported", 0 },
	[111] = { "reserved_shared_memory_per_block", 1024 },
	/* Sparse and deferred-mapping arrays need cuMemMapArrayAsync: not simulated. */
	[112] = { "sparse_cuda_array_supported", 0 },
	[113] = { "read_only_host_register_supported", 0 },
	[114] = { "timeline_semaphore_interop_supported", 0 },
	/* cuMemAllocAsync and the cuMemPool calls are simulated: cudaMallocAsync works. */
	[115] = { "memory_pools_supported", 1 },
	[116] = { "gpu_direct_rdma_supported", 0 },
	[117] = { "gpu_direct_rdma_flush_writes_options", 0 },
	[118] = { "gpu_direct_rdma_writes_ordering", 0 },
	[119] = { "mempool_supported_handle_types", 1 }, /* POSIX fd */
	[120] = { "cluster_launch", 1 },
	[121] = { "deferred_mapping_cuda_array_supported", 0 },
	[122] = { "can_use_64_bit_stream_mem_ops", 1 },
	[123] = { "can_use_stream_wait_value_nor", 1 },
	[124] = { "dma_buf_supported", 0 },
	[125] = { "ipc_event_supported", 1 },
	[126] = { "mem_sync_domain_count", 4 },
	[127] = { "tensor_map_access_supported", 1 },
	/* No NVSwitch fabric: NVML's fabric state says the same. */
	[128] = { "handle_type_fabric_supported", 0 },
	[129] = { "unified_function_pointers", 0 },
	[130] = { "numa_config", 0 }, /* not a NUMA node */
	[131] = { "numa_id", -1 },
	[132] = { "multicast_supported", 0 },
	[133] = { "mps_enabled", 0 },
	[134] = { "host_numa_id", -1 }, /* no NUMA host */
	[135] = { "d3d12_cig_supported", 0 },
	[136] = { "mem_decompress_algorithm_mask", 0 },
	[137] = { "mem_decompress_maximum_length", 0 },
	[138] = { "vulkan_cig_supported", 0 },
	/* The H100 SXM5's PCI ids (device 0x2330, NVIDIA 0x10de); NVML shows the same. */
	[139] = { "gpu_pci_device_id", 0x233010de },
	[140] = { "gpu_pci_subsystem_id", 0x16c110de },
	/* The simulated driver refuses host memory locations (cuMemCreate, pools). */
	[141] = { "host_numa_virtual_memory_management_supported", 0 },
	[142] = { "host_numa_memory_pools_supported", 0 },
	[143] = { "host_numa_multinode_ipc_supported", 0 },
	[144] = { "host_memory_pools_supported", 0 },
	[145] = { "host_virtual_memory_management_supported", 0 },
	[146] = { "host_alloc_dma_buf_supported", 0 },
	[147] = { "only_partial_host_native_atomic_supported", 0 },
};

void sim_attrs_default(struct sim_spec *spec)
{
	int id;

	spec->attrs[0] = 0;
	spec->context = 0;
	for (id = 1; id < SIM_ATTR_COUNT; id++)
		spec->attrs[id] = sim_attr_table[id].value;
	/* cuDeviceGetPCIBusId and NVML build the same bus id from the position. */
	spec->attrs[SIM_ATTR_PCI_BUS_ID] = spec->index + 1;
	/* Each simulated GPU is a board of its own. */
	spec->attrs[SIM_ATTR_MULTI_GPU_BOARD_GROUP_ID] = spec->index;
}

int sim_device_attribute(const struct sim_spec *spec, int attrib, int *value)
{
	if (attrib <= 0 || attrib >= SIM_ATTR_COUNT || !value)
		return -1;
	*value = spec->attrs[attrib];
	return 0;
}

/* Overrides. */

/* The attribute id key (len bytes) names, or -1. */
static int sim_attr_lookup(const char *key, size_t len)
{
	int id = 0;
	size_t i;

	if (len == 0)
		return -1;
	if (key[0] >= '0' && key[0] <= '9') {
		for (i = 0; i < len; i++) {
			if (key[i] < '0' || key[i] > '9' || id >= SIM_ATTR_COUNT)
				return -1;
			id = id * 10 + (key[i] - '0');
		}
		return id > 0 && id < SIM_ATTR_COUNT ? id : -1;
	}
	if (len == 3 && strncasecmp(key, "sms", 3) == 0)
		return SIM_ATTR_MULTIPROCESSOR_COUNT;
	for (id = 1; id < SIM_ATTR_COUNT; id++) {
		const char *name = sim_attr_table[id].name;

		if (strlen(name) == len && strncasecmp(name, key, len) == 0)
			return id;
	}
	return -1;
}

/*
 * A decimal int, or a hex one ("0x...") up to 32 bits, for ids written the
 * way NVIDIA prints them (gpu_pci_device_id=0x20b010de).
 */
static bool sim_parse_int(const char *s, size_t len, int *out)
{
	bool neg = false, hex;
	uint64_t v = 0, limit;
	size_t i = 0;

	if (len > 0 && (s[0] == '-' || s[0] == '+')) {
		neg = s[0] == '-';
		i++;
	}
	hex = !neg && len - i > 2 && s[i] == '0' && (s[i + 1] == 'x' || s[i + 1] == 'X');
	if (hex)
		i += 2;
	if (i == len)
		return false;
	limit = hex ? UINT32_MAX : neg ? (uint64_t)INT_MAX + 1 : INT_MAX;
	for (; i < len; i++) {
		int d = hex ? sim_hexval(s[i]) : s[i] >= '0' && s[i] <= '9' ? s[i] - '0' : -1;

		if (d < 0)
			return false;
		v = v * (hex ? 16 : 10) + (unsigned int)d;
		if (v > limit)
			return false;
	}
	if (hex)
		*out = (int)(uint32_t)v;
	else
		*out = neg ? (int)(-(int64_t)v) : (int)v;
	return true;
}

/* Plain decimal digits, nothing else, up to INT_MAX. */
static bool sim_parse_digits(const char *s, size_t len, int *out)
{
	int v = 0;
	size_t i;

	if (len == 0)
		return false;
	for (i = 0; i < len; i++) {
		if (s[i] < '0' || s[i] > '9' || v > (INT_MAX - (s[i] - '0')) / 10)
			return false;
		v = v * 10 + (s[i] - '0');
	}
	*out = v;
	return true;
}

/* "MAJOR.MINOR", as CUDA writes compute capabilities. */
static bool sim_parse_cc(const char *s, size_t len, int *major, int *minor)
{
	const char *dot = memchr(s, '.', len);

	return dot && sim_parse_digits(s, (size_t)(dot - s), major) &&
	       sim_parse_digits(dot + 1, (size_t)(s + len - dot - 1), minor);
}

/* One KEY=VALUE item; set[] records the ids already given. */
static bool sim_attrs_item(struct sim_spec *spec, bool *set, const char *item, size_t len,
			   char *why, size_t whylen)
{
	const char *eq = memchr(item, '=', len);
	const char *val;
	size_t klen, vlen;
	int id, major, minor, v;

	if (len == 0) {
		snprintf(why, whylen, "empty override (expected KEY=VALUE,KEY=VALUE)");
		return false;
	}
	if (!eq || eq == item) {
		snprintf(why, whylen, "bad override \"%.*s\": expected KEY=VALUE", (int)len, item);
		return false;
	}
	klen = (size_t)(eq - item);
	val = eq + 1;
	vlen = len - klen - 1;
	if (klen == 2 && strncasecmp(item, "cc", 2) == 0) {
		if (!sim_parse_cc(val, vlen, &major, &minor)) {
			snprintf(why, whylen,
				 "bad value \"%.*s\" for cc: expected MAJOR.MINOR, e.g. 8.0",
				 (int)vlen, val);
			return false;
		}
		if (set[SIM_ATTR_CC_MAJOR] || set[SIM_ATTR_CC_MINOR]) {
			snprintf(why, whylen, "the compute capability is set twice");
			return false;
		}
		set[SIM_ATTR_CC_MAJOR] = set[SIM_ATTR_CC_MINOR] = true;
		spec->attrs[SIM_ATTR_CC_MAJOR] = major;
		spec->attrs[SIM_ATTR_CC_MINOR] = minor;
		return true;
	}
	/* Not an attribute: set[0] (no attribute has id 0) says it was given. */
	if (klen == 7 && strncasecmp(item, "context", 7) == 0) {
		if (!sim_parse_bytes(&spec->context, val, vlen)) {
			snprintf(why, whylen,
				 "bad value \"%.*s\" for context: expected a byte count", (int)vlen,
				 val);
			return false;
		}
		if (set[0]) {
			snprintf(why, whylen, "the context size is set twice");
			return false;
		}
		set[0] = true;
		return true;
	}
	id = sim_attr_lookup(item, klen);
	if (id < 0) {
		snprintf(why, whylen,
			 "unknown attribute \"%.*s\" (an id from 1 to %d, a name such as "
			 "multiprocessor_count, or cc, sms or context)",
			 (int)klen, item, SIM_ATTR_COUNT - 1);
		return false;
	}
	/* Both libraries derive the PCI address from the position: it cannot move. */
	if (id == SIM_ATTR_PCI_BUS_ID || id == SIM_ATTR_PCI_DEVICE_ID ||
	    id == SIM_ATTR_PCI_DOMAIN_ID) {
		snprintf(why, whylen,
			 "attribute %s (%d) follows the device's position in the list and cannot "
			 "be set",
			 sim_attr_table[id].name, id);
		return false;
	}
	if (!sim_parse_int(val, vlen, &v)) {
		snprintf(why, whylen, "bad value \"%.*s\" for %s (%d): expected an integer",
			 (int)vlen, val, sim_attr_table[id].name, id);
		return false;
	}
	if (set[id]) {
		snprintf(why, whylen, "attribute %s (%d) is set twice", sim_attr_table[id].name,
			 id);
		return false;
	}
	set[id] = true;
	spec->attrs[id] = v;
	return true;
}

bool sim_attrs_override(struct sim_spec *spec, const char *list, size_t len, char *why,
			size_t whylen)
{
	bool set[SIM_ATTR_COUNT] = { false };
	const char *end = list + len;
	const char *p = list;

	if (len == 0)
		return true;
	for (;;) {
		const char *comma = memchr(p, ',', (size_t)(end - p));
		const char *stop = comma ? comma : end;

		if (!sim_attrs_item(spec, set, p, (size_t)(stop - p), why, whylen))
			return false;
		if (!comma)
			return true;
		p = comma + 1;
	}
}
