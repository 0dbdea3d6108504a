/*
 * A stand-in libcuda.so.1 that has some of the shim's hooked entry points and
 * lacks others, as an older driver lacks newer ones (the real 535 driver has
 * no cuCtxCreate_v4): what a global lookup sees must not depend on a driver
 * being installed. It has cuInit and cuCtxCreate_v2 and nothing else.
 */
typedef int CUresult;

CUresult cuInit(unsigned int flags)
{
	(void)flags;
	return 100; /* CUDA_ERROR_NO_DEVICE, as the real driver without a GPU */
}

CUresult cuCtxCreate_v2(void **ctx, unsigned int flags, int dev)
{
	(void)ctx;
	(void)flags;
	(void)dev;
	return 100;
}
