/* Shared helpers of the native CPU kernels: 16-lane float vectors, bf16 <-> fp32, exp, sums.
 *
 * GCC/Clang vector extensions (AVX-512 registers here; the compiler splits them into narrower
 * ones on CPUs without AVX-512), plus AVX-512 intrinsics where the generic form compiles badly.
 * bf16 -> fp32 is exact (a shift); fp32 -> bf16 rounds to nearest even like torch's .to().
 */
#ifndef VB_SIMD_H
#define VB_SIMD_H

#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef uint16_t bf16;
typedef float v16f __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32), aligned(2)));

static inline v16f splat(float x) { return (v16f){0} + x; }

static inline v16f load_bf16x16(const bf16 *src) {
#ifdef __AVX512F__
    return (v16f)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src)), 16);
#else
    const v16h h = *(const v16h *)src;
    return (v16f)(__builtin_convertvector(h, v16u) << 16);
#endif
}

static inline v16h round_bf16x16(v16f f) {  /* round to nearest even; NaN stays NaN */
    v16u u = (v16u)f;
    const v16u nan = (v16u)((u & 0x7fffffffu) > 0x7f800000u);  /* all-ones lanes where f is NaN */
    const v16u rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    u = (rounded & ~nan) | (((u >> 16) | 0x40u) & nan);
    return __builtin_convertvector(u, v16h);
}

static inline void store_bf16x16(bf16 *dst, v16f f) { *(v16h *)dst = round_bf16x16(f); }

/* The first n (< 16) lanes: loads read zeros past them, stores leave dst[n..] alone. */
static inline v16f load_bf16_tail(const bf16 *src, int n) {
    bf16 tmp[16] = {0};
    for (int j = 0; j < n; ++j) tmp[j] = src[j];
    return load_bf16x16(tmp);
}

static inline void store_bf16_tail(bf16 *dst, v16f f, int n) {
    const v16h h = round_bf16x16(f);
    for (int j = 0; j < n; ++j) dst[j] = h[j];
}

static inline float sum16(v16f v) {
    v += __builtin_shuffle(v, (v16u){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    v += __builtin_shuffle(v, (v16u){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    v += __builtin_shuffle(v, (v16u){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    v += __builtin_shuffle(v, (v16u){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
    return v[0];
}

/* e^x, 16 lanes, x clamped to [-87, 88]: range reduction to [-0.5, 0.5] in base 2 and a degree-7
 * Taylor polynomial (relative error about 1e-7), so it vectorises without -ffast-math (whose
 * shared-library start-up code would flush denormals for the whole process on GCC < 13). */
static inline v16f exp16(v16f x) {
    const v16i low = x < -87.0f, high = x > 88.0f;  /* all-ones lanes out of range */
    x = (v16f)(((v16i)x & ~low) | ((v16i)splat(-87.0f) & low));
    x = (v16f)(((v16i)x & ~high) | ((v16i)splat(88.0f) & high));
    const v16f t = x * 1.4426950408889634f;  /* x / ln 2 */
#ifdef __AVX512F__
    const v16f n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    v16f n;
    for (int j = 0; j < 16; ++j) n[j] = __builtin_rintf(t[j]);
#endif
    const v16f f = (t - n) * 0.6931471805599453f;  /* in [-ln2/2, ln2/2] */
    v16f p = f * (1.0f / 5040.0f) + 1.0f / 720.0f;
    p = p * f + 1.0f / 120.0f;
    p = p * f + 1.0f / 24.0f;
    p = p * f + 1.0f / 6.0f;
    p = p * f + 0.5f;
    p = p * f + 1.0f;
    p = p * f + 1.0f;
    return (v16f)((v16i)p + (__builtin_convertvector(n, v16i) << 23));
}

#if defined(__AVX512F__)
/* 16 vectors -> one vector of their 16 sums (lane i = sum of d[i]): one transposing tree of 45
 * shuffles/adds instead of 8 per sum. */
static inline __m512 sum16x16(const __m512 d[16]) {
    __m512 quad[4];
    for (int e = 0; e < 4; ++e) {
        __m512 pair[2];
        for (int f = 0; f < 2; ++f) {
            const __m512 a = d[4 * e + 2 * f], b = d[4 * e + 2 * f + 1];
            pair[f] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
        }
        quad[e] = _mm512_add_ps(_mm512_shuffle_f32x4(pair[0], pair[1], 0x88),
                                _mm512_shuffle_f32x4(pair[0], pair[1], 0xDD));
    }
    __m512 half[2];
    for (int f = 0; f < 2; ++f)
        half[f] = _mm512_add_ps(_mm512_shuffle_ps(quad[2 * f], quad[2 * f + 1], 0x44),
                                _mm512_shuffle_ps(quad[2 * f], quad[2 * f + 1], 0xEE));
    const __m512 all = _mm512_add_ps(_mm512_shuffle_ps(half[0], half[1], 0x88),
                                     _mm512_shuffle_ps(half[0], half[1], 0xDD));
    /* lane 4k+e holds the sum of d[4e+k] */
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), all);
}
#endif

#endif
