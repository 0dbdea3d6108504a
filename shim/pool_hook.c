/*
 * The shim's wrappers of stream-ordered memory: cuMemAllocAsync and its
 * kin, the pools they take from (made, fetched, set, trimmed, destroyed),
 * the synchronisations where a pool may give memory back, stream capture,
 * and graph memory (allocation nodes, uploads, trims). The policy is
 * pools.c's and graph_mem.c's; the launch wrappers, graph launches among
 * them, are cuda_hook.c's.
 */
#include "graph_mem.h"

/*
 * Before the driver call of a stream-ordered allocation from `pool` (NULL:
 * the stream's device's current pool): an error to answer, or op->how and
 * its charge. The mode decides as for every allocation (cuMemAlloc_v2). An
 * allocation on a capturing stream is a graph's node, charged when a launch
 * maps it (graph_mem.c); `cap` is the stream as the driver names it to
 * cuStreamIsCapturing.
 */
static CUresult stream_alloc_begin(struct gs_pool_alloc *op, const CUdeviceptr *dptr, size_t bytes,
				   CUmemoryPool pool, CUstream stream, CUstream cap)
{
	op->how = GS_PASS;
	if (gs_state.mode == GS_INERT)
		return CUDA_SUCCESS;
	if (gs_state.mode == GS_BROKEN)
		return CUDA_ERROR_NOT_PERMITTED;
	if (dptr == NULL || bytes == 0)
		return CUDA_SUCCESS;
	if (stream_captures(cap)) {
		op->how = GS_NODE;
		return CUDA_SUCCESS;
	}
	return pool_alloc_begin(op, bytes, pool, stream);
}

/* After the driver's answer to an allocation stream_alloc_begin() charged. */
static CUresult stream_alloc_end(const struct gs_pool_alloc *op, CUresult rc,
				 const CUdeviceptr *dptr)
{
	if (op->how == GS_NODE)
		return graph_node_made(rc);
	return pool_alloc_end(op, rc, dptr);
}

/* The per-thread flavours' NULL stream is the per-thread default stream, which may capture. */
#define PTSZ_STREAM(stream) ((stream) == NULL ? GS_STREAM_PER_THREAD : (stream))

#define ASYNC_WRAPPER(abi, params, pool, cap, args)                                \
	GS_EXPORT CUresult abi params                                              \
	{                                                                          \
		struct gs_pool_alloc op;                                           \
		CUresult rc;                                                       \
		gs_fn_##abi fn = TRACED_FN(abi);                                   \
		if (unlikely(fn == NULL))                                          \
			return CUDA_ERROR_NOT_FOUND;                               \
		rc = stream_alloc_begin(&op, dptr, bytesize, (pool), stream, cap); \
		if (rc != CUDA_SUCCESS)                                            \
			return rc;                                                 \
		if (op.how == GS_PASS)                                             \
			return fn args;                                            \
		return stream_alloc_end(&op, fn args, dptr);                       \
	}

ASYNC_WRAPPER(cuMemAllocAsync, (CUdeviceptr *dptr, size_t bytesize, CUstream stream), NULL,
	      stream, (dptr, bytesize, stream))
ASYNC_WRAPPER(cuMemAllocAsync_ptsz, (CUdeviceptr *dptr, size_t bytesize, CUstream stream), NULL,
	      PTSZ_STREAM(stream), (dptr, bytesize, stream))
ASYNC_WRAPPER(cuMemAllocFromPoolAsync,
	      (CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream stream), pool,
	      stream, (dptr, bytesize, pool, stream))
ASYNC_WRAPPER(cuMemAllocFromPoolAsync_ptsz,
	      (CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream stream), pool,
	      PTSZ_STREAM(stream), (dptr, bytesize, pool, stream))

GS_EXPORT CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props)
{
	gs_fn_cuMemPoolCreate fn = TRACED_FN(cuMemPoolCreate);
	CUresult rc = fn != NULL ? fn(pool, props) : CUDA_ERROR_NOT_FOUND;

	if (rc == CUDA_SUCCESS && gs_state.mode == GS_ENFORCE)
		pool_note(*pool, pool_gpu(&props->location, props->allocType));
	return rc;
}

/* A device's default or current pool is its pool of device memory. */
#define DEVICE_POOL_WRAPPER(abi)                                                 \
	GS_EXPORT CUresult abi(CUmemoryPool *pool, CUdevice dev)                 \
	{                                                                        \
		gs_fn_##abi fn = TRACED_FN(abi);                                 \
		CUresult rc = fn != NULL ? fn(pool, dev) : CUDA_ERROR_NOT_FOUND; \
		if (rc == CUDA_SUCCESS && gs_state.mode == GS_ENFORCE)           \
			pool_note(*pool, ledger_gpu(dev));                       \
		return rc;                                                       \
	}

DEVICE_POOL_WRAPPER(cuDeviceGetDefaultMemPool)
DEVICE_POOL_WRAPPER(cuDeviceGetMemPool)

/* CUDA 13's way to the same pools: by location and allocation type. */
#define LOCATION_POOL_WRAPPER(abi)                                                          \
	GS_EXPORT CUresult abi(CUmemoryPool *pool, CUmemLocation *location, int type)       \
	{                                                                                   \
		gs_fn_##abi fn = TRACED_FN(abi);                                            \
		CUresult rc = fn != NULL ? fn(pool, location, type) : CUDA_ERROR_NOT_FOUND; \
		if (rc == CUDA_SUCCESS && gs_state.mode == GS_ENFORCE)                      \
			pool_note(*pool, pool_gpu(location, type));                         \
		return rc;                                                                  \
	}

LOCATION_POOL_WRAPPER(cuMemGetDefaultMemPool)
LOCATION_POOL_WRAPPER(cuMemGetMemPool)

GS_EXPORT CUresult cuDeviceSetMemPool(CUdevice dev, CUmemoryPool pool)
{
	gs_fn_cuDeviceSetMemPool fn = TRACED_FN(cuDeviceSetMemPool);
	CUresult rc = fn != NULL ? fn(dev, pool) : CUDA_ERROR_NOT_FOUND;

	if (rc == CUDA_SUCCESS && gs_state.mode == GS_ENFORCE)
		set_current_pool(pool, ledger_gpu(dev));
	return rc;
}

GS_EXPORT CUresult cuMemSetMemPool(CUmemLocation *location, int type, CUmemoryPool pool)
{
	gs_fn_cuMemSetMemPool fn = TRACED_FN(cuMemSetMemPool);
	CUresult rc = fn != NULL ? fn(location, type, pool) : CUDA_ERROR_NOT_FOUND;

	if (rc == CUDA_SUCCESS && gs_state.mode == GS_ENFORCE && pool_gpu(location, type) >= 0)
		set_current_pool(pool, ledger_gpu(location->id));
	return rc;
}

GS_EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t keep)
{
	gs_fn_cuMemPoolTrimTo fn = TRACED_FN(cuMemPoolTrimTo);
	CUresult rc = fn != NULL ? fn(pool, keep) : CUDA_ERROR_NOT_FOUND;

	if (rc == CUDA_SUCCESS && gs_state.mode == GS_ENFORCE)
		pool_trimmed(pool);
	return rc;
}

GS_EXPORT CUresult cuMemPoolSetAttribute(CUmemoryPool pool, int attr, void *value)
{
	gs_fn_cuMemPoolSetAttribute fn = TRACED_FN(cuMemPoolSetAttribute);
	CUresult rc = fn != NULL ? fn(pool, attr, value) : CUDA_ERROR_NOT_FOUND;

	if (rc == CUDA_SUCCESS && gs_state.mode == GS_ENFORCE && attr == GS_POOL_RELEASE_THRESHOLD)
		pool_threshold_set(pool, *(const cuuint64_t *)value);
	return rc;
}

/*
 * The driver gives a destroyed pool's idle memory back at once and the rest
 * as its allocations are freed (pool_give); a device whose current pool it
 * was takes from its default pool again.
 */
GS_EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool)
{
	gs_fn_cuMemPoolDestroy fn = TRACED_FN(cuMemPoolDestroy);
	CUresult rc = fn != NULL ? fn(pool) : CUDA_ERROR_NOT_FOUND;

	if (rc == CUDA_SUCCESS && gs_state.mode == GS_ENFORCE)
		pool_destroyed(pool);
	return rc;
}

/* A synchronisation: where a pool above its release threshold gives memory back. */
#define SYNC_WRAPPER(abi, params, args)                                    \
	GS_EXPORT CUresult abi params                                      \
	{                                                                  \
		gs_fn_##abi fn = TRACED_FN(abi);                           \
		CUresult rc = fn != NULL ? fn args : CUDA_ERROR_NOT_FOUND; \
		if (rc == CUDA_SUCCESS && gs_state.mode == GS_ENFORCE)     \
			pools_after_sync();                                \
		return rc;                                                 \
	}

SYNC_WRAPPER(cuCtxSynchronize, (void), ())
SYNC_WRAPPER(cuCtxSynchronize_v2, (CUcontext ctx), (ctx))
SYNC_WRAPPER(cuStreamSynchronize, (CUstream stream), (stream))
SYNC_WRAPPER(cuStreamSynchronize_ptsz, (CUstream stream), (stream))
SYNC_WRAPPER(cuEventSynchronize, (CUevent event), (event))

#define BEGIN_CAPTURE_WRAPPER(abi, params, args)                  \
	GS_EXPORT CUresult abi params                             \
	{                                                         \
		gs_fn_##abi fn = TRACED_FN(abi);                  \
		CUresult rc;                                      \
		capture_starting();                               \
		rc = fn != NULL ? fn args : CUDA_ERROR_NOT_FOUND; \
		capture_begun(rc);                                \
		return rc;                                        \
	}

BEGIN_CAPTURE_WRAPPER(cuStreamBeginCapture, (CUstream stream), (stream))
BEGIN_CAPTURE_WRAPPER(cuStreamBeginCapture_ptsz, (CUstream stream), (stream))
BEGIN_CAPTURE_WRAPPER(cuStreamBeginCapture_v2, (CUstream stream, int mode), (stream, mode))
BEGIN_CAPTURE_WRAPPER(cuStreamBeginCapture_v2_ptsz, (CUstream stream, int mode), (stream, mode))
BEGIN_CAPTURE_WRAPPER(cuStreamBeginCaptureToGraph,
		      (CUstream stream, void *graph, const void *deps, const void *edges,
		       size_t ndeps, int mode),
		      (stream, graph, deps, edges, ndeps, mode))
BEGIN_CAPTURE_WRAPPER(cuStreamBeginCaptureToGraph_ptsz,
		      (CUstream stream, void *graph, const void *deps, const void *edges,
		       size_t ndeps, int mode),
		      (stream, graph, deps, edges, ndeps, mode))

#define END_CAPTURE_WRAPPER(abi)                                                     \
	GS_EXPORT CUresult abi(CUstream stream, void **graph)                        \
	{                                                                            \
		gs_fn_##abi fn = TRACED_FN(abi);                                     \
		CUresult rc = fn != NULL ? fn(stream, graph) : CUDA_ERROR_NOT_FOUND; \
		capture_ended(rc);                                                   \
		return rc;                                                           \
	}

END_CAPTURE_WRAPPER(cuStreamEndCapture)
END_CAPTURE_WRAPPER(cuStreamEndCapture_ptsz)

GS_EXPORT CUresult cuGraphAddMemAllocNode(void **node, void *graph, const void *deps, size_t ndeps,
					  void *params)
{
	gs_fn_cuGraphAddMemAllocNode fn = TRACED_FN(cuGraphAddMemAllocNode);
	CUresult rc = fn != NULL ? fn(node, graph, deps, ndeps, params) : CUDA_ERROR_NOT_FOUND;

	return gs_state.mode == GS_ENFORCE ? graph_node_made(rc) : rc;
}

/* An upload maps the graph's memory as its launch would. */
#define UPLOAD_WRAPPER(abi)                                                                 \
	GS_EXPORT CUresult abi(CUgraphExec exec, CUstream stream)                           \
	{                                                                                   \
		gs_fn_##abi fn = TRACED_FN(abi);                                            \
		CUresult rc = fn != NULL ? fn(exec, stream) : CUDA_ERROR_NOT_FOUND;         \
		if (rc == CUDA_SUCCESS && __atomic_load_n(&gs_graph_mem, __ATOMIC_ACQUIRE)) \
			graph_launched(stream);                                             \
		return rc;                                                                  \
	}

UPLOAD_WRAPPER(cuGraphUpload)
UPLOAD_WRAPPER(cuGraphUpload_ptsz)

GS_EXPORT CUresult cuDeviceGraphMemTrim(CUdevice dev)
{
	gs_fn_cuDeviceGraphMemTrim fn = TRACED_FN(cuDeviceGraphMemTrim);
	CUresult rc = fn != NULL ? fn(dev) : CUDA_ERROR_NOT_FOUND;

	if (rc == CUDA_SUCCESS && gs_state.mode == GS_ENFORCE)
		graph_pool_trimmed(ledger_gpu(dev));
	return rc;
}

/* The driver may give back the memory only that executable graph's launches used. */
GS_EXPORT CUresult cuGraphExecDestroy(CUgraphExec exec)
{
	gs_fn_cuGraphExecDestroy fn = TRACED_FN(cuGraphExecDestroy);
	CUresult rc = fn != NULL ? fn(exec) : CUDA_ERROR_NOT_FOUND;

	if (rc == CUDA_SUCCESS && gs_state.mode == GS_ENFORCE &&
	    __atomic_load_n(&gs_graph_mem, __ATOMIC_ACQUIRE))
		graph_pools_sync();
	return rc;
}
