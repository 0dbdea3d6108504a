/*
 * The driver's implementations (sim_impl_<name>), as their files define
 * them: sim_exports.c forwards each export to one, declaring it its own way
 * (machine words, weak), so it must not include this. Each file's own
 * definitions are checked against these prototypes.
 */
#ifndef GPUSHARE_SIM_IMPL_H
#define GPUSHARE_SIM_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include "sim_abi.h"

/* A device pointer of the 32-bit (pre-3020) ABI variants: sim_cuda.c refuses them all. */
typedef unsigned int sim_devptr_v1;

/* cuOccupancy*'s block-size-to-shared-memory callback. */
typedef size_t (*sim_smem_fn)(int block);

/* CUDA_GRAPH_INSTANTIATE_PARAMS: flags, upload stream, error node, result. */
struct sim_instantiate_params {
	uint64_t flags;
	CUstream upload;
	void *err_node;
	int result;
};

/* sim_cuda.c and sim_ctx.c */
CUresult sim_impl_cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev);
CUresult sim_impl_cuCtxCreate_v3(CUcontext *pctx, void *affinity, int naffinity, unsigned int flags,
				 CUdevice dev);
CUresult sim_impl_cuCtxCreate_v4(CUcontext *pctx, void *params, unsigned int flags, CUdevice dev);
CUresult sim_impl_cuCtxDestroy_v2(CUcontext ctx);
CUresult sim_impl_cuCtxSetCurrent(CUcontext ctx);
CUresult sim_impl_cuCtxGetCurrent(CUcontext *pctx);
CUresult sim_impl_cuCtxGetDevice(CUdevice *dev);
CUresult sim_impl_cuCtxPushCurrent_v2(CUcontext ctx);
CUresult sim_impl_cuCtxPopCurrent_v2(CUcontext *pctx);
CUresult sim_impl_cuCtxSynchronize(void);
CUresult sim_impl_cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev);
CUresult sim_impl_cuDevicePrimaryCtxRelease_v2(CUdevice dev);
CUresult sim_impl_cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active);
CUresult sim_impl_cuDevicePrimaryCtxSetFlags_v2(CUdevice dev, unsigned int flags);
CUresult sim_impl_cuDevicePrimaryCtxReset_v2(CUdevice dev);
CUresult sim_impl_cuCtxDestroy(CUcontext ctx);
CUresult sim_impl_cuDevicePrimaryCtxRelease(CUdevice dev);
CUresult sim_impl_cuDevicePrimaryCtxReset(CUdevice dev);
CUresult sim_impl_cuInit(unsigned int flags);
CUresult sim_impl_cuDeviceGet(CUdevice *dev, int ordinal);
CUresult sim_impl_cuDeviceGetName(char *name, int len, CUdevice dev);
CUresult sim_impl_cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev);
CUresult sim_impl_cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev);
CUresult sim_impl_cuDeviceGetPCIBusId(char *bus_id, int len, CUdevice dev);
CUresult sim_impl_cuDeviceTotalMem(unsigned int *bytes, CUdevice dev);
CUresult sim_impl_cuMemGetInfo(unsigned int *free_bytes, unsigned int *total_bytes);
CUresult sim_impl_cuMemAlloc(sim_devptr_v1 *dptr, unsigned int bytesize);
CUresult sim_impl_cuMemAllocPitch(sim_devptr_v1 *dptr, unsigned int *pitch, unsigned int width,
				  unsigned int height, unsigned int elem);
CUresult sim_impl_cuMemFree(sim_devptr_v1 dptr);
CUresult sim_impl_cuArrayCreate(CUarray *array, const void *desc);
CUresult sim_impl_cuArray3DCreate(CUarray *array, const void *desc);
CUresult sim_impl_cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev);
CUresult sim_impl_cuGetErrorString(CUresult error, const char **str);
CUresult sim_impl_cuGetErrorName(CUresult error, const char **str);
CUresult sim_impl_cuGetExportTable(const void **table, const CUuuid *table_id);
CUresult sim_impl_cuGetProcAddress(const char *symbol, void **pfn, int cuda_version,
				   cuuint64_t flags);
CUresult sim_impl_cuGetProcAddress_v2(const char *symbol, void **pfn, int cuda_version,
				      cuuint64_t flags, CUdriverProcAddressQueryResult *status);
CUresult sim_impl_cuCtxGetLimit(size_t *v, int limit);
CUresult sim_impl_cuCtxSetLimit(int limit, size_t v);
CUresult sim_impl_cuCtxGetFlags(unsigned int *flags);
CUresult sim_impl_cuCtxSetFlags(unsigned int flags);
CUresult sim_impl_cuCtxGetApiVersion(CUcontext ctx, unsigned int *version);
CUresult sim_impl_cuCtxGetId(CUcontext ctx, unsigned long long *id);
CUresult sim_impl_cuCtxGetDevice_v2(CUdevice *dev, CUcontext ctx);
CUresult sim_impl_cuCtxSynchronize_v2(CUcontext ctx);
CUresult sim_impl_cuCtxGetCacheConfig(int *config);
CUresult sim_impl_cuCtxSetCacheConfig(int config);
CUresult sim_impl_cuCtxResetPersistingL2Cache(void);
CUresult sim_impl_cuDeviceCanAccessPeer(int *can, CUdevice dev, CUdevice peer);
CUresult sim_impl_cuDeviceGetP2PAttribute(int *v, int attr, CUdevice src, CUdevice dst);
CUresult sim_impl_cuCtxEnablePeerAccess(CUcontext peer, unsigned int flags);
CUresult sim_impl_cuCtxDisablePeerAccess(CUcontext peer);
CUresult sim_impl_cuDeviceGetByPCIBusId(CUdevice *dev, const char *bus_id);
CUresult sim_impl_cuDeviceComputeCapability(int *major, int *minor, CUdevice dev);
CUresult sim_impl_cuDeviceGetTexture1DLinearMaxWidth(size_t *width, int format,
						     unsigned int channels, CUdevice dev);
CUresult sim_impl_cuDeviceGetExecAffinitySupport(int *supported, int type, CUdevice dev);
CUresult sim_impl_cuFlushGPUDirectRDMAWrites(int target, int scope);

/* sim_heap.c, sim_pools.c, sim_vmm.c, sim_host.c, sim_ipc.c and sim_copy.c */
CUresult sim_impl_cuDeviceGraphMemTrim(CUdevice dev);
CUresult sim_impl_cuDeviceGetGraphMemAttribute(CUdevice dev, int attr, void *value);
CUresult sim_impl_cuDeviceSetGraphMemAttribute(CUdevice dev, int attr, void *value);
CUresult sim_impl_cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize);
CUresult sim_impl_cuMemFree_v2(CUdeviceptr dptr);
CUresult sim_impl_cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height,
				     unsigned int elem);
CUresult sim_impl_cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags);
CUresult sim_impl_cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes);
CUresult sim_impl_cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice dev);
CUresult sim_impl_cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev);
CUresult sim_impl_cuDeviceSetMemPool(CUdevice dev, CUmemoryPool pool);
CUresult sim_impl_cuMemGetDefaultMemPool(CUmemoryPool *pool, const CUmemLocation *loc, int type);
CUresult sim_impl_cuMemGetMemPool(CUmemoryPool *pool, const CUmemLocation *loc, int type);
CUresult sim_impl_cuMemSetMemPool(const CUmemLocation *loc, int type, CUmemoryPool pool);
CUresult sim_impl_cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props);
CUresult sim_impl_cuMemPoolDestroy(CUmemoryPool pool);
CUresult sim_impl_cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream stream);
CUresult sim_impl_cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream stream);
CUresult sim_impl_cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
					  CUstream stream);
CUresult sim_impl_cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize,
					       CUmemoryPool pool, CUstream stream);
CUresult sim_impl_cuMemFreeAsync(CUdeviceptr dptr, CUstream stream);
CUresult sim_impl_cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream stream);
CUresult sim_impl_cuMemGetAllocationGranularity(size_t *granularity,
						const CUmemAllocationProp *prop, int option);
CUresult sim_impl_cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
			      const CUmemAllocationProp *prop, unsigned long long flags);
CUresult sim_impl_cuMemRelease(CUmemGenericAllocationHandle handle);
CUresult sim_impl_cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment,
				      CUdeviceptr addr, unsigned long long flags);
CUresult sim_impl_cuMemAddressFree(CUdeviceptr ptr, size_t size);
CUresult sim_impl_cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
			   CUmemGenericAllocationHandle handle, unsigned long long flags);
CUresult sim_impl_cuMemUnmap(CUdeviceptr ptr, size_t size);
CUresult sim_impl_cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc,
				 size_t count);
CUresult sim_impl_cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr);
CUresult sim_impl_cuArrayCreate_v2(CUarray *array, const CUDA_ARRAY_DESCRIPTOR *desc);
CUresult sim_impl_cuArray3DCreate_v2(CUarray *array, const CUDA_ARRAY3D_DESCRIPTOR *desc);
CUresult sim_impl_cuArrayDestroy(CUarray array);
CUresult sim_impl_cuMipmappedArrayCreate(CUmipmappedArray *array,
					 const CUDA_ARRAY3D_DESCRIPTOR *desc, unsigned int levels);
CUresult sim_impl_cuMipmappedArrayDestroy(CUmipmappedArray array);
CUresult sim_impl_cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n);
CUresult sim_impl_cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream stream);
CUresult sim_impl_cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n);
CUresult sim_impl_cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream stream);
CUresult sim_impl_cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n);
CUresult sim_impl_cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream stream);
CUresult sim_impl_cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n);
CUresult sim_impl_cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream stream);
CUresult sim_impl_cuMemcpyPeer(CUdeviceptr dst, CUcontext dctx, CUdeviceptr src, CUcontext sctx,
			       size_t n);
CUresult sim_impl_cuMemcpyPeerAsync(CUdeviceptr dst, CUcontext dctx, CUdeviceptr src,
				    CUcontext sctx, size_t n, CUstream stream);
CUresult sim_impl_cuMemcpy2D_v2(const CUDA_MEMCPY2D *p);
CUresult sim_impl_cuMemcpy2DUnaligned_v2(const CUDA_MEMCPY2D *p);
CUresult sim_impl_cuMemcpy2DAsync_v2(const CUDA_MEMCPY2D *p, CUstream stream);
CUresult sim_impl_cuMemcpy3D_v2(const CUDA_MEMCPY3D *p);
CUresult sim_impl_cuMemcpy3DAsync_v2(const CUDA_MEMCPY3D *p, CUstream stream);
CUresult sim_impl_cuMemsetD8_v2(CUdeviceptr dst, unsigned char v, size_t n);
CUresult sim_impl_cuMemsetD16_v2(CUdeviceptr dst, unsigned short v, size_t n);
CUresult sim_impl_cuMemsetD32_v2(CUdeviceptr dst, unsigned int v, size_t n);
CUresult sim_impl_cuMemsetD8Async(CUdeviceptr dst, unsigned char v, size_t n, CUstream s);
CUresult sim_impl_cuMemsetD16Async(CUdeviceptr dst, unsigned short v, size_t n, CUstream s);
CUresult sim_impl_cuMemsetD32Async(CUdeviceptr dst, unsigned int v, size_t n, CUstream s);
CUresult sim_impl_cuMemsetD2D8_v2(CUdeviceptr dst, size_t pitch, unsigned char v, size_t w,
				  size_t h);
CUresult sim_impl_cuMemsetD2D16_v2(CUdeviceptr dst, size_t pitch, unsigned short v, size_t w,
				   size_t h);
CUresult sim_impl_cuMemsetD2D32_v2(CUdeviceptr dst, size_t pitch, unsigned int v, size_t w,
				   size_t h);
CUresult sim_impl_cuMemsetD2D8Async(CUdeviceptr dst, size_t pitch, unsigned char v, size_t w,
				    size_t h, CUstream s);
CUresult sim_impl_cuMemsetD2D16Async(CUdeviceptr dst, size_t pitch, unsigned short v, size_t w,
				     size_t h, CUstream s);
CUresult sim_impl_cuMemsetD2D32Async(CUdeviceptr dst, size_t pitch, unsigned int v, size_t w,
				     size_t h, CUstream s);
CUresult sim_impl_cuMemHostAlloc(void **pp, size_t size, unsigned int flags);
CUresult sim_impl_cuMemAllocHost_v2(void **pp, size_t size);
CUresult sim_impl_cuMemFreeHost(void *p);
CUresult sim_impl_cuMemHostRegister_v2(void *p, size_t size, unsigned int flags);
CUresult sim_impl_cuMemHostUnregister(void *p);
CUresult sim_impl_cuMemHostGetDevicePointer_v2(CUdeviceptr *pd, void *p, unsigned int flags);
CUresult sim_impl_cuMemHostGetFlags(unsigned int *flags, void *p);
CUresult sim_impl_cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p);
CUresult sim_impl_cuPointerGetAttribute(void *data, int attr, CUdeviceptr p);
CUresult sim_impl_cuPointerGetAttributes(unsigned int n, int *attrs, void **data, CUdeviceptr p);
CUresult sim_impl_cuPointerSetAttribute(const void *value, int attr, CUdeviceptr p);
CUresult sim_impl_cuMemAdvise(CUdeviceptr p, size_t n, int advice, CUdevice dev);
CUresult sim_impl_cuMemAdvise_v2(CUdeviceptr p, size_t n, int advice, CUmemLocation loc);
CUresult sim_impl_cuMemPrefetchAsync(CUdeviceptr p, size_t n, CUdevice dev, CUstream s);
CUresult sim_impl_cuMemPoolSetAttribute(CUmemoryPool pool, int attr, void *value);
CUresult sim_impl_cuMemPoolGetAttribute(CUmemoryPool pool, int attr, void *value);
CUresult sim_impl_cuMemPoolTrimTo(CUmemoryPool pool, size_t keep);
CUresult sim_impl_cuMemPoolSetAccess(CUmemoryPool pool, const CUmemAccessDesc *desc, size_t n);
CUresult sim_impl_cuMemPoolGetAccess(int *flags, CUmemoryPool pool, const CUmemLocation *loc);
CUresult sim_impl_cuIpcGetMemHandle(CUipcMemHandle *handle, CUdeviceptr p);
CUresult sim_impl_cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle,
					unsigned int flags);
CUresult sim_impl_cuIpcOpenMemHandle(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int flags);
CUresult sim_impl_cuIpcCloseMemHandle(CUdeviceptr p);
CUresult sim_impl_cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle handle,
					       int type, unsigned long long flags);
CUresult sim_impl_cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle,
						 void *os_handle, int type);
CUresult sim_impl_cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop,
							 CUmemGenericAllocationHandle handle);

/* sim_streams.c, sim_graphs.c and sim_events.c */
CUresult sim_impl_cuStreamCreate(CUstream *stream, unsigned int flags);
CUresult sim_impl_cuStreamDestroy_v2(CUstream stream);
CUresult sim_impl_cuStreamGetCtx(CUstream stream, CUcontext *pctx);
CUresult sim_impl_cuStreamGetCtx_ptsz(CUstream stream, CUcontext *pctx);
CUresult sim_impl_cuStreamGetCtx_v2(CUstream stream, CUcontext *pctx, CUgreenCtx *pgreen);
CUresult sim_impl_cuStreamGetCtx_v2_ptsz(CUstream stream, CUcontext *pctx, CUgreenCtx *pgreen);
CUresult sim_impl_cuStreamSynchronize(CUstream stream);
CUresult sim_impl_cuStreamSynchronize_ptsz(CUstream stream);
CUresult sim_impl_cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
				 unsigned int bx, unsigned int by, unsigned int bz,
				 unsigned int shmem, CUstream stream, void **params, void **extra);
CUresult sim_impl_cuLaunchKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy,
				      unsigned int gz, unsigned int bx, unsigned int by,
				      unsigned int bz, unsigned int shmem, CUstream stream,
				      void **params, void **extra);
CUresult sim_impl_cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **params,
				   void **extra);
CUresult sim_impl_cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **params,
					void **extra);
CUresult sim_impl_cuLaunchCooperativeKernel(CUfunction f, unsigned int gx, unsigned int gy,
					    unsigned int gz, unsigned int bx, unsigned int by,
					    unsigned int bz, unsigned int shmem, CUstream stream,
					    void **params);
CUresult sim_impl_cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy,
						 unsigned int gz, unsigned int bx, unsigned int by,
						 unsigned int bz, unsigned int shmem,
						 CUstream stream, void **params);
CUresult sim_impl_cuGraphLaunch(CUgraphExec exec, CUstream stream);
CUresult sim_impl_cuGraphLaunch_ptsz(CUgraphExec exec, CUstream stream);
CUresult sim_impl_cuEventCreate(CUevent *pe, unsigned int flags);
CUresult sim_impl_cuEventDestroy_v2(CUevent e);
CUresult sim_impl_cuEventRecord(CUevent e, CUstream s);
CUresult sim_impl_cuEventRecordWithFlags(CUevent e, CUstream s, unsigned int flags);
CUresult sim_impl_cuEventQuery(CUevent e);
CUresult sim_impl_cuEventSynchronize(CUevent e);
CUresult sim_impl_cuEventElapsedTime(float *ms, CUevent start, CUevent end);
CUresult sim_impl_cuEventElapsedTime_v2(float *ms, CUevent start, CUevent end);
CUresult sim_impl_cuStreamWaitEvent(CUstream stream, CUevent ev, unsigned int flags);
CUresult sim_impl_cuIpcGetEventHandle(CUipcEventHandle *h, CUevent ev);
CUresult sim_impl_cuIpcOpenEventHandle(CUevent *pe, CUipcEventHandle h);
CUresult sim_impl_cuStreamCreateWithPriority(CUstream *stream, unsigned int flags, int priority);
CUresult sim_impl_cuStreamGetPriority(CUstream stream, int *priority);
CUresult sim_impl_cuStreamGetFlags(CUstream stream, unsigned int *flags);
CUresult sim_impl_cuStreamGetId(CUstream stream, unsigned long long *id);
CUresult sim_impl_cuStreamGetDevice(CUstream stream, CUdevice *dev);
CUresult sim_impl_cuStreamQuery(CUstream stream);
CUresult sim_impl_cuLaunchHostFunc(CUstream stream, CUhostFn fn, void *data);
CUresult sim_impl_cuStreamAddCallback(CUstream stream, CUstreamCallback cb, void *data,
				      unsigned int flags);
CUresult sim_impl_cuCtxGetStreamPriorityRange(int *least, int *greatest);
CUresult sim_impl_cuStreamBeginCapture(CUstream stream);
CUresult sim_impl_cuStreamBeginCapture_v2(CUstream stream, int mode);
CUresult sim_impl_cuStreamEndCapture(CUstream stream, CUgraph *pg);
CUresult sim_impl_cuStreamIsCapturing(CUstream stream, int *status);
CUresult sim_impl_cuStreamGetCaptureInfo(CUstream stream, int *status, uint64_t *id);
CUresult sim_impl_cuStreamGetCaptureInfo_v2(CUstream stream, int *status, uint64_t *id,
					    CUgraph *graph, const void **deps, size_t *ndeps);
CUresult sim_impl_cuStreamGetCaptureInfo_v3(CUstream stream, int *status, uint64_t *id,
					    CUgraph *graph, const void **deps, const void **edges,
					    size_t *ndeps);
CUresult sim_impl_cuThreadExchangeStreamCaptureMode(int *mode);
CUresult sim_impl_cuGraphCreate(CUgraph *pg, unsigned int flags);
CUresult sim_impl_cuGraphDestroy(CUgraph g);
CUresult sim_impl_cuGraphGetNodes(CUgraph g, void **nodes, size_t *n);
CUresult sim_impl_cuGraphInstantiateWithFlags(CUgraphExec *pe, CUgraph g, unsigned long long flags);
CUresult sim_impl_cuGraphInstantiate(CUgraphExec *pe, CUgraph g, void *err_node, char *log,
				     size_t log_size);
CUresult sim_impl_cuGraphInstantiate_v2(CUgraphExec *pe, CUgraph g, void *err_node, char *log,
					size_t log_size);
CUresult sim_impl_cuGraphInstantiateWithParams(CUgraphExec *pe, CUgraph g,
					       struct sim_instantiate_params *params);
CUresult sim_impl_cuGraphExecDestroy(CUgraphExec e);
CUresult sim_impl_cuGraphUpload(CUgraphExec exec, CUstream stream);

/* sim_modules.c */
CUresult sim_impl_cuModuleGetLoadingMode(int *mode);
CUresult sim_impl_cuLibraryLoadData(CUlibrary *lib, const void *code, void *jit_opts,
				    void *jit_vals, unsigned int njit, void *lib_opts,
				    void *lib_vals, unsigned int nlib);
CUresult sim_impl_cuLibraryLoadFromFile(CUlibrary *lib, const char *path, void *jit_opts,
					void *jit_vals, unsigned int njit, void *lib_opts,
					void *lib_vals, unsigned int nlib);
CUresult sim_impl_cuModuleLoadData(CUmodule *mod, const void *image);
CUresult sim_impl_cuModuleLoadDataEx(CUmodule *mod, const void *image, unsigned int n, void *opts,
				     void *vals);
CUresult sim_impl_cuModuleLoadFatBinary(CUmodule *mod, const void *fatbin);
CUresult sim_impl_cuModuleLoad(CUmodule *mod, const char *path);
CUresult sim_impl_cuLibraryUnload(CUlibrary lib);
CUresult sim_impl_cuModuleUnload(CUmodule mod);
CUresult sim_impl_cuLibraryGetModule(CUmodule *mod, CUlibrary lib);
CUresult sim_impl_cuLibraryGetKernel(CUkernel *k, CUlibrary lib, const char *name);
CUresult sim_impl_cuModuleGetFunction(CUfunction *f, CUmodule mod, const char *name);
CUresult sim_impl_cuKernelGetFunction(CUfunction *f, CUkernel k);
CUresult sim_impl_cuKernelGetLibrary(CUlibrary *lib, CUkernel k);
CUresult sim_impl_cuFuncGetModule(CUmodule *mod, CUfunction f);
CUresult sim_impl_cuFuncGetName(const char **name, CUfunction f);
CUresult sim_impl_cuKernelGetName(const char **name, CUkernel k);
CUresult sim_impl_cuLibraryGetGlobal(CUdeviceptr *dptr, size_t *bytes, CUlibrary lib,
				     const char *name);
CUresult sim_impl_cuModuleGetGlobal_v2(CUdeviceptr *dptr, size_t *bytes, CUmodule mod,
				       const char *name);
CUresult sim_impl_cuFuncGetAttribute(int *v, int attr, CUfunction f);
CUresult sim_impl_cuFuncSetAttribute(CUfunction f, int attr, int v);
CUresult sim_impl_cuKernelGetAttribute(int *v, int attr, CUkernel k, CUdevice dev);
CUresult sim_impl_cuKernelSetAttribute(int attr, int v, CUkernel k, CUdevice dev);
CUresult sim_impl_cuFuncSetCacheConfig(CUfunction f, int config);
CUresult sim_impl_cuKernelSetCacheConfig(CUkernel k, int config, CUdevice dev);
CUresult sim_impl_cuFuncIsLoaded(int *state, CUfunction f);
CUresult sim_impl_cuFuncLoad(CUfunction f);
CUresult sim_impl_cuOccupancyMaxActiveBlocksPerMultiprocessor(int *n, CUfunction f, int block,
							      size_t smem);
CUresult sim_impl_cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int *n, CUfunction f,
								       int block, size_t smem,
								       unsigned int flags);
CUresult sim_impl_cuOccupancyMaxPotentialBlockSize(int *grid, int *block, CUfunction f,
						   sim_smem_fn smem_fn, size_t smem, int limit);
CUresult sim_impl_cuOccupancyMaxPotentialBlockSizeWithFlags(int *grid, int *block, CUfunction f,
							    sim_smem_fn smem_fn, size_t smem,
							    int limit, unsigned int flags);
CUresult sim_impl_cuOccupancyAvailableDynamicSMemPerBlock(size_t *bytes, CUfunction f, int nblocks,
							  int block);
CUresult sim_impl_cuOccupancyMaxActiveClusters(int *n, CUfunction f, const void *config);
CUresult sim_impl_cuOccupancyMaxPotentialClusterSize(int *n, CUfunction f, const void *config);

#endif
