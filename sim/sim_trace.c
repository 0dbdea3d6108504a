/*
 * The trace: with GPUSHARE_SIM_TRACE=FILE every call into the simulated
 * driver is appended to FILE as one line, with the caller's pid and thread,
 * the entry point, its arguments, what it handed out through its out
 * parameters and its return code. Export-table slots log their own calls
 * the same way. It is how a new CUDA or framework release that stops on the
 * simulator gets diagnosed: the last calls before a failure, and any
 * CUDA_ERROR_NOT_SUPPORTED (801) answer, say what is missing.
 *
 * Each line is one write(2) to a file opened with O_APPEND, so the lines of
 * several processes (DataLoader workers, spawned children) and threads
 * interleave whole.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "sim_internal.h"

int sim_trace_on;
static int sim_trace_fd = -1;

__attribute__((constructor)) static void sim_trace_open(void)
{
	const char *path = getenv(SIM_TRACE_ENV);

	if (!path || !*path)
		return;
	sim_trace_fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
	if (sim_trace_fd < 0) {
		fprintf(stderr, "gpushare sim: %s=%s: cannot open it, not tracing\n", SIM_TRACE_ENV,
			path);
		return;
	}
	sim_trace_on = 1;
}

#define SIM_TRACE_LINE 1024

static void sim_trace_vline(const char *fmt, va_list ap)
{
	char line[SIM_TRACE_LINE];
	int n, m;

	n = snprintf(line, sizeof(line), "%d %ld ", (int)getpid(), (long)syscall(SYS_gettid));
	m = vsnprintf(line + n, sizeof(line) - (size_t)n - 1, fmt, ap);
	if (m < 0)
		m = 0;
	n += m;
	if (n > (int)sizeof(line) - 2)
		n = (int)sizeof(line) - 2;
	line[n++] = '\n';
	if (write(sim_trace_fd, line, (size_t)n) < 0) {
		/* Nowhere to say it: a trace that cannot be written is simply lost. */
	}
}

void sim_trace(const char *fmt, ...)
{
	va_list ap;

	if (!sim_trace_on)
		return;
	va_start(ap, fmt);
	sim_trace_vline(fmt, ap);
	va_end(ap);
}

/* Appends to buf at *len, never past size. */
static void sim_append(char *buf, size_t size, size_t *len, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));

static void sim_append(char *buf, size_t size, size_t *len, const char *fmt, ...)
{
	va_list ap;
	int n;

	if (*len >= size)
		return;
	va_start(ap, fmt);
	n = vsnprintf(buf + *len, size - *len, fmt, ap);
	va_end(ap);
	if (n > 0)
		*len = *len + (size_t)n < size ? *len + (size_t)n : size;
}

/*
 * Out parameters are read only after a successful call: then the caller's
 * pointer was good, and the value is what the driver handed out.
 */
void sim_trace_call(const char *name, const char *kinds, const uintptr_t *args, CUresult rc)
{
	char buf[SIM_TRACE_LINE - 64];
	size_t len = 0;
	unsigned int i;

	sim_append(buf, sizeof(buf), &len, "%s(", name);
	for (i = 0; kinds[i]; i++) {
		uintptr_t a = args[i];
		const char *sep = len && buf[len - 1] != '(' ? ", " : "";

		switch (kinds[i]) {
		case 'i':
			sim_append(buf, sizeof(buf), &len, "%s%d", sep, (int)(uint32_t)a);
			break;
		case 's':
			if (a)
				sim_append(buf, sizeof(buf), &len, "%s\"%.80s\"", sep,
					   (const char *)a);
			else
				sim_append(buf, sizeof(buf), &len, "%sNULL", sep);
			break;
		case 'O':
			if (a && rc == CUDA_SUCCESS)
				sim_append(buf, sizeof(buf), &len, "%s%#lx->%#llx", sep,
					   (unsigned long)a,
					   (unsigned long long)*(const uint64_t *)a);
			else
				sim_append(buf, sizeof(buf), &len, "%s%#lx", sep, (unsigned long)a);
			break;
		case 'I':
			if (a && rc == CUDA_SUCCESS)
				sim_append(buf, sizeof(buf), &len, "%s%#lx->%d", sep,
					   (unsigned long)a, *(const int *)a);
			else
				sim_append(buf, sizeof(buf), &len, "%s%#lx", sep, (unsigned long)a);
			break;
		case 'x':
			/* A register the call leaves unused (a struct went to the stack). */
			continue;
		case 'f':
			/* Passed in a vector register: not among the words forwarded. */
			sim_append(buf, sizeof(buf), &len, "%s(float)", sep);
			break;
		default:
			sim_append(buf, sizeof(buf), &len, "%s%#lx", sep, (unsigned long)a);
			break;
		}
	}
	sim_trace("%s) = %d", buf, rc);
}
