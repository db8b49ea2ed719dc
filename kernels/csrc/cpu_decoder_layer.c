/* Consecutive Llama-family decoder layers for a few tokens (decode at small batch), in one call.
 *
 * Specification and test oracle: the layers as the model composes them from the ops
 * (engine/models/llama.py LlamaDecoderLayer.forward: add+RMSNorm, qkv, rotary, KV write, paged
 * attention, o_proj, add+RMSNorm, gate_up, SiLU-and-mul, down_proj), each step here being the
 * native kernel of that op (vb_kernels.h), so results are the ops' results bit for bit.
 * Python binding: kernels/cpu_native.py; used by kernels/cpu_native_ops.py decoder_layers.
 *
 * NOTE: why. At one to four tokens a layer is ten small ops; called one by one from Python each
 * costs a dispatch, allocations and an OpenMP fork/join, about a third of a batch-1 decode step
 * here. Inside one parallel region the matrix-vector products are shared out by `omp for`, the
 * per-token steps run on one thread (`omp single`), and the team only meets at barriers. The
 * region spans every layer of the call (the model passes all of them): a layer per call cost
 * about 13 us of Python and a fork/join per layer, 3-4% of a batch-1 step (docs/performance/batch-1.md, session 18).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vb_kernels.h"

/* One layer, run by every thread of the enclosing team; ends with the team's barrier (that of the
 * last shared linear), so the next layer may read `hidden` and reuse the scratch rows. Returns
 * this thread's codes. */
static int layer_shared(const VbLayer *L, const VbStep *S, const VbAttention *plan, kv_t *key_cache,
                        kv_t *value_cache, act_t *hidden, act_t *residual, int first_layer) {
    const int T = S->rows, H = L->hidden, D = L->head_dim;
    const int Q = L->num_q_heads * D, KV = L->num_kv_heads * D, QKV = Q + 2 * KV, I = L->intermediate;
    const int W = L->weight_format;
    int mine = 0;
#pragma omp single
    {
        if (first_layer) memcpy(residual, hidden, sizeof(act_t) * (size_t)T * H);
        VB_ACT(vb_rms_norm_rows)(first_layer ? residual : hidden, first_layer ? NULL : residual, L->input_norm, L->eps,
                                 S->normed, first_layer ? NULL : residual, 0, T, H);
    }
    mine |= VB_ACT(vb_linear_small_shared)(S->normed, L->qkv_weight, W, L->qkv_bias, S->qkv, T, QKV, H);
#pragma omp single
    {
        VB_ACT(vb_rotary_rows)(S->qkv, QKV, L->num_q_heads, S->qkv + Q, QKV, L->num_kv_heads, S->cos, S->signed_sin,
                               0, T, D);
        VB_ACT(vb_write_kv_rows)(S->qkv + Q, QKV, S->qkv + Q + KV, QKV, key_cache, value_cache, S->slots, 0, T, KV);
    }
    mine |= VB_ACT(vb_attention_run_shared)(plan);
    mine |= VB_ACT(vb_linear_small_shared)(S->attn, L->o_weight, W, L->o_bias, S->proj, T, H, Q);
#pragma omp single
    VB_ACT(vb_rms_norm_rows)(S->proj, residual, L->post_norm, L->eps, S->normed, residual, 0, T, H);
    mine |= VB_ACT(vb_linear_small_shared)(S->normed, L->gate_up_weight, W, L->gate_up_bias, S->gate_up, T, 2 * I, H);
#pragma omp single
    VB_ACT(vb_silu_and_mul_rows)(S->gate_up, S->act, 0, T, I);
    mine |= VB_ACT(vb_linear_small_shared)(S->act, L->down_weight, W, L->down_bias, hidden, T, H, I);
    return mine;
}

/* VbLayer, VbStep and the entry point's contract: vb_kernels.h. */
int VB_ACT(vb_decoder_layers)(const VbLayer *layers, int num_layers, const VbStep *S, kv_t *const *key_caches,
                              kv_t *const *value_caches, act_t *hidden, act_t *residual, int first_layer,
                              int num_threads) {
    VbAttention **plans = calloc(num_layers > 0 ? (size_t)num_layers : 1, sizeof(VbAttention *));
    if (!plans) return 2;
    int rc = 0;
    for (int l = 0; l < num_layers && rc == 0; ++l) {
        const VbLayer *L = &layers[l];
        const int Q = L->num_q_heads * L->head_dim, QKV = Q + 2 * L->num_kv_heads * L->head_dim;
        rc = VB_ACT(vb_attention_plan)(&plans[l], S->qkv, QKV, S->attn, key_caches[l], value_caches[l],
                                       S->block_tables, S->table_stride, S->query_start, S->seq_lens, S->num_reqs,
                                       L->num_q_heads, L->num_kv_heads, L->head_dim, S->block_size, L->scale,
                                       num_threads);
    }
    int failed = rc;
    if (rc == 0) {
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
        {
            int mine = 0;
            for (int l = 0; l < num_layers; ++l)
                mine |= layer_shared(&layers[l], S, plans[l], key_caches[l], value_caches[l], hidden, residual,
                                     first_layer && l == 0);
            /* the model's final norm, in place (the row's sum is complete before any output is written) */
            if (S->final_norm && num_layers > 0) {
#pragma omp single
                VB_ACT(vb_rms_norm_rows)(hidden, residual, S->final_norm, S->final_eps, hidden, residual, 0, S->rows,
                                         layers[num_layers - 1].hidden);
            }
            if (mine) {
#pragma omp atomic write
                failed = mine;
            }
        }
    }
    for (int l = 0; l < num_layers; ++l) VB_ACT(vb_attention_free)(plans[l]);
    free(plans);
    return failed;
}
