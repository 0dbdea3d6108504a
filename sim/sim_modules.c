/*
 * Modules, libraries, kernels and functions. Code is loaded and never run:
 * a library or module is a handle, and each kernel name asked of it gets a
 * function object (a CUkernel and its CUfunction are the same object) with
 * H100-like attributes. Each device global asked for gets SIM_GLOBAL_BYTES
 * of device memory: the real sizes live in the image, which is not parsed,
 * and untouched pages cost nothing.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "sim_driver.h"

#define SIM_GLOBAL_BYTES ((size_t)1 << 20)

struct CUlib_st {
	struct sim_obj obj;
};

struct CUfunc_st {
	struct sim_obj obj;
	struct CUlib_st *lib;
	int max_dynamic_smem;
	int carveout;
	char name[]; /* mangled names run to hundreds of bytes */
};

/* CU_MODULE_LAZY_LOADING: what the runtime asks before anything else. */
#define SIM_MODULE_LAZY_LOADING 2

CUresult sim_impl_cuModuleGetLoadingMode(int *mode)
{
	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (mode == NULL)
		return CUDA_ERROR_INVALID_VALUE;
	*mode = SIM_MODULE_LAZY_LOADING;
	return CUDA_SUCCESS;
}

static CUresult sim_library_new(CUlibrary *out, const void *code)
{
	struct CUlib_st *l;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!out || !code)
		return CUDA_ERROR_INVALID_VALUE;
	l = calloc(1, sizeof(*l));
	if (!l)
		return CUDA_ERROR_OUT_OF_MEMORY;
	l->obj.kind = SIM_OBJ_LIBRARY;
	sim_obj_add(&l->obj);
	*out = l;
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuLibraryLoadData(CUlibrary *lib, const void *code, void *jit_opts,
				    void *jit_vals, unsigned int njit, void *lib_opts,
				    void *lib_vals, unsigned int nlib)
{
	(void)jit_opts, (void)jit_vals, (void)njit, (void)lib_opts, (void)lib_vals, (void)nlib;
	return sim_library_new(lib, code);
}

CUresult sim_impl_cuLibraryLoadFromFile(CUlibrary *lib, const char *path, void *jit_opts,
					void *jit_vals, unsigned int njit, void *lib_opts,
					void *lib_vals, unsigned int nlib)
{
	(void)jit_opts, (void)jit_vals, (void)njit, (void)lib_opts, (void)lib_vals, (void)nlib;
	if (path && access(path, R_OK) != 0)
		return CUDA_ERROR_NOT_FOUND;
	return sim_library_new(lib, path);
}

CUresult sim_impl_cuModuleLoadData(CUmodule *mod, const void *image)
{
	return sim_library_new((CUlibrary *)mod, image);
}

CUresult sim_impl_cuModuleLoadDataEx(CUmodule *mod, const void *image, unsigned int n, void *opts,
				     void *vals)
{
	(void)n, (void)opts, (void)vals;
	return sim_library_new((CUlibrary *)mod, image);
}

CUresult sim_impl_cuModuleLoadFatBinary(CUmodule *mod, const void *fatbin)
{
	return sim_library_new((CUlibrary *)mod, fatbin);
}

CUresult sim_impl_cuModuleLoad(CUmodule *mod, const char *path)
{
	if (path && access(path, R_OK) != 0)
		return CUDA_ERROR_NOT_FOUND;
	return sim_library_new((CUlibrary *)mod, path);
}

/* The library and the functions made from it go together. */
static CUresult sim_library_unload(void *lib)
{
	struct sim_obj **pp, *o, *dead = NULL;
	bool found = false;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	pthread_mutex_lock(&sim_obj_lock);
	for (pp = &sim_obj_list; (o = *pp);) {
		bool mine = (o == lib && o->kind == SIM_OBJ_LIBRARY) ||
			    ((o->kind == SIM_OBJ_FUNC || o->kind == SIM_OBJ_GLOBAL) &&
			     ((struct CUfunc_st *)o)->lib == lib);

		found |= o == lib && o->kind == SIM_OBJ_LIBRARY;
		if (mine) {
			*pp = o->next;
			o->next = dead;
			dead = o;
		} else {
			pp = &o->next;
		}
	}
	pthread_mutex_unlock(&sim_obj_lock);
	while ((o = dead)) {
		dead = o->next;
		if (o->kind == SIM_OBJ_GLOBAL)
			sim_mem_free(o->addr, SIM_MEM_PTR);
		free(o);
	}
	return found ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult sim_impl_cuLibraryUnload(CUlibrary lib)
{
	return sim_library_unload(lib);
}

CUresult sim_impl_cuModuleUnload(CUmodule mod)
{
	return sim_library_unload(mod);
}

/*
 * A library is its own module and a kernel its own function: *out is handle
 * itself, once handle is checked to be a live object of that kind.
 */
static CUresult sim_same_handle(void **out, void *handle, enum sim_obj_kind kind)
{
	struct sim_obj seen;
	CUresult rc = sim_check_args(out != NULL);

	if (rc == CUDA_SUCCESS && !sim_obj_lookup(handle, kind, false, &seen))
		rc = CUDA_ERROR_INVALID_HANDLE;
	if (rc == CUDA_SUCCESS)
		*out = handle;
	return rc;
}

CUresult sim_impl_cuLibraryGetModule(CUmodule *mod, CUlibrary lib)
{
	return sim_same_handle((void **)mod, lib, SIM_OBJ_LIBRARY);
}

/*
 * With sim_obj_lock held: the function (or global) named name in lib, made
 * on first request.
 */
static CUresult sim_symbol_locked(struct CUfunc_st **out, void *lib, const char *name,
				  enum sim_obj_kind kind)
{
	struct sim_obj *o;
	struct CUfunc_st *f;

	if (!sim_obj_find(lib, SIM_OBJ_LIBRARY))
		return CUDA_ERROR_INVALID_HANDLE;
	for (o = sim_obj_list; o; o = o->next) {
		f = (struct CUfunc_st *)o;
		if (o->kind == kind && f->lib == lib && strcmp(f->name, name) == 0) {
			*out = f;
			return CUDA_SUCCESS;
		}
	}
	f = calloc(1, sizeof(*f) + strlen(name) + 1);
	if (!f)
		return CUDA_ERROR_OUT_OF_MEMORY;
	f->obj.kind = kind;
	f->lib = lib;
	f->max_dynamic_smem = 49152;
	f->carveout = -1;
	strcpy(f->name, name);
	f->obj.next = sim_obj_list;
	sim_obj_list = &f->obj;
	*out = f;
	return CUDA_SUCCESS;
}

static CUresult sim_symbol(struct CUfunc_st **out, void *lib, const char *name,
			   enum sim_obj_kind kind)
{
	CUresult rc;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!out || !name)
		return CUDA_ERROR_INVALID_VALUE;
	pthread_mutex_lock(&sim_obj_lock);
	rc = sim_symbol_locked(out, lib, name, kind);
	pthread_mutex_unlock(&sim_obj_lock);
	return rc;
}

static CUresult sim_function(struct CUfunc_st **out, void *lib, const char *name)
{
	return sim_symbol(out, lib, name, SIM_OBJ_FUNC);
}

CUresult sim_impl_cuLibraryGetKernel(CUkernel *k, CUlibrary lib, const char *name)
{
	return sim_function((struct CUfunc_st **)k, lib, name);
}

CUresult sim_impl_cuModuleGetFunction(CUfunction *f, CUmodule mod, const char *name)
{
	return sim_function(f, mod, name);
}

CUresult sim_impl_cuKernelGetFunction(CUfunction *f, CUkernel k)
{
	return sim_same_handle((void **)f, k, SIM_OBJ_FUNC);
}

/*
 * A copy of the function or kernel fn, asked about through out: the checks
 * the queries share, in the driver's order.
 */
static CUresult sim_func_copy(const void *out, const void *fn, struct CUfunc_st *f)
{
	CUresult rc = sim_check_args(out != NULL);

	if (rc == CUDA_SUCCESS && !sim_obj_copy(fn, SIM_OBJ_FUNC, f, sizeof(*f)))
		rc = CUDA_ERROR_INVALID_HANDLE;
	return rc;
}

CUresult sim_impl_cuKernelGetLibrary(CUlibrary *lib, CUkernel k)
{
	struct CUfunc_st f;
	CUresult rc = sim_func_copy(lib, k, &f);

	if (rc == CUDA_SUCCESS)
		*lib = f.lib;
	return rc;
}

CUresult sim_impl_cuFuncGetModule(CUmodule *mod, CUfunction f)
{
	return sim_impl_cuKernelGetLibrary((CUlibrary *)mod, (CUkernel)f);
}

/* The name stays valid while the function lives, as documented. */
static CUresult sim_func_name(const char **name, const void *f)
{
	struct sim_obj **pp;
	CUresult rc = sim_check_args(name != NULL);

	if (rc != CUDA_SUCCESS)
		return rc;
	pthread_mutex_lock(&sim_obj_lock);
	pp = sim_obj_find(f, SIM_OBJ_FUNC);
	if (pp)
		*name = ((struct CUfunc_st *)*pp)->name;
	pthread_mutex_unlock(&sim_obj_lock);
	return pp ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult sim_impl_cuFuncGetName(const char **name, CUfunction f)
{
	return sim_func_name(name, f);
}

CUresult sim_impl_cuKernelGetName(const char **name, CUkernel k)
{
	return sim_func_name(name, k);
}

/*
 * A global's memory is taken from the current device when it is first asked
 * for, and belongs to the library: it goes when the library is unloaded.
 */
CUresult sim_impl_cuLibraryGetGlobal(CUdeviceptr *dptr, size_t *bytes, CUlibrary lib,
				     const char *name)
{
	struct CUfunc_st *g;
	CUdeviceptr addr = 0;
	CUresult rc;

	if (!sim_depth)
		return sim_live() == CUDA_SUCCESS ? CUDA_ERROR_INVALID_CONTEXT : sim_live();
	if (!name)
		return CUDA_ERROR_INVALID_VALUE;
	/* Held throughout (sim_obj_lock before a heap lock), so no unload frees g meanwhile. */
	pthread_mutex_lock(&sim_obj_lock);
	rc = sim_symbol_locked(&g, lib, name, SIM_OBJ_GLOBAL);
	if (rc == CUDA_SUCCESS && !g->obj.addr)
		rc = sim_heap_alloc(&sim_devs[sim_current_dev()], SIM_GLOBAL_BYTES, SIM_MEM_PTR, 0,
				    &g->obj.addr);
	if (rc == CUDA_SUCCESS)
		addr = g->obj.addr;
	pthread_mutex_unlock(&sim_obj_lock);
	if (rc != CUDA_SUCCESS)
		return rc;
	if (dptr)
		*dptr = addr;
	if (bytes)
		*bytes = SIM_GLOBAL_BYTES;
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuModuleGetGlobal_v2(CUdeviceptr *dptr, size_t *bytes, CUmodule mod,
				       const char *name)
{
	return sim_impl_cuLibraryGetGlobal(dptr, bytes, (CUlibrary)mod, name);
}

static CUresult sim_func_attr(int *v, int attr, const void *fn)
{
	struct CUfunc_st f;
	CUresult rc = sim_func_copy(v, fn, &f);

	if (rc != CUDA_SUCCESS)
		return rc;
	switch (attr) {
	case CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK:
		*v = 1024;
		break;
	case CU_FUNC_ATTRIBUTE_NUM_REGS:
		*v = 32;
		break;
	case CU_FUNC_ATTRIBUTE_PTX_VERSION:
	case CU_FUNC_ATTRIBUTE_BINARY_VERSION:
		*v = 90;
		break;
	case CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES:
		*v = f.max_dynamic_smem;
		break;
	case CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT:
		*v = f.carveout;
		break;
	default:
		if (attr < 0 || attr >= CU_FUNC_ATTRIBUTE_MAX)
			return CUDA_ERROR_INVALID_VALUE;
		*v = 0; /* static/const/local memory, cluster shape: none */
		break;
	}
	return CUDA_SUCCESS;
}

static CUresult sim_func_set(const void *fn, int attr, int v)
{
	struct sim_obj **pp;
	CUresult rc = CUDA_SUCCESS;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	pthread_mutex_lock(&sim_obj_lock);
	pp = sim_obj_find(fn, SIM_OBJ_FUNC);
	if (!pp) {
		rc = CUDA_ERROR_INVALID_HANDLE;
	} else if (attr == CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES) {
		/* The opt-in limit: shared memory per block, less the static part. */
		if (v < 0 || v > 232448)
			rc = CUDA_ERROR_INVALID_VALUE;
		else
			((struct CUfunc_st *)*pp)->max_dynamic_smem = v;
	} else if (attr == CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT) {
		((struct CUfunc_st *)*pp)->carveout = v;
	} else if (attr < 0 || attr >= CU_FUNC_ATTRIBUTE_MAX) {
		rc = CUDA_ERROR_INVALID_VALUE;
	}
	pthread_mutex_unlock(&sim_obj_lock);
	return rc;
}

CUresult sim_impl_cuFuncGetAttribute(int *v, int attr, CUfunction f)
{
	return sim_func_attr(v, attr, f);
}

CUresult sim_impl_cuFuncSetAttribute(CUfunction f, int attr, int v)
{
	return sim_func_set(f, attr, v);
}

CUresult sim_impl_cuKernelGetAttribute(int *v, int attr, CUkernel k, CUdevice dev)
{
	CUresult rc = sim_check_dev(dev);

	return rc == CUDA_SUCCESS ? sim_func_attr(v, attr, k) : rc;
}

CUresult sim_impl_cuKernelSetAttribute(int attr, int v, CUkernel k, CUdevice dev)
{
	CUresult rc = sim_check_dev(dev);

	return rc == CUDA_SUCCESS ? sim_func_set(k, attr, v) : rc;
}

static CUresult sim_func_known(const void *f)
{
	struct sim_obj seen;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	return sim_obj_lookup(f, SIM_OBJ_FUNC, false, &seen) ? CUDA_SUCCESS
							     : CUDA_ERROR_INVALID_HANDLE;
}

CUresult sim_impl_cuFuncSetCacheConfig(CUfunction f, int config)
{
	(void)config;
	return sim_func_known(f);
}

CUresult sim_impl_cuKernelSetCacheConfig(CUkernel k, int config, CUdevice dev)
{
	CUresult rc = sim_check_dev(dev);

	(void)config;
	return rc == CUDA_SUCCESS ? sim_func_known(k) : rc;
}

CUresult sim_impl_cuFuncIsLoaded(int *state, CUfunction f)
{
	CUresult rc = state ? sim_func_known(f) : CUDA_ERROR_INVALID_VALUE;

	if (rc == CUDA_SUCCESS)
		*state = 1; /* CU_FUNCTION_LOADING_STATE_LOADED */
	return rc;
}

CUresult sim_impl_cuFuncLoad(CUfunction f)
{
	return sim_func_known(f);
}

/*
 * Occupancy, from an H100's limits: 2048 threads, 32 blocks and 228 KiB of
 * shared memory per multiprocessor.
 */
#define SIM_SM_THREADS 2048
#define SIM_SM_BLOCKS 32
#define SIM_SM_SMEM 233472

static int sim_blocks_per_sm(int block, size_t smem)
{
	int n;

	if (block <= 0)
		return 0;
	n = SIM_SM_THREADS / block;
	if (n > SIM_SM_BLOCKS)
		n = SIM_SM_BLOCKS;
	if (smem && (size_t)n > SIM_SM_SMEM / smem)
		n = (int)(SIM_SM_SMEM / smem);
	return n;
}

CUresult sim_impl_cuOccupancyMaxActiveBlocksPerMultiprocessor(int *n, CUfunction f, int block,
							      size_t smem)
{
	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!n || !f || block <= 0 || block > 1024)
		return CUDA_ERROR_INVALID_VALUE;
	*n = sim_blocks_per_sm(block, smem);
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int *n, CUfunction f,
								       int block, size_t smem,
								       unsigned int flags)
{
	(void)flags;
	return sim_impl_cuOccupancyMaxActiveBlocksPerMultiprocessor(n, f, block, smem);
}

CUresult sim_impl_cuOccupancyMaxPotentialBlockSize(int *grid, int *block, CUfunction f,
						   sim_smem_fn smem_fn, size_t smem, int limit)
{
	int b = limit > 0 && limit < 1024 ? limit : 1024;
	size_t shared;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!grid || !block || !f)
		return CUDA_ERROR_INVALID_VALUE;
	shared = smem_fn ? smem_fn(b) : smem;
	*block = b;
	*grid = sim_blocks_per_sm(b, shared) * 132;
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuOccupancyMaxPotentialBlockSizeWithFlags(int *grid, int *block, CUfunction f,
							    sim_smem_fn smem_fn, size_t smem,
							    int limit, unsigned int flags)
{
	(void)flags;
	return sim_impl_cuOccupancyMaxPotentialBlockSize(grid, block, f, smem_fn, smem, limit);
}

CUresult sim_impl_cuOccupancyAvailableDynamicSMemPerBlock(size_t *bytes, CUfunction f, int nblocks,
							  int block)
{
	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!bytes || !f || nblocks <= 0 || block <= 0)
		return CUDA_ERROR_INVALID_VALUE;
	*bytes = SIM_SM_SMEM / (size_t)nblocks;
	if (*bytes > 232448)
		*bytes = 232448;
	return CUDA_SUCCESS;
}

/* The cluster queries: their checks, then the one answer each has. */
static CUresult sim_cluster_answer(int *n, CUfunction f, const void *config, int answer)
{
	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!n || !f || !config)
		return CUDA_ERROR_INVALID_VALUE;
	*n = answer;
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuOccupancyMaxActiveClusters(int *n, CUfunction f, const void *config)
{
	return sim_cluster_answer(n, f, config, 132);
}

CUresult sim_impl_cuOccupancyMaxPotentialClusterSize(int *n, CUfunction f, const void *config)
{
	return sim_cluster_answer(n, f, config, 8); /* the portable cluster size limit */
}
