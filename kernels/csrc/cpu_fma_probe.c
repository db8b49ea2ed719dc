/* The machine's fp32 multiply-add rate as this tier's vectors get it: registers only, no memory.
 *
 * Specification: every thread runs CHAINS independent chains of a = a * x + y on VL-lane vectors,
 * `iters` steps each (chain c starts at 1 + c / 16, x and y are the arguments), and the call returns
 * the sum over threads, chains and lanes of the final a: the value tests/test_cpu_native.py
 * recomputes. The chains start apart so that no compiler can fold them into one.
 * What is measured is the time: 2 x VL x CHAINS x iters FLOPs per thread. Python binding:
 * kernels/cpu_native.py fma_probe; used by bench/gemm_backends.py to say how close the GEMM
 * libraries come to the cores' peak.
 *
 * NOTE: why. A GEMM rate alone does not say whether a faster GEMM could exist. On the Intel Xeon
 * held to AVX2 (session 12) this probe reads 237-240 GFLOP/s on 2 threads; oneDNN's fp32 GEMMs ran
 * the model's shapes at 200-213 (84-89%) and a hand-written 6 x 16 AVX2 kernel (packed A and B, K
 * blocked) at 193-219: the library was not the gap. Ten chains cover an FMA latency of 4-5
 * cycles on two ports.
 */
#include <omp.h>
#include <stdint.h>

#include "vb_kernels.h"

#define CHAINS 10

float VB_ACT(vb_fma_probe)(int64_t iters, float x, float y, int num_threads) {
    float total = 0.0f;
#pragma omp parallel num_threads(num_threads) reduction(+ : total)
    {
        vf a[CHAINS];
        const vf vx = splat(x), vy = splat(y);
        for (int c = 0; c < CHAINS; ++c) a[c] = splat(1.0f + 0.0625f * (float)c);
        for (int64_t i = 0; i < iters; ++i)
#pragma GCC unroll 10
            for (int c = 0; c < CHAINS; ++c) a[c] = a[c] * vx + vy;
        vf sum = a[0];
        for (int c = 1; c < CHAINS; ++c) sum += a[c];
        total += hsum(sum);
    }
    return total;
}

/* Multiply-adds per step of one thread in vb_fma_probe: VL lanes x CHAINS chains. */
int VB_ACT(vb_fma_width)(void) { return VL * CHAINS; }

/* fp32 lanes of this build's vectors (vb_simd.h VL). */
int VB_ACT(vb_vector_lanes)(void) { return VL; }
