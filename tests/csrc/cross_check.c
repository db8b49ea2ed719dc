/* Every native kernel of one build variant, called on fixed inputs, its results written to a file:
 * the same program built for two machines must write the same numbers (within rounding).
 *
 *     cross_check OUT      (exit status 0; a kernel's nonzero return code is recorded, not fatal)
 *
 * Used by tests/test_cross_arch.py: built with the portable tier's flags for this x86-64 machine and
 * for aarch64 (a cross compiler, run under qemu-user), the two files are compared record by record.
 * The x86-64 build's results are the oracle: the rest of the suite checks that build against the
 * PyTorch references (the `portable` tier, forced), so agreement says the aarch64 build computes
 * what the references compute. The inputs come from a fixed integer generator, identical on both.
 *
 * OUT: records of a 32-byte NUL-padded name, an int64 count, then count float32 values (outputs in
 * act_t are widened to fp32; integer outputs and return codes converted to float).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "vb_kernels.h"

#if defined(VB_KV_E4M3) || defined(VB_KV_E5M2) || defined(VB_KV_F16) || defined(VB_KV_BF16)
#define KV_ONLY 1  /* a cache of another dtype than the activations: the KV sources only (native_build.py KV_SOURCES) */
#else
#define KV_ONLY 0
#endif

static FILE *out_file;
static uint32_t state = 12345u;

static uint32_t next_u32(void) {  /* xorshift32: the same sequence on every machine */
    state ^= state << 13;
    state ^= state >> 17;
    state ^= state << 5;
    return state;
}

static float uniform(void) { return (float)(next_u32() >> 8) / 16777216.0f * 2.0f - 1.0f; }  /* [-1, 1) */

static act_t to_act(float f) {
#ifdef VB_ACT_F32
    return f;
#else
    uint32_t u;
    memcpy(&u, &f, 4);
    return (act_t)(u >> 16);  /* bf16 by truncation: an input, any nearby value will do */
#endif
}

static float from_act(act_t a) {
#ifdef VB_ACT_F32
    return a;
#else
    uint32_t u = (uint32_t)a << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

static act_t *acts(int64_t n, float scale) {
    act_t *a = malloc(sizeof(act_t) * (size_t)(n > 0 ? n : 1));
    for (int64_t i = 0; i < n; ++i) a[i] = to_act(uniform() * scale);
    return a;
}

static void record(const char *name, const float *v, int64_t n) {
    char padded[32] = {0};
    snprintf(padded, sizeof padded, "%s", name);
    fwrite(padded, 1, sizeof padded, out_file);
    fwrite(&n, sizeof n, 1, out_file);
    fwrite(v, sizeof(float), (size_t)n, out_file);
}

static void record_acts(const char *name, const act_t *a, int64_t n) {
    float *v = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    for (int64_t i = 0; i < n; ++i) v[i] = from_act(a[i]);
    record(name, v, n);
    free(v);
}

static void record_int(const char *name, int64_t x) {
    const float v = (float)x;
    record(name, &v, 1);
}

/* A weight [n, k] in `format`: fp32 / fp16 / bf16 values of magnitude ~2^-4 .. 2^1, or Q8_0 rows (k int8
 * values, then k / 32 fp16 scales). */
static void *weight(int format, int n, int k) {
    const int64_t count = (int64_t)n * k;
    if (format == VB_WEIGHT_F32) {
        float *w = malloc(sizeof(float) * (size_t)count);
        for (int64_t i = 0; i < count; ++i) w[i] = uniform() * 0.25f;
        return w;
    }
    if (format == VB_WEIGHT_Q8_0) {
        const int64_t row_bytes = k + k / VB_Q8_BLOCK * 2;
        uint8_t *w = malloc((size_t)(row_bytes * n));
        for (int r = 0; r < n; ++r) {
            uint8_t *row = w + r * row_bytes;
            for (int i = 0; i < k; ++i) row[i] = (uint8_t)(int8_t)((int)(next_u32() % 255) - 127);
            for (int b = 0; b < k / VB_Q8_BLOCK; ++b) {  /* fp16 scales 2^-11 .. 2^-8 */
                const uint16_t h = (uint16_t)(((4 + next_u32() % 3) << 10) | (next_u32() & 0x3ff));
                memcpy(row + k + 2 * b, &h, 2);
            }
        }
        return w;
    }
    uint16_t *w = malloc(sizeof(uint16_t) * (size_t)count);
    for (int64_t i = 0; i < count; ++i) {
        const uint32_t r = next_u32(), sign = r >> 31;
        w[i] = format == VB_WEIGHT_F16 ? (uint16_t)(sign << 15 | (11 + r % 6) << 10 | ((r >> 8) & 0x3ff))
                                       : (uint16_t)(sign << 15 | (123 + r % 6) << 7 | ((r >> 8) & 0x7f));
    }
    return w;
}

static void check_linear_small(void) {
    const int formats[] = {VB_WEIGHT_F32, VB_WEIGHT_F16, VB_WEIGHT_BF16, VB_WEIGHT_Q8_0};
    const int shapes[][4] = {{1, 40, 96, 1}, {3, 40, 96, 2}, {8, 200, 160, 2}, {5, 7, 64, 1}};  /* m, n, k, threads */
    for (int f = 0; f < 4; ++f)
        for (int s = 0; s < 4; ++s) {
            const int m = shapes[s][0], n = shapes[s][1], k = shapes[s][2], threads = shapes[s][3];
            act_t *x = acts((int64_t)m * k, 1.0f), *bias = s % 2 ? acts(n, 0.5f) : NULL;
            act_t *y = calloc((size_t)m * n, sizeof(act_t));
            void *w = weight(formats[f], n, k);
            char name[32];
            const int rc = VB_ACT(vb_linear_small)(x, w, formats[f], bias, y, m, n, k, threads);
            snprintf(name, sizeof name, "linear_small f%d s%d rc", formats[f], s);
            record_int(name, rc);
            if (rc == 0) {
                snprintf(name, sizeof name, "linear_small f%d s%d", formats[f], s);
                record_acts(name, y, (int64_t)m * n);
            }
            free(x), free(bias), free(y), free(w);
        }
}

static void check_elementwise(void) {
    const int rows = 5, hidden = 72;
    act_t *x = acts(rows * hidden, 2.0f), *res = acts(rows * hidden, 1.0f), *w = acts(hidden, 1.0f);
    act_t *out = calloc(rows * hidden, sizeof(act_t)), *new_res = calloc(rows * hidden, sizeof(act_t));
    VB_ACT(vb_rms_norm)(x, NULL, w, 1e-5f, out, NULL, rows, hidden, 2);
    record_acts("rms_norm", out, rows * hidden);
    VB_ACT(vb_rms_norm)(x, res, w, 1e-6f, out, new_res, rows, hidden, 2);
    record_acts("add_rms_norm", out, rows * hidden);
    record_acts("add_rms_norm residual", new_res, rows * hidden);
    free(x), free(res), free(w), free(out), free(new_res);

    const int d = 37;
    act_t *g = acts(3 * 2 * d, 6.0f), *a = calloc(3 * d, sizeof(act_t));
    VB_ACT(vb_silu_and_mul)(g, a, 3, d, 2);
    record_acts("silu_and_mul", a, 3 * d);
    free(g), free(a);

    const int T = 4, D = 64, qh = 3, kh = 1, qstride = (qh + 2 * kh) * D;
    act_t *qkv = acts(T * qstride, 1.0f), *cos = malloc(sizeof(act_t) * T * D), *sin_ = malloc(sizeof(act_t) * T * D);
    for (int t = 0; t < T; ++t)
        for (int i = 0; i < D; ++i) {
            const float angle = (float)(t + 3) * powf(10000.0f, -(float)(2 * (i % (D / 2))) / (float)D);
            cos[t * D + i] = to_act(cosf(angle));
            sin_[t * D + i] = to_act(i < D / 2 ? -sinf(angle) : sinf(angle));
        }
    VB_ACT(vb_rotary)(qkv, qstride, qh, qkv + qh * D, qstride, kh, cos, sin_, T, D, 2);
    record_acts("rotary", qkv, T * qstride);
    free(qkv), free(cos), free(sin_);
}

/* Three requests over a paged cache of blocks of 16 (blocks handed out in a scrambled order): a decode
 * row at 37 positions, a 20-row prefill (the tiled path), a 6-row chunk after 44 cached positions. */
static void check_attention(int head_dim) {
    const int nq = 6, nkv = 2, BS = 16, reqs = 3, width = nkv * head_dim, table_stride = 4;
    const int seq_lens[3] = {37, 20, 50}, q_rows[3] = {1, 20, 6};
    int32_t tables[3 * 4], query_start[4] = {0}, lens[3];
    const int order[12] = {7, 2, 9, 0, 4, 11, 1, 6, 3, 10, 5, 8};
    for (int i = 0; i < reqs * table_stride; ++i) tables[i] = order[i];
    for (int r = 0; r < reqs; ++r) query_start[r + 1] = query_start[r] + q_rows[r], lens[r] = seq_lens[r];
    const int positions = seq_lens[0] + seq_lens[1] + seq_lens[2], T = query_start[reqs];
    act_t *keys = acts((int64_t)positions * width, 1.0f), *values = acts((int64_t)positions * width, 1.0f);
    int64_t *slots = malloc(sizeof(int64_t) * positions);
    for (int r = 0, i = 0; r < reqs; ++r)
        for (int p = 0; p < seq_lens[r]; ++p, ++i) slots[i] = (int64_t)tables[r * table_stride + p / BS] * BS + p % BS;
    kv_t *kc = calloc((size_t)12 * BS * width, sizeof(kv_t)), *vc = calloc((size_t)12 * BS * width, sizeof(kv_t));
    VB_ACT(vb_write_kv)(keys, width, values, width, kc, vc, slots, positions, width, 2);
    char name[32];
    snprintf(name, sizeof name, "write_kv d%d", head_dim);
    float *cache = malloc(sizeof(float) * (size_t)positions * width);
    for (int i = 0; i < positions; ++i)  /* the stored keys as their codes (fp16 / bf16 / fp8 bits), or fp32 */
        for (int j = 0; j < width; ++j) cache[(int64_t)i * width + j] = (float)kc[slots[i] * width + j];
    record(name, cache, (int64_t)positions * width);
    free(cache);
    const int qstride = (nq + 2 * nkv) * head_dim;
    act_t *q = acts((int64_t)T * qstride, 1.0f), *o = calloc((size_t)T * nq * head_dim, sizeof(act_t));
    const int rc = VB_ACT(vb_paged_attention)(q, qstride, o, kc, vc, tables, table_stride, query_start, lens, reqs,
                                              nq, nkv, head_dim, BS, 1.0f / sqrtf((float)head_dim), 2);
    snprintf(name, sizeof name, "paged_attention d%d rc", head_dim);
    record_int(name, rc);
    snprintf(name, sizeof name, "paged_attention d%d", head_dim);
    record_acts(name, o, (int64_t)T * nq * head_dim);
    free(keys), free(values), free(slots), free(kc), free(vc), free(q), free(o);
}

/* Two decoder layers (hidden 64, 4 query heads and 2 kv heads of 16, intermediate 96) for a step of
 * 4 rows: a decode row at 21 positions and a 3-row chunk after 9, weights in `format`. The first
 * layer alone, then both in one call with a final norm (their step's KV written again at the same slots),
 * then three decode steps of the two requests (vb_decode_steps). */
static void check_decoder_layer(int format) {
    const int H = 64, nq = 4, nkv = 2, D = 16, I = 96, BS = 16, T = 4;
    const int Q = nq * D, KV = nkv * D, QKV = Q + 2 * KV;
    int32_t tables[2 * 2] = {3, 0, 1, 2}, query_start[3] = {0, 1, 4}, lens[2] = {21, 12};
    int64_t slots[4];
    slots[0] = (int64_t)tables[1] * BS + 20 % BS;
    for (int i = 0; i < 3; ++i) slots[1 + i] = (int64_t)tables[2] * BS + 9 + i;
    kv_t *kc = calloc((size_t)4 * BS * KV * 2, sizeof(kv_t)), *vc = calloc((size_t)4 * BS * KV * 2, sizeof(kv_t));
    {   /* the cached positions (the step's own are written by the layer) */
        int64_t cached[30];
        int n = 0;
        for (int p = 0; p < 20; ++p) cached[n++] = (int64_t)tables[p / BS] * BS + p % BS;
        for (int p = 0; p < 9; ++p) cached[n++] = (int64_t)tables[2] * BS + p;
        for (int l = 0; l < 2; ++l) {
            act_t *k = acts((int64_t)n * KV, 1.0f), *v = acts((int64_t)n * KV, 1.0f);
            VB_ACT(vb_write_kv)(k, KV, v, KV, kc + (int64_t)l * 4 * BS * KV, vc + (int64_t)l * 4 * BS * KV, cached, n, KV, 2);
            free(k), free(v);
        }
    }
    act_t *cos = malloc(sizeof(act_t) * T * D), *sin_ = malloc(sizeof(act_t) * T * D);
    const int pos[4] = {20, 9, 10, 11};
    for (int t = 0; t < T; ++t)
        for (int i = 0; i < D; ++i) {
            const float angle = (float)pos[t] * powf(10000.0f, -(float)(2 * (i % (D / 2))) / (float)D);
            cos[t * D + i] = to_act(cosf(angle));
            sin_[t * D + i] = to_act(i < D / 2 ? -sinf(angle) : sinf(angle));
        }
    act_t *hidden = acts(T * H, 1.0f), *residual = calloc(T * H, sizeof(act_t));
    act_t *normed = calloc(T * H, sizeof(act_t)), *qkv = calloc(T * QKV, sizeof(act_t));
    act_t *attn = calloc(T * Q, sizeof(act_t)), *proj = calloc(T * H, sizeof(act_t));
    act_t *gate_up = calloc(T * 2 * I, sizeof(act_t)), *act = calloc(T * I, sizeof(act_t));
    const VbStep step = {T, cos, sin_, slots, tables, 2, query_start, lens, 2, BS, normed, qkv, attn, proj, gate_up, act,
                         NULL, 0.0f};
    VbLayer layers[2];
    void *owned[2][7];
    for (int l = 0; l < 2; ++l) {
        act_t *in_norm = acts(H, 1.0f), *post_norm = acts(H, 1.0f), *qkv_bias = acts(QKV, 0.1f);
        void *wqkv = weight(format, QKV, H), *wo = weight(format, H, Q), *wgu = weight(format, 2 * I, H);
        void *wd = weight(format, H, I);
        const VbLayer layer = {in_norm, post_norm, wqkv, qkv_bias, wo, NULL, wgu, NULL, wd, NULL,
                               H, nq, nkv, D, I, format, 1e-5f, 1.0f / sqrtf((float)D)};
        layers[l] = layer;
        void *mine[7] = {in_norm, post_norm, qkv_bias, wqkv, wo, wgu, wd};
        memcpy(owned[l], mine, sizeof mine);
    }
    kv_t *key_caches[2] = {kc, kc + (int64_t)4 * BS * KV}, *value_caches[2] = {vc, vc + (int64_t)4 * BS * KV};
    char name[32];
    int rc = VB_ACT(vb_decoder_layers)(layers, 1, &step, key_caches, value_caches, hidden, residual, 1, 2);
    snprintf(name, sizeof name, "decoder_layer f%d l0 rc", format);
    record_int(name, rc);
    snprintf(name, sizeof name, "decoder_layer f%d l0", format);
    record_acts(name, hidden, T * H);
    VbStep with_final_norm = step;  /* and the model's final norm after the last */
    with_final_norm.final_norm = layers[1].post_norm;
    with_final_norm.final_eps = 1e-6f;
    rc = VB_ACT(vb_decoder_layers)(layers, 2, &with_final_norm, key_caches, value_caches, hidden, residual, 0, 2);
    snprintf(name, sizeof name, "decoder_layer f%d l0-1 rc", format);
    record_int(name, rc);
    snprintf(name, sizeof name, "decoder_layer f%d l0-1", format);
    record_acts(name, hidden, T * H);
    {   /* then three decode steps of both requests (at 21 and 12) in one call: a vocab of 50, request 1
         * drawn at temperature 0.8 (the uniforms given), the head stored like the layers */
        const int V = 50, R = 2, S = 3;
        act_t *embedding = acts((int64_t)V * H, 1.0f), *cos_table = malloc(sizeof(act_t) * 32 * D);
        act_t *sin_table = malloc(sizeof(act_t) * 32 * D), *logits = calloc((size_t)R * V, sizeof(act_t));
        act_t *cos_rows = calloc((size_t)R * D, sizeof(act_t)), *sin_rows = calloc((size_t)R * D, sizeof(act_t));
        void *head = weight(format, V, H);
        for (int p = 0; p < 32; ++p)
            for (int i = 0; i < D; ++i) {
                const float angle = (float)p * powf(10000.0f, -(float)(2 * (i % (D / 2))) / (float)D);
                cos_table[p * D + i] = to_act(cosf(angle));
                sin_table[p * D + i] = to_act(i < D / 2 ? -sinf(angle) : sinf(angle));
            }
        const int64_t stop_ids[2] = {-1, -1}, positions[2] = {21, 12};
        const float temperature[2] = {0.0f, 0.8f}, uniforms[6] = {0.1f, 0.62f, 0.3f, 0.27f, 0.9f, 0.45f};
        int64_t step_slots[2], tokens[(3 + 1) * 2] = {7, 31};
        int32_t step_lens[2], decode_start[3] = {0, 1, 2};
        const VbDecode D_ = {embedding, head, format, V, cos_table, sin_table, 0, 32, stop_ids, 1, temperature,
                             uniforms, logits, cos_rows, sin_rows, step_slots, step_lens};
        VbStep decode = with_final_norm;
        decode.rows = R;
        decode.query_start = decode_start;
        const int done = VB_ACT(vb_decode_steps)(layers, 2, &decode, &D_, key_caches, value_caches, tokens, positions,
                                                 hidden, residual, S, 2);
        /* 0 when all three ran; minus the code it returned (bf16 without avx512_bf16: 1, no layer kernel) */
        snprintf(name, sizeof name, "decoder_layer f%d steps rc", format);
        record_int(name, done == S ? 0 : done < 0 ? -done : 100 + done);
        float sampled[3 * 2];
        for (int i = 0; i < S * R; ++i) sampled[i] = (float)tokens[R + i];
        snprintf(name, sizeof name, "sampled f%d in decode steps", format);   /* compared exactly */
        record(name, sampled, S * R);
        snprintf(name, sizeof name, "decoder_layer f%d steps", format);
        record_acts(name, hidden, R * H);
        free(embedding), free(cos_table), free(sin_table), free(logits), free(cos_rows), free(sin_rows), free(head);
    }
    for (int l = 0; l < 2; ++l)
        for (int j = 0; j < 7; ++j) free(owned[l][j]);
    free(kc), free(vc), free(cos), free(sin_), free(hidden), free(residual), free(normed), free(qkv), free(attn);
    free(proj), free(gate_up), free(act);
}

#if !KV_ONLY
static void check_sampler_and_encoder(void) {
    const int rows = 4, vocab = 1000;
    act_t *logits = acts(rows * vocab, 8.0f);
    const float temperature[4] = {0.0f, 0.8f, 1.0f, 0.0f}, u[4] = {0.31f, 0.52f, 0.93f, 0.07f};
    int64_t picked[4] = {-1, -1, -1, -1};
    const int rc = VB_ACT(vb_sample)(logits, vocab, rows, vocab, temperature, u, picked, 2);
    float as_float[5] = {(float)rc};
    for (int i = 0; i < rows; ++i) as_float[1 + i] = (float)picked[i];
    record("sample rc, tokens", as_float, 5);
    free(logits);

    const int heads = 4, kv_heads = 2, D = 32, tokens = 20, stride = (heads + 2 * kv_heads) * D;
    const int64_t starts[2] = {0, 7};
    const int32_t lens[2] = {7, 13};
    act_t *qkv = acts(tokens * stride, 1.0f), *out = calloc(tokens * heads * D, sizeof(act_t));
    const int erc = VB_ACT(vb_encoder_attention)(qkv, qkv + heads * D, qkv + (heads + kv_heads) * D, stride, out,
                                                 starts, lens, 2, heads, kv_heads, D, 1.0f / sqrtf((float)D), 2);
    record_int("encoder_attention rc", erc);
    record_acts("encoder_attention", out, tokens * heads * D);
    free(qkv), free(out);

    const float probe = VB_ACT(vb_fma_probe)(1000, 0.999f, 0.001f, 2);
    record("fma_probe", &probe, 1);
}
#endif

int main(int argc, char **argv) {
    if (argc != 2 || !(out_file = fopen(argv[1], "wb"))) {
        fprintf(stderr, "usage: cross_check OUT\n");
        return 2;
    }
    record_int("vector lanes", VL);
    check_linear_small();
    check_elementwise();
    check_attention(64);
    check_attention(32);
#ifdef VB_ACT_F32
    check_decoder_layer(VB_WEIGHT_F16);
#endif
    check_decoder_layer(VB_WEIGHT_BF16);
#if !KV_ONLY
    check_sampler_and_encoder();
#endif
    return fclose(out_file) == 0 ? 0 : 1;
}
