/*
 * libcuda.so.1's exports, generated from one list (cuda_api.gen.h, made from
 * CUDA's own cuda.h by gen_api.py): every ABI name of the header is exported,
 * as the real driver exports them, because libraries such as cuBLASLt look
 * about 120 of them up by name and give up if one is missing.
 *
 * Each export forwards its arguments, as machine words, to the driver's
 * implementation sim_impl_<name> when one of its files (sim_cuda.c and
 * those beside it, see sim_driver.h) defines one; a name with none
 * answers CUDA_ERROR_NOT_SUPPORTED. That is sound on x86-64, the only ABI
 * the project builds for: every driver entry point returns CUresult and
 * takes integers and pointers, which travel in the same registers and stack
 * slots whatever their C type (the few float parameters belong to texture
 * references, which are never implemented). The implementations are weak
 * references, so a missing one is a null pointer, never a link error.
 *
 * Every call is traced here when GPUSHARE_SIM_TRACE is set: one place sees
 * them all, with their arguments, out-values and return codes.
 */
#include <stddef.h>
#include <stdint.h>

#define SIM_EXPORT_LAYER
#include "sim_internal.h"

#define SIM_P0 void
#define SIM_P1 uintptr_t a0
#define SIM_P2 SIM_P1, uintptr_t a1
#define SIM_P3 SIM_P2, uintptr_t a2
#define SIM_P4 SIM_P3, uintptr_t a3
#define SIM_P5 SIM_P4, uintptr_t a4
#define SIM_P6 SIM_P5, uintptr_t a5
#define SIM_P7 SIM_P6, uintptr_t a6
#define SIM_P8 SIM_P7, uintptr_t a7
#define SIM_P9 SIM_P8, uintptr_t a8
#define SIM_P10 SIM_P9, uintptr_t a9
#define SIM_P11 SIM_P10, uintptr_t a10
#define SIM_P12 SIM_P11, uintptr_t a11
#define SIM_P13 SIM_P12, uintptr_t a12
#define SIM_P14 SIM_P13, uintptr_t a13
#define SIM_P15 SIM_P14, uintptr_t a14
#define SIM_P16 SIM_P15, uintptr_t a15

/* The arguments passed on, and the same with a leading comma for an initializer. */
#define SIM_A0
#define SIM_A1 a0
#define SIM_A2 SIM_A1, a1
#define SIM_A3 SIM_A2, a2
#define SIM_A4 SIM_A3, a3
#define SIM_A5 SIM_A4, a4
#define SIM_A6 SIM_A5, a5
#define SIM_A7 SIM_A6, a6
#define SIM_A8 SIM_A7, a7
#define SIM_A9 SIM_A8, a8
#define SIM_A10 SIM_A9, a9
#define SIM_A11 SIM_A10, a10
#define SIM_A12 SIM_A11, a11
#define SIM_A13 SIM_A12, a12
#define SIM_A14 SIM_A13, a13
#define SIM_A15 SIM_A14, a14
#define SIM_A16 SIM_A15, a15
#define SIM_L0
#define SIM_L1 , SIM_A1
#define SIM_L2 , SIM_A2
#define SIM_L3 , SIM_A3
#define SIM_L4 , SIM_A4
#define SIM_L5 , SIM_A5
#define SIM_L6 , SIM_A6
#define SIM_L7 , SIM_A7
#define SIM_L8 , SIM_A8
#define SIM_L9 , SIM_A9
#define SIM_L10 , SIM_A10
#define SIM_L11 , SIM_A11
#define SIM_L12 , SIM_A12
#define SIM_L13 , SIM_A13
#define SIM_L14 , SIM_A14
#define SIM_L15 , SIM_A15
#define SIM_L16 , SIM_A16

/*
 * Both ways the call is a tail call with no frame of its own: untraced, the
 * implementation gets the caller's very arguments, stack ones included, with
 * nothing copied (launches are hot); traced, a cold function of its own does
 * the call and logs it.
 */
#define SIM_ENTRY(name, n, kinds)                                                               \
	extern CUresult sim_impl_##name(SIM_P##n) __attribute__((weak, visibility("hidden")));  \
	static __attribute__((noinline, cold)) CUresult sim_traced_##name(SIM_P##n)             \
	{                                                                                       \
		CUresult rc =                                                                   \
			sim_impl_##name ? sim_impl_##name(SIM_A##n) : CUDA_ERROR_NOT_SUPPORTED; \
		const uintptr_t args[] = { 0 SIM_L##n };                                        \
                                                                                                \
		sim_trace_call(#name, kinds, args + 1, rc);                                     \
		return rc;                                                                      \
	}                                                                                       \
	SIM_EXPORT CUresult name(SIM_P##n);                                                     \
	SIM_EXPORT CUresult name(SIM_P##n)                                                      \
	{                                                                                       \
		if (__builtin_expect(sim_trace_on, 0))                                          \
			return sim_traced_##name(SIM_A##n);                                     \
		return sim_impl_##name ? sim_impl_##name(SIM_A##n) : CUDA_ERROR_NOT_SUPPORTED;  \
	}
#include "cuda_api.gen.h"
#undef SIM_ENTRY

#define SIM_PROC(base, abi, version, per_thread) { #base, #abi, version, per_thread, (void *)abi },
const struct sim_proc sim_procs[] = {
#include "cuda_api.gen.h"
};
#undef SIM_PROC

const unsigned int sim_nprocs = sizeof(sim_procs) / sizeof(sim_procs[0]);
