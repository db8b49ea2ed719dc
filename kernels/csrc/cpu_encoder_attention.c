/* Bidirectional attention within each packed sequence (encoder models: BERT), fp32 arithmetic.
 *
 * Reference: kernels/encoder_attention_ref.py (the same result within fp32 rounding); fast torch
 * path: kernels/torch_encoder.py (padded groups through SDPA). Called through
 * kernels/cpu_native.py NativeKernels.encoder_attention.
 *
 * q, k, v: [num_tokens, heads, head_dim] rows `row_stride` elements apart (views into a fused qkv
 * projection); out: [num_tokens, num_heads, head_dim] contiguous. Sequence s holds rows
 * [starts[s], starts[s] + lens[s]). One (sequence, head) pair per task, pairs spread over threads:
 * its keys are transposed once into a [head_dim][n] scratch, so a query's n scores are VL-wide FMAs
 * over keys (no horizontal sums); softmax in fp32 with vexp; p.v as VL-wide FMAs over head_dim.
 * Why not SDPA: MiniLM's sequences are ~20 tokens of 12 heads x 32 dims, where the CPU flash kernel
 * spends most of its time in per-tile overhead (measured ~12 GFLOP/s effective).
 * Requires head_dim % VL == 0 and head_dim <= 256 (the caller checks); returns 0, or 1 when a
 * scratch allocation fails.
 */
#include <stdlib.h>
#include <string.h>

#include "vb_act.h"

#define ENC_MAX_HEAD_DIM 256

int VB_ACT(vb_encoder_attention)(const act_t *q, const act_t *k, const act_t *v, int64_t row_stride,
                                 act_t *out, const int64_t *starts, const int32_t *lens, int num_seqs,
                                 int num_heads, int num_kv_heads, int head_dim, float scale, int num_threads) {
    int max_n = 1;
    for (int s = 0; s < num_seqs; ++s) max_n = lens[s] > max_n ? lens[s] : max_n;
    const int npad = (max_n + VL - 1) / VL * VL;
    const int group = num_heads / num_kv_heads, NV = head_dim / VL;
    const int64_t pairs = (int64_t)num_seqs * num_heads;
    int failed = 0;
    _Pragma("omp parallel num_threads(num_threads)") {
        float *kt = aligned_alloc(64, ((size_t)head_dim * npad * sizeof(float) + 63) / 64 * 64);
        float *sc = aligned_alloc(64, ((size_t)npad * sizeof(float) + 63) / 64 * 64);
        if (kt == NULL || sc == NULL) {
            _Pragma("omp atomic write") failed = 1;
        } else {
            _Pragma("omp for schedule(dynamic, 4)")
            for (int64_t pair = 0; pair < pairs; ++pair) {
                const int s = (int)(pair / num_heads), h = (int)(pair % num_heads), kvh = h / group;
                const int n = lens[s], np = (n + VL - 1) / VL * VL;
                const int64_t base = starts[s];
                for (int j = 0; j < n; ++j) {
                    const act_t *kj = k + (base + j) * row_stride + (int64_t)kvh * head_dim;
                    for (int d = 0; d < head_dim; ++d) kt[(int64_t)d * np + j] = act_to_float(kj[d]);
                }
                for (int d = 0; d < head_dim; ++d)
                    for (int j = n; j < np; ++j) kt[(int64_t)d * np + j] = 0.0f;
                for (int i = 0; i < n; ++i) {
                    const act_t *qi = q + (base + i) * row_stride + (int64_t)h * head_dim;
                    float qf[ENC_MAX_HEAD_DIM];
                    for (int d = 0; d < head_dim; ++d) qf[d] = act_to_float(qi[d]) * scale;
                    vf vmax = splat(-3.0e38f);
                    for (int j0 = 0; j0 < np; j0 += VL) {
                        vf acc = splat(0.0f);
                        for (int d = 0; d < head_dim; ++d) acc += splat(qf[d]) * load_f32(kt + (int64_t)d * np + j0);
                        acc = select_lanes(mask_lanes_below(n - j0), acc, splat(-3.0e38f));
                        store_f32(sc + j0, acc);
                        vmax = max_lanes(vmax, acc);
                    }
                    const float m = hmax(vmax);
                    vf vsum = splat(0.0f);
                    for (int j0 = 0; j0 < np; j0 += VL) {
                        vf e = vexp(load_f32(sc + j0) - splat(m));
                        e = select_lanes(mask_lanes_below(n - j0), e, splat(0.0f));
                        store_f32(sc + j0, e);
                        vsum += e;
                    }
                    const float inv = 1.0f / hsum(vsum);
                    vf o[ENC_MAX_HEAD_DIM / VL];
                    for (int c = 0; c < NV; ++c) o[c] = splat(0.0f);
                    for (int j = 0; j < n; ++j) {
                        const act_t *vj = v + (base + j) * row_stride + (int64_t)kvh * head_dim;
                        const vf w = splat(sc[j]);
                        for (int c = 0; c < NV; ++c) o[c] += w * load_act(vj + VL * c);
                    }
                    act_t *oi = out + ((base + i) * num_heads + h) * (int64_t)head_dim;
                    for (int c = 0; c < NV; ++c) store_act(oi + VL * c, o[c] * splat(inv));
                }
            }
        }
        free(kt);
        free(sc);
    }
    return failed;
}
