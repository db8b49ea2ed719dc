/* y = x W^T + b for a few rows of x (decode at small batch), bf16 in and out, fp32 accumulation.
 *
 * Specification and test oracle: torch.nn.functional.linear on the same bf16 tensors.
 * Python binding: kernels/cpu_native.py; used by kernels/cpu_linear.py below a row threshold.
 *
 * NOTE: why. At one to a few rows a linear layer is a pass over its weight: oneDNN's packed GEMM
 * reads it at about 13 GB/s here (its blocking is built for many rows), this kernel streams the
 * plain [out, in] weight, each thread over a contiguous range of output rows, near the memory
 * bandwidth. Dot products use vdpbf16ps (bf16 pairs multiplied exactly, summed in fp32) where the
 * CPU has avx512_bf16; 16 output rows at a time, their partial-dot vectors summed by one
 * transposing tree. Without avx512_bf16 the library is built without this kernel and the caller
 * keeps oneDNN (vb_linear_small_bf16 returns 1).
 */
#include <string.h>

#include "vb_kernels.h"
#include "vb_simd.h"

#if defined(__AVX512BF16__)

#define MAX_ROWS 8

/* Output rows [n0, n0 + 16) (fewer at the end) for every x row: each weight row is read once,
 * front to back, and used for all m_rows rows of x. */
static void tile(const bf16 *x, const bf16 *w, const bf16 *bias, bf16 *y, int m_rows, int n_out, int k_in,
                 int n0) {
    const int full = k_in / 32, tail = k_in % 32, nt = n_out - n0 < 16 ? n_out - n0 : 16;
    const __mmask32 tail_mask = (__mmask32)((1ull << tail) - 1);
    __m512 d[MAX_ROWS][16];
    for (int j = 0; j < 16; ++j) {
        if (j >= nt) {
            for (int m = 0; m < m_rows; ++m) d[m][j] = _mm512_setzero_ps();
            continue;
        }
        const bf16 *wr = w + (int64_t)(n0 + j) * k_in;
        __m512 a0[MAX_ROWS], a1[MAX_ROWS];  /* two chains per x row: even and odd chunks */
        for (int m = 0; m < m_rows; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
        int c = 0;
        for (; c + 1 < full; c += 2) {
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wr + 32 * c);
            const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wr + 32 * c + 32);
            for (int m = 0; m < m_rows; ++m) {
                const bf16 *xm = x + (int64_t)m * k_in + 32 * c;
                a0[m] = _mm512_dpbf16_ps(a0[m], (__m512bh)_mm512_loadu_si512(xm), w0);
                a1[m] = _mm512_dpbf16_ps(a1[m], (__m512bh)_mm512_loadu_si512(xm + 32), w1);
            }
        }
        for (; c < full + (tail ? 1 : 0); ++c) {  /* an odd last chunk and the masked tail */
            const __mmask32 mask = c < full ? (__mmask32)~0u : tail_mask;
            const __m512bh wc = (__m512bh)_mm512_maskz_loadu_epi16(mask, wr + 32 * c);
            for (int m = 0; m < m_rows; ++m)
                a0[m] = _mm512_dpbf16_ps(a0[m], (__m512bh)_mm512_maskz_loadu_epi16(mask, x + (int64_t)m * k_in + 32 * c), wc);
        }
        for (int m = 0; m < m_rows; ++m) d[m][j] = _mm512_add_ps(a0[m], a1[m]);
    }
    const __mmask16 keep = (__mmask16)((1u << nt) - 1);
    const __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep, bias + n0)), 16))
                          : _mm512_setzero_ps();
    for (int m = 0; m < m_rows; ++m)
        _mm256_mask_storeu_epi16(y + (int64_t)m * n_out + n0, keep, (__m256i)round_bf16x16((v16f)_mm512_add_ps(sum16x16(d[m]), b)));
}

/* On the enclosing team (see vb_kernels.h). Returns 0, or 1: no such kernel in this build / too many rows. */
int vb_linear_small_shared(const bf16 *x, const bf16 *w, const bf16 *bias, bf16 *y, int m_rows, int n_out,
                           int k_in) {
    if (m_rows < 1 || m_rows > MAX_ROWS) return 1;
    /* contiguous tile ranges per thread: each streams its part of the weight front to back */
#pragma omp for schedule(static)
    for (int t = 0; t < (n_out + 15) / 16; ++t) tile(x, w, bias, y, m_rows, n_out, k_in, 16 * t);
    return 0;
}

int vb_linear_small_bf16(const bf16 *x, const bf16 *w, const bf16 *bias, bf16 *y, int m_rows, int n_out,
                         int k_in, int num_threads) {
    if (m_rows < 1 || m_rows > MAX_ROWS) return 1;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && n_out > 16)
    vb_linear_small_shared(x, w, bias, y, m_rows, n_out, k_in);
    return 0;
}

#else

int vb_linear_small_shared(const bf16 *x, const bf16 *w, const bf16 *bias, bf16 *y, int m_rows, int n_out,
                           int k_in) {
    (void)x; (void)w; (void)bias; (void)y; (void)m_rows; (void)n_out; (void)k_in;
    return 1;
}

int vb_linear_small_bf16(const bf16 *x, const bf16 *w, const bf16 *bias, bf16 *y, int m_rows, int n_out,
                         int k_in, int num_threads) {
    (void)num_threads;
    return vb_linear_small_shared(x, w, bias, y, m_rows, n_out, k_in);
}

#endif
