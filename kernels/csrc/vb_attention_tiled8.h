/* The tiled path of the paged attention on 8-lane registers with FMA (the avx2 tier): many query
 * rows of one request (prefill, chunked prefill) against chunks of 16 positions, each chunk as two
 * small GEMMs in cpu_gemm.c's micro-tile shape, 6 (row, head) pairs x 16 lanes in 12 accumulators:
 * q.k against the chunk's keys transposed ([D][16] fp32: the 16 scores of a pair come out in two
 * vectors, no horizontal sums), the online softmax of those 6 pairs in registers, then p.v against
 * the chunk's values ([16][D] fp32), 16 dims at a time. Included by
 * kernels/csrc/cpu_paged_attention.c (static inline: specialised there per head size).
 *
 * Reference: kernels/attention_ref.py `paged_attention`, as for every path of the kernel
 * (tests/test_cpu_attention.py runs this one wherever the avx2 build runs: prefill, chunked prefill
 * on a cached prefix, rows past a chunk edge, every group size).
 *
 * NOTE: why not attend_rows_tiled_fma (vb_attention_tiled.h) on 8 lanes. There a chunk is VL = 8
 * positions, q.k runs 8 pairs against one key vector (one load of the key per 8 broadcasts of q)
 * and p.v one pair at a time (8 accumulators for 64 dims: a load of each value vector per FMA, and
 * 8 positions of softmax overhead per 64 FMAs of each pair): ~120 GFLOP/s of the cores' ~220 on
 * Zen 4 held to AVX2 (bench/decode_attention.py --query-rows 256). Here both products load 2
 * vectors per 6 broadcasts and 12 FMAs, and the softmax is spread over 16 positions.
 * Raced in one process against the old path's build (Zen 4 with the avx2 tier, 2 threads, fp32
 * queries over an fp16 cache, 8 requests x 256 query rows at positions 256-511, 7 alternating
 * rounds, bench/decode_attention.py --query-rows 256 --against): 0.825x the time (rounds
 * 0.80-0.84), 146 against 119 GFLOP/s; outputs within 7e-7. perf then puts ~65% of its samples in
 * the two FMA loops (which so run near the FMA peak), ~20% in the softmax and ~8% in the chunk's
 * conversions and transposes (docs/performance/avx2-on-zen4.md, "The prefill attention in micro
 * tiles").
 */
#ifndef VB_ATTENTION_TILED8_H
#define VB_ATTENTION_TILED8_H

#include "vb_attention.h"

#if !HAVE_DPBF16 && VL == 8 && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#define HAVE_TILED8 1
#define T8_POS 16  /* positions per chunk: two score vectors per (row, head) pair */
#define T8_MR 6    /* (row, head) pairs per micro tile */

/* The chunk's n <= 16 positions in fp32: kt[d][16] = dimension d of each position, vals[j][D] =
 * position j's values (zeros past n in both). */
static inline __attribute__((always_inline)) void t8_chunk(float *kt, float *vals, const kv_t *krows,
                                                           const kv_t *vrows, int64_t row_stride, int n, const int NV) {
    const int D = NV * 8;
    for (int half = 0; half < 2; ++half)
        for (int c = 0; c < NV; ++c) {
            vf r[8];
            for (int j = 0; j < 8; ++j) {
                const int o = 8 * half + j;
                r[j] = o < n ? load_kv(krows + o * row_stride + 8 * c) : splat(0.0f);
            }
            transpose_lanes(r);
            for (int d = 0; d < 8; ++d) *(vf *)(kt + (8 * c + d) * T8_POS + 8 * half) = r[d];
        }
    for (int j = 0; j < T8_POS; ++j)
        for (int c = 0; c < NV; ++c)
            *(vf *)(vals + j * D + 8 * c) = j < n ? load_kv(vrows + j * row_stride + 8 * c) : splat(0.0f);
}

/* s[i][0..1] = q_i . k over the chunk's 16 positions for mr pairs (q_i = qp[i], D values). */
static inline __attribute__((always_inline)) void t8_scores(const int mr, const act_t *const *qp, const float *kt,
                                                            const int D, __m256 s[T8_MR][2]) {
#pragma GCC unroll 6
    for (int i = 0; i < mr; ++i) s[i][0] = s[i][1] = _mm256_setzero_ps();
    for (int d = 0; d < D; ++d) {
        const __m256 k0 = _mm256_load_ps(kt + d * T8_POS), k1 = _mm256_load_ps(kt + d * T8_POS + 8);
#pragma GCC unroll 6
        for (int i = 0; i < mr; ++i) {
            const __m256 a = _mm256_set1_ps(act_to_float(qp[i][d]));
            s[i][0] = _mm256_fmadd_ps(a, k0, s[i][0]);
            s[i][1] = _mm256_fmadd_ps(a, k1, s[i][1]);
        }
    }
}

/* Pair i's online softmax over the chunk: scores s0 | s1 (unscaled), of which the first `valid`
 * (1..16) are seen by its row; the numerators go to tp[i], their sums into tl[i] (per lane), and the
 * running max moves only past LAZY_MAX (vb_attention_tiled.h), rescaling tl[i] and tacc[i] then.
 * (Run for all 6 pairs of a tile step by step, so their exp polynomials interleave, it measured the
 * same: 1.004x the time.) */
static inline __attribute__((always_inline)) void t8_softmax(Scratch *sc, int i, int valid, float scale, __m256 s0,
                                                             __m256 s1, const int D) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 in0 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(valid), lane));
    const __m256 in1 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(valid - 8), lane));
    const __m256 low = _mm256_set1_ps(-FLT_MAX), sv = _mm256_set1_ps(scale);
    s0 = _mm256_mul_ps(s0, sv);
    s1 = _mm256_mul_ps(s1, sv);
    const float top = hmax((vf)_mm256_max_ps(_mm256_blendv_ps(low, s0, in0), _mm256_blendv_ps(low, s1, in1)));
    float *tl = sc->tl + i * 16;
    float m = sc->tm[i];
    if (top > m + LAZY_MAX) {
        const __m256 alpha = _mm256_set1_ps(exp1(m - top));
        float *acc = sc->tacc + (int64_t)i * D;
        m = sc->tm[i] = top;
        _mm256_store_ps(tl, _mm256_mul_ps(_mm256_load_ps(tl), alpha));
        _mm256_store_ps(tl + 8, _mm256_mul_ps(_mm256_load_ps(tl + 8), alpha));
        for (int c = 0; c < D; c += 8) _mm256_store_ps(acc + c, _mm256_mul_ps(_mm256_load_ps(acc + c), alpha));
    }
    const vf mv = splat(m);
    const __m256 e0 = _mm256_and_ps(in0, (__m256)vexp((vf)s0 - mv));
    const __m256 e1 = _mm256_and_ps(in1, (__m256)vexp((vf)s1 - mv));
    _mm256_store_ps(tl, _mm256_add_ps(_mm256_load_ps(tl), e0));
    _mm256_store_ps(tl + 8, _mm256_add_ps(_mm256_load_ps(tl + 8), e1));
    _mm256_store_ps(sc->tp + i * 16, e0);
    _mm256_store_ps(sc->tp + i * 16 + 8, e1);
}

/* tacc[i] += sum_j tp[i][j] vals[j] for mr pairs from acc / w on (rows D and 16 apart), over the
 * chunk's first n positions: 16 dims at a time, 12 accumulators. */
static inline __attribute__((always_inline)) void t8_values(const int mr, float *acc, const float *w,
                                                            const float *vals, int n, const int D) {
    for (int c0 = 0; c0 < D; c0 += 16) {
        __m256 a[T8_MR][2];
#pragma GCC unroll 6
        for (int i = 0; i < mr; ++i) {
            a[i][0] = _mm256_load_ps(acc + i * D + c0);
            a[i][1] = _mm256_load_ps(acc + i * D + c0 + 8);
        }
        for (int j = 0; j < n; ++j) {
            const __m256 v0 = _mm256_load_ps(vals + j * D + c0), v1 = _mm256_load_ps(vals + j * D + c0 + 8);
#pragma GCC unroll 6
            for (int i = 0; i < mr; ++i) {
                const __m256 p = _mm256_broadcast_ss(w + i * 16 + j);
                a[i][0] = _mm256_fmadd_ps(p, v0, a[i][0]);
                a[i][1] = _mm256_fmadd_ps(p, v1, a[i][1]);
            }
        }
#pragma GCC unroll 6
        for (int i = 0; i < mr; ++i) {
            _mm256_store_ps(acc + i * D + c0, a[i][0]);
            _mm256_store_ps(acc + i * D + c0 + 8, a[i][1]);
        }
    }
}

/* One micro tile: pairs [i0, i0 + mr) of the current kv head over the chunk at s0 (n positions); pair
 * i's query row is qp[i], and its row sees positions up to pos[i]. */
static inline __attribute__((always_inline)) void t8_tile(const int mr, const Problem *p, Scratch *sc,
                                                          const act_t *const *qp, const int *pos, int i0, int s0,
                                                          int n, const int D) {
    __m256 s[T8_MR][2];
    t8_scores(mr, qp + i0, (const float *)sc->kt, D, s);
    for (int i = 0; i < mr; ++i) {
        const int seen = pos[i0 + i] - s0 + 1;  /* positions of the chunk the pair's row sees */
        t8_softmax(sc, i0 + i, seen < n ? seen : n, p->scale, s[i][0], s[i][1], D);
    }
    t8_values(mr, sc->tacc + (int64_t)i0 * D, sc->tp + i0 * 16, sc->vf, n, D);
}

/* attend_rows_tiled_fma's contract on 8 lanes with FMA: the item's rows against its request's
 * positions, one kv head at a time, chunks of 16 positions (within one block: block_size % 16 == 0). */
static inline __attribute__((always_inline)) void attend_rows_tiled8(const Problem *p, const Item *it, Scratch *sc,
                                                                     const int NV, const int G) {
    const int D = NV * 8, BS = p->block_size;
    const ItemView iv = item_view(p, it, D);
    const int R = iv.rows;
    const act_t *qp[ROWS_PER_ITEM * MAX_GROUP];  /* pair i's query row: row i / G, query head h * G + i % G */
    int pos[ROWS_PER_ITEM * MAX_GROUP];          /* the position of pair i's row */
    for (int i = 0; i < R * G; ++i) pos[i] = iv.first_pos + iv.r0 + i / G;
    for (int h = it->head_begin; h < it->head_end; ++h) {
        for (int i = 0; i < R * G; ++i)
            qp[i] = p->query + (int64_t)(iv.q_begin + iv.r0 + i / G) * p->query_stride + ((int64_t)h * G + i % G) * D;
        for (int i = 0; i < R * G; ++i) sc->tm[i] = -FLT_MAX;
        memset(sc->tl, 0, sizeof(float) * (size_t)R * G * 16);
        memset(sc->tacc, 0, sizeof(float) * (size_t)R * G * D);
        for (int s0 = 0; s0 < iv.len_max; s0 += T8_POS) {
            const int n = iv.len_max - s0 < T8_POS ? iv.len_max - s0 : T8_POS;
            const int64_t base = (int64_t)iv.table[s0 / BS] * iv.block_stride + (int64_t)(s0 % BS) * iv.row_stride
                                 + (int64_t)h * D;
            t8_chunk((float *)sc->kt, sc->vf, p->key_cache + base, p->value_cache + base, iv.row_stride, n, NV);
            /* rows whose position is below s0 are finished */
            const int first_active = s0 - iv.first_pos > iv.r0 ? s0 - iv.first_pos - iv.r0 : 0;
            const int rg_end = R * G;
            for (int i0 = first_active * G; i0 < rg_end; i0 += T8_MR) {
                switch (rg_end - i0 < T8_MR ? rg_end - i0 : T8_MR) {
                    case 6: t8_tile(6, p, sc, qp, pos, i0, s0, n, D); break;
                    case 5: t8_tile(5, p, sc, qp, pos, i0, s0, n, D); break;
                    case 4: t8_tile(4, p, sc, qp, pos, i0, s0, n, D); break;
                    case 3: t8_tile(3, p, sc, qp, pos, i0, s0, n, D); break;
                    case 2: t8_tile(2, p, sc, qp, pos, i0, s0, n, D); break;
                    default: t8_tile(1, p, sc, qp, pos, i0, s0, n, D); break;
                }
            }
        }
        for (int i = 0; i < R * G; ++i) {
            const float *tl = sc->tl + i * 16;
            const float inv = 1.0f / hsum(load_f32(tl) + load_f32(tl + 8));
            act_t *os = p->out + ((iv.q_begin + iv.r0 + (int64_t)(i / G)) * p->num_q_heads + (int64_t)h * G + i % G) * D;
            for (int c = 0; c < NV; ++c) store_act(os + 8 * c, load_f32(sc->tacc + (int64_t)i * D + 8 * c) * inv);
        }
    }
}
#else
#define HAVE_TILED8 0
#endif

#endif
