/* Shared helpers of the native CPU kernels: float vectors of the target's register width,
 * bf16/fp16 <-> fp32, exp, horizontal sums and maxima, lane masks.
 *
 * `vf` holds VL floats, VL being the width of the registers the library is built for (its CPU
 * tier, kernels/cpu_features.py): 16 with AVX-512, 8 with AVX/AVX2, 4 otherwise (SSE2 on
 * x86-64, NEON on aarch64). The kernels are written once against vf and VL in GCC/Clang vector
 * extensions; intrinsics appear only where the generic form compiles badly and the target has
 * the instruction (AVX-512, F16C).
 * NOTE: why not one 16-lane type everywhere: GCC 12 lowers 64-byte vectors badly on targets
 * without 512-bit registers (arrays of them moved through the stack in 64-bit pieces, every
 * comparison turned into 16 scalar compares and branches): the AVX2 attention ran 10x slower.
 * bf16 -> fp32 is exact (a shift); fp32 -> bf16 rounds to nearest even like torch's .to();
 * fp16 -> fp32 is exact (F16C's vcvtph2ps, or the same bit arithmetic in plain C).
 */
#ifndef VB_SIMD_H
#define VB_SIMD_H

#include <stdint.h>
#if defined(__AVX512F__) || defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#elif defined(__SSE2__)
#include <emmintrin.h>
#endif

#if defined(VB_LANES)  /* tests only: another width in plain C (16 checks the AVX-512 code shape anywhere) */
#define VL VB_LANES
#elif defined(__AVX512F__)
#define VL 16
#elif defined(__AVX__)
#define VL 8
#else
#define VL 4
#endif
/* The AVX-512 intrinsics below are used only when the lanes are AVX-512's. */
#if VL == 16 && defined(__AVX512F__)
#define VB_AVX512 1
#else
#define VB_AVX512 0
#endif

typedef uint16_t bf16;
typedef float vf __attribute__((vector_size(4 * VL)));
typedef uint32_t vu __attribute__((vector_size(4 * VL)));
typedef int32_t vi __attribute__((vector_size(4 * VL)));
typedef uint16_t vh __attribute__((vector_size(2 * VL), aligned(2)));
typedef float vf_unaligned __attribute__((vector_size(4 * VL), aligned(4)));
/* The AVX-512 code paths (vdpbf16ps) name their 16-lane vectors explicitly. */
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));

#if VL == 16
#define LANE_INDEX {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}
#elif VL == 8
#define LANE_INDEX {0, 1, 2, 3, 4, 5, 6, 7}
#else
#define LANE_INDEX {0, 1, 2, 3}
#endif

static inline vf splat(float x) { return (vf){0} + x; }

/* *p in every lane, as one broadcast load on AVX. splat(*p) compiles to a zeroed register, a scalar
 * add and a broadcast (0 + x is not x for x = -0.0, so the add stays without -ffast-math): a
 * register more than the 16-register AVX2 loops that use this (vb_attention_spans.h) can spare. */
static inline vf load_splat(const float *p) {
#if VL == 8 && defined(__AVX__) && !defined(VB_LANES)
    return (vf)_mm256_broadcast_ss(p);
#else
    return splat(*p);
#endif
}

static inline vf widen_bf16(vh h) { return (vf)(__builtin_convertvector(h, vu) << 16); }

static inline vf load_bf16(const bf16 *src) {
#if VB_AVX512
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src)), 16);
#else
    return widen_bf16(*(const vh *)src);
#endif
}

static inline vh round_bf16(vf f) {  /* round to nearest even; NaN stays NaN */
    vu u = (vu)f;
    const vu nan = (vu)((u & 0x7fffffffu) > 0x7f800000u);  /* all-ones lanes where f is NaN */
    const vu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    u = (rounded & ~nan) | (((u >> 16) | 0x40u) & nan);
    return __builtin_convertvector(u, vh);
}

static inline void store_bf16(bf16 *dst, vf f) { *(vh *)dst = round_bf16(f); }

/* The first n (< VL) lanes: loads read zeros past them, stores leave dst[n..] alone. */
static inline vf load_bf16_tail(const bf16 *src, int n) {
    bf16 tmp[VL] = {0};
    for (int j = 0; j < n; ++j) tmp[j] = src[j];
    return load_bf16(tmp);
}

static inline void store_bf16_tail(bf16 *dst, vf f, int n) {
    const vh h = round_bf16(f);
    for (int j = 0; j < n; ++j) dst[j] = h[j];
}

static inline vf load_f32(const float *src) { return *(const vf_unaligned *)src; }
static inline void store_f32(float *dst, vf v) { *(vf_unaligned *)dst = v; }

/* IEEE half-precision bit patterns (one per 32-bit lane) -> fp32, exactly, in plain C: the
 * exponent and mantissa moved into fp32 position, then scaled by 2^112 (exact for normals and
 * subnormals alike: the multiply renormalises); exponent 31 (inf/NaN) set to 255. */
static inline vf f16_bits_to_f32(vu h) {
    const vu bits = (h & 0x7fffu) << 13;
    const vf scaled = (vf)bits * 0x1p112f;
    const vu special = (vu)((h & 0x7c00u) == 0x7c00u);
    const vu magnitude = ((vu)scaled & ~special) | ((bits | 0x7f800000u) & special);
    return (vf)(magnitude | ((h & 0x8000u) << 16));
}

/* VL IEEE half-precision values -> fp32, exactly (normals, subnormals, inf and NaN). */
static inline vf load_f16(const uint16_t *src) {
#if VB_AVX512
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)src));
#elif VL == 8 && defined(__F16C__)
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)src));
#else
    return f16_bits_to_f32(__builtin_convertvector(*(const vh *)src, vu));
#endif
}

/* VL fp32 values -> IEEE half precision, rounded to nearest even like torch's .to(float16)
 * (overflow to inf, subnormals kept, NaN stays NaN). */
static inline vh round_f16(vf f) {
#if VB_AVX512
    return (vh)_mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#elif VL == 8 && defined(__F16C__)
    return (vh)_mm256_cvtps_ph((__m256)f, _MM_FROUND_TO_NEAREST_INT);
#else
    /* the bit arithmetic: the magnitude, re-biased and rounded (adding 0xfff plus the kept lowest
       mantissa bit rounds to nearest even); below 2^-14 the float adder does the rounding (adding
       0.5 aligns the subnormal's mantissa); at or above 65520 inf, NaN a quiet NaN */
    const vu u = (vu)f, sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    const vu normal = (a + 0xc8000fffu + ((a >> 13) & 1u)) >> 13;        /* (127 - 15) << 23 taken off */
    const vu subnormal = (vu)((vf)a + 0.5f) - 0x3f000000u;
    const vu is_sub = (vu)(a < 0x38800000u), is_big = (vu)(a >= 0x477ff000u), is_nan = (vu)(a > 0x7f800000u);
    vu h = (normal & ~is_sub) | (subnormal & is_sub);
    h = (h & ~is_big) | ((0x7c00u | (is_nan & 0x200u)) & is_big);
    return __builtin_convertvector(h | sign, vh);
#endif
}

static inline void store_f16(uint16_t *dst, vf f) { *(vh *)dst = round_f16(f); }

/* One IEEE half-precision value -> fp32, exactly (the scalar of load_f16). */
static inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    union { uint32_t u; float f; } bits = {.u = (uint32_t)(h & 0x7fffu) << 13}, out;
    out.f = bits.f * 0x1p112f;
    if ((h & 0x7c00u) == 0x7c00u) out.u = bits.u | 0x7f800000u;
    out.u |= (uint32_t)(h & 0x8000u) << 16;
    return out.f;
#endif
}

/* VL int8 values (any alignment) -> fp32, exactly.
 * NOTE: intrinsics on x86 because GCC 12 turns the generic conversion of a narrow int8 vector into
 * one scalar load and convert per lane (the AVX2 Q8_0 linear ran at a fifth of the fp16 one). */
typedef int8_t vq __attribute__((vector_size(VL), aligned(1)));
static inline vf load_i8(const int8_t *src) {
#if VB_AVX512
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)src)));
#elif VL == 8 && defined(__AVX2__)
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)src)));
#elif VL == 4 && defined(__SSE2__) && !defined(VB_LANES)
    int32_t word;
    __builtin_memcpy(&word, src, 4);
    __m128i b = _mm_cvtsi32_si128(word);
    b = _mm_unpacklo_epi8(b, b);                  /* each byte twice, then four times: */
    b = _mm_unpacklo_epi16(b, b);                 /* the byte in the top of its 32-bit lane, */
    return (vf)_mm_cvtepi32_ps(_mm_srai_epi32(b, 24));  /* shifted down with its sign */
#else
    return __builtin_convertvector(__builtin_convertvector(*(const vq *)src, vi), vf);
#endif
}

/* fp8 (OCP E4M3FN and E5M2, the KV cache's 8-bit formats) <-> fp32.
 * Widening: an E5M2 code is exactly the high byte of the IEEE half of the same value; an E4M3
 * code's exponent and mantissa placed at the bottom of a half's make the half of its value times
 * 2^-8 (normals and subnormals alike: both formats' subnormals are the same fixed-point steps), so
 * one F16C conversion (or f16_bits_to_f32) and a multiply by 256 widen it exactly. The sign goes to
 * bit 15 by sign-extending the byte, shifting by 7 and clearing bit 14.
 * NOTE: E4M3FN's NaN codes (S.1111.111; written only for a NaN activation) read as +-480, not NaN:
 * the check cost a fifth of the decode attention's time (28.7 -> 35.7 ns per position and kv head,
 * bf16 queries, 256 x 384 positions, bench/decode_attention.py). The reference reads NaN.
 * NOTE: not through fp32 bits times 2^120 (one op fewer): E4M3 subnormals then make fp32
 * subnormal operands, and Intel's multiplier takes a microcode assist on each (84 against 29 ns). */
#define FP8_E4M3 0
#define FP8_E5M2 1

static inline vf load_fp8(const uint8_t *src, const int format) {
#if VB_AVX512
    const __m128i b = _mm_loadu_si128((const __m128i *)src);
    if (format == FP8_E5M2) return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8));
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7), _mm256_set1_epi16((short)0xbfff));
    return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
#elif VL == 8 && defined(__F16C__)
    const __m128i b = _mm_loadl_epi64((const __m128i *)src);
    if (format == FP8_E5M2) return (vf)_mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(b), 8));
    const __m128i h = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(b), 7), _mm_set1_epi16((short)0xbfff));
    return (vf)_mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
#else
#if VL == 4 && defined(__SSE2__) && !defined(VB_LANES)
    int32_t word;
    __builtin_memcpy(&word, src, 4);
    const __m128i zero = _mm_setzero_si128();
    const vu b = (vu)_mm_unpacklo_epi16(_mm_unpacklo_epi8(_mm_cvtsi32_si128(word), zero), zero);
#else
    vu b;
    for (int j = 0; j < VL; ++j) b[j] = src[j];
#endif
    if (format == FP8_E5M2) return f16_bits_to_f32(b << 8);
    return f16_bits_to_f32(((b & 0x7fu) << 7) | ((b & 0x80u) << 8)) * 256.0f;
#endif
}

/* VL fp32 values -> fp8 codes, rounded to nearest even like torch's .to(float8_e4m3fn / e5m2) on
 * the same value, and saturated to the largest finite code (E4M3 448, E5M2 57344; torch saturates
 * E4M3 too, but overflows E5M2 to inf, so the reference clamps first); NaN stays NaN. The bit
 * arithmetic of round_f16: the magnitude re-biased and rounded (adding half an ulp minus one plus
 * the kept lowest bit rounds to nearest even); below the smallest normal the float adder rounds
 * (adding a power of two whose ulp is the format's subnormal step aligns the mantissa). */
static inline void store_fp8(uint8_t *dst, vf f, const int format) {
    const int mant = format == FP8_E5M2 ? 2 : 3, bias = format == FP8_E5M2 ? 15 : 7, shift = 23 - mant;
    const uint32_t max_code = format == FP8_E5M2 ? 0x7bu : 0x7eu;
    const uint32_t magic_bits = (uint32_t)((127 - bias) + shift + 1) << 23;
    float magic;
    __builtin_memcpy(&magic, &magic_bits, 4);
    const vu u = (vu)f, sign = (u >> 24) & 0x80u, a = u & 0x7fffffffu;
    const vu normal = (a + ((uint32_t)(bias - 127) << 23) + ((1u << (shift - 1)) - 1u) + ((a >> shift) & 1u)) >> shift;
    const vu subnormal = (vu)((vf)a + magic) - magic_bits;
    const vu is_sub = (vu)(a < ((uint32_t)(128 - bias) << 23));
    vu r = (normal & ~is_sub) | (subnormal & is_sub);  /* above the range (inf too): codes > max_code */
    const vu over = (vu)(r > max_code), nan = (vu)(a > 0x7f800000u);
    r = (r & ~over) | (max_code & over);
    r = (r & ~nan) | (0x7fu & nan);
    r |= sign;
    for (int j = 0; j < VL; ++j) dst[j] = (uint8_t)r[j];
}

/* Lane masks (all-ones lanes where true) and a select. */
static inline vi mask_lanes_below(int n) { return (vi)LANE_INDEX < n; }  /* lane index < n */
static inline vf select_lanes(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

/* Lane i ^ k for every lane i (the butterfly partner at distance k). */
#if VL == 16
#define XOR_LANES(k) ((vu){0 ^ k, 1 ^ k, 2 ^ k, 3 ^ k, 4 ^ k, 5 ^ k, 6 ^ k, 7 ^ k, \
                         8 ^ k, 9 ^ k, 10 ^ k, 11 ^ k, 12 ^ k, 13 ^ k, 14 ^ k, 15 ^ k})
#elif VL == 8
#define XOR_LANES(k) ((vu){0 ^ k, 1 ^ k, 2 ^ k, 3 ^ k, 4 ^ k, 5 ^ k, 6 ^ k, 7 ^ k})
#else
#define XOR_LANES(k) ((vu){0 ^ k, 1 ^ k, 2 ^ k, 3 ^ k})
#endif

/* Sum and maximum of the lanes: lane i combined with lane i ^ VL/2, then i ^ VL/4, ... (for 16
 * lanes the order _mm512_reduce_add_ps uses). */
static inline float hsum(vf v) {
    for (int k = VL / 2; k >= 1; k /= 2) v += __builtin_shuffle(v, XOR_LANES(k));
    return v[0];
}

static inline vf max_lanes(vf a, vf b) { return select_lanes(a < b, b, a); }

static inline float hmax(vf v) {
    for (int k = VL / 2; k >= 1; k /= 2) v = max_lanes(v, __builtin_shuffle(v, XOR_LANES(k)));
    return v[0];
}

/* e^x per lane, x clamped to [-87, 88]: range reduction to [-0.5, 0.5] in base 2 and a degree-7
 * Taylor polynomial (relative error about 1e-7), so it vectorises without -ffast-math (whose
 * shared-library start-up code would flush denormals for the whole process on GCC < 13). */
static inline vf vexp(vf x) {
    const vi low = x < -87.0f, high = x > 88.0f;  /* all-ones lanes out of range */
    x = (vf)(((vi)x & ~low) | ((vi)splat(-87.0f) & low));
    x = (vf)(((vi)x & ~high) | ((vi)splat(88.0f) & high));
    const vf t = x * 1.4426950408889634f;  /* x / ln 2 */
#if VB_AVX512
    const vf n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    /* round to nearest even by the 1.5 * 2^23 trick (exact for |t| < 2^22; here |t| < 128): plain
       adds that vectorise on every target, where a per-lane rintf loop would not */
    const vf n = (t + 12582912.0f) - 12582912.0f;
#endif
    const vf f = (t - n) * 0.6931471805599453f;  /* in [-ln2/2, ln2/2] */
    vf p = f * (1.0f / 5040.0f) + 1.0f / 720.0f;
    p = p * f + 1.0f / 120.0f;
    p = p * f + 1.0f / 24.0f;
    p = p * f + 1.0f / 6.0f;
    p = p * f + 0.5f;
    p = p * f + 1.0f;
    p = p * f + 1.0f;
    return (vf)((vi)p + (__builtin_convertvector(n, vi) << 23));
}

static inline float exp1(float x) { return vexp(splat(x))[0]; }

#if VL == 8
/* The 8 x 8 block r transposed in place (r[i][j] <- r[j][i]): shuffles within 128-bit halves, then
 * across them (the unpack / shuffle / permute2f128 pattern). */
static inline void transpose_lanes(vf r[8]) {
    vf t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = __builtin_shuffle(r[i], r[i + 1], (vu){0, 8, 1, 9, 4, 12, 5, 13});
        t[i + 1] = __builtin_shuffle(r[i], r[i + 1], (vu){2, 10, 3, 11, 6, 14, 7, 15});
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = __builtin_shuffle(t[i], t[i + 2], (vu){0, 1, 8, 9, 4, 5, 12, 13});
        u[i + 1] = __builtin_shuffle(t[i], t[i + 2], (vu){2, 3, 10, 11, 6, 7, 14, 15});
        u[i + 2] = __builtin_shuffle(t[i + 1], t[i + 3], (vu){0, 1, 8, 9, 4, 5, 12, 13});
        u[i + 3] = __builtin_shuffle(t[i + 1], t[i + 3], (vu){2, 3, 10, 11, 6, 7, 14, 15});
    }
    for (int i = 0; i < 4; ++i) {
        r[i] = __builtin_shuffle(u[i], u[i + 4], (vu){0, 1, 2, 3, 8, 9, 10, 11});
        r[i + 4] = __builtin_shuffle(u[i], u[i + 4], (vu){4, 5, 6, 7, 12, 13, 14, 15});
    }
}
#elif VL == 4
/* The 4 x 4 block r transposed in place (the unpack / movelh pattern of _MM_TRANSPOSE4_PS). */
static inline void transpose_lanes(vf r[4]) {
    const vf t0 = __builtin_shuffle(r[0], r[1], (vu){0, 4, 1, 5}), t1 = __builtin_shuffle(r[0], r[1], (vu){2, 6, 3, 7});
    const vf t2 = __builtin_shuffle(r[2], r[3], (vu){0, 4, 1, 5}), t3 = __builtin_shuffle(r[2], r[3], (vu){2, 6, 3, 7});
    r[0] = __builtin_shuffle(t0, t2, (vu){0, 1, 4, 5});
    r[1] = __builtin_shuffle(t0, t2, (vu){2, 3, 6, 7});
    r[2] = __builtin_shuffle(t1, t3, (vu){0, 1, 4, 5});
    r[3] = __builtin_shuffle(t1, t3, (vu){2, 3, 6, 7});
}
#else
/* The 16 x 16 block r transposed in place, lane by lane (only the fp32 build of an AVX-512 tier
 * takes this path; its bf16 build transposes the keys with intrinsics). */
static inline void transpose_lanes(vf r[VL]) {
    vf t[VL];
    for (int i = 0; i < VL; ++i) t[i] = splat(0.0f);
    for (int i = 0; i < VL; ++i)
        for (int j = 0; j < VL; ++j) t[j][i] = r[i][j];
    for (int i = 0; i < VL; ++i) r[i] = t[i];
}
#endif

#if VL < 16
/* Pairwise sums of two vectors, per 128-bit half: (a0+a1, a2+a3, b0+b1, b2+b3 | the same for lanes
 * 4-7): the vhaddps pattern. */
static inline vf hadd_pairs(vf a, vf b) {
#if VL == 8
    return __builtin_shuffle(a, b, (vu){0, 2, 8, 10, 4, 6, 12, 14}) + __builtin_shuffle(a, b, (vu){1, 3, 9, 11, 5, 7, 13, 15});
#else
    return __builtin_shuffle(a, b, (vu){0, 2, 4, 6}) + __builtin_shuffle(a, b, (vu){1, 3, 5, 7});
#endif
}

/* Four vectors -> their four sums, in the four lanes of each 128-bit half (VL 4: the sums;
 * VL 8: partial sums over lanes 0-3 and 4-7, which hsum_halves then adds). */
static inline vf hsum4(vf d0, vf d1, vf d2, vf d3) { return hadd_pairs(hadd_pairs(d0, d1), hadd_pairs(d2, d3)); }

#if VL == 8
/* hsum4 of eight vectors d0-d3 (lo) and d4-d7 (hi) -> the vector of the eight sums. */
static inline vf hsum_halves(vf lo, vf hi) {
    return __builtin_shuffle(lo, hi, (vu){0, 1, 2, 3, 8, 9, 10, 11}) + __builtin_shuffle(lo, hi, (vu){4, 5, 6, 7, 12, 13, 14, 15});
}
#endif
#endif

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
