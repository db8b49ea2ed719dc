/* One token per row from the model's logits (fp32 or bf16, vb_act.h), for the plain case of the
 * sampler: temperature only (no top-k/top-p/min-p, penalties, masks or logprobs), greedy rows with
 * temperature 0.
 *
 * Specification and test oracle: engine/sampler.py (greedy: argmax; random: the inverse CDF of
 * softmax(logits / T) at u * total, u drawn by the caller, one per row, from the row's generator).
 * Python binding: kernels/cpu_native.py; used by engine/sampler.py for the model's own logits.
 *
 * NOTE: why. At batch 256 x 49k vocab the torch path spent ~30 ms a step on four full passes
 * (bf16 -> fp32 copy, softmax, cumsum, search); here a row is two passes over its logits
 * (max; exp-sum per VL-lane block), then a walk over the block sums and one block. The walk
 * accumulates the same block sums in the same order as the total, so it always ends inside the
 * row; a probability-0 lane (exp underflow) is never chosen.
 */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>

#include "vb_kernels.h"

/* Scalar reference of argmax_row, and its rule: the first index of the largest value, NaN never
 * chosen, 0 when nothing exceeds -FLT_MAX. */
static int64_t argmax_scalar(const act_t *row, int64_t begin, int64_t end, float *best_out) {
    float best = -FLT_MAX;
    int64_t at = -1;
    for (int64_t i = begin; i < end; ++i) {
        const float x = act_to_float(row[i]);
        if (x > best) { best = x; at = i; }
    }
    *best_out = best;
    return at;
}

/* The same rule in two vector passes: each chunk's maximum (max_lanes keeps the running maximum
 * when a lane is NaN), the first chunk holding the row's largest, then its first index in that
 * chunk. NOTE: why. The scalar loop's compare-and-branch does not vectorise: 130 us for one row of
 * 49k fp32 logits (a batch-1 step is ~11 ms); this reads the row once plus one chunk. */
enum { ARGMAX_CHUNK = 32 * VL };
static int64_t argmax_row(const act_t *row, int vocab) {
    const int64_t chunks = vocab / ARGMAX_CHUNK;
    float best = -FLT_MAX;
    int64_t best_chunk = -1;
    for (int64_t c = 0; c < chunks; ++c) {
        vf m = splat(-FLT_MAX);
        for (int i = 0; i < ARGMAX_CHUNK; i += VL) m = max_lanes(m, load_act(row + c * ARGMAX_CHUNK + i));
        const float chunk_max = hmax(m);
        if (chunk_max > best) { best = chunk_max; best_chunk = c; }
    }
    float tail_best;
    const int64_t tail_at = argmax_scalar(row, chunks * ARGMAX_CHUNK, vocab, &tail_best);
    if (tail_at >= 0 && tail_best > best) return tail_at;
    if (best_chunk < 0) return 0;
    float unused;
    return argmax_scalar(row, best_chunk * ARGMAX_CHUNK, (best_chunk + 1) * ARGMAX_CHUNK, &unused);
}

static int64_t sample_row(const act_t *row, int vocab, float temperature, float u, float *block_sums) {
    const int blocks = (vocab + VL - 1) / VL;
    vf vmax = splat(-FLT_MAX);
    for (int b = 0; b < blocks; ++b) {
        const int n = vocab - VL * b < VL ? vocab - VL * b : VL;
        vf x = n == VL ? load_act(row + VL * b) : load_act_tail(row + VL * b, n);
        if (n < VL) x = select_lanes(mask_lanes_below(n), x, splat(-FLT_MAX));
        vmax = max_lanes(vmax, x);
    }
    const float m = hmax(vmax);
    const float inv_t = 1.0f / temperature;
    float total = 0.0f;
    for (int b = 0; b < blocks; ++b) {
        const int n = vocab - VL * b < VL ? vocab - VL * b : VL;
        const vf x = n == VL ? load_act(row + VL * b) : load_act_tail(row + VL * b, n);
        vf e = vexp((x - m) * inv_t);
        if (n < VL) e = select_lanes(mask_lanes_below(n), e, splat(0.0f));
        block_sums[b] = hsum(e);
        total += block_sums[b];
    }
    const float target = u * total;
    float running = 0.0f;
    int b = 0;
    for (; b < blocks - 1 && running + block_sums[b] <= target; ++b) running += block_sums[b];
    const int n = vocab - VL * b < VL ? vocab - VL * b : VL;
    const vf x = n == VL ? load_act(row + VL * b) : load_act_tail(row + VL * b, n);
    const vf e = vexp((x - m) * inv_t);
    int64_t last_positive = -1;
    for (int j = 0; j < n; ++j) {
        if (e[j] <= 0.0f) continue;
        last_positive = VL * b + j;
        running += e[j];
        if (running > target) return last_positive;
    }
    return last_positive >= 0 ? last_positive : argmax_row(row, vocab);  /* rounding inside the block */
}

/* logits [rows, vocab] (rows row_stride apart); temperature [rows] (0: greedy); u [rows] in
 * [0, 1); out [rows]. Returns 0, or 2 when out of memory. */
int VB_ACT(vb_sample)(const act_t *logits, int64_t row_stride, int rows, int vocab, const float *temperature,
                   const float *u, int64_t *out, int num_threads) {
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && rows > 1)
    {
        float *block_sums = malloc(sizeof(float) * (size_t)((vocab + VL - 1) / VL));
        if (!block_sums) {
#pragma omp atomic write
            failed = 2;
        }
#pragma omp for schedule(static)
        for (int r = 0; r < rows; ++r) {
            const act_t *row = logits + (int64_t)r * row_stride;
            if (!temperature || temperature[r] <= 0.0f) out[r] = argmax_row(row, vocab);
            else if (block_sums) out[r] = sample_row(row, vocab, temperature[r], u[r], block_sums);
        }
        free(block_sums);
    }
    return failed;
}
