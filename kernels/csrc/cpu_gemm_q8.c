/* GEMM over Q8_0 weights in integer arithmetic: y[M, N] = x[M, K] . (q * d)[N, K]^T (+ b), for the
 * large-batch linears of a model loaded with `--quantization q8_0` where it beats oneDNN over the
 * dequantized weights (kernels/cpu_q8_0_linear.py gemm_choice: the avx2 tier; measured there).
 * vb_gemm_q8_gated runs a gated MLP's merged gate/up projection with SiLU-and-mul in its epilogue
 * (kernels/cpu_q8_0_linear.py PackedQ8_0GateUp).
 *
 * Reference: tests/test_cpu_gemm_q8.py computes the same integers in torch (int64) and the block
 * scales in float64, and F.linear on the dequantized weights for the end-to-end tolerance; the gated
 * GEMM also against the plain one followed by vb_silu_and_mul (equal bit for bit).
 *
 * The arithmetic. Each row of x is quantized once per call to int16 with one scale:
 * s = max |x| / 32767, xq = rint(x * (32767 / max |x|)) (xq = 0 for a row of zeros). Per block of 32
 * inputs the products xq * q are summed exactly in int32 (|sum| <= 32 x 32767 x 127 < 2^31), the
 * block sum is converted to fp32 and multiplied by the block's weight scale d into an fp32
 * accumulator, and the row's total is multiplied by s (and the bias added) at the end:
 *     y[m, n] = s[m] * sum_b d[n, b] * sum_{k in b} xq[m, k] q[n, k]  (+ b[n]).
 * The only rounding beyond fp32 accumulation is x's to 1 / 65,534 of its row's largest magnitude
 * (llama.cpp rounds activations to int8 per block of 32 for its Q8_0 dot products: 1 / 254 of the
 * block's).
 *
 * NOTE: why int16 activations and vpmaddwd, not int8 and vpmaddubsw. vpmaddwd multiplies 16 int16
 * pairs and adds neighbours into 8 int32 lanes: 16 multiply-adds per instruction against an fp32
 * FMA's 8, on the integer multipliers (Zen 3: two pipes beside the FMA pipes' two; Intel: the FMA
 * ports). vpmaddubsw does 32 int8 products but saturates their pair sums at int16 (two 8-bit
 * operands overflow it), needs vpmaddwd after it to widen, and so reaches the same 32 products per
 * two multiplier instructions while forcing activations or weights to 7 bits. int16 activations
 * cost nothing extra and keep 15 bits. Where the CPU has AVX-VNNI (Intel since Alder Lake and
 * Sapphire Rapids), vpdpwssd does vpmaddwd and the add in one instruction (`vnni`, chosen at run time:
 * the avx2 tier's build is for any AVX2 CPU).
 *
 * Packed layout (kernels/cpu_q8_0_linear.py pack_panels): the outputs in panels of NR = 16, the last
 * one padded with zero weights and scales; panel p holds its weights as [K / 2][16][2] int16
 * (for each pair of inputs, each output's two weights side by side: one vpmaddwd operand per 8
 * outputs), all panels first, then the scales as fp32 [panels][K / 32][16].
 * Blocking as cpu_gemm.c: threads take contiguous ranges of panels, K goes in near-equal blocks of
 * at most kc_max() (a multiple of 32), rows in blocks of MC; the micro tile is MR rows x 16 outputs.
 * NOTE: as in cpu_gemm.c, in the first row block each panel's first tile prefetches the next
 * panel's weights and scales (read straight from memory there), a block of 32 inputs at a time.
 * Raced in one process against the kernel without it (Zen 4 held to AVX2, 2 threads, SmolLM2's 30
 * layers of four linears, medians of 9 rounds; outputs identical): 4 rows 1.20x, 5 rows 1.24x, 8
 * rows 1.44-1.60x, 16 rows 1.32-1.38x, 32 rows 1.17x, 64 rows 1.05-1.10x, 256-2,048 rows 0.99-1.02x;
 * in the engine (bench/op_times.py --num-prompts 32 --quantization q8_0, two pairs) the decode
 * steps' linears took 5.02 -> 4.38 s.
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vb_blocking.h"
#include "vb_kernels.h"
#include "vb_silu_mul.h"

#define NR 16   /* outputs per panel */
#define MR 6    /* rows per micro tile (block6) */
#define MC 96   /* rows per block */

#if defined(__AVX2__) && defined(__FMA__)
#include <cpuid.h>
#include <immintrin.h>

/* One row of x (k a multiple of 32) -> int16, returns its scale s: 0 for a row of zeros, NaN for a
 * row holding a NaN or an infinity (its outputs are then NaN, as an fp32 GEMM's would not be finite
 * either). The conversion rounds to nearest even (MXCSR's default), as rintf and torch.round. */
static float quantize_row(const float *x, int k, int16_t *xq) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    for (int i = 0; i < k; i += 8) {
        const __m256 v = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i));
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));   /* maxps drops a NaN in its first operand */
        m = _mm256_max_ps(m, v);
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h);
    if (!(amax > 0.0f) || amax > FLT_MAX || _mm256_movemask_ps(bad)) {
        memset(xq, 0, (size_t)k * sizeof(int16_t));
        return amax == 0.0f && !_mm256_movemask_ps(bad) ? 0.0f : NAN;
    }
    const __m256 inv = _mm256_set1_ps(32767.0f / amax);
    const __m256i hi = _mm256_set1_epi32(32767), lo = _mm256_set1_epi32(-32767);
    for (int i = 0; i < k; i += 16) {
        __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), inv));
        __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8), inv));
        a = _mm256_max_epi32(_mm256_min_epi32(a, hi), lo);
        b = _mm256_max_epi32(_mm256_min_epi32(b, hi), lo);
        /* packs works within 128-bit lanes: [a0..3 b0..3 a4..7 b4..7] -> k order */
        _mm256_storeu_si256((__m256i *)(xq + i), _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8));
    }
    return amax / 32767.0f;
}

/* The micro tile's inner loop for MR = 6 rows: one block of 32 inputs (16 pairs) into the 12 int32
 * accumulators. Written in assembly because GCC, given the same loop in intrinsics, hoisted the
 * multiplies of several rows ahead of their adds and spilled accumulators to the stack (objdump of
 * the intrinsics version: 8-12 spills per block); here each row's two products go through one
 * temporary register and the renamer overlaps them. 12 accumulators + 2 weight vectors + the
 * broadcast + the product = all 16 ymm registers. */
#define VB_Q8_ROW(xaddr, c0, c1)                                                  \
    "vpbroadcastd vbq8_i * 4" xaddr ", %%ymm14\n\t"                              \
    "vpmaddwd %%ymm12, %%ymm14, %%ymm15\n\t"                                      \
    "vpaddd %%ymm15, %" c0 ", %" c0 "\n\t"                                        \
    "vpmaddwd %%ymm13, %%ymm14, %%ymm15\n\t"                                      \
    "vpaddd %%ymm15, %" c1 ", %" c1 "\n\t"
/* The same with AVX-VNNI's vpdpwssd, multiply, add neighbours and accumulate in one instruction. */
#define VB_Q8_ROW_VNNI(xaddr, c0, c1)                                             \
    "vpbroadcastd vbq8_i * 4" xaddr ", %%ymm14\n\t"                              \
    "%{vex%} vpdpwssd %%ymm12, %%ymm14, %" c0 "\n\t"                                \
    "%{vex%} vpdpwssd %%ymm13, %%ymm14, %" c1 "\n\t"

#define VB_Q8_BLOCK6(ROW)                                                                               \
    __asm__(".set vbq8_i, 0\n\t"                                                                        \
            ".rept 16\n\t"                                                                              \
            "vmovdqu vbq8_i * 64(%[w]), %%ymm12\n\t"                                                    \
            "vmovdqu vbq8_i * 64 + 32(%[w]), %%ymm13\n\t"                                               \
            ROW("(%[x0])", "[c00]", "[c01]")                                                             \
            ROW("(%[x0],%[ld],1)", "[c10]", "[c11]")                                                     \
            ROW("(%[x0],%[ld],2)", "[c20]", "[c21]")                                                     \
            ROW("(%[x3])", "[c30]", "[c31]")                                                             \
            ROW("(%[x3],%[ld],1)", "[c40]", "[c41]")                                                     \
            ROW("(%[x3],%[ld],2)", "[c50]", "[c51]")                                                     \
            ".set vbq8_i, vbq8_i + 1\n\t"                                                               \
            ".endr"                                                                                     \
            : [c00] "+x"(c[0][0]), [c01] "+x"(c[0][1]), [c10] "+x"(c[1][0]), [c11] "+x"(c[1][1]),        \
              [c20] "+x"(c[2][0]), [c21] "+x"(c[2][1]), [c30] "+x"(c[3][0]), [c31] "+x"(c[3][1]),        \
              [c40] "+x"(c[4][0]), [c41] "+x"(c[4][1]), [c50] "+x"(c[5][0]), [c51] "+x"(c[5][1])         \
            : [w] "r"(w), [x0] "r"(x), [x3] "r"(x3), [ld] "r"(ld)                                       \
            : "xmm12", "xmm13", "xmm14", "xmm15", "memory")

static inline __attribute__((always_inline)) void block6(const int16_t *x, int64_t ldq, const int16_t *w,
                                                         __m256i c[6][2], int vnni) {
    const int16_t *x3 = x + 3 * ldq;
    const int64_t ld = ldq * (int64_t)sizeof(int16_t);
#ifndef VB_NO_AVXVNNI_ASM
    if (vnni)
        VB_Q8_BLOCK6(VB_Q8_ROW_VNNI);
    else
#endif
        VB_Q8_BLOCK6(VB_Q8_ROW);
    (void)vnni;
}

/* AVX-VNNI: CPUID leaf 7, sub-leaf 1, EAX bit 4 (the build may lack it: an assembler older than
 * binutils 2.36 does not know `{vex} vpdpwssd`, and kernels/native_build.py then defines
 * VB_NO_AVXVNNI_ASM). */
static int has_avxvnni(void) {
#ifdef VB_NO_AVXVNNI_ASM
    return 0;
#else
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a >> 4 & 1);
#endif
}
#undef VB_Q8_BLOCK6
#undef VB_Q8_ROW_VNNI
#undef VB_Q8_ROW

/* y[0..mr, 0..nc) (+)= the k block [k0, k0 + kc) of one panel: w is the panel's pairs from k0 on
 * ([kc / 2][16][2]), d its scales from block k0 / 32 on ([kc / 32][16]). `first`: start from zero, else
 * from y; `last`: finish the rows (times s, plus the bias). nc < 16: only nc outputs are written. */
static inline __attribute__((always_inline)) void tile(const int mr, int nc, int kc, const int16_t *xq,
                                                       int64_t ldq, const int16_t *w, const float *d, float *y,
                                                       int64_t ldy, const float *s, const float *bias, int first,
                                                       int last, int vnni, const int16_t *pw, const float *pd) {
    __m256 c[MR][2];
#pragma GCC unroll 6
    for (int i = 0; i < mr; ++i) c[i][0] = c[i][1] = _mm256_setzero_ps();
    for (int b = 0; b < kc; b += VB_Q8_BLOCK) {
        if (pw) {   /* the next panel's weights and scales of this block (1 KiB + 64 B) into the L2 */
            const char *next = (const char *)(pw + (int64_t)b * NR);
#pragma GCC unroll 16
            for (int l = 0; l < VB_Q8_BLOCK * NR * 2; l += 64) _mm_prefetch(next + l, _MM_HINT_T1);
            _mm_prefetch((const char *)(pd + (b / VB_Q8_BLOCK) * NR), _MM_HINT_T1);
        }
        __m256i acc[MR][2];
#pragma GCC unroll 6
        for (int i = 0; i < mr; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
        if (mr == MR) {
            block6(xq + b, ldq, w + (int64_t)b * NR, acc, vnni);
        } else
#pragma GCC unroll 4
        for (int p = 0; p < VB_Q8_BLOCK / 2; ++p) {
            const int16_t *wp = w + (int64_t)(b / 2 + p) * 2 * NR;
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)wp);
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(wp + NR));
#pragma GCC unroll 6
            for (int i = 0; i < mr; ++i) {
                int32_t pair;
                memcpy(&pair, xq + i * ldq + b + 2 * p, sizeof pair);
                const __m256i a = _mm256_set1_epi32(pair);
                acc[i][0] = _mm256_add_epi32(acc[i][0], _mm256_madd_epi16(a, w0));
                acc[i][1] = _mm256_add_epi32(acc[i][1], _mm256_madd_epi16(a, w1));
            }
        }
        const __m256 d0 = _mm256_loadu_ps(d + (b / VB_Q8_BLOCK) * NR);
        const __m256 d1 = _mm256_loadu_ps(d + (b / VB_Q8_BLOCK) * NR + 8);
#pragma GCC unroll 6
        for (int i = 0; i < mr; ++i) {
            c[i][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i][0]), d0, c[i][0]);
            c[i][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i][1]), d1, c[i][1]);
        }
    }
    if (nc == NR) {
        const __m256 b0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
        const __m256 b1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
#pragma GCC unroll 6
        for (int i = 0; i < mr; ++i) {
            float *yi = y + i * ldy;
            __m256 v0 = c[i][0], v1 = c[i][1];
            if (!first) v0 = _mm256_add_ps(_mm256_loadu_ps(yi), v0), v1 = _mm256_add_ps(_mm256_loadu_ps(yi + 8), v1);
            if (last) {
                const __m256 si = _mm256_set1_ps(s[i]);
                v0 = _mm256_fmadd_ps(v0, si, b0), v1 = _mm256_fmadd_ps(v1, si, b1);
            }
            _mm256_storeu_ps(yi, v0), _mm256_storeu_ps(yi + 8, v1);
        }
        return;
    }
    for (int i = 0; i < mr; ++i) {  /* the last panel's nc < 16 outputs */
        float out[NR];
        _mm256_storeu_ps(out, c[i][0]);
        _mm256_storeu_ps(out + 8, c[i][1]);
        float *yi = y + i * ldy;
        for (int j = 0; j < nc; ++j) {
            float v = first ? out[j] : yi[j] + out[j];
            if (last) v = fmaf(v, s[i], bias ? bias[j] : 0.0f);
            yi[j] = v;
        }
    }
}

static void panel_rows(int nc, int r0, int r1, int k0, int kc, int last, int vnni, const int16_t *xq, int64_t ldq,
                       const int16_t *w, const float *d, float *y, int64_t ldy, const float *s, const float *bias,
                       const int16_t *pw, const float *pd) {
    const int first = k0 == 0;
    int i = r0;
    if (pw && i + MR <= r1) {   /* the first tile also prefetches the next panel's block */
        tile(MR, nc, kc, xq + i * ldq + k0, ldq, w, d, y + i * ldy, ldy, s + i, bias, first, last, vnni, pw, pd);
        i += MR;
        pw = NULL, pd = NULL;
    }
    for (; i + MR <= r1; i += MR)
        tile(MR, nc, kc, xq + i * ldq + k0, ldq, w, d, y + i * ldy, ldy, s + i, bias, first, last, vnni, NULL, NULL);
    const int16_t *xi = xq + i * ldq + k0;
    float *yi = y + i * ldy;
    switch (r1 - i) {
        case 5: tile(5, nc, kc, xi, ldq, w, d, yi, ldy, s + i, bias, first, last, vnni, pw, pd); break;
        case 4: tile(4, nc, kc, xi, ldq, w, d, yi, ldy, s + i, bias, first, last, vnni, pw, pd); break;
        case 3: tile(3, nc, kc, xi, ldq, w, d, yi, ldy, s + i, bias, first, last, vnni, pw, pd); break;
        case 2: tile(2, nc, kc, xi, ldq, w, d, yi, ldy, s + i, bias, first, last, vnni, pw, pd); break;
        case 1: tile(1, nc, kc, xi, ldq, w, d, yi, ldy, s + i, bias, first, last, vnni, pw, pd); break;
        default: break;
    }
}

/* The most k per block (vb_blocking.h): the 96-row block of int16 activations and one panel's
 * weights, (MC + NR) x 2 bytes per k, in half the L2: 2,336 for 1 MiB (Zen 4), 1,152 for 512 KiB
 * (Zen 3), 4,672 for 2 MiB (the Intel Xeon). Until session 24 it was three quarters of the L1 (544
 * for 32 KiB); on Zen 4 with the avx2 tier held the L2 bound ran 0.90-1.02x the L1 bound's time at
 * 16-2,048 rows (median 0.93; SmolLM2's four layer shapes summed, 15 rounds alternating in one
 * process), and at K = 4,096-8,192 every block from 544 to unblocked was within 3%. */
static int kc_max(void) {
    static int cached;
    if (!cached) cached = vb_k_block(2 * (MC + NR), VB_Q8_BLOCK);
    return cached;
}

/* K in near-equal blocks of whole 32s, each at most kc_max(). */
static int k_block(int k) {
    const int blocks = k / VB_Q8_BLOCK, k_blocks = (k + kc_max() - 1) / kc_max();
    return (blocks + k_blocks - 1) / k_blocks * VB_Q8_BLOCK;
}

/* x's m rows rounded to int16 (xq [m][k], scales s [m]), shared among the enclosing team: an omp for,
 * so it ends with the team's barrier. */
static void quantize_rows(const float *x, int64_t ldx, int m, int k, int16_t *xq, float *s) {
#pragma omp for schedule(static)
    for (int r = 0; r < m; ++r) s[r] = quantize_row(x + r * ldx, k, xq + (int64_t)r * k);
}

int VB_ACT(vb_gemm_q8)(const float *x, int64_t ldx, const int16_t *packed, const float *bias, float *y,
                       int64_t ldy, int m, int n, int k, int vnni, int num_threads) {
    if (k <= 0 || k % VB_Q8_BLOCK) return 2;
    if (vnni && !has_avxvnni()) return 4;
    const int panels = (n + NR - 1) / NR;
    const float *scales = (const float *)(packed + (int64_t)panels * NR * k);
    int16_t *xq = malloc((size_t)m * k * sizeof(int16_t));
    float *s = malloc((size_t)(m > 0 ? m : 1) * sizeof(float));
    if (!xq || !s) {
        free(xq), free(s);
        return 3;
    }
    const int blocks = k / VB_Q8_BLOCK, kb = k_block(k);
#pragma omp parallel num_threads(num_threads)
    {
        quantize_rows(x, ldx, m, k, xq, s);
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int p0 = (int)((int64_t)panels * t / nt), p1 = (int)((int64_t)panels * (t + 1) / nt);
        for (int k0 = 0; k0 < k; k0 += kb) {
            const int kc = k - k0 < kb ? k - k0 : kb, last = k0 + kc == k;
            for (int r0 = 0; r0 < m; r0 += MC) {
                const int r1 = m - r0 < MC ? m : r0 + MC;
                for (int p = p0; p < p1; ++p) {
                    const int nc = n - p * NR < NR ? n - p * NR : NR;
                    const int16_t *w = packed + (int64_t)p * NR * k + (int64_t)k0 * NR;
                    const float *d = scales + ((int64_t)p * blocks + k0 / VB_Q8_BLOCK) * NR;
                    /* the next panel's block, read straight from memory in the first row block */
                    const int pref = r0 == 0 && p + 1 < p1;
                    panel_rows(nc, r0, r1, k0, kc, last, vnni, xq, k, w, d, y + p * NR, ldy, s,
                               bias ? bias + p * NR : NULL, pref ? w + (int64_t)NR * k : NULL,
                               pref ? d + (int64_t)blocks * NR : NULL);
                }
            }
        }
    }
    free(xq), free(s);
    return 0;
}

/* The gated GEMM over Q8_0 weights: `packed` is a gated MLP's merged [gate; up] projection ([2 *
 * inter, K], inter a multiple of 16, pack_panels), so up panel p lies inter / 16 panels after gate
 * panel p; bias [2 * inter] (the gate's, then the up's) or NULL. y[m, inter] = silu(gate) * up: each
 * thread takes a range of gate panels and, per block of MC rows, computes gate panel p into a
 * per-thread [MC][16] buffer and up panel p into y, then the epilogue (vb_silu_mul.h), so the
 * [m, 2 * inter] product is never written out and read back. The sums are vb_gemm_q8's (the same
 * tiles and k blocks), so it equals vb_gemm_q8 over the merged weight followed by vb_silu_and_mul
 * bit for bit (tests/test_cpu_gemm_q8.py).
 * NOTE: what it saves is the product's write and the op's read of it, against multiply-adds that
 * run about 1.4x faster here than in the fp32 GEMM, so the gain is small. Raced against vb_gemm_q8
 * + vb_silu_and_mul (bench/gemm_builds.py --kernel gated-q8_0: Zen 4 held to AVX2, 2 threads, 30
 * layers' gate/up [3072, 576], both sides allocating their outputs per call as the engine does,
 * medians of 7-11 rounds; outputs identical): 8 rows 1.05x, 16 rows 0.97-0.98x, 32 rows 1.05x, 64
 * rows 1.01x, 256 rows 1.07x, 2,048 rows 1.05x. In the engine (bench/op_times.py --num-prompts 64
 * --quantization q8_0, ABBA) the gate/up and the op took 7.08 / 7.07 s of the prefill steps
 * unfused and 6.71 / 7.26 s fused: within the machine's noise (docs/performance/avx2-on-zen4.md,
 * session 28). */
int VB_ACT(vb_gemm_q8_gated)(const float *x, int64_t ldx, const int16_t *packed, const float *bias, float *y,
                             int64_t ldy, int m, int inter, int k, int vnni, int num_threads) {
    if (k <= 0 || k % VB_Q8_BLOCK || inter <= 0 || inter % NR) return 2;
    if (vnni && !has_avxvnni()) return 4;
    const int half = inter / NR, blocks = k / VB_Q8_BLOCK, kb = k_block(k);
    const float *scales = (const float *)(packed + (int64_t)2 * half * NR * k);
    int16_t *xq = malloc((size_t)m * k * sizeof(int16_t));
    float *s = malloc((size_t)(m > 0 ? m : 1) * sizeof(float));
    if (!xq || !s) {
        free(xq), free(s);
        return 3;
    }
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        quantize_rows(x, ldx, m, k, xq, s);
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int p0 = (int)((int64_t)half * t / nt), p1 = (int)((int64_t)half * (t + 1) / nt);
        float *gbuf = p1 > p0 && m > 0 ? aligned_alloc(64, (size_t)MC * NR * sizeof(float)) : NULL;
        if (p1 > p0 && m > 0 && !gbuf) failed = 1;
        for (int r0 = 0; r0 < m && gbuf; r0 += MC) {
            const int rows = m - r0 < MC ? m - r0 : MC;
            const int16_t *xr = xq + (int64_t)r0 * k;
            float *yr = y + (int64_t)r0 * ldy;
            for (int p = p0; p < p1; ++p) {
                for (int up = 0; up < 2; ++up) {
                    const int panel = p + up * half;
                    /* what the tiles prefetch in the first row block (weights straight from memory there):
                       the up panel during the gate's, the next gate panel during the up's */
                    const int next = up ? (p + 1 < p1 ? p + 1 : -1) : p + half, pref = r0 == 0 && next >= 0;
                    for (int k0 = 0; k0 < k; k0 += kb) {
                        const int kc = k - k0 < kb ? k - k0 : kb;
                        const int64_t at = (int64_t)k0 * NR, block = k0 / VB_Q8_BLOCK;
                        const int16_t *w = packed + (int64_t)panel * NR * k + at;
                        const float *d = scales + ((int64_t)panel * blocks + block) * NR;
                        panel_rows(NR, 0, rows, k0, kc, k0 + kc == k, vnni, xr, k, w, d, up ? yr + p * NR : gbuf,
                                   up ? ldy : NR, s + r0, bias ? bias + up * inter + p * NR : NULL,
                                   pref ? packed + (int64_t)next * NR * k + at : NULL,
                                   pref ? scales + ((int64_t)next * blocks + block) * NR : NULL);
                    }
                }
                vb_silu_mul_rows(gbuf, NR, yr + p * NR, ldy, rows, NR);
            }
        }
        free(gbuf);
    }
    free(xq), free(s);
    return failed ? 3 : 0;
}

#else

int VB_ACT(vb_gemm_q8)(const float *x, int64_t ldx, const int16_t *packed, const float *bias, float *y,
                       int64_t ldy, int m, int n, int k, int vnni, int num_threads) {
    (void)x, (void)ldx, (void)packed, (void)bias, (void)y, (void)ldy, (void)m, (void)n, (void)k, (void)vnni;
    (void)num_threads;
    return 1;
}

int VB_ACT(vb_gemm_q8_gated)(const float *x, int64_t ldx, const int16_t *packed, const float *bias, float *y,
                             int64_t ldy, int m, int inter, int k, int vnni, int num_threads) {
    (void)x, (void)ldx, (void)packed, (void)bias, (void)y, (void)ldy, (void)m, (void)inter, (void)k, (void)vnni;
    (void)num_threads;
    return 1;
}

#endif
