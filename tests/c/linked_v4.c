/*
 * A program linked with -lcuda against a driver that has cuCtxCreate_v4,
 * then run on one that lacks it: what it sees with and without the shim.
 */
#include <stdio.h>

typedef int CUresult;
CUresult cuCtxCreate_v4(void **ctx, void *params, unsigned int flags, int dev);

int main(void)
{
	void *ctx = NULL;

	printf("cuCtxCreate_v4 %d\n", cuCtxCreate_v4(&ctx, NULL, 0, 0));
	return 0;
}
