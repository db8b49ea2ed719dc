/* The gated GEMMs' epilogue (cpu_gemm.c gemm_gated, cpu_gemm_q8.c vb_gemm_q8_gated): a panel's gate
 * block, kept in a per-thread buffer, times SiLU, times the up block already written to y.
 * Reference: vb_silu_and_mul_rows (cpu_elementwise.c), whose formula this is lane for lane in fp32,
 * so a fused GEMM equals the GEMM followed by the op bit for bit (tests/test_cpu_gemm.py,
 * tests/test_cpu_gemm_q8.py).
 */
#ifndef VB_SILU_MUL_H
#define VB_SILU_MUL_H

#include <stdint.h>

#include "vb_simd.h"

/* y[i, 0..nc) = silu(g[i, 0..nc)) * y[i, 0..nc) for `rows` rows; g's rows are ldg floats apart. */
static inline void vb_silu_mul_rows(const float *g, int64_t ldg, float *y, int64_t ldy, int rows, int nc) {
    for (int i = 0; i < rows; ++i) {
        const float *gi = g + (int64_t)i * ldg;
        float *yi = y + (int64_t)i * ldy;
        int c = 0;
        for (; c + VL <= nc; c += VL) {
            const vf gv = load_f32(gi + c);
            store_f32(yi + c, gv / (1.0f + vexp(-gv)) * load_f32(yi + c));
        }
        for (; c < nc; ++c) yi[c] = gi[c] / (1.0f + exp1(-gi[c])) * yi[c];
    }
}

#endif
