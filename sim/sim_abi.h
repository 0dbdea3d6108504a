/*
 * The part of the driver ABI only the simulator implements (the shim's
 * share is shim/cuda_abi.h): the layouts and values of CUDA 13.0's cuda.h
 * that the simulated entry points read or write.
 */
#ifndef GPUSHARE_SIM_ABI_H
#define GPUSHARE_SIM_ABI_H

#include <stddef.h>
#include <stdint.h>

#include "cuda_abi.h"

typedef struct CUevent_st *CUevent;
typedef struct CUgraph_st *CUgraph;
typedef struct CUlib_st *CUlibrary;
typedef struct CUkern_st *CUkernel;
typedef struct CUmod_st *CUmodule;
typedef void (*CUhostFn)(void *user_data);
typedef void (*CUstreamCallback)(CUstream stream, CUresult status, void *user_data);

enum {
	CUDA_ERROR_NOT_READY = 600,
	CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704,
	CUDA_ERROR_PEER_ACCESS_NOT_ENABLED = 705,
	CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900,
	CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901,
	CUDA_ERROR_STREAM_CAPTURE_UNMATCHED = 903,
	CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD = 908,
	CUDA_ERROR_ILLEGAL_STATE = 401,
	CUDA_ERROR_ALREADY_MAPPED = 208,
};

enum {
	CU_MEMORYTYPE_HOST = 1,
	CU_MEMORYTYPE_DEVICE = 2,
	CU_MEMORYTYPE_ARRAY = 3,
	CU_MEMORYTYPE_UNIFIED = 4,
};

/* cuMemcpy2D(Async)_v2 */
typedef struct {
	size_t srcXInBytes, srcY;
	int srcMemoryType;
	const void *srcHost;
	CUdeviceptr srcDevice;
	CUarray srcArray;
	size_t srcPitch;
	size_t dstXInBytes, dstY;
	int dstMemoryType;
	void *dstHost;
	CUdeviceptr dstDevice;
	CUarray dstArray;
	size_t dstPitch;
	size_t WidthInBytes, Height;
} CUDA_MEMCPY2D;

/* cuMemcpy3D(Async)_v2 */
typedef struct {
	size_t srcXInBytes, srcY, srcZ, srcLOD;
	int srcMemoryType;
	const void *srcHost;
	CUdeviceptr srcDevice;
	CUarray srcArray;
	void *reserved0;
	size_t srcPitch, srcHeight;
	size_t dstXInBytes, dstY, dstZ, dstLOD;
	int dstMemoryType;
	void *dstHost;
	CUdeviceptr dstDevice;
	CUarray dstArray;
	void *reserved1;
	size_t dstPitch, dstHeight;
	size_t WidthInBytes, Height, Depth;
} CUDA_MEMCPY3D;

enum {
	CU_POINTER_ATTRIBUTE_CONTEXT = 1,
	CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2,
	CU_POINTER_ATTRIBUTE_DEVICE_POINTER = 3,
	CU_POINTER_ATTRIBUTE_HOST_POINTER = 4,
	CU_POINTER_ATTRIBUTE_SYNC_MEMOPS = 6,
	CU_POINTER_ATTRIBUTE_BUFFER_ID = 7,
	CU_POINTER_ATTRIBUTE_IS_MANAGED = 8,
	CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9,
	CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10,
	CU_POINTER_ATTRIBUTE_RANGE_START_ADDR = 11,
	CU_POINTER_ATTRIBUTE_RANGE_SIZE = 12,
	CU_POINTER_ATTRIBUTE_MAPPED = 13,
	CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES = 14,
	CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE = 15,
	CU_POINTER_ATTRIBUTE_ACCESS_FLAGS = 16,
	CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE = 17,
	CU_POINTER_ATTRIBUTE_MAPPING_SIZE = 18,
	CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR = 19,
	CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID = 20,
};

enum {
	CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES = 1,
	CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC = 2,
	CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES = 3,
	CU_MEMPOOL_ATTR_RELEASE_THRESHOLD = 4,
	CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT = 5,
	CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH = 6,
	CU_MEMPOOL_ATTR_USED_MEM_CURRENT = 7,
	CU_MEMPOOL_ATTR_USED_MEM_HIGH = 8,
};

enum {
	CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 0,
	CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1,
	CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES = 2,
	CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES = 3,
	CU_FUNC_ATTRIBUTE_NUM_REGS = 4,
	CU_FUNC_ATTRIBUTE_PTX_VERSION = 5,
	CU_FUNC_ATTRIBUTE_BINARY_VERSION = 6,
	CU_FUNC_ATTRIBUTE_CACHE_MODE_CA = 7,
	CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8,
	CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 9,
	CU_FUNC_ATTRIBUTE_MAX = 20,
};

enum {
	CU_STREAM_CAPTURE_STATUS_NONE = 0,
	CU_STREAM_CAPTURE_STATUS_ACTIVE = 1,
	CU_STREAM_CAPTURE_STATUS_INVALIDATED = 2,
};
enum {
	CU_STREAM_CAPTURE_MODE_GLOBAL = 0,
	CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1,
	CU_STREAM_CAPTURE_MODE_RELAXED = 2,
};

enum {
	CU_EVENT_DISABLE_TIMING = 0x2,
	CU_EVENT_INTERPROCESS = 0x4,
};

enum {
	CU_LIMIT_COUNT = 10
}; /* CU_LIMIT_STACK_SIZE (0) .. CU_LIMIT_CIG_SHMEM_FALLBACK_ENABLED */

#define CU_IPC_HANDLE_SIZE 64
typedef struct {
	char reserved[CU_IPC_HANDLE_SIZE];
} CUipcMemHandle;
typedef struct {
	char reserved[CU_IPC_HANDLE_SIZE];
} CUipcEventHandle;

#endif
