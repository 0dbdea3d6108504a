/*
 * graph_mem.c: graph memory (each device's graph memory pool, charged for
 * what the driver says it reserves) and the count of stream captures under
 * way. Above pools.h.
 */
#ifndef GS_GRAPH_MEM_H
#define GS_GRAPH_MEM_H

#include "pools.h"

#pragma GCC visibility push(hidden)

extern uint32_t gs_graph_mem; /* 1 once this process made graph memory */

int stream_captures(CUstream stream);
CUresult graph_node_made(CUresult rc);
__attribute__((cold)) void graph_launched(CUstream stream);
void graph_pool_trimmed(int gpu);
void graph_pools_sync(void);
void capture_starting(void);
void capture_begun(CUresult rc);
int quiet_begin(void);
void quiet_end(void);
void capture_ended(CUresult rc);

#pragma GCC visibility pop

#endif
