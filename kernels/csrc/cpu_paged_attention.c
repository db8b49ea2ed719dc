/* Paged attention on CPU: fp32 or bf16 queries over a KV cache of the same dtype or, for fp32
 * models, of half precision (vb_act.h: act_t, kv_t): every row of a flattened batch in one call.
 *
 * Specification and test oracle: kernels/attention_ref.py `paged_attention` (same contract).
 * Python binding: kernels/cpu_native.py (built with the system C compiler, loaded with ctypes).
 *
 * Request r owns query rows [query_start[r], query_start[r+1]); row i of it sits at absolute
 * position seq_lens[r] - query_len + i and attends to cache positions 0..that position, read
 * through block_tables[r]. Decode (query length 1), prefill, prefill on a cached prefix and
 * chunked prefill are all the same loop.
 *
 * NOTE: a work item is (request, a range of kv heads, up to ROWS_PER_ITEM query rows). Normally
 * the range is every kv head, so a block's keys and values are read as the contiguous rows the
 * cache stores ([block_size, kv_heads, head_dim]) instead of a 1/kv_heads slice of each row; the
 * range is split per head only when there are too few requests to keep the threads busy. The G
 * query heads that share a kv head are done together, so each key/value row is used G times.
 * NOTE: one sweep over the request's blocks with an online softmax (running max, rescaled sums and
 * accumulators, as in flash attention): each block's keys and values are read once, in place,
 * upcast to fp32 in registers (bf16), while the next block is prefetched (the blocks of a request sit
 * anywhere in the cache, so the hardware prefetcher cannot guess the jump).
 * NOTE: q.k uses vdpbf16ps for bf16 where the CPU has avx512_bf16 (bf16 pairs multiplied exactly,
 * summed in fp32: the products the reference gets by upcasting both sides), fp32 FMAs otherwise.
 * NOTE: exp is vb_simd.h's polynomial (relative error about 1e-7).
 * NOTE: only positions below a request's length are read: unwritten cache slots (any bit
 * pattern, NaN included) never reach the arithmetic.
 */
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
 * blocks ahead changed nothing. */
#define PREFETCH_HINT 2
#define PREFETCH_BLOCKS 1

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
} Problem;

typedef struct { int32_t req, head_begin, head_end, row_begin, row_end; } Item;

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
    float *mx, *sum;                           /* [heads in item, G] */
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

/* scores[g][o] = q_g . k_o (scaled) for the n rows of one block and one kv head; returns nothing,
 * the block maxima go to bmax[g]. */
static inline __attribute__((always_inline)) void block_scores(
        const act_t *q /* [G, D] of this kv head */, float scale, const kv_t *krows, int64_t row_stride, int n,
        float *scores, int score_stride, float *bmax, const int NV, const int G) {
#if HAVE_DPBF16
    if (NV % 2 == 0) {
        /* bf16 pairs multiplied exactly and summed in fp32, keys not converted. 16 positions at a
           time: their 16 partial-dot vectors are summed by one transposing tree (45 shuffles/adds
           instead of 8 per score), leaving the 16 scores in one vector. */
        for (int g = 0; g < G; ++g) {
            __m512bh qb[MAX_HEAD_DIM / 32];
            for (int c = 0; c < NV / 2; ++c) qb[c] = (__m512bh)_mm512_loadu_si512(q + g * NV * VL + 32 * c);
            for (int o0 = 0; o0 < n; o0 += 16) {
                const int m = n - o0 < 16 ? n - o0 : 16;
                __m512 dot[16];
                for (int j = 0; j < 16; ++j) {
                    dot[j] = _mm512_setzero_ps();
                    if (j < m)
                        for (int c = 0; c < NV / 2; ++c)
                            dot[j] = _mm512_dpbf16_ps(dot[j], qb[c],
                                (__m512bh)_mm512_loadu_si512(krows + (o0 + j) * row_stride + 32 * c));
                }
                const __m512 all = _mm512_mul_ps(sum16x16(dot), _mm512_set1_ps(scale));
                _mm512_store_ps(scores + g * score_stride + o0, all);
                const float top = _mm512_mask_reduce_max_ps((__mmask16)((1u << m) - 1u), all);
                bmax[g] = top > bmax[g] ? top : bmax[g];
            }
        }
        return;
    }
#endif
    vf qf[MAX_GROUP][MAX_HEAD_DIM / VL];
    for (int g = 0; g < G; ++g)
        for (int c = 0; c < NV; ++c) qf[g][c] = load_act(q + g * NV * VL + VL * c) * scale;
    for (int o = 0; o < n; ++o) {
        vf k[MAX_HEAD_DIM / VL];
        for (int c = 0; c < NV; ++c) k[c] = load_kv(krows + o * row_stride + VL * c);
        for (int g = 0; g < G; ++g) {
            vf dot = qf[g][0] * k[0];
            for (int c = 1; c < NV; ++c) dot += qf[g][c] * k[c];
            const float s = hsum(dot);
            scores[g * score_stride + o] = s;
            bmax[g] = s > bmax[g] ? s : bmax[g];
        }
    }
}

#define TILED_MIN_ROWS 4
/* The tiled path keeps its running max until a score exceeds it by more than this (natural log
 * units): exp(score - max) then stays below e^8 ~ 3e3, far inside fp32, the result is the same
 * softmax, and the max reduction and rescale run only when the max really moves (measured: a
 * third of the prefill attention time went to the per-chunk reductions). */
#define LAZY_MAX 8.0f

/* The tiled paths' values of one chunk of n <= CHUNK positions, in fp32: vf[j][d] (zeros past n). */
static inline __attribute__((always_inline)) void tiled_values(Scratch *sc, const kv_t *vrows, int64_t row_stride,
                                                               int n, const int NV) {
    const int D = NV * VL;
    for (int j = 0; j < CHUNK; ++j) {
        for (int c = 0; c < NV; ++c)
            *(vf *)(sc->vf + j * D + VL * c) = j < n ? load_kv(vrows + j * row_stride + VL * c) : splat(0.0f);
    }
}

/* (row, head) pairs per step of tiled_pv: their PV_ROWS x NV accumulators in registers (16 of 32
 * zmm with AVX-512; with 16 registers one pair of 64 fp32 dims, 8 ymm: four pairs spilled every FMA). */
#define PV_ROWS(NV) (VL == 16 ? 4 : (NV) >= 8 ? 1 : 8 / (NV))

/* The tiled paths' p.v for (row, head) pairs [rg_begin, rg_end): tacc[i] += sum_j tp[i][j] * vf[j],
 * PV_ROWS accumulators at a time: independent FMA chains, shared loads. */
static inline __attribute__((always_inline)) void tiled_pv(Scratch *sc, int rg_begin, int rg_end, int n, const int NV) {
    const int D = NV * VL, U = PV_ROWS(NV);
    for (int i0 = rg_begin; i0 < rg_end; i0 += U) {
        const int cnt = rg_end - i0 < U ? rg_end - i0 : U;
        vf a[4][MAX_HEAD_DIM / VL];
        for (int u = 0; u < U; ++u)
            for (int c = 0; c < NV; ++c)
                a[u][c] = u < cnt ? *(vf *)(sc->tacc + (int64_t)(i0 + u) * D + VL * c) : splat(0.0f);
        for (int j = 0; j < n; ++j) {
            vf v[MAX_HEAD_DIM / VL];
            for (int c = 0; c < NV; ++c) v[c] = *(const vf *)(sc->vf + j * D + VL * c);
            for (int u = 0; u < U; ++u) {
                const float w = u < cnt ? sc->tp[(i0 + u) * 16 + j] : 0.0f;
                for (int c = 0; c < NV; ++c) a[u][c] += w * v[c];
            }
        }
        for (int u = 0; u < cnt; ++u)
            for (int c = 0; c < NV; ++c) *(vf *)(sc->tacc + (int64_t)(i0 + u) * D + VL * c) = a[u][c];
    }
}

/* The tiled paths' last step for one kv head: out = tacc / sum of the per-lane running sums. */
static inline __attribute__((always_inline)) void tiled_store(const Problem *p, const Scratch *sc, int64_t first_row,
                                                              int h, int RG, const int NV, const int G) {
    const int D = NV * VL;
    for (int i = 0; i < RG; ++i) {
        const float inv = 1.0f / hsum(*(const vf *)(sc->tl + i * 16));
        act_t *os = p->out + ((first_row + i / G) * p->num_q_heads + (int64_t)h * G + i % G) * D;
        for (int c = 0; c < NV; ++c) store_act(os + VL * c, *(const vf *)(sc->tacc + (int64_t)i * D + VL * c) * inv);
    }
}

#if HAVE_DPBF16
/* r[i][j] <- r[j][i] for a 16 x 16 block of 32-bit elements (unpack 32, unpack 64, two 128-bit lane shuffles) */
static inline __attribute__((always_inline)) void transpose16x16_epi32(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int h = 0; h < 16; h += 8)
        for (int i = 0; i < 4; ++i) {
            t[h + i] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0x88);
            t[h + i + 4] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0xdd);
        }
    for (int i = 0; i < 8; ++i) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    }
}

/* Many query rows of one request (prefill, chunked prefill): 16 positions at a time, every row of
 * the item against them. The chunk's keys are transposed once into bf16 pairs per lane
 * ([D/2][16 positions]), so q.k for one (row, head) is D/2 vdpbf16ps with the q pair broadcast,
 * leaving the 16 scores in one vector (no per-score sums), and the chunk's values are converted
 * to fp32 once for all rows. Eight (row, head) dot products run side by side to hide latency.
 * Causal limits differ per row: lanes past a row's position are masked out of the softmax. */
static inline __attribute__((always_inline)) void attend_rows_tiled(
        const Problem *p, const Item *it, Scratch *sc, const int NV, const int G) {
    const int D = NV * VL, DP = D / 2, BS = p->block_size;
    const ItemView iv = item_view(p, it, D);
    const int64_t row_stride = iv.row_stride, block_stride = iv.block_stride;
    const int32_t *table = iv.table;
    const int q_begin = iv.q_begin, first_pos = iv.first_pos, r0 = iv.r0, R = iv.rows, len_max = iv.len_max;
    const __m512 scale = _mm512_set1_ps(p->scale);
    for (int h = it->head_begin; h < it->head_end; ++h) {
        for (int i = 0; i < R * G; ++i) sc->tm[i] = -FLT_MAX;
        memset(sc->tl, 0, sizeof(float) * (size_t)R * G * 16);
        memset(sc->tacc, 0, sizeof(float) * (size_t)R * G * D);
        for (int s0 = 0; s0 < len_max; s0 += 16) {
            const int n = len_max - s0 < 16 ? len_max - s0 : 16;
            const int64_t base = (int64_t)table[s0 / BS] * block_stride + (int64_t)(s0 % BS) * row_stride + (int64_t)h * D;
            const kv_t *krows = p->key_cache + base, *vrows = p->value_cache + base;
            for (int b = 0; b < DP; b += 16) {  /* keys transposed: kt[dp][j] = pair dp of position j */
                __m512i r[16];
                for (int j = 0; j < 16; ++j)
                    r[j] = j < n ? _mm512_loadu_si512((const uint32_t *)(krows + j * row_stride) + b) : _mm512_setzero_si512();
                transpose16x16_epi32(r);
                for (int j = 0; j < 16; ++j) _mm512_store_si512(sc->kt + (b + j) * 16, r[j]);
            }
            tiled_values(sc, vrows, row_stride, n, NV);
            /* rows whose position is below s0 are finished */
            const int first_active = s0 - first_pos > r0 ? s0 - first_pos - r0 : 0;
            const int rg_begin = first_active * G, rg_end = R * G;
            for (int i0 = rg_begin; i0 < rg_end; i0 += 8) {
                const int cnt = rg_end - i0 < 8 ? rg_end - i0 : 8;
                const uint32_t *qp[8];
                __m512 acc[8];
                for (int u = 0; u < 8; ++u) {
                    const int i = i0 + (u < cnt ? u : 0), r = i / G, g = i % G;
                    qp[u] = (const uint32_t *)(p->query + (int64_t)(q_begin + r0 + r) * p->query_stride
                                               + ((int64_t)h * G + g) * D);
                    acc[u] = _mm512_setzero_ps();
                }
                for (int dp = 0; dp < DP; ++dp) {
                    const __m512bh k = (__m512bh)_mm512_load_si512(sc->kt + dp * 16);
                    for (int u = 0; u < 8; ++u)
                        acc[u] = _mm512_dpbf16_ps(acc[u], (__m512bh)_mm512_set1_epi32((int)qp[u][dp]), k);
                }
                for (int u = 0; u < cnt; ++u) {
                    const int i = i0 + u, last = first_pos + r0 + i / G - s0;  /* last position this row sees */
                    const __mmask16 valid = (__mmask16)((last >= 15 ? 0xFFFFu : (1u << (last + 1)) - 1u)
                                                        & ((1u << n) - 1u));
                    const __m512 sc16 = _mm512_mul_ps(acc[u], scale);
                    float m = sc->tm[i];
                    if (_mm512_mask_cmp_ps_mask(valid, sc16, _mm512_set1_ps(m + LAZY_MAX), _CMP_GT_OQ)) {
                        /* a score above the running max (+ LAZY_MAX): move the max to this chunk's and
                           rescale what was accumulated under the old one */
                        const float top = _mm512_mask_reduce_max_ps(valid, sc16), alpha = exp1(m - top);
                        m = sc->tm[i] = top;
                        _mm512_store_ps(sc->tl + i * 16, _mm512_mul_ps(_mm512_load_ps(sc->tl + i * 16), _mm512_set1_ps(alpha)));
                        for (int c = 0; c < NV; ++c) *(v16f *)(sc->tacc + (int64_t)i * D + 16 * c) *= alpha;
                    }
                    const __m512 e = _mm512_maskz_mov_ps(valid, (__m512)vexp((v16f)_mm512_sub_ps(sc16, _mm512_set1_ps(m))));
                    _mm512_store_ps(sc->tl + i * 16, _mm512_add_ps(_mm512_load_ps(sc->tl + i * 16), e));
                    _mm512_store_ps(sc->tp + i * 16, e);
                }
            }
            tiled_pv(sc, rg_begin, rg_end, n, NV);
        }
        tiled_store(p, sc, (int64_t)q_begin + r0, h, R * G, NV, G);
    }
}
#endif
#if !HAVE_DPBF16
/* The chunk's keys in fp32, transposed: kt[d][j] = dimension d of position j (zeros past n), by
 * VL x VL block transposes. */
static inline __attribute__((always_inline)) void tiled_keys_fp32(float *kt, const kv_t *krows, int64_t row_stride,
                                                                  int n, const int NV) {
    for (int c = 0; c < NV; ++c) {
        vf r[VL];
        for (int j = 0; j < VL; ++j) r[j] = j < n ? load_kv(krows + j * row_stride + VL * c) : splat(0.0f);
        transpose_lanes(r);
        for (int d = 0; d < VL; ++d) *(vf *)(kt + (VL * c + d) * VL) = r[d];
    }
}

/* (row, head) pairs whose scores are computed side by side: QK_ROWS independent FMA chains per key
 * vector (with four, the chains' latency held the loop to under half the FMA rate on Zen 3). */
#define QK_ROWS 8

/* attend_rows_tiled for builds without vdpbf16ps (fp32 activations on every tier, bf16 without
 * avx512_bf16): chunks of VL positions, the same lazy max and p.v, with q.k as fp32 FMAs against
 * the transposed keys (one broadcast q element times the chunk's values of that dimension), so the
 * VL scores of a (row, head) come out in one vector, with no per-score horizontal sums. */
static inline __attribute__((always_inline)) void attend_rows_tiled_fma(
        const Problem *p, const Item *it, Scratch *sc, const int NV, const int G) {
    const int D = NV * VL, BS = p->block_size;
    const ItemView iv = item_view(p, it, D);
    const int64_t row_stride = iv.row_stride, block_stride = iv.block_stride;
    const int32_t *table = iv.table;
    const int q_begin = iv.q_begin, first_pos = iv.first_pos, r0 = iv.r0, R = iv.rows, len_max = iv.len_max;
    float *kt = (float *)sc->kt;
    for (int h = it->head_begin; h < it->head_end; ++h) {
        for (int i = 0; i < R * G; ++i) sc->tm[i] = -FLT_MAX;
        memset(sc->tl, 0, sizeof(float) * (size_t)R * G * 16);
        memset(sc->tacc, 0, sizeof(float) * (size_t)R * G * D);
        for (int s0 = 0; s0 < len_max; s0 += VL) {
            const int n = len_max - s0 < VL ? len_max - s0 : VL;
            const int64_t base = (int64_t)table[s0 / BS] * block_stride + (int64_t)(s0 % BS) * row_stride + (int64_t)h * D;
            tiled_keys_fp32(kt, p->key_cache + base, row_stride, n, NV);
            tiled_values(sc, p->value_cache + base, row_stride, n, NV);
            /* rows whose position is below s0 are finished */
            const int first_active = s0 - first_pos > r0 ? s0 - first_pos - r0 : 0;
            const int rg_begin = first_active * G, rg_end = R * G;
            for (int i0 = rg_begin; i0 < rg_end; i0 += QK_ROWS) {
                const int cnt = rg_end - i0 < QK_ROWS ? rg_end - i0 : QK_ROWS;
                const act_t *qp[QK_ROWS];
                vf acc[QK_ROWS];
                for (int u = 0; u < QK_ROWS; ++u) {
                    const int i = i0 + (u < cnt ? u : 0), r = i / G, g = i % G;
                    qp[u] = p->query + (int64_t)(q_begin + r0 + r) * p->query_stride + ((int64_t)h * G + g) * D;
                    acc[u] = splat(0.0f);
                }
                for (int d = 0; d < D; ++d) {
                    const vf k = *(const vf *)(kt + d * VL);
                    for (int u = 0; u < QK_ROWS; ++u) acc[u] += act_to_float(qp[u][d]) * k;
                }
                for (int u = 0; u < cnt; ++u) {
                    const int i = i0 + u, last = first_pos + r0 + i / G - s0;  /* last position this row sees */
                    const vi valid = mask_lanes_below(last + 1 < n ? last + 1 : n);
                    const vf scores = acc[u] * p->scale;
                    const float top = hmax(select_lanes(valid, scores, splat(-FLT_MAX)));
                    float m = sc->tm[i];
                    if (top > m + LAZY_MAX) {
                        /* a score above the running max (+ LAZY_MAX): move the max to this chunk's and
                           rescale what was accumulated under the old one */
                        const float alpha = exp1(m - top);
                        m = sc->tm[i] = top;
                        *(vf *)(sc->tl + i * 16) *= alpha;
                        for (int c = 0; c < NV; ++c) *(vf *)(sc->tacc + (int64_t)i * D + VL * c) *= alpha;
                    }
                    const vf e = select_lanes(valid, vexp(scores - m), splat(0.0f));
                    *(vf *)(sc->tl + i * 16) += e;
                    *(vf *)(sc->tp + i * 16) = e;
                }
            }
            tiled_pv(sc, rg_begin, rg_end, n, NV);
        }
        tiled_store(p, sc, (int64_t)q_begin + r0, h, R * G, NV, G);
    }
}
#endif

#if VL < 16
/* Positions per softmax span of attend_row_spans: the span's keys and values of one kv head
 * (32 x 256 B each for 64 fp32 dims) stay in L1 while every query head of the group uses them. */
#define SPAN 32
/* Query heads whose scores are computed together: 4 positions x 3 heads = 12 accumulators. */
#define SCORE_HEADS 3

/* Where position `pos` of the item's request sits in a cache (kv head h). */
static inline const kv_t *cache_row(const kv_t *cache, const ItemView *iv, int block_size, int block_shift,
                                     int pos, int h, int D) {
    const int block = block_shift >= 0 ? pos >> block_shift : pos / block_size;
    const int offset = block_shift >= 0 ? pos & (block_size - 1) : pos % block_size;
    return cache + (int64_t)iv->table[block] * iv->block_stride + (int64_t)offset * iv->row_stride + (int64_t)h * D;
}

/* scores[g][o] (g < GG, o < n) = scale q_g . k_o for the span's n positions: four positions and GG query
 * heads at a time, each key vector loaded once for all of them (q read from L1), the 4 x GG dot
 * products independent FMA chains, summed by transposing trees. */
static inline __attribute__((always_inline)) void span_scores(
        const Problem *p, const ItemView *iv, const act_t *q /* [GG, D] */, int s0, int n, int h, int block_shift,
        float *scores /* [GG, SPAN] */, const int NV, const int GG) {
    const int D = NV * VL;
    for (int o0 = 0; o0 < n; o0 += 4) {
        const kv_t *krow[4];
        for (int j = 0; j < 4; ++j)
            krow[j] = cache_row(p->key_cache, iv, p->block_size, block_shift, s0 + (o0 + j < n ? o0 + j : o0), h, D);
        vf dot[SCORE_HEADS][4];
        for (int g = 0; g < GG; ++g)
            for (int j = 0; j < 4; ++j) dot[g][j] = splat(0.0f);
#pragma GCC unroll 16
        for (int c = 0; c < NV; ++c)
            for (int j = 0; j < 4; ++j) {
                const vf k = load_kv(krow[j] + VL * c);
                for (int g = 0; g < GG; ++g) dot[g][j] += load_act(q + g * D + VL * c) * k;
            }
        for (int g = 0; g < GG; ++g) {
            const vf quad = hsum4(dot[g][0], dot[g][1], dot[g][2], dot[g][3]) * p->scale;
#if VL == 8  /* the two 128-bit halves hold partial sums over dims 0-3 and 4-7 of each 8 */
            for (int j = 0; j < 4; ++j) scores[g * SPAN + o0 + j] = quad[j] + quad[j + 4];
#else
            for (int j = 0; j < 4; ++j) scores[g * SPAN + o0 + j] = quad[j];
#endif
        }
    }
}

/* Narrow registers (AVX2, SSE, NEON): one query row over spans of SPAN positions, the item's kv
 * heads one after another inside each span (a span's cache rows, all heads, are read from memory
 * once and used while in L1): the scores of every query head of the group (span_scores), then
 * per query head its online softmax update and p.v with NV accumulators in registers, the span's
 * values re-read from L1.
 * NOTE: why not per block with all heads' accumulators in registers, as the 16-lane build does:
 * G x NV accumulators (24 for 3 query heads of 64 fp32 dims) do not fit 16 registers. Measured on
 * Zen 3 (fp32, 3 kv heads x 3 query heads, 64 x 448 positions, one thread): per query head over
 * whole blocks 69 cycles per position and kv head with warm caches, 176 from memory; here 58 and ... */
static inline __attribute__((always_inline)) void attend_row_spans(
        const Problem *p, const ItemView *iv, const act_t *qrow /* [Hq, D] */, act_t *orow /* [Hq, D] */,
        int len, int h0, int nh, Scratch *sc, const int NV, const int G) {
    const int D = NV * VL;
    int block_shift = -1;
    for (int b = 0; b < 31; ++b)
        if ((1 << b) == p->block_size) block_shift = b;
    for (int j = 0; j < nh * G; ++j) {
        sc->mx[j] = -FLT_MAX;
        sc->sum[j] = 0.0f;
    }
    memset(sc->acc, 0, sizeof(float) * (size_t)nh * G * D);
    for (int s0 = 0; s0 < len; s0 += SPAN) {
        const int n = len - s0 < SPAN ? len - s0 : SPAN;
        for (int h = h0; h < h0 + nh; ++h) {
            const act_t *q = qrow + (int64_t)h * G * D;
            float *m = sc->mx + (h - h0) * G, *l = sc->sum + (h - h0) * G, *acc = sc->acc + (int64_t)(h - h0) * G * D;
            for (int g0 = 0; g0 < G; g0 += SCORE_HEADS) {
                const int gg = G - g0 < SCORE_HEADS ? G - g0 : SCORE_HEADS;
                float *out = sc->scores + g0 * SPAN;
                if (gg == 3) span_scores(p, iv, q + g0 * D, s0, n, h, block_shift, out, NV, 3);
                else if (gg == 2) span_scores(p, iv, q + g0 * D, s0, n, h, block_shift, out, NV, 2);
                else span_scores(p, iv, q + g0 * D, s0, n, h, block_shift, out, NV, 1);
            }
            for (int g = 0; g < G; ++g) {
                float *sg = sc->scores + g * SPAN;
                vf vmax = splat(-FLT_MAX);
                for (int o0 = 0; o0 < n; o0 += VL) {
                    const vf sv = load_f32(sg + o0);
                    vmax = max_lanes(vmax, n - o0 < VL ? select_lanes(mask_lanes_below(n - o0), sv, splat(-FLT_MAX)) : sv);
                }
                const float top = hmax(vmax), new_m = top > m[g] ? top : m[g], alpha = exp1(m[g] - new_m);
                m[g] = new_m;
                vf lsum = splat(0.0f);
                for (int o0 = 0; o0 < n; o0 += VL) {
                    vf e = vexp(load_f32(sg + o0) - new_m);
                    if (n - o0 < VL) e = select_lanes(mask_lanes_below(n - o0), e, splat(0.0f));
                    store_f32(sg + o0, e);
                    lsum += e;
                }
                l[g] = l[g] * alpha + hsum(lsum);
                vf a[MAX_HEAD_DIM / VL];
#pragma GCC unroll 16
                for (int c = 0; c < NV; ++c) a[c] = load_f32(acc + g * D + VL * c) * alpha;
                for (int o = 0; o < n; ++o) {
                    const kv_t *vrow = cache_row(p->value_cache, iv, p->block_size, block_shift, s0 + o, h, D);
                    const float w = sg[o];
#pragma GCC unroll 16
                    for (int c = 0; c < NV; ++c) a[c] += w * load_kv(vrow + VL * c);
                }
#pragma GCC unroll 16
                for (int c = 0; c < NV; ++c) store_f32(acc + g * D + VL * c, a[c]);
            }
        }
    }
    for (int j = 0; j < nh * G; ++j) {
        act_t *o = orow + ((int64_t)h0 * G + j) * D;
        const float inv = 1.0f / sc->sum[j];
#pragma GCC unroll 16
        for (int c = 0; c < NV; ++c) store_act(o + VL * c, load_f32(sc->acc + (int64_t)j * D + VL * c) * inv);
    }
}
#endif

/* One work item. NV (= head_dim / VL) and G are compile-time constants in the specialised copies
 * below, so the query and accumulator vectors of one kv head live in registers. */
static inline __attribute__((always_inline)) void attend_item(
        const Problem *p, const Item *it, Scratch *sc, const int NV, const int G) {
    const int D = NV * VL, Hq = p->num_q_heads, BS = p->block_size;
    const ItemView iv = item_view(p, it, D);
    const int64_t row_stride = iv.row_stride, block_stride = iv.block_stride;
    const int32_t *table = iv.table;
    const int q_begin = iv.q_begin, first_pos = iv.first_pos;
    const int h0 = it->head_begin, nh = it->head_end - it->head_begin;
#if HAVE_DPBF16
    if (NV % 2 == 0 && BS % 16 == 0 && it->row_end - it->row_begin >= TILED_MIN_ROWS) {
        attend_rows_tiled(p, it, sc, NV, G);
        return;
    }
#endif
#if VL < 16
    for (int i = it->row_begin; i < it->row_end; ++i) {
        const int64_t t = q_begin + i;
        attend_row_spans(p, &iv, p->query + t * p->query_stride, p->out + t * Hq * D, first_pos + i + 1, h0, nh,
                         sc, NV, G);
    }
    return;
#endif
    const int SS = (BS + 15) / 16 * 16;                    /* score row stride: whole aligned vectors */

    for (int i = it->row_begin; i < it->row_end; ++i) {
        const int64_t t = q_begin + i;
        const int len = first_pos + i + 1;  /* keys 0 .. first_pos + i */
        const act_t *qrow = p->query + t * p->query_stride;
        for (int j = 0; j < nh * G; ++j) { sc->mx[j] = -FLT_MAX; sc->sum[j] = 0.0f; }
        memset(sc->acc, 0, sizeof(float) * (size_t)nh * G * D);

        for (int s0 = 0; s0 < len; s0 += BS) {
            const int n = len - s0 < BS ? len - s0 : BS;
            const int64_t block = table[s0 / BS];
            /* the next block (keys and values) is prefetched row by row while this one is used */
            const int ahead = s0 + PREFETCH_BLOCKS * BS;
            const int64_t next = ahead < len ? (int64_t)table[ahead / BS] * block_stride : -1;
            const int n_next = next < 0 ? 0 : (len - ahead < BS ? len - ahead : BS);
            for (int h = h0; h < h0 + nh; ++h) {
                const int64_t base = block * block_stride + (int64_t)h * D;
                float *mx = sc->mx + (h - h0) * G, *sum = sc->sum + (h - h0) * G;
                float *acc = sc->acc + (int64_t)(h - h0) * G * D;
                float bmax[MAX_GROUP];
                for (int g = 0; g < G; ++g) bmax[g] = mx[g];
                block_scores(qrow + (int64_t)h * G * D, p->scale, p->key_cache + base, row_stride, n,
                             sc->scores, SS, bmax, NV, G);
                /* online softmax: rescale what was accumulated under the old max */
                vf a[MAX_GROUP][MAX_HEAD_DIM / VL];
                for (int g = 0; g < G; ++g) {
                    const float alpha = exp1(mx[g] - bmax[g]);
                    mx[g] = bmax[g];
                    float *sg = sc->scores + g * SS, bsum = 0.0f;
                    for (int o = 0; o < n; o += VL) {
                        vf e = vexp(*(vf *)(sg + o) - bmax[g]);
                        const int left = n - o;
                        if (left < VL) e = select_lanes(mask_lanes_below(left), e, splat(0.0f));
                        *(vf *)(sg + o) = e;
                        bsum += hsum(e);
                    }
                    sum[g] = sum[g] * alpha + bsum;
                    for (int c = 0; c < NV; ++c) a[g][c] = *(vf *)(acc + g * D + VL * c) * alpha;
                }
                const kv_t *vrows = p->value_cache + base;
                for (int o = 0; o < n; ++o) {
                    if (o < n_next) {
                        const int64_t at = next + o * row_stride + (int64_t)h * D;
                        for (int b = 0; b < D * (int)sizeof(kv_t); b += 64) {
                            __builtin_prefetch((const char *)(p->key_cache + at) + b, 0, PREFETCH_HINT);
                            __builtin_prefetch((const char *)(p->value_cache + at) + b, 0, PREFETCH_HINT);
                        }
                    }
                    vf v[MAX_HEAD_DIM / VL];
                    for (int c = 0; c < NV; ++c) v[c] = load_kv(vrows + o * row_stride + VL * c);
                    for (int g = 0; g < G; ++g) {
                        const float w = sc->scores[g * SS + o];
                        for (int c = 0; c < NV; ++c) a[g][c] += w * v[c];
                    }
                }
                for (int g = 0; g < G; ++g)
                    for (int c = 0; c < NV; ++c) *(vf *)(acc + g * D + VL * c) = a[g][c];
            }
        }
        for (int h = h0; h < h0 + nh; ++h)
            for (int g = 0; g < G; ++g) {
                const float inv = 1.0f / sc->sum[(h - h0) * G + g];
                const float *acc = sc->acc + ((int64_t)(h - h0) * G + g) * D;
                act_t *os = p->out + (t * Hq + (int64_t)h * G + g) * D;
                for (int c = 0; c < NV; ++c) store_act(os + VL * c, *(const vf *)(acc + VL * c) * inv);
            }
    }
}

#define SPECIALISE(DIM, GROUP) \
    static void attend_##DIM##_##GROUP(const Problem *p, const Item *it, Scratch *sc) { \
        attend_item(p, it, sc, DIM / VL, GROUP); }
#define SPECIALISE_GROUPS(DIM) SPECIALISE(DIM, 1) SPECIALISE(DIM, 2) SPECIALISE(DIM, 3) SPECIALISE(DIM, 4) \
    SPECIALISE(DIM, 5) SPECIALISE(DIM, 6) SPECIALISE(DIM, 7) SPECIALISE(DIM, 8)
SPECIALISE_GROUPS(64)
SPECIALISE_GROUPS(128)

static void attend_generic(const Problem *p, const Item *it, Scratch *sc) {
    attend_item(p, it, sc, p->head_dim / VL, p->num_q_heads / p->num_kv_heads);
}

typedef void (*AttendFn)(const Problem *, const Item *, Scratch *);

#if HAVE_DPBF16
static AttendFn pick_tiled(int head_dim, int block_size) {  /* inside attend_item (vdpbf16ps) */
    (void)head_dim; (void)block_size;
    return NULL;
}
#else
/* The FMA tiled path is specialised on head_dim only (the group is a loop bound there): 18 copies
 * of it cost the AVX2 build 20 s of compile time for nothing measurable. */
#define SPECIALISE_TILED(DIM) \
    static void attend_tiled_##DIM(const Problem *p, const Item *it, Scratch *sc) { \
        attend_rows_tiled_fma(p, it, sc, DIM / VL, p->num_q_heads / p->num_kv_heads); }
SPECIALISE_TILED(64)
SPECIALISE_TILED(128)

static void attend_tiled_generic(const Problem *p, const Item *it, Scratch *sc) {
    attend_rows_tiled_fma(p, it, sc, p->head_dim / VL, p->num_q_heads / p->num_kv_heads);
}

static AttendFn pick_tiled(int head_dim, int block_size) {  /* items of >= TILED_MIN_ROWS rows */
    if (block_size % 16 != 0) return NULL;
    return head_dim == 64 ? attend_tiled_64 : head_dim == 128 ? attend_tiled_128 : attend_tiled_generic;
}
#endif

static AttendFn pick(int head_dim, int group) {
    static const AttendFn by64[8] = {attend_64_1, attend_64_2, attend_64_3, attend_64_4,
                                     attend_64_5, attend_64_6, attend_64_7, attend_64_8};
    static const AttendFn by128[8] = {attend_128_1, attend_128_2, attend_128_3, attend_128_4,
                                      attend_128_5, attend_128_6, attend_128_7, attend_128_8};
    if (group >= 1 && group <= 8 && head_dim == 64) return by64[group - 1];
    if (group >= 1 && group <= 8 && head_dim == 128) return by128[group - 1];
    return attend_generic;
}

/* A planned call: the work items and the kernel copy, shared by the threads that run it. */
struct VbAttention {
    Problem problem;
    AttendFn fn;
    AttendFn tiled_fn;  /* items of TILED_MIN_ROWS rows or more, where the build has a separate copy */
    Item *items;
    int64_t num_items;
    int heads_per_item, group;
};

/* Returns 0, or: 1 unsupported shape (head_dim not a multiple of 16 or above 256, more than 16
 * query heads per kv head, block size above 1024), 2 out of memory. */
int VB_ACT(vb_attention_plan)(
        VbAttention **plan, const act_t *query, int64_t query_stride, act_t *out, const kv_t *key_cache,
        const kv_t *value_cache, const int32_t *block_tables, int64_t table_stride, const int32_t *query_start,
        const int32_t *seq_lens, int num_reqs, int num_q_heads, int num_kv_heads, int head_dim,
        int block_size, float scale, int num_threads) {
    const int group = num_q_heads / num_kv_heads;
    if (head_dim % 16 != 0 || head_dim > MAX_HEAD_DIM || group > MAX_GROUP || group * num_kv_heads != num_q_heads
        || block_size > MAX_BLOCK_SIZE)
        return 1;
    int64_t row_chunks = 0;
    for (int r = 0; r < num_reqs; ++r)
        row_chunks += (query_start[r + 1] - query_start[r] + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM;
    /* all kv heads per item unless that leaves threads idle */
    const int heads_per_item = row_chunks >= 2 * (int64_t)num_threads ? num_kv_heads : 1;
    const int64_t num_items = row_chunks * (num_kv_heads / heads_per_item);
    VbAttention *pl = malloc(sizeof(VbAttention));
    Item *items = malloc(sizeof(Item) * (size_t)(num_items > 0 ? num_items : 1));
    if (!pl || !items) {
        free(pl);
        free(items);
        return 2;
    }
    int64_t k = 0;
    for (int r = 0; r < num_reqs; ++r) {
        const int q_len = query_start[r + 1] - query_start[r];
        for (int b = 0; b < q_len; b += ROWS_PER_ITEM)
            for (int h = 0; h < num_kv_heads; h += heads_per_item) {
                items[k].req = r;
                items[k].head_begin = h;
                items[k].head_end = h + heads_per_item;
                items[k].row_begin = b;
                items[k].row_end = b + ROWS_PER_ITEM < q_len ? b + ROWS_PER_ITEM : q_len;
                ++k;
            }
    }
    const Problem problem = {query, query_stride, out, key_cache, value_cache, block_tables, table_stride, query_start,
                             seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, scale};
    pl->problem = problem;
    pl->fn = pick(head_dim, group);
    pl->tiled_fn = pick_tiled(head_dim, block_size);
    pl->items = items;
    pl->num_items = num_items;
    pl->heads_per_item = heads_per_item;
    pl->group = group;
    *plan = pl;
    return 0;
}

void VB_ACT(vb_attention_free)(VbAttention *plan) {
    if (plan) free(plan->items);
    free(plan);
}

/* Called by every thread of the enclosing team (or alone): runs the items shared out by an
 * orphaned `omp for`, which ends with the team's barrier. Returns 0, or 2 when this thread's
 * scratch could not be allocated (its items are then not computed). */
int VB_ACT(vb_attention_run_shared)(const VbAttention *plan) {
    const int group = plan->group, head_dim = plan->problem.head_dim, heads_per_item = plan->heads_per_item;
    /* one aligned allocation: per-row state, then the tiled path's buffers (16-float aligned) */
    const size_t rg = (size_t)ROWS_PER_ITEM * group, up = 16;
    /* the last: the transposed keys (bf16 pairs: head_dim / 2 x 16 words; fp32: head_dim x 16), then
       the chunk's fp32 values (16 x head_dim) */
    const size_t key_words = (size_t)head_dim * 16 / (HAVE_DPBF16 ? 2 : 1);
    const size_t sizes[8] = {(size_t)heads_per_item * group * head_dim, (size_t)heads_per_item * group,
                             (size_t)heads_per_item * group, rg * head_dim, rg, rg * 16, rg * 16,
                             key_words + (size_t)16 * head_dim};
    size_t total = 0;
    for (int j = 0; j < 8; ++j) total += (sizes[j] + up - 1) / up * up;
    Scratch *sc = aligned_alloc(64, (sizeof(Scratch) + 63) / 64 * 64);
    float *state = sc ? aligned_alloc(64, total * sizeof(float)) : NULL;
    if (state) {
        float *at[8];
        float *cursor = state;
        for (int j = 0; j < 8; ++j) { at[j] = cursor; cursor += (sizes[j] + up - 1) / up * up; }
        sc->acc = at[0]; sc->mx = at[1]; sc->sum = at[2];
        sc->tacc = at[3]; sc->tm = at[4]; sc->tl = at[5]; sc->tp = at[6];
        sc->kt = (uint32_t *)at[7];
        sc->vf = at[7] + key_words;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < plan->num_items; ++i) {
        const Item *it = &plan->items[i];
        if (!state) continue;
        if (plan->tiled_fn && it->row_end - it->row_begin >= TILED_MIN_ROWS) plan->tiled_fn(&plan->problem, it, sc);
        else plan->fn(&plan->problem, it, sc);
    }
    free(state);
    free(sc);
    return state ? 0 : 2;
}

/* The whole call: plan, run on num_threads threads, free. Returns vb_attention_plan's codes. */
int VB_ACT(vb_paged_attention)(
        const act_t *query, int64_t query_stride, act_t *out, const kv_t *key_cache, const kv_t *value_cache,
        const int32_t *block_tables, int64_t table_stride, const int32_t *query_start,
        const int32_t *seq_lens, int num_reqs, int num_q_heads, int num_kv_heads, int head_dim,
        int block_size, float scale, int num_threads) {
    VbAttention *plan = NULL;
    const int rc = VB_ACT(vb_attention_plan)(&plan, query, query_stride, out, key_cache, value_cache, block_tables,
                                     table_stride, query_start, seq_lens, num_reqs, num_q_heads, num_kv_heads,
                                     head_dim, block_size, scale, num_threads);
    if (rc != 0) return rc;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && plan->num_items > 1)
    {
        if (VB_ACT(vb_attention_run_shared)(plan) != 0) {
#pragma omp atomic write
            failed = 2;
        }
    }
    VB_ACT(vb_attention_free)(plan);
    return failed;
}
