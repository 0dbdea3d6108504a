/*
 * The slice of the CUDA driver ABI that gpushare's shim and simulated driver
 * use. Written from the driver's documented ABI (type widths, enum values,
 * calling conventions) so the project builds without the CUDA toolkit.
 */
#ifndef GPUSHARE_CUDA_ABI_H
#define GPUSHARE_CUDA_ABI_H

#include <stddef.h>
#include <stdint.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st *CUcontext;
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUgreenCtx_st *CUgreenCtx;
typedef struct CUuuid_st {
	char bytes[16];
} CUuuid;
typedef uint64_t cuuint64_t;
typedef int CUdriverProcAddressQueryResult;
typedef struct CUarray_st *CUarray;
typedef struct CUmipmappedArray_st *CUmipmappedArray;
typedef struct CUgraphExec_st *CUgraphExec;
typedef struct CUmemPoolHandle_st *CUmemoryPool;
typedef unsigned long long CUmemGenericAllocationHandle;

/* cuArrayCreate_v2 */
typedef struct {
	size_t Width;
	size_t Height;
	int Format; /* CUarray_format */
	unsigned int NumChannels;
} CUDA_ARRAY_DESCRIPTOR;

/* cuArray3DCreate_v2, cuMipmappedArrayCreate */
typedef struct {
	size_t Width;
	size_t Height;
	size_t Depth;
	int Format; /* CUarray_format */
	unsigned int NumChannels;
	unsigned int Flags;
} CUDA_ARRAY3D_DESCRIPTOR;

/* CUarray_format values with a known element size. */
enum {
	CU_AD_FORMAT_UNSIGNED_INT8 = 0x01,
	CU_AD_FORMAT_UNSIGNED_INT16 = 0x02,
	CU_AD_FORMAT_UNSIGNED_INT32 = 0x03,
	CU_AD_FORMAT_SIGNED_INT8 = 0x08,
	CU_AD_FORMAT_SIGNED_INT16 = 0x09,
	CU_AD_FORMAT_SIGNED_INT32 = 0x0a,
	CU_AD_FORMAT_HALF = 0x10,
	CU_AD_FORMAT_FLOAT = 0x20,
};

/* Bytes per channel of an array format; 0 for a format not listed above. */
static inline size_t gs_array_format_bytes(int format)
{
	switch (format) {
	case CU_AD_FORMAT_UNSIGNED_INT8:
	case CU_AD_FORMAT_SIGNED_INT8:
		return 1;
	case CU_AD_FORMAT_UNSIGNED_INT16:
	case CU_AD_FORMAT_SIGNED_INT16:
	case CU_AD_FORMAT_HALF:
		return 2;
	case CU_AD_FORMAT_UNSIGNED_INT32:
	case CU_AD_FORMAT_SIGNED_INT32:
	case CU_AD_FORMAT_FLOAT:
		return 4;
	default:
		return 0;
	}
}

/* cuMemCreate */
typedef struct {
	int type; /* CUmemLocationType */
	int id;
} CUmemLocation;

typedef struct {
	int type;		  /* CUmemAllocationType */
	int requestedHandleTypes; /* CUmemAllocationHandleType */
	CUmemLocation location;
	void *win32HandleMetaData;
	struct {
		unsigned char compressionType;
		unsigned char gpuDirectRDMACapable;
		unsigned short usage;
		unsigned char reserved[4];
	} allocFlags;
} CUmemAllocationProp;

/* cuMemPoolCreate: maxSize and usage took bytes of reserved[64] in CUDA 12. */
typedef struct {
	int allocType;	 /* CUmemAllocationType */
	int handleTypes; /* CUmemAllocationHandleType */
	CUmemLocation location;
	void *win32SecurityAttributes;
	size_t maxSize;
	unsigned short usage;
	unsigned char reserved[54];
} CUmemPoolProps;

enum {
	CU_MEM_LOCATION_TYPE_INVALID = 0,
	CU_MEM_LOCATION_TYPE_DEVICE = 1,
	CU_MEM_LOCATION_TYPE_HOST = 2,
	CU_MEM_LOCATION_TYPE_HOST_NUMA = 3,
	CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT = 4,
};
enum {
	CU_MEM_ALLOCATION_TYPE_PINNED = 1
};

/* cuMemSetAccess */
typedef struct {
	CUmemLocation location;
	int flags; /* CUmemAccess_flags */
} CUmemAccessDesc;

enum {
	CU_MEM_ACCESS_FLAGS_PROT_NONE = 0,
	CU_MEM_ACCESS_FLAGS_PROT_READ = 1,
	CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3,
};
enum {
	CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0,
	CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1,
};

/* cuStreamCreate flags, and the stream handles that name a default stream. */
enum {
	CU_STREAM_DEFAULT = 0,
	CU_STREAM_NON_BLOCKING = 1
};
#define CU_STREAM_LEGACY ((CUstream)0x1)
#define CU_STREAM_PER_THREAD ((CUstream)0x2)

/* cuMemAllocManaged flags */
enum {
	CU_MEM_ATTACH_GLOBAL = 1,
	CU_MEM_ATTACH_HOST = 2
};

/* cuLaunchKernelEx: the shim only passes the config through. */
typedef struct CUlaunchAttribute_st CUlaunchAttribute;
typedef struct {
	unsigned int gridDimX, gridDimY, gridDimZ;
	unsigned int blockDimX, blockDimY, blockDimZ;
	unsigned int sharedMemBytes;
	CUstream hStream;
	CUlaunchAttribute *attrs;
	unsigned int numAttrs;
} CUlaunchConfig;

/* NVML, the slice the shim and the simulated NVML use. */
typedef int nvmlReturn_t;
typedef struct nvmlDevice_st *nvmlDevice_t;
typedef struct {
	unsigned long long total;
	unsigned long long free;
	unsigned long long used;
} nvmlMemory_t;
typedef struct {
	unsigned int version;
	unsigned long long total;
	unsigned long long reserved;
	unsigned long long free;
	unsigned long long used;
} nvmlMemory_v2_t;
/* NVML_STRUCT_VERSION(Memory, 2) */
#define GS_NVML_MEMORY_V2 ((unsigned int)(sizeof(nvmlMemory_v2_t) | (2u << 24)))
enum {
	NVML_SUCCESS = 0,
	NVML_ERROR_UNINITIALIZED = 1,
	NVML_ERROR_INVALID_ARGUMENT = 2,
	NVML_ERROR_NOT_SUPPORTED = 3,
	NVML_ERROR_NO_PERMISSION = 4,
	NVML_ERROR_ALREADY_INITIALIZED = 5,
	NVML_ERROR_NOT_FOUND = 6,
	NVML_ERROR_INSUFFICIENT_SIZE = 7,
	NVML_ERROR_DRIVER_NOT_LOADED = 9,
	NVML_ERROR_LIBRARY_NOT_FOUND = 12,
	NVML_ERROR_FUNCTION_NOT_FOUND = 13,
	NVML_ERROR_GPU_IS_LOST = 15,
	NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
	NVML_ERROR_UNKNOWN = 999,
};
#define GS_NVML_UUID_LEN 96 /* NVML_DEVICE_UUID_V2_BUFFER_SIZE */
#define GS_NVML_NAME_LEN 96 /* NVML_DEVICE_NAME_V2_BUFFER_SIZE */

enum {
	CUDA_SUCCESS = 0,
	CUDA_ERROR_INVALID_VALUE = 1,
	CUDA_ERROR_OUT_OF_MEMORY = 2,
	CUDA_ERROR_NOT_INITIALIZED = 3,
	CUDA_ERROR_DEINITIALIZED = 4,
	CUDA_ERROR_NO_DEVICE = 100,
	CUDA_ERROR_INVALID_DEVICE = 101,
	CUDA_ERROR_INVALID_CONTEXT = 201,
	CUDA_ERROR_INVALID_HANDLE = 400,
	CUDA_ERROR_INVALID_IMAGE = 200,
	CUDA_ERROR_NOT_FOUND = 500,
	CUDA_ERROR_NOT_PERMITTED = 800,
	CUDA_ERROR_NOT_SUPPORTED = 801,
	CUDA_ERROR_UNKNOWN = 999,
};

/* cuGetProcAddress flags and query results. */
enum {
	CU_GET_PROC_ADDRESS_DEFAULT = 0,
	CU_GET_PROC_ADDRESS_LEGACY_STREAM = 1,
	CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM = 2,
};
enum {
	CU_GET_PROC_ADDRESS_SUCCESS = 0,
	CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND = 1,
	CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT = 2,
};

/* Device attributes the simulated driver answers. */
enum {
	CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 1,
	CU_DEVICE_ATTRIBUTE_WARP_SIZE = 10,
	CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16,
	CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR = 39,
	CU_DEVICE_ATTRIBUTE_PCI_BUS_ID = 33,
	CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID = 34,
	CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75,
	CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76,
	CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING = 41,
	CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID = 50,
};

/* cuCtxSetLimit's limits that are device memory. */
enum {
	CU_LIMIT_STACK_SIZE = 0,
	CU_LIMIT_MALLOC_HEAP_SIZE = 2,
};

/* The driver version the simulated driver reports (13.0). */
#define GS_SIM_DRIVER_VERSION 13000

#endif
