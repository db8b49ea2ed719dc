/* The paged-attention kernel's shared pieces (kernels/csrc/cpu_paged_attention.c and the paths it
 * includes): limits, the problem and work-item descriptions, the per-thread scratch.
 * Included once per build variant (vb_act.h), by the attention sources only.
 */
#ifndef VB_ATTENTION_H
#define VB_ATTENTION_H

#include <float.h>
#include <stdlib.h>
#include <string.h>

#include "vb_kernels.h"

#define ROWS_PER_ITEM 16
#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_BLOCK_SIZE 1024
/* Prefetch one block ahead into L2 (hint 2): measured here at batch 64 x 448 positions, scattered
 * blocks, 2 threads: 1.74 ms with L1 prefetches (hint 3), 1.25-1.29 into L2, 1.87 without; two
 * blocks ahead changed nothing. That is for items of 3 kv heads or more: one block of one kv head
 * is too little work to hide the next block's latency, so the 16-lane loop looks PREFETCH_HEAD_BLOCKS
 * / (the item's kv heads) blocks ahead, rounded up (session 35, Zen 4, bf16, 1 x 1,536 positions in
 * per-kv-head items: 3 blocks ahead 0.66-0.68x the time of 1, 2 blocks 0.72x). */
#define PREFETCH_HINT 2
#define PREFETCH_BLOCKS 1
#ifndef PREFETCH_HEAD_BLOCKS   /* 1: the loop before (a race: VBATCH_NATIVE_CFLAGS=-DPREFETCH_HEAD_BLOCKS=1) */
#define PREFETCH_HEAD_BLOCKS 3
#endif
/* Decode rows of a call with fewer than SPLIT_BELOW_ROWS query rows are split along their positions
 * into a power of two of equal parts of at least SPLIT_MIN_POSITIONS (rounded up to whole blocks),
 * each part a work item over every kv head whose unnormalised softmax state (max, sum, accumulators)
 * the last of the row's parts to finish merges (flash-decoding). Why: at batch 1 the items were the kv
 * heads, 3 of them for SmolLM2 on 2 threads, so one thread did two heads while the other waited,
 * each reading a third of every cache row. The rule reads only the call's shape and the build, never
 * the thread count, so a row's result is the same bits on any number of threads (the engine's team
 * shrinks under load: engine/cpu_threads.py). bench/decode_attention.py on Zen 4, 2 threads, in one
 * process against the kernel before (docs/performance/batch-1.md, session 35): 1 row of 1,536
 * positions 0.57x the time on 16 lanes, 0.90-0.99x on avx2's spans (384-1,536 positions). Parts
 * under 192 positions lost what the balance won. */
#ifndef SPLIT_MIN_POSITIONS
#define SPLIT_MIN_POSITIONS 192
#endif
#ifndef SPLIT_BELOW_ROWS
#if VL >= 16
#define SPLIT_BELOW_ROWS 4   /* 2-3 rows as well: 0.81-1.10x the time of per-kv-head items (batch-1.md) */
#else
#define SPLIT_BELOW_ROWS 2   /* the spans at 2-3 rows: 0.85-0.93x the per-kv-head items' speed split */
#endif
#endif
#define MAX_PARTS 16

typedef struct {
    const act_t *query;           /* [T, Hq, D], rows query_stride apart */
    int64_t query_stride;
    act_t *out;                   /* [T, Hq, D] */
    const kv_t *key_cache;        /* [num_blocks, block_size, Hk, D] */
    const kv_t *value_cache;
    const int32_t *block_tables;  /* [R, table_stride] */
    int64_t table_stride;
    const int32_t *query_start;   /* [R + 1] */
    const int32_t *seq_lens;      /* [R] */
    int num_q_heads, num_kv_heads, head_dim, block_size;
    float scale;
    float *partials;              /* [parts of split rows, Hq, D + 2]: accumulators, then maxima, then sums */
} Problem;

/* A work item: request req's query rows [row_begin, row_end), kv heads [head_begin, head_end),
 * over positions [pos_begin, pos_end) of what each row sees. split < 0: the item writes its rows'
 * outputs; otherwise it is part `part` (a slot of Problem.partials) of split row `split`. */
typedef struct { int32_t req, head_begin, head_end, row_begin, row_end, pos_begin, pos_end, split, part; } Item;

/* A decode row split along its positions (every kv head): parts first .. first + parts - 1. */
typedef struct { int32_t row, first, parts; } Split;

/* A part of a split row ends: its unnormalised state goes to its slot for the merge. sum: the
 * running sums, `lanes` floats per query head (summed here). */
static inline void store_part(const Problem *p, const Item *it, const float *acc /* [Hq, D] */,
                              const float *mx /* [Hq] */, const float *sum /* [Hq, lanes] */, int lanes) {
    const int Hq = p->num_q_heads, D = p->head_dim;
    float *slot = p->partials + (int64_t)it->part * Hq * (D + 2);
    memcpy(slot, acc, sizeof(float) * (size_t)Hq * D);
    memcpy(slot + (int64_t)Hq * D, mx, sizeof(float) * (size_t)Hq);
    for (int j = 0; j < Hq; ++j) {
        float total = 0.0f;
        for (int l = 0; l < lanes; ++l) total += sum[j * lanes + l];
        slot[(int64_t)Hq * D + Hq + j] = total;
    }
}

/* Where one item's request lives: its cache strides, block table and query rows. */
typedef struct {
    int64_t row_stride, block_stride;  /* elements between cache rows (positions), blocks */
    const int32_t *table;              /* the request's block table */
    int q_begin, first_pos;            /* its first query row; the absolute position of that row */
    int r0, rows, len_max;             /* the item's first row in the request, its row count, and the
                                          positions its last row sees (< len_max) */
} ItemView;

static inline ItemView item_view(const Problem *p, const Item *it, int head_dim) {
    ItemView v;
    v.row_stride = (int64_t)p->num_kv_heads * head_dim;
    v.block_stride = (int64_t)p->block_size * v.row_stride;
    v.table = p->block_tables + (int64_t)it->req * p->table_stride;
    v.q_begin = p->query_start[it->req];
    v.first_pos = p->seq_lens[it->req] - (p->query_start[it->req + 1] - v.q_begin);
    v.r0 = it->row_begin;
    v.rows = it->row_end - it->row_begin;
    v.len_max = v.first_pos + it->row_end;
    return v;
}

/* Per-thread scratch for one item: running softmax state and accumulators of every head. */
typedef struct {
    float scores[MAX_GROUP * MAX_BLOCK_SIZE];  /* [G, block_size rounded up to 16] of the current block */
    float *acc;                                /* [heads in item, G, D] */
    float *mx, *sum;                           /* [heads in item, G]; sum: [heads in item, G, VL] lanes on
                                                  the 16-lane one-row path */
    /* the tiled (many-row) path: one kv head at a time */
    float *tacc;                               /* [ROWS_PER_ITEM * G, D] */
    float *tm;                                 /* [ROWS_PER_ITEM * G] running max */
    float *tl;                                 /* [ROWS_PER_ITEM * G, 16] running sums, per lane */
    float *tp;                                 /* [ROWS_PER_ITEM * G, 16] softmax numerators of the chunk */
    uint32_t *kt;                              /* the chunk's keys, transposed: [D / 2, 16] bf16 pairs
                                                  (vdpbf16ps) or [D, VL] fp32 (FMAs) */
    float *vf;                                 /* [CHUNK, D] the chunk's values in fp32 */
} Scratch;

#if VB_ACT_BF16 && defined(__AVX512BF16__)
#define HAVE_DPBF16 1
#define CHUNK 16  /* positions per step of the tiled path: one 16-lane score vector */
#else
#define HAVE_DPBF16 0
#define CHUNK VL
#endif

#endif
