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

/* cpu_linear_small.c: y = x W^T + b for 1..8 rows. Returns 0, or 1 when this build has no kernel
 * for the weight format (bf16 activations: only bf16 weights on CPUs with avx512_bf16). */
int VB_ACT(vb_linear_small_shared)(const act_t *x, const void *w, int weight_format, const act_t *bias, act_t *y,
                                   int m_rows, int n_out, int k_in);
int VB_ACT(vb_linear_small)(const act_t *x, const void *w, int weight_format, const act_t *bias, act_t *y,
                            int m_rows, int n_out, int k_in, int num_threads);

/* cpu_gemm.c: y[m, n] = x[m, k] W^T (+ b), fp32, W packed in panels of 16 outputs (k >= 1). Returns 0,
 * or 1 in a build without AVX2 + FMA (no GEMM there). */
int VB_ACT(vb_gemm)(const float *x, int64_t ldx, const float *packed, const float *bias, float *y, int64_t ldy,
                    int m, int n, int k, int num_threads);

/* cpu_gemm_q8.c: y[m, n] = x[m, k] (q * d)^T (+ b) over Q8_0 weights packed in int16 panels, in
 * integer arithmetic (x rounded to int16 per row); vnni: AVX-VNNI's vpdpwssd. Returns 0; 1 in a
 * build without AVX2 + FMA; 2 for k not a multiple of 32; 3 out of memory; 4 vnni on a CPU (or a
 * build) without it. */
int VB_ACT(vb_gemm_q8)(const float *x, int64_t ldx, const int16_t *packed, const float *bias, float *y,
                       int64_t ldy, int m, int n, int k, int vnni, int num_threads);

/* cpu_elementwise.c: one thread, rows [row_begin, row_end) */
void VB_ACT(vb_rms_norm_rows)(const act_t *x, const act_t *residual, const act_t *weight, float eps, act_t *out,
                              act_t *new_residual, int64_t row_begin, int64_t row_end, int hidden);
void VB_ACT(vb_silu_and_mul_rows)(const act_t *x, act_t *out, int64_t row_begin, int64_t row_end, int d);
void VB_ACT(vb_rotary_rows)(act_t *q, int64_t q_row_stride, int q_heads, act_t *k, int64_t k_row_stride,
                            int k_heads, const act_t *cos, const act_t *signed_sin, int64_t row_begin,
                            int64_t row_end, int head_dim);
void VB_ACT(vb_write_kv)(const act_t *key, int64_t k_row_stride, const act_t *value, int64_t v_row_stride,
                         kv_t *key_cache, kv_t *value_cache, const int64_t *slots, int64_t rows, int width);

#endif
