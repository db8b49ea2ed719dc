/* One token per row from bf16 logits, for the plain case of the sampler: temperature only (no
 * top-k/top-p/min-p, penalties, masks or logprobs), greedy rows with temperature 0.
 *
 * Specification and test oracle: engine/sampler.py (greedy: argmax; random: the inverse CDF of
 * softmax(logits / T) at u * total, u drawn by the caller, one per row, from the row's generator).
 * Python binding: kernels/cpu_native.py; used by engine/sampler.py when the rows are bf16.
 *
 * NOTE: why. At batch 256 x 49k vocab the torch path spent ~30 ms a step on four full passes
 * (bf16 -> fp32 copy, softmax, cumsum, search); here a row is two passes over its bf16 logits
 * (max; exp-sum per 16-lane block), then a walk over the block sums and one block. The walk
 * accumulates the same block sums in the same order as the total, so it always ends inside the
 * row; a probability-0 lane (exp underflow) is never chosen.
 */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>

#include "vb_kernels.h"
#include "vb_simd.h"

static int64_t argmax_row(const bf16 *row, int vocab) {  /* first index of the largest value */
    float best = -FLT_MAX;
    int64_t at = 0;
    for (int i = 0; i < vocab; ++i) {
        union { uint32_t u; float f; } x;
        x.u = (uint32_t)row[i] << 16;
        if (x.f > best) { best = x.f; at = i; }
    }
    return at;
}

static int64_t sample_row(const bf16 *row, int vocab, float temperature, float u, float *block_sums) {
    const int blocks = (vocab + 15) / 16;
    v16f vmax = splat(-FLT_MAX);
    for (int b = 0; b < blocks; ++b) {
        const int n = vocab - 16 * b < 16 ? vocab - 16 * b : 16;
        v16f x = n == 16 ? load_bf16x16(row + 16 * b) : load_bf16_tail(row + 16 * b, n);
        if (n < 16) for (int j = n; j < 16; ++j) x[j] = -FLT_MAX;
        vmax = (v16f)((v16i)vmax & (v16i)(vmax >= x)) + (v16f)((v16i)x & (v16i)(vmax < x));
    }
    float m = -FLT_MAX;
    for (int j = 0; j < 16; ++j) m = vmax[j] > m ? vmax[j] : m;
    const float inv_t = 1.0f / temperature;
    float total = 0.0f;
    for (int b = 0; b < blocks; ++b) {
        const int n = vocab - 16 * b < 16 ? vocab - 16 * b : 16;
        const v16f x = n == 16 ? load_bf16x16(row + 16 * b) : load_bf16_tail(row + 16 * b, n);
        v16f e = exp16((x - m) * inv_t);
        if (n < 16) for (int j = n; j < 16; ++j) e[j] = 0.0f;
        block_sums[b] = sum16(e);
        total += block_sums[b];
    }
    const float target = u * total;
    float running = 0.0f;
    int b = 0;
    for (; b < blocks - 1 && running + block_sums[b] <= target; ++b) running += block_sums[b];
    const int n = vocab - 16 * b < 16 ? vocab - 16 * b : 16;
    const v16f x = n == 16 ? load_bf16x16(row + 16 * b) : load_bf16_tail(row + 16 * b, n);
    const v16f e = exp16((x - m) * inv_t);
    int64_t last_positive = -1;
    for (int j = 0; j < n; ++j) {
        if (e[j] <= 0.0f) continue;
        last_positive = 16 * b + j;
        running += e[j];
        if (running > target) return last_positive;
    }
    return last_positive >= 0 ? last_positive : argmax_row(row, vocab);  /* rounding inside the block */
}

/* logits [rows, vocab] bf16 (rows row_stride apart); temperature [rows] (0: greedy); u [rows] in
 * [0, 1); out [rows]. Returns 0, or 2 when out of memory. */
int vb_sample_bf16(const bf16 *logits, int64_t row_stride, int rows, int vocab, const float *temperature,
                   const float *u, int64_t *out, int num_threads) {
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && rows > 1)
    {
        float *block_sums = malloc(sizeof(float) * (size_t)((vocab + 15) / 16));
        if (!block_sums) {
#pragma omp atomic write
            failed = 2;
        }
#pragma omp for schedule(static)
        for (int r = 0; r < rows; ++r) {
            const bf16 *row = logits + (int64_t)r * row_stride;
            if (temperature[r] <= 0.0f) out[r] = argmax_row(row, vocab);
            else if (block_sums) out[r] = sample_row(row, vocab, temperature[r], u[r], block_sums);
        }
        free(block_sums);
    }
    return failed;
}
