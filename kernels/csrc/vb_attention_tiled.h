/* The tiled path of the paged attention: many query rows of one request (prefill, chunked prefill)
 * against chunks of positions, every row of the item at once. Two builds of it: vdpbf16ps on bf16
 * where the CPU has avx512_bf16 (16 positions a chunk), fp32 FMAs everywhere else (VL positions).
 * Included by kernels/csrc/cpu_paged_attention.c (static inline: specialised there per head size).
 */
#ifndef VB_ATTENTION_TILED_H
#define VB_ATTENTION_TILED_H

#include "vb_attention.h"

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
 * zmm with AVX-512; with 16 registers one pair of 64 fp32 dims, 8 ymm: four pairs spilled every FMA).
 * At most PV_ROWS_MAX: the accumulators' array bound (head_dim % 16 == 0 gives NV >= 2 on 8 lanes
 * and NV >= 4 on 4, so 8 / NV never exceeds it; the cap says so to the compiler, which warned of
 * a write past the array for NV = 1 in the build specialised on no head size). */
#define PV_ROWS_MAX 4
#define PV_ROWS(NV) (VL == 16 || (NV) < 2 ? PV_ROWS_MAX : (NV) >= 8 ? 1 : 8 / (NV))

/* The tiled paths' p.v for (row, head) pairs [rg_begin, rg_end): tacc[i] += sum_j tp[i][j] * vf[j],
 * PV_ROWS accumulators at a time: independent FMA chains, shared loads. */
static inline __attribute__((always_inline)) void tiled_pv(Scratch *sc, int rg_begin, int rg_end, int n, const int NV) {
    const int D = NV * VL, U = PV_ROWS(NV);
    for (int i0 = rg_begin; i0 < rg_end; i0 += U) {
        const int cnt = rg_end - i0 < U ? rg_end - i0 : U;
        vf a[PV_ROWS_MAX][MAX_HEAD_DIM / VL];
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
                    r[j] = j < n ? load_kv_bf16x32(krows + j * row_stride + 2 * b) : _mm512_setzero_si512();
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

#endif
