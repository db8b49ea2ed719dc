/* Paged attention on CPU over a bf16 KV cache: every row of a flattened batch in one call.
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
 * accumulators, as in flash attention): each block's keys and values are read once, in place, in
 * bf16, upcast in registers, while the next block is prefetched (the blocks of a request sit
 * anywhere in the cache, so the hardware prefetcher cannot guess the jump).
 * NOTE: q.k uses vdpbf16ps where the CPU has avx512_bf16 (bf16 pairs multiplied exactly, summed in
 * fp32: the products the reference gets by upcasting both sides), fp32 FMAs otherwise.
 * NOTE: exp is vb_simd.h's polynomial (relative error about 1e-7).
 * NOTE: only positions below a request's length are read: unwritten cache slots (any bit
 * pattern, NaN included) never reach the arithmetic.
 */
#include <float.h>
#include <stdlib.h>
#include <string.h>

#include "vb_kernels.h"
#include "vb_simd.h"

#define ROWS_PER_ITEM 16
#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_BLOCK_SIZE 1024
/* Prefetch one block ahead into L2 (hint 2): measured here at batch 64 x 448 positions, scattered
 * blocks, 2 threads: 1.74 ms with L1 prefetches (hint 3), 1.25-1.29 into L2, 1.87 without; two
 * blocks ahead changed nothing. */
#define PREFETCH_HINT 2
#define PREFETCH_BLOCKS 1

static inline float exp1(float x) { return exp16(splat(x))[0]; }

typedef struct {
    const bf16 *query;            /* [T, Hq, D], rows query_stride apart */
    int64_t query_stride;
    bf16 *out;                    /* [T, Hq, D] */
    const bf16 *key_cache;        /* [num_blocks, block_size, Hk, D] */
    const bf16 *value_cache;
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
} ItemView;

static inline ItemView item_view(const Problem *p, const Item *it, int head_dim) {
    ItemView v;
    v.row_stride = (int64_t)p->num_kv_heads * head_dim;
    v.block_stride = (int64_t)p->block_size * v.row_stride;
    v.table = p->block_tables + (int64_t)it->req * p->table_stride;
    v.q_begin = p->query_start[it->req];
    v.first_pos = p->seq_lens[it->req] - (p->query_start[it->req + 1] - v.q_begin);
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
    uint32_t *kt;                              /* [D / 2, 16] the chunk's keys as bf16 pairs, transposed */
    float *vf;                                 /* [16, D] the chunk's values in fp32 */
} Scratch;

#if defined(__AVX512BF16__)
#define HAVE_DPBF16 1
#else
#define HAVE_DPBF16 0
#endif

/* scores[g][o] = q_g . k_o (scaled) for the n rows of one block and one kv head; returns nothing,
 * the block maxima go to bmax[g]. */
static inline __attribute__((always_inline)) void block_scores(
        const bf16 *q /* [G, D] of this kv head */, float scale, const bf16 *krows, int64_t row_stride, int n,
        float *scores, int score_stride, float *bmax, const int NV, const int G) {
#if HAVE_DPBF16
    if (NV % 2 == 0) {
        /* bf16 pairs multiplied exactly and summed in fp32, keys not converted. 16 positions at a
           time: their 16 partial-dot vectors are summed by one transposing tree (45 shuffles/adds
           instead of 8 per score), leaving the 16 scores in one vector. */
        for (int g = 0; g < G; ++g) {
            __m512bh qb[MAX_HEAD_DIM / 32];
            for (int c = 0; c < NV / 2; ++c) qb[c] = (__m512bh)_mm512_loadu_si512(q + g * NV * 16 + 32 * c);
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
    v16f qf[MAX_GROUP][MAX_HEAD_DIM / 16];
    for (int g = 0; g < G; ++g)
        for (int c = 0; c < NV; ++c) qf[g][c] = load_bf16x16(q + g * NV * 16 + 16 * c) * scale;
    for (int o = 0; o < n; ++o) {
        v16f k[MAX_HEAD_DIM / 16];
        for (int c = 0; c < NV; ++c) k[c] = load_bf16x16(krows + o * row_stride + 16 * c);
        for (int g = 0; g < G; ++g) {
            v16f dot = qf[g][0] * k[0];
            for (int c = 1; c < NV; ++c) dot += qf[g][c] * k[c];
            const float s = sum16(dot);
            scores[g * score_stride + o] = s;
            bmax[g] = s > bmax[g] ? s : bmax[g];
        }
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

#define TILED_MIN_ROWS 4
/* The tiled path keeps its running max until a score exceeds it by more than this (natural log
 * units): exp(score - max) then stays below e^8 ~ 3e3, far inside fp32, the result is the same
 * softmax, and the max reduction and rescale run only when the max really moves (measured: a
 * third of the prefill attention time went to the per-chunk reductions). */
#define LAZY_MAX 8.0f
/* Many query rows of one request (prefill, chunked prefill): 16 positions at a time, every row of
 * the item against them. The chunk's keys are transposed once into bf16 pairs per lane
 * ([D/2][16 positions]), so q.k for one (row, head) is D/2 vdpbf16ps with the q pair broadcast,
 * leaving the 16 scores in one vector (no per-score sums), and the chunk's values are converted
 * to fp32 once for all rows. Eight (row, head) dot products run side by side to hide latency.
 * Causal limits differ per row: lanes past a row's position are masked out of the softmax. */
static inline __attribute__((always_inline)) void attend_rows_tiled(
        const Problem *p, const Item *it, Scratch *sc, const int NV, const int G) {
    const int D = NV * 16, DP = D / 2, Hq = p->num_q_heads, BS = p->block_size;
    const ItemView iv = item_view(p, it, D);
    const int64_t row_stride = iv.row_stride, block_stride = iv.block_stride;
    const int32_t *table = iv.table;
    const int q_begin = iv.q_begin, first_pos = iv.first_pos;
    const int r0 = it->row_begin, R = it->row_end - it->row_begin;
    const int len_max = first_pos + it->row_end;         /* the item's last row sees positions < this */
    const __m512 scale = _mm512_set1_ps(p->scale);
    for (int h = it->head_begin; h < it->head_end; ++h) {
        for (int i = 0; i < R * G; ++i) sc->tm[i] = -FLT_MAX;
        memset(sc->tl, 0, sizeof(float) * (size_t)R * G * 16);
        memset(sc->tacc, 0, sizeof(float) * (size_t)R * G * D);
        for (int s0 = 0; s0 < len_max; s0 += 16) {
            const int n = len_max - s0 < 16 ? len_max - s0 : 16;
            const int64_t base = (int64_t)table[s0 / BS] * block_stride + (int64_t)(s0 % BS) * row_stride + (int64_t)h * D;
            const bf16 *krows = p->key_cache + base, *vrows = p->value_cache + base;
            for (int b = 0; b < DP; b += 16) {  /* keys transposed: kt[dp][j] = pair dp of position j */
                __m512i r[16];
                for (int j = 0; j < 16; ++j)
                    r[j] = j < n ? _mm512_loadu_si512((const uint32_t *)(krows + j * row_stride) + b) : _mm512_setzero_si512();
                transpose16x16_epi32(r);
                for (int j = 0; j < 16; ++j) _mm512_store_si512(sc->kt + (b + j) * 16, r[j]);
            }
            for (int j = 0; j < 16; ++j) {
                for (int c = 0; c < NV; ++c)
                    *(v16f *)(sc->vf + j * D + 16 * c) = j < n ? load_bf16x16(vrows + j * row_stride + 16 * c) : splat(0.0f);
            }
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
                    const __m512 e = _mm512_maskz_mov_ps(valid, (__m512)exp16((v16f)_mm512_sub_ps(sc16, _mm512_set1_ps(m))));
                    _mm512_store_ps(sc->tl + i * 16, _mm512_add_ps(_mm512_load_ps(sc->tl + i * 16), e));
                    _mm512_store_ps(sc->tp + i * 16, e);
                }
            }
            /* p.v, four (row, head) accumulators at a time: independent FMA chains, shared loads */
            for (int i0 = rg_begin; i0 < rg_end; i0 += 4) {
                const int cnt = rg_end - i0 < 4 ? rg_end - i0 : 4;
                v16f a[4][MAX_HEAD_DIM / 16];
                for (int u = 0; u < 4; ++u)
                    for (int c = 0; c < NV; ++c)
                        a[u][c] = u < cnt ? *(v16f *)(sc->tacc + (int64_t)(i0 + u) * D + 16 * c) : splat(0.0f);
                for (int j = 0; j < n; ++j) {
                    v16f v[MAX_HEAD_DIM / 16];
                    for (int c = 0; c < NV; ++c) v[c] = *(const v16f *)(sc->vf + j * D + 16 * c);
                    for (int u = 0; u < 4; ++u) {
                        const float w = u < cnt ? sc->tp[(i0 + u) * 16 + j] : 0.0f;
                        for (int c = 0; c < NV; ++c) a[u][c] += w * v[c];
                    }
                }
                for (int u = 0; u < cnt; ++u)
                    for (int c = 0; c < NV; ++c) *(v16f *)(sc->tacc + (int64_t)(i0 + u) * D + 16 * c) = a[u][c];
            }
        }
        for (int i = 0; i < R * G; ++i) {
            const float inv = 1.0f / _mm512_reduce_add_ps(_mm512_load_ps(sc->tl + i * 16));
            bf16 *os = p->out + ((int64_t)(q_begin + r0 + i / G) * Hq + (int64_t)h * G + i % G) * D;
            for (int c = 0; c < NV; ++c) store_bf16x16(os + 16 * c, *(v16f *)(sc->tacc + (int64_t)i * D + 16 * c) * inv);
        }
    }
}
#endif

/* One work item. NV (= head_dim / 16) and G are compile-time constants in the specialised copies
 * below, so the query and accumulator vectors of one kv head live in registers. */
static inline __attribute__((always_inline)) void attend_item(
        const Problem *p, const Item *it, Scratch *sc, const int NV, const int G) {
    const int D = NV * 16, Hq = p->num_q_heads, BS = p->block_size;
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
    const int SS = (BS + 15) / 16 * 16;                    /* score row stride: whole aligned vectors */

    for (int i = it->row_begin; i < it->row_end; ++i) {
        const int64_t t = q_begin + i;
        const int len = first_pos + i + 1;  /* keys 0 .. first_pos + i */
        const bf16 *qrow = p->query + t * p->query_stride;
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
                v16f a[MAX_GROUP][MAX_HEAD_DIM / 16];
                for (int g = 0; g < G; ++g) {
                    const float alpha = exp1(mx[g] - bmax[g]);
                    mx[g] = bmax[g];
                    float *sg = sc->scores + g * SS, bsum = 0.0f;
                    for (int o = 0; o < n; o += 16) {
                        v16f e = exp16(*(v16f *)(sg + o) - bmax[g]);
                        const int left = n - o;
                        if (left < 16)
                            for (int j = left; j < 16; ++j) e[j] = 0.0f;
                        *(v16f *)(sg + o) = e;
                        bsum += sum16(e);
                    }
                    sum[g] = sum[g] * alpha + bsum;
                    for (int c = 0; c < NV; ++c) a[g][c] = *(v16f *)(acc + g * D + 16 * c) * alpha;
                }
                const bf16 *vrows = p->value_cache + base;
                for (int o = 0; o < n; ++o) {
                    if (o < n_next) {
                        const int64_t at = next + o * row_stride + (int64_t)h * D;
                        for (int b = 0; b < D * 2; b += 64) {
                            __builtin_prefetch((const char *)(p->key_cache + at) + b, 0, PREFETCH_HINT);
                            __builtin_prefetch((const char *)(p->value_cache + at) + b, 0, PREFETCH_HINT);
                        }
                    }
                    v16f v[MAX_HEAD_DIM / 16];
                    for (int c = 0; c < NV; ++c) v[c] = load_bf16x16(vrows + o * row_stride + 16 * c);
                    for (int g = 0; g < G; ++g) {
                        const float w = sc->scores[g * SS + o];
                        for (int c = 0; c < NV; ++c) a[g][c] += w * v[c];
                    }
                }
                for (int g = 0; g < G; ++g)
                    for (int c = 0; c < NV; ++c) *(v16f *)(acc + g * D + 16 * c) = a[g][c];
            }
        }
        for (int h = h0; h < h0 + nh; ++h)
            for (int g = 0; g < G; ++g) {
                const float inv = 1.0f / sc->sum[(h - h0) * G + g];
                const float *acc = sc->acc + ((int64_t)(h - h0) * G + g) * D;
                bf16 *os = p->out + (t * Hq + (int64_t)h * G + g) * D;
                for (int c = 0; c < NV; ++c) store_bf16x16(os + 16 * c, *(const v16f *)(acc + 16 * c) * inv);
            }
    }
}

#define SPECIALISE(DIM, GROUP) \
    static void attend_##DIM##_##GROUP(const Problem *p, const Item *it, Scratch *sc) { \
        attend_item(p, it, sc, DIM / 16, GROUP); }
#define SPECIALISE_GROUPS(DIM) SPECIALISE(DIM, 1) SPECIALISE(DIM, 2) SPECIALISE(DIM, 3) SPECIALISE(DIM, 4) \
    SPECIALISE(DIM, 5) SPECIALISE(DIM, 6) SPECIALISE(DIM, 7) SPECIALISE(DIM, 8)
SPECIALISE_GROUPS(64)
SPECIALISE_GROUPS(128)

static void attend_generic(const Problem *p, const Item *it, Scratch *sc) {
    attend_item(p, it, sc, p->head_dim / 16, p->num_q_heads / p->num_kv_heads);
}

typedef void (*AttendFn)(const Problem *, const Item *, Scratch *);

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
    Item *items;
    int64_t num_items;
    int heads_per_item, group;
};

/* Returns 0, or: 1 unsupported shape (head_dim not a multiple of 16 or above 256, more than 16
 * query heads per kv head, block size above 1024), 2 out of memory. */
int vb_attention_plan(
        VbAttention **plan, const bf16 *query, int64_t query_stride, bf16 *out, const bf16 *key_cache,
        const bf16 *value_cache, const int32_t *block_tables, int64_t table_stride, const int32_t *query_start,
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
    pl->items = items;
    pl->num_items = num_items;
    pl->heads_per_item = heads_per_item;
    pl->group = group;
    *plan = pl;
    return 0;
}

void vb_attention_free(VbAttention *plan) {
    if (plan) free(plan->items);
    free(plan);
}

/* Called by every thread of the enclosing team (or alone): runs the items shared out by an
 * orphaned `omp for`, which ends with the team's barrier. Returns 0, or 2 when this thread's
 * scratch could not be allocated (its items are then not computed). */
int vb_attention_run_shared(const VbAttention *plan) {
    const int group = plan->group, head_dim = plan->problem.head_dim, heads_per_item = plan->heads_per_item;
    /* one aligned allocation: per-row state, then the tiled path's buffers (16-float aligned) */
    const size_t rg = (size_t)ROWS_PER_ITEM * group, up = 16;
    const size_t sizes[8] = {(size_t)heads_per_item * group * head_dim, (size_t)heads_per_item * group,
                             (size_t)heads_per_item * group, rg * head_dim, rg, rg * 16, rg * 16,
                             (size_t)head_dim / 2 * 16 + (size_t)16 * head_dim};
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
        sc->vf = at[7] + (size_t)head_dim / 2 * 16;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < plan->num_items; ++i)
        if (state) plan->fn(&plan->problem, &plan->items[i], sc);
    free(state);
    free(sc);
    return state ? 0 : 2;
}

/* The whole call: plan, run on num_threads threads, free. Returns vb_attention_plan's codes. */
int vb_paged_attention_bf16(
        const bf16 *query, int64_t query_stride, bf16 *out, const bf16 *key_cache, const bf16 *value_cache,
        const int32_t *block_tables, int64_t table_stride, const int32_t *query_start,
        const int32_t *seq_lens, int num_reqs, int num_q_heads, int num_kv_heads, int head_dim,
        int block_size, float scale, int num_threads) {
    VbAttention *plan = NULL;
    const int rc = vb_attention_plan(&plan, query, query_stride, out, key_cache, value_cache, block_tables,
                                     table_stride, query_start, seq_lens, num_reqs, num_q_heads, num_kv_heads,
                                     head_dim, block_size, scale, num_threads);
    if (rc != 0) return rc;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && plan->num_items > 1)
    {
        if (vb_attention_run_shared(plan) != 0) {
#pragma omp atomic write
            failed = 2;
        }
    }
    vb_attention_free(plan);
    return failed;
}
