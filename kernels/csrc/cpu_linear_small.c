/* y = x W^T + b for a few rows of x (decode at small batch: 1 to MAX_ROWS), fp32 accumulation.
 *
 * Specification and test oracle: torch.nn.functional.linear on the same tensors (the weight
 * widened to fp32 first where it is stored in half precision).
 * Python binding: kernels/cpu_native.py; used by kernels/cpu_linear.py below a row threshold.
 *
 * NOTE: why. At one to a few rows a linear layer is a pass over its weight: oneDNN's packed GEMM
 * reads it at about 13 GB/s here (its blocking is built for many rows), this kernel streams the
 * plain [out, in] weight, each thread over a contiguous range of output rows, near the memory
 * bandwidth. Two builds (vb_act.h):
 *  - bf16 activations: bf16 weights, dot products by vdpbf16ps (bf16 pairs multiplied exactly,
 *    summed in fp32), tiles of 16 output rows, their partial-dot vectors summed by one
 *    transposing tree; each thread reads its tiles as four far-apart streams side by side, each
 *    prefetched ahead. Only where the CPU has avx512_bf16; elsewhere the kernel returns 1 and the
 *    caller keeps its GEMM.
 *  - fp32 activations (every CPU tier): the weight stored as fp32, fp16 or bf16 and widened in
 *    registers (F16C's vcvtph2ps, a shift for bf16), so a half-precision weight halves the bytes
 *    streamed, or as Q8_0 blocks (int8 and an fp16 scale per 32, vb_kernels.h), 53% of fp16's
 *    bytes; products and sums in fp32 FMAs, 8 lanes at a time; each thread reads its output
 *    rows as several far-apart streams side by side (each weight vector used for every row of x).
 */
#include <omp.h>
#include <string.h>

#include "vb_kernels.h"

/* Rows of x one call takes, in passes of up to 4 over the weight: at least any CPU tier's
 * `small_rows_wider` (kernels/cpu_features.py: 16 on every tier since session 33, measured:
 * kernels/cpu_linear.py PackedLinear's NOTE), where the caller's GEMM library multiplies a wider copy
 * of the weights than this kernel reads (fp32 over fp16, bf16 or Q8_0 storage); 32 so that
 * bench/small_rows_limit.py can race limits above it. */
#define MAX_ROWS 32

/* VB_PREFETCH_STREAMS: defined by the build on Intel CPUs (cpu_features.CpuFeatures.
 * prefetches_weight_streams), where prefetching each weight stream ahead of its loads helps the bf16
 * and fp32 kernels below; each has its own distance, measured, and a -D of it overrides the choice
 * (VBATCH_NATIVE_CFLAGS, for measuring). The Q8_0 rows prefetch on every CPU (their NOTE). */

/* This thread's contiguous share [*begin, *end) of `count` units (tiles or rows), the team's threads
 * in order: each thread then reads its part of the weight as a few streams (below). */
static inline void team_share(int count, int *begin, int *end) {
    const int threads = omp_get_num_threads(), me = omp_get_thread_num();
    *begin = (int)((int64_t)count * me / threads);
    *end = (int)((int64_t)count * (me + 1) / threads);
}

#if VB_ACT_BF16 && defined(__AVX512BF16__)

/* S tiles of 16 output rows at once, starting at rows n0[0..S) that lie far apart, for M rows of
 * x: S sequential streams (each tile's rows read front to back, one after another), one vdpbf16ps
 * chain per (stream, x row) along each weight row, each weight chunk used for all M rows of x and
 * each x chunk for all S streams; the 16 sums of each (stream, x row) by one transposing tree at
 * the end. A tile may end before 16 rows (the weight's last: `last` rows, S == 1 only).
 * Every output is summed the same way whichever S its tile went with, so the result does not
 * depend on the thread count (which decides the streams) or on the rows of x beside it.
 * NOTE: why several streams and a software prefetch: one stream per core keeps too few misses in
 * flight. Measured on an Intel Xeon (AVX-512 + AMX, 2 threads): a plain read gets 25.9 GB/s with
 * one stream per thread, 29.8 with two, 30.9 with four (cpu_read_probe.c); this kernel over the
 * model's 120 decoder matrices and its head in turn (bench/small_rows.py, bf16, medians of 15
 * passes), at 1 / 2 / 4 rows of x: 14.2 / 12.8 / 11.0 GB/s one tile after another (the kernel
 * before), 19.5 / 18.4 / 16.3 with four streams (eight: 19.0 at one row), 22.3-22.9 / 19.9-20.3 /
 * 18.5-19.8 with each stream also prefetched 2 KB ahead (512 B: 20.4-20.9, 1 KB: 20.2-21.8, 3 KB:
 * 22.3, 4 KB: 20.9-21.8).
 * NOTE: on Zen 4 the prefetch does not help (AMD EPYC, avx512_bf16, 2 threads, the same script,
 * each build in its own process, 5 alternating rounds, medians): at 1 / 2 / 4 rows 26.1 / 20.5 /
 * 21.1 GB/s with it, 26.2 / 23.9 / 23.1 without (2 and 4 rows: every round; 3 more rounds with
 * the instruction left out: 2 rows 23.9-25.5 against 19.3-23.8, 4 rows 20.1-24.5 against
 * 20.3-21.0). One stream per thread there: 20-28 GB/s at one row, 15-23 at four; two streams
 * 20-28 / 18-25. So the 2 KB prefetch is built in on Intel only (VB_PREFETCH_STREAMS above), the
 * four streams everywhere. Session 36 raced 1-2 KB ahead at 3-4 rows only, in one process on Zen 4
 * (`python bench/small_rows.py --tier avx512-bf16 --rows R --against <the build without>`, 80-100
 * rounds): 0.97-1.16x the speed, varying with the minute, and a tie end to end at 4 prompts. Not
 * kept (unlike the fp32 rows' deeper prefetch at 3-4 rows below). */
#ifndef BF16_STREAMS
#define BF16_STREAMS 4
#endif
#ifndef BF16_PREFETCH
#ifdef VB_PREFETCH_STREAMS
#define BF16_PREFETCH 2048
#else
#define BF16_PREFETCH 0
#endif
#endif
static inline __attribute__((always_inline)) void tiles(
        const bf16 *x, const bf16 *w, const bf16 *bias, bf16 *y, int n_out, int k_in, const int *n0, int last,
        const int S, const int M) {
    const int full = k_in / 32, tail = k_in % 32;
    const __mmask32 tail_mask = (__mmask32)((1ull << tail) - 1);
    __m512 d[BF16_STREAMS][4][16];  /* [stream][x row][tile row] */
    for (int j = 0; j < 16; ++j) {
        if (j >= last) {  /* past the weight's last row (S == 1) */
            for (int m = 0; m < M; ++m) d[0][m][j] = _mm512_setzero_ps();
            continue;
        }
        const bf16 *wr[BF16_STREAMS];
        for (int s = 0; s < S; ++s) wr[s] = w + (int64_t)(n0[s] + j) * k_in;
        __m512 acc[BF16_STREAMS][4];
        for (int s = 0; s < S; ++s)
            for (int m = 0; m < M; ++m) acc[s][m] = _mm512_setzero_ps();
        for (int c = 0; c < full + (tail ? 1 : 0); ++c) {
            const __mmask32 mask = c < full ? (__mmask32)~0u : tail_mask;
            __m512bh xv[4];
            for (int m = 0; m < M; ++m) xv[m] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + (int64_t)m * k_in + 32 * c);
            for (int s = 0; s < S; ++s) {
                const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, wr[s] + 32 * c);
                if (BF16_PREFETCH) __builtin_prefetch((const char *)(wr[s] + 32 * c) + BF16_PREFETCH);
                for (int m = 0; m < M; ++m) acc[s][m] = _mm512_dpbf16_ps(acc[s][m], xv[m], wv);
            }
        }
        for (int s = 0; s < S; ++s)
            for (int m = 0; m < M; ++m) d[s][m][j] = acc[s][m];
    }
    const __mmask16 keep = (__mmask16)((1u << (last < 16 ? last : 16)) - 1);
    for (int s = 0; s < S; ++s) {
        const __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                    _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep, bias + n0[s])), 16))
                              : _mm512_setzero_ps();
        for (int m = 0; m < M; ++m)
            _mm256_mask_storeu_epi16(y + (int64_t)m * n_out + n0[s], keep,
                                     (__m256i)round_bf16((vf)_mm512_add_ps(sum16x16(d[s][m]), b)));
    }
}

/* This thread's share of the tiles (contiguous, the team's threads in order), cut into
 * BF16_STREAMS equal parts read side by side; the tiles of unequal parts and the weight's last,
 * partial tile go one at a time. Ends with the team's barrier like an `omp for`. */
static inline __attribute__((always_inline)) void share_bf16(
        const bf16 *x, const bf16 *w, const bf16 *bias, bf16 *y, int n_out, int k_in, const int M) {
    const int S = BF16_STREAMS;
    int begin, end;
    team_share((n_out + 15) / 16, &begin, &end);
    const int part = (end - begin + S - 1) / S;
    for (int r = 0; r < part; ++r) {
        int n0[BF16_STREAMS], valid = 0, whole = 1;
        for (int s = 0; s < S; ++s) {
            const int t = begin + s * part + r;
            if (t < end) {
                n0[valid++] = 16 * t;
                whole &= 16 * t + 16 <= n_out;
            }
        }
        if (valid == S && whole)
            tiles(x, w, bias, y, n_out, k_in, n0, 16, S, M);
        else
            for (int s = 0; s < valid; ++s)
                tiles(x, w, bias, y, n_out, k_in, n0 + s, n_out - n0[s] < 16 ? n_out - n0[s] : 16, 1, M);
    }
#pragma omp barrier
}

/* On the enclosing team (see vb_kernels.h). Returns 0, or 1: no such kernel in this build / too many rows. */
int VB_ACT(vb_linear_small_shared)(const act_t *x, const void *weight, int weight_format, const act_t *bias, act_t *y,
                                   int m_rows, int n_out, int k_in) {
    if (m_rows < 1 || m_rows > MAX_ROWS || weight_format != VB_WEIGHT_BF16) return 1;
    const bf16 *w = weight;
    for (int m0 = 0; m0 < m_rows; m0 += 4) {  /* up to 4 rows of x in one pass over the weight */
        const bf16 *xs = x + (int64_t)m0 * k_in;
        bf16 *ys = y + (int64_t)m0 * n_out;
        switch (m_rows - m0 < 4 ? m_rows - m0 : 4) {
            case 1: share_bf16(xs, w, bias, ys, n_out, k_in, 1); break;
            case 2: share_bf16(xs, w, bias, ys, n_out, k_in, 2); break;
            case 3: share_bf16(xs, w, bias, ys, n_out, k_in, 3); break;
            default: share_bf16(xs, w, bias, ys, n_out, k_in, 4); break;
        }
    }
    return 0;
}

#elif VB_ACT_BF16  /* bf16 activations without avx512_bf16: no kernel, the caller keeps its GEMM */

int VB_ACT(vb_linear_small_shared)(const act_t *x, const void *weight, int weight_format, const act_t *bias, act_t *y,
                                   int m_rows, int n_out, int k_in) {
    (void)x; (void)weight; (void)weight_format; (void)bias; (void)y; (void)m_rows; (void)n_out; (void)k_in;
    return 1;
}

#else  /* fp32 activations */

/* VL weights at w + k, widened to fp32 (FMT is a compile-time constant in the copies below). */
static inline __attribute__((always_inline)) vf load_w(const void *w, int64_t k, const int FMT) {
    if (FMT == VB_WEIGHT_F32) return load_f32((const float *)w + k);
    if (FMT == VB_WEIGHT_BF16) return load_bf16((const bf16 *)w + k);
    return load_f16((const uint16_t *)w + k);
}

static inline float weight_at(const void *w, int64_t k, const int FMT) {  /* one weight, for the tail */
    if (FMT == VB_WEIGHT_F32) return ((const float *)w)[k];
    uint16_t h[VL] = {0};
    h[0] = ((const uint16_t *)w)[k];
    return load_w(h, 0, FMT)[0];
}

/* rows_f32 (below) for a VB_WEIGHT_Q8_0 weight (vb_kernels.h; k_in a multiple of 32): each weight
 * vector is widened from int8 and multiplied by its block's scale, w = q * d rounded to fp32 exactly as
 * the reference dequantizes it (kernels/q8_0.py), then used like a widened half-precision one.
 * NOTE: why dequantize per vector rather than sum q * x per block and scale the block's sum: the
 * per-block sums would need S x M more accumulators than the 16 registers hold at 8 streams, and
 * the products would differ from the dequantized weight's. The multiply is one more instruction
 * per 8 weights, against half the bytes of fp16 streamed.
 * NOTE: why software prefetch here (it gave nothing on the fp16 rows): int8 rows carry half the
 * bytes per instruction, so the core's out-of-order window spans half as many lines and keeps
 * fewer misses in flight. Measured on Zen 3, 2 threads, one [58368, 576] weight: 9 Gw/s (weights
 * per second) without prefetch, the same as fp16; prefetching 256 / 384 / 512 / 640 / 768 / 1024
 * bytes ahead: 9.9 / 13.1 / 15.9 / 16.4-17.4 / 15-19 / 17.4 Gw/s, fp16 8-12 in the same runs. */
#ifndef Q8_PREFETCH
#define Q8_PREFETCH 768
#endif
/* Passes of 3-4 rows of x (2 streams a thread, as for the half-precision rows below): further ahead.
 * Zen 4, avx2 tier, 4 rows (`bench/small_rows.py --weights q8_0 --rows 4 --against`, 100 rounds):
 * 1,536 / 3,072 bytes ahead 1.07x / 1.08x the speed of 768 (again 1.08x over 60 rounds); at 1 row
 * 768 stays (1,536: 1.00-1.05x). End to end a tie (8 prompts, `--quantization q8_0`, avx2 held: 440
 * against 443 output tok/s, medians of 3 ABBA runs): these rows spend more on widening than on reading. */
#ifndef Q8_PREFETCH_FEW
#define Q8_PREFETCH_FEW 3072
#endif
static inline __attribute__((always_inline)) void rows_q8(
        const float *x, const void *w, const float *bias, float *y, int n_out, int k_in, const int *n,
        const int S, const int M) {
    const int64_t stride = k_in + k_in / VB_Q8_BLOCK * 2;  /* bytes per row: the values, then the scales */
    const int8_t *row[8];
    const uint16_t *scale[8];
    for (int s = 0; s < S; ++s) {
        row[s] = (const int8_t *)w + (int64_t)n[s] * stride;
        scale[s] = (const uint16_t *)(row[s] + k_in);
    }
    vf acc[8][4];
    for (int s = 0; s < S; ++s)
        for (int m = 0; m < M; ++m) acc[s][m] = splat(0.0f);
    for (int b = 0; b < k_in / VB_Q8_BLOCK; ++b) {
        vf d[8];
        for (int s = 0; s < S; ++s) d[s] = splat(f16_to_f32(scale[s][b]));
        if ((b & 1) == 0)  /* a line every 64 bytes of each stream, Q8_PREFETCH bytes ahead (see NOTE) */
            for (int s = 0; s < S; ++s) __builtin_prefetch(row[s] + b * VB_Q8_BLOCK + (S <= 2 ? Q8_PREFETCH_FEW : Q8_PREFETCH));
        for (int k = b * VB_Q8_BLOCK; k < (b + 1) * VB_Q8_BLOCK; k += VL) {
            vf xv[4];
            for (int m = 0; m < M; ++m) xv[m] = load_f32(x + (int64_t)m * k_in + k);
            for (int s = 0; s < S; ++s) {
                const vf wv = load_i8(row[s] + k) * d[s];
                for (int m = 0; m < M; ++m) acc[s][m] += xv[m] * wv;
            }
        }
    }
    for (int s = 0; s < S; ++s)
        for (int m = 0; m < M; ++m) y[(int64_t)m * n_out + n[s]] = hsum(acc[s][m]) + (bias ? bias[n[s]] : 0.0f);
}

/* S output rows of M rows of x at once, the rows n[0..S) lying far apart: S sequential streams
 * per thread, each weight row read front to back, one FMA chain per (stream, x row); each weight
 * vector is used for all M rows of x, each x vector for all S streams.
 * NOTE: why several streams: a core keeps more cache misses in flight over several far-apart
 * sequential streams than over one. Measured on Zen 3, 2 threads, a 512 MB read
 * (cpu_read_probe.c): 21 GB/s with one stream per thread, 23 with two, 26 with four, 32 with
 * eight. This kernel over one [233472, 576] fp16 weight: 16.5 GB/s one row after another (the
 * earlier kernel), 22.5 with four streams; over the model's 120 decoder matrices in turn 16 ->
 * 19.9 (four streams, two chains) -> 20.5 (eight streams, one chain). From L2 it runs at 60 GB/s,
 * so memory, not the arithmetic, bounds it. Software prefetch 256-2048 bytes ahead in each
 * stream: no gain (15.5-20.5 GB/s, the longer distances slower).
 * NOTE: on Intel the same prefetch helps: on the Xeon of docs/performance/intel-xeon.md (`python
 * bench/small_rows.py --dtype float32 --weights float16 --rows 1`, 2 threads, alternating) 1 KB
 * ahead took the avx2 tier from 21.5 to 24.2 GB/s (medians of 4 rounds) and the AVX-512 tier from
 * 21.7 to 25.6 (3 rounds); 2-3 KB gained less. So it is built in on Intel CPUs only
 * (VB_PREFETCH_STREAMS above). */
#ifndef VB_F32_PREFETCH
#ifdef VB_PREFETCH_STREAMS
#define VB_F32_PREFETCH 1024
#else
#define VB_F32_PREFETCH 0
#endif
#endif
/* NOTE: passes of 3-4 rows of x read only 2 streams per thread (STREAMS below: 8 accumulators in
 * 16 registers), and each weight line feeds 3-4 rows' FMAs, so its loads come further apart: too
 * few misses in flight for the hardware prefetchers alone. There a prefetch 4 KB ahead helps; it is
 * built in on every CPU, as the cause is, though only Zen 4 has measured it (Zen 3 and the Intel
 * Xeon are owed). Zen 4 (AMD EPYC, 2 threads; `python bench/small_rows.py --rows R --tier T
 * --against <builds with -DVB_F32_PREFETCH_FEW=...>`, alternating in one process, 60-100 rounds),
 * the avx2 tier over fp16 weights at 4 rows: 34.2-34.9 -> 47.2-47.4 GB/s (1.35-1.38x; 2 KB 1.28x,
 * 3 KB 1.34x, 6-8 KB 1.37-1.38x), at 3 rows 1.14x (2 KB 1.09x); the avx512 tier at 4 rows 1.17x.
 * At 1 and 2 rows (8 and 4 streams) the choice above stays: on Zen 4, 2 KB ahead at 2 rows gave
 * 1.00-1.06x, 1 KB at 1 row 0.96x in some minutes and 1.09x in others. The portable tier, compiled
 * for x86-64 without F16C, widens too slowly to wait on memory (7 GB/s at 4 rows): 0.98x there.
 * End to end (avx2 held, `vbatch bench throughput --num-prompts P --input-len 128 --output-len
 * 256`, ABBA): 4 prompts 1.17x, 8 prompts 1.14x (every round), 16 prompts 1.13x (noisier). */
#ifndef VB_F32_PREFETCH_FEW
#define VB_F32_PREFETCH_FEW 4096
#endif
static inline __attribute__((always_inline)) void rows_f32(
        const float *x, const void *w, const float *bias, float *y, int n_out, int k_in, const int *n,
        const int S, const int M, const int FMT) {
    if (FMT == VB_WEIGHT_Q8_0) {
        rows_q8(x, w, bias, y, n_out, k_in, n, S, M);
        return;
    }
    const int esize = FMT == VB_WEIGHT_F32 ? 4 : 2;
    const char *row[8];
    for (int s = 0; s < S; ++s) row[s] = (const char *)w + (int64_t)n[s] * k_in * esize;
    vf acc[8][4];
    for (int s = 0; s < S; ++s)
        for (int m = 0; m < M; ++m) acc[s][m] = splat(0.0f);
    for (int k = 0; k + VL <= k_in; k += VL) {
        vf xv[4];
        for (int m = 0; m < M; ++m) xv[m] = load_f32(x + (int64_t)m * k_in + k);
        const int ahead = S <= 2 ? VB_F32_PREFETCH_FEW : VB_F32_PREFETCH;
        if (ahead && (k * esize) % 64 == 0)  /* a line of each stream, `ahead` bytes ahead */
            for (int s = 0; s < S; ++s) __builtin_prefetch(row[s] + (int64_t)k * esize + ahead);
        for (int s = 0; s < S; ++s) {
            const vf wv = load_w(row[s], k, FMT);
            for (int m = 0; m < M; ++m) acc[s][m] += xv[m] * wv;
        }
    }
    for (int s = 0; s < S; ++s)
        for (int m = 0; m < M; ++m) {
            float sum = hsum(acc[s][m]);
            for (int k = k_in / VL * VL; k < k_in; ++k) sum += x[(int64_t)m * k_in + k] * weight_at(row[s], k, FMT);
            y[(int64_t)m * n_out + n[s]] = sum + (bias ? bias[n[s]] : 0.0f);
        }
}

/* Streams for M rows of x: S x M accumulators (independent FMA chains, enough to cover the FMA
 * latency at the rate memory feeds them) within 8 of the 16 registers of AVX2 (and SSE / NEON),
 * the rest for the x and weight vectors. */
/* At one row of x over fp32 / fp16 / bf16 weights: 4 streams on every tier; over Q8_0 weights 8.
 * NOTE: why 4: on Zen 4 the avx512 tier over fp16 weights read 1.10x faster with 4 than with 8
 * (`python bench/small_rows.py --tier avx512 --dtype float32 --weights float16 --rows 1 --rounds 150
 * --against <a build with -DSTREAMS_1=8>`, twice, probe at 80 GB/s), as the Intel Xeon's 16-lane bf16
 * kernel did (BF16_STREAMS' NOTE: 19.5 GB/s at four, 19.0 at eight). The narrow tiers had 8, chosen on
 * Zen 3 in session 8 (20.5 GB/s at eight against 19.9 at four, a tie); Zen 4 and Zen 5 held to AVX2
 * then read 1.13-1.14x faster at four, and Zen 3 itself again in session 40 (`python bench/retune.py
 * --tier avx2 --only STREAMS_1`, 60 rounds, twice): 1.027x and 1.117x the speed of eight; the portable
 * tier over bf16 1.034x.
 * NOTE: why not for Q8_0: its int8 rows carry half the bytes per instruction (rows_q8's NOTE), and on
 * 16 lanes they read faster at eight: 1.06x (avx512 tier) and 1.09x (avx512-bf16 tier's fp32 rows)
 * the speed of four on Zen 4 (`--weights q8_0 --rows 1 --rounds 120 --against <-DSTREAMS_1=8>`). */
#ifndef STREAMS_1
#define STREAMS_1 4
#endif
#define STREAMS(M, FMT) ((M) == 1 ? ((FMT) == VB_WEIGHT_Q8_0 ? 8 : STREAMS_1) : (M) == 2 ? 4 : 2)

/* This thread's share of the output rows (contiguous, the team's threads in order), cut into
 * STREAMS(M, FMT) equal parts read side by side; ends with the team's barrier like an `omp for`. */
static inline __attribute__((always_inline)) void share_f32(
        const float *x, const void *w, const float *bias, float *y, int n_out, int k_in, const int M, const int FMT) {
    const int S = STREAMS(M, FMT);
    int begin, end;
    team_share(n_out, &begin, &end);
    const int part = (end - begin + S - 1) / S;
    for (int r = 0; r < part; ++r) {
        int n[8], valid = 0;
        for (int s = 0; s < S; ++s)
            if (begin + s * part + r < end) n[valid++] = begin + s * part + r;
        if (valid == S)
            rows_f32(x, w, bias, y, n_out, k_in, n, S, M, FMT);
        else
            for (int s = 0; s < valid; ++s) rows_f32(x, w, bias, y, n_out, k_in, n + s, 1, M, FMT);
    }
#pragma omp barrier
}

/* Up to 4 rows of x in one pass over the weight (more: one pass per 4 rows). */
static inline __attribute__((always_inline)) void pass_f32(
        const float *x, const void *w, const float *bias, float *y, int m_rows, int n_out, int k_in, const int FMT) {
    for (int m0 = 0; m0 < m_rows; m0 += 4) {
        const float *xs = x + (int64_t)m0 * k_in;
        float *ys = y + (int64_t)m0 * n_out;
        switch (m_rows - m0 < 4 ? m_rows - m0 : 4) {
            case 1: share_f32(xs, w, bias, ys, n_out, k_in, 1, FMT); break;
            case 2: share_f32(xs, w, bias, ys, n_out, k_in, 2, FMT); break;
            case 3: share_f32(xs, w, bias, ys, n_out, k_in, 3, FMT); break;
            default: share_f32(xs, w, bias, ys, n_out, k_in, 4, FMT); break;
        }
    }
}

/* On the enclosing team (see vb_kernels.h). Returns 0, or 1 for an unknown format / too many rows
 * (or a Q8_0 weight whose rows are not whole blocks). */
int VB_ACT(vb_linear_small_shared)(const act_t *x, const void *weight, int weight_format, const act_t *bias, act_t *y,
                                   int m_rows, int n_out, int k_in) {
    if (m_rows < 1 || m_rows > MAX_ROWS) return 1;
    switch (weight_format) {
        case VB_WEIGHT_F32: pass_f32(x, weight, bias, y, m_rows, n_out, k_in, VB_WEIGHT_F32); return 0;
        case VB_WEIGHT_F16: pass_f32(x, weight, bias, y, m_rows, n_out, k_in, VB_WEIGHT_F16); return 0;
        case VB_WEIGHT_BF16: pass_f32(x, weight, bias, y, m_rows, n_out, k_in, VB_WEIGHT_BF16); return 0;
        case VB_WEIGHT_Q8_0:
            if (k_in % VB_Q8_BLOCK) return 1;
            pass_f32(x, weight, bias, y, m_rows, n_out, k_in, VB_WEIGHT_Q8_0);
            return 0;
        default: return 1;
    }
}
#endif

int VB_ACT(vb_linear_small)(const act_t *x, const void *weight, int weight_format, const act_t *bias, act_t *y,
                            int m_rows, int n_out, int k_in, int num_threads) {
    if (m_rows < 1 || m_rows > MAX_ROWS) return 1;
    int rc = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && n_out > 16)
    {
        const int mine = VB_ACT(vb_linear_small_shared)(x, weight, weight_format, bias, y, m_rows, n_out, k_in);
        if (mine) {
#pragma omp atomic write
            rc = mine;
        }
    }
    return rc;
}
