/*
 * A CUDA runtime program for the real-PyTorch tier (tests/real_torch/test_torch_sim.py):
 * cudaMalloc, cudaMemset, a trivial kernel, host->device->host copies and
 * cudaFree through the real libcudart (linked shared), one line per step:
 *
 *   STEP err=N name=cudaErrorName [detail]
 *
 * The simulated driver does not execute kernels: the launch must succeed but
 * what the kernel would have written is not there, so nothing here checks a
 * kernel's result. What the memset and the copies wrote is checked, and said
 * on their lines (match=1 or match=0).
 *
 * Exit status: 0 when every step returned cudaSuccess and the bytes matched,
 * 1 otherwise; the steps after a failed one still run where they can.
 */
#include <cuda_runtime.h>
#include <stdio.h>
#include <string.h>

#define N 4096 /* bytes, a multiple of sizeof(unsigned int) */

__global__ void add_one(unsigned int *v, int n)
{
	int i = blockIdx.x * blockDim.x + threadIdx.x;

	if (i < n)
		v[i] += 1;
}

static int failed;

static cudaError_t step(const char *name, cudaError_t err, const char *detail)
{
	printf("%s err=%d name=%s%s%s\n", name, (int)err, cudaGetErrorName(err),
	       detail ? " " : "", detail ? detail : "");
	fflush(stdout);
	if (err != cudaSuccess)
		failed = 1;
	return err;
}

/* Did the copy succeed and bring back what was wanted? Said as match=0|1. */
static const char *match(cudaError_t err, const void *got, const void *want, size_t n)
{
	int ok = err == cudaSuccess && memcmp(got, want, n) == 0;

	if (!ok)
		failed = 1;
	return ok ? "match=1" : "match=0";
}

int main(void)
{
	static unsigned char pattern[N], back[N], memset_want[N];
	unsigned char *dev = NULL, *dev2 = NULL;
	cudaError_t err;
	int count = 0, version = 0;
	size_t i;

	for (i = 0; i < N; i++)
		pattern[i] = (unsigned char)(i * 31u + 7u);
	memset(memset_want, 0x5a, N);

	step("cudaRuntimeGetVersion", cudaRuntimeGetVersion(&version), NULL);
	printf("runtime_version %d\n", version);
	if (step("cudaGetDeviceCount", cudaGetDeviceCount(&count), NULL) == cudaSuccess)
		printf("device_count %d\n", count);
	step("cudaSetDevice", cudaSetDevice(0), NULL);
	if (step("cudaMalloc", cudaMalloc((void **)&dev, N), NULL) != cudaSuccess ||
	    step("cudaMalloc2", cudaMalloc((void **)&dev2, N), NULL) != cudaSuccess) {
		printf("result fail\n");
		return 1;
	}

	/* cudaMemset, read back. */
	step("cudaMemset", cudaMemset(dev, 0x5a, N), NULL);
	memset(back, 0, N);
	err = cudaMemcpy(back, dev, N, cudaMemcpyDeviceToHost);
	step("cudaMemcpyD2H_memset", err, match(err, back, memset_want, N));

	/* The kernel: launched on dev2 (its result is not looked at, see above). */
	add_one<<<(N / 4 + 255) / 256, 256>>>((unsigned int *)dev2, N / 4);
	step("launch", cudaGetLastError(), NULL);
	step("cudaDeviceSynchronize", cudaDeviceSynchronize(), NULL);

	/* Host -> device -> device -> host. */
	step("cudaMemcpyH2D", cudaMemcpy(dev, pattern, N, cudaMemcpyHostToDevice), NULL);
	step("cudaMemcpyD2D", cudaMemcpy(dev2, dev, N, cudaMemcpyDeviceToDevice), NULL);
	memset(back, 0, N);
	err = cudaMemcpy(back, dev2, N, cudaMemcpyDeviceToHost);
	step("cudaMemcpyD2H", err, match(err, back, pattern, N));

	step("cudaFree", cudaFree(dev), NULL);
	step("cudaFree2", cudaFree(dev2), NULL);
	printf("result %s\n", failed ? "fail" : "ok");
	return failed;
}
