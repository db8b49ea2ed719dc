/* Fused per-token ops of the decoder layer: RMSNorm (with the residual add), SiLU-and-mul, rotary
 * embedding, and the KV-cache write; fp32 or bf16 activations, the cache in their type or half
 * precision (vb_act.h).
 *
 * Specifications and test oracles: kernels/norm_ref.py, activation_ref.py, cpu_rotary.py (the
 * per-step tables), cache_ref.py. Python binding: kernels/cpu_native.py.
 *
 * NOTE: why. Each of these is 4-10 small torch ops (casts, pow, mean, rsqrt, cat, ...), each a
 * dispatch and a pass over the activations; at decode sizes the dispatches cost more than the
 * arithmetic. Here each is one pass, and the intermediate roundings of the references are kept
 * (every bf16 rounding the reference does, this does at the same place: round_act), so results
 * agree with them to the last bit except where a sum is taken in a different order (and, in fp32,
 * where a multiply and an add contract into one FMA).
 * NOTE: rows are split across threads only above PARALLEL_MIN elements: below that the fork/join
 * costs more than it saves. The KV write, which waits on memory rather than arithmetic, splits from
 * KV_WRITE_PARALLEL_ROWS rows (vb_write_kv's NOTE).
 */
#include <math.h>
#include <string.h>

#include "vb_kernels.h"

#define PARALLEL_MIN 65536
/* Rows from which the KV write is split across the threads (vb_write_kv's NOTE). */
#ifndef KV_WRITE_PARALLEL_ROWS
#define KV_WRITE_PARALLEL_ROWS 8
#endif

static inline vf load_n(const act_t *src, int n) { return n == VL ? load_act(src) : load_act_tail(src, n); }

static inline void store_n(act_t *dst, vf v, int n) {
    if (n == VL) store_act(dst, v); else store_act_tail(dst, v, n);
}

/* out = w * round(s * rsqrt(mean(s^2) + eps)), s = round(x + residual) or x; new_residual = s. */
void VB_ACT(vb_rms_norm_rows)(const act_t *x, const act_t *residual, const act_t *weight, float eps, act_t *out,
                              act_t *new_residual, int64_t row_begin, int64_t row_end, int hidden) {
    for (int64_t t = row_begin; t < row_end; ++t) {
        const act_t *xr = x + t * hidden;
        const act_t *rr = residual ? residual + t * hidden : NULL;
        act_t *sr = new_residual ? new_residual + t * hidden : NULL;
        act_t *orow = out + t * hidden;
        vf sq = splat(0.0f);
        float tail_sq = 0.0f;
        for (int i = 0; i < hidden; i += VL) {  /* pass 1: the (rounded) sum and its squares */
            const int n = hidden - i < VL ? hidden - i : VL;
            vf s = load_n(xr + i, n);
            if (rr) {
                s = round_act(s + load_n(rr + i, n));
                store_n(sr + i, s, n);
            }
            if (n == VL) sq += s * s; else for (int j = 0; j < n; ++j) tail_sq += s[j] * s[j];
        }
        const float inv = 1.0f / sqrtf((hsum(sq) + tail_sq) / (float)hidden + eps);
        const act_t *src = rr ? sr : xr;
        for (int i = 0; i < hidden; i += VL) {  /* pass 2: normalise, round, scale, round */
            const int n = hidden - i < VL ? hidden - i : VL;
            store_n(orow + i, load_n(weight + i, n) * round_act(load_n(src + i, n) * inv), n);
        }
    }
}

/* out[t, i] = round(round(silu(gate)) * up), x[t] = gate | up, each of width d. */
void VB_ACT(vb_silu_and_mul_rows)(const act_t *x, act_t *out, int64_t row_begin, int64_t row_end, int d) {
    for (int64_t t = row_begin; t < row_end; ++t) {
        const act_t *gate = x + t * 2 * d, *up = gate + d;
        act_t *orow = out + t * d;
        for (int i = 0; i < d; i += VL) {
            const int n = d - i < VL ? d - i : VL;
            const vf g = load_n(gate + i, n);
            store_n(orow + i, round_act(g / (1.0f + vexp(-g))) * load_n(up + i, n), n);
        }
    }
}

/* In place, for every token and head of q and k (rows of `row_stride` elements, heads of D):
 * x = round(round(x * cos) + round(rotate_half(x) * signed_sin)), tables [T, D] of act_t. */
void VB_ACT(vb_rotary_rows)(act_t *q, int64_t q_row_stride, int q_heads, act_t *k, int64_t k_row_stride,
                            int k_heads, const act_t *cos, const act_t *signed_sin, int64_t row_begin,
                            int64_t row_end, int head_dim) {
    const int half = head_dim / 2;
    if (half % VL != 0) return;  /* the binding only calls with head_dim a multiple of 32 */
    for (int64_t t = row_begin; t < row_end; ++t) {
        const act_t *c = cos + t * head_dim, *s = signed_sin + t * head_dim;
        for (int h = 0; h < q_heads + k_heads; ++h) {
            act_t *x = h < q_heads ? q + t * q_row_stride + (int64_t)h * head_dim
                                   : k + t * k_row_stride + (int64_t)(h - q_heads) * head_dim;
            for (int i = 0; i < half; i += VL) {
                const vf lo = load_act(x + i), hi = load_act(x + half + i);
                /* rotate_half(x) = (x[half:], x[:half]); the sign is folded into signed_sin */
                const vf new_lo = round_act(lo * load_act(c + i)) + round_act(hi * load_act(s + i));
                const vf new_hi = round_act(hi * load_act(c + half + i)) + round_act(lo * load_act(s + half + i));
                store_act(x + i, new_lo);
                store_act(x + half + i, new_hi);
            }
        }
    }
}

/* key_cache[slot[t]] = key[t], value_cache[slot[t]] = value[t]: rows of `width` values (kv heads x
 * head_dim), rounded to the cache's kv_t where it is narrower (like the reference's .to()); the
 * source rows are `k_row_stride` / `v_row_stride` elements apart. */
static inline void convert_row(kv_t *dst, const act_t *src, int width) {
    int i = 0;
    for (; i + VL <= width; i += VL) store_kv(dst + i, load_act(src + i));
    if (i < width) {  /* the tail through a lane buffer */
        kv_t tail[VL];
        store_kv(tail, load_act_tail(src + i, width - i));
        memcpy(dst + i, tail, sizeof(kv_t) * (size_t)(width - i));
    }
}

void VB_ACT(vb_write_kv_rows)(const act_t *key, int64_t k_row_stride, const act_t *value, int64_t v_row_stride,
                              kv_t *key_cache, kv_t *value_cache, const int64_t *slots, int64_t row_begin,
                              int64_t row_end, int width) {
    for (int64_t t = row_begin; t < row_end; ++t) {
        if (VB_KV_IS_ACT) {
            memcpy(key_cache + slots[t] * width, key + t * k_row_stride, sizeof(kv_t) * (size_t)width);
            memcpy(value_cache + slots[t] * width, value + t * v_row_stride, sizeof(kv_t) * (size_t)width);
        } else {
            convert_row(key_cache + slots[t] * width, key + t * k_row_stride, width);
            convert_row(value_cache + slots[t] * width, value + t * v_row_stride, width);
        }
    }
}

/* The same over all rows, split across num_threads threads when `worth` (PARALLEL_MIN elements for
 * the arithmetic ones). */
#define SPLIT_ROWS(rows, worth, call)                                                                 \
    do {                                                                                              \
        const int team = num_threads > 1 && (worth) ? num_threads : 1;                                \
        _Pragma("omp parallel for schedule(static) num_threads(team)")                               \
        for (int part = 0; part < team; ++part) {                                                     \
            const int64_t row_begin = (rows) * part / team, row_end = (rows) * (part + 1) / team;     \
            call;                                                                                     \
        }                                                                                             \
    } while (0)

void VB_ACT(vb_rms_norm)(const act_t *x, const act_t *residual, const act_t *weight, float eps, act_t *out,
                         act_t *new_residual, int64_t rows, int hidden, int num_threads) {
    SPLIT_ROWS(rows, rows * hidden >= PARALLEL_MIN,
               VB_ACT(vb_rms_norm_rows)(x, residual, weight, eps, out, new_residual, row_begin, row_end, hidden));
}

void VB_ACT(vb_silu_and_mul)(const act_t *x, act_t *out, int64_t rows, int d, int num_threads) {
    SPLIT_ROWS(rows, rows * d >= PARALLEL_MIN, VB_ACT(vb_silu_and_mul_rows)(x, out, row_begin, row_end, d));
}

/* NOTE: why the KV write is shared across the threads from 8 rows (KV_WRITE_PARALLEL_ROWS), where the
 * arithmetic ops wait for PARALLEL_MIN elements. Its rows scatter to blocks anywhere in caches that
 * are mostly out of the CPU's caches, so a thread mostly waits on memory: in the 256-prompt run
 * (bench/op_times.py, Zen 3, session 41) one thread took 1.4 us a row in the prompt steps (4.0 s)
 * and 1.9 s over the decode steps' 256 rows a call. Measured there, SmolLM2's 3 x 64 fp32 keys and
 * values into fp16 caches of 20-30 layers in turn, 2 threads against 1:
 *   - a prompt step's 7,400 rows (20 layers, 7 runs alternating): 155-292 against 252-587 ns a row;
 *     end to end the prompt steps' writes went from 4.0 to 1.9 s;
 *   - a decode step's rows, each in a block of its own (7 rounds, medians, the call's Python
 *     included): 1.58x at 8 rows, 1.80x at 16, 2.25x at 32 and 64, 1.96x at 256; end to end the
 *     decode steps' writes went from 1.8 to 1.2 s.
 * A software prefetch of the destination rows 8 ahead lost in 5 of the 7 prompt-step runs (0.45-1.7x
 * the time on one thread). */
void VB_ACT(vb_write_kv)(const act_t *key, int64_t k_row_stride, const act_t *value, int64_t v_row_stride,
                         kv_t *key_cache, kv_t *value_cache, const int64_t *slots, int64_t rows, int width,
                         int num_threads) {
    SPLIT_ROWS(rows, rows >= KV_WRITE_PARALLEL_ROWS,
               VB_ACT(vb_write_kv_rows)(key, k_row_stride, value, v_row_stride, key_cache, value_cache, slots,
                                        row_begin, row_end, width));
}

void VB_ACT(vb_rotary)(act_t *q, int64_t q_row_stride, int q_heads, act_t *k, int64_t k_row_stride, int k_heads,
                       const act_t *cos, const act_t *signed_sin, int64_t rows, int head_dim, int num_threads) {
    SPLIT_ROWS(rows, rows * (q_heads + k_heads) * head_dim >= PARALLEL_MIN,
               VB_ACT(vb_rotary_rows)(q, q_row_stride, q_heads, k, k_row_stride, k_heads, cos, signed_sin,
                                      row_begin, row_end, head_dim));
}
