/* Fused per-token ops of the decoder layer on bf16 activations: RMSNorm (with the residual add),
 * SiLU-and-mul, rotary embedding, and the KV-cache write.
 *
 * Specifications and test oracles: kernels/norm_ref.py, activation_ref.py, cpu_rotary.py (the
 * per-step tables), cache_ref.py. Python binding: kernels/cpu_native.py.
 *
 * NOTE: why. Each of these is 4-10 small torch ops (casts, pow, mean, rsqrt, cat, ...), each a
 * dispatch and a pass over the activations; at decode sizes the dispatches cost more than the
 * arithmetic. Here each is one pass, and the intermediate roundings of the references are kept
 * (every bf16 rounding the reference does, this does at the same place), so results agree with
 * them to the last bit except where a sum is taken in a different order.
 * NOTE: rows are split across threads only above PARALLEL_MIN elements: below that the fork/join
 * costs more than it saves.
 */
#include <math.h>
#include <string.h>

#include "vb_kernels.h"
#include "vb_simd.h"

#define PARALLEL_MIN 65536

/* out = w * bf16(s * rsqrt(mean(s^2) + eps)), s = bf16(x + residual) or x; new_residual = s. */
void vb_rms_norm_rows(const bf16 *x, const bf16 *residual, const bf16 *weight, float eps, bf16 *out,
                      bf16 *new_residual, int64_t row_begin, int64_t row_end, int hidden) {
    const int full = hidden / 16 * 16;
    for (int64_t t = row_begin; t < row_end; ++t) {
        const bf16 *xr = x + t * hidden;
        const bf16 *rr = residual ? residual + t * hidden : NULL;
        bf16 *sr = new_residual ? new_residual + t * hidden : NULL;
        bf16 *orow = out + t * hidden;
        v16f sq = splat(0.0f);
        float tail_sq = 0.0f;
        for (int i = 0; i < hidden; i += 16) {  /* pass 1: the (rounded) sum and its squares */
            const int n = hidden - i < 16 ? hidden - i : 16;
            v16f s = n == 16 ? load_bf16x16(xr + i) : load_bf16_tail(xr + i, n);
            if (rr) {
                const v16f r = n == 16 ? load_bf16x16(rr + i) : load_bf16_tail(rr + i, n);
                const v16h h = round_bf16x16(s + r);
                if (n == 16) *(v16h *)(sr + i) = h; else for (int j = 0; j < n; ++j) sr[i + j] = h[j];
                s = (v16f)(__builtin_convertvector(h, v16u) << 16);
            }
            if (n == 16) sq += s * s; else for (int j = 0; j < n; ++j) tail_sq += s[j] * s[j];
        }
        const float inv = 1.0f / sqrtf((sum16(sq) + tail_sq) / (float)hidden + eps);
        const bf16 *src = rr ? sr : xr;
        for (int i = 0; i < full; i += 16) {    /* pass 2: normalise, round, scale, round */
            const v16f normed = (v16f)(__builtin_convertvector(round_bf16x16(load_bf16x16(src + i) * inv), v16u) << 16);
            store_bf16x16(orow + i, load_bf16x16(weight + i) * normed);
        }
        if (full < hidden) {
            const int n = hidden - full;
            const v16f normed = (v16f)(__builtin_convertvector(round_bf16x16(load_bf16_tail(src + full, n) * inv), v16u) << 16);
            store_bf16_tail(orow + full, load_bf16_tail(weight + full, n) * normed, n);
        }
    }
}

/* out[t, i] = bf16(bf16(silu(gate)) * up), x[t] = gate | up, each of width d. */
void vb_silu_and_mul_rows(const bf16 *x, bf16 *out, int64_t row_begin, int64_t row_end, int d) {
    for (int64_t t = row_begin; t < row_end; ++t) {
        const bf16 *gate = x + t * 2 * d, *up = gate + d;
        bf16 *orow = out + t * d;
        for (int i = 0; i < d; i += 16) {
            const int n = d - i < 16 ? d - i : 16;
            const v16f g = n == 16 ? load_bf16x16(gate + i) : load_bf16_tail(gate + i, n);
            const v16f u = n == 16 ? load_bf16x16(up + i) : load_bf16_tail(up + i, n);
            const v16f silu = (v16f)(__builtin_convertvector(round_bf16x16(g / (1.0f + exp16(-g))), v16u) << 16);
            if (n == 16) store_bf16x16(orow + i, silu * u); else store_bf16_tail(orow + i, silu * u, n);
        }
    }
}

/* In place, for every token and head of q and k (rows of `row_stride` elements, heads of D):
 * x = bf16(bf16(x * cos) + bf16(rotate_half(x) * signed_sin)), tables [T, D] bf16. */
void vb_rotary_rows(bf16 *q, int64_t q_row_stride, int q_heads, bf16 *k, int64_t k_row_stride, int k_heads,
                    const bf16 *cos, const bf16 *signed_sin, int64_t row_begin, int64_t row_end, int head_dim) {
    const int half = head_dim / 2;
    if (half % 16 != 0) return;  /* the binding only calls with head_dim a multiple of 32 */
    for (int64_t t = row_begin; t < row_end; ++t) {
        const bf16 *c = cos + t * head_dim, *s = signed_sin + t * head_dim;
        for (int h = 0; h < q_heads + k_heads; ++h) {
            bf16 *x = h < q_heads ? q + t * q_row_stride + (int64_t)h * head_dim
                                  : k + t * k_row_stride + (int64_t)(h - q_heads) * head_dim;
            for (int i = 0; i < half; i += 16) {
                const v16f lo = load_bf16x16(x + i), hi = load_bf16x16(x + half + i);
                /* rotate_half(x) = (x[half:], x[:half]); the sign is folded into signed_sin */
                const v16f new_lo = (v16f)(__builtin_convertvector(round_bf16x16(lo * load_bf16x16(c + i)), v16u) << 16)
                                  + (v16f)(__builtin_convertvector(round_bf16x16(hi * load_bf16x16(s + i)), v16u) << 16);
                const v16f new_hi = (v16f)(__builtin_convertvector(round_bf16x16(hi * load_bf16x16(c + half + i)), v16u) << 16)
                                  + (v16f)(__builtin_convertvector(round_bf16x16(lo * load_bf16x16(s + half + i)), v16u) << 16);
                store_bf16x16(x + i, new_lo);
                store_bf16x16(x + half + i, new_hi);
            }
        }
    }
}

/* key_cache[slot[t]] = key[t], value_cache[slot[t]] = value[t]: rows of `width` bf16 (kv heads x
 * head_dim); the source rows are `k_row_stride` / `v_row_stride` elements apart. */
void vb_write_kv_bf16(const bf16 *key, int64_t k_row_stride, const bf16 *value, int64_t v_row_stride,
                      bf16 *key_cache, bf16 *value_cache, const int64_t *slots, int64_t rows, int width) {
    for (int64_t t = 0; t < rows; ++t) {
        memcpy(key_cache + slots[t] * width, key + t * k_row_stride, sizeof(bf16) * (size_t)width);
        memcpy(value_cache + slots[t] * width, value + t * v_row_stride, sizeof(bf16) * (size_t)width);
    }
}

/* The same over all rows, split across num_threads threads above PARALLEL_MIN elements. */
#define SPLIT_ROWS(rows, elements, call)                                                              \
    do {                                                                                              \
        const int team = num_threads > 1 && (elements) >= PARALLEL_MIN ? num_threads : 1;             \
        _Pragma("omp parallel for schedule(static) num_threads(team)")                               \
        for (int part = 0; part < team; ++part) {                                                     \
            const int64_t row_begin = (rows) * part / team, row_end = (rows) * (part + 1) / team;     \
            call;                                                                                     \
        }                                                                                             \
    } while (0)

void vb_rms_norm_bf16(const bf16 *x, const bf16 *residual, const bf16 *weight, float eps, bf16 *out,
                      bf16 *new_residual, int64_t rows, int hidden, int num_threads) {
    SPLIT_ROWS(rows, rows * hidden, vb_rms_norm_rows(x, residual, weight, eps, out, new_residual, row_begin, row_end, hidden));
}

void vb_silu_and_mul_bf16(const bf16 *x, bf16 *out, int64_t rows, int d, int num_threads) {
    SPLIT_ROWS(rows, rows * d, vb_silu_and_mul_rows(x, out, row_begin, row_end, d));
}

void vb_rotary_bf16(bf16 *q, int64_t q_row_stride, int q_heads, bf16 *k, int64_t k_row_stride, int k_heads,
                    const bf16 *cos, const bf16 *signed_sin, int64_t rows, int head_dim, int num_threads) {
    SPLIT_ROWS(rows, rows * (q_heads + k_heads) * head_dim,
               vb_rotary_rows(q, q_row_stride, q_heads, k, k_row_stride, k_heads, cos, signed_sin, row_begin, row_end,
                              head_dim));
}
