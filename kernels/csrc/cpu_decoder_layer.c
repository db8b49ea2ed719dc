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

typedef struct {
    const bf16 *input_norm, *post_norm;         /* [hidden] */
    const bf16 *qkv_weight, *qkv_bias;          /* [q + 2 kv, hidden], bias or NULL */
    const bf16 *o_weight, *o_bias;              /* [hidden, q] */
    const bf16 *gate_up_weight, *gate_up_bias;  /* [2 intermediate, hidden] */
    const bf16 *down_weight, *down_bias;        /* [hidden, intermediate] */
    int hidden, num_q_heads, num_kv_heads, head_dim, intermediate;
    float eps, scale;
} VbLayer;

typedef struct {
    int rows;                                    /* tokens in the step, at most 8 */
    const bf16 *cos, *signed_sin;                /* [rows, head_dim] per-token rotary tables */
    const int64_t *slots;                        /* [rows] KV-cache slots of the new tokens */
    const int32_t *block_tables;                 /* [num_reqs, table_stride] */
    int64_t table_stride;
    const int32_t *query_start, *seq_lens;       /* [num_reqs + 1], [num_reqs] */
    int num_reqs, block_size;
    bf16 *normed, *qkv, *attn, *proj, *gate_up, *act;  /* scratch rows: [rows, hidden / q+2kv / q / hidden / 2i / i] */
} VbStep;

/* hidden [rows, hidden_size]: the layer's input, replaced by its output (the MLP's);
 * residual [rows, hidden_size]: the residual stream, updated (first_layer: set from hidden).
 * Returns 0, or the attention/linear codes (1 unsupported shape, 2 out of memory). */
int vb_decoder_layer_bf16(const VbLayer *L, const VbStep *S, bf16 *key_cache, bf16 *value_cache, bf16 *hidden,
                          bf16 *residual, int first_layer, int num_threads) {
    const int T = S->rows, H = L->hidden, D = L->head_dim;
    const int Q = L->num_q_heads * D, KV = L->num_kv_heads * D, QKV = Q + 2 * KV, I = L->intermediate;
    VbAttention *plan = NULL;
    int rc = vb_attention_plan(&plan, S->qkv, QKV, S->attn, key_cache, value_cache, S->block_tables,
                               S->table_stride, S->query_start, S->seq_lens, S->num_reqs, L->num_q_heads,
                               L->num_kv_heads, D, S->block_size, L->scale, num_threads);
    if (rc != 0) return rc;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        int mine = 0;
#pragma omp single
        {
            if (first_layer) memcpy(residual, hidden, sizeof(bf16) * (size_t)T * H);
            vb_rms_norm_rows(first_layer ? residual : hidden, first_layer ? NULL : residual, L->input_norm, L->eps,
                             S->normed, first_layer ? NULL : residual, 0, T, H);
        }
        mine |= vb_linear_small_shared(S->normed, L->qkv_weight, L->qkv_bias, S->qkv, T, QKV, H);
#pragma omp single
        {
            vb_rotary_rows(S->qkv, QKV, L->num_q_heads, S->qkv + Q, QKV, L->num_kv_heads, S->cos, S->signed_sin, 0, T, D);
            vb_write_kv_bf16(S->qkv + Q, QKV, S->qkv + Q + KV, QKV, key_cache, value_cache, S->slots, T, KV);
        }
        mine |= vb_attention_run_shared(plan);
        mine |= vb_linear_small_shared(S->attn, L->o_weight, L->o_bias, S->proj, T, H, Q);
#pragma omp single
        vb_rms_norm_rows(S->proj, residual, L->post_norm, L->eps, S->normed, residual, 0, T, H);
        mine |= vb_linear_small_shared(S->normed, L->gate_up_weight, L->gate_up_bias, S->gate_up, T, 2 * I, H);
#pragma omp single
        vb_silu_and_mul_rows(S->gate_up, S->act, 0, T, I);
        mine |= vb_linear_small_shared(S->act, L->down_weight, L->down_bias, hidden, T, H, I);
        if (mine) {
#pragma omp atomic write
            failed = mine;
        }
    }
    vb_attention_free(plan);
    return failed;
}
