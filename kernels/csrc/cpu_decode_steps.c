/* Several decode steps of a few requests in one call: each step looks up the tokens the previous
 * one sampled, runs every decoder layer and the model's final norm (vb_decoder_layers), the logits
 * head (vb_linear_small) and the plain sampler (vb_sample: greedy rows' argmax, the others drawn
 * with their temperature at the step's given uniform), then moves each request on by one position.
 *
 * Specification and test oracle: the engine's own step, repeated (engine/llm_engine.py step with
 * num_scheduler_steps 1: the model's forward on the native ops, compute_logits, the sampler's plain
 * rows), each part here being the native kernel that step calls, so the tokens are the same token for
 * token (tests/test_decode_steps.py). Python binding: kernels/cpu_native.py; used by
 * kernels/cpu_native_ops.py decode_steps, for the scheduler's multi-step decodes (engine/scheduler.py).
 *
 * NOTE: why. At batch 1 the Python between two forwards (scheduling, input tensors, the head's and
 * the sampler's calls, the outputs) takes about 1 ms of a 10.8 ms step, most of it cache misses: each
 * forward streams 270 MB of weights through every cache level (docs/performance/batch-1.md, session 20).
 * Here that runs once per call of up to num_steps steps instead of once per token.
 */
#include <stdint.h>
#include <string.h>

#include "vb_kernels.h"

/* VbDecode and the entry point's contract: vb_kernels.h. */
int VB_ACT(vb_decode_steps)(const VbLayer *layers, int num_layers, const VbStep *step, const VbDecode *D,
                            kv_t *const *key_caches, kv_t *const *value_caches, int64_t *tokens,
                            const int64_t *positions, act_t *hidden, act_t *residual, int num_steps,
                            int num_threads) {
    const int T = step->rows;
    if (num_layers < 1 || T < 1 || T > VB_DECODE_MAX_ROWS || step->num_reqs != T) return -100;
    const int H = layers[0].hidden, Dh = layers[0].head_dim, bs = step->block_size;
    VbStep S = *step;   /* the caller's tables and scratch rows; this call's per-step rows */
    S.cos = D->cos;
    S.signed_sin = D->signed_sin;
    S.slots = D->slots;
    S.seq_lens = D->seq_lens;
    for (int s = 0; s < num_steps; ++s) {
        const int64_t *in = tokens + (int64_t)s * T;
        for (int r = 0; r < T; ++r) {
            const int64_t pos = positions[r] + s, row = pos - D->position_base;
            if (in[r] < 0 || in[r] >= D->vocab || row < 0 || row >= D->num_table_rows) return -100;
            memcpy(hidden + (int64_t)r * H, D->embedding + in[r] * H, sizeof(act_t) * (size_t)H);
            memcpy(D->cos + (int64_t)r * Dh, D->cos_table + row * Dh, sizeof(act_t) * (size_t)Dh);
            memcpy(D->signed_sin + (int64_t)r * Dh, D->signed_sin_table + row * Dh, sizeof(act_t) * (size_t)Dh);
            D->slots[r] = (int64_t)S.block_tables[r * S.table_stride + pos / bs] * bs + pos % bs;
            D->seq_lens[r] = (int32_t)(pos + 1);
        }
        int rc = VB_ACT(vb_decoder_layers)(layers, num_layers, &S, key_caches, value_caches, hidden, residual, 1,
                                           num_threads);
        if (rc == 0)
            rc = VB_ACT(vb_linear_small)(hidden, D->head_weight, D->head_format, NULL, D->logits, T, D->vocab, H,
                                         num_threads);
        if (rc == 0)
            rc = VB_ACT(vb_sample)(D->logits, D->vocab, T, D->vocab, D->temperature,
                                   D->temperature ? D->uniforms + (int64_t)s * T : NULL,
                                   tokens + (int64_t)(s + 1) * T, num_threads);
        if (rc != 0) return -rc;
        /* The scheduler's stop rule for a token (min_tokens is already met when it asks for these
         * steps). The call ends with the first step in which a request stops: the next steps then run
         * for the requests left, as single steps would, and draw their uniforms for those only. */
        for (int r = 0; r < T; ++r) {
            const int64_t token = tokens[(int64_t)(s + 1) * T + r];
            for (int j = 0; j < D->max_stops; ++j)
                if (D->stop_ids[(int64_t)r * D->max_stops + j] == token) return s + 1;
        }
    }
    return num_steps;
}
