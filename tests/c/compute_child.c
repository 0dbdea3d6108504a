/*
 * A busy launcher for the compute-share tests (tests/shim/compute_child.py):
 * linked against libcuda.so.1, it takes device 0's primary context and
 * launches kernels for SECONDS, GAP_US microseconds apart (0: back to back),
 * counting launches per bin of BIN_US microseconds of CLOCK_MONOTONIC. A gap
 * well under a bin leaves the CPU to others (the pacer among them) and
 * still marks every bin in which the gate was open. Then it prints one line per bin
 * that saw a launch: "BIN_START_NS COUNT" (absolute CLOCK_MONOTONIC), and a
 * last line "done TOTAL".
 *
 *   compute_child SECONDS BIN_US GAP_US [capture]
 *
 * With "capture", the launches go to a stream that captures them into a
 * graph for the whole run (the capture ends after the last).
 *
 * It prints "ready" once its context is current (before the first launch).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cuda_abi.h"

CUresult cuInit(unsigned int);
CUresult cuDeviceGet(CUdevice *, int);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuStreamCreate(CUstream *, unsigned int);
CUresult cuStreamBeginCapture(CUstream);
CUresult cuStreamEndCapture(CUstream, void **);
CUresult cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
			unsigned, CUstream, void **, void **);

static uint64_t now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

int main(int argc, char **argv)
{
	uint64_t seconds, bin, gap, start, end, total = 0, nbins, *counts;
	struct timespec pause;
	CUstream stream = NULL;
	void *graph = NULL;
	CUcontext ctx;
	CUdevice dev;

	if (argc != 4 && !(argc == 5 && strcmp(argv[4], "capture") == 0)) {
		fprintf(stderr, "usage: compute_child SECONDS BIN_US GAP_US\n");
		return 2;
	}
	seconds = strtoull(argv[1], NULL, 10);
	bin = strtoull(argv[2], NULL, 10) * 1000u;
	gap = strtoull(argv[3], NULL, 10) * 1000u;
	pause = (struct timespec){ (time_t)(gap / 1000000000u), (long)(gap % 1000000000u) };
	if (bin == 0 || cuInit(0) != CUDA_SUCCESS || cuDeviceGet(&dev, 0) != CUDA_SUCCESS ||
	    cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS ||
	    cuCtxSetCurrent(ctx) != CUDA_SUCCESS) {
		fprintf(stderr, "compute_child: no context\n");
		return 1;
	}
	if (argc == 5 && (cuStreamCreate(&stream, 0) != CUDA_SUCCESS ||
			  cuStreamBeginCapture(stream) != CUDA_SUCCESS)) {
		fprintf(stderr, "compute_child: no capture\n");
		return 1;
	}
	nbins = seconds * 1000000000u / bin + 2;
	counts = calloc(nbins, sizeof(*counts));
	if (counts == NULL)
		return 1;
	printf("ready\n");
	fflush(stdout);
	start = now_ns() / bin * bin;
	end = start + seconds * 1000000000u;
	for (uint64_t t = now_ns(); t < end; t = now_ns()) {
		if (cuLaunchKernel((CUfunction)0x1, 1, 1, 1, 1, 1, 1, 0, stream, NULL, NULL) !=
		    CUDA_SUCCESS) {
			fprintf(stderr, "compute_child: launch failed\n");
			return 1;
		}
		/* Counted when the launch returned: a gated launch counts where it went. */
		t = now_ns();
		if (t < end)
			counts[(t - start) / bin]++;
		total++;
		if (gap != 0)
			nanosleep(&pause, NULL);
	}
	if (stream != NULL && cuStreamEndCapture(stream, &graph) != CUDA_SUCCESS) {
		fprintf(stderr, "compute_child: capture not ended\n");
		return 1;
	}
	for (uint64_t i = 0; i < nbins; i++)
		if (counts[i] != 0)
			printf("%llu %llu\n", (unsigned long long)(start + i * bin),
			       (unsigned long long)counts[i]);
	printf("done %llu\n", (unsigned long long)total);
	return 0;
}
