/* The decode path of the paged attention on narrow registers (AVX2, SSE, NEON: VL < 16): one query
 * row over spans of positions. Included by kernels/csrc/cpu_paged_attention.c.
 */
#ifndef VB_ATTENTION_SPANS_H
#define VB_ATTENTION_SPANS_H

#include "vb_attention.h"

#if VL < 16
/* Positions per softmax span of attend_row_spans: the span's keys and values of one kv head
 * (32 x 256 B each for 64 fp32 dims) stay in L1 while every query head of the group uses them. */
#define SPAN 32
/* Query heads whose scores are computed together: 4 positions x 3 heads = 12 accumulators. */
#define SCORE_HEADS 3
/* Positions ahead whose cache rows are prefetched (into L2, PREFETCH_HINT) while a span is used: the
 * next span's, line by line beside the loads of this one (a request's blocks sit anywhere in the
 * cache, so the hardware prefetcher cannot follow). Measured on the Intel Xeon, avx2 tier, 64 x 384
 * positions from memory: 56-58 ns per (position, kv head) without, 34-35 at 32 ahead, 37-38 at 16,
 * 37-39 at 64, 40-42 at 128 (docs/performance/intel-xeon.md, session 12). On Zen 4 (avx2 tier, fp16
 * cache, 256 x 384 positions in order, 2 threads; session 36, `python bench/decode_attention.py --tier
 * avx2 --dtype float32 --kv-dtype float16 --order in-order --repeats 9 --against <a build with
 * -DSPAN_PREFETCH=N>`): 16 / 48 / 64 / 96 ahead took 1.19x / 1.02x / 1.10x / 1.14x the time of 32.
 * NOTE: Zen 3 builds 16 (kernels/cpu_features.py span_prefetch_positions; the build adds
 * -DSPAN_PREFETCH=16): there 16 ran 1.02-1.11x the speed of 32 in six races (session 40, `python
 * bench/retune.py --tier avx2 --only SPAN_PREFETCH` twice, and bench/decode_attention.py --order
 * random / in-order, 7 rounds each, caches on huge pages or not), the portable tier 1.06x; 64 ran
 * 0.92-0.98x, 8 0.99-1.05x. Also tried there, not kept: a second prefetch 48-96 positions ahead
 * with hint 1 (8 and 48 ahead against 16 alone: 1.01-1.07x), spans of 16 or 64 positions (no better
 * than the distance alone), prefetcht0 (hint 3: 0.96-1.04x). */
#ifndef SPAN_PREFETCH
#define SPAN_PREFETCH SPAN
#endif
/* p.v (span_pv) takes the group's query heads PV_HEADS at a time: for a 16-bit cache (fp16, bf16:
 * the avx2 and portable tiers' defaults) three, so each value vector is loaded and widened once for
 * three heads, 3 x 4 accumulators in the registers; before, one head at a time re-read the span's
 * values per head (fp16 from a span widened once per kv head, as fp8 still is below). Raced in one
 * process against the build before (Zen 4, avx2 tier, fp32 queries, `python bench/decode_attention.py
 * --tier avx2 --dtype float32 --kv-dtype K --repeats 9 --against <before>`; time ratios): fp16 0.887
 * in L2 (--batch 4 --positions 256 --layers 1 --threads 1 --calls 1000), 0.90-0.99 from memory (256
 * x 384 positions, 30 layers, 2 threads); bf16 0.71 / 0.81; the portable tier over bf16 0.84 / 0.88;
 * outputs identical (the sums run over the positions in the same order).
 * NOTE: why not for fp32 and fp8 caches: there the three-head p.v measured 0.96-0.98 in L2 but 1.08x
 * the time from memory (fp32), and 1.03-1.08x (fp8, over its widened span), so those keep one head
 * at a time (PV_HEADS 1: 8 accumulators, each value row read from L1 per head). */
#if defined(VB_KV_E4M3) || defined(VB_KV_E5M2) || (defined(VB_ACT_F32) && !defined(VB_KV_F16) && !defined(VB_KV_BF16))
#define PV_HEADS 1
#else
#define PV_HEADS SCORE_HEADS
#endif
/* An fp8 cache has each span's values widened once per kv head into the scratch's key/value buffers
 * (sc->kt: 16 x D + 16 x D floats in builds without vdpbf16ps, = SPAN x D), not once per query head
 * of the group. bench/decode_attention.py, avx2 tier on the Intel Xeon, fp32 queries, 2 alternating
 * rounds, in L2 (--batch 4 --positions 256 --layers 1 --threads 1): E4M3 46.8-51.0 -> 33.9-35.0,
 * E5M2 36.1-40.4 -> 32.8-33.0 ns per position and kv head; on Zen 3 (session 14, 3 alternating
 * rounds) E4M3 59.2 / 42.3 / 58.6 -> 41.7 / 29.6 / 34.1. (fp16 was widened so too until session 37:
 * 22.7-23.0 -> 20.5-20.9 on the Xeon, 40.6 / 26.2 / 26.7 -> 36.5 / 24.1 / 24.7 on Zen 3; the
 * three-head p.v above widens each value once without the buffer.) */
#if defined(VB_KV_E4M3) || defined(VB_KV_E5M2)
#define SPAN_VALUES_WIDENED 1
#else
#define SPAN_VALUES_WIDENED 0
#endif

/* Where position `pos` of the item's request sits in a cache (kv head h). */
static inline const kv_t *cache_row(const kv_t *cache, const ItemView *iv, int block_size, int block_shift,
                                     int pos, int h, int D) {
    const int block = block_shift >= 0 ? pos >> block_shift : pos / block_size;
    const int offset = block_shift >= 0 ? pos & (block_size - 1) : pos % block_size;
    return cache + (int64_t)iv->table[block] * iv->block_stride + (int64_t)offset * iv->row_stride + (int64_t)h * D;
}

/* Prefetch the D elements of kv head h at position `pos` of a cache, if pos < len. */
static inline void prefetch_row(const kv_t *cache, const ItemView *iv, int block_size, int block_shift, int pos,
                                int len, int h, int D) {
    if (pos >= len) return;
    const char *row = (const char *)cache_row(cache, iv, block_size, block_shift, pos, h, D);
    for (int b = 0; b < D * (int)sizeof(kv_t); b += 64) __builtin_prefetch(row + b, 0, PREFETCH_HINT);
}

/* scores[g][o] (g < GG, o < n) = scale q_g . k_o for the span's n positions: four positions and GG query
 * heads at a time, 4 x GG dot products as independent FMA chains, summed by transposing trees. Per
 * VL dims the GG query vectors are loaded once for the four keys (12 accumulators, 3 q vectors and
 * a key: all 16 ymm registers), and a quad's rows are one address apart by the row stride (a quad
 * never crosses a block when the block size is a multiple of 4), so one block-table lookup serves it. */
static inline __attribute__((always_inline)) void span_scores(
        const Problem *p, const ItemView *iv, const act_t *q /* [GG, D] */, int s0, int n, int h, int block_shift,
        int prefetch_len /* prefetch keys SPAN_PREFETCH ahead below this position; 0: none */,
        float *scores /* [GG, SPAN] */, const int NV, const int GG) {
    const int D = NV * VL;
    const int quads = p->block_size % 4 == 0;   /* whole quads lie in one block */
    for (int o0 = 0; o0 < n; o0 += 4) {
        const kv_t *krow[4];
        if (quads && o0 + 4 <= n) {
            krow[0] = cache_row(p->key_cache, iv, p->block_size, block_shift, s0 + o0, h, D);
            for (int j = 1; j < 4; ++j) krow[j] = krow[0] + j * iv->row_stride;
        } else {
            for (int j = 0; j < 4; ++j)   /* the span's last positions: rows past n repeat o0's */
                krow[j] = cache_row(p->key_cache, iv, p->block_size, block_shift, s0 + (o0 + j < n ? o0 + j : o0), h, D);
        }
        const int ahead = s0 + o0 + SPAN_PREFETCH;
        if (quads && ahead + 3 < prefetch_len) {
            const char *row = (const char *)cache_row(p->key_cache, iv, p->block_size, block_shift, ahead, h, D);
            for (int j = 0; j < 4; ++j, row += iv->row_stride * (int64_t)sizeof(kv_t))
                for (int b = 0; b < D * (int)sizeof(kv_t); b += 64) __builtin_prefetch(row + b, 0, PREFETCH_HINT);
        } else {
            for (int j = 0; j < 4; ++j)
                prefetch_row(p->key_cache, iv, p->block_size, block_shift, ahead + j, prefetch_len, h, D);
        }
        vf dot[SCORE_HEADS][4];
        for (int g = 0; g < GG; ++g)
            for (int j = 0; j < 4; ++j) dot[g][j] = splat(0.0f);
#pragma GCC unroll 16
        for (int c = 0; c < NV; ++c) {
            vf qc[SCORE_HEADS];
            for (int g = 0; g < GG; ++g) qc[g] = load_act(q + g * D + VL * c);
            for (int j = 0; j < 4; ++j) {
                const vf k = load_kv(krow[j] + VL * c);
                for (int g = 0; g < GG; ++g) dot[g][j] += qc[g] * k;
            }
        }
        for (int g = 0; g < GG; ++g) {
            const vf quad = hsum4(dot[g][0], dot[g][1], dot[g][2], dot[g][3]) * p->scale;
#if VL == 8  /* the two 128-bit halves hold partial sums over dims 0-3 and 4-7 of each 8: one vector add
                of the halves, where scalar lane sums spent a shuffle and an extract on each score (Zen
                4, avx2 tier, fp16 cache, bench/decode_attention.py --against the scalar build, 7
                rounds: 0.98x the time in L2 and from memory; outputs identical) */
            const vf sums = quad + __builtin_shuffle(quad, (vu){4, 5, 6, 7, 0, 1, 2, 3});   /* lanes 0-3 */
            memcpy(scores + g * SPAN + o0, &sums, 4 * sizeof(float));
#else
            store_f32(scores + g * SPAN + o0, quad);
#endif
        }
    }
}

/* acc[g] = alpha[g] acc[g] + sum_o w[g][o] v_o (g < GG) over the span's n value rows: GG query heads
 * at once, CV vectors of the head dim at a time (GG x CV accumulators, GG weights and a value in the
 * registers: 16 for 3 x 4; one head: 8 vectors), so each value vector is loaded (and widened) once
 * for the GG heads and every accumulator gets an independent FMA per position. The weights are
 * broadcast straight from memory (load_splat: splat() would spend a 17th register). The sums run
 * over o in order, as one head at a time does (PV_HEADS 1), so the outputs are the same bits. The
 * first chunk prefetches the value rows SPAN_PREFETCH ahead. */
static inline __attribute__((always_inline)) void span_pv(
        const Problem *p, const ItemView *iv, const kv_t *const *vrows /* [n] */, const float *w /* [GG, SPAN] */,
        const float *alpha /* [GG] */, float *acc /* [GG, D] */, int s0, int n,
        int h, int block_shift, int prefetch_len, const int NV, const int GG) {
    const int D = NV * VL, CV = GG == 1 && NV % 8 == 0 ? 8 : NV % 4 == 0 ? 4 : NV % 2 == 0 ? 2 : 1;
    for (int c0 = 0; c0 < NV; c0 += CV) {
        vf a[SCORE_HEADS][8];
        for (int g = 0; g < GG; ++g)
            for (int j = 0; j < CV; ++j) a[g][j] = load_f32(acc + g * D + VL * (c0 + j)) * alpha[g];
        for (int o = 0; o < n; ++o) {
            if (c0 == 0)
                prefetch_row(p->value_cache, iv, p->block_size, block_shift, s0 + o + SPAN_PREFETCH, prefetch_len, h, D);
            vf wg[SCORE_HEADS];
            for (int g = 0; g < GG; ++g) wg[g] = load_splat(w + g * SPAN + o);
            for (int j = 0; j < CV; ++j) {
                const vf v = load_kv(vrows[o] + VL * (c0 + j));
                for (int g = 0; g < GG; ++g) a[g][j] += wg[g] * v;
            }
        }
        for (int g = 0; g < GG; ++g)
            for (int j = 0; j < CV; ++j) store_f32(acc + g * D + VL * (c0 + j), a[g][j]);
    }
}

/* Narrow registers (AVX2, SSE, NEON): one query row over spans of SPAN positions, the item's kv
 * heads one after another inside each span (a span's cache rows, all heads, are read from memory
 * once and used while in L1): the scores of every query head of the group (span_scores), then
 * per query head its online softmax update and p.v with NV accumulators in registers, the span's
 * values re-read from L1. A part of a split row (begin > 0 or len short of the row's) leaves its
 * unnormalised state for the merge instead of writing the row.
 * NOTE: why not per block with all heads' accumulators in registers, as the 16-lane build does:
 * G x NV accumulators (24 for 3 query heads of 64 fp32 dims) do not fit 16 registers. Measured on
 * Zen 3 (fp32, 3 kv heads x 3 query heads, 64 x 448 positions, one thread): per query head over
 * whole blocks 69 cycles per position and kv head with warm caches, 176 from memory; here 57 with
 * warm caches (commit 6cb190e; its figure from memory went unrecorded). Session 40 there, fp16 cache,
 * bench/decode_attention.py: 21 ns per position and kv head in L2-L3 (4 x 256 positions, 1 thread),
 * 54-66 from memory (256 x 384 positions x 30 layers, 1 or 2 threads): bound by memory latency. */
static inline __attribute__((always_inline)) void attend_row_spans(
        const Problem *p, const ItemView *iv, const Item *it, const act_t *qrow /* [Hq, D] */,
        act_t *orow /* [Hq, D] */, int begin, int len /* positions begin .. len - 1 */,
        int prefetch_len /* the row's length: a part prefetches into the next part, which this thread
                            may take next */, Scratch *sc, const int NV, const int G) {
    const int D = NV * VL, h0 = it->head_begin, nh = it->head_end - it->head_begin;
    int block_shift = -1;
    for (int b = 0; b < 31; ++b)
        if ((1 << b) == p->block_size) block_shift = b;
    for (int j = 0; j < nh * G; ++j) {
        sc->mx[j] = -FLT_MAX;
        sc->sum[j] = 0.0f;
    }
    memset(sc->acc, 0, sizeof(float) * (size_t)nh * G * D);
    /* the first span's rows are in no earlier span's prefetch: ask for all of them at once (a part of
       a split row starts cold; bench/decode_attention.py, avx2 tier, fp16 cache, 3 x 384 positions,
       2 threads, parts of 64: 1.49x -> 1.08x the unsplit time) */
    for (int o = begin; o < begin + SPAN && o < len; ++o)
        for (int h = h0; h < h0 + nh; ++h) {
            prefetch_row(p->key_cache, iv, p->block_size, block_shift, o, len, h, D);
            prefetch_row(p->value_cache, iv, p->block_size, block_shift, o, len, h, D);
        }
    for (int s0 = begin; s0 < len; s0 += SPAN) {
        const int n = len - s0 < SPAN ? len - s0 : SPAN;
        for (int h = h0; h < h0 + nh; ++h) {
            const act_t *q = qrow + (int64_t)h * G * D;
            float *m = sc->mx + (h - h0) * G, *l = sc->sum + (h - h0) * G, *acc = sc->acc + (int64_t)(h - h0) * G * D;
            for (int g0 = 0; g0 < G; g0 += SCORE_HEADS) {
                const int gg = G - g0 < SCORE_HEADS ? G - g0 : SCORE_HEADS;
                float *out = sc->scores + g0 * SPAN;
                const int ahead = g0 == 0 ? prefetch_len : 0;  /* the first group's pass prefetches */
                if (gg == 3) span_scores(p, iv, q + g0 * D, s0, n, h, block_shift, ahead, out, NV, 3);
                else if (gg == 2) span_scores(p, iv, q + g0 * D, s0, n, h, block_shift, ahead, out, NV, 2);
                else span_scores(p, iv, q + g0 * D, s0, n, h, block_shift, ahead, out, NV, 1);
            }
#if SPAN_VALUES_WIDENED
            /* fp8: the span's values of this kv head widened once for every query head of the group */
            float *vspan = (float *)sc->kt;
            for (int o = 0; o < n; ++o) {
                const kv_t *vrow = cache_row(p->value_cache, iv, p->block_size, block_shift, s0 + o, h, D);
                prefetch_row(p->value_cache, iv, p->block_size, block_shift, s0 + o + SPAN_PREFETCH, prefetch_len, h, D);
#pragma GCC unroll 16
                for (int c = 0; c < NV; ++c) store_f32(vspan + o * D + VL * c, load_kv(vrow + VL * c));
            }
#endif
            /* softmax per query head: the span's weights in place, the running max and sum; with
               PV_HEADS 1 the head's p.v follows at once */
            float alpha[MAX_GROUP];
            for (int g = 0; g < G; ++g) {
                float *sg = sc->scores + g * SPAN;
                vf vmax = splat(-FLT_MAX);
                for (int o0 = 0; o0 < n; o0 += VL) {
                    const vf sv = load_f32(sg + o0);
                    vmax = max_lanes(vmax, n - o0 < VL ? select_lanes(mask_lanes_below(n - o0), sv, splat(-FLT_MAX)) : sv);
                }
                const float top = hmax(vmax), new_m = top > m[g] ? top : m[g];
                alpha[g] = exp1(m[g] - new_m);
                m[g] = new_m;
                vf lsum = splat(0.0f);
                for (int o0 = 0; o0 < n; o0 += VL) {
                    vf e = vexp(load_f32(sg + o0) - new_m);
                    if (n - o0 < VL) e = select_lanes(mask_lanes_below(n - o0), e, splat(0.0f));
                    store_f32(sg + o0, e);
                    lsum += e;
                }
                l[g] = l[g] * alpha[g] + hsum(lsum);
#if PV_HEADS == 1
                vf a[MAX_HEAD_DIM / VL];
#pragma GCC unroll 16
                for (int c = 0; c < NV; ++c) a[c] = load_f32(acc + g * D + VL * c) * alpha[g];
                for (int o = 0; o < n; ++o) {
                    const float w = sg[o];
#if SPAN_VALUES_WIDENED
#pragma GCC unroll 16
                    for (int c = 0; c < NV; ++c) a[c] += w * load_f32(vspan + o * D + VL * c);
#else
                    const kv_t *vrow = cache_row(p->value_cache, iv, p->block_size, block_shift, s0 + o, h, D);
                    if (g == 0)
                        prefetch_row(p->value_cache, iv, p->block_size, block_shift, s0 + o + SPAN_PREFETCH, prefetch_len, h, D);
#pragma GCC unroll 16
                    for (int c = 0; c < NV; ++c) a[c] += w * load_kv(vrow + VL * c);
#endif
                }
#pragma GCC unroll 16
                for (int c = 0; c < NV; ++c) store_f32(acc + g * D + VL * c, a[c]);
#endif
            }
#if PV_HEADS > 1
            /* p.v: the group's query heads three at a time over the span's value rows */
            const kv_t *vrows[SPAN];
            for (int o = 0; o < n; ++o)
                vrows[o] = cache_row(p->value_cache, iv, p->block_size, block_shift, s0 + o, h, D);
            for (int g0 = 0; g0 < G; g0 += PV_HEADS) {
                const int gg = G - g0 < PV_HEADS ? G - g0 : PV_HEADS;
                const float *w = sc->scores + g0 * SPAN;
                const int ahead = g0 == 0 ? prefetch_len : 0;   /* the first group's pass prefetches */
                float *ag = acc + g0 * D;
                if (gg == 3) span_pv(p, iv, vrows, w, alpha + g0, ag, s0, n, h, block_shift, ahead, NV, 3);
                else if (gg == 2) span_pv(p, iv, vrows, w, alpha + g0, ag, s0, n, h, block_shift, ahead, NV, 2);
                else span_pv(p, iv, vrows, w, alpha + g0, ag, s0, n, h, block_shift, ahead, NV, 1);
            }
#endif
        }
    }
    if (it->split >= 0) {   /* every kv head (vb_attention_plan) */
        store_part(p, it, sc->acc, sc->mx, sc->sum, 1);
        return;
    }
    for (int j = 0; j < nh * G; ++j) {
        act_t *o = orow + ((int64_t)h0 * G + j) * D;
        const float inv = 1.0f / sc->sum[j];
#pragma GCC unroll 16
        for (int c = 0; c < NV; ++c) store_act(o + VL * c, load_f32(sc->acc + (int64_t)j * D + VL * c) * inv);
    }
}
#endif

#endif
