/*
 * The simulated driver's graphs: a graph is the operations recorded into it
 * (by a stream's capture, sim_streams.c), an executable graph a copy of
 * them that each launch does in order. Also graph uploads, which map the
 * memory of a graph's allocation nodes (sim_pools.c).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "sim_driver.h"

#define SIM_INSTANTIATE_AUTO_FREE_ON_LAUNCH 1ULL

/* Does op now. */
void sim_op_run(const struct sim_op *op)
{
	size_t r, i;

	switch (op->kind) {
	case SIM_OP_COPY:
		for (r = 0; r < op->height; r++)
			memmove((void *)(op->dst + r * op->dpitch),
				(const void *)(op->src + r * op->spitch), op->width);
		break;
	case SIM_OP_SET:
		for (r = 0; r < op->height; r++) {
			uintptr_t row = op->dst + r * op->dpitch;

			if (op->elem == 1) {
				memset((void *)row, (int)(op->value & 0xff), op->width);
				continue;
			}
			for (i = 0; i < op->width; i++) {
				if (op->elem == 2)
					((uint16_t *)row)[i] = (uint16_t)op->value;
				else
					((uint32_t *)row)[i] = op->value;
			}
		}
		break;
	case SIM_OP_HOST:
		op->fn(op->data);
		break;
	case SIM_OP_KERNEL:
		/* Kernels do not execute: what they would compute stays as it was. */
		break;
	case SIM_OP_GALLOC:
	case SIM_OP_GFREE:
		sim_galloc_run(op);
		break;
	}
}

/* Copies of n ops, each holding its own reference to its graph allocation; NULL if none. */
struct sim_op *sim_ops_copy(const struct sim_op *ops, size_t n, bool *failed)
{
	struct sim_op *v = n ? malloc(n * sizeof(*v)) : NULL;
	size_t i;

	*failed = n && !v;
	if (!v)
		return NULL;
	memcpy(v, ops, n * sizeof(*v));
	for (i = 0; i < n; i++)
		if (v[i].ga)
			sim_galloc_ref(v[i].ga);
	return v;
}

/* Frees n ops and their references to graph allocations. */
void sim_ops_free(struct sim_op *ops, size_t n)
{
	size_t i;

	for (i = 0; ops && i < n; i++)
		if (ops[i].ga)
			sim_galloc_unref(ops[i].ga);
	free(ops);
}

/* Appends a copy of op to g, with its own reference; false if out of memory. */
bool sim_graph_add(struct CUgraph_st *g, const struct sim_op *op)
{
	if (g->nops == g->cap) {
		size_t cap = g->cap ? g->cap * 2 : 16;
		struct sim_op *v = realloc(g->ops, cap * sizeof(*v));

		if (!v)
			return false;
		g->ops = v;
		g->cap = cap;
	}
	g->ops[g->nops++] = *op;
	if (op->ga)
		sim_galloc_ref(op->ga);
	return true;
}

/* An empty graph, not on the list yet; NULL if out of memory. */
struct CUgraph_st *sim_graph_new(void)
{
	return sim_obj_new(sizeof(struct CUgraph_st), SIM_OBJ_GRAPH, 0);
}

CUresult sim_impl_cuGraphCreate(CUgraph *pg, unsigned int flags)
{
	struct CUgraph_st *g;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!pg || flags != 0)
		return CUDA_ERROR_INVALID_VALUE;
	g = sim_graph_new();
	if (!g)
		return CUDA_ERROR_OUT_OF_MEMORY;
	sim_obj_add(&g->obj);
	*pg = g;
	return CUDA_SUCCESS;
}

void sim_graph_free(struct CUgraph_st *g)
{
	if (g)
		sim_ops_free(g->ops, g->nops);
	free(g);
}

CUresult sim_impl_cuGraphDestroy(CUgraph g)
{
	struct sim_obj *o;
	CUresult rc = sim_obj_take(g, SIM_OBJ_GRAPH, CUDA_ERROR_INVALID_VALUE, &o);

	if (rc == CUDA_SUCCESS)
		sim_graph_free((struct CUgraph_st *)o);
	return rc;
}

CUresult sim_impl_cuGraphGetNodes(CUgraph g, void **nodes, size_t *n)
{
	struct CUgraph_st copy;
	CUresult rc = sim_check_args(n != NULL);
	size_t i;

	if (rc != CUDA_SUCCESS)
		return rc;
	if (!sim_obj_copy(g, SIM_OBJ_GRAPH, &copy, sizeof(copy)))
		return CUDA_ERROR_INVALID_VALUE;
	/* Node handles are the graph's address and the node's position: opaque, distinct. */
	for (i = 0; nodes && i < *n; i++)
		nodes[i] = i < copy.nops ? (char *)g + i + 1 : NULL;
	*n = copy.nops;
	return CUDA_SUCCESS;
}

static CUresult sim_instantiate(CUgraphExec *pe, CUgraph g, uint64_t flags)
{
	struct CUgraphExec_st *e;
	struct sim_obj **pp;
	CUresult rc = CUDA_SUCCESS;

	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!pe)
		return CUDA_ERROR_INVALID_VALUE;
	e = sim_obj_new(sizeof(*e), SIM_OBJ_EXEC, 0);
	if (!e)
		return CUDA_ERROR_OUT_OF_MEMORY;
	e->autofree = flags & SIM_INSTANTIATE_AUTO_FREE_ON_LAUNCH;
	pthread_mutex_lock(&sim_obj_lock);
	pp = sim_obj_find(g, SIM_OBJ_GRAPH);
	if (!pp) {
		rc = CUDA_ERROR_INVALID_VALUE;
	} else {
		const struct CUgraph_st *src = (const struct CUgraph_st *)*pp;
		bool failed;

		e->nops = src->nops;
		e->ops = sim_ops_copy(src->ops, src->nops, &failed);
		if (failed)
			rc = CUDA_ERROR_OUT_OF_MEMORY;
	}
	pthread_mutex_unlock(&sim_obj_lock);
	if (rc != CUDA_SUCCESS) {
		free(e);
		return rc;
	}
	sim_obj_add(&e->obj);
	*pe = e;
	return CUDA_SUCCESS;
}

CUresult sim_impl_cuGraphInstantiateWithFlags(CUgraphExec *pe, CUgraph g, unsigned long long flags)
{
	return sim_instantiate(pe, g, flags);
}

CUresult sim_impl_cuGraphInstantiate(CUgraphExec *pe, CUgraph g, void *err_node, char *log,
				     size_t log_size)
{
	(void)err_node;
	if (log && log_size)
		log[0] = '\0';
	return sim_instantiate(pe, g, 0);
}

CUresult sim_impl_cuGraphInstantiate_v2(CUgraphExec *pe, CUgraph g, void *err_node, char *log,
					size_t log_size)
{
	return sim_impl_cuGraphInstantiate(pe, g, err_node, log, log_size);
}

CUresult sim_impl_cuGraphInstantiateWithParams(CUgraphExec *pe, CUgraph g,
					       struct sim_instantiate_params *params)
{
	CUresult rc = sim_instantiate(pe, g, params ? params->flags : 0);

	if (params)
		params->result = rc == CUDA_SUCCESS ? 0 : 1;
	return rc;
}

CUresult sim_impl_cuGraphExecDestroy(CUgraphExec e)
{
	struct sim_obj *o;
	CUresult rc = sim_obj_take(e, SIM_OBJ_EXEC, CUDA_ERROR_INVALID_VALUE, &o);

	if (rc != CUDA_SUCCESS)
		return rc;
	sim_ops_free(((struct CUgraphExec_st *)o)->ops, ((struct CUgraphExec_st *)o)->nops);
	free(o);
	return CUDA_SUCCESS;
}

/* An upload maps the memory the graph's allocation nodes will use at its launches. */
CUresult sim_impl_cuGraphUpload(CUgraphExec exec, CUstream stream)
{
	struct sim_op *ops = NULL;
	struct sim_obj **pp;
	bool autofree = false, failed = false;
	size_t n = 0;

	(void)stream;
	if (!sim_initialized())
		return CUDA_ERROR_NOT_INITIALIZED;
	pthread_mutex_lock(&sim_obj_lock);
	pp = sim_obj_find(exec, SIM_OBJ_EXEC);
	if (pp) {
		const struct CUgraphExec_st *e = (const struct CUgraphExec_st *)*pp;

		ops = sim_ops_copy(e->ops, e->nops, &failed);
		n = ops ? e->nops : 0;
		autofree = e->autofree;
	}
	pthread_mutex_unlock(&sim_obj_lock);
	if (!pp)
		return CUDA_ERROR_INVALID_VALUE;
	if (failed)
		return CUDA_ERROR_OUT_OF_MEMORY;
	sim_gmem_launch(ops, n, autofree, true);
	sim_ops_free(ops, n);
	return CUDA_SUCCESS;
}

/* The per-thread default stream variants (SIM_SAME_AS). */
SIM_SAME_AS(cuGraphUpload_ptsz, cuGraphUpload);
SIM_SAME_AS(cuGraphInstantiateWithParams_ptsz, cuGraphInstantiateWithParams);
