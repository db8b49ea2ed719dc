/* fp32 GEMM over a weight packed once: y[M, N] = x[M, K] . W[N, K]^T (+ b), for the large-batch
 * linears on CPUs where it beats the libraries (kernels/cpu_linear.py NATIVE, chosen per CPU).
 *
 * Reference: torch.nn.functional.linear on the unpacked weight (tests/test_cpu_gemm.py, every shape
 * edge: rows not a multiple of 6, outputs not a multiple of 16, K not a multiple of the block).
 *
 * Packed layout (kernels/cpu_linear.py pack_panels): the N outputs in panels of NR = 16; panel p
 * (outputs 16p .. 16p + 15) is [K][16], k-major; a last panel of r < 16 outputs is [K][r]. So the
 * packed weight holds N x K floats, like W, and keeps W's shape.
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
 * So the micro tile is AVX2 + FMA intrinsics; a build without them has no GEMM (returns 1) and the
 * libraries serve.
 */
#include <omp.h>
#include <stdint.h>

#include "vb_blocking.h"
#include "vb_kernels.h"

#define NR 16   /* outputs per panel */
#define MR 6    /* rows per micro tile */
#define MC 96   /* rows per block */

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* y[0..mr, 0..nc) (+)= x[0..mr, 0..kc) . w: w is [kc][ncp] (ncp = 16 for a whole panel, else nc, and
 * then nc lanes are loaded and stored under a mask). `first`: start from the bias (or zero), else
 * from y (the earlier k blocks' sums). */
static inline __attribute__((always_inline)) void tile(const int mr, const int whole, int nc, int kc,
                                                       const float *x, int64_t ldx, const float *w, float *y,
                                                       int64_t ldy, const float *bias, int first) {
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

/* Rows [r0, r1) of one panel over k block [k0, k0 + kc): 6-row tiles, then the 1-5 rows left. */
static void panel_rows(int whole, int nc, int r0, int r1, int k0, int kc, const float *x, int64_t ldx,
                       const float *w, float *y, int64_t ldy, const float *bias) {
    const int first = k0 == 0;
    int i = r0;
    if (whole) {
        for (; i + MR <= r1; i += MR) tile(MR, 1, NR, kc, x + i * ldx + k0, ldx, w, y + i * ldy, ldy, bias, first);
    } else {
        for (; i + MR <= r1; i += MR) tile(MR, 0, nc, kc, x + i * ldx + k0, ldx, w, y + i * ldy, ldy, bias, first);
    }
    const float *xi = x + i * ldx + k0;
    float *yi = y + i * ldy;
#define VB_GEMM_LEFT(m) \
    (whole ? tile(m, 1, NR, kc, xi, ldx, w, yi, ldy, bias, first) : tile(m, 0, nc, kc, xi, ldx, w, yi, ldy, bias, first))
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

int VB_ACT(vb_gemm)(const float *x, int64_t ldx, const float *packed, const float *bias, float *y, int64_t ldy,
                    int m, int n, int k, int num_threads) {
    const int panels = (n + NR - 1) / NR;
    const int kc_most = kc_max();
    const int k_blocks = (k + kc_most - 1) / kc_most, kb = (k + k_blocks - 1) / k_blocks;  /* k >= 1 */
#pragma omp parallel num_threads(num_threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int p0 = (int)((int64_t)panels * t / nt), p1 = (int)((int64_t)panels * (t + 1) / nt);
        for (int k0 = 0; k0 < k; k0 += kb) {
            const int kc = k - k0 < kb ? k - k0 : kb;
            for (int r0 = 0; r0 < m; r0 += MC) {
                const int r1 = m - r0 < MC ? m : r0 + MC;
                for (int p = p0; p < p1; ++p) {
                    const int nc = n - p * NR < NR ? n - p * NR : NR;
                    const float *w = packed + (int64_t)p * NR * k + (int64_t)k0 * nc;
                    panel_rows(nc == NR, nc, r0, r1, k0, kc, x, ldx, w, y + p * NR, ldy, bias ? bias + p * NR : NULL);
                }
            }
        }
    }
    return 0;
}

#else

int VB_ACT(vb_gemm)(const float *x, int64_t ldx, const float *packed, const float *bias, float *y, int64_t ldy,
                    int m, int n, int k, int num_threads) {
    (void)x, (void)ldx, (void)packed, (void)bias, (void)y, (void)ldy, (void)m, (void)n, (void)k, (void)num_threads;
    return 1;
}

#endif
