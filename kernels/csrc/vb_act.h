/* The activation and KV-cache types a kernel source is compiled for.
 *
 * kernels/cpu_native.py compiles every source once per variant into one library: VB_ACT_F32 for
 * fp32 models (activations, norms and biases in fp32; every CPU tier), without it for bf16 models,
 * and for fp32 models VB_KV_F16 / VB_KV_BF16 for a KV cache stored in half precision, for either
 * VB_KV_E4M3 / VB_KV_E5M2 for one stored in fp8 (read and widened by the attention, rounded once
 * by the KV write). VB_ACT(name) gives each entry point the variant's suffix (vb_rms_norm_f32,
 * vb_paged_attention_f32_kvf16, vb_rms_norm_bf16, vb_paged_attention_bf16_kve4m3), so every set
 * lives side by side. The kernels are written once against act_t and kv_t:
 *   load_act / store_act / load_act_tail / store_act_tail  move VL (or n < VL) values as fp32;
 *   act_to_float                                          one value as fp32;
 *   round_act(v)  rounds to the activation type and back: the references' intermediate roundings
 *                 (torch rounds every op's result to the tensor's dtype): identity in fp32.
 *   load_kv / store_kv                                     the same for the KV cache's kv_t;
 *   load_kv_bf16x32 (bf16 activations on avx512_bf16)      32 cache values as bf16 (vdpbf16ps).
 * Arithmetic is fp32 in all.
 */
#ifndef VB_ACT_H
#define VB_ACT_H

#include "vb_simd.h"

#if defined(VB_ACT_F32)

typedef float act_t;
#if defined(VB_KV_F16)
#define VB_ACT(name) name##_f32_kvf16
#elif defined(VB_KV_BF16)
#define VB_ACT(name) name##_f32_kvbf16
#elif defined(VB_KV_E4M3)
#define VB_ACT(name) name##_f32_kve4m3
#elif defined(VB_KV_E5M2)
#define VB_ACT(name) name##_f32_kve5m2
#else
#define VB_ACT(name) name##_f32
#endif
#define VB_ACT_BF16 0

static inline vf load_act(const act_t *src) { return load_f32(src); }
static inline void store_act(act_t *dst, vf v) { store_f32(dst, v); }
static inline float act_to_float(act_t x) { return x; }
static inline vf round_act(vf v) { return v; }

static inline vf load_act_tail(const act_t *src, int n) {
    vf v = splat(0.0f);
    for (int j = 0; j < n; ++j) v[j] = src[j];
    return v;
}

static inline void store_act_tail(act_t *dst, vf v, int n) {
    for (int j = 0; j < n; ++j) dst[j] = v[j];
}

#else

typedef bf16 act_t;
#if defined(VB_KV_E4M3)
#define VB_ACT(name) name##_bf16_kve4m3
#elif defined(VB_KV_E5M2)
#define VB_ACT(name) name##_bf16_kve5m2
#else
#define VB_ACT(name) name##_bf16
#endif
#define VB_ACT_BF16 1

static inline vf load_act(const act_t *src) { return load_bf16(src); }
static inline void store_act(act_t *dst, vf v) { store_bf16(dst, v); }
static inline vf round_act(vf v) { return widen_bf16(round_bf16(v)); }
static inline vf load_act_tail(const act_t *src, int n) { return load_bf16_tail(src, n); }
static inline void store_act_tail(act_t *dst, vf v, int n) { store_bf16_tail(dst, v, n); }

static inline float act_to_float(act_t x) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}

#endif

#if defined(VB_KV_F16)
typedef uint16_t kv_t;
static inline vf load_kv(const kv_t *src) { return load_f16(src); }
static inline void store_kv(kv_t *dst, vf v) { store_f16(dst, v); }
#define VB_KV_IS_ACT 0
#elif defined(VB_KV_BF16)
typedef bf16 kv_t;
static inline vf load_kv(const kv_t *src) { return load_bf16(src); }
static inline void store_kv(kv_t *dst, vf v) { store_bf16(dst, v); }
#define VB_KV_IS_ACT 0
#elif defined(VB_KV_E4M3) || defined(VB_KV_E5M2)
typedef uint8_t kv_t;
#if defined(VB_KV_E4M3)
#define VB_KV_FP8 FP8_E4M3
#else
#define VB_KV_FP8 FP8_E5M2
#endif
static inline vf load_kv(const kv_t *src) { return load_fp8(src, VB_KV_FP8); }
static inline void store_kv(kv_t *dst, vf v) { store_fp8(dst, v, VB_KV_FP8); }
#define VB_KV_IS_ACT 0
#else
typedef act_t kv_t;
static inline vf load_kv(const kv_t *src) { return load_act(src); }
static inline void store_kv(kv_t *dst, vf v) { store_act(dst, v); }
#define VB_KV_IS_ACT 1
#endif

#if VB_ACT_BF16 && defined(__AVX512BF16__)
/* 32 cache values as bf16 pairs, for vdpbf16ps: a bf16 cache's as stored; an fp8 cache's widened
 * and narrowed to bf16, exactly (every fp8 value is a bf16 value). */
static inline __m512i load_kv_bf16x32(const kv_t *src) {
#if VB_KV_IS_ACT
    return _mm512_loadu_si512(src);
#else
    return (__m512i)_mm512_cvtne2ps_pbh(load_kv(src + 16), load_kv(src));
#endif
}
#endif

#endif
