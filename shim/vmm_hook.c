/*
 * The shim's wrappers of virtual memory management (PyTorch's expandable
 * segments, NCCL): cuMemCreate and cuMemRelease, which charge and uncharge
 * the physical memory, and the mappings that keep a released handle's
 * memory alive (cuMemMap, cuMemUnmap, cuMemRetainAllocationHandle).
 */
#include "accounting.h"

/*
 * Virtual memory management (PyTorch's expandable segments, NCCL): the
 * physical memory is cuMemCreate's, charged on the device it names until
 * cuMemRelease. Host locations take no device memory and are not charged.
 */
GS_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
			       const CUmemAllocationProp *prop, unsigned long long flags)
{
	struct gs_charge c;
	CUresult rc;
	int gpu;

	gs_fn_cuMemCreate fn = TRACED_FN(cuMemCreate);
	if (unlikely(fn == NULL))
		return CUDA_ERROR_NOT_FOUND;
	if (gs_state.mode == GS_INERT)
		return fn(handle, size, prop, flags);
	if (handle == NULL || prop == NULL || size == 0 ||
	    prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
		return fn(handle, size, prop, flags);
	if (gs_state.mode == GS_BROKEN)
		return CUDA_ERROR_NOT_PERMITTED;
	gpu = ledger_gpu(prop->location.id);
	/*
	 * A device the driver cannot name (a bad ordinal, before cuInit) is the
	 * driver's to answer: a made-up CUDA_ERROR_OUT_OF_MEMORY would read as a
	 * full GPU, which PyTorch's expandable segments take for one to retry.
	 */
	if (gpu == GS_DEV_UNRESOLVED)
		return fn(handle, size, prop, flags);
	rc = charge_new(gpu, footprint(size), &c);
	if (rc != CUDA_SUCCESS)
		return rc;
	rc = fn(handle, size, prop, flags);
	return settle(rc, *handle, GS_K_HANDLE, &c, undo_handle);
}

/*
 * The driver frees cuMemCreate memory when the last reference (cuMemCreate's
 * and each cuMemRetainAllocationHandle's) is released AND the last mapping
 * unmapped, in either order: releasing right after mapping is common. The
 * charge follows the memory, not the handle.
 */
GS_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
	struct gs_alloc gone;
	CUresult rc;
	int r;

	gs_fn_cuMemRelease fn = TRACED_FN(cuMemRelease);
	if (unlikely(fn == NULL))
		return CUDA_ERROR_NOT_FOUND;
	if (gs_state.mode != GS_ENFORCE)
		return fn(handle);
	/* Before the driver call: once freed, the handle value may be handed out again. */
	r = gs_map_handle_adjust(handle, -1, 0, &gone);
	if (r < 0 || r == 2)
		return fn(handle);
	rc = fn(handle);
	if (rc != CUDA_SUCCESS) {
		if (r == 1) {
			gone.refs = 1;
			alloc_put(gone);
		} else {
			gs_map_handle_adjust(handle, 1, 0, &gone);
		}
		return rc;
	}
	if (r == 1)
		uncharge_record(&gone);
	return rc;
}

/* A mapping's handle: its charge is gone with the handle's last reference and mapping. */
static void drop_mapping(uint64_t handle)
{
	struct gs_alloc gone;

	if (gs_map_handle_adjust(handle, 0, -1, &gone) == 1)
		uncharge_record(&gone);
}

GS_EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr)
{
	struct gs_alloc map, gone;
	int early = 0;
	CUresult rc;

	gs_fn_cuMemRetainAllocationHandle fn = TRACED_FN(cuMemRetainAllocationHandle);
	if (unlikely(fn == NULL))
		return CUDA_ERROR_NOT_FOUND;
	if (gs_state.mode != GS_ENFORCE || handle == NULL)
		return fn(handle, addr);
	/*
	 * At a mapping's start the handle is known beforehand: the reference is
	 * counted before the driver call, so a release racing with it can never
	 * free the record of memory this retain keeps alive.
	 */
	if (gs_map_peek((uint64_t)(uintptr_t)addr, GS_K_MAP, &map) == 0)
		early = gs_map_handle_adjust(map.owner, 1, 0, &gone) == 0;
	rc = fn(handle, addr);
	if (early && (rc != CUDA_SUCCESS || *handle != map.owner)) {
		if (gs_map_handle_adjust(map.owner, -1, 0, &gone) == 1)
			uncharge_record(&gone);
		early = 0;
	}
	if (rc == CUDA_SUCCESS && !early)
		gs_map_handle_adjust(*handle, 1, 0, &gone);
	return rc;
}

GS_EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
			    CUmemGenericAllocationHandle handle, unsigned long long flags)
{
	struct gs_alloc stale, gone;
	CUresult rc;
	int ours;

	gs_fn_cuMemMap fn = TRACED_FN(cuMemMap);
	if (unlikely(fn == NULL))
		return CUDA_ERROR_NOT_FOUND;
	if (gs_state.mode != GS_ENFORCE)
		return fn(ptr, size, offset, handle, flags);
	/* Counted before the call, so a racing last release cannot free the record. */
	ours = gs_map_handle_adjust(handle, 0, 1, &gone) == 0;
	rc = fn(ptr, size, offset, handle, flags);
	if (rc != CUDA_SUCCESS) {
		if (ours)
			drop_mapping(handle);
		return rc;
	}
	/* A record still at this address is a mapping that went without us: settle it. */
	if (gs_map_take(ptr, GS_K_MAP, &stale) == 0)
		drop_mapping(stale.owner);
	/*
	 * Every mapping is recorded, of handles not ours too, so an unmap can walk
	 * its range. One that cannot be recorded keeps its memory charged: never
	 * too little.
	 */
	alloc_put((struct gs_alloc){ .key = ptr,
				     .kind = GS_K_MAP,
				     .gpu = GS_DEV_FOREIGN,
				     .size = size,
				     .owner = handle });
	return rc;
}

/*
 * The mappings [ptr, ptr + size) covers, in order, taken out of the table
 * into a buffer; the walk stops at an address with no record (a mapping
 * made before the shim was there).
 */
static struct gs_alloc *take_mappings(CUdeviceptr ptr, size_t size, size_t *n)
{
	struct gs_alloc *m = NULL, *grown;
	size_t cap = 0;

	*n = 0;
	for (CUdeviceptr cur = ptr; cur - ptr < size;) {
		if (*n == cap) {
			cap = cap ? cap * 2 : 4;
			grown = realloc(m, cap * sizeof(*m));
			if (grown == NULL)
				break; /* the rest stay recorded and charged: never too little */
			m = grown;
		}
		if (gs_map_take(cur, GS_K_MAP, &m[*n]) != 0 || m[*n].size == 0)
			break;
		cur += m[(*n)++].size;
	}
	return m;
}

/* What an unmap did to one mapping's handle, to be undone or settled after the driver call. */
struct gs_unmapped {
	struct gs_alloc gone; /* the handle's record, if this was its last hold */
	int state;	      /* 0: not ours; 1: mapping count dropped; 2: record taken out */
};

GS_EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
	struct gs_unmapped *u;
	struct gs_alloc *m, ignored;
	CUresult rc;
	size_t n;

	gs_fn_cuMemUnmap fn = TRACED_FN(cuMemUnmap);
	if (unlikely(fn == NULL))
		return CUDA_ERROR_NOT_FOUND;
	if (gs_state.mode != GS_ENFORCE)
		return fn(ptr, size);
	/*
	 * Out before the driver call: once unmapped, the range may be mapped
	 * again, and a freed handle handed out again, by other threads.
	 */
	m = take_mappings(ptr, size, &n);
	u = n ? calloc(n, sizeof(*u)) : NULL;
	if (n != 0 && u == NULL) {
		/* Nothing to keep the undo in: the mappings stay charged, never too little. */
		for (size_t i = 0; i < n; i++)
			alloc_put(m[i]);
		free(m);
		return fn(ptr, size);
	}
	for (size_t i = 0; i < n; i++) {
		int r = gs_map_handle_adjust(m[i].owner, 0, -1, &u[i].gone);

		u[i].state = r == 1 ? 2 : r == 0 ? 1 : 0;
	}
	rc = fn(ptr, size);
	/* Undone last first: a handle mapped twice in the range had its record put back last. */
	for (size_t k = n; k-- > 0;) {
		size_t i = k;

		if (rc == CUDA_SUCCESS) {
			if (u[i].state == 2)
				uncharge_record(&u[i].gone);
			continue;
		}
		alloc_put(m[i]);
		if (u[i].state == 2) {
			u[i].gone.maps = 1;
			alloc_put(u[i].gone);
		} else if (u[i].state == 1) {
			gs_map_handle_adjust(m[i].owner, 0, 1, &ignored);
		}
	}
	free(u);
	free(m);
	return rc;
}
