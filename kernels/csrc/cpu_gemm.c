/* fp32 GEMM over a weight packed once: y[M, N] = x[M, K] . W[N, K]^T (+ b), for the large-batch
 * linears on CPUs where it beats the libraries (kernels/gemm_libraries.py: the avx2 tier's default,
 * CpuTier.native_gemm). The weight in fp32 (vb_gemm) or fp16 (vb_gemm_f16: the avx2 tier's storage,
 * so no fp32 copy of the model is kept; each panel's k block is widened exactly, with F16C, into a
 * per-thread buffer once per block of MC rows and read from there by all its micro tiles). The gated
 * GEMM (vb_gemm_gated, _f16) runs a gated MLP's gate and up projections together, SiLU-and-mul in
 * its epilogue (gemm_gated's NOTE).
 *
 * Reference: torch.nn.functional.linear on the unpacked weight (tests/test_cpu_gemm.py, every shape
 * edge: rows not a multiple of 6, outputs not a multiple of 16, K not a multiple of the block); the
 * gated GEMM also against itself unfused followed by vb_silu_and_mul (equal bit for bit).
 *
 * Packed layout (kernels/gemm_libraries.py pack_panels): the N outputs in panels of NR = 16; panel p
 * (outputs 16p .. 16p + 15) is [K][16], k-major; a last panel of r < 16 outputs is [K][r]. So the
 * packed weight holds N x K values, like W, and keeps W's shape and dtype.
 * Blocking (as BLIS's): each thread takes a contiguous range of panels; K goes in near-equal blocks
 * of at most kc_max() (vb_blocking.h: a panel's block, 64 B per k, and the MC rows' block of x, MC x
 * 4 B per k, in half the L2: 1,152 for 1 MiB, 576 for 512 KiB); rows go in blocks of MC. The micro
 * tile is 6 rows x 16 outputs: 12 accumulators, and per k two loads of W and six broadcasts of x.
 *
 * NOTE: why by hand, and why intrinsics. On Zen 3 (2 threads, SmolLM2's layer shapes) oneDNN's fp32
 * GEMM ran at 68% of the cores' multiply-add peak at 256 rows and 74-78% at 1,024-2,048
 * (bench/gemm_backends.py: 119 / 137 / 130 of 176 GFLOP/s); a scratch version of this kernel ran
 * 143 and 128-148 in the same session. Written against vb_simd.h's generic vectors the same loop ran
 * at 52-92: GCC emitted each broadcast as a splat plus an add of zero (x + 0 is not x for -0.0).
 * So the micro tile is AVX2 + FMA intrinsics; a build without them (or F16C) has no GEMM (returns 1)
 * and the libraries serve.
 * NOTE: why fp16 panels cost nothing. On Zen 4 held to AVX2 (2 threads, SmolLM2-135M's 121 matrices
 * in turn, one process alternating; session 26) the fp16 panels ran 0.95-1.02x the fp32 panels' speed
 * at 16-8,192 rows: widening a 576 x 16 block is ~2% of the 96 rows' multiply-adds on it, and at 16-64
 * rows this GEMM is bound by its tiles, not by the bytes (docs/performance/avx2-on-zen4.md "vbatch's own GEMM over fp16 panels").
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "vb_blocking.h"
#include "vb_kernels.h"
#include "vb_silu_mul.h"
#include "vb_simd.h"

#define NR 16   /* outputs per panel */
#define MR 6    /* rows per micro tile */
#define MC 96   /* rows per block */

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

/* y[0..mr, 0..nc) (+)= x[0..mr, 0..kc) . w: w is [kc][ncp] (ncp = 16 for a whole panel, else nc, and
 * then nc lanes are loaded and stored under a mask). `first`: start from the bias (or zero), else
 * from y (the earlier k blocks' sums). `prefetching` (a constant at each call): also pull pf[0 ..
 * kc * pf_step) into the L2, a line's worth at each k (gemm's NOTE on the next block). */
static inline __attribute__((always_inline)) void tile(const int mr, const int whole, int nc, int kc,
                                                       const float *x, int64_t ldx, const float *w, float *y,
                                                       int64_t ldy, const float *bias, int first,
                                                       const int prefetching, const char *pf, int64_t pf_step) {
    const int ncp = whole ? NR : nc;
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(nc), lane);
    const __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(nc - 8), lane);
    __m256 c[MR][2];
#pragma GCC unroll 6
    for (int i = 0; i < mr; ++i) {
        if (first) {
            c[i][0] = !bias ? _mm256_setzero_ps() : whole ? _mm256_loadu_ps(bias) : _mm256_maskload_ps(bias, m0);
            c[i][1] = !bias ? _mm256_setzero_ps() : whole ? _mm256_loadu_ps(bias + 8) : _mm256_maskload_ps(bias + 8, m1);
        } else {
            c[i][0] = whole ? _mm256_loadu_ps(y + i * ldy) : _mm256_maskload_ps(y + i * ldy, m0);
            c[i][1] = whole ? _mm256_loadu_ps(y + i * ldy + 8) : _mm256_maskload_ps(y + i * ldy + 8, m1);
        }
    }
    for (int k = 0; k < kc; ++k) {
        if (prefetching) _mm_prefetch(pf + pf_step * k, _MM_HINT_T1);
        const __m256 b0 = whole ? _mm256_loadu_ps(w + NR * k) : _mm256_maskload_ps(w + ncp * k, m0);
        const __m256 b1 = whole ? _mm256_loadu_ps(w + NR * k + 8) : _mm256_maskload_ps(w + ncp * k + 8, m1);
#pragma GCC unroll 6
        for (int i = 0; i < mr; ++i) {
            const __m256 a = _mm256_broadcast_ss(x + i * ldx + k);
            c[i][0] = _mm256_fmadd_ps(a, b0, c[i][0]);
            c[i][1] = _mm256_fmadd_ps(a, b1, c[i][1]);
        }
    }
#pragma GCC unroll 6
    for (int i = 0; i < mr; ++i) {
        if (whole) {
            _mm256_storeu_ps(y + i * ldy, c[i][0]);
            _mm256_storeu_ps(y + i * ldy + 8, c[i][1]);
        } else {
            _mm256_maskstore_ps(y + i * ldy, m0, c[i][0]);
            _mm256_maskstore_ps(y + i * ldy + 8, m1, c[i][1]);
        }
    }
}

/* Rows [r0, r1) of one panel over k block [k0, k0 + kc): 6-row tiles, then the 1-5 rows left. The
 * first tile (of 6 rows, or of all the rows when fewer) also prefetches the block read next, pf (kc
 * x pf_step bytes), when there is one. */
static void panel_rows(int whole, int nc, int r0, int r1, int k0, int kc, const float *x, int64_t ldx,
                       const float *w, float *y, int64_t ldy, const float *bias, const char *pf, int64_t pf_step) {
    const int first = k0 == 0;
    int i = r0;
    if (pf && i + MR <= r1) {
        if (whole) tile(MR, 1, NR, kc, x + i * ldx + k0, ldx, w, y + i * ldy, ldy, bias, first, 1, pf, pf_step);
        else tile(MR, 0, nc, kc, x + i * ldx + k0, ldx, w, y + i * ldy, ldy, bias, first, 1, pf, pf_step);
        i += MR;
        pf = NULL;
    }
    if (whole) {
        for (; i + MR <= r1; i += MR) tile(MR, 1, NR, kc, x + i * ldx + k0, ldx, w, y + i * ldy, ldy, bias, first, 0, 0, 0);
    } else {
        for (; i + MR <= r1; i += MR) tile(MR, 0, nc, kc, x + i * ldx + k0, ldx, w, y + i * ldy, ldy, bias, first, 0, 0, 0);
    }
    const float *xi = x + i * ldx + k0;
    float *yi = y + i * ldy;
#define VB_GEMM_LEFT(m) \
    (pf ? (whole ? tile(m, 1, NR, kc, xi, ldx, w, yi, ldy, bias, first, 1, pf, pf_step) \
                 : tile(m, 0, nc, kc, xi, ldx, w, yi, ldy, bias, first, 1, pf, pf_step)) \
        : (whole ? tile(m, 1, NR, kc, xi, ldx, w, yi, ldy, bias, first, 0, 0, 0) \
                 : tile(m, 0, nc, kc, xi, ldx, w, yi, ldy, bias, first, 0, 0, 0)))
    switch (r1 - i) {
        case 5: VB_GEMM_LEFT(5); break;
        case 4: VB_GEMM_LEFT(4); break;
        case 3: VB_GEMM_LEFT(3); break;
        case 2: VB_GEMM_LEFT(2); break;
        case 1: VB_GEMM_LEFT(1); break;
        default: break;
    }
#undef VB_GEMM_LEFT
}

/* Until session 24 the block was 256 (a panel's block in the L1), which cut K = 576 in three and
 * 1,536 in six. On Zen 4 with the avx2 tier held (2 threads, SmolLM2's four layer shapes summed, 7
 * rounds alternating in one process with oneDNN), blocks of 576-1,536 ran 0.95-0.98x oneDNN's time at
 * 256-8,192 rows, where 256 ran 1.01-1.06x. */
static int kc_max(void) {
    static int cached;
    if (!cached) cached = vb_k_block((long)((MC + NR) * sizeof(float)), 64);
    return cached;
}

/* A panel's k block of fp16 weights ([kc][nc] halves) widened to fp32 in `out` (exact: every fp16 value
 * is an fp32 value); the micro tiles then read it from the L1/L2 as they read fp32 panels. */
static void widen_block(const uint16_t *w, int count, float *out) {
    int i = 0;
    for (; i + 8 <= count; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + i))));
    for (; i < count; ++i) out[i] = _cvtsh_ss(w[i]);
}

/* Outputs in panel p of n (16, or fewer in the last). */
static inline int panel_width(int n, int p) { return n - p * NR < NR ? n - p * NR : NR; }

/* The panel whose block a thread reads after panel p's, to prefetch (gemm's NOTE): its next panel,
 * or with fp16 panels (widened at every row block) its first panel p0 when more rows follow; with
 * fp32 panels only in the first row block (later ones come from the L3). -1: none. */
static inline int next_panel(int p, int p0, int p1, int half, int first_rows, int more_rows) {
    if (!half && !first_rows) return -1;
    return p + 1 < p1 ? p + 1 : half && more_rows ? p0 : -1;
}

/* The GEMM over fp32 panels (half = 0) or fp16 panels (half = 1: each panel's k block widened into a
 * per-thread buffer once per row block, then used by every micro tile of it).
 * NOTE: why each panel prefetches the next. A thread reads its panels' k blocks one after another,
 * fp32 panels straight from memory in the first row block, fp16 ones widened in every row block, and
 * the widening stalled on their loads: 6.5% of a 64-prompt run's samples (perf, Zen 4 held to AVX2)
 * sat in its loop, against 61% in the micro tiles. So the first micro tile of each panel pulls the
 * block read next into the L2, one line's worth per k beside its own loads: the next panel's block,
 * or (fp16) the thread's first panel's at the next row block. Raced in one process against the
 * kernel without it (Zen 4 with the avx2 tier held, 2 threads, SmolLM2-135M's 30 layers of four
 * linears in turn, medians of 9 alternating rounds): fp16 panels 1.40x at 16 rows, 1.10x at 64, 1.06x
 * at 256, 0.98-1.00x at 2,048-8,192; fp32 panels 1.34x / 1.09x / 1.04x, 0.98-1.01x. Prefetching in
 * later row blocks too (fp32) lost 2-7% at 8,192 rows (those panels come from the L3). A lone tile
 * of 1-5 rows prefetches as well: fp16 panels 1.66-1.76x at 1-5 rows (session 27). */
static int gemm(const float *x, int64_t ldx, const void *packed, int half, const float *bias, float *y, int64_t ldy,
                int m, int n, int k, int num_threads) {
    const int panels = (n + NR - 1) / NR;
    const int kc_most = kc_max();
    const int k_blocks = (k + kc_most - 1) / kc_most, kb = (k + k_blocks - 1) / k_blocks;  /* k >= 1 */
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int p0 = (int)((int64_t)panels * t / nt), p1 = (int)((int64_t)panels * (t + 1) / nt);
        float *wide = half ? aligned_alloc(64, ((size_t)kb * NR * sizeof(float) + 63) / 64 * 64) : NULL;
        if (half && !wide) failed = 1;
        for (int k0 = 0; k0 < k && !failed; k0 += kb) {
            const int kc = k - k0 < kb ? k - k0 : kb;
            for (int r0 = 0; r0 < m; r0 += MC) {
                const int r1 = m - r0 < MC ? m : r0 + MC;
                for (int p = p0; p < p1; ++p) {
                    const int nc = panel_width(n, p);
                    const int64_t at = (int64_t)p * NR * k + (int64_t)k0 * nc;   /* the block's first weight */
                    const float *w;
                    if (half) {
                        widen_block((const uint16_t *)packed + at, kc * nc, wide);
                        w = wide;
                    } else {
                        w = (const float *)packed + at;
                    }
                    /* the block this thread reads next, into the L2 while this one computes (NOTE above) */
                    const int q = next_panel(p, p0, p1, half, r0 == 0, r1 < m);
                    const int64_t elem = half ? 2 : 4, nq = q < 0 ? 0 : panel_width(n, q);
                    const char *pf = q < 0 ? NULL : (const char *)packed + ((int64_t)q * NR * k + (int64_t)k0 * nq) * elem;
                    const int64_t pf_step = nq * elem;
                    panel_rows(nc == NR, nc, r0, r1, k0, kc, x, ldx, w, y + p * NR, ldy, bias ? bias + p * NR : NULL,
                               pf, pf_step);
                }
            }
        }
        free(wide);
    }
    return failed ? 3 : 0;
}

/* The gated GEMM: the packed weight holds a gated MLP's gate and up projections (each [inter, K]) as
 * pairs of panels (kernels/gemm_libraries.py pack_gated: panel p of the gate, [K][nc], then panel p of
 * the up projection), and each thread computes both panels of a pair over a row block, one after the
 * other, while the row block's x is in the L2. fuse: y[M, inter] = silu(gate) * up, the gate's block
 * kept in a per-thread [rows][16] buffer and never written out; else y[M, 2 * inter] = gate | up.
 * One k block of all of K (the gate's sums must be whole before SiLU), so the row block shrinks
 * for a long K to keep x's block and a widened panel in half the L2 (vb_row_block).
 * NOTE: why fused. The plain GEMM writes the [M, 2 * inter] product out and the op reads it back;
 * here only silu(gate) * up is written. Raced in one process against vb_gemm_f16 + vb_silu_and_mul
 * (Zen 4 held to AVX2, 2 threads, SmolLM2-135M's 30 gate/up projections, fp16 weights, medians of 7
 * alternating rounds; the results equal bit for bit; both sides allocating their outputs per call
 * as the engine does, session 28): 1.016x at 16 rows, 1.038x at 64, 1.037x at 256, 0.984x at 2,048
 * (the MLP's row chunk, cpu_linear.MLP_CHUNK_ROWS); end to end 1.016x (session 27's ABBA). */
static int gemm_gated(const float *x, int64_t ldx, const void *packed, int half, const float *bias, float *y,
                      int64_t ldy, int m, int inter, int k, int fuse, int num_threads) {
    const int panels = (inter + NR - 1) / NR;
    const int mc = vb_row_block((long)k * sizeof(float), (long)k * NR * sizeof(float), MC, MR);
    const int64_t elem = half ? 2 : 4;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int p0 = (int)((int64_t)panels * t / nt), p1 = (int)((int64_t)panels * (t + 1) / nt);
        float *wide = half ? aligned_alloc(64, ((size_t)k * NR * sizeof(float) + 63) / 64 * 64) : NULL;
        float *gbuf = fuse ? aligned_alloc(64, (size_t)mc * NR * sizeof(float)) : NULL;
        if ((half && !wide) || (fuse && !gbuf)) failed = 1;
        for (int r0 = 0; r0 < m && !failed; r0 += mc) {
            const int rows = m - r0 < mc ? m - r0 : mc;
            const float *xr = x + (int64_t)r0 * ldx;
            float *yr = y + (int64_t)r0 * ldy;
            for (int p = p0; p < p1; ++p) {
                const int nc = panel_width(inter, p), whole = nc == NR;
                const char *gate = (const char *)packed + (int64_t)p * 2 * NR * k * elem;  /* pair p */
                const char *up = gate + (int64_t)nc * k * elem;
                /* what the tiles prefetch: the up panel during the gate's, the next pair's gate (or, fp16,
                   the thread's first pair's at the next row block) during the up's */
                const int q = next_panel(p, p0, p1, half, r0 == 0, r0 + rows < m);
                const int nq = q < 0 ? 0 : panel_width(inter, q);
                const char *next = q < 0 ? NULL : (const char *)packed + (int64_t)q * 2 * NR * k * elem;
                const float *w = (const float *)gate;
                if (half) {
                    widen_block((const uint16_t *)gate, k * nc, wide);
                    w = wide;
                }
                panel_rows(whole, nc, 0, rows, 0, k, xr, ldx, w, fuse ? gbuf : yr + p * NR, fuse ? NR : ldy,
                           bias ? bias + p * NR : NULL, half || r0 == 0 ? up : NULL, nc * elem);
                w = (const float *)up;
                if (half) {
                    widen_block((const uint16_t *)up, k * nc, wide);
                    w = wide;
                }
                float *yu = yr + (fuse ? 0 : inter) + p * NR;
                panel_rows(whole, nc, 0, rows, 0, k, xr, ldx, w, yu, ldy, bias ? bias + inter + p * NR : NULL,
                           next, nq * elem);
                if (fuse) vb_silu_mul_rows(gbuf, NR, yu, ldy, rows, nc);
            }
        }
        free(wide);
        free(gbuf);
    }
    return failed ? 3 : 0;
}

int VB_ACT(vb_gemm)(const float *x, int64_t ldx, const float *packed, const float *bias, float *y, int64_t ldy,
                    int m, int n, int k, int num_threads) {
    return gemm(x, ldx, packed, 0, bias, y, ldy, m, n, k, num_threads);
}

int VB_ACT(vb_gemm_gated)(const float *x, int64_t ldx, const float *packed, const float *bias, float *y, int64_t ldy,
                          int m, int inter, int k, int fuse, int num_threads) {
    return gemm_gated(x, ldx, packed, 0, bias, y, ldy, m, inter, k, fuse, num_threads);
}

int VB_ACT(vb_gemm_gated_f16)(const float *x, int64_t ldx, const uint16_t *packed, const float *bias, float *y,
                              int64_t ldy, int m, int inter, int k, int fuse, int num_threads) {
    return gemm_gated(x, ldx, packed, 1, bias, y, ldy, m, inter, k, fuse, num_threads);
}

int VB_ACT(vb_gemm_f16)(const float *x, int64_t ldx, const uint16_t *packed, const float *bias, float *y,
                        int64_t ldy, int m, int n, int k, int num_threads) {
    return gemm(x, ldx, packed, 1, bias, y, ldy, m, n, k, num_threads);
}

#else

int VB_ACT(vb_gemm)(const float *x, int64_t ldx, const float *packed, const float *bias, float *y, int64_t ldy,
                    int m, int n, int k, int num_threads) {
    (void)x, (void)ldx, (void)packed, (void)bias, (void)y, (void)ldy, (void)m, (void)n, (void)k, (void)num_threads;
    return 1;
}

int VB_ACT(vb_gemm_f16)(const float *x, int64_t ldx, const uint16_t *packed, const float *bias, float *y,
                        int64_t ldy, int m, int n, int k, int num_threads) {
    (void)x, (void)ldx, (void)packed, (void)bias, (void)y, (void)ldy, (void)m, (void)n, (void)k, (void)num_threads;
    return 1;
}

int VB_ACT(vb_gemm_gated)(const float *x, int64_t ldx, const float *packed, const float *bias, float *y, int64_t ldy,
                          int m, int inter, int k, int fuse, int num_threads) {
    (void)x, (void)ldx, (void)packed, (void)bias, (void)y, (void)ldy, (void)m, (void)inter, (void)k, (void)fuse;
    (void)num_threads;
    return 1;
}

int VB_ACT(vb_gemm_gated_f16)(const float *x, int64_t ldx, const uint16_t *packed, const float *bias, float *y,
                              int64_t ldy, int m, int inter, int k, int fuse, int num_threads) {
    (void)x, (void)ldx, (void)packed, (void)bias, (void)y, (void)ldy, (void)m, (void)inter, (void)k, (void)fuse;
    (void)num_threads;
    return 1;
}

#endif
