/* The native kernels' entry points, for the files that compose them (cpu_decoder_layer.c) and,
 * as exported symbols, for the ctypes binding (kernels/cpu_native.py).
 *
 * Every entry point exists once per variant (vb_act.h: VB_ACT(name) is name_f32, name_f32_kvf16,
 * name_f32_kvbf16 or name_bf16; act_t the activations' type, kv_t the KV cache's); these
 * declarations are the active variant's.
 * The *_shared functions run on the threads of an enclosing OpenMP team: every thread of the team
 * calls them, they share the work out with an orphaned `omp for` and end with its barrier. The
 * other entry points open their own team of num_threads.
 */
#ifndef VB_KERNELS_H
#define VB_KERNELS_H

#include <stdint.h>

#include "vb_act.h"

/* How a linear layer's weight is stored ([out, in], row-major); the arithmetic is fp32 whatever it is.
 * VB_WEIGHT_Q8_0 (fp32 activations only; kernels/q8_0.py writes it): each output row is its in
 * int8 values q followed by in / 32 fp16 scales d, one per block of 32 (in a multiple of 32), the
 * weight being q * d (as llama.cpp's Q8_0, with the scales after the row's values). */
enum { VB_WEIGHT_F32 = 0, VB_WEIGHT_F16 = 1, VB_WEIGHT_BF16 = 2, VB_WEIGHT_Q8_0 = 3 };
#define VB_Q8_BLOCK 32

/* cpu_paged_attention.c */
typedef struct VbAttention VbAttention;
int VB_ACT(vb_attention_plan)(VbAttention **plan, const act_t *query, int64_t query_stride, act_t *out,
                              const kv_t *key_cache, const kv_t *value_cache, const int32_t *block_tables,
                              int64_t table_stride, const int32_t *query_start, const int32_t *seq_lens,
                              int num_reqs, int num_q_heads, int num_kv_heads, int head_dim, int block_size,
                              float scale, int num_threads);
int VB_ACT(vb_attention_run_shared)(const VbAttention *plan);
void VB_ACT(vb_attention_free)(VbAttention *plan);
int VB_ACT(vb_paged_attention)(const act_t *query, int64_t query_stride, act_t *out, const kv_t *key_cache,
                               const kv_t *value_cache, const int32_t *block_tables, int64_t table_stride,
                               const int32_t *query_start, const int32_t *seq_lens, int num_reqs,
                               int num_q_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                               int num_threads);

/* cpu_linear_small.c: y = x W^T + b for 1..32 rows (its MAX_ROWS). Returns 0, or 1 when this build has no kernel
 * for the weight format (bf16 activations: only bf16 weights on CPUs with avx512_bf16). */
int VB_ACT(vb_linear_small_shared)(const act_t *x, const void *w, int weight_format, const act_t *bias, act_t *y,
                                   int m_rows, int n_out, int k_in);
int VB_ACT(vb_linear_small)(const act_t *x, const void *w, int weight_format, const act_t *bias, act_t *y,
                            int m_rows, int n_out, int k_in, int num_threads);

/* cpu_gemm.c: y[m, n] = x[m, k] W^T (+ b), fp32, W packed in panels of 16 outputs (k >= 1). Returns 0,
 * or 1 in a build without AVX2 + FMA (no GEMM there). */
int VB_ACT(vb_gemm)(const float *x, int64_t ldx, const float *packed, const float *bias, float *y, int64_t ldy,
                    int m, int n, int k, int num_threads);
/* The same over fp16 weights in the same panels (widened exactly, a panel's k block at a time); also 3
 * when out of memory for the per-thread block. */
int VB_ACT(vb_gemm_f16)(const float *x, int64_t ldx, const uint16_t *packed, const float *bias, float *y,
                        int64_t ldy, int m, int n, int k, int num_threads);
/* A gated MLP's gate and up projections ([inter, k] each) in one GEMM, their panels in pairs
 * (gemm_libraries.pack_gated_panels), bias [2 * inter] (gate's, then up's) or NULL: fuse = 1, y[m,
 * inter] = silu(gate) * up (vb_silu_and_mul's formula); fuse = 0, y[m, 2 * inter] = gate | up. Returns as
 * vb_gemm / vb_gemm_f16 (3: out of memory for the per-thread buffers). */
int VB_ACT(vb_gemm_gated)(const float *x, int64_t ldx, const float *packed, const float *bias, float *y, int64_t ldy,
                          int m, int inter, int k, int fuse, int num_threads);
int VB_ACT(vb_gemm_gated_f16)(const float *x, int64_t ldx, const uint16_t *packed, const float *bias, float *y,
                              int64_t ldy, int m, int inter, int k, int fuse, int num_threads);

/* cpu_gemm_q8.c: y[m, n] = x[m, k] (q * d)^T (+ b) over Q8_0 weights packed in int16 panels, in
 * integer arithmetic (x rounded to int16 per row); vnni: AVX-VNNI's vpdpwssd. Returns 0; 1 in a
 * build without AVX2 + FMA; 2 for k not a multiple of 32; 3 out of memory; 4 vnni on a CPU (or a
 * build) without it. */
int VB_ACT(vb_gemm_q8)(const float *x, int64_t ldx, const int16_t *packed, const float *bias, float *y,
                       int64_t ldy, int m, int n, int k, int vnni, int num_threads);
/* cpu_gemm_q8.c: a gated MLP's merged [gate; up] Q8_0 weight ([2 * inter, k] packed as vb_gemm_q8's,
 * inter a multiple of 16), bias [2 * inter] or NULL: y[m, inter] = silu(gate) * up (vb_silu_and_mul's
 * formula). Returns as vb_gemm_q8 (2 also for inter not a multiple of 16). */
int VB_ACT(vb_gemm_q8_gated)(const float *x, int64_t ldx, const int16_t *packed, const float *bias, float *y,
                             int64_t ldy, int m, int inter, int k, int vnni, int num_threads);

/* cpu_decoder_layer.c: consecutive Llama-family decoder layers for 1-8 tokens in one call. Norms, biases and
 * activations are act_t (the model's dtype); the four weights are stored as weight_format says
 * (VB_WEIGHT_*: the model's dtype, or half precision for an fp32 model). kernels/cpu_native_structs.py
 * mirrors both structs (and VbDecode, below) in ctypes. */
typedef struct {
    const act_t *input_norm, *post_norm;        /* [hidden] */
    const void *qkv_weight;                     /* [q + 2 kv, hidden] */
    const act_t *qkv_bias;                      /* bias or NULL */
    const void *o_weight;                       /* [hidden, q] */
    const act_t *o_bias;
    const void *gate_up_weight;                 /* [2 intermediate, hidden] */
    const act_t *gate_up_bias;
    const void *down_weight;                    /* [hidden, intermediate] */
    const act_t *down_bias;
    int hidden, num_q_heads, num_kv_heads, head_dim, intermediate, weight_format;
    float eps, scale;
} VbLayer;

typedef struct {
    int rows;                                    /* tokens in the step, at most 8 */
    const act_t *cos, *signed_sin;               /* [rows, head_dim] per-token rotary tables */
    const int64_t *slots;                        /* [rows] KV-cache slots of the new tokens */
    const int32_t *block_tables;                 /* [num_reqs, table_stride] */
    int64_t table_stride;
    const int32_t *query_start, *seq_lens;       /* [num_reqs + 1], [num_reqs] */
    int num_reqs, block_size;
    act_t *normed, *qkv, *attn, *proj, *gate_up, *act;  /* scratch rows: [rows, hidden / q+2kv / q / hidden / 2i / i] */
    const act_t *final_norm;                     /* [hidden]: the model's final norm after the last layer, or NULL */
    float final_eps;
} VbStep;

/* layers [num_layers]: consecutive layers, run in order; key_caches / value_caches [num_layers]: each
 * layer's cache; hidden [rows, hidden_size]: the first layer's input, replaced by the last one's output
 * (its MLP's); residual [rows, hidden_size]: the residual stream, updated (first_layer: layers[0] is
 * the model's first, and the stream is set from hidden). With S->final_norm, hidden then becomes the
 * model's final add+RMSNorm of the two (the residual stream updated by that add). Returns 0, or the
 * attention/linear codes (1 unsupported shape, 2 out of memory). */
int VB_ACT(vb_decoder_layers)(const VbLayer *layers, int num_layers, const VbStep *S, kv_t *const *key_caches,
                              kv_t *const *value_caches, act_t *hidden, act_t *residual, int first_layer,
                              int num_threads);

/* cpu_decode_steps.c: what the decode steps add to the layers: the embedding, the head, the rotary
 * tables of every position they reach, the requests' stop tokens, and per-step scratch. */
#define VB_DECODE_MAX_ROWS 32   /* cpu_linear_small.c MAX_ROWS */
typedef struct {
    const act_t *embedding;                      /* [vocab, hidden]: the token embedding */
    const void *head_weight;                     /* [vocab, hidden] stored as head_format (VB_WEIGHT_*) */
    int head_format, vocab;
    const act_t *cos_table, *signed_sin_table;   /* [num_table_rows, head_dim]: positions position_base.. */
    int64_t position_base, num_table_rows;
    const int64_t *stop_ids;                     /* [rows, max_stops]: each request's stop tokens, -1 padded */
    int max_stops;
    const float *temperature;                    /* [rows] (0: greedy), or NULL: every row greedy */
    const float *uniforms;                       /* [num_steps, rows] in [0, 1): each step's draws (vb_sample's u) */
    act_t *logits;                               /* scratch [rows, vocab] */
    act_t *cos, *signed_sin;                     /* scratch [rows, head_dim] */
    int64_t *slots;                              /* scratch [rows] */
    int32_t *seq_lens;                           /* scratch [rows] */
} VbDecode;

/* Up to num_steps decode steps of step->rows requests, one token each (step->num_reqs ==
 * rows; step: block tables, query starts, scratch rows and final norm as for vb_decoder_layers).
 * tokens [num_steps + 1, rows]: row 0 the tokens fed first (at positions [rows]); step s writes row
 * s + 1, the tokens it sampled, which step s + 1 feeds at positions + s + 1 (the block tables must
 * hold those slots). Ends early, after the first step in which a request sampled one of its stop
 * tokens. Returns the
 * steps run; -100 for arguments out of range (rows, a token, a position past the tables), or minus
 * a kernel's code (1 unsupported shape or weight format, 2 out of memory). */
int VB_ACT(vb_decode_steps)(const VbLayer *layers, int num_layers, const VbStep *step, const VbDecode *D,
                            kv_t *const *key_caches, kv_t *const *value_caches, int64_t *tokens,
                            const int64_t *positions, act_t *hidden, act_t *residual, int num_steps,
                            int num_threads);

/* cpu_sample.c: logits [rows, vocab] (rows row_stride apart); temperature [rows] (0: greedy; NULL: every
 * row greedy, u unread); u [rows] in [0, 1); out [rows]. Returns 0, or 2 when out of memory. */
int VB_ACT(vb_sample)(const act_t *logits, int64_t row_stride, int rows, int vocab, const float *temperature,
                      const float *u, int64_t *out, int num_threads);

/* cpu_encoder_attention.c: bidirectional attention within each packed sequence. Returns 0, or 1 when a
 * scratch allocation fails. */
int VB_ACT(vb_encoder_attention)(const act_t *q, const act_t *k, const act_t *v, int64_t row_stride, act_t *out,
                                 const int64_t *starts, const int32_t *lens, int num_seqs, int num_heads,
                                 int num_kv_heads, int head_dim, float scale, int num_threads);

/* cpu_fma_probe.c: the multiply-add rate's probe (its value is what tests/test_cpu_native.py recomputes) */
float VB_ACT(vb_fma_probe)(int64_t iters, float x, float y, int num_threads);

/* cpu_elementwise.c: the row ranges below shared over num_threads */
void VB_ACT(vb_rms_norm)(const act_t *x, const act_t *residual, const act_t *weight, float eps, act_t *out,
                         act_t *new_residual, int64_t rows, int hidden, int num_threads);
void VB_ACT(vb_silu_and_mul)(const act_t *x, act_t *out, int64_t rows, int d, int num_threads);
void VB_ACT(vb_rotary)(act_t *q, int64_t q_row_stride, int q_heads, act_t *k, int64_t k_row_stride, int k_heads,
                       const act_t *cos, const act_t *signed_sin, int64_t rows, int head_dim, int num_threads);
void VB_ACT(vb_write_kv)(const act_t *key, int64_t k_row_stride, const act_t *value, int64_t v_row_stride,
                         kv_t *key_cache, kv_t *value_cache, const int64_t *slots, int64_t rows, int width,
                         int num_threads);

/* cpu_elementwise.c: one thread, rows [row_begin, row_end) */
void VB_ACT(vb_rms_norm_rows)(const act_t *x, const act_t *residual, const act_t *weight, float eps, act_t *out,
                              act_t *new_residual, int64_t row_begin, int64_t row_end, int hidden);
void VB_ACT(vb_silu_and_mul_rows)(const act_t *x, act_t *out, int64_t row_begin, int64_t row_end, int d);
void VB_ACT(vb_rotary_rows)(act_t *q, int64_t q_row_stride, int q_heads, act_t *k, int64_t k_row_stride,
                            int k_heads, const act_t *cos, const act_t *signed_sin, int64_t row_begin,
                            int64_t row_end, int head_dim);
void VB_ACT(vb_write_kv_rows)(const act_t *key, int64_t k_row_stride, const act_t *value, int64_t v_row_stride,
                              kv_t *key_cache, kv_t *value_cache, const int64_t *slots, int64_t row_begin,
                              int64_t row_end, int width);

#endif
