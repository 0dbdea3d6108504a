/*
 * The private tables the CUDA runtime asks cuGetExportTable for, by UUID.
 * They are undocumented; what each slot must do was measured against real
 * libcudart 13.0.96 and PyTorch 2.14.1 (docs/simulator.md lists them). A
 * table the simulator does not know is refused with CUDA_ERROR_INVALID_VALUE,
 * as the real driver refuses an unknown UUID. Slots the simulator has no
 * behaviour for are traced when called, so a new release that calls one
 * shows it in the trace.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "sim_internal.h"
#include "sim_registry.h"

/* Slots with no known behaviour: each says which it is in the trace. */
#define SIM_SLOT_STUB(table, n, rc)                                                    \
	static CUresult sim_##table##_slot##n(void *a0, void *a1, void *a2, void *a3)  \
	{                                                                              \
		sim_trace(#table "[" #n "](%p, %p, %p, %p) = %d", a0, a1, a2, a3, rc); \
		return rc;                                                             \
	}

/* CUDART_INTERFACE */

/*
 * Slot 2: the device's primary-context handle, without retaining it or
 * making it current; asked once per device as the runtime enumerates them.
 */
static CUresult sim_cudart_primary(CUcontext *out, CUdevice dev)
{
	CUresult rc = sim_primary_handle(out, dev);

	sim_trace("cudart_interface[2](%p->%p, %d) = %d", (void *)out,
		  rc == CUDA_SUCCESS ? (void *)*out : NULL, dev, rc);
	return rc;
}

SIM_SLOT_STUB(cudart_interface, 1, CUDA_ERROR_NOT_SUPPORTED)
SIM_SLOT_STUB(cudart_interface, 3, CUDA_ERROR_NOT_SUPPORTED)
SIM_SLOT_STUB(cudart_interface, 4, CUDA_ERROR_NOT_SUPPORTED)
SIM_SLOT_STUB(cudart_interface, 5, CUDA_ERROR_NOT_SUPPORTED)
SIM_SLOT_STUB(cudart_interface, 6, CUDA_ERROR_NOT_SUPPORTED)
SIM_SLOT_STUB(cudart_interface, 7, CUDA_ERROR_NOT_SUPPORTED)
SIM_SLOT_STUB(cudart_interface, 8, CUDA_ERROR_NOT_SUPPORTED)
SIM_SLOT_STUB(cudart_interface, 9, CUDA_ERROR_NOT_SUPPORTED)
SIM_SLOT_STUB(cudart_interface, 10, CUDA_ERROR_NOT_SUPPORTED)
SIM_SLOT_STUB(cudart_interface, 11, CUDA_ERROR_NOT_SUPPORTED)
SIM_SLOT_STUB(cudart_interface, 12, CUDA_ERROR_NOT_SUPPORTED)

/* clang-format off */
static const void *sim_cudart_interface[] = {
	(void *)(13 * sizeof(void *)),
	(void *)sim_cudart_interface_slot1,
	(void *)sim_cudart_primary,
	(void *)sim_cudart_interface_slot3,
	(void *)sim_cudart_interface_slot4,
	(void *)sim_cudart_interface_slot5,
	(void *)sim_cudart_interface_slot6,
	(void *)sim_cudart_interface_slot7,
	(void *)sim_cudart_interface_slot8,
	(void *)sim_cudart_interface_slot9,
	(void *)sim_cudart_interface_slot10,
	(void *)sim_cudart_interface_slot11,
	(void *)sim_cudart_interface_slot12,
};
/* clang-format on */

/* TOOLS_RUNTIME_CALLBACK_HOOKS */

/*
 * Slots 2 and 6 hand out a buffer and its entry count. Left unfilled, the
 * runtime reports cudaErrorInsufficientDriver (35); fewer than 523 entries
 * crash it. 1024 entries of 4 bytes is what was measured to work.
 */
#define SIM_HOOK_ENTRIES 1024
static uint32_t sim_hook_buf_a[SIM_HOOK_ENTRIES];
static uint32_t sim_hook_buf_b[SIM_HOOK_ENTRIES];

static CUresult sim_hooks_buffer(int slot, uint32_t *buf, void **out, size_t *n)
{
	if (out)
		*out = buf;
	if (n)
		*n = SIM_HOOK_ENTRIES;
	sim_trace("callback_hooks[%d](%p->%p, %p->%d) = 0", slot, (void *)out, (void *)buf,
		  (void *)n, SIM_HOOK_ENTRIES);
	return CUDA_SUCCESS;
}

static CUresult sim_hooks_slot2(void **out, size_t *n)
{
	return sim_hooks_buffer(2, sim_hook_buf_a, out, n);
}

static CUresult sim_hooks_slot6(void **out, size_t *n)
{
	return sim_hooks_buffer(6, sim_hook_buf_b, out, n);
}

/* The other slots register tool callbacks: there are no tools to call. */
SIM_SLOT_STUB(callback_hooks, 1, CUDA_SUCCESS)
SIM_SLOT_STUB(callback_hooks, 3, CUDA_SUCCESS)
SIM_SLOT_STUB(callback_hooks, 4, CUDA_SUCCESS)
SIM_SLOT_STUB(callback_hooks, 5, CUDA_SUCCESS)
SIM_SLOT_STUB(callback_hooks, 7, CUDA_SUCCESS)

/* clang-format off */
static const void *sim_callback_hooks[] = {
	(void *)(8 * sizeof(void *)),
	(void *)sim_callback_hooks_slot1,
	(void *)sim_hooks_slot2,
	(void *)sim_callback_hooks_slot3,
	(void *)sim_callback_hooks_slot4,
	(void *)sim_callback_hooks_slot5,
	(void *)sim_hooks_slot6,
	(void *)sim_callback_hooks_slot7,
};
/* clang-format on */

/* TOOLS_TLS: slot 2 hands out the tools' thread state; there is none. */
static CUresult sim_tools_tls_get(void **out)
{
	if (out)
		*out = NULL;
	sim_trace("tools_tls[2](%p->NULL) = 0", (void *)out);
	return CUDA_SUCCESS;
}

SIM_SLOT_STUB(tools_tls, 1, CUDA_SUCCESS)
SIM_SLOT_STUB(tools_tls, 3, CUDA_SUCCESS)

static const void *sim_tools_tls[] = {
	(void *)(4 * sizeof(void *)),
	(void *)sim_tools_tls_slot1,
	(void *)sim_tools_tls_get,
	(void *)sim_tools_tls_slot3,
};

/*
 * CONTEXT_LOCAL_STORAGE: the runtime's per-context state. Slot 0 is a
 * function here, not a size. A missing key answers CUDA_ERROR_INVALID_HANDLE:
 * that is how the runtime finds a context it has not set up yet. Entries
 * are keyed by the context's id, never its handle, so a context made at a
 * freed one's address starts empty; a context's entries go with it
 * (sim_cls_drop). Destructors are not called: their prototype is unknown,
 * and a context's teardown ends the runtime's use of the state anyway.
 */
struct sim_cls {
	struct sim_cls *next;
	uint64_t ctx;
	void *key;
	void *value;
};

static pthread_mutex_t sim_cls_lock = PTHREAD_MUTEX_INITIALIZER;
static struct sim_cls *sim_cls_list;

/* With sim_cls_lock held. */
static struct sim_cls **sim_cls_find(uint64_t ctx, void *key)
{
	struct sim_cls **pp;

	for (pp = &sim_cls_list; *pp && ((*pp)->ctx != ctx || (*pp)->key != key); pp = &(*pp)->next)
		;
	return pp;
}

static CUresult sim_cls_put(CUcontext ctx, void *key, void *value, void *dtor)
{
	struct sim_cls **pp, *e;
	CUresult rc = CUDA_SUCCESS;
	uint64_t id;

	if (!sim_ctx_id(ctx, &id)) {
		rc = CUDA_ERROR_INVALID_CONTEXT;
		goto out;
	}
	pthread_mutex_lock(&sim_cls_lock);
	pp = sim_cls_find(id, key);
	e = *pp;
	if (!e) {
		e = calloc(1, sizeof(*e));
		if (e) {
			e->ctx = id;
			e->key = key;
			e->next = sim_cls_list;
			sim_cls_list = e;
		}
	}
	if (e)
		e->value = value;
	else
		rc = CUDA_ERROR_OUT_OF_MEMORY;
	pthread_mutex_unlock(&sim_cls_lock);
out:
	sim_trace("context_storage[0](%p, %p, %p, %p) = %d", (void *)ctx, key, value, dtor, rc);
	return rc;
}

static CUresult sim_cls_delete(CUcontext ctx, void *key)
{
	CUresult rc = CUDA_ERROR_INVALID_HANDLE;
	struct sim_cls **pp, *e = NULL;
	uint64_t id;

	if (sim_ctx_id(ctx, &id)) {
		pthread_mutex_lock(&sim_cls_lock);
		pp = sim_cls_find(id, key);
		e = *pp;
		if (e)
			*pp = e->next;
		pthread_mutex_unlock(&sim_cls_lock);
	} else {
		rc = CUDA_ERROR_INVALID_CONTEXT;
	}
	if (e)
		rc = CUDA_SUCCESS;
	free(e);
	sim_trace("context_storage[1](%p, %p) = %d", (void *)ctx, key, rc);
	return rc;
}

static CUresult sim_cls_get(void **value, CUcontext ctx, void *key)
{
	CUresult rc = CUDA_ERROR_INVALID_HANDLE;
	struct sim_cls *e;
	uint64_t id;

	if (!value) {
		rc = CUDA_ERROR_INVALID_VALUE;
	} else if (!sim_ctx_id(ctx, &id)) {
		rc = CUDA_ERROR_INVALID_CONTEXT;
	} else {
		pthread_mutex_lock(&sim_cls_lock);
		e = *sim_cls_find(id, key);
		if (e) {
			*value = e->value;
			rc = CUDA_SUCCESS;
		}
		pthread_mutex_unlock(&sim_cls_lock);
	}
	sim_trace("context_storage[2](%p->%p, %p, %p) = %d", (void *)value,
		  rc == CUDA_SUCCESS ? *value : NULL, (void *)ctx, key, rc);
	return rc;
}

/* In a forked child: the storage's lock, which another thread may have held, anew. */
static void sim_cls_after_fork(void)
{
	pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;

	sim_cls_lock = fresh;
}

/* A context's runtime state goes with the context. */
static void sim_cls_drop(uint64_t ctx)
{
	struct sim_cls **pp, *e;

	pthread_mutex_lock(&sim_cls_lock);
	for (pp = &sim_cls_list; (e = *pp);) {
		if (e->ctx == ctx) {
			*pp = e->next;
			free(e);
		} else {
			pp = &e->next;
		}
	}
	pthread_mutex_unlock(&sim_cls_lock);
}

SIM_SLOT_STUB(context_storage, 3, CUDA_ERROR_NOT_SUPPORTED)

static const void *sim_context_storage[] = {
	(void *)sim_cls_put,
	(void *)sim_cls_delete,
	(void *)sim_cls_get,
	(void *)sim_context_storage_slot3,
};

/* CONTEXT_CHECKS */
static CUresult sim_ctx_checks_2(CUcontext ctx, uint32_t *r1, void **r2)
{
	if (r1)
		*r1 = 0;
	sim_trace("context_checks[2](%p, %p->0, %p) = 0", (void *)ctx, (void *)r1, (void *)r2);
	return CUDA_SUCCESS;
}

static CUresult sim_ctx_checks_3(void)
{
	sim_trace("context_checks[3]() = 0");
	return CUDA_SUCCESS;
}

SIM_SLOT_STUB(context_checks, 1, CUDA_SUCCESS)

static const void *sim_context_checks[] = {
	(void *)(4 * sizeof(void *)),
	(void *)sim_context_checks_slot1,
	(void *)sim_ctx_checks_2,
	(void *)sim_ctx_checks_3,
};

/*
 * INTEGRITY_CHECK: the runtime computes the same value from the same inputs
 * and compares, refusing to run (cudaErrorSoftwareValidityNotEstablished,
 * 103) on a mismatch. The value is HMAC-MD2 (RFC 2104 over RFC 1319) under
 * a fixed key, of a record of the driver's and caller's state followed by
 * each device's identity.
 */
/* clang-format off */
static const uint8_t sim_md2_s[256] = {
	0x29, 0x2e, 0x43, 0xc9, 0xa2, 0xd8, 0x7c, 0x01, 0x3d, 0x36, 0x54, 0xa1, 0xec, 0xf0, 0x06, 0x13,
	0x62, 0xa7, 0x05, 0xf3, 0xc0, 0xc7, 0x73, 0x8c, 0x98, 0x93, 0x2b, 0xd9, 0xbc, 0x4c, 0x82, 0xca,
	0x1e, 0x9b, 0x57, 0x3c, 0xfd, 0xd4, 0xe0, 0x16, 0x67, 0x42, 0x6f, 0x18, 0x8a, 0x17, 0xe5, 0x12,
	0xbe, 0x4e, 0xc4, 0xd6, 0xda, 0x9e, 0xde, 0x49, 0xa0, 0xfb, 0xf5, 0x8e, 0xbb, 0x2f, 0xee, 0x7a,
	0xa9, 0x68, 0x79, 0x91, 0x15, 0xb2, 0x07, 0x3f, 0x94, 0xc2, 0x10, 0x89, 0x0b, 0x22, 0x5f, 0x21,
	0x80, 0x7f, 0x5d, 0x9a, 0x5a, 0x90, 0x32, 0x27, 0x35, 0x3e, 0xcc, 0xe7, 0xbf, 0xf7, 0x97, 0x03,
	0xff, 0x19, 0x30, 0xb3, 0x48, 0xa5, 0xb5, 0xd1, 0xd7, 0x5e, 0x92, 0x2a, 0xac, 0x56, 0xaa, 0xc6,
	0x4f, 0xb8, 0x38, 0xd2, 0x96, 0xa4, 0x7d, 0xb6, 0x76, 0xfc, 0x6b, 0xe2, 0x9c, 0x74, 0x04, 0xf1,
	0x45, 0x9d, 0x70, 0x59, 0x64, 0x71, 0x87, 0x20, 0x86, 0x5b, 0xcf, 0x65, 0xe6, 0x2d, 0xa8, 0x02,
	0x1b, 0x60, 0x25, 0xad, 0xae, 0xb0, 0xb9, 0xf6, 0x1c, 0x46, 0x61, 0x69, 0x34, 0x40, 0x7e, 0x0f,
	0x55, 0x47, 0xa3, 0x23, 0xdd, 0x51, 0xaf, 0x3a, 0xc3, 0x5c, 0xf9, 0xce, 0xba, 0xc5, 0xea, 0x26,
	0x2c, 0x53, 0x0d, 0x6e, 0x85, 0x28, 0x84, 0x09, 0xd3, 0xdf, 0xcd, 0xf4, 0x41, 0x81, 0x4d, 0x52,
	0x6a, 0xdc, 0x37, 0xc8, 0x6c, 0xc1, 0xab, 0xfa, 0x24, 0xe1, 0x7b, 0x08, 0x0c, 0xbd, 0xb1, 0x4a,
	0x78, 0x88, 0x95, 0x8b, 0xe3, 0x63, 0xe8, 0x6d, 0xe9, 0xcb, 0xd5, 0xfe, 0x3b, 0x00, 0x1d, 0x39,
	0xf2, 0xef, 0xb7, 0x0e, 0x66, 0x58, 0xd0, 0xe4, 0xa6, 0x77, 0x72, 0xf8, 0xeb, 0x75, 0x4b, 0x0a,
	0x31, 0x44, 0x50, 0xb4, 0x8f, 0xed, 0x1f, 0x1a, 0xdb, 0x99, 0x8d, 0x33, 0x9f, 0x11, 0x83, 0x14,
};
/* clang-format on */

#define SIM_MD2_BLOCK 16

struct sim_md2 {
	uint8_t x[48]; /* the state; its first 16 bytes are the digest */
	uint8_t checksum[SIM_MD2_BLOCK];
	uint8_t buf[SIM_MD2_BLOCK];
	size_t nbuf;
};

/* RFC 1319 step 4 for one block. */
static void sim_md2_compress(struct sim_md2 *m, const uint8_t *block)
{
	unsigned int j, k, t;

	for (j = 0; j < SIM_MD2_BLOCK; j++) {
		m->x[16 + j] = block[j];
		m->x[32 + j] = (uint8_t)(m->x[16 + j] ^ m->x[j]);
	}
	for (t = 0, j = 0; j < 18; j++) {
		for (k = 0; k < 48; k++)
			t = m->x[k] ^= sim_md2_s[t];
		t = (t + j) & 0xff;
	}
}

/* A message block: it goes into the checksum (step 2) and the state. */
static void sim_md2_block(struct sim_md2 *m, const uint8_t *block)
{
	uint8_t l = m->checksum[SIM_MD2_BLOCK - 1];
	unsigned int j;

	/* As RFC 1319's reference code (and its erratum): the byte is xored in. */
	for (j = 0; j < SIM_MD2_BLOCK; j++)
		l = m->checksum[j] ^= sim_md2_s[block[j] ^ l];
	sim_md2_compress(m, block);
}

static void sim_md2_update(struct sim_md2 *m, const void *data, size_t len)
{
	const uint8_t *p = data;

	while (len--) {
		m->buf[m->nbuf++] = *p++;
		if (m->nbuf == SIM_MD2_BLOCK) {
			sim_md2_block(m, m->buf);
			m->nbuf = 0;
		}
	}
}

/* Padding (i bytes of value i), then the checksum as a last block. */
static void sim_md2_final(struct sim_md2 *m, uint8_t digest[SIM_MD2_BLOCK])
{
	uint8_t pad[SIM_MD2_BLOCK];
	size_t n = SIM_MD2_BLOCK - m->nbuf;

	memset(pad, (int)n, n);
	sim_md2_update(m, pad, n);
	memcpy(pad, m->checksum, sizeof(pad));
	sim_md2_compress(m, pad);
	memcpy(digest, m->x, SIM_MD2_BLOCK);
}

static const uint8_t sim_integrity_key[SIM_MD2_BLOCK] = {
	0x14, 0x6a, 0xdd, 0xae, 0x53, 0xa9, 0xa7, 0x52,
	0xaa, 0x08, 0x41, 0x36, 0x0b, 0xf5, 0x5a, 0x9f,
};

/* RFC 2104 with MD2's 16-byte block: the key is exactly one block long. */
static void sim_hmac_md2(const void *msg, size_t len, uint8_t mac[SIM_MD2_BLOCK])
{
	uint8_t pad[SIM_MD2_BLOCK], inner[SIM_MD2_BLOCK];
	struct sim_md2 m;
	unsigned int i;

	memset(&m, 0, sizeof(m));
	for (i = 0; i < SIM_MD2_BLOCK; i++)
		pad[i] = sim_integrity_key[i] ^ 0x36;
	sim_md2_update(&m, pad, sizeof(pad));
	sim_md2_update(&m, msg, len);
	sim_md2_final(&m, inner);
	memset(&m, 0, sizeof(m));
	for (i = 0; i < SIM_MD2_BLOCK; i++)
		pad[i] = sim_integrity_key[i] ^ 0x5c;
	sim_md2_update(&m, pad, sizeof(pad));
	sim_md2_update(&m, inner, sizeof(inner));
	sim_md2_final(&m, mac);
}

static const void *sim_integrity[];

struct sim_integrity_head {
	uint32_t driver_version;
	uint32_t version;
	uint32_t pid;
	uint32_t thread;
	uint64_t cudart_interface;
	uint64_t integrity_table;
	uint64_t integrity_fn;
	uint64_t unix_seconds;
};
_Static_assert(sizeof(struct sim_integrity_head) == 48, "the record is 48 bytes, unpadded");

struct sim_integrity_dev {
	uint8_t uuid[16];
	int32_t pci_domain;
	int32_t pci_bus;
	int32_t pci_device;
};
_Static_assert(sizeof(struct sim_integrity_dev) == 28, "a device is 28 bytes, unpadded");

static CUresult sim_integrity_check(uint32_t version, uint64_t unix_seconds, uint64_t out[2]);

static CUresult sim_integrity_compute(uint32_t version, uint64_t unix_seconds, uint64_t out[2])
{
	struct sim_integrity_head head;
	struct sim_integrity_dev devs[64];
	uint8_t mac[SIM_MD2_BLOCK];
	int i, count, driver;
	CUresult rc;

	/* Versions ending in 0 or 1 are answered with constants. */
	if (version % 10 == 0) {
		out[0] = 0x3341181C03CB675CULL;
		out[1] = 0x8ED383AA1F4CD1E8ULL;
		return CUDA_SUCCESS;
	}
	if (version % 10 == 1) {
		out[0] = 0x1841181C03CB675CULL;
		out[1] = 0x8ED383AA1F4CD1E8ULL;
		return CUDA_SUCCESS;
	}
	rc = sim_impl_cuDriverGetVersion(&driver);
	if (rc == CUDA_SUCCESS)
		rc = sim_impl_cuDeviceGetCount(&count);
	if (rc != CUDA_SUCCESS)
		return rc;
	if (count > 64)
		count = 64;
	head.driver_version = (uint32_t)driver;
	head.version = version;
	head.pid = (uint32_t)getpid();
	head.thread = (uint32_t)pthread_self();
	head.cudart_interface = (uint64_t)(uintptr_t)sim_cudart_interface;
	head.integrity_table = (uint64_t)(uintptr_t)sim_integrity;
	/* What the table holds, as cudart reads it, whatever that is. */
	head.integrity_fn =
		(uint64_t)(uintptr_t)__atomic_load_n(&sim_integrity[1], __ATOMIC_RELAXED);
	head.unix_seconds = unix_seconds;
	for (i = 0; i < count && rc == CUDA_SUCCESS; i++) {
		rc = sim_impl_cuDeviceGetUuid((CUuuid *)devs[i].uuid, i);
		if (rc == CUDA_SUCCESS)
			rc = sim_impl_cuDeviceGetAttribute(&devs[i].pci_domain,
							   CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID, i);
		if (rc == CUDA_SUCCESS)
			rc = sim_impl_cuDeviceGetAttribute(&devs[i].pci_bus,
							   CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, i);
		if (rc == CUDA_SUCCESS)
			rc = sim_impl_cuDeviceGetAttribute(&devs[i].pci_device,
							   CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID, i);
	}
	if (rc != CUDA_SUCCESS)
		return rc;
	{
		uint8_t msg[sizeof(head) + sizeof(devs)];

		memcpy(msg, &head, sizeof(head));
		memcpy(msg + sizeof(head), devs, (size_t)count * sizeof(devs[0]));
		sim_hmac_md2(msg, sizeof(head) + (size_t)count * sizeof(devs[0]), mac);
	}
	memcpy(out, mac, sizeof(mac));
	return CUDA_SUCCESS;
}

/* Slot 1: called with versions 13000, 13001 and 13002 by cudart 13.0. */
static CUresult sim_integrity_check(uint32_t version, uint64_t unix_seconds, uint64_t out[2])
{
	CUresult rc =
		out ? sim_integrity_compute(version, unix_seconds, out) : CUDA_ERROR_INVALID_VALUE;

	sim_trace("integrity[1](%u, %llu, %p->{%#llx, %#llx}) = %d", version,
		  (unsigned long long)unix_seconds, (void *)out,
		  rc == CUDA_SUCCESS ? (unsigned long long)out[0] : 0ULL,
		  rc == CUDA_SUCCESS ? (unsigned long long)out[1] : 0ULL, rc);
	return rc;
}

SIM_SLOT_STUB(integrity, 2, CUDA_ERROR_NOT_SUPPORTED)

static const void *sim_integrity[] = {
	(void *)(3 * sizeof(void *)),
	(void *)sim_integrity_check,
	(void *)sim_integrity_slot2,
};

/* The two cuBLASLt tables: slot 4 must succeed; it writes nothing. */
static CUresult sim_blaslt_a4(void *a0, void *a1)
{
	sim_trace("blaslt_21318c60[4](%p, %p) = 0", a0, a1);
	return CUDA_SUCCESS;
}

static CUresult sim_blaslt_b4(void *a0, void *a1)
{
	sim_trace("blaslt_1734dc26[4](%p, %p) = 0", a0, a1);
	return CUDA_SUCCESS;
}

SIM_SLOT_STUB(blaslt_a, 1, CUDA_SUCCESS)
SIM_SLOT_STUB(blaslt_a, 2, CUDA_SUCCESS)
SIM_SLOT_STUB(blaslt_a, 3, CUDA_SUCCESS)
SIM_SLOT_STUB(blaslt_b, 1, CUDA_SUCCESS)
SIM_SLOT_STUB(blaslt_b, 2, CUDA_SUCCESS)
SIM_SLOT_STUB(blaslt_b, 3, CUDA_SUCCESS)

/* clang-format off */
static const void *sim_blaslt_a[] = {
	(void *)(5 * sizeof(void *)), (void *)sim_blaslt_a_slot1, (void *)sim_blaslt_a_slot2,
	(void *)sim_blaslt_a_slot3, (void *)sim_blaslt_a4,
};

static const void *sim_blaslt_b[] = {
	(void *)(5 * sizeof(void *)), (void *)sim_blaslt_b_slot1, (void *)sim_blaslt_b_slot2,
	(void *)sim_blaslt_b_slot3, (void *)sim_blaslt_b4,
};
/* clang-format on */

/*
 * The tables by UUID, written as the trace and docs/simulator.md write
 * them: CUuuid.bytes in order, byte 0 first, in upper-case hex.
 *
 * Not here, on purpose: F8CFF951-2146-8B4E-B9E2-FB469E7C0DD9, asked first by
 * every cudart and again by the static cudart copies inside cuBLAS and
 * cuBLASLt. It is refused like an unknown UUID: success makes those copies
 * skip their own start-up.
 */
static const struct {
	const char *uuid;
	const char *name;
	const void *const *table;
	unsigned int slots;
} sim_tables[] = {
#define SIM_TABLE(uuid, name, table) { uuid, name, table, sizeof(table) / sizeof(table[0]) }
	SIM_TABLE("6BD5FB6C-5BF4-E74A-8987-D93912FD9DF9", "cudart_interface", sim_cudart_interface),
	SIM_TABLE("A094798C-2E74-2E74-93F2-0800200C0A66", "callback_hooks", sim_callback_hooks),
	SIM_TABLE("42D85A81-23F6-CB47-8298-F6E78A3AECDC", "tools_tls", sim_tools_tls),
	SIM_TABLE("C693336E-1121-DF11-A8C3-68F355D89593", "context_storage", sim_context_storage),
	SIM_TABLE("263E8860-7CD2-6143-92F6-BBD5006DFA7E", "context_checks", sim_context_checks),
	SIM_TABLE("D4082055-BDE6-704B-8D34-BA123C66E1F2", "integrity", sim_integrity),
	/*
	 * Asked by cuBLASLt as it sets up a context: refused, it loads no
	 * kernel library, finds no algorithm, and every GEMM fails with
	 * CUBLAS_STATUS_NOT_SUPPORTED. Only slot 4 is called.
	 */
	SIM_TABLE("21318C60-9714-3248-8CA6-41FF7324C8F2", "blaslt_21318c60", sim_blaslt_a),
	/* The same shape; without it the first fp16/bf16 GEMM crashes. */
	SIM_TABLE("1734DC26-800D-4745-8726-C0F1E7DD8BCA", "blaslt_1734dc26", sim_blaslt_b),
#undef SIM_TABLE
};

/* The table's slots, for the trace: every pointer handed out is logged. */
static void sim_trace_table(const char *name, const void *const *table, unsigned int slots)
{
	unsigned int i;

	for (i = 0; i < slots; i++)
		sim_trace("  %s[%u] = %p", name, i, table[i]);
}

CUresult sim_export_table(const void **table, const CUuuid *id)
{
	const unsigned char *b = (const unsigned char *)id->bytes;
	char uuid[sizeof("XXXXXXXX-XXXX-XXXX-XXXX-XXXXXXXXXXXX")];
	size_t i;

	/* The form docs/simulator.md lists the tables by, and sim_tables[] keys them by. */
	snprintf(uuid, sizeof(uuid),
		 "%02X%02X%02X%02X-%02X%02X-%02X%02X-%02X%02X-%02X%02X%02X%02X%02X%02X", b[0], b[1],
		 b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14],
		 b[15]);
	sim_trace("  table %s", uuid);

	for (i = 0; i < sizeof(sim_tables) / sizeof(sim_tables[0]); i++) {
		if (strcmp(sim_tables[i].uuid, uuid) != 0)
			continue;
		*table = sim_tables[i].table;
		if (sim_trace_on)
			sim_trace_table(sim_tables[i].name, sim_tables[i].table,
					sim_tables[i].slots);
		return CUDA_SUCCESS;
	}
	return CUDA_ERROR_INVALID_VALUE;
}

static const struct sim_hooks sim_tables_hooks = {
	.ctx_gone = sim_cls_drop,
	.fork_child = sim_cls_after_fork,
};

__attribute__((constructor)) static void sim_tables_load(void)
{
	sim_hooks_add(&sim_tables_hooks);
}
