/* One Llama-family decoder layer for a few tokens (decode at small batch), in one call.
 *
 * Specification and test oracle: the layer as the model composes it from the ops
 * (engine/models/llama.py LlamaDecoderLayer.forward: add+RMSNorm, qkv, rotary, KV write, paged
 * attention, o_proj, add+RMSNorm, gate_up, SiLU-and-mul, down_proj), each step here being the
 * native kernel of that op (vb_kernels.h), so results are the ops' results bit for bit.
 * Python binding: kernels/cpu_native.py; used by kernels/cpu_native_ops.py decoder_layer.
 *
 * NOTE: why. At one to four tokens a layer is ten small ops; called one by one from Python each
 * costs a dispatch, allocations and an OpenMP fork/join, about a third of a batch-1 decode step
 * here. Inside one parallel region the matrix-vector products are shared out by `omp for`, the
 * per-token steps run on one thread (`omp single`), and the team only meets at barriers.
 */
#include <stdint.h>
#include <string.h>

#include "vb_kernels.h"

/* VbLayer, VbStep and the entry point's contract: vb_kernels.h. */
int VB_ACT(vb_decoder_layer)(const VbLayer *L, const VbStep *S, kv_t *key_cache, kv_t *value_cache, act_t *hidden,
                             act_t *residual, int first_layer, int num_threads) {
    const int T = S->rows, H = L->hidden, D = L->head_dim;
    const int Q = L->num_q_heads * D, KV = L->num_kv_heads * D, QKV = Q + 2 * KV, I = L->intermediate;
    VbAttention *plan = NULL;
    const int W = L->weight_format;
    int rc = VB_ACT(vb_attention_plan)(&plan, S->qkv, QKV, S->attn, key_cache, value_cache, S->block_tables,
                                       S->table_stride, S->query_start, S->seq_lens, S->num_reqs, L->num_q_heads,
                                       L->num_kv_heads, D, S->block_size, L->scale, num_threads);
    if (rc != 0) return rc;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
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
            VB_ACT(vb_rotary_rows)(S->qkv, QKV, L->num_q_heads, S->qkv + Q, QKV, L->num_kv_heads, S->cos, S->signed_sin, 0, T, D);
            VB_ACT(vb_write_kv)(S->qkv + Q, QKV, S->qkv + Q + KV, QKV, key_cache, value_cache, S->slots, T, KV);
        }
        mine |= VB_ACT(vb_attention_run_shared)(plan);
        mine |= VB_ACT(vb_linear_small_shared)(S->attn, L->o_weight, W, L->o_bias, S->proj, T, H, Q);
#pragma omp single
        VB_ACT(vb_rms_norm_rows)(S->proj, residual, L->post_norm, L->eps, S->normed, residual, 0, T, H);
        mine |= VB_ACT(vb_linear_small_shared)(S->normed, L->gate_up_weight, W, L->gate_up_bias, S->gate_up, T, 2 * I, H);
#pragma omp single
        VB_ACT(vb_silu_and_mul_rows)(S->gate_up, S->act, 0, T, I);
        mine |= VB_ACT(vb_linear_small_shared)(S->act, L->down_weight, W, L->down_bias, hidden, T, H, I);
        if (mine) {
#pragma omp atomic write
            failed = mine;
        }
    }
    VB_ACT(vb_attention_free)(plan);
    return failed;
}
