/* The native kernels' entry points, for the files that compose them (cpu_decoder_layer.c) and,
 * as exported symbols, for the ctypes binding (kernels/cpu_native.py).
 *
 * The *_shared functions run on the threads of an enclosing OpenMP team: every thread of the team
 * calls them, they share the work out with an orphaned `omp for` and end with its barrier. The
 * other entry points open their own team of num_threads.
 */
#ifndef VB_KERNELS_H
#define VB_KERNELS_H

#include <stdint.h>

typedef uint16_t bf16;

/* cpu_paged_attention.c */
typedef struct VbAttention VbAttention;
int vb_attention_plan(VbAttention **plan, const bf16 *query, int64_t query_stride, bf16 *out,
                      const bf16 *key_cache, const bf16 *value_cache, const int32_t *block_tables,
                      int64_t table_stride, const int32_t *query_start, const int32_t *seq_lens, int num_reqs,
                      int num_q_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                      int num_threads);
int vb_attention_run_shared(const VbAttention *plan);
void vb_attention_free(VbAttention *plan);
int vb_paged_attention_bf16(const bf16 *query, int64_t query_stride, bf16 *out, const bf16 *key_cache,
                            const bf16 *value_cache, const int32_t *block_tables, int64_t table_stride,
                            const int32_t *query_start, const int32_t *seq_lens, int num_reqs, int num_q_heads,
                            int num_kv_heads, int head_dim, int block_size, float scale, int num_threads);

/* cpu_linear_small.c */
int vb_linear_small_shared(const bf16 *x, const bf16 *w, const bf16 *bias, bf16 *y, int m_rows, int n_out,
                           int k_in);
int vb_linear_small_bf16(const bf16 *x, const bf16 *w, const bf16 *bias, bf16 *y, int m_rows, int n_out,
                         int k_in, int num_threads);

/* cpu_elementwise.c: one thread, `rows` rows */
void vb_rms_norm_rows(const bf16 *x, const bf16 *residual, const bf16 *weight, float eps, bf16 *out,
                      bf16 *new_residual, int64_t row_begin, int64_t row_end, int hidden);
void vb_silu_and_mul_rows(const bf16 *x, bf16 *out, int64_t row_begin, int64_t row_end, int d);
void vb_rotary_rows(bf16 *q, int64_t q_row_stride, int q_heads, bf16 *k, int64_t k_row_stride, int k_heads,
                    const bf16 *cos, const bf16 *signed_sin, int64_t row_begin, int64_t row_end, int head_dim);
void vb_write_kv_bf16(const bf16 *key, int64_t k_row_stride, const bf16 *value, int64_t v_row_stride,
                      bf16 *key_cache, bf16 *value_cache, const int64_t *slots, int64_t rows, int width);

#endif
